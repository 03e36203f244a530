"""actviz.watch end to end: what lands in the event files, when, and what is left behind."""

from __future__ import annotations

import copy
import gc
import math
import os
import warnings
import weakref

import numpy as np
import pytest
import torch
import torchvision
from conftest import optimizer_listeners, NO_HOOKS, hooks_left, small_cnn, train_step
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import actviz
from actviz.common.histogram_buckets import expand_empty_buckets
from actviz.pictures.rendering import feature_map_grid, grid_layout, heatmap, tile_size

LAYERS = ["0", "2", "3", "6"]  # the small CNN's conv, conv, batch norm and linear



def once_not_zero(run, tag: str, step: int) -> float:
    """A scalar written only from the first step it is not zero on (nonfinite, zero_fraction): 0 before."""
    if tag not in run.scalar_tags or step < run.scalar_events(tag)[0].step:
        return 0.0
    return run.scalar(tag, step)

def non_inplace_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return twin


def capture_outputs(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Keep each named layer's output with retain_grad, the slow honest way."""
    outputs: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, inputs, output):
            output.retain_grad()
            outputs[name] = output

        return hook

    for name in names:
        model.get_submodule(name).register_forward_hook(keep(name))
    return outputs


def assert_histogram_matches(histogram, values: torch.Tensor, bins: int) -> None:
    exact = values.detach().double().flatten()
    assert histogram.num == exact.numel()
    assert histogram.min == pytest.approx(exact.min().item(), rel=1e-6, abs=1e-9)
    assert histogram.max == pytest.approx(exact.max().item(), rel=1e-6, abs=1e-9)
    assert histogram.sum == pytest.approx(exact.sum().item(), rel=1e-4, abs=1e-6)
    assert histogram.sum_squares == pytest.approx((exact**2).sum().item(), rel=1e-5)
    if exact.min() == exact.max():  # a constant (a fresh BatchNorm weight) is one bucket
        assert (histogram.bucket_limit, histogram.bucket) == ([exact.max().item()], [exact.numel()])
        return
    edges = np.linspace(exact.min().item(), exact.max().item(), bins + 1)
    counts, _ = np.histogram(exact.numpy(), bins=edges)
    # runs of empty buckets are written as one (actviz.common.histogram_buckets)
    limits, buckets = expand_empty_buckets(histogram.min, histogram.max, histogram.bucket_limit, histogram.bucket, bins)
    assert len(buckets) == bins
    assert sum(buckets) == exact.numel()
    assert np.abs(np.array(buckets) - counts).max() <= 1  # float32 rounding at an edge
    assert limits[-1] == histogram.bucket_limit[-1] == histogram.max


@pytest.mark.usefixtures("every_path")
def test_logged_values_equal_values_computed_by_hand(tmp_path, read_run):
    model = small_cnn(inplace=True)
    twin = non_inplace_twin(model)
    outputs = capture_outputs(twin, LAYERS)
    weights_before = {name: p.detach().clone() for name, p in twin.named_parameters()}
    inputs = torch.randn(4, 3, 8, 8)
    twin(inputs).square().mean().backward()

    viz = actviz.watch(model, tmp_path, every=1, options=actviz.Options(bins=8, histogram_sample_size=None))
    model(inputs).square().mean().backward()
    viz.close()

    run = read_run(tmp_path)
    for name in LAYERS:
        output = outputs[name]
        # Layer "0" feeds an in-place ReLU: the logged values are the conv's, from before it.
        assert_histogram_matches(run.histogram(f"activations/{name}", 0), output, bins=8)
        assert_histogram_matches(run.histogram(f"gradients/{name}", 0), output.grad, bins=8)
        values = output.detach().double()
        assert run.scalar(f"activation_stats/mean@{name}", 0) == pytest.approx(values.mean().item(), rel=1e-4, abs=1e-6)
        assert run.scalar(f"activation_stats/std@{name}", 0) == pytest.approx(values.std().item(), rel=1e-4)
        assert once_not_zero(run, f"activation_stats/zero_fraction@{name}", 0) == (values == 0).double().mean().item()
        assert f"activation_stats/nonfinite@{name}" not in run.scalar_tags  # written only once not zero
        assert run.scalar(f"gradient_stats/norm@{name}", 0) == pytest.approx(output.grad.double().norm().item(), rel=1e-5)
        assert f"gradient_stats/nonfinite@{name}" not in run.scalar_tags
    assert outputs["0"].min() < 0  # so the check above really saw pre-ReLU values

    for name, param in twin.named_parameters():
        assert_histogram_matches(run.histogram(f"weights/{name}", 0), weights_before[name], bins=8)
        assert_histogram_matches(run.histogram(f"weight_grads/{name}", 0), param.grad, bins=8)

    for name in ["0", "2"]:
        expected = feature_map_grid(outputs[name][0])
        picture = run.image(f"feature_maps/{name}", 0)
        channels, height, width = outputs[name].shape[1:]
        assert picture.shape == grid_layout(channels, *tile_size(height, width))
        assert (picture == expected[0].numpy()).all()
    assert "feature_maps/6" not in run.image_tags  # 2-D outputs get no picture
    assert "feature_maps/3" not in run.image_tags  # the BatchNorm after conv 2: the same picture again
    repeat = feature_map_grid(outputs["3"][0]).int() - feature_map_grid(outputs["2"][0]).int()
    assert repeat.abs().max() <= 1  # equal up to rounding, as its weights are still positive


@pytest.mark.usefixtures("both_paths")
def test_a_layer_whose_output_is_a_leaf_logs_the_gradient_its_tensor_hook_gets(tmp_path, read_run):
    # A layer that returns a leaf (its input as it came, or a parameter) has no op to hook before: its output
    # gets a tensor hook instead, and the gradient logged must be the leaf's own.
    model = nn.Sequential(nn.Identity(), nn.Linear(3, 2))
    inputs = torch.randn(5, 3, requires_grad=True)
    viz = actviz.watch(model, tmp_path, every=1, layers=["0", "1"],
        options=actviz.Options(bins=8, histogram_sample_size=None))
    model(inputs).square().sum().backward()
    viz.close()

    run = read_run(tmp_path)
    assert_histogram_matches(run.histogram("gradients/0", 0), inputs.grad, bins=8)
    assert run.scalar("gradient_stats/norm@0", 0) == pytest.approx(inputs.grad.double().norm().item(), rel=1e-5)
    assert_histogram_matches(run.histogram("activations/0", 0), inputs.detach(), bins=8)


def test_schedule_counts_training_forwards_with_grad_only(tmp_path, read_run):
    model = small_cnn()
    viz = actviz.watch(model, tmp_path, every=3, image_every=5)
    probe = torch.randn(2, 3, 8, 8)
    for _ in range(11):
        train_step(model)
        model.eval()
        model(probe)  # eval: not a step
        model.train()
        with torch.no_grad():
            model(probe)  # no grad: not a step
    assert viz.step == 11
    viz.close()
    run = read_run(tmp_path)
    for name in LAYERS:
        assert run.histogram_steps(f"activations/{name}") == [0, 3, 6, 9]
        assert run.histogram_steps(f"gradients/{name}") == [0, 3, 6, 9]
        assert [e.step for e in run.scalar_events(f"activation_stats/mean@{name}")] == [0, 3, 6, 9]
    assert run.histogram_steps("weight_grads/0.weight") == [0, 3, 6, 9]
    for name in ["0", "2"]:
        assert run.image_steps(f"feature_maps/{name}") == [0, 5, 10]


def test_explicit_steps_and_predicates(tmp_path, read_run):
    model = small_cnn()
    with actviz.watch(model, tmp_path, every=[1, 4], image_every=lambda step: step == 2):
        for _ in range(6):
            train_step(model)
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == [1, 4]
    assert run.image_steps("feature_maps/0") == [2]


def test_manual_steps_for_gradient_accumulation(tmp_path, read_run):
    model = small_cnn()
    viz = actviz.watch(model, tmp_path, every=20, options=actviz.Options(auto_step=False))
    for global_step in range(5):
        viz.set_step(global_step * 10)
        for _ in range(3):  # micro-batches: only the first of a scheduled step logs
            train_step(model)
    viz.close()
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == [0, 20, 40]
    assert run.histogram_steps("gradients/6") == [0, 20, 40]


def test_two_forwards_then_one_backward_with_manual_steps(tmp_path, read_run):
    model = small_cnn()  # a siamese use: both halves of a pair go through the same model
    viz = actviz.watch(model, tmp_path, every=1, options=actviz.Options(auto_step=False))
    for step in range(2):
        viz.set_step(step)
        left, right = model(torch.randn(2, 3, 8, 8)), model(torch.randn(2, 3, 8, 8))
        (left - right).square().mean().backward()
    viz.close()
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == [0, 1]
    assert run.histogram_steps("gradients/0") == [0, 1]  # from the first forward of each step
    assert run.histogram("activations/0", 0).num == 2 * 6 * 8 * 8


class CallsItself(nn.Module):
    """Like Lightning's DDP forward redirection: the outer call runs a step that calls the model again."""

    def __init__(self) -> None:
        super().__init__()
        self.net = small_cnn()
        self.redirect = False

    def forward(self, x):
        if self.redirect:
            self.redirect = False
            return self(x)
        return self.net(x)


@pytest.mark.parametrize("auto_step", [True, False])
def test_a_model_that_calls_itself_on_a_logging_step(auto_step, tmp_path, read_run):
    model = CallsItself()
    viz = actviz.watch(model, tmp_path, every=1, options=actviz.Options(auto_step=auto_step))
    for step in range(3):
        viz.set_step(step)
        model.redirect = True
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    viz.close()
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/net.0") == [0, 1, 2]
    assert run.histogram_steps("gradients/net.6") == [0, 1, 2]
    assert hooks_left(model) == NO_HOOKS


def test_set_step_in_auto_mode_continues_from_there(tmp_path, read_run):
    model = small_cnn()
    with actviz.watch(model, tmp_path, every=5) as viz:
        train_step(model)
        viz.set_step(99)
        train_step(model)
        train_step(model)
        assert viz.step == 101
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 100]
    with pytest.raises(ValueError, match="-1"):
        viz.set_step(-1)


def test_non_logging_steps_carry_no_layer_hooks(tmp_path):
    class Probe(nn.Conv2d):
        def forward(self, x):
            self.seen.append(len(self._forward_hooks))
            return super().forward(x)

    probe = Probe(3, 4, 3)
    probe.seen = []
    model = nn.Sequential(probe, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path, every=2):
        for _ in range(4):
            train_step(model, optimizer)  # the optimizer step ends a logging step
            # the root's step counter, and each parameter's hook of the gradient norms before clipping (step_norms)
            assert hooks_left(model) == {**NO_HOOKS, "forward_pre": 1, "param": len(list(model.parameters()))}
            assert len(model._forward_pre_hooks) == 1
    assert probe.seen == [1, 0, 1, 0]


def test_a_step_ends_at_the_optimizer_step_or_else_at_the_next_forward(tmp_path, read_run):
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    viz = actviz.watch(model, tmp_path, every=1)
    before = optimizer_listeners()  # the watcher's own, and other tests' watchers'
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert optimizer_listeners() == before + 1  # waiting for the optimizer to take the gradients
    optimizer.step()
    assert optimizer_listeners() == before  # the optimizer's step ended step 0
    model(torch.randn(2, 3, 8, 8)).sum().backward()  # step 1: no optimizer step
    model.eval()
    model(torch.randn(2, 3, 8, 8))  # an eval forward is not a step: step 1 still open
    assert optimizer_listeners() == before + 1
    model.train()
    model(torch.randn(2, 3, 8, 8))  # step 2 starts: step 1 still waits for the optimizer step
    assert optimizer_listeners() == before + 2
    with pytest.warns(RuntimeWarning, match="no weight_grads for step 1"):  # none came: said, not logged
        viz.flush()
    run = read_run(tmp_path)
    assert run.histogram_steps("gradients/0") == [0, 1]
    assert run.histogram_steps("weight_grads/6.bias") == [0]
    viz.close()


def test_a_forward_without_backward_still_logs_its_activations(tmp_path, read_run):
    model = small_cnn()
    with actviz.watch(model, tmp_path, every=1) as viz:
        model(torch.randn(2, 3, 8, 8))  # no backward
        train_step(model)
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == [0, 1]
    assert run.histogram_steps("gradients/0") == [1]
    assert viz.closed


def test_no_batch_outlives_its_step(tmp_path):
    model = small_cnn()
    refs = []
    model[0].register_forward_hook(lambda module, inputs, output: refs.append(weakref.ref(output)))
    with actviz.watch(model, tmp_path, every=1):
        train_step(model)
        gc.collect()
        assert refs and all(ref() is None for ref in refs)


@pytest.mark.parametrize("name", ["alexnet", "vgg11"])
def test_torchvision_models_with_inplace_relus(name, tmp_path, read_run):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    shapes = {}

    def keep_shape(name):
        def hook(module, inputs, output):
            shapes[name] = tuple(output.shape[1:])

        return hook

    shape_hooks = [
        module.register_forward_hook(keep_shape(layer_name))
        for layer_name, module in model.named_modules()
        if isinstance(module, nn.Conv2d)
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    viz = actviz.watch(model, tmp_path, every=2, image_every=3)
    for _ in range(4):
        loss = nn.functional.cross_entropy(model(torch.randn(2, 3, 64, 64)), torch.tensor([1, 7]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    viz.close()
    run = read_run(tmp_path)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert len(shapes) == len(convs) >= 5
    for layer in convs:
        assert run.image_steps(f"feature_maps/{layer}") == [0, 3]
        channels, height, width = shapes[layer]
        expected_size = grid_layout(min(channels, 64), *tile_size(height, width))
        assert run.image(f"feature_maps/{layer}", 3).shape == expected_size
    for layer in viz.layer_names:
        assert run.histogram_steps(f"activations/{layer}") == [0, 2]
        assert run.histogram_steps(f"gradients/{layer}") == [0, 2]
        for stat in ("mean", "std"):
            assert [e.step for e in run.scalar_events(f"activation_stats/{stat}@{layer}")] == [0, 2]
        assert [e.step for e in run.scalar_events(f"gradient_stats/norm@{layer}")] == [0, 2]
        for tag in (f"activation_stats/zero_fraction@{layer}", f"activation_stats/nonfinite@{layer}",
                    f"gradient_stats/nonfinite@{layer}"):  # written from the first step they are not zero on
            assert tag not in run.scalar_tags or [e.step for e in run.scalar_events(tag)] in ([0, 2], [2])
    for param, _ in model.named_parameters():
        assert run.histogram_steps(f"weights/{param}") == [0, 2]
        assert run.histogram_steps(f"weight_grads/{param}") == [0, 2]
    for handle in shape_hooks:
        handle.remove()
    assert hooks_left(model) == NO_HOOKS


@pytest.mark.usefixtures("every_path")
def test_nan_in_a_layer_is_counted_and_training_goes_on(tmp_path, read_run):
    model = small_cnn()
    batches = [torch.randn(2, 3, 8, 8) for _ in range(5)]
    batches[2][0, 0, 3, 3] = float("nan")  # reaches a 3x3 patch of every conv-0 channel
    batches[3].fill_(float("nan"))
    expected_nan = torch.isnan(model[0](batches[2])).sum().item()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tmp_path, every=1):
            for batch in batches:
                model(batch).sum().backward()
    # NaN is data, not an error: the one warning names where it first showed
    assert len(caught) == 1 and str(caught[0].message).startswith("actviz: NaN or Inf first at step 2, in the output of '0'")
    run = read_run(tmp_path)
    nonfinite = [once_not_zero(run, "activation_stats/nonfinite@0", step) for step in range(5)]
    assert nonfinite == [0, 0, expected_nan, 2 * 6 * 8 * 8, 0]
    assert [e.step for e in run.scalar_events("activation_stats/nonfinite@0")] == [2, 3, 4]  # from the first NaN on
    assert expected_nan == 2 * 6 * 9 - 6 * 9 == 54  # one sample, 6 channels, 3x3 patch
    assert run.histogram("activations/0", 2).num == 2 * 6 * 8 * 8 - expected_nan
    assert run.histogram_steps("activations/0") == [0, 1, 2, 4]  # all-NaN step: scalars only
    assert math.isnan(run.scalar("activation_stats/mean@0", 3))
    assert run.scalar("gradient_stats/nonfinite@0", 3) > 0


@pytest.mark.usefixtures("both_paths")
def test_bfloat16_autocast_step(tmp_path, read_run):
    model = small_cnn()
    seen = {}

    def keep(module, inputs, output):
        assert output.dtype == torch.bfloat16
        seen["out"] = output.detach().float()

    model[2].register_forward_hook(keep)
    with actviz.watch(model, tmp_path, every=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 3, 8, 8)).float().square().mean()
        loss.backward()
    run = read_run(tmp_path)
    out = seen["out"].double()
    histogram = run.histogram("activations/2", 0)
    assert histogram.num == out.numel()
    assert histogram.sum == pytest.approx(out.sum().item(), rel=1e-3, abs=1e-3)
    assert (histogram.min, histogram.max) == (out.min().item(), out.max().item())
    assert "gradient_stats/nonfinite@2" not in run.scalar_tags  # written only once not zero
    assert "feature_maps/2" in run.image_tags


class SequenceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens):
        output, _ = self.lstm(self.embed(tokens))
        return self.head(output[:, -1])


def test_lstm_first_output_and_all_outputs(tmp_path, read_run):
    model = SequenceModel()
    tokens = torch.randint(0, 20, (4, 10))
    with actviz.watch(model, tmp_path / "first", every=1):
        model(tokens).sum().backward()
    run = read_run(tmp_path / "first")
    assert {"activations/embed", "activations/lstm", "activations/head", "gradients/lstm"} <= run.histogram_tags
    assert run.histogram("activations/lstm", 0).num == 4 * 10 * 6
    assert run.image("feature_maps/lstm", 0).shape == (*heatmap(torch.zeros(10, 6)).shape[1:], 3)

    with actviz.watch(model, tmp_path / "all", every=1, options=actviz.Options(outputs="all")):
        model(tokens).sum().backward()
    run = read_run(tmp_path / "all")
    assert {"activations/lstm/0", "activations/lstm/1.0", "activations/lstm/1.1"} <= run.histogram_tags
    assert run.histogram("activations/lstm/1.0", 0).num == 1 * 4 * 6  # h: (layers, batch, hidden)
    assert "gradients/lstm/0" in run.histogram_tags
    assert run.image_tags >= {"feature_maps/lstm/0"} and "feature_maps/lstm/1.0" not in run.image_tags


def test_transformer_encoder_layer(tmp_path, read_run):
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True))
    with actviz.watch(model, tmp_path, every=1) as viz:
        model(torch.randn(3, 5, 16)).sum().backward()
    run = read_run(tmp_path)
    assert "0.self_attn" in viz.layer_names
    for layer in ["0.self_attn", "0.linear1", "0.linear2", "0.norm1", "0.norm2"]:
        assert f"activations/{layer}" in run.histogram_tags
        assert f"gradients/{layer}" in run.histogram_tags
        assert f"feature_maps/{layer}" in run.image_tags  # (batch, time, features) -> heat map
    assert run.histogram("activations/0.linear1", 0).num == 3 * 5 * 32
    assert run.image("feature_maps/0.linear1", 0).shape == (*heatmap(torch.zeros(5, 32)).shape[1:], 3)
    assert "weight_grads/0.self_attn.in_proj_weight" in run.histogram_tags


def test_a_long_sequence_heat_map_is_area_averaged_to_512_pixels_by_the_whole_bounds(tmp_path, read_run):
    # 1,024 tokens x 96 features: the picture is 512 x 64 (its shorter side kept at 64 px), each pixel the mean of
    # its area (2 tokens x 1.5 features), coloured by where it falls between the whole matrix's min and max.
    from actviz.pictures.heatmap_sources import HEATMAP_COLOURS
    from actviz.common.pixels import PaletteImage

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 96))
    inputs = torch.randn(2, 1024, 8)
    with actviz.watch(model, tmp_path, every=1) as viz:
        hidden = model(inputs)
        hidden.sum().backward()
        viz.flush()
    matrix = hidden[0].detach().double()
    pooled = torch.nn.functional.adaptive_avg_pool2d(matrix[None], (512, 64))[0]
    levels = ((pooled - matrix.min()) / (matrix.max() - matrix.min()) * 255).round().to(torch.uint8)
    kept = viz.latest.images["0"]
    assert isinstance(kept, PaletteImage) and kept.shape == (3, 512, 64)
    assert (kept.indices.int() - levels.int()).abs().max() <= 1  # float32 on the way, float64 here
    assert (kept.indices != levels).float().mean() < 0.01
    logged = read_run(tmp_path).image("feature_maps/0", 0)
    assert np.array_equal(logged, HEATMAP_COLOURS[kept.indices.long()].numpy())  # the PNG decodes to them


class ComplexScale(nn.Module):
    """A layer whose output actviz cannot summarize (complex), to make its hook fail."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return torch.complex(x * self.scale, x)


def complex_model() -> nn.Module:
    class Real(nn.Module):
        def forward(self, z):
            return z.real

    return nn.Sequential(nn.Linear(4, 4), ComplexScale(), Real(), nn.Linear(4, 1))


def test_a_failing_hook_warns_once_and_skips_that_layer(tmp_path, read_run):
    model = complex_model()
    with pytest.warns(RuntimeWarning, match=r"actviz skips '1' from now on: .*complex") as caught:
        with actviz.watch(model, tmp_path, every=1):
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
    assert sum("skips '1'" in str(w.message) for w in caught) == 1
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == [0, 1, 2]
    assert run.histogram_steps("activations/3") == [0, 1, 2]
    assert not any(tag.startswith("activations/1") for tag in run.histogram_tags)


def test_strict_reraises(tmp_path):
    model = complex_model()
    with actviz.watch(model, tmp_path, every=1, options=actviz.Options(strict=True)):
        with pytest.raises(TypeError, match="complex"):
            model(torch.randn(2, 4))
    assert hooks_left(model) == NO_HOOKS


def test_an_error_in_the_users_forward_leaves_no_layer_hooks(tmp_path, read_run):
    model = small_cnn()
    with actviz.watch(model, tmp_path, every=1):
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 5, 8, 8))  # wrong channel count
        assert hooks_left(model) == {**NO_HOOKS, "forward_pre": 1, "param": len(list(model.parameters()))}
        train_step(model)
    assert read_run(tmp_path).histogram_steps("gradients/0") == [1]


def test_close_removes_everything_even_mid_step(tmp_path):
    model = small_cnn()
    before = optimizer_listeners()
    viz = actviz.watch(model, tmp_path, every=1)
    model(torch.randn(2, 3, 8, 8))  # a logging step waiting for its backward
    assert optimizer_listeners() > before
    viz.close()
    assert hooks_left(model) == NO_HOOKS and optimizer_listeners() == before
    viz.close()  # idempotent
    assert hooks_left(model) == NO_HOOKS


def test_an_exception_inside_with_propagates_and_cleans_up(tmp_path):
    model = small_cnn()
    with pytest.raises(KeyError, match="user error"):
        with actviz.watch(model, tmp_path, every=1):
            model(torch.randn(2, 3, 8, 8))
            raise KeyError("user error")
    assert hooks_left(model) == NO_HOOKS


def test_a_closed_watcher_can_be_garbage_collected(tmp_path):
    model = small_cnn()
    viz = actviz.watch(model, tmp_path, every=1)
    train_step(model)
    viz.close()
    ref = weakref.ref(viz)
    del viz
    gc.collect()
    assert ref() is None


def test_a_given_writer_is_not_closed_and_an_owned_one_is(tmp_path):
    model = small_cnn()
    writer = SummaryWriter(tmp_path / "mine")
    with actviz.watch(model, sink=writer, every=1):
        train_step(model)
    assert writer.file_writer is not None  # still open
    writer.add_scalar("after", 1.0, 0)
    writer.close()
    with actviz.watch(model, tmp_path / "owned") as viz:
        train_step(model)
    assert viz.writer.file_writer is None


# -- bad input: a clear error from watch() itself, and nothing half-done --------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"every": 0}, ValueError, r"every must be a positive number of steps, got 0"),
        ({"image_every": -3}, ValueError, r"image_every must be a positive number of steps, got -3"),
        ({"layers": ["feature.0"]}, ValueError, r"unknown layer 'feature\.0'; did you mean"),
        ({"layers": [nn.Conv3d]}, ValueError, r"no layer of type Conv3d"),
        ({"sink": "runs/x"}, TypeError, r"sink must have the methods write\(results\), flush\(\) and close\(\); str"),
        ({"options": {"bins": 8}}, TypeError, r"options must be an actviz.Options, got dict: .*options=actviz.Options"),
    ],
)
def test_bad_arguments(kwargs, error, message, tmp_path):
    model = torchvision.models.alexnet(num_classes=2)
    log_dir = tmp_path / "run"
    with pytest.raises(error, match=message):
        if "sink" in kwargs:
            actviz.watch(model, **kwargs)
        else:
            actviz.watch(model, log_dir, **kwargs)
    assert hooks_left(model) == NO_HOOKS
    assert not log_dir.exists()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_channels": 0}, ValueError, r"^max_channels must be positive, got 0; for example max_channels=64$"),
        ({"bins": -1}, ValueError, r"^bins must be positive, got -1; for example bins=64$"),
        ({"bins": 2.5}, TypeError, r"^bins must be an int, got float: 2.5; for example bins=64$"),
        ({"bins": 10**7}, ValueError, r"^bins must be at most 4096, got 10000000; for example bins=64$"),
        ({"histogram_sample_size": 0}, ValueError, r"^histogram_sample_size must be positive"),
        ({"outputs": "last"}, ValueError, r"^outputs must be 'first' or 'all', got 'last'$"),
        ({"strict": "yes"}, TypeError, r"^strict must be True or False, got 'yes'$"),
        ({"auto_step": 0}, TypeError, r"^auto_step must be True or False, got 0$"),
        ({"merge_ranks": "yes"}, TypeError, r"^merge_ranks must be True or False, got 'yes'$"),
        ({"grad_scaler": 2.0**16}, TypeError, r"^grad_scaler must be a torch.amp.GradScaler .*got float"),
    ],
)
def test_bad_options_are_refused_when_the_options_object_is_made(kwargs, error, message):
    with pytest.raises(error, match=message):
        actviz.Options(**kwargs)


def test_model_must_be_a_module(tmp_path):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        actviz.watch(lambda x: x, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_log_dir_and_writer_together(tmp_path):
    model = small_cnn()
    writer = SummaryWriter(tmp_path / "mine")
    with pytest.raises(ValueError, match="give log_dir or a SummaryWriter as sink=, not both"):
        actviz.watch(model, tmp_path / "run", sink=writer)
    writer.close()
    assert hooks_left(model) == NO_HOOKS and not (tmp_path / "run").exists()


def test_log_dir_that_cannot_be_created(tmp_path):
    model = small_cnn()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match=f"cannot create log_dir '{blocker / 'run'}'"):
        actviz.watch(model, blocker / "run")
    assert hooks_left(model) == NO_HOOKS


def test_watching_the_same_model_twice(tmp_path):
    model = small_cnn()
    first = actviz.watch(model, tmp_path / "first")
    with pytest.raises(ValueError, match="already watched"):
        actviz.watch(model, tmp_path / "second")
    assert not (tmp_path / "second").exists()
    assert hooks_left(model) == {**NO_HOOKS, "forward_pre": 1, "param": len(list(model.parameters()))}  # the first's
    first.close()
    actviz.watch(model, tmp_path / "second").close()  # fine once the first is closed


@pytest.mark.parametrize("norm", [nn.BatchNorm2d(4), nn.InstanceNorm2d(4, affine=True), nn.GroupNorm(2, 4)])
def test_a_norm_layer_repeating_a_drawn_grid_is_not_drawn_again(tmp_path, read_run, norm):
    direct = nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.ReLU())
    with actviz.watch(direct, tmp_path / "direct", every=1):
        direct(torch.randn(2, 3, 10, 10)).sum().backward()
    run = read_run(tmp_path / "direct")
    assert "feature_maps/0" in run.image_tags and "feature_maps/1" not in run.image_tags
    assert run.histogram_steps("activations/1") == [0]  # its statistics are still logged


def test_a_norm_layer_gets_its_picture_when_its_input_was_not_drawn_as_it_is(tmp_path, read_run):
    # conv -> in-place ReLU -> BatchNorm: the BN sees the conv's tensor, changed since it was drawn
    changed = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.BatchNorm2d(4))
    with actviz.watch(changed, tmp_path / "changed", every=1):
        changed(torch.randn(2, 3, 10, 10)).sum().backward()
    assert {"feature_maps/0", "feature_maps/2"} <= read_run(tmp_path / "changed").image_tags
    # the BatchNorm watched alone: nothing drawn before it
    alone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with actviz.watch(alone, tmp_path / "alone", every=1, layers=[nn.BatchNorm2d]):
        alone(torch.randn(2, 3, 10, 10)).sum().backward()
    assert {tag for tag in read_run(tmp_path / "alone").image_tags if tag.startswith("feature_maps/")} == {
        "feature_maps/1"}


class _ListSink:
    def write(self, results): pass
    def flush(self): pass
    def close(self): pass


@pytest.mark.parametrize(("options", "error", "pattern"), [
    ({"alerts": {"dead_zero_fraction": 99}}, ValueError,
     r"dead_zero_fraction must be a fraction in \(0, 1\], got 99; for example alerts=\{'dead_zero_fraction': 0.99\}"),
    ({"alerts": {"vanishing_steps": 0.5}}, ValueError,
     r"vanishing_steps must be a whole number of logging steps, 1 or more, got 0.5; for example alerts=\{'vanishing_steps': 3\}"),
    ({"alerts": {"exploding_min_history": 40}}, ValueError, r"exploding_min_history must be a whole number of logging steps from 1 to 32"),
    ({"alerts": {"update_ratio_low": 0.1}}, ValueError, r"update_ratio_low \(0.1\) must be below update_ratio_high \(0.01\)"),
    ({"sink": _ListSink}, TypeError, r"sink must be an object, got the class _ListSink; for example sink=_ListSink\(\)"),
    ({"log_dir": ""}, ValueError, r"log_dir must not be empty .*for example log_dir='runs/exp1'"),
    ({"log_dir": "x/" + os.fsdecode(b"\xff")}, ValueError, r"log_dir must be encodable as UTF-8 .*for example log_dir='runs/exp1'"),
    ({"every": torch.tensor(10)}, TypeError, r"every must be a Python int .*got a Tensor: tensor\(10\); for example every=10"),
    ({"image_every": torch.tensor([1, 5])}, TypeError, r"image_every must be .*for example image_every=steps.tolist\(\)"),
    ({"every": range(-5, 5)}, ValueError, r"every steps must be non-negative .*for example every=range\(0, 1000, 10\)"),
])
def test_bad_arguments_name_the_argument_and_a_good_value_and_leave_nothing(tmp_path, monkeypatch, options, error, pattern):
    monkeypatch.chdir(tmp_path)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    log_dir = options.pop("log_dir", "runs/x")
    if log_dir.startswith("x/"):
        log_dir = str(tmp_path / log_dir)
    with pytest.raises(error, match=pattern):
        actviz.watch(model, log_dir, **options)
    assert list(tmp_path.iterdir()) == [] and hooks_left(model) == NO_HOOKS


def test_a_huge_range_is_a_schedule_and_a_scripted_model_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with actviz.watch(model, tmp_path / "run", every=range(0, 10**15, 2), image_every=False) as viz:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
    assert viz.step == 3
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(TypeError, match=r"the model is a RecursiveScriptModule .*watch the nn.Module itself, for example"):
        actviz.watch(scripted, tmp_path / "jit")
    assert not (tmp_path / "jit").exists() and hooks_left(scripted) == NO_HOOKS
