"""A word at the start and at the end of a watched run: what is watched, where it goes, and how to look.

At :func:`actviz.watch` one line says what is watched and where it goes; at ``close()`` (also through
``with`` and at interpreter exit, which closes the watchers still open) one line says how many steps were
logged, the alerts, the dropped steps and the two commands that show the run. A run that logged fewer
than :data:`FEW_STEPS` steps is told so, with the ``every=`` that would give it a curve. A watcher dropped
without ``close()`` and garbage-collected with its model says no end line (its finalizer waits for nothing).

Both go to the logger ``"actviz"`` at ``INFO``. Where no handler would show them (no ``logging`` set up)
and stderr is a terminal, they are written to stderr too. ``actviz.Options(quiet=True)`` or the environment
variable ``ACTVIZ_QUIET=1`` turns both off.

Example:
    >>> import logging
    >>> from actviz.schedule import Schedule
    >>> notes = RunNotes("Net", 4, "runs/x", Schedule.default(), Schedule.parse(100), quiet=False)
    >>> notes.start_line()
    'actviz: watching 4 layers of Net → runs/x, logging steps 0-9, every 10 up to 990, then every 100 (feature maps every 100 steps)'
    >>> print(notes.end_line(logged=2, steps=200, alerts=0, dropped=0))
    actviz: Net logged 2 of 200 steps, 0 alerts, 0 dropped → runs/x
      only 2 steps were logged, too few for a curve: every=10 logs 20 of these 200 steps
      view: tensorboard --logdir runs --samples_per_plugin images=100
      check: actviz doctor runs/x
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ..schedule import Schedule
from .open_watchers import steps_apart

__all__ = ["FEW_STEPS", "RunNotes", "end_of_run", "quiet_by_environment", "subject_of"]

logger = logging.getLogger("actviz")

#: A run that logged fewer steps than this is told that it drew no real curve, and how to get one.
FEW_STEPS = 10


def subject_of(model: str, sink: object) -> str:
    """What a watcher's warnings name: ``"Net → runs/x"``, the model's class name and the run folder (the sink's
    class name where there is none), or the name alone on a rank that writes nothing.

    Example:
        >>> subject_of("Net", None)
        'Net'
    """
    writer = getattr(sink, "writer", None)
    if writer is not None:
        return f"{model} → {writer.get_logdir()}"
    return model if sink is None else f"{model} → {type(sink).__name__}"


def quiet_by_environment() -> bool:
    """Whether ``ACTVIZ_QUIET`` is set to something other than ``""`` or ``"0"``."""
    return os.environ.get("ACTVIZ_QUIET", "0") not in ("", "0")


def _to_terminal() -> bool:
    """No handler would show an ``INFO`` record of ``"actviz"``, and stderr is a terminal."""
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        return False
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty(), or closed
        return False


def say(message: str) -> None:
    """``message`` to the logger ``"actviz"`` at ``INFO``, and to a terminal's stderr where no handler shows it."""
    logger.info("%s", message)
    if _to_terminal():
        try:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stderr at exit: nothing to say it on
            pass


class RunNotes:
    """The start and end lines of one watcher.

    Args:
        model: The watched model's class name.
        layers: How many layers are watched.
        destination: The run folder (a ``SummaryWriter``'s ``log_dir``), or ``None`` when only sinks of the
            user's are written to (``sink_names`` names them).
        stats_schedule: The schedule of ``every=``.
        image_schedule: The schedule of ``image_every=``.
        quiet: Say nothing (``Options(quiet=True)``; ``ACTVIZ_QUIET=1`` is read here too).
        sink_names: The user's sinks' class names.
    """

    def __init__(self, model: str, layers: int, destination: str | None, stats_schedule: Schedule,
                 image_schedule: Schedule, quiet: bool, sink_names: tuple[str, ...] = ()) -> None:
        self.model = model
        self.layers = layers
        self.destination = destination
        self.stats_schedule = stats_schedule
        self.image_schedule = image_schedule
        self.quiet = quiet or quiet_by_environment()
        self.sink_names = sink_names
        self._ended = False

    @property
    def _where(self) -> str:
        if self.destination is not None:
            return self.destination
        return ", ".join(self.sink_names) or "no sink"

    def start_line(self) -> str:
        """What is watched, where it goes and which steps log."""
        stats, images = self.stats_schedule, self.image_schedule
        schedule = f"logging {stats.describe()}" if not stats.never else "logging no histograms or statistics"
        if images.never:
            pictures = "no feature maps"
        elif images == stats:
            pictures = "feature maps on the same steps"
        else:
            pictures = f"feature maps {images.describe()}"
        layers = f"{self.layers} layer{'s' if self.layers != 1 else ''}"
        return f"actviz: watching {layers} of {self.model} → {self._where}, {schedule} ({pictures})"

    def end_line(self, logged: int, steps: int, alerts: int,
                 dropped: int) -> str:
        """Steps logged, alerts, dropped steps, the fix for a short run and the commands that show the run."""
        alerts_text = f"{alerts} alert{'s' if alerts != 1 else ''}"
        lines = [f"actviz: {self.model} logged {logged} of {steps} steps, {alerts_text}, {dropped} dropped → "
                 f"{self._where}"]
        if logged < FEW_STEPS and steps > logged:
            every = max(1, steps // 20)
            lines.append(f"  only {logged} step{'s were' if logged != 1 else ' was'} logged, too few for a curve: "
                         f"every={every} logs {len(range(0, steps, every))} of these {steps} steps")
        if self.destination is not None:
            parent = os.path.dirname(os.path.normpath(self.destination)) or "."
            lines.append(f"  view: tensorboard --logdir {parent} --samples_per_plugin images=100")
            lines.append(f"  check: actviz doctor {self.destination}")
        return "\n".join(lines)

    def start(self) -> None:
        """Say :meth:`start_line`, unless quiet."""
        if not self.quiet:
            say(self.start_line())

    def end(self, logged: int, steps: int, alerts: int, dropped: int) -> None:
        """Say :meth:`end_line` once, unless quiet."""
        if self.quiet or self._ended:
            return
        self._ended = True
        try:
            say(self.end_line(logged, steps, alerts, dropped))
        except Exception:
            logger.debug("the end line failed", exc_info=True)


def end_of_run(watcher: Any, logging_steps: int, notices: Any) -> None:
    """At ``watcher.close()``: warn (through ``notices``) where another open watcher's step axis does not match
    this one's (:func:`~actviz.output.open_watchers.steps_apart`), then say its end line, ``logging_steps`` of its
    ``counted_steps`` started, less those dropped."""
    other = steps_apart(watcher, watcher.counted_steps)
    if other is not None:
        notices.once("step_axes", steps=watcher.counted_steps, other=other[0], other_steps=other[1])
    if watcher.notes is not None:
        dropped = watcher.dropped_steps
        watcher.notes.end(logging_steps - dropped, watcher.counted_steps, len(watcher.alerts), dropped)
