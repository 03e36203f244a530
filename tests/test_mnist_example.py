"""The one line in pytorch/examples' mnist: 200 steps of its own loop log a curve and its loss, and say so.

The model and ``train()`` are the example's own (tests/examples/mnist_main.py); the data are random tensors of
MNIST's shape, as no data set can be downloaded here, in batches of 2 so that 200 steps take a second or two.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import actviz
from actviz.output.open_watchers import _close_open_watchers

_SPEC = importlib.util.spec_from_file_location("mnist_main", Path(__file__).parent / "examples" / "mnist_main.py")
mnist_main = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mnist_main)

STEPS = 200


@pytest.mark.slow
def test_mnist_with_the_one_line_logs_a_curve_its_loss_and_a_word_at_start_and_end(tmp_path, read_run, caplog,
                                                                                    monkeypatch, capsys):
    caplog.set_level(logging.INFO, logger="actviz")
    computed: list[float] = []  # every loss the example's loop computed, as F.nll_loss returned it
    nll_loss = torch.nn.functional.nll_loss

    def recorded(*args, **kwargs):
        loss = nll_loss(*args, **kwargs)
        computed.append(float(loss.detach().double()))
        return loss

    monkeypatch.setattr(torch.nn.functional, "nll_loss", recorded)
    torch.manual_seed(1)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(STEPS * 2, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (STEPS * 2,), generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=2)
    model = mnist_main.Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    run = tmp_path / "runs" / "mnist"
    actviz.watch(model, run)  # the one line, and nothing else: the watcher is closed at exit
    mnist_main.train(SimpleNamespace(log_interval=10, dry_run=False), model, torch.device("cpu"), loader, optimizer, 1)
    _close_open_watchers()  # what the atexit entry runs when Python exits

    assert len(computed) == STEPS and "Train Epoch: 1 [0/400 (0%)]" in capsys.readouterr().out
    events = read_run(run).scalar_events("loss/backward_root")
    steps = [event.step for event in events]
    assert len(steps) >= 10 and steps == [*range(10), *range(10, STEPS, 10)]
    assert read_run(run).histogram_steps("gradients/fc1") == steps
    np.testing.assert_allclose([event.value for event in events], [computed[step] for step in steps], rtol=1e-6)
    said = [record.getMessage() for record in caplog.records if record.name == "actviz"]
    assert said[0] == (f"actviz: watching 4 layers of Net → {run}, logging steps 0-9, every 10 up to 990, then "
                       "every 100 (feature maps every 100 steps)")
    assert said[-1].splitlines() == [
        f"actviz: Net logged 29 of 200 steps, 0 alerts, 0 dropped → {run}",
        f"  view: tensorboard --logdir {run.parent} --samples_per_plugin images=100",
        f"  check: actviz doctor {run}",
    ]
