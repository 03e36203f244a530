"""A paper model of a logging step on an H100 SXM, from actviz's compiled kernels and the bytes its ops move, no GPU.

1. **What a logging step runs.** A logging step of the model (``watch(every=1, image_every=1)``, everything on) runs
   on the CPU on the accelerator code path (``ACTVIZ_CPU_SHORTCUTS=0``) under bf16 autocast, and
   :class:`step_ops.StepOps` records each of actviz's ops: its bytes, and for ``actviz::summarize`` and
   ``actviz::logit_rows`` (the Triton kernels' ops) their sizes and flags. GPT-2 small (1 x 1,024 tokens) runs at
   its real size; ResNet-50 runs at batch 2 and 4 (224²) and every size that grows with the batch is extrapolated
   linearly to batch 64 (the two runs must dispatch the same ops in the same order).
2. **The bare step.** ResNet-50 at batch 64 on the ``meta`` device, in bf16 throughout (no memory, exact shapes);
   GPT-2 on the CPU under bf16 autocast, attention dropout off (so that its ``sdpa`` takes the flash kernel, which
   moves no ``T x T`` matrix, as a GPU's does with dropout; the CPU's math path would). Each op costs
   ``max(FLOPs / (peak x efficiency), bytes / bandwidth)`` plus a launch gap; FLOPs from
   ``torch.utils.flop_counter`` (flash attention: ``4*H*T²*d`` forward, ``10*H*T²*d`` backward).
3. **The kernels.** Each distinct variant the step launches is compiled for sm_90 through Triton's own JIT binder
   (``kernel.warmup`` at actviz's own call sites, a stand-in driver, ptxas from the Triton wheel: no GPU), and its
   SASS main loop is read with nvdisasm: static instructions per loop turn, the 64-bit division subroutines it
   calls (counted at their static size per call), the fp64 instructions, registers and shared memory. A launch
   costs the largest of:

   * the **bandwidth roofline**: bytes / bandwidth;
   * the **issue bound**: programs x warps x (loop turns x instructions per turn + the body's other instructions
     once) / (active SMs x clock x 4 warp-instructions per cycle), and the same for the loop's fp64 instructions
     at 2 per cycle (H100: 64 FP64 lanes per SM);
   * the **latency bound**: a resident block has at most ``stages`` turns' loads in flight (1 unless the kernel
     pipelines them with ``cp.async``), so it finishes at most that many turns per memory latency:
     turns x latency / (active SMs x resident blocks per SM x stages x clock);

   plus a launch gap. Not modelled: same-address atomics serializing in L2, tail effects, caches.
4. **The rest of actviz's ops** (eager torch ops: pictures, attention statistics, the step's copy to the host):
   bytes / bandwidth plus a launch gap each.

Idle step: a step that logs nothing runs no actviz op on the device (one root pre-hook on the host, about 18 µs):
its device time is the bare step's.

Usage::

    python scripts/gpu_step_model.py                     # both models: about 15 minutes on 2 cores
    python scripts/gpu_step_model.py --models gpt2 --json model.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("ACTVIZ_CPU_SHORTCUTS", "0")
os.environ.pop("TRITON_INTERPRET", None)

#: The card: an H100 SXM5 (NVIDIA's datasheet: 132 SMs, 1.755 GHz boost, 3.35 TB/s HBM3, 989 TFLOP/s dense bf16).
H100 = {"sms": 132, "clock_hz": 1.755e9, "bandwidth": 3.35e12, "bf16_flops": 989e12, "issue_per_cycle": 4,
        "fp64_per_cycle": 2, "registers_per_sm": 65536, "warps_per_sm": 64, "shared_per_sm": 228 * 1024}
#: Bare steps measured on a GPU, for a second denominator: an H200 (the same GH100 chip and clocks as an H100 SXM,
#: 4.8 TB/s instead of 3.35, so an H100's bare step takes at least as long), 2026-11-27, commit 50ee81b,
#: scripts/bench_gpu_step.py, bf16 autocast, median wall time (docs/performance.md, "On a GPU").
MEASURED_BARE_MS = {"resnet50": 31.4, "gpt2": 31.6}
#: What the model assumes beyond the datasheet (printed with the table).
ASSUMPTIONS = {
    "matmul_efficiency": 0.5,  # of dense bf16 peak for convolutions and matmuls in the bare step
    "launch_gap_s": 2e-6,  # device idle between two dependent kernels
    "memory_latency_cycles": 600,  # a global load's round trip, about 340 ns at 1.755 GHz
}


# ------------------------------------------------------------------------------------------------ pure functions

def op_time(flops: float, nbytes: float, card: dict = H100, assumptions: dict = ASSUMPTIONS) -> float:
    """Seconds for one eager op: ``max(FLOPs at the stated efficiency, bytes at full bandwidth)`` plus a launch gap.

    Example:
        >>> round(op_time(989e12 * 0.5 * 1e-3, 0) * 1e3, 3)  # 1 ms of matmul at half of peak, + 2 µs
        1.002
    """
    compute = flops / (card["bf16_flops"] * assumptions["matmul_efficiency"])
    return max(compute, nbytes / card["bandwidth"]) + assumptions["launch_gap_s"]


def resident_blocks(registers: int, warps: int, shared: int, card: dict = H100) -> int:
    """Blocks of ``warps`` warps one SM holds at once, by registers, warps and shared memory.

    Example:
        >>> resident_blocks(128, 8, 0), resident_blocks(64, 8, 0), resident_blocks(32, 4, 100_000)
        (2, 4, 2)
    """
    by_registers = card["registers_per_sm"] // max(1, registers * 32 * warps)
    by_warps = card["warps_per_sm"] // warps
    by_shared = card["shared_per_sm"] // shared if shared else by_warps
    return max(1, min(by_registers, by_warps, by_shared))


@dataclasses.dataclass
class Loop:
    """A kernel's main loop, from its SASS: per turn, per warp."""

    instructions: int  # static instructions of the loop body, subroutine calls at the subroutines' size
    fp64: int  # of them on the fp64 pipe (DADD, DMUL, DFMA, DSETP, F2F/I2F to or from 64 bits)
    calls: int  # subroutine calls (64-bit integer division and remainder)
    other: int = 0  # the kernel body's instructions outside the main loop: counted once a program


def launch_time(nbytes: float, grid: int, turns: float, warps: int, loop: Loop, blocks_per_sm: int,
                stages: int = 1, card: dict = H100, assumptions: dict = ASSUMPTIONS) -> dict[str, float]:
    """Seconds of one Triton launch by each bound, and the one that holds (their max, plus a launch gap).

    ``turns`` is the main-loop turns of one program (all programs alike), ``grid`` the programs, ``stages`` the
    turns whose loads are in flight at once (1: none pipelined).

    Example:
        >>> loop = Loop(instructions=100, fp64=10, calls=0)
        >>> t = launch_time(3.35e9, grid=1320, turns=32, warps=8, loop=loop, blocks_per_sm=2)
        >>> round(t["roofline"] * 1e3, 3), round(t["issue"] * 1e6, 2), round(t["latency"] * 1e6, 2)
        (1.0, 36.47, 54.7)
        >>> round(t["total"] * 1e3, 3)  # the roofline holds, + 2 µs
        1.002
    """
    clock = card["clock_hz"]
    active = min(grid, card["sms"])
    waves = grid * turns  # program-turns in all
    issue = grid * warps * (turns * loop.instructions + loop.other) / (active * clock * card["issue_per_cycle"])
    fp64 = grid * warps * turns * loop.fp64 / (active * clock * card["fp64_per_cycle"])
    resident = min(blocks_per_sm, math.ceil(grid / active))
    latency = waves * assumptions["memory_latency_cycles"] / (active * resident * max(1, stages) * clock)
    roofline = nbytes / card["bandwidth"]
    found = {"roofline": roofline, "issue": max(issue, fp64), "latency": latency}
    found["total"] = max(found.values()) + assumptions["launch_gap_s"]
    found["bound"] = max(("roofline", "issue", "latency"), key=lambda k: found[k])
    return found


INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+|\$__internal_\d+_\$__\w+|\w+):\s*$")
FP64 = ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "F2F.F64", "F2F.F32.F64", "I2F.F64", "F2I.F64", "DEPBAR_NONE")


def sass_loop(text: str) -> Loop | None:
    """The main loop of a kernel's own body (before its ``$__internal`` subroutines) in ``nvdisasm -c`` output:
    of the loops not inside another, the one with the most global loads and fp64 instructions; ``None`` if it
    has none.

    Example:
        >>> text = '''k:
        ...   /*0000*/ MOV R1, c[0x0][0x28] ;
        ... .L_x_0:
        ...   /*0010*/ DADD R2, R2, R4 ;
        ...   /*0020*/ CALL.REL.NOINC `($__internal_0_$__cuda_sm20_rem_s64) ;
        ...   /*0030*/ BRA `(.L_x_0) ;
        ...   /*0040*/ EXIT ;
        ... $__internal_0_$__cuda_sm20_rem_s64:
        ...   /*0050*/ IADD3 R0, R0, 1, RZ ;
        ...   /*0060*/ RET.REL.NODEC R20 `(k) ;'''
        >>> sass_loop(text)   # 3 in the loop + the 2-instruction subroutine per call; 2 outside it
        Loop(instructions=5, fp64=1, calls=1, other=2)
    """
    instructions, labels, subroutines, pending = [], {}, [], []
    for line in text.splitlines():
        match = LABEL.match(line.strip())
        if match:
            pending.append(match.group(1))
            continue
        match = INSTRUCTION.search(line)
        if match:
            for name in pending:
                labels[name] = len(instructions)
                if name.startswith("$__internal"):
                    subroutines.append((name, len(instructions)))
            pending = []
            instructions.append((match.group(3), match.group(4)))
    body_end = min([start for _, start in subroutines] + [len(instructions)])
    sizes = {}
    ordered = sorted(start for _, start in subroutines) + [len(instructions)]
    for name, start in subroutines:
        sizes[name.split("$__")[-1]] = ordered[ordered.index(start) + 1] - start
    loops = []
    for index, (op, rest) in enumerate(instructions[:body_end]):
        target = re.search(r"\(\s*(\.L_x_\d+)\s*\)", rest)
        if op.startswith("BRA") and target and labels.get(target.group(1), index + 1) <= index:
            loops.append((labels[target.group(1)], index))
    outermost = [(a, b) for a, b in loops if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in loops)]
    if not outermost:
        return None

    def weight(span: tuple[int, int]) -> tuple[int, int]:  # the loop over the data: the most loads and fp64
        body = instructions[span[0]:span[1] + 1]
        return sum(op.startswith(("LDG", "LDGSTS") + FP64) for op, _ in body), span[1] - span[0]

    start, stop = max(outermost, key=weight)
    body = instructions[start:stop + 1]
    calls = [re.sub(r"[`()\s]", "", rest).split("$__")[-1] for op, rest in body if op.startswith("CALL")]
    fp64 = sum(op.startswith(FP64) for op, _ in body)
    return Loop(len(body) + sum(sizes.get(name, 0) for name in calls), fp64, len(calls), body_end - len(body))


# -------------------------------------------------------------------------------------------- what a step runs

def _autocast() -> contextlib.AbstractContextManager:
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16)


def logging_ops(name: str, batch: int, smoke: bool) -> list:
    """actviz's ops in one logging step of ``name`` on the CPU (after one warm-up step), as step_ops.Op rows."""
    import torch

    import actviz
    from step_ops import StepOps

    model, loss_of = build(name, batch, torch.device("cpu"), smoke)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
    viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=1)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with _autocast():
            loss = loss_of(model)
        loss.backward()
        optimizer.step()
        viz.flush()

    try:
        step()
        with StepOps() as ops:
            step()
    finally:
        viz.close()
    return [op for op in ops.ops if op.owner == "actviz"]


def build(name: str, batch: int, device: object, smoke: bool, dtype: object = None,
          attention_dropout: bool = True) -> tuple[object, object]:
    """The model (random init, from its config) and its loss on one fixed batch; in ``dtype`` throughout if given."""
    import torch

    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        sizes = {} if not smoke else {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512}
        config = GPT2Config(**sizes, **({} if attention_dropout else {"attn_pdrop": 0.0}))
        model = GPT2LMHeadModel(config).to(device=device, dtype=dtype).train()
        tokens = torch.randint(0, config.vocab_size, (batch, 1024 if not smoke else 64), device=device)
        return model, lambda m: m(tokens, labels=tokens).loss
    import torchvision

    model = (torchvision.models.resnet50() if not smoke else torchvision.models.resnet18(num_classes=10))
    side, classes = (224, 1000) if not smoke else (32, 10)
    inputs = torch.randn(batch, 3, side, side, device=device, dtype=dtype)
    targets = torch.randint(0, classes, (batch,), device=device)
    return model.to(device=device, dtype=dtype).train(), lambda m: torch.nn.functional.cross_entropy(m(inputs), targets)


def extrapolate(small: list, large: list, batches: tuple[int, int], target: int) -> list:
    """actviz's ops at batch ``target`` from the same step at two batches: every byte count and one-pass size
    linear in the batch. Raises where the two steps dispatched different ops."""
    if [op.name for op in small] != [op.name for op in large]:
        raise RuntimeError(f"batches {batches} dispatched different actviz ops ({len(small)} and {len(large)}): "
                           "no linear extrapolation")
    (b1, b2), found = batches, []

    def line(v1: int, v2: int) -> int:
        return max(0, round(v1 + (v2 - v1) * (target - b1) / (b2 - b1)))

    for one, two in zip(small, large):
        call = one.call
        if call and call[0] == "summarize":
            sizes = tuple((line(n1, n2), dtype) for (n1, dtype), (n2, _) in zip(call[1], two.call[1]))
            call = ("summarize", sizes, *call[2:])
        elif call and call[0] == "logit_rows":
            call = ("logit_rows", (line(call[1][0], two.call[1][0]), call[1][1]), call[2])
        found.append(dataclasses.replace(one, read=line(one.read, two.read), written=line(one.written, two.written),
                                         call=call))
    return found


#: Flash attention's FLOPs per ``B*H*T*S*d`` (the CPU's flash kernel, which the GPU's replaces; forward: two matmuls;
#: backward: five, the scores recomputed).
FLASH = {"aten._scaled_dot_product_flash_attention_for_cpu.default": 4,
         "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": 10}


def bare_ops(name: str, batch: int, smoke: bool) -> list:
    """The bare step's ops at the real size: a CNN on the meta device in bf16 throughout (no memory); GPT-2 on the
    CPU under bf16 autocast, so that ``sdpa`` takes the flash kernel (the meta device takes the math one, which
    materializes ``T x T``)."""
    import torch

    from step_ops import StepOps

    meta = name != "gpt2"
    device = torch.device("meta" if meta else "cpu")
    # GPT-2 without attention dropout: the CPU's sdpa then takes its flash kernel, which moves no T x T matrix, as a
    # GPU's flash kernel does with dropout; with dropout the CPU takes the math path and materializes them.
    model, loss_of = build(name, batch, device, smoke, torch.bfloat16 if meta else None, attention_dropout=meta)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with _autocast() if not meta else contextlib.nullcontext():
            loss = loss_of(model)
        loss.backward()
        optimizer.step()

    step()
    with StepOps() as ops:
        step()
    for op in ops.ops:
        if op.name in FLASH and op.call:
            (b, h, t, d), (_, _, s, _) = op.call[1], op.call[2]
            op.flops = FLASH[op.name] * b * h * t * s * d
    return ops.ops


# ----------------------------------------------------------------------------------------- compiled, no GPU

class StandInDriver:
    """What Triton's ``JITFunction.run(warmup=True)`` asks of a driver: the target, device 0, stream 0."""

    def __init__(self, target: object) -> None:
        self.target = target

    def get_current_target(self) -> object:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: object = None) -> int:
        return 0

    def get_active_torch_device(self) -> object:
        import torch

        return torch.device("cpu")


class Compiler:
    """Compiles the Triton launches of actviz's one-pass calls for ``sm_{arch}`` at actviz's own call sites: each
    launched kernel's ``kernel[grid](...)`` becomes ``kernel.warmup(...)``, so the JIT binder specializes the real
    arguments (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16) as a launch on a GPU would."""

    def __init__(self, arch: int = 90) -> None:
        import inspect

        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
        from triton.runtime import driver

        driver.set_active(StandInDriver(GPUTarget("cuda", arch, 32)))
        from actviz.statistics import logit_rows_triton
        from actviz.summaries import one_pass_triton

        self.ptxas = get_ptxas(arch).path
        self.nvdisasm = os.path.join(os.path.dirname(self.ptxas), "nvdisasm")
        self.gpu_name = sm_arch_from_capability(arch)
        self.modules = (one_pass_triton, logit_rows_triton)
        self.launches: list[dict] = []
        self.facts: dict[str, dict] = {}  # by compiled kernel hash
        for module in self.modules:
            source = inspect.getsource(module)
            for name, value in list(vars(module).items()):
                if isinstance(value, triton.runtime.jit.KernelInterface) and re.search(rf"\b{name}\[", source):
                    setattr(module, name, _WarmUp(value, name, self.launches))

    def compile_call(self, call: tuple) -> list[dict]:
        """The launches of one ``summarize`` or ``logit_rows`` call, compiled (tensors of its sizes on the CPU)."""
        import torch

        from actviz.summaries.one_pass import OUTLIER_THRESHOLD, row_width

        one_pass_triton, logit_rows_triton = self.modules
        del self.launches[:]
        if call[0] == "logit_rows":
            logit_rows_triton.logit_rows(torch.empty(call[1], dtype=getattr(torch, call[2])))
        else:
            _, sizes, strides, outliers, units, channels = call
            tensors = [torch.empty(n, dtype=getattr(torch, dtype)) for n, dtype in sizes]
            one_pass_triton.summarize_tensors(tensors, strides, row_width(outliers, bool(units)), OUTLIER_THRESHOLD,
                                              outliers, units, channels)
        found = list(self.launches)
        for launch in found:
            launch["facts"] = self.facts_of(launch["compiled"])
        return found

    def facts_of(self, compiled: object) -> dict:
        key = compiled.hash
        if key not in self.facts:
            with tempfile.TemporaryDirectory() as folder:
                ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
                with open(ptx, "w") as out:
                    out.write(compiled.asm["ptx"])
                with open(cubin, "wb") as out:
                    out.write(compiled.asm["cubin"])
                verbose = subprocess.run([self.ptxas, "-v", f"--gpu-name={self.gpu_name}", ptx, "-o",
                                          os.path.join(folder, "k.o")], capture_output=True, text=True)
                sass = subprocess.run([self.nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
            log = verbose.stderr + verbose.stdout
            registers = re.search(r"Used (\d+) registers", log)
            spills = re.search(r"(\d+) bytes spill stores", log)
            self.facts[key] = {
                "name": compiled.metadata.name, "warps": compiled.metadata.num_warps,
                "shared": compiled.metadata.shared, "registers": int(registers.group(1)) if registers else 255,
                "spills": int(spills.group(1)) if spills else None, "loop": sass_loop(sass),
                "pipelined": "async_copy" in compiled.asm.get("ttgir", ""),
                "stages": compiled.metadata.num_stages,
            }
        return self.facts[key]


class _WarmUp:
    def __init__(self, kernel: object, name: str, launches: list[dict]) -> None:
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid: tuple) -> object:
        def warm(*args: object, **kwargs: object) -> object:
            compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            self.launches.append({"kernel": self.name, "grid": int(grid[0]), "constants": {
                k: v for k, v in kwargs.items() if isinstance(v, (int, bool))}, "compiled": compiled})
            return compiled
        return warm

    def __getattr__(self, name: str) -> object:
        return getattr(self.kernel, name)


def trips(kernel: str, call: tuple, grid: int, constants: dict) -> tuple[float, float]:
    """``(main-loop turns of one program, float64 partials a tile leaves)`` of a launch, from the call's sizes and
    the launch's constants, for the kernels of actviz.summaries.one_pass_triton and logit_rows_triton.

    Example:
        >>> trips("_tile_partials", ("summarize", ((100_000, "bfloat16"),)), 4, {"BLOCK": 1024})  # 24.4 turns a tile
        (24.4140625, 0)
        >>> trips("_combine_tiles", ("summarize", ((100_000, "bfloat16"),)), 1, {"TILES": 64, "WIDE": 12})  # 4 tiles
        (1, 12)
    """
    if kernel == "_row_kernel":
        return math.ceil(call[1][1] / constants.get("BLOCK", 1024)), 0
    sizes = [n for n, _ in call[1]]
    tile = constants.get("TILE", 32 * 1024)
    if kernel == "_combine_tiles":  # one program per tensor walks its tiles, TILES a turn (one, before it had TILES)
        tiles = max(math.ceil(n / tile) for n in sizes)
        return math.ceil(tiles / constants.get("TILES", 1)), constants.get("WIDE", 11)
    if "TURNS" in constants:  # a fixed trip count
        return constants["TURNS"], 0
    return sum(sizes) / (grid * constants.get("BLOCK", 1024)), 0


def call_launch_times(call: tuple, read: int, written: int, launches: list[dict]) -> list[dict]:
    """Each launch of one call, with its bytes, trip counts and bounds (:func:`launch_time`): the call's bytes go to
    its first launch (the one that reads the tensors); a combine reads its tiles' partials."""
    rows = []
    for index, launch in enumerate(launches):
        facts, name, grid, constants = launch["facts"], launch["kernel"], launch["grid"], launch["constants"]
        turns, wide = trips(name, call, grid, constants)
        if name == "_combine_tiles":
            nbytes = sum(math.ceil(n / constants.get("TILE", 32 * 1024)) for n, _ in call[1]) * wide * 8
        else:
            nbytes = read + written if index == 0 else 0
        loop = facts["loop"] or Loop(0, 0, 0)
        blocks = resident_blocks(facts["registers"], facts["warps"], facts["shared"])
        stages = constants.get("STAGES", facts["stages"]) if facts["pipelined"] else 1
        times = launch_time(nbytes, grid, turns, facts["warps"], loop, blocks, stages)
        rows.append({"kernel": name, "grid": grid, "turns": turns, "bytes": nbytes, "blocks_per_sm": blocks,
                     **{k: facts[k] for k in ("registers", "spills", "shared", "warps", "pipelined")},
                     "loop_instructions": loop.instructions, "loop_other": loop.other, "loop_fp64": loop.fp64,
                     "loop_calls": loop.calls, **times})
    return rows


# ---------------------------------------------------------------------------------------------------- the model

def model_step(name: str, compiler: Compiler, smoke: bool) -> dict:
    """Bare, idle and logging step seconds of one model on the card, with the pieces."""
    began = time.perf_counter()
    if name == "gpt2":
        ours = logging_ops("gpt2", 1, smoke)
        batch, scaled = 1, "real size"
    else:
        batch = 64 if not smoke else 8
        ours = extrapolate(logging_ops(name, 2, smoke), logging_ops(name, 4, smoke),
                           (2, 4), batch)
        scaled = "extrapolated from batches 2 and 4"
    bare = bare_ops(name, batch, smoke)
    bare_s = sum(op_time(op.flops, op.read + op.written) for op in bare)
    launches, eager_s, kernel_s, kernel_bytes, eager_bytes, kernel_launches = [], 0.0, 0.0, 0, 0, 0
    for op in ours:
        if op.call and op.call[0] in ("summarize", "logit_rows"):
            rows = call_launch_times(op.call, op.read, op.written, compiler.compile_call(op.call))
            launches.extend(rows)
            kernel_s += sum(row["total"] for row in rows)
            kernel_bytes += op.read + op.written
            kernel_launches += len(rows)
        else:
            eager_s += op_time(0, op.read + op.written)
            eager_bytes += op.read + op.written
    logging_s = bare_s + kernel_s + eager_s
    return {
        "model": name, "batch": batch, "actviz_ops": scaled, "bare_ops": len(bare),
        "bare_flops": sum(op.flops for op in bare), "bare_bytes": sum(op.read + op.written for op in bare),
        "bare_s": bare_s, "idle_s": bare_s, "logging_s": logging_s, "kernel_s": kernel_s, "eager_s": eager_s,
        "kernel_launches": kernel_launches, "eager_ops": len(ours) - sum(1 for op in ours if op.call and op.call[0] in (
            "summarize", "logit_rows")), "kernel_bytes": kernel_bytes, "eager_bytes": eager_bytes,
        "roofline_kernel_s": sum(row["roofline"] for row in launches),
        "by_bound": dict(collections.Counter(row["bound"] for row in launches)),
        "launches": launches, "seconds_to_model": time.perf_counter() - began,
    }


def variants_table(launches: list[dict]) -> list[str]:
    """One line per distinct compiled kernel: its facts and the time all its launches take, by bound."""
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for row in launches:
        groups[(row["kernel"], row["registers"], row["loop_instructions"], row["loop_calls"], row["warps"])].append(row)
    lines = [f"  {'kernel':15s} {'regs':>4s} {'warps':>5s} {'blocks/SM':>9s} {'loop instr':>10s} {'calls':>5s} "
             f"{'fp64':>4s} {'launches':>8s} {'GB':>6s} {'roofline ms':>11s} {'modelled ms':>11s}  bound"]
    for (kernel, regs, instructions, calls, warps), rows in sorted(groups.items(), key=lambda kv: -sum(
            r["total"] for r in kv[1])):
        bounds = collections.Counter(r["bound"] for r in rows).most_common(1)[0][0]
        lines.append(f"  {kernel:15s} {regs:4d} {warps:5d} {rows[0]['blocks_per_sm']:9d} {instructions:10d} {calls:5d} "
                     f"{rows[0]['loop_fp64']:4d} {len(rows):8d} {sum(r['bytes'] for r in rows) / 1e9:6.2f} "
                     f"{sum(r['roofline'] for r in rows) * 1e3:11.2f} {sum(r['total'] for r in rows) * 1e3:11.2f}  {bounds}")
    return lines


def measured_ratio(result: dict) -> str:
    """The logging step over a bare step measured on a GPU: ``(measured + actviz's modelled time) / measured``.

    Example:
        >>> measured_ratio({"model": "resnet50", "kernel_s": 0.004, "eager_s": 0.0006, "batch": 64})
        '1.15x'
    """
    measured = MEASURED_BARE_MS.get(result["model"]) if result.get("batch") in (1, 64) else None
    if measured is None:
        return "-"
    return f"{(measured + (result['kernel_s'] + result['eager_s']) * 1e3) / measured:.2f}x"


def report(results: list[dict], commit: str) -> str:
    lines = [f"actviz logging step on an H100 SXM, a paper model (scripts/gpu_step_model.py, commit {commit})",
             "card: " + ", ".join(f"{k} {v:g}" for k, v in H100.items()),
             "assumed: " + ", ".join(f"{k} {v:g}" for k, v in ASSUMPTIONS.items()),
             "bare step: per op max(FLOPs / (bf16 peak x matmul_efficiency), bytes / bandwidth) + launch gap; Triton "
             "kernels: max(roofline, issue, latency) + launch gap; other actviz ops: roofline + launch gap", ""]
    lines.append(f"{'model':28s} {'bare ms':>8s} {'TFLOP':>6s} {'GB':>6s} {'actviz kernels ms':>17s} "
                 f"{'(roofline)':>10s} {'eager ops ms':>12s} {'logging ms':>10s} {'logging/bare':>12s} {'idle/bare':>9s} "
                 f"{'logging/measured bare':>21s}")
    for r in results:
        what = f"{r['model']} b{r['batch']} bf16" if r["model"] != "gpt2" else "gpt2 small 1x1024 bf16"
        lines.append(f"{what:28s} {r['bare_s'] * 1e3:8.2f} {r['bare_flops'] / 1e12:6.2f} {r['bare_bytes'] / 1e9:6.1f} "
                     f"{r['kernel_s'] * 1e3:17.2f} {r['roofline_kernel_s'] * 1e3:10.2f} {r['eager_s'] * 1e3:12.2f} "
                     f"{r['logging_s'] * 1e3:10.2f} {r['logging_s'] / r['bare_s']:11.2f}x {r['idle_s'] / r['bare_s']:8.2f}x "
                     f"{measured_ratio(r):>21s}")
    lines.append("logging/measured bare: (a measured H200 bare step + actviz's modelled ms) / that bare step; "
                 f"bare steps measured: {MEASURED_BARE_MS} ms (H200, commit 50ee81b)")
    for r in results:
        lines += ["", f"{r['model']}: {r['kernel_launches']} Triton launches moving {r['kernel_bytes'] / 1e9:.2f} GB "
                  f"(bounds: {r['by_bound']}), {r['eager_ops']} other actviz ops moving {r['eager_bytes'] / 1e9:.2f} GB; "
                  f"bare step {r['bare_ops']} ops; actviz's ops {r['actviz_ops']}"]
        lines += variants_table(r["launches"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--models", default="resnet50,gpt2", help="resnet50, gpt2 or both (default)")
    parser.add_argument("--arch", type=int, default=90, help="the compile target, sm_ARCH (default 90)")
    parser.add_argument("--smoke", action="store_true", help="toy models (resnet18 at 32², a 2-layer GPT-2)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    compiler = Compiler(args.arch)
    results = [model_step(name, compiler, args.smoke) for name in args.models.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    print(report(results, commit))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"card": H100, "assumptions": ASSUMPTIONS, "commit": commit, "results": results}, out, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
