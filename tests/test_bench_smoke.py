"""Smoke test of scripts/bench_overhead.py: it runs and writes a complete JSON report.

No timing is asserted here; the numbers come from a real run (see README "Performance").
"""

from __future__ import annotations

import json
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
