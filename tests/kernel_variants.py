"""Every Triton kernel variant actviz launches, compiled for a GPU with no GPU, and what its code costs.

Run as a script (tests/test_kernel_compile.py runs it in a fresh process, Triton's driver being process-wide):
``python tests/kernel_variants.py --arch 90 [--quick]`` prints one JSON object per compiled variant. Each
variant comes from actviz's own launch code (:func:`~actviz.summaries.one_pass_triton.summarize_tensors`,
:func:`~actviz.statistics.logit_rows_triton.logit_rows`) with the launches (``kernel[grid](...)``) replaced by
``kernel.warmup(...)``: Triton's own binder specializes the arguments as on a GPU, and a stand-in driver names
the target, so the kernel goes through Triton's compiler and the ptxas of the Triton wheel. For each: registers,
spills and the stack (``ptxas -v``), shared memory, and, from the PTX, the 64-bit divisions and remainders in
any loop, the atomics that are not relaxed, and the loops that both load from global memory and add to it
atomically (an atomic per element).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

#: Shared memory a block can have (bytes): sm_80 (A100) 163 KiB, sm_90 (H100) 227 KiB.
SHARED_LIMITS = {80: 163 * 1024, 90: 227 * 1024}
DIVISIONS = re.compile(r"\b(div|rem)\.[su]64\b")
LABEL = re.compile(r"^\s*(\$L__\w+):")
BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
GLOBAL_ATOMIC = re.compile(r"\b(atom|red)(\.\w+)*\.global\b|\b(atom|red)\.global")
ATOMIC = re.compile(r"^\s*(@!?%p\d+\s+)?((atom|red)\.[\w.]+)")
GLOBAL_LOAD = re.compile(r"\bld\.global\b|\bcp\.async\.\w+\.shared\.global\b")


def loops(ptx: list[str]) -> list[tuple[int, int]]:
    """``(first, last)`` line of each loop: a label and a branch back to it."""
    labels, found = {}, []
    for index, line in enumerate(ptx):
        match = LABEL.match(line)
        if match:
            labels[match.group(1)] = index
        match = BRANCH.search(line)
        if match and match.group(1) in labels:
            found.append((labels[match.group(1)], index))
    return found


def read_ptx(text: str) -> dict:
    """The loops' 64-bit divisions, the atomics that are not relaxed, and the atomics a loop makes per element."""
    lines = text.splitlines()
    found = loops(lines)
    divisions, per_element = [], []
    for first, last in found:
        body = lines[first:last + 1]
        divisions += [line.strip() for line in body if DIVISIONS.search(line)]
        nested = [(a, b) for a, b in found if first < a and b <= last and (a, b) != (first, last)]
        own = [line for index, line in enumerate(lines[first:last + 1], first)
               if not any(a <= index <= b for a, b in nested)]
        if any(GLOBAL_LOAD.search(line) for line in own) and any(GLOBAL_ATOMIC.search(line) for line in own):
            per_element.append(f"lines {first}-{last}")
    atomics = [match.group(2) for match in map(ATOMIC.match, lines) if match]
    ordered = [name for name in atomics if ".relaxed" not in name]
    return {"loops": len(found), "loop_divisions": sorted(set(divisions)), "ordered_atomics": sorted(set(ordered)),
            "per_element_atomics": per_element, "atomics": sorted(set(atomics))}


def ptxas_verbose(ptx: str, arch: int) -> dict:
    """Registers, spill bytes and stack frame of the kernel, from the wheel's ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", source,
                               "-o", os.path.join(folder, "kernel.o")], capture_output=True, text=True, timeout=120)
    log = done.stderr + done.stdout
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"ptxas_rc": done.returncode, "registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else None,
            "stack": int(stack.group(1)) if stack else None}


def launches(quick: bool):
    """``(label, call)``: actviz's launch code for each kind of tensor it summarizes, on small CPU tensors (the
    constants a variant compiles with come from the dtypes, the flags and the channel layout, not the size)."""
    import torch

    from actviz.statistics import logit_rows_triton
    from actviz.summaries import one_pass_triton
    from actviz.summaries.one_pass import OUTLIER_THRESHOLD, row_width

    def summarize(tensors, outliers=False, units=(), channels=()):
        strides = tuple(max(1, tensor.numel() // 7) for tensor in tensors)
        width = row_width(outliers, bool(units))
        return lambda: one_pass_triton.summarize_tensors(tensors, strides, width, OUTLIER_THRESHOLD, outliers,
                                                         tuple(units), tuple(channels))

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    if quick:
        values = torch.zeros(4096, dtype=torch.bfloat16)
        yield "bf16 NCHW dead channels and strengths (256x56x56)", summarize([values], False, (1, 256, 3136, 0), (256, 3136, 0))
        yield "fp32 listed parameters", summarize([torch.zeros(300), torch.zeros(70)])
        yield "bf16 logit rows", lambda: logit_rows_triton.logit_rows(torch.zeros(4, 1000, dtype=torch.bfloat16))
        return
    for dtype, name in names.items():
        values = torch.zeros(4096, dtype=dtype)
        yield f"{name} plain", summarize([values])
        yield f"{name} outliers", summarize([values], True)
        yield f"{name} saturation", summarize([values], False, (2, 0.0, 0.97))
        yield f"{name} NCHW dead channels and strengths (256x56x56)", summarize([values], False, (1, 256, 3136, 0), (256, 3136, 0))
        yield f"{name} NHWC dead channels and strengths (256x56x56)", summarize([values], False, (1, 256, 1, 1), (256, 3136, 1))
        yield f"{name} NCHW strengths and outliers (2048x7x7)", summarize([values], True, (), (2048, 49, 0))
        yield f"{name} NHWC dead channels, the most bins (4096)", summarize([values], False, (1, 4096, 1, 1))
        yield f"{name} listed parameters", summarize([torch.zeros(300, dtype=dtype), torch.zeros(70, dtype=dtype)])
        yield f"{name} listed, not 16-byte aligned", summarize([torch.zeros(301, dtype=dtype)[1:], torch.zeros(70, dtype=dtype)])
        yield f"{name} one tensor, not 16-byte aligned", summarize([torch.zeros(4097, dtype=dtype)[1:]])
    for channels in (40, 100, 200, 500, 1000, 2000):  # 64 to 2048 bins, a bin per channel (channels last)
        yield f"bf16 NHWC dead channels, {channels} channels", summarize([torch.zeros(4096, dtype=torch.bfloat16)], False,
                                                                        (1, channels, 1, 1))
    yield "bf16 dead channels, a bin per row (300x200)", summarize([torch.zeros(4096, dtype=torch.bfloat16)], False, (1, 300, 200, 0))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        yield f"{names[dtype]} logit rows", lambda dtype=dtype: logit_rows_triton.logit_rows(torch.zeros(4, 1000, dtype=dtype))


class _Recorder:
    """Stands for a kernel at its launch site: ``kernel[grid](*args)`` compiles it instead of running it."""

    def __init__(self, kernel, name: str, compiled: list):
        self.kernel, self.name, self.compiled = kernel, name, compiled

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.compiled.append((self.name, self.kernel.warmup(*args, grid=grid, **options)))
        return launch


def compile_all(arch: int, quick: bool, only: str = "") -> list[dict]:
    """Each distinct variant compiled for ``arch``, read (see the module docstring)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StandInDriver:  # what JITFunction.warmup asks of a driver
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return arch  # a device number per target: Triton keeps its compiled kernels per device

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(StandInDriver())
    from actviz.statistics import logit_rows_triton
    from actviz.summaries import one_pass_triton

    kernels = {(one_pass_triton, "_tile_partials"), (one_pass_triton, "_combine_tiles"), (logit_rows_triton, "_row_kernel")}
    results, seen = [], set()
    for label, call in launches(quick):
        if only not in label:
            continue
        compiled: list = []
        saved = {(module, name): getattr(module, name) for module, name in kernels}
        for module, name in kernels:
            setattr(module, name, _Recorder(saved[module, name], name, compiled))
        try:
            call()
        except Exception as error:  # noqa: BLE001 - a variant that does not compile is a finding
            results.append({"label": label, "arch": arch, "error": f"{type(error).__name__}: {str(error)[:2000]}"})
            continue
        finally:
            for (module, name), kernel in saved.items():
                setattr(module, name, kernel)
        for name, kernel in compiled:
            if kernel.hash in seen:
                continue
            seen.add(kernel.hash)
            found = {"label": label, "kernel": name, "arch": arch, "shared": kernel.metadata.shared,
                     "shared_limit": SHARED_LIMITS[arch], "warps": kernel.metadata.num_warps}
            found.update(ptxas_verbose(kernel.asm["ptx"], arch))
            found.update(read_ptx(kernel.asm["ptx"]))
            results.append(found)
    return results


def problems(found: dict) -> list[str]:
    """What is wrong with one compiled variant, in words; nothing if it is fine."""
    where = f"{found.get('kernel', '')} {found['label']} sm_{found['arch']}"
    if "error" in found:
        return [f"{where}: does not compile: {found['error'][:400]}"]
    wrong = []
    if found["ptxas_rc"] != 0 or found["registers"] is None:
        wrong.append(f"{where}: ptxas failed")
    if found["spill_bytes"]:
        wrong.append(f"{where}: {found['spill_bytes']} bytes of register spills")
    if found["shared"] > found["shared_limit"]:
        wrong.append(f"{where}: {found['shared']} bytes of shared memory, over the card's {found['shared_limit']}")
    if found["loop_divisions"]:
        wrong.append(f"{where}: 64-bit division or remainder in a loop: {found['loop_divisions'][:3]}")
    if found["ordered_atomics"]:
        wrong.append(f"{where}: atomics that are not relaxed: {found['ordered_atomics']}")
    if found["per_element_atomics"]:
        wrong.append(f"{where}: a loop that loads and adds atomically to global memory: {found['per_element_atomics']}")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMITS))
    parser.add_argument("--quick", action="store_true", help="three launches instead of all")
    parser.add_argument("--only", default="", help="the launches whose label holds this")
    options = parser.parse_args()
    for found in compile_all(options.arch, options.quick, options.only):
        print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
