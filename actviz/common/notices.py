"""What a watcher tells its user, each at most once per run: the causes and the fixes, in one place.

Every message goes through :func:`~actviz.common.safe_warnings.warn_safely`, so that ``-W error``
never turns one into an exception in the training thread.
"""

from __future__ import annotations

from .safe_warnings import warn_safely

__all__ = ["Notices"]

_TEXTS = {
    "forked": "actviz logs nothing in this process: it was forked from the process that called watch() (Hogwild, "
              "os.fork()). Call actviz.watch() in each process that should log, with its own log_dir. Warned once.",
    "dropped": "actviz logs no weight_grads for step {step}: no optimizer that holds them applied the gradients its "
               "backward made (zero_grad() came first, as in a GAN generator's update through the discriminator, or "
               "the run ended). In a GAN, number the steps by iteration: options=actviz.Options(auto_step=False) and "
               "viz.set_step(iteration) (docs/training-setups.md, 'Several optimizers, several backward passes per "
               "step'). Warned once per run.",
    "no_backward": "actviz logs no gradients for step {step}: its forward got no backward pass (another backward "
                   "updated the watched parameters first, or more forwards ran). If your loop calls the model more "
                   "than once per optimizer step, call it under torch.no_grad() where its output is not "
                   "backpropagated (a GAN generator's forward for the discriminator step), or number the steps "
                   "yourself: options=actviz.Options(auto_step=False) and viz.set_step(iteration) before the "
                   "forward you want logged, so that every watched model counts iterations (docs/training-setups.md, "
                   "'Several optimizers, several backward passes per step'). Warned once per run.",
    "step_axes": "actviz counted {steps} steps of this model and {other_steps} of {other}, watched in the same "
                 "process: their step axes do not match, so one step number is a different moment for each (a GAN's "
                 "discriminator runs two forwards an iteration, its generator one). Number both by iteration: "
                 "options=actviz.Options(auto_step=False) for each, and viz.set_step(iteration) before each "
                 "model's forward (docs/training-setups.md, 'Several optimizers, several backward passes per "
                 "step'). Warned once.",
    "compiled": "actviz could not log step {step}: the model ran compiled. It was compiled after watch() in a process "
                "that had not imported torch.compile when watch() ran; later logging steps run eagerly and log. "
                "Compile before watch() (or import torch._dynamo first) to log this step too. Warned once.",
}


class Notices:
    """Warns each kind of notice once.

    Example:
        >>> import warnings
        >>> notices = Notices()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     notices.once("dropped", step=4); notices.once("dropped", step=5)
        >>> len(caught), "step 4" in str(caught[0].message)
        (1, True)
    """

    def __init__(self, subject: str | None = None) -> None:
        self._given: set[str] = set()
        self._subject = subject  # the watcher its warnings name: "Net → runs/x"

    def once(self, kind: str, **values: object) -> None:
        """Warn the notice ``kind`` (a key of the texts above) unless it was given already."""
        if kind not in self._given:
            self._given.add(kind)
            warn_safely(_TEXTS[kind].format(**values), RuntimeWarning, stacklevel=3, subject=self._subject)

    def skipped(self, name: str, error: BaseException) -> None:
        """A hook failed: ``name`` is skipped from now on (once per name)."""
        self.once_text(f"skip:{name}",
                       f"actviz skips {name!r} from now on: its hook raised {type(error).__name__}: {error}")

    def once_text(self, kind: str, text: str) -> None:
        if kind not in self._given:
            self._given.add(kind)
            warn_safely(text, RuntimeWarning, stacklevel=3, subject=self._subject)
