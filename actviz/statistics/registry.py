"""The built-in statistics, and which of them a watcher runs: ``watch(statistics=...)``.

``statistics=`` names every per-step number a watcher writes (:data:`NAMES`): the per-layer
statistics of :data:`BUILT_IN`, and the step-wide ones, ``"attention"``, ``"moe"``, ``"update_ratio"``,
``"gradient_noise"`` and ``"loss"``. ``"default"`` is the default set (what ``statistics=None`` runs), so that adding to it
is one line, ``statistics=["default", "update_ratio"]``; ``"transformer"`` is short for ``"attention"``,
``"outliers"`` and ``"logits"``. :func:`resolve_statistics` turns the list into the fields of
:class:`~actviz.options.CaptureOptions` that capture reads.

:data:`BUILT_IN` lists every statistic actviz ships, in the order their values are written. With
``watch(statistics=None)`` (the default) each runs where its own
:meth:`~actviz.statistics.layer_statistic.LayerStatistic.on_by_default` says; a list runs exactly
the statistics it names (a built-in's :attr:`~actviz.statistics.layer_statistic.LayerStatistic.name`,
or a :class:`~actviz.statistics.layer_statistic.LayerStatistic` of your own), on every layer they apply to:
a list without ``"moments"`` writes no ``activation_stats/mean@{layer}`` (``std``, ``zero_fraction``,
``nonfinite``), as it runs no statistic it does not name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from ..common.suggestions import did_you_mean
from ..selection import layer_tag_names
from .dormant_units import DormantUnits
from .fp8_readiness import Fp8GradientReadiness, Fp8Readiness
from .gradient_kurtosis import GradientKurtosis, WeightGradKurtosis
from .gradient_norms import GradientNorms
from .layer_statistic import LayerStatistic
from .logits import Logits
from .moments import Moments
from .outliers import Outliers
from .relu_zeros import ReluZeros
from .residual import Residual
from .unit_counts import DeadChannels, Saturation, note_layouts
from .updates import AdamEpsilon, UpdateLost, UpdateRMS

__all__ = ["BUILT_IN", "Chosen", "NAMES", "STEP_WIDE", "check_statistics", "choose", "resolve_statistics"]

#: Every built-in statistic, in the order their values are written.
BUILT_IN: tuple[LayerStatistic, ...] = (
    Moments(), GradientNorms(), DeadChannels(), Saturation(), ReluZeros(), DormantUnits(), Outliers(), Logits(),
    GradientKurtosis(), WeightGradKurtosis(), Fp8Readiness(), Fp8GradientReadiness(), UpdateRMS(), UpdateLost(),
    AdamEpsilon(), Residual(),
)

#: The statistics of a whole step, not of one layer's tensor, each with what it writes: named in
#: ``statistics=`` as the layer statistics are.
STEP_WIDE: dict[str, str] = {
    "attention": "attention health of every attention call (docs/transformers.md)",
    "moe": "mixture-of-experts router health (docs/moe.md)",
    "update_ratio": "update_ratio/{param}, the relative change of each parameter across the next update",
    "gradient_noise": "gradient_noise/simple, the gradient noise scale (docs/gradient-noise.md)",
    "loss": "loss/backward_root, the value of the tensor each logging step's backward pass starts from",
    "gradient_clipping": "gradient_clipping/*, the global gradient norm before and after clipping (docs/diagnosis.md)",
}

#: Names that stand for several: ``"default"`` for the default set, ``"transformer"`` for the transformer set.
GROUPS: dict[str, tuple[str, ...]] = {"transformer": ("attention", "outliers", "logits")}

#: Every name ``statistics=`` takes.
NAMES: tuple[str, ...] = ("default", *(statistic.name for statistic in BUILT_IN), *STEP_WIDE, *GROUPS)


def resolve_statistics(value: Any) -> dict[str, Any]:
    """``watch(statistics=...)`` -> the :class:`~actviz.options.CaptureOptions` fields it sets.

    ``None`` and ``["default"]`` are the default set: each built-in layer statistic where it is on by
    default, the gradient norms before and after clipping, attention and outlier statistics on models with an attention module, router statistics on
    models with a mixture-of-experts module. A name given in the list runs on any model. A list without
    ``"default"`` runs only what it names.

    Raises:
        TypeError, ValueError: As :func:`check_statistics`.

    Example:
        >>> resolve_statistics(["default", "update_ratio"])["update_ratio"]
        True
        >>> fields = resolve_statistics(["moments", "transformer"])
        >>> [s.name for s in fields["statistics"]], fields["transformer_stats"], fields["moe"]
        (['moments', 'outliers', 'logits'], True, False)
    """
    if value is None:
        return {"statistics": None, "with_defaults": False, "transformer_stats": None, "moe": None,
                "update_ratio": False, "gradient_noise": False, "loss": None, "gradient_clipping": True}
    if isinstance(value, (str, LayerStatistic)) or not isinstance(value, Iterable):
        check_statistics(value)  # raises its TypeError
    items = list(value)
    expanded: list[Any] = []
    for item in items:
        expanded.extend(GROUPS.get(item, (item,)) if isinstance(item, str) else (item,))
    with_defaults = "default" in expanded
    named = {item for item in expanded if isinstance(item, str)}
    layer_items = [item for item in expanded if not (isinstance(item, str) and item in (*STEP_WIDE, "default"))]
    unique: list[Any] = []
    for item in layer_items:  # a group may name what the list names too: once each
        if not (isinstance(item, str) and item in unique):
            unique.append(item)
    statistics = check_statistics(unique)
    return {
        "statistics": None if with_defaults and not statistics else statistics,
        "with_defaults": with_defaults and bool(statistics),
        "transformer_stats": True if "attention" in named else None if with_defaults else False,
        "moe": True if "moe" in named else None if with_defaults else False,
        "update_ratio": "update_ratio" in named,
        "gradient_noise": "gradient_noise" in named,
        "loss": True if "loss" in named else None if with_defaults else False,
        "gradient_clipping": with_defaults or "gradient_clipping" in named,
    }


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
                        f"{type(value).__name__}: {value!r}; for example statistics=['default', 'update_ratio']")
    known = {statistic.name: statistic for statistic in BUILT_IN}
    everything = [*NAMES]
    found: list[LayerStatistic] = []
    for item in value:
        if isinstance(item, str):
            if item not in known:
                hint = did_you_mean(item, everything, otherwise=f"; known: {', '.join(everything)}")
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
    """The statistics one watcher runs on one set of layers, looked up once, by target: per module (of its outputs
    and of their gradients), of every watched parameter and parameter gradient, and of the model's output.

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

    __slots__ = ("by_module", "on_output", "unwatched", "of_summaries", "of_gradients", "of_parameters",
                 "of_parameter_gradients", "of_parameter_updates", "warned")

    def __init__(self, by_module: dict[int, tuple[LayerStatistic, ...]], on_output: tuple[LayerStatistic, ...],
                 unwatched: tuple[tuple[str, nn.Module], ...] = (),
                 of_summaries: dict[str, tuple[LayerStatistic, ...]] | None = None,
                 of_gradients: dict[int, tuple[LayerStatistic, ...]] | None = None,
                 of_parameters: tuple[LayerStatistic, ...] = (),
                 of_parameter_gradients: tuple[LayerStatistic, ...] = (),
                 of_parameter_updates: tuple[LayerStatistic, ...] = ()) -> None:
        self.by_module = by_module  # id(module) -> the statistics of its outputs; only modules with some
        self.on_output = on_output  # target "model_output": taken of the model's output
        self.unwatched = unwatched  # (name, module) pairs run for their statistics alone
        self.of_summaries = of_summaries or {}  # target -> reads_summary ones, taken of its summaries on the writer thread
        self.of_gradients = of_gradients or {}  # id(module) -> the statistics of its outputs' gradients
        self.of_parameters = of_parameters  # target "parameter": of every watched parameter
        self.of_parameter_gradients = of_parameter_gradients  # target "parameter_gradient"
        self.of_parameter_updates = of_parameter_updates  # target "parameter_update" (actviz.statistics.updates)
        self.warned: set[str] = set()  # statistics that failed, warned about once

    @classmethod
    def of(cls, model: nn.Module, layers: Sequence[tuple[str, nn.Module]], options: Any) -> Chosen:
        running = choose(model, options)
        note_layouts(model)  # which 3-D outputs are (batch, channels, length), for the unit counts, named or default
        of_summaries: dict[str, tuple[LayerStatistic, ...]] = {}
        for statistic in running:
            if statistic.reads_summary:
                of_summaries[statistic.target] = (*of_summaries.get(statistic.target, ()), statistic)
        in_hooks = [statistic for statistic in running if not statistic.reads_summary]
        per_layer = [statistic for statistic in in_hooks if statistic.target == "output"]
        of_gradient = [statistic for statistic in in_hooks if statistic.target == "output_gradient"]
        by_module: dict[int, tuple[LayerStatistic, ...]] = {}
        of_gradients: dict[int, tuple[LayerStatistic, ...]] = {}
        for _, module in layers:
            applying = tuple(statistic for statistic in per_layer
                             if statistic.watched_layers and statistic.applies_in(model, module))
            if applying:
                by_module[id(module)] = applying
            applying = tuple(statistic for statistic in of_gradient if statistic.applies_to(module))
            if applying:
                of_gradients[id(module)] = applying
        unwatched = []
        reaching = [statistic for statistic in per_layer if statistic.unwatched_layers]
        if reaching:
            watched = {id(module) for _, module in layers}
            tag_names = layer_tag_names(model)  # their tags name them as every tag does (0.query, not bert.encoder...)
            for name, module in model.named_modules():
                if id(module) in watched or id(module) in by_module or not name:
                    continue
                applying = tuple(statistic for statistic in reaching if statistic.applies_in(model, module))
                if applying:
                    by_module[id(module)] = applying
                    unwatched.append((tag_names.get(name, name), module))
        on_output = tuple(statistic for statistic in in_hooks if statistic.target == "model_output")
        return cls(by_module, on_output, tuple(unwatched), of_summaries, of_gradients,
                   tuple(statistic for statistic in in_hooks if statistic.target == "parameter"),
                   tuple(statistic for statistic in in_hooks if statistic.target == "parameter_gradient"),
                   tuple(statistic for statistic in in_hooks if statistic.target == "parameter_update"))


def choose(model: nn.Module, options: Any) -> tuple[LayerStatistic, ...]:
    """The statistics a watcher of ``model`` runs: ``options.statistics``, or where ``None`` the built-ins on by default."""
    chosen = getattr(options, "statistics", None)
    if chosen is not None and not getattr(options, "with_defaults", False):
        return tuple(chosen)
    defaults = tuple(statistic for statistic in BUILT_IN if statistic.on_by_default(model, options))
    if chosen is None:
        return defaults
    order = {statistic.name: index for index, statistic in enumerate(BUILT_IN)}
    named = {statistic.name for statistic in chosen}
    merged = [statistic for statistic in defaults if statistic.name not in named] + list(chosen)
    return tuple(sorted(merged, key=lambda statistic: order.get(statistic.name, len(order))))  # sorted() is stable
