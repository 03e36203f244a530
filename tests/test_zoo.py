"""A sweep of real architectures: three logged steps each, compared with a twin watched by plain hooks.

Residual (resnet18), depthwise and squeeze-excite (mobilenet_v3_small), attention (a small
VisionTransformer), inception-style with auxiliary outputs (googlenet), segmentation in
train mode (lraspp_mobilenet_v3_large) and, when transformers is installed, BERT and GPT-2
built from tiny configs. For each: no crash, no actviz warning, every expected tag at every
logged step, the values the twin computed, and no hook left after close().
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torchvision
from conftest import NO_HOOKS, Run, hooks_left
from torch import nn
from torch.nn import functional as F

import actviz
from actviz.capture.layer_outputs import output_tensors
from actviz.selection import layer_tag_names, parameter_tag_names

STEPS, EVERY = 6, 2
LOGGED = [0, 2, 4]


def classify(size: int, classes: int = 10) -> Callable[[nn.Module, int], torch.Tensor]:
    def loss(model: nn.Module, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(2, 3, size, size, generator=generator)
        out = model(inputs)
        logits = out.logits if hasattr(out, "logits") else out  # googlenet's namedtuple in train mode
        extra = sum(aux.float().mean() for aux in (getattr(out, "aux_logits1", None), getattr(out, "aux_logits2", None))
                    if aux is not None)
        return F.cross_entropy(logits, torch.tensor([1, 3])) + 0.3 * extra
    return loss


def segment(model: nn.Module, step: int) -> torch.Tensor:
    inputs = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(step))
    targets = torch.randint(0, 3, (2, 64, 64), generator=torch.Generator().manual_seed(9))
    return F.cross_entropy(model(inputs)["out"], targets)


def language(model: nn.Module, step: int) -> torch.Tensor:
    tokens = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(step))
    if "GPT2" in type(model).__name__:
        return model(input_ids=tokens, labels=tokens).loss
    return model(input_ids=tokens, labels=torch.tensor([0, 1])).loss


def torchvision_cases():
    from torchvision.models.vision_transformer import VisionTransformer

    return [
        ("resnet18", lambda: torchvision.models.resnet18(num_classes=10), classify(32)),
        ("mobilenet_v3_small", lambda: torchvision.models.mobilenet_v3_small(num_classes=10), classify(32)),
        ("vit", lambda: VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                          mlp_dim=64, num_classes=10), classify(32)),
        ("googlenet", lambda: torchvision.models.googlenet(num_classes=10, aux_logits=True, init_weights=True),
         classify(64)),
        ("lraspp", lambda: torchvision.models.segmentation.lraspp_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=3), segment),
    ]


def huggingface_cases():
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=100, max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0)
    return [
        ("bert", lambda: transformers.BertForSequenceClassification(bert), language),
        ("gpt2", lambda: transformers.GPT2LMHeadModel(gpt2), language),
    ]


class Recorder:
    """Plain hooks on the twin: the first call's output and output gradient of each layer, at logged steps."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.step = -1
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}
        self.grads: dict[tuple[int, str], torch.Tensor] = {}
        module_names = {tag: module for module, tag in layer_tag_names(model).items()}  # tag name -> module name
        for name in names:
            model.get_submodule(module_names[name]).register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(module, inputs, output):
            key = (self.step, name)
            if self.step not in LOGGED or key in self.outputs:
                return
            found = next(iter(output_tensors(output)), None)
            if found is None:
                return
            tensor = found[1]
            self.outputs[key] = tensor.detach().double().clone()
            if tensor.requires_grad:
                tensor.register_hook(lambda grad: self._keep_grad(key, grad))
        return hook

    def _keep_grad(self, key: tuple[int, str], grad: torch.Tensor) -> None:
        self.grads.setdefault(key, grad.double().clone())


def train(model: nn.Module, loss: Callable[[nn.Module, int], torch.Tensor], on_step=None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for step in range(STEPS):
        if on_step is not None:
            on_step(step)
        torch.manual_seed(step)  # the same dropout masks in the twin and the watched model
        optimizer.zero_grad()
        loss(model, step).backward()
        optimizer.step()


def check_model(build, loss, tmp_path) -> None:
    torch.manual_seed(0)
    model = build()
    twin = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        viz = actviz.watch(model, tmp_path, every=EVERY)
        layers = viz.layer_names
        recorder = Recorder(twin, layers)
        train(twin, loss, on_step=lambda step: setattr(recorder, "step", step))
        train(model, loss)
        viz.close()
    assert [str(w.message) for w in caught if "actviz" in str(w.message)] == []
    assert hooks_left(model) == NO_HOOKS
    run = Run(tmp_path)
    ran = {name for _, name in recorder.outputs}
    assert len(ran) >= 0.8 * len(layers)  # most run; an attention out_proj whose forward MHA never calls does not
    for name in ran:
        assert run.histogram_steps(f"activations/{name}") == LOGGED, name
        for step in LOGGED:
            expected = recorder.outputs[(step, name)]
            finite = expected[torch.isfinite(expected)]
            logged = run.histogram(f"activations/{name}", step)
            assert logged.num == finite.numel(), name
            tolerance = 1e-3 * math.sqrt(finite.numel())  # float32 sums in another order
            assert logged.sum == pytest.approx(finite.sum().item(), rel=1e-3, abs=tolerance), name
            assert (logged.min, logged.max) == pytest.approx((finite.min().item(), finite.max().item()), rel=1e-4,
                                                               abs=1e-5), name
    graded = {name for _, name in recorder.grads}
    assert graded, "no layer got a gradient"
    for name in graded:
        assert run.histogram_steps(f"gradients/{name}") == LOGGED, name
        expected = recorder.grads[(0, name)]
        assert run.scalar(f"gradient_stats/norm@{name}", 0) == pytest.approx(expected.norm().item(), rel=1e-3,
                                                                                abs=1e-9), name
    tag_names = parameter_tag_names(model)
    for module_param_name, param in model.named_parameters():
        param_name = tag_names[module_param_name]
        if param_name in viz.parameter_names:
            assert run.histogram_steps(f"weights/{param_name}") == LOGGED, param_name
            if param.grad is not None:
                assert run.histogram_steps(f"weight_grads/{param_name}") == LOGGED, param_name


@pytest.mark.parametrize("name, build, loss", torchvision_cases(), ids=[case[0] for case in torchvision_cases()])
def test_torchvision_model(name, build, loss, tmp_path):
    check_model(build, loss, tmp_path)


@pytest.mark.parametrize("index", [0, 1], ids=["bert", "gpt2"])
def test_huggingface_model(index, tmp_path):
    name, build, loss = huggingface_cases()[index]
    check_model(build, loss, tmp_path)
