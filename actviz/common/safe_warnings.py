"""Warnings that can never stop training: ``python -W error`` turns them into log records instead.

Every warning actviz gives from a hook, the writer thread or an optimizer step goes
through :func:`warn_safely`. Under a filter that makes warnings errors (``-W error``,
``warnings.simplefilter("error")``), ``warnings.warn`` raises in the middle of the
user's forward or backward pass; here that error is caught and the message is logged
at WARNING level instead, so the user still reads it and training goes on.
"""

from __future__ import annotations

import logging
import os
import sysconfig
import threading
import warnings
from typing import Any

from ._internals import frame_outside

__all__ = ["Site", "done_speaking_for", "speak_for", "user_site", "warn_once", "warn_safely"]

logger = logging.getLogger("actviz")

#: Where a warning is attributed: ``(filename, line number, the module's globals)``.
Site = tuple[str, int, dict[str, Any]]

_thread = threading.local()  # .subject (str) and .site (Site) of this thread, set by speak_for
_ACTVIZ = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY: tuple[str, ...] | None = None  # actviz's, torch's and the standard library's folders: not the user's


def _library() -> tuple[str, ...]:
    global _LIBRARY
    if _LIBRARY is None:
        import torch

        paths = sysconfig.get_paths()
        _LIBRARY = (_ACTVIZ, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                    *{os.path.abspath(paths[name]) + os.sep for name in ("stdlib", "platstdlib")}, "<actviz", "<frozen")
    return _LIBRARY


def user_site() -> Site | None:
    """The innermost frame of this thread's stack outside actviz, PyTorch and the standard library, or ``None``.

    Example:
        >>> site = user_site()
        >>> site is None or not site[0].startswith(_ACTVIZ)
        True
    """
    frame = frame_outside(_library())
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


def speak_for(subject: str | None, site: Site | None = None) -> None:
    """Make ``subject`` (``"Net → runs/x"``) what this thread's warnings name, and ``site`` where those with no user
    frame point (the writer thread's: its ``watch()`` line)."""
    _thread.subject = subject
    _thread.site = site


def done_speaking_for(subject: str | None) -> None:
    """Forget this thread's subject if it is ``subject`` (its watcher closed)."""
    if getattr(_thread, "subject", None) == subject:
        speak_for(None)


def warn_safely(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2,
                subject: str | None = None) -> None:
    """``warnings.warn(message, category)`` at the user's line, naming ``subject`` (or the thread's, see
    :func:`speak_for`), or a log record where a filter would make it raise.

    ``stacklevel`` counts from the caller, as ``warnings.warn``'s does, where no user frame is found.

    Example:
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error")
        ...     warn_safely("actviz: something to know")  # logged instead of raised
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_safely("actviz: something to know", subject="Net → runs/x")
        >>> [str(warning.message) for warning in caught]
        ['actviz: something to know [Net → runs/x]']
    """
    subject = subject or getattr(_thread, "subject", None)
    if subject:
        message = f"{message} [{subject}]"
    site = user_site() or getattr(_thread, "site", None)
    try:
        if site is None:
            warnings.warn(message, category, stacklevel=stacklevel + 1)
        else:
            filename, lineno, module_globals = site
            module = module_globals.get("__name__") or filename.removesuffix(".py")  # as warnings.warn names it
            warnings.warn_explicit(message, category, filename, lineno, module=module,
                                   registry=module_globals.setdefault("__warningregistry__", {}))
    except Warning:
        logger.warning("%s", message)


def warn_once(warned: set, key: object, message: str, category: type[Warning] = RuntimeWarning,
              stacklevel: int = 2, subject: str | None = None) -> bool:
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
    warn_safely(message, category, stacklevel=stacklevel + 1, subject=subject)
    return True
