"""torch.compile: logging steps run eagerly, so actviz adds no graph and hits no recompile limit.

Compiled with ``backend="aot_eager"``, which needs no C++ compiler. Graphs are counted with
``torch._dynamo.utils.counters``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torchvision
from conftest import NO_HOOKS, hooks_left

import actviz

STEPS, EVERY = 13, 4


def train(target: torch.nn.Module, model: torch.nn.Module, after_step=None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        loss = torch.nn.functional.cross_entropy(target(inputs), torch.tensor([1, 2]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(step)


def compiled_resnet(style: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(what the loop calls, the plain module)`` for ``torch.compile(model)`` or ``model.compile()``."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    if style == "torch.compile(model)":
        return torch.compile(model, backend="aot_eager"), model
    model.compile(backend="aot_eager")
    return model, model


def graph_counts() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())


@pytest.mark.parametrize("style", ["torch.compile(model)", "model.compile()"])
def test_compiled_models_log_the_right_layers_and_compile_nothing_new(style, tmp_path, read_run):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    target, model = compiled_resnet(style)
    train(target, model)
    bare_graphs, _ = graph_counts()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    target, model = compiled_resnet(style)
    after_logging_steps: dict[int, int] = {}
    compiled_call = model._compiled_call_impl  # model.compile()'s, which actviz wraps while it watches
    viz = actviz.watch(target, tmp_path, every=EVERY)
    assert len(viz.layer_names) >= 30 and viz.layer_names[0] == "conv1"  # plain names, no "_orig_mod."
    train(target, model, after_step=lambda step: after_logging_steps.__setitem__(step, graph_counts()[0]))
    viz.close()

    graphs, recompiles = graph_counts()
    assert graphs <= bare_graphs + 2
    assert recompiles == 0  # so the recompile limit is never near
    assert after_logging_steps[4] == after_logging_steps[12]  # nothing compiled after the second logging step
    assert hooks_left(model) == {**NO_HOOKS}
    assert model._compiled_call_impl is compiled_call  # put back
    run = read_run(tmp_path)
    for layer in ("conv1", "layer1.0.bn2", "layer4.1.conv2", "fc"):
        assert run.histogram_steps(f"activations/{layer}") == [0, 4, 8, 12]
        assert run.histogram_steps(f"gradients/{layer}") == [0, 4, 8, 12]
    assert run.histogram_steps("weight_grads/fc.weight") == [0, 4, 8, 12]


def test_the_compiled_model_gives_what_the_eager_one_gives(tmp_path, read_run):
    torch.manual_seed(0)
    eager = torchvision.models.resnet18(num_classes=10)
    compiled_source = torchvision.models.resnet18(num_classes=10)
    compiled_source.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_source, backend="aot_eager")
    for module, folder in ((eager, "eager"), (compiled, "compiled")):
        with actviz.watch(module, tmp_path / folder, every=1):
            torch.nn.functional.cross_entropy(module(torch.ones(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    a, b = read_run(tmp_path / "eager"), read_run(tmp_path / "compiled")
    assert a.histogram_tags == b.histogram_tags
    for tag in ("activations/conv1", "gradients/layer2.0.conv1", "weight_grads/fc.weight"):
        assert a.histogram(tag, 0).sum_squares == pytest.approx(b.histogram(tag, 0).sum_squares, rel=1e-5)


def test_a_torch_whose_dynamo_folds_is_exporting_to_true_still_counts_compiled_steps(tmp_path, monkeypatch, read_run):
    # torch 2.11's Dynamo folds torch.compiler.is_exporting() to True under torch.compile too (2.14 reads the
    # flag). A model compiled after watch() then ran without its step op: no step counted, nothing logged after
    # step 0. Here that torch is played by an is_exporting that answers True whenever Dynamo traces.
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling())
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    viz = actviz.watch(model, tmp_path, every=3)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for _ in range(8):
        optimizer.zero_grad()
        compiled(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
    viz.close()
    torch._dynamo.reset()
    assert viz.step == 8
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 3, 6]
