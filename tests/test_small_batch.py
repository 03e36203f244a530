"""Small tensors reduced together at a step's end (actviz/summaries/small_tensors.py): values against float64, ops, syncs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CountOps
from torch import nn

import actviz
from actviz.summaries.many_tensors import reduce_tensors
from actviz.summaries.one_tensor import finish, reduce_tensor, start_summary
from actviz.summaries.segments import reduce_segments
from actviz.summaries.small_tensors import SmallTensors


@pytest.fixture(autouse=True)
def device_path(monkeypatch):
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    monkeypatch.setenv("ACTVIZ_FUSED", "0")


def cases() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    offset = torch.randn(5000, generator=generator, dtype=torch.float64) * 1.0 + 1e4  # std 1 about 1e4
    one_signed = torch.rand(3000, generator=generator) + 0.5
    one_signed[17], one_signed[200] = float("nan"), float("inf")  # min/max of the finite ones, not a 0 put in
    negative = -(torch.rand(700, generator=generator) + 2.0)
    negative[3] = -float("inf")
    zeros = torch.randn(999, generator=generator).clamp_min(0)  # about half exact zeros
    return [
        offset.float(), one_signed, negative, zeros, torch.full((4,), float("nan")), torch.tensor([7.0]),
        torch.randn(333, generator=generator).half(), torch.randn(250, generator=generator).bfloat16(),
        torch.tensor([1e-40, -3e-39, 0.0]),  # denormals
    ]


def expected(tensor: torch.Tensor) -> tuple[int, int, int, float, float, float, float]:
    """(numel, nonfinite, zeros, min, max, sum, std) in float64, by hand."""
    values = tensor.double()
    finite = values[torch.isfinite(values)]
    low, high = (finite.min().item(), finite.max().item()) if finite.numel() else (math.nan, math.nan)
    std = finite.std().item() if finite.numel() > 1 else (0.0 if finite.numel() else math.nan)
    return (values.numel(), values.numel() - finite.numel(), int((values == 0).sum()), low, high,
            finite.sum().item(), std)


def check(summary, tensor: torch.Tensor) -> None:
    numel, nonfinite, zeros, low, high, total, std = expected(tensor)
    assert (summary.num, summary.nonfinite, summary.zeros) == (numel, nonfinite, zeros)
    if nonfinite == numel:
        assert math.isnan(summary.min) and math.isnan(summary.max) and not summary.has_histogram
        return
    assert (summary.min, summary.max) == (low, high)
    assert summary.sum == pytest.approx(total, rel=1e-9, abs=1e-30)
    assert summary.std == pytest.approx(std, rel=1e-6, abs=1e-45)
    assert sum(summary.bucket_counts) == numel - nonfinite  # the sample is the whole tensor


def test_many_small_tensors_reduced_together_against_float64_by_hand():
    tensors = cases()
    small = SmallTensors(cpu_shortcut=False)
    reductions = [reduce_tensor(tensor, small=small) for tensor in tensors]
    assert all(reduction.header is None for reduction in reductions)  # nothing reduced in the "hook"
    small.reduce()
    assert len({id(reduction.header) for reduction in reductions}) == 1  # one (k, FIELDS) matrix
    for tensor, reduction in zip(tensors, reductions):
        check(finish(reduction, bins=10), tensor)


def test_a_copy_in_the_hook_keeps_what_was_logged_after_an_in_place_change():
    small = SmallTensors(cpu_shortcut=False)
    tensor = torch.tensor([-1.0, 2.0, -3.0])
    reduction = reduce_tensor(tensor, small=small)
    tensor.relu_()  # a later ReLU(inplace=True)
    small.reduce()
    assert finish(reduction).min == -3.0 and finish(reduction).sum == -2.0


def test_the_batch_takes_one_op_per_tensor_and_a_constant_number_at_the_end_with_no_sync():
    counts = []
    for k in (3, 60):
        tensors = [torch.randn(10 + index) for index in range(k)]
        small = SmallTensors(cpu_shortcut=False)
        for tensor in tensors:
            with CountOps() as hook:
                reduce_tensor(tensor, small=small)
            assert len(hook.kernels) == 1 and hook.syncs == [], hook.kernels  # one copy
        sizes = tuple(tensor.numel() for tensor in tensors)
        reduce_segments(torch.cat(tensors).double(), sizes)  # the layout for these sizes, made once (a run's steps repeat)
        with CountOps() as end:
            small.reduce()
        assert end.syncs == []
        counts.append(len(end.kernels))
    assert counts[0] == counts[1] <= 30, counts


def test_devices_without_segment_reduce_get_the_same_header_from_index_add(monkeypatch):
    from actviz.summaries import segments
    tensors = cases()
    sizes = tuple(tensor.numel() for tensor in tensors)
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.cat([tensor.to(dtype) for tensor in tensors])
        reduce_segments(flat, sizes)  # the layout for these sizes, made once (other tests' writer threads may clear it)
        with CountOps() as default:
            by_segment = reduce_segments(flat, sizes)
        assert default.kernels.count("aten.segment_reduce.default") == 3 and default.syncs == []  # sums, min, max
        with monkeypatch.context() as patch:
            patch.setattr(segments, "SEGMENT_REDUCE_DEVICES", frozenset())  # as on MPS
            with CountOps() as fallback:
                by_index = reduce_segments(flat, sizes)
        assert fallback.syncs == [] and "aten.segment_reduce.default" not in fallback.kernels
        torch.testing.assert_close(by_index, by_segment, rtol=1e-12, atol=0, equal_nan=True)
        for column, tensor in zip(by_segment, tensors):  # and both against float64 by hand
            numel, nonfinite, zeros, low, high, _, _ = expected(tensor.to(dtype))
            assert column[:2].tolist() == [numel - zeros, numel - zeros - nonfinite]
            if nonfinite < numel:
                assert column[4:].tolist() == [low, high]


def test_the_cpu_shortcut_is_not_batched():
    small = SmallTensors(cpu_shortcut=True)
    reduction = reduce_tensor(torch.tensor([1.0, 2.0]), small=small)
    assert reduction.header is not None  # reduced at once, on the host


def test_parameters_the_sample_covers_take_the_segment_reduction():
    generator = torch.Generator().manual_seed(5)
    parameters = [torch.randn(40, generator=generator) + 1e3, torch.randn(7, 9, generator=generator),
                  torch.randn(30_000, generator=generator)]  # the last is strided: the _foreach path
    reductions = [summary.made for summary in reduce_tensors(parameters)]
    assert reductions[0].header is reductions[1].header is not reductions[2].header
    for tensor, reduction in zip(parameters, reductions):
        summary = finish(reduction)
        numel, _, _, low, high, total, std = expected(tensor)
        assert (summary.num, summary.min, summary.max) == (numel, low, high)
        assert summary.sum == pytest.approx(total, rel=1e-9)
        assert summary.std == pytest.approx(std, rel=1e-6)


class Planted(nn.Module):
    """Outputs with NaN, ±Inf, a large offset and one sign: what the hooks batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 50)
        self.offset = nn.Identity()
        self.positive = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(x)
        shifted = self.offset(hidden.detach() * 1e-3 + 1e4)
        positive = hidden.detach().abs() + 0.25
        positive[0, 3], positive[1, 4] = float("nan"), float("inf")
        self.positive(positive)
        return hidden + 0 * shifted.sum()


@pytest.mark.filterwarnings("ignore:actviz. NaN or Inf")  # planted
def test_a_watched_step_logs_the_batched_numbers_against_float64(tmp_path, read_run):
    torch.manual_seed(0)
    model = Planted()
    seen: dict[str, torch.Tensor] = {}
    for name in ("fc", "offset", "positive"):
        getattr(model, name).register_forward_hook(lambda m, i, out, name=name: seen.__setitem__(name, out.detach().clone()))
    with actviz.watch(model, tmp_path, every=1, image_every=False, layers=["fc", "offset", "positive"]) as viz:
        model(torch.randn(4, 6)).square().mean().backward()
        viz.flush()
    run = read_run(tmp_path)
    for name, tensor in seen.items():
        histogram = run.histogram(f"activations/{name}", 0)
        numel, nonfinite, _, low, high, total, std = expected(tensor)
        assert (histogram.min, histogram.max) == (low, high)
        assert histogram.sum == pytest.approx(total, rel=1e-9)
        assert run.scalar(f"activation_stats/std@{name}", 0) == pytest.approx(std, rel=1e-5)
    assert run.scalar("activation_stats/nonfinite@positive", 0) == 2


def test_the_writer_thread_reduces_a_steps_small_tensors(tmp_path, read_run):
    # Their packed copy goes to the host anyway, as their samples: the training thread launches no reduction for them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 50), nn.ReLU(), nn.Linear(50, 3))
    inputs = torch.randn(4, 6)
    with actviz.watch(model, tmp_path, every=1, image_every=False) as viz:
        with CountOps() as count:  # the training thread's ops only: the mode is thread-local
            model(inputs).square().mean().backward()
            viz.flush()
    assert "aten.segment_reduce.default" not in count.kernels and count.syncs == [], count.kernels
    run = read_run(tmp_path)
    with torch.no_grad():
        hidden = model[0](inputs)
    histogram = run.histogram("activations/0", 0)
    assert (histogram.num, histogram.min, histogram.max) == (200, hidden.min().item(), hidden.max().item())
    assert histogram.sum == pytest.approx(hidden.double().sum().item(), rel=1e-9)
    assert run.histogram("weights/0.bias", 0).sum == pytest.approx(model[0].bias.double().sum().item(), rel=1e-9)


def test_merge_ranks_has_the_small_tensors_reduced_on_their_device():
    # merge_ranks merges the rows on the devices (tests/test_distributed.py runs it on two ranks).
    from actviz.output.pending_step import PendingStep

    reduce_segments(torch.zeros(3), (3,))  # the layout for these sizes, made once (a run's steps repeat)
    pending = PendingStep(0, bins=8)
    pending.activations.add_many({"a": start_summary(torch.tensor([1.0, float("nan"), -2.0]), None, pending.small)},
                                 mergeable={"a"})
    with CountOps() as count:
        ((tag, reduction),) = pending.mergeable
    assert count.kernels.count("aten.segment_reduce.default") == 3 and count.syncs == []  # sums, min, max
    assert tag == "activations/a" and isinstance(reduction.header, torch.Tensor)
    summary = finish(reduction)
    assert (summary.nonfinite, summary.min, summary.max) == (1, -2.0, 1.0) and summary.sum == pytest.approx(-1.0)
