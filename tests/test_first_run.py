"""A first run with the one line: the default schedule draws a curve, the loss is logged, a word at start and end."""

from __future__ import annotations

import logging
import tempfile
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import CountOps
from torch import nn

import actviz
from actviz.schedule import Schedule, default_step, logged_steps
from actviz.tags import LOSS


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _train(model: nn.Module, steps: int, scaler: torch.amp.GradScaler | None = None) -> list[float]:
    """``steps`` SGD steps on cross-entropy; the losses the loop computed, in float64."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        inputs, targets = torch.randn(5, 4, generator=generator), torch.randint(0, 3, (5,), generator=generator)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        losses.append(float(loss.detach().double()))
    return losses


def test_the_default_schedule_draws_a_curve_in_a_short_run_and_costs_as_every_100_in_a_long_one():
    short = [step for step in range(200) if default_step(step)]
    assert short == [*range(10), *range(10, 200, 10)]  # 29 points of a 200-step run, not 2
    # 100,000 steps: 1,099 logged against every=100's 1,000: 99 more, all in the first 1,000 steps
    assert logged_steps(default_step, 100_000) == 1099
    assert logged_steps(Schedule.parse(100), 100_000) == 1000
    assert [step for step in range(1000, 100_000) if default_step(step)] == list(range(1000, 100_000, 100))


def test_watch_without_every_logs_the_default_steps_and_pictures_every_100(tmp_path, read_run):
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 6 * 6, 2))
    with actviz.watch(model, tmp_path, options=actviz.Options(quiet=True)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(120):
            optimizer.zero_grad()
            model(torch.randn(2, 1, 8, 8)).square().mean().backward()
            optimizer.step()
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == [*range(10), *range(10, 120, 10)]
    assert run.image_steps("feature_maps/0") == [0, 100]


def test_an_explicit_every_keeps_meaning_exactly_every_n(tmp_path, read_run):
    model = _net()
    with actviz.watch(model, tmp_path, every=7, options=actviz.Options(quiet=True)):
        _train(model, 30)
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 7, 14, 21, 28]


@pytest.mark.usefixtures("both_paths")
def test_the_loss_each_backward_starts_from_is_logged_as_the_loop_computed_it(tmp_path, read_run):
    model = _net()
    with actviz.watch(model, tmp_path, every=3, options=actviz.Options(quiet=True)):
        losses = _train(model, 10)
    events = read_run(tmp_path).scalar_events(LOSS)
    assert [event.step for event in events] == [0, 3, 6, 9]
    np.testing.assert_allclose([event.value for event in events], [losses[step] for step in (0, 3, 6, 9)],
                               rtol=1e-6)  # float32 in the event file


def test_the_loss_adds_no_op_and_no_sync_on_the_accelerator_path(monkeypatch):
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    monkeypatch.setenv("ACTVIZ_FUSED", "0")
    counts = []
    for statistics in (["moments"], ["moments", "loss"]):
        model = _net()
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, statistics=statistics,
                          options=actviz.Options(quiet=True)) as viz:
            _train(model, 1)  # step 0 warms up
            viz.flush()
            inputs, targets = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with CountOps() as count:
                nn.functional.cross_entropy(model(inputs), targets).backward()
                optimizer.step()
                viz.flush()  # the writer thread's half is not counted: the mode is thread-local
        assert (LOSS in viz.latest.scalars) == ("loss" in statistics)
        counts.append(count)
    assert counts[0].syncs == counts[1].syncs == []
    assert Counter(counts[0].kernels) == Counter(counts[1].kernels)  # a row of the step's one packed copy


def test_the_loss_of_a_scaled_backward_is_divided_by_the_scale(tmp_path, read_run):
    model = _net()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with actviz.watch(model, tmp_path, every=2, options=actviz.Options(quiet=True, grad_scaler=scaler)):
        losses = _train(model, 4, scaler)
    run = read_run(tmp_path)
    assert run.scalar(LOSS, 2) == pytest.approx(losses[2], rel=1e-6)
    assert run.scalar("amp/grad_scale", 2) == 1024.0


def test_no_loss_from_autograd_grad_nor_with_the_users_own_writer_nor_when_left_out(tmp_path, read_run):
    from torch.utils.tensorboard import SummaryWriter

    model = _net()
    with actviz.watch(model, tmp_path / "grad", every=1, options=actviz.Options(quiet=True)) as viz:
        loss = model(torch.randn(2, 4)).sum()
        torch.autograd.grad(loss, list(model.parameters()))  # not a backward call: nothing to read
        viz.flush()
    assert LOSS not in viz.latest.scalars
    writer = SummaryWriter(tmp_path / "own")  # the user logs their own loss there: actviz adds none
    with actviz.watch(model, sink=writer, every=1, options=actviz.Options(quiet=True)):
        _train(model, 2)
    writer.close()
    assert LOSS not in read_run(tmp_path / "own").scalar_tags
    with actviz.watch(model, sink=SummaryWriter(tmp_path / "named"), every=1, statistics=["default", "loss"],
                      options=actviz.Options(quiet=True)):
        _train(model, 2)  # named: logged into the user's writer too
    assert len(read_run(tmp_path / "named").scalar_events(LOSS)) == 2
    with actviz.watch(model, tmp_path / "off", every=1, statistics=["moments"], options=actviz.Options(quiet=True)):
        _train(model, 2)
    assert LOSS not in read_run(tmp_path / "off").scalar_tags


def test_a_word_at_start_and_end_through_logging_with_the_fix_for_a_short_run(tmp_path, caplog):
    model = _net()
    caplog.set_level(logging.INFO, logger="actviz")
    with actviz.watch(model, tmp_path / "x", every=100):
        _train(model, 200)
    said = [record.getMessage() for record in caplog.records if record.name == "actviz"]
    start, end = said[0], said[-1]
    assert start.startswith(f"actviz: watching 2 layers of Sequential → {tmp_path / 'x'}, logging every 100 steps")
    assert f"Sequential logged 2 of 200 steps, 0 alerts, 0 dropped → {tmp_path / 'x'}" in end
    assert "only 2 steps were logged, too few for a curve: every=10 logs 20 of these 200 steps" in end
    assert f"tensorboard --logdir {tmp_path} --samples_per_plugin images=100" in end
    assert f"actviz doctor {tmp_path / 'x'}" in end


def test_a_long_enough_run_is_not_told_it_is_short_and_quiet_says_nothing(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="actviz")
    model = _net()
    with actviz.watch(model, tmp_path / "a"):
        _train(model, 30)
    said = [record.getMessage() for record in caplog.records if record.name == "actviz"]
    assert "logging steps 0-9, every 10 up to 990, then every 100 (feature maps every 100 steps)" in said[0]
    assert "logged 12 of 30 steps" in said[-1] and "too few" not in said[-1]
    caplog.clear()
    with actviz.watch(model, tmp_path / "b", options=actviz.Options(quiet=True)):
        _train(model, 2)
    monkeypatch.setenv("ACTVIZ_QUIET", "1")
    with actviz.watch(model, tmp_path / "c"):
        _train(model, 2)
    assert not [record for record in caplog.records if record.name == "actviz"]


def test_the_word_goes_to_a_terminal_where_no_handler_shows_it(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    logger = logging.getLogger("actviz")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)  # no handler anywhere: pytest's own are on the root logger
    model = _net()
    with actviz.watch(model, tmp_path, every=1):
        _train(model, 1)
    err = capsys.readouterr().err
    assert err.startswith("actviz: watching 2 layers of Sequential") and "actviz doctor" in err
