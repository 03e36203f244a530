"""Warnings that can never stop training: ``python -W error`` turns them into log records instead.

Every warning actviz gives from a hook, the writer thread or an optimizer step goes
through :func:`warn_safely`. Under a filter that makes warnings errors (``-W error``,
``warnings.simplefilter("error")``), ``warnings.warn`` raises in the middle of the
user's forward or backward pass; here that error is caught and the message is logged
at WARNING level instead, so the user still reads it and training goes on.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["warn_once", "warn_safely"]

logger = logging.getLogger("actviz")


def warn_safely(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    """``warnings.warn(message, category)``, or a log record where a filter would make it raise.

    Example:
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error")
        ...     warn_safely("actviz: something to know")  # logged instead of raised
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_safely("actviz: something to know")
        >>> [str(warning.message) for warning in caught]
        ['actviz: something to know']
    """
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning:
        logger.warning("%s", message)


def warn_once(warned: set, key: object, message: str, category: type[Warning] = RuntimeWarning,
              stacklevel: int = 2) -> bool:
    """:func:`warn_safely` ``message`` unless ``key`` is in ``warned``, the set of what its owner said; then add it.
    The one way actviz says a thing once. Returns whether it warned.

    Example:
        >>> said: set = set()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     [warn_once(said, "disk", "actviz: the disk is full") for _ in range(2)]
        [True, False]
        >>> len(caught), said
        (1, {'disk'})
    """
    if key in warned:
        return False
    warned.add(key)
    warn_safely(message, category, stacklevel=stacklevel + 1)
    return True
