"""A full disk: one warning naming the folder and the error, the steps not written counted, training going on,
no traceback from TensorBoard's thread, and the steps after written to a valid event file once there is room.

One test fills a real file size limit (``RLIMIT_FSIZE``: writes past it fail with ``EFBIG``) in a fresh process,
then lifts it; the others make TensorBoard's file write fail with ``ENOSPC`` in this process. Processes and
threads run under a hard limit and fail past it instead of hanging.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from tensorboard.compat.tensorflow_stub.io import gfile
from torch import nn

import actviz
from actviz.output.event_records import WholeRecords
from actviz.output.run_folders import read_records

ROOT = Path(__file__).resolve().parents[1]
LIMIT_SECONDS = 120  # a process that runs longer has hung: the test fails
TAG = "activations/0"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _whole(folder: Path) -> list[Path]:
    """The event files of ``folder``, each read to its end without a damaged record."""
    files = sorted(folder.glob("events.out.tfevents.*"))
    for file in files:
        list(read_records(file))  # raises DamagedEventFile at a half record
    return files


def _doctor(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "actviz", "doctor", str(folder)], capture_output=True, text=True,
                          env=_env(), timeout=LIMIT_SECONDS)


_FILE_SIZE_LIMIT_SCRIPT = textwrap.dedent("""
    import json, os, resource, signal, sys
    import torch
    import actviz

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    folder = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def train(steps):
        for _ in range(steps):
            model(torch.randn(16, 4)).square().mean().backward()

    viz = actviz.watch(model, folder, every=1)
    train(3)
    viz.flush()
    written = sum(path.stat().st_size for path in os.scandir(folder))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (written + 100, hard))  # the next record fits in part only
    train(3)
    viz.flush()
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # room again
    train(3)
    viz.close()
    print(json.dumps({"dropped": viz.dropped_steps, "step": viz.step}))
""")


def test_a_file_size_limit_costs_the_steps_past_it_and_the_run_goes_on_once_it_is_lifted(tmp_path, read_run):
    pytest.importorskip("resource")
    if not hasattr(__import__("signal"), "SIGXFSZ"):
        pytest.skip("no SIGXFSZ on this platform")
    done = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, env=_env(), timeout=LIMIT_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"dropped": 3, "step": 9}
    assert "Traceback" not in done.stderr  # TensorBoard's writer thread did not die
    warned = [line for line in done.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1, done.stderr
    assert "File too large" in warned[0] and str(tmp_path) in warned[0] and "viz.dropped_steps" in warned[0]
    _whole(tmp_path)
    assert read_run(tmp_path).histogram_steps(TAG) == [0, 1, 2, 6, 7, 8]  # in order, the three past the limit lost
    doctor = _doctor(tmp_path)
    assert doctor.returncode in (0, 1), doctor.stdout + doctor.stderr  # read whole: not 3, a damaged file
    assert "damaged" not in doctor.stdout


class FillingDisk:
    """TensorBoard's local file appends, failing with ENOSPC while ``full`` is set, after writing half the record."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self.failed = 0
        original = gfile.LocalFileSystem.append

        def append(fs, filename, file_content, binary_mode=False):
            if not self.full:
                return original(fs, filename, file_content, binary_mode)
            self.failed += 1
            original(fs, filename, file_content[: len(file_content) // 2], binary_mode)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(gfile.LocalFileSystem, "append", append)


@pytest.fixture
def foreign_thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """What ends a thread with an exception (TensorBoard's writer thread, on a failed write, unguarded)."""
    caught: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: caught.append(args.exc_value))
    return caught


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _train(model: nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(16, 4)).square().mean().backward()


def _closed_within(viz: actviz.Watcher, seconds: float = LIMIT_SECONDS) -> None:
    closing = threading.Thread(target=viz.close, daemon=True)
    closing.start()
    closing.join(seconds)
    assert not closing.is_alive(), "close() did not return"


def test_a_full_disk_warns_once_counts_the_steps_and_the_steps_after_are_written(
        tmp_path, read_run, monkeypatch, foreign_thread_errors):
    disk = FillingDisk(monkeypatch)
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        viz = actviz.watch(model, tmp_path, every=1, alerts=False)
        _train(model, 3)
        viz.flush()
        disk.full = True
        _train(model, 4)
        viz.flush()
        disk.full = False
        _train(model, 3)
        _closed_within(viz)
    full = [str(warning.message) for warning in caught if "No space left on device" in str(warning.message)]
    assert len(full) == 1, [str(warning.message) for warning in caught]
    assert str(tmp_path) in full[0] and "step 3" in full[0] and "viz.dropped_steps" in full[0]
    assert disk.failed == 4 and viz.dropped_steps == 4
    assert foreign_thread_errors == []
    _whole(tmp_path)
    assert read_run(tmp_path).histogram_steps(TAG) == [0, 1, 2, 7, 8, 9]


def test_close_on_a_full_disk_returns_and_raises_nothing(tmp_path, monkeypatch, foreign_thread_errors):
    disk = FillingDisk(monkeypatch)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        viz = actviz.watch(model, tmp_path, every=1, alerts=False)
        _train(model, 2)
        disk.full = True
        _train(model, 2)
        started = time.monotonic()
        _closed_within(viz)
        viz.close()  # again: a no-op
    assert time.monotonic() - started < LIMIT_SECONDS
    assert foreign_thread_errors == []
    assert viz.dropped_steps == disk.failed > 0  # the steps still queued at close were written, or counted
    _whole(tmp_path)


def test_a_file_that_cannot_be_cut_back_gets_no_record_after_the_half_one(tmp_path, monkeypatch):
    path = tmp_path / "events"
    path.write_bytes(b"")

    class HalfThenFail:
        def write(self, data: bytes) -> None:
            with open(path, "ab") as file:
                file.write(data[: len(data) // 2])
            raise OSError(errno.EIO, "Input/output error")

        def flush(self) -> None: ...

        def close(self) -> None: ...

    records = WholeRecords(HalfThenFail(), str(path))

    def no_truncate(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "truncate", no_truncate)
    records.write(b"0123456789")
    assert records.damaged and path.read_bytes() == b"01234"
    records.records = None  # anything written now would fail loudly: nothing is
    records.write(b"abcdef")
    assert records.state()[0] == 2 and path.read_bytes() == b"01234"
