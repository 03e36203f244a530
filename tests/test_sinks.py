"""Writing: the fast TensorBoard checksum and failed writes that must not stop training."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import small_cnn, train_step
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
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


class FullDisk(SummaryWriter):
    def add_histogram_raw(self, *args, **kwargs):
        raise OSError(28, "No space left on device")


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
    viz.close()
    writer.close()
