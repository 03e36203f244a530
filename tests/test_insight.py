"""A fixed probe, Grad-CAM, the first NaN named, the dashboards laid out, update ratios: each checked exactly."""

from __future__ import annotations

import copy
import re
import warnings

import numpy as np
import pytest
import torch
from conftest import NO_HOOKS, hooks_left, small_cnn, train
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

import actviz
from actviz.pictures.rendering import feature_map_grid


def batches(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(count)]


# -- the probe ------------------------------------------------------------------------------------


def test_the_probe_draws_the_same_input_and_changes_nothing(tmp_path, read_run):
    model = small_cnn(inplace=False)
    twin = copy.deepcopy(model)
    probe = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # what the probe forward at step 0 must draw: the eval-mode output of sample 0
        expected = {name: feature_map_grid(twin.eval().get_submodule(name)(x)[0])
                    for name, x in (("0", probe), ("2", twin[1](twin[0](probe))))}
    twin.train()
    data = batches(4)
    with actviz.watch(model, tmp_path, every=2, extras=[actviz.Probe(probe)]):
        train(model, len(data), data, lr=0.1)
        assert model.training and all(module.training for module in model.modules())
    train(twin, len(data), data, lr=0.1)
    run = read_run(tmp_path)
    assert run.image_steps("feature_maps/0") == [0, 2]
    for name, grid in expected.items():
        assert (run.image(f"feature_maps/{name}", 0) == grid[0].numpy()).all()
    for (name, buffer), twin_buffer in zip(model.named_buffers(), twin.buffers()):
        assert torch.equal(buffer, twin_buffer), name  # BatchNorm statistics as without the probe
    for (name, param), twin_param in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(param, twin_param) and torch.equal(param.grad, twin_param.grad), name
    # statistics still come from the training batch
    assert run.histogram("activations/0", 0).num == 4 * 6 * 8 * 8
    picture = run.image("probe/input", 0)
    normalised = (probe[0] - probe[0].min()) / (probe[0].max() - probe[0].min())
    assert picture.shape == (8, 8, 3)
    assert np.abs(picture.astype(int) - normalised.mul(255).round().permute(1, 2, 0).numpy()).max() <= 1
    assert hooks_left(model) == NO_HOOKS


def test_a_probe_of_several_arguments_and_bad_probes(tmp_path):
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, image, scale):
            return self.conv(image) * scale

    model = TwoInputs()
    with actviz.watch(model, tmp_path, every=1,
        extras=[actviz.Probe({"image": torch.randn(1, 3, 6, 6), "scale": torch.tensor(2.0)})]):
        model(torch.randn(2, 3, 6, 6), torch.tensor(1.0)).sum().backward()
    with pytest.raises(TypeError, match=r"actviz.Probe\(batch\) takes a batch the model takes.*got str"):
        actviz.watch(small_cnn(), tmp_path / "bad", extras=[actviz.Probe("cat.jpg")])
    with pytest.raises(ValueError, match=r"unknown layer 'feature.0' in gradcam="):
        actviz.watch(small_cnn(), tmp_path / "bad",
            extras=[actviz.Probe(torch.randn(1, 3, 8, 8), gradcam="feature.0")])
    assert not (tmp_path / "bad").exists()


class FourLayers(nn.Module):
    """Conv-Conv-Linear named like a ResNet's stages, and a conv its forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = nn.Conv2d(3, 4, 3)
        self.layer4 = nn.Conv2d(4, 4, 3)
        self.spare = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.layer4(torch.relu(self.layer1(x)))).mean(dim=(2, 3)))


IMAGE = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kwargs, message", [
    ({"extras": [actviz.Probe(torch.randn(1, 5, 8, 8))]},
     r"^actviz.Probe\(batch\) of shape \(1, 5, 8, 8\) does not go through the FourLayers: RuntimeError: .*expected input\[1, 5, 8, 8\] "
     r"to have 3 channels.* Give a batch it takes, such as the first sample of a training batch: actviz.Probe\(inputs\[:1\]\)$"),
    ({"extras": [actviz.Probe((IMAGE, torch.ones(1)))]},
     r"^actviz.Probe\(batch\) of shapes \(\(1, 3, 8, 8\), \(1,\)\) does not go through the FourLayers: TypeError: "
     r".*actviz.Probe\(inputs\[:1\]\)$"),
    ({"extras": [actviz.Probe(IMAGE, gradcam="layer5")]}, r"^unknown layer 'layer5' in gradcam='layer5'; did you mean 'layer4'"),
    ({"extras": [actviz.Probe(IMAGE, gradcam="fc")]}, r"^gradcam='fc': this layer gives an output of shape \(1, 2\); Grad-CAM needs "
     r"a layer whose output is \(N, C, h, w\), e.g. gradcam='layer4', the last Conv2d the probe runs$"),
    ({"extras": [actviz.Probe(IMAGE, gradcam=["layer1", "spare"])]},
     r"^gradcam='spare': this layer is not run by the probe's forward; .* e.g. gradcam='layer4'"),
    ({"extras": [actviz.Probe(torch.randn(1, 8), gradcam=True)]},
     r"^gradcam=True draws over probe sample 0 as a picture, so the probe must be a batch of images, "
     r"\(N, 1 or 3, H, W\) floats.*got shape \(1, 8\)"),
], ids=["channels", "arguments", "no-such-layer", "not-4d", "not-run", "not-an-image"])
def test_watch_refuses_a_bad_probe_or_gradcam_at_once_and_leaves_nothing(tmp_path, kwargs, message):
    model = FourLayers()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        actviz.watch(model, tmp_path / "run", every=1, **kwargs)
    assert not (tmp_path / "run").exists()
    assert hooks_left(model) == NO_HOOKS
    assert all(module.training for module in model.modules())
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


class Noisy(nn.Module):
    """Adds noise in eval mode too, and counts its calls: a forward that draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + 0.1 * torch.randn_like(x)


def test_the_probe_tried_at_watch_leaves_the_model_and_the_random_stream_as_they_were(tmp_path, read_run):
    torch.manual_seed(0)
    noisy = Noisy()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), noisy, nn.Dropout(0.5), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2))
    model[3].eval()  # the user's own mix of modes: kept as it is
    modes = [module.training for module in model.modules()]
    state = {name: value.clone() for name, value in model.state_dict().items()}  # BatchNorm's statistics included
    random_state = torch.get_rng_state()

    viz = actviz.watch(model, tmp_path, every=1, extras=[actviz.Probe(IMAGE, gradcam=True)])
    assert noisy.calls == 1  # the probe went through once
    assert [module.training for module in model.modules()] == modes
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    assert all(param.grad is None for param in model.parameters())
    assert torch.equal(torch.get_rng_state(), random_state)

    with viz:  # and the probe still draws on the image step
        model(torch.randn(4, 3, 8, 8)).square().mean().backward()
    run = read_run(tmp_path)
    assert run.image_steps("probe/input") == [0] and run.image_steps("gradcam/0") == [0]
    assert hooks_left(model) == NO_HOOKS


# -- Grad-CAM -------------------------------------------------------------------------------------


def cam_by_hand(model: nn.Module, layer: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    kept = {}
    handle = layer.register_forward_hook(lambda module, args, output: kept.update(a=output))
    model.eval()
    logits = model(inputs)
    handle.remove()
    top = logits.argmax(dim=1)
    maps = []
    for index in range(inputs.shape[0]):
        gradient = torch.autograd.grad(logits[index, top[index]], kept["a"], retain_graph=True)[0][index]
        weights = gradient.mean(dim=(1, 2))  # alpha_c: the spatial mean of the gradient
        cam = torch.relu((weights[:, None, None] * kept["a"][index]).sum(dim=0))
        maps.append(cam / cam.max() if cam.max() > 0 else cam)
    model.train()
    return torch.stack(maps).detach()


def test_grad_cam_is_the_formula_and_leaves_nothing_behind():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 6, 3), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5))
    inputs = torch.randn(3, 3, 10, 10)
    cams = actviz.grad_cam(model, "2", inputs)
    assert cams.shape == (3, 6, 6)
    torch.testing.assert_close(cams, cam_by_hand(model, model[2], inputs))
    assert model.training and hooks_left(model) == NO_HOOKS
    assert all(param.grad is None for param in model.parameters())
    chosen = actviz.grad_cam(model, model[2], inputs, target=[0, 1, 2])  # a module and explicit classes
    assert chosen.shape == (3, 6, 6) and float(chosen.amax(dim=(1, 2)).min()) in (0.0, 1.0)
    dead = nn.Sequential(nn.Conv2d(3, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 8 * 8, 2))
    with torch.no_grad():
        dead[0].weight.zero_()
        dead[0].bias.fill_(-1.0)  # the ReLU after it never fires: every map is zero
    assert torch.equal(actviz.grad_cam(dead, "1", inputs), torch.zeros(3, 8, 8))


def test_gradcam_during_training_draws_over_the_probe_and_leaves_training_gradients_alone(tmp_path, read_run):
    model = small_cnn(inplace=False)
    twin = copy.deepcopy(model)
    probe = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    data = batches(2)
    with actviz.watch(model, tmp_path, every=1, extras=[actviz.Probe(probe, gradcam=True)]):
        train(model, len(data), data, lr=0.1)
    train(twin, len(data), data, lr=0.1)
    for param, twin_param in zip(model.parameters(), twin.parameters()):
        assert torch.equal(param.grad, twin_param.grad) and torch.equal(param, twin_param)
    run = read_run(tmp_path)
    assert run.image_steps("gradcam/2") == [0, 1]  # the last Conv2d
    assert run.image("gradcam/2", 0).shape == (8, 8, 3)


# -- the first NaN, named -------------------------------------------------------------------------


def test_the_first_nan_is_named_once_with_its_step_and_layer(tmp_path, read_run):
    model = small_cnn(inplace=False)
    data = batches(5)
    data[2][0, 0, 0, 0] = float("nan")  # reaches conv 0 first
    data[4][1, 1, 1, 1] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"NaN or Inf first at step 2, in the output of '0'") as caught:
        with actviz.watch(model, tmp_path, every=1) as viz:
            for batch in data:
                model(batch).sum().backward()
            viz.flush()
    assert sum("NaN or Inf first" in str(w.message) for w in caught) == 1  # once per run
    alerts = read_run(tmp_path).events.Tensors("alerts")
    assert [event.step for event in alerts] == [2]
    assert "'0'" in alerts[0].tensor_proto.string_val[0].decode()


def test_when_only_gradients_go_bad_the_layer_they_first_reach_is_named(tmp_path):
    model = small_cnn(inplace=False)
    with pytest.warns(RuntimeWarning, match=r"first at step 0, in the gradient flowing into '6'"):
        with actviz.watch(model, tmp_path, every=1) as viz:
            (model(batches(1)[0]).sum() * float("inf")).backward()  # outputs finite, gradients not
            viz.flush()


# -- the dashboards, laid out ---------------------------------------------------------------------


def test_the_custom_scalars_layout_covers_the_real_tags(tmp_path, read_run):
    model = small_cnn()
    inputs = batches(2)
    inputs[1][0, 0, 0, 0] = float("nan")  # non-finite counts are written once they are not zero
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1, layers=["conv", "relu", nn.Linear],
            statistics=["default", "update_ratio"]):
            train(model, len(inputs), inputs, lr=0.1)
    run = read_run(tmp_path)
    layout_events = run.events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(layout_events[0].tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    assert set(charts) == {"gradient norm", "activation std", "zero fraction", "non-finite counts", "update ratio"}
    scalars = {run.tensorboard_tag(tag) for tag in run.scalar_tags}  # the layout matches TensorBoard's names
    for title, patterns in charts.items():
        assert all(pattern.startswith("^") and pattern.endswith("$") for pattern in patterns)
        matched = {tag for tag in scalars for pattern in patterns if re.match(pattern, tag)}
        assert matched, title
    norms = {tag for tag in scalars if re.match(charts["gradient norm"][0], tag)}
    assert norms == {f"~gradient_stats/norm@{layer}" for layer in ("0", "1", "2", "4", "6")}


# -- update ratios --------------------------------------------------------------------------------


@pytest.mark.usefixtures("both_paths")
def test_the_update_ratio_is_what_plain_sgd_gives_by_hand(tmp_path, read_run):
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with actviz.watch(model, tmp_path, every=2, statistics=["default", "update_ratio"]):
            for step, batch in enumerate(batches(4)):
                optimizer.zero_grad()
                model(batch).square().mean().backward()
                if step % 2 == 0:
                    expected[step] = {name: (0.05 * param.grad.norm() / param.detach().norm()).item()
                                      for name, param in model.named_parameters()}
                optimizer.step()
    run = read_run(tmp_path)
    checked = 0
    for step, ratios in expected.items():
        for name, ratio in ratios.items():
            # float32 resolves w_after - w_before to about 1e-7 of |w|: smaller ratios (the bias of a conv
            # before a BatchNorm, whose gradient is about 0) are rounding noise, and an all-zero w has none
            if ratio > 1e-5:
                assert run.scalar(f"update_ratio/{name}", step) == pytest.approx(ratio, rel=1e-3), (step, name)
                checked += 1
    assert checked >= 10


# -- the report's Grad-CAM and load_images --------------------------------------------------------


def test_load_images_is_torchvisions_classification_preprocessing():
    from PIL import Image
    from torchvision import transforms

    path = "tests/data/chelsea.jpg"
    by_hand = transforms.Compose([
        transforms.Resize(round(96 * 256 / 224)), transforms.CenterCrop(96), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])(Image.open(path).convert("RGB"))
    batch = actviz.load_images([path, "tests/data/coffee.jpg"], size=96)
    assert batch.shape == (2, 3, 96, 96)
    torch.testing.assert_close(batch[0], by_hand, atol=1e-5, rtol=0)
    from actviz.report.errors import ImageError

    with pytest.raises(ImageError, match="cannot read image 'missing.jpg': no such file"):
        actviz.load_images(["missing.jpg"])


def test_report_gradcam_draws_the_top_class_over_the_input(tmp_path, read_run):
    from actviz.pictures.gradcam import grad_cam, gradcam_overlay

    result = actviz.report("alexnet", ["tests/data/chelsea.jpg"], weights="none", logdir=tmp_path / "runs",
                           html=tmp_path / "html", size=96, progress=False, gradcam=True)
    item = result.images[0]
    layer, picture = item.gradcam
    assert layer == "features.10"  # alexnet's last Conv2d
    torch.manual_seed(0)  # the report's random initialisation, seed 0
    import torchvision

    model = torchvision.models.alexnet()
    cam = grad_cam(model, layer, actviz.load_images(["tests/data/chelsea.jpg"], size=96))[0]
    assert torch.equal(picture, gradcam_overlay(item.input_image.float() / 255, cam))
    assert read_run(tmp_path / "runs" / "alexnet" / "chelsea").image_tags >= {"gradcam/features.10"}
    page = (tmp_path / "html" / "index.html").read_text()
    assert '<a href="chelsea/gradcam.png"' in page and "Grad-CAM of the top class" in page
    assert (tmp_path / "html" / "chelsea" / "gradcam.png").exists()
