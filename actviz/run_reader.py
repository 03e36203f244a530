"""A run folder's per-layer statistics read back from its event files, step by step, for ``actviz diff``.

Each event file is read record by record (:func:`~actviz.output.run_folders.read_records`, TensorBoard's
protobufs; no torch call), every record's checksums checked. :class:`RunStream` walks a run's steps in step
order, holding one step's values (``{(layer, statistic): value}`` of :data:`STATISTICS`) at a time, whatever the
run's length; :func:`read_run` keeps them all (:class:`RunStatistics`).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .output.run_folders import EVENT_FILE_PREFIX, DamagedEventFile, is_event_file, read_records
from .tags import LAYERS, TENSORBOARD_PREFIX

__all__ = ["COUNTS", "STATISTICS", "NoRunToCompare", "RunStatistics", "RunStream", "read_run"]

#: The statistics compared, in the order a layer's are checked: name -> (tag prefix, what is read).
#: ``stat:`` reads the scalar ``{prefix}{stat}@{layer}``, ``histo:`` a field of the histogram ``{prefix}{layer}``.
STATISTICS = {
    "activation_mean": ("activation_stats/", "stat:mean"),
    "activation_std": ("activation_stats/", "stat:std"),
    "activation_sum": ("activations/", "histo:sum"),
    "activation_sum_squares": ("activations/", "histo:sum_squares"),
    "activation_nonfinite": ("activation_stats/", "stat:nonfinite"),
    "gradient_norm": ("gradient_stats/", "stat:norm"),
    "gradient_sum": ("gradients/", "histo:sum"),
    "gradient_sum_squares": ("gradients/", "histo:sum_squares"),
    "gradient_nonfinite": ("gradient_stats/", "stat:nonfinite"),
}
#: The number of elements each histogram's sums add, kept with the statistics (not compared): what tells a sum
#: that is 0 up to rounding (:func:`actviz.run_diff.rounding_floor`).
COUNTS = {"activations/": "activation_count", "gradients/": "gradient_count"}
_BY_SOURCE = {(prefix, source): name for name, (prefix, source) in STATISTICS.items()}


@dataclass
class RunStatistics:
    """One run read back: its folder, its layers in forward order, and per step ``{(layer, statistic): value}``."""

    path: str
    layers: list[str]
    steps: dict[int, dict[tuple[str, str], float]]
    problems: list[str] = field(default_factory=list)

    def walk(self) -> Iterator[tuple[int, dict[tuple[str, str], float]]]:
        """The steps in order, each with its values."""
        return iter(sorted(self.steps.items()))


class NoRunToCompare(Exception):
    """A folder holds no actviz run, or two runs share no logged step or layer: exit status 2."""


class RunStream:
    """A run folder's statistics, read one step at a time in step order: what is held is one step's values and
    the layers' names, whatever the run's length (:func:`compare_runs` walks two of them side by side).

    ``layers`` grows as the walk meets layers (the ``layers`` text's order, then the order outputs first
    appear); ``problems`` gets each damaged file, and ``steps_seen`` counts the steps walked, with the first
    and last. Raises :class:`NoRunToCompare` where the folder holds no event file.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.root = Path(folder)
        if not self.root.is_dir():
            raise NoRunToCompare(f"{ascii(str(self.root))} is not a folder")
        self.path = str(self.root)
        self.files = _event_files(self.root)
        self.problems: list[str] = []  # damaged files
        self.notes: list[str] = []  # what was left out, not damage
        self.steps_seen: list[int] = [0, -1, -1]  # how many, the first, the last
        self._table: list[str] = []
        self._outputs: dict[str, None] = {}  # ordered set
        self._seen: set[str] = set()
        self._layers: list[str] | None = None

    @property
    def layers(self) -> list[str]:
        """The layers met so far, in forward order."""
        if self._layers is None:
            ordered = [layer for layer in dict.fromkeys([*self._table, *self._outputs]) if layer in self._seen]
            self._layers = ordered + sorted(self._seen - set(ordered))
        return self._layers

    def walk(self) -> Iterator[tuple[int, dict[tuple[str, str], float]]]:
        """``(step, {(layer, statistic): value})`` in step order; a later file's value of a step replaces an
        earlier one's. A step with none of :data:`STATISTICS` is left out."""
        merged = heapq.merge(*(self._file_steps(file) for file in self.files), key=lambda item: item[0])
        current: tuple[int, dict[tuple[str, str], float]] | None = None
        for step, values in merged:
            if current is not None and step == current[0]:
                current[1].update(values)
                continue
            if current is not None and current[1]:
                yield self._finished(*current)
            current = (step, values)
        if current is not None and current[1]:
            yield self._finished(*current)
        if not self.steps_seen[0]:
            raise NoRunToCompare(f"no actviz run in {ascii(self.path)}: no per-layer statistics (~activation_stats/, "
                                 "~gradient_stats/). Give the folder actviz.watch() wrote to.")

    def _finished(self, step: int, values: dict[tuple[str, str], float]) -> tuple[int, dict[tuple[str, str], float]]:
        for layer, statistic in list(values):  # NaN/Inf counts are written from their first step that is not 0
            if layer not in self._seen:
                self._seen.add(layer)
                self._layers = None
            if statistic in ("activation_mean", "gradient_norm"):
                values.setdefault((layer, statistic.split("_")[0] + "_nonfinite"), 0.0)
        count, first, _ = self.steps_seen
        self.steps_seen = [count + 1, first if count else step, step]
        return step, values

    def _file_steps(self, file: Path) -> Iterator[tuple[int, dict[tuple[str, str], float]]]:
        """One file's steps in its order, consecutive events of a step together; a step that goes back is
        left out and named in ``problems``."""
        from google.protobuf.message import DecodeError
        from tensorboard.compat.proto.event_pb2 import Event

        step: int | None = None
        values: dict[tuple[str, str], float] = {}
        backwards = 0
        try:
            for data in read_records(file):
                try:
                    event = Event.FromString(data)
                except DecodeError:  # whole by its checksums, but not an event
                    continue
                if step is not None and event.step != step:
                    if event.step < step:  # a user's own value at an earlier step (sink=SummaryWriter): not actviz's, or out of order
                        backwards += any(_read_value(value, {}, {}) for value in event.summary.value)
                        continue
                    yield step, values
                    values = {}
                step = event.step
                for value in event.summary.value:
                    if value.tag == LAYERS and value.tensor.string_val and not self._table:
                        self._table = _table_layers(value.tensor.string_val[0].decode("utf-8", "replace"))
                        self._layers = None
                    else:
                        _read_value(value, values, self._outputs)
        except (DamagedEventFile, OSError) as error:
            read = "nothing read" if step is None else f"read to step {step}"
            self.problems.append(f"{_shown(file)}: damaged ({error}); {read}")
        if backwards:
            self.notes.append(f"{_shown(file)}: {backwards} event(s) of statistics at a step before the one read "
                              "last, left out")
        if step is not None:
            yield step, values


def read_run(folder: str | os.PathLike[str]) -> RunStatistics:
    """The statistics of :data:`STATISTICS` that the run in ``folder`` logged, per step, all in memory
    (:func:`diff` walks a :class:`RunStream` instead).

    ``folder`` is a run folder (a ``log_dir``), or a folder with exactly one run folder below it
    (``lightning_logs``). Several event files are read in name order, a later value of a step
    replacing an earlier one. Raises :class:`NoRunToCompare` where there is no actviz run.

    Example:
        >>> import tempfile
        >>> read_run(tempfile.mkdtemp())
        Traceback (most recent call last):
        ...
        actviz.run_reader.NoRunToCompare: no actviz run in '...': no event file (events.out.tfevents.*)
    """
    stream = RunStream(folder)
    steps = dict(stream.walk())
    return RunStatistics(stream.path, stream.layers, steps, stream.problems)


def _event_files(root: Path) -> list[Path]:
    files = sorted(path for path in root.iterdir() if is_event_file(path))
    if files:
        return files
    below = sorted({path.parent for path in root.rglob(EVENT_FILE_PREFIX + "*") if is_event_file(path)})
    if not below:
        raise NoRunToCompare(f"no actviz run in {ascii(str(root))}: no event file ({EVENT_FILE_PREFIX}*)")
    if len(below) > 1:
        names = ", ".join(ascii(str(path.relative_to(root))) for path in below[:3])
        raise NoRunToCompare(f"{ascii(str(root))} holds {len(below)} runs ({names}{', ...' if len(below) > 3 else ''})"
                             ": give one run folder")
    return sorted(path for path in below[0].iterdir() if is_event_file(path))


def _read_value(value: Any, values: dict[tuple[str, str], float], outputs: dict[str, None]) -> bool:
    """Put one ``Summary.Value`` in ``values`` if it is one of :data:`STATISTICS` (then return True); note output
    layers in order."""
    tag = value.tag.removeprefix(TENSORBOARD_PREFIX)
    prefix = next((prefix for prefix in ("activation_stats/", "activations/", "gradient_stats/", "gradients/")
                   if tag.startswith(prefix)), None)
    if prefix is None:
        return False
    rest = tag[len(prefix):]
    if value.HasField("histo"):
        for field_name in ("sum", "sum_squares"):
            values[(rest, _BY_SOURCE[(prefix, f"histo:{field_name}")])] = getattr(value.histo, field_name)
        values[(rest, COUNTS[prefix])] = value.histo.num  # not compared: how many numbers the sums add
        if prefix == "activations/":
            outputs.setdefault(rest)
        return True
    elif "@" in rest:
        stat, layer = rest.split("@", 1)
        name = _BY_SOURCE.get((prefix, f"stat:{stat}"))
        number = value.simple_value if value.HasField("simple_value") else (
            value.tensor.float_val[0] if value.tensor.float_val else None)
        if name is not None and number is not None:
            values[(layer, name)] = float(number)
            if prefix == "activation_stats/":
                outputs.setdefault(layer)
            return True
    return False


def _table_layers(text: str) -> list[str]:
    """The layer names of a ``layers`` markdown table, in its order (the model's)."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines()[2:]]
    return [cells[0].strip() for cells in rows if cells and cells[0].strip()]


def _shown(text: object) -> str:
    """``text`` for a terminal: control characters escaped, not sent raw."""
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in str(text))
