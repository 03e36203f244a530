"""Every wait of the training thread on actviz's writer is bounded.

A sink that stops answering (a tracker's server down) costs one warning and the steps it cannot take, counted in
``viz.dropped_steps``; training goes on, and ``viz.close()`` returns even if the sink's ``close()`` never does.
A sink that is slow but answers loses nothing. Each test runs the watched code on a thread it joins with a hard
timeout, so that a hang fails the test instead of stopping the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import train
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import actviz
from actviz.common.results import StepResults
from actviz.output import writer_thread

ROOT = Path(__file__).resolve().parents[1]
WRITE_LIMIT = 0.5  # seconds: the limits, made small for these tests
CLOSE_LIMIT = 0.5
HARD_TIMEOUT = 20.0  # seconds: far above what the bounded waits add up to, far below "forever"


@pytest.fixture(autouse=True)
def short_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_thread, "WRITE_TIMEOUT_SECONDS", WRITE_LIMIT, raising=False)
    monkeypatch.setattr(writer_thread, "CLOSE_TIMEOUT_SECONDS", CLOSE_LIMIT, raising=False)


class ListSink:
    """Keeps the step of every write; its writes and its close wait on ``write_gate`` and ``close_gate``."""

    def __init__(self, write_delay: float = 0.0, close_delay: float = 0.0) -> None:
        self.steps: list[int] = []
        self.closes = 0
        self.write_delay = write_delay
        self.close_delay = close_delay
        self.write_gate = threading.Event()
        self.close_gate = threading.Event()
        self.write_gate.set()
        self.close_gate.set()

    def write(self, results: StepResults) -> None:
        self.steps.append(results.step)
        time.sleep(self.write_delay)
        self.write_gate.wait()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        time.sleep(self.close_delay)
        self.close_gate.wait()
        self.closes += 1

    def release(self) -> None:
        self.write_gate.set()
        self.close_gate.set()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def within(seconds: float, work: Callable[[], Any]) -> float:
    """Run ``work`` on a daemon thread and return how long it took; fail if it has not returned after ``seconds``."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - raised again on the test's thread
            failure.append(error)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if failure:
        raise failure[0]
    return time.monotonic() - start


def actviz_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(warning.message) for warning in caught if "actviz" in str(warning.message)]


def test_a_sink_whose_write_never_returns_costs_one_warning_and_the_steps_it_cannot_take():
    model = mlp()
    sink = ListSink()
    sink.write_gate.clear()  # the first write waits until the test ends
    viz = actviz.watch(model, sink=sink, every=1, image_every=False, alerts=False)

    def run() -> None:
        train(model, 10)
        viz.flush()
        viz.close()

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            within(HARD_TIMEOUT, run)
        assert viz.closed
        assert sink.steps == [0]  # the one write that never returned
        assert viz.dropped_steps == 9  # every other step: dropped, and counted
        messages = actviz_warnings(caught)
        assert len(messages) == 1, messages
        assert "ListSink.write()" in messages[0] and f"{WRITE_LIMIT:g} s" in messages[0], messages
        assert "Training goes on" in messages[0]
    finally:
        sink.release()


class StuckFileWriter:
    """TensorBoard's file writer on a disk that stops answering (an NFS server gone): add_summary waits on ``gate``."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def add_summary(self, *args: Any, **kwargs: Any) -> None:
        self.gate.wait()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class StuckDiskWriter(SummaryWriter):
    def _get_file_writer(self) -> StuckFileWriter:
        if not hasattr(self, "stuck"):
            self.stuck = StuckFileWriter()
        return self.stuck


def test_tensorboards_writer_that_never_returns_costs_one_warning_and_the_steps_it_cannot_take(tmp_path):
    model = mlp()
    writer = StuckDiskWriter(tmp_path)
    viz = actviz.watch(model, sink=writer, every=1, image_every=False, alerts=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            within(HARD_TIMEOUT, lambda: (train(model, 10), viz.close()))
        assert viz.closed and viz.dropped_steps == 9
        messages = actviz_warnings(caught)
        assert len(messages) == 1 and "TensorBoardSink.write()" in messages[0], messages
    finally:
        writer.stuck.gate.set()


def test_a_sink_that_answers_again_gets_the_later_steps():
    model = mlp()
    sink = ListSink()
    sink.write_gate.clear()
    viz = actviz.watch(model, sink=sink, every=1, image_every=False, alerts=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            within(HARD_TIMEOUT, lambda: train(model, 6))
            sink.release()
            deadline = time.monotonic() + HARD_TIMEOUT
            while len(sink.steps) < 3 and time.monotonic() < deadline:  # the steps queued before it stopped
                time.sleep(0.01)
            within(HARD_TIMEOUT, lambda: (train(model, 3), viz.close()))
        dropped = viz.dropped_steps
        assert dropped > 0 and sink.steps[:3] == [0, 1, 2] and sink.steps[3:] == [6, 7, 8]
        assert len(sink.steps) + dropped == 9 and sink.closes == 1
        assert len(actviz_warnings(caught)) == 1, actviz_warnings(caught)
    finally:
        sink.release()


def test_close_returns_within_its_limit_when_the_sinks_close_never_returns():
    model = mlp()
    sink = ListSink()
    sink.close_gate.clear()  # close() waits until the test ends
    viz = actviz.watch(model, sink=sink, every=1, image_every=False, alerts=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            within(HARD_TIMEOUT, lambda: train(model, 3))
            took = within(HARD_TIMEOUT, viz.close)
        assert took < CLOSE_LIMIT + WRITE_LIMIT + 2.0, took
        assert viz.closed and sink.steps == [0, 1, 2] and viz.dropped_steps == 0
        messages = actviz_warnings(caught)
        assert len(messages) == 1, messages
        assert "ListSink.close()" in messages[0] and f"{CLOSE_LIMIT:g} s" in messages[0], messages
        assert viz._writer._thread.daemon  # it does not hold up the interpreter's exit either
    finally:
        sink.release()


def test_a_slow_sink_that_answers_loses_nothing(monkeypatch):
    # Each write takes a fifth of the limit; the ten together take twice the limit.
    monkeypatch.setattr(writer_thread, "WRITE_TIMEOUT_SECONDS", 1.0, raising=False)
    model = mlp()
    sink = ListSink(write_delay=0.2, close_delay=0.3)
    viz = actviz.watch(model, sink=sink, every=1, image_every=False, alerts=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def run() -> None:
            train(model, 5)
            viz.flush()
            assert sink.steps == [0, 1, 2, 3, 4]
            train(model, 5)
            viz.close()

        within(HARD_TIMEOUT, run)
    assert sink.steps == list(range(10)) and sink.closes == 1
    assert viz.dropped_steps == 0
    assert actviz_warnings(caught) == []


@pytest.mark.slow  # a fresh Python: about 4 s
def test_python_exits_when_a_sinks_close_never_returns():
    source = """
        import threading, torch, actviz
        from actviz.output import writer_thread
        writer_thread.CLOSE_TIMEOUT_SECONDS = 0.5

        class StuckSink:
            def write(self, results): pass
            def flush(self): pass
            def close(self): threading.Event().wait()

        model = torch.nn.Linear(4, 2)
        viz = actviz.watch(model, sink=StuckSink(), every=1, image_every=False, alerts=False)
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
        print("trained")  # no close(): actviz closes the watcher at exit
    """
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0 and done.stdout.split() == ["trained"], done.stdout + done.stderr
    assert "StuckSink.close()" in done.stderr, done.stderr
