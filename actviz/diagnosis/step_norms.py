"""The gradient norm of every optimizer step, before and after clipping, kept on the device.

A training loop clips between its backward pass and its optimizer step (``clip_grad_norm_``,
``clip_grad_value_``, Accelerate's, Lightning's ``gradient_clip_val``, the Hugging Face Trainer's
``max_grad_norm``), and actviz's optimizer step pre-hook only sees what clipping left. So
:class:`StepNorms` reads the gradients twice per optimizer step, one norm per gradient each time:

* **before clipping**, at the end of each backward pass: a post-accumulate-grad hook on each trainable
  parameter (a Python call, no op) asks autograd for a callback at the pass's end; that callback asks
  for one more, which runs after every callback queued during the pass (DDP's all-reduce, FSDP's
  reduce-scatter), and there ``torch._foreach_norm`` of every gradient is stacked into the ring row of
  the step under way. With gradient accumulation each micro-batch's pass writes the same row: the
  last one, the complete gradient, stays;
* **after clipping**, in the optimizer step pre-hook (:mod:`actviz.common.optimizer_steps`): the same
  two ops into the row's second half, then ``torch.linalg.vector_norm`` of both halves (the two global
  norms) and their copy to the host, started without waiting. A step whose closure runs the backward
  and the clipping inside it (LBFGS, Lightning) is read in the step's post-hook instead.

Each row of the ring (``(RING, 2, n)``, float32, on the gradients' device) holds one optimizer step:
``[0]`` the per-parameter norms before clipping, ``[1]`` after. A loop that updates by hand
(``p.data.add_(p.grad, alpha=-lr)``, no optimizer object) has no optimizer step: its row is committed
at the next forward, with the norms before clipping only (``[1]`` is NaN): its loop zeroes the
gradients before that forward, so what it applied is not there to read.

With ``Options(grad_scaler=scaler)`` the norms before clipping are divided by the loss scale the pass's
gradients carry (one more op per pass); the norms after it are read once ``scaler.step`` has unscaled them.

Cost of a step that logs nothing: 2 ops per backward pass and 4 per optimizer step, no sync
(docs/performance.md).

Under FSDP2 each rank reads its local shards (an op on a DTensor could start a collective on one rank
alone), before clipping once FSDP2's reduce-scatter has set them (it runs their post-accumulate hooks), and
:class:`~actviz.diagnosis.rank_sums.RankSums` sums them over the ranks at each logging step's optimizer
step (one ``all_reduce``, on every rank). Until then a row holds this rank's shards: not written, not judged.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> norms = StepNorms(list(model.named_parameters()), [0, 0], ["fc"], lambda: 0)
    >>> model(torch.ones(1, 2)).sum().backward()  # gradients [1, 1] and [1]: norm 3 ** 0.5
    >>> _ = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    >>> optimizer.step()
    >>> [(step, round(before, 4), round(after, 4)) for step, before, after in norms.finished()]
    [(0, 1.7321, 0.5)]
    >>> norms.close(); norms.close()
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..common._internals import grad_scaler_scale, queue_end_of_backward
from ..common.optimizer_steps import subscribe
from ..common.owned_hooks import HookHandles
from ..common.safe_warnings import warn_safely
from ..options import cpu_shortcuts
from ..summaries.merge_ranks import is_sharded
from ..summaries.one_tensor import local_shard
from .rank_sums import RankSums

__all__ = ["RING", "StepNorms", "step_norms_of", "weak_clock"]

logger = logging.getLogger(__name__)

#: Optimizer steps the ring buffer holds.
RING = 16


class StepNorms:
    """Every optimizer step's gradient norms, before and after clipping (see the module docstring).

    Args:
        parameters: ``(name, parameter)`` of the parameters whose gradients are read: the trainable ones are.
        layer_of: For each of ``parameters``' trainable ones, in order, the index of its layer in ``layer_names``.
        layer_names: The layers the norms are grouped by (per-layer shares, spike reports).
        current_step: The number of the step under way (the watcher's last started step), or ``None``.

    Attributes:
        stepped: Whether an optimizer holding one of the parameters has stepped.
        sharded: A parameter is sharded across ranks (FSDP2): rows are summed over the ranks at logging steps.
        host_copies: Each step's global norms go to the host (not on a rank that only adds to rank 0's sums).
    """

    def __init__(self, parameters: Sequence[tuple[str, nn.Parameter]], layer_of: Sequence[int],
                 layer_names: Sequence[str], current_step: Callable[[], int | None]) -> None:
        self.params = [param for _, param in parameters if param.requires_grad]
        self.layer_of = list(layer_of)
        self.layer_names = list(layer_names)
        self.ring: torch.Tensor | None = None
        self.ring_steps = [-1] * RING
        self.stepped = False
        self.grad_scaler: Any = None  # Options(grad_scaler=): the norms before clipping are divided by its scale
        self.sharded = any(map(is_sharded, self.params))  # FSDP2: each rank reads its shards, summed at logging steps
        self.host_copies = True
        self._ranks = RankSums(self.params, RING) if self.sharded else None
        self._ids = {id(param) for param in self.params}
        self._current_step = current_step
        self._host: torch.Tensor | None = None
        self._zeros: dict[int, torch.Tensor] = {}
        self._slot = 0
        self._measured = False  # a backward's end wrote the row under way
        self._measured_step: int | None = None  # the step under way then
        self._queued = False  # an end-of-backward callback is asked for
        self._last: tuple[Any, int] | None = None  # (optimizer, slot) of the last step recorded
        self._waiting: deque[tuple[list[int], Any, torch.Tensor]] = deque()  # (steps, event, (steps, 2) on the host)
        self._failed = False
        self._pid = os.getpid()  # a forked child (hogwild workers) reads nothing: its parent's watcher is not there
        self._handles = HookHandles()
        self._unhooked = list(self.params)  # a lazy module's parameters (nn.LazyLinear) are hooked once they have a value
        self._hook_the_ready()
        self._stepping: Any = None  # the optimizer whose step began with no backward's norms: a closure may run one
        self._subscription = subscribe(self._on_optimizer_step, after=self._on_optimizer_done) if self.params else None

    def _hook_the_ready(self) -> None:
        """Put the post-accumulate-grad hook on each parameter not hooked yet that has a value."""
        ref = weakref.ref(self)  # the hooks hold the recorder weakly: a dropped watcher goes

        def accumulated(param: torch.Tensor) -> None:  # one Python call per parameter and pass: kept inline
            found = ref()
            if found is not None and not (found._queued or found._failed):
                found._on_accumulated()

        ready = [param for param in self._unhooked if not is_lazy(param)]
        self._unhooked = [param for param in self._unhooked if is_lazy(param)]
        for param in ready:
            self._handles.add("accumulated", param.register_post_accumulate_grad_hook(accumulated))

    @property
    def waiting(self) -> int:
        """Steps whose copy to the host is under way or not yet read (:meth:`finished`)."""
        return sum(len(steps) for steps, _, _ in self._waiting)

    def logging_step_started(self) -> None:
        """A step the schedule logs started (on every rank alike): with sharded parameters, the next step recorded
        sums the rows over the ranks (the one collective), so that its norms, and the steps' since the last logging
        step, are whole."""
        if self._ranks is not None:
            self._ranks.due = True

    def judged_steps(self) -> list[int]:
        """The step of each ring row whose norms are whole (-1 for the others: a row being written, or one holding
        this rank's shards alone, not yet summed over the ranks)."""
        if self._ranks is None:
            return list(self.ring_steps)
        return [step if summed else -1 for step, summed in zip(self.ring_steps, self._ranks.summed)]

    def close(self) -> None:
        """Remove the hooks and stop listening to optimizer steps. Safe to call more than once."""
        self._unhooked = []
        self._handles.remove()
        if self._subscription is not None:
            self._subscription.remove()

    def row_applied_by(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The ring row (``(2, n)``) of the step ``optimizer`` is about to apply, or ``None``: called from a later
        listener of the same optimizer step pre-hook (the recorder subscribed first)."""
        if self._last is None or self._last[0] is not optimizer or self.ring is None or not self._whole(self._last[1]):
            return None
        return self.ring[self._last[1]]

    def row_committed_for(self, step: int) -> torch.Tensor | None:
        """The ring row of ``step`` if :meth:`commit_unstepped` recorded it last (an update by hand), else ``None``."""
        last = self._last
        if last is None or last[0] is not None or self.ring is None or self.ring_steps[last[1]] != step or not self._whole(last[1]):
            return None
        return self.ring[self._last[1]]

    def _whole(self, slot: int) -> bool:  # not this rank's shards alone (FSDP2)
        return self._ranks is None or self._ranks.summed[slot]

    def commit_unstepped(self, closing: bool = False) -> None:
        """At a training forward: a loop that steps no optimizer (an update by hand) has its last backward's
        norms recorded now, as a step without the norms after clipping. ``closing``: at ``close()``, which one rank
        may call alone: no sum over the ranks."""
        if self._unhooked and not self._failed:
            self._guarded(self._hook_the_ready)
        if not self.stepped and self._measured and self._measured_step is not None and not self._failed:
            self._guarded(self._record, self._measured_step, None, not closing)

    def finished(self, wait: bool = False) -> list[tuple[int, float, float]]:
        """``(step, norm before clipping, norm after)`` of the steps whose copy to the host is done, in order; with
        ``wait`` (at ``close()``), of every step recorded."""
        done = []
        while self._waiting:
            steps, event, value = self._waiting[0]
            if event is not None and wait:
                event.synchronize()  # at close(): the run is over
            elif event is not None and not event.query():
                break  # the device is not there yet: a later call
            self._waiting.popleft()
            pairs = value.tolist() if value.dim() == 2 else [value.tolist()]
            done.extend(sorted((step, before, after) for step, (before, after) in zip(steps, pairs)))
        return done

    def _on_accumulated(self) -> None:
        """A gradient of the backward pass under way was accumulated: ask for its end, once per pass."""
        if self._queued or self._failed or os.getpid() != self._pid:
            return
        self._queued = True
        try:
            queue_end_of_backward(self._after_the_pass_callbacks)
        except RuntimeError:  # not inside an engine's pass: nothing to wait for
            self._queued = False

    def _after_the_pass_callbacks(self) -> None:
        """Queued during the pass: queue the measurement behind the callbacks queued after this one (DDP's)."""
        try:
            queue_end_of_backward(self._measure)
        except RuntimeError:
            self._measure()

    def _measure(self) -> None:
        self._queued = False
        if not self._failed:
            self._guarded(self._measure_now)

    def _measure_now(self) -> None:
        row = self._row(self._slot)
        torch.stack(self._norms(), out=row[0])
        scaler = self.grad_scaler
        scale = None if scaler is None or not scaler.is_enabled() else grad_scaler_scale(scaler)  # no sync
        if scale is not None:  # the pass's gradients carry the loss scale: one op with AMP
            row[0].div_(scale)
        if self._ranks is not None:  # this rank's shards now: not whole until summed
            self._ranks.summed[self._slot] = False
        self._measured, self._measured_step = True, self._current_step()

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._failed or os.getpid() != self._pid or not self._holds(optimizer):
            return
        self.stepped = True
        if not self._measured:  # a closure (LBFGS, Lightning) runs the backward and the clipping inside the step
            self._stepping = optimizer
            return
        self._record_now(optimizer)

    def _on_optimizer_done(self, optimizer: torch.optim.Optimizer) -> None:
        """After the step: if its closure ran a backward (or none was seen: gradients set by hand), its gradients
        as the closure left them, clipped, are the step's."""
        if self._stepping is not optimizer or self._failed or os.getpid() != self._pid:
            return
        self._stepping = None
        self._record_now(optimizer)

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(param) in self._ids for group in optimizer.param_groups for param in group["params"])

    def _record_now(self, optimizer: torch.optim.Optimizer) -> None:
        step = self._current_step()
        if step is None or (self._last is not None and self.ring_steps[self._last[1]] == step):
            return  # a second optimizer of the same step (one for matrices, one for the rest): the first's row
        self._guarded(self._record, step, optimizer)

    def _record(self, step: int, optimizer: torch.optim.Optimizer | None, may_sum: bool = True) -> None:
        """Close the row under way as ``step``'s: with the norms after clipping when ``optimizer`` is about to
        step, and the norms before it read now if no backward's end wrote them. With sharded parameters, at a
        logging step (``may_sum``: on every rank alike), the rows not yet summed over the ranks are."""
        slot = self._slot
        row = self._row(slot)
        if optimizer is not None:
            torch.stack(self._norms(), out=row[1])
            if not self._measured:  # no end of backward seen (gradients set by hand): the same
                row[0].copy_(row[1])
        else:
            row[1].fill_(math.nan)
        self._measured = False
        self._last = (optimizer, slot)
        self.ring_steps[slot] = step
        self._slot = (slot + 1) % RING
        if self._ranks is not None and self._ranks.agreed is not False:  # FSDP2: summed at logging steps alone
            self._ranks.add(row, slot, step)
            if optimizer is not None and self._ranks.provisional:  # the first optimizer step ends the first logging
                self._ranks.due, self._ranks.provisional = True, False  # step, whose micro-batch was taken for a by-hand one
            if self._ranks.due and may_sum:
                self._ranks.provisional = optimizer is None and not self.stepped
                steps, totals = self._ranks.sum(self.ring, slot)  # type: ignore[arg-type]
                if self.host_copies:
                    self._copy_to_host(steps, totals, None)
            return
        self._copy_to_host([step], torch.linalg.vector_norm(row, dim=1), slot)

    def _copy_to_host(self, steps: list[int], totals: torch.Tensor, slot: int | None) -> None:
        """Start the copy of ``steps``' global norms (``(2,)`` for one step, ``(steps, 2)``) to the host, into the host
        ring's ``slot`` (or a buffer of their own), and queue it for :meth:`finished`."""
        event = None
        if len(self._waiting) >= RING:  # a copy never read (a device far behind, or no reader): it is gone
            self._waiting.popleft()
        if totals.device.type == "cpu" and (self._host is None or slot is None):
            value = totals  # on the host already
        else:
            value = self._host[slot] if slot is not None and self._host is not None else torch.empty(
                totals.shape, pin_memory=totals.device.type == "cuda")
            value.copy_(totals, non_blocking=True)
            if totals.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(totals.device))
        self._waiting.append((steps, event, value))

    def _row(self, slot: int) -> torch.Tensor:
        if self.ring is None:
            device = next((param.grad.device for param in self.params if param.grad is not None), self.params[0].device)
            self.ring = torch.zeros(RING, 2, len(self.params), device=device)
            if device.type != "cpu" or not cpu_shortcuts():
                self._host = torch.zeros(RING, 2, pin_memory=device.type == "cuda")
        return self.ring[slot]

    def _norms(self) -> list[torch.Tensor]:
        # a DTensor's local shard (FSDP2): an op on the DTensor could start a collective on this rank alone;
        # the shards' norms are summed over the ranks at logging steps (RankSums)
        grads = [local_shard(param.grad) if param.grad is not None else self._zero(param) for param in self.params]
        return torch._foreach_norm(grads, 2, dtype=torch.float32)

    def _zero(self, param: torch.Tensor) -> torch.Tensor:
        if id(param) not in self._zeros:
            self._zeros[id(param)] = torch.zeros((), device=param.device)
        return self._zeros[id(param)]

    def _guarded(self, function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 - never stop training; the norms end here
            self._failed = True
            self.close()
            warn_safely(f"actviz stops reading gradient norms before clipping: {type(error).__name__}: {error}",
                        RuntimeWarning)


def step_norms_of(model: nn.Module, layers: Sequence[tuple[str, nn.Module]],
                  current_step: Callable[[], int | None]) -> StepNorms:
    """A :class:`StepNorms` of every trainable parameter of ``model`` (what ``clip_grad_norm_(model.parameters())``
    reads), each grouped under the first of ``layers`` (``(tag name, module)``) that holds it, else under the
    module that owns it.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> norms = step_norms_of(model, [("first", model[0])], lambda: None)
        >>> norms.layer_names, norms.layer_of
        (['first', '1'], [0, 0, 1, 1])
        >>> norms.close()
    """
    owner: dict[int, int] = {}
    for index, (_, module) in enumerate(layers):
        for param in module.parameters():
            owner.setdefault(id(param), index)
    names = [name for name, _ in layers]
    others: dict[str, int] = {}
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    layer_of = []
    for name, param in trainable:
        if id(param) in owner:
            layer_of.append(owner[id(param)])
        else:
            module_name = name.rpartition(".")[0] or name
            layer_of.append(others.setdefault(module_name, len(names) + len(others)))
    return StepNorms(trainable, layer_of, names + list(others), current_step)


def weak_clock(owner: Any, attribute: str) -> Callable[[], int | None]:
    """The norms' clock: ``owner``'s step number ``attribute`` (a watcher's last started step), read through a weak
    reference, so that the norms (listening to every optimizer step of the process) never keep a dropped owner alive.

    Example:
        >>> class Owner:
        ...     step = 3
        >>> owner = Owner(); clock = weak_clock(owner, "step"); first = clock(); del owner
        >>> first, clock()
        (3, None)
    """
    ref = weakref.ref(owner)

    def current_step() -> int | None:
        found = ref()
        return None if found is None else getattr(found, attribute)

    return current_step
