"""Flow pictures: every watched layer over time, one image per statistic.

Each picture is a grid: one row per watched layer in forward order (top: the first to
run), one column per logging step so far (left: the first), each cell coloured by the
log10 of the value on a viridis scale (dark: small) with a labelled colour bar of whole
decades on the right. NaN cells are magenta, cells without a value (a layer that did not
run) light grey, zeros the darkest colour. Tags: ``flow/gradient_norm``,
``flow/activation_std``, ``flow/zero_fraction`` and, with ``update_ratio=True``,
``flow/update_ratio`` (one row per parameter). Each write carries the whole history, so
TensorBoard's sampling of 10 images per tag hides nothing; beyond :data:`MAX_COLUMNS`
logging steps, every other old column is dropped. :class:`FlowHistory` keeps the numbers
and draws on the writer thread, on image steps.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from .results import StepResults
from .tags import FLOW, UPDATE_RATIO

__all__ = ["FLOW_STATISTICS", "FlowHistory", "FlowLayout", "colour_bar_range", "draw_flow", "flow_layout"]

#: Statistic name -> how it is read from one step's results: (kind, attribute).
FLOW_STATISTICS = {
    "gradient_norm": ("gradients", "norm"),
    "activation_std": ("activations", "std"),
    "zero_fraction": ("activations", "zero_fraction"),
}
MAX_COLUMNS = 1024
NAN_COLOUR = (255, 0, 255)
MISSING_COLOUR = (210, 210, 210)
_VIRIDIS = [(68, 1, 84), (71, 44, 122), (59, 81, 139), (44, 113, 142), (33, 144, 141), (39, 173, 129),
            (92, 200, 99), (170, 220, 50), (253, 231, 37)]
#: 256 colours from dark to bright: viridis, whose lightness grows with the value.
PALETTE = np.array([
    [np.interp(i / 255 * 8, range(9), [anchor[c] for anchor in _VIRIDIS]) for c in range(3)] for i in range(256)
]).round().astype(np.uint8)


@dataclass(frozen=True)
class FlowLayout:
    """Where things are in a flow picture (pixels): the grid's corner and cell size, the colour bar."""

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

    def cell_centre(self, row: int, column: int) -> tuple[int, int]:
        """``(y, x)`` of the middle of a cell."""
        return self.top + row * self.cell_height + self.cell_height // 2, self.left + column * self.cell_width + self.cell_width // 2

    def bar_value(self, y: int, low: int, high: int) -> float:
        """The log10 value the colour bar shows at pixel row ``y`` (top: ``high``, bottom: ``low``)."""
        return high - (y - self.top) / (self.rows * self.cell_height - 1) * (high - low)


_fonts = threading.local()  # one font per thread: loading it decodes a whole font file (FreeType is not shared)


def _font() -> ImageFont.ImageFont:
    font = getattr(_fonts, "font", None)
    if font is None:
        font = _fonts.font = ImageFont.load_default()
        _fonts.lengths = {}
        _fonts.labels = {}
    return font


def _text_length(text: str) -> float:
    """The width of ``text`` in the default font, measured once per thread: layer names come back every step."""
    _font()
    found = _fonts.lengths.get(text)
    if found is None:
        if len(_fonts.lengths) > 4096:
            _fonts.lengths.clear()
        found = _fonts.lengths[text] = ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(text, font=_font())
    return found


def _labels(names: list[str], layout: FlowLayout) -> np.ndarray:
    """The row labels, right-aligned left of the grid, drawn once per thread and layout: ``(height, left, 3)``."""
    _font()
    key = (tuple(names), layout.left, layout.top, layout.cell_height, layout.height)
    found = _fonts.labels.get(key)
    if found is None:
        image = Image.new("RGB", (layout.left, layout.height), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for row, name in enumerate(names):
            y = layout.top + row * layout.cell_height + (layout.cell_height - 10) // 2
            draw.text((layout.left - 4 - _text_length(name), y), name, fill=(0, 0, 0), font=_font())
        found = np.asarray(image)
        if len(_fonts.labels) > 8:
            _fonts.labels.clear()
        _fonts.labels[key] = found
    return found


def flow_layout(names: list[str], columns: int) -> FlowLayout:
    """The geometry of a flow picture of ``names`` (rows) over ``columns`` logging steps.

    Example:
        >>> layout = flow_layout(["conv1", "fc"], 3)
        >>> layout.rows, layout.columns, layout.cell_centre(0, 0)[1] > layout.left
        (2, 3, True)
    """
    label = max((_text_length(name) for name in names), default=0)
    cell_height = max(12, min(40, 480 // max(1, len(names))))
    cell_width = max(2, min(24, 720 // max(1, columns)))
    left, top = int(label) + 8, 18
    bar_left = left + columns * cell_width + 12
    width = bar_left + 14 + int(_text_length("1e-10")) + 8
    return FlowLayout(left, top, cell_width, cell_height, len(names), columns, bar_left, 14, width,
                      top + len(names) * cell_height + 34)


def colour_bar_range(values: np.ndarray) -> tuple[int, int]:
    """Whole decades ``(low, high)`` spanning the finite positive ``values`` (``(-1, 0)`` if none).

    Example:
        >>> colour_bar_range(np.array([0.003, 0.5, np.nan, 0.0]))
        (-3, 0)
    """
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size == 0:
        return -1, 0
    low, high = math.floor(math.log10(positive.min())), math.ceil(math.log10(positive.max()))
    return low, max(high, low + 1)


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
    low, high = colour_bar_range(values)
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
    canvas[:, :layout.left] = _labels(names, layout)  # white but for the labels: the text below draws over it as before
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    font = _font()
    draw.text((2, 2), f"{title} (log10 colour; magenta: NaN)", fill=(0, 0, 0), font=font)
    every = max(1, math.ceil(12 * (high - low) / max(1, bottom - layout.top)))  # labels 12 px apart at least
    for decade in range(high, low - 1, -every):
        y = round(layout.top + (high - decade) / (high - low) * (bottom - layout.top - 1))
        draw.line([(layout.bar_left + layout.bar_width, y), (layout.bar_left + layout.bar_width + 3, y)], fill=(0, 0, 0))
        draw.text((layout.bar_left + layout.bar_width + 5, max(0, y - 5)), f"1e{decade}", fill=(0, 0, 0), font=font)
    if steps:
        draw.text((layout.left, bottom + 4), f"step {steps[0]}", fill=(0, 0, 0), font=font)
        last = f"step {steps[-1]}"
        draw.text((max(layout.left + 60, layout.bar_left - 4 - draw.textlength(last, font=font)), bottom + 4), last,
                  fill=(0, 0, 0), font=font)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()


class FlowHistory:
    """The flow statistics of every logging step so far; draws them into a step's pictures on image steps.

    Args:
        update_ratio: Also ``flow/update_ratio``, one row per parameter.
        image_steps: The watcher's image schedule: draws on these steps (and on any step with pictures).

    Example:
        >>> from actviz.results import Summary
        >>> flow = FlowHistory()
        >>> grad = Summary(4, 0, 0, -1.0, 1.0, 0.0, 4.0, [4.0])
        >>> flow.add(StepResults(0, activations={"fc": grad}, gradients={"fc": grad}, images={"fc": torch.zeros(1, 2, 2)}))
        >>> sorted(flow.last_pictures)
        ['flow/activation_std', 'flow/gradient_norm', 'flow/zero_fraction']
    """

    def __init__(self, update_ratio: bool = False, image_steps: Callable[[int], bool] | None = None) -> None:
        self.update_ratio = update_ratio
        self.image_steps = image_steps
        self.steps: list[int] = []
        # Per statistic: one array per step, indexed by row (rows in order of first appearance). A picture
        # stacks them in a few numpy ops: drawing at step 1,000 costs no Python loop over every value kept.
        self.columns: dict[str, list[np.ndarray]] = {name: [] for name in self._statistics()}
        self.rows: dict[str, list[str]] = {name: [] for name in self._statistics()}
        self._row_index: dict[str, dict[str, int]] = {name: {} for name in self._statistics()}
        self.last_pictures: dict[str, torch.Tensor] = {}

    def _statistics(self) -> list[str]:
        return [*FLOW_STATISTICS, *(["update_ratio"] if self.update_ratio else [])]

    def add(self, results: StepResults) -> None:
        """Record a stats step's values; on an image step, draw every statistic into ``results.pictures``."""
        if results.activations or results.gradients:
            self.steps.append(results.step)
            for name in self._statistics():
                found, rows, index = self._values(results, name), self.rows[name], self._row_index[name]
                for row in found:
                    if row not in index:
                        index[row] = len(rows)
                        rows.append(row)
                column = np.full(len(rows), -np.inf)
                column[[index[row] for row in found]] = list(found.values())
                self.columns[name].append(column)
            if len(self.steps) > MAX_COLUMNS:  # keep every other old column: the picture stays small
                keep = list(range(0, len(self.steps) - 1, 2)) + [len(self.steps) - 1]
                self.steps = [self.steps[i] for i in keep]
                self.columns = {name: [column[i] for i in keep] for name, column in self.columns.items()}
        image_step = bool(results.images) or any(not tag.startswith("flow/") for tag in results.pictures)
        image_step = image_step or (self.image_steps is not None and self.image_steps(results.step))
        if image_step and self.steps:
            self.last_pictures = {FLOW.format(statistic=name): self.picture(name) for name in self._statistics() if self.rows[name]}
            results.pictures.update(self.last_pictures)

    def picture(self, name: str) -> torch.Tensor:
        """The flow picture of statistic ``name`` over every step recorded."""
        return draw_flow(name, self.rows[name], self.steps, self.values(name))

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
