"""Shared test helpers: small models and reading TensorBoard event files back."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from actviz.tags import TENSORBOARD_PREFIX, pattern_of

DATA_DIR = Path(__file__).parent / "data"

pytest_plugins = ["quick_lane"]  # pytest --quick: all but the slow tests (tests/quick_lane.py)


class Run:
    """Everything a run folder holds, read with TensorBoard's own EventAccumulator.

    Tags are actviz's names (``activations/0``). TensorBoard holds actviz's scalars, histograms and
    images under ``~`` + name (:func:`actviz.tags.tensorboard_tag`); this reads them by actviz's name,
    and fails on a run where one of actviz's tags lacks the ``~`` (test_tags.py and
    test_tensorboard_server.py check TensorBoard's own names). Other tags (a user's ``loss``, the texts)
    are read as they are; ``events`` is the accumulator itself, by TensorBoard's names.
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.events = EventAccumulator(str(log_dir), size_guidance={"images": 0, "histograms": 0, "scalars": 0})
        self.events.Reload()
        tags = self.events.Tags()
        self._tensorboard_tags: dict[str, str] = {}  # actviz's name -> TensorBoard's
        for kind in ("images", "histograms", "scalars"):
            for tag in tags[kind]:
                name = tag.removeprefix(TENSORBOARD_PREFIX)
                assert name != tag or pattern_of(tag) is None, f"actviz's {kind} tag {tag!r} is written without '~'"
                self._tensorboard_tags[name] = tag
        self.image_tags = {tag.removeprefix(TENSORBOARD_PREFIX) for tag in tags["images"]}
        self.histogram_tags = {tag.removeprefix(TENSORBOARD_PREFIX) for tag in tags["histograms"]}
        self.scalar_tags = {tag.removeprefix(TENSORBOARD_PREFIX) for tag in tags["scalars"]}

    def tensorboard_tag(self, tag: str) -> str:
        """TensorBoard's name of ``tag`` in this run (``tag`` itself when the run lacks it)."""
        return self._tensorboard_tags.get(tag, tag)

    def histogram_events(self, tag: str) -> list:
        return self.events.Histograms(self.tensorboard_tag(tag))

    def histogram_steps(self, tag: str) -> list[int]:
        return [event.step for event in self.histogram_events(tag)]

    def histogram(self, tag: str, step: int):
        (value,) = [event.histogram_value for event in self.histogram_events(tag) if event.step == step]
        return value

    def scalar_events(self, tag: str) -> list:
        return self.events.Scalars(self.tensorboard_tag(tag))

    def scalar(self, tag: str, step: int) -> float:
        (value,) = [event.value for event in self.scalar_events(tag) if event.step == step]
        return value

    def image_steps(self, tag: str) -> list[int]:
        return [event.step for event in self.events.Images(self.tensorboard_tag(tag))]

    def image(self, tag: str, step: int) -> np.ndarray:
        (event,) = [event for event in self.events.Images(self.tensorboard_tag(tag)) if event.step == step]
        image = Image.open(io.BytesIO(event.encoded_image_string))
        array = np.asarray(image.convert("RGB") if image.mode == "P" else image)  # a heat map: palette indices
        assert array.shape[:2] == (event.height, event.width)
        return array


@pytest.fixture
def read_run():
    return Run


#: The summaries' code paths, as the environment picks them (read at every call): the CPU's NumPy shortcut,
#: the accelerator path run on the CPU (the GPU's torch ops, packing and one copy), and the compiled one.
CODE_PATHS = {
    "shortcuts": {"ACTVIZ_CPU_SHORTCUTS": "1", "ACTVIZ_FUSED": "0"},
    "device": {"ACTVIZ_CPU_SHORTCUTS": "0", "ACTVIZ_FUSED": "0"},
    "fused": {"ACTVIZ_CPU_SHORTCUTS": "0", "ACTVIZ_FUSED": "1"},
}


def use_code_path(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Set the environment that picks code path ``name`` of :data:`CODE_PATHS` for one test."""
    for variable, value in CODE_PATHS[name].items():
        monkeypatch.setenv(variable, value)  # spawned processes (test_distributed) inherit it
    return name


@pytest.fixture(params=["shortcuts", "device"])
def both_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a value test on the CPU shortcut and on the accelerator path: ``@pytest.mark.usefixtures("both_paths")``."""
    return use_code_path(request.param, monkeypatch)


@pytest.fixture(params=["shortcuts", "device", "fused"])
def every_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The core value tests, on the compiled path too (compiling on the CPU takes seconds per graph: keep them few)."""
    return use_code_path(request.param, monkeypatch)


def small_cnn(inplace: bool = True) -> nn.Sequential:
    """Conv-ReLU(in place)-Conv-BN-ReLU-Linear, like the torchvision models in miniature."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(6, 5, 3, stride=2, padding=1),
        nn.BatchNorm2d(5),
        nn.ReLU(inplace=inplace),
        nn.Flatten(),
        nn.Linear(5 * 4 * 4, 3),
    )


def train(model: nn.Module, steps: int = 1, inputs=None, lr: float = 0.01, optimizer: bool = True) -> None:
    """``steps`` training steps of ``model`` on the loss ``model(x).square().mean()``, with SGD at ``lr`` unless
    ``optimizer=False`` (backward only). ``x``: ``inputs(step)`` if it is callable, ``inputs[step]`` if it is a list,
    else a fresh ``torch.randn(3, 4)``."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr) if optimizer else None
    for step in range(steps):
        if sgd is not None:
            sgd.zero_grad()
        if inputs is None:
            batch = torch.randn(3, 4)
        else:
            batch = inputs(step) if callable(inputs) else inputs[step]
        model(batch).square().mean().backward()
        if sgd is not None:
            sgd.step()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, batch: int = 4, size: int = 8) -> torch.Tensor:
    inputs = torch.randn(batch, 3, size, size)
    loss = model(inputs).square().mean()
    if optimizer is not None:
        optimizer.zero_grad()
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


def hooks_left(model: nn.Module) -> dict[str, int]:
    """Count every hook actviz could have left on the model, its modules and its parameters."""
    counts = {"forward": 0, "forward_pre": 0, "backward": 0, "backward_pre": 0, "param": 0}
    for module in model.modules():
        counts["forward"] += len(module._forward_hooks)
        counts["forward_pre"] += len(module._forward_pre_hooks)
        counts["backward"] += len(module._backward_hooks)
        counts["backward_pre"] += len(module._backward_pre_hooks)
    for param in model.parameters():
        counts["param"] += len(getattr(param, "_post_accumulate_grad_hooks", None) or {})
        counts["param"] += len(param._backward_hooks or {})
    return counts


def optimizer_listeners() -> int:
    """How many open logging steps (of every watcher in the process) wait for an optimizer step."""
    from actviz.common import optimizer_steps

    return len(optimizer_steps._listeners)


NO_HOOKS = {"forward": 0, "forward_pre": 0, "backward": 0, "backward_pre": 0, "param": 0}


#: aten ops that make the host wait for a device (on CUDA): .item()/.tolist(), data-dependent sizes, and
#: a tensor made from Python numbers (``torch.tensor([...])``, ``t[i] = 0.5``), which reaches a GPU by a
#: blocking copy from pageable memory (an H200 showed one per large tensor, tests/test_cuda.py).
SYNCING = {
    "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
    "aten.bincount.default", "aten.unique.default", "aten._unique2.default", "aten.histc.default",
    "aten.repeat_interleave.Tensor", "aten.unique_consecutive.default", "aten.item.default",
    "aten.lift_fresh.default",
}


class CountOps(TorchDispatchMode):
    """Kernel-launching ops (views left out) and host-syncing ops dispatched on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[str] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNCING:
            self.syncs.append(str(func))
        if not func.is_view:
            self.kernels.append(str(func))
        return func(*args, **(kwargs or {}))
