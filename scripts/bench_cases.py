"""The setups of scripts/bench_overhead.py's cases: actviz at several schedules and the patterns it is compared with.

Each setup takes the monitored copy (B) and a log folder and returns a :class:`Setup`: what
to run after each timed step, and how to clean up after the case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import actviz
from actviz.selection import select_layers

DEFAULT_EVERY = 100


# -- the cases: each sets up the B side and says what to run after each step and how to clean up --


@dataclass
class Setup:
    """What a case's setup returns. The hooks run inside B's timed step; ``cleanup`` runs after the case."""

    note: str
    cleanup: list[Callable[[], Any]] = field(default_factory=list)
    after_step: Callable[[torch.Tensor], None] | None = None  # called with the loss
    after_backward: Callable[[int], None] | None = None  # called with the step count
    before_measure: Callable[[], None] | None = None  # between warm-up and the measured pairs


def actviz_case(model: nn.Module, log_dir: Path, every: int, **watch_args: Any) -> Setup:
    viz = actviz.watch(model, log_dir, every=every, **watch_args)
    if every != 1:
        return Setup("step 0 logs during warm-up; measured steps log nothing", [viz.close])
    # Wait for the background writer inside B's time, so that its work is charged to B.
    return Setup("every=1: feature maps, activation/gradient/weight/weight-grad histograms, scalars; "
                 "timed until the step is written (viz.flush())", [viz.close], after_step=lambda loss: viz.flush())


def amortised_case(model: nn.Module, log_dir: Path) -> Setup:
    viz = actviz.watch(model, log_dir)  # the default every=100
    # After warm-up the measured steps are 1..N, so N/100 of them log; those are timed until written.
    return Setup("default every=100 over whole periods; total_ratio (ratio of summed times) is the amortised cost",
                 [viz.close], after_step=lambda loss: viz.flush() if (viz.step - 1) % DEFAULT_EVERY == 0 else None,
                 before_measure=lambda: viz.set_step(1))


def tutorial_case(model: nn.Module, log_dir: Path) -> Setup:
    """Forward hooks: make_grid + add_image + add_histogram; full backward hooks: add_histogram; every step."""
    from torch.utils.tensorboard import SummaryWriter
    from torchvision.utils import make_grid

    writer, step = SummaryWriter(str(log_dir)), 0

    def forward(name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        writer.add_histogram(f"activations/{name}", out, step)
        sample = out[0].detach()
        if sample.dim() in (2, 3):  # (C, H, W): one tile per channel; (T, D): one grayscale picture
            tiles = sample.unsqueeze(1) if sample.dim() == 3 else sample.unsqueeze(0)
            writer.add_image(f"feature_maps/{name}", make_grid(tiles, normalize=True, scale_each=True), step)

    def backward(name: str, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        if grad_output and grad_output[0] is not None:
            writer.add_histogram(f"gradients/{name}", grad_output[0], step)

    def next_step(loss: torch.Tensor) -> None:
        nonlocal step
        step += 1

    handles = []
    for name, module in select_layers(model, None):
        handles += [module.register_forward_hook(partial(forward, name)),
                    module.register_full_backward_hook(partial(backward, name))]
    return Setup("make_grid+add_image+add_histogram in forward hooks, add_histogram in full backward hooks",
                 [*(handle.remove for handle in handles), writer.close], after_step=next_step)


def ignite_case(model: nn.Module, log_dir: Path) -> Setup:
    """``add_histogram`` of every parameter and gradient after backward, as ignite's handlers do."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir))

    def log(step: int) -> None:
        for name, param in model.named_parameters():
            writer.add_histogram(f"weights/{name}", param, step)
            if param.grad is not None:
                writer.add_histogram(f"grads/{name}", param.grad, step)

    return Setup("add_histogram of each parameter and its gradient", [writer.close], after_backward=log)


def wandb_case(model: nn.Module, log_dir: Path, log_freq: int) -> Setup:
    import wandb

    run = wandb.init(mode="offline", dir=str(log_dir.parent), project="actviz-bench", name=log_dir.name,
                     settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
    wandb.watch(model, log="all", log_freq=log_freq)
    return Setup(f"log_freq={log_freq}; each step also calls run.log(loss) so the histograms are committed",
                 [lambda: wandb.unwatch(model), run.finish], after_step=lambda loss: run.log({"loss": loss.item()}))
