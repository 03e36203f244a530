"""Writing: the fast TensorBoard checksum and failed writes that must not stop training."""

from __future__ import annotations

import os

import numpy as np

import pytest
import torch
from conftest import small_cnn, train_step
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.summary.writer import record_writer
from torch.utils.tensorboard import SummaryWriter

import actviz
from actviz.sinks import use_fast_crc


def test_fast_crc_gives_tensorboards_checksums():
    assert use_fast_crc()
    assert use_fast_crc()  # idempotent
    fast = record_writer.masked_crc32c
    assert fast is not pywrap_tensorflow.masked_crc32c
    for size in (0, 1, 7, 8, 9, 1000, 34_000):
        data = os.urandom(size) if size else b""
        assert fast(data) == pywrap_tensorflow.masked_crc32c(data)


class FullDiskFileWriter:
    def add_summary(self, *args, **kwargs):
        raise OSError(28, "No space left on device")


class FullDisk(SummaryWriter):
    def _get_file_writer(self):
        return FullDiskFileWriter()


def test_a_failing_write_warns_once_and_training_goes_on(tmp_path):
    model = small_cnn()
    writer = FullDisk(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"could not write step 0: OSError: .*No space left") as caught:
        with actviz.watch(model, writer=writer, every=1):
            for _ in range(3):
                train_step(model)
    assert sum("could not write" in str(w.message) for w in caught) == 1
    writer.close()


def test_strict_raises_a_failing_write_in_the_training_thread(tmp_path):
    model = small_cnn()
    writer = FullDisk(tmp_path)
    viz = actviz.watch(model, writer=writer, every=1, strict=True)
    with pytest.raises(OSError, match="No space left"):
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        viz.flush()  # the step ends here (no optimizer step) and is written on this thread
    viz.close()
    writer.close()


class PublicMethodsOnly:
    """A writer with SummaryWriter's public methods but no ``_get_file_writer``."""

    def __init__(self, log_dir):
        self._writer = SummaryWriter(log_dir)
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name.startswith("add_"):
            self.calls.append(name)
        return getattr(self._writer, name)


def test_a_step_is_one_event_with_the_same_values_as_the_public_methods_write(tmp_path, read_run):
    model, twin = small_cnn(), small_cnn()
    twin.load_state_dict(model.state_dict())
    public = PublicMethodsOnly(tmp_path / "public")
    with actviz.watch(model, tmp_path / "merged", every=1, strict=True), \
            actviz.watch(twin, writer=public, every=1, strict=True):
        torch.manual_seed(0)
        train_step(model)
        torch.manual_seed(0)
        train_step(twin)
    public._writer.close()
    assert {"add_scalar", "add_histogram_raw", "add_image"} <= set(public.calls)

    events = list(EventFileLoader(str(next((tmp_path / "merged").glob("events.*")))).Load())
    step_events = [event for event in events if event.HasField("summary")]
    assert len(step_events) == 1  # one event carries the whole step
    merged, separate = read_run(tmp_path / "merged"), read_run(tmp_path / "public")
    assert merged.scalar_tags == separate.scalar_tags and len(merged.scalar_tags) > 0
    assert merged.histogram_tags == separate.histogram_tags and len(merged.histogram_tags) > 0
    assert merged.image_tags == separate.image_tags and len(merged.image_tags) > 0
    texts = set(merged.events.Tags()["tensors"])
    assert texts == {"layers"}  # the layer table, at the first stats step
    assert len(step_events[0].summary.value) == len(
        merged.scalar_tags | merged.histogram_tags | merged.image_tags | texts
    )
    for tag in merged.scalar_tags:
        assert merged.scalar(tag, 0) == pytest.approx(separate.scalar(tag, 0), rel=1e-6, nan_ok=True)
    for tag in merged.histogram_tags:
        a, b = merged.histogram(tag, 0), separate.histogram(tag, 0)
        assert (a.min, a.max, a.num) == (b.min, b.max, b.num)
        assert a.bucket == b.bucket and a.bucket_limit == b.bucket_limit
    for tag in merged.image_tags:
        picture, through_add_image = merged.image(tag, 0), separate.image(tag, 0)
        if picture.ndim == 2:  # add_image stores a grayscale grid as RGB with three equal channels
            picture = np.repeat(picture[:, :, None], 3, axis=2)
        assert (picture == through_add_image).all()
