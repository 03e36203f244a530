"""The optimizer audit: weight decay on norms, biases and embeddings, parameters no optimizer holds, parameters an
optimizer holds that never get a gradient, groups at learning rate 0; said once, and nothing on healthy loops."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actviz
from actviz.common import optimizer_steps
from actviz.diagnosis.optimizer_audit import AUDITED_STEPS


class TinyTransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.ln = nn.LayerNorm(8)
        self.mlp = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + self.mlp(self.ln(x)))


class MnistShaped(nn.Module):
    def __init__(self, skip_conv2: bool = False) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3)
        self.fc = nn.Linear(8 * 4 * 4, 10)
        self.skip_conv2 = skip_conv2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x)) if not self.skip_conv2 else x[:, :, 1:-1, 1:-1].repeat(1, 2, 1, 1)
        return self.fc(F.max_pool2d(x, 2).flatten(1))


def train(model: nn.Module, optimizer, steps: int = AUDITED_STEPS + 2, scheduler=None, **watch_args):
    """``steps`` steps under watch(every=1); the alerts of the audit's rules and the warnings' texts."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, **watch_args) as viz:
            for _ in range(steps):
                if isinstance(model, TinyTransformerBlock):
                    tokens = torch.randint(0, 16, (4, 6))
                    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
                else:
                    loss = F.cross_entropy(model(torch.randn(4, 1, 12, 12)), torch.randint(0, 10, (4,)))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
            viz.flush()
    audit_rules = {"weight_decay_on_norm", "not_in_optimizer", "no_gradient", "zero_learning_rate"}
    found = [(alert.rule, alert.layer, alert.message) for alert in viz.alerts if alert.rule in audit_rules]
    return found, [str(w.message) for w in caught if "actviz" in str(w.message)]


def test_weight_decay_on_layernorm_weights_is_named_with_the_fix():
    torch.manual_seed(0)
    model = TinyTransformerBlock()
    found, messages = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    assert [(rule, layer) for rule, layer, _ in found] == [("weight_decay_on_norm", "ln.weight")]
    said = [message for message in messages if "weight decay" in message]
    assert len(said) == 1  # said once: the warning, not again by the alert
    for name in ("ln.weight", "ln.bias", "mlp.bias", "embed.weight", "TinyTransformerBlock", "weight_decay=0"):
        assert name in said[0], said[0]
    assert "mlp.weight" not in said[0] and "head.weight" not in said[0]


def test_decay_groups_as_nanogpt_makes_them_and_adam_without_decay_raise_nothing():
    torch.manual_seed(0)
    model = TinyTransformerBlock()
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not model.embed.weight]
    rest = [p for p in model.parameters() if p.dim() < 2 or p is model.embed.weight]
    grouped = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    assert train(model, grouped) == ([], [])
    assert train(model, torch.optim.Adam(model.parameters(), foreach=True)) == ([], [])


def test_nanogpts_own_groups_decay_the_embedding_which_is_said_once_and_raises_no_alert():
    torch.manual_seed(0)
    model = TinyTransformerBlock()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    found, messages = train(model, torch.optim.AdamW(groups))
    assert found == []
    assert len(messages) == 1 and "1 embedding parameter(s) of TinyTransformerBlock: embed.weight;" in messages[0]


def test_a_layer_frozen_by_mistake_is_named():
    torch.manual_seed(0)
    model = MnistShaped()
    model.conv2.requires_grad_(False)
    found, messages = train(model, torch.optim.Adadelta(model.parameters(), lr=1.0))
    assert [(rule, layer) for rule, layer, _ in found] == [("no_gradient", "conv2.weight")]
    assert "conv2.weight, conv2.bias" in found[0][2] and "requires_grad" in found[0][2]
    assert len([message for message in messages if "never get" in message]) == 1


def test_a_layer_left_out_of_the_forward_is_named_after_the_audited_steps():
    torch.manual_seed(0)
    model = MnistShaped(skip_conv2=True)
    found, _ = train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert [(rule, layer) for rule, layer, _ in found] == [("no_gradient", "conv2.weight")]
    assert "conv2.bias" in found[0][2] and "left out of the forward" in found[0][2]


def test_parameters_no_optimizer_holds_are_named():
    torch.manual_seed(0)
    model = MnistShaped()
    found, _ = train(model, torch.optim.SGD(model.fc.parameters(), lr=0.1))
    assert [(rule, layer) for rule, layer, _ in found] == [("not_in_optimizer", "conv1.weight")]
    assert "conv1.weight, conv1.bias, conv2.weight, conv2.bias" in found[0][2]


def test_a_group_at_learning_rate_0_is_named_and_a_warm_up_from_0_is_not():
    torch.manual_seed(0)
    model = MnistShaped()
    frozen = torch.optim.SGD([{"params": model.conv1.parameters(), "lr": 0.0},
                              {"params": [*model.conv2.parameters(), *model.fc.parameters()]}], lr=0.1)
    found, _ = train(model, frozen)
    assert [(rule, layer) for rule, layer, _ in found] == [("zero_learning_rate", "conv1.weight")]
    assert "group 0 of SGD" in found[0][2]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step / 10)  # lr 0 at the first step
    assert train(model, optimizer, scheduler=warm_up) == ([], [])


def test_two_optimizers_of_one_model_and_lbfgs_raise_nothing_and_the_audit_ends():
    torch.manual_seed(0)
    model = MnistShaped()
    first = torch.optim.SGD(model.conv1.parameters(), lr=0.1)
    second = torch.optim.Adam([*model.conv2.parameters(), *model.fc.parameters()], lr=1e-3)

    class Both:  # a GAN-like loop: each optimizer steps its own part
        def zero_grad(self) -> None:
            first.zero_grad(), second.zero_grad()

        def step(self) -> None:
            first.step(), second.step()

    assert train(model, Both()) == ([], [])
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    inputs, labels = torch.randn(4, 1, 12, 12), torch.randint(0, 10, (4,))

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        return loss

    listening = len(optimizer_steps._listeners)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False) as viz:
            assert len(optimizer_steps._listeners) > listening
            for _ in range(AUDITED_STEPS + 2):
                lbfgs.step(closure)
            viz.flush()
            audit = viz._audit
            assert audit._subscription is None  # judged and gone: later steps cost nothing
    assert not [alert for alert in viz.alerts if alert.statistic == "optimizer"]
    assert not [w for w in caught if "optimizer audit" in str(w.message)]


def test_alerts_false_runs_no_audit():
    torch.manual_seed(0)
    model = TinyTransformerBlock()
    with actviz.watch(model, tempfile.mkdtemp(), alerts=False) as viz:
        assert viz._audit is None


class SignDescent(torch.optim.Optimizer):
    """A hand-written optimizer whose groups have neither ``lr`` nor ``weight_decay``."""

    def __init__(self, params, step_size: float) -> None:
        super().__init__(params, {"step_size": step_size})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.sub_(group["step_size"] * param.grad.sign())


@pytest.mark.parametrize("odd", ["lr as a tensor", "no lr or weight_decay key"])
def test_an_odd_optimizer_never_stops_training_nor_raises_an_alert(odd):
    torch.manual_seed(0)
    model = MnistShaped()
    if odd == "lr as a tensor":
        optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3), weight_decay=torch.tensor(0.0))
    else:
        optimizer = SignDescent(model.parameters(), 1e-3)
    assert train(model, optimizer) == ([], [])
