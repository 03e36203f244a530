"""The writer thread's CPU time per logging step of ResNet-50 at 224², pictures on: what the host spends turning a
step's results into histograms, pictures, alerts and event-file records, off the training thread.

The model trains on the accelerator code path (``ACTVIZ_CPU_SHORTCUTS=0``, the path CUDA tensors take) with
``every=1, image_every=1``; after one warm-up step, each measured step is followed by ``viz.flush()``, and the
writer thread's CPU time (``pthread_getcpuclockid``) over those steps is divided by their number. Its work grows with
the number of watched tensors and pictures, not with the batch: every histogram is counted on a sample of at most
``histogram_sample_size`` elements, and every picture shows one sample of the batch.

Usage: ``python scripts/bench_writer.py [--batch 16] [--steps 3]``; about a minute on 2 cores at batch 16 (batch 64
needs about 12 GB of memory and several minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import torch
import torchvision
from bench_host_time import writer_cpu_seconds

import actviz


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument("--steps", type=int, default=3, help="measured logging steps (default 3)")
    args = parser.parse_args()
    os.environ["ACTVIZ_CPU_SHORTCUTS"] = "0"
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    inputs, labels = torch.randn(args.batch, 3, 224, 224), torch.randint(0, 1000, (args.batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
    viz = actviz.watch(model, tempfile.mkdtemp(prefix="bench-writer-"), every=1, image_every=1)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        viz.flush()

    step()  # warm-up: plans, tables and the writer's first event file
    spent = -writer_cpu_seconds()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    spent += writer_cpu_seconds()
    wall = time.perf_counter() - started
    viz.close()
    print(f"ResNet-50, batch {args.batch}, 224x224, pictures on: writer thread {spent / args.steps:.3f} s of CPU per "
          f"logging step (over {args.steps} steps; {wall / args.steps:.1f} s a step on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
