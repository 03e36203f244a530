"""Hugging Face Transformers: ``Trainer(..., callbacks=[ActvizCallback(every=100)])``.

The callback watches the model the ``Trainer`` hands to its callbacks for the length of
``train()`` and numbers actviz's steps as the Trainer numbers its logged loss: the batch
that starts at ``state.global_step = k`` has its loss logged at step ``k + 1`` (after the
optimizer step), so its histograms go to step ``k + 1`` too.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..api import watch
from ..safe_warnings import warn_safely
from ..watcher import Watcher
from . import _check_watch_kwargs

try:
    from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState
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


class ActvizCallback(TrainerCallback):
    """Watch the model while ``transformers.Trainer.train`` runs.

    On ``on_train_begin`` it calls :func:`actviz.watch` with ``auto_step=False`` on the
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

    Args:
        log_dir: Folder for actviz's ``SummaryWriter``. Defaults to ``args.logging_dir``
            where ``TrainingArguments`` has one (transformers 4), else
            ``<args.output_dir>/runs``.
        **watch_kwargs: Passed to :func:`actviz.watch`: ``every``, ``image_every``,
            ``layers``, ``max_channels``, ``bins``, ``histogram_sample_size``, ``outputs``,
            ``strict`` or ``writer``. Steps are the Trainer's global steps.

    Raises:
        TypeError: An unknown ``watch()`` argument, or ``model=``/``auto_step=``, which
            the callback sets itself.
        ValueError: Both ``log_dir`` and ``writer``, or a bad schedule.

    Example:
        >>> from transformers import Trainer, TrainingArguments  # doctest: +SKIP
        >>> from actviz.integrations.huggingface import ActvizCallback  # doctest: +SKIP
        >>> trainer = Trainer(model=model, args=TrainingArguments("out"), train_dataset=train_set,
        ...                   callbacks=[ActvizCallback(every=100)])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, **watch_kwargs: Any) -> None:
        self.log_dir = log_dir
        self.watch_kwargs = _check_watch_kwargs(type(self).__name__, log_dir, watch_kwargs)
        self._viz: Watcher | None = None

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
        kwargs_for_watch = {"grad_scaler": scaler if isinstance(scaler, torch.amp.GradScaler) else None}
        kwargs_for_watch.update(self.watch_kwargs)
        self._viz = watch(model, auto_step=False, **self._destination(args), **kwargs_for_watch)

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
        if viz is not None:
            viz.close()

    def _destination(self, args: TrainingArguments) -> dict[str, Any]:
        """``log_dir=`` for watch(), unless a ``writer`` was given."""
        if self.log_dir is not None:
            return {"log_dir": self.log_dir}
        if self.watch_kwargs.get("writer") is not None:
            return {}
        logging_dir = getattr(args, "logging_dir", None)  # gone in transformers 5
        return {"log_dir": logging_dir or os.path.join(args.output_dir, "runs")}
