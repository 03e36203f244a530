"""Run pytorch/examples programs bare and watched, and compare: actviz must change nothing they print.

Real programs are the test: this runs each program of a pytorch/examples checkout twice, once as
written and once with actviz watching every model an optimizer trains (``watch(model, every=2)``,
attached when the optimizer is made, so the program's source is not edited), then compares what
each run printed and reads the event files back. MNIST, FashionMNIST, CIFAR10 and FakeData are
replaced by small random datasets of the same shapes, so no download is needed; ``torch.load``
defaults to ``weights_only=False`` (time_sequence_prediction loads a NumPy array).

Usage (the examples are not in this repository; clone or fetch github.com/pytorch/examples)::

    python scripts/check_examples.py /path/to/pytorch-examples [--only mnist dcgan] [--timeout 300]

Printed, per program: both exit codes, whether stdout is identical (seeded programs only: siamese_network,
regression and mnist_forward_forward are not deterministic even bare), actviz's warnings, and the steps
logged. It exits 1 if a watched run fails where the bare run passed, or an actviz error appears.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: program, arguments: short runs on the CPU.
PROGRAMS: dict[str, list[str]] = {
    "mnist/main.py": ["--epochs", "1", "--test-batch-size", "128", "--no-accel"],
    "vae/main.py": ["--epochs", "1", "--batch-size", "64", "--no-accel"],
    "mnist_rnn/main.py": ["--epochs", "1", "--test-batch-size", "128"],
    "siamese_network/main.py": ["--epochs", "1", "--batch-size", "32", "--test-batch-size", "64", "--no-accel"],
    "regression/main.py": [],
    "time_sequence_prediction/train.py": ["--steps", "2"],
    "mnist_forward_forward/main.py": ["--epochs", "3", "--no_accel", "--train_size", "256", "--test_size", "64"],
    "dcgan/main.py": ["--dataset", "fake", "--batchSize", "8", "--imageSize", "64", "--niter", "1", "--dry-run",
                      "--workers", "0", "--manualSeed", "1"],
    "imagenet/main.py": ["--dummy", "-a", "resnet18", "--epochs", "1", "-b", "8", "--workers", "0", "--seed", "1",
                         "--no-accel", "--print-freq", "2"],
}

# Runs inside the program's process, before the program: fake datasets, and watch() where an optimizer is made.
_PRELUDE = r'''
import gc, os, runpy, sys, warnings
import torch, torchvision
from torch import nn

class _Fake(torch.utils.data.Dataset):
    def __init__(self, root=None, train=True, download=False, transform=None, target_transform=None,
                 shape=(28, 28), mode="L", **kwargs):
        generator = torch.Generator().manual_seed(1 if train else 2)
        count = 512 if train else 128
        channels = (3,) if mode == "RGB" else ()
        self.data = torch.randint(0, 256, (count, *shape, *channels), generator=generator, dtype=torch.uint8)
        self.targets = torch.randint(0, 10, (count,), generator=generator)
        self.transform, self.target_transform, self.mode, self.classes = transform, target_transform, mode, list(range(10))
    def __len__(self):
        return len(self.data)
    def __getitem__(self, index):
        from PIL import Image
        image, target = Image.fromarray(self.data[index].numpy(), mode=self.mode), int(self.targets[index])
        return (self.transform(image) if self.transform else image,
                self.target_transform(target) if self.target_transform else target)

torchvision.datasets.MNIST = torchvision.datasets.FashionMNIST = _Fake
torchvision.datasets.CIFAR10 = lambda *a, **k: _Fake(*a, shape=(32, 32), mode="RGB", **k)
_FakeData = torchvision.datasets.FakeData
torchvision.datasets.FakeData = lambda size=1000, *a, **k: _FakeData(min(size, 48), *a, **k)
_load = torch.load
torch.load = lambda *a, **k: _load(*a, **{"weights_only": False, **k})
log_dir, script, arguments = sys.argv[1], sys.argv[2], sys.argv[3:]
watchers = []
if log_dir != "-":
    import actviz
    _init = torch.optim.Optimizer.__init__

    def _watching_init(self, params, *args, **kwargs):
        params = list(params)
        _init(self, params, *args, **kwargs)
        held = {id(p) for group in self.param_groups for p in group["params"]}
        found = [m for m in gc.get_objects() if isinstance(m, nn.Module) and not isinstance(m, torch.jit.ScriptModule)
                 and {id(p) for p in m.parameters()} & held]
        inner = {id(child) for m in found for child in m.modules() if child is not m}
        for model in found:
            if id(model) not in inner and not any(viz.model is model for viz in watchers):
                watchers.append(actviz.watch(model, os.path.join(log_dir, f"{type(model).__name__}_{len(watchers)}"), every=2))

    torch.optim.Optimizer.__init__ = _watching_init
sys.argv = [script, *arguments]
os.chdir(os.path.dirname(os.path.abspath(script)))
sys.path.insert(0, os.getcwd())
try:
    runpy.run_path(os.path.basename(script), run_name="__main__")
finally:
    for viz in watchers:
        viz.close()
'''


def run(program: Path, arguments: list[str], log_dir: str, timeout: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONWARNINGS": "always::RuntimeWarning"}
    command = [sys.executable, "-c", _PRELUDE, log_dir, str(program), *arguments]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as expired:
        return subprocess.CompletedProcess(command, 124, str(expired.stdout or ""), f"timed out after {timeout} s")


def logged_steps(log_dir: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for run_dir in sorted(path for path in log_dir.iterdir() if path.is_dir()):
        events = EventAccumulator(str(run_dir), size_guidance={"histograms": 0})
        events.Reload()
        found[run_dir.name] = sorted({e.step for tag in events.Tags()["histograms"] for e in events.Histograms(tag)})
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", type=Path, help="a checkout of github.com/pytorch/examples")
    parser.add_argument("--only", nargs="*", help="program folders to run (default: all of PROGRAMS)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    args = parser.parse_args()
    failed = False
    for relative, arguments in PROGRAMS.items():
        folder = relative.split("/")[0]
        program = args.examples / relative
        if (args.only and folder not in args.only) or not program.exists():
            continue
        if folder == "time_sequence_prediction":
            subprocess.run([sys.executable, "generate_sine_wave.py"], cwd=program.parent, check=False, capture_output=True)
        log_dir = Path(tempfile.mkdtemp(prefix=f"actviz-{folder}-"))
        bare, watched = (run(program, arguments, where, args.timeout) for where in ("-", str(log_dir)))
        warnings = sorted({line.strip() for line in watched.stderr.splitlines() if "actviz" in line and "Warning" in line})
        errors = [line for line in watched.stderr.splitlines() if "actviz" in line and "Error" in line]
        broke = watched.returncode != 0 and bare.returncode == 0
        failed |= broke or bool(errors)
        same = "identical" if bare.stdout == watched.stdout else "differs"
        print(f"== {folder}: bare rc={bare.returncode}, watched rc={watched.returncode}, stdout {same}, "
              f"logged steps {logged_steps(log_dir) if log_dir.exists() else {}}")
        for line in [*warnings, *errors, *(watched.stderr.splitlines()[-5:] if broke else [])]:
            print("   ", line[:300])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
