"""The writer's warnings: each kind of failure is said once, training goes on, and every failure is logged.

A full disk fails every write, flush and close after it: one warning says so (kinds come from
:func:`~actviz.output.sink.failure_cause`, so an OS error is one kind whatever failed), and each later
failure goes to the ``actviz`` logger at DEBUG level, with its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..common.safe_warnings import warn_once
from .sink import failure_cause

__all__ = ["OnceWarnings"]

logger = logging.getLogger(__name__)


class OnceWarnings:
    """One writer's warnings, each kind once.

    Example:
        >>> import warnings
        >>> said = OnceWarnings()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for step in (3, 4):
        ...         said.failed(step, ValueError("bad"))
        ...     said.guarded("flush", lambda: None)
        >>> [str(warning.message) for warning in caught]
        ['actviz could not write step 3: ValueError: bad. Training goes on; later failures are logged at DEBUG level.']
    """

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def warn(self, kind: str, message: str, error: BaseException | None = None) -> None:
        """Warn once per ``kind``; with ``error``, each failure is logged at DEBUG level too."""
        later = "; later failures are logged at DEBUG level" if error is not None else ""
        warn_once(self.warned, kind, f"{message}. Training goes on{later}.")
        if error is not None:
            logger.debug("%s failed", kind, exc_info=error)

    def failed(self, step: int, error: BaseException) -> None:
        """Step ``step`` could not be finished or written. Never raises, whatever the warning filters do."""
        try:
            self.warn(failure_cause(error, "write"), f"actviz could not write step {step}: {type(error).__name__}: {error}",
                      error)
        except BaseException:  # a warning filter that raises must not end the writer thread
            logger.debug("reporting a failed write failed", exc_info=True)

    def guarded(self, what: str, call: Callable[[], None]) -> None:
        """Call ``call`` (the sink's ``flush`` or ``close``); an error is warned about instead of raised."""
        try:
            call()
        except Exception as error:  # noqa: BLE001 - a full disk must not end the with-block with an error
            self.warn(failure_cause(error, what), f"actviz could not {what} its writer: {type(error).__name__}: {error}",
                      error)
