"""Adapters that attach :func:`actviz.watch` to a framework's trainer.

Each adapter is one thin file, imported on its own so that ``import actviz`` needs
neither framework:

* :mod:`actviz.integrations.lightning` — ``ActvizCallback`` for Lightning's ``Trainer``
  (``pip install -e ".[lightning]"`` from a clone).
* :mod:`actviz.integrations.huggingface` — ``ActvizCallback`` for 🤗 Transformers'
  ``Trainer`` (``pip install -e ".[huggingface]"`` from a clone).

Both watch the model the trainer trains with ``Options(auto_step=False)`` and set the step to
the trainer's global step before each optimizer step, so actviz's steps line up with
the trainer's own logs and gradient accumulation logs once per optimizer step.

Example:
    >>> from actviz.integrations.lightning import ActvizCallback  # doctest: +SKIP
    >>> trainer = lightning.pytorch.Trainer(callbacks=[ActvizCallback(every=100)])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

from ..api import REMOVED_KEYWORDS, removed_keyword_error, watch
from ..extras import check_extras
from ..options import Options
from ..schedule import Schedule
from ..common.suggestions import did_you_mean
from ..statistics import resolve_statistics

__all__: list[str] = []  # the adapters live in their submodules

# Arguments of watch() an adapter sets itself.
_SET_BY_ADAPTER = ("model",)


def adapter_options(options: Options | None, grad_scaler: Any) -> Options:
    """The callback's ``options``, with ``auto_step=False`` (the trainer's global step drives the steps) and the
    trainer's ``GradScaler`` unless the user's options name one."""
    options = options or Options()
    return dataclasses.replace(options, auto_step=False, grad_scaler=options.grad_scaler or grad_scaler)


def with_destination(destination: dict[str, Any], watch_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``watch()``'s keywords: the callback's ``destination`` (``log_dir=`` or ``sink=`` a SummaryWriter) with the
    user's, a ``sink=`` of the user's kept beside a writer the callback found."""
    merged = dict(watch_kwargs)
    if "sink" in destination and merged.get("sink") is not None:
        user = merged["sink"]
        merged["sink"] = [destination["sink"], *(user if isinstance(user, (list, tuple)) else [user])]
        return {key: value for key, value in destination.items() if key != "sink"} | merged
    return destination | merged


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
                "steps from the trainer's global step (Options(auto_step=False))"
            )
        if name in REMOVED_KEYWORDS:
            raise removed_keyword_error(name, owner)
        if name not in known:
            hint = did_you_mean(name, known, otherwise=f"; it takes {', '.join(known)}")
            raise TypeError(f"{owner} got an unknown actviz.watch() argument {name!r}{hint}")
    if log_dir is not None and _has_writer(watch_kwargs.get("sink")):
        raise ValueError(f"give {owner} a log_dir or a SummaryWriter as sink=, not both: actviz writes to one "
                         "SummaryWriter")
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a path, got {type(log_dir).__name__}: {log_dir!r}")
    for name in ("every", "image_every"):
        if watch_kwargs.get(name) is not None:
            Schedule.parse(watch_kwargs[name], name)
    resolve_statistics(watch_kwargs.get("statistics"))
    check_extras(watch_kwargs.get("extras"))
    options = watch_kwargs.get("options")
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options must be an actviz.Options, got {type(options).__name__}: {options!r}; for example "
                        "options=actviz.Options(bins=32)")
    return dict(watch_kwargs)


def _has_writer(sink: Any) -> bool:
    from torch.utils.tensorboard import SummaryWriter

    return any(isinstance(item, SummaryWriter) for item in (sink if isinstance(sink, (list, tuple)) else [sink]))
