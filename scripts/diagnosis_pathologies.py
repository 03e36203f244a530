"""The sick programs of ``scripts/diagnosis_benchmark.py``: one known pathology each, with its cause, layer and onset.

Each is a small training loop (most of them a healthy program of :mod:`diagnosis_programs` with one thing
changed) that says which alerts name its cause (``rules``), which layers such an alert may name (``layers``)
and at which step the pathology starts (``onset``). Its :meth:`~diagnosis_programs.Program.happened` checks
with the program's own hooks, not actviz's, that the pathology really happened.

Example:
    >>> program = SICK["nan_in_data"]()
    >>> _ = [program.step(step) for step in range(program.onset + 1)]
    >>> program.happened()
    'the loss is NaN from step 45'
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diagnosis_programs import DCGAN, Classifier, LanguageModel, MnistNet, Program, mnist_cnn

__all__ = ["SICK"]

#: Rules that name a run gone out of range as a whole (any layer is the right one).
DIVERGED = frozenset({"exploding_gradients", "exploding_activations", "nonfinite", "diverged", "gradient_spike"})


def mlp(widths: list[int], activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths[:-2], widths[1:-1]):
        layers += [nn.Linear(width_in, width_out), activation()]
    return nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]))


def classifier(model: nn.Module, features: int = 16, lr: float = 0.05, optimizer: str = "sgd") -> Classifier:
    inputs = torch.randn(1024, features)
    params = model.parameters()
    make = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.Adam(params, lr=lr)
    return Classifier(model, inputs, 4, make)


class Sick(Program):
    """A healthy loop (``inner``) with a pathology injected by :meth:`inject` before each step from ``onset`` on."""

    def __init__(self, inner: Program) -> None:
        self.inner, self.model, self.losses = inner, inner.model, []

    def inject(self, step: int) -> None:
        """Change the loop at ``step`` (called before each step from ``onset`` on)."""

    def step(self, step: int) -> float:
        if step >= self.onset:
            self.inject(step)
        loss = self.inner.step(step)
        self.losses.append(loss)
        return loss

    def bad_step(self) -> int | None:
        """The first step from ``onset`` whose loss is not finite or above 10x the median before it."""
        before = sorted(self.losses[max(0, self.onset - 20):self.onset] or self.losses[:1])
        median = before[len(before) // 2]
        for step, loss in enumerate(self.losses[self.onset:], self.onset):
            if not math.isfinite(loss) or loss > 10 * median:
                return step
        return None

    def loss_went_bad(self) -> str | None:
        """Says how the loss went bad (:meth:`bad_step`), or ``None``."""
        step = self.bad_step()
        if step is None:
            return None
        loss = self.losses[step]
        return f"the loss is {loss} from step {step}" if not math.isfinite(loss) else f"the loss jumps at step {step}"

    def happened(self) -> str | None:
        return self.loss_went_bad()


class LearningRateX1000(Sick):
    """The mnist CNN whose Adadelta learning rate goes from 1 to 1000 at step 50 (a schedule written wrong)."""

    onset, cause, rules = 50, "learning rate x1000 from step 50", DIVERGED

    def __init__(self) -> None:
        super().__init__(mnist_cnn())

    def inject(self, step: int) -> None:
        for group in self.inner.optimizer.param_groups:
            group["lr"] = 1000.0


class DemoCNNLearningRate10(Sick):
    """scripts/demo_train.py's CNN trained with Adam at learning rate 10: the loss diverges and the gradients go
    to exactly zero."""

    onset, cause, rules = 0, "Adam at lr 10: diverges, gradients exactly zero", DIVERGED | {"vanishing_gradients"}

    def __init__(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import demo_train

        torch.manual_seed(0)
        images, labels = demo_train.make_dataset(256, 32, seed=0)
        model = demo_train.small_cnn()
        inner = Classifier(model, images, 6, torch.optim.Adam(model.parameters(), lr=10.0), batch=16)
        inner.labels = labels
        super().__init__(inner)

    def happened(self) -> str | None:
        grads = [param.grad for param in self.model.parameters() if param.grad is not None]
        zero = sum(1 for grad in grads if not grad.any())
        bad = self.loss_went_bad()
        if bad and zero > len(grads) / 2:
            return f"{bad}; {zero} of {len(grads)} parameter gradients exactly zero at the end"
        return bad


class DeepSigmoid(Sick):
    """Ten Linear + Sigmoid layers without normalisation (Glorot & Bengio 2010): the first layers get almost no
    gradient from step 0."""

    onset, cause, rules = 0, "deep sigmoid net: gradients vanish towards the input", frozenset({"vanishing_gradients"})
    layers = frozenset({"0", "2", "4", "6"})

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(classifier(mlp([16] + [32] * 10 + [4], nn.Sigmoid), lr=0.1))
        self.rms: dict[str, float] = {}
        for name in ("0", "18"):
            self.model[int(name)].register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def keep(module, inputs, output):
            output.register_hook(lambda grad: self.rms.__setitem__(name, float(grad.square().mean().sqrt())))
        return keep

    def happened(self) -> str | None:
        ratio = self.rms["0"] / self.rms["18"]
        return f"the first layer's output gradient is {ratio:.2g} x the 10th's" if ratio < 1e-4 else None


class DyingReLU(Sick):
    """An MLP whose second layer's bias is set to -10 at step 40 (a bad update): its ReLU is dead from then on."""

    onset, cause, rules = 40, "bias -10 at step 40: dead ReLU after layer 2", frozenset({"dead_units", "vanishing_gradients"})
    layers = frozenset({"2", "3"})

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(classifier(mlp([16, 32, 32, 32, 4])))
        self.alive = 1.0
        self.model[3].register_forward_hook(lambda m, i, out: setattr(self, "alive", float((out > 0).any(0).float().mean())))

    def inject(self, step: int) -> None:
        if step == self.onset:
            self.model[2].bias.data.fill_(-10.0)

    def happened(self) -> str | None:
        return "every unit of layer 3 is zero for the whole batch" if self.alive == 0 else None


class BadBatch(Sick):
    """An MLP trained with SGD that gets one batch of unnormalised inputs (x1000) at step 60."""

    onset, cause, rules = 60, "one batch x1000 at step 60", DIVERGED

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(classifier(mlp([16, 32, 32, 4])))
        original = self.inner.batch_at
        self.inner.batch_at = lambda step: ((lambda x, y: (x * 1000.0, y))(*original(step)) if step == self.onset
                                            else original(step))


class Float16Overflow(Sick):
    """An MLP whose middle layer computes in float16; from step 40 an input feature is unnormalised (x1e4) and that
    layer's output overflows to Inf. As ``torch.amp.GradScaler`` does, a step whose loss is not finite is skipped,
    so the weights stay finite."""

    onset, cause, rules = 40, "float16 layer overflows from step 40", frozenset({"nonfinite", "low_headroom"})
    layers = frozenset({"2", "2.linear"})

    def __init__(self) -> None:
        torch.manual_seed(0)
        model = mlp([16, 64, 64, 4])
        model[2] = HalfLinear(model[2])
        super().__init__(classifier(model))
        self.overflowed = False
        model[2].register_forward_hook(lambda m, i, out: setattr(self, "overflowed", self.overflowed or bool(out.isinf().any())))
        original = self.inner.batch_at
        self.inner.batch_at = lambda step: self._scaled(*original(step)) if step >= self.onset else original(step)
        self.inner.optimizer = SkipNonFinite(self.inner.optimizer)

    @staticmethod
    def _scaled(inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.clone()
        inputs[:, 0] *= 1e4
        return inputs, labels

    def happened(self) -> str | None:
        return "layer 2's float16 output holds Inf" if self.overflowed else None


class SkipNonFinite:
    """An optimizer that skips a step whose gradients are not finite, as a gradient scaler does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if all(bool(grad.isfinite().all()) for grad in grads):
            self.optimizer.step()


class HalfLinear(nn.Module):
    """A Linear that computes in float16 and hands float32 on."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear.half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.half()).float()


class TanhSaturation(Sick):
    """An MLP of Tanh layers (watched with ``layers="all"``) whose inputs are unnormalised (x50) from step 40."""

    onset, cause, rules = 40, "inputs x50 from step 40: Tanh saturates", frozenset({"saturation"})
    layers, watch = frozenset({"1"}), {"layers": "all"}

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(classifier(mlp([16, 32, 32, 4], nn.Tanh)))
        self.saturated = 0.0
        self.model[1].register_forward_hook(
            lambda m, i, out: setattr(self, "saturated", float((out.abs() > 0.97).float().mean())))
        original = self.inner.batch_at
        self.inner.batch_at = lambda step: ((lambda x, y: (x * 50.0, y))(*original(step)) if step >= self.onset
                                            else original(step))

    def happened(self) -> str | None:
        return f"{self.saturated:.0%} of layer 1's outputs beyond 0.97" if self.saturated > 0.5 else None


class SaturatedGenerator(Sick):
    """DCGAN whose generator's last convolution is scaled x100 from step 40 (an init or a weight blown up): its
    final ``nn.Tanh``, which the default layers do not watch, outputs almost only -1 and +1."""

    onset, cause, rules = 40, "generator's Tanh input x100 from step 40", frozenset({"saturation"})
    layers = frozenset({"7"})

    def __init__(self) -> None:
        super().__init__(DCGAN())
        self.saturated = 0.0
        self.model[7].register_forward_hook(
            lambda m, i, out: setattr(self, "saturated", float((out.abs() > 0.97).float().mean())))

    @property
    def watched(self) -> dict[str, nn.Module]:
        return self.inner.watched

    def inject(self, step: int) -> None:
        if step == self.onset:
            with torch.no_grad():
                self.model[6].weight.mul_(100.0)

    def happened(self) -> str | None:
        return f"{self.saturated:.0%} of the generator's outputs beyond 0.97" if self.saturated > 0.5 else None


class ForgottenGroup(Sick):
    """The mnist CNN whose optimizer was given the classifier's parameters only: the convolutions get gradients
    and never move."""

    onset, cause, rules = 0, "conv parameters left out of the optimizer", frozenset({"frozen_parameter", "not_in_optimizer"})
    layers = frozenset({"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "conv1", "conv2"})

    def __init__(self) -> None:
        inner = mnist_cnn()
        model: MnistNet = inner.model
        inner.optimizer = torch.optim.Adadelta([*model.fc1.parameters(), *model.fc2.parameters()], lr=1.0)
        super().__init__(inner)
        self.before = model.conv1.weight.detach().clone()

    def happened(self) -> str | None:
        conv = self.model.conv1
        if torch.equal(conv.weight, self.before) and conv.weight.grad is not None and conv.weight.grad.any():
            return "conv1.weight has a gradient and never moved"
        return None


class FrozenByMistake(Sick):
    """The mnist CNN with ``conv2.requires_grad_(False)`` left in (a fine-tuning line copied over), its optimizer
    holding every parameter: conv2 never learns."""

    onset, cause, rules = 0, "conv2.requires_grad_(False) left in", frozenset({"no_gradient"})
    layers = frozenset({"conv2.weight", "conv2.bias"})

    def __init__(self) -> None:
        inner = mnist_cnn()
        inner.model.conv2.requires_grad_(False)
        super().__init__(inner)

    def happened(self) -> str | None:
        conv2 = self.model.conv2
        held = any(param is conv2.weight for group in self.inner.optimizer.param_groups for param in group["params"])
        return "conv2.weight is in the optimizer and gets no gradient" if held and conv2.weight.grad is None else None


class DecayedLayerNorm(Sick):
    """The nanoGPT-shaped GPT with AdamW's weight decay 0.1 on every parameter, its LayerNorms' and biases too."""

    onset, cause, rules = 0, "weight decay 0.1 on the LayerNorm weights", frozenset({"weight_decay_on_norm"})

    def __init__(self) -> None:
        super().__init__(LanguageModel(decay_everything=True))
        self.layers = frozenset(name for name, _ in self.model.named_parameters() if "ln" in name)

    def happened(self) -> str | None:
        decayed = [group for group in self.inner.optimizer.param_groups if group["weight_decay"] > 0
                   and any(param is self.model.ln_f.weight for param in group["params"])]
        return "ln_f.weight is in a group with weight decay 0.1" if decayed else None


class NaNInData(Sick):
    """The mnist CNN given one NaN pixel at step 45: the NaN reaches the weights and stays."""

    onset, cause, rules = 45, "one NaN pixel at step 45", frozenset({"nonfinite"})
    layers = frozenset({"conv1"})

    def __init__(self) -> None:
        super().__init__(mnist_cnn())
        original = self.inner.batch_at

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            inputs, labels = original(step)
            if step == self.onset:
                inputs = inputs.clone()
                inputs[0, 0, 3, 3] = math.nan
            return inputs, labels

        self.inner.batch_at = batch


class AttentionLogitGrowth(Sick):
    """The small GPT at Adam's learning rate 0.1 without clipping (Wortsman et al. 2023's small-scale proxy of
    attention-logit growth)."""

    onset, cause = 0, "GPT at lr 0.1: attention logits grow"
    rules = frozenset({"attention_max_logit"}) | DIVERGED

    def __init__(self) -> None:
        super().__init__(LanguageModel(lr=0.1, clip=None))
        self.largest = 0.0

    def step(self, step: int) -> float:
        loss = super().step(step)
        self.largest = max([self.largest] + [block.attn.max_logit for block in self.model.h])
        return loss

    def happened(self) -> str | None:
        return f"attention logits reach {self.largest:.3g}" if self.largest > 100 else None


class ClippedSpike(Sick):
    """The GPT of nanoGPT's recipe (AdamW, ``clip_grad_norm_(…, 1.0)``) whose loss is x1000 at step 203, a step that
    logs nothing: clipping keeps what the optimizer applies at norm 1, so only the norm before clipping shows it."""

    onset, cause, rules = 203, "loss x1000 at step 203 of a clipped run", frozenset({"gradient_spike"})

    def __init__(self) -> None:
        super().__init__(LanguageModel(spike_at=self.onset))

    def happened(self) -> str | None:
        norms = self.inner.norms
        before = sorted(norms[self.onset - 20:self.onset])
        if len(norms) > self.onset and norms[self.onset] > 100 * before[len(before) // 2]:
            return f"the norm before clipping is {norms[self.onset]:.3g} at step {self.onset}, clipped to 1"
        return None


class BatchBetweenLogs(Sick):
    """The mnist CNN given one batch x10^4 at step 57, a step that logs nothing (every=5)."""

    onset, cause, rules = 57, "one batch x10^4 at step 57, between logging steps", DIVERGED

    def __init__(self) -> None:
        super().__init__(mnist_cnn())
        original = self.inner.batch_at
        self.inner.batch_at = lambda step: ((lambda x, y: (x * 1e4, y))(*original(step)) if step == self.onset
                                            else original(step))


#: The sick programs by name: each makes a fresh program.
SICK = {
    "lr_x1000": LearningRateX1000, "demo_cnn_lr10": DemoCNNLearningRate10, "deep_sigmoid": DeepSigmoid,
    "dying_relu": DyingReLU, "bad_batch": BadBatch, "fp16_overflow": Float16Overflow,
    "tanh_saturation": TanhSaturation, "saturated_generator": SaturatedGenerator, "forgotten_group": ForgottenGroup,
    "nan_in_data": NaNInData, "attention_logit_growth": AttentionLogitGrowth, "frozen_by_mistake": FrozenByMistake,
    "decayed_layernorm": DecayedLayerNorm, "clipped_spike": ClippedSpike, "mnist_batch_between_logs": BatchBetweenLogs,
}
