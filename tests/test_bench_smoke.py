"""Smoke test of scripts/bench_overhead.py: it runs and writes a complete JSON report.

No timing is asserted here; the numbers come from a real run (see README "Performance").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_overhead.py"


def test_quick_run_writes_json_with_every_case(tmp_path):
    out = tmp_path / "bench.json"
    command = [
        sys.executable, str(SCRIPT), "--quick", "--models", "transformer", "--steps", "1", "--warmup", "0",
        "--memory-steps", "2", "--no-wandb", "--json", str(out), "--markdown", str(tmp_path / "bench.md"),
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_overhead import CASES
    finally:
        sys.path.remove(str(SCRIPT.parent))
    report = json.loads(out.read_text())
    cases = report["models"]["transformer"]["cases"]
    assert set(cases) == set(CASES)
    for name, result in cases.items():
        assert result["status"] in ("ok", "skipped"), (name, result)
        if name.startswith("wandb"):
            continue
        assert result["status"] == "ok", (name, result)
        assert result["total_ratio"] > 0
        if name != "actviz_amortised":
            assert result["pairs"] >= 1 and result["min"] <= result["median"] <= result["max"]
    assert report["models"]["transformer"]["bare_ms"] > 0
    assert [row["numel"] for row in report["histogram"]] == [10**4, 10**5, 10**6]
    assert all(row["speedup"] > 0 for row in report["histogram"])
    assert report["memory"]["steps"] == 2
    assert "non-logging step (median, worst model)" in report["bars"]
    hook = report["idle_hook"]
    assert hook["forwards"] > 0 and hook["bare_forward_us"] > 0
    assert hook["watched_forward_us"] == pytest.approx(hook["bare_forward_us"] + hook["hook_us"])
    from actviz.options import cpu_shortcuts

    assert report["meta"]["cpu_shortcuts"] == cpu_shortcuts()  # which summary path was timed
    assert "| actviz_logging |" in (tmp_path / "bench.md").read_text()


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_overhead

    return bench_overhead


def test_amortised_is_computed_from_idle_and_logging_in_one_place(bench):
    idle, logging_ = {"status": "ok", "total_ratio": 1.01}, {"status": "ok", "total_ratio": 1.5}
    computed = {"actviz_idle": idle, "actviz_logging": logging_,
                "actviz_amortised": {"status": "ok", "method": "computed"}}
    bench.amortised(computed)
    assert computed["actviz_amortised"]["total_ratio"] == pytest.approx((99 * 1.01 + 1.5) / 100)  # 1.0149
    measured = {"actviz_idle": idle, "actviz_logging": logging_,
                "actviz_amortised": {"status": "ok", "total_ratio": 1.004, "pairs": 200}}
    bench.amortised(measured)
    assert measured["actviz_amortised"] == {"status": "ok", "total_ratio": 1.004, "pairs": 200,
                                            "computed": pytest.approx(1.0149), "method": "measured"}


def test_a_case_variant_is_one_line_and_runs_in_its_environment(bench, monkeypatch, tmp_path):
    eager, fused = bench.CASES["actviz_logging_eager"], bench.CASES["actviz_logging"]
    assert eager.env == {"ACTVIZ_FUSED": "0"} and eager.setup.func is fused.setup.func
    assert eager.setup.keywords == fused.setup.keywords == {"every": 1}
    seen = []

    def probe(model, log_dir):
        seen.append(("setup", os.environ.get("ACTVIZ_BENCH_PROBE")))
        return bench.Setup("probe", after_step=lambda loss: seen.append(("step", os.environ.get("ACTVIZ_BENCH_PROBE"))),
                           cleanup=[lambda: seen.append(("cleanup", os.environ.get("ACTVIZ_BENCH_PROBE")))])

    monkeypatch.delenv("ACTVIZ_BENCH_PROBE", raising=False)
    monkeypatch.setitem(bench.CASES, "probe", bench.Case(probe, env={"ACTVIZ_BENCH_PROBE": "0"}))
    result = bench.run_case("transformer", "probe", steps=2, warmup=1, budget_s=60, tmp=tmp_path)
    assert result["status"] == "ok" and result["pairs"] == 2 and result["note"] == "probe"
    assert seen == [("setup", "0")] + [("step", "0")] * 3 + [("cleanup", "0")]  # warm-up + 2 measured steps
    assert "ACTVIZ_BENCH_PROBE" not in os.environ  # restored


def test_bench_compile_runs_both_sides_in_fresh_processes(tmp_path):
    """scripts/bench_compile.py: one bare and one watched run, each its own process; Dynamo's counts come back."""
    out = tmp_path / "compile.json"
    command = [sys.executable, str(SCRIPT.parent / "bench_compile.py"), "--backend", "eager", "--steps", "3",
               "--every", "2", "--repeats", "1", "--json", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = json.loads(out.read_text())
    bare, watched = report["runs"]["bare"][0], report["runs"]["watched"][0]
    assert bare["graphs"] >= 1 and watched["graphs"] == bare["graphs"]  # actviz adds no graph
    assert watched["recompiles"] == 0
    assert report["ratio"] == pytest.approx(report["median"]["watched"]["seconds"] / report["median"]["bare"]["seconds"])
    assert "ratio" in finished.stdout


def test_the_gpu_step_benchmark_runs_its_three_copies_and_refuses_a_missing_gpu(tmp_path):
    # On a GPU it times a step with memory figures; here --device cpu checks the script itself.
    script = SCRIPT.parent / "bench_gpu_step.py"
    command = [sys.executable, str(script), "--device", "cpu", "--model", "micro", "--rounds", "2", "--warmup", "1"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.startswith("micro, batch 1, float32, eager summaries, cpu") and "x the bare step" in finished.stdout
    assert [line.split()[0] for line in finished.stderr.splitlines()[-3:]] == ["bare", "idle", "logging"]
    refused = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert refused.returncode == 2 and "needs a CUDA GPU" in refused.stderr and "--device cpu" in refused.stderr


def test_the_run_size_benchmark_reads_its_run_back_by_kind_of_record(tmp_path):
    """scripts/bench_run_size.py: a short run with every feature on; bytes per 1,000 steps and by kind, read back."""
    command = [sys.executable, str(SCRIPT.parent / "bench_run_size.py"), "--steps", "30", "--keep", str(tmp_path / "run"),
               "--flow-pictures"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    out = finished.stdout
    assert "30 steps, every=10, image_every=10: 3 image steps" in out and "per 1,000 steps:" in out
    assert all(kind in out for kind in ("histograms", "scalars", "images: flow", "images: feature_maps", "images: gradcam"))
    assert any((tmp_path / "run").glob("events.out.tfevents.*"))  # --keep keeps it
