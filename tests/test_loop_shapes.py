"""Loops nobody here wrote: what the optimizer applies, several forwards per step, checkpointing.

Each test compares the logged numbers with a twin model run without actviz.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

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
    viz = actviz.watch(model, tmp_path, every=1, options=actviz.Options(auto_step=False))
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


# -- pytorch/examples loop shapes, condensed ---------------------------------------------------------------------


def dcgan_nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(3)
    generator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    return generator, discriminator


def dcgan(generator: nn.Module, discriminator: nn.Module, iterations: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """pytorch/examples dcgan's loop; returns the gradients each optimizer applied, per iteration."""
    criterion = nn.BCEWithLogitsLoss()
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3)
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=2e-3)
    applied: dict[str, list[dict[str, torch.Tensor]]] = {"D": [], "G": []}
    data = torch.Generator().manual_seed(0)
    for _ in range(iterations):
        real, noise = torch.randn(5, 6, generator=data), torch.randn(5, 4, generator=data)
        discriminator.zero_grad()
        criterion(discriminator(real), torch.ones(5, 1)).backward()
        fake = generator(noise)
        criterion(discriminator(fake.detach()), torch.zeros(5, 1)).backward()
        applied["D"].append({name: p.grad.clone() for name, p in discriminator.named_parameters()})
        optimizer_d.step()
        generator.zero_grad()
        criterion(discriminator(fake), torch.ones(5, 1)).backward()  # the generator's update, through D
        applied["G"].append({name: p.grad.clone() for name, p in generator.named_parameters()})
        optimizer_g.step()
    return applied


@pytest.mark.parametrize("every", [1, 2])
def test_dcgan_both_nets_watched_log_what_each_optimizer_applies(every, tmp_path, read_run):
    expected = dcgan(*dcgan_nets(), iterations=4)
    generator, discriminator = dcgan_nets()
    with pytest.warns(RuntimeWarning, match="no weight_grads for step 2") as caught:
        with actviz.watch(generator, tmp_path / "G", every=every), \
                actviz.watch(discriminator, tmp_path / "D", every=every):
            dcgan(generator, discriminator, iterations=4)
    assert sum("no weight_grads" in str(w.message) for w in caught) == 1
    run_d, run_g = read_run(tmp_path / "D"), read_run(tmp_path / "G")
    # D takes three forwards per iteration: real (3i), fake (3i + 1), the generator's update (3i + 2).
    logged = run_d.histogram_steps("weight_grads/0.weight")
    assert logged == [step for step in range(12) if step % every == 0 and step % 3 != 2]
    for step in logged:  # real and fake batches both: what optimizerD.step() applied
        for name, grad in expected["D"][step // 3].items():
            assert_logged(run_d.histogram(f"weight_grads/{name}", step), grad)
    assert run_d.histogram_steps("activations/0") == list(range(0, 12, every))
    assert run_g.histogram_steps("weight_grads/0.weight") == list(range(0, 4, every))
    for step in run_g.histogram_steps("weight_grads/0.weight"):
        for name, grad in expected["G"][step].items():
            assert_logged(run_g.histogram(f"weight_grads/{name}", step), grad)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.affine1 = nn.Linear(4, 16)
        self.affine2 = nn.Linear(16, 2)

    def forward(self, x):
        return torch.softmax(self.affine2(torch.relu(self.affine1(x))), dim=1)


def reinforce(policy: nn.Module, episodes: list[int]) -> list[dict[str, torch.Tensor]]:
    """pytorch/examples reinforce.py's shape: one forward per action, one backward and step per episode."""
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    applied = []
    for length in episodes:
        log_probs, rewards = [], []
        for _ in range(length):
            probs = policy(torch.randn(1, 4, generator=data))
            action = torch.multinomial(probs, 1, generator=data).item()
            log_probs.append(torch.log(probs[0, action]))
            rewards.append(torch.rand((), generator=data).item())
        returns = torch.tensor(rewards).flip(0).cumsum(0).flip(0)
        loss = torch.stack([-lp * r for lp, r in zip(log_probs, returns)]).sum()
        optimizer.zero_grad()
        loss.backward()
        applied.append({name: p.grad.clone() for name, p in policy.named_parameters()})
        optimizer.step()
    return applied


def test_reinforce_episode_spanning_two_multiples_of_the_default_every(tmp_path, read_run):
    episodes = [90, 130]  # the second episode holds steps 100 and 200
    expected = reinforce(Policy(), episodes)
    policy = Policy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with actviz.watch(policy, tmp_path, every=100):
            reinforce(policy, episodes)
    run = read_run(tmp_path)
    assert run.histogram_steps("weight_grads/affine1.weight") == [0, 100, 200]
    for step, episode in [(0, 0), (100, 1), (200, 1)]:  # each step's gradient: its episode's, as Adam applied it
        for name, grad in expected[episode].items():
            assert_logged(run.histogram(f"weight_grads/{name}", step), grad)


def test_a_two_forward_siamese_step_logs_the_applied_weight_gradients(tmp_path, read_run):
    model = small_cnn(inplace=False)
    twin = copy.deepcopy(model)
    pairs = [batches(2, seed) for seed in range(3)]
    expected = []
    for left, right in pairs:
        twin.zero_grad()
        (twin(left) - twin(right)).square().mean().backward()
        expected.append({name: p.grad.clone() for name, p in twin.named_parameters()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with actviz.watch(model, tmp_path, every=1):  # both halves are steps; both wait for the one backward
        for left, right in pairs:
            optimizer.zero_grad()
            (model(left) - model(right)).square().mean().backward()
            optimizer.step()
    run = read_run(tmp_path)
    assert run.histogram_steps("weight_grads/0.weight") == list(range(6))
    for step in range(6):
        for name, grad in expected[step // 2].items():
            assert_logged(run.histogram(f"weight_grads/{name}", step), grad)


class TinyLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.rnn, self.decoder = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.rnn(self.embedding(tokens))[0])


def word_language_model(model: nn.Module, epochs: int, save_to=None) -> list[dict[str, torch.Tensor]]:
    """pytorch/examples' word_language_model: no optimizer, clipping, an update by hand, the model saved whole."""
    tokens = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(0))
    backward_left = []
    for _epoch in range(epochs):
        for _ in range(2):
            model.zero_grad()
            output = model(tokens[:, :-1])
            nn.functional.cross_entropy(output.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            backward_left.append({name: p.grad.clone() for name, p in model.named_parameters()})
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-20.0)
        if save_to is not None:
            with open(save_to, "wb") as file:  # as the example does with the best model
                torch.save(model, file)
    return backward_left


def test_word_language_model_updates_by_hand_and_its_saved_model_loads_with_weights_only(tmp_path, read_run):
    torch.manual_seed(0)
    model = TinyLanguageModel()
    twin = copy.deepcopy(model)
    expected = word_language_model(twin, epochs=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the loop uses the gradients its backward made
        with actviz.watch(model, tmp_path / "run", every=2) as viz:
            word_language_model(model, epochs=3, save_to=tmp_path / "model.pt")
            # torch.load's default since torch 2.6, trusting the model's own classes as the example does: no actviz name
            with torch.serialization.safe_globals([TinyLanguageModel, nn.Embedding, nn.LSTM, nn.Linear]):
                loaded = torch.load(tmp_path / "model.pt")
            loaded(torch.zeros(1, 3, dtype=torch.long)).sum().backward()  # the saved model trains, unwatched
            assert viz.step == 6
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), model.state_dict().values()))
    assert len(loaded._forward_pre_hooks) == 0 and "__getstate__" not in vars(loaded)
    run = read_run(tmp_path / "run")
    assert run.histogram_steps("activations/decoder") == [0, 2, 4]
    assert run.histogram_steps("weight_grads/decoder.weight") == [0, 2, 4]  # none were logged before
    for step in (0, 2, 4):
        for name, grad in expected[step].items():  # as the backward left them, before clipping
            assert_logged(run.histogram(f"weight_grads/{name}", step), grad)


def test_an_ema_teacher_from_averaged_model_is_not_watched(tmp_path, read_run):
    student = small_cnn()
    teacher = torch.optim.swa_utils.AveragedModel(
        student, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    with actviz.watch(student, tmp_path, every=1) as viz:
        for batch in batches(3):
            optimizer.zero_grad()
            with torch.no_grad():
                target = teacher(batch)  # the teacher's forward, as in distillation
            (student(batch) - target).square().mean().backward()
            optimizer.step()
            teacher.update_parameters(student)
            teacher.train()
            teacher(batch)  # even a training forward of the copy is no step of the student's
        assert viz.step == 3
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2]


HOGWILD = """
import os, sys, tempfile, torch, torch.multiprocessing as mp
import actviz

def train(model, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 4)).square().mean().backward()
        optimizer.step()

if __name__ == "__main__":
    method = sys.argv[1]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.share_memory()
    log_dir = tempfile.mkdtemp()
    viz = actviz.watch(model, log_dir, every=1)
    context = mp.get_context(method)
    workers = [context.Process(target=train, args=(model, 5)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    train(model, 2)  # the parent trains too, and logs
    viz.close()
    print([worker.exitcode for worker in workers], viz.step)
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_mnist_hogwild_workers_run_the_watched_model(method, tmp_path):
    script = tmp_path / "hogwild.py"
    script.write_text(HOGWILD)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[0, 0] 2"


def test_parameter_gradients_are_reduced_once_per_step_once_an_optimizer_is_known(tmp_path, read_run, monkeypatch):
    import actviz.capture.step_parameters as step_parameters

    calls: list[int] = []
    original = step_parameters.reduce_tensors

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(step_parameters, "reduce_tensors", counting)
    model, twin = small_cnn(), small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    per_step = []
    with actviz.watch(model, tmp_path, every=1):
        for batch in batches(3):
            before = len(calls)
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()
            per_step.append(len(calls) - before)
    # values once per step; gradients at the end of backward and at the step for the first step only,
    # then only in the optimizer's pre-hook
    assert per_step == [3, 2, 2]
    run = read_run(tmp_path)
    for step, batch in enumerate(batches(3)):
        twin.zero_grad()
        twin(batch).square().mean().backward()
        assert_logged(run.histogram("weight_grads/0.weight", step), twin[0].weight.grad)


class SineSequence(nn.Module):
    """pytorch/examples' time_sequence_prediction model, narrower: two LSTMCells and a Linear called per time step."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.width = width
        self.lstm1, self.lstm2, self.linear = nn.LSTMCell(1, width), nn.LSTMCell(width, width), nn.Linear(width, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        h_t = c_t = h_t2 = c_t2 = torch.zeros(input.size(0), self.width, dtype=torch.double)
        outputs = []
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs.append(self.linear(h_t2))
        return torch.cat(outputs, dim=1)


def test_time_sequence_prediction_lbfgs_logs_each_closure_evaluation(tmp_path, read_run):
    """LBFGS evaluates its closure (forward and backward) several times per step(): each evaluation is a step,
    logged with its own gradients and the first call of each cell, as in pytorch/examples' train.py."""
    torch.manual_seed(0)
    model = SineSequence().double()
    twin = copy.deepcopy(model)
    wave = torch.sin(torch.arange(12, dtype=torch.double)[None, :] / 2 + torch.arange(4, dtype=torch.double)[:, None])
    inputs, targets = wave[:, :-1], wave[:, 1:]

    def train(net: nn.Module, seen: list | None) -> None:
        optimizer = torch.optim.LBFGS(net.parameters(), lr=0.8, max_iter=3)
        first_linear = []
        hook = net.linear.register_forward_hook(lambda m, i, o: first_linear.append(o.detach().clone()))

        def closure():
            optimizer.zero_grad()
            first_linear.clear()
            loss = nn.functional.mse_loss(net(inputs), targets)
            loss.backward()
            if seen is not None:
                seen.append((first_linear[0], {name: p.grad.clone() for name, p in net.named_parameters()}))
            return loss

        for _ in range(2):
            optimizer.step(closure)
        hook.remove()

    evaluations: list = []
    train(twin, evaluations)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no actviz warning for this loop
        with actviz.watch(model, tmp_path, every=1) as viz:
            train(model, None)
            assert viz.step == len(evaluations) >= 4
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/linear") == list(range(len(evaluations)))
    for step, (linear_output, grads) in enumerate(evaluations):
        assert_logged(run.histogram("activations/linear", step), linear_output)  # the first of 11 calls
        for name, grad in grads.items():
            assert_logged(run.histogram(f"weight_grads/{name}", step), grad)


def test_a_logging_step_draws_no_random_number(tmp_path):
    """Dropout, data shuffling and sampling downstream see the same random numbers with actviz as without it."""

    def train(watch: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(), nn.LazyLinear(2))
        model(torch.randn(2, 3, 8, 8))  # materialise the lazy layer
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        viz = actviz.watch(model, tmp_path / str(watch), every=1, image_every=1) if watch else None
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 3, 8, 8)).square().mean().backward()
            optimizer.step()
        if viz is not None:
            viz.close()
        return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    (bare, bare_state), (watched, watched_state) = train(False), train(True)
    assert torch.equal(bare_state, watched_state)
    assert all(torch.equal(a, b) for a, b in zip(bare, watched))
