"""The watched parameters of one logging step: their values, and their gradients as the optimizer applies them.

Values are reduced when the step starts. Gradients are reduced once, when an optimizer
that holds a watched parameter steps (actviz's one optimizer step pre-hook): after DDP's
all-reduce, every micro-batch of accumulation, every further backward pass (a GAN
discriminator's real and fake batches), clipping and ``GradScaler.unscale_``. A loop not
yet known to step an optimizer (:class:`LoopHistory`) also has them reduced at the end of
each backward pass, as that pass left them. Gradients zeroed (``zero_grad()`` sets them to
``None``) before any optimizer applied them are not logged: :meth:`StepParameters.dropped`
tells. All of them are reduced together (:func:`~actviz.summaries.many_tensors.reduce_tensors`).
"""

from __future__ import annotations

import operator
import weakref
from functools import partial
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..common._internals import forward_hooks
from ..common.safe_warnings import warn_safely
from .layer_outputs import layers_by_module
from .amp import loss_scale_of, unscaled_by
from .clip_norms import finish_clip_norms
from ..diagnosis.optimizer_audit import OPTIMIZER_VALUES, learning_rates
from ..diagnosis.step_norms import StepNorms
from ..common.optimizer_steps import subscribe
from ..options import CaptureOptions
from ..output.pending_step import LayerValues, PendingStep
from ..summaries.many_tensors import reduce_tensors
from ..summaries.merge_ranks import is_sharded
from ..summaries.one_tensor import PendingSummary, local_shard, start_summary
from ..statistics.layer_statistic import take_values, warn_statistic_failed
from ..statistics.gradient_noise import NoiseRun
from ..statistics.registry import Chosen
from ..statistics.update_sample import UpdateSample, optimizer_entries
from ..statistics.updates import UpdateStatistic
from ..tags import UPDATE_RATIO, UPDATE_STAT

__all__ = ["LoopHistory", "StepParameters"]

_GRAD = operator.attrgetter("grad")  # a parameter's .grad, read in C in map()


def _same_layout(now: torch.Tensor, then: torch.Tensor) -> bool:
    """Whether a parameter's value ``now`` can be compared with its copy ``then``: same shape, same device."""
    return now.shape == then.shape and now.device == then.device


@dataclass
class LoopHistory:
    """What a watcher learned about its training loop, shared by its steps.

    ``optimizer_steps``: ``True`` once an optimizer holding a watched parameter stepped after a
    logging step's backward; ``False`` once a step waited for one in vain; ``None`` before.
    ``resized``: the parameters resized across an update (no update ratio), each warned about once.
    ``layer_lookup``: the last step's ``(layers, layers_by_module(layers), the modules' forward hook dicts)``,
    reused while its steps watch the same ``(name, module)`` pairs (:meth:`lookup`); ``statistic_lookup`` likewise
    the statistics each layer runs (:meth:`statistics`).
    """

    optimizer_steps: bool | None = None
    resized: set[str] = field(default_factory=set)  # parameters whose update ratio was skipped, warned about
    layer_lookup: tuple[list[tuple[str, nn.Module]], dict[int, tuple[Any, ...]], list[dict[int, Any]]] | None = None
    statistic_lookup: tuple[list[tuple[str, nn.Module]], Chosen] | None = None
    noise: NoiseRun | None = None  # statistics=[..., "gradient_noise"]: the model's batch dimension, the causes warned about
    step_norms: StepNorms | None = None  # the gradient norms before and after clipping of every optimizer step

    def noise_run(self, model: nn.Module) -> NoiseRun:
        """The gradient noise scale's state shared by the steps (:class:`~actviz.statistics.gradient_noise.NoiseRun`)."""
        if self.noise is None:
            self.noise = NoiseRun.of(model)
        return self.noise

    def lookup(self, layers: list[tuple[str, nn.Module]]) -> tuple[dict[int, tuple[Any, ...]], list[dict[int, Any]]]:
        """``layers_by_module(layers)`` and each of its modules' forward hook dicts (what
        :meth:`~actviz.common.owned_hooks.ForwardHooks.add_to` fills), made again only when the pairs changed."""
        kept = self.layer_lookup
        if _changed(kept, layers):
            by_module = layers_by_module(layers)
            kept = self.layer_lookup = (list(layers), by_module, [forward_hooks(entry[0]) for entry in by_module.values()])
        return kept[1], kept[2]

    def statistics(self, model: nn.Module, layers: list[tuple[str, nn.Module]], options: CaptureOptions) -> Chosen:
        """The per-layer statistics of ``model``'s steps (:class:`~actviz.statistics.registry.Chosen`), asked of each
        statistic and layer only when the pairs changed."""
        kept = self.statistic_lookup
        if _changed(kept, layers):
            kept = self.statistic_lookup = (list(layers), Chosen.of(model, layers, options))
        return kept[1]


def _changed(kept: tuple[Any, ...] | None, layers: list[tuple[str, nn.Module]]) -> bool:
    """Whether ``layers`` are not the very pairs a lookup was ``kept`` for (its first item)."""
    return kept is None or len(kept[0]) != len(layers) or not all(map(operator.is_, kept[0], layers))


class StepParameters:
    """Reductions of the watched parameters and their gradients for one step.

    Args:
        parameters: ``(tag name, parameter)`` pairs.
        options: Sampling options.
        pending: Where the step's results go.
        report: Called with the failing parameter name and the exception.
        grad_scaler: A ``torch.amp.GradScaler`` whose scale the gradients carry, or ``None``.
        history: The watcher's :class:`LoopHistory` (which resized parameters were warned about).

    With ``options.update_ratio`` it also logs ``update_ratio/{param}`` =
    ||w_after - w_before|| / ||w_before|| across the update that follows the step, from a
    copy of the parameters taken just before it (with the gradients) and compared when the
    step ends. A parameter resized in between (``p.data = torch.randn(new_shape)``)
    gets no ratio for that step, with one warning per parameter; the step is logged all the same.

    Example:
        The gradients logged are the ones the optimizer applies, here after clipping:

        >>> import tempfile, actviz
        >>> model = nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with tempfile.TemporaryDirectory() as runs, actviz.watch(model, runs, every=1, image_every=False) as viz:
        ...     model(torch.ones(1, 2)).sum().backward()  # gradients [1, 1] and [1]: norm 3 ** 0.5
        ...     _ = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        ...     optimizer.step()
        ...     viz.flush()
        ...     print(round(viz.latest.statistics()["weight_grads/weight"]["norm"], 4))  # 2 ** 0.5 * 0.5 / 3 ** 0.5
        0.4082
    """

    def __init__(
        self,
        parameters: Sequence[tuple[str, nn.Parameter]],
        options: CaptureOptions,
        pending: PendingStep,
        report: Callable[[str, BaseException], None],
        grad_scaler: Any = None,
        history: LoopHistory | None = None,
    ) -> None:
        self.named = list(parameters)
        self.update_ratio = options.update_ratio
        self._before: list[torch.Tensor] | None = None
        self.trainable = [pair for pair in self.named if pair[1].requires_grad]  # the same pairs: no new tuples
        self._options = options
        self._pending = pending
        self._report = report
        self._grad_scaler = grad_scaler
        self._history = history or LoopHistory()
        # merged across ranks (merge_ranks) only when sharded: looked at only then
        self._sharded = {name for name, param in self.named if is_sharded(param)} if options.merge_ranks else set()
        self._grads: dict[str, PendingSummary] = {}  # the latest, replaced until the step ends
        self._grads_scaled = False
        self._trainable_params = [param for _, param in self.trainable]
        self._grad_refs: list[weakref.ref[torch.Tensor] | None] = []  # each .grad as the step's backward left it
        self.taken_at_step = False  # reduced as an optimizer applied them
        # the statistics of targets "parameter" and "parameter_gradient" (set by the step), and the last device
        # halves of the latter, replaced as the gradients are until the step ends
        self.statistics: tuple[tuple[Any, ...], ...] = ((), (), ())  # targets parameter, its gradient, its update
        self._grad_values: LayerValues | None = None
        self.scale_taken = False  # the gradients of this step's backward carry the loss scale
        self._rates: dict[str, dict[str, float]] = {}  # learning_rates() of the optimizer that took the gradients
        self._optimizer: torch.optim.Optimizer | None = None  # that optimizer, until the update is done: its state
        self._sample: UpdateSample | None = None  # the update statistics' sample of the parameters before the update
        self._clip_row: torch.Tensor | None = None  # the step's norms before and after clipping (gradient_clipping)

    @property
    def waits_for_update(self) -> bool:
        """Whether the step ends once the update is done (the next forward), not when the optimizer takes the
        gradients: ``update_ratio`` and the update statistics compare the parameters across it."""
        return self.update_ratio or bool(self.statistics[2])

    def reduce_values(self) -> None:
        """Reduce the parameters as they are now, at the start of the step."""
        found = self._reduce(self.named, [param for _, param in self.named])
        self._pending.weights.add_many(found, mergeable=self._sharded)
        if self.statistics[0]:
            self._take_values(self.statistics[0], self.named, [param for _, param in self.named], found,
                              self._pending.layer_values)

    def attach(
        self,
        add_handle: Callable[[Any], None],
        on_optimizer_step: Callable[[torch.optim.Optimizer], None],
        on_optimizer_done: Callable[[torch.optim.Optimizer], None],
    ) -> None:
        """Hook the optimizers that hold a trainable watched parameter; the handle goes to ``add_handle``.

        ``on_optimizer_step(optimizer)`` runs before such an optimizer steps, ``on_optimizer_done(optimizer)``
        after it (a closure may have run the backward inside). The subscription, the process's, holds the
        step until it ends: a watcher dropped with a step open is kept until exit, which closes it and
        writes the step (:mod:`actviz.output.open_watchers`).
        """
        watched = {id(param) for _, param in self.trainable}

        def holds(optimizer: torch.optim.Optimizer) -> bool:
            return any(id(param) in watched for group in optimizer.param_groups for param in group["params"])

        def optimizer_hook(optimizer: torch.optim.Optimizer) -> None:
            if holds(optimizer):
                on_optimizer_step(optimizer)

        def optimizer_done(optimizer: torch.optim.Optimizer) -> None:
            if holds(optimizer):
                on_optimizer_done(optimizer)

        if self.trainable:
            add_handle(subscribe(optimizer_hook, after=optimizer_done))

    def take_loss_scale(self) -> None:
        """Copy, on the device, the AMP scale that this backward pass multiplies gradients by."""
        scale = loss_scale_of(self._grad_scaler)
        if scale is not None and not self.scale_taken:
            self.scale_taken = True
            self._pending.loss_scale = scale.detach().clone().reshape(())

    def note_gradients(self) -> None:
        """Remember which tensors the step's backward left in ``.grad``: later passes accumulate into them."""
        self._grad_refs = [None if grad is None else weakref.ref(grad) for grad in map(_GRAD, self._trainable_params)]

    def dropped(self) -> bool:
        """Whether a watched gradient was zeroed to ``None`` (or replaced) since :meth:`note_gradients`."""
        for ref, grad in zip(self._grad_refs, map(_GRAD, self._trainable_params)):
            if ref is not None and ((noted := ref()) is None or noted is not grad):
                return True
        return False

    def discard_gradients(self) -> None:
        """Log no gradients for this step: no optimizer applied the ones its backward made."""
        self._grads, self._grad_refs, self._clip_row = {}, [], None

    def take_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Reduce the gradients as they are now: as ``optimizer`` is about to apply them, or as a pass left them."""
        self.taken_at_step = self.taken_at_step or optimizer is not None
        if optimizer is not None:
            try:
                self._rates = learning_rates(optimizer, self.trainable)
            except Exception:  # noqa: BLE001 - an odd optimizer: frozen_parameter names both causes
                self._rates = {}
        norms = self._history.step_norms
        if optimizer is not None and norms is not None:
            row = norms.row_applied_by(optimizer)  # its listener ran first (and summed it over the ranks under FSDP2)
            self._clip_row = None if row is None else row.clone()  # one op: the ring's row is written again later
        with_grads = [pair for pair in self.trainable if pair[1].grad is not None]
        if self.update_ratio and self.trainable:  # the values the update will change, one op
            self._before = torch._foreach_mul([local_shard(param) for _, param in self.trainable], 1.0)
        if self.statistics[2] and self.trainable:  # their sample (update_sample), a few ops for all of them
            self._optimizer = optimizer  # held until hand_over, one step at most
            masked = any(getattr(statistic, "needs_gradient_mask", False) for statistic in self.statistics[2])
            self._sample = UpdateSample([local_shard(param) for _, param in self.trainable],
                                        [None if param.grad is None else local_shard(param.grad)
                                         for _, param in self.trainable] if masked else [], masked)
        if with_grads:
            grads = [param.grad for _, param in with_grads]
            self._grads = self._reduce(with_grads, grads)
            if self.statistics[1]:  # kept apart until hand_over: a later take replaces them
                self._grad_values = LayerValues()
                self._grad_values.warned = self._pending.layer_values.warned
                self._take_values(self.statistics[1], with_grads, grads, self._grads, self._grad_values)
            self._grads_scaled = self.scale_taken and not (
                optimizer is not None and unscaled_by(self._grad_scaler, optimizer)
            )

    def hand_over(self) -> None:
        """Put the last gradients taken, and the update ratios since, into the step's results."""
        if self._rates:
            rates, self._rates = self._rates, {}
            self._pending.add_host_work(lambda results, _: results.layer_values.setdefault(OPTIMIZER_VALUES, {})
                                        .update(rates))
        if self._before is not None:
            before, self._before = self._before, None
            self._add_update_ratios(before)
        if self._sample is not None:
            sample, self._sample = self._sample, None
            self._take_update_values(sample)
        self._pending.weight_grads.add_many(self._grads, scaled=self._grads_scaled, mergeable=self._sharded)
        took, self._grads = bool(self._grads), {}
        norms = self._history.step_norms
        if took and self._clip_row is None and norms is not None and not self.taken_at_step and not norms.stepped:
            row = norms.row_committed_for(self._pending.step)  # an update by hand: the norms before clipping alone
            self._clip_row = None if row is None else row.clone()
        if self._clip_row is not None and norms is not None:
            row, self._clip_row = self._clip_row, None
            self._pending.add_host_work(partial(finish_clip_norms, layer_of=norms.layer_of, layer_names=norms.layer_names,
                                                scaled_after=self._grads_scaled), row)
        if self._grad_values is not None:
            self._pending.layer_values.extend(self._grad_values)
            self._grad_values = None

    def _take_values(self, statistics: tuple[Any, ...], named: list[tuple[str, nn.Parameter]],
                     tensors: list[torch.Tensor], reductions: dict[str, PendingSummary], into: LayerValues) -> None:
        """The device halves of ``statistics`` of each of ``tensors`` (the parameters of ``named`` or their gradients)."""
        for (name, _), tensor in zip(named, tensors):
            take_values(statistics, name, None, tensor, reductions.get(name), into, self._options)

    def _add_update_ratios(self, before: list[torch.Tensor]) -> None:
        """``update_ratio/{param}`` of the parameters still shaped as ``before`` (a few ops for all of them).

        A parameter resized, or moved, since :meth:`take_gradients` is skipped and warned about once; if the
        ops fail all the same, the step's ratios are skipped with one warning, never an error: the step goes on.
        """
        pairs, after = self.trainable, [local_shard(param) for _, param in self.trainable]
        same = list(map(_same_layout, after, before))
        if not all(same):  # the same lists while nothing is resized: no new tuples
            self._warn_resized([name for (name, _), kept in zip(pairs, same) if not kept])
            pairs, after, before = ([item for item, kept in zip(items, same) if kept] for items in (pairs, after, before))
        if not pairs:
            return
        try:
            updates = torch._foreach_sub(after, before)
            ratios = torch._foreach_div(torch._foreach_norm(updates), torch._foreach_norm(before))  # NaN for all-zero
        except Exception as error:  # noqa: BLE001 - a parameter changed some other way: the step goes on
            self._warn_once([UPDATE_RATIO], f"actviz: no update ratios for this step, and any later one that fails the "
                                            f"same way: {type(error).__name__}: {error}")
            return
        for (name, _), ratio in zip(pairs, ratios):
            self._pending.add_scalar(UPDATE_RATIO.format(param=name), ratio)

    def _warn_resized(self, resized: list[str]) -> None:
        """Warn once about the parameters that changed shape or device across the optimizer step."""
        self._warn_once(resized, f"actviz: no update ratio or update statistics for {', '.join(resized)}: the parameter "
                                 "changed shape or device across the optimizer step (resized in place); the step is "
                                 "logged without them")

    def _take_update_values(self, sample: UpdateSample) -> None:
        """The update statistics' device halves (:mod:`actviz.statistics.updates`) of the sampled updates, packed per
        device and dtype (:class:`~actviz.statistics.update_sample.UpdateSample`), with each parameter's optimizer
        state and group where the optimizer that took the gradients holds it: a few ops for all the parameters."""
        optimizer, self._optimizer = self._optimizer, None
        params = [param for _, param in self.trainable]
        try:
            packs = sample.updates([local_shard(param) for param in params], *optimizer_entries(optimizer, params))
        except Exception as error:  # noqa: BLE001 - a parameter changed some other way: the step goes on
            self._warn_once([UPDATE_STAT], f"actviz: no update statistics for this step, and any later one that fails "
                                           f"the same way: {type(error).__name__}: {error}")
            return
        reported = {index for pack in packs for index in pack.kept}
        if len(reported) < len(params) and not self.update_ratio:  # update_ratio warned already
            self._warn_resized([name for index, (name, _) in enumerate(self.trainable) if index not in reported])
        values = self._pending.layer_values
        for statistic in self.statistics[2]:
            for pack in packs:
                try:  # a user's LayerStatistic of this target: device() per parameter, as UpdateStatistic's default
                    rows = getattr(statistic, "device_packed", partial(UpdateStatistic.device_packed, statistic))(
                        pack, self._options)
                except Exception as error:  # noqa: BLE001 - a statistic must never stop training
                    warn_statistic_failed(statistic, error, values.warned)
                    continue
                kept = set(pack.kept)
                for index, length, row in zip(pack.indices, pack.lengths, rows):
                    if row is not None and index in kept:
                        values.add(statistic, self.trainable[index][0], row, length, self.trainable[index][1].dtype)

    def _warn_once(self, names: list[str], message: str) -> None:
        """Warn with ``message`` unless every one of ``names`` was warned about already.

        Not :func:`~actviz.common.safe_warnings.warn_once`, which says a thing once per key: one message here
        names several parameters, and says them again only with one that is new."""
        if not self._history.resized.issuperset(names):
            self._history.resized.update(names)
            warn_safely(message, RuntimeWarning)

    def _reduce(self, named: list[tuple[str, nn.Parameter]], tensors: list[torch.Tensor]) -> dict[str, PendingSummary]:
        """Reduce ``tensors`` (the parameters of ``named``, or their gradients) in a fixed number of ops;
        if that fails, one by one, to name the one that fails."""
        sample_size = self._options.histogram_sample_size
        owners = [param for _, param in named]
        try:
            reductions = reduce_tensors(tensors, sample_size, owners, self._pending.small)  # copies: reduced at the end
            return dict(zip([name for name, _ in named], reductions))
        except Exception:  # noqa: BLE001 - a hook must never stop training
            found = {}
            for (tag, _), tensor in zip(named, tensors):
                try:
                    found[tag] = start_summary(tensor, sample_size, count_zeros=False)
                except Exception as error:  # noqa: BLE001
                    self._report(tag, error)
            return found
