"""The optional C extension actviz._fused, checked against NumPy on the same arrays."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import actviz.summaries


def test_the_extension_is_built_and_used_here():
    # scripts/install.sh builds it; without a C compiler actviz still works, on its NumPy path
    # (set ACTVIZ_ALLOW_NO_EXTENSION=1 to run the suite on such a machine).
    if os.environ.get("ACTVIZ_ALLOW_NO_EXTENSION"):
        pytest.importorskip("actviz._fused")
    import actviz._fused

    assert actviz.summaries.FUSED == (actviz._fused.VECTORIZED and not os.environ.get("ACTVIZ_PURE_PYTHON"))
    if not actviz._fused.VECTORIZED:
        pytest.skip("this CPU has no AVX2/FMA")


def fused():
    actviz_fused = pytest.importorskip("actviz._fused")

    if not actviz_fused.VECTORIZED:
        pytest.skip("this CPU has no AVX2/FMA")
    return actviz_fused


def summary_vector(array, stride=1, count_zeros=True, bins=4):
    """The C loop's vector for a float32 array, or None when it reports NaN, Inf or overflow."""
    vector = np.empty(actviz.summaries.HEADER_SIZE + bins)
    return vector if fused().summarize(array, stride, count_zeros, vector) else None


# Lengths around the 16-element vector step and the 4,096-element block, so every tail is covered.
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 4095, 4096, 4097, 100_003])
@pytest.mark.parametrize("count_zeros", [True, False])
def test_moments_equal_numpy(numel, count_zeros):
    generator = torch.Generator().manual_seed(numel)
    array = (torch.randn(numel, generator=generator) * 3 + 1).relu().numpy()  # about a third exactly 0
    num, nonfinite, zeros, low, high, total, squares = summary_vector(array, count_zeros=count_zeros)[:7]
    wide = array.astype(np.float64)
    assert (num, nonfinite) == (numel, 0)
    assert total == pytest.approx(wide.sum(), rel=1e-12, abs=1e-9)
    assert squares == pytest.approx((wide * wide).sum(), rel=1e-6)
    assert (low, high) == (array.min(), array.max())
    if count_zeros:
        assert zeros == np.count_nonzero(array == 0)
    else:
        assert math.isnan(zeros)


def test_negative_zero_is_a_zero_and_the_minimum_is_found_in_the_tail():
    array = np.full(4096 + 3, 2.0, dtype=np.float32)
    array[[5, 4096 + 1]] = [-0.0, -7.5]
    _, _, zeros, low, high, total, _ = summary_vector(array)[:7]
    assert (low, high, zeros) == (-7.5, 2.0, 1)
    assert total == 2.0 * (4096 + 1) - 7.5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_is_reported(bad):
    array = np.arange(1000, dtype=np.float32)
    array[500] = bad
    assert summary_vector(array) is None


def test_squares_that_overflow_float32_are_reported():
    # The caller then summarizes in float64 (see test_summaries).
    array = np.full(4096, 3e19, dtype=np.float32)
    array[1::2] = -3e19
    assert summary_vector(array) is None


def test_wrong_buffers_are_refused_by_name():
    module, out = fused(), np.empty(12)
    with pytest.raises(TypeError, match="float32"):
        module.summarize(np.zeros(4), 1, True, out)
    with pytest.raises(ValueError, match="non-empty"):
        module.summarize(np.zeros(0, dtype=np.float32), 1, True, out)
    with pytest.raises(ValueError, match="contiguous"):
        module.summarize(np.zeros(8, dtype=np.float32)[::2], 1, True, out)
    with pytest.raises(TypeError, match="float64"):
        module.summarize(np.ones(4, dtype=np.float32), 1, True, np.zeros(12, dtype=np.float32))
    with pytest.raises(TypeError, match="at least 8 elements"):
        module.summarize(np.ones(4, dtype=np.float32), 1, True, np.empty(7))
    with pytest.raises(ValueError, match="stride"):
        module.summarize(np.ones(4, dtype=np.float32), 0, True, out)


def test_a_strided_tensor_takes_the_numpy_path():
    values = torch.arange(20.0)[::2]  # a 1-D view with stride 2: no C-contiguous buffer
    summary = actviz.summaries.Summary.from_vector(actviz.summaries.summarize(values, bins=2).tolist())
    assert (summary.sum, summary.min, summary.max, summary.zeros) == (90.0, 0.0, 18.0, 1)


def test_pure_python_switch_turns_the_c_loop_off():
    code = "import actviz.summaries as s; print(s.FUSED)"
    environment = {**os.environ, "ACTVIZ_PURE_PYTHON": "1"}
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stdout.strip() == "False"


@pytest.mark.parametrize("count_zeros", [True, False])
@pytest.mark.parametrize(
    "make, stride",
    [
        (lambda g: torch.randn(100_003, generator=g).relu(), 13),  # sampled buckets, scaled up
        (lambda g: torch.randn(5_000, generator=g), 1),
        (lambda g: torch.full((4097,), 2.5), 7),                    # constant: one bucket
        (lambda g: torch.tensor([-1.0, 0.0, 3.0]), 1),              # shorter than one vector
    ],
)
def test_summarize_writes_the_vector_the_numpy_path_writes(make, stride, count_zeros, monkeypatch):
    values = make(torch.Generator().manual_seed(stride))
    vector = np.empty(actviz.summaries.HEADER_SIZE + 16)
    assert fused().summarize(values.numpy(), stride, count_zeros, vector) is True
    monkeypatch.setattr(actviz.summaries, "FUSED", False)
    expected = actviz.summaries._summarize_finite_cpu(values, 16, stride, torch.float64, count_zeros).numpy()
    header = actviz.summaries.HEADER_SIZE
    np.testing.assert_array_equal(vector[:5], expected[:5])  # num, nonfinite, zeros (or NaN), min, max
    np.testing.assert_allclose(vector[5:header], expected[5:header], rtol=1e-6, atol=1e-6)  # sums
    np.testing.assert_array_equal(vector[header:], expected[header:])  # the same buckets, the same scaling
