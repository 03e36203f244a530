"""Every Triton kernel variant actviz launches compiles for sm_80 and sm_90, with no GPU, into code that can reach
bandwidth: no register spills, shared memory within the card's, no 64-bit division or remainder in a loop, only
relaxed atomics, and no loop that adds to global memory atomically per element (tests/kernel_variants.py, in a
fresh process: Triton's driver is process-wide). The quick lane compiles three launches for sm_90; the slow set
compiles them all for both targets.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def _ptxas_missing() -> str:
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        if not os.path.exists(get_ptxas(90).path):
            return "the Triton wheel has no ptxas"
    except Exception as error:  # noqa: BLE001 - no NVIDIA backend in this Triton
        return f"Triton's NVIDIA backend is missing ({type(error).__name__})"
    return ""


needs_ptxas = pytest.mark.skipif(bool(_ptxas_missing()), reason=_ptxas_missing() or "ptxas present")


def _start(arch: int, quick: bool) -> subprocess.Popen:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    command = [sys.executable, str(TESTS / "kernel_variants.py"), "--arch", str(arch)] + (["--quick"] if quick else [])
    return subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _compiled(arches: tuple[int, ...], quick: bool) -> list[dict]:
    """Every variant for ``arches``, one process per target, side by side, each with a hard timeout."""
    running = [_start(arch, quick) for arch in arches]
    found = []
    try:
        for process in running:
            out, err = process.communicate(timeout=600)
            assert process.returncode == 0, err[-3000:]
            found += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
    return found


def _check(found: list[dict], kernels: set[str]) -> None:
    from kernel_variants import problems

    wrong = [problem for variant in found for problem in problems(variant)]
    assert wrong == [], "\n".join(wrong)
    assert {variant["kernel"] for variant in found} == kernels


@needs_ptxas
def test_three_launches_compile_for_sm90_without_spills_divisions_or_ordered_atomics():
    found = _compiled((90,), quick=True)
    _check(found, {"_tile_partials", "_combine_tiles", "_row_kernel"})
    strengths = next(v for v in found if v["kernel"] == "_tile_partials" and "strengths" in v["label"])
    assert "atom.global.gpu.relaxed.add.f64" in strengths["atomics"]  # the strength sums: relaxed, per block


@needs_ptxas
def test_every_variant_compiles_for_sm80_and_sm90_without_spills_divisions_or_ordered_atomics():
    found = _compiled((80, 90), quick=False)
    _check(found, {"_tile_partials", "_combine_tiles", "_row_kernel"})
    for arch in (80, 90):
        tiles = [v for v in found if v["arch"] == arch and v["kernel"] == "_tile_partials"]
        assert len(tiles) >= 40, len(tiles)  # 4 dtypes x 10 launches and the range of bins, each its own variant
        assert any("(4096)" in v["label"] for v in tiles)  # the most bins a tile counts in


def test_float8_takes_the_eager_body_which_the_compile_test_leaves_out():
    from actviz.summaries import one_pass

    values = torch.zeros(8, dtype=torch.float8_e4m3fn)
    assert values.dtype not in one_pass.TRITON_DTYPES and not one_pass._takes_triton([values])
