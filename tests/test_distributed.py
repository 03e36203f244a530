"""DistributedDataParallel on two CPU processes (gloo): rank 0 writes, rank 1 doesn't, nobody hangs."""

from __future__ import annotations

import time

import pytest
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import NO_HOOKS, Run, hooks_left, small_cnn, train_step
from torch.nn.parallel import DistributedDataParallel

import actviz

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


def run_workers(worker, *args, timeout: float = 180) -> None:
    """Run ``worker(rank, *args)`` on WORLD_SIZE processes; fail instead of hanging past ``timeout``."""
    context = mp.start_processes(worker, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
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


def test_ddp_weight_gradients_are_the_averaged_ones_the_optimizer_applies(tmp_path):
    run_workers(_averaging_worker, str(tmp_path / "init"), str(tmp_path / "run"))
    twins = [small_cnn() for _ in range(WORLD_SIZE)]
    for rank, twin in enumerate(twins):
        twin(_rank_batch(rank)).square().mean().backward()
    run = Run(tmp_path / "run")
    local_differs = False
    for (name, param), (_, other) in zip(twins[0].named_parameters(), twins[1].named_parameters()):
        averaged = ((param.grad + other.grad) / 2).double()
        logged = run.histogram(f"weight_grads/module.{name}", 0)
        assert logged.sum_squares == pytest.approx((averaged**2).sum().item(), rel=1e-4)
        assert logged.sum == pytest.approx(averaged.sum().item(), rel=1e-4, abs=1e-7)
        assert (logged.min, logged.max) == pytest.approx((averaged.min().item(), averaged.max().item()), rel=1e-5)
        local_differs |= abs(logged.sum_squares - (param.grad.double() ** 2).sum().item()) > 1e-3 * logged.sum_squares
    assert local_differs  # rank 0's own gradients would have given other numbers
