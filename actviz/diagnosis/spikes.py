"""The spike recorder (``watch(..., spikes=True)``): catch a gradient spike, name the layers, log what follows.

Before every optimizer step that applies a watched parameter's gradient (through the one
pre-hook of :mod:`actviz.common.optimizer_steps`), :class:`SpikeRecorder` takes every watched
gradient's norm with one ``torch._foreach_norm``, stacks them into a row of a small device
ring buffer (the last :data:`RING` steps), takes the global norm of that row and starts its
copy to the host without waiting. At the start of a later step, once that copy is done
(the next step on a CPU, usually the next on a GPU), it is checked against a baseline: the
logs of the global norms of the last :data:`WINDOW` steps that were not spikes (at least
:data:`MIN_HISTORY`), their median ``m`` and ``s``, 1.4826 x their median absolute deviation.
A norm that is not finite, or whose log is above ``m + max(log(FLOOR), SIGMA * s)``, is a spike.
A gradient norm's batch-to-batch noise is multiplicative, so the median and deviation of its
logs follow a small batch's wander (a 2x wander is no spike); :data:`FLOOR` keeps a very
smooth run from calling a small jump one.

Spikes no more than :data:`QUIET` steps apart are one episode, and only its first spike is
reported. Once an episode has :data:`ADAPT` spikes the change lasts: the last :data:`ADAPT`
steps become the new baseline. A lasting change of scale is one alert. The first spike of an
episode gives:

* an :class:`~actviz.diagnosis.alerts.Alert` (rule ``gradient_spike``) names the step and the layers
  ranked by their own z-scores over the ring buffer (a layer whose gradient was exactly 0 before, an expert
  no token chose, has none and comes after the layers that grew);
* ``spikes/gradient_norm/{layer}`` and ``spikes/global_gradient_norm`` are written for the
  last :data:`RING` steps, from the ring buffer;
* the next :data:`FOLLOW` steps log in full, pictures included.

A step that does not log pays four ops on the device and no sync (see docs/diagnosis.md).

Example:
    >>> import tempfile, actviz
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    >>> with actviz.watch(model, tempfile.mkdtemp(), every=1000, extras=[actviz.Spikes()]) as viz:
    ...     for step in range(40):
    ...         optimizer.zero_grad()
    ...         loss = model(torch.randn(8, 4)).square().mean() * (1000.0 if step == 30 else 1.0)
    ...         loss.backward()
    ...         optimizer.step()
    >>> sorted({alert.rule for alert in viz.alerts})
    ['gradient_spike']
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .alerts import Alert
from ..common.optimizer_steps import subscribe
from ..options import cpu_shortcuts
from ..output.pending_step import HostCopy
from ..common.safe_warnings import warn_safely
from ..summaries.one_tensor import local_shard
from ..tags import SPIKE_GLOBAL_NORM, SPIKE_NORM

__all__ = ["ADAPT", "FLOOR", "FOLLOW", "QUIET", "RING", "SIGMA", "WINDOW", "SpikeRecord", "SpikeRecorder"]

logger = logging.getLogger(__name__)

#: Steps of the baseline, robust deviations above its median (the loss-spike rule of OLMo's and LLM-Foundry's
#: trainers), steps in the ring buffer, steps logged in full after a spike.
WINDOW, SIGMA, RING, FOLLOW = 128, 6.0, 16, 3
#: Steps of history before a spike can be called (a deviation of fewer is noise).
MIN_HISTORY = 16
#: A spike is at least this x the baseline's median. Six robust deviations alone are a factor of 1.3 on the
#: smoothest healthy run measured (a tiny transformer at batch 2); healthy small-batch runs stay below six
#: robust deviations (docs/diagnosis.md), and a lasting 5x change is still caught.
FLOOR = 4.0
#: Steps without a spike that end an episode (the ring buffer's length: a spike in the last one's ring is
#: part of it).
QUIET = 16
#: Spikes of one episode after which the change is taken to last: the last ADAPT steps are the new baseline.
ADAPT = 16


@dataclass
class SpikeRecord:
    """A spike found on the training thread, finished on the writer thread by :meth:`resolve`."""

    step: int
    norm: float
    median: float
    limit: float
    ring: HostCopy
    ring_steps: list[int]
    layer_of: list[int]
    layer_names: list[str]

    def resolve(self) -> tuple[Alert, dict[int, dict[str, float]]]:
        """The alert, and the scalars to write: ``{step: {tag: value}}`` for the ring buffer's steps."""
        (ring,) = self.ring.wait()
        rows = sorted((step, index) for index, step in enumerate(self.ring_steps) if step >= 0)
        per_layer = torch.zeros(ring.shape[0], len(self.layer_names), dtype=torch.float64)
        per_layer.index_add_(1, torch.tensor(self.layer_of), ring.to(torch.float64).square())
        per_layer = per_layer.sqrt()
        values: dict[int, dict[str, float]] = {}
        for step, index in rows:
            values[step] = {SPIKE_NORM.format(layer=name): float(per_layer[index, i])
                            for i, name in enumerate(self.layer_names)}
            values[step][SPIKE_GLOBAL_NORM] = float(ring[index].double().square().sum().sqrt())
        ranked = sorted(((self._z_score(per_layer, rows, i), name) for i, name in enumerate(self.layer_names)),
                        key=lambda item: -item[0] if not math.isnan(item[0]) else math.inf)
        named = ", ".join(f"{name} ({f'z={z:.3g}' if not math.isnan(z) else 'no z-score: no gradient before'})"
                          for z, name in ranked[:5])
        what = "is not finite" if not math.isfinite(self.norm) else f"{self.norm:.3g} is above {self.limit:.3g}"
        message = (f"gradient spike at step {self.step}: the global gradient norm {what} (the median {self.median:.3g} "
                   f"of the last {WINDOW} steps without a spike, times the larger of {FLOOR:g} and {SIGMA:g} robust "
                   f"deviations of the log norm); layers by z-score over the last {len(rows)} steps: {named}. The next "
                   f"{FOLLOW} steps are logged in full")
        top = ranked[0][1] if ranked else None
        return Alert(self.step, "gradient_spike", top, "global_gradient_norm", self.norm, self.limit, message), values

    def _z_score(self, per_layer: torch.Tensor, rows: list[tuple[int, int]], layer: int) -> float:
        now = [float(per_layer[index, layer]) for step, index in rows if step == self.step]
        before = [float(per_layer[index, layer]) for step, index in rows if step < self.step]
        if not now or len(before) < 2 or not math.isfinite(now[0]):
            return math.inf if now and not math.isfinite(now[0]) else math.nan
        if not any(before):  # no gradient before (an expert no token chose): growth from 0 has no z-score
            return math.nan  # ranked after the layers that grew
        sigma = statistics.pstdev(before)
        deviation = now[0] - statistics.fmean(before)
        return deviation / sigma if sigma > 0 else (math.inf if deviation > 0 else 0.0)


class SpikeRecorder:
    """Watches the global gradient norm of the watched parameters at every optimizer step.

    Args:
        layers: ``(tag name, module)`` of the watched layers, in model order.
        parameters: ``(name, parameter)`` of the watched parameters.
        current_step: Gives the step number of the optimizer step under way.

    Call :meth:`forces` at the start of each step (the watcher's schedule override) and
    :meth:`close` at the end.
    """

    def __init__(
        self, layers: Sequence[tuple[str, nn.Module]], parameters: Sequence[tuple[str, nn.Parameter]],
        current_step: Callable[[], int | None],
    ) -> None:
        owner: dict[int, int] = {}
        for index, (_, module) in enumerate(layers):
            for param in module.parameters():
                owner.setdefault(id(param), index)
        self._params = [param for _, param in parameters if param.requires_grad and id(param) in owner]
        self._layer_of = [owner[id(param)] for param in self._params]
        self._layer_names = [name for name, _ in layers]
        self._ids = {id(param) for param in self._params}
        self._current_step = current_step
        self._ring: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._zeros: dict[int, torch.Tensor] = {}
        self._ring_steps = [-1] * RING
        self._slot = 0
        self._last_step: int | None = None
        self._waiting: deque[tuple[int, int, Any]] = deque()  # (step, slot, event) whose copy is under way
        self._history: deque[float] = deque(maxlen=WINDOW)  # log norms of the steps without a spike
        self._recent: deque[float] = deque(maxlen=ADAPT)  # log norms of the last steps, spikes included
        self._quiet = QUIET  # steps since the last spike: an episode is under way while below QUIET
        self._episode_spikes = 0
        self._force_until = -1
        self._records: deque[SpikeRecord] = deque()
        self._lock = threading.Lock()
        self._failed = False
        self._nonfinite_seen = False
        self._subscription = subscribe(self._on_optimizer_step) if self._params else None

    def forces(self, step: int) -> bool:
        """Check the norms whose copy is done; True while ``step`` is one of the steps after a spike."""
        self._check(step)
        return step <= self._force_until

    def take_records(self) -> list[SpikeRecord]:
        """The spikes found since the last call (for the writer thread)."""
        with self._lock:
            records, self._records = list(self._records), deque()
        return records

    def close(self) -> None:
        """Stop listening to optimizer steps. Safe to call more than once."""
        if self._subscription is not None:
            self._subscription.remove()

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        step = self._current_step()
        if self._failed or step is None or step == self._last_step:
            return
        if not any(id(param) in self._ids for group in optimizer.param_groups for param in group["params"]):
            return
        self._last_step = step
        try:
            self._record(step)
        except Exception as error:  # noqa: BLE001 - never stop training; spikes end here
            self._failed = True
            warn_safely(f"actviz's spike recorder stops: {type(error).__name__}: {error}", RuntimeWarning)

    def _record(self, step: int) -> None:
        # a DTensor's local shard (FSDP2): an op on the DTensor could start a collective on this rank alone
        grads = [local_shard(param.grad) if param.grad is not None else self._zero(param) for param in self._params]
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        if self._ring is None:
            device = norms[0].device
            self._ring = torch.zeros(RING, len(norms), device=device)
            pinned = device.type == "cuda"
            self._host = torch.zeros(RING, pin_memory=pinned) if device.type != "cpu" or not cpu_shortcuts() else None
        slot = self._slot
        self._slot = (slot + 1) % RING
        row = self._ring[slot]
        torch.stack(norms, out=row)
        total = torch.linalg.vector_norm(row)
        self._ring_steps[slot] = step
        event = None
        if self._host is None:  # a CPU tensor is on the host already
            value: Any = total
        else:
            self._host[slot].copy_(total, non_blocking=True)
            value = None
            if total.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(total.device))
        self._waiting.append((step, slot, (event, value)))

    def _zero(self, param: torch.Tensor) -> torch.Tensor:
        if id(param) not in self._zeros:
            self._zeros[id(param)] = torch.zeros((), device=param.device)
        return self._zeros[id(param)]

    def _check(self, now: int) -> None:
        while self._waiting:
            step, slot, (event, value) = self._waiting[0]
            if event is not None and not event.query():
                return  # the device is not there yet: check at a later step
            self._waiting.popleft()
            norm = float(value.detach().numpy()) if value is not None else float(self._host.numpy()[slot])
            self._judge(step, norm, now)

    def _judge(self, step: int, norm: float, now: int) -> None:
        """Add one step's global norm to the baseline, or call it a spike (see the module's docstring)."""
        median, limit = self.baseline()
        if not math.isfinite(norm):
            if not self._nonfinite_seen:  # NaN from here on: one alert is enough
                self._nonfinite_seen = True
                self._spike(step, norm, median, limit, now)
            return
        if norm <= 0:
            return  # no gradient reached the watched parameters: nothing to compare
        log_norm = math.log(norm)
        self._recent.append(log_norm)
        if norm <= limit:
            self._history.append(log_norm)
            self._quiet += 1
            return
        if self._quiet >= QUIET:  # the first spike of an episode
            self._episode_spikes = 0
            self._spike(step, norm, median, limit, now)
        self._quiet = 0
        self._episode_spikes += 1
        if self._episode_spikes >= ADAPT:  # a lasting change: the last ADAPT steps are the new baseline
            self._history.clear()
            self._history.extend(self._recent)
            self._episode_spikes = 0

    def baseline(self) -> tuple[float, float]:
        """``(median, limit)`` of the global norm now: the median of the baseline and the norm above which a
        step is a spike (``inf`` before :data:`MIN_HISTORY` steps).

        Example:
            >>> recorder = SpikeRecorder([], [], lambda: None)
            >>> for step in range(20):
            ...     recorder._judge(step, 1.0 if step % 2 else 2.0, step)
            >>> [round(value, 2) for value in recorder.baseline()]  # a 2x wander: the limit is 22x the median
            [1.41, 30.86]
        """
        history = self._history
        if len(history) < MIN_HISTORY:
            return (math.exp(statistics.median(history)) if history else math.nan), math.inf
        middle = statistics.median(history)
        spread = 1.4826 * statistics.median([abs(value - middle) for value in history])
        return math.exp(middle), math.exp(middle + max(math.log(FLOOR), SIGMA * spread))

    def _spike(self, step: int, norm: float, median: float, limit: float, now: int) -> None:
        assert self._ring is not None
        self._force_until = now + FOLLOW - 1  # this step and the next FOLLOW - 1
        record = SpikeRecord(step, norm, median, limit, HostCopy([self._ring.clone()]), list(self._ring_steps),
                             self._layer_of, self._layer_names)
        with self._lock:
            self._records.append(record)
