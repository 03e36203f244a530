"""Adapters that attach :func:`actviz.watch` to a framework's trainer.

Each adapter is one thin file, imported on its own so that ``import actviz`` needs
neither framework:

* :mod:`actviz.integrations.lightning` — ``ActvizCallback`` for Lightning's ``Trainer``
  (``pip install -e ".[lightning]"`` from a clone).
* :mod:`actviz.integrations.huggingface` — ``ActvizCallback`` for 🤗 Transformers'
  ``Trainer`` (``pip install -e ".[huggingface]"`` from a clone).

Both watch the model the trainer trains with ``auto_step=False`` and set the step to
the trainer's global step before each optimizer step, so actviz's steps line up with
the trainer's own logs and gradient accumulation logs once per optimizer step.

Example:
    >>> from actviz.integrations.lightning import ActvizCallback  # doctest: +SKIP
    >>> trainer = lightning.pytorch.Trainer(callbacks=[ActvizCallback(every=100)])  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from ..api import watch
from ..options import CaptureOptions
from ..schedule import Schedule
from ..common.suggestions import did_you_mean
from ..statistics import check_statistics

__all__: list[str] = []  # the adapters live in their submodules

# Arguments of watch() an adapter sets itself.
_SET_BY_ADAPTER = ("model", "auto_step")


def _check_watch_kwargs(
    owner: str, log_dir: str | os.PathLike[str] | None, watch_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Check a callback's ``watch()`` arguments when it is made, not when training starts.

    Names are checked against :func:`actviz.watch`'s signature, schedules are parsed and
    :class:`~actviz.options.CaptureOptions` checks bins, sampling, channels and outputs;
    the other values are checked by ``watch()`` itself before it touches the model.
    """
    known = [name for name in inspect.signature(watch).parameters if name not in ("model", "log_dir")]
    for name in watch_kwargs:
        if name in _SET_BY_ADAPTER:
            raise TypeError(
                f"{owner} sets {name}= itself: it watches the trainer's model and drives the "
                "steps from the trainer's global step (auto_step=False)"
            )
        if name not in known:
            hint = did_you_mean(name, known, otherwise=f"; it takes {', '.join(known)}")
            raise TypeError(f"{owner} got an unknown actviz.watch() argument {name!r}{hint}")
    if log_dir is not None and watch_kwargs.get("writer") is not None:
        raise ValueError(f"give {owner} a log_dir or a writer, not both: actviz writes to one SummaryWriter")
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a path, got {type(log_dir).__name__}: {log_dir!r}")
    for name in ("every", "image_every"):
        if watch_kwargs.get(name) is not None:
            Schedule.parse(watch_kwargs[name], name)
    check_statistics(watch_kwargs.get("statistics"))
    CaptureOptions(**{name: value for name, value in watch_kwargs.items()
                      if name in CaptureOptions.names() and name != "statistics"})
    return dict(watch_kwargs)
