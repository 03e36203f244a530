"""Flow pictures: every watched layer over time, one image per statistic.

Each picture is a grid: one row per watched layer in forward order (top: the first to
run), one column per logging step of the latest :data:`WINDOW` (left: the oldest), each
cell coloured by the log10 of the value on a viridis scale (dark: small) with a labelled
colour bar of whole decades on the right, from a floor (:mod:`~actviz.diagnosis.colour_scale`: a zero fraction's bar is 1e-3 to 1,
so a layer with one zero in a million is dark, not the brightest cell). NaN cells are magenta, cells without a value (a layer that did not
run) light grey, zeros the darkest colour. Tags: ``flow/gradient_norm``,
``flow/activation_std``, ``flow/zero_fraction`` and, with ``statistics=[..., "update_ratio"]``,
``flow/update_ratio`` (one row per parameter). A statistic with nothing to show (every value the same,
e.g. the zero fraction of layers with no exact zeros, and no NaN) is not drawn until it has. A picture shows
the latest :data:`WINDOW` logging steps, so from then on every picture has the same size in pixels and about
the same in bytes however long the run, and is drawn once every :data:`REDRAW_STEPS` logging steps at most
(docs/diagnosis.md gives the measured bytes); the scalars keep every step. :class:`FlowHistory` keeps the
numbers of the window and draws on the writer thread, on image steps.

The text is sized for TensorBoard's Time Series, which fits a picture into its card's
:data:`CARD_IMAGE_BOX`: digits are at least :data:`MIN_TEXT_PX` tall there, so a picture
with many steps or layers gets larger text, and row labels on every ``label_every``-th row.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from ..common.results import StepResults
from ..tags import FLOW, UPDATE_RATIO
from .colour_scale import BAR_FLOORS, colour_bar_range, colour_floor

__all__ = ["BAR_FLOORS", "CARD_IMAGE_BOX", "FLOW_STATISTICS", "MIN_TEXT_PX", "REDRAW_STEPS", "WINDOW",
           "FlowHistory", "FlowLayout", "colour_bar_range", "colour_floor", "draw_flow", "flow_layout",
           "has_something_to_show"]

#: Statistic name -> how it is read from one step's results: (kind, attribute).
FLOW_STATISTICS = {
    "gradient_norm": ("gradients", "norm"),
    "activation_std": ("activations", "std"),
    "zero_fraction": ("activations", "zero_fraction"),
}
#: Logging steps a flow picture shows: the latest 64, five pixels a column in the grid. A picture then costs
#: the same bytes at every image step however long the run, and 64 columns still show a trend and a spike.
WINDOW = 64
#: Once the window is full, an image step draws the flow pictures only if this many logging steps are new since
#: the last ones (a quarter of the window): each step is in 4 pictures, not 64, and they cost 1/16 of the bytes.
REDRAW_STEPS = WINDOW // 4
NAN_COLOUR = (255, 0, 255)
MISSING_COLOUR = (210, 210, 210)
_VIRIDIS = [(68, 1, 84), (71, 44, 122), (59, 81, 139), (44, 113, 142), (33, 144, 141), (39, 173, 129),
            (92, 200, 99), (170, 220, 50), (253, 231, 37)]
#: 256 colours from dark to bright: viridis, whose lightness grows with the value.
PALETTE = np.array([
    [np.interp(i / 255 * 8, range(9), [anchor[c] for anchor in _VIRIDIS]) for c in range(3)] for i in range(256)
]).round().astype(np.uint8)

#: ``(width, height)`` in screen pixels of the smallest box TensorBoard's Time Series scales an image card's
#: picture into, whole (TensorBoard 2.21, ``image_card_component``, ``object-fit: contain``): a card is at
#: least 335 px wide (its grid's ``minmax(335px, 1fr)``), 34 px of it padding and border, and 215 px of its
#: 320 px height hold the picture (measured in Chromium; tests/test_tensorboard_server.py checks both).
CARD_IMAGE_BOX = (301, 215)
#: The least height of digits, in screen pixels, in :data:`CARD_IMAGE_BOX`.
MIN_TEXT_PX = 10
#: Layer names longer than this are shown by their end, after an ellipsis: the grid keeps most of the card.
MAX_LABEL_CHARS = 16
#: The grid's size in the picture's pixels that cells aim for (each cell 1 to 24 px wide; rows up to 40 px tall,
#: or more when many steps make the grid wide).
GRID_WIDTH, GRID_HEIGHT = 320, 200
_BAR_LABEL = "1e-10"  # the widest colour-bar label kept room for
_WIDEST_STEP = 9_999_999  # the widest last step kept room for under the grid
#: The title of the widest statistic name, with the NaN legend: every picture keeps room for it.
_WIDEST_TITLE = "activation_std (log10), magenta: NaN"


@dataclass(frozen=True)
class FlowLayout:
    """Where things are in a flow picture (pixels): the grid's corner and cell size, the colour bar, the text."""

    left: int
    top: int
    cell_width: int
    cell_height: int
    rows: int
    columns: int
    bar_left: int
    bar_width: int
    width: int
    height: int
    font_size: int  # of every text, in the picture's pixels
    line_height: int  # a line of text at ``font_size``: its ascent and descent
    text_height: int  # the ink height of the shortest digit at ``font_size``
    label_every: int  # a row label on rows 0, label_every, 2 * label_every, ...

    @property
    def card_scale(self) -> float:
        """How much TensorBoard's Time Series scales the picture to fit :data:`CARD_IMAGE_BOX`."""
        return min(CARD_IMAGE_BOX[0] / self.width, CARD_IMAGE_BOX[1] / self.height)

    @property
    def unit(self) -> float:
        """Gaps and ticks grow with the text: one unit is a tenth of the font size."""
        return self.font_size / 10

    def cell_centre(self, row: int, column: int) -> tuple[int, int]:
        """``(y, x)`` of the middle of a cell."""
        return self.top + row * self.cell_height + self.cell_height // 2, self.left + column * self.cell_width + self.cell_width // 2

    def bar_value(self, y: int, low: int, high: int) -> float:
        """The log10 value the colour bar shows at pixel row ``y`` (top: ``high``, bottom: ``low``)."""
        return high - (y - self.top) / (self.rows * self.cell_height - 1) * (high - low)


_fonts = threading.local()  # fonts per thread and size: loading one decodes a whole font file (FreeType is not shared)


def _cache() -> threading.local:
    """This thread's fonts, text widths, drawn labels and layouts."""
    if not hasattr(_fonts, "fonts"):
        _fonts.fonts, _fonts.lengths, _fonts.labels, _fonts.layouts = {}, {}, {}, {}
    return _fonts


def _font(size: int) -> ImageFont.ImageFont:
    """Pillow's own font (Aileron) at ``size`` px; before Pillow 10.1, its one bitmap size."""
    font = _cache().fonts.get(size)
    if font is None:
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1: no sizes
            font = ImageFont.load_default()
        _fonts.fonts[size] = font
    return font


def _text_length(text: str, size: int) -> float:
    """The width of ``text`` at ``size``, measured once per thread: layer names come back every step."""
    font = _font(size)
    found = _cache().lengths.get((text, size))
    if found is None:
        if len(_fonts.lengths) > 4096:
            _fonts.lengths.clear()
        found = _fonts.lengths[text, size] = ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(text, font=font)
    return found


def _ink_height(text: str, size: int) -> int:
    """Pixel rows the glyphs of ``text`` cover at ``size``."""
    left, top, right, bottom = _font(size).getbbox(text)
    return bottom - top


def _label(name: str) -> str:
    """A row's label: ``name``, or its last characters after an ellipsis when longer than :data:`MAX_LABEL_CHARS`.

    Example:
        >>> _label("features.0"), _label("encoder.layers.11.self_attn")
        ('features.0', '…rs.11.self_attn')
    """
    return name if len(name) <= MAX_LABEL_CHARS else "…" + name[-(MAX_LABEL_CHARS - 1):]


def _labels(names: list[str], layout: FlowLayout) -> np.ndarray:
    """The row labels, right-aligned left of the grid, drawn once per thread and layout: ``(height, left, 3)``."""
    key = (tuple(names), layout)
    found = _cache().labels.get(key)
    if found is None:
        image = Image.new("RGB", (layout.left, layout.height), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        font, gap = _font(layout.font_size), 4 * layout.unit
        for row in range(0, len(names), layout.label_every):
            y = layout.top + row * layout.cell_height + layout.cell_height / 2
            draw.text((layout.left - gap, y), _label(names[row]), fill=(0, 0, 0), font=font, anchor="rm")
        found = np.asarray(image)
        if len(_fonts.labels) > 8:
            _fonts.labels.clear()
        _fonts.labels[key] = found
    return found


def _layout_at(names: list[str], columns: int, cell_width: int, cell_height: int, size: int) -> FlowLayout:
    """The layout of a grid of ``cell_width`` x ``cell_height`` cells with text of ``size`` px."""
    unit = size / 10
    ascent, descent = _font(size).getmetrics()
    line = ascent + descent  # a line of text; labels are centred on their row or tick
    label_width = max((_text_length(_label(name), size) for name in names), default=0)
    left = math.ceil(label_width + 8 * unit)
    top = math.ceil(3 * unit + 1.5 * line)  # the title, a gap, and the top half of the first row's or decade's label
    bar_left = left + columns * cell_width + round(12 * unit)
    bar_width = round(14 * unit)
    width = max(bar_left + bar_width + math.ceil(5 * unit + _text_length(_BAR_LABEL, size) + 4 * unit),
                math.ceil(_text_length(_WIDEST_TITLE, size) + 6 * unit),
                math.ceil(left + _text_length(f"step 0 step {_WIDEST_STEP}", size) + 10 * unit))
    height = top + len(names) * cell_height + math.ceil(4 * unit + line + 2 * unit)
    # rows far enough apart for a label each: the ink of a name with descenders, and a unit between
    label_every = max(1, math.ceil((_ink_height("Agy0", size) + unit) / cell_height))
    digits = min(_ink_height(digit, size) for digit in "0123456789")  # flat ones (1, 4, 7) are the shortest
    return FlowLayout(left, top, cell_width, cell_height, len(names), columns, bar_left, bar_width, width, height,
                      size, line, digits, label_every)


def _legible(layout: FlowLayout) -> bool:
    return layout.text_height * layout.card_scale >= MIN_TEXT_PX


def flow_layout(names: list[str], columns: int) -> FlowLayout:
    """The geometry of a flow picture of ``names`` (rows) over ``columns`` logging steps.

    The font is the smallest whose digits are :data:`MIN_TEXT_PX` tall on a Time Series card.

    Example:
        >>> layout = flow_layout(["conv1", "fc"], 3)
        >>> layout.rows, layout.columns, layout.cell_centre(0, 0)[1] > layout.left
        (2, 3, True)
        >>> layout.text_height * layout.card_scale >= MIN_TEXT_PX
        True
    """
    key = (tuple(names), columns)
    found = _cache().layouts.get(key)
    if found is not None:
        return found
    cell_width = max(1, min(24, GRID_WIDTH // max(1, columns)))
    # many steps make a wide grid: taller rows keep it near the card's shape, so it is not scaled to a sliver
    grid_height = max(GRID_HEIGHT, cell_width * columns * 2 // 3)
    cell_height = max(1, min(max(40, grid_height // 4), grid_height // max(1, len(names))))
    size = 10
    for _ in range(100):  # a few steps: text that grows makes the picture, and so the scale down, grow slowly
        found = _layout_at(names, columns, cell_width, cell_height, size)
        if _legible(found) or not isinstance(_font(size), ImageFont.FreeTypeFont):  # met, or one size only
            break
        size = max(size + 1, math.floor(size * MIN_TEXT_PX / (found.text_height * found.card_scale)))
    while size > 10 and _legible(smaller := _layout_at(names, columns, cell_width, cell_height, size - 1)):
        found, size = smaller, size - 1  # the jump above may overshoot: the smallest size that is enough
    if len(_fonts.layouts) > 64:
        _fonts.layouts.clear()
    _fonts.layouts[key] = found
    return found


def has_something_to_show(values: np.ndarray) -> bool:
    """Whether a flow picture of ``values`` shows anything: a NaN, or two different logged values.

    All zeros (the zero fraction of layers without exact zeros) or any one value everywhere draws one
    colour: such a statistic is left out. ``-inf`` marks a cell without a value.

    Example:
        >>> has_something_to_show(np.zeros((3, 4))), has_something_to_show(np.array([[0.0, -np.inf, 0.5]]))
        (False, True)
        >>> has_something_to_show(np.array([[2.0, -np.inf], [2.0, 2.0]])), has_something_to_show(np.array([[np.nan]]))
        (False, True)
    """
    logged = values[~np.isneginf(values)]
    if np.isnan(logged).any():
        return True
    return logged.size > 0 and bool(logged.min() < logged.max())


def draw_flow(title: str, names: list[str], steps: list[int], values: np.ndarray) -> torch.Tensor:
    """A flow picture: ``values[row, column]`` of layer ``names[row]`` at ``steps[column]``, as a
    ``(3, H, W)`` ``uint8`` tensor. NaN cells are magenta, missing ones (``-inf``) light grey; zeros and
    values below the colour bar take its darkest colour.

    Example:
        >>> picture = draw_flow("gradient_norm", ["a", "b"], [0, 10], np.array([[1e-3, 1e-2], [np.nan, 1.0]]))
        >>> picture.shape[0], picture.dtype
        (3, torch.uint8)
    """
    layout = flow_layout(names, len(steps))
    unit = layout.unit
    low, high = colour_bar_range(values, title)
    with np.errstate(divide="ignore", invalid="ignore"):
        position = (np.log10(np.maximum(values, 10.0 ** low)) - low) / (high - low)
    index = np.clip(np.nan_to_num(position * 255, nan=0), 0, 255).round().astype(np.intp)
    cells = PALETTE[index]
    cells[np.isnan(values)] = NAN_COLOUR
    cells[np.isneginf(values)] = MISSING_COLOUR
    grid = cells.repeat(layout.cell_height, axis=0).repeat(layout.cell_width, axis=1)
    canvas = np.full((layout.height, layout.width, 3), 255, dtype=np.uint8)
    bottom = layout.top + grid.shape[0]
    canvas[layout.top:bottom, layout.left:layout.left + grid.shape[1]] = grid
    bar_rows = np.linspace(255, 0, bottom - layout.top).round().astype(np.intp)
    canvas[layout.top:bottom, layout.bar_left:layout.bar_left + layout.bar_width] = PALETTE[bar_rows][:, None, :]
    canvas[:, :layout.left] = _labels(names, layout)  # white but for the labels; the title and legend below draw over it
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    font = _font(layout.font_size)
    legend = ", magenta: NaN" if np.isnan(values).any() else ""
    draw.text((2 * unit, 2 * unit), f"{title} (log10){legend}", fill=(0, 0, 0), font=font)
    tick_right = layout.bar_left + layout.bar_width + round(3 * unit)
    spacing = layout.text_height + 4 * unit  # labels this far apart at least
    every = max(1, math.ceil(spacing * (high - low) / max(1, bottom - layout.top)))
    for decade in range(high, low - 1, -every):
        y = round(layout.top + (high - decade) / (high - low) * (bottom - layout.top - 1))
        draw.line([(layout.bar_left + layout.bar_width, y), (tick_right, y)], fill=(0, 0, 0), width=max(1, round(unit)))
        draw.text((tick_right + 2 * unit, y), f"1e{decade}", fill=(0, 0, 0), font=font, anchor="lm")
    if steps:
        y = bottom + 4 * unit
        first, last = f"step {steps[0]}", f"step {steps[-1]}"
        draw.text((layout.left, y), first, fill=(0, 0, 0), font=font)
        if len(steps) > 1:
            width = draw.textlength(last, font=font)
            x = max(layout.left + draw.textlength(first, font=font) + 8 * unit, layout.bar_left - 4 * unit - width)
            draw.text((min(x, layout.width - 2 * unit - width), y), last, fill=(0, 0, 0), font=font)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()


class FlowHistory:
    """The flow statistics of the latest :data:`WINDOW` logging steps; draws them into a step's pictures on
    image steps: each one while the window fills, then once every :data:`REDRAW_STEPS` logging steps at most.

    Args:
        update_ratio: Also ``flow/update_ratio``, one row per parameter.
        image_steps: The watcher's image schedule: draws on these steps (and on any step with pictures).

    Example:
        >>> from actviz.common.results import Summary
        >>> flow = FlowHistory()
        >>> grad = Summary(4, 0, 0, -1.0, 1.0, 0.0, 4.0, [4.0])
        >>> flow.add(StepResults(0, activations={"fc": grad, "out": grad.divided_by(0.5)},
        ...                      gradients={"fc": grad, "out": grad}, images={"fc": torch.zeros(1, 2, 2)}))
        >>> sorted(flow.last_pictures)  # no zeros anywhere and one gradient norm, 2.0: nothing to show there
        ['flow/activation_std']
    """

    def __init__(self, update_ratio: bool = False, image_steps: Callable[[int], bool] | None = None) -> None:
        self.update_ratio = update_ratio
        self.image_steps = image_steps
        self.steps: deque[int] = deque(maxlen=WINDOW)
        # Per statistic: one array per step, indexed by row (rows in order of first appearance). A picture
        # stacks them in a few numpy ops, with no Python loop over every value kept.
        self.columns: dict[str, deque[np.ndarray]] = {name: deque(maxlen=WINDOW) for name in self._statistics()}
        self.rows: dict[str, list[str]] = {name: [] for name in self._statistics()}
        self._row_index: dict[str, dict[str, int]] = {name: {} for name in self._statistics()}
        self.last_pictures: dict[str, torch.Tensor] = {}
        self.new_steps = 0  # logging steps recorded since the pictures were last drawn

    def _statistics(self) -> list[str]:
        return [*FLOW_STATISTICS, *(["update_ratio"] if self.update_ratio else [])]

    def add(self, results: StepResults) -> None:
        """Record a stats step's values; on an image step, draw every statistic into ``results.pictures``."""
        if results.activations or results.gradients:
            self.steps.append(results.step)
            self.new_steps += 1
            for name in self._statistics():
                found, rows, index = self._values(results, name), self.rows[name], self._row_index[name]
                for row in found:
                    if row not in index:
                        index[row] = len(rows)
                        rows.append(row)
                column = np.full(len(rows), -np.inf)
                column[[index[row] for row in found]] = list(found.values())
                self.columns[name].append(column)
        image_step = bool(results.images) or any(not tag.startswith("flow/") for tag in results.pictures)
        image_step = image_step or (self.image_steps is not None and self.image_steps(results.step))
        if image_step and self.steps and (len(self.steps) < WINDOW or self.new_steps >= REDRAW_STEPS):
            steps, self.new_steps = list(self.steps), 0
            self.last_pictures = {FLOW.format(statistic=name): draw_flow(name, self.rows[name], steps, values)
                                  for name in self._statistics() if self.rows[name]
                                  for values in [self.values(name)] if has_something_to_show(values)}
            results.pictures.update(self.last_pictures)

    def picture(self, name: str) -> torch.Tensor:
        """The flow picture of statistic ``name`` over the steps of the window."""
        return draw_flow(name, self.rows[name], list(self.steps), self.values(name))

    def values(self, name: str) -> np.ndarray:
        """Statistic ``name`` as a ``(rows, steps)`` array; ``-inf`` where a row was not logged at a step."""
        columns = self.columns[name]
        values = np.full((len(self.rows[name]), len(columns)), -np.inf)
        for at, column in enumerate(columns):
            values[:len(column), at] = column
        return values

    def _values(self, results: StepResults, name: str) -> dict[str, float]:
        if name == "update_ratio":
            return {tag.removeprefix(UPDATE_RATIO.format(param="")): value for tag, value in results.scalars.items()
                    if tag.startswith(UPDATE_RATIO.format(param=""))}
        kind, attribute = FLOW_STATISTICS[name]
        found = {layer: math.nan if summary.nonfinite else float(getattr(summary, attribute))
                 for layer, summary in getattr(results, kind).items()}
        order = list(results.activations) + [layer for layer in found if layer not in results.activations]
        return {layer: found[layer] for layer in order if layer in found}
