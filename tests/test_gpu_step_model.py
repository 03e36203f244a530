"""scripts/gpu_step_model.py, the paper model of a logging step on an H100: its pure functions against numbers worked
out by hand, and its command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_step_model as model  # noqa: E402
from step_ops import Op  # noqa: E402


def test_an_eager_op_costs_the_larger_of_its_compute_and_its_bytes_plus_a_launch_gap():
    # 1 GFLOP at 494.5 TFLOP/s is 2.02 µs; 33.5 MB at 3.35 TB/s is 10 µs: the bytes hold, + 2 µs
    assert model.op_time(1e9, 33.5e6) == pytest.approx(12e-6)
    # 1 TFLOP: 2.022 ms of compute against 1 µs of bytes
    assert model.op_time(1e12, 3.35e6) == pytest.approx(1e12 / 494.5e12 + 2e-6)


def test_resident_blocks_take_the_tightest_of_registers_warps_and_shared_memory():
    assert model.resident_blocks(255, 8, 0) == 1  # 65,536 / (255 * 256) = 1.004
    assert model.resident_blocks(40, 4, 0) == 12  # 65,536 / 5,120 = 12.8; warps allow 16
    assert model.resident_blocks(16, 4, 0) == 16  # registers allow 32; 64 warps / 4
    assert model.resident_blocks(32, 4, 60_000) == 3  # 233,472 / 60,000 = 3.9


def test_a_launch_is_held_by_its_largest_bound():
    loop = model.Loop(instructions=900, fp64=20, calls=8)
    # 2,000 programs of 32 turns of 8 warps: 512,000 warp-turns x 900 / (132 x 1.755e9 x 4) = 497.3 µs of issue;
    # fp64: 512,000 x 20 / (132 x 1.755e9 x 2) = 22.1 µs; latency: 64,000 turns x 600 / (132 x 2 x 1.755e9) = 82.9 µs;
    # bytes: 131 MB / 3.35 TB/s = 39.1 µs
    times = model.launch_time(131e6, grid=2000, turns=32, warps=8, loop=loop, blocks_per_sm=2)
    assert times["issue"] == pytest.approx(497.3e-6, rel=1e-3)
    assert times["latency"] == pytest.approx(82.9e-6, rel=1e-3)
    assert times["roofline"] == pytest.approx(39.1e-6, rel=1e-3)
    assert times["bound"] == "issue" and times["total"] == pytest.approx(times["issue"] + 2e-6)
    # one program walking 1,000 tiles: 1,000 memory latencies on one SM, 341.9 µs, whatever the bytes
    serial = model.launch_time(88_000, grid=1, turns=1000, warps=4, loop=model.Loop(20, 2, 0), blocks_per_sm=13)
    assert serial["bound"] == "latency" and serial["latency"] == pytest.approx(1000 * 600 / 1.755e9)
    # three turns' loads in flight: a third of the latency bound
    assert model.launch_time(131e6, 2000, 32, 8, loop, 2, stages=3)["latency"] == pytest.approx(times["latency"] / 3)
    # the body's instructions outside the loop, once a program: 2,000 x 8 x 5,000 / (132 x 1.755e9 x 4) = 86.3 µs more
    other = model.launch_time(131e6, 2000, 32, 8, model.Loop(900, 20, 8, other=5000), 2)
    assert other["issue"] - times["issue"] == pytest.approx(86.3e-6, rel=1e-3)


def test_the_main_loop_is_the_outermost_backward_branch_with_its_calls_at_their_size():
    listing = """k:
      /*0000*/ S2R R0, SR_CTAID.X ;
    .L_x_1:
      /*0010*/ LDG.E R2, desc[UR4][R4.64] ;
      /*0020*/ CALL.REL.NOINC `($__internal_0_$__cuda_sm20_div_s64) ;
    .L_x_2:
      /*0030*/ DFMA R6, R2, R2, R6 ;
      /*0040*/ @P0 BRA `(.L_x_2) ;
      /*0050*/ CALL.REL.NOINC `($__internal_1_$__cuda_sm20_rem_s64) ;
      /*0060*/ F2F.F64.F32 R8, R2 ;
      /*0070*/ @P1 BRA `(.L_x_1) ;
      /*0080*/ EXIT ;
    $__internal_0_$__cuda_sm20_div_s64:
      /*0090*/ IADD3 R0, R0, 1, RZ ;
      /*00a0*/ IADD3 R0, R0, 1, RZ ;
      /*00b0*/ RET.REL.NODEC R20 `(k) ;
    $__internal_1_$__cuda_sm20_rem_s64:
      /*00c0*/ RET.REL.NODEC R20 `(k) ;"""
    # the outer loop: 7 instructions, a 3-instruction and a 1-instruction subroutine; DFMA and F2F.F64 on fp64;
    # S2R and EXIT outside it
    assert model.sass_loop(listing) == model.Loop(instructions=11, fp64=2, calls=2, other=2)
    assert model.sass_loop("k:\n  /*0000*/ EXIT ;") is None


def test_trip_counts_follow_the_kernels_tiles():
    call = ("summarize", ((5_000_000, "bfloat16"), (70_000, "bfloat16")))
    # 5,070,000 elements over 156 tiles of 1,024-element turns: 31.7 turns a program
    assert model.trips("_tile_partials", call, 156, {"BLOCK": 1024}) == (5_070_000 / (156 * 1024), 0)
    assert model.trips("_tile_partials", call, 156, {"TURNS": 32}) == (32, 0)  # a fixed trip count
    # the larger tensor's 153 tiles, 64 a turn: 3 turns; one tile a turn: 153
    assert model.trips("_combine_tiles", call, 2, {"TILES": 64, "WIDE": 12}) == (3, 12)
    assert model.trips("_combine_tiles", call, 2, {}) == (153, 11)
    assert model.trips("_row_kernel", ("logit_rows", (1024, 50257), "bfloat16"), 1024, {"BLOCK": 1024}) == (50, 0)


def test_sizes_that_grow_with_the_batch_are_extrapolated_linearly():
    def ops(batch):
        return [Op("actviz.summarize.default", "actviz", False, 100 * batch, 8, 0,
                   ("summarize", ((1000 * batch, "bfloat16"),), (7,), False, (), ())),
                Op("aten.topk.default", "actviz", False, 50, 10, 0)]

    found = model.extrapolate(ops(2), ops(4), (2, 4), 64)
    assert found[0].read == 6400 and found[0].written == 8 and found[0].call[1] == ((64000, "bfloat16"),)
    assert (found[1].read, found[1].written) == (50, 10)
    with pytest.raises(RuntimeError, match="dispatched different actviz ops"):
        model.extrapolate(ops(2), ops(4)[:1], (2, 4), 64)


def test_the_script_explains_its_model():
    shown = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_step_model.py"), "--help"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0
    assert all(words in shown.stdout for words in ("bandwidth roofline", "issue bound", "latency bound", "--models"))
