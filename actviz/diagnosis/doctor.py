"""``actviz doctor RUN_DIR``: what a run's event files say about each layer, without TensorBoard.

Reads every event file under ``RUN_DIR`` record by record, each record's checksums checked
(TensorBoard's reader may stop at a bad record without a word), and prints, per run, a table
of the watched layers (last gradient norm and its trend, activation std, zero fraction,
NaN/Inf) and every alert actviz raised, with its step. Works on runs of :func:`actviz.watch`
and of the Lightning and Hugging Face callbacks alike (same tags). A damaged file is named,
with the step it is read to, and the rest are read; anything named like an event file that
is not a regular file (a folder, a FIFO) is skipped. Every name is printed with its control
characters escaped. Exit status: 0 no alert, 1 an alert, 2 no actviz run, 3 a damaged
event file (:data:`EXIT_DAMAGED`, over 1 and 0: what it holds before the damage is reported).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..output.run_folders import EVENT_FILE_PREFIX, DamagedEventFile, is_event_file, read_records
from ..tags import ALERTS, TENSORBOARD_PREFIX, layer_statistic_of
from .alerts import parse_alert_lines
from .doctor_text import format_run, problem_line

__all__ = [
    "DOCTOR_DESCRIPTION", "DOCTOR_EPILOG", "EXIT_ALERTS", "EXIT_DAMAGED", "EXIT_HEALTHY", "EXIT_NO_RUN",
    "FileProblem", "RunHealth", "diagnose_runs", "doctor", "format_run",
]

#: ``actviz doctor``'s exit statuses: no alert, an alert, no actviz run in RUN_DIR, a damaged event file.
EXIT_HEALTHY, EXIT_ALERTS, EXIT_NO_RUN, EXIT_DAMAGED = 0, 1, 2, 3

DOCTOR_DESCRIPTION = """\
Read a training run's TensorBoard event files and say what is wrong, without TensorBoard:
one line per watched layer (last gradient norm and its trend, activation std, zero
fraction, NaN/Inf count) and every alert actviz raised while it trained, with its step.

Alerts are raised during training by actviz.watch(model, "runs/x") (alerts=True is the
default): non-finite values, vanishing and exploding gradients, dead ReLUs, saturated
Tanh/Sigmoid, update ratios out of range, gradient spikes (before clipping), attention
and outlier alerts of transformers, and experts of a mixture of experts that no token
chooses (dead_experts).
"""

DOCTOR_EPILOG = """\
examples:
  actviz doctor runs/exp1                 # one run
  actviz doctor runs                      # every run below runs/
  actviz doctor lightning_logs --json     # machine-readable, for CI
  actviz doctor runs/exp1 || echo "look at the alerts"

reading the table:
  grad norm   L2 norm of the gradient flowing into the layer's output, at the last logged step
  trend       the last 12 logged gradient norms (log scale) and last / first
  act std     standard deviation of the layer's output
  zero frac   fraction of exact zeros in the output (near 1 for a ReLU: dead units)
  nan/inf     most NaN/Inf elements in one step's output or gradient (0 when never written)

exit codes: 0 no alert, 1 at least one alert, 2 no actviz run in RUN_DIR,
  3 a damaged event file (bad checksum, cut short, undecodable record): it is named with
  the step it is read to, and everything before the damage and in other files is reported.
Names are printed with control characters escaped (\\x1b, \\x0a, ...).
See docs/diagnosis.md for every rule, its threshold and what to do about it.
"""


@dataclass
class LayerHealth:
    """One layer's last numbers in a run."""

    layer: str
    gradient_norm: float | None = None
    gradient_trend: list[float] = field(default_factory=list)
    activation_std: float | None = None
    zero_fraction: float | None = None
    nonfinite: int = 0


@dataclass
class RunHealth:
    """What ``actviz doctor`` found in one run folder."""

    path: str
    last_step: int
    layers: list[LayerHealth]
    alerts: list[dict[str, Any]]


@dataclass
class FileProblem:
    """An event file ``actviz doctor`` could not read to its end (``last_step``: the last step read whole,
    ``None`` when none was), or a thing named like one that is not a regular file."""

    path: str
    last_step: int | None
    reason: str


#: The values of each statistic the doctor keeps: the trend's (the last 12 logged gradient norms).
KEPT_VALUES = 12


class _Series:
    """One scalar tag's last :data:`KEPT_VALUES` points by step, and its largest value: what the table reads.

    Points come in file order, mostly by step; one that comes late takes its place by step.

    Example:
        >>> series = _Series()
        >>> for step in [*range(20), 3]:
        ...     series.add(step, float(step))
        >>> series.values()[:2], series.values()[-1], series.largest
        ([8.0, 9.0], 19.0, 19.0)
    """

    __slots__ = ("points", "largest")

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []
        self.largest = -math.inf

    def add(self, step: int, value: float) -> None:
        if not math.isnan(value):
            self.largest = max(self.largest, value)
        points = self.points
        if not points or step >= points[-1][0]:
            points.append((step, value))
        else:
            bisect.insort(points, (step, value), key=lambda point: point[0])
        if len(points) > KEPT_VALUES:
            del points[0]

    def values(self) -> list[float]:
        return [value for _, value in self.points]


@dataclass
class _Events:
    """What a run folder's event files hold that the doctor reads: each per-layer statistic's last values
    (:class:`_Series`), the first ``layers`` text and the alerts texts. Memory grows with the layers, not the steps."""

    scalars: dict[str, _Series] = field(default_factory=dict)
    texts: dict[str, list[tuple[int, list[bytes]]]] = field(default_factory=dict)

    def add_scalar(self, tag: str, step: int, value: float) -> None:
        if tag.removeprefix(TENSORBOARD_PREFIX).startswith(("activation_stats/", "gradient_stats/")):
            series = self.scalars.get(tag)
            if series is None:
                series = self.scalars[tag] = _Series()
            series.add(step, value)

    def add_text(self, tag: str, step: int, strings: list[bytes]) -> None:
        if tag == ALERTS or (tag == "layers" and tag not in self.texts):
            self.texts.setdefault(tag, []).append((step, strings))


def _event_files(root: Path, skipped: list[FileProblem]) -> dict[Path, list[Path]]:
    """The event files below ``root`` by folder; anything else so named goes to ``skipped``."""
    folders: dict[Path, list[Path]] = {}

    def unreadable(error: OSError) -> None:
        skipped.append(FileProblem(str(error.filename or root), None, f"cannot be read: {error.strerror or error}"))

    for folder, subfolders, files in os.walk(root, onerror=unreadable):
        subfolders.sort()
        for name in sorted(files + subfolders):
            if name.startswith(EVENT_FILE_PREFIX):
                path = Path(folder) / name
                if is_event_file(path):
                    folders.setdefault(Path(folder), []).append(path)
                else:
                    skipped.append(FileProblem(str(path), None, "not a regular file (a folder, a FIFO, ...)"))
    return folders


def _read_events(files: list[Path], damaged: list[FileProblem]) -> _Events:
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event

    events = _Events()
    for file in files:
        step: int | None = None
        undecodable = False
        try:
            for data in read_records(file):
                try:
                    event = Event.FromString(data)
                except DecodeError:  # whole, by its checksums, but not an event (a tag that is not UTF-8): skip it
                    if not undecodable:
                        damaged.append(FileProblem(str(file), step, f"a record after step {step} that is not a "
                                                                    "TensorBoard event, skipped"))
                    undecodable = True
                    continue
                step = event.step
                for value in event.summary.value:
                    if value.HasField("simple_value"):
                        events.add_scalar(value.tag, step, value.simple_value)
                    elif value.tensor.string_val:
                        events.add_text(value.tag, step, list(value.tensor.string_val))
                    elif value.metadata.plugin_data.plugin_name == "scalars" and value.tensor.float_val:
                        events.add_scalar(value.tag, step, value.tensor.float_val[0])
        except DamagedEventFile as error:
            read = "nothing read" if step is None else f"read to step {step}, nothing after it"
            damaged.append(FileProblem(str(file), step, f"{error.reason} at byte {error.offset}; {read}"))
        except OSError as error:
            damaged.append(FileProblem(str(file), step, f"cannot be read: {error.strerror or error}"))
    return events


def _read(folder: Path, files: list[Path], damaged: list[FileProblem]) -> RunHealth | None:
    events = _read_events(files, damaged)
    # actviz's names of the statistics -> TensorBoard's (after "~"; without it in runs written before it)
    written = {tag.removeprefix(TENSORBOARD_PREFIX): tag for tag in events.scalars}
    stats = [tag for tag in written if tag.startswith(("activation_stats/", "gradient_stats/"))]
    if not stats and ALERTS not in events.texts:
        return None
    names = _layer_order(events.texts.get("layers", []), stats)
    series = {tag: events.scalars[written[tag]] for tag in stats}
    last_step = max((points.points[-1][0] for points in series.values() if points.points), default=0)
    layers = []
    empty = _Series()
    for name in names:
        def values(tag: str) -> list[float]:
            return series.get(tag, empty).values()

        gradient = values(f"gradient_stats/norm@{name}")
        std = values(f"activation_stats/std@{name}")
        zeros = values(f"activation_stats/zero_fraction@{name}")
        bad = [series.get(f"{kind}_stats/nonfinite@{name}", empty).largest for kind in ("activation", "gradient")]
        layers.append(LayerHealth(
            name, gradient[-1] if gradient else None, gradient[-KEPT_VALUES:], std[-1] if std else None,
            zeros[-1] if zeros else (0.0 if std else None), int(min(max(0.0, *bad), 2.0**53)),
        ))
    alerts = []
    for step, texts in events.texts.get(ALERTS, []):
        for text in texts:
            alerts += [{"step": at, "rule": rule, "layer": layer, "message": message}
                       for at, rule, layer, message in parse_alert_lines(text.decode("utf-8", "replace"), step)]
    return RunHealth(str(folder), last_step, layers, alerts)


def _layer_order(tables: list[tuple[int, list[bytes]]], stats: list[str]) -> list[str]:
    """Layers in the order of the first ``layers`` table (model order), then any others by name."""
    found = sorted({parts[2] for parts in map(layer_statistic_of, stats) if parts})
    ordered: list[str] = []
    table = tables[0][1][0].decode("utf-8", "replace") if tables and tables[0][1] else ""
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells and cells[0] in found and cells[0] not in ordered:
            ordered.append(cells[0])
    return ordered + [name for name in found if name not in ordered]


def diagnose_runs(root: str | Path, problems: list[FileProblem] | None = None) -> list[RunHealth]:
    """Every actviz run under ``root`` (the folder itself or any below it), read back.

    Args:
        root: A run folder or a folder of runs.
        problems: If given, gets a :class:`FileProblem` for each damaged event file (``damaged: ...``)
            and each thing named like one that is not a regular file (``skipped: ...``).

    Example:
        >>> import tempfile
        >>> diagnose_runs(tempfile.mkdtemp())
        []
    """
    damaged: list[FileProblem] = []
    skipped: list[FileProblem] = []
    runs = []
    for folder, files in sorted(_event_files(Path(root), skipped).items()):
        health = _read(folder, files, damaged)
        if health is not None:
            runs.append(health)
    if problems is not None:
        problems += [FileProblem(p.path, p.last_step, f"damaged: {p.reason}") for p in damaged]
        problems += [FileProblem(p.path, p.last_step, f"skipped: {p.reason}") for p in skipped]
    return runs


def doctor(run_dir: str | Path, as_json: bool = False) -> tuple[int, str]:
    """``(exit status, text)`` of ``actviz doctor run_dir``: 0 healthy, 1 alerts, 2 no actviz run, 3 a damaged file.

    With ``as_json`` the text is JSON whatever happens: ``{"error": ..., "status": 2, "problems": [...]}`` where
    there is no run to report (as ``actviz diff --json``).

    Example:
        >>> import json, tempfile
        >>> status, text = doctor(tempfile.mkdtemp(), as_json=True)
        >>> status, sorted(json.loads(text))
        (2, ['error', 'problems', 'status'])
    """
    root = Path(run_dir)
    problems: list[FileProblem] = []
    if not root.is_dir():
        return _no_run(f"{ascii(str(root))} is not a folder", problems, as_json)
    try:
        runs = diagnose_runs(root, problems)
    except OSError as error:  # a folder that vanished or cannot be listed while it is read
        return _no_run(f"{ascii(str(root))} cannot be read: {error.strerror or error}", problems, as_json)
    damaged = any(problem.reason.startswith("damaged") for problem in problems)
    if not runs and not damaged:
        return _no_run(f"no actviz run in {ascii(str(root))}: no event file with actviz's tags "
                       "(~activation_stats/, ~gradient_stats/, alerts). Give the folder actviz.watch() wrote to.",
                       problems, as_json, label="")
    status = EXIT_DAMAGED if damaged else EXIT_ALERTS if any(run.alerts for run in runs) else EXIT_HEALTHY
    if as_json:
        report = {"status": status, "runs": [asdict(run) for run in runs], "problems": [asdict(p) for p in problems]}
        return status, json.dumps(_no_nan(report), indent=2)
    text = "\n\n".join(format_run(run) for run in runs)
    if problems:
        text += ("\n\n" if text else "") + "\n".join(problem_line(problem) for problem in problems)
    return status, text


def _no_run(reason: str, problems: list[FileProblem], as_json: bool, label: str = "error: ") -> tuple[int, str]:
    """Exit status 2, with ``reason`` as text or as ``{"error": ...}``."""
    if as_json:
        return EXIT_NO_RUN, json.dumps({"error": reason, "status": EXIT_NO_RUN, "problems": [asdict(p) for p in problems]})
    return EXIT_NO_RUN, "\n".join([f"actviz doctor: {label}{reason}", *(problem_line(p) for p in problems)])


def _no_nan(value: Any) -> Any:
    """``value`` with NaN and infinities as ``null``: strict JSON, as CI tools read it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _no_nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_no_nan(item) for item in value]
    return value


def add_doctor_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """Add the ``doctor`` subcommand to the ``actviz`` parser's subcommands."""
    parser = commands.add_parser("doctor", help="what a run's event files say is wrong, layer by layer",
                                 description=DOCTOR_DESCRIPTION, epilog=DOCTOR_EPILOG, formatter_class=formatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (log_dir of actviz.watch) or a folder of runs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table (for scripts and CI)")
