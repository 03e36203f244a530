"""``actviz doctor RUN_DIR``: what a run's event files say about each layer, without TensorBoard.

Reads every run under ``RUN_DIR`` with TensorBoard's own ``EventAccumulator`` and prints,
per run, a table of the watched layers (last gradient norm and its trend, activation std,
zero fraction, NaN/Inf) and every alert actviz raised, with its step. Works on runs of
:func:`actviz.watch` and of the Lightning and Hugging Face callbacks alike (same tags).
Exit status: 1 when a run holds an alert, 0 when none does, 2 when no actviz run is found.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..tags import TENSORBOARD_PREFIX

__all__ = ["DOCTOR_DESCRIPTION", "DOCTOR_EPILOG", "RunHealth", "diagnose_runs", "doctor", "format_run"]

EXIT_HEALTHY, EXIT_ALERTS, EXIT_NO_RUN = 0, 1, 2
_SPARKS = "▁▂▃▄▅▆▇█"
_ALERT_LINE = re.compile(r"^step (\d+) · \*\*(\w+)\*\* · `([^`]*)`: (.*)$")

DOCTOR_DESCRIPTION = """\
Read a training run's TensorBoard event files and say what is wrong, without TensorBoard:
one line per watched layer (last gradient norm and its trend, activation std, zero
fraction, NaN/Inf count) and every alert actviz raised while it trained, with its step.

Alerts are raised during training by actviz.watch(model, "runs/x") (alerts=True is the
default): non-finite values, vanishing and exploding gradients, dead ReLUs, saturated
Tanh/Sigmoid, update ratios out of range, gradient spikes (spikes=True).
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

exit codes: 0 no alert, 1 at least one alert, 2 no actviz run in RUN_DIR.
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


def _runs(root: Path) -> list[Path]:
    folders = {path.parent for path in root.rglob("events.out.tfevents.*")}
    return sorted(folders)


def _read(folder: Path) -> RunHealth | None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "images": 1, "histograms": 1})
    events.Reload()
    tags = events.Tags()
    scalars, texts = set(tags.get("scalars", [])), set(tags.get("tensors", []))
    # actviz's names of the statistics -> TensorBoard's (after "~"; without it in runs written before it)
    written = {tag.removeprefix(TENSORBOARD_PREFIX): tag for tag in scalars}
    stats = [tag for tag in written if tag.startswith(("activation_stats/", "gradient_stats/"))]
    if not stats and "alerts" not in texts:
        return None
    names = _layer_order(events, texts, stats)
    series = {tag: [(event.step, event.value) for event in events.Scalars(written[tag])] for tag in stats}
    last_step = max((points[-1][0] for points in series.values() if points), default=0)
    layers = []
    for name in names:
        def values(tag: str) -> list[float]:
            return [value for _, value in series.get(tag, [])]

        gradient = values(f"gradient_stats/{name}/norm")
        std = values(f"activation_stats/{name}/std")
        zeros = values(f"activation_stats/{name}/zero_fraction")
        bad = values(f"activation_stats/{name}/nonfinite") + values(f"gradient_stats/{name}/nonfinite")
        layers.append(LayerHealth(
            name, gradient[-1] if gradient else None, gradient[-12:], std[-1] if std else None,
            zeros[-1] if zeros else (0.0 if std else None), int(max(bad, default=0)),
        ))
    alerts = []
    if "alerts" in texts:
        for event in events.Tensors("alerts"):
            for text in event.tensor_proto.string_val:
                alerts += _parse_alerts(event.step, text.decode("utf-8", "replace"))
    return RunHealth(str(folder), last_step, layers, alerts)


def _layer_order(events: Any, texts: set[str], stats: list[str]) -> list[str]:
    """Layers in the order of the ``layers`` table (model order), then any others by name."""
    found = sorted({tag.split("/", 1)[1].rsplit("/", 1)[0] for tag in stats})
    ordered: list[str] = []
    if "layers" in texts:
        table = events.Tensors("layers")[0].tensor_proto.string_val[0].decode("utf-8", "replace")
        for line in table.splitlines()[2:]:
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if cells and cells[0] in found and cells[0] not in ordered:
                ordered.append(cells[0])
    return ordered + [name for name in found if name not in ordered]


def _parse_alerts(step: int, text: str) -> list[dict[str, Any]]:
    found = []
    for line in (line.strip() for line in text.split("\n\n")):
        match = _ALERT_LINE.match(line)
        if match:
            found.append({"step": int(match[1]), "rule": match[2], "layer": match[3], "message": match[4]})
        elif line:  # written before actviz had rules: the first NaN/Inf
            found.append({"step": step, "rule": "nonfinite", "layer": "-", "message": line.removeprefix("actviz: ")})
    return found


def diagnose_runs(root: str | Path) -> list[RunHealth]:
    """Every actviz run under ``root`` (the folder itself or any below it), read back.

    Example:
        >>> import tempfile
        >>> diagnose_runs(tempfile.mkdtemp())
        []
    """
    return [health for health in (_read(folder) for folder in _runs(Path(root))) if health is not None]


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return "nan" if math.isnan(value) else f"{value:.3g}"


def _trend(values: list[float]) -> str:
    finite = [value for value in values if math.isfinite(value) and value > 0]
    if len(finite) < 2:
        return "-"
    logs = [math.log10(value) for value in finite]
    low, high = min(logs), max(logs)
    spark = "".join(_SPARKS[0 if high == low else round((v - low) / (high - low) * 7)] for v in logs)
    return f"{spark} x{finite[-1] / finite[0]:.2g}"


def format_run(health: RunHealth) -> str:
    """The report of one run as text: the layer table, then the alerts."""
    rows = [("layer", "grad norm", "trend", "act std", "zero frac", "nan/inf")]
    for layer in health.layers:
        rows.append((layer.layer, _number(layer.gradient_norm), _trend(layer.gradient_trend),
                     _number(layer.activation_std), _number(layer.zero_fraction), str(layer.nonfinite)))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [f"run {health.path} (last step {health.last_step})", ""]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    if health.alerts:
        lines.append(f"{len(health.alerts)} alert(s):")
        lines += [f"  step {a['step']:>6}  {a['rule']:<20} {a['layer']:<16} {a['message']}" for a in health.alerts]
    else:
        lines.append("no alerts")
    return "\n".join(lines)


def doctor(run_dir: str | Path, as_json: bool = False) -> tuple[int, str]:
    """``(exit status, text)`` of ``actviz doctor run_dir``: 0 healthy, 1 alerts, 2 no actviz run."""
    root = Path(run_dir)
    if not root.is_dir():
        return EXIT_NO_RUN, f"actviz doctor: error: {str(root)!r} is not a folder"
    runs = diagnose_runs(root)
    if not runs:
        return EXIT_NO_RUN, (f"actviz doctor: no actviz run in {str(root)!r}: no event file with actviz's tags "
                             "(~activation_stats/, ~gradient_stats/, alerts). Give the folder actviz.watch() wrote to.")
    status = EXIT_ALERTS if any(run.alerts for run in runs) else EXIT_HEALTHY
    if as_json:
        report = {"status": status, "runs": [asdict(run) for run in runs]}
        return status, json.dumps(_no_nan(report), indent=2)
    return status, "\n\n".join(format_run(run) for run in runs)


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
