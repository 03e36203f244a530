"""actviz as people see it: a live ``tensorboard`` server, and its web page in headless Chromium.

One small CNN run is written once per module and served by one TensorBoard
process; the HTTP data API tests and the browser test share it. Everything the
run should show is computed here by hand from the model's shapes. Tags here are
TensorBoard's: actviz's scalars, histograms and images after a ``~``.

The Time Series tests serve a run of their own each, with the user's loss beside
actviz's tags (or a small BERT's, for its card titles), and measure the page at a laptop's 1366 x 768.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from torch import nn

import actviz
from actviz.diagnosis.flow import flow_layout
from actviz.pictures.rendering import grid_layout, tile_size

RUN = "cnn"
#: More image steps than TensorBoard keeps per tag by default (10), to see its sampling.
STEPS = 12
TENSORBOARD_DEFAULT_IMAGES = 10
INPUT_SHAPE = (4, 3, 16, 16)
#: Output shapes (channels, height, width) of the conv layers for a 16 x 16 input, by hand:
#: conv1 keeps 16 x 16 with padding 1; conv2 halves it with stride 2.
CONV_OUTPUTS = {"conv1": (8, 16, 16), "conv2": (16, 8, 8)}
#: ``mix`` (a 1x1 Conv1d over conv2's 64 positions) outputs (4, 64) per sample, drawn as a
#: viridis heat map enlarged 8 times, the most that keeps the long side within 512 px.
HEATMAP_LAYER, HEATMAP_SIZE = "mix", (4 * 8, 64 * 8)
LAYERS = ("conv1", "conv2", "mix", "fc")
PARAMETERS = tuple(f"{layer}.{kind}" for layer in LAYERS for kind in ("weight", "bias"))
STARTUP_TIMEOUT = 60.0
CHROMIUM = "/usr/bin/chromium"
#: Chromium must not look anything up on the network, or headless start-up hangs.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def small_cnn() -> nn.Sequential:
    return nn.Sequential(
        collections.OrderedDict(
            conv1=nn.Conv2d(3, 8, 3, padding=1),
            relu1=nn.ReLU(inplace=True),
            conv2=nn.Conv2d(8, 16, 3, stride=2, padding=1),
            relu2=nn.ReLU(inplace=True),
            positions=nn.Flatten(start_dim=2),
            mix=nn.Conv1d(16, 4, 1),
            flatten=nn.Flatten(),
            fc=nn.Linear(4 * 64, 4),
        )
    )


def write_run(log_dir: Path) -> None:
    """Train :func:`small_cnn` for :data:`STEPS` steps, logging everything on every step."""
    torch.manual_seed(0)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with actviz.watch(model, log_dir, every=1, options=actviz.Options(flow_pictures=True)) as viz:
        assert viz.layer_names == list(LAYERS)
        for _ in range(STEPS):
            loss = nn.functional.cross_entropy(model(torch.randn(INPUT_SHAPE)), torch.randint(0, 4, (4,)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def expected_image_size(layer: str) -> tuple[int, int]:
    """``(height, width)`` of the picture of ``layer``: a heat map, or a grid sized from the output shape."""
    if layer == HEATMAP_LAYER:
        return HEATMAP_SIZE
    channels, height, width = CONV_OUTPUTS[layer]
    return grid_layout(channels, *tile_size(height, width))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Call ``check`` until it returns something truthy, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except OSError as error:  # not listening yet, or reset while starting
            last_error = error
        time.sleep(0.25)
    raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what} (last error: {last_error})")


class TensorBoard:
    """A ``tensorboard`` subprocess on a free local port, and a small client for its data API."""

    def __init__(self, log_dir: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._output = tempfile.TemporaryFile()
        command = [
            sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir),
            "--host", "127.0.0.1", "--port", str(self.port), *flags,
        ]
        # Its own session, so that stop() also ends the data server it starts.
        self.process = subprocess.Popen(
            command, stdout=self._output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def get(self, path: str, **params: Any) -> bytes:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            return response.read()

    def json(self, path: str, **params: Any) -> Any:
        return json.loads(self.get(path, **params))

    def tags(self, plugin: str) -> set[str]:
        return set(self.json(f"/data/plugin/{plugin}/tags").get(RUN, {}))

    def image_steps(self, tag: str) -> list[dict[str, Any]]:
        return self.json("/data/plugin/images/images", run=RUN, tag=tag, sample=0)

    def wait_until_loaded(self, images_served: bool = True) -> None:
        """Wait until the server answers and has read the whole run.

        Images are the last thing actviz writes in a step, so the run is loaded once the
        last step's images are served (or, when images are not served, their tags are listed
        and the last step's histogram is).
        """

        def loaded() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"tensorboard exited with {self.process.returncode}:\n{self.output()}")
            if not all(tags <= self.tags(plugin) for plugin, tags in EXPECTED_TAGS.items()):
                return False
            if images_served:
                tags = EXPECTED_TAGS["images"]
                return all(max((e["step"] for e in self.image_steps(tag)), default=-1) == STEPS - 1 for tag in tags)
            histograms = self.json("/data/plugin/histograms/histograms", run=RUN, tag=f"~activations/{LAYERS[-1]}")
            return histograms[-1][1] == STEPS - 1

        try:
            wait_for(loaded, STARTUP_TIMEOUT, f"tensorboard at {self.url} to serve the run")
        except TimeoutError as error:
            served = {plugin: sorted(self.tags(plugin)) for plugin in EXPECTED_TAGS} if self.process.poll() is None else {}
            raise AssertionError(f"{error}\nserved: {served}\ntensorboard said:\n{self.output()}") from None

    def output(self) -> str:
        self._output.seek(0)
        return self._output.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        """End the server and its children. Safe to call more than once."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._output.close()


@contextlib.contextmanager
def serving(log_dir: Path, *flags: str, images_served: bool = True) -> Iterator[TensorBoard]:
    """Start TensorBoard on ``log_dir``, wait until it serves the run, and always stop it."""
    server = TensorBoard(log_dir, *flags)
    try:
        server.wait_until_loaded(images_served)
        yield server
    finally:
        server.stop()


#: flow/zero_fraction shows the ReLUs the layers leave out (relu_zeros): no watched layer has an exact zero.
FLOW_TAGS = {"~flow/gradient_norm", "~flow/activation_std", "~flow/zero_fraction"}
EXPECTED_TAGS = {
    "images": {f"~feature_maps/{layer}" for layer in (*CONV_OUTPUTS, HEATMAP_LAYER)} | FLOW_TAGS,
    "histograms": {f"~{kind}/{layer}" for kind in ("activations", "gradients") for layer in LAYERS}
    | {f"~{kind}/{param}" for kind in ("weights", "weight_grads") for param in PARAMETERS},
    # nonfinite and zero_fraction are written once they are not zero: never, on this healthy run before its ReLUs;
    # the ReLUs the layers leave out write theirs (relu_zeros); the loss, and the norms before and after clipping
    "scalars": {f"~activation_stats/{stat}@{layer}" for layer in LAYERS for stat in ("mean", "std")}
    | {f"~gradient_stats/norm@{layer}" for layer in LAYERS}
    | {"~activation_stats/zero_fraction@relu1", "~activation_stats/zero_fraction@relu2", "~loss/backward_root"}
    | {f"~gradient_clipping/{name}" for name in ("pre_clip_norm", "post_clip_norm", "coefficient")}
    | {f"~gradient_clipping/share@{layer}" for layer in LAYERS},
}


@pytest.fixture(scope="module")
def log_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tensorboard_logs")
    write_run(root / RUN)
    return root


@pytest.fixture(scope="module")
def tensorboard(log_root: Path) -> Iterator[TensorBoard]:
    """One server with TensorBoard's default flags, as a user would start it."""
    with serving(log_root) as server:
        yield server


# -- the HTTP data API ---------------------------------------------------------------------


def test_server_lists_the_run(tensorboard: TensorBoard) -> None:
    assert tensorboard.json("/data/runs") == [RUN]


@pytest.mark.parametrize("plugin", sorted(EXPECTED_TAGS))
def test_every_tag_is_served_by_its_dashboard(tensorboard: TensorBoard, plugin: str) -> None:
    served = tensorboard.tags(plugin)
    missing = EXPECTED_TAGS[plugin] - served
    assert not missing, f"{plugin} dashboard lacks {sorted(missing)}; it serves {sorted(served)}"
    assert served == EXPECTED_TAGS[plugin], f"unexpected {plugin} tags: {sorted(served - EXPECTED_TAGS[plugin])}"


@pytest.mark.parametrize("layer", [*CONV_OUTPUTS, HEATMAP_LAYER])
def test_feature_map_endpoint_returns_a_png_of_the_expected_size(tensorboard: TensorBoard, layer: str) -> None:
    entries = tensorboard.image_steps(f"~feature_maps/{layer}")
    data = tensorboard.get(f"/data/plugin/images/individualImage?{entries[-1]['query']}")
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        assert image.mode == ("P" if layer == HEATMAP_LAYER else "L")  # a heat map: indices into viridis
        assert (image.height, image.width) == expected_image_size(layer)
        low, high = image.convert("L").getextrema()
        assert low < high  # not a blank picture


def test_histograms_have_every_step(tensorboard: TensorBoard) -> None:
    events = tensorboard.json("/data/plugin/histograms/histograms", run=RUN, tag="~gradients/conv1")
    assert [step for _, step, _ in events] == list(range(STEPS))
    _, _, buckets = events[-1]
    assert sum(count for _, _, count in buckets) > 0


def test_scalars_have_every_step(tensorboard: TensorBoard) -> None:
    points = tensorboard.json("/data/plugin/scalars/scalars", run=RUN, tag="~activation_stats/std@conv1")
    assert [step for _, step, _ in points] == list(range(STEPS))
    assert all(value > 0.0 for _, _, value in points)


def test_custom_scalars_dashboard_serves_the_layout(tensorboard: TensorBoard) -> None:
    """The Custom Scalars tab puts every layer's value of one statistic on one chart."""
    layout = tensorboard.json("/data/plugin/custom_scalars/layout")
    charts = {chart["title"]: chart["multiline"]["tag"] for category in layout["category"] for chart in category["chart"]}
    assert charts["gradient norm"] == [r"^~gradient_stats/norm@.+$"]
    served = tensorboard.tags("scalars")
    assert {tag for tag in served if re.match(charts["gradient norm"][0], tag)} == {
        f"~gradient_stats/norm@{layer}" for layer in LAYERS
    }
    data = tensorboard.json("/data/plugin/custom_scalars/scalars", run=RUN, tag=charts["activation std"][0])
    assert data["regex_valid"]
    assert set(data["tag_to_events"]) == {f"~activation_stats/std@{layer}" for layer in LAYERS}
    assert all(len(events) == STEPS for events in data["tag_to_events"].values())  # a line per layer, every step


def test_flow_pictures_carry_every_step_even_when_tensorboard_serves_ten(tensorboard: TensorBoard) -> None:
    """The last flow picture served has one column per logging step: sampling hides no step."""
    entries = tensorboard.image_steps("~flow/gradient_norm")
    assert len(entries) == TENSORBOARD_DEFAULT_IMAGES and entries[-1]["step"] == STEPS - 1
    png = tensorboard.get(f"/data/plugin/images/individualImage?{entries[-1]['query']}")
    with Image.open(io.BytesIO(png)) as picture:
        layout = flow_layout(list(LAYERS), STEPS)
        assert picture.size == (layout.width, layout.height)


def test_default_flags_keep_only_ten_images_per_tag(tensorboard: TensorBoard) -> None:
    """TensorBoard samples images per tag: it serves 10 of our 12 steps, always with the last."""
    steps = [entry["step"] for entry in tensorboard.image_steps("~feature_maps/conv1")]
    assert len(steps) == TENSORBOARD_DEFAULT_IMAGES < STEPS
    assert steps[-1] == STEPS - 1


def test_samples_per_plugin_flag_serves_every_image_step(log_root: Path) -> None:
    """What the README recommends: ``--samples_per_plugin images=100`` keeps up to 100 per tag."""
    with serving(log_root, "--samples_per_plugin", "images=100") as server:
        steps = [entry["step"] for entry in server.image_steps("~feature_maps/conv1")]
    assert steps == list(range(STEPS))


def test_samples_per_plugin_zero_hides_every_image(log_root: Path) -> None:
    """Why the README does not suggest ``images=0``: TensorBoard 2.21 then serves no image at all.

    If a TensorBoard release makes 0 mean "all", this fails: update the README's advice.
    """
    with serving(log_root, "--samples_per_plugin", "images=0", images_served=False) as server:
        assert server.image_steps("~feature_maps/conv1") == []


def test_server_is_stopped_when_the_block_fails(log_root: Path) -> None:
    with pytest.raises(KeyError), serving(log_root) as server:
        raise KeyError("a failing test")
    assert server.process.poll() is not None
    with pytest.raises(OSError):
        server.get("/data/runs")


# -- the web page in headless Chromium -------------------------------------------------------


def _missing_browser(reason: str) -> None:
    """Skip loudly, but fail in CI, where scripts/test.sh must have installed the browser."""
    message = f"BROWSER TEST NOT RUN: {reason}. Run scripts/test.sh, or: apt-get install chromium && pip install playwright"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium for the module (a persistent context: its own profile, nothing shared)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing_browser("playwright is not installed")
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        _missing_browser(f"{CHROMIUM} is missing")
    profile = tmp_path_factory.mktemp("chromium_profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
            headless=True, args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 1100},
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def browser_page(browser: Any) -> Any:
    return browser.new_page()


def test_images_dashboard_shows_feature_map_grids(
    tensorboard: TensorBoard, browser_page: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    page.goto(f"{tensorboard.url}/#images", timeout=30_000)
    for layer in (*CONV_OUTPUTS, HEATMAP_LAYER):
        card = page.locator("tf-image-loader", has_text=f"~feature_maps/{layer}")
        image = card.locator("img")
        height, width = expected_image_size(layer)
        # naturalWidth is 0 until the PNG has loaded and decoded.
        expect(image).to_have_js_property("naturalWidth", width, timeout=30_000)
        expect(image).to_have_js_property("naturalHeight", height, timeout=5_000)
        assert image.bounding_box()["width"] > 0  # laid out, not hidden
    for tag in sorted(FLOW_TAGS):  # every layer over time: one row per layer, one column per step so far
        image = page.locator("tf-image-loader", has_text=tag).locator("img")
        # the zero fraction's rows go on with the ReLUs the layers leave out (relu_zeros), after the watched layers
        rows = [*LAYERS, *(["relu1", "relu2"] if tag == "~flow/zero_fraction" else [])]
        height, width = flow_layout(rows, STEPS).height, flow_layout(rows, STEPS).width
        expect(image).to_have_js_property("naturalWidth", width, timeout=30_000)
        expect(image).to_have_js_property("naturalHeight", height, timeout=5_000)
    screenshot = tmp_path_factory.mktemp("screenshots") / "images_dashboard.png"
    page.screenshot(path=str(screenshot))
    with Image.open(screenshot) as picture:
        assert picture.size == (1280, 1100)
    print(f"screenshot: {screenshot}")


# -- TensorBoard's default tab, Time Series, at a laptop's 1366 x 768 ---------------------------

LAPTOP = {"width": 1366, "height": 768}
#: The user's loss card must start this close to the top of the page (on a laptop: the first screen, and a bit).
FIRST_SCREEN_PX = 1000
DEMO_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "demo_train.py"
#: Time Series lays its cards out in columns of at least this width (TensorBoard 2.21, ``$metrics-min-card-width``).
TIME_SERIES_MIN_CARD_WIDTH = 335


def write_user_run(log_dir: Path, user_tag: str) -> None:
    """:func:`write_run`'s CNN under actviz, and the user's own ``SummaryWriter`` logging ``user_tag`` to the same folder."""
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with SummaryWriter(log_dir) as writer, actviz.watch(model, log_dir, every=1, options=actviz.Options(flow_pictures=True)):
        for step in range(STEPS):
            loss = nn.functional.cross_entropy(model(torch.randn(INPUT_SHAPE)), torch.randint(0, 4, (4,)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            writer.add_scalar(user_tag, loss.item(), step)


def write_demo_run(log_dir: Path) -> None:
    """scripts/demo_train.py's model, ``watch()`` and ``demo/`` scalars through ``viz.writer``, for 100 steps on a
    smaller data set instead of a minute (its first ``demo/loss`` is at step 100)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_train", DEMO_SCRIPT)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    torch.manual_seed(0)
    train_x, train_y = demo.make_dataset(256, 32, seed=0)
    test_x, test_y = demo.make_dataset(64, 32, seed=1)
    model = demo.small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4)
    with actviz.watch(model, log_dir, every=20, image_every=100, extras=[actviz.Probe(test_x[:1])]) as viz:
        for _ in range(100):  # steps 0 to 99; the demo logs demo/ every 100 steps, at step 100
            batch = torch.randint(0, len(train_x), (64,))
            loss = nn.functional.cross_entropy(model(train_x[batch]), train_y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        viz.writer.add_scalar("demo/loss", loss.item(), viz.step)
        viz.writer.add_scalar("demo/test_accuracy", accuracy, viz.step)


def time_series_tags(server: TensorBoard) -> set[str]:
    """Every tag the Time Series tab lists: what the page fetches when it opens."""
    found = server.json("/data/plugin/timeseries/tags")
    by_run = [*found["scalars"]["runTagInfo"].values(), *found["histograms"]["runTagInfo"].values()]
    return {tag for tags in by_run for tag in tags} | set(found["images"]["tagRunSampledInfo"])


@contextlib.contextmanager
def serving_time_series(log_root: Path, user_tag: str, last_image: str) -> Iterator[TensorBoard]:
    """TensorBoard on ``log_root``, once it lists ``user_tag`` and ``last_image``, the last tag actviz writes.

    Time Series opens the first two groups of its first list of tags, so the page must not open before
    every tag is listed.
    """
    server = TensorBoard(log_root)
    try:
        wait_for(lambda: {user_tag, last_image} <= time_series_tags(server), STARTUP_TIMEOUT,
                 f"tensorboard to list {user_tag} and {last_image}")
        yield server
    finally:
        server.stop()


def open_time_series(browser: Any, server: TensorBoard, user_tag: str) -> tuple[Any, float, list[str]]:
    """A fresh laptop-sized page on the Time Series tab: ``(page, top of the user's card, group names in order)``."""
    page = browser.new_page()
    page.set_viewport_size(LAPTOP)
    page.goto(f"{server.url}/#timeseries", timeout=30_000)
    card = page.locator(f'card-view:has(tb-truncated-path[title="{user_tag}"])')
    card.wait_for(timeout=30_000)  # a card is only drawn in an open group
    tops = [card.bounding_box()["y"]]
    while len(tops) < 3 or tops[-1] != tops[-2]:  # until the cards have settled in their grid
        assert len(tops) < 40, f"the card kept moving: {tops}"
        page.wait_for_timeout(500)
        tops.append(card.bounding_box()["y"])
    assert page.evaluate("document.scrollingElement.scrollTop") == 0
    groups = [title.get_attribute("title") for title in page.locator("metrics-card-group-toolbar .group-title").all()]
    return page, tops[-1], groups


@pytest.mark.parametrize("user_tag", ["loss", "train/loss", "demo/loss"])
def test_the_users_loss_is_on_the_first_screen_of_time_series(
    browser: Any, tmp_path: Path, user_tag: str
) -> None:
    """TensorBoard's default tab, as it opens at 1366 x 768: the user's loss card starts in the first 1,000 px.

    Time Series lists the groups (the tags' first parts) by name and opens the first two; actviz's all start with
    "~", after the user's.
    """
    if user_tag == "demo/loss":
        write_demo_run(tmp_path / "demo")
        last_image = "~probe/input"
    else:
        write_user_run(tmp_path / RUN, user_tag)
        last_image = "~flow/gradient_norm"
    with serving_time_series(tmp_path, user_tag, last_image) as server:
        page, top, groups = open_time_series(browser, server, user_tag)
        page.close()
    user_group = user_tag.split("/", 1)[0]
    print(f"{user_tag}: card top {top:.0f} px; groups {groups}")
    assert groups[0] == user_group and all(group.startswith("~") for group in groups if group != user_group), groups
    assert 0 < top < FIRST_SCREEN_PX, f"{user_tag}'s card starts {top:.0f} px down; groups: {groups}"


def expect_natural_size(image: Any, width: int, height: int) -> None:
    from playwright.sync_api import expect

    expect(image).to_have_js_property("naturalWidth", width, timeout=30_000)  # 0 until the PNG is decoded
    expect(image).to_have_js_property("naturalHeight", height, timeout=5_000)


def test_flow_pictures_text_is_at_least_10_px_on_a_time_series_card(browser: Any, tmp_path: Path) -> None:
    """The box a Time Series card fits a picture into is flow.CARD_IMAGE_BOX, and the digits of the flow pictures
    are at least MIN_TEXT_PX tall there: measured on the page, at a laptop's 1366 x 768."""
    from actviz.diagnosis.flow import CARD_IMAGE_BOX, MIN_TEXT_PX

    write_user_run(tmp_path / RUN, "loss")
    with serving_time_series(tmp_path, "loss", "~flow/gradient_norm") as server:
        page, _, groups = open_time_series(browser, server, "loss")
        assert "~flow" in groups
        page.locator('metrics-card-group-toolbar .group-title[title="~flow"]').click()  # open when asked
        images = page.locator('card-view:has(tb-truncated-path[title^="~flow/"]) img')
        images.first.wait_for(timeout=30_000)
        # this run's ReLUs have no exact zero: its zero fraction has nothing to show and is not drawn
        assert images.count() == len(FLOW_TAGS - {"~flow/zero_fraction"})
        layout = flow_layout(list(LAYERS), STEPS)  # the last step's picture, which a card shows first
        for index in range(images.count()):
            image = images.nth(index)
            expect_natural_size(image, layout.width, layout.height)
            # The <img> fills its box and "object-fit: contain" scales the picture whole to fit inside it.
            element = image.bounding_box()
            box = image.evaluate("img => img.parentElement.getBoundingClientRect().toJSON()")
            card_width = image.evaluate("img => img.closest('card-view').getBoundingClientRect().width")
            assert image.evaluate("img => getComputedStyle(img).objectFit") == "contain"
            assert element["width"] == pytest.approx(box["width"], abs=1)
            assert element["height"] == pytest.approx(box["height"], abs=1)
            scale = min(element["width"] / layout.width, element["height"] / layout.height)
            print(f"flow card: picture {layout.width} x {layout.height} in a {box['width']:.0f} x {box['height']:.0f} "
                  f"box: x{scale:.3f} (flow.py assumes x{layout.card_scale:.3f}); digits {layout.text_height} px "
                  f"-> {layout.text_height * scale:.1f} px on the card")
            # a card is 335 px wide or more: the box is narrowest there
            assert card_width >= TIME_SERIES_MIN_CARD_WIDTH
            assert card_width - box["width"] == pytest.approx(TIME_SERIES_MIN_CARD_WIDTH - CARD_IMAGE_BOX[0], abs=1)
            assert box["height"] == pytest.approx(CARD_IMAGE_BOX[1], abs=1)
            assert scale >= layout.card_scale * 0.99  # shown no smaller than flow.py assumes
            assert layout.text_height * scale >= MIN_TEXT_PX
        page.close()


# -- card titles with BERT's module names -----------------------------------------------------------

#: Sets each tag as the text of the first card title's two parts (TensorBoard's ``tb-truncated-path`` cuts a tag
#: at its last "/" and elides each part at its end) and reads what the card shows: ``[tag, shown last part, elided]``.
MEASURE_TITLES = """tags => {
  const [first, second] = document.querySelector('card-view tb-truncated-path').querySelectorAll('span');
  const kept = [first.textContent, second.textContent];
  const rows = tags.map(tag => {
    const cut = tag.lastIndexOf('/');
    first.textContent = tag.slice(0, cut);
    second.textContent = tag.slice(cut);
    const whole = second.textContent;
    if (second.scrollWidth <= second.clientWidth) return [tag, whole, false];
    let fits = 0;  // the longest start of the last part that fits before the ellipsis
    while (fits < whole.length) {
      second.textContent = whole.slice(0, fits + 1) + '\u2026';
      if (second.scrollWidth > second.clientWidth) break;
      fits += 1;
    }
    second.textContent = whole;
    return [tag, whole.slice(0, fits), true];
  });
  [first.textContent, second.textContent] = kept;
  return rows;
}"""


def write_bert_run(log_dir: Path) -> nn.Module:
    """Two steps of a small random BERT (two blocks, BERT's own module names), watched with the defaults."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    with actviz.watch(model, log_dir, every=1):
        for _ in range(2):
            model(input_ids=torch.randint(0, 64, (2, 8)), labels=torch.tensor([0, 1])).loss.backward()
    return model


def test_every_time_series_card_title_shows_its_statistic_and_which_layer_at_a_laptops_width(
    browser: Any, tmp_path: Path
) -> None:
    """At 1366 x 768, each card title of a BERT run shows its statistic whole and enough of its layer's tag name to
    tell it from every other card: TensorBoard keeps the last part of a tag, where actviz puts ``statistic@layer``.
    Measured in TensorBoard's own title element, at its card width, for every tag the run has."""
    from actviz.selection import layer_tag_names
    from actviz.tags import layer_statistic_of

    model = write_bert_run(tmp_path / "bert")
    tag_names = set(layer_tag_names(model).values())
    server = TensorBoard(tmp_path)
    try:
        tags = wait_for(lambda: sorted(tag for tag in time_series_tags(server) if tag.startswith("~")), STARTUP_TIMEOUT,
                        "tensorboard to list the run's tags")
        page = browser.new_page()
        page.set_viewport_size(LAPTOP)
        page.goto(f"{server.url}/#timeseries", timeout=30_000)
        page.locator("card-view tb-truncated-path").first.wait_for(timeout=30_000)
        page.wait_for_timeout(1_000)  # the cards settle in their grid
        card_width = page.evaluate("document.querySelector('card-view').getBoundingClientRect().width")
        rows = page.evaluate(MEASURE_TITLES, tags)
        page.screenshot(path=str(tmp_path / "time_series_bert.png"))
        page.close()
    finally:
        server.stop()
    assert card_width >= TIME_SERIES_MIN_CARD_WIDTH
    shown = {tag: last for tag, last, _ in rows}
    elided = [tag for tag, _, cut in rows if cut]
    print(f"{len(rows)} cards {card_width:.0f} px wide; the last part of {len(elided)} is cut: {elided}")
    layer_cards = 0
    for tag, last in shown.items():
        parts = layer_statistic_of(tag)
        if parts is not None:  # a per-layer statistic: the statistic whole, then the start of the layer's name
            group, statistic, layer = parts
            assert layer in tag_names, tag
            assert last.startswith(f"/{statistic}@") and len(last) > len(statistic) + 2, (tag, last)
            layer_cards += 1
        elif tag.rsplit("/", 1)[-1].split(".weight")[0].split(".bias")[0] in tag_names:  # a layer's histogram, picture
            assert len(last) > 1, (tag, last)
            layer_cards += 1
    assert layer_cards > 200  # 22 layers, each with several cards
    by_group: dict[str, list[str]] = collections.defaultdict(list)
    for tag, last in shown.items():
        by_group[tag.split("/", 1)[0]].append(last)
    for group, titles in by_group.items():  # no two cards of a group look the same: each tells its layer apart
        repeated = [title for title, count in collections.Counter(titles).items() if count > 1]
        assert not repeated, (group, repeated)
