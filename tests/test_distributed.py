"""DistributedDataParallel on two CPU processes (gloo): rank 0 writes, rank 1 doesn't, nobody hangs."""

from __future__ import annotations

import time
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


def test_only_rank_zero_writes_and_nothing_hangs(tmp_path):
    context = mp.start_processes(
        _worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 180
    try:
        while not context.join(timeout=5):
            assert time.monotonic() < deadline, "DDP workers did not finish: deadlock?"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    assert not (tmp_path / "rank1").exists()
    run = Run(tmp_path / "rank0")
    assert run.histogram_steps("activations/module.0") == [0, 2]
    assert run.histogram_steps("gradients/module.6") == [0, 2]
    assert run.histogram_steps("weight_grads/module.0.weight") == [0, 2]
    assert run.image_steps("feature_maps/module.2") == [0, 2]
