"""Instructions the training thread runs per step, bare and watched: a deterministic twin of ``scripts/bench_host_time.py``.

``scripts/bench_host_time.py`` measures a logging step's host time on the accelerator path
(``ACTVIZ_CPU_SHORTCUTS=0``) with thread CPU time, which moves by 20-30 % from one minute to the next on a
shared machine: too much to see a change of a few percent. This script counts instead, with valgrind's
callgrind: the same micro ResNet-50 (ResNet-50's 107 layers and 161 parameters at tiny widths), the same
training step (cross-entropy, backward, SGD ``foreach``, ``flush()``), and only the training thread's
instructions inside the measured steps (the writer thread and the imports are left out). Page faults, cache
misses and garbage-collection pauses are not counted; time them with ``scripts/bench_host_time.py``.

Needs valgrind (``apt install valgrind``); about two minutes. Compare two trees with ``--tree``::

    python scripts/count_host_instructions.py                      # this checkout
    python scripts/count_host_instructions.py --tree /path/to/other/checkout --modes watched

Prints one line per mode: ``bare 27,063,797 instructions per step`` and so on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOGGLE = "_operator_call*"  # operator.call: the C function around the measured steps, called nowhere else


def micro_resnet50():
    """torchvision's ResNet-50 layer structure (53 Conv2d, 53 BatchNorm2d, 1 Linear) with 4 to 32 channels."""
    import torch
    from torch import nn
    from torchvision.models.resnet import Bottleneck, ResNet

    class Micro(ResNet):
        def _make_layer(self, block, planes, blocks, stride=1, dilate=False):
            if planes == 64:
                self.inplanes = 4
            return super()._make_layer(block, max(1, planes // 64), blocks, stride, dilate)

    torch.manual_seed(0)
    model = Micro(Bottleneck, [3, 4, 6, 3], num_classes=10)
    model.conv1 = nn.Conv2d(3, 4, kernel_size=7, stride=2, padding=3, bias=False)
    model.bn1 = nn.BatchNorm2d(4)
    model.fc = nn.Linear(8 * Bottleneck.expansion, 10)
    return model


def child(mode: str, steps: int) -> None:
    """Runs under callgrind: warm up uninstrumented, then count ``steps`` steps inside ``operator.call``."""
    import operator
    import warnings

    os.environ.setdefault("ACTVIZ_CPU_SHORTCUTS", "0")
    import torch
    from torch import nn

    import actviz

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = micro_resnet50()
    inputs, labels = torch.randn(1, 3, 33, 33), torch.randint(0, 10, (1,))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=1) if mode == "watched" else None

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        if viz is not None:
            viz.flush()

    for _ in range(4):
        step()
    subprocess.run(["callgrind_control", "--instr=on", str(os.getpid())], check=True, capture_output=True)
    for _ in range(2):  # plans and layouts are made once, caches warm
        step()
    operator.call(lambda: [step() for _ in range(steps)])
    if viz is not None:
        viz.close()
    os._exit(0)  # no interpreter teardown in the profile


def count(tree: Path, mode: str, steps: int) -> int:
    """Run :func:`child` under callgrind with ``tree`` first on the path; the main thread's instructions per step."""
    with tempfile.TemporaryDirectory() as folder:
        command = [
            "valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no", "--collect-atstart=no",
            f"--toggle-collect={TOGGLE}", f"--callgrind-out-file={folder}/out.%p",
            sys.executable, str(Path(__file__).resolve()), "--child", mode, "--steps", str(steps),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        main_thread = sorted(Path(folder).glob("out.*-01"))
        if done.returncode != 0 or not main_thread:
            raise SystemExit(f"callgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
        totals = [line for line in main_thread[0].read_text().splitlines() if line.startswith("totals:")]
        return int(totals[0].split()[1]) // steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the actviz checkout to measure (default: this one)")
    parser.add_argument("--modes", default="bare,watched", help="comma-separated: bare, watched")
    parser.add_argument("--steps", type=int, default=3, help="steps counted per mode (default 3)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed: apt install valgrind (or time the step with scripts/bench_host_time.py)")
    for mode in args.modes.split(","):
        if mode not in ("bare", "watched"):
            raise SystemExit(f"--modes takes bare and watched, got {mode!r}")
        print(f"{mode} {count(args.tree, mode, args.steps):,} instructions per step", flush=True)


if __name__ == "__main__":
    main()
