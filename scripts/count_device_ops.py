"""The aten ops one training step dispatches on the accelerator code path, and the bytes actviz's ops move, counted
on the CPU: bare and watched.

On a GPU every aten op that is not a view launches a kernel (5-10 us of host time each), and a few ops make the
host wait for the device. A ``TorchDispatchMode`` counts both, deterministically, on the training thread while
torchvision's ResNet-50 takes a training step (forward, cross-entropy, backward, ``SGD(foreach=True)`` step,
``viz.flush()``) with actviz's CPU shortcuts off (``ACTVIZ_CPU_SHORTCUTS=0``: the code path CUDA tensors take)
and the eager summaries (``ACTVIZ_FUSED=0``, the default). Three copies are counted, one step each after two
warm-up steps: bare, watched with ``every=1`` and pictures on (a logging step, everything on), and watched with
``every=1`` and pictures off (statistics only).

Counted as a sync: ``.item()``, data-dependent sizes (``nonzero``, ``bincount``, ...), and a tensor made from
Python numbers (``aten.lift_fresh``), which reaches a GPU by a blocking copy. The bytes an op moves are those of
its tensor inputs and outputs (``numel * element_size``; allocations move none); an op is actviz's when a frame
of the actviz package is on the stack as it is dispatched. They are compared with the bytes actviz watches: each
watched layer's first output tensor and its gradient, each watched parameter and its gradient, once. The writer thread's work (host
arithmetic, PNG, protobuf) dispatches nothing on the device and is not counted. Counts are of float32 (a CPU has
no fast bf16 autocast); under bf16 a large tensor's pieces hold twice as many elements.

Usage::

    python scripts/count_device_ops.py                           # ResNet-50 at batch 2, 64x64 (seconds)
    python scripts/count_device_ops.py --batch 16 --size 224     # real sizes (a minute or two, about 4 GB)
    python scripts/count_device_ops.py --top 10                  # also the ten ops a logging step adds most

Prints one line per copy: ``bare 1,234 ops``, then ``logging ... (x3.05), 0 syncs, N views, actviz moved M GiB,
x1.16 of the watched bytes`` and so on.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import warnings

import torch
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import actviz

#: Ops after which the host waits for the device.
HOST_WAITS = frozenset({
    "aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default", "aten.masked_select.default",
    "aten.bincount.default", "aten.unique.default", "aten._unique2.default", "aten.unique_consecutive.default",
    "aten.histc.default", "aten.repeat_interleave.Tensor", "aten.lift_fresh.default",
})


#: Ops that only allocate: no kernel, no bytes moved.
ALLOCATIONS = frozenset({"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
                         "aten.new_empty.default", "aten.new_empty_strided.default"})
PACKAGE = os.path.join(os.path.dirname(actviz.__file__), "")


def tensor_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def from_actviz() -> bool:
    """Whether a frame of the actviz package other than a ``__torch_function__`` is on the stack: the attention
    statistics' mode passes every torch call of a logging forward on, the model's and actviz's own hooks' alike."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE) and frame.f_code.co_name != "__torch_function__":
            return True
        frame = frame.f_back
    return False


class OpTally(TorchDispatchMode):
    """Ops by name on this thread: those that launch a kernel, the views, those the host waits for, and the bytes
    actviz's ops read and write."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: collections.Counter[str] = collections.Counter()
        self.views = 0
        self.waits = 0
        self.actviz_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.waits += name in HOST_WAITS
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            self.views += 1
        elif name not in ALLOCATIONS:
            self.kernels[name] += 1
            if from_actviz():
                written = kwargs.get("out") if kwargs else None
                self.actviz_bytes += tensor_bytes((args, {k: v for k, v in (kwargs or {}).items() if k != "out"}))
                self.actviz_bytes += tensor_bytes(out if written is None else written)
        return out


def watched_bytes(viz, step) -> int:
    """The bytes ``viz`` watches in one ``step()``: each watched layer's first output and its gradient, each watched
    parameter and its gradient (forward hooks that only read sizes)."""
    outputs: dict[str, int] = {}

    def hook(name):
        def keep(module, args, output):
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            if tensors and name not in outputs:
                outputs[name] = tensors[0].numel() * tensors[0].element_size() * (2 if tensors[0].requires_grad else 1)
        return keep

    handles = [module.register_forward_hook(hook(name)) for name, module in viz._layers]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return sum(outputs.values()) + 2 * sum(p.numel() * p.element_size() for _, p in viz._parameters)


def count_step(batch: int, size: int, **watch_args) -> tuple[OpTally, int]:
    """Two warm-up steps of a fresh ResNet-50 (watched with ``watch_args`` unless empty), then one counted step;
    and the bytes it watches (0 bare)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10)
    inputs, labels = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    viz = actviz.watch(model, tempfile.mkdtemp(), **watch_args) if watch_args else None

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        if viz is not None:
            viz.flush()

    try:
        step()
        watched = watched_bytes(viz, step) if viz is not None else 0  # plans and layouts are made once
        with OpTally() as tally:
            step()
    finally:
        if viz is not None:
            viz.close()
    return tally, watched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=64, help="the pictures' side in pixels")
    parser.add_argument("--top", type=int, default=0, help="also list the ops a logging step adds most")
    args = parser.parse_args()
    os.environ["ACTVIZ_CPU_SHORTCUTS"] = "0"  # read at every call
    os.environ.setdefault("ACTVIZ_FUSED", "0")
    warnings.simplefilter("ignore")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"torchvision ResNet-50, batch {args.batch}, {args.size}x{args.size}, float32, torch {torch.__version__}")
    bare, _ = count_step(args.batch, args.size)
    base = sum(bare.kernels.values())
    print(f"bare {base:,} ops, {bare.waits} syncs, {bare.views:,} views", flush=True)
    copies = {"logging": {"every": 1, "image_every": 1}, "statistics only": {"every": 1, "image_every": 10**9}}
    logging_step = None
    for name, watch_args in copies.items():
        tally, watched = count_step(args.batch, args.size, **watch_args)
        logging_step = logging_step or tally
        ops = sum(tally.kernels.values())
        print(f"{name} {ops:,} ops (x{ops / base:.2f}), {tally.waits - bare.waits} syncs, {tally.views:,} views, "
              f"actviz moved {tally.actviz_bytes / 2**30:.3f} GiB, x{tally.actviz_bytes / watched:.2f} of the "
              f"{watched / 2**30:.3f} GiB watched", flush=True)
    if args.top and logging_step is not None:
        added = logging_step.kernels.copy()
        added.subtract(bare.kernels)
        for name, extra in added.most_common(args.top):
            print(f"  {extra:+,} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
