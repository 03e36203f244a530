"""How well actviz's health alerts tell a healthy run from a sick one, on real loop shapes.

    python scripts/diagnosis_benchmark.py           # 11 healthy and 15 sick programs, about 4 minutes on 2 cores
    python scripts/diagnosis_benchmark.py --quick   # 2 healthy and 7 sick programs
    python scripts/diagnosis_benchmark.py --only vit,dying_relu --verbose

Each program (``scripts/diagnosis_programs.py``, ``scripts/diagnosis_pathologies.py``) trains under
``actviz.watch(model, run, every=...)`` with default options (a sick program may name one, as
``layers="all"`` for Tanh saturation). A healthy program should raise no alert. A sick program has one
injected pathology with a known cause, layer and onset; the program's own hooks check that it happened,
and it is caught when an alert of a rule that names that cause, on a layer it may name, comes no later
than :data:`LATE_LOGGING_STEPS` logging steps after the loss went bad (or after the onset, for a
pathology that stalls the loss rather than blowing it up).

The table: per healthy program its alerts; per sick program the first alert on the right cause and layer,
its step, the step the loss went bad, and the alerts before it. Then precision (caught sick programs over
caught ones plus healthy ones with an alert), recall (caught over those whose pathology happened) and false
alarms per 1,000 logged steps of the healthy programs. The exit status is 0 when there is no false alarm and
every pathology that happened is caught, else 1.

Example:
    >>> outcome = run_program("regression")
    >>> outcome.alerts
    []
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import actviz
from diagnosis_pathologies import SICK
from diagnosis_programs import HEALTHY

#: Training steps and logging interval (``every``) of each program.
PLAN = {
    "mnist_cnn": (600, 10), "vae": (600, 10), "dcgan": (400, 10), "word_lm_lstm": (600, 10),
    "word_lm_transformer": (600, 10), "vit": (400, 10), "resnet18": (300, 10), "gpt": (600, 10),
    "regression": (600, 10), "sines_lbfgs": (10, 5), "gcn": (300, 5),
    "lr_x1000": (120, 5), "demo_cnn_lr10": (60, 5), "deep_sigmoid": (100, 5), "dying_relu": (100, 5),
    "bad_batch": (100, 5), "fp16_overflow": (100, 5), "tanh_saturation": (100, 5),
    "saturated_generator": (80, 5), "forgotten_group": (60, 5),
    "nan_in_data": (80, 5), "attention_logit_growth": (200, 5), "frozen_by_mistake": (40, 5),
    "decayed_layernorm": (40, 5), "clipped_spike": (240, 10), "mnist_batch_between_logs": (100, 5),
}
#: The quick subset (``--quick``), which tests/test_diagnosis_benchmark.py runs.
QUICK = ("mnist_cnn", "regression", "lr_x1000", "dying_relu", "nan_in_data", "saturated_generator",
         "frozen_by_mistake", "decayed_layernorm", "mnist_batch_between_logs")
#: An alert this many logging steps after the loss went bad (or after the onset) is late.
LATE_LOGGING_STEPS = 3


@dataclass
class Outcome:
    """What one program did and what actviz said about it."""

    name: str
    sick: bool
    logged_steps: int
    seconds: float
    alerts: list = field(default_factory=list)
    happened: str | None = None
    bad_step: int | None = None
    right: object = None  # the first alert on the right cause and layer
    deadline: int | None = None
    losses: tuple[float, float] = (math.nan, math.nan)  # mean loss of the first and of the last tenth of the steps

    @property
    def caught(self) -> bool:
        return self.right is not None and self.right.step <= self.deadline

    def verdict(self) -> str:
        if not self.sick:
            return "ok" if not self.alerts else "FALSE ALARM"
        if self.happened is None:
            return "did not happen"
        return "caught" if self.caught else "LATE" if self.right is not None else "MISSED"


def run_program(name: str) -> Outcome:
    """Train program ``name`` under actviz and judge what it said."""
    sick = name in SICK
    program = (SICK if sick else HEALTHY)[name]()
    steps, every = PLAN[name]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.ExitStack() as stack:
            watchers = [stack.enter_context(actviz.watch(model, Path(folder) / run, every=every, image_every=False,
                                                         **program.watch))
                        for run, model in program.watched.items()]
            losses = [program.step(step) for step in range(steps)]
            for viz in watchers:
                viz.flush()
        alerts = [alert for viz in watchers for alert in viz.alerts]
        logged = sum(math.ceil(viz.step / every) for viz in watchers)
    outcome = Outcome(name, sick, logged, time.perf_counter() - start, sorted(alerts, key=lambda alert: alert.step))
    tenth = max(1, len(losses) // 10)
    outcome.losses = (sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth)
    if sick:
        outcome.happened = program.happened()
        outcome.bad_step = program.bad_step()
        outcome.deadline = (program.onset if outcome.bad_step is None else outcome.bad_step) + LATE_LOGGING_STEPS * every
        outcome.right = next((alert for alert in outcome.alerts if alert.rule in program.rules
                              and (program.layers is None or alert.layer in program.layers)), None)
    return outcome


def _alert(alert) -> str:
    return "-" if alert is None else f"{alert.step} {alert.rule} {alert.layer or '-'}"


def _losses(outcome: Outcome) -> str:
    return f"{outcome.losses[0]:.3g} → {outcome.losses[1]:.3g}"


def table(outcomes: list[Outcome]) -> str:
    """The benchmark's one table, with precision, recall and false alarms per 1,000 logged steps under it."""
    lines = ["| program | loss first → last | logged steps | alerts | first right alert (step rule layer) | loss bad at | "
             "alerts before it | verdict |", "|---|---|---|---|---|---|---|---|"]
    for outcome in outcomes:
        if outcome.sick:
            before = [alert for alert in outcome.alerts if outcome.right is None or alert.step < outcome.right.step]
            bad = "stalls" if outcome.bad_step is None else str(outcome.bad_step)
            lines.append(f"| {outcome.name} | {_losses(outcome)} | {outcome.logged_steps} | {len(outcome.alerts)} | {_alert(outcome.right)} | "
                         f"{bad} | {', '.join(_alert(a) for a in before[:2]) or '-'} | {outcome.verdict()} |")
        else:
            first = _alert(outcome.alerts[0]) if outcome.alerts else "-"
            lines.append(f"| {outcome.name} | {_losses(outcome)} | {outcome.logged_steps} | {len(outcome.alerts)} | {first} | - | - | "
                         f"{outcome.verdict()} |")
    healthy = [outcome for outcome in outcomes if not outcome.sick]
    happened = [outcome for outcome in outcomes if outcome.sick and outcome.happened is not None]
    caught = sum(outcome.caught for outcome in happened)
    noisy = sum(bool(outcome.alerts) for outcome in healthy)
    false_alarms = sum(len(outcome.alerts) for outcome in healthy)
    logged = sum(outcome.logged_steps for outcome in healthy)
    lines += ["", f"healthy programs: {len(healthy)}, with an alert: {noisy}; false alarms per 1,000 logged steps: "
              f"{1000 * false_alarms / max(logged, 1):.1f} ({false_alarms} over {logged})",
              f"sick programs: {len([o for o in outcomes if o.sick])}, pathology happened: {len(happened)}, "
              f"caught: {caught}; precision {caught / max(caught + noisy, 1):.2f}, "
              f"recall {caught / max(len(happened), 1):.2f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the quick subset only")
    parser.add_argument("--only", help="comma-separated program names")
    parser.add_argument("--verbose", action="store_true", help="print every alert's message")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else list(QUICK if args.quick else PLAN)
    unknown = [name for name in names if name not in PLAN]
    if unknown:
        parser.error(f"unknown program(s) {', '.join(unknown)}; known: {', '.join(PLAN)}")
    outcomes = []
    for name in names:
        outcome = run_program(name)
        outcomes.append(outcome)
        print(f"{name}: {outcome.verdict()} in {outcome.seconds:.1f} s", file=sys.stderr)
        if args.verbose:
            print(f"  happened: {outcome.happened}; loss bad at {outcome.bad_step}", file=sys.stderr)
            for alert in outcome.alerts[:8]:
                print(f"  {alert.message}", file=sys.stderr)
    print(table(outcomes))
    failed = [o for o in outcomes if o.verdict() in ("FALSE ALARM", "LATE", "MISSED")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
