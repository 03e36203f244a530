"""``actviz doctor``: the layer table and alerts of a run, read back from its event files, and its exit codes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import small_cnn, train_step
from torch import nn

import actviz
from actviz.cli import main

ROOT = Path(__file__).resolve().parents[1]


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def train(log_dir: Path, model: nn.Module, steps: int = 6) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=1, alerts={"warmup_steps": 0}) as viz:
            for _ in range(steps):
                train_step(model, optimizer)
    return viz.alerts


def sick_cnn() -> nn.Sequential:
    model = small_cnn()
    model.insert(1, Scale(1e-6))  # after the first conv: its output gradient vanishes
    return model


def test_a_healthy_run_exits_0_with_every_layer_in_the_table(tmp_path, capsys, read_run):
    assert train(tmp_path, small_cnn()) == []
    assert main(["doctor", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line and line.split()[0] in ["0", "2", "3", "6"]}
    assert list(rows) == ["0", "2", "3", "6"]  # the layers table's order
    run = read_run(tmp_path)
    for layer, row in rows.items():  # last gradient norm and activation std, as logged at step 5
        assert float(row[1]) == pytest.approx(run.scalar(f"gradient_stats/{layer}/norm", 5), rel=1e-2)
        assert float(row[4]) == pytest.approx(run.scalar(f"activation_stats/{layer}/std", 5), rel=1e-2)
        assert row[-1] == "0"  # NaN/Inf
    assert "no alerts" in out


def test_a_sick_run_exits_1_and_lists_each_alert_with_its_step(tmp_path, capsys):
    alerts = train(tmp_path, sick_cnn())
    assert [(alert.step, alert.rule, alert.layer) for alert in alerts] == [(2, "vanishing_gradients", "0")]
    assert main(["doctor", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "vanishing_gradients" in line]
    assert line.split()[:4] == ["step", "2", "vanishing_gradients", "0"]


def test_json_and_a_folder_of_runs(tmp_path, capsys):
    train(tmp_path / "healthy", small_cnn())
    train(tmp_path / "sick", sick_cnn())
    assert main(["doctor", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == 1
    runs = {Path(run["path"]).name: run for run in report["runs"]}
    assert runs["healthy"]["alerts"] == []
    assert [(a["step"], a["rule"], a["layer"]) for a in runs["sick"]["alerts"]] == [(2, "vanishing_gradients", "0")]
    assert [layer["layer"] for layer in runs["sick"]["layers"]] == ["0", "3", "4", "7"]


def test_a_nan_run_counts_the_nonfinite_elements(tmp_path, capsys):
    model = small_cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1):
            model(torch.full((2, 3, 8, 8), math.nan)).sum().backward()
    assert main(["doctor", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (run,) = report["runs"]
    assert {layer["layer"]: layer["nonfinite"] for layer in run["layers"]}["0"] == 2 * 6 * 8 * 8
    assert run["alerts"][0]["rule"] == "nonfinite" and run["alerts"][0]["step"] == 0


def test_no_actviz_run_exits_2(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert "no actviz run" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path / "other") as writer:  # a TensorBoard run, not actviz's
        writer.add_scalar("loss", 1.0, 0)
    assert main(["doctor", str(tmp_path)]) == 2


def test_a_run_written_before_the_tilde_is_read_too(tmp_path, capsys):
    """Runs written before actviz put "~" before its TensorBoard tags: the same statistics, by their bare names."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path / "old") as writer:
        for step, norm in enumerate([0.5, 0.25]):
            writer.add_scalar("gradient_stats/fc/norm", norm, step)
            writer.add_scalar("activation_stats/fc/std", 2.0, step)
    with SummaryWriter(tmp_path / "new") as writer:
        writer.add_scalar("~gradient_stats/fc/norm", 0.125, 0)
        writer.add_scalar("~activation_stats/fc/std", 4.0, 0)
    assert main(["doctor", "--json", str(tmp_path)]) == 0
    runs = {Path(run["path"]).name: run for run in json.loads(capsys.readouterr().out)["runs"]}
    (old,), (new,) = runs["old"]["layers"], runs["new"]["layers"]
    assert (old["layer"], old["gradient_norm"], old["activation_std"]) == ("fc", 0.25, 2.0)
    assert (new["layer"], new["gradient_norm"], new["activation_std"]) == ("fc", 0.125, 4.0)


def test_the_command_runs_as_a_program_and_its_help_teaches(tmp_path):
    train(tmp_path, sick_cnn())
    done = subprocess.run([sys.executable, "-m", "actviz", "doctor", str(tmp_path)], capture_output=True, text=True, check=False,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 1 and "vanishing_gradients" in done.stdout
    shown = subprocess.run([sys.executable, "-m", "actviz", "doctor", "--help"], capture_output=True, text=True, check=False,
                           cwd=ROOT, timeout=120).stdout
    assert "exit codes: 0 no alert, 1 at least one alert, 2 no actviz run" in shown and "--json" in shown


def test_a_lightning_run(tmp_path, capsys):
    from test_integrations import fit, lightning, lit_cnn

    pl = lightning()
    from actviz.integrations.lightning import ActvizCallback

    fit(pl, lit_cnn(pl), tmp_path / "healthy", [ActvizCallback(every=1)])
    assert main(["doctor", str(tmp_path / "healthy")]) == 0
    assert "net.0" in capsys.readouterr().out
    # every layer below 0.99 x the median for one step: an alert, found in Lightning's own run folder
    fit(pl, lit_cnn(pl), tmp_path / "sick", [ActvizCallback(every=1, alerts={"vanishing_ratio": 0.99, "warmup_steps": 0,
                                                                             "vanishing_steps": 1})])
    capsys.readouterr()
    assert main(["doctor", str(tmp_path / "sick"), "--json"]) == 1
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["alerts"][0]["rule"] == "vanishing_gradients" and "lit" in run["path"]


def test_a_hugging_face_run(tmp_path, capsys):
    from test_integrations import hf_train, tiny_bert, transformers

    hf = transformers()
    from actviz.integrations.huggingface import ActvizCallback

    hf_train(hf, tiny_bert(hf), tmp_path, [ActvizCallback(every=1, alerts={"vanishing_ratio": 0.99, "warmup_steps": 0,
                                                                           "vanishing_steps": 1})])
    capsys.readouterr()  # the Trainer's own printing
    assert main(["doctor", str(tmp_path), "--json"]) == 1
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert "classifier" in [layer["layer"] for layer in run["layers"]]
    assert run["alerts"][0]["rule"] == "vanishing_gradients"


def test_the_python_blocks_of_docs_diagnosis_md_run(tmp_path, monkeypatch, capsys):
    import re

    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "diagnosis.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/diagnosis.md", "exec"), {})
    assert "[(100, 'vanishing_gradients', '0')]" in capsys.readouterr().out  # what the block's comment says
