"""Compiled summaries: a pure tensor function run through ``torch.compile`` (Inductor), safely.

:func:`run` compiles a function of one 1-D tensor, such as
:func:`actviz.summaries.one_pass.header_sums`, once per (function, device, dtype, size class) and
calls it. Every tensor of one device and dtype shares the compiled code: its length is an
unbacked dynamic size (so not even length 1 is specialized), it is given stride 1
and no view base, and the global state Dynamo guards on is the same on every call.
A run compiles at most two graphs per device and dtype, however many layer
shapes: one for tensors under :data:`LARGE` elements, one for the others, each tuned
for its size.

* **Lazily.** Nothing is compiled until the first call, which comes from the first
  logging step's hooks: a run that never logs compiles nothing.
* **Never in a user's graph.** The call goes through ``torch.compiler.disable``,
  so when Dynamo traces a compiled model's hooks, the summary is a graph break
  and runs outside the user's graph, compiled on its own. It runs under the
  ``"default"`` stance, so a user's ``torch.compiler.set_stance("force_eager")``
  does not silently make it eager, and under ``no_grad`` with autocast off, so
  that forward and backward hooks meet the same guards.
* **Its own code object per key.** Dynamo counts compiled entries per code object
  against ``torch._dynamo.config.recompile_limit``; a copy of the function's code
  per key keeps each key's count its own, however many dtypes a run has.
* **On the training thread, not at exit.** The writer thread's small host tensors take the eager path:
  torch holds one process-wide flag while any thread compiles, so a compile there would make
  ``torch.compiler.is_compiling()`` true in the training thread's eager code (its hooks, an
  ``optimizer.step()``), and two threads compiling at once share Dynamo's global state. Nothing is
  compiled once the interpreter shuts down (the main thread has stopped: Inductor's compile threads
  cannot start then).
* **Fail safe.** If compiling or running fails (no C++ compiler, an Inductor error,
  an old torch), a ``RuntimeWarning`` says why once, :func:`run` returns ``None``
  for that key from then on, and the caller takes the eager path. Tensor
  subclasses and inference tensors (other guards) get ``None`` at once.

It is off unless ``ACTVIZ_FUSED=1`` (:func:`use_fused` says why). It needs three private APIs, each
behind one function in :mod:`actviz.common._internals`: Inductor's backend (wrapped to count graphs and calls),
``mark_unbacked`` with a size hint (Inductor tunes its reduction for the size class, not for the first
tensor it sees) and the current stance (to skip ``set_stance`` when it is already the default). An error
from any of them counts as a failed compile.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from ..common._internals import compiler_stance, inductor_backend, mark_size_unbacked
from ..common.safe_warnings import warn_once

__all__ = ["CompiledFunction", "compiled_functions", "run", "use_fused"]

logger = logging.getLogger(__name__)

#: Tensors from this length on get their own graph, tuned for 16 M elements (a GPU splits the reduction
#: over many blocks, a CPU over its threads); shorter ones one tuned for 256 (one block, one thread: on a
#: GPU one kernel instead of two, on a CPU no thread team to wait for, as aten's reductions; Inductor's
#: CPU loop goes parallel from 512 elements per thread of the hint).
LARGE = 1 << 15
SIZE_HINTS = {False: 1 << 8, True: 1 << 24}

#: The name of actviz's writer thread (:mod:`actviz.output.writer_thread`), which never compiles.
WRITER_THREAD = "actviz-writer"

Key = tuple[str, str, torch.dtype, bool]
#: (function name, device, dtype, large) -> its compiled function, or None once it failed. The device
#: with its index ("cuda:1"), as Dynamo guards on it: one process driving two GPUs gets graphs for each.
_compiled: dict[Key, CompiledFunction | None] = {}
_warned: set[str] = set()  # "compile" once a failed compile was warned about (later ones are logged)


def use_fused() -> bool:
    """Whether tensors take the compiled summaries: only where the environment sets ``ACTVIZ_FUSED=1``.

    The compiled path is off by default on every device, GPUs included. On an H200 (2026-11-27, torch 2.11)
    it made a logging step of ResNet-50 (batch 64, bf16) cost 3.0 s more than a bare step, against 0.31 s eagerly:
    five Triton reductions a call, 2-5 ms each on a 51 M-element activation, about one block's bandwidth
    (apparently unsplit: the length is unbacked, so Inductor cannot size a split; docs/performance.md,
    "On a GPU"). In a watcher's step only tensors larger than their sample ask: the small ones are
    batched (:mod:`actviz.summaries.small_tensors`).

    Example:
        >>> import os
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"ACTVIZ_FUSED": ""}):
        ...     use_fused()
        False
    """
    return os.environ.get("ACTVIZ_FUSED", "") == "1"  # read per tensor: no dict made per call


def run(function: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor) -> torch.Tensor | None:
    """``function(values)`` compiled, for a 1-D tensor; ``None`` where it cannot be (then run it eagerly).

    Example:
        >>> from actviz.summaries.one_pass import header_sums
        >>> run(header_sums, torch.arange(4.0)).tolist()  # compiles on first use (seconds); see actviz.summaries.header
        [3.0, 3.0, 1.5, 1.25, 0.0, 3.0]
    """
    if torch.compiler.is_compiling():  # Dynamo is tracing a compiled model's hook: break the graph here
        return torch.compiler.disable(_run)(function, values)
    return _run(function, values)


def _run(function: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor) -> torch.Tensor | None:
    if type(values) is not torch.Tensor or values.is_inference():
        return None  # a subclass (DTensor) or an inference tensor: its own guards, so leave it to eager torch
    if threading.current_thread().name == WRITER_THREAD or not threading.main_thread().is_alive():
        return None  # see the module docstring: compiled on the training thread alone, and not at exit
    # Dynamo guards on the stride, even of a length-1 tensor, and on the shape of a view's base: give it
    # stride 1 and no base, so that one graph serves every call of its size class.
    if values.stride() != (1,):
        values = values.as_strided((values.numel(),), (1,)) if values.numel() == 1 else values.contiguous()
    values = values.data
    key = (function.__qualname__, str(values.device), values.dtype, values.numel() >= LARGE)
    compiled = _compiled.get(key, ...)
    try:
        if compiled is ...:
            compiled = _compiled[key] = CompiledFunction(function, *key[1:])
        return None if compiled is None else compiled(values)
    except Exception as error:  # noqa: BLE001 - a summary must never stop training
        _compiled[key] = None
        _report_failure(key, error)
        return None


def _report_failure(key: Key, error: BaseException) -> None:
    name, device, dtype, _ = key
    reason = " ".join([line for line in str(error).splitlines() if line.strip()][:2])[:500] or type(error).__name__
    message = f"actviz: compiling {name} for {device} {dtype} failed, so it runs eagerly: {reason}"
    if not warn_once(_warned, "compile", message, RuntimeWarning, stacklevel=3):
        logger.info(message)


def compiled_functions() -> dict[Key, CompiledFunction | None]:
    """Every function compiled so far, by (name, device, dtype, large); ``None`` where it failed."""
    return dict(_compiled)


class CompiledFunction:
    """One function compiled for one device, dtype and size class, with counts of its graphs and calls.

    Args:
        function: A pure function of one 1-D tensor.
        device: ``"cuda:0"``, ``"cpu"``, ...
        dtype: The dtype of the tensors it will take.
        large: Whether they have :data:`LARGE` elements or more.
    """

    def __init__(
        self, function: Callable[[torch.Tensor], torch.Tensor], device: str, dtype: torch.dtype, large: bool
    ) -> None:
        import torch._dynamo

        self.device_type = torch.device(device).type
        self.size_hint = SIZE_HINTS[large]
        self.graphs = 0  # graphs compiled for this key
        self.calls = 0  # calls that ran compiled code
        self._inductor = inductor_backend()
        name = f"{function.__name__}_{device.replace(':', '')}_{str(dtype).removeprefix('torch.')}{'_large' * large}"
        names = {"co_name": name, **({"co_qualname": name} if hasattr(function.__code__, "co_qualname") else {})}
        code = function.__code__.replace(**names)  # its own Dynamo cache entries and recompile limit
        copy = types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)
        self._compiled = torch.compile(copy, backend=self._backend, dynamic=True, fullgraph=True)
        self._call = torch.compiler.disable(self._call_compiled)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        return self._call(values)

    def _call_compiled(self, values: torch.Tensor) -> torch.Tensor:
        # One graph for every length (an unbacked size, so not even 1 is specialized), tuned for its size class.
        mark_size_unbacked(values, 0, self.size_hint)
        # The same global state on every call, as Dynamo guards on it; each switch only where needed (µs each).
        with ExitStack() as stack:
            if compiler_stance() != "default":
                stack.enter_context(torch.compiler.set_stance("default"))
            if torch.is_grad_enabled():  # forward hooks: on; backward hooks: off
                stack.enter_context(torch.no_grad())
            if torch.is_autocast_enabled(self.device_type):
                stack.enter_context(torch.autocast(self.device_type, enabled=False))
            return self._compiled(values)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = self._inductor(graph, example_inputs)
        self.graphs += 1

        def counted(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return counted
