"""On a CUDA GPU: no host sync on the training thread, the same numbers as on the CPU, the compiled summaries.

Skipped where no GPU is present (CI has none). Run on a GPU machine with ``python scripts/check_gpu.py`` or
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import Run, small_cnn

import actviz
from actviz import Summary
from actviz.summaries import fused
from actviz.summaries.one_tensor import reduce_tensor, summarize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def step(model, inputs, targets=None):
    if targets is None:  # a tensor made from a list is copied from pageable memory: the copy waits for the device
        targets = torch.tensor([0, 1, 2, 0], device=inputs.device)
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()


def test_steps_never_wait_for_the_gpu_on_the_training_thread(tmp_path):
    model = small_cnn().cuda()
    inputs, targets = torch.randn(4, 3, 8, 8, device="cuda"), torch.tensor([0, 1, 2, 0], device="cuda")
    viz = actviz.watch(model, tmp_path, every=3)
    step(model, inputs, targets)  # step 0 logs: first calls, pinned memory, the writer thread
    viz.flush()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(model, inputs, targets)  # steps 1 and 2 log nothing
        step(model, inputs, targets)
        step(model, inputs, targets)  # step 3 logs: its results go to the host without blocking this thread
    finally:
        torch.cuda.set_sync_debug_mode(0)
    viz.close()
    assert Run(tmp_path).histogram_steps("gradients/0") == [0, 3]


def test_values_equal_the_cpus(tmp_path):
    cpu_model = small_cnn()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    inputs = torch.randn(4, 3, 8, 8)
    for model, device, folder in ((cpu_model, "cpu", "cpu"), (gpu_model, "cuda", "gpu")):
        with actviz.watch(model, tmp_path / folder, every=1, options=actviz.Options(histogram_sample_size=None)):
            step(model, inputs.to(device))
    cpu, gpu = Run(tmp_path / "cpu"), Run(tmp_path / "gpu")
    assert cpu.histogram_tags == gpu.histogram_tags and cpu.image_tags == gpu.image_tags
    for tag in cpu.histogram_tags:
        a, b = cpu.histogram(tag, 0), gpu.histogram(tag, 0)
        assert (a.num, a.min, a.max) == pytest.approx((b.num, b.min, b.max), rel=1e-5, abs=1e-6)
        assert a.sum == pytest.approx(b.sum, rel=1e-4, abs=1e-4)
        assert a.sum_squares == pytest.approx(b.sum_squares, rel=1e-4)
    for tag in cpu.image_tags:
        difference = cpu.image(tag, 0).astype(int) - gpu.image(tag, 0).astype(int)
        assert abs(difference).max() <= 1  # GPU convolutions round differently


def test_a_heat_map_of_a_cuda_matrix_is_the_cpus():
    from actviz.pictures.rendering import heatmap

    for matrix in (torch.randn(30, 200), torch.randn(1024, 96)):  # levels on the device; pooled
        on_gpu, on_cpu = heatmap(matrix.cuda()), heatmap(matrix)
        assert on_gpu.is_cuda and on_gpu.shape == on_cpu.shape
        assert (on_gpu.cpu() != on_cpu).any(0).float().mean() < 0.01  # a level off by one where rounding differs


def cuda_calls() -> int:
    """Calls that ran the compiled summary on a CUDA device."""
    functions = fused.compiled_functions().items()
    return sum(function.calls for (_, device, _, _), function in functions if function and device.startswith("cuda"))


def cuda_kernels(function) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        function()
        torch.cuda.synchronize()
    return sum(event.device_type == torch.autograd.DeviceType.CUDA for event in profile.events())


def test_summaries_compiled_on_request_take_fewer_kernels_with_the_eager_numbers(monkeypatch):
    tensor = torch.randn(300_000, device="cuda")
    tensor[::997], tensor[5::1001] = float("nan"), 0.0
    monkeypatch.setenv("ACTVIZ_FUSED", "1")  # off by default, CUDA too (actviz.summaries.fused.use_fused says why)
    before = cuda_calls()
    fused_summary = Summary.from_vector(summarize(tensor).tolist())  # compiles
    assert cuda_calls() == before + 1
    fused_kernels = cuda_kernels(lambda: reduce_tensor(tensor))
    monkeypatch.setenv("ACTVIZ_FUSED", "0")
    eager_summary = Summary.from_vector(summarize(tensor).tolist())
    eager_kernels = cuda_kernels(lambda: reduce_tensor(tensor))
    assert fused_kernels < eager_kernels, (fused_kernels, eager_kernels)
    a, b = fused_summary, eager_summary
    assert (a.num, a.nonfinite, a.zeros, a.min, a.max) == (b.num, b.nonfinite, b.zeros, b.min, b.max)
    assert a.bucket_counts == b.bucket_counts
    exact = tensor.double().nan_to_num(0.0, 0.0, 0.0).cpu()
    assert abs(a.sum - exact.sum().item()) <= 1e-9 * exact.abs().sum().item()  # float64 sums
    assert a.sum_squares == pytest.approx((exact * exact).sum().item(), rel=1e-9)


@pytest.mark.parametrize("outliers", [False, True])
def test_the_one_pass_kernels_match_float64_on_the_gpu(outliers):
    # The Triton body of torch.ops.actviz.summarize on CUDA tensors, each case's numbers against float64 by hand.
    from one_pass_cases import cases, mismatches

    from actviz.summaries import one_pass

    if one_pass.triton_body() is None:
        pytest.skip("Triton is not installed: the op's eager body runs on this GPU")
    problems = []
    for name, values, sizes, strides in cases():
        on_gpu = values.cuda()
        assert one_pass._takes_triton([on_gpu]), name
        problems += mismatches(name, on_gpu, sizes, strides, outliers)
    assert problems == []


def test_the_unit_counts_and_channel_strengths_match_by_hand_on_the_gpu():
    # The Triton body's dead-channel and saturation counts (histogram and atomic adds) and each channel's strength in
    # sample 0 (atomic adds), on CUDA tensors, against counts and float64 by hand.
    from one_pass_cases import strength_cases, strength_mismatches, unit_cases, unit_mismatches

    from actviz.summaries import one_pass

    if one_pass.triton_body() is None:
        pytest.skip("Triton is not installed: the op's eager body runs on this GPU")
    problems = []
    for name, _, flat, units, wanted in unit_cases():
        problems += unit_mismatches(name, flat.cuda(), units, wanted)
    for name, shaped, flat, channels in strength_cases():
        problems += strength_mismatches(name, shaped.cuda(), flat.cuda(), channels)
    assert problems == []


def test_the_logit_rows_kernel_matches_float64_on_the_gpu():
    from one_pass_cases import logit_cases, logit_mismatches

    from actviz.statistics import logit_rows

    problems = []
    for name, logits in logit_cases():
        on_gpu = logits.cuda()
        assert logit_rows._takes_triton(on_gpu) or logit_rows._triton_body() is None, name
        problems += logit_mismatches(name, on_gpu)
    assert problems == []
