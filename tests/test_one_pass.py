"""The one-pass op, ``torch.ops.actviz.summarize``: its numbers against float64, in both of its bodies, and what a
logging step then reads: each watched tensor once.

The Triton body runs on CPU tensors under ``TRITON_INTERPRET=1``, which Triton reads when its kernels are
defined: those tests run in a fresh process, with a hard timeout.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from one_pass_cases import (GROUPS, cases, logit_cases, logit_mismatches, mismatches, strength_cases, strength_mismatches, unit_cases,
                            unit_mismatches)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import actviz
from actviz.summaries import one_pass

TESTS = Path(__file__).parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("case", cases(), ids=lambda case: case[0])
def test_the_eager_body_matches_float64(case, outliers):
    name, values, sizes, strides = case
    assert not one_pass._takes_triton([values]) or os.environ.get("TRITON_INTERPRET") == "1"
    assert mismatches(name, values, sizes, strides, outliers) == []


@pytest.mark.parametrize("case", unit_cases(), ids=lambda case: case[0])
def test_the_unit_fractions_of_the_eager_body_match_counts_by_hand(case):
    name, _, flat, units, wanted = case
    assert unit_mismatches(name, flat, units, wanted) == []


@pytest.mark.parametrize("case", strength_cases(), ids=lambda case: case[0])
def test_the_channel_strengths_of_the_eager_body_match_float64(case):
    assert strength_mismatches(*case) == []


@pytest.mark.parametrize("case", logit_cases(), ids=lambda case: case[0])
def test_the_logit_rows_eager_body_matches_float64(case):
    assert logit_mismatches(*case) == []


@needs_triton
def test_the_kernels_channel_quotients_match_integer_division_below_2_31():
    # The kernels divide 32-bit offsets by a channel's length with a multiply-high by a magic number: exact for every
    # numerator below 2**31, for divisors from 1 to 2**30 (every one to 5,000, each side of each power of two).
    import random

    from actviz.summaries.one_pass_tables import divider

    randoms = random.Random(0)
    divisors = list(range(1, 5000)) + [2**k + j for k in range(12, 31) for j in (-1, 0, 1)]
    divisors += [randoms.randrange(1, 2**30) for _ in range(300)]
    wrong = []
    for divisor in divisors:
        magic, shift = divider(divisor)
        assert -(2**31) <= magic < 2**31  # handed to the kernel as an int32: one variant for every divisor
        for n in {0, 1, divisor - 1, divisor, divisor + 1, 2**31 - 1, 2**31 - divisor, randoms.randrange(2**31)}:
            if 0 <= n < 2**31 and ((2 * n * (magic % 2**32)) >> 32) >> shift != n // divisor:
                wrong.append((divisor, n))
    assert wrong == []


@needs_triton
def test_the_tile_table_of_a_tensor_past_2_31_elements_holds_int64_places():
    # The host works out each tile's int64 numbers (the kernels then need no 64-bit division): for a tensor of
    # 2**31 + 5 elements in rows of 3,136 and 256 channels, sampled every 2**20 + 7, the last tile (from element
    # 2**31) against Python's integers.
    from actviz.summaries.one_pass_tables import TILE, tables_for

    size, stride = 2**31 + 5, 2**20 + 7
    segments, tiles, total = tables_for((size,), (stride,), 6, torch.device("cpu"), (3136, 256))
    rows = tiles.view(-1, 5)
    start = (rows.shape[0] - 1) * TILE
    taken = -(-start // stride)
    assert start == 2**31 and segments.tolist() == [size, stride, 6, 0, rows.shape[0]]
    assert rows[-1].tolist() == [0, taken * stride - start, taken, start % 3136, start // 3136 % 256]
    assert total == 6 + -(-size // stride)


def test_a_cuda_graph_capture_that_would_copy_tables_takes_the_eager_body(monkeypatch):
    # While a CUDA graph is captured, tables the kernels have not got on the device yet would be copied from a host
    # buffer that the graph keeps the address of: the op takes its eager body instead, with the same numbers.
    pytest.importorskip("triton")
    from actviz.summaries import one_pass_tables

    monkeypatch.setattr(one_pass_tables, "_capturing", lambda device: True)
    with pytest.raises(one_pass_tables.CaptureNeedsTables):
        one_pass_tables._on_device(torch.zeros(3), torch.device("cuda"))

    def capturing(*args):
        raise one_pass_tables.CaptureNeedsTables("capturing")

    values = torch.randn(500, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(one_pass, "_takes_triton", lambda *args: True)
    monkeypatch.setattr(one_pass, "triton_body", lambda: capturing)
    found = one_pass.summarize([values], [7], True)
    assert torch.equal(found, one_pass.eager_summarize([values], [7], True))


def run_fresh(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = {**os.environ, "TRITON_INTERPRET": "1", "ACTVIZ_CPU_SHORTCUTS": "0",
                   "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=timeout, cwd=TESTS)


@needs_triton
@pytest.mark.parametrize("group", GROUPS)  # one process each, so that the suite's workers share them out
def test_the_triton_kernels_match_float64_under_the_interpreter(group):
    # NaN, ±Inf, zeros, denormals, a 1e8 offset, bfloat16, float16 near its max, one element, several tensors of
    # several tiles, outliers; logits with masked classes, large logits, bfloat16; the script exits 2 if a Triton
    # body was not the one that ran.
    done = run_fresh(f"import sys, one_pass_cases; sys.exit(one_pass_cases.main(({group!r},)))")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "all match"


@needs_triton
def test_a_watched_step_logs_the_same_numbers_through_the_triton_kernels():
    # The same step of the same model, through the Triton body and through the eager one: every summary and every
    # outlier number alike, and the Triton body ran for every layer output, gradient and parameter group.
    code = textwrap.dedent("""
        import os, tempfile, torch, actviz
        from actviz.summaries import one_pass
        from actviz.summaries.one_pass_triton import summarize_tensors
        calls = []
        def counted(tensors, *args):
            calls.append(len(tensors))
            return summarize_tensors(tensors, *args)
        one_pass.triton_body.cache_clear()
        def step(triton):
            os.environ["TRITON_INTERPRET"] = "1" if triton else "0"
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                                        torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10))
            with torch.no_grad():
                model[0].bias[:2] = -100.0  # two dead channels
            inputs = torch.randn(4, 3, 16, 16) * 3
            viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, layers="all",
                               statistics=["outliers", "dead_channels", "saturation"],
                               options=actviz.Options(histogram_sample_size=256))
            torch.nn.functional.cross_entropy(model(inputs), torch.tensor([1, 2, 3, 4])).backward()
            viz.flush(); viz.close()
            return viz.latest
        import functools
        one_pass.triton_body = functools.cache(lambda: counted)
        eager, triton = step(False), step(True)
        # The convolutions', the ReLU's, the Tanh's and the Flatten's outputs and their gradients (the Linear's is
        # small: batched), the parameters and their gradients each in one call.
        assert sorted(calls) == [1] * 10 + [2, 2], calls
        for kind in ("activations", "gradients", "weights", "weight_grads"):
            a, b = getattr(eager, kind), getattr(triton, kind)
            assert sorted(a) == sorted(b) and a, (kind, sorted(a), sorted(b))
            for tag in a:
                x, y = a[tag], b[tag]
                assert (x.num, x.nonfinite, x.zeros, x.min, x.max, x.bucket_counts) == (
                    y.num, y.nonfinite, y.zeros, y.min, y.max, y.bucket_counts), (kind, tag, x, y)
                for field in ("sum", "sum_squares"):
                    u, v = getattr(x, field), getattr(y, field)
                    assert abs(u - v) <= 1e-9 * max(1.0, abs(u)), (kind, tag, field, u, v)
        outliers_a, outliers_b = eager.layer_values["outliers"], triton.layer_values["outliers"]
        assert sorted(outliers_a) == sorted(outliers_b) == ["0", "1", "2", "3", "4", "5"], sorted(outliers_a)
        assert eager.layer_values["dead_channels"]["1"]["dead_channel_fraction"] == 0.25
        for statistic in ("outliers", "dead_channels", "saturation"):
            for layer, numbers in eager.layer_values[statistic].items():
                for name, value in numbers.items():
                    other = triton.layer_values[statistic][layer][name]
                    assert abs(value - other) <= 1e-6 * max(1.0, abs(value)), (statistic, layer, name, value, other)
        print("alike", len(calls))
    """)
    done = run_fresh(code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("alike")


def test_dead_channels_and_saturation_come_from_the_summary_row(monkeypatch):
    # On the accelerator path a large ReLU or Tanh output's unit fraction is counted by the summary's one op: no
    # amax, eq or mean of its own; the numbers are those counted by hand from the outputs.
    from conftest import CountOps

    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(),
                          nn.Flatten(), nn.Linear(8 * 16 * 16, 4))
    with torch.no_grad():
        model[0].bias[:3] = -100.0  # three channels dead
        model[2].weight.mul_(20.0)  # a saturated Tanh
    inputs, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    seen = {}
    handles = [model[i].register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, out.detach().clone()))
               for i in (1, 3)]
    viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, layers="all",
        options=actviz.Options(histogram_sample_size=256))
    with CountOps() as count:
        nn.functional.cross_entropy(model(inputs), labels).backward()
        viz.flush()
    viz.close()
    for handle in handles:
        handle.remove()
    assert not {"aten.amax.default", "aten.eq.Scalar", "aten.gt.Scalar"} & set(count.kernels), count.kernels
    values = viz.latest.layer_values
    relu, tanh = seen[1], seen[3]
    assert values["dead_channels"]["1"]["dead_channel_fraction"] == pytest.approx(
        float((relu.amax(dim=(0, 2, 3)) == 0).double().mean()))
    assert values["dead_channels"]["1"]["dead_channel_fraction"] == pytest.approx(3 / 8)
    wanted = float((tanh.double().abs() > 0.97).double().mean())
    assert wanted > 0.1 and values["saturation"]["3"]["saturated_fraction"] == pytest.approx(wanted)


def test_the_op_has_a_fake_body_for_compiled_and_meta_callers():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.actviz.summarize.default([torch.empty(10), torch.empty(990)], [1, 7], True)
    assert out.shape == (2 * 10 + 10 + 142,) and out.dtype == torch.float64


class BytesMeter(TorchDispatchMode):
    """Ops dispatched while a frame of actviz is on the stack, and the bytes of their tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.package = os.path.join(os.path.dirname(actviz.__file__), "")
        self.ops: list[str] = []
        self.moved = 0

    def _from_actviz(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.package):
                return frame.f_code.co_name != "__torch_function__"
            frame = frame.f_back
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or "empty" in str(func) or not self._from_actviz():
            return out
        self.ops.append(str(func))
        tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0] if isinstance(t, torch.Tensor)]
        self.moved += sum(t.numel() * t.element_size() for t in tensors)
        return out


def test_a_logging_step_reads_each_watched_tensor_once(monkeypatch):
    # Large outputs (about 1.6 M elements each) on the accelerator path: the bytes actviz moves are the watched
    # bytes once, plus the rows, samples and the one copy to the host; a few ops per watched tensor. The ReLUs are
    # not watched by default, and the dead-channel count reads each of their outputs once too.
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    inputs, labels = torch.randn(8, 3, 80, 80), torch.randint(0, 10, (8,))
    viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        viz.flush()

    step()
    outputs, relus = {}, {}
    handles = [module.register_forward_hook(lambda m, a, out, name=name: outputs.setdefault(name, out))
               for name, module in viz._layers]
    handles += [module.register_forward_hook(lambda m, a, out, name=name: relus.setdefault(name, out))
                for name, module in model.named_children() if isinstance(module, nn.ReLU)]
    with BytesMeter() as meter:
        step()
    for handle in handles:
        handle.remove()
    viz.close()
    output_bytes = sum(out.numel() * out.element_size() for out in outputs.values())
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    relu_bytes = sum(out.numel() * out.element_size() for out in relus.values())
    assert len(relus) == 2 and not set(relus) & set(outputs)
    # Each output and its gradient, each parameter and its gradient; each unwatched ReLU's output.
    watched = 2 * output_bytes + 2 * parameter_bytes + relu_bytes
    watched_tensors = 2 * len(outputs) + 2 * len(list(model.parameters()))
    assert meter.moved <= 1.15 * watched, (meter.moved / watched, meter.ops)
    assert len(meter.ops) <= 2 * watched_tensors, meter.ops
    assert meter.ops.count("actviz.summarize.default") == 4  # the two large outputs and their gradients


class ShapeMeter(TorchDispatchMode):
    """Every op dispatched, with the shapes of its tensor inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [tuple(t.shape) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        self.calls.append((str(func), inputs))
        return func(*args, **(kwargs or {}))


def test_a_feature_map_grid_picks_its_channels_from_the_summary_read(monkeypatch, tmp_path, read_run):
    # A conv output of 96 channels, more than the 64 a grid draws: on the accelerator path the summary's one read
    # gives each channel's strength, so the only op that reads sample 0 for the picture is the copy of the chosen
    # channels; and the grid is the one feature_map_grid draws from sample 0 by hand.
    from actviz.pictures.rendering import feature_map_grid

    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 96, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(96, 4))
    inputs = torch.randn(4, 3, 40, 40)
    outputs = []
    model[0].register_forward_hook(lambda module, args, out: outputs.append(out.detach().clone()))
    with actviz.watch(model, tmp_path, every=1, image_every=1) as viz:
        with ShapeMeter() as meter:
            model(inputs).sum().backward()
            viz.flush()
    sample_reads = [name for name, shapes in meter.calls if (96, 40, 40) in shapes]
    assert sample_reads == ["aten.index_select.default"], sample_reads
    expected = feature_map_grid(outputs[0][0]).squeeze(0).numpy()
    drawn = read_run(tmp_path).image("feature_maps/0", 0)
    assert np.array_equal(drawn if drawn.ndim == 2 else drawn[..., 0], expected)
