"""docs/how-it-works.md's map from hook to disk is what a logging step runs: each route's rows, traced.

One logging step of a small CNN is traced with ``sys.setprofile`` (and ``threading.setprofile`` for the writer
thread and the event file's), on both CPU paths: the default one (the CPU shortcut) and ``ACTVIZ_CPU_SHORTCUTS=0``
(the accelerator's). Each route's rows of that path, per thread, must be calls of the trace in the map's order, and
every file the map cites must exist, as tests/test_tags.py checks the tag tables.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from conftest import small_cnn

import actviz

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(actviz.__file__).resolve().parent


def map_rows() -> list[dict[str, str]]:
    """The rows of the table under "## From the hook to the disk" in docs/how-it-works.md."""
    section = (ROOT / "docs" / "how-it-works.md").read_text().split("\n## From the hook to the disk\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip().strip("`") for cell in line.strip("|").split("|")))) for line in lines[1:]]


def trace_logging_step() -> dict[str, list[tuple[str, str]]]:
    """``{thread: [(file, function), ...]}`` of actviz's calls while one logging step runs and is written."""
    calls: dict[str, list[tuple[str, str]]] = {}
    recording = [False]

    def profile(frame, event, arg):
        if recording[0] and event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            name = threading.current_thread().name
            thread = "training" if name == "MainThread" else "writer" if name == "actviz-writer" else "event file"
            path = "actviz/" + os.path.relpath(frame.f_code.co_filename, PACKAGE)
            calls.setdefault(thread, []).append((path, frame.f_code.co_qualname))

    model = small_cnn(inplace=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    threading.setprofile(profile)  # before watch(): the threads it starts are profiled from their start
    try:
        with actviz.watch(model, tempfile.mkdtemp(), every=2, image_every=False, alerts=False) as viz:
            for step in range(3):  # step 2 logs, steps 0 and 1 warm up
                if step == 2:
                    sys.setprofile(profile)
                    recording[0] = True
                model(torch.randn(4, 3, 8, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            viz.flush()
    finally:
        recording[0] = False
        sys.setprofile(None)
        threading.setprofile(None)
    return calls


def follows(rows: list[dict[str, str]], calls: list[tuple[str, str]]) -> list[str]:
    """The rows that are not calls of ``calls`` in their order (each after the one before)."""
    missing, position = [], 0
    for row in rows:
        wanted = (row["file"], row["function"])
        found = next((index for index in range(position, len(calls)) if calls[index] == wanted), None)
        if found is None:
            missing.append(f"{row['hop']}. {row['file']} {row['function']}")
        else:
            position = found
    return missing


@pytest.mark.parametrize("path", ["default", "device"])
def test_each_route_of_the_map_is_what_one_logging_step_runs(path, monkeypatch):
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "1" if path == "default" else "0")
    calls = trace_logging_step()
    rows = [row for row in map_rows() if row["path"] in ("both", path)]
    assert {row["route"] for row in rows} == {"layer output", "output gradient", "parameter gradient"}
    for route in ("layer output", "output gradient", "parameter gradient"):
        for thread in ("training", "writer", "event file"):
            on_thread = [row for row in rows if row["route"] == route and row["thread"] == thread]
            assert follows(on_thread, calls.get(thread, [])) == [], f"{route} on the {thread} thread, {path} path"


def test_the_map_cites_files_the_repository_has_and_counts_its_hops():
    rows = map_rows()
    assert all((ROOT / row["file"]).is_file() for row in rows), [row["file"] for row in rows]
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    for path in ("default", "device"):
        main = [row for row in rows if row["route"] == "layer output" and row["path"] in ("both", path)]
        files = {row["file"] for row in main}
        assert f"{path} path: {len(main)} hops over {len(files)} files" in text
        assert len(main) <= 12 and len(files) <= 8, (path, len(main), sorted(files))
