"""Writing: the fast TensorBoard checksum, the one write path, exit, and failed writes that must not stop training."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import small_cnn, train_step
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import record_writer
from torch.utils.tensorboard import SummaryWriter

import actviz
from actviz.output import tensorboard as sinks
from actviz.common.histogram_buckets import merge_empty_buckets
from actviz.common.results import StepResults, Summary
from actviz.output.pending_step import record_values
from actviz.output.tensorboard import TensorBoardSink, use_fast_crc
from actviz.output.writer_thread import Writer
from actviz.pictures.rendering import feature_map_grid
from actviz.statistics.moments import Moments
from actviz.summaries.one_tensor import summarize


def finish_summary(tensor: torch.Tensor) -> Summary:
    return Summary.from_vector(summarize(tensor).tolist())


def test_fast_crc_gives_tensorboards_checksums():
    assert use_fast_crc()
    assert use_fast_crc()  # idempotent
    fast = record_writer.masked_crc32c
    assert fast is not pywrap_tensorflow.masked_crc32c
    for size in (0, 1, 7, 8, 9, 1000, 34_000):
        data = os.urandom(size) if size else b""
        assert fast(data) == pywrap_tensorflow.masked_crc32c(data)


def test_no_sink_patches_tensorboard_but_watch_does(tmp_path, monkeypatch):
    monkeypatch.setattr(record_writer, "masked_crc32c", pywrap_tensorflow.masked_crc32c)
    with SummaryWriter(tmp_path / "mine") as writer:
        TensorBoardSink(writer, owns_writer=False)
        Writer(TensorBoardSink(writer, owns_writer=False)).close()
    assert record_writer.masked_crc32c is pywrap_tensorflow.masked_crc32c  # constructors leave it alone
    actviz.watch(small_cnn(), tmp_path / "watched").close()
    assert record_writer.masked_crc32c is not pywrap_tensorflow.masked_crc32c
    assert getattr(record_writer.masked_crc32c, "actviz_fast_crc", False)


def test_fast_crc_is_fail_safe_when_tensorboard_renames_the_checksum(monkeypatch, caplog):
    monkeypatch.delattr(record_writer, "masked_crc32c")
    monkeypatch.setattr(sinks, "_fast_crc_failure_logged", False)
    with caplog.at_level(logging.DEBUG, logger="actviz.output.tensorboard"):
        assert use_fast_crc() is False
        assert use_fast_crc() is False
    assert not hasattr(record_writer, "masked_crc32c")  # left as it was: nothing added
    failures = [r for r in caplog.records if "pure Python" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.DEBUG  # once, at DEBUG
    assert "masked_crc32c" in failures[0].exc_text


def test_fast_crc_without_the_crc32c_package_leaves_tensorboard_alone(monkeypatch):
    monkeypatch.setattr(record_writer, "masked_crc32c", pywrap_tensorflow.masked_crc32c)
    monkeypatch.setitem(sys.modules, "crc32c", None)  # import crc32c raises ImportError
    monkeypatch.setattr(sinks, "_fast_crc_failure_logged", False)
    assert use_fast_crc() is False
    assert record_writer.masked_crc32c is pywrap_tensorflow.masked_crc32c


_EXIT_SCRIPT = """
import atexit, sys, torch
registered = []
_register = atexit.register
atexit.register = lambda function, *args, **kwargs: (registered.append(function.__module__), _register(function, *args, **kwargs))[1]
import actviz
for index in range(3):  # three watchers, never closed: their steps are written at exit
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    viz = actviz.watch(model, sys.argv[1] + f"/run{index}", every=1)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
print(registered.count("actviz.output.open_watchers"), sum(module.startswith("actviz") for module in registered))
"""


def test_one_atexit_entry_writes_the_pending_steps_of_every_watcher(tmp_path, read_run):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "1 1"  # one atexit entry, actviz's, for the three watchers
    for index in range(3):
        run = read_run(tmp_path / f"run{index}")
        assert run.histogram_steps("activations/0") == [0] and run.image_steps("feature_maps/0") == [0]


class FullDiskFileWriter:
    def add_summary(self, *args, **kwargs):
        raise OSError(28, "No space left on device")


class FullDisk(SummaryWriter):
    def _get_file_writer(self):
        return FullDiskFileWriter()


class FullDiskEverywhere(FullDiskFileWriter):
    def flush(self):
        raise OSError(28, "No space left on device")


class FullDiskWriter(SummaryWriter):
    def _get_file_writer(self):
        return FullDiskEverywhere()


def test_a_failing_write_warns_once_and_training_goes_on(tmp_path):
    model = small_cnn()
    writer = FullDisk(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"could not write step 0: OSError: .*No space left") as caught:
        with actviz.watch(model, sink=writer, every=1):
            for _ in range(3):
                train_step(model)
    assert sum("could not write" in str(w.message) for w in caught) == 1
    writer.close()


def test_a_full_disk_under_tensorboard_is_one_warning_for_its_writes_and_flushes(tmp_path):
    model = small_cnn()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, sink=FullDiskWriter(tmp_path), every=1) as viz:
            for _ in range(3):
                train_step(model)
            viz.flush()
    found = [str(w.message) for w in caught if str(w.message).startswith("actviz could not")]
    assert len(found) == 1 and "could not write step 0: OSError" in found[0]


class FullDiskSink:
    """A sink on a full disk: the write, the flush and the close all fail the same way."""

    def __init__(self, write_error: Exception | None = None) -> None:
        self.write_error = write_error

    def write(self, results):
        raise self.write_error or OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")

    def close(self):
        raise OSError(28, "No space left on device")


def _actviz_warnings(sink) -> list[str]:
    model = small_cnn()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, sink=sink, every=1) as viz:
            for _ in range(3):
                train_step(model)
            viz.flush()
    return [str(w.message) for w in caught if str(w.message).startswith("actviz's sink FullDiskSink")]


def test_a_full_disk_is_one_warning_for_its_writes_flushes_and_close():
    found = _actviz_warnings(FullDiskSink())
    assert len(found) == 1 and "FullDiskSink.write() raised OSError" in found[0] and "No space left" in found[0]
    # two causes, two warnings: a write that fails on its own, and the full disk at the flush
    found = _actviz_warnings(FullDiskSink(write_error=ValueError("a bad value")))
    assert len(found) == 2 and "ValueError: a bad value" in found[0] and ".flush() raised OSError" in found[1]


def test_strict_raises_a_failing_write_in_the_training_thread(tmp_path):
    model = small_cnn()
    writer = FullDisk(tmp_path)
    viz = actviz.watch(model, sink=writer, every=1, options=actviz.Options(strict=True))
    with pytest.raises(OSError, match="No space left"):
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        viz.flush()  # the step ends here (no optimizer step) and is written on this thread
    viz.close()
    writer.close()


def _write_with_public_methods(writer: SummaryWriter, results: StepResults) -> None:
    """What SummaryWriter's own methods write for one step: the reference for the sink's one event (TensorBoard's
    names of actviz's tags start with "~")."""
    for tag, summary in results.activations.items():
        limits, counts = merge_empty_buckets(*summary.histogram())  # runs of empty buckets as one, as actviz writes
        writer.add_histogram_raw(
            f"~activations/{tag}", min=summary.min, max=summary.max, num=summary.finite_count, sum=summary.sum,
            sum_squares=summary.sum_squares, bucket_limits=limits, bucket_counts=counts, global_step=results.step,
        )
        for name in ("mean", "std", "zero_fraction", "nonfinite"):
            if name in ("mean", "std") or getattr(summary, name) != 0:  # the last two only once not zero
                writer.add_scalar(f"~activation_stats/{name}@{tag}", getattr(summary, name), results.step)
    for tag, image in results.images.items():
        writer.add_image(f"~feature_maps/{tag}", image, results.step, dataformats="CHW")


def test_a_step_is_one_event_with_the_values_summarywriters_methods_write(tmp_path, read_run):
    torch.manual_seed(0)
    activation = torch.randn(2, 3, 5, 5).relu()
    results = StepResults(
        step=7,
        activations={"conv": finish_summary(activation), "head": finish_summary(torch.arange(6.0))},
        images={"conv": feature_map_grid(activation[0])},
    )
    for layer, summary in results.activations.items():  # the moments, as the writer thread records them
        record_values(results, Moments(), layer, Moments().from_layer_summary(summary))
    merged_writer = SummaryWriter(tmp_path / "merged")
    TensorBoardSink(merged_writer, owns_writer=True).write(results)
    merged_writer.close()
    with SummaryWriter(tmp_path / "public") as public_writer:
        _write_with_public_methods(public_writer, results)

    events = list(EventFileLoader(str(next((tmp_path / "merged").glob("events.*")))).Load())
    step_events = [event for event in events if event.HasField("summary")]
    assert len(step_events) == 1 and step_events[0].step == 7  # one event carries the whole step
    merged, separate = read_run(tmp_path / "merged"), read_run(tmp_path / "public")
    assert merged.scalar_tags == separate.scalar_tags and len(merged.scalar_tags) == 6  # no nonfinite: all zero
    assert merged.histogram_tags == separate.histogram_tags == {"activations/conv", "activations/head"}
    assert merged.image_tags == separate.image_tags == {"feature_maps/conv"}
    assert len(step_events[0].summary.value) == 6 + 2 + 1
    assert merged.scalar("activation_stats/mean@head", 7) == 2.5  # (0 + 1 + ... + 5) / 6, by hand
    for tag in merged.scalar_tags:
        assert merged.scalar(tag, 7) == pytest.approx(separate.scalar(tag, 7), rel=1e-6, nan_ok=True)
    for tag in merged.histogram_tags:
        a, b = merged.histogram(tag, 7), separate.histogram(tag, 7)
        assert (a.min, a.max, a.num, a.sum) == (b.min, b.max, b.num, b.sum)
        assert a.bucket == b.bucket and a.bucket_limit == b.bucket_limit
    picture, through_add_image = merged.image("feature_maps/conv", 7), separate.image("feature_maps/conv", 7)
    # add_image stores a grayscale grid as RGB with three equal channels
    assert (np.repeat(picture[:, :, None], 3, axis=2) == through_add_image).all()
