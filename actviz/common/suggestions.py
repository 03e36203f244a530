"""The "did you mean" of every error that names an unknown name: one spelling for the whole package.

An error about a layer, an argument, an alert threshold or a model name ends with the
closest known names, found by :func:`difflib.get_close_matches` (a ratio of matching
characters, 0.6 unless a caller asks otherwise). Only this module imports :mod:`difflib`;
``tests/test_idioms.py`` checks that.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "did_you_mean"]


def closest(word: str, known: Iterable[str], n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The at most ``n`` names of ``known`` closest to ``word``, best first; none under ``cutoff``.

    Example:
        >>> closest("evry", ["every", "image_every", "bins"])
        ['every']
        >>> closest("zzz", ["every"])
        []
    """
    return difflib.get_close_matches(word, list(known), n=n, cutoff=cutoff)


def did_you_mean(word: str, known: Iterable[str], n: int = 1, cutoff: float = 0.6, sep: str = " or ",
                 otherwise: str = "") -> str:
    """``"; did you mean 'a' or 'b'?"`` with the :func:`closest` names, for the end of an error message.

    Args:
        word: The unknown name as given.
        known: The names that would have worked.
        n: How many names to offer at most.
        cutoff: How close a name must be, 0 to 1.
        sep: What goes between two offered names.
        otherwise: What to return when no name is close enough, e.g. ``"; known: a, b"``.

    Example:
        >>> did_you_mean("feature.0", ["features.0", "features.1", "classifier"], n=2)
        "; did you mean 'features.0' or 'features.1'?"
        >>> did_you_mean("zzz", ["every"], otherwise="; it takes every")
        '; it takes every'
    """
    names = closest(word, known, n=n, cutoff=cutoff)
    return f"; did you mean {sep.join(repr(name) for name in names)}?" if names else otherwise
