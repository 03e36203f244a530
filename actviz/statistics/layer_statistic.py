"""The statistic interface: one object, a device half and a host half, and a target.

A :class:`LayerStatistic` is the one route by which a statistic of a tensor reaches the event file.
It declares its :attr:`~LayerStatistic.target`, the tensors it is taken of (:data:`TARGETS`): a watched
layer's output (``"output"``), the gradient with respect to it (``"output_gradient"``), a watched parameter
(``"parameter"``) or its gradient as applied (``"parameter_gradient"``), or the model's output
(``"model_output"``); and the one-pass fields it reads (:attr:`~LayerStatistic.summary_fields`). Capture runs
every target's statistics the same way (:func:`take_values`), and nothing in capture or output names one:

* :meth:`~LayerStatistic.applies_to` picks the watched layers it runs on, once per watcher;
* :meth:`~LayerStatistic.device` runs inside the step's hook of its target, on the tensor's device:
  a few numbers per tensor as one small tensor, never read on the host (no sync). The step keeps it
  with its other small results and copies it to the host in the step's one copy
  (:class:`~actviz.output.pending_step.LayerValues`);
* :meth:`~LayerStatistic.host` runs on the writer thread: those numbers, as floats, become named
  values. Each step's values are in ``results.layer_values[statistic.name][layer]`` (what the
  alerts read), and the ones in :attr:`~LayerStatistic.written` become the scalars
  ``activation_stats/{name}@{layer}`` (:meth:`~LayerStatistic.tag`; the pattern is its target's,
  :data:`TARGET_TAGS`); :meth:`~LayerStatistic.texts` may make texts of the step's values of every layer.

A statistic with ``reads_summary = True`` has no device half: on the writer thread,
:meth:`~LayerStatistic.from_layer_summary` takes its values of each finished summary of its target, which every
summarized tensor has (the moments, :mod:`actviz.statistics.moments`; the gradient norms,
:mod:`actviz.statistics.gradient_norms`).

A statistic of ``target = "model_output"`` runs once per step on the model's output
(:meth:`~LayerStatistic.select` picks the tensor), as the logit statistics do.

Example:
    A made-up statistic, the fraction of positive elements, in a few lines:

    >>> import tempfile, actviz
    >>> class Positive(LayerStatistic):
    ...     name, names = "positive", ("positive_fraction",)
    ...     def device(self, tensor, module, options):
    ...         return torch.mean(tensor.detach() > 0, dtype=torch.float32)
    ...     def host(self, numbers, numel, dtype):
    ...         return {"positive_fraction": numbers[0]}
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4))
    >>> with actviz.watch(model, tempfile.mkdtemp(), statistics=[Positive()]) as viz:
    ...     model(torch.ones(2, 3)).sum().backward()
    ...     viz.flush()
    >>> sorted(viz.latest.layer_values["positive"])
    ['0']
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import nn

from ..common.results import Summary
from ..common.safe_warnings import warn_once
from ..summaries.one_pass import OUTLIER_FIELDS, UNIT_FIELDS
from ..tags import ACTIVATION_STAT, GRADIENT_STAT, UPDATE_STAT, WEIGHT_GRAD_STAT, WEIGHT_STAT

__all__ = ["TARGETS", "TARGET_TAGS", "LayerStatistic", "summary_request", "take_values", "warn_statistic_failed"]

#: What a statistic is taken of: each tensor of a watched layer's output, the gradient with respect to it, each
#: watched parameter, its gradient as the optimizer applies it, the model's output, or the update an optimizer
#: step applies to a watched parameter (:mod:`actviz.statistics.updates`).
TARGETS = ("output", "output_gradient", "parameter", "parameter_gradient", "model_output", "parameter_update")

#: The scalar tag pattern of each target's values (``{layer}`` is the parameter's name for the parameter targets).
TARGET_TAGS = {"output": ACTIVATION_STAT, "output_gradient": GRADIENT_STAT, "parameter": WEIGHT_STAT,
               "parameter_gradient": WEIGHT_GRAD_STAT, "model_output": ACTIVATION_STAT, "parameter_update": UPDATE_STAT}

logger = logging.getLogger(__name__)


class LayerStatistic:
    """One per-layer statistic. Subclass it, set :attr:`name` and :attr:`names`, and write :meth:`device`
    and :meth:`host`; the rest has defaults.

    Attributes:
        name: The statistic's name: ``watch(statistics=[...])`` picks it by it, and its values are
            ``results.layer_values[name]``.
        names: The values :meth:`host` gives.
        written: Those of :attr:`names` written as scalars (:meth:`tag`); ``None`` for all of them.
        target: What it is taken of (:data:`TARGETS`): ``"output"`` (the default), ``"output_gradient"``,
            ``"parameter"``, ``"parameter_gradient"``, or ``"model_output"`` (once per step, :meth:`select`).
        cost: What :meth:`device` costs per tensor, as measured (kernels, no sync); said in the docs.
        unwatched_layers: Whether it also runs on the model's modules it applies to that are not watched:
            there it runs alone (:meth:`device` on their first call of a logging step), with no summary,
            picture or gradient of theirs.
        watched_layers: Whether it runs on watched layers; ``False`` for one that gives unwatched modules what the
            watched ones' summaries give already.
        summary_fields: Numbers of the layer's one-pass summary it is made from
            (:data:`~actviz.summaries.one_pass.OUTLIER_FIELDS`, or
            :data:`~actviz.summaries.one_pass.UNIT_FIELDS` as :meth:`summary_units` asks), or ``()``. Where
            the one-pass op summarizes the output, it adds them to the row it reads anyway, and
            :meth:`from_summary` takes them from there: no second read of the tensor. Elsewhere (a small
            output batched with the step's others, the CPU shortcut) :meth:`device` runs.
        reads_input: Its device half also takes the layer's input, the first tensor of its positional arguments
            (:meth:`device_with_input`, instead of :meth:`device`): a residual block's ``x`` of ``y = x + f(x)``.
        reads_summary: Its values come from the layer's finished :class:`~actviz.common.results.Summary`, on the
            writer thread (:meth:`from_layer_summary`): no device half, no op, nothing copied. It runs on every
            summarized output (:meth:`applies_to` is not asked) and never on the modules of ``unwatched_layers``.
    """

    name: str = ""
    names: tuple[str, ...] = ()
    written: tuple[str, ...] | None = None
    target: Literal["output", "output_gradient", "parameter", "parameter_gradient", "model_output",
                    "parameter_update"] = "output"
    cost: str = ""
    summary_fields: tuple[str, ...] = ()
    unwatched_layers: bool = False
    watched_layers: bool = True
    reads_summary: bool = False
    reads_input: bool = False

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        """Whether ``watch(statistics=None)`` (the default) runs it on ``model``. Asked once per watcher."""
        return True

    def applies_to(self, module: nn.Module) -> bool:
        """Whether it runs on this watched layer's outputs. Asked once per watcher and layer."""
        return True

    def applies_in(self, model: nn.Module, module: nn.Module) -> bool:
        """Whether it runs on ``module`` of ``model``; :meth:`applies_to` unless a statistic needs to see the model
        (the residual blocks are the repeated children of a ``ModuleList``). Asked once per watcher and module."""
        return self.applies_to(module)

    def select(self, model: nn.Module, output: Any) -> torch.Tensor | None:
        """``target = "model_output"``: the tensor of the model's ``output`` it is taken of, or ``None`` for none."""
        return output if isinstance(output, torch.Tensor) else None

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        """The device half: a few numbers of ``tensor`` (detach it first), a tensor of its target of ``module`` (the
        model, for ``target = "model_output"``; ``None`` for the parameter targets), as one small tensor on its
        device, never read on the host; ``None`` for a tensor it does not take (an integer one, say). ``options`` is the watcher's :class:`~actviz.options.CaptureOptions`."""
        raise NotImplementedError

    def device_with_input(self, tensor: torch.Tensor, layer_input: torch.Tensor | None, module: nn.Module,
                          options: Any) -> torch.Tensor | None:
        """For ``reads_input = True``: :meth:`device` with the layer's input too (``None`` where it has none)."""
        raise NotImplementedError

    def summary_units(self, tensor: torch.Tensor, module: nn.Module) -> tuple[float, ...] | None:
        """For ``summary_fields = UNIT_FIELDS``: the ``units`` the one-pass op counts for this output
        (:func:`~actviz.summaries.one_pass.unit_fraction`), or ``None`` where it cannot (a layout it does not read)."""
        return None

    def from_summary(self, fields: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The device half from the summary instead (``summary_fields`` set): ``fields``, those numbers of the
        row, and ``sample``, the histogram's strided sample of the output, both on its device -> what
        :meth:`device` would give."""
        raise NotImplementedError

    def from_summary_and_tensor(self, fields: torch.Tensor, sample: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`from_summary`, for a statistic that also takes a few elements of the ``tensor`` itself (a sample of
        its blocks, say) besides the numbers of its summary's read; by default :meth:`from_summary`."""
        return self.from_summary(fields, sample)

    def from_layer_summary(self, summary: Summary) -> dict[str, float]:
        """For ``reads_summary = True``, on the writer thread: the layer's finished summary ->
        ``{value name: value}``, as :meth:`host` gives."""
        raise NotImplementedError

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        """The host half, on the writer thread: :meth:`device`'s numbers as floats (with the tensor's
        ``numel`` and ``dtype``) → ``{value name: value}``."""
        raise NotImplementedError

    def texts(self, values: dict[str, dict[str, Any]]) -> dict[str, str]:
        """On the writer thread, once per step: the texts (``{tag: markdown}``) made of this step's values of every
        layer (``{layer: values}``, as :meth:`host` gave them); none by default."""
        return {}

    def tag(self, layer: str, name: str) -> str:
        """The scalar tag of value ``name`` of ``layer``: its target's pattern (:data:`TARGET_TAGS`), e.g.
        ``activation_stats/{name}@{layer}``."""
        pattern = TARGET_TAGS[self.target]
        return pattern.format(layer=layer, param=layer, statistic=name)

    def scalars(self, layer: str, values: dict[str, float]) -> dict[str, float]:
        """The scalars ``values`` of ``layer`` are written as: those of :attr:`written` under :meth:`tag`."""
        written = self.names if self.written is None else self.written
        return {self.tag(layer, name): values[name] for name in written if name in values}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def summary_request(statistics: tuple[LayerStatistic, ...] | None, tensor: torch.Tensor,
                    module: nn.Module) -> tuple[bool, tuple[float, ...]]:
    """What a tensor's one-pass summary should add for the fields ``statistics`` read: ``(outliers, units)``, the
    flags of :func:`~actviz.summaries.one_tensor.reduce_tensor` that add :data:`OUTLIER_FIELDS` and
    :data:`UNIT_FIELDS` to its row. Asked of the fields each statistic declares, whichever statistic it is.

    Example:
        >>> class Reads(LayerStatistic):
        ...     name, summary_fields = "reads", ("centred_fourths",)
        >>> summary_request((Reads(),), torch.zeros(2), nn.Identity())
        (True, ())
    """
    if not statistics:
        return False, ()
    outliers, units = False, ()
    for statistic in statistics:
        fields = statistic.summary_fields
        outliers = outliers or any(field in OUTLIER_FIELDS for field in fields)
        if not units and any(field in UNIT_FIELDS for field in fields):
            units = statistic.summary_units(tensor, module) or ()
    return outliers, units


def take_values(statistics: tuple[LayerStatistic, ...], layer: str, module: nn.Module, tensor: torch.Tensor,
                reduction: Any, layer_values: Any, options: Any, layer_input: Any = None) -> None:
    """Each statistic's device half of one tensor of its target, kept with the step's results (``layer_values``, a
    :class:`~actviz.output.pending_step.LayerValues`): from the numbers the summary's row holds where it has them
    (``reduction``, the tensor's :class:`~actviz.summaries.one_tensor.PendingSummary`, whose reduction made in the
    hook has the fields of :func:`summary_request`), else by its own ops. One that raises is warned about once;
    training goes on. ``layer_input``: the layer's positional arguments, for those with
    :attr:`~LayerStatistic.reads_input`."""
    reduction = reduction.made if reduction is not None else None  # a row of the small batch has no fields
    summarized = reduction is not None and reduction.extra
    for statistic in statistics:
        try:
            fields = reduction.extra_fields(statistic.summary_fields) if summarized else None
            if fields is not None:
                numbers = statistic.from_summary_and_tensor(fields, reduction.sample_values(), tensor)
            elif statistic.reads_input:
                numbers = statistic.device_with_input(tensor, first_input(layer_input), module, options)
            else:
                numbers = statistic.device(tensor, module, options)
        except Exception as error:  # noqa: BLE001 - a statistic must never stop training
            warn_statistic_failed(statistic, error, layer_values.warned)
            continue
        if numbers is not None:
            layer_values.add(statistic, layer, numbers, tensor.numel(), tensor.dtype)


def first_input(inputs: Any) -> torch.Tensor | None:
    """The first tensor of a module's positional arguments, or ``None``.

    Example:
        >>> first_input((3, torch.ones(2))).shape, first_input(())
        (torch.Size([2]), None)
    """
    if isinstance(inputs, torch.Tensor):
        return inputs
    for item in inputs if isinstance(inputs, (tuple, list)) else ():
        if isinstance(item, torch.Tensor):
            return item
    return None


def warn_statistic_failed(statistic: LayerStatistic, error: BaseException, warned: set[str]) -> None:
    """Warn that a statistic raised (training goes on), once per statistic in ``warned`` (a watcher's); log each
    failure at DEBUG level."""
    warn_once(warned, statistic.name, f"actviz: the statistic {statistic.name!r} failed, {type(error).__name__}: "
              f"{error} (training goes on; warned once)", RuntimeWarning, stacklevel=3)
    logger.debug("statistic %s failed", statistic.name, exc_info=error)
