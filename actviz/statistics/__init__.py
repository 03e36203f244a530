"""Per-layer statistics: one interface, a device half in the layer hook and a host half on the writer thread.

* :mod:`~actviz.statistics.layer_statistic`: :class:`LayerStatistic`, the interface;
* :mod:`~actviz.statistics.registry`: the built-in list (:data:`BUILT_IN`), ``watch(statistics=...)``'s check,
  and which statistics a watcher runs on which layers.

Adding a statistic is one module here (a ``LayerStatistic`` subclass), one entry of :data:`BUILT_IN`,
one row of :data:`actviz.tags.ROWS`, and a test.

Example:
    >>> [statistic.name for statistic in BUILT_IN] == [s.name for s in BUILT_IN]
    True
"""

from .layer_statistic import LayerStatistic
from .registry import BUILT_IN, NAMES, check_statistics, resolve_statistics

__all__ = ["BUILT_IN", "LayerStatistic", "NAMES", "check_statistics", "resolve_statistics"]
