"""Hugging Face Transformers: ``Trainer(..., callbacks=[ActvizCallback(every=100)])``.

The callback watches the model the ``Trainer`` hands to its callbacks for the length of
``train()`` and numbers actviz's steps as the Trainer numbers its logged loss: the batch
that starts at ``state.global_step = k`` has its loss logged at step ``k + 1`` (after the
optimizer step), so its histograms go to step ``k + 1`` too. With ``report_to="tensorboard"``
it writes into the folder of the Trainer's own ``TensorBoardCallback``, so that actviz's tags
and the Trainer's ``train/loss`` are one TensorBoard run.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..api import watch
from ..common.safe_warnings import warn_safely
from ..watcher import Watcher
from . import _check_watch_kwargs, _has_writer, adapter_options, with_destination

try:
    from transformers.trainer_callback import CallbackHandler, TrainerCallback, TrainerControl, TrainerState
except ModuleNotFoundError as error:
    if error.name not in ("transformers", "transformers.trainer_callback"):
        raise  # transformers is there but something it needs is not: show the real error
    raise ImportError(
        "actviz.integrations.huggingface needs transformers, which is not installed: "
        "pip install transformers accelerate, or from a clone of actviz: pip install -e \".[huggingface]\""
    ) from None

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["ActvizCallback"]

#: How far up the stack ``on_train_begin`` looks for the ``CallbackHandler`` calling it (a subclass adds frames).
_FRAMES_UP = 6


def _trainer_callbacks(callback: TrainerCallback) -> list[TrainerCallback] | None:
    """The callbacks of the Trainer that is calling ``callback`` now, or ``None`` if it cannot be found.

    A Trainer gives its callbacks no handle on one another. Its ``CallbackHandler`` calls
    them one after another from ``call_event``, so the handler is ``self`` in a frame just
    above the callback's method: reading that frame is the one place actviz looks inside
    transformers, and a layout it does not recognise gives ``None``.
    """
    frame = inspect.currentframe()  # this function's; the loop starts with the callback method calling it
    try:
        for _ in range(_FRAMES_UP):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler) and any(other is callback for other in handler.callbacks):
                return list(handler.callbacks)
        return None
    finally:
        del frame  # a frame held in a local would keep the whole stack alive


def _tensorboard_folder(callbacks: list[TrainerCallback]) -> tuple[bool, str | None]:
    """``(whether the Trainer has a TensorBoardCallback, the folder its writer writes to or None)``."""
    from transformers.integrations import TensorBoardCallback

    for other in callbacks:
        if isinstance(other, TensorBoardCallback):
            writer = getattr(other, "tb_writer", None)  # opened in its on_train_begin, which ran before ours
            if writer is not None and callable(getattr(writer, "get_logdir", None)):
                return True, str(writer.get_logdir())
            folder = getattr(other, "logging_dir", None)  # transformers 5: set from TENSORBOARD_LOGGING_DIR
            return True, None if folder is None else str(folder)
    return False, None


class ActvizCallback(TrainerCallback):
    """Watch the model while ``transformers.Trainer.train`` runs.

    On ``on_train_begin`` it calls :func:`actviz.watch` with ``Options(auto_step=False)`` on the
    model the Trainer passes to callbacks (the unwrapped model; a DDP wrapper calls it,
    so its hooks still run); on ``on_step_begin`` it calls
    :meth:`~actviz.Watcher.set_step` with ``state.global_step + 1``, the step at which
    the Trainer logs that batch's loss; on ``on_train_end`` it closes the watcher,
    removing every hook. Only the world's main process watches. With ``fp16=True`` it
    passes the Trainer's ``GradScaler`` to :func:`actviz.watch`, so gradients are logged
    unscaled.

    Evaluation runs in eval mode without grad and logs nothing. With
    ``gradient_accumulation_steps=k`` a scheduled global step logs the activations and
    output gradients of its first micro-batch and the parameter gradients the optimizer
    applies, summed over all ``k``. If ``train()`` raises, the Trainer sends no ``on_train_end``:
    call :meth:`close` yourself to take the hooks off.

    Where it writes: with ``report_to="tensorboard"`` (and no ``log_dir`` or ``SummaryWriter`` sink)
    it opens a ``SummaryWriter`` of its own in the folder of the Trainer's
    ``TensorBoardCallback`` and closes it when training ends. The two event files side
    by side are one TensorBoard run: the Trainer's ``train/loss`` beside actviz's tags,
    at the same steps. The Trainer's callbacks reach each other through no public
    attribute, so the callback finds that folder through the ``CallbackHandler`` calling
    it; where it cannot (a ``TensorBoardCallback`` listed after it, say) it warns and uses
    the default below.

    Args:
        log_dir: Folder for actviz's ``SummaryWriter``: a run of its own. Without it (and
            without a ``SummaryWriter`` sink): the Trainer's TensorBoard folder, as above; without TensorBoard
            reporting, ``args.logging_dir`` where ``TrainingArguments`` has one (transformers 4),
            else ``<args.output_dir>/runs``.
        **watch_kwargs: Passed to :func:`actviz.watch`: ``sink``, ``every``, ``image_every``,
            ``layers``, ``statistics``, ``extras``, ``alerts``, ``on_step``, ``on_alert`` or ``options``
            (its ``auto_step`` is set to ``False``). Steps are the Trainer's global steps.

    Raises:
        TypeError: An unknown or removed ``watch()`` argument (the message names the new spelling),
            or ``model=``, which the callback sets itself.
        ValueError: Both ``log_dir`` and a ``SummaryWriter`` as ``sink``, or a bad schedule.

    Example:
        >>> from transformers import Trainer, TrainingArguments  # doctest: +SKIP
        >>> from actviz.integrations.huggingface import ActvizCallback  # doctest: +SKIP
        >>> args = TrainingArguments("out", report_to="tensorboard", logging_steps=100)  # doctest: +SKIP
        >>> trainer = Trainer(model=model, args=args, train_dataset=train_set,
        ...                   callbacks=[ActvizCallback(every=100)])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, **watch_kwargs: Any) -> None:
        self.log_dir = log_dir
        self.watch_kwargs = _check_watch_kwargs(type(self).__name__, log_dir, watch_kwargs)
        self._viz: Watcher | None = None
        self._writer: Any = None  # the SummaryWriter opened in the Trainer's TensorBoard folder, closed by close()

    @property
    def viz(self) -> Watcher | None:
        """The watcher of the running ``train()``; ``None`` outside it and on other processes."""
        return self._viz

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self.close()  # a watcher left by an earlier train() that raised
        if not state.is_world_process_zero:
            return
        if model is None:
            warn_safely(
                "actviz logs nothing: the Trainer passed no model to its callbacks", RuntimeWarning, stacklevel=2
            )
            return
        # With fp16, accelerate wraps the optimizer and keeps the GradScaler on it; bf16 needs none.
        scaler = getattr(kwargs.get("optimizer"), "scaler", None)
        destination = self._destination(args, _trainer_callbacks(self))
        kwargs_for_watch = with_destination(destination, self.watch_kwargs)
        kwargs_for_watch["options"] = adapter_options(
            self.watch_kwargs.get("options"), scaler if isinstance(scaler, torch.amp.GradScaler) else None)
        try:
            self._viz = watch(model, **kwargs_for_watch)
        finally:
            if self._viz is None:
                self.close()  # the writer opened for it

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._viz is not None:
            # The Trainer logs this batch's loss after the optimizer step, at global_step + 1.
            self._viz.set_step(state.global_step + 1)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook, write what is pending and close actviz's writer. Safe to call more than once."""
        viz, self._viz = self._viz, None
        writer, self._writer = self._writer, None
        try:
            if viz is not None:
                viz.close()
        finally:
            if writer is not None:
                writer.close()

    def _destination(self, args: TrainingArguments, callbacks: list[TrainerCallback] | None) -> dict[str, Any]:
        """``log_dir=``, or ``sink=`` a SummaryWriter, for watch(), unless a ``SummaryWriter`` was given."""
        if self.log_dir is not None:
            return {"log_dir": self.log_dir}
        if _has_writer(self.watch_kwargs.get("sink")):
            return {}
        logging_dir = getattr(args, "logging_dir", None)  # gone in transformers 5
        default = logging_dir or os.path.join(args.output_dir, "runs")
        has_tensorboard, folder = _tensorboard_folder(callbacks or [])
        if folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            # A writer of our own, passed as sink=: log_dir= would warn that the folder holds a run (the Trainer's).
            self._writer = SummaryWriter(folder)
            return {"sink": self._writer}
        if has_tensorboard or (callbacks is None and "tensorboard" in (getattr(args, "report_to", None) or [])):
            warn_safely(
                f"actviz could not find the folder of the Trainer's TensorBoardCallback, so it writes to {default!r}, "
                "a run of its own beside the Trainer's loss. List ActvizCallback after TensorBoardCallback, or give "
                "both one folder: ActvizCallback(log_dir=...) and the environment variable TENSORBOARD_LOGGING_DIR",
                RuntimeWarning,
                stacklevel=3,
            )
        return {"log_dir": default}
