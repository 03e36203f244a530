"""On a CUDA GPU: no host sync on the training thread, and the same numbers as on the CPU.

Skipped where no GPU is present (CI has none). Run on a GPU machine with
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import Run, small_cnn

import actviz

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def step(model, inputs):
    torch.nn.functional.cross_entropy(model(inputs), torch.tensor([0, 1, 2, 0], device=inputs.device)).backward()


def test_steps_never_wait_for_the_gpu_on_the_training_thread(tmp_path):
    model = small_cnn().cuda()
    inputs = torch.randn(4, 3, 8, 8, device="cuda")
    viz = actviz.watch(model, tmp_path, every=3)
    step(model, inputs)  # step 0 logs: first calls, pinned memory, the writer thread
    viz.flush()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(model, inputs)  # steps 1 and 2 log nothing
        step(model, inputs)
        step(model, inputs)  # step 3 logs: its results go to the host without blocking this thread
    finally:
        torch.cuda.set_sync_debug_mode(0)
    viz.close()
    assert Run(tmp_path).histogram_steps("gradients/0") == [0, 3]


def test_values_equal_the_cpus(tmp_path):
    cpu_model = small_cnn()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    inputs = torch.randn(4, 3, 8, 8)
    for model, device, folder in ((cpu_model, "cpu", "cpu"), (gpu_model, "cuda", "gpu")):
        with actviz.watch(model, tmp_path / folder, every=1, histogram_sample_size=None):
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
