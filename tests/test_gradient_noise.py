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
    batch = ["aten.mm.default", "aten.dot.default", "aten.sum.dim_IntList", "aten.dot.default", "aten.add_.Tensor"]
    gram = ["aten.bmm.default", "aten.bmm.default", "aten.add_.Tensor", "aten.mul_.Tensor", "aten.sum.dim_IntList"]
    weight = ["aten.bmm.default", "aten.pow_.Scalar", "aten.sum.dim_IntList",  # Linear(16, 1): its 16 weights per example
              "aten.sum.dim_IntList", "aten.pow_.Scalar", "aten.sum.dim_IntList", "aten.add_.Tensor"]
    norm = ["aten.native_layer_norm.default", "aten.mul.Tensor", "aten.cat.default", "aten.sum.dim_IntList",
            "aten.sum.dim_IntList", "aten.mul.Tensor", "aten.sum.dim_IntList", "aten.dot.default"]
    # The norms join the cat that packs the step's other tensors for its one copy to the host: no op more.
    assert added == Counter(gram + batch + weight + batch + norm), sorted(added.elements())


# --- The batch dimension of time-first layouts, the memory of long sequences, and a step that counts nothing.


def loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_dim: int, y_dim: int | None = None) -> torch.Tensor:
    """``(B, parameters)``: each example's gradient of its own mean squared error, one backward per example,
    over the parameters that require grad (the reference for layers torch.func cannot map over)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for b in range(x.shape[batch_dim]):
        xb, yb = x.narrow(batch_dim, b, 1), y.narrow(batch_dim if y_dim is None else y_dim, b, 1)
        out = model(xb)
        out = out[0] if isinstance(out, tuple) else out
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(nn.functional.mse_loss(out, yb), params)]))
    return torch.stack(rows).double()


class TimeFirstLSTM(nn.Module):
    """word_language_model's layout: (T, B) in, an LSTM with batch_first=False, a Linear decoder on (T, B, hidden)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.project = nn.Linear(4, 6)
        self.rnn = nn.LSTM(6, 8)
        self.decoder = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(torch.tanh(self.project(x)))
        return self.decoder(output)


class LastHiddenClassifier(nn.Module):
    """A time-first LSTM whose last hidden state, (B, hidden), goes to a Linear: a 2-D input in a time-first model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(4, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = self.rnn(x)
        return self.fc(hidden[-1])


@pytest.mark.parametrize("make", [TimeFirstLSTM, LastHiddenClassifier,
                                  lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)],
                         ids=["lstm", "lstm, last hidden state", "transformer"])
def test_a_time_first_model_takes_its_examples_from_dimension_1(make):
    # (T, B, features) with T = 7, B = 5: the examples are dimension 1, not the time steps of dimension 0.
    model = make()
    torch.manual_seed(1)
    width = 4 if isinstance(model, (TimeFirstLSTM, LastHiddenClassifier)) else 8
    x = torch.randn(7, 5, width)
    y = torch.randn(model(x).shape)
    reference_model = copy.deepcopy(model)
    for name, parameter in reference_model.named_parameters():  # the counted layers' parameters alone
        owner = reference_model.get_submodule(name.rpartition(".")[0])
        parameter.requires_grad_(isinstance(owner, gradient_noise.COUNTED) and type(owner).__name__ != "NonDynamicallyQuantizableLinear")
    expected = reference(loop_gradients(reference_model, x, y, batch_dim=1, y_dim=1 if y.dim() == 3 else 0))
    with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, statistics=["default", "gradient_noise"]) as viz:
        nn.functional.mse_loss(model(x), y).backward()
        viz.flush()
    assert {tag: viz.latest.scalars[tag] for tag in GRADIENT_NOISE} == pytest.approx(expected, rel=1e-5)


def test_squared_norms_follow_the_batch_dimension_given():
    torch.manual_seed(0)
    layer = nn.Linear(5, 3).double()
    x = torch.randn(4, 6, 5, dtype=torch.double)  # (T, B, in)
    g = torch.randn(4, 6, 3, dtype=torch.double)
    per_example, batch = squared_norms(layer, x, g, batch_dim=1)
    shares = contributions(layer, x.transpose(0, 1), g.transpose(0, 1))
    torch.testing.assert_close(per_example, shares.square().sum(1))
    torch.testing.assert_close(batch, shares.sum(0).square().sum())


ROUTES = {  # (B, T, in, out), the floor of memory: the route and the examples taken at a time
    "whole-batch gram": ((4, 1, 8, 8), None, ("batch gram", 4)),
    "gram": ((6, 4, 16, 32), None, ("gram", 6)),
    "weight": ((6, 40, 3, 2), None, ("weight", 6)),
    # A floor of 1 element bounds the intermediates by the layer alone: a few examples at a time.
    "weight in chunks": ((4, 2, 2, 2), 1, ("weight", 2)),
    "gram in uneven chunks": ((4, 2, 2, 8), 1, ("gram", 3)),
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_each_route_and_its_chunks_give_each_examples_norm(monkeypatch, case):
    (batch, steps, d_in, d_out), floor, chosen = ROUTES[case]
    if floor is not None:
        monkeypatch.setattr(gradient_noise, "MEMORY_FLOOR", floor)
    assert gradient_noise.linear_route(batch, steps, d_in, d_out) == chosen
    torch.manual_seed(0)
    layer = nn.Linear(d_in, d_out).double()
    x = torch.randn(batch, steps, d_in, dtype=torch.double)
    g = torch.randn(batch, steps, d_out, dtype=torch.double)
    per_example, total = squared_norms(layer, x, g)
    shares = contributions(layer, x, g)
    torch.testing.assert_close(per_example, shares.square().sum(1))
    torch.testing.assert_close(total, shares.sum(0).square().sum())


class LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes one op's output took: what a route's intermediates cost."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not func.is_view:
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())
        return out


def test_a_long_sequence_costs_the_layers_size_not_t_squared():
    # T = 8,192 positions through a Linear(16, 16): two 8,192² Gram matrices per example would take 512 MB each;
    # each example's 16 × 16 weight-gradient share takes 1 KB. No intermediate may exceed the layer's input (1 MB).
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    x, g = torch.randn(2, 8192, 16), torch.randn(2, 8192, 16)
    with LargestOutput() as meter:
        per_example, batch = squared_norms(layer, x, g)
    assert meter.largest <= x.numel() * x.element_size()
    shares = torch.cat([torch.einsum("bto,bti->boi", g.double(), x.double()).flatten(1), g.double().sum(1)], dim=1)
    torch.testing.assert_close(per_example.double(), shares.square().sum(1), rtol=1e-4, atol=0)
    torch.testing.assert_close(batch.double(), shares.sum(0).square().sum(), rtol=1e-4, atol=0)


class ConvOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean((1, 2, 3))


class MixedLayouts(nn.Module):
    """A batch-first GRU and a time-first LSTM: a 3-D input's batch dimension cannot be told."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.lstm = nn.LSTM(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.gru(self.fc(x))[0].transpose(0, 1))[0]


NOTHING_COUNTS = {  # model, its input: the cause the warning names
    "a batch of one": (lambda: nn.Linear(8, 1), torch.randn(1, 8), "a batch of 1 example "),
    "an empty batch": (lambda: nn.Linear(8, 1), torch.randn(0, 8), "a batch of 0 examples"),
    "1-D inputs": (lambda: nn.Linear(8, 1), torch.randn(8), "1-D inputs"),
    "convolutions only": (ConvOnly, torch.randn(4, 3, 6, 6), "no watched nn.Linear, nn.LayerNorm or nn.RMSNorm"),
    "mixed layouts": (lambda: MixedLayouts(), torch.randn(4, 3, 8), "the batch dimension cannot be told"),
}


@pytest.mark.parametrize("case", list(NOTHING_COUNTS))
def test_a_step_that_counts_nothing_warns_once_naming_the_cause(case):
    make, x, cause = NOTHING_COUNTS[case]
    torch.manual_seed(0)
    model = make()
    with pytest.warns(RuntimeWarning, match="gradient_noise") as caught:
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, statistics=["default", "gradient_noise"]) as viz:
            for _ in range(3):
                out = model(x)
                (out[0] if isinstance(out, tuple) else out).square().mean().backward()
                viz.flush()
    said = [str(w.message) for w in caught if "gradient_noise" in str(w.message)]
    assert len(said) == 1 and cause in said[0], said
    assert not any(tag.startswith("gradient_noise/") for tag in viz.latest.scalars)
