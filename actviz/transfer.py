"""From the device to the writer thread: one step's small results, in one copy per device.

The hooks leave :class:`~actviz.summaries.Reduction` objects and picture sources on
the tensors' devices in a :class:`PendingStep`. When the step ends,
:meth:`PendingStep.send` packs every tensor of a device into one byte buffer and
starts a single copy to the host; on a GPU the copy goes to pinned memory without
blocking, so the training thread never waits. :meth:`PendingStep.resolve`, on the
writer thread, waits for the copy and finishes the summaries and pictures there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .options import cpu_shortcuts
from .results import StepResults
from .summaries import Reduction, finish

__all__ = ["HostCopy", "PendingStep"]

#: Turns a picture's sources, once on the host, into a ``uint8`` image.
Draw = Callable[..., torch.Tensor]


class HostCopy:
    """Tensors on their way to the host: one copy per device, started when made.

    CPU tensors need no copy; with ``ACTVIZ_CPU_SHORTCUTS=0`` they are packed all the
    same, so that the packing is tested and counted on a CPU.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._count = len(tensors)
        self._ready: dict[int, torch.Tensor] = {}
        by_device: dict[torch.device, list[int]] = {}
        skip_cpu = cpu_shortcuts()
        for index, tensor in enumerate(tensors):
            if tensor.device.type == "cpu" and skip_cpu:
                self._ready[index] = tensor
            else:
                by_device.setdefault(tensor.device, []).append(index)
        self._copies = [_DeviceCopy([(i, tensors[i]) for i in indices]) for indices in by_device.values()]

    def wait(self) -> list[torch.Tensor]:
        """The tensors on the host, in the order given. Waits for the copies."""
        for copy in self._copies:
            self._ready.update(copy.wait())
        self._copies = []
        return [self._ready[index] for index in range(self._count)]


class _DeviceCopy:
    """Every tensor of one device, packed as bytes (widest dtype first, so each stays aligned) and copied."""

    def __init__(self, items: list[tuple[int, torch.Tensor]]) -> None:
        by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for index, tensor in items:
            by_dtype.setdefault(tensor.dtype, []).append((index, tensor))
        dtypes = sorted(by_dtype, key=lambda dtype: (-dtype.itemsize, str(dtype)))
        flats = [torch.cat([tensor.reshape(-1) for _, tensor in by_dtype[dtype]]) for dtype in dtypes]
        self._layout = [
            (dtype, [(index, tensor.shape, tensor.numel()) for index, tensor in by_dtype[dtype]]) for dtype in dtypes
        ]
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

    def wait(self) -> dict[int, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        found: dict[int, torch.Tensor] = {}
        offset = 0
        for dtype, entries in self._layout:
            length = sum(numel for _, _, numel in entries)
            values = self._host[offset : offset + length * dtype.itemsize].view(dtype)
            offset += length * dtype.itemsize
            position = 0
            for index, shape, numel in entries:
                found[index] = values[position : position + numel].view(shape)
                position += numel
        return found


class PendingStep:
    """One step's reductions and picture sources, from the hooks to the writer thread.

    Args:
        step: The step number.
        bins: Histogram buckets, for :func:`~actviz.summaries.finish`.
    """

    def __init__(self, step: int, bins: int) -> None:
        self.step = step
        self.bins = bins
        self._summaries: list[tuple[str, str, Reduction, bool]] = []
        self._mergeable: list[tuple[str, Reduction]] = []
        self._pictures: list[tuple[str, Draw, tuple[torch.Tensor, ...], bool]] = []
        self._scalars: list[tuple[str, torch.Tensor]] = []
        self._texts: dict[str, str] = {}
        self._host_work: list[tuple[Callable[[StepResults, list[torch.Tensor]], None], tuple[torch.Tensor, ...]]] = []
        self._copy: HostCopy | None = None

    @property
    def empty(self) -> bool:
        return not (self._summaries or self._pictures or self._scalars or self._host_work)

    def add(self, kind: str, tag: str, reduction: Reduction, scaled: bool = False, mergeable: bool = False) -> None:
        """Keep one summary: ``kind`` is ``activations``, ``gradients``, ``weights`` or ``weight_grads``.

        ``scaled``: the tensor is multiplied by the loss scale (see :meth:`set_loss_scale`).
        ``mergeable``: it differs between ranks, and ``merge_ranks=True`` merges it (see :mod:`actviz.merge`).
        """
        self._summaries.append((kind, tag, reduction, scaled))
        if mergeable:
            self._mergeable.append((f"{kind}/{tag}", reduction))

    @property
    def mergeable(self) -> list[tuple[str, Reduction]]:
        """``(kind/tag, reduction)`` of the summaries that differ between ranks, in the order added."""
        return self._mergeable

    def add_scalar(self, tag: str, value: torch.Tensor) -> None:
        """Keep a 0-dim tensor, written as the scalar ``tag``."""
        self._scalars.append((tag, value))

    def add_host_work(self, finish: Callable[[StepResults, list[torch.Tensor]], None], *tensors: torch.Tensor) -> None:
        """Carry ``tensors`` to the host with the step; ``finish(results, host_tensors)`` runs on the writer thread."""
        self._host_work.append((finish, tensors))

    def add_text(self, tag: str, text: str) -> None:
        """Keep a text summary (markdown), written under ``tag``."""
        self._texts[tag] = text

    def set_loss_scale(self, scale: torch.Tensor) -> None:
        """The AMP loss scale of this step's backward pass, written as ``amp/grad_scale``.

        Scaled summaries are divided by it on the host, so the GPU never waits to read it.
        """
        self.add_scalar("amp/grad_scale", scale)

    def add_picture(self, tag: str, draw: Draw, *sources: torch.Tensor, full_tag: bool = False) -> None:
        """Keep what ``draw(*sources)`` turns into a picture on the host.

        ``tag`` is a layer's name, written as ``feature_maps/{tag}``, or with ``full_tag``
        the whole tag (``probe/input``, ``gradcam/features.10``).
        """
        self._pictures.append((tag, draw, sources, full_tag))

    def send(self) -> None:
        """Start the copy to the host. Called once, on the training thread, when the step ends."""
        tensors = [tensor for _, _, reduction, _ in self._summaries for tensor in reduction.device_tensors()]
        tensors += [source for _, _, sources, _ in self._pictures for source in sources]
        tensors += [value for _, value in self._scalars]
        tensors += [tensor for _, carried in self._host_work for tensor in carried]
        self._copy = HostCopy(tensors)

    def resolve(self) -> StepResults:
        """Wait for the copy, then finish every summary and draw every picture. Runs on the writer thread."""
        if self._copy is None:
            self.send()
        assert self._copy is not None
        host: Iterator[torch.Tensor] = iter(self._copy.wait())
        results = StepResults(self.step, texts=dict(self._texts))
        for kind, tag, reduction, _ in self._summaries:
            reduction.receive(host)
        for tag, draw, sources, full_tag in self._pictures:
            picture = draw(*[next(host) for _ in sources])
            (results.pictures if full_tag else results.images)[tag] = picture
        for tag, _ in self._scalars:
            results.scalars[tag] = float(next(host))
        for work, carried in self._host_work:
            work(results, [next(host) for _ in carried])
        scale = results.scalars.get("amp/grad_scale", 1.0)
        for kind, tag, reduction, scaled in self._summaries:
            summary = finish(reduction, self.bins)
            getattr(results, kind)[tag] = summary.divided_by(scale) if scaled and scale != 1.0 else summary
        return results
