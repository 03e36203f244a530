"""The hooks of one logging step, and the small results they leave: a step's life, stage by stage.

A :class:`StepCapture` exists only for a step that logs; every tensor is reduced in its hook, on its
device, into a :class:`~actviz.output.pending_step.PendingStep`. It is composed of the objects it
uses: the step's :class:`~actviz.capture.step_parameters.StepParameters`, an
:class:`~actviz.capture.output_gradients.OutputGradients` that holds the hooks on the outputs'
gradients, and a :class:`~actviz.capture.step_end.StepEnd` that holds the step's
:class:`~actviz.capture.step_end.Stage` and decides, event by event, when the step is over. The events, in order:

1. attach (``__init__``): layer forward hooks, the end-of-forward hook on the model, the optimizer hook;
2. layer output (``_on_module_output``, then ``_capture_tensor`` per tensor): summary, picture source, a hook on the output's gradient
   (:meth:`OutputGradients.hook <actviz.capture.output_gradients.OutputGradients.hook>`);
3. end of forward (``_on_forward_done``): forward hooks off, then :meth:`StepEnd.forward_done
   <actviz.capture.step_end.StepEnd.forward_done>`: over now if nothing waits for a backward;
4. output gradient (:class:`~actviz.capture.output_gradients.OutputGradients`): the gradient flowing into each layer, reduced
   (with ``gradient_noise``, and its per-example norms: :mod:`actviz.statistics.gradient_noise`);
5. end of backward (:meth:`StepEnd.backward_done <actviz.capture.step_end.StepEnd.backward_done>`): the gradients
   kept as left, unless an optimizer applies them;
6. optimizer step (:meth:`StepEnd.optimizer_step <actviz.capture.step_end.StepEnd.optimizer_step>`): the gradients
   it applies, however many backwards came between (a GAN discriminator's real and fake batches;
   :mod:`actviz.capture.step_parameters`);
7. end (:meth:`StepEnd.close <actviz.capture.step_end.StepEnd.close>`, also at the next training forward of a
   loop without optimizer, and at ``flush()``): :meth:`hand_over <StepCapture.hand_over>` takes the hooks off,
   starts one copy to the host and calls ``deliver`` once.

A step whose outputs require grad waits for its backward even if other forwards come first (a siamese
pair, an RL episode; :mod:`actviz.capture.open_steps`). No hook holds a batch: a later in-place op cannot change
what was logged. Output gradients come from the op that made each output (module backward hooks raise on
in-place ReLUs, pytorch#61519); layers run without grad (``checkpoint``) get it when backward recomputes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ..common._internals import functorch_wrapped
from .compiled_model import EagerStance
from .layer_outputs import DrawnTensors, first_tensor, layer_table, nested_values, output_tensors
from .layer_outputs import PER_CHANNEL_AFFINE, copied_picture, shape_of as _shape_of
from ..options import CaptureOptions
from ..output.pending_step import PendingStep
from ..common.owned_hooks import ForwardHooks, HookHandles, OwnedHook
from .output_gradients import OutputGradients
from .step_end import Stage, StepEnd
from .step_parameters import LoopHistory, StepParameters
from ..pictures.rendering import Picture, picture_source
from ..summaries.merge_ranks import merge_across_ranks
from ..summaries.one_tensor import PendingSummary, start_summary
from ..tags import LAYERS
from .probe import unwrap_for_probe
from ..selection import ROOT_NAME, layer_display_name
from .compiled_model import unwrap_compiled
from ..statistics.gradient_noise import GradientNoise
from ..statistics.layer_statistic import LayerStatistic, summary_request, take_values, warn_statistic_failed
from .transformer_step import TransformerStep

__all__ = ["StepCapture"]

_UNWATCHED = (None,)  # what the layer lookup gives a module it does not hold

#: Called with (what failed, the exception) when a hook raises.
ErrorHandler = Callable[[str, BaseException], None]


class StepCapture:
    """Hooks and results for one logging step.

    Args:
        step: The step number the results belong to.
        model: The watched model; a forward hook on it marks the end of the forward pass.
        layers: ``(tag name, module)`` pairs to hook.
        parameters: ``(tag name, parameter)`` pairs whose values and gradients to summarize.
        want_stats: Summarize activations, output gradients, weights and weight gradients.
        want_images: Draw feature maps.
        options: Bins, sampling and channel limits.
        deliver: Called once, with the :class:`~actviz.output.pending_step.PendingStep`, when the step
            ends and logged something.
        on_error: Called with the failing layer or parameter name; it may re-raise.
        on_no_backward: Called with this capture when it ends without the backward pass
            its outputs waited for, or without the gradients it made (``end.dropped_gradients``).
        grad_scaler: A ``torch.amp.GradScaler``: gradients are logged divided by its scale.
        describe_layers: Also write the text ``layers`` (see :func:`~actviz.capture.layer_outputs.layer_table`).
        pictures: Pictures made before the step (the probe's).

    With ``options.merge_ranks`` every rank runs a capture for the same steps and ``deliver``
    may be ``None``; with ``options.update_ratio`` a step ends at the next forward, once the
    update is done. ``stance`` holds ``force_eager`` until the step ends; ``history`` is what
    the watcher knows of its loop (:class:`~actviz.capture.step_parameters.LoopHistory`).

    Attributes:
        gradients: The hooks on the layer outputs' gradients (:class:`~actviz.capture.output_gradients.OutputGradients`).
        end: The step's stage, moved on by each event (:class:`~actviz.capture.step_end.StepEnd`).

    Example:
        >>> from actviz.options import CaptureOptions
        >>> model, delivered = torch.nn.Sequential(torch.nn.Linear(3, 2)), []
        >>> capture = StepCapture(0, model, [("0", model[0])], list(model.named_parameters()), want_stats=True,
        ...                       want_images=False, options=CaptureOptions(), deliver=delivered.append, on_error=print)
        >>> model(torch.randn(4, 3)).sum().backward()
        >>> capture.end.stage
        <Stage.WAITING_FOR_OPTIMIZER: 'waiting for the optimizer'>
        >>> capture.end.close()  # at an optimizer step, the next forward of a loop without one, or flush()
        >>> results = delivered[0].resolve()
        >>> sorted(results.gradients), sorted(results.weight_grads)
        (['0'], ['0.bias', '0.weight'])
    """

    def __init__(
        self,
        step: int,
        model: nn.Module,
        layers: Sequence[tuple[str, nn.Module]],
        parameters: Sequence[tuple[str, nn.Parameter]],
        *,
        want_stats: bool,
        want_images: bool,
        options: CaptureOptions,
        deliver: Callable[[PendingStep], None] | None,
        on_error: ErrorHandler,
        on_no_backward: Callable[[StepCapture], None] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        describe_layers: bool = False,
        pictures: Sequence[Picture] = (),
        stance: EagerStance | None = None,
        history: LoopHistory | None = None,
        hold_stance: bool = True,
        register: Callable[[StepCapture], None] | None = None,
    ) -> None:
        self.step = step
        self.want_stats = want_stats
        self.want_images = want_images
        self.options = options
        self._hold_stance = hold_stance  # a model compiled after watch(): until the step ends (fullgraph checks it)
        self._history = history or LoopHistory()
        self._deliver = deliver
        self._on_error = on_error
        self._on_no_backward = on_no_backward
        self._pending = PendingStep(step, options.bins)
        for picture in pictures:
            self._pending.add_picture(picture)
        self._hooks = HookHandles()
        self._layer_pairs = list(layers)  # the watcher's own pairs: its steps reuse their lookup (LoopHistory)
        self._layers = dict(layers)
        self._parameters = StepParameters(parameters, options, self._pending, on_error, grad_scaler, self._history)
        self.end = StepEnd(self._parameters, self._history, want_stats=want_stats, hand_over=self.hand_over)
        # statistics=[..., "gradient_noise"]: layer inputs kept until their output's gradient comes, on stats steps alone
        self._noise = (GradientNoise(self._pending.add_host_work, on_error, self._history.noise_run(model))
                       if options.gradient_noise and want_stats else None)
        self.gradients = OutputGradients(self.end, self._pending, self._parameters, options, on_error,
                                         self._hooks.group("gradients"), self._noise)
        self._seen: set[str] = set()  # layers logged: a module called twice logs its first call
        self._recompute: set[str] = set()  # layers that ran without grad: checkpointed, recomputed in backward
        self._merge = options.merge_ranks and want_stats
        self._shapes: dict[str, tuple[int, ...]] | None = {} if describe_layers else None
        self._module_names = {id(module): layer_display_name(name) for name, module in  # the layers text's last column
                              unwrap_compiled(model).named_modules()} if describe_layers else None
        self._drawn = DrawnTensors()
        self._layer_statistics: dict[int, tuple[LayerStatistic, ...]] = {}  # id(module) -> its statistics (want_stats)
        self._output_statistics: tuple[LayerStatistic, ...] = ()  # taken of the model's output
        self._statistics_only: set[str] | frozenset[str] = frozenset()  # hooked for their statistics alone
        self._layer_input: Any = None  # the hooked call's positional arguments, for statistics that read the input
        self._eager: EagerStance | None = stance or EagerStance()  # torch.compile never traces actviz's hooks
        try:
            if register is not None:  # the watcher knows the step before any hook is on: close() finds them all
                register(self)
            self._eager.enter()
            self._attach(model)
        except BaseException:  # Ctrl-C or an error while attaching: no hook stays behind
            self.abandon()
            raise

    def release_stance(self) -> None:
        self._end_eager()

    def abandon(self) -> None:
        """End a step cut short by an exception in one of its stages (Ctrl-C): every hook off, nothing delivered,
        no collective started. Safe to call again, and after the step ended."""
        self._deliver = self._on_no_backward = None
        self._merge = False
        try:
            self.end.close()  # hand_over: the hooks off, nothing sent without deliver
        finally:
            self._hooks.remove()  # where hand_over itself was cut short
            self._end_eager()

    def _end_eager(self) -> None:
        stance, self._eager = self._eager, None
        if stance is not None:
            stance.exit()

    def _attach(self, model: nn.Module) -> None:
        hooked = self._layer_pairs
        if self.want_stats:
            chosen = self._history.statistics(unwrap_for_probe(model), self._layer_pairs, self.options)
            self._layer_statistics, self._output_statistics = chosen.by_module, chosen.on_output
            self._pending.layer_values.warned = chosen.warned
            self._pending.layer_values.of_summaries = chosen.of_summaries  # the moments: nothing to do in the hooks
            if chosen.of_gradients:  # statistics of the outputs' gradients, by layer name
                self.gradients.statistics = {name: (module, chosen.of_gradients[id(module)])
                                             for name, module in self._layer_pairs if id(module) in chosen.of_gradients}
            self._parameters.statistics = (chosen.of_parameters, chosen.of_parameter_gradients,
                                           chosen.of_parameter_updates)
            if chosen.unwatched:  # modules a statistic runs on alone (the ReLUs the default layers leave out)
                hooked = [*self._layer_pairs, *chosen.unwatched]
                self._statistics_only = {name for name, _ in chosen.unwatched}
        # One hook object for all layers: few Python objects per logging step.
        self._by_module, hook_dicts = self._history.lookup(hooked)
        layer_hooks = ForwardHooks(OwnedHook(self._on_module_output))
        self._hooks.add("forward", layer_hooks)
        layer_hooks.add_to(hook_dicts)
        done = OwnedHook(self._on_forward_done, model)
        self._hooks.add("forward", model.register_forward_hook(done, always_call=True))
        if self.want_stats:
            self._parameters.reduce_values()
            self._parameters.attach(partial(self._hooks.add, "optimizer"), self.end.optimizer_step, self.end.optimizer_done)
            TransformerStep.start(model, self._layers, self._pending, self.options, self._hooks)  # attention, logits

    def _on_module_output(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """The layers' one forward hook: each name ``module`` is watched under, its output captured once."""
        entry = self._by_module.get(id(module), _UNWATCHED)
        if entry[0] is not module or self.end.stage is Stage.DONE:  # a copy's module (it shares the hook dict), or over
            return
        for at in range(1, len(entry), 2):
            name, batch_dim = entry[at], entry[at + 1]
            if name in self._seen:  # a module called twice logs its first call
                continue
            first = output if isinstance(output, torch.Tensor) else first_tensor(output)
            if first is not None and functorch_wrapped(first):  # a torch.func transform's call: skip the call only
                continue
            self._seen.add(name)
            if name in self._statistics_only:  # not watched: its statistics alone
                if first is not None:
                    self._layer_input = inputs
                    try:
                        self._run_statistics(self._layer_statistics[id(module)], name, module, first)
                    finally:
                        self._layer_input = None  # no batch outlives its step
                continue
            if self._shapes is not None and first is not None:
                self._shapes[name] = _shape_of(first)
            if not torch.is_grad_enabled():  # run without grad inside a training forward: checkpointed
                self._recompute.add(name)
            # A norm layer's grid would repeat its input's, pixel for pixel: not drawn again.
            draw = self.want_images and not (isinstance(module, PER_CHANNEL_AFFINE)
                                             and self._drawn.would_repeat(module, inputs))
            self._layer_input = inputs
            try:
                if self._noise is not None and first is not None and first.requires_grad:
                    self._noise.take_input(name, module, inputs, first)
                if type(output) is torch.Tensor and not output.is_nested:  # most layers: one plain tensor, no loop
                    self._capture_tensor(name, name, batch_dim, module, output, draw)
                else:
                    self._capture_output(name, batch_dim, module, output, draw)
            except Exception as error:  # noqa: BLE001 - a hook must never stop training
                self._on_error(name, error)
            finally:
                self._layer_input = None  # no batch outlives its step

    def _capture_output(self, name: str, batch_dim: int, module: nn.Module, output: Any, draw: bool) -> None:
        tensors = (("", output),) if isinstance(output, torch.Tensor) else output_tensors(output, self.options.outputs)
        for position, (suffix, tensor) in enumerate(tensors):
            if tensor.is_nested:  # ragged: its statistics are its values'; no grid, and its gradient is nested too
                if self.want_stats:
                    values = nested_values(tensor)
                    summary = start_summary(values, self.options.histogram_sample_size, self._pending.small)
                    summary.tag, summary.mergeable = name + suffix, True
                    self._pending.activations.append(summary)
                    statistics = self._layer_statistics.get(id(module))
                    if statistics is not None:
                        self._run_statistics(statistics, name + suffix, module, values, summary)
            else:  # only the first is drawn (an LSTM's h and c are not batch-first)
                self._capture_tensor(name, name + suffix, batch_dim, module, tensor, draw and position == 0)

    def _capture_tensor(self, name: str, tag: str, batch_dim: int, module: nn.Module, tensor: torch.Tensor,
                        draw: bool) -> None:
        """One tensor of a layer's output: its summary, its picture and the hook on its gradient.

        Most outputs are copied once, whole: the copy is the summary's, summarized on the host, and the picture's source (:func:`~actviz.capture.layer_outputs.copied_picture`).
        """
        options = self.options
        summary = picture = statistics = None
        if self.want_stats:
            statistics = self._layer_statistics.get(id(module))  # most layers of most models: none, no call
            outliers, units = summary_request(statistics, tensor, module) if statistics else (False, ())
            # A grid of a few of many channels picks them by the strengths the summary's read gives (the one-pass op's).
            many = draw and tensor.dim() == 4 and tensor.shape[1] > options.max_channels
            summary = start_summary(tensor, options.histogram_sample_size, self._pending.small, outliers=outliers,
                                    units=units, strengths=many)
        if draw:
            copy = summary.copy if summary is not None else None
            if copy is not None:  # copied whole: the copy is the picture's source too
                picture = copied_picture(copy, options.max_channels, batch_dim)
            else:
                strengths = summary.made.strengths if summary is not None and summary.made is not None else None
                picture = picture_source(tensor, options.max_channels, batch_dim, strengths=strengths)
        if summary is not None:
            summary.tag, summary.mergeable = tag, True
            self._pending.activations.append(summary)
            if statistics is not None:
                self._run_statistics(statistics, tag, module, tensor, summary)
            self.gradients.hook(name, tag, tensor)
        if picture is not None:
            self._pending.add_picture(Picture(tag, picture[0], (picture[1],)))
            self._drawn.add(tensor)

    def _run_statistics(self, statistics: tuple[LayerStatistic, ...], layer: str, module: nn.Module,
                        tensor: torch.Tensor, summary: PendingSummary | None = None) -> None:
        """Each statistic's device half of one tensor (:func:`~actviz.statistics.layer_statistic.take_values`)."""
        take_values(statistics, layer, module, tensor, summary, self._pending.layer_values, self.options,
                    self._layer_input)

    def _on_forward_done(self, model: nn.Module, args: Any, output: Any) -> None:
        try:
            self._forward_done(model, output)
        except BaseException:  # Ctrl-C while the step moves on: no hook left, the next steps start afresh
            self.abandon()
            raise

    def _forward_done(self, model: nn.Module, output: Any) -> None:
        self._hooks.remove("forward")
        if not self._hold_stance:  # the root hook runs outside compiled calls: they may compile again now
            self._end_eager()
        if output is None:  # the forward raised
            self.end.close()
            return
        if self._output_statistics:  # the logits' statistics
            self._output_values(unwrap_for_probe(model), output)
        # Checkpointed layers get their gradients' hooks when the backward pass runs them again.
        expects_backward = self.gradients.hooked or bool(self._recompute and self._parameters.trainable)
        self.gradients.hook_recomputed(self._layers, self._recompute)
        self.end.forward_done(expects_backward, backward_seen=bool(self.gradients.seen))

    def _output_values(self, model: nn.Module, output: Any) -> None:
        for statistic in self._output_statistics:
            try:
                tensor = statistic.select(model, output)
            except Exception as error:  # noqa: BLE001 - a statistic must never stop training
                warn_statistic_failed(statistic, error, self._pending.layer_values.warned)
                continue
            if tensor is not None:
                self._run_statistics((statistic,), ROOT_NAME, model, tensor)

    def hand_over(self, missed_backward: bool) -> None:
        """The step is over (:meth:`StepEnd.close <actviz.capture.step_end.StepEnd.close>` calls this once):
        remove every hook, start the copy to the host and deliver the step.

        ``missed_backward`` says the gradients the step waited for never came, or were dropped.
        """
        try:
            self._end_eager()
        finally:
            self._hooks.remove()
        self._drawn = DrawnTensors()
        self._parameters.hand_over()
        if self._noise is not None:
            self._noise.hand_over(backward_seen=bool(self.gradients.seen))
        if self._shapes is not None:
            names = {name: self._module_names.get(id(module), name) for name, module in self._layers.items()}
            self._pending.add_text(LAYERS, layer_table(list(self._layers.items()), self._shapes, names))
        if missed_backward and self._on_no_backward is not None:
            self._on_no_backward(self)
        if self._merge:
            mergeable = self._pending.mergeable
            try:
                merge_across_ranks(mergeable, self.options.bins)
            except Exception as error:  # noqa: BLE001 - a failed merge loses this step, not the run
                self._on_error("(merge_ranks)", error)
                return
        if self._pending.empty or self._deliver is None:
            return
        try:
            self._pending.send()
        except Exception as error:  # noqa: BLE001 - a failed copy loses this step, not the run
            self._on_error("(step)", error)
            return
        self._deliver(self._pending)
