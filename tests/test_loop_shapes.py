"""Loops nobody here wrote: what the optimizer applies, several forwards per step, checkpointing.

Each test compares the logged numbers with a twin model run without actviz.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import small_cnn
from torch import nn
from torch.utils.checkpoint import checkpoint

import actviz

pytestmark = pytest.mark.usefixtures("both_paths")  # every number here on the CPU shortcut and the accelerator path


def assert_logged(histogram, tensor: torch.Tensor) -> None:
    values = tensor.detach().double().flatten()
    assert histogram.num == values.numel()
    assert histogram.sum == pytest.approx(values.sum().item(), rel=1e-4, abs=1e-7)
    assert histogram.sum_squares == pytest.approx((values**2).sum().item(), rel=1e-4, abs=1e-12)
    assert (histogram.min, histogram.max) == pytest.approx((values.min().item(), values.max().item()), rel=1e-6)


def batches(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(count)]


def test_gradient_accumulation_logs_the_summed_gradient(tmp_path, read_run):
    model, twin = small_cnn(), small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = batches(2)
    for batch in micro:
        twin(batch).square().mean().backward()
    viz = actviz.watch(model, tmp_path, every=1, auto_step=False)
    viz.set_step(0)
    for batch in micro:
        model(batch).square().mean().backward()
    optimizer.step()  # the gradients it applies: both micro-batches
    viz.close()
    run = read_run(tmp_path)
    for name, param in twin.named_parameters():
        assert_logged(run.histogram(f"weight_grads/{name}", 0), param.grad)


def test_clipping_logs_the_clipped_gradient(tmp_path, read_run):
    model, twin = small_cnn(), small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = batches(1)[0]
    twin(batch).square().mean().mul(100).backward()
    norm = nn.utils.clip_grad_norm_(twin.parameters(), max_norm=0.5)
    assert norm > 0.5  # the clipping changed something
    with actviz.watch(model, tmp_path, every=1):
        model(batch).square().mean().mul(100).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        optimizer.step()
    run = read_run(tmp_path)
    for name, param in twin.named_parameters():
        assert_logged(run.histogram(f"weight_grads/{name}", 0), param.grad)


def test_a_loop_without_optimizer_logs_the_gradient_its_backward_left(tmp_path, read_run):
    model, twin = small_cnn(), small_cnn()
    batch = batches(1)[0]
    twin(batch).sum().backward()
    with actviz.watch(model, tmp_path, every=1):
        model(batch).sum().backward()
        for param in model.parameters():  # a hand-written update that zeroes the gradient in place
            param.data -= 0.1 * param.grad
            param.grad.zero_()
        model(batch)  # the next step starts
    run = read_run(tmp_path)
    assert_logged(run.histogram("weight_grads/0.weight", 0), twin[0].weight.grad)


def capture_output_grads(model: nn.Module, names: list[str]) -> dict[str, list[torch.Tensor]]:
    """Each call's output of each named layer, in call order, with its gradient kept (``.grad``)."""
    found: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for name in names:
        def hook(module, inputs, output, name=name):
            if output.requires_grad:
                output.retain_grad()
                found[name].append(output)
        model.get_submodule(name).register_forward_hook(hook)
    return found


def test_a_siamese_pair_logs_the_gradients_of_its_first_forward(tmp_path, read_run):
    model = small_cnn(inplace=False)
    twin = copy.deepcopy(model)
    outputs = capture_output_grads(twin, ["0", "6"])
    pairs = [batches(2, seed) for seed in range(4)]
    for left, right in pairs:
        (twin(left) - twin(right)).square().mean().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        with actviz.watch(model, tmp_path, every=2):  # steps 0, 2, 4, 6 are the left halves
            for left, right in pairs:
                (model(left) - model(right)).square().mean().backward()
                optimizer.step()
    run = read_run(tmp_path)
    assert run.histogram_steps("gradients/0") == [0, 2, 4, 6]
    for index, step in enumerate([0, 2, 4, 6]):
        for name in ["0", "6"]:
            left_output = outputs[name][2 * index]  # the left half ran first
            assert_logged(run.histogram(f"gradients/{name}", step), left_output.grad)
            assert_logged(run.histogram(f"activations/{name}", step), left_output)


class Generator(nn.Sequential):
    def __init__(self) -> None:
        torch.manual_seed(1)
        super().__init__(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def gan_iterations(generator: nn.Module, steps: int, no_grad_for_discriminator: bool) -> None:
    discriminator = nn.Linear(2, 1)
    g_optimizer = torch.optim.SGD(generator.parameters(), lr=0.01)
    d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.01)
    for iteration in range(steps):
        noise = torch.randn(8, 4, generator=torch.Generator().manual_seed(iteration))
        if no_grad_for_discriminator:
            with torch.no_grad():
                fake = generator(noise)
        else:
            fake = generator(noise).detach()
        d_optimizer.zero_grad()
        discriminator(fake).mean().backward()
        d_optimizer.step()
        g_optimizer.zero_grad()
        (-discriminator(generator(noise)).mean()).backward()
        g_optimizer.step()


def test_a_gan_generator_called_twice_warns_once_with_the_fix(tmp_path, read_run):
    generator = Generator()
    with pytest.warns(RuntimeWarning, match=r"no gradients for step 0.*torch\.no_grad\(\).*auto_step=False") as caught:
        with actviz.watch(generator, tmp_path, every=2):
            gan_iterations(generator, 4, no_grad_for_discriminator=False)
    assert sum("no gradients" in str(w.message) for w in caught) == 1
    assert "gradients/0" not in read_run(tmp_path).histogram_tags


def test_a_gan_generator_logs_its_gradients_when_the_discriminator_step_runs_without_grad(tmp_path, read_run):
    generator = Generator()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with actviz.watch(generator, tmp_path, every=2):
            gan_iterations(generator, 4, no_grad_for_discriminator=True)
    run = read_run(tmp_path)
    assert run.histogram_steps("gradients/0") == [0, 2]
    assert run.histogram_steps("weight_grads/2.weight") == [0, 2]


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.net = small_cnn(inplace=False)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        hidden = self.net[0](x)
        hidden = checkpoint(self.net[1:4], hidden, use_reentrant=self.use_reentrant)
        return self.net[4:](hidden)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_layers_log_their_output_gradients(use_reentrant, tmp_path, read_run):
    model = Checkpointed(use_reentrant)
    twin = small_cnn(inplace=False)
    grads = capture_output_grads(twin, ["2", "3"])
    batch = batches(1)[0]
    twin(batch).square().mean().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with actviz.watch(model, tmp_path, every=1):
            for _ in range(2):
                model(batch).square().mean().backward()
                optimizer.step()
    run = read_run(tmp_path)
    for name in ["2", "3"]:
        assert run.histogram_steps(f"gradients/net.{name}") == [0, 1]
        assert_logged(run.histogram(f"gradients/net.{name}", 0), grads[name][0].grad)
