"""The compiled summaries (ACTVIZ_FUSED=1), on the CPU: the eager path's numbers, few graphs, a safe fallback.

Compiling takes seconds, so every test shares the process's compiled functions (one per
dtype, made on first use) and the tensors are small.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from conftest import Run
from torch import nn

import actviz
import actviz.summaries.one_tensor
from actviz.summaries import fused
from actviz.summaries.one_pass import header_sums
from actviz.summaries.one_tensor import reduce_tensor, summarize

KEY = ("header_sums", "cpu", torch.float32, False)  # under fused.LARGE elements


@pytest.fixture(autouse=True)
def fused_path(monkeypatch):
    monkeypatch.setenv("ACTVIZ_FUSED", "1")
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")


def calls(dtype: torch.dtype = torch.float32) -> int:
    """Calls that ran compiled code, for CPU tensors of ``dtype`` of either size class."""
    found = [fused.compiled_functions().get(("header_sums", "cpu", dtype, large)) for large in (False, True)]
    return sum(compiled.calls for compiled in found if compiled is not None)


def fused_and_eager(tensor: torch.Tensor, monkeypatch, **kwargs) -> tuple[actviz.Summary, actviz.Summary]:
    """The summary of ``tensor`` on the compiled path (checked to have run) and on the eager torch path."""
    before = calls(tensor.dtype)
    fused_summary = actviz.Summary.from_vector(summarize(tensor, **kwargs).tolist())
    assert calls(tensor.dtype) == before + (tensor.numel() > 0)  # compiled code ran (an empty tensor needs none)
    monkeypatch.setenv("ACTVIZ_FUSED", "0")
    eager_summary = actviz.Summary.from_vector(summarize(tensor, **kwargs).tolist())
    monkeypatch.setenv("ACTVIZ_FUSED", "1")
    return fused_summary, eager_summary


def assert_same(fused_summary: actviz.Summary, eager_summary: actviz.Summary, tensor: torch.Tensor) -> None:
    """Counts, min, max and bucket counts exactly; sums to 1e-6 of the sum of magnitudes."""
    a, b = fused_summary, eager_summary
    assert (a.num, a.nonfinite, a.zeros) == (b.num, b.nonfinite, b.zeros)
    assert a.min == b.min or (math.isnan(a.min) and math.isnan(b.min))
    assert a.max == b.max or (math.isnan(a.max) and math.isnan(b.max))
    finite = tensor.double().nan_to_num(0.0, 0.0, 0.0)
    assert abs(a.sum - b.sum) <= 1e-6 * finite.abs().sum().item()
    assert a.sum_squares == pytest.approx(b.sum_squares, rel=1e-6, abs=0.0)
    assert a.bucket_counts == b.bucket_counts


def random_values(numel: int = 5000) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 3 + 1


CASES = {
    "random": lambda: random_values().view(50, 100),
    "random, strided sample": lambda: random_values(),
    "one element": lambda: torch.tensor([-2.5]),
    "constant": lambda: torch.full((300,), 2.5),
    "zeros": lambda: torch.zeros(40),
    "empty": lambda: torch.empty(0, 3),
    "all NaN": lambda: torch.full((9,), math.nan),
    "±Inf and NaN": lambda: torch.tensor([1.0, math.inf, -2.0, -math.inf, math.nan, 0.0, 4.0]),
    "positive with NaN, no zero": lambda: torch.tensor([2.0, math.nan, 5.0, math.inf, 3.0]),
    "negative with Inf, no zero": lambda: torch.tensor([-2.0, -math.inf, -5.0, -3.0]),
    "a channels-last activation": lambda: random_values(4 * 6 * 5 * 5).view(4, 6, 5, 5).to(
        memory_format=torch.channels_last
    ),
    "a slice with gaps": lambda: random_values().view(50, 100)[:, ::3],
    "expanded (the gradient of a sum)": lambda: torch.tensor(1.5).expand(4, 3),
    "expanded, one element": lambda: torch.tensor(1.5).expand(1, 1),
}


@pytest.mark.parametrize("case", CASES)
def test_fused_float32_equals_eager(case, monkeypatch):
    tensor = CASES[case]()
    sample_size = 1000 if case == "random, strided sample" else None
    assert_same(*fused_and_eager(tensor, monkeypatch, bins=8, sample_size=sample_size), tensor)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool], ids=lambda dtype: str(dtype)[6:]
)
def test_fused_other_dtypes_equal_eager(dtype, monkeypatch):
    values = torch.cat([random_values(997) * 20, torch.tensor([0.0, -7.0, 0.0])])
    if dtype.is_floating_point:
        values = torch.cat([values, torch.tensor([math.nan, math.inf, -math.inf])])
    tensor = values.to(dtype)
    fused_summary, eager_summary = fused_and_eager(tensor, monkeypatch, bins=16)
    assert_same(fused_summary, eager_summary, tensor)
    assert fused_summary.nonfinite == (3 if dtype.is_floating_point else 0)
    assert fused_summary.zeros == int((tensor == 0).sum()) >= 2


def test_float32_squares_past_the_float32_range_are_right_compiled_and_eager(monkeypatch):
    # Both sum in float64: squares past 3.4e38 do not overflow.
    tensor = torch.tensor([3e19, -2e19, 1.0])
    exact = tensor.double()
    fused_summary, eager_summary = fused_and_eager(tensor, monkeypatch)
    assert fused_summary.sum_squares == pytest.approx((exact * exact).sum().item(), rel=1e-12)
    assert eager_summary.sum_squares == pytest.approx((exact * exact).sum().item(), rel=1e-12)
    assert (fused_summary.min, fused_summary.max) == (eager_summary.min, eager_summary.max)
    assert fused_summary.sum == pytest.approx(exact.sum().item(), rel=1e-12)


def test_tensors_past_the_int32_counts_take_the_eager_path(monkeypatch):
    monkeypatch.setattr(actviz.summaries.one_tensor, "_INT32_COUNTS_MAX", 100)  # instead of 2**31 elements: 8 GB of float32
    before = calls()
    assert not compiled(reduce_tensor(torch.randn(100))) and compiled(reduce_tensor(torch.randn(99)))
    assert calls() == before + 1


def compiled(reduction) -> bool:
    """Whether a reduction's header came from the compiled function: a row of its own, the sample apart."""
    return reduction.header is not reduction.sample


def test_a_watched_step_batches_its_small_tensors_and_compiles_only_the_large_ones(tmp_path):
    model = staircase(3, wide=True)  # outputs 9, 10, 40,000 and 1 elements: one larger than the sample (16,384)
    before = calls()
    with actviz.watch(model, tmp_path, every=1, layers=nn.Linear) as viz:
        model(torch.randn(1, 8)).sum().backward()
        viz.flush()
    assert calls() - before == 2  # the wide layer's output and its gradient; the small ones batched
    assert Run(tmp_path).histogram_steps("activations/0") == [0]


def test_header_sums_by_hand():
    # NaN and -Inf count as non-zero and become 0: non-zero 4, then 2; z = [3, 0, 0, -1, 0]:
    # mean 2/5, variance 10/5 - (2/5)^2; min and max of the finite values -1 and 3.
    values = torch.tensor([3.0, math.nan, 0.0, -1.0, -math.inf])
    assert header_sums(values).tolist() == pytest.approx([4.0, 2.0, 0.4, 1.84, -1.0, 3.0], rel=1e-12)
    compiled = fused.run(header_sums, values)
    assert compiled is not None and compiled.tolist() == pytest.approx([4.0, 2.0, 0.4, 1.84, -1.0, 3.0], rel=1e-12)


def staircase(layers: int = 32, wide: bool = False) -> nn.Module:
    """Linear layers of widths 9, 10, ... (and 40,000 if ``wide``), then 1: every output a different length."""
    widths = list(range(8, 8 + layers)) + [40_000] * wide + [1]
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def test_graphs_stay_bounded_over_many_layer_shapes(monkeypatch):
    # Counted from a fresh start: earlier tests of the session compile under other settings (AMP, other paths).
    monkeypatch.setattr(fused, "_compiled", {})
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = staircase(wide=True)  # 33 layers
    before = calls()
    # A sample of 8: outputs of 9 elements or more are larger than it and compiled; the last layer's (1 and 3
    # elements) are batched with the step's small tensors (actviz/summaries/small_tensors.py), never compiled.
    with tempfile.TemporaryDirectory() as folder, torch._dynamo.config.patch(recompile_limit=1):  # no recompile
        with actviz.watch(model, folder, every=1, layers=nn.Linear, options=actviz.Options(histogram_sample_size=8)):
            for batch in (1, 3):  # output lengths 9..39, 40,000 and 1, then 27..117, 120,000 and 3
                model(torch.randn(batch, 8)).sum().backward()
        run = Run(folder)
    assert len(run.histogram_tags) == 6 * 33  # activations, gradients, and weight and bias, values and gradients
    assert calls() - before == 2 * 2 * 32  # every activation and output gradient larger than its sample
    graphs: dict[tuple[str, torch.dtype], int] = {}
    for (_, device, dtype, _), function in fused.compiled_functions().items():
        assert function is not None, (device, dtype)  # none failed to compile
        graphs[device, dtype] = graphs.get((device, dtype), 0) + function.graphs
    assert graphs[("cpu", torch.float32)] == 2  # one per size class
    assert max(graphs.values()) <= 2, graphs


def test_a_failed_compile_warns_once_and_falls_back(monkeypatch):
    def broken_backend():
        def backend(graph, example_inputs):
            raise RuntimeError("no C++ compiler here (forced)")

        return backend

    monkeypatch.setattr(fused, "inductor_backend", broken_backend)
    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(fused, "_warned", set())
    tensor = random_values()
    with pytest.warns(RuntimeWarning, match="no C.. compiler here") as warned:
        first = summarize(tensor)
        second = summarize(tensor.double())
    assert len([w for w in warned if "compiling" in str(w.message)]) == 1
    assert fused.compiled_functions() == {KEY: None, ("header_sums", "cpu", torch.float64, False): None}
    monkeypatch.setenv("ACTVIZ_FUSED", "0")
    assert torch.equal(first, summarize(tensor)) and torch.equal(second, summarize(tensor.double()))


def test_training_goes_on_after_a_failed_compile(monkeypatch, tmp_path):
    monkeypatch.setattr(fused, "inductor_backend", lambda: None)  # calling it raises
    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(fused, "_warned", set())
    model = staircase(3)
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        with actviz.watch(model, tmp_path, every=1, options=actviz.Options(histogram_sample_size=4)) as viz:  # outputs larger: compiled
            model(torch.randn(2, 8)).sum().backward()
            viz.flush()
    assert Run(tmp_path).histogram_steps("activations/0") == [0]


def test_nothing_is_compiled_before_the_first_logging_step(monkeypatch, tmp_path):
    monkeypatch.setattr(fused, "_compiled", {})
    model = staircase(3)
    with actviz.watch(model, tmp_path, every=[2], options=actviz.Options(histogram_sample_size=4)):  # outputs larger than it: compiled
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
        assert fused.compiled_functions() == {}
        model(torch.randn(2, 8)).sum().backward()
        assert fused.compiled_functions()[KEY].calls > 0


def test_the_summary_stays_compiled_in_a_compiled_model_and_under_force_eager():
    model = staircase(3)
    forms = []

    def hook(module, inputs, output):
        forms.append("sums" if compiled(reduce_tensor(output)) else "eager")

    model[1].register_forward_hook(hook)
    compiled_model = torch.compile(model, backend="eager")  # Dynamo traces the hook
    before = calls()
    compiled_model(torch.randn(2, 8))
    assert calls() == before + 1 and forms == ["sums"]
    assert not [name for name in vars(fused) if name.startswith("__compiled_fn")]  # no graph traced from fused.py
    with torch.compiler.set_stance("force_eager"):
        compiled_model(torch.randn(2, 8))
        summarize(torch.randn(5))
    assert calls() == before + 3
    disabled_hook_model = staircase(3)
    disabled_hook_model[1].register_forward_hook(torch.compiler.disable(hook))
    torch.compile(disabled_hook_model, backend="eager")(torch.randn(2, 8))
    assert calls() == before + 4 and forms == ["sums"] * 3


def test_default_is_eager_on_every_device_and_only_the_switch_compiles(monkeypatch):
    monkeypatch.delenv("ACTVIZ_FUSED")
    assert not fused.use_fused()  # CUDA too: an H200 measured the compiled path ten times slower (use_fused)
    monkeypatch.setenv("ACTVIZ_FUSED", "0")
    assert not fused.use_fused()
    monkeypatch.setenv("ACTVIZ_FUSED", "1")
    assert fused.use_fused()
    before = sum(f.calls for f in fused.compiled_functions().values() if f)
    monkeypatch.delenv("ACTVIZ_FUSED")
    actviz.summaries.one_tensor.reduce_tensor(torch.randn(100_000))  # sampled: the path the compiled summaries used to take by default
    assert sum(f.calls for f in fused.compiled_functions().values() if f) == before


TRAIN_A_TRANSFORMER = """
import tempfile, warnings
import torch
from torch import nn
import actviz

torch.manual_seed(0)
model = nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0), 2), nn.Linear(32, 100))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with actviz.watch(model, tempfile.mkdtemp(), every=1) as viz:
        for step in range(6):
            optimizer.zero_grad()
            model(torch.randn(35, 8, 32)).square().mean().backward()
            optimizer.step()
        viz.flush()
        print("logged", viz.latest.step)
print("\\n".join(str(w.message) for w in caught if "compil" in str(w.message)))
"""


@pytest.mark.slow
def test_a_transformer_trained_with_the_compiled_path_never_raises(tmp_path):
    # A time-first Transformer with attention statistics, ACTVIZ_FUSED=1, in fresh processes. The writer thread
    # compiled its small summaries, which set torch's process-wide compiling flag; the optimizer hook, seeing it
    # in eager code, recursed until RecursionError (3 runs of 3 on a 2-core CPU, 2026-11-29), and a compile at
    # exit warned "can't register atexit after shutdown". Two runs here, each with a hard timeout.
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, ACTVIZ_FUSED="1", ACTVIZ_CPU_SHORTCUTS="0", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", TRAIN_A_TRANSFORMER], env=env, capture_output=True, text=True,
                              timeout=400, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "logged 5" in done.stdout
        assert "RecursionError" not in done.stderr and "atexit" not in done.stdout + done.stderr
        assert "failed" not in done.stdout, done.stdout  # no compile warned about
