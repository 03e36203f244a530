"""The spike recorder: catch a gradient spike before clipping, name the layers, say how hard clipping acted.

It is on by default (with alerts). :class:`~actviz.diagnosis.step_norms.StepNorms` reads every
gradient's norm, on the device, at the end of each backward pass (before any clipping) and again
in the optimizer step pre-hook (after it), and copies the two global norms of each optimizer step
to the host without waiting. :class:`SpikeRecorder` judges the norm before clipping, so a run that
clips (``clip_grad_norm_(..., 1.0)``) still shows its spikes: at logging steps (or once half of the
:data:`RING` steps wait), every step since is checked against a baseline: the logs of the global
norms of the last :data:`WINDOW` steps that were not spikes (at least :data:`MIN_HISTORY`), their
median ``m`` and ``s``, 1.4826 x their median absolute deviation. A norm that is not finite, or
whose log is above ``m + max(log(FLOOR), SIGMA * s)``, is a spike. A gradient norm's
batch-to-batch noise is multiplicative, so the median and deviation of its logs follow a small
batch's wander (a 2x wander is no spike); :data:`FLOOR` keeps a very smooth run from calling a
small jump one.

Spikes no more than :data:`QUIET` steps apart are one episode, and only its first spike is
reported. Once an episode has :data:`ADAPT` spikes the change lasts: the last :data:`ADAPT`
steps become the new baseline. A lasting change of scale is one alert. The first spike of an
episode gives:

* an :class:`~actviz.diagnosis.alerts.Alert` (rule ``gradient_spike``) names the step, how hard clipping
  acted on it (the clip coefficient, after / before) and the layers ranked by their own z-scores over the
  ring buffer (a layer whose gradient was exactly 0 before, an expert no token chose, has none and comes
  after the layers that grew);
* with ``extras=[actviz.Spikes()]``, ``spikes/gradient_norm/{layer}`` and ``spikes/global_gradient_norm``
  (before clipping) are written for the last :data:`RING` steps, from the ring buffer, the steps are
  judged at every step, and the next :data:`FOLLOW` steps log in full, pictures included.

A step that does not log pays 2 ops per backward pass and 4 per optimizer step on the device, and no
sync (see docs/performance.md).

Example:
    >>> import tempfile, actviz
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    >>> with actviz.watch(model, tempfile.mkdtemp(), every=1000) as viz:  # clipped, and step 30 logs nothing
    ...     for step in range(40):
    ...         optimizer.zero_grad()
    ...         loss = model(torch.randn(8, 4)).square().mean() * (1000.0 if step == 30 else 1.0)
    ...         loss.backward()
    ...         _ = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
from dataclasses import dataclass

import torch

from .alerts import Alert
from .step_norms import RING, StepNorms
from ..output.pending_step import HostCopy
from ..tags import SPIKE_GLOBAL_NORM, SPIKE_NORM

__all__ = ["ADAPT", "DEFAULT_FLOOR", "FLOOR", "FOLLOW", "QUIET", "RING", "SIGMA", "WINDOW", "SpikeRecord", "SpikeRecorder", "clipping_said"]

logger = logging.getLogger(__name__)

#: Steps of the baseline, robust deviations above its median (the loss-spike rule of OLMo's and LLM-Foundry's
#: trainers), steps logged in full after a spike (the ring buffer's steps are
#: :data:`~actviz.diagnosis.step_norms.RING`).
WINDOW, SIGMA, FOLLOW = 128, 6.0, 3
#: Steps of history before a spike can be called (a deviation of fewer is noise).
MIN_HISTORY = 16
#: A spike is at least this x the baseline's median. Six robust deviations alone are a factor of 1.3 on the
#: smoothest healthy run measured (a tiny transformer at batch 2); healthy small-batch runs stay below six
#: robust deviations (docs/diagnosis.md), and a lasting 5x change is still caught.
FLOOR = 4.0
#: The floor of the check that runs by default (without ``actviz.Spikes()``): the healthy DCGAN of
#: ``scripts/diagnosis_benchmark.py`` (generator and discriminator watched, batch 16) wanders to 4.1x its median
#: within 128 steps, which 4x called a spike; the planted spikes the benchmark and the tests catch are 45x and more.
DEFAULT_FLOOR = 10.0
#: Steps without a spike that end an episode (the ring buffer's length: a spike in the last one's ring is
#: part of it).
QUIET = 16
#: Spikes of one episode after which the change is taken to last: the last ADAPT steps are the new baseline.
ADAPT = 16


@dataclass
class SpikeRecord:
    """A spike found on the training thread, finished on the writer thread by :meth:`resolve`.

    ``after`` is the global norm the optimizer applied at that step (after clipping), NaN where no optimizer
    stepped; ``ring`` the copy of :class:`~actviz.diagnosis.step_norms.StepNorms`' ring, ``(RING, 2, n)``.
    """

    step: int
    norm: float
    after: float
    median: float
    limit: float
    ring: HostCopy
    ring_steps: list[int]
    layer_of: list[int]
    layer_names: list[str]
    follow: bool = True  # actviz.Spikes(): the steps after it log in full
    floor: float = FLOOR  # the smallest ratio to the median that was a spike

    def resolve(self) -> tuple[Alert, dict[int, dict[str, float]]]:
        """The alert, and the scalars to write: ``{step: {tag: value}}`` for the ring buffer's steps."""
        (ring,) = self.ring.wait()
        before = ring[:, 0].to(torch.float64)  # the norms before clipping
        rows = sorted((step, index) for index, step in enumerate(self.ring_steps) if step >= 0)
        per_layer = torch.zeros(before.shape[0], len(self.layer_names), dtype=torch.float64)
        per_layer.index_add_(1, torch.tensor(self.layer_of, dtype=torch.long), before.square())
        per_layer = per_layer.sqrt()
        values: dict[int, dict[str, float]] = {}
        for step, index in rows:
            values[step] = {SPIKE_NORM.format(layer=name): float(per_layer[index, i])
                            for i, name in enumerate(self.layer_names)}
            values[step][SPIKE_GLOBAL_NORM] = float(before[index].square().sum().sqrt())
        ranked = sorted(((self._z_score(per_layer, rows, i), name) for i, name in enumerate(self.layer_names)),
                        key=lambda item: -item[0] if not math.isnan(item[0]) else math.inf)
        named = ", ".join(f"{name} ({f'z={z:.3g}' if not math.isnan(z) else 'no z-score: no gradient before'})"
                          for z, name in ranked[:5])
        what = "is not finite" if not math.isfinite(self.norm) else f"{self.norm:.3g} is above {self.limit:.3g}"
        message = (f"gradient spike at step {self.step}: the global gradient norm before clipping {what} (the median "
                   f"{self.median:.3g} of the last {WINDOW} steps without a spike, times the larger of {self.floor:g} and "
                   f"{SIGMA:g} robust deviations of the log norm); {clipping_said(self.norm, self.after)}; layers by "
                   f"z-score over the last {len(rows)} steps: {named}. " + (
                       f"The next {FOLLOW} steps are logged in full" if self.follow else
                       "With extras=[actviz.Spikes()] the steps after a spike are logged in full"))
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
    """Judges the global gradient norm before clipping of every optimizer step, read by a
    :class:`~actviz.diagnosis.step_norms.StepNorms`.

    Args:
        norms: What reads the norms, on the device, at every step.
        follow: ``actviz.Spikes()`` was given: the norms are judged at every step, the :data:`FOLLOW` steps
            after a spike log in full (:meth:`forces`) and the ring's norms are written. Without it (the
            default) they are judged at logging steps, or once half the ring waits, a spike is at least
            :data:`DEFAULT_FLOOR` x the median, and it is an alert; a norm that is not finite is left to the
            ``nonfinite`` rule.

    Call :meth:`forces` at the start of each step (the watcher's schedule override) and
    :meth:`close` at the end.
    """

    def __init__(self, norms: StepNorms, follow: bool = True) -> None:
        self.norms = norms
        self.follow = follow
        self.floor = FLOOR if follow else DEFAULT_FLOOR
        self._history: deque[float] = deque(maxlen=WINDOW)  # log norms of the steps without a spike
        self._recent: deque[float] = deque(maxlen=ADAPT)  # log norms of the last steps, spikes included
        self._quiet = QUIET  # steps since the last spike: an episode is under way while below QUIET
        self._episode_spikes = 0
        self._force_until = -1
        self._records: deque[SpikeRecord] = deque()
        self._lock = threading.Lock()
        self._nonfinite_seen = False

    def forces(self, step: int, logs: bool = True) -> bool:
        """At the start of ``step`` (``logs``: it is a logging step): judge the norms whose copy is done; True
        while ``step`` is one of the steps after a spike (with ``follow``)."""
        norms = self.norms
        norms.commit_unstepped()
        if self.follow or logs or norms.waiting >= RING // 2:
            for done, before, after in norms.finished():
                self._judge(done, before, step, after)
        return self.follow and step <= self._force_until

    def judge_the_rest(self, now: int) -> bool:
        """At ``close()``: judge every step recorded (waiting for its copy); whether a spike is left to write."""
        self.norms.commit_unstepped(closing=True)  # rank 0 alone closes: no sum over the ranks
        for done, before, after in self.norms.finished(wait=True):
            self._judge(done, before, now, after)
        with self._lock:
            return bool(self._records)

    def take_records(self) -> list[SpikeRecord]:
        """The spikes found since the last call (for the writer thread)."""
        with self._lock:
            records, self._records = list(self._records), deque()
        return records

    def close(self) -> None:
        """Stop reading norms. Safe to call more than once."""
        self.norms.close()

    def _judge(self, step: int, norm: float, now: int, after: float = math.nan) -> None:
        """Add one step's global norm (before clipping; ``after`` it) to the baseline, or call it a spike (see the
        module's docstring)."""
        median, limit = self.baseline()
        if not math.isfinite(norm):
            if not self._nonfinite_seen and self.follow:  # NaN from here on: one alert is enough; by default the
                # nonfinite rule names it, with its layer, at the next logging step
                self._nonfinite_seen = True
                self._spike(step, norm, after, median, limit, now)
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
            self._spike(step, norm, after, median, limit, now)
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
            >>> recorder = SpikeRecorder(StepNorms([], [], [], lambda: None))
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
        return math.exp(middle), math.exp(middle + max(math.log(self.floor), SIGMA * spread))

    def _spike(self, step: int, norm: float, after: float, median: float, limit: float, now: int) -> None:
        ring = self.norms.ring
        assert ring is not None
        self._force_until = now + FOLLOW - 1  # this step and the next FOLLOW - 1
        record = SpikeRecord(step, norm, after, median, limit, HostCopy([ring.clone()]), self.norms.judged_steps(),
                             self.norms.layer_of, self.norms.layer_names, self.follow, self.floor)
        with self._lock:
            self._records.append(record)


def clipping_said(before: float, after: float) -> str:
    """How hard clipping acted on a step, in words: the clip coefficient ``after / before``.

    Example:
        >>> clipping_said(200.0, 1.0)
        'clipping scaled the gradient by 0.005 (the optimizer applied a norm of 1)'
        >>> clipping_said(2.0, 2.0), clipping_said(2.0, float("nan"))[:25]
        ('no clipping on that step', 'no optimizer step applied')
    """
    if math.isnan(after):
        return "no optimizer step applied it (an update by hand): how hard clipping acted is not known"
    if not (math.isfinite(before) and before > 0):
        return f"the optimizer applied a norm of {after:.3g}"
    coefficient = after / before
    if abs(coefficient - 1.0) <= 1e-4:
        return "no clipping on that step"
    return f"clipping scaled the gradient by {coefficient:.3g} (the optimizer applied a norm of {after:.3g})"
