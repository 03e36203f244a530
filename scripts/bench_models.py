"""The models that scripts/bench_overhead.py times, each with four fixed batches, and their training step."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

MODELS = ["cnn", "alexnet", "transformer"]
Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class SmallVGG(nn.Module):
    """Five conv-BN-ReLU blocks and two linear layers: a small CNN on 32x32 pictures."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()

        def block(c_in: int, c_out: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]

        self.features = nn.Sequential(
            *block(3, 32), *block(32, 32), nn.MaxPool2d(2),
            *block(32, 64), *block(64, 64), nn.MaxPool2d(2),
            *block(64, 128), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SmallTransformer(nn.Module):
    """An embedding, two encoder layers (d=128) and a linear head over the mean token."""

    def __init__(self, vocab: int = 1000, d_model: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def _no_inplace(model: nn.Module) -> nn.Module:
    # The tutorial pattern's full backward hooks raise on in-place ReLU (pytorch#61519);
    # every case uses the same non-inplace model so the comparison is like for like.
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return model


def build_model(name: str, device: torch.device) -> tuple[nn.Module, Batches, str]:
    """The model on ``device``, a batch maker ``i -> (input, target)`` and a description."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "cnn":
        model, description = SmallVGG(), "small VGG-style CNN, 32x32, batch 64"
        inputs = [torch.randn((64, 3, 32, 32), generator=generator) for _ in range(4)]
    elif name == "alexnet":
        from torchvision.models import alexnet

        model, description = alexnet(num_classes=10), "torchvision alexnet(num_classes=10), 64x64, batch 16"
        inputs = [torch.randn((16, 3, 64, 64), generator=generator) for _ in range(4)]
    elif name == "transformer":
        model, description = SmallTransformer(), "TransformerEncoder 2 layers d=128, seq 32, batch 32"
        inputs = [torch.randint(0, 1000, (32, 32), generator=generator) for _ in range(4)]
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    targets = [torch.randint(0, 10, (len(batch),), generator=generator) for batch in inputs]
    data = [(x.to(device), y.to(device)) for x, y in zip(inputs, targets)]
    return _no_inplace(model).to(device), lambda i: data[i % 4], description


class Trainer:
    """One model with its optimizer; :meth:`step` is one timed training step, run after by ``after_*``."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model.train(), device
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.after_backward: Callable[[int], None] | None = None
        self.after_step: Callable[[torch.Tensor], None] | None = None
        self.count = 0

    def step(self, data: tuple[torch.Tensor, torch.Tensor]) -> float:
        inputs, targets = data
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(inputs), targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.after_backward is not None:
            self.after_backward(self.count)
        self.optimizer.step()
        if self.after_step is not None:
            self.after_step(loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # device work is asynchronous: wait for it before reading the clock
        self.count += 1
        return time.perf_counter() - start
