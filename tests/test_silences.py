"""Runs that log nothing say why, once, naming the cause and the fix; a normal run says nothing."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

import actviz


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 2))


def _batch() -> torch.Tensor:
    return torch.randn(5, 4)


def _actviz_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("actviz")]


@pytest.fixture
def caught():
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, call=None) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        (call or model)(_batch()).square().mean().backward()
        optimizer.step()


def test_a_normal_run_with_validation_says_nothing(tmp_path, caught, read_run):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path, every=2) as viz:
        for _ in range(2):  # epochs: train, then validate in eval mode under no_grad
            model.train()
            _train(model, optimizer, 3)
            viz.flush()
            model.eval()
            with torch.no_grad():
                for _ in range(4):
                    model(_batch())
            viz.flush()
    assert _actviz_warnings(caught) == []
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 2, 4]


def test_lbfgs_and_two_optimizers_on_one_model_say_nothing(tmp_path, caught):
    model = _model()
    lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=3)

    def closure():
        lbfgs.zero_grad()
        loss = model(_batch()).square().mean()
        loss.backward()
        return loss

    first, second = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[3].parameters(), lr=0.1)
    with actviz.watch(model, tmp_path, every=1):
        for _ in range(3):
            lbfgs.step(closure)  # its first step comes before any forward
        for _ in range(3):
            model(_batch()).square().mean().backward()
            first.step()
            second.step()  # a second optimizer, no forward between: not a silence
    assert _actviz_warnings(caught) == []


def test_a_model_left_in_eval_mode_warns_at_its_second_optimizer_step(tmp_path, caught):
    model = _model().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path):
        _train(model, optimizer, 1)
        assert _actviz_warnings(caught) == []
        _train(model, optimizer, 4)
        (message,) = _actviz_warnings(caught)
        assert "trains in eval mode" in message and "SGD stepped 2 times in a row" in message
        assert "the 2 forwards it saw since the last training forward (or since watch()) ran in eval mode" in message
        assert "call model.train()" in message
    assert len(_actviz_warnings(caught)) == 1  # close() does not say it again


def test_forgetting_model_train_after_validation_warns_once(tmp_path, caught, read_run):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path, every=1):
        _train(model, optimizer, 3)
        model.eval()
        with torch.no_grad():
            model(_batch())
            model(_batch())
        _train(model, optimizer, 3)  # model.train() forgotten
    (message,) = _actviz_warnings(caught)
    assert "trains in eval mode" in message
    assert "the 4 forwards it saw since the last training forward (or since watch()) ran in eval mode" in message
    assert "model.train()" in message
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2]


def test_inference_only_in_eval_mode_is_said_at_close_not_at_flush(tmp_path, caught):
    model = _model().eval()
    with actviz.watch(model, tmp_path) as viz:
        for _ in range(3):
            model(_batch())
        viz.flush()  # the parameters have not changed: this may be a validation before training
        assert _actviz_warnings(caught) == []
    (message,) = _actviz_warnings(caught)
    assert "saw 3 forwards of Sequential in eval mode and none in training mode" in message
    assert "Call model.train()" in message


def test_eval_forwards_under_no_grad_are_counted_too(tmp_path, caught):
    model = _model().eval()
    with actviz.watch(model, tmp_path):
        with torch.no_grad():
            model(_batch())
        model.train()
        with torch.no_grad():
            model(_batch())
            model(_batch())
    (message,) = _actviz_warnings(caught)
    assert "saw 1 forwards of Sequential in eval mode (2 more in training mode with grad disabled)" in message


def test_calling_model_forward_warns_at_the_second_optimizer_step(tmp_path, caught):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    with actviz.watch(model, tmp_path):
        _train(model, optimizer, 3, call=model.forward)
        (message,) = _actviz_warnings(caught)
    assert "Adam stepped 2 times in a row on the parameters of Sequential" in message
    assert "no forward of Sequential at all" in message and "call model(x) instead" in message


def test_model_forward_with_a_manual_update_is_said_at_flush(tmp_path, caught):
    model = _model()
    with actviz.watch(model, tmp_path) as viz:
        for _ in range(2):
            model.zero_grad()
            model.forward(_batch()).square().mean().backward()
            with torch.no_grad():
                for param in model.parameters():
                    param -= 0.1 * param.grad
        viz.flush()
        (message,) = _actviz_warnings(caught)
    assert message.startswith("actviz logged nothing: the parameters of Sequential changed, but no forward")
    assert len(_actviz_warnings(caught)) == 1


def test_training_under_no_grad_warns(tmp_path, caught):
    model = _model()  # evolution strategies: forwards without grad, gradients estimated and set by hand
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path):
        for _ in range(3):
            with torch.no_grad():
                model(_batch())
            for param in model.parameters():
                param.grad = torch.randn_like(param)
            optimizer.step()
        (message,) = _actviz_warnings(caught)
    assert "the 2 forwards it saw since the last training forward (or since watch()) ran with grad disabled" in message


class _Layer(nn.Linear):
    """A layer of pytorch/examples' forward-forward network: it trains itself through self.forward()."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)

    def forward(self, x):
        return torch.relu(x / (x.norm(2, 1, keepdim=True) + 1e-4) @ self.weight.T + self.bias)

    def train_layer(self, x_pos, x_neg, epochs: int = 3):
        for _ in range(epochs):
            g_pos, g_neg = self.forward(x_pos).pow(2).mean(1), self.forward(x_neg).pow(2).mean(1)
            loss = torch.log(1 + torch.exp(torch.cat([-g_pos + 2.0, g_neg - 2.0]))).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


def test_a_forward_forward_layer_trained_through_forward_calls_warns(tmp_path, caught):
    torch.manual_seed(0)
    layers = [_Layer(6, 5), _Layer(5, 4)]
    with actviz.watch(layers[0], tmp_path, every=1):
        h_pos, h_neg = torch.randn(8, 6), torch.randn(8, 6)
        for layer in layers:
            h_pos, h_neg = layer.train_layer(h_pos, h_neg)
        (message,) = _actviz_warnings(caught)
        for layer in layers:  # predict(): inference calls, which actviz would count as steps
            layer(torch.randn(2, layer.in_features))
    assert "layer.forward(x) inside a layer's own training loop (as forward-forward networks do)" in message
    assert "predict() method, are counted as training steps unless they run under torch.no_grad()" in message


class _ForwardForwardNet(nn.Module):
    """The forward-forward network with its layers in an nn.ModuleList, as actviz's selection error asks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([_Layer(6, 5), _Layer(5, 4)])

    def predict(self, x):
        goodness = []
        for layer in self.layers:
            x = layer(x)
            goodness.append(x.pow(2).mean(1))
        return sum(goodness)


def test_a_forward_forward_network_watched_whole_says_its_layers_train_out_of_sight(tmp_path, caught):
    net = _ForwardForwardNet()
    with actviz.watch(net, tmp_path, every=1) as viz:
        h_pos, h_neg = torch.randn(8, 6), torch.randn(8, 6)
        for layer in net.layers:
            h_pos, h_neg = layer.train_layer(h_pos, h_neg)
        net.predict(torch.randn(2, 6))
        assert viz.step == 0  # net itself is never called: no step
    (message,) = _actviz_warnings(caught)
    assert "Adam stepped 2 times in a row on the parameters of _ForwardForwardNet" in message
    assert "layer.forward(x) inside a layer's own training loop" in message


def test_a_schedule_that_picks_none_of_the_steps_is_said_at_close(tmp_path, caught):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path, every=[100, 200]) as viz:
        _train(model, optimizer, 5)
        viz.flush()  # the run may still reach step 100
        assert _actviz_warnings(caught) == []
    (message,) = _actviz_warnings(caught)
    assert "counted 5 training steps (numbered 0 to 4)" in message and "steps 100, 200" in message


def test_silences_never_raise_under_warnings_as_errors(tmp_path, caplog):
    model = _model().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING, logger="actviz"):
            with actviz.watch(model, tmp_path):
                _train(model, optimizer, 3)
    assert [r.getMessage() for r in caplog.records if "trains in eval mode" in r.getMessage()] != []


def test_a_closed_watcher_stops_listening_to_optimizer_steps(tmp_path, caught):
    model = _model().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path):
        pass
    _train(model, optimizer, 4)
    assert _actviz_warnings(caught) == []


def test_a_validation_before_training_does_not_make_a_forward_bypass_look_like_eval_mode(tmp_path, caught):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path):
        model.eval()
        with torch.no_grad():  # a sanity-check validation, as Lightning runs one
            model(_batch())
        model.train()
        _train(model, optimizer, 3, call=lambda x: model[3](model[0](x)))  # the layers, not the model
    (message,) = _actviz_warnings(caught)  # one warning, at the second optimizer step, and none at close()
    assert "and no forward of Sequential at all, in between" in message


def test_the_examples_of_docs_steps_run_and_warn_only_where_they_say(monkeypatch, tmp_path, caught):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "steps.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "docs/steps.md", "exec"), {})
    assert _actviz_warnings(caught) == []  # the reused folder's warning is caught (and checked) by its example
