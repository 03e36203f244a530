"""DistributedDataParallel on two CPU processes (gloo): rank 0 writes, rank 1 doesn't, nobody hangs."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import NO_HOOKS, Run, hooks_left, small_cnn, train_step, use_code_path
from torch.nn.parallel import DistributedDataParallel

import actviz
from actviz.common.histogram_buckets import expand_empty_buckets

WORLD_SIZE = 2
STEPS = 4


def _worker(rank: int, init_file: str, log_root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(small_cnn())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        viz = actviz.watch(model, Path(log_root) / f"rank{rank}", every=2)
        assert (viz.writer is None) == (rank != 0)
        for _ in range(STEPS):
            train_step(model, optimizer)
        viz.close()
        assert hooks_left(model) == NO_HOOKS
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _collected(rank: int, worker, *args) -> None:
    """``worker(rank, *args)``, then a garbage collection while the interpreter is whole.

    A caught exception (an import's, say) leaves frames in a reference cycle, and with them the
    worker's locals: the DDP model and what it holds of gloo. Left to the interpreter's shutdown,
    their destruction can abort the process ("terminate called without an active exception",
    about one run in thirty here; pytorch#179291 describes how). Collected here, they go
    while Python still runs, as in a training script whose model goes out of scope before exit.
    """
    worker(rank, *args)
    gc.collect()


def run_workers(worker, *args, timeout: float = 180) -> None:
    """Run ``worker(rank, *args)`` on WORLD_SIZE processes; fail instead of hanging past ``timeout``."""
    context = mp.start_processes(_collected, args=(worker, *args), nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=5):
            assert time.monotonic() < deadline, f"{worker.__name__} did not finish in {timeout} s: deadlock?"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def test_only_rank_zero_writes_and_nothing_hangs(tmp_path):
    run_workers(_worker, str(tmp_path / "init"), str(tmp_path))
    assert not (tmp_path / "rank1").exists()
    run = Run(tmp_path / "rank0")
    assert run.histogram_steps("activations/module.0") == [0, 2]
    assert run.histogram_steps("gradients/module.6") == [0, 2]
    assert run.histogram_steps("weight_grads/module.0.weight") == [0, 2]
    assert run.image_steps("feature_maps/module.2") == [0, 2]


def _rank_batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(100 + rank))


def _averaging_worker(rank: int, init_file: str, log_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        model = DistributedDataParallel(small_cnn())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        with actviz.watch(model, log_dir, every=1):
            model(_rank_batch(rank)).square().mean().backward()
            optimizer.step()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("both_paths")
def test_ddp_weight_gradients_are_the_averaged_ones_the_optimizer_applies(tmp_path):
    run_workers(_averaging_worker, str(tmp_path / "init"), str(tmp_path / "run"))
    twins = [small_cnn() for _ in range(WORLD_SIZE)]
    for rank, twin in enumerate(twins):
        twin(_rank_batch(rank)).square().mean().backward()
    run = Run(tmp_path / "run")
    # The conv bias before BatchNorm has a gradient of zero plus rounding noise (about 1e-7), which
    # differs with the number of threads: every value is compared to within 1e-5 of the largest gradient.
    tolerance = 1e-5 * max(param.grad.abs().max().item() for twin in twins for param in twin.parameters())
    local_differs = False
    for (name, param), (_, other) in zip(twins[0].named_parameters(), twins[1].named_parameters()):
        averaged = ((param.grad + other.grad) / 2).double()
        logged = run.histogram(f"weight_grads/module.{name}", 0)
        assert logged.sum_squares**0.5 == pytest.approx(averaged.norm().item(), rel=1e-4, abs=tolerance)
        assert logged.sum == pytest.approx(averaged.sum().item(), rel=1e-4, abs=tolerance * averaged.numel())
        assert (logged.min, logged.max) == pytest.approx(
            (averaged.min().item(), averaged.max().item()), rel=1e-5, abs=tolerance
        )
        local_differs |= abs(logged.sum_squares - (param.grad.double() ** 2).sum().item()) > 1e-3 * logged.sum_squares
    assert local_differs  # rank 0's own gradients would have given other numbers


# -- FSDP and merge_ranks -------------------------------------------------------------------------


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _mlp_batch(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))


def _sharded_worker(rank: int, init_file: str, log_dir: str, wrapper: str, merge: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        model = _mlp()
        if wrapper == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        elif wrapper == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
        else:
            model = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        with actviz.watch(model, log_dir, every=1,
            options=actviz.Options(bins=8, histogram_sample_size=None, merge_ranks=merge)):
            for step in range(3):
                model(_mlp_batch(rank, step)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _assert_histogram(histogram, values: torch.Tensor) -> None:
    values = values.detach().double().flatten()
    assert histogram.num == values.numel()
    assert histogram.sum == pytest.approx(values.sum().item(), rel=1e-5, abs=1e-6)
    assert histogram.sum_squares == pytest.approx((values**2).sum().item(), rel=1e-5)
    assert (histogram.min, histogram.max) == pytest.approx((values.min().item(), values.max().item()), rel=1e-6)
    edges = torch.linspace(values.min().item(), values.max().item(), 9, dtype=torch.float64)
    counts = torch.histogram(values, edges).hist
    _, buckets = expand_empty_buckets(histogram.min, histogram.max, histogram.bucket_limit, histogram.bucket, bins=8)
    assert sum(buckets) == pytest.approx(values.numel()) and len(buckets) == 8
    assert max(abs(a - b) for a, b in zip(buckets, counts.tolist())) <= 1  # an edge value may move


def _twin_step(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Sequential]:
    """The first layer's output over both ranks' batches and the twin with both ranks' averaged gradients."""
    twin = _mlp()
    outputs = []
    for rank in range(WORLD_SIZE):
        output = twin[0](_mlp_batch(rank, step))
        outputs.append(output)
        (twin[2](twin[1](output)).square().mean() / WORLD_SIZE).backward()  # DDP and FSDP average
    return outputs[0], torch.cat(outputs), twin


# FSDP1 logs activations only here, which other tests check on both paths: the device path for FSDP2 alone.
@pytest.mark.parametrize(("path", "wrapper"), [("shortcuts", "fsdp1"), ("shortcuts", "fsdp2"), ("device", "fsdp2")])
def test_fsdp_without_merge_finishes_and_rank_zero_logs_its_share(path, wrapper, tmp_path, monkeypatch):
    use_code_path(path, monkeypatch)
    run_workers(_sharded_worker, str(tmp_path / "init"), str(tmp_path / "run"), wrapper, False)
    run = Run(tmp_path / "run")
    layer = "0" if wrapper == "fsdp2" else "_fsdp_wrapped_module.0"
    assert run.histogram_steps(f"activations/{layer}") == [0, 1, 2]
    rank0_output, _, twin = _twin_step(0)
    _assert_histogram(run.histogram(f"activations/{layer}", 0), rank0_output)
    if wrapper == "fsdp2":  # a DTensor parameter, logged from rank 0's shard: the first half of its rows
        _assert_histogram(run.histogram("weights/0.weight", 0), twin[0].weight[:8])


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("wrapper", ["fsdp2", "ddp"])
def test_merged_ranks_give_the_whole_batch_and_the_whole_parameters(wrapper, tmp_path):
    run_workers(_sharded_worker, str(tmp_path / "init"), str(tmp_path / "run"), wrapper, True)
    run = Run(tmp_path / "run")
    prefix = "" if wrapper == "fsdp2" else "module."
    for step in range(3):
        _, both_outputs, twin = _twin_step(step)
        _assert_histogram(run.histogram(f"activations/{prefix}0", step), both_outputs)
        assert run.scalar(f"activation_stats/mean@{prefix}0", step) == pytest.approx(both_outputs.mean().item())
        # parameters: whole (FSDP2 shards merged) or not counted twice (DDP replicas)
        _assert_histogram(run.histogram(f"weights/{prefix}0.weight", step), twin[0].weight)
        _assert_histogram(run.histogram(f"weight_grads/{prefix}2.weight", step), twin[2].weight.grad)
    assert run.histogram(f"gradients/{prefix}2", 0).num == 2 * 4 * 4  # both ranks' output gradients


def _probe_worker(rank: int, init_file: str, log_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        model = DistributedDataParallel(small_cnn())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        probe = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(5))
        with actviz.watch(model, log_dir, every=2, extras=[actviz.Probe(probe, gradcam=True)]):
            for _ in range(4):  # the probe runs on rank 0 only, through model.module: no collective
                train_step(model, optimizer)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_probe_under_ddp_runs_on_rank_zero_without_a_collective(tmp_path):
    run_workers(_probe_worker, str(tmp_path / "init"), str(tmp_path / "run"))
    run = Run(tmp_path / "run")
    assert run.image_steps("feature_maps/module.0") == [0, 2]
    assert run.image_steps("probe/input") == [0, 2]
    assert run.image_steps("gradcam/module.2") == [0, 2]


# -- FSDP2: the gradient norms before and after clipping, over all ranks ---------------------------

CLIP_STEPS, CLIP_EVERY, SPIKE_STEP, MAX_NORM = 24, 20, 18, 0.05


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered from every rank (a collective every rank runs); any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _fsdp2_model(mesh=None) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp2_clipping_worker(rank: int, init_file: str, log_dir: str, out_dir: str) -> None:
    import warnings

    from actviz.diagnosis import rank_sums

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        with warnings.catch_warnings(record=True) as caught:  # what each rank says
            warnings.simplefilter("always")
            sums = []  # actviz's collectives: one per logging step, none on the others
            rank_sums.sum_over_ranks = lambda tensor, summed=rank_sums.sum_over_ranks: sums.append(step) or summed(tensor)
            model = _fsdp2_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            seen = []
            with actviz.watch(model, f"{log_dir}/every_rank", every=CLIP_EVERY, image_every=False) as viz:  # 0, 20 log
                for step in range(CLIP_STEPS):
                    loss = model(_mlp_batch(rank, step)).square().mean()
                    (loss * (1000.0 if step == SPIKE_STEP else 1.0)).backward()  # a spike between logging steps
                    full = {name: _full(param.grad).double() for name, param in model.named_parameters()}
                    returned = float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
                    after = float(torch.nn.utils.get_total_norm([_full(param.grad) for param in model.parameters()]))
                    squares = {layer: sum(float(grad.square().sum()) for name, grad in full.items() if name.startswith(f"{layer}."))
                               for layer in ("0", "2")}
                    seen.append({"returned": returned, "total": float(torch.nn.utils.get_total_norm(list(full.values()))),
                                 "after": after, "squares": squares})
                    optimizer.step()
                    optimizer.zero_grad()
            sums_first = list(sums)
            # HSDP (each rank a whole replica: counted once) and two micro-batches an update (steps 0, 2 log)
            from torch.distributed.device_mesh import init_device_mesh

            model = _fsdp2_model(init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("replicate", "shard")))
            optimizer, replicated = torch.optim.SGD(model.parameters(), lr=0.01), []
            with actviz.watch(model, f"{log_dir}/replicas", every=2, image_every=False):
                for step in range(4):
                    model(_mlp_batch(rank, step)).square().mean().backward()
                    if step % 2:
                        replicated.append(float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))))
                        optimizer.step()
                        optimizer.zero_grad()
            # Then as the Lightning and Hugging Face callbacks do: only rank 0 calls watch(). Nothing may wait.
            model, sums_before = _fsdp2_model(), len(sums)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            first_said = [str(warning.message) for warning in caught]
            alone = actviz.watch(model, f"{log_dir}/rank_zero", every=1, image_every=False) if rank == 0 else None
            for step in range(3):
                model(_mlp_batch(rank, step)).square().mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()
            if alone is not None:
                alone.close()
        said_alone = [str(warning.message) for warning in caught[len(first_said):]]
        torch.save({"seen": seen, "alerts": [(alert.step, alert.rule) for alert in viz.alerts], "sums": sums_first,
                    "said": first_said, "alone": {"sums": len(sums) - sums_before, "said": said_alone},
                    "replicated": replicated}, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_clipping_norms_are_over_all_ranks_a_spike_alerts_and_rank_zero_alone_waits_for_nobody(tmp_path):
    run_workers(_fsdp2_clipping_worker, str(tmp_path / "init"), str(tmp_path / "run"), str(tmp_path), timeout=150)
    seen = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    assert seen[0]["sums"] == seen[1]["sums"] == [0, CLIP_EVERY]  # every rank sums at the logging steps alone
    run = Run(tmp_path / "run" / "every_rank")
    pre, post, coefficient = (f"gradient_clipping/{name}" for name in ("pre_clip_norm", "post_clip_norm", "coefficient"))
    assert [event.step for event in run.scalar_events(pre)] == [0, CLIP_EVERY]
    for step in (0, CLIP_EVERY):
        mine, other = seen[0]["seen"][step], seen[1]["seen"][step]
        assert mine["returned"] == other["returned"]  # clip_grad_norm_ sums the shards: the same on every rank
        assert mine["returned"] == pytest.approx(mine["total"], rel=1e-6)
        assert mine["returned"] > 2 * MAX_NORM  # clipping acted
        assert run.scalar(pre, step) == pytest.approx(mine["returned"], rel=1e-6)
        assert run.scalar(post, step) == pytest.approx(mine["after"], rel=1e-6)
        assert run.scalar(coefficient, step) == pytest.approx(mine["after"] / mine["returned"], rel=1e-6)
        total = sum(mine["squares"].values())
        shares = [run.scalar(f"gradient_clipping/share@{layer}", step) for layer in ("0", "2")]
        assert sum(shares) == pytest.approx(1.0, rel=1e-6)
        assert shares == pytest.approx([mine["squares"][layer] / total for layer in ("0", "2")], rel=1e-5)
    spikes = [step for step, rule in seen[0]["alerts"] if rule == "gradient_spike"]
    assert spikes == [SPIKE_STEP]  # judged at the next logging step, on norms summed over both ranks
    assert seen[1]["alerts"] == []  # rank 1 writes and judges nothing
    assert not [message for message in seen[1]["said"] if "actviz" in message]  # and says nothing (it counts the steps)
    # watched on rank 0 alone: no collective, no partial norm written as a whole one, and one warning
    assert seen[0]["alone"]["sums"] == seen[1]["alone"]["sums"] == 0
    assert any("only when every rank calls watch()" in message for message in seen[0]["alone"]["said"])
    alone = Run(tmp_path / "run" / "rank_zero")
    assert alone.histogram_steps("activations/0") == [0, 1, 2]  # the steps are written all the same
    assert "gradient_clipping/pre_clip_norm" not in alone.scalar_tags
    replicas = Run(tmp_path / "run" / "replicas")
    assert [event.step for event in replicas.scalar_events(pre)] == [0, 2]
    assert [event.value for event in replicas.scalar_events(pre)] == pytest.approx(seen[0]["replicated"], rel=1e-6)
