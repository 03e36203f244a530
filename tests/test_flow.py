"""Flow pictures, decoded back from the event file: rows, columns, colours and the colour bar."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import actviz
from actviz.diagnosis.flow import (
    CARD_IMAGE_BOX,
    MIN_TEXT_PX,
    MISSING_COLOUR,
    NAN_COLOUR,
    PALETTE,
    FlowHistory,
    colour_bar_range,
    draw_flow,
    flow_layout,
    has_something_to_show,
)
from actviz.common.results import StepResults, Summary

FORWARD_ORDER = ["stem", "body", "head"]


class Net(nn.Module):
    """Registered head first, run stem first: model order is not forward order."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(16, 4)
        self.body = nn.Linear(16, 16)
        self.stem = nn.Linear(8, 16)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.relu(self.stem(x) * self.scale))))


def run(log_dir, model: nn.Module, steps: int = 11, nan_at: int | None = None, **watch_kwargs) -> None:
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=1, image_every=5, options=actviz.Options(flow_pictures=True),
                          **watch_kwargs):
            for step in range(steps):
                inputs = torch.randn(16, 8)
                if step == nan_at:
                    inputs[0, 0] = math.nan
                loss = model(inputs).square().mean()
                optimizer.zero_grad()
                loss.backward()
                if step != nan_at:
                    optimizer.step()


def decode(image: np.ndarray, layout, low: int, high: int) -> np.ndarray:
    """Each cell's log10 value, read through the colour bar's own pixels (NaN for magenta or grey cells)."""
    bar_x = layout.bar_left + layout.bar_width // 2
    bar = image[layout.top:layout.top + layout.rows * layout.cell_height, bar_x].astype(float)
    values = np.full((layout.rows, layout.columns), np.nan)
    for row in range(layout.rows):
        for column in range(layout.columns):
            y, x = layout.cell_centre(row, column)
            colour = image[y, x].astype(float)
            if tuple(image[y, x]) in (NAN_COLOUR, MISSING_COLOUR):
                continue
            nearest = int(np.argmin(((bar - colour) ** 2).sum(axis=1)))
            values[row, column] = layout.bar_value(layout.top + nearest, low, high)
    return values


def test_gradient_norm_rows_are_forward_order_and_colours_read_back_as_the_logged_norms(tmp_path, read_run):
    run(tmp_path, Net(scale=1e-6))
    events = read_run(tmp_path)
    assert events.image_steps("flow/gradient_norm") == [0, 5, 10]
    image = events.image("flow/gradient_norm", 10)
    layout = flow_layout(FORWARD_ORDER, 11)  # every logging step so far: 0..10
    assert image.shape[:2] == (layout.height, layout.width)
    logged = np.array([[events.scalar(f"gradient_stats/norm@{layer}", step) for step in range(11)]
                       for layer in FORWARD_ORDER])
    low, high = colour_bar_range(logged)
    decoded = decode(image, layout, low, high)
    resolution = (high - low) / (layout.rows * layout.cell_height - 1) + (high - low) / 255
    np.testing.assert_allclose(decoded, np.log10(logged), atol=2 * resolution)
    # the darkest row is the layer whose output was scaled by 1e-6
    luminance = image[..., :3].astype(float) @ [0.299, 0.587, 0.114]
    rows = [np.mean([luminance[layout.cell_centre(row, column)] for column in range(11)]) for row in range(3)]
    assert FORWARD_ORDER[int(np.argmin(rows))] == "stem"


def test_colour_bar_has_a_tick_at_every_decade_of_the_logged_range(tmp_path, read_run):
    run(tmp_path, Net(scale=1e-6))
    events = read_run(tmp_path)
    image = events.image("flow/gradient_norm", 5)
    layout = flow_layout(FORWARD_ORDER, 6)
    logged = np.array([[events.scalar(f"gradient_stats/norm@{layer}", step) for step in range(6)]
                       for layer in FORWARD_ORDER])
    low, high = colour_bar_range(logged)
    assert low == math.floor(math.log10(logged.min())) and high == math.ceil(math.log10(logged.max()))
    height = layout.rows * layout.cell_height
    spacing = layout.text_height + 4 * layout.font_size / 10  # a label's digits and a gap of 4 tenths of the font
    every = max(1, math.ceil(spacing * (high - low) / height))
    for decade in range(high, low - 1, -every):
        y = round(layout.top + (high - decade) / (high - low) * (height - 1))
        assert tuple(image[y, layout.bar_left + layout.bar_width + 1][:3]) == (0, 0, 0), decade


def test_each_write_carries_the_whole_history_and_nan_has_its_own_colour(tmp_path, read_run):
    run(tmp_path, Net(), nan_at=3)
    events = read_run(tmp_path)
    for step, columns in ((0, 1), (5, 6), (10, 11)):
        image = events.image("flow/activation_std", step)
        layout = flow_layout(FORWARD_ORDER, columns)
        assert image.shape[:2] == (layout.height, layout.width)
    layout = flow_layout(FORWARD_ORDER, 11)
    image = events.image("flow/activation_std", 10)
    for row in range(3):  # NaN from the input on: every layer's output at step 3
        assert tuple(image[layout.cell_centre(row, 3)][:3]) == NAN_COLOUR
        assert tuple(image[layout.cell_centre(row, 2)][:3]) != NAN_COLOUR


def test_flow_tags_by_default_and_update_ratio_when_asked(tmp_path, read_run):
    run(tmp_path / "default", Net())
    # the Linear layers' outputs have no exact zero: flow/zero_fraction would be one colour, and is not written
    assert {tag for tag in read_run(tmp_path / "default").image_tags if tag.startswith("flow/")} == {
        "flow/gradient_norm", "flow/activation_std"}
    relu = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    run(tmp_path / "relu", relu, layers="all")  # a ReLU zeroes about half its inputs: now there is something to show
    events = read_run(tmp_path / "relu")
    assert "flow/zero_fraction" in events.image_tags and 0.2 < events.scalar("activation_stats/zero_fraction@1", 10) < 0.8
    run(tmp_path / "ratio", Net(), statistics=["default", "update_ratio"])
    events = read_run(tmp_path / "ratio")
    assert "flow/update_ratio" in events.image_tags
    params = ["head.weight", "head.bias", "body.weight", "body.bias", "stem.weight", "stem.bias"]
    image = events.image("flow/update_ratio", 10)
    assert image.shape[:2] == (flow_layout(params, 11).height, flow_layout(params, 11).width)


def test_draw_flow_by_hand_values():
    values = np.array([[1e-3, 1e-1], [np.nan, -np.inf], [0.0, 1.0]])
    picture = draw_flow("x", ["a", "b", "c"], [0, 10], values).permute(1, 2, 0).numpy()
    layout = flow_layout(["a", "b", "c"], 2)
    assert colour_bar_range(values) == (-3, 0)
    assert tuple(picture[layout.cell_centre(0, 0)]) == tuple(PALETTE[0])  # 1e-3: the bottom of the bar
    assert tuple(picture[layout.cell_centre(0, 1)]) == tuple(PALETTE[170])  # 1e-1: two thirds up
    assert tuple(picture[layout.cell_centre(2, 1)]) == tuple(PALETTE[255])  # 1: the top
    assert tuple(picture[layout.cell_centre(2, 0)]) == tuple(PALETTE[0])  # zero: the darkest colour
    assert tuple(picture[layout.cell_centre(1, 0)]) == NAN_COLOUR
    assert tuple(picture[layout.cell_centre(1, 1)]) == MISSING_COLOUR


@pytest.mark.parametrize("rows, columns", [(1, 1), (60, 3), (4, 1024)])
def test_layout_fits_every_size(rows, columns):
    names = [f"layer{i}" for i in range(rows)]
    picture = draw_flow("g", names, list(range(columns)), np.ones((rows, columns)))
    layout = flow_layout(names, columns)
    assert picture.shape == (3, layout.height, layout.width)
    assert layout.bar_left + layout.bar_width < layout.width


def test_history_keeps_the_latest_window_of_logging_steps():
    from actviz.diagnosis.flow import WINDOW

    flow = FlowHistory()
    for step in range(3 * WINDOW):
        summary = Summary(4, 0, 0, -1.0, 1.0, 0.0, float(step + 1), [4.0])
        flow.add(StepResults(step, activations={"fc": summary}, gradients={"fc": summary}))
    assert list(flow.steps) == list(range(2 * WINDOW, 3 * WINDOW))
    assert flow.values("gradient_norm")[0].tolist() == [math.sqrt(s + 1) for s in flow.steps]
    assert flow.last_pictures == {}  # no image step: nothing drawn


def test_strict_mode_draws_and_alerts_on_the_training_thread(tmp_path, read_run):
    model = Net(scale=1e-6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1, image_every=5, alerts={"warmup_steps": 0},
            options=actviz.Options(strict=True, flow_pictures=True)) as viz:
            for _ in range(6):
                loss = model(torch.randn(16, 8)).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    assert [(alert.step, alert.rule, alert.layer) for alert in viz.alerts] == [(2, "vanishing_gradients", "stem")]
    assert read_run(tmp_path).image_steps("flow/gradient_norm") == [0, 5]


# -- legible on a Time Series card, and nothing drawn when there is nothing to show -----------------


def dark_runs(region: np.ndarray) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each band of consecutive pixel rows of ``region`` (H, W, 3) with dark ink in them."""
    inked = (region.min(axis=2) < 128).any(axis=1)
    runs, start = [], None
    for y, dark in enumerate([*inked, False]):
        if dark and start is None:
            start = y
        elif not dark and start is not None:
            runs.append((start, y - start))
            start = None
    return runs


@pytest.mark.parametrize("rows, columns, name", [
    (4, 12, "conv{}"), (14, 50, "{}"), (3, 1024, "{}"), (1, 1, "fc"), (60, 200, "layer{}.0.conv2"),
    (200, 500, "encoder.layers.{}.self_attn.out_proj"),
])
def test_digits_are_at_least_10_px_tall_on_a_time_series_card(rows, columns, name):
    """The card scales the picture whole into CARD_IMAGE_BOX (301 x 215 px at least). Measured on the picture: the
    ink of each colour-bar label ("1e0", "1e-4": digits only) and of each row label, times that scale."""
    names = [name.format(row) for row in range(rows)]
    rng = np.random.default_rng(0)
    values = 10 ** rng.uniform(-4, 0, size=(rows, columns))
    picture = draw_flow("gradient_norm", names, list(range(0, 20 * columns, 20)), values).permute(1, 2, 0).numpy()
    height, width = picture.shape[:2]
    scale = min(CARD_IMAGE_BOX[0] / width, CARD_IMAGE_BOX[1] / height)  # object-fit: contain
    layout = flow_layout(names, columns)
    assert (layout.width, layout.height) == (width, height) and layout.card_scale == pytest.approx(scale)
    unit = layout.font_size / 10
    title_end = math.ceil(2 * unit + layout.line_height)  # the title's line, drawn 2 units down
    labels_end = layout.top + rows * layout.cell_height + math.ceil(layout.line_height / 2)
    assert picture[title_end:math.floor(layout.top - layout.line_height / 2)].min() > 128  # a blank gap below it
    tick_end = layout.bar_left + layout.bar_width + round(3 * unit)
    bar_labels = dark_runs(picture[title_end:labels_end, tick_end + 1:])
    row_labels = dark_runs(picture[title_end:labels_end, :layout.left - 1])
    assert len(bar_labels) >= 2 and len(row_labels) == math.ceil(rows / layout.label_every)
    for runs, what in ((bar_labels, "colour bar label"), (row_labels, "row label")):
        shortest = min(height for _, height in runs)
        assert shortest * scale >= MIN_TEXT_PX, (what, shortest, scale)
    assert min(height for _, height in bar_labels) >= layout.text_height  # what the layout promises
    # nothing is cut off at the right edge: the title, the last step and the decades fit
    assert picture[:, -2:].min() > 128


@pytest.mark.parametrize("rows, columns", [(4, 12), (14, 50), (3, 1024)])
def test_the_font_is_the_smallest_that_makes_10_px(rows, columns):
    """Text no larger than it must be: one pixel smaller, the same grid's digits would be under 10 px on the card."""
    from actviz.diagnosis.flow import _layout_at

    names = [f"layer{i}" for i in range(rows)]
    layout = flow_layout(names, columns)
    assert layout.text_height * layout.card_scale >= MIN_TEXT_PX
    one_less = _layout_at(names, columns, layout.cell_width, layout.cell_height, layout.font_size - 1)
    assert one_less.text_height * one_less.card_scale < MIN_TEXT_PX


def test_has_something_to_show_by_hand():
    zeros, constant = np.zeros((3, 5)), np.full((2, 4), 0.25)
    assert not has_something_to_show(zeros) and not has_something_to_show(constant)
    assert not has_something_to_show(np.array([[0.25, -np.inf], [-np.inf, 0.25]]))  # missing cells show nothing
    assert not has_something_to_show(np.full((2, 2), -np.inf))
    assert has_something_to_show(np.array([[0.0, 0.0], [0.0, 1e-6]]))  # one zero fraction above 0
    assert has_something_to_show(np.array([[0.5, np.nan]]))  # a NaN is magenta
    assert has_something_to_show(np.array([[0.0, 1.0]]))


def summary_of(values: list[float]) -> Summary:
    """The summary of a 1-D tensor of ``values``, counted by hand: num, nonfinite, zeros, min, max, sum, sum of squares."""
    return Summary(len(values), 0, sum(value == 0 for value in values), min(values), max(values), sum(values),
                   sum(value * value for value in values), [float(len(values))])


def test_a_statistic_with_nothing_to_show_is_not_drawn_until_it_has():
    flow = FlowHistory()
    picture = {"fc": torch.zeros(1, 2, 2)}  # an image step
    healthy = {"fc": summary_of([1.0, -2.0, 3.0]), "out": summary_of([0.5, 0.25])}  # no zeros anywhere
    flow.add(StepResults(0, activations=healthy, gradients=healthy, images=picture))
    # zero fraction 0 everywhere: no picture; std and norm differ between the layers: pictures
    assert sorted(flow.last_pictures) == ["flow/activation_std", "flow/gradient_norm"]
    flow.add(StepResults(1, activations=healthy, gradients=healthy, images=picture))
    assert "flow/zero_fraction" not in flow.last_pictures
    dying = {"fc": summary_of([0.0, 0.0, 3.0]), "out": summary_of([0.5, 0.25])}  # fc: 2 of 3 zero
    flow.add(StepResults(2, activations=dying, gradients=healthy, images=picture))
    assert flow.values("zero_fraction").tolist() == [[0.0, 0.0, 2 / 3], [0.0, 0.0, 0.0]]
    assert sorted(flow.last_pictures) == ["flow/activation_std", "flow/gradient_norm", "flow/zero_fraction"]
    layout = flow_layout(["fc", "out"], 3)
    drawn = flow.last_pictures["flow/zero_fraction"].permute(1, 2, 0).numpy()
    assert drawn.shape[:2] == (layout.height, layout.width)
    assert colour_bar_range(flow.values("zero_fraction")) == (-1, 0)  # 2/3 within 1e-1 .. 1e0
    assert tuple(drawn[layout.cell_centre(0, 2)]) == tuple(PALETTE[round(255 * (math.log10(2 / 3) + 1))])  # 210
    assert tuple(drawn[layout.cell_centre(1, 2)]) == tuple(PALETTE[0])  # zero: the darkest colour


def test_one_gradient_norm_everywhere_is_not_drawn():
    flow = FlowHistory()
    same = {"a": summary_of([3.0, 4.0]), "b": summary_of([-4.0, 3.0])}  # both norms 5, by hand
    flow.add(StepResults(0, activations=same, gradients=same, images={"a": torch.zeros(1, 2, 2)}))
    assert flow.values("gradient_norm").tolist() == [[5.0], [5.0]]
    assert "flow/gradient_norm" not in flow.last_pictures and "flow/activation_std" in flow.last_pictures


def test_a_noise_level_zero_fraction_is_the_darkest_cell_on_a_scale_from_a_floor_to_one():
    # a layer with one zero in a million elements beside layers without zeros: noise, not the brightest cell
    values = np.array([[0.0, 0.0], [1e-6, 1e-6], [0.0, 0.0]])
    picture = draw_flow("zero_fraction", ["a", "b", "c"], [0, 10], values).permute(1, 2, 0).numpy()
    layout = flow_layout(["a", "b", "c"], 2)
    assert colour_bar_range(values, "zero_fraction") == (-3, 0)  # 1e-3 to 1, not 1e-7 to 1e-6
    assert tuple(picture[layout.cell_centre(1, 0)]) == tuple(PALETTE[0])
    # half the elements zero (a ReLU's output) is two thirds up the same scale, whatever the other rows hold
    values[0] = 0.5
    picture = draw_flow("zero_fraction", ["a", "b", "c"], [0, 10], values).permute(1, 2, 0).numpy()
    assert tuple(picture[layout.cell_centre(0, 0)]) == tuple(PALETTE[round(255 * (3 + math.log10(0.5)) / 3)])
    # a statistic without a floor spans every decade logged: a vanished gradient is news
    assert colour_bar_range(np.array([1e-9, 1e-2]), "gradient_norm") == (-9, -2)
