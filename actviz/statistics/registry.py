"""The built-in per-layer statistics, and which of them a watcher runs: ``watch(statistics=...)``.

:data:`BUILT_IN` lists every statistic actviz ships, in the order their values are written. With
``watch(statistics=None)`` (the default) each runs where its own
:meth:`~actviz.statistics.layer_statistic.LayerStatistic.on_by_default` says; a list runs exactly
the statistics it names (a built-in's :attr:`~actviz.statistics.layer_statistic.LayerStatistic.name`,
or a :class:`~actviz.statistics.layer_statistic.LayerStatistic` of your own), on every layer they apply to:
a list without ``"moments"`` writes no ``activation_stats/{layer}/mean`` (``std``, ``zero_fraction``,
``nonfinite``), as it runs no statistic it does not name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from ..common.suggestions import did_you_mean
from .layer_statistic import LayerStatistic
from .logits import Logits
from .moments import Moments
from .outliers import Outliers
from .unit_counts import DeadChannels, Saturation

__all__ = ["BUILT_IN", "Chosen", "check_statistics", "choose"]

#: Every built-in statistic, in the order their values are written.
BUILT_IN: tuple[LayerStatistic, ...] = (Moments(), DeadChannels(), Saturation(), Outliers(), Logits())


def check_statistics(value: Any) -> tuple[LayerStatistic, ...] | None:
    """Check ``watch(statistics=)``: ``None``, or a list of built-in names and :class:`LayerStatistic` objects.

    Raises:
        TypeError: Not ``None`` or a list, an item neither a name nor a ``LayerStatistic`` (a class instead
            of an instance is named), or a statistic with no ``name``.
        ValueError: An unknown name (the nearest is suggested), or a name given twice.

    Example:
        >>> check_statistics(None) is None
        True
        >>> check_statistics(["saturated"])
        Traceback (most recent call last):
        ...
        ValueError: unknown statistic 'saturated'; did you mean 'saturation'?
    """
    if value is None:
        return None
    if isinstance(value, (str, LayerStatistic)) or not isinstance(value, Iterable):
        raise TypeError(f"statistics must be None or a list of names and LayerStatistic objects, got "
                        f"{type(value).__name__}: {value!r}; for example statistics=['moments', 'outliers']")
    known = {statistic.name: statistic for statistic in BUILT_IN}
    found: list[LayerStatistic] = []
    for item in value:
        if isinstance(item, str):
            if item not in known:
                hint = did_you_mean(item, known, otherwise=f"; known: {', '.join(known)}")
                raise ValueError(f"unknown statistic {item!r}{hint}")
            item = known[item]
        elif isinstance(item, type) and issubclass(item, LayerStatistic):
            raise TypeError(f"statistics takes LayerStatistic objects, got the class {item.__name__}; for example "
                            f"statistics=[{item.__name__}()]")
        elif not isinstance(item, LayerStatistic):
            raise TypeError(f"each statistic must be a name or a LayerStatistic, got {type(item).__name__}: {item!r}")
        if not item.name:
            raise TypeError(f"{type(item).__name__} has no name: set its class attribute name")
        if any(other.name == item.name for other in found):
            raise ValueError(f"statistic {item.name!r} is given twice")
        found.append(item)
    return tuple(found)


class Chosen:
    """The statistics one watcher runs on one set of layers, looked up once: per module, and on the model's output.

    ``unwatched``: the model's modules that are not watched but that a statistic with
    :attr:`~actviz.statistics.layer_statistic.LayerStatistic.unwatched_layers` applies to (the ReLUs of a
    conv → BN → ReLU network, for the dead-channel count): on logging steps their first call runs those
    statistics alone, with no summary, picture or gradient.

    Example:
        >>> from actviz.options import CaptureOptions
        >>> class Everywhere(LayerStatistic):
        ...     name = "everywhere"
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> chosen = Chosen.of(model, [("0", model[0]), ("1", model[1])], CaptureOptions(statistics=(Everywhere(),)))
        >>> [len(chosen.by_module[id(module)]) for module in model], chosen.on_output
        ([1, 1], ())
        >>> from actviz.statistics.unit_counts import DeadChannels
        >>> Chosen.of(model, [("0", model[0])], CaptureOptions(statistics=(DeadChannels(),))).unwatched
        (('1', ReLU()),)
    """

    __slots__ = ("by_module", "on_output", "unwatched", "of_summaries", "warned")

    def __init__(self, by_module: dict[int, tuple[LayerStatistic, ...]], on_output: tuple[LayerStatistic, ...],
                 unwatched: tuple[tuple[str, nn.Module], ...] = (), of_summaries: tuple[LayerStatistic, ...] = ()) -> None:
        self.by_module = by_module  # id(module) -> the statistics of its outputs; only modules with some
        self.on_output = on_output  # scope "model": taken of the model's output
        self.unwatched = unwatched  # (name, module) pairs run for their statistics alone
        self.of_summaries = of_summaries  # reads_summary: taken of every output's summary on the writer thread
        self.warned: set[str] = set()  # statistics that failed, warned about once

    @classmethod
    def of(cls, model: nn.Module, layers: Sequence[tuple[str, nn.Module]], options: Any) -> Chosen:
        running = choose(model, options)
        of_summaries = tuple(statistic for statistic in running if statistic.reads_summary)
        per_layer = [statistic for statistic in running if statistic.scope == "layer" and not statistic.reads_summary]
        by_module: dict[int, tuple[LayerStatistic, ...]] = {}
        for _, module in layers:
            applying = tuple(statistic for statistic in per_layer if statistic.applies_to(module))
            if applying:
                by_module[id(module)] = applying
        unwatched = []
        reaching = [statistic for statistic in per_layer if statistic.unwatched_layers]
        if reaching:
            watched = {id(module) for _, module in layers}
            for name, module in model.named_modules():
                if id(module) in watched or id(module) in by_module or not name:
                    continue
                applying = tuple(statistic for statistic in reaching if statistic.applies_to(module))
                if applying:
                    by_module[id(module)] = applying
                    unwatched.append((name, module))
        on_output = tuple(statistic for statistic in running if statistic.scope == "model")
        return cls(by_module, on_output, tuple(unwatched), of_summaries)


def choose(model: nn.Module, options: Any) -> tuple[LayerStatistic, ...]:
    """The statistics a watcher of ``model`` runs: ``options.statistics``, or where ``None`` the built-ins on by default."""
    chosen = getattr(options, "statistics", None)
    if chosen is not None:
        return tuple(chosen)
    return tuple(statistic for statistic in BUILT_IN if statistic.on_by_default(model, options))
