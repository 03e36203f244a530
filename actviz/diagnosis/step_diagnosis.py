"""What actviz adds to each step on the writer thread, before it is written: alerts, flow pictures, spikes.

:class:`Diagnosis` is the one object :class:`~actviz.output.writer_thread.Writer` calls with each
step's results (``diagnose=``): the health rules (:mod:`actviz.diagnosis.alerts`, :mod:`actviz.diagnosis.trends`), the flow pictures
(:mod:`actviz.diagnosis.flow`) and the spike recorder's findings (:mod:`actviz.diagnosis.spikes`). A failure
here warns once and the step is written all the same.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy

from .alerts import Alert, HealthMonitor, check_alerts
from .flow import FlowHistory
from .optimizer_audit import OptimizerAudit
from ..common.results import StepResults
from ..common.safe_warnings import warn_safely
from .spikes import SpikeRecorder
from .step_norms import StepNorms, step_norms_of
from .transformer_alerts import outlier_alerts
from .trends import health_monitor
from ..selection import parameter_tag_names
from ..tags import ALERTS
from ..statistics.unit_counts import is_relu_family

__all__ = ["Alert", "Diagnosis", "make_diagnosis", "norms_of_rank"]

logger = logging.getLogger(__name__)


class Diagnosis:
    """Health alerts, flow pictures and spike records of one watcher's run.

    Args:
        sink: The sink spike records are written to, as steps of their own (:class:`actviz.output.sink.Sink`).
        monitor: The health rules, or ``None`` with ``alerts=False``.
        flow: The flow pictures' history.
        spikes: ``watch(extras=[Spikes()])``: the steps after a spike log in full and its norms are written; without
            it, with the alerts on, a spike is an alert alone (:meth:`spike_recorder`).
        on_alert: Called with each alert (for spikes when the rules are off).

    Example:
        >>> from actviz.common.results import Summary
        >>> diagnosis = Diagnosis(None, HealthMonitor(check_alerts(True)), FlowHistory())
        >>> bad = Summary(4, 4, 0, 0.0, 0.0, 0.0, 0.0, [0.0])
        >>> diagnosis(StepResults(3, activations={"fc": bad}))
        >>> [(alert.step, alert.rule, alert.layer) for alert in diagnosis.alerts]
        [(3, 'nonfinite', 'fc')]
    """

    def __init__(
        self, sink: Any, monitor: HealthMonitor | None, flow: FlowHistory | None, spikes: bool = False,
        on_alert: Any = None,
    ) -> None:
        self.sink = sink
        self.monitor = monitor
        self.flow = flow
        self.record_spikes = spikes
        self.spikes: SpikeRecorder | None = None
        self._reporter = monitor or HealthMonitor(check_alerts(True) or {}, on_alert=on_alert)
        self._written_until = -1  # the last step the sink got: spike records write no step again, nor one before it
        self._failed: set[str] = set()
        self._later_spikes: list[Any] = []  # spike records of steps after the last one the writer had
        self._audit_alerts: deque[Alert] = deque()  # the optimizer audit's (training thread), said already

    def optimizer_audit(self, model: nn.Module, current_step: Callable[[], int | None]) -> OptimizerAudit | None:
        """Start the optimizer audit of ``model`` (:mod:`actviz.diagnosis.optimizer_audit`) where alerts are on."""
        if self.monitor is None:
            return None
        return OptimizerAudit(model, self._audit_alerts.extend, current_step)

    @property
    def judges_spikes(self) -> bool:
        """Whether gradient spikes are judged: with ``actviz.Spikes()``, or by default with the alerts on."""
        return self.record_spikes or self.monitor is not None

    def gradient_norms(self, model: nn.Module, layers: Sequence[tuple[str, nn.Module]],
                       current_step: Callable[[], int | None], clipping: bool, grad_scaler: Any) -> StepNorms | None:
        """Start reading every optimizer step's gradient norms (:class:`StepNorms`) if the spikes are judged or
        ``clipping`` (``gradient_clipping/*``) is on, and the spike recorder on them if judged (:attr:`spikes`);
        ``None`` with one warning where the parameters take no hook: the run goes on without them."""
        if not (self.judges_spikes or clipping) or self.spikes is not None:
            return None
        norms = _norms_or_warning(model, layers, current_step,
                                  "before clipping for this model (no spike check, no gradient_clipping/*)")
        if norms is None:
            return None
        norms.grad_scaler = grad_scaler
        if self.judges_spikes:
            self.spikes = SpikeRecorder(norms, follow=self.record_spikes)
        return norms

    @property
    def alerts(self) -> list[Alert]:
        """The alerts so far (the latest :data:`~actviz.diagnosis.alerts.KEPT_ALERTS`), in the order raised."""
        return list(self._reporter.alerts)

    def __call__(self, results: StepResults) -> None:
        """Add this step's alerts and flow pictures to ``results``; write spike records found since the last step."""
        if self.spikes is not None:
            self._guarded("spikes", self._write_spikes, results)
        self._written_until = max(self._written_until, results.step)  # the writer writes this step next
        if self._audit_alerts and self.monitor is not None:
            audited = [self._audit_alerts.popleft() for _ in range(len(self._audit_alerts))]  # thread-safe pops
            self._guarded("alerts", self.monitor.report, results, audited, False)
        if self.monitor is not None:
            outliers = results.layer_values.get("outliers")
            if outliers:  # after the attention rules' findings, which the step brought
                self._guarded("alerts", lambda: results.alerts.extend(outlier_alerts(results.step, outliers)))
            self._guarded("alerts", self.monitor.check, results)
        results.alerts = []  # with alerts=False, the transformer rules' findings are dropped with the rest
        if self.flow is not None:
            self._guarded("flow pictures", self.flow.add, results)

    def _write_spikes(self, results: StepResults) -> None:
        """Each spike record found since the last step: its ring buffer's norms of steps after the last one
        written, as steps of their own before ``results``; those of ``results``' step with it. Steps already
        written are left out, so that a sink gets each step once, in order. The alert goes with its own step
        where that is written here, else with ``results``. A spike after ``results``' step (found while the
        writer was behind) waits for a later step."""
        assert self.spikes is not None
        found = [*self._later_spikes, *self.spikes.take_records()]
        self._later_spikes = [record for record in found if record.step > results.step]
        for record in found:
            if record.step > results.step:
                continue
            alert, values = record.resolve()
            self._reporter.report(None, [alert])
            if not self.spikes.follow:  # the default check: the alert alone
                values = {}
            carrier = results
            for step, scalars in sorted(values.items()):
                if step == results.step:
                    results.scalars.update(scalars)
                elif self._written_until < step < results.step:
                    written = StepResults(step, scalars=scalars)
                    if step == alert.step:
                        written.texts[ALERTS], carrier = alert.line(), written
                    self.sink.write(written)
                    self._written_until = step
            if carrier is results:
                old = results.texts.get(ALERTS)
                results.texts[ALERTS] = f"{old}\n\n{alert.line()}" if old else alert.line()

    def _guarded(self, what: str, function: Any, *args: Any) -> None:
        if what in self._failed:
            return
        try:
            function(*args)
        except Exception as error:
            if what not in self._failed:
                self._failed.add(what)
                warn_safely(f"actviz's {what} failed and are skipped from now on: {type(error).__name__}: {error}")
            logger.debug("%s failed", what, exc_info=error)


class MatrixNames:
    """The tag names of a model's parameters with 2 or more dimensions, read when first asked.

    A lazy module's parameters (``nn.LazyLinear``) have no shape until its first forward, so the
    names are read again until none is lazy.

    Example:
        >>> import torch
        >>> model = nn.Sequential(nn.LazyLinear(3), nn.LayerNorm(3))
        >>> names = MatrixNames(model)
        >>> "0.weight" in names, "1.weight" in names
        (False, False)
        >>> _ = model(torch.zeros(2, 5))
        >>> "0.weight" in names, "1.weight" in names
        (True, False)
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._names: frozenset[str] | None = None

    def __contains__(self, name: object) -> bool:
        if self._names is not None:
            return name in self._names
        model = self._model()
        if model is None:
            return False
        parameters = list(model.named_parameters())
        tag_names = parameter_tag_names(model)
        names = frozenset(tag_names.get(key, key) for key, param in parameters if not is_lazy(param) and param.dim() >= 2)
        if not any(is_lazy(param) for _, param in parameters):
            self._names = names
        return name in names


def norms_of_rank(diagnosis: Diagnosis | None, model: nn.Module, layers: Sequence[tuple[str, nn.Module]],
                  current_step: Callable[[], int | None], clipping: bool, grad_scaler: Any,
                  reads_norms: bool) -> StepNorms | None:
    """The gradient norms this rank reads: the logging rank's (:meth:`Diagnosis.gradient_norms`); on another rank,
    where the logging rank reads them (``reads_norms``), the norms of its own shards if a parameter is sharded
    (FSDP2), which the ranks sum at logging steps; else ``None`` (replicated gradients: rank 0's are whole).

    Example:
        >>> print(norms_of_rank(None, nn.Linear(2, 1), [], lambda: None, True, None, True))
        None
    """
    if diagnosis is not None:
        return diagnosis.gradient_norms(model, layers, current_step, clipping, grad_scaler)
    if not reads_norms:
        return None
    norms = _norms_or_warning(model, layers, current_step, "on this rank")
    if norms is None:
        return None
    if not norms.sharded:
        norms.close()
        return None
    norms.host_copies = False  # no spike check here: rank 0 judges the sums
    return norms


def make_diagnosis(
    sink: Any, model: nn.Module, layers: Sequence[tuple[str, nn.Module]], alerts: Any, on_alert: Any, spikes: bool,
    update_ratio: bool, image_steps: Callable[[int], bool] | None = None, flow_pictures: bool = False,
) -> Diagnosis:
    """The :class:`Diagnosis` of :func:`actviz.watch`'s ``alerts``, ``on_alert``, ``spikes`` and ``update_ratio``;
    flow pictures, with ``flow_pictures``, are drawn on ``image_steps`` (the image schedule).

    ``layers`` are ``(tag name, module)``; ``alerts`` has been checked (:func:`~actviz.diagnosis.alerts.check_alerts`).
    """
    thresholds = check_alerts(alerts)
    monitor = None if thresholds is None else health_monitor(
        thresholds, {name for name, module in layers if is_relu_family(module)}, MatrixNames(model), on_alert,
    )
    return Diagnosis(sink, monitor, FlowHistory(update_ratio, image_steps) if flow_pictures else None, spikes, on_alert)


def _norms_or_warning(model: nn.Module, layers: Sequence[tuple[str, nn.Module]], current_step: Callable[[], int | None],
                      what: str) -> StepNorms | None:
    """:func:`step_norms_of`, or ``None`` with one warning (``what``: which norms are missing) where the parameters
    take no hook: ``watch()`` must not fail for it, and the run goes on without them."""
    try:
        return step_norms_of(model, layers, current_step)
    except Exception as error:  # noqa: BLE001 - watch() must not fail for it
        warn_safely(f"actviz reads no gradient norms {what}: {type(error).__name__}: {error}", RuntimeWarning)
        return None
