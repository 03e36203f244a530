"""Features of a watcher that are not per-step numbers: ``watch(model, extras=[...])``.

* :class:`Probe`: a fixed batch drawn on image steps, with Grad-CAM over it if asked;
* :class:`Spikes`: the gradient-spike recorder (:mod:`actviz.diagnosis.spikes`).

Numbers are statistics, named in ``statistics=`` (:mod:`actviz.statistics.registry`); sizes and mechanics
are :class:`actviz.Options`. Each extra is given at most once.

Example:
    >>> import torch, actviz
    >>> extras = [actviz.Probe(torch.zeros(1, 3, 8, 8), gradcam=True), actviz.Spikes()]
    >>> [type(extra).__name__ for extra in extras]
    ['Probe', 'Spikes']
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Probe", "Spikes", "check_extras"]


@dataclass(frozen=True, eq=False)
class Probe:
    """A fixed batch the model takes, drawn on image steps: ``extras=[actviz.Probe(batch)]``.

    On image steps it goes once through the model (no grad, eval mode, not a step) and ``feature_maps/*`` are
    drawn from its sample 0, so the same picture moves through training; ``probe/input`` shows it.
    :func:`actviz.watch` sends it through once itself, the same way, so that a probe the model cannot take
    (a wrong shape or device) raises there; that forward changes nothing of the model
    (:func:`actviz.capture.probe.try_probe` says how).

    Args:
        batch: What the model takes: a tensor, or a tuple or dict of tensors passed as its arguments, e.g.
            ``actviz.load_images(["cat.jpg"])``.
        gradcam: With a batch of images: ``True`` draws Grad-CAM of the last ``Conv2d`` over sample 0 as
            ``gradcam/{layer}`` on image steps; a layer name or a list of names picks others. Each must be a
            layer the probe's forward runs and whose output is ``(N, C, h, w)``.

    Example:
        >>> import torch
        >>> Probe(torch.zeros(1, 3, 8, 8)).gradcam
        False
    """

    batch: Any
    gradcam: bool | str | list[str] = False


@dataclass(frozen=True)
class Spikes:
    """The gradient-spike recorder: ``extras=[actviz.Spikes()]``.

    Gradient spikes are judged by default (with the alerts on), on the global gradient norm before clipping,
    from 10x the median. With this extra they are judged at every step and from 4x the median, and a spike
    also writes its layers' last 16 gradient norms and logs the next 3 steps in full (docs/diagnosis.md).
    Not with ``Options(merge_ranks=True)``: rank 0 alone would log the steps after a spike.

    Example:
        >>> Spikes()
        Spikes()
    """


def check_extras(extras: Any) -> tuple[Probe | None, Spikes | None]:
    """``watch(extras=...)`` -> ``(probe, spikes)``, each ``None`` when not given.

    Raises:
        TypeError: Not a list of extras, an item that is not one (a class instead of an instance is named).
        ValueError: An extra given twice.

    Example:
        >>> check_extras([Spikes()])
        (None, Spikes())
        >>> check_extras([Spikes])
        Traceback (most recent call last):
        ...
        TypeError: extras takes objects, got the class Spikes; for example extras=[actviz.Spikes()]
    """
    if extras is None:
        return None, None
    if isinstance(extras, (Probe, Spikes, str)) or not isinstance(extras, Iterable):
        raise TypeError(f"extras must be a list, got {type(extras).__name__}: {extras!r}; for example "
                        "extras=[actviz.Spikes()]")
    found: dict[type, Any] = {}
    for extra in extras:
        if isinstance(extra, type) and extra in (Probe, Spikes):
            example = "actviz.Probe(batch)" if extra is Probe else "actviz.Spikes()"
            raise TypeError(f"extras takes objects, got the class {extra.__name__}; for example extras=[{example}]")
        if not isinstance(extra, (Probe, Spikes)):
            raise TypeError(f"each extra must be an actviz.Probe or actviz.Spikes, got {type(extra).__name__}: "
                            f"{extra!r}")
        if type(extra) in found:
            raise ValueError(f"extras holds two {type(extra).__name__} objects; give one")
        found[type(extra)] = extra
    return found.get(Probe), found.get(Spikes)
