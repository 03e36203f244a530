"""Tests of actviz.report: capture, images, weights, TensorBoard and HTML output."""

from __future__ import annotations

import builtins
import functools
import html
import io
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import actviz
from actviz.pictures.rendering import feature_map_grid
from actviz.report import (
    ImageError,
    ReportError,
    WeightsError,
    build_model,
    capture_layers,
    load_image,
    make_preprocess,
)
from actviz.selection import select_layers

DATA = Path(__file__).parent / "data"
CAT, COFFEE = DATA / "chelsea.jpg", DATA / "coffee.jpg"
SIZE = 64


def _events(run_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir), size_guidance={"images": 0, "tensors": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def _png(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    return np.asarray(image.convert("RGB") if image.mode == "P" else image)


def _conv_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Conv2d)]


# -- capture -----------------------------------------------------------------------------------


def _tiny_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 1))
    with torch.no_grad():
        net[0].bias[3] = -100.0  # channel 3 never positive: dead
    return net.eval()


def test_capture_conv_is_recorded_before_the_inplace_relu() -> None:
    net = _tiny_net()
    x = torch.randn(1, 3, 9, 9)
    with torch.no_grad():
        conv_out = net[0](x)
    records, output = capture_layers(net, x, [("0", net[0]), ("1", net[1])], max_channels=64)
    conv, relu = records
    assert conv.shape == (1, 4, 7, 7) and conv.type == "Conv2d" and conv.channels == 4
    assert conv.summary.mean == pytest.approx(conv_out.mean().item(), abs=1e-5)
    assert conv.summary.std == pytest.approx(conv_out.std().item(), rel=1e-4)
    assert conv.summary.min == pytest.approx(conv_out.min().item()) and conv.summary.min < -90
    assert conv.summary.zero_fraction == 0.0  # pre-ReLU values, although ReLU ran in place afterwards
    expected_dead = int((conv_out[0].amax(dim=(1, 2)) <= 0).sum())
    assert conv.dead_channels == expected_dead == 1
    assert torch.equal(conv.grid, feature_map_grid(conv_out[0]))
    relu_out = conv_out.clamp(min=0)
    assert relu.summary.zero_fraction == pytest.approx((relu_out == 0).float().mean().item())
    assert relu.summary.min == 0.0 and relu.dead_channels == 1
    assert torch.allclose(output, net[2](relu_out))
    assert all(len(module._forward_hooks) == 0 for module in net)


def test_capture_removes_hooks_when_forward_raises() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(2, 2))  # Linear(2) cannot take 7 columns
    with pytest.raises(RuntimeError):
        capture_layers(net, torch.randn(1, 3, 9, 9), [("0", net[0]), ("1", net[1])])
    assert all(len(module._forward_hooks) == 0 for module in net)


def test_report_layers_keywords_names_and_errors() -> None:
    with torch.device("meta"):
        net = torchvision.models.alexnet()
    assert [n for n, _ in select_layers(net, "conv")] == ["features.0", "features.3", "features.6", "features.8", "features.10"]
    assert [n for n, _ in select_layers(net, "relu")] == ["features.1", "features.4", "features.7", "features.9", "features.11", "classifier.2", "classifier.5"]
    assert [n for n, _ in select_layers(net, ["classifier.6", "features.0"])] == ["features.0", "classifier.6"]
    leaves = [n for n, m in net.named_modules() if n and not list(m.children())]
    assert [n for n, _ in select_layers(net, "all")] == leaves
    with pytest.raises(ReportError, match=r"unknown layer 'feature\.0'; did you mean 'features\.0'"):
        actviz.report(net, [CAT], layers=["feature.0"], logdir=None, progress=False)


# -- images ------------------------------------------------------------------------------------


def test_load_image_16_bit_is_scaled_not_clipped(tmp_path: Path) -> None:
    values = np.array([[0, 257, 32896], [65535, 1000, 60000]], dtype=np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    assert Image.open(path).mode.startswith("I")  # really a 16-bit file
    rgb = np.asarray(load_image(path))
    expected = np.round(values / 65535 * 255).astype(np.uint8)  # 0, 1, 128 / 255, 4, 234
    assert rgb.shape == (2, 3, 3)
    assert (rgb == expected[:, :, None]).all()


def test_load_image_rgba_is_drawn_on_white_and_gray_is_repeated(tmp_path: Path) -> None:
    rgba = np.array([[[255, 0, 0, 255], [0, 0, 0, 0], [0, 0, 255, 128]]], dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "alpha.png")
    rgb = np.asarray(load_image(tmp_path / "alpha.png")).astype(int)
    assert rgb[0, 0].tolist() == [255, 0, 0]  # opaque red stays red
    assert rgb[0, 1].tolist() == [255, 255, 255]  # transparent black becomes the white background
    assert rgb[0, 2].tolist() == pytest.approx([127, 127, 255], abs=1)  # half blue over white
    Image.fromarray(np.array([[10, 200]], dtype=np.uint8), "L").save(tmp_path / "gray.png")
    assert np.asarray(load_image(tmp_path / "gray.png")).tolist() == [[[10] * 3, [200] * 3]]


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"this is not an image\n", "not an image"), (CAT.read_bytes()[:3000], "truncated")],
    ids=["text", "truncated-jpeg"],
)
def test_load_image_errors_name_the_file(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "broken.jpg"
    path.write_bytes(content)
    with pytest.raises(ImageError, match=re.escape(str(path)) + ".*" + reason):
        load_image(path)


# -- weights -----------------------------------------------------------------------------------


class _Payload:
    """Unpickling this calls open(marker, "w"): a stand-in for any code a pickle can run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_malicious_pickle_does_not_run(tmp_path: Path, writer: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    payload = {"features.0.weight": _Payload(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    with pytest.raises(WeightsError, match="refusing to load .*weights_only"):
        actviz.report("alexnet", [CAT], weights=path, logdir=None, size=SIZE, progress=False)
    assert not marker.exists()
    # The payload is real: an unsafe load would have created the marker.
    if writer == "torch.save":
        torch.load(path, weights_only=False)
    else:
        pickle.loads(path.read_bytes())
    assert marker.exists()


def test_wrong_architecture_state_dict_names_missing_and_unexpected_keys(tmp_path: Path) -> None:
    torch.save(torchvision.models.squeezenet1_1().state_dict(), tmp_path / "squeezenet.pth")
    with torch.device("meta"):
        alexnet_keys = list(torchvision.models.alexnet().state_dict())
        squeeze_keys = list(torchvision.models.squeezenet1_1().state_dict())
    missing = [key for key in alexnet_keys if key not in squeeze_keys]
    unexpected = [key for key in squeeze_keys if key not in alexnet_keys]
    with pytest.raises(WeightsError) as caught:
        build_model("alexnet", tmp_path / "squeezenet.pth")
    message = str(caught.value)
    assert f"missing keys ({len(missing)})" in message and repr(missing[0]) in message
    assert f"unexpected keys ({len(unexpected)})" in message and repr(unexpected[0]) in message
    assert "features.0.weight: file (64, 3, 3, 3), model (64, 3, 11, 11)" in message  # same key, other shape


def test_checkpoint_dict_is_unwrapped_and_loaded(tmp_path: Path) -> None:
    source = _tiny_net()
    state = {f"module.{key}": value for key, value in source.state_dict().items()}  # as DataParallel saves
    torch.save({"epoch": 7, "state_dict": state, "optimizer": {"lr": torch.tensor(0.1)}}, tmp_path / "ckpt.pt")
    target = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 1))
    built = build_model(target, tmp_path / "ckpt.pt")
    assert built.module is target and built.categories is None and built.weights.endswith("ckpt.pt")
    assert not built.random_weights
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_missing_weights_file_and_unknown_model_are_explained(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"'.*nope\.pth' does not exist; pass DEFAULT .* none"):
        build_model("alexnet", tmp_path / "nope.pth")
    with pytest.raises(ReportError, match=r"unknown model 'vgg61'; did you mean .*'vgg16'"):
        build_model("vgg61")


def test_none_weights_are_seeded_and_leave_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = build_model("squeezenet1_1", "none").module
    assert torch.equal(torch.random.get_rng_state(), before)
    second = build_model("squeezenet1_1", "none").module
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


# -- end to end ----------------------------------------------------------------------------------


def _check_html(folder: Path, result: actviz.ReportResult) -> str:
    page = (folder / "index.html").read_text(encoding="utf-8")
    sources = re.findall(r'<img [^>]*src="([^"]+)"', page)
    expected = [f"{item.run}/input.png" for item in result.images]
    expected += [f"{item.run}/{layer.name}.png" for item in result.images for layer in item.layers]
    assert sorted(sources) == sorted(expected)
    for source in sources:
        width, height = Image.open(folder / source).size
        assert re.search(rf'src="{re.escape(source)}"[^>]*width="{width}" height="{height}"', page)
        # Each picture is a link to its own PNG, which the browser opens at full size.
        assert re.search(rf'<a href="{re.escape(source)}"[^>]*><img src="{re.escape(source)}"', page)
    assert page.count("<a href=") == len(sources) + page.count('<a href="#')
    assert "<script" not in page.lower() and "http://" not in page and "https://" not in page
    return page


@pytest.mark.parametrize(
    ("model", "images", "first_grid"),
    [
        # features.0 of AlexNet: (64 + 2*2 - 11) // 4 + 1 = 15 px, drawn 3x = 45 px, 8x8 tiles: 8*47+2 = 378
        ("alexnet", [CAT, COFFEE], (378, 378)),
        # features.0 of VGG11: 64 px (3x3, padding 1), drawn as is, 8x8 tiles: 8*66+2 = 530
        ("vgg11", [CAT], (530, 530)),
    ],
)
def test_report_writes_tensorboard_runs_and_html(
    tmp_path: Path, model: str, images: list[Path], first_grid: tuple[int, int]
) -> None:
    result = actviz.report(
        model, images, weights="none", logdir=tmp_path / "tb", html=tmp_path / "html", size=SIZE, progress=False
    )
    with torch.device("meta"):
        convs = _conv_names(torchvision.models.get_model(model))
    assert result.ok and result.layer_names == convs
    assert [item.run for item in result.images] == [path.stem for path in images]
    assert [p.name for p in (tmp_path / "tb").iterdir()] == [model]  # LOGDIR/<model>/<image>
    assert sorted(p.name for p in (tmp_path / "tb" / model).iterdir()) == sorted(path.stem for path in images)

    for item, path in zip(result.images, images):
        assert item.run_dir == tmp_path / "tb" / model / path.stem
        events = _events(item.run_dir)
        tags = events.Tags()
        assert sorted(tags["images"]) == sorted(["~input"] + [f"~feature_maps/{name}" for name in convs])
        assert sorted(tags["histograms"]) == sorted(f"~activations/{name}" for name in convs)
        assert "predictions/text_summary" not in tags["tensors"]  # random weights: no class names
        (input_event,) = events.Images("~input")
        assert (input_event.step, input_event.width, input_event.height) == (0, SIZE, SIZE)
        first = events.Images(f"~feature_maps/{convs[0]}")[0]
        assert (first.height, first.width) == first_grid
        for record in item.layers:
            (event,) = events.Images(f"~feature_maps/{record.name}")
            assert (event.height, event.width) == tuple(record.grid.shape[1:])
            assert np.array_equal(_png(event.encoded_image_string), record.grid[0].numpy())

    page = _check_html(tmp_path / "html", result)
    assert page.count('<tr><td class="mono">') == len(convs) * len(images)  # one stats row per layer and image
    assert "Conv2d" in page and "dead channels" in page
    assert "Top-5" not in page and 'class="preds"' not in page  # random weights: no class names, no empty box


def test_report_grid_is_the_watchers_rendering_of_the_conv_output(tmp_path: Path) -> None:
    built = build_model("alexnet", "none", size=SIZE)
    net, x = built.module, built.preprocess(load_image(CAT)).unsqueeze(0)
    with torch.no_grad():
        conv_out = net.features[0](x)
    actviz.report("alexnet", [CAT], logdir=tmp_path, layers="features.0", size=SIZE, progress=False)
    events = _events(tmp_path / "alexnet" / "chelsea")
    (image,) = events.Images("~feature_maps/features.0")
    assert np.array_equal(_png(image.encoded_image_string), feature_map_grid(conv_out[0])[0].numpy())
    (mean,) = events.Scalars("~activation_stats/mean@features.0")
    assert mean.value == pytest.approx(conv_out.mean().item(), abs=1e-5)
    assert (conv_out == 0).sum() == 0  # a conv output without exact zeros: zero_fraction is written once not zero
    assert "~activation_stats/zero_fraction@features.0" not in events.Tags()["scalars"]


def test_pretrained_style_state_dict_gets_top5_in_tensorboard_and_html(tmp_path: Path) -> None:
    torch.manual_seed(3)
    reference = torchvision.models.squeezenet1_1().eval()
    torch.save(reference.state_dict(), tmp_path / "squeeze.pth")
    result = actviz.report(
        "squeezenet1_1", [CAT], weights=tmp_path / "squeeze.pth", logdir=tmp_path / "tb",
        html=tmp_path / "html", size=SIZE, progress=False,
    )
    categories = torchvision.models.SqueezeNet1_1_Weights.DEFAULT.meta["categories"]
    with torch.no_grad():
        probabilities = reference(make_preprocess(None, SIZE)(load_image(CAT)).unsqueeze(0))[0].softmax(0)
    top = probabilities.topk(5)
    expected = [(categories[i], p) for p, i in zip(top.values.tolist(), top.indices.tolist())]
    got = result.images[0].predictions
    assert [label for label, _ in got] == [label for label, _ in expected]
    assert [p for _, p in got] == pytest.approx([p for _, p in expected], rel=1e-4)
    (text,) = _events(tmp_path / "tb" / "squeezenet1_1" / "chelsea").Tensors("predictions/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert all(label in table for label, _ in expected) and f"{expected[0][1]:.1%}" in table
    page = _check_html(tmp_path / "html", result)
    assert all(label in page for label, _ in expected)


def test_relu_layers_see_post_relu_values_and_model_runs_once_per_image(tmp_path: Path) -> None:
    calls: list[int] = []
    net = build_model("alexnet", "none", size=SIZE).module
    net.register_forward_pre_hook(lambda module, args: calls.append(1))
    result = actviz.report(net, [CAT, COFFEE], layers="relu", logdir=None, size=SIZE, progress=False)
    assert len(calls) == 2  # one forward pass per image, whatever the number of layers
    records = result.images[0].layers
    assert [r.name for r in records] == [n for n, m in net.named_modules() if isinstance(m, nn.ReLU)]
    assert all(r.summary.min >= 0 and r.summary.zero_fraction > 0 for r in records)
    last = records[-1]  # classifier ReLU: statistics, but no picture and no dead-channel count
    assert last.grid is None and last.shape == (1, 4096) and last.channels == 4096 and last.dead_channels is None
    assert len(net._forward_hooks) == 0 and all(len(m._forward_hooks) == 0 for m in net.modules())


def test_bad_image_is_reported_and_the_others_still_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    result = actviz.report(
        "alexnet", [broken, CAT], logdir=tmp_path / "tb", html=tmp_path / "html", size=SIZE, progress=False
    )
    assert not result.ok and list(result.failed) == [str(broken)]
    assert str(broken) in caplog.text
    assert [item.run for item in result.images] == ["chelsea"]
    assert [p.name for p in (tmp_path / "tb" / "alexnet").iterdir()] == ["chelsea"]
    page = _check_html(tmp_path / "html", result)
    assert "could not be processed" in page and "broken.png" in page


def test_progress_bar_counts_images_times_layers(capsys: pytest.CaptureFixture[str]) -> None:
    actviz.report("alexnet", [CAT, COFFEE], logdir=None, size=SIZE, progress=True)
    assert "10/10" in capsys.readouterr().err  # 2 images x 5 conv layers
    actviz.report("alexnet", [CAT], logdir=None, size=SIZE, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_channels": 0}, "max_channels must be positive, got 0; for example max_channels=64"),
        ({"size": 8}, "size must be an int of at least 16 pixels, got 8"),
        ({"layers": "convs"}, "unknown layer 'convs'"),
        ({"weights": "DEFAULT", "model": nn.Conv2d(3, 3, 1)}, "needs a torchvision model name"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs: dict, message: str) -> None:
    model = kwargs.pop("model", "alexnet")
    with pytest.raises(ReportError, match=re.escape(message)):
        actviz.report(model, [CAT], logdir=None, progress=False, **kwargs)


@pytest.mark.parametrize("name", ["vgg13", "vgg16", "vgg19", "vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn"])
def test_every_guaranteed_vgg_variant_reports_each_conv(name: str) -> None:
    # alexnet and vgg11 are covered end to end above; here each other VGG runs once, small.
    result = actviz.report(name, [CAT], logdir=None, size=32, progress=False)
    with torch.device("meta"):
        convs = [n for n, m in getattr(torchvision.models, name)().named_modules() if isinstance(m, nn.Conv2d)]
    assert result.ok and result.layer_names == convs
    (item,) = result.images
    assert [record.name for record in item.layers] == convs
    assert all(record.grid is not None and record.shape[0] == 1 for record in item.layers)


def _text(run_dir: Path, tag: str) -> str:
    (event,) = _events(run_dir).Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def test_two_models_get_their_own_runs_and_say_which_they_are(tmp_path: Path) -> None:
    # The same image and the default logdir layout: before, both models wrote into LOGDIR/chelsea.
    for model in ("alexnet", "vgg11"):
        actviz.report(model, [CAT], logdir=tmp_path, layers="features.0", size=SIZE, progress=False)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/*")) == ["alexnet/chelsea", "vgg11/chelsea"]
    for model in ("alexnet", "vgg11"):
        events = _events(tmp_path / model / "chelsea")
        assert events.Tags()["images"] == ["~feature_maps/features.0", "~input"]  # one model's tags, not two
        assert _text(tmp_path / model / "chelsea", "image").startswith(
            f"`{CAT}` (451×300), model `{model}`, weights none")


def test_a_run_folder_that_already_holds_events_gets_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    actviz.report("alexnet", [CAT], logdir=tmp_path, layers="features.0", size=SIZE, progress=False)
    assert "already holds the events" not in caplog.text
    actviz.report("alexnet", [CAT], logdir=tmp_path, layers="features.0", size=SIZE, progress=False)
    (warning,) = [r for r in caplog.records if "already holds the events" in r.getMessage()]
    assert warning.levelname == "WARNING" and str(tmp_path / "alexnet" / "chelsea") in warning.getMessage()


def test_random_weights_are_unmissable_on_the_page_in_tensorboard_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from actviz.cli import main
    from actviz.report.models import RANDOM_WEIGHTS_NOTE

    assert "not trained" in RANDOM_WEIGHTS_NOTE and "edges and colours, not learned features" in RANDOM_WEIGHTS_NOTE
    args = ["--image", str(CAT), "--size", str(SIZE), "--layers", "features.0", "--logdir", str(tmp_path / "tb")]
    assert main(["report", "--model", "alexnet", "--weights", "none", *args, "--html", str(tmp_path / "random")]) == 0
    assert f"alexnet: {RANDOM_WEIGHTS_NOTE}" in capsys.readouterr().out.splitlines()
    page = (tmp_path / "random" / "index.html").read_text(encoding="utf-8")
    assert "<title>What alexnet sees (random weights, untrained)</title>" in page
    banner = re.search(r'<p class="banner" role="note">(.*?)</p>', page)
    assert banner is not None and html.unescape(banner.group(1)) == RANDOM_WEIGHTS_NOTE
    assert page.index('class="banner"') < page.index("<section")  # above the first image
    assert _text(tmp_path / "tb" / "alexnet" / "chelsea", "image").endswith(f"**{RANDOM_WEIGHTS_NOTE}**")

    # A trained network (here: a state_dict file) and your own module get none of it.
    torch.save(torchvision.models.alexnet().state_dict(), tmp_path / "trained.pth")
    args[-1] = str(tmp_path / "tb-trained")
    assert main(["report", "--model", "alexnet", "--weights", str(tmp_path / "trained.pth"), *args,
                 "--html", str(tmp_path / "trained")]) == 0
    assert "Random weights" not in capsys.readouterr().out
    page = (tmp_path / "trained" / "index.html").read_text(encoding="utf-8")
    assert 'class="banner"' not in page and "random initialisation" not in page and "(random weights" not in page
    text = _text(tmp_path / "tb-trained" / "alexnet" / "chelsea", "image")
    assert "Random" not in text and text.endswith(f"weights state_dict {tmp_path / 'trained.pth'} (ImageNet class names)")
    own = actviz.report(_tiny_net(), [CAT], logdir=None, size=SIZE, progress=False)
    assert not own.random_weights and own.weights == "its own"


def test_html_numbers_are_formatted_one_way(tmp_path: Path) -> None:
    from actviz.report.html import format_number, format_percent

    result = actviz.report("alexnet", [CAT], logdir=None, html=tmp_path, size=SIZE, layers="all", progress=False)
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    rows = re.findall(r'<tr><td class="mono">.*?</tr>', page)
    assert len(rows) == len(result.images[0].layers) == 21
    for row, record in zip(rows, result.images[0].layers):
        cells = re.findall(r'<td class="num(?: warn)?">(.*?)</td>', row)
        summary = record.summary
        assert cells[:4] == [format_number(v) for v in (summary.mean, summary.std, summary.min, summary.max)]
        assert cells[4] == format_percent(record.relu_zero_fraction)
        # Four significant digits each: 0.01234, -1.060, 1235, 2.500e-7, or 0, or – for no finite value.
        digits = [re.sub(r"\D", "", cell.split("e")[0]).lstrip("0") for cell in cells[:4] if cell not in ("0", "–")]
        assert all(len(significant) == 4 for significant in digits), cells
        assert re.fullmatch(r"\d+\.\d%", cells[4]), cells
    built = build_model("alexnet", "none", size=SIZE)  # the first conv and ReLU, by hand
    with torch.no_grad():
        conv = built.module.features[0](built.preprocess(load_image(CAT)).unsqueeze(0))
    conv_cells = re.findall(r'<td class="num(?: warn)?">(.*?)</td>', rows[0])
    relu_cells = re.findall(r'<td class="num(?: warn)?">(.*?)</td>', rows[1])
    assert float(conv_cells[0]) == pytest.approx(conv.mean().item(), rel=1e-3)
    assert float(conv_cells[3]) == pytest.approx(conv.max().item(), rel=1e-3)
    assert relu_cells[4] == f"{(conv <= 0).float().mean().item():.1%}"
    assert conv_cells[4] == relu_cells[4] != "0.0%"  # the conv's row: the share its ReLU zeroes
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page)[1:]  # after the input's
    assert captions and all(re.fullmatch(r"\d+ of \d+ channels · mean \S+ · zero after ReLU \d+\.\d% · dead \d+", c)
                            for c in captions), captions


class _TwoNamesOneFile(nn.Module):
    """Layers whose names become the same file name (``blocks.a_b``), and one named like the input picture."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Module()
        self.blocks.add_module("a b", nn.Conv2d(3, 4, 3))
        self.blocks.add_module("a_b", nn.Conv2d(3, 2, 5))
        self.input = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.blocks, "a b")(x).mean() + self.blocks.a_b(x).mean() + self.input(x).mean()


def test_layers_whose_names_map_to_one_file_name_get_their_own_pictures(tmp_path: Path) -> None:
    result = actviz.report(_TwoNamesOneFile(), [CAT], logdir=None, html=tmp_path, size=SIZE, progress=False)
    (item,) = result.images
    assert [record.name for record in item.layers] == ["blocks.a b", "blocks.a_b", "input"]
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    for record in item.layers:  # each card's picture is its own layer's grid, not the last one written
        card = re.search(rf'<figure class="layer" id="[^"]*"><header><b>{re.escape(html.escape(record.name))}</b>'
                         r'.*?<img src="([^"]+)"', page)
        assert card is not None, record.name
        assert np.array_equal(_png((tmp_path / card.group(1)).read_bytes()), record.grid[0].numpy()), record.name
    sources = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert len(sources) == len(set(sources)) == 4  # the input and three grids, four files
    assert np.array_equal(_png((tmp_path / "chelsea" / "input.png").read_bytes()), item.input_image.permute(1, 2, 0).numpy())


def test_html_zero_after_relu_is_the_share_the_relu_zeroes(tmp_path: Path) -> None:
    # A conv output before its ReLU has no exact zeros (zero fraction 0.0%); the column shows what its ReLU zeroes.
    net = _tiny_net()  # Conv (channel 3 never positive) - ReLU(inplace) - Conv 1x1
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, module: nn.Module, args: tuple, out: torch.Tensor) -> None:  # returns None: out unchanged
        seen[name] = out.clone()

    net[0].register_forward_hook(functools.partial(keep, "conv"))
    net[1].register_forward_hook(functools.partial(keep, "relu"))
    result = actviz.report(net, [CAT], logdir=None, html=tmp_path, layers=["0", "1"], size=SIZE, progress=False)
    conv, relu = result.images[0].layers
    after_relu = (seen["relu"] == 0).sum().item() / seen["relu"].numel()  # by hand, from our own hook
    assert (seen["conv"] == 0).sum() == 0 and conv.summary.zero_fraction == 0.0  # the watcher's own statistic
    assert after_relu > 0.25  # channel 3 of 4 is all zero after the ReLU, and others partly
    assert conv.relu_zero_fraction == pytest.approx(after_relu)
    assert relu.relu_zero_fraction == pytest.approx(after_relu) == relu.summary.zero_fraction
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    rows = re.findall(r'<tr><td class="mono">.*?</tr>', page)
    header = re.findall(r"<th[^>]*>(.*?)</th>", page)
    column = header.index("zero after ReLU") - 3  # the first three cells (name, type, shape) are not "num"
    cells = [re.findall(r'<td class="num(?: warn)?">(.*?)</td>', row)[column] for row in rows]
    assert cells == [f"{after_relu:.1%}"] * 2


def _no_browser(reason: str) -> None:
    """Skip loudly, but fail in CI, where scripts/test.sh installs the browser (as tests/test_tensorboard_server.py)."""
    message = f"PRINT TEST NOT RUN: {reason}. Run scripts/test.sh, or: apt-get install chromium && pip install playwright"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _pdf_pages(page: Path, paper: str) -> int:
    """Print ``page`` to PDF with headless Chromium and count the PDF's page objects."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _no_browser("playwright is not installed")
    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists():
        _no_browser(f"{chromium} is missing")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            tab = browser.new_page()
            tab.goto(page.resolve().as_uri())
            pdf = tab.pdf(format=paper)
        finally:
            browser.close()
    pages = len(re.findall(rb"/Type\s*/Page(?![A-Za-z])", pdf))  # each page object, not the /Pages tree
    trees = re.findall(rb"/Type\s*/Pages\b(.*?)>>", pdf, re.S)  # the page tree: its root counts every page
    assert max(int(re.search(rb"/Count (\d+)", tree).group(1)) for tree in trees) == pages
    return pages


@pytest.mark.parametrize(("model", "gradcam"), [("alexnet", False), ("vgg16", True)])  # 5 and 13 conv layers
def test_html_prints_one_image_per_page(tmp_path: Path, model: str, gradcam: bool) -> None:
    images = [CAT, COFFEE, DATA / "astronaut.jpg"]
    result = actviz.report(model, images, weights="none", logdir=None, html=tmp_path, size=SIZE, progress=False,
                           gradcam=gradcam)
    assert len(result.images) == 3
    for paper in ("A4", "Letter"):
        assert _pdf_pages(result.html, paper) == 3, paper


class _LongName(nn.Module):
    """A layer with a 300-character name: longer than a file name may be."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("stage_" + "x" * 294, nn.Conv2d(3, 4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return next(iter(self.children()))(x).mean()


def test_a_300_character_layer_name_gets_its_picture(tmp_path: Path) -> None:
    result = actviz.report(_LongName(), [CAT], logdir=None, html=tmp_path, size=SIZE, progress=False)
    (item,) = result.images
    (record,) = item.layers
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    (source,) = [src for src in re.findall(r'<img [^>]*src="([^"]+)"', page) if not src.endswith("input.png")]
    assert len(Path(source).name) <= 104
    assert np.array_equal(_png((tmp_path / source).read_bytes()), record.grid[0].numpy())
