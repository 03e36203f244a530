"""Mixture-of-experts router health: the router rule, the values read back against the batch's own
choices, Hugging Face MoE models from small configs, the dead-experts alert and ``actviz doctor``."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import NO_HOOKS, CountOps, hooks_left
from torch import nn

import actviz
from actviz.selection import layer_tag_names
from actviz.cli import main
from actviz.diagnosis.moe_alerts import DEAD_EXPERT_STEPS, DeadExperts
from actviz.transformers.attention import AttentionMode
from actviz.transformers.moe import RouterCalls, is_moe_module, router_vector

EXPERTS, TOP_K, WIDTH = 8, 2, 16
STATISTICS = ("load_max_over_mean", "dead_experts", "router_entropy", "topk_margin")


class TopKMoE(nn.Module):
    """A hand-written top-k block: ``self.router`` (an ``nn.Linear``) makes the logits, softmax and topk run here."""

    def __init__(self, logits_to_topk: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.logits_to_topk = logits_to_topk  # Mixtral's older shape: topk of the logits, softmax of the k chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        if self.logits_to_topk:
            top, chosen = torch.topk(logits, TOP_K, dim=-1)
            weights = F.softmax(top, dim=-1)
        else:
            weights, chosen = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        for expert, layer in enumerate(self.experts):  # dense, for a test: every expert sees every token
            out = out + layer(x) * (weights * (chosen == expert)).sum(-1, keepdim=True)
        return out


class Router(nn.Module):
    """Hugging Face's shape: linear, softmax and topk inside the router's own forward, which returns the choices."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.reshape(-1, WIDTH), self.weight)
        weights, chosen = torch.topk(F.softmax(logits.float(), dim=-1), TOP_K, dim=-1)
        return logits, weights, chosen


class SparseBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Router()
        self.expert = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, _ = self.gate(x)
        return self.expert(x) * weights.sum(-1).reshape(*x.shape[:-1], 1)


def moe_model(**kwargs) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), TopKMoE(**kwargs))


def expected(logits: torch.Tensor) -> dict[str, float]:
    """The four values of a batch's router logits, computed here in float64 from the definitions."""
    p = torch.softmax(logits.double().reshape(-1, EXPERTS), dim=-1)
    chosen = p.topk(TOP_K, dim=-1).indices
    load = torch.stack([(chosen == expert).sum() for expert in range(EXPERTS)]).double()
    entropy = -(p * p.log()).nan_to_num().sum(-1).mean()
    ranked = p.sort(dim=-1, descending=True).values
    return {"load_max_over_mean": float(load.max() / load.mean()), "dead_experts": float((load == 0).sum()),
            "router_entropy": float(entropy), "topk_margin": float((ranked[:, TOP_K - 1] - ranked[:, TOP_K]).mean()),
            "load": load.tolist()}


def train(model: nn.Module, log_dir, batches: list[torch.Tensor], **kwargs) -> actviz.Watcher:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=1, **kwargs) as viz:
            for x in batches:
                model(x).square().mean().backward()
    return viz


@pytest.mark.parametrize("logits_to_topk", [False, True], ids=["softmax then topk", "topk of the logits"])
def test_a_router_that_leaves_one_expert_out_logs_the_batchs_own_numbers(tmp_path, read_run, logits_to_topk):
    model = moe_model(logits_to_topk=logits_to_topk)
    with torch.no_grad():
        model[1].router.bias[3] = -1e4  # expert 3: chosen by no token
    x = torch.randn(4, 32, WIDTH)
    with torch.no_grad():
        want = expected(model[1].router(model[0](x)))
    assert want["dead_experts"] == 1 and want["load"][3] == 0
    train(model, tmp_path, [x])
    run = read_run(tmp_path)
    for statistic in STATISTICS:
        assert run.scalar(f"moe/{statistic}@1.router", 0) == pytest.approx(want[statistic], rel=1e-5, abs=1e-6)
    assert run.scalar("moe/load_max_over_mean@1.router", 0) == pytest.approx(max(want["load"]) / 32.0, rel=1e-7)
    load = run.histogram("moe/expert_load@1.router", 0)
    assert (load.num, load.sum, load.min, load.max) == (EXPERTS, 4 * 32 * TOP_K, 0, max(want["load"]))
    assert hooks_left(model) == NO_HOOKS


def test_a_router_that_calls_topk_in_its_own_forward_is_named_after_itself():
    block = SparseBlock()
    calls = RouterCalls({"gate", ""})
    x = torch.randn(3, 5, WIDTH)
    with AttentionMode(attention=False, routers=calls) as mode:
        mode.enter("gate")  # the step's pre-hook on the router
        block(x)
    (call,) = calls.calls
    with torch.no_grad():
        probabilities = torch.softmax(F.linear(x.reshape(-1, WIDTH), block.gate.weight), -1)
    assert (call.name, call.k) == ("gate", TOP_K)
    assert call.vector[:EXPERTS].sum() == 15 * TOP_K
    assert float(call.vector[EXPERTS]) == pytest.approx(float(torch.special.entr(probabilities).sum()), rel=1e-5)


def test_a_topk_outside_every_router_candidate_is_left_out():
    calls = RouterCalls({"moe.router"})
    with AttentionMode(attention=False, routers=calls) as mode:
        mode.enter("attn")
        torch.randn(4, 10).topk(3, dim=-1)  # in an attention module: no router's
        torch.randn(4, 10).topk(3, dim=0)  # not over the last dimension
    assert calls.calls == []


def hugging_face_moe(name: str) -> nn.Module:
    """A Mixtral, Qwen2-MoE or OLMoE causal LM of a small config, 2 layers of 4 experts, top 2, random init."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    if name == "mixtral":  # with the load-balancing loss, whose topk over every layer's logits is no router's
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True))
    if name == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32))
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **small, num_experts=4, num_experts_per_tok=2, eos_token_id=None, pad_token_id=None, bos_token_id=None))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_hugging_face_moe_models_get_every_tag_for_every_router(tmp_path, read_run, name):
    model, ids = hugging_face_moe(name).train(), torch.randint(0, 64, (4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1, layers="lm_head") as viz:  # routers are found whatever is watched
            for _ in range(DEAD_EXPERT_STEPS):
                model(input_ids=ids, labels=ids).loss.backward()
    run = read_run(tmp_path)
    names = layer_tag_names(model)  # model.layers.0.mlp.gate -> 0.gate: the tag name (one rule for every tag)
    routers = [names[f"model.layers.{layer}.mlp.gate"] for layer in range(2)]
    assert routers == ["0.gate", "1.gate"]
    assert {tag for tag in run.scalar_tags if tag.startswith("moe/")} == {
        f"moe/{statistic}@{router}" for router in routers for statistic in STATISTICS}
    assert {tag for tag in run.histogram_tags if tag.startswith("moe/")} == {f"moe/expert_load@{r}" for r in routers}
    for router in routers:
        assert 1 <= run.scalar(f"moe/load_max_over_mean@{router}", 2) <= 2  # 4 experts, top 2
        assert run.scalar(f"moe/dead_experts@{router}", 2) == 0
        assert 0 < run.scalar(f"moe/router_entropy@{router}", 2) <= math.log(4) + 1e-6
        assert 0 <= run.scalar(f"moe/topk_margin@{router}", 2) <= 1
        assert run.histogram(f"moe/expert_load@{router}", 2).sum == 64 * 2
    assert [alert for alert in viz.alerts if alert.rule == "dead_experts"] == []  # healthy: no alarm


@pytest.mark.parametrize(("statistics", "attention", "moe"), [
    (["default"], True, True), (["moments", "moe"], False, True), (["moments", "attention"], True, False)])
def test_one_mode_serves_attention_and_routers_each_turned_off_alone(tmp_path, read_run, statistics, attention, moe):
    model, ids = hugging_face_moe("qwen2_moe").train(), torch.randint(0, 64, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1, layers="lm_head", statistics=statistics):
            model(input_ids=ids, labels=ids).loss.backward()
    kinds = {tag.split("/", 1)[0] for tag in read_run(tmp_path).scalar_tags}
    assert ("attention" in kinds, "moe" in kinds) == (attention, moe)


def test_deepseek_v3s_group_limited_router_logs_its_choice_over_every_expert(tmp_path, read_run):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=64, max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model, ids = transformers.DeepseekV3ForCausalLM(config).train(), torch.randint(0, 64, (4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1, layers="lm_head"):
            model(input_ids=ids, labels=ids).loss.backward()
    load = read_run(tmp_path).histogram("moe/expert_load@0.gate", 0)
    assert (load.num, load.sum) == (8, 64 * 2)  # its topk over 8 experts, not the one over 2 groups before it


def test_moe_false_and_a_model_without_moe_log_no_router(tmp_path, read_run):
    x = torch.randn(4, 32, WIDTH)
    train(moe_model(), tmp_path / "off", [x], statistics=["moments", "transformer"])
    assert not any(tag.startswith("moe/") for tag in read_run(tmp_path / "off").scalar_tags)

    class Block(nn.Module):  # a top-k router that no class name says
        def __init__(self) -> None:
            super().__init__()
            self.scores = nn.Linear(WIDTH, EXPERTS)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weights, _ = self.scores(x).softmax(-1).topk(TOP_K)
            return x * weights.sum(-1, keepdim=True)

    torch.manual_seed(0)
    train(Block(), tmp_path / "auto", [x])
    assert not any(tag.startswith("moe/") for tag in read_run(tmp_path / "auto").scalar_tags)
    torch.manual_seed(0)
    train(Block(), tmp_path / "on", [x], statistics=["default", "moe"])
    assert {tag for tag in read_run(tmp_path / "on").scalar_tags if tag.startswith("moe/")} == {
        f"moe/{statistic}@scores" for statistic in STATISTICS}


def test_steps_that_do_not_log_enter_no_mode_and_attach_nothing(tmp_path):
    model = moe_model()
    modes = []
    model[1].register_forward_pre_hook(lambda module, args: modes.append(torch._C._len_torch_function_stack()))
    hooks = hooks_left(model[1])
    with actviz.watch(model, tmp_path, every=2, image_every=False):
        for _ in range(3):
            model(torch.randn(2, 8, WIDTH)).sum().backward()
            # between steps: no hook of actviz on the block's modules; its parameters carry the gradient norms' hook
            assert hooks_left(model[1]) == {**hooks, "param": hooks["param"] + len(list(model[1].parameters()))}
    assert modes == [1, 0, 1]


def test_a_router_call_costs_ten_kernels_and_no_sync():
    probabilities = torch.softmax(torch.randn(64, EXPERTS), -1)
    indices = probabilities.topk(TOP_K).indices
    with CountOps() as counted:
        router_vector(probabilities, indices, TOP_K)
    assert counted.syncs == [] and len(counted.kernels) == 10, counted.kernels
    calls, x = RouterCalls(None), torch.randn(64, EXPERTS)
    with CountOps() as bare:
        x.topk(TOP_K)
    with AttentionMode(attention=False, routers=calls) as mode:
        mode.enter("router")
        with CountOps() as watched:
            x.topk(TOP_K)  # the logits themselves: one softmax more
    assert len(watched.kernels) - len(bare.kernels) == 11 and watched.syncs == [] and len(calls.calls) == 1


def test_a_logging_forward_of_mixtral_adds_ten_kernels_per_router(tmp_path):
    ids, kernels, syncs = torch.randint(0, 64, (2, 16)), {}, {}
    for moe in (False, True):
        model = hugging_face_moe("mixtral").train()  # the same weights: the same experts run
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with actviz.watch(model, tmp_path / str(moe), every=1, layers="lm_head",
                              statistics=["moments", "transformer", *(["moe"] if moe else [])]):
                for _ in range(2):  # the second: a process's first logging forward makes a few things once
                    with CountOps() as counted:
                        loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
        kernels[moe], syncs[moe] = len(counted.kernels), counted.syncs
    assert kernels[True] - kernels[False] == 2 * 10 and syncs[True] == syncs[False]  # the model's own nonzero


def test_experts_dead_for_three_logging_steps_raise_one_alert_and_doctor_lists_it(tmp_path, capsys):
    model = moe_model()
    with torch.no_grad():
        model[1].router.bias[5] = -1e4
    batches = [torch.randn(4, 32, WIDTH) for _ in range(DEAD_EXPERT_STEPS + 1)]
    viz = train(model, tmp_path, batches)
    dead = [alert for alert in viz.alerts if alert.rule == "dead_experts"]
    assert [(alert.step, alert.layer, alert.value) for alert in dead] == [(DEAD_EXPERT_STEPS - 1, "1.router", 1.0)]
    assert "expert 5 chosen by no token for 3 logging steps in a row" in dead[0].message
    assert main(["doctor", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "dead_experts" in out and "1.router" in out


def test_experts_that_recover_and_die_again_are_named_again(tmp_path):
    model = moe_model()
    batches = [torch.randn(4, 32, WIDTH) for _ in range(2 * DEAD_EXPERT_STEPS + 1)]

    def bias(step: int, module: nn.Module, args: tuple) -> None:  # expert 5 dead but at step 3
        with torch.no_grad():
            module.router.bias[5] = 0.0 if step == DEAD_EXPERT_STEPS else -1e4

    steps = iter(range(len(batches)))
    model[1].register_forward_pre_hook(lambda module, args: bias(next(steps), module, args))
    viz = train(model, tmp_path, batches)
    assert [alert.step for alert in viz.alerts if alert.rule == "dead_experts"] == [2, 6]


def test_a_healthy_router_raises_no_alert(tmp_path):
    model = moe_model()
    with torch.no_grad():  # Hugging Face's router init: near-uniform load. At nn.Linear's own init this router
        model[1].router.weight.normal_(std=0.02)  # leaves expert 2 almost unchosen (0 to 2 tokens of 128)
        model[1].router.bias.zero_()
    viz = train(model, tmp_path, [torch.randn(4, 32, WIDTH) for _ in range(DEAD_EXPERT_STEPS + 2)])
    assert [alert for alert in viz.alerts if alert.rule == "dead_experts"] == []


def test_the_dead_experts_rule_follows_the_same_experts_and_judges_big_enough_batches():
    rule = DeadExperts()
    busy = [32.0] * 4
    assert rule.check(0, {"r": [64.0, 64.0, 0.0, 0.0]}) == []
    assert rule.check(1, {"r": [64.0, 0.0, 64.0, 0.0]}) == []  # expert 3 is the one dead both times
    assert rule.check(2, {"r": [128.0, 0.0, 0.0, 0.0]})[0].message.startswith("dead experts in 'r' at step 2: expert 3 ")
    assert rule.check(3, {"r": [128.0, 0.0, 0.0, 0.0]}) == []  # once a streak
    assert rule.check(4, {"r": busy}) == []
    for step in range(5, 5 + DEAD_EXPERT_STEPS):  # expert 1 dead from the step expert 3's streak ends
        found = rule.check(step, {"r": [64.0, 0.0, 64.0, 0.0] if step == 5 else [64.0, 0.0, 64.0, 64.0]})
    assert [alert.step for alert in found] == [7]  # a streak of its own
    small = [2.0, 2.0, 0.0, 0.0]  # 1 token per expert on average: experts left out by chance
    assert [rule.check(step, {"s": small}) for step in range(4)] == [[], [], [], []]


def test_moe_is_checked_and_class_names_pick_the_default():
    with pytest.raises(TypeError, match=r"^watch\(\) no longer takes moe=; pass statistics=\['default', 'moe'\] to "):
        actviz.watch(nn.Linear(2, 2), moe=True)
    names = {"MixtralSparseMoeBlock": True, "Qwen2MoeTopKRouter": True, "SwitchTransformersTop1Router": True,
             "TopKGate": True, "OlmoeExperts": True, "GatedMLP": False, "Aggregate": False, "Linear": False}
    for name, want in names.items():
        assert is_moe_module(type(name, (nn.Module,), {})()) is want, name


def test_a_failing_router_statistic_warns_once_and_training_goes_on(tmp_path, read_run, monkeypatch):
    import actviz.transformers.moe as moe

    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(moe, "router_vector", broken)
    model = moe_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tmp_path, every=1):
            for _ in range(2):
                model(torch.randn(2, 8, WIDTH)).sum().backward()
    assert len([w for w in caught if "broken on purpose" in str(w.message)]) == 1
    run = read_run(tmp_path)
    assert run.scalar_events("activation_stats/mean@1.router") and not any(t.startswith("moe/") for t in run.scalar_tags)


# --- What a router's numbers mean at the edges: a NaN router, no tokens, a dense k == experts router.


def test_a_nan_router_names_no_dead_expert(tmp_path, read_run):
    # topk of NaN rows picks the same experts whatever the router learned: no routing collapse to report.
    model = moe_model()
    with torch.no_grad():
        model[1].router.bias[0] = math.nan  # every row of logits has a NaN: its softmax is NaN
    viz = train(model, tmp_path, [torch.randn(4, 32, WIDTH) for _ in range(DEAD_EXPERT_STEPS + 1)])
    run = read_run(tmp_path)
    assert not {tag for tag in run.scalar_tags if tag.endswith(("/dead_experts", "/load_max_over_mean"))}
    assert "moe/expert_load@1.router" not in run.histogram_tags
    assert math.isnan(run.scalar("moe/router_entropy@1.router", DEAD_EXPERT_STEPS))  # the NaN itself is written
    assert [alert for alert in viz.alerts if alert.rule == "dead_experts"] == []


def test_a_batch_of_no_tokens_writes_no_router_numbers(tmp_path, read_run):
    model = moe_model()
    train(model, tmp_path, [torch.randn(4, 32, WIDTH), torch.randn(0, 32, WIDTH)])
    run = read_run(tmp_path)
    assert run.scalar("moe/dead_experts@1.router", 0) == 0
    at_step_1 = [tag for tag in run.scalar_tags if tag.startswith("moe/") and 1 in [e.step for e in run.scalar_events(tag)]]
    at_step_1 += [tag for tag in run.histogram_tags if tag.startswith("moe/") and 1 in run.histogram_steps(tag)]
    assert at_step_1 == []


class DenseMoE(TopKMoE):
    """k == experts: every token goes to every expert, weighted by the softmax (a dense config of a top-k block)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(self.router(x), dim=-1).topk(EXPERTS, dim=-1)
        return sum(layer(x) * (weights * (chosen == expert)).sum(-1, keepdim=True)
                   for expert, layer in enumerate(self.experts))


def test_a_dense_router_is_named_once_with_its_entropy(tmp_path, read_run):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), DenseMoE())
    batches = [torch.randn(4, 32, WIDTH) for _ in range(2)]
    with pytest.warns(RuntimeWarning, match=r"router '1\.router' chooses every one of its experts") as caught:
        with actviz.watch(model, tmp_path, every=1) as viz:
            for x in batches:
                model(x).square().mean().backward()
    assert len([w for w in caught if "chooses every one" in str(w.message)]) == 1
    run = read_run(tmp_path)
    assert {tag for tag in run.scalar_tags | run.histogram_tags if tag.startswith("moe/")} == {"moe/router_entropy@1.router"}
    with torch.no_grad():
        p = torch.softmax(model[1].router(model[0](batches[1])).double(), -1)
    assert run.scalar("moe/router_entropy@1.router", 1) == pytest.approx(float(-(p * p.log()).sum(-1).mean()), rel=1e-5)
    assert [alert for alert in viz.alerts if alert.rule == "dead_experts"] == []


# Routers written as Hugging Face writes them (transformers' modeling_ernie4_5_moe.py, modeling_deepseek_v2.py's
# group_limited_greedy, modeling_deepseek_v3.py, modeling_phimoe.py's sparsemixer), small and random: what their
# topk (or max) saw is their own tensor, so the truth is computed from it here, in float64.
GROUPS = 4


class ErnieStatics(nn.Module):
    """Ernie4_5_MoeStatics: the gate's correction bias, added to the probabilities in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(0.05 * torch.rand(1, EXPERTS), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.e_score_correction_bias.squeeze()


class EditedRouterMoe(nn.Module):
    """``style``: "ernie" (softmax, a bias added, topk), "deepseek_v2" (softmax, groups masked with masked_fill,
    topk), "deepseek_v3" (sigmoid, a bias added, groups by their top-2 sum masked, topk), "phimoe" (max of the
    logits: sparsemixer's first expert). ``seen`` keeps what the choice was made over, and the indices chosen."""

    def __init__(self, style: str, sharpness: float = 3.0, groups: int = GROUPS, topk_group: int = 2) -> None:
        super().__init__()
        self.style, self.groups, self.topk_group = style, groups, topk_group
        self.gate = nn.Linear(WIDTH, EXPERTS, bias=False)
        with torch.no_grad():
            self.gate.weight.mul_(sharpness)
        self.moe_statics = ErnieStatics()
        self.register_buffer("e_score_correction_bias", 0.05 * torch.rand(EXPERTS))
        self.expert = nn.Linear(WIDTH, WIDTH)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = self.gate(hidden_states.float())
        tokens = hidden_states.shape[0]
        if self.style == "ernie":
            routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
            chosen_over = self.moe_statics(routing_weights)
            _, selected_experts = torch.topk(chosen_over, TOP_K, dim=-1)
            return torch.gather(routing_weights, dim=-1, index=selected_experts), (chosen_over, selected_experts)
        if self.style == "deepseek_v2":
            scores = router_logits.softmax(dim=-1, dtype=torch.float32)
            group_scores = scores.view(tokens, self.groups, -1).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(tokens, self.groups, EXPERTS // self.groups).reshape(tokens, -1)
            tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
            topk_weight, topk_idx = torch.topk(tmp_scores, k=TOP_K, dim=-1, sorted=False)
            return topk_weight, (tmp_scores, topk_idx)
        if self.style == "deepseek_v3":
            router_logits = router_logits.sigmoid()
            scores_for_choice = router_logits.view(-1, EXPERTS) + self.e_score_correction_bias.unsqueeze(0)
            per_group = EXPERTS // self.groups
            group_scores = scores_for_choice.view(-1, self.groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, self.groups, per_group).reshape(-1, EXPERTS)
            scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
            topk_indices = torch.topk(scores_for_choice, k=TOP_K, dim=-1, sorted=False)[1]
            return router_logits.gather(1, topk_indices), (scores_for_choice, topk_indices)
        with torch.no_grad():  # phimoe's sparsemixer, first expert
            mask_logits_threshold, max_ind = router_logits.max(dim=-1, keepdim=True)
        masked_gates = torch.softmax(router_logits.masked_fill(router_logits < mask_logits_threshold - 1, float("-inf")), -1)
        return masked_gates.gather(-1, max_ind), (router_logits, max_ind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden_states = x.view(-1, WIDTH)
        weights, seen = self.route(hidden_states)
        self.seen.append(tuple(tensor.detach() for tensor in seen))
        return (self.expert(hidden_states) * weights.sum(-1, keepdim=True)).view_as(x)


def choice_truth(chosen_over: torch.Tensor, indices: torch.Tensor, style: str) -> dict[str, float]:
    """Entropy and margin of the distribution the choice was made over (the logits' softmax for a max over logits,
    else the scores normalized to sum to 1), and the load of the indices chosen, in float64."""
    seen = chosen_over.double()
    p = torch.softmax(seen, -1) if style == "phimoe" else seen.clamp(min=0) / seen.clamp(min=0).sum(-1, keepdim=True)
    k = indices.shape[-1]
    load = torch.bincount(indices.reshape(-1), minlength=EXPERTS).double()
    ranked = p.sort(dim=-1, descending=True).values
    return {"load_max_over_mean": float(load.max() / load.mean()), "dead_experts": float((load == 0).sum()),
            "router_entropy": float(torch.special.entr(p).sum(-1).mean()),
            "topk_margin": float((ranked[:, k - 1] - ranked[:, k]).mean())}


@pytest.mark.parametrize("style", ["ernie", "deepseek_v2", "deepseek_v3", "phimoe"])
def test_a_router_that_edits_its_scores_or_routes_with_max_logs_what_its_choice_saw(tmp_path, read_run, style):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), EditedRouterMoe(style))
    train(model, tmp_path, [torch.randn(4, 16, WIDTH)])
    (chosen_over, indices), = model[1].seen
    want = choice_truth(chosen_over, indices, style)
    run = read_run(tmp_path)
    router = "1.moe_statics" if style == "ernie" else "1.gate"  # the module whose output the choice was made over
    assert {tag for tag in run.scalar_tags if tag.startswith("moe/")} == {f"moe/{s}@{router}" for s in STATISTICS}
    for statistic in STATISTICS:
        assert run.scalar(f"moe/{statistic}@{router}", 0) == pytest.approx(want[statistic], rel=1e-5, abs=1e-6), statistic
    if style != "phimoe":  # a second softmax of scores near 0..1 reads near log(8) whatever the router learned
        again = torch.softmax(chosen_over.double(), -1)
        assert abs(float(torch.special.entr(again).sum(-1).mean()) - want["router_entropy"]) > 0.2


def test_a_sigmoid_routers_entropy_follows_its_normalized_scores_as_they_sharpen(tmp_path, read_run):
    # DeepSeek-V3's router with one group, no bias: the normalized sigmoid scores go from near uniform to one expert.
    truths, logged = [], []
    for step, sharpness in enumerate([0.01, 1.0, 3.0, 10.0, 40.0]):
        torch.manual_seed(0)
        block = EditedRouterMoe("deepseek_v3", sharpness, groups=1, topk_group=1)
        block.e_score_correction_bias.zero_()
        with torch.no_grad():  # each token's strongest expert by a margin that grows with the sharpness
            block.gate.weight.copy_(sharpness * torch.eye(EXPERTS, WIDTH))
        x = torch.randn(64, WIDTH).abs() * torch.eye(EXPERTS, WIDTH)[torch.arange(64) % EXPERTS] * 3 - 1
        train(block, tmp_path / str(step), [x])
        scores = torch.sigmoid(block.gate(x).double())
        p = scores / scores.sum(-1, keepdim=True)
        truths.append(float(torch.special.entr(p).sum(-1).mean()))
        logged.append(read_run(tmp_path / str(step)).scalar("moe/router_entropy@gate", 0))
    assert truths[0] > 2.0 and truths[-1] < 0.15  # the truth falls from about log(8) to near 0
    assert logged == pytest.approx(truths, abs=1e-5)


@pytest.mark.slow  # builds a Hugging Face model: about 8 s with the import on 2 cores
def test_hugging_face_phimoe_routes_with_max_and_logs_its_first_choice(tmp_path, read_run):
    transformers = pytest.importorskip("transformers")
    config = transformers.PhimoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=4, vocab_size=64, max_position_embeddings=64,
                                       num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model, ids = transformers.PhimoeForCausalLM(config).train(), torch.randint(0, 64, (2, 16))
    router = model.model.layers[0].mlp.router
    seen = []
    router.register_forward_hook(lambda module, args, output: seen.append((output[0].detach(), output[2])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1, layers="lm_head"):
            model(input_ids=ids, labels=ids).loss.backward()
    (logits, selected), = seen
    p = torch.softmax(logits.double(), -1)
    # sparsemixer's first max over the logits (in training it then draws its first expert with Gumbel noise)
    load = torch.bincount(logits.argmax(-1), minlength=4).double()
    assert selected.shape == (32, 2)
    ranked = p.sort(-1, descending=True).values
    want = {"load_max_over_mean": float(load.max() / load.mean()), "dead_experts": float((load == 0).sum()),
            "router_entropy": float(torch.special.entr(p).sum(-1).mean()), "topk_margin": float((ranked[:, 0] - ranked[:, 1]).mean())}
    run = read_run(tmp_path)
    name = layer_tag_names(model)["model.layers.0.mlp.router"]
    assert {tag for tag in run.scalar_tags if tag.startswith("moe/")} == {f"moe/{s}@{name}" for s in STATISTICS}
    for statistic in STATISTICS:
        assert run.scalar(f"moe/{statistic}@{name}", 0) == pytest.approx(want[statistic], rel=1e-5, abs=1e-6), statistic


def test_scores_cost_four_kernels_more_than_probabilities_and_no_sync():
    # sigmoid scores: clamp, sum, clamp, divide to normalize them; probabilities go to router_vector as they are
    def kernels(make) -> CountOps:
        calls = RouterCalls(None)
        with AttentionMode(attention=False, routers=calls) as mode:
            mode.enter("router")
            x = make(torch.randn(64, EXPERTS))
            with CountOps() as counted:
                x.topk(TOP_K)
        assert len(calls.calls) == 1 and counted.syncs == []
        return counted

    scores, probabilities = kernels(torch.sigmoid), kernels(lambda logits: logits.softmax(-1))
    logits = kernels(lambda logits: logits)
    assert len(scores.kernels) - len(probabilities.kernels) == 4
    assert len(logits.kernels) - len(probabilities.kernels) == 1  # the softmax of logits


@pytest.mark.parametrize("edit", ["+=", "masked_fill_"])
def test_probabilities_edited_in_place_are_scores_too(edit):
    calls, logits, bias = RouterCalls(None), torch.randn(6, EXPERTS), 0.1 * torch.rand(EXPERTS)
    with AttentionMode(attention=False, routers=calls) as mode:
        mode.enter("router")
        p = logits.softmax(-1)
        if edit == "+=":
            p += bias
        else:
            p.masked_fill_(logits < 0, 0.0)
        p.topk(TOP_K)
    q = logits.double().softmax(-1)
    q = q + bias.double() if edit == "+=" else q.masked_fill(logits < 0, 0.0)
    q = q / q.sum(-1, keepdim=True)
    assert float(calls.calls[0].vector[-2]) == pytest.approx(float(torch.special.entr(q).sum()), rel=1e-5)
