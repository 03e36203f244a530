"""The user's callbacks, ``on_alert`` and ``on_step``: called once their step is on disk, whatever they raise.

A step's alerts are found before it is written (each is a line of its ``alerts`` text), but
:func:`actviz.watch`'s ``on_alert`` hears of them only after the write: the diagnosis hands each alert
to :meth:`StepCallbacks.hold_alert`, and the writer, once the step went to every sink, calls
:meth:`StepCallbacks.after_write`, which passes the held alerts to ``on_alert`` and then the step to
``on_step``. So ``on_alert=lambda alert: sys.exit(1)``, the natural "stop on the first NaN", leaves the
step that holds the NaN in the event file, and ``actviz doctor`` finds its alert.

What a callback raises is handled here, the same for both: on the writer thread it is warned about
(an ``Exception`` from ``on_alert`` at each alert, anything else once per callback) and the writer goes
on; with ``strict=True`` (on the training thread) ``on_step``'s errors, and ``SystemExit`` or
``KeyboardInterrupt`` from ``on_alert``, raise there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..common.results import StepResults
from ..common.safe_warnings import warn_safely

__all__ = ["StepCallbacks"]

#: ``warn_once(kind, message, error)``: the writer's warning, once per kind.
WarnOnce = Callable[[str, str, BaseException], None]


class StepCallbacks:
    """``on_alert`` and ``on_step`` of one watcher, run by the writer after each step is written.

    Args:
        on_step: Called with each written step's results.
        on_alert: Called with each alert, after the step it was found in is written.

    Example:
        >>> heard = []
        >>> callbacks = StepCallbacks(on_step=lambda results: heard.append(("step", results.step)),
        ...                           on_alert=lambda alert: heard.append(("alert", alert)))
        >>> callbacks.hold_alert("NaN in fc")  # while step 7 is diagnosed: nothing is called yet
        >>> heard
        []
        >>> callbacks.after_write(StepResults(7), strict=False, warn_once=print)  # step 7 is written
        >>> heard
        [('alert', 'NaN in fc'), ('step', 7)]
    """

    def __init__(
        self, on_step: Callable[[StepResults], None] | None = None, on_alert: Callable[[Any], None] | None = None,
    ) -> None:
        self.on_step = on_step
        self.on_alert = on_alert
        self._held: list[Any] = []  # alerts of the step being finished, for on_alert once it is written

    @property
    def hold(self) -> Callable[[Any], None] | None:
        """What the diagnosis calls with each alert (its ``on_alert``), or ``None`` without ``on_alert``."""
        return None if self.on_alert is None else self.hold_alert

    def hold_alert(self, alert: Any) -> None:
        """Keep ``alert`` for ``on_alert`` until :meth:`after_write`."""
        self._held.append(alert)

    def after_write(self, results: StepResults | None, strict: bool, warn_once: WarnOnce) -> None:
        """Call ``on_alert`` with each held alert, then ``on_step`` with ``results`` (``None``: nothing was written).

        The alerts go to ``on_alert`` whether or not the write succeeded. ``warn_once(kind, message, error)``
        reports what a callback raised (see the module docstring); with ``strict`` the errors that raise
        there raise here.
        """
        alerts, self._held = self._held, []
        for alert in alerts:
            _call("on_alert", self.on_alert, alert, getattr(alert, "step", None), strict, warn_once)
        if results is not None and self.on_step is not None:
            _call("on_step", self.on_step, results, results.step, strict, warn_once)


def _call(name: str, callback: Any, value: Any, step: int | None, strict: bool, warn_once: WarnOnce) -> None:
    try:
        callback(value)
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: the step is written already
        where = "" if step is None else f" (step {step})"
        if name == "on_alert" and isinstance(error, Exception):  # said at each alert, never raised
            warn_safely(f"actviz's on_alert callback raised {type(error).__name__}: {error}{where}", RuntimeWarning)
        elif strict:  # on the training thread
            raise
        else:
            warn_once(name, f"actviz's {name} callback raised {type(error).__name__}: {error}{where}", error)
