"""watch(gradient_noise=True): B_simple from per-example gradient norms, checked against torch.func.

The reference takes every example's whole gradient with ``torch.func.vmap(grad(...))`` on the same parameters
and batch, and applies McCandlish et al.'s estimators to it; actviz takes only norms, in its hooks.
"""

from __future__ import annotations

import copy
import tempfile
from collections import Counter

import pytest
import torch
from conftest import NO_HOOKS, CountOps, hooks_left
from torch import nn
from torch.func import functional_call, grad, vmap

import actviz
from actviz.statistics import gradient_noise
from actviz.statistics.gradient_noise import noise_scale, squared_norms
from actviz.tags import GRADIENT_NOISE

SIMPLE, GRAD_SQUARED, TRACE_SIGMA = GRADIENT_NOISE


def per_example_gradients(model: nn.Module, loss_of, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(B, parameters)``: each example's gradient of ``loss_of(model(x_b), y_b)`` over the trainable parameters."""
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}

    def loss(values, xb, yb):
        return loss_of(functional_call(model, values, (xb[None],)), yb[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(x.shape[0], -1) for g in grads.values()], dim=1).double()


def reference(per_example: torch.Tensor) -> dict[str, float]:
    """McCandlish et al.'s estimators with B_small = 1 and B_big = B, from the whole per-example gradients."""
    size = per_example.shape[0]
    one = per_example.square().sum(1).mean()
    batch = per_example.mean(0).square().sum()
    grad_squared = (size * batch - one) / (size - 1)
    trace_sigma = (one - batch) / (1 - 1 / size)
    return {SIMPLE: float(trace_sigma / grad_squared), GRAD_SQUARED: float(grad_squared), TRACE_SIGMA: float(trace_sigma)}


def contributions(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``(B, parameters)``: example b's share of the layer's parameter gradient, ``∂(layer(x_b)·g_b)/∂θ``."""
    return per_example_gradients(layer, lambda out, gb: (out * gb).sum(), x.double(), g.double())


def _frozen_weight() -> nn.Linear:
    layer = nn.Linear(5, 3)
    layer.weight.requires_grad_(False)  # the bias alone trains
    return layer


LAYERS = {  # (layer, input shape): the Gram path where (B-1)·T·(in + out) <= in·out, the split path elsewhere
    "linear": (lambda: nn.Linear(5, 3), (6, 5)),
    "linear, whole-batch Gram": (lambda: nn.Linear(40, 48), (6, 40)),
    "linear, sequence": (lambda: nn.Linear(5, 3), (6, 4, 5)),
    "linear, sequence, whole-batch Gram": (lambda: nn.Linear(64, 64), (3, 2, 2, 64)),
    "linear, no bias": (lambda: nn.Linear(5, 3, bias=False), (6, 4, 5)),
    "linear, frozen weight": (_frozen_weight, (6, 4, 5)),
    "layer norm": (lambda: nn.LayerNorm(5), (6, 4, 5)),
    "layer norm over two dims, no bias": (lambda: nn.LayerNorm((2, 5), bias=False), (6, 3, 2, 5)),
    "rms norm": (lambda: nn.RMSNorm(5), (6, 5)),
}


@pytest.mark.parametrize("case", list(LAYERS))
def test_squared_norms_are_those_of_each_examples_gradient_share(case):
    torch.manual_seed(0)
    make, shape = LAYERS[case]
    layer = make().double()
    x = torch.randn(shape, dtype=torch.double)
    g = torch.randn(layer(x).shape, dtype=torch.double)
    per_example, batch = squared_norms(layer, x if layer.weight.requires_grad else None, g)
    shares = contributions(layer, x, g)
    torch.testing.assert_close(per_example, shares.square().sum(1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(batch, shares.sum(0).square().sum(), rtol=1e-10, atol=1e-10)


def test_noise_scale_by_hand():
    # Two examples with gradient shares 1 and 3 (mean loss: gradients 2 and 6): |G_1|² = 20, |G_B|² = 16;
    # tr(Σ) is their unbiased variance 8, and |G|² = |G_B|² - tr(Σ) / B = 12.
    values = noise_scale([1.0, 9.0], 16.0)
    assert values == {SIMPLE: 8.0 / 12.0, GRAD_SQUARED: 12.0, TRACE_SIGMA: 8.0}
    assert noise_scale([4.0, 36.0], 64.0, loss_scale=2.0) == values  # AMP: the shares carry the loss scale
    assert SIMPLE not in noise_scale([1.0, 1.0], 2.0)  # orthogonal shares: |G|² estimated at 0, no ratio


def regression(noise: float, size: int = 32, features: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """y = X w + noise·ε, batches of ``size``: X normal, w fixed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, size, features, generator=generator)
    w = torch.randn(features, 1, generator=generator)
    return x, x @ w + noise * torch.randn(4, size, 1, generator=generator)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[int, dict[str, float]], dict[int, dict]]:
    """SGD on the batches, watched with gradient_noise=True; the values written and the torch.func reference."""
    loss_of = nn.functional.mse_loss
    unwatched = copy.deepcopy(model)  # the reference's copy: a watched model's forward would count as a step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    expected, written = {}, {}
    with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False,
        on_step=lambda results: written.__setitem__(results.step, {
                          tag: value for tag, value in results.scalars.items() if tag in GRADIENT_NOISE}),
        statistics=["default", "gradient_noise"]) as viz:
        for step, (xb, yb) in enumerate(zip(x, y)):
            unwatched.load_state_dict(model.state_dict())
            expected[step] = reference(per_example_gradients(unwatched, loss_of, xb, yb))
            optimizer.zero_grad()
            loss_of(model(xb), yb).backward()
            optimizer.step()
        viz.flush()
    return written, expected


def mlp(features: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 1))


def test_b_simple_of_a_regression_is_the_torch_func_estimate(tmp_path, read_run):
    x, y = regression(noise=0.5)
    model = mlp()
    written, expected = train(model, x, y)
    assert sorted(written) == sorted(expected) == [0, 1, 2, 3]
    for step in expected:  # float32 against float64: 2e-7 apart
        for tag in GRADIENT_NOISE:
            assert written[step][tag] == pytest.approx(expected[step][tag], rel=1e-5), (step, tag)
    # What the event file holds is what on_step got (float32 in TensorBoard).
    with actviz.watch(model, tmp_path, every=1, image_every=False, statistics=["default", "gradient_noise"]) as viz:
        nn.functional.mse_loss(model(x[0]), y[0]).backward()
        viz.flush()
        latest = viz.latest.scalars
    run = read_run(tmp_path)
    assert set(GRADIENT_NOISE) <= run.scalar_tags
    for tag in GRADIENT_NOISE:
        assert run.scalar(tag, 0) == pytest.approx(latest[tag], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_sequence_dimension_sums_each_examples_positions(dtype):
    # (B, T, features): example b's loss is its T positions' mean, its gradient share the sum over them.
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 6, 8, generator=generator)
    y = x.sum(-1, keepdim=True) + 0.3 * torch.randn(2, 16, 6, 1, generator=generator)
    written, expected = train(mlp().to(dtype), x.to(dtype), y.to(dtype))
    for step in expected:
        for tag in GRADIENT_NOISE:
            assert written[step][tag] == pytest.approx(expected[step][tag], rel=1e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over attention, on the CPU
def test_a_transformer_layer_counts_its_linear_and_norm_calls():
    # MultiheadAttention uses its projections' weights without calling them: its out_proj is watched, never called.
    # The reference takes the per-example gradients of the counted parameters alone.
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    x, y = torch.randn(8, 5, 16), torch.randn(8, 5, 16)
    unwatched = copy.deepcopy(model)
    for name, parameter in unwatched.named_parameters():
        parameter.requires_grad_(name.split(".")[0] in ("linear1", "linear2", "norm1", "norm2"))
    expected = reference(per_example_gradients(unwatched, nn.functional.mse_loss, x, y))
    with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False,
        statistics=["default", "gradient_noise"]) as viz:
        nn.functional.mse_loss(model(x), y).backward()
        viz.flush()
    assert {tag: viz.latest.scalars[tag] for tag in GRADIENT_NOISE} == pytest.approx(expected, rel=1e-5)


class Twice(nn.Module):
    """One Linear called twice (tied weights), or, untied, two copies of it."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 6)
        self.second = self.first if tied else copy.deepcopy(self.first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_a_layer_called_twice_counts_its_first_call():
    x, y = torch.randn(16, 6), torch.randn(16, 6)
    untied = Twice(tied=False)
    untied.second.requires_grad_(False)  # the reference: the first call's share alone
    expected = reference(per_example_gradients(untied, nn.functional.mse_loss, x, y))
    model = Twice()
    with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False,
        statistics=["default", "gradient_noise"]) as viz:
        nn.functional.mse_loss(model(x), y).backward()
        viz.flush()
    assert {tag: viz.latest.scalars[tag] for tag in GRADIENT_NOISE} == pytest.approx(expected, rel=1e-5)


def test_the_loss_scale_is_taken_out():
    x, y = regression(noise=0.5)
    found = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=1024.0)):
        model = mlp()
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False,
            statistics=["default", "gradient_noise"], options=actviz.Options(grad_scaler=scaler)) as viz:
            loss = nn.functional.mse_loss(model(x[0]), y[0])
            (loss if scaler is None else scaler.scale(loss)).backward()
            viz.flush()
            found.append({tag: viz.latest.scalars[tag] for tag in GRADIENT_NOISE})
    assert found[1] == pytest.approx(found[0], rel=1e-5)


def test_a_noisier_dataset_has_a_much_larger_noise_scale():
    # Linear regression from a random start: the examples' gradients 2·r_b·x_b scatter with the residuals r_b,
    # whose noise part has variance σ². σ = 10 against 0.1 gives about ten times B_simple (about 10 to 100 here).
    found, each = {}, {}
    for noise in (0.1, 10.0):
        x, y = regression(noise, size=512)
        written, _ = train(nn.Linear(8, 1), x, y)
        trace = sum(values[TRACE_SIGMA] for values in written.values())
        squared = sum(values[GRAD_SQUARED] for values in written.values())
        found[noise] = trace / squared  # averaged before the ratio, as McCandlish et al. advise
        each[noise] = [values[SIMPLE] for values in written.values()]
    assert found[10.0] > 5 * found[0.1] > 0
    assert min(each[10.0]) > max(each[0.1]) > 0


def test_off_by_default_and_a_bad_value_names_the_argument(tmp_path, read_run, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("gradient noise code ran with gradient_noise=False")

    monkeypatch.setattr("actviz.capture.step_capture.GradientNoise", never)
    monkeypatch.setattr(gradient_noise, "squared_norms", never)
    model = mlp()
    with actviz.watch(model, tmp_path / "run", every=1, options=actviz.Options(strict=True)):
        model(torch.randn(4, 8)).square().mean().backward()
    assert not {tag for tag in read_run(tmp_path / "run").scalar_tags if tag.startswith("gradient_noise/")}
    with pytest.raises(TypeError, match=r"^watch\(\) no longer takes gradient_noise=; pass statistics=\['default', 'gra"):
        actviz.watch(model, tmp_path / "bad", gradient_noise=True)
    assert hooks_left(model) == NO_HOOKS and not (tmp_path / "bad").exists()


def test_a_failure_warns_once_and_turns_the_option_off(monkeypatch, tmp_path):
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("no norms")

    monkeypatch.setattr(gradient_noise, "squared_norms", broken)
    model = mlp()
    with pytest.warns(RuntimeWarning, match=r"'\(gradient_noise\)'.*RuntimeError: no norms") as caught:
        with actviz.watch(model, tmp_path, every=1, image_every=False, statistics=["default", "gradient_noise"]) as viz:
            for _ in range(3):
                model(torch.randn(4, 8)).square().mean().backward()
                viz.flush()
    assert len([w for w in caught if "gradient_noise" in str(w.message)]) == 1
    assert len(calls) == 1  # the step took no more layers, and the later steps no input
    assert sorted(viz.latest.gradients) == ["0", "2", "3"] and "gradient_noise/simple" not in viz.latest.scalars
    with pytest.raises(RuntimeError, match="no norms"):
        with actviz.watch(model, tmp_path / "strict", every=1, statistics=["default", "gradient_noise"],
            options=actviz.Options(strict=True)):
            model(torch.randn(4, 8)).square().mean().backward()


def _count_step(model: nn.Module, **options) -> CountOps:
    x, y = torch.randn(16, 4, 8), torch.randn(16, 4, 1)
    with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, **options) as viz:
        nn.functional.mse_loss(model(x), y).backward()  # step 0 warms up
        viz.flush()
        with CountOps() as count:
            nn.functional.mse_loss(model(x), y).backward()
            viz.flush()  # the writer thread's half is not counted: the mode is thread-local
    return count


def test_the_device_half_is_a_few_ops_per_layer_and_no_sync(monkeypatch):
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")  # the accelerator's code path, on the CPU
    monkeypatch.setenv("ACTVIZ_FUSED", "0")
    model = mlp()
    off, on = _count_step(model), _count_step(model, statistics=["default", "gradient_noise"])
    assert off.syncs == on.syncs == []
    added = Counter(on.kernels) - Counter(off.kernels)
    assert Counter(off.kernels) - Counter(on.kernels) == Counter()  # nothing of the step changes, ops are added
    linear = ["aten.bmm.default", "aten.bmm.default", "aten.add_.Tensor", "aten.mul_.Tensor", "aten.sum.dim_IntList",
              "aten.mm.default", "aten.dot.default", "aten.sum.dim_IntList", "aten.dot.default", "aten.add_.Tensor"]
    norm = ["aten.native_layer_norm.default", "aten.mul.Tensor", "aten.cat.default", "aten.sum.dim_IntList",
            "aten.sum.dim_IntList", "aten.mul.Tensor", "aten.sum.dim_IntList", "aten.dot.default"]
    packing = ["aten.cat.default"]  # the step's one copy to the host takes the norms along
    assert added == Counter(linear * 2 + norm + packing), sorted(added.elements())
