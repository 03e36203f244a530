"""The diagnosis benchmark's quick subset, and a diverged run named by the alerts and by ``actviz doctor``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import actviz
from actviz.diagnosis.doctor import EXIT_ALERTS, doctor

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


sys.path.insert(0, str(SCRIPTS))
import diagnosis_benchmark  # noqa: E402 - scripts/ holds it


def test_the_quick_subset_has_healthy_and_sick_programs():
    healthy = [name for name in diagnosis_benchmark.QUICK if name in diagnosis_benchmark.HEALTHY]
    sick = [name for name in diagnosis_benchmark.QUICK if name in diagnosis_benchmark.SICK]
    assert len(healthy) >= 2 and len(sick) >= 6  # the full run, scripts/diagnosis_benchmark.py, has 11 and 15
    assert set(diagnosis_benchmark.QUICK) == set(healthy) | set(sick)


# One test per program, so that the suite's workers share them out.
@pytest.mark.slow
@pytest.mark.parametrize("name", diagnosis_benchmark.QUICK)
def test_each_program_of_the_quick_subset_is_judged_right(name):
    outcome = diagnosis_benchmark.run_program(name)
    if not outcome.sick:
        assert outcome.alerts == []  # no false alarm
        return
    assert outcome.happened is not None  # the benchmark's own hooks saw the pathology
    assert outcome.verdict() == "caught", (outcome.right, outcome.alerts)


def test_a_cnn_at_learning_rate_10_is_named_diverged_and_doctor_exits_1(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 32), nn.ReLU(inplace=True), nn.Linear(32, 4))
    images, labels = torch.randn(256, 3, 8, 8), torch.randint(0, 4, (256,))
    optimizer = torch.optim.Adam(model.parameters(), lr=10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=5, image_every=False) as viz:
            for _ in range(60):
                batch = torch.randint(0, len(images), (16,))
                loss = nn.functional.cross_entropy(model(images[batch]), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            viz.flush()
            alerts = viz.alerts
    rules = {alert.rule for alert in alerts}
    assert rules & {"diverged", "exploding_activations", "exploding_gradients"}
    assert min(alert.step for alert in alerts) <= 10  # within two logging steps of the blow-up
    status, report = doctor(tmp_path)
    assert status == EXIT_ALERTS and "exploding" in report
