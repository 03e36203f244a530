"""actviz's own ``torch.library`` ops, defined in one place, and where their Triton bodies run.

:func:`define_op` defines an op in the ``actviz`` namespace with torch.library's low-level API: one body for
every device, which the dispatcher calls straight away, without the Python frames of the ``custom_op``
wrapper (about 20 a call, and actviz calls its ops for every large tensor of a logging step), and a fake
body for meta tensors and ``torch.compile``. A ``TorchDispatchMode`` sees each call as one op with its
tensors as inputs. :func:`triton_runs_on` says where an op's Triton body runs rather than its eager one.

Example:
    >>> triton_runs_on(torch.device("meta"))
    False
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["define_op", "triton_runs_on"]

_LIBRARIES: list[torch.library.Library] = []  # kept: a Library's registrations end when it is collected


def define_op(name: str, schema: str, body: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """Define ``actviz::{name}`` with ``schema`` (its signature, the name included), ``body`` for every device
    and ``fake`` for meta tensors; returns its overload, ``torch.ops.actviz.{name}.default``. A second copy of
    actviz in one process (a module reloaded, a vendored copy) finds it defined and uses the op defined first."""
    library = torch.library.Library("actviz", "FRAGMENT")
    try:
        library.define(schema)
    except RuntimeError:  # defined already
        pass
    else:
        library.impl(name, body, "CompositeExplicitAutograd")
        torch.library.register_fake(f"actviz::{name}", fake, lib=library)
        _LIBRARIES.append(library)
    return getattr(torch.ops.actviz, name).default


def triton_runs_on(device: torch.device) -> bool:
    """Whether an op's Triton body runs on ``device`` (where Triton is installed): CUDA, or the CPU where
    ``TRITON_INTERPRET=1`` was set before the kernels were defined, which is how the test suite runs them."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
