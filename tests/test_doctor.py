"""``actviz doctor``: the layer table and alerts of a run, read back from its event files, and its exit codes."""

from __future__ import annotations

import json
import os
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
        assert float(row[1]) == pytest.approx(run.scalar(f"gradient_stats/norm@{layer}", 5), rel=1e-2)
        assert float(row[4]) == pytest.approx(run.scalar(f"activation_stats/std@{layer}", 5), rel=1e-2)
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
    # the watched layers, in order, then the ReLUs they leave out, which write their zero fraction alone
    assert [layer["layer"] for layer in runs["sick"]["layers"]] == ["0", "3", "4", "7", "2", "5"]


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
            writer.add_scalar("gradient_stats/norm@fc", norm, step)
            writer.add_scalar("activation_stats/std@fc", 2.0, step)
    with SummaryWriter(tmp_path / "new") as writer:
        writer.add_scalar("~gradient_stats/norm@fc", 0.125, 0)
        writer.add_scalar("~activation_stats/std@fc", 4.0, 0)
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
    assert "[(20, 'vanishing_gradients', '0')]" in capsys.readouterr().out  # what the block's comment says


# --- anything in RUN_DIR: FIFOs, damaged records, odd names (each call under a hard timeout) ---

def _record(data: bytes) -> bytes:
    import struct

    from actviz.output.run_folders import _masked_crc

    crc = _masked_crc()
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", crc(header)) + data + struct.pack("<I", crc(data))


def _event(step: int, *values) -> bytes:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Event(step=step, wall_time=1.0, summary=Summary(value=list(values))).SerializeToString()


def _scalar(tag: str, value: float):
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary.Value(tag=tag, simple_value=value)


def _text(tag: str, *texts: str):
    from torch.utils.tensorboard.summary import text as text_summary

    value = text_summary(tag, "x").value[0]
    value.tag = tag
    value.tensor.ClearField("string_val")
    value.tensor.string_val.extend(text.encode("utf-8") for text in texts)
    return value


def _write_run(folder: Path, *records: bytes, name: str = "events.out.tfevents.1.host") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / name
    file.write_bytes(b"".join(records))
    return file


def _good_steps(steps: int = 3) -> list[bytes]:
    return [_record(_event(step, _scalar("~activation_stats/std@fc", 1.0 + step),
                           _scalar("~gradient_stats/norm@fc", 0.5))) for step in range(steps)]


def _doctor(folder: Path, *options: str) -> subprocess.CompletedProcess:
    """``actviz doctor`` as a program, killed after 60 s: a test that would hang fails instead."""
    return subprocess.run([sys.executable, "-m", "actviz", "doctor", str(folder), *options], capture_output=True,
                          check=False, cwd=ROOT, timeout=60)


def test_a_fifo_named_like_an_event_file_is_skipped_not_waited_on(tmp_path):
    _write_run(tmp_path / "run", *_good_steps())
    os.mkfifo(tmp_path / "run" / "events.out.tfevents.2.fifo")
    done = _doctor(tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    assert "events.out.tfevents.2.fifo: skipped: not a regular file" in out and "no alerts" in out


def test_exit_statuses_are_distinct_and_documented(tmp_path):
    from actviz.diagnosis import doctor as module

    assert (module.EXIT_HEALTHY, module.EXIT_ALERTS, module.EXIT_NO_RUN, module.EXIT_DAMAGED) == (0, 1, 2, 3)
    shown = subprocess.run([sys.executable, "-m", "actviz", "doctor", "--help"], capture_output=True, text=True,
                           check=False, cwd=ROOT, timeout=120).stdout
    assert "2 no actviz run in RUN_DIR,\n  3 a damaged event file" in shown
    assert "**3** when an event file is damaged" in (ROOT / "docs" / "diagnosis.md").read_text()


def test_a_record_claiming_2_to_the_40_bytes_is_damage_and_the_other_runs_are_read(tmp_path):
    import struct

    from actviz.output.run_folders import _masked_crc

    header = struct.pack("<Q", 2**40)
    huge = header + struct.pack("<I", _masked_crc()(header)) + b"\0" * 32
    _write_run(tmp_path / "bad", *_good_steps(2), huge)
    _write_run(tmp_path / "good", *_good_steps(4))
    done = _doctor(tmp_path, "--json")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == 3
    assert {Path(run["path"]).name: run["last_step"] for run in report["runs"]} == {"bad": 1, "good": 3}
    (problem,) = report["problems"]
    assert Path(problem["path"]).parent.name == "bad" and problem["last_step"] == 1
    assert "claiming 1099511627776 bytes" in problem["reason"] and problem["reason"].startswith("damaged")


@pytest.mark.parametrize("where", ["length", "data", "last crc"])
def test_one_flipped_byte_in_an_event_file_is_damage_from_the_step_where_it_stops(tmp_path, where):
    records = _good_steps(5)
    offset = sum(map(len, records[:3])) + {"length": 2, "data": 20, "last crc": len(records[3]) - 1}[where]
    data = bytearray(b"".join(records))
    data[offset] ^= 0x10
    _write_run(tmp_path, bytes(data))
    done = _doctor(tmp_path)
    assert done.returncode == 3, (done.stdout, done.stderr)
    out = done.stdout.decode()
    assert "checksum does not match" in out and "read to step 2, nothing after it" in out
    assert "run " in out and "(last step 2)" in out  # what precedes the damage is still reported


def test_an_intact_file_written_by_actviz_is_not_damaged(tmp_path):
    train(tmp_path, small_cnn(), steps=3)
    assert _doctor(tmp_path).returncode == 0


def test_a_layers_text_with_no_string_a_folder_named_like_an_event_file_and_a_tag_not_utf8(tmp_path):
    empty_layers = _text("layers")
    empty_layers.tensor.ClearField("string_val")
    _write_run(tmp_path / "run", _record(_event(0, empty_layers)), *_good_steps(2))
    (tmp_path / "run" / "events.out.tfevents.9.folder").mkdir()
    bad_tag = _event(0, _scalar("~activation_stats/std@QQ", 1.0)).replace(b"QQ", b"\xff\xfe")
    _write_run(tmp_path / "tag", *_good_steps(2), _record(bad_tag), *_good_steps(3)[2:])
    done = _doctor(tmp_path, "--json")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert {Path(run["path"]).name: run["last_step"] for run in report["runs"]} == {"run": 1, "tag": 2}
    reasons = {Path(problem["path"]).name: problem["reason"] for problem in report["problems"]}
    assert reasons["events.out.tfevents.9.folder"].startswith("skipped: not a regular file")
    assert reasons["events.out.tfevents.1.host"] == "damaged: a record after step 1 that is not a TensorBoard event, skipped"


def test_a_folder_name_that_is_not_utf8_and_control_characters_are_escaped_on_the_terminal(tmp_path):
    from actviz.diagnosis.alerts import Alert

    layer = "evil\x1b[31m`\nname\\x"
    alert = Alert(4, "dead_units", layer, "zero_fraction", 1.0, 0.99, f"dead units in {layer!r}\n\nnext")
    folder = tmp_path / os.fsdecode(b"run\xff\x1b]0;title\x07")
    _write_run(folder, *_good_steps(2), _record(_event(4, _scalar(f"~activation_stats/std@{layer}", 2.0),
                                                        _text("alerts", alert.line()))))
    done = _doctor(tmp_path)
    assert done.returncode == 1, done.stderr
    assert b"\x1b" not in done.stdout and b"\x07" not in done.stdout and b"\xff" not in done.stdout
    out = done.stdout.decode()
    assert "run\\udcff\\x1b]0;title\\x07" in out and "evil\\x1b[31m`\\nname\\x" in out
    report = json.loads(_doctor(tmp_path, "--json").stdout)
    (run,) = report["runs"]
    (found,) = run["alerts"]
    assert (found["step"], found["rule"], found["layer"], found["message"]) == (4, "dead_units", layer, alert.message)
    assert layer in [entry["layer"] for entry in run["layers"]]


@pytest.mark.parametrize("layer", ["fc", "a`b", "a\nb", "-", "", " x ", "a\\x60b", "\\", "\x1b[2J", "\udcff", "é·`"])
def test_alert_text_round_trips_any_layer_name(layer):
    from actviz.diagnosis.alerts import Alert, parse_alert_lines

    alerts = [Alert(3, "dead_units", layer, "zero_fraction", 1.0, 0.99, f"m {layer} \n\n {layer!r} "),
              Alert(5, "gradient_spike", None, "global_norm", 9.0, 1.0, "spike")]
    text = "\n\n".join(alert.line() for alert in alerts)
    assert "\n" not in alerts[0].line() and text.encode("utf-8")
    assert parse_alert_lines(text) == [(a.step, a.rule, a.layer, a.message) for a in alerts]


def test_json_answers_in_json_whatever_happens(tmp_path):
    # No run in the folder, a path that is not a folder, a folder that cannot be listed: JSON, exit 2, as diff --json.
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "empty", "no actviz run in"), (tmp_path / "missing", "is not a folder")]
    locked = tmp_path / "locked"
    _write_run(locked / "run", *_good_steps())
    if os.geteuid() != 0:  # root reads any folder
        cases.append((locked, "no actviz run in"))
    locked.chmod(0)
    try:
        for folder, reason in cases:
            done = _doctor(folder, "--json")
            assert done.returncode == 2, done.stderr
            report = json.loads(done.stdout)
            assert report["status"] == 2 and reason in report["error"], report
            if folder == locked:
                assert any("cannot be read" in problem["reason"] for problem in report["problems"]), report
    finally:
        locked.chmod(0o755)


def test_the_trend_counts_zeros_and_draws_a_flat_series_flat():
    from actviz.diagnosis.doctor_text import trend as _trend

    # a gradient that fell to exactly 0: the zeros are drawn, below the lowest bar, and it ends "to 0"
    assert _trend([0.01, 0.34, 0.0, 0.0, 0.0]) == "▁█___ to 0"
    assert _trend([0.0, 0.0, 2.0]) == "__▄ from 0"
    # a change of 1.0x in noise is flat, in the middle; a decade or more fills the height, last / first after it
    assert _trend([1.0, 1.0001, 0.9999, 1.0]) == "▄▄▄▄ x1"
    assert _trend([1.0, 2.0]) == "▃▅ x2"  # log10(2) = 0.3 of a decade: 3 -/+ 1.05 bars
    assert _trend([1.0, 10.0, 100.0]) == "▁▅█ x1e+02"


def test_the_alert_table_stays_aligned_for_long_rule_and_layer_names():
    from actviz.diagnosis.doctor import RunHealth
    from actviz.diagnosis.doctor_text import format_run

    alerts = [{"step": 3, "rule": "nonfinite", "layer": "fc", "message": "first"},
              {"step": 120, "rule": "exploding_activations", "layer": "encoder.layer.0.attention.self.query",
               "message": "second"},
              {"step": 7, "rule": "dead_units", "layer": None, "message": "third"}]
    lines = format_run(RunHealth("runs/x", 120, [], alerts)).splitlines()
    rows = lines[lines.index("3 alert(s):") + 1:]
    assert [row.index(message) for row, message in zip(rows, ("first", "second", "third"))] == [rows[1].index("second")] * 3
    assert [row.index(layer) for row, layer in zip(rows, ("fc", "encoder", "-"))] == [rows[1].index("encoder")] * 3


def test_doctor_help_prints_no_raw_control_character(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "escaped (\\x1b, \\x0a, ...)" in shown


def test_a_reader_that_stops_reading_ends_doctor_json_quietly(tmp_path, monkeypatch):
    train(tmp_path, small_cnn())
    read_end, write_end = os.pipe()
    os.close(read_end)  # `actviz doctor --json | head -1`: head has read its line and gone
    stdout = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["doctor", str(tmp_path), "--json"]) == 0  # no BrokenPipeError
    stdout.write("more")
    stdout.flush()  # what Python does at exit: the descriptor now goes to os.devnull, no error either
    stdout.close()
