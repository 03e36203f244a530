"""Lightning: ``Trainer(callbacks=[ActvizCallback(every=100)])``.

The callback watches the ``LightningModule`` for the length of a ``fit`` and sets
actviz's step to ``trainer.global_step`` before every training batch, so histograms
sit at the same steps as the metrics Lightning logs. It writes into the trainer's
``TensorBoardLogger`` run when there is one.

actviz starts a step when the watched module's forward runs in training mode, so
``training_step`` should call the module itself (``self(x)``); the callback warns
once if the first training batch never does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..api import watch
from ..common.safe_warnings import warn_safely
from ..watcher import Watcher
from . import _check_watch_kwargs, _has_writer, adapter_options, with_destination

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
except ModuleNotFoundError as error:
    if error.name not in ("lightning", "lightning.pytorch"):
        raise  # Lightning is there but something it needs is not: show the real error
    try:
        import pytorch_lightning as pl  # the standalone package, same API
        from pytorch_lightning.loggers import TensorBoardLogger
    except ModuleNotFoundError as fallback_error:
        if fallback_error.name != "pytorch_lightning":
            raise
        raise ImportError(
            "actviz.integrations.lightning needs Lightning, which is not installed: "
            "pip install lightning, or from a clone of actviz: pip install -e \".[lightning]\""
        ) from None

__all__ = ["ActvizCallback", "trainer_grad_scaler"]


def trainer_grad_scaler(trainer: Any) -> Any:
    """The ``GradScaler`` of a trainer with ``precision="16-mixed"``, else ``None`` (bf16 needs none)."""
    plugin = getattr(trainer, "precision_plugin", None) or getattr(getattr(trainer, "strategy", None),
                                                                  "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


class ActvizCallback(pl.Callback):
    """Watch the ``LightningModule`` while ``Trainer.fit`` runs.

    On ``on_fit_start`` (after the strategy has set the model up) it calls
    :func:`actviz.watch` on the module with ``Options(auto_step=False)``; before each training
    batch it calls :meth:`~actviz.Watcher.set_step` with ``trainer.global_step``; at the
    end of the fit, on ``teardown`` and on an exception it closes the watcher, removing
    every hook. Only global rank 0 watches anything. With ``precision="16-mixed"`` it
    passes the trainer's ``GradScaler`` to :func:`actviz.watch`, so gradients are logged
    unscaled.

    Validation and sanity-check batches run in eval mode without grad and log nothing.
    With ``accumulate_grad_batches=k`` a scheduled global step logs the activations and
    output gradients of its first micro-batch and the parameter gradients the optimizer
    applies, summed over all ``k``.

    Args:
        log_dir: Folder for actviz's own ``SummaryWriter``. By default actviz writes
            into the trainer's ``TensorBoardLogger`` (its ``experiment``, which it never
            closes), so its tags share the run with Lightning's metrics; without such a
            logger it writes to an ``actviz`` folder in the first logger's folder, or in
            ``trainer.default_root_dir`` when there is no logger.
        **watch_kwargs: Passed to :func:`actviz.watch`: ``sink``, ``every``, ``image_every``,
            ``layers``, ``statistics``, ``extras``, ``alerts``, ``on_step``, ``on_alert`` or ``options``
            (its ``auto_step`` is set to ``False``). Steps are Lightning's global steps.

    Raises:
        TypeError: An unknown or removed ``watch()`` argument (the message names the new spelling),
            or ``model=``, which the callback sets itself.
        ValueError: Both ``log_dir`` and a ``SummaryWriter`` as ``sink``, or a bad schedule.

    Example:
        >>> import lightning.pytorch as pl  # doctest: +SKIP
        >>> from actviz.integrations.lightning import ActvizCallback  # doctest: +SKIP
        >>> trainer = pl.Trainer(max_epochs=10, callbacks=[ActvizCallback(every=100)])  # doctest: +SKIP
        >>> trainer.fit(model, train_loader)  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, **watch_kwargs: Any) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.watch_kwargs = _check_watch_kwargs(type(self).__name__, log_dir, watch_kwargs)
        self._viz: Watcher | None = None
        self._probe: RemovableHandle | None = None
        self._probe_saw_forward = False
        self._probed = False

    @property
    def viz(self) -> Watcher | None:
        """The watcher of the running fit; ``None`` outside a fit and on ranks other than 0."""
        return self._viz

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()  # a watcher left by an earlier fit
        if not trainer.is_global_zero:
            return
        kwargs = with_destination(self._destination(trainer), self.watch_kwargs)
        kwargs["options"] = adapter_options(self.watch_kwargs.get("options"), trainer_grad_scaler(trainer))
        self._viz = watch(pl_module, **kwargs)
        self._probed = False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._viz is None:
            return
        self._viz.set_step(trainer.global_step)
        if not self._probed:  # once per fit: does training_step call the module's forward?
            self._probed = True
            self._probe_saw_forward = False
            self._probe = pl_module.register_forward_pre_hook(self._on_probe_forward)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._probe is None:
            return
        self._remove_probe()
        if not self._probe_saw_forward:
            warn_safely(
                f"actviz logs nothing: {type(pl_module).__name__}.training_step does not call the module "
                "itself, and actviz starts a step when the watched module's forward runs. Call self(x) in "
                "training_step (with a forward that runs your network) to use ActvizCallback.",
                RuntimeWarning,
                stacklevel=2,
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()  # Lightning skips on_fit_end and teardown when fit raises

    def close(self) -> None:
        """Remove every hook and write what is pending. Safe to call more than once."""
        self._remove_probe()
        viz, self._viz = self._viz, None
        if viz is not None:
            viz.close()

    # -- helpers -----------------------------------------------------------------------------

    def _destination(self, trainer: pl.Trainer) -> dict[str, Any]:
        """``log_dir=``, or ``sink=`` the logger's SummaryWriter, for watch()."""
        if self.log_dir is not None:
            return {"log_dir": self.log_dir}
        if _has_writer(self.watch_kwargs.get("sink")):
            return {}
        from torch.utils.tensorboard import SummaryWriter

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                experiment = logger.experiment
                if isinstance(experiment, SummaryWriter):
                    return {"sink": experiment}
                return {"log_dir": logger.log_dir}  # a tensorboardX writer: same folder, own writer
        # trainer.log_dir's logic without its broadcast, which would hang with only rank 0 here.
        first = trainer.loggers[0] if trainer.loggers else None
        base = getattr(first, "log_dir", None) or getattr(first, "save_dir", None) or trainer.default_root_dir
        return {"log_dir": os.path.join(base, "actviz")}

    def _on_probe_forward(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self._probe_saw_forward = True

    def _remove_probe(self) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
