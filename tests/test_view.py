"""The actviz view: TensorBoard's actviz tab in Chromium on a live server, the one-file export opened from ``file://``,
and the notebook page; plus the pieces under them (tags, step bins, flow pictures off by default).

Two runs of a four-layer CNN are written once: ``a`` with a NaN in its input at :data:`NAN_STEP` (its optimizer
skips that step, as AMP does), ``b`` the same but with inputs 1.5 times larger from :data:`PART_STEP` on. So by
hand: ``a`` has a ``nonfinite`` alert at ``NAN_STEP`` in ``stem`` (the first layer), and the runs part at
``PART_STEP`` in ``stem``. Every value the page shows is compared with the event file read back by TensorBoard's
``EventAccumulator``. One TensorBoard server and one Chromium serve the browser tests (marked slow); with
``ACTVIZ_FIGURES=docs/figures`` they also save the README's screenshots at 1366 x 768.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_tensorboard_server import CHROMIUM, CHROMIUM_FLAGS, STARTUP_TIMEOUT, TensorBoard, _missing_browser, wait_for
from torch import nn

import actviz
from actviz.cli import main
from actviz.run_diff import compare_runs, read_run
from actviz.view.binning import bin_steps
from actviz.view.export import local_provider
from actviz.view.plugin import ActvizPlugin

REPO = Path(__file__).resolve().parent.parent
STEPS, NAN_STEP, PART_STEP = 24, 8, 5
#: Forward order; by name they would be block1, block2, head, stem.
LAYERS = ["stem", "block1", "block2", "head"]
LAPTOP = {"width": 1366, "height": 768}
NOTEBOOK = REPO / "notebooks" / "view.ipynb"


def four_layer_cnn() -> nn.Sequential:
    return nn.Sequential(collections.OrderedDict(
        stem=nn.Conv2d(3, 8, 3, padding=1), relu1=nn.ReLU(), block1=nn.Conv2d(8, 8, 3, padding=1), relu2=nn.ReLU(),
        block2=nn.Conv2d(8, 16, 3, stride=2, padding=1), relu3=nn.ReLU(), flatten=nn.Flatten(),
        head=nn.Linear(16 * 8 * 8, 4),
    ))


def write_run(log_dir: Path, larger_from: int | None = None) -> None:
    torch.manual_seed(0)
    model = four_layer_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NaN's alert is what is tested, from the event file
        with actviz.watch(model, log_dir, every=1) as viz:
            assert viz.layer_names == LAYERS
            for step in range(STEPS):
                batch = torch.randn((4, 3, 16, 16), generator=data)
                if larger_from is not None and step >= larger_from:
                    batch = batch * 1.5
                if larger_from is None and step == NAN_STEP:
                    batch[0, 0, 0, 0] = float("nan")
                loss = nn.functional.cross_entropy(model(batch), torch.arange(4))
                optimizer.zero_grad()
                loss.backward()
                if torch.isfinite(loss):
                    optimizer.step()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("view_runs")
    write_run(root / "a")
    write_run(root / "b", larger_from=PART_STEP)
    return root


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """``{step: value}`` of one scalar tag, read back by TensorBoard's EventAccumulator, every point kept."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


# -- the pieces, without a browser ----------------------------------------------------------------------------


def test_bins_keep_the_max_and_the_last_and_a_nan_shows() -> None:
    series = {"a": (np.arange(1000), np.arange(1000) % 7.0), "b": ([3, 999], [math.nan, 2.0])}
    bins = bin_steps(series, ["a", "b"], columns=500)
    assert len(bins.first_steps) == 500 and bins.first_steps[:3] == [0, 2, 4] and bins.last_steps[-1] == 999
    expected = [max(step % 7 for step in (2 * c, 2 * c + 1)) for c in range(500)]
    rows_max, rows_last = json.loads(bins.matrix_json("max")), json.loads(bins.matrix_json("last"))
    assert rows_max[0] == expected and rows_last[0] == [(2 * c + 1) % 7 for c in range(500)]
    assert rows_max[1][1] == "NaN" and rows_max[1][0] is None and rows_max[1][-1] == 2.0


def test_the_tabs_comparison_names_what_actviz_diff_names() -> None:
    """The tab's comparison (numpy first, then compare_runs on the steps where a value may differ, a few rows at
    a time) finds the same first divergence as compare_runs on every step: values near the tolerance, NaN,
    infinities, statistics one run lacks, steps one run lacks, 200 random pairs of runs."""
    from actviz.run_diff import NoRunToCompare, RunStatistics
    from actviz.view.run_compare import ScalarTable, compare_tables

    def table(run: RunStatistics) -> ScalarTable:  # as the tab reads it: per (layer, statistic) its points
        series: dict = {}
        for step, values in run.steps.items():
            for key, value in values.items():
                series.setdefault(key, ([], []))[0].append(step)
                series[key][1].append(value)
        return ScalarTable.from_series(run.path, run.layers, {key: (np.array(steps), np.array(values))
                                                              for key, (steps, values) in series.items()})

    rng = np.random.default_rng(0)
    names = ["activation_mean", "activation_std", "gradient_norm"]
    parted = 0
    for case in range(200):
        steps = {}, {}
        for step in range(12):
            for layer in ("x", "y", "z"):
                for name in names:
                    value = float(rng.normal())
                    other = value * (1 + float(rng.choice([0.0, 2e-4, 4.9e-4, 5.1e-4, 9.9e-4, 1.1e-3, 1e-2]))
                                     * (rng.random() < 0.05))
                    if rng.random() < 0.01:
                        value, other = float(rng.choice([math.nan, math.inf])), float(rng.choice([math.nan, math.inf]))
                    if rng.random() > 0.01:  # now and then a step only the second run logged
                        steps[0].setdefault(step, {})[(layer, name)] = value
                    if rng.random() > 0.02:  # now and then a statistic only the first run holds
                        steps[1].setdefault(step, {})[(layer, name)] = other
        a, b = (RunStatistics(f"run{index}", ["x", "y", "z"], held) for index, held in enumerate(steps))
        expected = compare_runs(a, b)
        parted += expected.first_divergence is not None
        for rows_at_once in (1, 5, 4096):
            found = compare_tables(table(a), table(b), rows_at_once=rows_at_once)
            assert repr((found.first_divergence, found.differing, found.common_steps, found.layers)) == repr((
                expected.first_divergence, expected.differing, expected.common_steps, expected.layers)), case  # NaN
    assert 50 < parted < 200  # both answers are tested
    twice = ScalarTable.from_series("a", ["x"], {("x", "gradient_norm"): (np.array([0, 1, 1, 2]), np.array([1.0, 2, 3, 4])),
                                                 ("x", "activation_std"): (np.array([2, 0]), np.array([5.0, 6]))})
    assert twice.steps.tolist() == [0, 1, 2] and twice.held.tolist() == [[True, True], [True, False], [True, True]]
    assert twice.values[:, 0].tolist() == [1.0, 3.0, 4.0] and twice.values[[0, 2], 1].tolist() == [6.0, 5.0]  # the last
    with pytest.raises(NoRunToCompare, match="share no logged step"):
        compare_tables(table(RunStatistics("a", ["x"], {1: {("x", "gradient_norm"): 1.0}})),
                       table(RunStatistics("b", ["x"], {2: {("x", "gradient_norm"): 1.0}})))


def test_is_active_for_an_actviz_run_only(tmp_path: Path) -> None:
    from tensorboard.plugins.base_plugin import TBContext
    from torch.utils.tensorboard import SummaryWriter

    model = nn.Linear(3, 2)
    with actviz.watch(model, tmp_path / "watched"):
        model(torch.randn(4, 3)).sum().backward()
    assert ActvizPlugin(TBContext(data_provider=local_provider(tmp_path / "watched"))).is_active()
    with SummaryWriter(tmp_path / "own") as writer:
        writer.add_scalar("loss", 1.0, 0)
        writer.add_scalar("gradient_norm/fc", 1.0, 0)
    assert not ActvizPlugin(TBContext(data_provider=local_provider(tmp_path / "own"))).is_active()


def test_flow_pictures_are_off_by_default_and_one_option_away(tmp_path: Path, read_run: Any) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    for name, options in (("default", {}), ("on", {"options": actviz.Options(flow_pictures=True)})):
        with actviz.watch(model, tmp_path / name, every=1, **options):
            for _ in range(3):
                model(torch.randn(8, 4)).square().mean().backward()
    assert not any(tag.startswith("flow/") for tag in read_run(tmp_path / "default").image_tags)
    assert "flow/gradient_norm" in read_run(tmp_path / "on").image_tags


def test_the_tabs_zero_fraction_scale_starts_at_its_floor_and_ends_at_one(tmp_path: Path) -> None:
    """A layer with one zero in a million elements is noise: the tab's colour scale of the zero fraction is
    1e-3 to 1 (flow.colour_floor), so that cell is the darkest, not the brightest."""
    from torch.utils.tensorboard import SummaryWriter

    from actviz.view.run_data import RunData

    with SummaryWriter(tmp_path / "run") as writer:
        for step in range(3):
            writer.add_scalar("~activation_stats/zero_fraction@noisy", 1e-6, step)
            writer.add_scalar("~activation_stats/zero_fraction@relu", 0.5, step)
            writer.add_scalar("~activation_stats/std@relu", 1e-6, step)
    data = RunData(local_provider(tmp_path))
    zeros = data.heatmap("run", "activation_stats/zero_fraction")
    assert (zeros["low"], zeros["high"]) == (1e-3, 1.0)
    std = data.heatmap("run", "activation_stats/std")  # no floor: its own values
    assert std["low"] == pytest.approx(1e-6) and std["high"] == pytest.approx(1e-6)


def test_export_needs_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path), "--html", str(tmp_path / "view.html")]) == 2
    assert "no actviz run" in capsys.readouterr().err and not (tmp_path / "view.html").exists()


# -- in Chromium: the tab on a live TensorBoard, the exported file, the notebook ------------------------------


def plugin_path(folder: Path) -> str:
    """A folder that registers pyproject.toml's ``tensorboard_plugins`` entry point, for a checkout that is not
    installed with it; ``""`` where the installed actviz has it already."""
    from importlib.metadata import entry_points

    if any(entry.name == "actviz" for entry in entry_points(group="tensorboard_plugins")):
        return ""
    section = (REPO / "pyproject.toml").read_text().split("[project.entry-points.tensorboard_plugins]")[1]
    line = next(line for line in section.splitlines() if line.startswith("actviz"))
    name, target = (part.strip().strip('"') for part in line.split("=", 1))
    info = folder / "actviz_tab-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: actviz-tab\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[tensorboard_plugins]\n{name} = {target}\n")
    return str(folder)


@pytest.fixture(scope="module")
def tensorboard(runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TensorBoard]:
    extra = plugin_path(tmp_path_factory.mktemp("entry_point"))
    patch = pytest.MonkeyPatch()
    if extra:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), extra, os.environ.get("PYTHONPATH")])))
    server = TensorBoard(runs)
    patch.undo()
    try:
        wait_for(lambda: server.process.poll() is None and server.json("/data/plugin/actviz/runs")
                 and len(server.json("/data/plugin/actviz/heatmap", run="b", statistic="gradient_stats/norm")
                         ["first_steps"]) == STEPS, STARTUP_TIMEOUT, "tensorboard to serve both runs to the tab")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing_browser("playwright is not installed")
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        _missing_browser(f"{CHROMIUM} is missing")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"), headless=True,
            args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


def screenshot(page: Any, name: str) -> None:
    """Save the page at 1366 x 768 under $ACTVIZ_FIGURES (docs/figures for the README), if set."""
    folder = os.environ.get("ACTVIZ_FIGURES")
    if folder:
        page.mouse.move(1, 700)  # no tooltip in the picture
        page.screenshot(path=str(Path(folder) / name))


def open_view(browser: Any, url: str, in_tab: bool, offline: bool = False) -> tuple[Any, Any, list[str]]:
    """A laptop-sized page on ``url``: ``(page, where the view is, errors)``, the view the tab's iframe or the page;
    the page's errors, and with ``offline`` any request off the disk, are added to ``errors`` as they come."""
    page = browser.new_page(viewport=LAPTOP)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    if offline:
        page.on("request", lambda request: None if request.url.startswith(("file:", "data:"))
                else errors.append(f"requested {request.url}"))
    page.goto(url, timeout=30_000)
    view = page.frame_locator("iframe.plugin-iframe, iframe").first if in_tab else page
    view.locator(".av-root[data-ready=true]").wait_for(timeout=30_000)
    assert not errors, errors
    return page, view, errors


def hovered(view: Any, canvas: Any, row: int, column: int) -> dict[str, str]:
    """Hover the middle of a heat-map cell; what the tooltip says (its layer, step and value)."""
    size = {key: float(canvas.get_attribute(f"data-{key}")) for key in ("left", "top", "cell-width", "cell-height")}
    canvas.hover(position={"x": size["left"] + (column + 0.5) * size["cell-width"],
                           "y": size["top"] + (row + 0.5) * size["cell-height"]})
    tip = view.locator("#av-tip")
    return {key: tip.get_attribute(f"data-{key}") for key in ("layer", "step", "value")}


def check_cells(view: Any, run_dir: Path, statistic_tag: str) -> int:
    """Hover every cell of the shown heat map: each says its layer, step and the event file's value."""
    canvas = view.locator("canvas.av-heatmap").first
    assert int(canvas.get_attribute("data-rows")) == len(LAYERS)
    assert int(canvas.get_attribute("data-columns")) == STEPS  # 24 steps: one column each
    checked = 0
    for row, layer in enumerate(LAYERS):
        expected = scalars(run_dir, statistic_tag.format(layer=layer))
        assert sorted(expected) == list(range(STEPS))
        for step in sorted({0, PART_STEP, NAN_STEP, STEPS - 1, *range(0, STEPS, 6)}):
            tip = hovered(view, canvas, row, step)
            assert (tip["layer"], tip["step"]) == (layer, str(step))
            value = expected[step]
            if math.isnan(value):
                assert tip["value"] == "NaN", (layer, step)
            else:
                assert float(tip["value"]) == pytest.approx(value, rel=1e-6), (layer, step)
            checked += 1
    return checked


@pytest.mark.slow
def test_plugins_listing_lists_the_tab(tensorboard: TensorBoard) -> None:
    listing = tensorboard.json("/data/plugins_listing")["actviz"]
    assert listing["enabled"] and listing["tab_name"] == "actviz"
    assert listing["loading_mechanism"] == {"type": "IFRAME", "module_path": "/data/plugin/actviz/view.js"}


@pytest.mark.slow
def test_the_tab_shows_the_event_files_values_and_an_alert_opens_its_cell(
    tensorboard: TensorBoard, browser: Any, runs: Path
) -> None:
    started = time.perf_counter()
    page, view, errors = open_view(browser, f"{tensorboard.url}/#actviz", in_tab=True)
    assert page.locator(".mat-mdc-tab-link, a, .plugin-name, [role=tab]", has_text=re.compile("^ *actviz *$", re.I)).count() >= 1
    assert view.locator("#av-statistic").input_value() == "gradient_stats/norm"
    checked = check_cells(view, runs / "a", "~gradient_stats/norm@{layer}")
    # The alert: a NaN in stem's output at NAN_STEP, read back from the event file's alerts text too.
    alerts = view.locator("tr.av-alert")
    first = alerts.first
    assert (first.get_attribute("data-step"), first.get_attribute("data-layer")) == (str(NAN_STEP), "stem")
    assert "nonfinite" in first.inner_text()
    first.click()
    title = view.locator("#av-cell-title")
    view.locator(f'#av-cell-title[data-step="{NAN_STEP}"]').wait_for(timeout=10_000)
    assert (title.get_attribute("data-layer"), title.get_attribute("data-step")) == ("stem", str(NAN_STEP))
    canvas = view.locator("canvas.av-heatmap").first
    assert (canvas.get_attribute("data-selected-layer"), canvas.get_attribute("data-selected-step")) == ("stem", str(NAN_STEP))
    # The cell opens that layer's histograms and feature map at that step.
    assert view.locator(".av-histogram h3").first.inner_text() == f"output · step {NAN_STEP}"
    # TensorBoard keeps 10 pictures per tag: the one shown is the latest kept at or before the step.
    kept = tensorboard_image_steps(tensorboard, "a", "~feature_maps/stem")
    shown = max(step for step in kept if step <= NAN_STEP)
    assert view.locator("#av-feature-step").get_attribute("data-step") == str(shown)
    assert view.locator(".av-cell-image").get_attribute("data-step") == str(shown)
    screenshot(page, "view_tab.png")
    # The slider walks the feature maps: its first position is the first kept step.
    slider = view.locator("#av-feature-slider")
    slider.fill("0")
    assert view.locator("#av-feature-step").get_attribute("data-step") == str(kept[0])
    assert not errors, errors
    page.close()
    print(f"tab: {checked} cells hovered in {time.perf_counter() - started:.1f} s")


def tensorboard_image_steps(server: TensorBoard, run: str, tag: str) -> list[int]:
    return [entry["step"] for entry in server.json("/data/plugin/images/images", run=run, tag=tag, sample=0)]


@pytest.mark.slow
def test_two_runs_side_by_side_show_where_they_part(tensorboard: TensorBoard, browser: Any, runs: Path) -> None:
    page, view, errors = open_view(browser, f"{tensorboard.url}/#actviz", in_tab=True)
    view.locator("#av-compare").select_option("b")
    divergence = view.locator("#av-divergence")
    view.locator(f'#av-divergence[data-step="{PART_STEP}"]').wait_for(timeout=10_000)
    assert (divergence.get_attribute("data-step"), divergence.get_attribute("data-layer")) == (str(PART_STEP), "stem")
    assert view.locator("canvas.av-heatmap").count() == 2
    first = compare_runs(read_run(runs / "a"), read_run(runs / "b")).first_divergence  # actviz diff's answer
    assert (first.step, first.layer) == (PART_STEP, "stem")
    b_canvas = view.locator('canvas.av-heatmap[data-run="b"]')
    expected = scalars(runs / "b", "~gradient_stats/norm@head")[STEPS - 1]
    assert float(hovered(view, b_canvas, 3, STEPS - 1)["value"]) == pytest.approx(expected, rel=1e-6)
    screenshot(page, "view_compare.png")
    assert not errors, errors
    page.close()


@pytest.mark.slow
def test_the_exported_file_shows_the_same_values_from_disk(browser: Any, runs: Path, tmp_path: Path) -> None:
    file = tmp_path / "view.html"
    started = time.perf_counter()
    assert main(["export", str(runs), "--html", str(file)]) == 0
    print(f"export: {file.stat().st_size / 1e6:.2f} MB in {time.perf_counter() - started:.1f} s")
    page, view, errors = open_view(browser, file.as_uri(), in_tab=False, offline=True)
    view.locator("#av-statistic").select_option("activation_stats/std")
    view.locator('canvas.av-heatmap[data-statistic="activation_stats/std"]').wait_for(timeout=10_000)
    check_cells(view, runs / "a", "~activation_stats/std@{layer}")
    view.locator("tr.av-alert").first.click()
    view.locator(f'#av-cell-title[data-step="{NAN_STEP}"][data-layer="stem"]').wait_for(timeout=10_000)
    view.locator("#av-compare").select_option("b")
    view.locator(f'#av-divergence[data-step="{PART_STEP}"][data-layer="stem"]').wait_for(timeout=10_000)
    screenshot(page, "view_export.png")
    assert not errors, errors
    page.close()


@pytest.mark.slow
def test_the_notebook_renders_the_view_inline(browser: Any, tmp_path: Path) -> None:
    import nbclient
    import nbformat

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
               if "text/html" in output.get("data", {})]
    assert len(outputs) == 1
    html = outputs[0]["data"]["text/html"]
    assert html.startswith('<iframe class="actviz-view" srcdoc="') and "actviz-data" in html
    page = browser.new_page(viewport=LAPTOP)
    page.set_content(f"<!DOCTYPE html><body style='margin:0'>{html}</body>")
    view = page.frame_locator("iframe.actviz-view")
    view.locator(".av-root[data-ready=true]").wait_for(timeout=30_000)
    canvas = view.locator("canvas.av-heatmap").first
    run_dir = next(path.parent for path in (tmp_path / "runs").rglob("events.out.tfevents.*"))
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    layers = {tag.split("/")[1] for tag in events.Tags()["scalars"] if re.fullmatch(r"~gradient_stats/norm@.+", tag)}
    assert int(canvas.get_attribute("data-rows")) == len(layers)
    for row in range(len(layers)):
        tip = hovered(view, canvas, row, 0)
        (value,) = [event.value for event in events.Scalars(f"~gradient_stats/norm@{tip['layer']}")
                    if event.step == int(tip["step"])]
        assert float(tip["value"]) == pytest.approx(value, rel=1e-6)
    page.close()
