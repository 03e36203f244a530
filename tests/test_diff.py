"""``actviz diff RUN_A RUN_B``: where two runs part, read back from their event files, and its exit codes.

The runs are a seeded three-layer MLP trained on the CPU for a few steps; a perturbed run scales one
layer's output (a forward hook) or the gradient a layer passes back (a backward hook) from a given step on.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import actviz
from actviz.cli import main
from actviz.run_diff import RunStatistics, compare_runs, read_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 7  # logged: 0, 2, 4, 6


def train(log_dir: Path, *, output_from: int | None = None, gradient_from: int | None = None,
          every: int | list[int] = 2, learn: bool = True) -> None:
    """Train the MLP ``Linear 0 - Tanh - Linear 2 - Tanh - Linear 4``, watched every ``every`` steps.

    ``output_from``: layer 2's output is scaled by 1.5 from that step on. ``gradient_from``: the gradient
    layer 4 passes back to its input (layer 2's output, through the Tanh) is scaled by 1.5 from that step on.
    ``learn=False`` makes no optimizer step: the weights stay as they are.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 if learn else 0.0)
    now = {"step": 0}  # the step the hooks see
    if output_from is not None:
        model[2].register_forward_hook(
            lambda module, args, output: output * 1.5 if now["step"] >= output_from else None)
    if gradient_from is not None:
        model[4].register_full_backward_hook(
            lambda module, grad_input, grad_output: tuple(g * 1.5 for g in grad_input)
            if now["step"] >= gradient_from else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=every):
            for step in range(STEPS):
                now["step"] = step
                loss = model(torch.randn(16, 4)).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    train(root / "a")
    train(root / "a_again")
    train(root / "output_at_4", output_from=4)
    train(root / "output_at_0", output_from=0)
    train(root / "still", learn=False)
    train(root / "output_at_3", output_from=3, learn=False)
    train(root / "gradient_at_4", gradient_from=4)
    train(root / "odd_steps", every=[1, 3])
    return root


def diff_json(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    status = main(["diff", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_two_runs_of_one_seeded_program_agree(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(runs / "a"), str(runs / "a_again")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the runs agree: 4 common logged step(s), 0 to 6, 3 layer(s)")
    assert diff_json(str(runs / "a"), str(runs / "a_again"), capsys=capsys) == (0, {"first_divergence": None, "status": 0, "problems": []})


def test_a_scaled_output_parts_at_its_first_logged_step_and_names_that_layer(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(runs / "a"), str(runs / "output_at_4")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("the runs part at step 4, layer 2 (output): activation_mean ")
    table = lines[lines.index(next(line for line in lines if line.startswith("layers that differ"))) + 2:]
    assert [row.split()[:2] for row in table] == [  # layer 0's output agrees; its gradient follows from 2's
        ["0", "gradient_norm"], ["2", "activation_mean"], ["4", "activation_mean"]]
    status, found = diff_json(str(runs / "a"), str(runs / "output_at_4"), capsys=capsys)
    first = found["first_divergence"]
    assert (status, first["step"], first["layer"], first["statistic"]) == (1, 4, "2", "activation_mean")
    assert first["b"] == pytest.approx(1.5 * first["a"], rel=1e-5)  # the mean of an output scaled by 1.5


def test_runs_that_part_at_their_first_common_step_claim_no_step_before_it(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(runs / "a"), str(runs / "output_at_0")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("the runs part at step 0, layer 2 (output)")
    assert lines[1].endswith("; they part at their first common step, 0: none before it")
    assert main(["diff", str(runs / "a"), str(runs / "output_at_4")]) == 1
    assert capsys.readouterr().out.splitlines()[1].endswith("; every common step before 4 agrees")


def test_a_change_between_logged_steps_shows_at_the_next_logged_step(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, found = diff_json(str(runs / "still"), str(runs / "output_at_3"), capsys=capsys)
    assert status == 1 and found["first_divergence"]["step"] == 4  # no weights learnt: layer 0 still agrees
    assert found["first_divergence"]["layer"] == "2"


def test_a_scaled_gradient_names_the_last_layer_whose_gradient_differs(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, found = diff_json(str(runs / "a"), str(runs / "gradient_at_4"), capsys=capsys)
    assert status == 1
    assert found == {"first_divergence": {"step": 4, "layer": "2", "statistic": "gradient_norm",
                                          "a": found["first_divergence"]["a"], "b": found["first_divergence"]["b"]},
                     "status": 1, "problems": []}
    assert isinstance(found["first_divergence"]["a"], float)
    assert main(["diff", str(runs / "a"), str(runs / "gradient_at_4")]) == 1
    out = capsys.readouterr().out
    assert "only gradients differ" in out and "layer 2 (gradient)" in out
    rows = out.split("in forward order (the first statistic of each):\n", 1)[1].splitlines()[1:]
    assert [row.split()[:2] for row in rows] == [["0", "gradient_norm"], ["2", "gradient_norm"]]  # 4's agrees


def test_the_layer_order_is_the_layers_text(runs: Path) -> None:
    assert read_run(runs / "a").layers == ["0", "2", "4"]
    assert sorted(read_run(runs / "a").steps) == [0, 2, 4, 6]


def test_tolerances(capsys: pytest.CaptureFixture[str]) -> None:
    def run(value: float) -> RunStatistics:
        return RunStatistics("r", ["fc"], {0: {("fc", "activation_sum"): value}})

    assert compare_runs(run(1.0), run(1.0005)).first_divergence is None  # rtol 1e-3
    assert compare_runs(run(1.0), run(1.0005), rtol=1e-4).first_divergence is not None
    assert compare_runs(run(0.0), run(1e-9)).first_divergence is not None  # atol 0
    assert compare_runs(run(0.0), run(1e-9), atol=1e-6).first_divergence is None
    assert compare_runs(run(float("nan")), run(float("nan"))).first_divergence is None
    assert compare_runs(run(1.0), run(float("inf"))).first_divergence is not None
    with pytest.raises(SystemExit):
        main(["diff", "a", "b", "--rtol", "-1"])
    assert "--rtol: must be a number >= 0, got '-1'" in capsys.readouterr().err


def test_no_actviz_run_or_no_common_step_exits_2(runs: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["diff", str(runs / "a"), str(tmp_path / "empty")]) == 2
    assert "no actviz run in" in capsys.readouterr().err
    with SummaryWriter(tmp_path / "not_actviz") as writer:  # a run with the user's own tags only
        writer.add_scalar("loss", 1.0, 0)
    assert main(["diff", str(tmp_path / "not_actviz"), str(runs / "a")]) == 2
    assert "no per-layer statistics" in capsys.readouterr().err
    assert main(["diff", str(runs / "a"), str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    status, found = diff_json(str(runs / "a"), str(runs / "odd_steps"), capsys=capsys)
    assert status == 2 and "share no logged step" in found["error"]


def test_the_command_runs_as_a_process(runs: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "actviz", "diff", str(runs / "a"), str(runs / "output_at_4")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("the runs part at step 4, layer 2 (output)")


def _record_starts(file: Path) -> list[tuple[int, int]]:
    """``(offset, step)`` of each record of an event file."""
    import struct

    from tensorboard.compat.proto.event_pb2 import Event

    data, offset, found = file.read_bytes(), 0, []
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        found.append((offset, Event.FromString(data[offset + 12:offset + 12 + length]).step))
        offset += length + 16
    return found


def test_a_flipped_byte_is_damage_with_its_own_exit_status_in_text_and_json(
        runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One flipped byte in the first record of step 4: the run reads to step 2 only. Its first steps agree with
    # run a, but a CI step must not pass on a run it could not read whole.
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (file,) = [path for path in (runs / "a").iterdir() if path.name.startswith("events.out.tfevents")]
    offset = next(start for start, step in _record_starts(file) if step == 4)
    data = bytearray(file.read_bytes())
    data[offset + 20] ^= 0x10
    (damaged / file.name).write_bytes(bytes(data))
    assert main(["diff", str(runs / "a"), str(damaged)]) == 3
    out = capsys.readouterr().out
    assert out.startswith("the runs agree: 2 common logged step(s), 0 to 2")
    assert "exit 3" in out and "damaged:" in out and "read to step 2" in out and file.name in out
    status, found = diff_json(str(damaged), str(runs / "output_at_4"), capsys=capsys)
    assert status == 3 and found["status"] == 3 and found["first_divergence"] is None
    (problem,) = found["problems"]
    assert file.name in problem and "checksum does not match" in problem and "read to step 2" in problem


def _peak_bytes(call) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_diff_and_doctor_hold_memory_by_layers_not_steps(tmp_path: Path) -> None:
    # Runs of 20 and 160 logged steps × 10 layers (scripts/run_reader_memory.py's tags): eight times the steps,
    # not eight times the memory. Holding every value, doctor took 6.6 times as much at 160 steps as at 20.
    import importlib.util

    from actviz.diagnosis.doctor import doctor
    from actviz.run_diff import diff

    spec = importlib.util.spec_from_file_location("run_reader_memory", ROOT / "scripts" / "run_reader_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    peaks = {}
    for steps in (20, 160):
        for name in ("a", "b"):
            script.write_run(tmp_path / str(steps) / name, steps, 10)
        folder = tmp_path / str(steps)
        peaks[steps] = (_peak_bytes(partial(doctor, folder / "a")), _peak_bytes(partial(diff, folder / "a", folder / "b")))
        assert doctor(folder / "a")[0] == 0 and diff(folder / "a", folder / "b")[0] == 0
    for command, short, long in zip(("doctor", "diff"), peaks[20], peaks[160]):
        assert long < 1.5 * short, (command, short, long)


def test_a_users_own_value_at_an_earlier_step_is_no_damage(runs: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # writer= shared with the user's loop: a value it writes at an earlier step (an epoch's loss at step 0 after
    # step 6) is not actviz's and is no damage; an actviz statistic out of order is left out with a note.
    import struct

    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    from actviz.output.run_folders import _masked_crc

    def record(tag: str) -> bytes:
        data = Event(step=0, wall_time=1.0, summary=Summary(value=[Summary.Value(tag=tag, simple_value=9.0)]))
        data = data.SerializeToString()
        header = struct.pack("<Q", len(data))
        return header + struct.pack("<I", _masked_crc()(header)) + data + struct.pack("<I", _masked_crc()(data))

    (file,) = [path for path in (runs / "a").iterdir() if path.name.startswith("events.out.tfevents")]
    for name, tag in (("users", "epoch_loss"), ("late_statistic", "~activation_stats/mean@0")):
        (tmp_path / name).mkdir()
        (tmp_path / name / file.name).write_bytes(file.read_bytes() + record(tag))
        assert main(["diff", str(runs / "a"), str(tmp_path / name)]) == 0
        out = capsys.readouterr().out
        assert out.startswith("the runs agree: 4 common logged step(s)") and "damaged" not in out
        assert ("note: " in out) == (name == "late_statistic"), out


def train_classifier(log_dir: Path, nudge_at: int | None = None) -> None:
    """A seeded cross-entropy MLP logged every step; ``nudge_at``: layer 2's weight is scaled by 1 + 1e-4 then."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=1):
            for step in range(5):
                x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
                if step == nudge_at:
                    with torch.no_grad():
                        model[2].weight.mul_(1 + 1e-4)
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()


def test_a_nudge_below_rtol_names_its_layer_not_a_gradient_sum_that_is_rounding(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Layer 2's output moves by ~1e-4 of its scale (under rtol); the last layer's gradient sum is 0 up to rounding
    (a cross-entropy gradient sums to 0 over the classes) and differs in relative terms by 100 %."""
    train_classifier(tmp_path / "a")
    train_classifier(tmp_path / "b", nudge_at=3)
    first = compare_runs(read_run(tmp_path / "a"), read_run(tmp_path / "b")).first_divergence
    assert first is not None and (first.step, first.layer) == (3, "2")
    assert first.statistic.startswith("activation_")
    assert abs(first.a - first.b) < 1e-3 * max(abs(first.a), abs(first.b))  # not past rtol itself
    runs = [read_run(tmp_path / name) for name in ("a", "b")]
    sums = [run.steps[3][("4", "gradient_sum")] for run in runs]  # what the old rule named: rounding around 0
    norm = runs[0].steps[3][("4", "gradient_norm")]
    assert max(map(abs, sums)) < 1e-5 * norm and not math.isclose(*sums, rel_tol=1e-3)
    status, found = diff_json(str(tmp_path / "a"), str(tmp_path / "b"), capsys=capsys)
    assert (status, found["first_divergence"]["step"], found["first_divergence"]["layer"]) == (1, 3, "2")
