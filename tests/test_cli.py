"""Tests of the ``actviz`` command line: help, exit codes and messages.

Two tests run ``python -m actviz`` in a subprocess against this working tree (PYTHONPATH
is the repository root); the others call ``actviz.cli.main`` in-process, which is faster.
"""

from __future__ import annotations

import builtins
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actviz.cli import main

ROOT = Path(__file__).resolve().parents[1]
CAT = ROOT / "tests" / "data" / "chelsea.jpg"
SMALL = ["--weights", "none", "--size", "64"]


def _run(args: list[str], tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_HOME=str(tmp_path / "torch_home"), **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "actviz", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )


def test_help_teaches_every_option_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["report", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "--image", "--weights", "--logdir", "--html", "--layers", "--max-channels",
                   "--size", "--device", "--quiet"):
        assert option in text
    assert "(default: DEFAULT)" in text and "(default: 64)" in text and "(default: runs/report)" in text
    assert "weights_only=True" in text and "examples:" in text and "actviz report --model alexnet" in text
    assert "exit codes:" in text


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "report" in capsys.readouterr().err


def test_good_run_exits_0_and_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["report", "--model", "alexnet", *SMALL, "--image", str(CAT), "--logdir", str(tmp_path / "tb"),
                 "--html", str(tmp_path / "html"), "--layers", "features.0", "features.3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "alexnet: 1 of 1 image(s), 2 layers" in out and str(tmp_path / "html" / "index.html") in out
    assert sorted(p.name for p in (tmp_path / "html" / "chelsea").iterdir()) == [
        "features.0.png", "features.3.png", "input.png"]
    assert (tmp_path / "tb" / "alexnet" / "chelsea").is_dir()
    assert f"TensorBoard runs: {tmp_path / 'tb' / 'alexnet'}   (view: tensorboard --logdir {tmp_path / 'tb'})" in out


def test_quiet_run_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--model", "alexnet", *SMALL, "--image", str(CAT), "--no-tensorboard", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_corrupt_image_exits_1_names_it_and_keeps_the_others(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(CAT.read_bytes()[:2000])  # a truncated JPEG
    done = _run(["report", "--model", "alexnet", *SMALL, "--image", str(broken), str(CAT),
                 "--logdir", "tb", "--layers", "features.0"], tmp_path)
    assert done.returncode == 1
    assert f"cannot read image '{broken}'" in done.stderr and "1 image(s) failed" in done.stderr
    assert "Traceback" not in done.stderr
    assert [p.name for p in (tmp_path / "tb" / "alexnet").iterdir()] == ["chelsea"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "vgg61"], "unknown model 'vgg61'; did you mean"),
        (["--model", "alexnet", "--layers", "feature.0"], "did you mean 'features.0'"),
        (["--model", "alexnet", "--weights", "missing.pth"], "weights file 'missing.pth' does not exist"),
        (["--model", "alexnet", "--max-channels", "0"], "--max-channels must be positive, got 0"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["report", "--weights", "none", *args, "--image", str(CAT), "--no-tensorboard", "--quiet"])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


def test_malicious_weights_file_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    torch.save({"features.0.weight": _Payload(marker)}, tmp_path / "evil.pth")
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--model", "alexnet", "--weights", "evil.pth", "--image", str(CAT), "--quiet"]) == 2
    assert "refusing to load 'evil.pth'" in capsys.readouterr().err
    assert not marker.exists()
    torch.load(tmp_path / "evil.pth", weights_only=False)  # the payload is real: an unsafe load runs it
    assert marker.exists()


def test_default_weights_offline_gives_a_clear_message(tmp_path: Path) -> None:
    # An empty TORCH_HOME forces a download; a proxy on a closed local port makes it fail at
    # once, even on a machine with network access.
    proxy = "http://127.0.0.1:9"
    done = _run(["report", "--model", "alexnet", "--image", str(CAT), "--quiet"], tmp_path,
                https_proxy=proxy, HTTPS_PROXY=proxy, http_proxy=proxy, HTTP_PROXY=proxy, no_proxy="", NO_PROXY="")
    assert done.returncode == 2
    assert "could not download the pretrained weights for alexnet" in done.stderr
    assert "--weights PATH" in done.stderr and "--weights none" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


def test_main_leaves_the_callers_logging_as_it_was() -> None:
    package_logger = logging.getLogger("actviz")
    before = package_logger.handlers[:], package_logger.level, package_logger.propagate
    assert main(["report", "--model", "alexnet", *SMALL, "--image", str(CAT), "--no-tensorboard", "--quiet"]) == 0
    assert (package_logger.handlers[:], package_logger.level, package_logger.propagate) == before


def test_help_starts_with_a_complete_offline_example_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shlex

    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = capsys.readouterr().out
    first = next(line.strip() for line in text.split("\n\n", 1)[1].splitlines() if line.startswith("  actviz "))
    assert text.index(first) < text.index("options:") < text.index("examples:")  # before anything else
    assert "--weights none" in first and "--image" in first and "--model" in first
    # Run it as printed, with our cat as cat.jpg and no network at all: it needs nothing else.
    (tmp_path / "cat.jpg").write_bytes(CAT.read_bytes())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # an empty cache: a download would fail
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    argv = shlex.split(first)
    assert argv[0] == "actviz" and main(argv[1:]) == 0
    assert (tmp_path / "report_html" / "index.html").is_file()
    assert list((tmp_path / "runs" / "report" / "alexnet" / "cat").glob("events.out.tfevents.*"))
    assert not (tmp_path / "torch_home").exists()
