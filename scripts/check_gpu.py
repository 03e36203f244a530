#!/usr/bin/env python
"""actviz on one CUDA GPU (H100/H200) in one call of at most 540 s, ending with one table.

Phases, each in its own process under a time cap drawn from one budget (``--budget``, default 520 s, so that a 540 s
call still prints the table); a crash or a hang loses one phase, not the call:

    env       the machine, torch, Triton, where actviz is imported from
    kernels   every kernel variant actviz launches (each dtype, NCHW and channels-last, channel strengths, dead
              channels, saturation, outliers, listed parameters, logit rows), at real sizes:
              compile   compiled and launched, or the error; registers, spills, shared memory, first-call seconds
              correct   the op's numbers against float64 (NaN, ±Inf and zeros spiked in), and one tensor of
                        2**31 + 4099 elements
              speed     the op's GB/s against a plain read of the same tensor (``x.sum()``) and a copy
    resnet50  torchvision's ResNet-50, batch 64, 224², bf16 autocast: a logging step and an idle step (watched,
              logging nothing) against a bare step; the first logging step (Triton compiles, cold cache)
    gpt2      GPT-2 small from its config, 1 x 1,024 tokens, bf16 autocast: the same
    tests     the project's tests/test_cuda.py, with what the budget leaves

**Any actviz warning fails the check**: every phase counts the warnings and the ``actviz`` logger's records it sees
(a layer actviz skipped, a statistic that failed) and reports them as a FAIL row. The exit status is 1 if any row
failed, 0 otherwise.

Logs go to ``--out`` (default ``$OUT`` if set, else ``gpu-logs/``): ``check.log`` (every phase's output),
``rows.jsonl`` (the raw rows), ``table.txt`` and ``table.json`` (the table).

``--smoke`` runs every phase on the CPU at toy sizes, with ``TRITON_INTERPRET=1`` (the Triton kernels interpreted),
all in one process: it checks this script on a machine without a GPU (``tests/test_check_gpu.py``). The
interpreter takes seconds a call, so the smoke kernels phase takes one case of each kind of variant, and the smoke
models (a conv-BN-ReLU block for ResNet-50, a 2-layer GPT-2 of width 64) are small enough for seconds a step. Nothing is
downloaded: the models are built from configs with random weights.

Usage::

    python scripts/check_gpu.py                  # on the GPU machine; logs in $OUT or gpu-logs/
    python scripts/check_gpu.py --out logs --skip tests
    python scripts/check_gpu.py --smoke --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: (phase, its cap in seconds): the caps add up to more than the budget on purpose; each gets min(cap, what is left).
PHASES = [("env", 40), ("kernels", 170), ("resnet50", 130), ("gpt2", 110), ("tests", 90)]
SECTIONS = ["env", "compile", "correct", "speed", "step", "warnings", "tests", "note"]
SMOKE = False
ROWS_FILE = "rows.jsonl"


# ----------------------------------------------------------------------------------------------------------- rows

def emit(out: Path, section: str, item: str, value: str, verdict: str = "info", **data: object) -> None:
    """One row of the table, appended to ``out/rows.jsonl`` and printed."""
    row = {"section": section, "item": item, "value": value, "verdict": verdict, **data}
    with open(out / ROWS_FILE, "a") as rows:
        rows.write(json.dumps(row, default=str) + "\n")
    print(f"[{section}] {item}: {value} ({verdict})", flush=True)


def first_line(error: BaseException) -> str:
    """An error in one line: its type, its first line, and (Triton puts the cause last) its last error line."""
    lines = [line.strip() for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()]
    cause = next((line for line in reversed(lines) if "rror" in line), lines[0])
    return (lines[0] + (" | " + cause if cause != lines[0] else ""))[:300]


class ActvizWarnings(logging.Handler):
    """Counts actviz's warnings, in any thread, while entered: ``warnings.warn`` calls whose message or file is
    actviz's, and the ``actviz`` logger's records at WARNING or above (where a ``-W error`` filter turned a warning
    into a log record: :func:`actviz.common.safe_warnings.warn_safely`).

    Example:
        >>> from actviz.common.safe_warnings import warn_safely
        >>> with ActvizWarnings() as seen:
        ...     warn_safely("actviz: a layer was skipped")
        ...     warnings.warn("something else")
        >>> seen.messages
        ['actviz: a layer was skipped']
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._package = ""
        self._shown: Callable[..., None] | None = None
        self._filters: contextlib.AbstractContextManager[object] | None = None

    def emit(self, record: logging.LogRecord) -> None:  # the logging half
        self.messages.append(record.getMessage())

    def _show(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: object = None, line: str | None = None) -> None:
        text = str(message)
        if text.startswith("actviz") or (self._package and filename.startswith(self._package)):
            self.messages.append(text)
        elif self._shown is not None:
            self._shown(message, category, filename, lineno, file, line)

    def __enter__(self) -> ActvizWarnings:
        import actviz

        self._package = os.path.dirname(actviz.__file__)
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.simplefilter("always")
        self._shown, warnings.showwarning = warnings.showwarning, self._show
        logging.getLogger("actviz").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("actviz").removeHandler(self)
        assert self._filters is not None
        self._filters.__exit__(*exc)  # restores showwarning and the filters


def report_warnings(out: Path, phase: str, seen: ActvizWarnings) -> None:
    counts = collections.Counter(seen.messages)
    first = "; ".join(f"{n}x {m[:160]}" for m, n in counts.most_common(3))
    emit(out, "warnings", f"actviz warnings in phase {phase}", f"{len(seen.messages)}" + (f": {first}" if first else ""),
         "FAIL" if seen.messages else "ok", messages=list(counts.items())[:50])


# ------------------------------------------------------------------------------------------------------ timing

def cuda() -> bool:
    import torch

    return not SMOKE and torch.cuda.is_available()


def sync() -> None:
    import torch

    if cuda():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median milliseconds per call: CUDA events around each call on a GPU, the wall clock on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        if cuda():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------------- env phase

def phase_env(out: Path) -> None:
    import torch

    emit(out, "env", "python", sys.version.split()[0])
    emit(out, "env", "torch", torch.__version__)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        emit(out, "env", "gpu", f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
             f"{p.total_memory / 2**30:.0f} GiB", "ok")
    else:
        emit(out, "env", "gpu", "none (torch.cuda.is_available() is False)", "info" if SMOKE else "FAIL")
    for name in ("triton", "torchvision", "transformers", "tensorboard", "pytest"):
        try:
            emit(out, "env", name, getattr(__import__(name), "__version__", "present"))
        except Exception as error:  # noqa: BLE001
            emit(out, "env", name, f"missing: {first_line(error)}", "WARN")
    import actviz

    emit(out, "env", "actviz", f"{getattr(actviz, '__version__', '?')} from {os.path.dirname(actviz.__file__)}")
    emit(out, "env", "TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "unset"))


# --------------------------------------------------------------------------------------------------- kernels phase

class Launches:
    """Wraps every Triton kernel actviz launches from Python (``kernel[grid](...)`` in its source) to keep what each
    launch compiled (registers, spills, shared memory) and how long its first call took, whatever the kernels'
    names."""

    def __init__(self) -> None:
        self.log = _Log()
        self.names: list[str] = []
        import inspect

        import triton

        from actviz.statistics import logit_rows_triton
        from actviz.summaries import one_pass_triton

        for module in (one_pass_triton, logit_rows_triton):
            source = inspect.getsource(module)
            for name, value in list(vars(module).items()):
                launched = re.search(rf"\b{re.escape(name)}\[", source) is not None
                if launched and isinstance(value, triton.runtime.jit.KernelInterface):
                    setattr(module, name, _Recorded(value, name, self.log))
                    self.names.append(name)


class _Log(list):
    """The launches recorded while ``active`` (the first call of each case: its compile; not the timed calls)."""

    active = False


class _Recorded:
    def __init__(self, kernel: object, name: str, log: _Log) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid: object) -> Callable[..., object]:
        launch = self.kernel[grid]

        def recorded(*args: object, **kwargs: object) -> object:
            if not self.log.active:
                return launch(*args, **kwargs)
            began = time.perf_counter()
            compiled = launch(*args, **kwargs)
            sync()
            self.log.append({"kernel": self.name, "compiled": compiled, "seconds": time.perf_counter() - began})
            return compiled
        return recorded

    def __getattr__(self, name: str) -> object:
        return getattr(self.kernel, name)


def compile_facts(record: dict[str, object]) -> str:
    compiled = record.get("compiled")
    metadata = getattr(compiled, "metadata", None)
    if metadata is None:  # the interpreter returns no compiled kernel
        return f"ran (interpreter), {record['seconds']:.2f} s"
    return (f"regs {getattr(compiled, 'n_regs', '?')}, spills {getattr(compiled, 'n_spills', '?')}, "
            f"smem {getattr(metadata, 'shared', '?')} B, warps {getattr(metadata, 'num_warps', '?')}, "
            f"first call {record['seconds']:.2f} s")


def kernel_cases(scale: int) -> list[dict[str, object]]:
    """The variants, as actviz's layer hook and parameter step would call the op (real sizes; ``scale`` shrinks the
    spatial and sequence sizes for ``--smoke``)."""
    import torch

    bf16, fp32, fp16, fp64 = torch.bfloat16, torch.float32, torch.float16, torch.float64

    def small(shape: tuple[int, ...]) -> tuple[int, ...]:  # --smoke: batch 2, the spatial sides over scale
        if scale == 1:
            return shape
        return tuple(2 if i == 0 else max(2, s // scale) if i >= 2 else s for i, s in enumerate(shape))

    conv, deep, gpt_mlp, gpt_hidden = small((64, 256, 56, 56)), small((64, 2048, 7, 7)), (1, 1024 // scale, 3072), (
        1, 1024 // scale, 768)
    cases: list[dict[str, object]] = []
    for dtype in (bf16, fp32, fp16, fp64):
        cases.append(dict(label="r50 conv 64x256x56x56 no picture", shape=conv, dtype=dtype))
        cases.append(dict(label="r50 conv 64x256x56x56 NCHW strengths", shape=conv, dtype=dtype, strengths=True))
    for dtype in (bf16, fp32):
        cases += [
            dict(label="r50 conv 64x256x56x56 NHWC strengths", shape=conv, dtype=dtype, last=True, strengths=True),
            dict(label="r50 relu 64x256x56x56 NCHW dead+strengths", shape=conv, dtype=dtype, units="dead",
                 strengths=True),
            dict(label="r50 relu 64x256x56x56 NHWC dead+strengths", shape=conv, dtype=dtype, last=True, units="dead",
                 strengths=True),
            dict(label="r50 relu 64x2048x7x7 NCHW dead+strengths", shape=deep, dtype=dtype, units="dead",
                 strengths=True),
            dict(label="tanh 64x256x56x56 saturation", shape=conv, dtype=dtype, units="saturation"),
            dict(label="gpt2 mlp 1x1024x3072 outliers", shape=gpt_mlp, dtype=dtype, outliers=True),
        ]
    cases.append(dict(label="gpt2 hidden 1x1024x768 outliers", shape=gpt_hidden, dtype=fp16, outliers=True))
    cases.append(dict(label="seq relu 1x32768x128 dead (32,768 channels)", shape=(1, 32768 // scale, 128), dtype=bf16,
                      units="dead"))
    r50 = [(256, 256, 3, 3), (512, 1024, 1, 1), (2048, 512, 1, 1), (1000, 2048), (64, 3, 7, 7)]
    gpt2 = [(50257, 768), (768, 2304), (768, 3072), (3072, 768), (1024, 768)]
    r50, gpt2 = ([(max(1, s[0] // scale**2), *s[1:]) for s in shapes] for shapes in (r50, gpt2))
    cases.append(dict(label="r50 params listed x5 fp32", listed=r50, dtype=fp32))
    cases.append(dict(label="gpt2 params listed x5 fp32", listed=gpt2, dtype=fp32))
    for dtype in (bf16, fp32, fp16):
        cases.append(dict(label="gpt2 logits 1024x50257", logits=(1024 // scale**2 or 1024, 50257 // scale), dtype=dtype))
    cases.append(dict(label="r50 logits 64x1000", logits=(64, 1000), dtype=fp32))
    if scale > 1:  # --smoke: one case of each kind of variant (the interpreter takes seconds a call)
        kept = {("r50 conv 64x256x56x56 no picture", fp64), ("r50 conv 64x256x56x56 NCHW strengths", bf16),
                ("r50 conv 64x256x56x56 NHWC strengths", fp32), ("r50 relu 64x256x56x56 NCHW dead+strengths", bf16),
                ("tanh 64x256x56x56 saturation", bf16), ("gpt2 hidden 1x1024x768 outliers", fp16),
                ("seq relu 1x32768x128 dead (32,768 channels)", bf16), ("r50 params listed x5 fp32", fp32),
                ("gpt2 logits 1024x50257", bf16)}
        cases = [case for case in cases if (case["label"], case["dtype"]) in kept]
    return cases


def spiked(shape: tuple[int, ...], dtype: object, device: object, last: bool = False, relu: bool = False) -> object:
    """Random values with NaN, ±Inf and a run of zeros at fixed places (a ReLU's output: half zeros, some dead
    channels)."""
    import torch

    x = torch.randn(shape, device=device, dtype=torch.float32) * 3
    if relu:
        x = x.relu()
        if x.dim() >= 3:
            x[:, : max(1, x.shape[1] // 8)] = 0.0
    flat = x.view(-1)
    n = flat.numel()
    flat[[n // 3, n // 2, n - 1]] = torch.tensor([math.nan, math.inf, -math.inf], device=device)
    flat[n // 5: n // 5 + 100] = 0.0
    x = x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if last else x


def reference_row(x: object, stride: int, outliers: bool, piece: int = 1 << 26) -> list[float]:
    """The op's row and sample of a 1-D tensor, by float64 ops a piece at a time (two passes: the mean, then the
    sums about it): nonzero, finite nonzero, mean and variance of z (NaN and ±Inf as 0), finite min and max; with
    ``outliers``, max |x| (NaN left out), the count of |x| >= 6, Σ(z-μ)², Σ(z-μ)⁴; then x[::stride]."""
    import torch

    n = x.numel()
    nonzero = finite_nonzero = big = 0
    total, low, high, largest = 0.0, math.inf, -math.inf, 0.0
    for start in range(0, n, piece):
        part = x[start:start + piece].double()
        finite = torch.isfinite(part)
        z = torch.where(finite, part, 0.0)
        nonzero += int((part != 0).sum())
        finite_nonzero += int((z != 0).sum())
        total += float(z.sum())
        if finite.any():
            low, high = min(low, float(part[finite].min())), max(high, float(part[finite].max()))
        magnitude = part.abs()
        kept = magnitude[~torch.isnan(part)]
        largest = max(largest, float(kept.max())) if kept.numel() else largest
        big += int((magnitude >= 6.0).sum())
    mean = total / n
    squares = fourths = 0.0
    for start in range(0, n, piece):
        part = x[start:start + piece].double()
        centred = torch.where(torch.isfinite(part), part, 0.0) - mean
        squares += float((centred * centred).sum())
        fourths += float((centred ** 4).sum())
    row = [float(nonzero), float(finite_nonzero), mean, squares / n, low, high]
    if outliers:
        row += [largest, float(big), squares, fourths]
    return row + x[::stride].double().cpu().tolist()


def differences(found: list[float], wanted: list[float], width: int) -> list[str]:
    """Where the op's numbers and float64's differ beyond float64 rounding of sums (counts, bounds, the sample:
    exactly)."""
    names = ["nonzero", "finite_nonzero", "mean", "variance", "min", "max", "max_abs", "outliers", "squares",
             "fourths"][:width]
    problems = []
    if len(found) != len(wanted):
        return [f"{len(found)} numbers, expected {len(wanted)}"]
    scale = max(1.0, abs(wanted[2]))
    for index, (got, want) in enumerate(zip(found, wanted)):
        field = names[index] if index < width else f"sample[{index - width}]"
        tolerance = 0.0
        if field == "mean":
            tolerance = 1e-12 * scale + 1e-12 * abs(want)
        elif field in ("variance", "squares", "fourths"):
            tolerance = 1e-9 + 1e-6 * abs(want)
        same = (math.isnan(got) and math.isnan(want)) or got == want or abs(got - want) <= tolerance
        if not same:
            problems.append(f"{field} {got!r}, expected {want!r}")
    return problems


def run_case(case: dict[str, object], device: object) -> tuple[Callable[[], object], Callable[[object], list[str]],
                                                                 int, object]:
    """(the op's call, its check against float64, the bytes one call reads, the tensor a plain read reads)."""
    import torch

    from actviz.options import DEFAULT_SAMPLE_SIZE
    from actviz.statistics import logit_rows
    from actviz.summaries import one_pass
    from actviz.summaries.one_tensor import flat_view, sample_stride

    dtype = case["dtype"]
    if "logits" in case:
        logits = torch.randn(case["logits"], device=device, dtype=dtype) * 4

        def check_logits(found: object) -> list[str]:
            x = logits.double()
            wanted = torch.stack([x.amax(-1), torch.logsumexp(x, -1), torch.special.xlogy(
                torch.softmax(x, -1), torch.softmax(x, -1)).sum(-1)])
            error = ((found.double() - wanted).abs() / wanted.abs().clamp_min(1.0)).max().item()
            return [] if error <= 2e-5 else [f"relative error {error:.2e} over 2e-05"]
        return (lambda: logit_rows.LOGIT_ROWS(logits)), check_logits, logits.numel() * logits.element_size(), logits
    if "listed" in case:
        tensors = [torch.randn(shape, device=device, dtype=dtype).view(-1) for shape in case["listed"]]
        strides = [sample_stride(t.numel(), DEFAULT_SAMPLE_SIZE) for t in tensors]

        def check_listed(found: object) -> list[str]:
            found = found.cpu().tolist()
            rows, at = [], len(tensors) * 6
            for index, (t, stride) in enumerate(zip(tensors, strides)):
                count = -(-t.numel() // stride)
                rows.append(found[index * 6:(index + 1) * 6] + found[at:at + count])
                at += count
            return [f"tensor {i}: {p}" for i, (row, t, s) in enumerate(zip(rows, tensors, strides))
                    for p in differences(row, reference_row(t, s, False), 6)]
        read = sum(t.numel() * t.element_size() for t in tensors)
        return (lambda: one_pass.SUMMARIZE(tensors, strides, False)), check_listed, read, tensors[0]
    x = spiked(case["shape"], dtype, device, case.get("last", False), case.get("units") == "dead")
    flat = flat_view(x)
    stride = sample_stride(flat.numel(), DEFAULT_SAMPLE_SIZE)
    layout = one_pass.channel_layout(x)
    units = {"dead": (1, *layout) if layout else (), "saturation": (2, 0.0, 0.97)}.get(case.get("units"), ())
    channels = layout if case.get("strengths") and layout else ()
    outliers = bool(case.get("outliers"))
    width = one_pass.row_width(outliers, bool(units))

    def check(found: object) -> list[str]:
        found = found.cpu().tolist()
        head = 10 if outliers else 6
        sample_count = -(-flat.numel() // stride)
        problems = differences(found[:head] + found[width:width + sample_count], reference_row(flat, stride, outliers),
                               head)
        if units:
            if units[0] == 1:
                dims = [d for d in range(x.dim()) if d != 1]
                wanted = float(((x != 0).sum(dim=dims) == 0).double().mean())
            else:
                wanted = float(((x.double() - units[1]).abs() > units[2]).double().mean())
            if abs(found[width - 1] - wanted) > 1e-9:
                problems.append(f"unit fraction {found[width - 1]!r}, expected {wanted!r}")
        if channels:
            magnitude = x[0].double().abs()
            wanted = torch.where(torch.isfinite(magnitude), magnitude, 0.0).flatten(1).mean(1).cpu()
            got = torch.tensor(found[width + sample_count:], dtype=torch.float64)
            if got.shape != wanted.shape or not torch.allclose(got, wanted, rtol=1e-9, atol=0.0):
                problems.append("channel strengths differ from sample 0's mean |x| per channel")
        return problems
    call = lambda: one_pass.SUMMARIZE([flat], [stride], outliers, list(units), list(channels))  # noqa: E731
    return call, check, flat.numel() * flat.element_size(), flat


def phase_kernels(out: Path) -> None:
    import torch

    from actviz.summaries import one_pass

    device = torch.device("cuda" if cuda() else "cpu")
    if not one_pass._takes_triton([torch.zeros(4, device=device)]):
        emit(out, "compile", "Triton body", f"not taken on {device} (no Triton, or TRITON_INTERPRET unset on the CPU)",
             "FAIL")
        return
    launches = Launches()
    emit(out, "compile", "kernels launched from Python", ", ".join(launches.names))
    repeat = 1 if SMOKE else 10
    for case in kernel_cases(16 if SMOKE else 1):
        label = f"{case['label']} {str(case['dtype']).split('.')[-1]}"
        launches.log.clear()
        launches.log.active = True
        try:
            call, check, read, plain = run_case(case, device)
            found = call()
            sync()
        except Exception as error:  # noqa: BLE001
            emit(out, "compile", label, first_line(error), "FAIL", trace=traceback.format_exc()[-3000:])
            continue
        finally:
            launches.log.active = False
        for record in launches.log:
            emit(out, "compile", f"{label}: {record['kernel']}", compile_facts(record), "ok")
        if not launches.log:
            emit(out, "compile", label, "no Triton launch: the eager body ran", "FAIL")
        problems = check(found)
        emit(out, "correct", label, "matches float64" if not problems else "; ".join(problems[:3]),
             "FAIL" if problems else "ok")
        op_ms = median_ms(call, repeat, warmup=0 if SMOKE else 2)  # the interpreter is slow: one call with --smoke
        sum_ms = median_ms(plain.sum, repeat)
        copy_ms = median_ms(plain.clone, repeat)
        plain_bytes = plain.numel() * plain.element_size()
        emit(out, "speed", label, f"{read / op_ms / 1e6:.0f} GB/s ({op_ms * 1e3:.0f} µs for {read / 1e6:.1f} MB); "
             f"x.sum() {plain_bytes / sum_ms / 1e6:.0f} GB/s, copy {2 * plain_bytes / copy_ms / 1e6:.0f} GB/s; "
             f"op / sum {op_ms / sum_ms * plain_bytes / read:.2f}", op_ms=op_ms, sum_ms=sum_ms, copy_ms=copy_ms,
             bytes=read)
    past_int32(out, device)


def past_int32(out: Path, device: object) -> None:
    """One bf16 tensor of 2**31 + 4099 elements (4.3 GB): 32-bit offsets would wrap. A toy size with --smoke."""
    import torch

    from actviz.options import DEFAULT_SAMPLE_SIZE
    from actviz.summaries import one_pass
    from actviz.summaries.one_tensor import sample_stride

    n = (1 << 31) + 4099 if not SMOKE else (1 << 16) + 4099
    label = f"{n:,} elements bf16" + (" (toy size: --smoke)" if SMOKE else "")
    try:
        x = torch.empty(n, device=device, dtype=torch.bfloat16)
        for start in range(0, n, 1 << 28):  # piece by piece: no float32 temporary of the whole
            stop = min(n, start + (1 << 28))
            x[start:stop] = (torch.arange(start, stop, device=device, dtype=torch.float32) % 1009 - 500).to(x.dtype)
        x[-1] = 700.0  # the largest value last: beyond 2**31
        stride = sample_stride(n, DEFAULT_SAMPLE_SIZE)
        found = one_pass.SUMMARIZE([x], [stride], True).cpu().tolist()
        problems = differences(found, reference_row(x, stride, True), 10)
        emit(out, "correct", label, "matches float64 (max 700 at the last element)" if not problems
             else "; ".join(problems[:3]), "FAIL" if problems else "ok")
    except Exception as error:  # noqa: BLE001
        emit(out, "correct", label, first_line(error), "FAIL", trace=traceback.format_exc()[-3000:])


# ----------------------------------------------------------------------------------------------------- step phases

def build(name: str, device: object) -> tuple[object, Callable[[object], object]]:
    """The model (random init, from its config) on ``device`` and its loss on one fixed batch; toy sizes with
    --smoke."""
    import torch

    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config() if not SMOKE else GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512,
                                                            n_positions=64)
        model = GPT2LMHeadModel(config)
        tokens = torch.randint(0, config.vocab_size, (1, 1024 if not SMOKE else 32), device=device)
        return model.to(device).train(), lambda m: m(tokens, labels=tokens).loss
    if SMOKE:  # a ResNet's first block at 16 channels: every output and parameter under the sample size
        from torch import nn

        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                              nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    else:
        import torchvision

        model = torchvision.models.resnet50()
    batch, size, classes = (64, 224, 1000) if not SMOKE else (2, 16, 10)
    inputs = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, classes, (batch,), device=device)
    return model.to(device).train(), lambda m: torch.nn.functional.cross_entropy(m(inputs), targets)


def phase_steps(out: Path, name: str) -> None:
    """Bare, idle (watched, logging nothing) and logging copies of one model, one step each in turn."""
    import torch

    import actviz

    device = torch.device("cuda" if cuda() else "cpu")
    bare, loss_of = build(name, device)
    copies = {"bare": bare, "idle": copy.deepcopy(bare), "logging": copy.deepcopy(bare)}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, foreach=True) for k, m in copies.items()}
    folder = tempfile.mkdtemp(prefix="check-gpu-")
    watchers = {"idle": actviz.watch(copies["idle"], os.path.join(folder, "idle"), every=10**6),
                "logging": actviz.watch(copies["logging"], os.path.join(folder, "logging"), every=1)}

    def step(kind: str) -> float:
        model, optimizer = copies[kind], optimizers[kind]
        sync()
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model)
        loss.backward()
        optimizer.step()
        sync()
        took = (time.perf_counter() - began) * 1e3
        if kind in watchers:
            watchers[kind].flush()  # outside the timed step: the writer thread's work
        return took

    first = step("logging")  # the first logging step: Triton compiles here (a cold cache per phase)
    step("idle")  # the idle copy's step 0 logs (0 % every == 0): out of the measured rounds
    rounds, warmup = (1, 0) if SMOKE else (8, 2)
    kinds = list(copies)
    for _ in range(warmup):
        for kind in kinds:
            step(kind)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for turn in range(rounds):
        for kind in kinds[turn % 3:] + kinds[:turn % 3]:
            times[kind].append(step(kind))
    for viz in watchers.values():
        viz.close()
    bare_ms, idle_ms, logging_ms = (statistics.median(times[kind]) for kind in kinds)
    what = f"{name if not SMOKE else name + ' (toy size)'}, bf16 autocast, medians of {rounds}"
    emit(out, "step", f"{what}: logging step / bare", f"{logging_ms / bare_ms:.2f}x ({logging_ms:.1f} ms against "
         f"{bare_ms:.1f} ms; goal <= 1.3x)", "ok" if logging_ms <= 1.3 * bare_ms or SMOKE else "WARN",
         ratio=logging_ms / bare_ms, bare_ms=bare_ms, logging_ms=logging_ms)
    emit(out, "step", f"{what}: idle step / bare", f"{idle_ms / bare_ms:.2f}x ({idle_ms:.1f} ms)",
         "ok" if idle_ms <= 1.05 * bare_ms or SMOKE else "WARN", ratio=idle_ms / bare_ms, idle_ms=idle_ms)
    emit(out, "step", f"{name}: first logging step (Triton compiles, cold cache)", f"{first:.0f} ms", first_ms=first)


def phase_tests(out: Path, limit: float) -> None:
    if not cuda():
        emit(out, "tests", "tests/test_cuda.py", "not run: no GPU", "info")
        return
    log = out / "pytest.log"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=max(10.0, limit - 5))
        log.write_text(done.stdout + done.stderr)
        last = next((line for line in reversed(done.stdout.splitlines()) if re.search(r"passed|failed|error", line)),
                    f"no summary line (rc {done.returncode})")
        emit(out, "tests", "pytest tests/test_cuda.py", last, "ok" if done.returncode == 0 else "FAIL")
    except subprocess.TimeoutExpired:
        emit(out, "tests", "pytest tests/test_cuda.py", f"stopped at {limit:.0f} s", "WARN")


def run_phase(out: Path, phase: str, limit: float) -> None:
    """One phase in this process, its actviz warnings counted."""
    with ActvizWarnings() as seen:
        if phase == "env":
            phase_env(out)
        elif phase == "kernels":
            phase_kernels(out)
        elif phase in ("resnet50", "gpt2"):
            phase_steps(out, phase)
        elif phase == "tests":
            phase_tests(out, limit)
    if phase != "tests":
        report_warnings(out, phase, seen)


# ------------------------------------------------------------------------------------------------------- the call

def table(out: Path) -> tuple[str, list[dict[str, object]]]:
    """The rows as one text table, by section."""
    rows = []
    if (out / ROWS_FILE).exists():
        rows = [json.loads(line) for line in (out / ROWS_FILE).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: SECTIONS.index(r["section"]) if r["section"] in SECTIONS else len(SECTIONS))
    width = min(64, max([len(r["item"]) for r in rows] + [4]))
    lines = [f"{'section':8s} | {'item':{width}s} | verdict | value", "-" * (width + 32)]
    for r in rows:
        item = r["item"] if len(r["item"]) <= width else r["item"][:width - 1] + "…"
        lines.append(f"{r['section']:8s} | {item:{width}s} | {r['verdict']:7s} | {r['value']}")
    fails = sum(r["verdict"] == "FAIL" for r in rows)
    lines.append(f"{len(rows)} rows: {fails} FAIL, {sum(r['verdict'] == 'WARN' for r in rows)} WARN")
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> int:
    global SMOKE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-logs", help="folder for the logs and the table "
                        "(default $OUT if set, else gpu-logs)")
    parser.add_argument("--budget", type=float, default=520.0, help="seconds for all phases (default 520)")
    parser.add_argument("--skip", default="", help="phases to leave out, comma-separated: " +
                        ", ".join(name for name, _ in PHASES))
    parser.add_argument("--smoke", action="store_true", help="the CPU at toy sizes, TRITON_INTERPRET=1, one process")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase in this process
    parser.add_argument("--limit", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    SMOKE = args.smoke
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.phase:  # the phases named, one after another in this process
        failed = 0
        for phase in args.phase.split(","):
            try:
                run_phase(out, phase, args.limit)
            except Exception as error:  # noqa: BLE001
                emit(out, "note", f"phase {phase} crashed", first_line(error), "FAIL",
                     trace=traceback.format_exc()[-3000:])
                traceback.print_exc()
                failed = 1
        return failed

    began = time.monotonic()
    (out / ROWS_FILE).write_text("")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if SMOKE:
        env.update(TRITON_INTERPRET="1", ACTVIZ_CPU_SHORTCUTS="0", CUDA_VISIBLE_DEVICES="")
    skipped = {name.strip() for name in args.skip.split(",") if name.strip()}
    plan = [(name, cap) for name, cap in PHASES if name not in skipped]
    with open(out / "check.log", "w") as log:
        groups = [[name for name, _ in plan]] if SMOKE else [[name] for name, _ in plan]
        caps = dict(plan)
        for group in groups:
            left = args.budget - (time.monotonic() - began)
            limit = min(sum(caps[name] for name in group), left - 5)
            if limit < 20:
                emit(out, "note", f"phases {', '.join(group)}", "not run: the budget is spent", "WARN")
                continue
            log.write(f"== {', '.join(group)} (up to {limit:.0f} s; {time.monotonic() - began:.0f} s gone)\n")
            log.flush()
            command = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--limit", str(limit), "--phase", ",".join(group)]
            cache = tempfile.mkdtemp(prefix="triton-cache-")  # cold: the first logging step compiles, as a user's does
            try:
                done = subprocess.run(command + ["--smoke"] * SMOKE, stdout=log, stderr=subprocess.STDOUT,
                                      env=dict(env, TRITON_CACHE_DIR=cache), cwd=ROOT, timeout=limit)
                if done.returncode != 0:
                    emit(out, "note", f"phases {', '.join(group)}", f"exited with {done.returncode} (see check.log)",
                         "FAIL")
            except subprocess.TimeoutExpired:
                emit(out, "note", f"phases {', '.join(group)}", f"stopped at their {limit:.0f} s cap", "FAIL")
    emit(out, "note", "wall time of this check", f"{time.monotonic() - began:.0f} s of a {args.budget:.0f} s budget")
    text, rows = table(out)
    (out / "table.txt").write_text(text + "\n")
    (out / "table.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print(text)
    return 1 if any(row["verdict"] == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
