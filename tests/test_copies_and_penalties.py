"""Backward passes that do not train, replicas, custom copies and models that pickle their own way (issue 41).

A gradient penalty's ``torch.autograd.grad`` is not the layers' training gradient; a ``DataParallel``
replica and a class's own ``__copy__`` never unhook or stand for the original; a model whose class
pickles its own way saves and loads while watched.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import NO_HOOKS, hooks_left, train
from torch import nn

import actviz
from actviz.common._internals import backward_accumulates, backward_pass_id

# -- the gradient of the backward that trains ---------------------------------------------------------------------


def critic() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


class TrainingGradients:
    """The gradient with respect to each Linear's output, by hand: tensor hooks, kept only in the training backward."""

    def __init__(self, model: nn.Sequential) -> None:
        self.training = False
        self.calls: list[dict[str, float]] = []  # one per forward call of the model: layer -> gradient norm
        self._model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        norms: dict[str, float] = {}
        self.calls.append(norms)
        output = batch
        for name, layer in self._model.named_children():
            output = layer(output)
            if isinstance(layer, nn.Linear):
                output.register_hook(lambda grad, name=name: self._keep(norms, name, grad))
        return output

    def _keep(self, norms: dict[str, float], name: str, grad: torch.Tensor) -> None:
        if self.training:
            norms[name] = grad.double().norm().item()


def wgan_gp_critic_steps(model: nn.Sequential, iterations: int, forward=None) -> None:
    """The critic's half of WGAN-GP (Gulrajani et al. 2017): its loss plus 10 times the gradient penalty."""
    forward = forward or model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.0, 0.9))
    generator = torch.Generator().manual_seed(1)
    for _ in range(iterations):
        real = torch.randn(64, 2, generator=generator) + 3
        fake = torch.randn(64, 2, generator=generator)  # a generator's output, detached
        optimizer.zero_grad()
        critic_loss = forward(fake).mean() - forward(real).mean()
        alpha = torch.rand(64, 1, generator=generator)
        interpolated = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (slopes,) = torch.autograd.grad(forward(interpolated).sum(), interpolated, create_graph=True)
        penalty = ((slopes.norm(2, dim=1) - 1) ** 2).mean()
        training = getattr(forward, "__self__", None)
        if training is not None:
            training.training = True
        (critic_loss + 10 * penalty).backward()
        if training is not None:
            training.training = False
        optimizer.step()


def test_a_gradient_penalty_is_not_logged_as_the_critics_training_gradient(tmp_path, read_run):
    model, alerts = critic(), []
    twin = critic()
    by_hand = TrainingGradients(twin)
    wgan_gp_critic_steps(twin, 12, forward=by_hand.forward)
    # every=2: the critic's three forwards of an iteration (fake, real, the penalty's) each get logged
    with actviz.watch(model, tmp_path, every=2, image_every=False, on_alert=alerts.append) as viz:
        wgan_gp_critic_steps(model, 12)
    assert viz.step == 36
    run = read_run(tmp_path)
    for step in range(0, 36, 2):
        expected = by_hand.calls[step]
        for layer in ("0", "2", "4"):
            logged = [event for event in run.histogram_events(f"gradients/{layer}") if event.step == step]
            if layer not in expected:  # the training backward does not reach the penalty's last output
                assert logged == [], (step, layer)
                continue
            norm = logged[0].histogram_value.sum_squares ** 0.5
            assert norm == pytest.approx(expected[layer], rel=1e-5, abs=1e-12), (step, layer)
    assert by_hand.calls[0]["4"] == pytest.approx(0.125) and "4" not in by_hand.calls[2]  # the penalty's: 8.0
    assert [alert.rule for alert in alerts] == []


def test_input_gradients_and_r1_before_the_backward_are_not_logged(tmp_path):
    model = critic()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with actviz.watch(model, tmp_path, every=1, image_every=False) as viz:
        real = torch.randn(8, 2).requires_grad_(True)
        scores = model(real)
        (r1,) = torch.autograd.grad(scores.sum(), real, create_graph=True)  # R1 (Mescheder et al. 2018)
        (grads_of_params := torch.autograd.grad(scores.sum(), list(model.parameters()), retain_graph=True))
        assert len(grads_of_params) == 6
        (scores.mean() + r1.square().sum()).backward()
        training = model[4].weight.grad.clone()
        optimizer.step()
        viz.flush()
    # the output's gradient of the training loss: d(mean)/d(score) = 1/8 each, as R1's term has none for it
    assert viz.latest.gradients["4"].sum == pytest.approx(1.0)
    assert viz.latest.gradients["4"].sum_squares == pytest.approx(8 / 64)
    assert viz.latest.weight_grads["4.weight"].sum == pytest.approx(float(training.sum()), rel=1e-6)


class GatheredCopy(nn.Module):
    """A layer whose forward uses a gathered copy of its weight, a leaf of its own, as FSDP's does."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, 2))
        self.gathered = torch.ones(1, 2, requires_grad=True)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(batch, self.gathered)


def test_a_backward_into_leaves_actviz_does_not_see_is_still_the_training_one(tmp_path):
    model = nn.Sequential(GatheredCopy())
    with actviz.watch(model, tmp_path, every=1, image_every=False) as viz:
        model(torch.ones(3, 2)).sum().backward()
        viz.flush()
    assert viz.latest.gradients["0"].sum == pytest.approx(3.0)


def test_the_engine_query_tells_a_training_backward_from_autograd_grad():
    # backward_accumulates' assumptions about torch._C._will_engine_execute_node
    layer = nn.Linear(2, 1)
    answers: list[object] = []
    batch = torch.ones(1, 2, requires_grad=True)

    def ask(output: torch.Tensor) -> None:
        output.grad_fn.register_prehook(lambda grads: answers.append((backward_pass_id(), backward_accumulates(
            list(layer.parameters())))))

    for run in ("backward", "grad of the input", "grad of the parameters", "backward of the input"):
        output = layer(batch)
        ask(output)
        if run == "backward":
            output.sum().backward()
        elif run == "grad of the input":
            torch.autograd.grad(output.sum(), batch)
        elif run == "grad of the parameters":
            torch.autograd.grad(output.sum(), list(layer.parameters()))
        else:
            output.sum().backward(inputs=[batch])
    assert [answer for _, answer in answers] == [True, False, False, False]
    assert len({number for number, _ in answers}) == 4  # each pass its own number


# -- replicas and copies never unhook or stand for the original ---------------------------------------------------


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class CopiesItself(nn.Sequential):
    """A model with its own ``__copy__``: a new object with the same ``__dict__`` entries."""

    def __copy__(self) -> CopiesItself:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new


def test_a_replica_that_shares_the_hook_dicts_leaves_the_original_watched(tmp_path, read_run):
    model = mlp()
    with actviz.watch(model, tmp_path, every=1) as viz:
        train(model)
        replica = model._replicate_for_data_parallel()  # what torch.nn.parallel.replicate makes, per forward
        assert replica._forward_pre_hooks is model._forward_pre_hooks
        train(replica)
        del replica
        train(model, 2)
        assert viz.step == 3  # the original's forwards, not the replica's
    assert hooks_left(model) == NO_HOOKS
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2]


def test_a_copy_made_by_the_class_pickles_itself_and_leaves_the_original_watched(tmp_path, read_run):
    model = CopiesItself(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with actviz.watch(model, tmp_path, every=1) as viz:
        train(model)
        twin = copy.copy(model)
        twin._modules = dict(twin._modules, extra=nn.Identity())  # the copy now differs from the original
        loaded = pickle.loads(pickle.dumps(twin))
        assert list(loaded._modules) == ["0", "1", "2", "extra"]  # the copy's modules, not the original's
        train(twin)
        train(loaded)
        assert "__getstate__" not in vars(twin) and "__getstate__" not in vars(loaded)
        train(model, 2)
        assert viz.step == 3
    assert hooks_left(model) == NO_HOOKS
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2]


# -- models that pickle their own way save and load while watched -------------------------------------------------


class TupleState(nn.Sequential):
    def __getstate__(self) -> tuple[dict, int]:
        return (self.__dict__.copy(), 1)

    def __setstate__(self, state: tuple[dict, int]) -> None:
        self.__dict__.update(state[0])


def rebuild(cls: type, state: dict) -> nn.Module:
    model = cls.__new__(cls)
    model.__dict__.update(state)
    return model


class OwnReduce(nn.Sequential):
    def __reduce__(self) -> tuple:
        return (rebuild, (type(self), self.__dict__))


@pytest.mark.parametrize("kind", ["tuple __getstate__", "own __reduce__", "torch.fx.GraphModule"])
def test_a_model_that_pickles_its_own_way_saves_and_loads_unwatched(kind, tmp_path, read_run):
    if kind == "torch.fx.GraphModule":
        model = torch.fx.symbolic_trace(mlp())
    else:
        model = (TupleState if kind == "tuple __getstate__" else OwnReduce)(*mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with actviz.watch(model, tmp_path, every=1) as viz:
        train(model)
        for when in ("between steps", "during a step"):
            output = model(torch.randn(3, 4)) if when == "during a step" else None  # a step's hooks are on the model
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
            train(loaded, 2)  # unwatched: its forwards are no steps of the original's
            assert hooks_left(loaded) == NO_HOOKS
            if output is not None:
                output.square().mean().backward()
                optimizer.step()
        train(model)
        assert viz.step == 3
    assert hooks_left(model) == NO_HOOKS
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2]


# -- a compiled optimizer.step does not trace actviz's hooks ------------------------------------------------------


@pytest.mark.slow  # compiles the optimizer's step: about 5 s
def test_a_compiled_optimizer_step_runs_actvizs_hooks_eagerly_and_compiles_one_graph(tmp_path, read_run):
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = torch.compile(optimizer.step, backend=backend)
    with actviz.watch(model, tmp_path, every=2, extras=[actviz.Spikes()]) as viz:
        for _ in range(12):  # the spike recorder writes a new slot of its ring at every step
            optimizer.zero_grad()
            model(torch.randn(3, 4)).square().mean().backward()
            step()
        assert viz.step == 12
    torch._dynamo.reset()
    assert len(graphs) == 1  # the update alone: no recorder of actviz's compiled, nothing recompiled
    assert not any("ring" in str(node.target) or "slot" in str(node.target) for node in graphs[0].graph.nodes)
    assert read_run(tmp_path).histogram_steps("weight_grads/0.weight") == list(range(0, 12, 2))
