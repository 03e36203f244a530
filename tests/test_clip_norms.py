"""The gradient norms before and after clipping (``gradient_clipping/*``), and gradient spikes in clipped runs.

Every value is read back from the event file and compared, in float64 tolerance, with torch's own norms:
what ``clip_grad_norm_`` returns and ``torch.nn.utils.get_total_norm`` of the gradients after clipping.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import actviz

PRE, POST, COEFFICIENT = "gradient_clipping/pre_clip_norm", "gradient_clipping/post_clip_norm", "gradient_clipping/coefficient"


def total_norm(tensors) -> float:
    """The global L2 norm of ``tensors``, by hand in float64."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


@pytest.mark.parametrize("clip", ["norm", "value", "none"])
def test_the_norms_equal_what_clip_grad_norm_returns_and_get_total_norm_after_it(clip, tmp_path, read_run):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    expected = {}
    with actviz.watch(model, tmp_path, every=4) as viz:  # two micro-batches an optimizer step: steps 0, 4 log
        for update in range(4):
            for micro in range(2):
                model(torch.randn(8, 6)).square().mean().mul(3.0 if micro else 1.0).backward()
            grads = [p.grad for p in model.parameters()]
            before = total_norm(grads)
            squares = {name: sum(float(p.grad.double().square().sum()) for p in model[index].parameters())
                       for name, index in (("0", 0), ("2", 2), ("4", 4))}
            if clip == "norm":
                returned = float(nn.utils.clip_grad_norm_(model.parameters(), 0.05))
                assert returned == pytest.approx(before, rel=1e-6)
            elif clip == "value":
                nn.utils.clip_grad_value_(model.parameters(), 0.01)
            after = float(nn.utils.get_total_norm([p.grad for p in model.parameters()]))
            expected[2 * update] = before, after, squares
            optimizer.step()
            optimizer.zero_grad()
        viz.flush()
    run = read_run(tmp_path)
    assert [event.step for event in run.scalar_events(PRE)] == [0, 4]
    for step in (0, 4):
        before, after, squares = expected[step]
        assert run.scalar(PRE, step) == pytest.approx(before, rel=1e-6)  # the complete gradient of both micro-batches
        assert run.scalar(POST, step) == pytest.approx(after, rel=1e-6)
        assert run.scalar(COEFFICIENT, step) == pytest.approx(after / before, rel=1e-6)
        for layer, square in squares.items():
            assert run.scalar(f"gradient_clipping/share@{layer}", step) == pytest.approx(square / before**2, rel=1e-5)
    if clip == "norm":
        assert run.scalar(POST, 4) == pytest.approx(0.05, rel=1e-5)  # max_norm / norm: clipping acted
    if clip == "none":
        assert run.scalar(COEFFICIENT, 4) == pytest.approx(1.0, abs=1e-6)
    (text,) = [event for event in run.events.Tensors("gradient_clipping/top_layers") if event.step == 4]
    top = max(expected[4][2], key=expected[4][2].get)
    assert text.tensor_proto.string_val[0].decode().startswith(f"{top} ")


def clipped_run(log_dir, spike_at: int, steps: int = 40, **watch_kwargs):
    """A clipped run (clip 1.0) with the loss x1000 at ``spike_at``; the watcher and each step's norm by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    norms = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=10, **watch_kwargs) as viz:
            for step in range(steps):
                optimizer.zero_grad()
                (model(torch.randn(8, 4)).square().mean() * (1000.0 if step == spike_at else 1.0)).backward()
                norms[step] = float(nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                optimizer.step()
            viz.flush()
    return viz, norms


@pytest.mark.parametrize("spike_at", [30, 33], ids=["at a logging step", "between logging steps"])
def test_a_spike_in_a_clipped_run_alerts_with_the_one_line(spike_at, tmp_path, read_run):
    viz, norms = clipped_run(tmp_path, spike_at)
    (alert,) = [alert for alert in viz.alerts if alert.rule == "gradient_spike"]
    assert alert.step == spike_at
    assert alert.value == pytest.approx(norms[spike_at], rel=1e-5)  # the norm before clipping, not the 1.0 applied
    coefficient = 1.0 / norms[spike_at]
    assert f"clipping scaled the gradient by {coefficient:.3g} (the optimizer applied a norm of 1)" in alert.message
    run = read_run(tmp_path)
    texts = [event.tensor_proto.string_val[0].decode() for event in run.events.Tensors("alerts")]
    assert sum("gradient_spike" in text for text in texts) == 1
    assert not any(tag.startswith("spikes/") for tag in run.scalar_tags)  # the ring's norms: with actviz.Spikes()


def test_a_healthy_clipped_run_has_no_spike_and_alerts_false_judges_none(tmp_path):
    viz, _ = clipped_run(tmp_path / "healthy", spike_at=-1, steps=60)
    assert viz.alerts == []
    viz, _ = clipped_run(tmp_path / "off", spike_at=33, alerts=False)
    assert viz.alerts == []


class TinyGPT(nn.Module):
    """nanoGPT's shape, tiny: token and position embeddings, one pre-LayerNorm block, a tied head."""

    def __init__(self, vocab: int = 32, width: int = 16, length: int = 8) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.ln_1, self.attn = nn.LayerNorm(width), nn.MultiheadAttention(width, 2, batch_first=True)
        self.ln_2, self.mlp = nn.LayerNorm(width), nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                                 nn.Linear(4 * width, width))
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        h = self.ln_1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.ln_2(x))
        logits = self.lm_head(self.ln_f(x))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_nanogpt_loop_logs_the_norm_clip_grad_norm_returns(tmp_path, read_run):
    """karpathy/nanoGPT train.py's loop: AdamW with its decay groups, micro-steps with the loss divided, the next
    batch fetched before backward, ``scaler.unscale_``, ``clip_grad_norm_(…, 1.0)``, ``scaler.step``."""
    torch.manual_seed(0)
    model = TinyGPT()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # float32 on a CPU, as nanoGPT's scaler there
    accumulation, returned = 2, {}

    def get_batch():
        data = torch.randint(0, 32, (4, 9))
        return data[:, :-1], data[:, 1:]

    X, Y = get_batch()
    with actviz.watch(model, tmp_path, every=2) as viz:  # one logging step per optimizer step
        for iteration in range(3):
            for _micro_step in range(accumulation):
                _, loss = model(X, Y)
                loss = loss / accumulation
                X, Y = get_batch()
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            returned[2 * iteration] = float(nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            after = float(nn.utils.get_total_norm([p.grad for p in model.parameters()]))
            returned[2 * iteration] = (returned[2 * iteration], after)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        viz.flush()
    run = read_run(tmp_path)
    for step, (before, after) in returned.items():
        assert run.scalar(PRE, step) == pytest.approx(before, rel=1e-6)
        assert run.scalar(POST, step) == pytest.approx(after, rel=1e-6)
    shares = sum(event.value for tag in run.scalar_tags if tag.startswith("gradient_clipping/share@")
                 for event in run.scalar_events(tag) if event.step == 4)
    assert shares == pytest.approx(1.0, rel=1e-6)  # the tied weight counted once, as clip_grad_norm_ counts it


def test_word_language_model_logs_the_norm_before_clipping_and_catches_a_spike_between_logging_steps(tmp_path,
                                                                                                    read_run):
    """pytorch/examples' word_language_model: clip 0.25 and ``p.data.add_(p.grad, alpha=-lr)``, no optimizer object.
    With no optimizer step to read them at, the norms after clipping are not written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(40, 20))
    tokens = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(0))
    norms = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=10) as viz:
            for step in range(36):
                model.zero_grad()
                loss = nn.functional.cross_entropy(model(tokens[:, :5]), tokens[:, 5])
                (loss * (1000.0 if step == 33 else 1.0)).backward()
                norms[step] = float(nn.utils.clip_grad_norm_(model.parameters(), 0.25))
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.1)
            viz.flush()
    run = read_run(tmp_path)
    for step in (0, 10, 20, 30):
        assert run.scalar(PRE, step) == pytest.approx(norms[step], rel=1e-6)
    assert POST not in run.scalar_tags and COEFFICIENT not in run.scalar_tags
    (alert,) = [alert for alert in viz.alerts if alert.rule == "gradient_spike"]
    assert alert.step == 33 and alert.value == pytest.approx(norms[33], rel=1e-5)
    assert "no optimizer step applied it" in alert.message


@pytest.mark.slow
def test_the_hugging_face_trainer_max_grad_norm_logs_the_norm_it_reports(tmp_path, read_run):
    pytest.importorskip("accelerate")
    hf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = hf.GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    model = hf.GPT2LMHeadModel(config)  # random init
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 40, (8, 8), generator=generator)]
    args = hf.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2,
                                max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none",
                                use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, learning_rate=0.05)
    trainer = hf.Trainer(model=model, args=args, train_dataset=data)
    with actviz.watch(model, tmp_path / "run", every=1):
        trainer.train()
    reported = {entry["step"]: entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry}
    run = read_run(tmp_path / "run")
    assert [event.step for event in run.scalar_events(PRE)] == [0, 1, 2, 3]
    for step in range(4):  # the Trainer counts optimizer steps from 1
        before = float(reported[step + 1])
        assert run.scalar(PRE, step) == pytest.approx(before, rel=1e-5)
        assert run.scalar(POST, step) == pytest.approx(min(before, 1.0), rel=1e-5)


def _ddp_clipping_worker(rank: int, init_file: str, log_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from conftest import small_cnn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = DistributedDataParallel(small_cnn())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        returned = []
        with actviz.watch(model, log_dir, every=1):
            for step in range(2):
                batch = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(100 * rank + step))
                optimizer.zero_grad()
                model(batch).square().mean().backward()
                returned.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
                optimizer.step()
        torch.save({"returned": returned}, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_logs_the_norm_of_the_averaged_gradient_before_clipping(tmp_path, read_run):
    from test_distributed import run_workers

    run_workers(_ddp_clipping_worker, str(tmp_path / "init"), str(tmp_path / "run"), str(tmp_path))
    returned = [torch.load(tmp_path / f"rank{rank}.pt")["returned"] for rank in range(2)]
    assert returned[0] == pytest.approx(returned[1], rel=1e-6)  # all-reduced: every rank clips the same gradient
    run = read_run(tmp_path / "run")
    for step in range(2):
        assert run.scalar(PRE, step) == pytest.approx(returned[0][step], rel=1e-5)
        assert run.scalar(POST, step) == pytest.approx(0.1, rel=1e-5)


def test_with_a_grad_scaler_the_norms_are_of_the_unscaled_gradients(tmp_path, read_run):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    returned = {}
    with actviz.watch(model, tmp_path, every=2, options=actviz.Options(grad_scaler=scaler)) as viz:
        for step in range(4):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(8, 6)).square().mean()).backward()
            scaler.unscale_(optimizer)
            returned[step] = float(nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            scaler.step(optimizer)
            scaler.update()
        viz.flush()
    run = read_run(tmp_path)
    for step in (0, 2):
        assert run.scalar(PRE, step) == pytest.approx(returned[step], rel=1e-6)  # not 1024 times it
        assert run.scalar(POST, step) == pytest.approx(0.05, rel=1e-5)


def test_a_closure_that_clips_inside_the_optimizer_step_as_lightning_does(tmp_path, read_run):
    """Lightning's ``gradient_clip_val``: ``optimizer.step(closure)``, the closure runs forward, backward and
    ``clip_grad_norm_`` inside the step, after its pre-hook."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    returned, after = {}, {}
    with actviz.watch(model, tmp_path, every=2) as viz:
        for step in range(4):
            def closure(step=step):
                optimizer.zero_grad()
                loss = model(torch.randn(8, 6)).square().mean()
                loss.backward()
                returned[step] = float(nn.utils.clip_grad_norm_(model.parameters(), 0.05))
                after[step] = float(nn.utils.get_total_norm([p.grad for p in model.parameters()]))
                return loss

            optimizer.step(closure)
        viz.flush()
    run = read_run(tmp_path)
    for step in (0, 2):
        assert run.scalar(PRE, step) == pytest.approx(returned[step], rel=1e-6)
        assert run.scalar(POST, step) == pytest.approx(after[step], rel=1e-6)


@pytest.mark.slow
def test_lightnings_gradient_clip_val_logs_the_norm_before_and_after_clipping(tmp_path, read_run):
    pl = pytest.importorskip("lightning.pytorch")
    from test_integrations import fit, lit_cnn

    from actviz.integrations.lightning import ActvizCallback

    class Norms(pl.Callback):
        """Lightning calls it after the closure's backward, before clipping; the step's end sees what was applied."""

        def __init__(self) -> None:
            self.before, self.after = {}, {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.before[trainer.global_step] = total_norm(p.grad for p in pl_module.parameters() if p.grad is not None)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.after[trainer.global_step - 1] = total_norm(grads)

    norms = Norms()
    trainer = fit(pl, lit_cnn(pl), tmp_path, [ActvizCallback(every=2), norms], gradient_clip_val=0.05)
    run = read_run(trainer.logger.log_dir)
    assert [event.step for event in run.scalar_events(PRE)] == [0, 2, 4]
    for step in (0, 2, 4):
        assert run.scalar(PRE, step) == pytest.approx(norms.before[step], rel=1e-5)
        assert run.scalar(POST, step) == pytest.approx(norms.after[step], rel=1e-5)
        assert norms.after[step] == pytest.approx(0.05, rel=1e-4)  # clipping acted
