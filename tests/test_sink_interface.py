"""watch(sink=...): a sink of your own gets the numbers TensorBoard gets, alone or beside it, and never stops training."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import hooks_left, small_cnn, train_step

import actviz
from actviz.common.histogram_buckets import expand_empty_buckets, merge_empty_buckets
from actviz.output.open_watchers import watching
from actviz.common.results import StepResults
from actviz.output.sink import FanOutSink
from actviz.tags import ONCE_NOT_ZERO, step_items


class ListSink:
    """Keeps every ``(step, kind, tag, value)`` it is given, and counts flushes and closes."""

    def __init__(self) -> None:
        self.items: dict[tuple[int, str], tuple[str, object]] = {}
        self.steps: list[int] = []
        self.flushes = 0
        self.closes = 0

    def write(self, results: StepResults) -> None:
        self.steps.append(results.step)
        for kind, tag, value in step_items(results):
            self.items[(results.step, tag)] = (kind, value)

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closes += 1


def same_float32(written: float, value: float) -> bool:
    """TensorBoard keeps scalars as float32: ``written`` is ``value`` rounded so (NaN is NaN)."""
    return (math.isnan(written) and math.isnan(value)) or written == float(np.float32(value))


def test_a_sink_beside_tensorboard_gets_the_numbers_tensorboard_writes(tmp_path, read_run):
    model = small_cnn(inplace=False)
    twin = small_cnn(inplace=False)  # the same weights: its first layer's output at step 0, by hand
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = ListSink()
    torch.manual_seed(1)
    first = torch.randn(4, 3, 8, 8)
    with actviz.watch(model, tmp_path, sink=sink, every=1, image_every=2) as viz:
        model(first).square().mean().backward()
        optimizer.step()
        for _ in range(3):
            train_step(model, optimizer)
        viz.flush()
        assert sink.flushes == 1 and sink.closes == 0
    assert sink.closes == 1 and sink.steps == [0, 1, 2, 3]
    run = read_run(tmp_path)

    written = 0
    for tag in run.scalar_tags:
        for event in run.scalar_events(tag):
            kind, value = sink.items[(event.step, tag)]
            assert kind == "scalar" and same_float32(event.value, value), (tag, event.step, event.value, value)
            written += 1
    for tag in run.histogram_tags:
        for event in run.histogram_events(tag):
            kind, summary = sink.items[(event.step, tag)]
            histogram = event.histogram_value
            limits, counts = summary.histogram()
            assert kind == "histogram" and (histogram.min, histogram.max, histogram.num, histogram.sum) == (
                summary.min, summary.max, summary.finite_count, summary.sum)
            assert (list(histogram.bucket_limit), list(histogram.bucket)) == merge_empty_buckets(limits, counts)
            assert expand_empty_buckets(histogram.min, histogram.max, histogram.bucket_limit, histogram.bucket,
                                        len(summary.bucket_counts)) == (limits, counts)
            written += 1
    for tag in run.image_tags:
        for step in run.image_steps(tag):
            kind, image = sink.items[(step, tag)]
            assert kind == "image"
            assert np.array_equal(run.image(tag, step).reshape(image.shape[1], image.shape[2], -1),
                                  image.permute(1, 2, 0).numpy())
            written += 1
    assert written > 100
    # What the sink got and TensorBoard did not: only zero counts TensorBoard leaves out until they are not zero.
    on_tensorboard = {(step, tag) for tag in run.image_tags for step in run.image_steps(tag)}
    on_tensorboard |= {(event.step, tag) for tag in run.scalar_tags for event in run.scalar_events(tag)}
    on_tensorboard |= {(event.step, tag) for tag in run.histogram_tags for event in run.histogram_events(tag)}
    on_tensorboard |= {(event.step, tag) for tag in run.events.Tags()["tensors"] for event in run.events.Tensors(tag)}
    left_out = {key for key in sink.items if key not in on_tensorboard}
    assert left_out and all(tag.split("/")[1].split("@")[0] in ONCE_NOT_ZERO and sink.items[(step, tag)][1] == 0
                            for step, tag in left_out), sorted(left_out)[:5]
    # and both are right: layer 0's mean at step 0, by hand in float64
    mean = float(twin[0](first).detach().double().mean())
    assert sink.items[(0, "activation_stats/mean@0")][1] == pytest.approx(mean, rel=1e-6)


def test_a_sink_alone_is_the_only_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = small_cnn()
    sink = ListSink()
    with actviz.watch(model, sink=sink, every=2) as viz:
        for _ in range(5):
            train_step(model, torch.optim.SGD(model.parameters(), lr=0.01))
        assert viz.writer is None
    assert sink.steps == [0, 2, 4] and sink.closes == 1
    assert list(tmp_path.iterdir()) == []  # no SummaryWriter, no runs/ folder
    assert (2, "gradient_stats/norm@6") in sink.items and (0, "feature_maps/0") in sink.items
    assert hooks_left(model) == hooks_left(small_cnn())


@pytest.mark.parametrize("bad, missing", [
    (object(), "object has no write, flush, close"),
    (type("WriteOnly", (), {"write": lambda self, results: None})(), "WriteOnly has no flush, close"),
    (type("NotCallable", (ListSink,), {"flush": 3})(), "NotCallable has no flush"),
])
def test_a_sink_without_the_interface_is_a_type_error_at_watch(tmp_path, bad, missing):
    model = small_cnn()
    with pytest.raises(TypeError, match=f"sink must have the methods write\\(results\\), flush\\(\\) and close\\(\\); "
                                        f"{missing}$"):
        actviz.watch(model, tmp_path / "run", sink=bad)
    assert watching(model) is None and not (tmp_path / "run").exists()  # nothing attached, no folder made


class Broken(ListSink):
    def write(self, results: StepResults) -> None:
        super().write(results)
        raise OSError("disk full")


@pytest.mark.parametrize("with_tensorboard", [True, False])
def test_a_sink_that_raises_never_stops_training_and_warns_once(tmp_path, read_run, with_tensorboard):
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Broken()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tmp_path if with_tensorboard else None, sink=sink, every=1):
            losses = [train_step(model, optimizer) for _ in range(4)]
    assert all(torch.isfinite(loss) for loss in losses)
    messages = [str(warning.message) for warning in caught if "sink" in str(warning.message)]
    assert len(messages) == 1 and "sink Broken.write() raised OSError: disk full. Training goes on" in messages[0]
    assert sink.steps == [0, 1, 2, 3]  # called again after it raised
    if with_tensorboard:
        assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2, 3]  # TensorBoard got every step


def test_fan_out_calls_every_sink_and_raises_the_first_sinks_error_after():
    class Failing(ListSink):
        def write(self, results: StepResults) -> None:
            raise ValueError("first")

    later = ListSink()
    with pytest.raises(ValueError, match="first"):
        FanOutSink([Failing(), later], guard_from=1).write(StepResults(3, scalars={"a": 1.0}))
    assert later.steps == [3]


def test_flush_is_done_by_the_writer_thread_after_the_steps_queued_before(tmp_path):
    """The training thread does no file I/O in flush(): the writer thread flushes once the steps before are written;
    a flush that fails warns once, and training and the next flushes go on."""
    import threading

    class RecordingSink(ListSink):
        def __init__(self) -> None:
            super().__init__()
            self.flushed_after: list[list[int]] = []
            self.threads: list[str] = []
            self.fail = True

        def flush(self) -> None:
            super().flush()
            self.flushed_after.append(list(self.steps))
            self.threads.append(threading.current_thread().name)
            if self.fail:
                self.fail = False
                raise OSError("disk full")

    model = small_cnn(inplace=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = RecordingSink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, sink=sink, every=1, image_every=False) as viz:
            for _ in range(2):
                train_step(model, optimizer)
            viz.flush()  # the first flush fails: warned, not raised
            train_step(model, optimizer)
            viz.flush()
    assert sink.flushed_after[:2] == [[0, 1], [0, 1, 2]]
    assert sink.threads[:2] == ["actviz-writer", "actviz-writer"]
    flush_warnings = [str(w.message) for w in caught if "flush() raised" in str(w.message)]
    assert len(flush_warnings) == 1 and "disk full" in flush_warnings[0], flush_warnings
