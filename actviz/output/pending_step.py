"""From the device to the writer thread: one step's small results, in one copy per device.

The hooks leave summary handles (:class:`~actviz.summaries.one_tensor.PendingSummary`) and pictures
(:class:`~actviz.pictures.rendering.Picture`) on the tensors' devices in a :class:`PendingStep`: each summary in the field of its kind
(``pending.activations.append(summary)``, likewise ``gradients``, ``weights`` and
``weight_grads``: :class:`TaggedReductions`), the AMP loss scale in :attr:`PendingStep.loss_scale`.
When the step ends, :meth:`PendingStep.send` packs every tensor of a device into one byte
buffer and starts a single copy to the host; on a GPU the copy goes to pinned memory without
blocking, so the training thread never waits. :meth:`PendingStep.resolve`, on the writer
thread, waits for the copy and finishes the summaries and pictures there, the scaled ones
divided by the loss scale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from ..common.safe_warnings import warn_once
from ..options import cpu_shortcuts
from ..pictures.rendering import Picture
from ..summaries.header import Reduction
from ..summaries.one_tensor import PendingSummary
from ..summaries.small_tensors import SmallTensors
from ..tags import GRAD_SCALE
from ..common.results import StepResults

__all__ = ["HostCopy", "LayerValues", "PendingStep", "TaggedReductions", "record_values"]

logger = logging.getLogger(__name__)

#: Turns a picture's sources, once on the host, into a ``uint8`` image.
Draw = Callable[..., torch.Tensor]


class HostCopy:
    """Tensors on their way to the host: one copy per device, started when made.

    CPU tensors need no copy; with ``ACTVIZ_CPU_SHORTCUTS=0`` they are packed all the
    same, so that the packing is tested and counted on a CPU. Per tensor it keeps no
    Python object but the tensor: the layout is lists of indices, one per device and dtype.

    Example:
        >>> [tensor.tolist() for tensor in HostCopy([torch.tensor([1.5]), torch.arange(3)]).wait()]
        [[1.5], [0, 1, 2]]
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        skip_cpu = cpu_shortcuts()
        for index, tensor in enumerate(self._tensors):
            if not (skip_cpu and tensor.device.type == "cpu"):
                groups.setdefault((tensor.device, tensor.dtype), []).append(index)
        by_device: dict[torch.device, list[list[int]]] = {}
        for (device, _), indices in sorted(groups.items(), key=lambda item: -item[0][1].itemsize):
            by_device.setdefault(device, []).append(indices)  # widest dtype first: each stays aligned
        self._copies = [_DeviceCopy(self._tensors, device_groups) for device_groups in by_device.values()]

    def wait(self) -> list[torch.Tensor]:
        """The tensors on the host, in the order given. Waits for the copies."""
        found = list(self._tensors)
        for copy in self._copies:
            copy.wait(found)
        self._copies = []
        return found


class _DeviceCopy:
    """Every tensor of one device, packed as bytes and copied: one ``cat`` per dtype, one of their bytes."""

    def __init__(self, tensors: list[torch.Tensor], groups: list[list[int]]) -> None:
        self._groups = groups
        flats = [_flat_cat([tensors[index] for index in indices]) for indices in groups]
        packed = flats[0].view(torch.uint8) if len(flats) == 1 else torch.cat([f.view(torch.uint8) for f in flats])
        device = packed.device
        self._event: Any = None
        if device.type == "cuda":
            with torch.cuda.device(device):
                self._host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
                self._host.copy_(packed, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        elif device.type == "cpu":
            self._host = packed
        else:  # other accelerators: a plain copy, which waits
            self._host = packed.cpu()

    def wait(self, found: list[torch.Tensor]) -> None:
        """Replace, in ``found``, each device tensor of this copy by its host view."""
        if self._event is not None:
            self._event.synchronize()
        offset = 0
        for indices in self._groups:
            dtype = found[indices[0]].dtype
            length = sum(found[index].numel() for index in indices)
            values = self._host[offset : offset + length * dtype.itemsize].view(dtype)
            offset += length * dtype.itemsize
            position = 0
            for index in indices:
                tensor = found[index]
                numel = tensor.numel()
                found[index] = values[position : position + numel].view(tensor.shape)
                position += numel


def _flat_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor of every element, in order: one ``cat``, a view only for tensors that are not 1-D."""
    flats = [tensor if tensor.dim() == 1 else tensor.reshape(-1) for tensor in tensors]
    return flats[0] if len(flats) == 1 else torch.cat(flats)


class TaggedReductions(list):
    """One kind of a step's summaries, as the hooks leave them: their handles
    (:class:`~actviz.summaries.one_tensor.PendingSummary`), in the order added, each with its ``tag``.

    A :class:`PendingStep` has one per field of summaries of :class:`~actviz.common.results.StepResults`
    (:attr:`PendingStep.activations`, :attr:`~PendingStep.gradients`, :attr:`~PendingStep.weights`,
    :attr:`~PendingStep.weight_grads`), which :meth:`PendingStep.resolve` finishes on the host. A hook sets its
    handle's ``tag`` (the layer's or parameter's name), ``scaled`` (the tensor is multiplied by the loss scale,
    :attr:`PendingStep.loss_scale`, which the host divides out) and ``mergeable`` (it differs between ranks, and
    ``merge_ranks=True`` merges it, :mod:`actviz.summaries.merge_ranks`), then appends it: no call of actviz's
    and no object but the handle per summary.

    Args:
        name: The field's name, which prefixes the tags that :attr:`PendingStep.mergeable` gives.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def add_many(self, summaries: dict[str, PendingSummary], scaled: bool = False,
                 mergeable: Collection[str] = ()) -> None:
        """Append each ``tag: summary`` of ``summaries`` (many parameters), ``scaled``; the tags in ``mergeable`` are."""
        for tag, summary in summaries.items():
            summary.tag, summary.scaled, summary.mergeable = tag, scaled, tag in mergeable
        self.extend(summaries.values())


class LayerValues:
    """A step's per-layer statistics (:mod:`actviz.statistics`) as the hooks leave them: each statistic's device
    half, a few numbers per tensor, kept in parallel lists (no object per entry but its tensor), and the statistics
    that read every summary of their target instead (:attr:`of_summaries`, the moments and the gradient norms):
    nothing per layer.

    :meth:`finish`, on the writer thread, gives each statistic's host half its numbers, or each output's finished
    summary (``reads_summary``): the named values go into ``results.layer_values[statistic.name][layer]``, and
    those it writes into ``results.scalars`` under their tags (:func:`record_values`); then each statistic's texts of
    the step (:meth:`~actviz.statistics.layer_statistic.LayerStatistic.texts`) into ``results.texts``.
    A host half that raises loses its own values, warned once per statistic; the step keeps the rest.
    """

    __slots__ = ("statistics", "layers", "tensors", "numels", "dtypes", "of_summaries", "warned")

    def __init__(self) -> None:
        self.statistics: list[Any] = []  # LayerStatistic objects
        self.layers: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.numels: list[int] = []
        self.dtypes: list[torch.dtype] = []
        self.of_summaries: dict[str, tuple[Any, ...]] = {}  # target -> reads_summary statistics, of its summaries
        self.warned: set[str] = set()  # statistics that failed, warned about once: the watcher's, set by its steps

    def add(self, statistic: Any, layer: str, numbers: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
        """Keep ``numbers``, ``statistic``'s device half of a tensor of ``layer`` (``numel`` elements of ``dtype``)."""
        self.statistics.append(statistic)
        self.layers.append(layer)
        self.tensors.append(numbers)
        self.numels.append(numel)
        self.dtypes.append(dtype)

    def extend(self, other: LayerValues) -> None:
        """Keep ``other``'s entries too (a step's parameter gradients', taken apart until they are final)."""
        for entry in zip(other.statistics, other.layers, other.tensors, other.numels, other.dtypes):
            self.add(*entry)

    def finish(self, host: dict[int, torch.Tensor], results: StepResults) -> None:
        """On the host: every entry's named values into ``results`` (see the class docstring)."""
        summaries = {"output": results.activations, "output_gradient": results.gradients,
                     "parameter": results.weights, "parameter_gradient": results.weight_grads}
        for target, statistics in self.of_summaries.items():
            for statistic in statistics:
                _from_summaries(statistic, summaries.get(target, {}), results, self.warned)
        for statistic, layer, tensor, numel, dtype in zip(self.statistics, self.layers, self.tensors, self.numels,
                                                          self.dtypes):
            try:
                values = statistic.host(host[id(tensor)].reshape(-1).tolist(), numel, dtype)
            except Exception as error:  # noqa: BLE001 - one statistic must not lose the step
                _warn_once(statistic, error, self.warned)
                continue
            record_values(results, statistic, layer, values)
        for statistic in dict.fromkeys(self.statistics):  # each once, in order
            try:
                results.texts.update(statistic.texts(results.layer_values.get(statistic.name, {})))
            except Exception as error:  # noqa: BLE001 - one statistic must not lose the step
                _warn_once(statistic, error, self.warned)


def _from_summaries(statistic: Any, summaries: dict[str, Any], results: StepResults, warned: set[str]) -> None:
    """A ``reads_summary`` statistic's values of each of ``summaries`` (``{layer: Summary}``) into ``results``."""
    for layer, summary in summaries.items():
        try:
            values = statistic.from_layer_summary(summary)
        except Exception as error:  # noqa: BLE001 - one statistic must not lose the step
            _warn_once(statistic, error, warned)
            break
        record_values(results, statistic, layer, values)


def record_values(results: StepResults, statistic: Any, layer: str, values: dict[str, float]) -> None:
    """``statistic``'s ``values`` of ``layer`` into ``results``: ``results.layer_values[statistic.name][layer]``,
    and the ones it writes into ``results.scalars`` under their tags (:meth:`~actviz.statistics.LayerStatistic.scalars`)."""
    results.layer_values.setdefault(statistic.name, {})[layer] = values
    results.scalars.update(statistic.scalars(layer, values))


def _warn_once(statistic: Any, error: Exception, warned: set[str]) -> None:
    warn_once(warned, statistic.name, f"actviz: the statistic {statistic.name!r} failed on the host, "
              f"{type(error).__name__}: {error} (training goes on; warned once)")
    logger.debug("statistic %s failed", statistic.name, exc_info=error)


class PendingStep:
    """One step's reductions and picture sources, from the hooks to the writer thread.

    Args:
        step: The step number.
        bins: Histogram buckets, for :func:`~actviz.summaries.one_tensor.finish`.

    Example:
        >>> from actviz.summaries.one_tensor import start_summary
        >>> pending = PendingStep(3, bins=4)
        >>> summary = start_summary(torch.tensor([2.0, -6.0]))
        >>> summary.tag, summary.scaled = "fc", True
        >>> pending.gradients.append(summary)
        >>> pending.loss_scale = torch.tensor(2.0)
        >>> results = pending.resolve()
        >>> results.gradients["fc"].max, results.scalars
        (1.0, {'amp/grad_scale': 2.0})
    """

    def __init__(self, step: int, bins: int) -> None:
        self.step = step
        self.bins = bins
        self.activations = TaggedReductions("activations")  # each layer's output
        self.gradients = TaggedReductions("gradients")  # the gradient of the loss with respect to that output
        self.weights = TaggedReductions("weights")  # each watched parameter
        self.weight_grads = TaggedReductions("weight_grads")  # its gradient
        #: The AMP loss scale of this step's backward pass, a 0-dim tensor on its device: written as
        #: ``amp/grad_scale``, and the scaled summaries are divided by it on the host, so the GPU never waits to read it.
        self.loss_scale: torch.Tensor | None = None
        self._pictures: list[Picture] = []
        self._scalars: list[tuple[str, torch.Tensor | int, bool]] = []  # a tensor, or a row of self.small
        self._texts: dict[str, str] = {}
        #: Each per-layer statistic's device half (:mod:`actviz.statistics`), finished on the host after the summaries.
        self.layer_values = LayerValues()
        self._host_work: list[tuple[Callable[[StepResults, list[torch.Tensor]], None], tuple[torch.Tensor, ...]]] = []
        self._copy: HostCopy | None = None
        self._ids: list[int] = []
        #: The small tensors the hooks copy (:func:`~actviz.summaries.one_tensor.start_summary`), reduced together
        #: before merging or sending; ``ACTVIZ_CPU_SHORTCUTS`` is read once, here, per step.
        self.small = SmallTensors(cpu_shortcuts())

    @property
    def _kinds(self) -> tuple[TaggedReductions, ...]:
        return self.activations, self.gradients, self.weights, self.weight_grads

    @property
    def empty(self) -> bool:
        return not (any(self._kinds) or self.loss_scale is not None or self._pictures
                    or self._scalars or self._host_work or self.layer_values.tensors)

    @property
    def mergeable(self) -> list[tuple[str, Reduction]]:
        """``(kind/tag, reduction)`` of the summaries that differ between ranks, kind by kind in the order added.

        The small tensors are reduced on the device first, so that every reduction has its header there to merge.
        """
        merged = [(kind, summary) for kind in self._kinds for summary in kind if summary.mergeable]
        for _, summary in merged:
            summary.join(self.small)  # a whole copy becomes a row of the small tensors, reduced on the device
        self.small.reduce()
        return [(f"{kind.name}/{summary.tag}", summary.reduction(self.small)) for kind, summary in merged]

    def add_scalar(self, tag: str, value: torch.Tensor, scaled: bool = False, join_small: bool = False) -> None:
        """Keep a one-element tensor, written as the scalar ``tag``; ``scaled``: divided by the loss scale on the
        host. With ``join_small``, where the step's small tensors of its device take it at no cost
        (:meth:`SmallTensors.joins <actviz.summaries.small_tensors.SmallTensors.joins>`), it is a row of their
        packed copy (it must not change until the step ends): no op of its own."""
        if join_small and self.small.joins(value):
            self._scalars.append((tag, self.small.add_copy(value.reshape(1)), scaled))
        else:
            self._scalars.append((tag, value, scaled))

    def add_host_work(self, finish: Callable[[StepResults, list[torch.Tensor]], None], *tensors: torch.Tensor) -> None:
        """Carry ``tensors`` to the host with the step; ``finish(results, host_tensors)`` runs on the writer thread."""
        self._host_work.append((finish, tensors))

    def add_text(self, tag: str, text: str) -> None:
        """Keep a text summary (markdown), written under ``tag``."""
        self._texts[tag] = text

    def add_picture(self, picture: Picture) -> None:
        """Keep ``picture``, drawn on the host by ``picture.draw(*sources)``, each source on the host."""
        self._pictures.append(picture)

    def send(self) -> None:
        """Start the copy to the host. Called once, on the training thread, when the step ends.

        Each distinct tensor goes once: a header matrix that many parameters share, a row
        that holds its sample behind it, a tensor's whole copy that is also its picture's source. The parameters
        copied end to end go as they are, their samples: the writer thread reduces them
        (:meth:`~actviz.summaries.small_tensors.SmallTensors.pack`), unless a merge across ranks has reduced them on
        the device already (:attr:`mergeable`).
        """
        self.small.pack()
        unique: dict[int, torch.Tensor] = {id(tensor): tensor for tensor in self.small.device_tensors()}
        for kind in self._kinds:
            for summary in kind:  # many share one header and one sample: look each up once
                reduction = summary.made
                if reduction is None:  # a whole copy, or a row of self.small (its batch's tensors are in)
                    if summary.copy is not None:
                        unique[id(summary.copy)] = summary.copy
                    continue
                header, sample = reduction.header, reduction.sample
                if id(header) not in unique or id(sample) not in unique or reduction.counts is not None:
                    for tensor in reduction.device_tensors():
                        unique[id(tensor)] = tensor
        for picture in self._pictures:
            for source in picture.sources:
                unique[id(source)] = source
        if self.loss_scale is not None:
            unique[id(self.loss_scale)] = self.loss_scale
        for _, value, _ in self._scalars:
            if not isinstance(value, int):  # a row of self.small goes with its batch
                unique[id(value)] = value
        for _, carried in self._host_work:
            for tensor in carried:
                unique[id(tensor)] = tensor
        for tensor in self.layer_values.tensors:
            unique[id(tensor)] = tensor
        self._ids = list(unique)
        self._copy = HostCopy(list(unique.values()))

    def resolve(self) -> StepResults:
        """Wait for the copy, then finish every summary and draw every picture. Runs on the writer thread."""
        if self._copy is None:
            self.send()
        assert self._copy is not None
        host = dict(zip(self._ids, self._copy.wait()))
        self.small.receive(host)
        scale = 1.0 if self.loss_scale is None else float(host[id(self.loss_scale)])
        results = StepResults(self.step, texts=dict(self._texts))
        for kind in self._kinds:  # each summary finished, the scaled ones divided by the loss scale
            found = getattr(results, kind.name)
            for summary in kind:
                finished = summary.finish(self.small, host, self.bins)
                found[summary.tag] = finished.divided_by(scale) if summary.scaled and scale != 1.0 else finished
        for picture in self._pictures:
            image = picture.draw(*[host[id(source)] for source in picture.sources])
            (results.pictures if picture.full_tag else results.images)[picture.tag] = image
        if self.loss_scale is not None:
            results.scalars[GRAD_SCALE] = scale
        for tag, value, scaled in self._scalars:
            found = self.small.row_sample(value) if isinstance(value, int) else host[id(value)]
            results.scalars[tag] = float(found.reshape(-1)[0]) / (scale if scaled else 1.0)
        for work, carried in self._host_work:
            work(results, [host[id(tensor)] for tensor in carried])
        self.layer_values.finish(host, results)
        return results
