"""No step lost: a callback that exits, a parameter resized in place, a watcher dropped without close().

* ``on_alert`` and ``on_step`` run once their step is written to every sink, so ``on_alert=sys.exit`` at the
  first NaN leaves that step in the event file and ``actviz doctor`` finds its alert (exit 1);
* with ``update_ratio=True`` a parameter resized across the update gets no ratio (one warning), and
  ``close()`` writes the rest instead of raising;
* a watcher garbage-collected unclosed (its model gone) ends its writer thread, after writing what was queued.

Tests that start a process or wait for threads have a hard limit and fail past it instead of hanging.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import train
from torch import nn

import actviz

ROOT = Path(__file__).resolve().parents[1]
LIMIT_SECONDS = 120  # a process that runs longer has hung: the test fails
NAN_STEP = 3


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _doctor(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "actviz", "doctor", str(folder)], capture_output=True, text=True,
                          env=_env(), timeout=LIMIT_SECONDS)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batches(nan_at: int | None = None):
    """``train``'s inputs: a batch of 8 × 4 per step, with a NaN in sample 0 at step ``nan_at``."""
    def batch(step: int) -> torch.Tensor:
        values = torch.randn(8, 4)
        if step == nan_at:
            values[0, 0] = float("nan")
        return values
    return batch


def test_on_alert_that_exits_leaves_its_step_on_disk_and_doctor_finds_the_alert(tmp_path, read_run):
    heard = []

    def stop(alert):
        heard.append(alert.step)
        sys.exit(1)  # the natural "stop on NaN": on the writer thread it is warned about, once

    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tmp_path, every=1, image_every=False, on_alert=stop) as viz:
            train(model, NAN_STEP + 2, _batches(nan_at=NAN_STEP))
    assert heard == [NAN_STEP] and viz.dropped_steps == 0
    messages = [str(warning.message) for warning in caught]
    assert sum("on_alert callback raised SystemExit" in message for message in messages) == 1
    assert not any("could not write" in message for message in messages)
    assert NAN_STEP in read_run(tmp_path).histogram_steps("activations/0")
    done = _doctor(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NaN or Inf first at step 3" in done.stdout


_STRICT_EXIT_SCRIPT = """
import sys, torch, actviz
sys.path.insert(0, sys.argv[2])
from conftest import train
from test_no_step_lost import _batches, _model
model = _model()
viz = actviz.watch(model, sys.argv[1], every=1, image_every=False, options=actviz.Options(strict=True),
                   on_alert=lambda alert: sys.exit(7))
train(model, 6, _batches(nan_at=3))
print("not stopped")
"""


def test_strict_on_alert_exit_stops_training_after_its_step_is_written(tmp_path, read_run):
    done = subprocess.run([sys.executable, "-c", _STRICT_EXIT_SCRIPT, str(tmp_path), str(ROOT / "tests")],
                          capture_output=True, text=True, env=_env(), timeout=LIMIT_SECONDS)
    assert done.returncode == 7 and "not stopped" not in done.stdout, done.stderr[-2000:]
    assert NAN_STEP in read_run(tmp_path).histogram_steps("activations/0")
    doctor = _doctor(tmp_path)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr


def test_an_on_step_that_exits_runs_after_its_step_is_written(tmp_path, read_run):
    model = _model()
    with pytest.warns(RuntimeWarning, match="on_step callback raised SystemExit"):
        with actviz.watch(model, tmp_path, every=1, image_every=False, on_step=lambda results: sys.exit(1)):
            train(model, 3, _batches())
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2]


@pytest.mark.parametrize("where", ["last step", "earlier step"])
def test_a_parameter_resized_in_place_skips_its_update_ratio_and_close_writes_the_rest(tmp_path, read_run, where):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    viz = actviz.watch(model, tmp_path, every=1, image_every=False, statistics=["default", "update_ratio"])
    resize_at = 3 if where == "last step" else 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            model(torch.randn(8, 4)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == resize_at:
                model[0].weight.data = torch.randn(16, 4)  # resized across this step's update
                model[0].bias.data = torch.randn(16)
                model[2].weight.data = torch.randn(2, 16)
        viz.close()  # no error: the whole run is written
    resized = [str(warning.message) for warning in caught if "no update ratio" in str(warning.message)]
    assert len(resized) == 1 and "0.weight" in resized[0], resized
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == [0, 1, 2, 3]
    ratio_steps = [event.step for event in run.scalar_events("update_ratio/2.bias")]
    assert ratio_steps == [0, 1, 2, 3]  # the parameter that kept its shape has all its ratios
    skipped = [event.step for event in run.scalar_events("update_ratio/0.weight")]
    assert resize_at not in skipped and len(skipped) == 3


def _writer_threads() -> int:
    return sum(thread.name == "actviz-writer" for thread in threading.enumerate())


def _watch_and_drop(folder: Path) -> None:
    model = _model()
    actviz.watch(model, folder, every=2, image_every=False)  # the returned watcher is not kept, nor closed
    train(model, 2, _batches())  # step 0 logged and handed to the writer at step 1's forward


def test_dropped_watchers_end_their_writer_threads(tmp_path, read_run):
    gc.collect()
    writers, threads = _writer_threads(), threading.active_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(20):
            _watch_and_drop(tmp_path / f"run{index}")
    deadline = time.monotonic() + 10
    while (_writer_threads() > writers or threading.active_count() > threads) and time.monotonic() < deadline:
        gc.collect()  # a watcher and its model hold each other: the cycle goes at a collection
        time.sleep(0.1)
    assert _writer_threads() == writers and threading.active_count() == threads, [
        thread.name for thread in threading.enumerate()]
    for index in (0, 19):  # what was queued was written before the thread ended
        assert read_run(tmp_path / f"run{index}").histogram_steps("activations/0") == [0]
