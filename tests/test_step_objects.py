"""The Python objects a logging step creates: counted, never timed.

A logging step of a GPU model is host-bound when it allocates thousands of Python objects:
each costs time, and together they trigger the process's garbage collections. The hooks of a
step are shared objects looked up by module, so adding layers adds handles and results, not
hooks, weak methods and closures.
"""

from __future__ import annotations

import collections
import gc
import tempfile

import pytest
import torch
from torch import nn

import actviz
from actviz.common.owned_hooks import OwnedHook


class HookCensus(nn.Module):
    """An identity layer that records, when it runs, the distinct forward hook objects on its siblings."""

    def __init__(self) -> None:
        super().__init__()
        self.siblings: list[nn.Module] = []
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hooks = {id(hook) for module in self.siblings for hook in module._forward_hooks.values()}
        self.seen.append(len(hooks))
        return x


def mlp(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(8, 8), nn.ReLU()]
    return nn.Sequential(*layers)


def objects_of_open_step(blocks: int) -> collections.Counter[str]:
    """The new gc-tracked objects alive after a logging step's backward, by type, while it waits for its optimizer."""
    model = mlp(blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(4, 8)

    def forward_backward() -> None:
        optimizer.zero_grad()
        model(inputs).square().mean().backward()

    with tempfile.TemporaryDirectory() as runs, actviz.watch(model, runs, every=1, image_every=False) as viz:
        for _ in range(2):  # steady state: every lazy import and cache made
            forward_backward()
            optimizer.step()
            viz.flush()
        gc.collect()
        gc.disable()
        try:
            kept = gc.get_objects()  # held, so that no id of theirs is reused by a new object
            before = {id(thing) for thing in kept}
            forward_backward()
            new = collections.Counter(type(thing).__name__ for thing in gc.get_objects() if id(thing) not in before)
            del kept
        finally:
            gc.enable()
        optimizer.step()
        viz.flush()
        assert "weight_grads/0.weight" in viz.latest.statistics()  # the step counted was a full logging step
    return new


def test_every_layer_shares_one_forward_hook_object() -> None:
    census = HookCensus()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), census, nn.Linear(4, 2))
    census.siblings = [model[0], model[1], model[2], model[3]]
    with tempfile.TemporaryDirectory() as runs, actviz.watch(model, runs, every=2, image_every=False) as viz:
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
        viz.flush()
    assert census.seen == [1, 0, 1]  # steps 0 and 2 log: two watched layers, one hook object; step 1 hooks nothing


@pytest.mark.parametrize("path", ["device", "shortcuts"])
def test_hooks_and_weak_references_do_not_grow_with_the_layers(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0" if path == "device" else "1")
    monkeypatch.setenv("ACTVIZ_FUSED", "0")
    small, large = objects_of_open_step(2), objects_of_open_step(8)
    # Six more blocks: 12 more layers, 12 more parameters. Each used to bring a hook object and a weak
    # method per layer, per output gradient and per parameter (about 42 objects a block in all).
    assert large["OwnedHook"] == small["OwnedHook"] <= 3
    assert large["WeakMethod"] == small["WeakMethod"] <= 3
    per_block = (sum(large.values()) - sum(small.values())) / 6
    assert per_block <= 32, (per_block, large - small)


def test_a_shared_hook_ignores_what_it_was_not_attached_for() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    stranger = nn.Linear(2, 2)
    with tempfile.TemporaryDirectory() as runs, actviz.watch(model, runs, every=1, image_every=False) as viz:
        shared = []
        pre = model[0].register_forward_pre_hook(
            lambda module, args: shared.extend(h for h in model[0]._forward_hooks.values() if isinstance(h, OwnedHook)))
        model(torch.randn(1, 2)).sum().backward()
        pre.remove()
        assert len(shared) == 1
        shared[0](stranger, (torch.ones(5, 2),), torch.ones(5, 2))  # a module sharing the hook dict by a shallow copy
        viz.flush()
        assert sorted(viz.latest.activations) == ["0", "2"]
        assert viz.latest.activations["0"].num == 2  # the model's own output, not the stranger's
