"""Histogram and moment math, checked against values worked out by hand, on both code paths."""

import math
import warnings

import numpy as np
import pytest
import torch

from actviz.options import DEFAULT_SAMPLE_SIZE
from actviz.common.results import HEADER_SIZE, Summary
from actviz.summaries.many_tensors import reduce_tensors
from actviz.summaries.one_tensor import finish, flat_view, reduce_tensor, sample_stride, summarize


@pytest.fixture(autouse=True, params=["shortcuts", "device"])
def path(request, monkeypatch):
    """Run every test here twice: with the CPU shortcut, and on the accelerator path (ACTVIZ_CPU_SHORTCUTS=0)."""
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "1" if request.param == "shortcuts" else "0")
    monkeypatch.setenv("ACTVIZ_FUSED", "0")  # its eager form; the compiled one is tests/test_fused.py's
    return request.param


def summary_of(tensor, bins=4, sample_size=None) -> Summary:
    vector = summarize(tensor, bins=bins, sample_size=sample_size)
    assert vector.shape == (HEADER_SIZE + bins,)
    return Summary.from_vector(vector.tolist())


def finished(reduction, bins):
    reduction.receive({id(t): t.cpu() for t in reduction.device_tensors()})
    return finish(reduction, bins)


def test_buckets_and_moments_by_hand():
    # min 0, max 4, width 1: [0,1) holds 0 and 0.5; [1,2) holds 1; [2,3) nothing; [3,4] holds 3 and 4.
    summary = summary_of(torch.tensor([0.0, 0.5, 1.0, 3.0, 4.0]), bins=4)
    assert (summary.num, summary.nonfinite, summary.zeros) == (5, 0, 1)
    assert (summary.min, summary.max) == (0.0, 4.0)
    assert summary.sum == pytest.approx(8.5, rel=1e-7)
    assert summary.sum_squares == pytest.approx(0.25 + 1 + 9 + 16, rel=1e-7)
    assert summary.bucket_counts == [2.0, 1.0, 0.0, 2.0]
    assert summary.bucket_limits() == [1.0, 2.0, 3.0, 4.0]
    assert summary.mean == pytest.approx(8.5 / 5)
    assert summary.std == pytest.approx(math.sqrt((26.25 - 8.5**2 / 5) / 4))
    assert summary.zero_fraction == 1 / 5
    assert summary.norm == pytest.approx(math.sqrt(26.25))


def test_nan_and_inf_are_counted_and_left_out():
    summary = summary_of(torch.tensor([1.0, float("nan"), -2.0, float("inf"), float("-inf"), 0.0]), bins=3)
    assert (summary.num, summary.nonfinite, summary.finite_count) == (6, 3, 3)
    assert (summary.min, summary.max) == (-2.0, 1.0)
    assert (summary.sum, summary.sum_squares) == pytest.approx((-1.0, 5.0), rel=1e-7)
    # width 1: [-2,-1) holds -2; [-1,0) nothing; [0,1] holds 0 and 1
    assert summary.bucket_counts == [1.0, 0.0, 2.0]
    assert summary.zeros == 1
    assert summary.has_histogram


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_signed_values_with_nan_and_no_zero_keep_their_true_range(sign):
    # The 0 standing in for NaN/Inf in the sums would be the min (or max): it must not show.
    values = sign * torch.tensor([2.0, float("nan"), 5.0, float("inf"), 3.0])
    summary = summary_of(values, bins=3)
    assert (summary.min, summary.max) == tuple(sorted((2.0 * sign, 5.0 * sign)))
    assert summary.sum == pytest.approx(10.0 * sign) and summary.zeros == 0
    # width 1 over [2, 5]: 2, 3 and 5 land in buckets 0, 1, 2; over [-5, -2]: -5, -3, -2 in 0, 2, 2
    assert summary.bucket_counts == ([1.0, 1.0, 1.0] if sign > 0 else [1.0, 0.0, 2.0])


@pytest.mark.parametrize("values", [[], [float("nan")] * 3, [float("inf"), float("nan")]])
def test_empty_or_all_nonfinite_has_no_histogram(values):
    summary = summary_of(torch.tensor(values))
    assert summary.num == len(values)
    assert summary.nonfinite == len(values)
    assert not summary.has_histogram
    assert math.isnan(summary.mean) and math.isnan(summary.std)


def test_constant_tensor_gets_one_bucket():
    summary = summary_of(torch.full((7,), 2.5))
    assert summary.histogram() == ([2.5], [7.0])
    assert summary.std == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.uint8, torch.bool]
)
def test_every_real_dtype(dtype):
    generator = torch.Generator().manual_seed(1)
    values = torch.randint(0, 2 if dtype == torch.bool else 50, (1000,), generator=generator)
    tensor = values.to(dtype)
    exact = tensor.double().numpy()
    summary = summary_of(tensor, bins=8)
    assert summary.num == 1000
    assert summary.min == exact.min() and summary.max == exact.max()
    assert summary.sum == pytest.approx(exact.sum())
    assert summary.sum_squares == pytest.approx((exact**2).sum())
    assert summary.zeros == int((exact == 0).sum())
    assert sum(summary.bucket_counts) == 1000


def test_complex_is_refused():
    with pytest.raises(TypeError, match="complex"):
        summarize(torch.zeros(3, dtype=torch.complex64))


def test_input_is_not_modified():
    tensor = torch.tensor([float("nan"), 1.0, -1.0])
    before = tensor.clone()
    summarize(tensor)
    torch.testing.assert_close(tensor, before, equal_nan=True)


def test_sampled_buckets_scale_to_the_full_count_and_keep_exact_moments():
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(64, 16, 32, 32, generator=generator)  # 1,048,576 elements
    tensor[0, 0, 0, :5] = float("nan")
    sampled = summary_of(tensor, bins=16, sample_size=1 << 16)
    exact = summary_of(tensor, bins=16, sample_size=None)
    finite = tensor[torch.isfinite(tensor)].double()
    assert sampled.num == exact.num == tensor.numel()
    assert sampled.nonfinite == 5
    assert sampled.min == finite.min().item() and sampled.max == finite.max().item()
    assert sampled.sum == pytest.approx(finite.sum().item(), rel=1e-5, abs=1e-2)
    assert sampled.sum_squares == pytest.approx((finite**2).sum().item(), rel=1e-5)
    assert sum(sampled.bucket_counts) == pytest.approx(sampled.finite_count)
    assert sum(exact.bucket_counts) == exact.finite_count
    # exact counts match numpy's histogram on the same edges
    edges = np.linspace(exact.min, exact.max, 17)
    numpy_counts, _ = np.histogram(finite.numpy(), bins=edges)
    assert np.abs(np.array(exact.bucket_counts) - numpy_counts).max() <= 2  # float32 edge rounding
    # the sample's shape agrees with the full count within sampling noise on the big buckets
    big = numpy_counts > 50_000
    assert np.allclose(np.array(sampled.bucket_counts)[big], numpy_counts[big], rtol=0.03)


def test_default_sample_keeps_the_histogram_shape():
    # At the default sample size (256 values per bucket at 64 bins) the scaled counts stay
    # close to the exact ones: total variation distance under 3% on a real conv output.
    generator = torch.Generator().manual_seed(1)
    conv = torch.nn.Conv2d(3, 32, 3, padding=1)
    with torch.no_grad():
        output = conv(torch.randn(64, 3, 32, 32, generator=generator))  # 2,097,152 elements
    for tensor in (output, output.relu(), torch.randn(2_000_000, generator=generator)):
        assert tensor.numel() > 100 * DEFAULT_SAMPLE_SIZE
        sampled = Summary.from_vector(summarize(tensor, bins=64).tolist())
        exact = Summary.from_vector(summarize(tensor, bins=64, sample_size=None).tolist())
        assert (sampled.min, sampled.max) == (tensor.min().item(), tensor.max().item())  # every element, by hand
        assert sampled.sum == pytest.approx(tensor.double().sum().item(), rel=1e-6, abs=1e-3)
        difference = np.abs(np.array(sampled.bucket_counts) - np.array(exact.bucket_counts)).sum()
        assert difference / 2 / exact.finite_count < 0.03


def test_sample_stride_avoids_feature_map_periods():
    for numel in (10**6, 64 * 55 * 55, 512 * 7 * 7 * 8, 3 * 10**7):
        stride = sample_stride(numel, 1 << 16)
        assert -(-numel // stride) <= 1 << 16
        assert all(stride % p for p in (2, 3, 5, 7, 11, 13))
    assert sample_stride(100, 1 << 16) == 1
    assert sample_stride(10**9, None) == 1


@pytest.mark.parametrize("make", [
    lambda x: x,                    # both signs
    lambda x: x.relu(),             # min exactly 0
    lambda x: -x.relu(),            # max exactly 0
    lambda x: x.abs() + 1,          # all positive: no zeros
    lambda x: -(x.abs() + 1),       # all negative
])
def test_zero_count_is_exact_whatever_the_range(make):
    values = make(torch.randn(10_000, generator=torch.Generator().manual_seed(3)))
    values[::7] = 0.0 if values.min() <= 0 <= values.max() else values[::7]
    assert summary_of(values).zeros == int((values == 0).sum())


def test_channels_last_is_read_in_place_and_gives_the_same_summary():
    tensor = torch.randn(4, 6, 5, 7, generator=torch.Generator().manual_seed(2))
    last = tensor.to(memory_format=torch.channels_last)
    assert flat_view(last).data_ptr() == last.data_ptr()  # a view, not a copy
    assert sorted(flat_view(last).tolist()) == sorted(tensor.flatten().tolist())
    a, b = summary_of(tensor, bins=8), summary_of(last, bins=8)
    assert (a.num, a.zeros, a.min, a.max, a.bucket_counts) == (b.num, b.zeros, b.min, b.max, b.bucket_counts)
    assert a.sum == pytest.approx(b.sum, rel=1e-5, abs=1e-5)


def test_float32_squares_that_overflow(path):
    values = torch.tensor([3e19, -3e19] * 2048 + [1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = summary_of(values)
    assert summary.nonfinite == 0
    # The CPU shortcut and the one-pass op both sum the squares in float64.
    assert summary.sum_squares == pytest.approx(4096 * 3e19**2 + 1, rel=1e-6)


def test_reduce_tensors_gives_what_reduce_tensor_gives_one_by_one():
    generator = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(32, generator=generator),                # a bias
        torch.ones(64),                                      # a constant (a fresh norm weight)
        torch.randn(16, 6, 3, 3, generator=generator),       # a conv weight
        torch.tensor([1.0, float("nan"), float("inf")]),     # not finite
        torch.tensor([2.0, float("nan"), 3.0]),              # not finite, one sign, no zero
        torch.randn(100_000, generator=generator),           # large
        torch.randn(128, generator=generator).double(),      # another dtype, another group
        torch.randn(1000, generator=generator).relu(),       # half zeros
        torch.randn(300, generator=generator).bfloat16(),    # 16-bit
        torch.zeros(0),                                      # empty
        torch.randn(9000, generator=generator),              # sampled at a stride
    ]
    together = [summary.made for summary in reduce_tensors(tensors, sample_size=4096)]
    assert len(together) == len(tensors)
    for tensor, reduction in zip(tensors, together):
        many = finished(reduction, 16)
        alone = finished(reduce_tensor(tensor, sample_size=4096), 16)
        assert (many.num, many.nonfinite, many.min, many.max) == (alone.num, alone.nonfinite, alone.min, alone.max)
        assert many.bucket_counts == alone.bucket_counts
        assert many.sum == pytest.approx(alone.sum, rel=1e-6, abs=1e-6)
        assert many.sum_squares == pytest.approx(alone.sum_squares, rel=1e-6)
    by_hand = finished(reduce_tensors([torch.tensor([0.0, -1.0, 3.0, 4.0])])[0].made, 2)
    # width 2.5 over [-1, 4]: -1 and 0 in the first bucket, 3 and 4 in the second
    assert (by_hand.sum, by_hand.sum_squares, by_hand.min, by_hand.max, by_hand.bucket_counts) == (
        6.0, 26.0, -1.0, 4.0, [2.0, 2.0])


def test_a_tensor_that_requires_grad_builds_no_graph():
    weight = torch.randn(300, requires_grad=True)
    for tensor in (weight, weight * 2, torch.tensor([1.0, float("nan")], requires_grad=True)):
        vector = summarize(tensor, bins=4)
        assert not vector.requires_grad and vector.grad_fn is None
    for summary in reduce_tensors([weight, weight * 2]):
        assert all(t.grad_fn is None for t in summary.made.device_tensors())


@pytest.mark.parametrize("mean, std, numel", [(1e4, 1.0, 100_000), (1000.0, 0.01, 100_000), (1.0, 1e-4, 1_000_000)])
def test_std_of_a_large_offset_is_torch_std_in_float64(mean, std, numel):
    # Activations after a LayerNorm with a large bias: float32 sums of squares cancel to 0 here.
    generator = torch.Generator().manual_seed(3)
    tensor = (torch.randn(numel, generator=generator, dtype=torch.float64) * std + mean).float()
    summary = Summary.from_vector(summarize(tensor).tolist())  # the default sample, as the watcher takes it
    exact = tensor.double()
    assert summary.std == pytest.approx(exact.std().item(), rel=1e-6)
    assert summary.mean == pytest.approx(exact.mean().item(), rel=1e-6)
    assert (summary.min, summary.max) == (exact.min().item(), exact.max().item())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_min_and_max_are_exact_with_one_nan_and_one_sign(sign, path):
    # 100,000 elements: the histogram sample is strided, and must not give the min or the max.
    generator = torch.Generator().manual_seed(4)
    tensor = sign * (torch.rand(100_000, generator=generator) + 0.5001)
    tensor[777] = 0.5 * sign  # the true extreme, off the sample's stride
    tensor[12345] = float("nan")
    summary = Summary.from_vector(summarize(tensor).tolist())
    finite = tensor[torch.isfinite(tensor)].double()
    assert (summary.min, summary.max) == (finite.min().item(), finite.max().item())
    assert (summary.nonfinite, summary.zeros) == (1, 0)
    assert summary.std == pytest.approx(finite.std().item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("nan", [False, True])
def test_16_bit_integer_and_bool_outputs_against_float64_by_hand(dtype, nan):
    generator = torch.Generator().manual_seed(6)
    if dtype.is_floating_point:
        tensor = (torch.randn(50_000, generator=generator) * 3 + 2).to(dtype)
        if nan:
            tensor[::997] = float("nan")
    elif nan:
        pytest.skip("integers have no NaN")
    else:
        high = 2 if dtype == torch.bool else 200
        tensor = torch.randint(0, high, (50_000,), generator=generator).to(dtype)
    summary = Summary.from_vector(summarize(tensor, sample_size=None).tolist())
    values = tensor.double()
    finite = values[torch.isfinite(values)]
    assert (summary.num, summary.nonfinite, summary.zeros) == (50_000, 50_000 - finite.numel(), int((values == 0).sum()))
    assert (summary.min, summary.max) == (finite.min().item(), finite.max().item())
    assert summary.sum == pytest.approx(finite.sum().item(), rel=1e-9)
    assert summary.std == pytest.approx(finite.std().item(), rel=1e-6)
    assert sum(summary.bucket_counts) == pytest.approx(finite.numel())


def test_denormals_are_counted_and_summed():
    tensor = torch.tensor([1e-40, -3e-41, 0.0, 2e-39, float("nan")], dtype=torch.float32)
    assert tensor[0].item() != 0.0  # a float32 denormal, not flushed
    summary = summary_of(tensor, bins=2)
    values = tensor.double()[:4]
    assert (summary.nonfinite, summary.zeros) == (1, 1)
    assert (summary.min, summary.max) == (values.min().item(), values.max().item())
    assert summary.sum == pytest.approx(values.sum().item(), rel=1e-6)
    assert summary.std == pytest.approx(values.std().item(), rel=1e-5)


MEMORY_SCRIPT = """
import resource, sys, torch
torch.set_num_threads(1)
dtype = getattr(torch, sys.argv[1])
tensor = torch.empty(20_000_000, dtype=dtype)
tensor.view(torch.uint8).random_(0, 2) if dtype == torch.bool else tensor.random_(0, 100)
from actviz.summaries.one_tensor import reduce_tensor
reduce_tensor(torch.zeros(10, dtype=dtype))  # imports and first calls, before the peak is read
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
reduction = reduce_tensor(tensor)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / (tensor.numel() * tensor.element_size()))
"""


@pytest.mark.parametrize("dtype, most", [("uint8", 0.75), ("bool", 0.75), ("int32", 0.75), ("float16", 4.5)])
def test_extra_memory_of_an_integer_output_is_at_most_its_size(dtype, most, path):
    # The peak resident memory of a fresh process (ru_maxrss): allocations inside ops count too. Every
    # allocation from 64 KiB on is its own mapping, given back when freed, so the peak is what was live.
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, dtype], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) <= most


def test_a_large_tensor_reduced_in_pieces_gives_the_same_numbers(monkeypatch):
    import actviz.summaries.piecewise

    monkeypatch.setattr(actviz.summaries.piecewise, "PIECE", 1000)  # instead of 4 M elements
    monkeypatch.setattr(actviz.summaries.piecewise, "PIECE_BYTES", 4000)  # instead of 32 MB: eleven pieces
    generator = torch.Generator().manual_seed(8)
    tensor = torch.randn(10_500, generator=generator) * 0.01 + 1000
    tensor[4321] = float("nan")
    summary = Summary.from_vector(summarize(tensor).tolist())
    finite = tensor[torch.isfinite(tensor)].double()
    assert (summary.num, summary.nonfinite, summary.zeros) == (10_500, 1, 0)
    assert summary.mean == pytest.approx(finite.mean().item(), rel=1e-9)
    assert summary.std == pytest.approx(finite.std().item(), rel=1e-6)
    assert (summary.min, summary.max) == (finite.min().item(), finite.max().item())


def test_merge_ranks_reads_a_tensor_reduced_in_pieces(monkeypatch, tmp_path):
    # merge_ranks needs each row on the device: the one-pass op's eager body adds a large tensor's pieces up there.
    import torch.distributed as dist

    import actviz.summaries.piecewise
    from actviz.summaries.merge_ranks import merge_across_ranks

    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    monkeypatch.setattr(actviz.summaries.piecewise, "PIECE", 1000)
    monkeypatch.setattr(actviz.summaries.piecewise, "PIECE_BYTES", 4000)  # four pieces of 1,000 float32
    tensor = torch.randn(3500, generator=torch.Generator().manual_seed(4)) * 2 + 50
    tensor[7] = float("nan")
    in_pieces, whole = reduce_tensor(tensor, None), reduce_tensor(tensor[:999], None)
    assert in_pieces.row_tensor().shape == whole.row_tensor().shape == (6,)  # one header row each, on the device
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        assert merge_across_ranks([("a", in_pieces), ("b", whole)], bins=8)
    finally:
        dist.destroy_process_group()
    for reduction, values in ((in_pieces, tensor), (whole, tensor[:999])):
        summary, finite = finish(reduction, bins=8), values[torch.isfinite(values)].double()
        assert (summary.num, summary.nonfinite, summary.min, summary.max) == (
            values.numel(), values.numel() - finite.numel(), finite.min().item(), finite.max().item())
        assert summary.sum == pytest.approx(finite.sum().item(), rel=1e-6)  # the eager row of 999: float32 moments
        assert summary.std == pytest.approx(finite.std().item(), rel=1e-6)
        assert sum(summary.bucket_counts) == pytest.approx(finite.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_with_zeros_infinities_and_a_piece_of_nan_merge_to_the_whole_tensors_numbers(monkeypatch, dtype):
    import actviz.summaries.piecewise

    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")  # the path CUDA tensors take
    monkeypatch.setattr(actviz.summaries.piecewise, "PIECE", 1000)
    monkeypatch.setattr(actviz.summaries.piecewise, "PIECE_BYTES", 1000 * dtype.itemsize)  # eleven pieces, the last of 500
    generator = torch.Generator().manual_seed(9)
    tensor = (torch.randn(10_500, generator=generator) * 3 + 5).to(dtype)
    tensor[::7] = 0.0
    tensor[2000:3000] = float("nan")  # the third piece has no finite element
    tensor[11], tensor[10_499], tensor[4242] = float("inf"), -float("inf"), float("nan")
    summary = Summary.from_vector(summarize(tensor).tolist())
    exact = tensor.double()
    finite = exact[torch.isfinite(exact)]
    assert (summary.num, summary.nonfinite) == (10_500, 10_500 - finite.numel())
    assert summary.zeros == (finite == 0).sum().item()
    assert (summary.min, summary.max) == (finite.min().item(), finite.max().item())
    assert summary.sum == pytest.approx(finite.sum().item(), rel=1e-12)
    assert summary.sum_squares == pytest.approx((finite * finite).sum().item(), rel=1e-12)
