"""The noise scale on Hugging Face models: GPT-2's ``Conv1D`` layers, Llama's ``LlamaRMSNorm``, the tied embedding
counted through the head, and ``gradient_noise/counted_fraction``, against per-example gradients from torch.func.

The reference takes every example's gradient over the parameters actviz counts (the tied embedding as the head's
weight alone: ``functional_call(..., tie_weights=False)`` gives the head its own copy), and the whole model's
gradient from an ordinary backward for the fraction.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import actviz
from actviz.statistics.gradient_noise import layer_kind
from actviz.tags import GRADIENT_NOISE, NOISE_COUNTED_FRACTION

transformers = pytest.importorskip("transformers")
SIMPLE, GRAD_SQUARED, TRACE_SIGMA = GRADIENT_NOISE


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"  # vmap maps over eager attention
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8,
                                      tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def counted_names(model: nn.Module) -> list[str]:
    """The parameters actviz counts, by the names of the modules that use them (the head's weight where tied)."""
    return [f"{name}.{kind}" for name, module in model.named_modules() if layer_kind(module) is not None
            for kind in ("weight", "bias") if isinstance(getattr(module, kind, None), nn.Parameter)]


def truth(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """McCandlish et al.'s estimators over the counted parameters' per-example gradients, and the counted fraction
    of the batch gradient's squared norm."""
    model = copy.deepcopy(model).double()
    every = {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
    names = counted_names(model)
    counted = {name: every[name] for name in names}
    rest = {name: value for name, value in every.items() if name not in counted}

    def loss(values, example):
        return lm_loss(functional_call(model, ({**values, **rest},), (example[None],), tie_weights=False).logits,
                       example[None])

    shares = vmap(grad(loss), in_dims=(None, 0))(counted, ids)
    per_example = torch.cat([shares[name].reshape(ids.shape[0], -1) for name in names], dim=1)
    size = ids.shape[0]
    one = per_example.square().sum(1).mean()
    batch = per_example.mean(0).square().sum()
    grad_squared = (size * batch - one) / (size - 1)
    trace_sigma = (one - batch) / (1 - 1 / size)
    model.zero_grad()
    lm_loss(model(ids).logits, ids).backward()
    whole = sum(float(p.grad.square().sum()) for p in model.parameters())
    return {SIMPLE: float(trace_sigma / grad_squared), GRAD_SQUARED: float(grad_squared),
            TRACE_SIGMA: float(trace_sigma), NOISE_COUNTED_FRACTION: float(batch) / whole}


def written(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False,
                      statistics=["default", "gradient_noise"]) as viz:
        optimizer.zero_grad()
        lm_loss(model(ids).logits, ids).backward()
        optimizer.step()
        viz.flush()
    return {tag: viz.latest.scalars.get(tag) for tag in (*GRADIENT_NOISE, NOISE_COUNTED_FRACTION)}


@pytest.mark.slow  # imports transformers and maps torch.func over GPT-2: about 5 s
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2 Conv1D, tied head", "llama RMSNorm"])
def test_hugging_face_layers_count_as_torch_func_says(make):
    torch.manual_seed(0)
    model = make()
    kinds = {type(module).__name__: layer_kind(module) for module in model.modules()}
    assert kinds.get("Conv1D", "linear") == "linear" and kinds.get("LlamaRMSNorm", "rms_norm") == "rms_norm"
    ids = torch.randint(0, 40, (6, 8))
    expected = truth(model, ids)
    assert 0.05 < expected[NOISE_COUNTED_FRACTION] < 0.999  # the embeddings hold the rest
    found = written(model, ids)
    assert {tag: found[tag] for tag in GRADIENT_NOISE} == pytest.approx(
        {tag: expected[tag] for tag in GRADIENT_NOISE}, rel=1e-4)
    assert found[NOISE_COUNTED_FRACTION] == pytest.approx(expected[NOISE_COUNTED_FRACTION], rel=1e-4)
