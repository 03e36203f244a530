"""A log_dir reused by a second run, and two watchers writing the same tags: warned once each, with the fix."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import actviz
from actviz.output.run_folders import earlier_runs


def _messages(caught, text: str) -> list[str]:
    return [str(w.message) for w in caught if text in str(w.message)]


@pytest.fixture
def caught():
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


def _run(model: nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()


def test_a_reused_log_dir_is_warned_about_once_and_a_fresh_one_is_not(tmp_path, caught, read_run):
    torch.manual_seed(0)
    first, second = nn.Linear(4, 2), nn.Linear(4, 2)
    with actviz.watch(first, tmp_path, every=5):
        _run(first, 10)
    assert _messages(caught, "already holds") == []
    with actviz.watch(second, tmp_path, every=5):
        _run(second, 10)
    (message,) = _messages(caught, "already holds")
    assert f"log_dir '{tmp_path}' already holds the events of an earlier run (1 file(s)" in message
    assert "interleave" in message and "Give each run its own folder" in message
    # What the warning is about: TensorBoard reads both runs as one, steps 0, 5, 0, 5.
    assert read_run(tmp_path).histogram_steps("activations/(model)") == [0, 5, 0, 5]


def test_a_folder_with_only_a_writers_header_is_not_an_earlier_run(tmp_path, caught):
    SummaryWriter(tmp_path).close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1 and earlier_runs(tmp_path) == []
    with actviz.watch(nn.Linear(4, 2), tmp_path):
        pass
    assert _messages(caught, "actviz") == []


def test_two_models_on_one_writer_with_the_same_tags_warn_once(tmp_path, caught, read_run):
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(4, 2)), nn.Sequential(nn.Linear(4, 2))
    writer = SummaryWriter(tmp_path)
    with actviz.watch(a, sink=writer, every=1), actviz.watch(b, sink=writer, every=1):
        x = torch.randn(3, 4)
        a(x).sum().backward()
        b(x).sum().backward()
    writer.close()
    (message,) = _messages(caught, "both watched")
    assert f"this Sequential and another Sequential are both watched into '{tmp_path}'" in message
    assert "(activations/0, weights/0.bias, weights/0.weight; 3 in all)" in message
    assert f"'{tmp_path / 'a'}' and '{tmp_path / 'b'}'" in message
    assert _messages(caught, "already holds") == []
    run = read_run(tmp_path)  # what it warns about: two points on one curve at step 0
    assert run.histogram_steps("activations/0") == [0, 0]
    means = sorted(event.value for event in run.scalar_events("activation_stats/mean@0"))
    assert means == pytest.approx(sorted([a(x).mean().item(), b(x).mean().item()]), rel=1e-5)


def test_two_watchers_into_one_log_dir_at_once_get_the_tag_warning_only(tmp_path, caught):
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    with actviz.watch(a, tmp_path, every=1) as first:
        _run(a, 2)
        first.flush()  # the first run's steps are on disk
        with actviz.watch(b, tmp_path, every=1):
            _run(b, 2)
    assert len(_messages(caught, "both watched")) == 1 and _messages(caught, "already holds") == []


def test_models_with_different_tags_or_a_closed_first_watcher_are_not_warned_about(tmp_path, caught):
    writer = SummaryWriter(tmp_path)
    encoder = nn.Sequential()
    encoder.add_module("encoder", nn.Linear(4, 3))
    decoder = nn.Sequential()
    decoder.add_module("decoder", nn.Linear(3, 4))
    with actviz.watch(encoder, sink=writer), actviz.watch(decoder, sink=writer):
        decoder(encoder(torch.randn(2, 4))).sum().backward()
    with actviz.watch(encoder, sink=writer):  # the same tags again, but the first watcher is closed
        pass
    writer.close()
    assert _messages(caught, "actviz") == []


def test_run_folder_warnings_never_raise_under_warnings_as_errors(tmp_path, caplog):
    writer = SummaryWriter(tmp_path)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="actviz"):
        warnings.simplefilter("error")
        with actviz.watch(nn.Linear(4, 2), sink=writer), actviz.watch(nn.Linear(4, 2), sink=writer):
            pass
    writer.close()
    assert any("both watched" in record.getMessage() for record in caplog.records)


def test_closed_watchers_are_forgotten_in_every_folder(tmp_path):
    from actviz.output import run_folders

    for index in range(3):
        with actviz.watch(nn.Linear(4, 2), tmp_path / f"run{index}"):
            pass
    with actviz.watch(nn.Linear(4, 2), tmp_path / "open"):
        assert [key for key in run_folders._writing if key.startswith(str(tmp_path))] == [str(tmp_path / "open")]


def test_a_fifo_named_like_an_event_file_is_not_opened_by_watch(tmp_path):
    """Opening a FIFO waits for a writer: watch() would hang on its check for an earlier run."""
    import os
    import threading

    from conftest import NO_HOOKS, hooks_left

    os.mkfifo(tmp_path / "events.out.tfevents.1.fifo")
    model, found = nn.Linear(4, 2), {}

    def call() -> None:
        found["earlier"] = earlier_runs(tmp_path)
        with actviz.watch(model, tmp_path, every=5):
            _run(model, 2)
        found["done"] = True

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():  # let the stuck open() return, so that the test fails instead of hanging
        with open(tmp_path / "events.out.tfevents.1.fifo", "wb"):
            pass
        pytest.fail("earlier_runs() or watch() opened the FIFO and waited")
    assert found == {"earlier": [], "done": True} and hooks_left(model) == NO_HOOKS
