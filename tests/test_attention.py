"""Attention statistics from SDPA calls, against softmax(q kᵀ·scale + mask) computed eagerly for every row."""

from __future__ import annotations

import math
import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import CountOps, hooks_left
from torch import nn

import actviz
from actviz.selection import layer_tag_names
from actviz.transformers.attention import AttentionMode
from actviz.transformers.attention_stats import attention_logits, attention_stats, head_numbers


def brute_force(q, k, mask=None, is_causal=False, scale=None, groups=1):
    """Every row of batch element 0 in float64: (logits (H, L, S) with -inf where left out, softmax)."""
    q, k = q[0].double(), k[0].double()
    if groups > 1:
        k = k.repeat_interleave(groups, dim=0)
    factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = q @ k.transpose(-2, -1) * factor
    length, keys = logits.shape[-2:]
    if is_causal:
        allowed = torch.ones(length, keys, dtype=torch.bool).tril()
        logits = logits.masked_fill(~allowed, -math.inf)
    if mask is not None:
        mask = mask[0] if mask.dim() == 4 else mask
        logits = torch.where(mask, logits, -math.inf) if mask.dtype == torch.bool else logits + mask.double()
    return logits, torch.softmax(logits, -1)


def expected_stats(logits, probabilities, rows):
    sampled_logits, p = logits[:, rows], probabilities[:, rows]
    entropy = -(torch.where(p > 0, p * p.log(), 0.0)).sum(-1)
    return torch.stack([sampled_logits.amax((-2, -1)), entropy.amin(-1), entropy.mean(-1), p[..., 0].mean(-1)])


def numbers(logits):
    return head_numbers(attention_stats(logits))


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "given scale": {"scale": 0.3},
    "causal, given scale": {"is_causal": True, "scale": 2.0},
}


@pytest.mark.parametrize("length, rows", [(10, 64), (200, 64), (7, 3)])
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_rows_match_brute_force(case, length, rows):
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, length, 8), torch.randn(2, 3, length, 8)
    logits, probabilities = brute_force(q, k, **CASES[case])
    sampled = list(range(1, length, math.ceil((length - 1) / rows)))  # row 0 left out
    assert len(sampled) <= rows
    stats = numbers(attention_logits(q, k, rows=rows, **CASES[case]))
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, sampled), atol=1e-5, rtol=1e-5)
    assert (stats[0].double() <= logits.amax((-2, -1)) + 1e-5).all()  # sampled max <= exact max


@pytest.mark.parametrize("kind", ["bool", "additive", "bool per batch and head"])
def test_masks_match_brute_force(kind):
    torch.manual_seed(1)
    q, k = torch.randn(2, 2, 12, 4), torch.randn(2, 2, 16, 4)
    if kind == "bool":
        mask = torch.rand(12, 16) > 0.3
        mask[:, 0] = True  # no row left without a key
    elif kind == "additive":
        mask = torch.randn(12, 16) * 3
    else:
        mask = torch.rand(2, 2, 12, 16) > 0.5
        mask[..., 3] = True
    logits, probabilities = brute_force(q, k, mask=mask)
    stats = numbers(attention_logits(q, k, masks=(mask,), rows=5))
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, [1, 4, 7, 10]), atol=1e-5, rtol=1e-5)
    # and the call as SDPA gets it, through the mode
    with AttentionMode(rows=5) as mode:
        out = F.scaled_dot_product_attention(q, k, torch.randn(2, 2, 16, 4), attn_mask=mask)
    assert out.shape == (2, 2, 12, 4)
    torch.testing.assert_close(head_numbers(mode.calls[0][1]), stats)


def test_grouped_query_attention():
    torch.manual_seed(2)
    q, k = torch.randn(1, 6, 9, 4), torch.randn(1, 2, 9, 4)
    logits, probabilities = brute_force(q, k, is_causal=True, groups=3)
    with AttentionMode() as mode:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    (name, stats), = mode.calls
    stats = head_numbers(stats)
    assert name == "sdpa.0"
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, list(range(1, 9))), atol=1e-5, rtol=1e-5)


def test_three_dimensional_and_half_precision_inputs():
    torch.manual_seed(3)
    q, k = torch.randn(2, 5, 8), torch.randn(2, 7, 8)  # (N, L, E): one head
    logits, probabilities = brute_force(q[:, None], k[:, None])
    stats = numbers(attention_logits(q, k))
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, list(range(1, 5))), atol=1e-5, rtol=1e-5)
    half = numbers(attention_logits(q.bfloat16()[:, None], k.bfloat16()[:, None]))
    torch.testing.assert_close(half, stats, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_multihead_attention_module(need_weights, masked):
    torch.manual_seed(4)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(3, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1) if masked else None  # MHA's True: left out
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, 5] = True  # batch element 0 leaves out key 5
    with AttentionMode() as mode:
        mode.enter("attn")
        attention(x, x, x, attn_mask=mask, key_padding_mask=padding, need_weights=need_weights)
    (name, stats), = mode.calls
    stats = head_numbers(stats)
    w_q, w_k, _ = attention.in_proj_weight.chunk(3)
    b_q, b_k, _ = attention.in_proj_bias.chunk(3)
    q = (x[0] @ w_q.T + b_q).view(6, 2, 4).transpose(0, 1)[None]
    k = (x[0] @ w_k.T + b_k).view(6, 2, 4).transpose(0, 1)[None]
    allowed = torch.ones(6, 6, dtype=torch.bool)
    allowed[:, 5] = False
    if masked:
        allowed &= torch.ones(6, 6, dtype=torch.bool).tril()
    logits, probabilities = brute_force(q.detach(), k.detach(), mask=allowed)
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, list(range(1, 6))), atol=1e-5, rtol=1e-5)


def test_calls_are_named_by_the_innermost_module_and_a_second_call_keeps_the_first():
    q = torch.randn(1, 1, 4, 2)
    with AttentionMode() as mode:
        mode.enter("block")
        mode.enter("block.attn")
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q * 100, q, q)  # same module again: its first call is kept
        mode.leave("block.attn")
        F.scaled_dot_product_attention(q, q, q)
    assert [name for name, _ in mode.calls] == ["block.attn", "block"]


def test_a_failing_statistic_never_stops_the_forward():
    q = torch.randn(1, 4, 3, 2)
    with AttentionMode() as mode:
        out = F.scaled_dot_product_attention(q, q, q)
        with pytest.raises(RuntimeError):  # the user's own error still raises
            F.scaled_dot_product_attention(q, torch.randn(1, 4, 3, 5), q)
    assert out.shape == q.shape and mode.failed is not None  # stats stopped after the failure, the forward did not


# -- whole models, read back from the event files ----------------------------------------------

ATTENTION_SCALARS = ("max_logit", "entropy_min", "entropy_mean", "sink_fraction")


def tiny_gpt2(layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_head=2, n_embd=16, vocab_size=40, n_positions=32, bos_token_id=0,
                        eos_token_id=0, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=32, num_labels=3, attn_implementation="sdpa")
    return BertForSequenceClassification(config)


def tiny_vit():
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=5)


def tiny_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(16, 7))


def run_model(kind, model):
    if kind == "gpt2":
        ids = torch.randint(0, 40, (2, 12))
        return model(ids, labels=ids).loss
    if kind == "bert":
        ids, mask = torch.randint(0, 40, (2, 10)), torch.ones(2, 10, dtype=torch.long)
        mask[0, 7:] = 0  # padding in batch element 0: a key padding mask reaches SDPA
        return model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2])).loss
    if kind == "vit":
        return model(torch.randn(2, 3, 16, 16)).square().mean()
    return model(torch.randn(2, 9, 16)).square().mean()


MODELS = {
    "gpt2": (tiny_gpt2, ["transformer.h.0.attn", "transformer.h.1.attn"]),
    "bert": (tiny_bert, ["bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.attention.self"]),
    "vit": (tiny_vit, ["encoder.layers.encoder_layer_0.self_attention", "encoder.layers.encoder_layer_1.self_attention"]),
    "encoder": (tiny_encoder, ["0.layers.0.self_attn", "0.layers.1.self_attn"]),
}  # named_modules() names: the tags hold their tag names (actviz.selection.layer_tag_names)


@pytest.mark.parametrize("kind", list(MODELS))
def test_every_tag_on_four_transformers(kind, read_run):
    make, modules = MODELS[kind]
    model, log_dir = make(), tempfile.mkdtemp()
    attention_layers = [layer_tag_names(model)[name] for name in modules]
    with actviz.watch(model, log_dir, every=2, options=actviz.Options(strict=True)) as viz:
        for _ in range(3):
            run_model(kind, model).backward()
        layers = viz.layer_names
    run = read_run(log_dir)
    for layer in attention_layers:
        for name in ATTENTION_SCALARS:
            assert [e.step for e in run.scalar_events(f"attention/{name}@{layer}")] == [0, 2], (layer, name)
        assert run.histogram_steps(f"attention/head_max_logit@{layer}") == [0, 2]
        assert 0 < run.scalar(f"attention/entropy_min@{layer}", 0) <= run.scalar(f"attention/entropy_mean@{layer}", 0)
    assert not [t for t in run.scalar_tags if t.startswith("attention/") and t.split("@")[1] not in attention_layers]
    for tag in ("logits/max", "logits/logsumexp", "logits/entropy"):
        assert tag in run.scalar_tags
    summarized = [layer for layer in layers if f"activation_stats/mean@{layer}" in run.scalar_tags]
    assert len(summarized) >= len(layers) - 2  # MultiheadAttention's out_proj is never called as a module
    for layer in summarized:  # every watched layer that ran
        for name in ("max_abs", "kurtosis", "outlier_fraction"):
            assert f"activation_stats/{name}@{layer}" in run.scalar_tags, (layer, name)


def test_collapse_gives_entropy_near_zero_and_the_max_logit_alert(read_run):
    torch.manual_seed(0)
    model, log_dir = tiny_encoder(), tempfile.mkdtemp()
    attention = model[0].layers[0].self_attn
    with torch.no_grad():
        attention.in_proj_weight[:16] *= 100  # W_q scaled by 100: attention one-hot
    handed = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, log_dir, every=1, on_alert=handed.append, options=actviz.Options(strict=True)) as viz:
            for _ in range(2):
                run_model("encoder", model).backward()
        kept = list(viz.alerts)
    run = read_run(log_dir)
    # an Alert like the health rules': in viz.alerts and on_alert, once for the layer although both steps hit it
    logit_alerts = [alert for alert in kept if alert.rule == "attention_max_logit"]
    assert [(a.step, a.layer, a.statistic) for a in logit_alerts] == [(0, "0.0.self_attn", "max_logit")]
    assert logit_alerts[0].value == pytest.approx(run.scalar("attention/max_logit@0.0.self_attn", 0))
    assert logit_alerts[0].threshold == 100.0
    assert handed == kept
    assert sum("max logit" in str(w.message) for w in caught) == 1
    assert run.scalar("attention/max_logit@0.0.self_attn", 0) > 100
    assert run.scalar("attention/entropy_min@0.0.self_attn", 0) < 0.05  # log 9 = 2.2 when uniform
    assert run.scalar("attention/entropy_min@0.1.self_attn", 0) > 0.5
    messages = [str(w.message) for w in caught]
    assert any("max logit" in m and "'0.0.self_attn'" in m for m in messages), messages
    assert "0.0.self_attn" in run.events.Tensors("alerts")[0].tensor_proto.string_val[0].decode()


def test_entropy_collapse_over_logging_steps_alerts():
    from actviz.diagnosis.transformer_alerts import TransformerAlerts

    alerts = TransformerAlerts()
    for step, entropy in enumerate([2.0, 1.9, 1.8]):
        assert alerts.check(step, {"a": {"max_logit": 1.0, "entropy_min": entropy}}, {}) == []
    (alert,) = alerts.check(3, {"a": {"max_logit": 1.0, "entropy_min": 0.9}}, {})
    assert "entropy collapse in 'a'" in alert.message
    assert (alert.step, alert.rule, alert.layer, alert.value, alert.threshold) == (
        3, "attention_entropy_collapse", "a", 0.9, 1.0)  # half of the highest of the window, 2.0


def test_alerts_false_turns_the_transformer_alerts_off_too(read_run):
    torch.manual_seed(0)
    model, log_dir = tiny_encoder(), tempfile.mkdtemp()
    with torch.no_grad():
        model[0].layers[0].self_attn.in_proj_weight[:16] *= 100
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, log_dir, every=1, alerts=False) as viz:
            run_model("encoder", model).backward()
    run = read_run(log_dir)
    assert run.scalar("attention/max_logit@0.0.self_attn", 0) > 100  # the numbers are still logged
    assert viz.alerts == [] and not [w for w in caught if "max logit" in str(w.message)]
    assert "alerts" not in run.events.Tags()["tensors"]


def test_steps_that_do_not_log_run_no_mode_and_no_hook():
    model = tiny_gpt2()
    seen = []

    def spy(module, args):  # a user's hook on the inner attention module
        seen.append((torch._C._len_torch_function_stack(), hooks_left(model)["forward_pre"]))

    with actviz.watch(model, tempfile.mkdtemp(), every=2):
        handle = model.transformer.h[0].attn.register_forward_pre_hook(spy)
        for _ in range(2):
            run_model("gpt2", model).backward()
        handle.remove()
    (logging_mode, logging_hooks), (quiet_mode, quiet_hooks) = seen
    assert logging_mode == 1 and quiet_mode == 0
    assert quiet_hooks == 2  # the watcher's root hook and the spy
    assert logging_hooks > quiet_hooks
    assert torch._C._len_torch_function_stack() == 0 and hooks_left(model)["forward_pre"] == 0


def test_a_forward_that_raises_leaves_no_mode():
    model = tiny_encoder()
    with actviz.watch(model, tempfile.mkdtemp(), every=1):
        with pytest.raises(AssertionError, match="embedding dimension"):
            model(torch.randn(2, 9, 5))  # wrong width
        assert torch._C._len_torch_function_stack() == 0
        run_model("encoder", model).backward()  # the next step works
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_compiled_gpt2_keeps_one_graph_and_never_recompiles(how):
    model = tiny_gpt2()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    if how == "model.compile()":
        model.compile(backend=backend)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 40, (2, 12))
    with actviz.watch(compiled, tempfile.mkdtemp(), every=4) as viz:
        for step in range(8):
            compiled(ids, labels=ids).loss.backward()
            if step == 1:
                first = len(graphs)
        viz.flush()
        assert viz.latest is not None and "attention/max_logit@0.attn" in viz.latest.scalars
    assert first >= 1 and len(graphs) == first  # compiled on the first step that did not log, never again


# -- costs: kernels added per attention call, counted as tests/test_device_path.py counts them ---------

def _sdpa_cases():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 100, 8), torch.randn(2, 4, 100, 8)
    small_k = torch.randn(2, 2, 100, 8)
    return {
        "plain": (q, k, k, {}),
        "causal": (q, k, k, {"is_causal": True}),
        "bool mask": (q, k, k, {"attn_mask": torch.rand(2, 1, 100, 100) > 0.2}),
        "additive mask": (q, k, k, {"attn_mask": torch.randn(100, 100)}),
        "grouped query": (q, small_k, small_k, {"is_causal": True, "enable_gqa": True}),
        "bfloat16": (q.bfloat16(), k.bfloat16(), k.bfloat16(), {"is_causal": True}),
    }


@pytest.mark.parametrize("case", list(_sdpa_cases()))
def test_an_sdpa_call_adds_at_most_sixteen_kernels_and_no_sync(case):
    q, k, v, kwargs = _sdpa_cases()[case]
    with CountOps() as bare:
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    with AttentionMode() as mode:
        mode.enter("warm")  # the causal mask is made once and kept
        F.scaled_dot_product_attention(q, k, v, **kwargs)
        mode.enter("counted")
        with CountOps() as watched:
            F.scaled_dot_product_attention(q, k, v, **kwargs)
    added = len(watched.kernels) - len(bare.kernels)
    # 7 to 9: bmm, scale, mask, softmax, xlogy, sum, amax, cat (+ a cast); 6 for the logit bound of a fused kernel
    # (7 with grouped queries: the key heads' norms repeated)
    assert added <= 16, watched.kernels
    assert watched.syncs == [] and len(mode.calls) == 2


def test_a_multihead_attention_call_adds_at_most_seventeen_kernels():
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    x, causal = torch.randn(2, 30, 16), torch.ones(30, 30, dtype=torch.bool).triu(1)
    with CountOps() as bare:
        attention(x, x, x, attn_mask=causal, need_weights=False)
    with AttentionMode() as mode:
        mode.enter("attn")
        with CountOps() as watched:
            attention(x, x, x, attn_mask=causal, need_weights=False)
    added = len(watched.kernels) - len(bare.kernels)
    # the two projections of batch element 0, then as SDPA, and the logit bound
    assert added <= 17 and watched.syncs == [], watched.kernels


def test_a_failing_statistic_warns_once_and_the_rest_of_the_step_is_written(read_run, monkeypatch):
    import actviz.statistics.outliers as outliers

    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(outliers, "outlier_vector", broken)
    model, log_dir = tiny_encoder(), tempfile.mkdtemp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, log_dir, every=1):
            for _ in range(2):
                run_model("encoder", model).backward()
    messages = [str(w.message) for w in caught if "statistic 'outliers' failed" in str(w.message)]
    assert len(messages) == 1 and "broken on purpose" in messages[0]
    run = read_run(log_dir)
    assert [e.step for e in run.scalar_events("attention/max_logit@0.0.self_attn")] == [0, 1]
    assert "activation_stats/mean@1" in run.scalar_tags and "activation_stats/max_abs@1" not in run.scalar_tags


class HandWritten(nn.Module):
    """nanoGPT-style attention in a module whose name says nothing of attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(x.shape))


def test_hand_written_attention_needs_transformer_stats_true(read_run):
    torch.manual_seed(0)
    x = torch.randn(2, 10, 16)
    for statistics, expected in ((["default"], set()), (["default", "transformer"], {"sdpa.0"}), (["moments"], set())):
        model, log_dir = nn.Sequential(HandWritten()), tempfile.mkdtemp()
        with actviz.watch(model, log_dir, every=1, statistics=statistics, options=actviz.Options(strict=True)):
            model(x).sum().backward()
        run = read_run(log_dir)
        assert {tag.split("@")[1] for tag in run.scalar_tags if tag.startswith("attention/")} == expected
    # named after a watched module with children that encloses the call
    model, log_dir = nn.Sequential(HandWritten()), tempfile.mkdtemp()
    with actviz.watch(model, log_dir, every=1, layers=["0", "0.qkv"], statistics=["default", "transformer"],
        options=actviz.Options(strict=True)):
        model(x).sum().backward()
    q, k, _ = model[0].qkv(x).detach().view(2, 10, 3, 2, 8).permute(2, 0, 3, 1, 4)
    logits, probabilities = brute_force(q, k, is_causal=True)
    expected = expected_stats(logits, probabilities, list(range(1, 10)))
    run = read_run(log_dir)
    assert run.scalar("attention/max_logit@0", 0) == pytest.approx(expected[0].max().item(), rel=1e-5)
    assert run.scalar("attention/entropy_min@0", 0) == pytest.approx(expected[2].min().item(), rel=1e-5)
    assert run.scalar("attention/entropy_mean@0", 0) == pytest.approx(expected[2].mean().item(), rel=1e-5)
    assert run.scalar("attention/sink_fraction@0", 0) == pytest.approx((expected[3] > 0.3).double().mean().item())
    histogram = run.histogram("attention/head_max_logit@0", 0)  # one value per head
    assert (histogram.num, histogram.min, histogram.max) == (2, pytest.approx(expected[0].min().item(), rel=1e-6),
                                                             pytest.approx(expected[0].max().item(), rel=1e-6))
