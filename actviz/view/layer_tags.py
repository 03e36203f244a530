"""Which layer and which statistic a TensorBoard tag is about: the one parser of the actviz tab and ``actviz export``.

A per-layer statistic is a scalar tag of :mod:`actviz.tags` with a ``{layer}`` or ``{param}`` in its pattern.
Its *statistic* is the pattern without that part (``activation_stats/std@{layer}`` -> ``activation_stats/std``),
its *layer* the part itself. Scalars under ``~activation_stats/`` or ``~gradient_stats/`` that no pattern names
(a :class:`~actviz.statistics.layer_statistic.LayerStatistic` of your own) are read as
``{prefix}/{statistic}@{layer}`` too, so the tab shows every per-layer statistic the run holds.

Example:
    >>> parse_tag("~gradient_stats/norm@features.0")
    ('gradient_stats/norm', 'features.0')
    >>> parse_tag("~update_ratio/fc.weight"), parse_tag("~activation_stats/my_kurtosis@fc")
    (('update_ratio', 'fc.weight'), ('activation_stats/my_kurtosis', 'fc'))
    >>> parse_tag("loss") is None, parse_tag("~gradient_noise/simple") is None
    (True, True)
    >>> label("gradient_stats/norm"), label("activation_stats/zero_fraction")
    ('gradient norm', 'activation zero fraction')
    >>> table_layers("| layer | type |\\n|---|---|\\n| conv1 | Conv2d |\\n| fc | Linear |")
    ['conv1', 'fc']
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..run_reader import _table_layers as table_layers  # the layers text's one parser, shared with actviz diff
from ..tags import ACTIVATION_STAT, GRADIENT_STAT, PATTERNS, TENSORBOARD_PREFIX, layer_statistic_of

__all__ = ["FIRST_STATISTICS", "label", "layer_order", "parse_tag", "statistic_order", "table_layers"]

#: The statistics the tab offers first, in this order; any others the run holds follow by name.
FIRST_STATISTICS = ("gradient_stats/norm", "activation_stats/std", "activation_stats/zero_fraction", "update_ratio")
_PLACES = ("{layer}", "{param}")
_PER_LAYER = [
    (re.compile("^" + re.escape(pattern).replace(re.escape(place), "(?P<layer>.+)") + "$"),
     pattern.replace("/" + place, "").replace("@" + place, "").replace(place + "/", ""))
    for pattern in PATTERNS for place in _PLACES if place in pattern and "{statistic}" not in pattern
]
_OWN_STATISTICS = tuple(pattern.split("{")[0] for pattern in (ACTIVATION_STAT, GRADIENT_STAT))


def parse_tag(tag: str) -> tuple[str, str] | None:
    """``(statistic, layer)`` of a per-layer scalar tag (TensorBoard's name, with or without ``~``), else ``None``."""
    name = tag.removeprefix(TENSORBOARD_PREFIX)
    for matcher, statistic in _PER_LAYER:
        found = matcher.match(name)
        if found:
            return statistic, found["layer"]
    parts = layer_statistic_of(name) if name.startswith(_OWN_STATISTICS) else None
    if parts is not None:
        return f"{parts[0]}/{parts[1]}", parts[2]
    return None


def label(statistic: str) -> str:
    """A statistic's name for people: ``gradient_stats/norm`` -> ``gradient norm``."""
    return statistic.replace("_stats/", " ").replace("/", " ").replace("_", " ")


def statistic_order(statistics: Iterable[str]) -> list[str]:
    """:data:`FIRST_STATISTICS` that are there, then the others by name."""
    found = set(statistics)
    return [name for name in FIRST_STATISTICS if name in found] + sorted(found - set(FIRST_STATISTICS))


def layer_order(found: Iterable[str], table: list[str]) -> list[str]:
    """``found`` in forward order: as the ``layers`` table lists them; a parameter (``fc.weight``) after its layer;
    the rest by name.

    Example:
        >>> layer_order(["fc", "conv1.bias", "conv1.weight", "extra"], ["conv1", "fc"])
        ['conv1.weight', 'conv1.bias', 'fc', 'extra']
    """
    found = list(dict.fromkeys(found))
    place = {layer: index for index, layer in enumerate(table)}

    def key(name: str) -> tuple[int, int, str]:
        if name in place:
            return place[name], 0, ""
        owner = name.rsplit(".", 1)[0]
        if owner in place:  # a parameter: weight before bias
            return place[owner], 1, {"weight": "0", "bias": "1"}.get(name.rsplit(".", 1)[1], name)
        return len(place), 2, name

    return sorted(found, key=key)
