"""scripts/check_gpu.py, the one-call GPU check: its smoke mode on the CPU, and its rule that any actviz warning fails."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_gpu  # noqa: E402

from actviz.common.safe_warnings import warn_safely  # noqa: E402


def test_an_actviz_warning_is_counted_and_fails_the_table_whether_warned_or_logged(tmp_path):
    with warnings.catch_warnings(record=True) as passed_on, check_gpu.ActvizWarnings() as seen:
        warn_safely("actviz: layer 'conv1' skipped")  # a warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warn_safely("actviz: statistic failed")  # -W error: logged instead
        warnings.warn("not actviz's", UserWarning, stacklevel=1)
    assert seen.messages == ["actviz: layer 'conv1' skipped", "actviz: statistic failed"]
    assert [str(warning.message) for warning in passed_on] == ["not actviz's"]  # shown as before
    (tmp_path / check_gpu.ROWS_FILE).write_text("")
    check_gpu.report_warnings(tmp_path, "resnet50", seen)
    with check_gpu.ActvizWarnings() as quiet:
        pass
    check_gpu.report_warnings(tmp_path, "gpt2", quiet)
    text, rows = check_gpu.table(tmp_path)
    assert [row["verdict"] for row in rows] == ["FAIL", "ok"]
    assert rows[0]["value"].startswith("2: 1x actviz: layer 'conv1' skipped")
    assert text.endswith("2 rows: 1 FAIL, 0 WARN")


def test_the_reference_row_is_float64_of_a_spiked_tensor():
    import torch

    x = torch.tensor([1.0, float("nan"), -2.0, float("inf"), 0.0, 7.0])
    row = check_gpu.reference_row(x, 4, True, piece=4)  # two pieces
    z = [1.0, 0.0, -2.0, 0.0, 0.0, 7.0]
    mean = sum(z) / 6
    squares = sum((v - mean) ** 2 for v in z)
    assert row[:6] == [5.0, 3.0, mean, squares / 6, -2.0, 7.0]
    assert row[6:8] == [float("inf"), 2.0]  # max |x| (NaN left out), count of |x| >= 6
    assert abs(row[8] - squares) < 1e-12 and abs(row[9] - sum((v - mean) ** 4 for v in z)) < 1e-9
    assert row[10] == 1.0 and row[11] == 0.0  # x[::4]
    assert check_gpu.differences(row, row, 10) == []
    assert check_gpu.differences([6.0] + row[1:], row, 10) == ["nonzero 6.0, expected 5.0"]


def test_smoke_mode_runs_every_phase_on_the_cpu_and_writes_its_table(tmp_path):
    out = tmp_path / "logs"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_gpu.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "table.json").read_text())
    sections = {row["section"] for row in rows}
    assert {"env", "compile", "correct", "speed", "step", "warnings"} <= sections
    assert not [row for row in rows if row["verdict"] == "FAIL"]
    correct = [row for row in rows if row["section"] == "correct"]
    assert len(correct) >= 10 and all(row["value"].startswith("matches float64") for row in correct)
    steps = [row["item"] for row in rows if row["section"] == "step"]
    assert any("resnet50" in item and "logging step / bare" in item for item in steps)
    assert any("gpt2" in item and "idle step / bare" in item for item in steps)
    assert (out / "check.log").stat().st_size > 0 and (out / "table.txt").read_text() in done.stdout + "\n"
