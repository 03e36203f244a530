"""What the gradient norms before and after clipping (on by default: the spike check and ``gradient_clipping/*``)
cost a training step that does not log: a side-by-side loop, with them off (``alerts=False,
statistics=["moments"]``) and on (the default), the loop clipping at 1.0.

    python scripts/spike_cost.py              # demo CNN and ResNet-18 on the CPU (a few seconds each)
    python scripts/spike_cost.py --device cuda

Both watchers log only step 0 (every=10**9), so every timed step is one that does not log;
the two runs alternate in blocks so that a busy machine slows both alike. Prints the median
step time of each and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision

import actviz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_train import small_cnn


def step_times(model, inputs, labels, spikes: bool, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    off = {} if spikes else {"alerts": False, "statistics": ["moments"]}
    with actviz.watch(model, tempfile.mkdtemp(), every=10**9, **off):
        for step in range(steps + 5):
            start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if inputs.is_cuda:
                torch.cuda.synchronize()
            if step >= 5:  # step 0 logs; then warm up
                times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for name, make, size, batch in (("demo CNN", small_cnn, 32, 64), ("ResNet-18", torchvision.models.resnet18, 64, 16)):
        torch.manual_seed(0)
        model = make().to(args.device)
        inputs = torch.randn(batch, 3, size, size, device=args.device)
        labels = torch.randint(0, 6, (batch,), device=args.device)
        found = {False: [], True: []}
        for _ in range(args.rounds):
            for spikes in (False, True):
                found[spikes] += step_times(model, inputs, labels, spikes, 20)
        off, on = statistics.median(found[False]), statistics.median(found[True])
        print(f"{name:10s} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
              f"{len(list(model.parameters()))} tensors): step {off * 1e3:.2f} ms without the norms, {on * 1e3:.2f} ms "
              f"with, +{(on - off) * 1e3:.3f} ms ({(on / off - 1):+.1%})")


if __name__ == "__main__":
    main()
