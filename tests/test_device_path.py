"""The accelerator code path, run on the CPU (ACTVIZ_CPU_SHORTCUTS=0): its kernel budget and host syncs.

On a GPU every aten op that is not a view launches a kernel, and .item(), nonzero, bincount
or a boolean mask make the host wait. A TorchDispatchMode counts them deterministically, so
these budgets cannot drift back. scripts/count_device_ops.py makes the same count on
ResNet-50; the README reports it.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torchvision
from conftest import CountOps

import actviz
from actviz.output.pending_step import HostCopy, PendingStep
from actviz.common.pixels import PaletteImage
from actviz.pictures.rendering import feature_map_grid, heatmap, picture_source
from actviz.summaries.many_tensors import reduce_tensors
from actviz.summaries.one_tensor import reduce_tensor, start_summary


@pytest.fixture(autouse=True)
def device_path(monkeypatch):
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    monkeypatch.setenv("ACTVIZ_FUSED", "0")  # the eager path; the compiled one is tests/test_fused.py's


class CountAll(CountOps):
    """Also the view ops."""

    def __init__(self) -> None:
        super().__init__()
        self.views: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views.append(str(func))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("numel", [8 * 16 * 12 * 12, 40 * 16 * 12 * 12])  # the whole tensor sampled, or strided
def test_one_tensor_takes_one_op_that_reads_it_once_and_no_sync(dtype, numel):
    # Outside a watcher's step (no SmallTensors): the one-pass op, whose input is the tensor and output its row.
    tensor = torch.randn(numel // 192, 16, 12).to(dtype)
    with CountAll() as count:
        reduction = reduce_tensor(tensor)
    assert count.kernels == ["actviz.summarize.default"]
    assert len(count.views) <= 2, count.views  # the flat view
    assert count.syncs == []
    assert isinstance(reduction.header, torch.Tensor) and reduction.header.dim() == 1  # one tensor, not one per number
    assert reduction.device_tensors() == [reduction.header]  # the sample behind the row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_tensor_takes_one_op_whatever_its_size_and_no_sync(dtype):
    # A large batch's activations (ResNet-50 at batch 64: up to 51 M elements): one op, and its body reads them once
    # (on a CPU, the eager body goes a piece at a time: tests/test_one_pass.py checks its numbers).
    from actviz.summaries.piecewise import PIECE

    for size in (PIECE // 2, PIECE + 1000, 3 * PIECE):
        tensor = torch.randn(size).to(dtype)
        with CountOps() as count:
            reduce_tensor(tensor)
        assert count.kernels == ["actviz.summarize.default"] and count.syncs == []


def test_a_channels_last_output_is_read_in_place():
    tensor = torch.randn(8, 16, 12, 12).to(memory_format=torch.channels_last)
    with CountOps() as count:
        reduce_tensor(tensor)
    assert count.kernels == ["actviz.summarize.default"]  # no copy to a contiguous layout first


def test_many_parameters_take_the_same_ops_whatever_their_count():
    counts = []
    for model in (torchvision.models.resnet18, torchvision.models.resnet34):  # 62 and 110 parameters
        parameters = list(model().parameters())
        reduce_tensors(parameters)  # the first time makes the layouts (segment ids, 1 / sizes), kept for the next steps
        with CountOps() as count:
            reductions = reduce_tensors(parameters)
        assert count.syncs == []
        counts.append(len(count.kernels))
        assert len({id(summary.made.header) for summary in reductions}) == 2  # the small ones' matrix, the others'
    assert counts[0] == counts[1] <= 56, counts  # segment reduction (small_tensors) + _foreach reductions


def test_a_step_of_many_summaries_packs_in_a_handful_of_ops():
    pending = PendingStep(0, bins=8)
    tensors = [torch.randn(50, 30) for _ in range(100)] + [torch.randn(4000) for _ in range(100)]
    for index, tensor in enumerate(tensors):
        pending.activations.add_many({str(index): start_summary(tensor, sample_size=1000)})
    with CountAll() as count:
        pending.send()
    assert len(count.kernels) <= 3, count.kernels  # one cat per dtype and one of their bytes
    assert len(count.views) <= 8, count.views
    results = pending.resolve()
    for index, tensor in enumerate(tensors):
        assert results.activations[str(index)].sum == pytest.approx(tensor.double().sum().item(), rel=1e-6, abs=1e-4)


def test_a_picture_takes_at_most_six_ops():
    wide, narrow = torch.randn(2, 256, 7, 7), torch.randn(2, 32, 7, 7)
    with CountOps() as count:
        picture_source(wide, max_channels=64)  # more channels than drawn: pick the 64 strongest
    assert len(count.kernels) == 6 and count.syncs == [], count.kernels
    with CountOps() as count:
        picture_source(narrow, max_channels=64)  # all channels: one copy
    assert len(count.kernels) == 1


def small_conv_step(**watch_args):
    """A small convolution's training step (its output changed in place by a ReLU after its hook), counted."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(inplace=True), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 2))
    inputs = torch.randn(2, 3, 8, 8)
    viz = actviz.watch(model, tempfile.mkdtemp(), every=1, **watch_args)
    with CountAll() as count:
        torch.nn.functional.cross_entropy(model(inputs), torch.tensor([1, 0])).backward()
        viz.flush()
    viz.close()
    with torch.no_grad():
        before_relu = model[0](inputs)
    assert before_relu.min() < 0  # the in-place ReLU changed the output after its hook
    return viz.latest, count, before_relu


@pytest.mark.parametrize("max_channels", [64, 3])
def test_a_small_output_is_copied_once_for_its_summary_and_its_grid(max_channels):
    """A small 4-D output's grid is drawn from the copy its summary makes: one copy per tensor, taken before the
    in-place ReLU. With every channel drawn, the grid takes no op of its own (drawn on the host from the row's
    sample); with fewer, sample 0's chosen channels are picked from that copy on the device."""
    results, count, before_relu = small_conv_step(image_every=1, options=actviz.Options(max_channels=max_channels))
    _, without_pictures, _ = small_conv_step(image_every=False)
    assert sorted(results.activations) == sorted(results.gradients) == ["0", "3"]
    assert count.kernels.count("aten.clone.default") == 4  # two outputs and their two gradients, no more
    selects = count.views.count("aten.select.int") - without_pictures.views.count("aten.select.int")
    extra_kernels = len(count.kernels) - len(without_pictures.kernels)
    assert (selects, extra_kernels > 0) == ((0, False) if max_channels >= 4 else (1, True))  # sample 0, the pick
    assert torch.equal(results.images["0"], feature_map_grid(before_relu[0], max_channels=max_channels))
    assert results.activations["0"].min == pytest.approx(before_relu.min().item())


def test_a_step_goes_to_the_host_in_one_packed_copy():
    tensors = [torch.randn(()), torch.randn(5), torch.randn((), dtype=torch.float64), torch.randn(3).bfloat16()]
    with CountOps() as count:
        copy = HostCopy(tensors)
    assert len(count.kernels) <= 4  # one concatenation per dtype with several tensors, one of their bytes
    for before, after in zip(tensors, copy.wait()):
        assert torch.equal(before, after) and before.dtype == after.dtype and before.shape == after.shape


def count_step(model, inputs, **watch_args):
    """Kernel and sync ops of one training step (the second; step 0 warms up), watched or bare."""
    viz = actviz.watch(model, tempfile.mkdtemp(), **watch_args) if watch_args else None
    targets = torch.tensor([1, 2])  # made from Python numbers: outside the counted step (see conftest.SYNCING)

    def step():
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()

    step()
    if viz is not None:
        viz.flush()  # step 0 ends here, not inside the counted step (without an optimizer it would end there)
    with CountOps() as count:
        step()
        if viz is not None:
            viz.flush()  # the writer thread's host work is not counted: the mode is thread-local
    if viz is not None:
        viz.close()
    return count


def test_logging_step_budget_on_a_small_resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    inputs = torch.randn(2, 3, 32, 32)
    bare = count_step(model, inputs)
    idle = count_step(model, inputs, every=10**9)
    stats = count_step(model, inputs, every=1, image_every=10**9)
    everything = count_step(model, inputs, every=1)
    # a step that logs nothing adds the gradient norms before clipping at its backward's end (2 ops); in this loop,
    # which steps no optimizer, the last step's are committed at the forward: no norms after clipping (NaN), both
    # global norms, their copy (actviz.diagnosis.step_norms)
    extra = list(idle.kernels)
    for op in bare.kernels:
        extra.remove(op)
    assert sorted(extra) == sorted(["aten._foreach_norm.Scalar", "aten.stack.out", "aten.fill_.Scalar",
                                    "aten.linalg_vector_norm.default", "aten.copy_.default"]), extra
    added = len(stats.kernels) - len(bare.kernels)
    tensors = 2 * 41  # 41 watched layers (20 conv, 20 batch norm, 1 linear): outputs and their gradients
    assert added >= tensors  # the device path ran: at least one copy per tensor
    assert len(stats.kernels) <= 3 * len(bare.kernels)
    assert len(everything.kernels) <= 4 * len(bare.kernels)
    assert stats.syncs == everything.syncs == bare.syncs == []


def test_a_heat_map_source_is_bounded_on_the_device():
    logits = torch.randn(1, 300, 20_000)  # vocabulary-sized: the picture is 64 x 512, its shorter side legible
    with CountOps() as count:
        draw, source = picture_source(logits, max_channels=64)
    assert count.syncs == [] and len(count.kernels) <= 4, count.kernels
    assert source.numel() == 64 * 512 + 2  # the pooled picture, and the whole's min and max
    assert draw(source).shape == (3, 64, 512)
    hidden = torch.randn(2, 1024, 768)  # 1,024 tokens: the picture is 512 x 384, area-averaged
    draw, source = picture_source(hidden, max_channels=64)
    assert source.numel() == 512 * 384 + 2
    pooled = torch.nn.functional.adaptive_avg_pool2d(hidden[:1], (512, 384))[0]
    levels = ((pooled - hidden[0].min()) / (hidden[0].max() - hidden[0].min()) * 255).round().to(torch.uint8)
    image = draw(source)
    assert isinstance(image, PaletteImage) and torch.equal(image.indices, levels)  # normalised by the whole's bounds
    assert torch.equal(image.rgb(), heatmap(hidden[0]))  # the same picture as the one-call function
    within = torch.randn(2, 500, 96)  # within the bound: its levels, a byte per value, not four
    draw, source = picture_source(within, max_channels=64)
    assert source.dtype == torch.uint8 and source.numel() == 500 * 96
    assert torch.equal(draw(source).rgb(), heatmap(within[0]))


def python_calls(step) -> int:
    """Python function calls made on this thread while ``step()`` runs (deterministic, unlike its time)."""
    import sys

    calls = [0]

    def count(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls[0]


def test_a_logging_step_makes_few_python_calls_per_hooked_tensor():
    """The host cost of a logging step on a GPU is mostly Python: about 22 calls per layer output or
    gradient hooked (the hooks, the copies, the step's start and end shared out)."""
    torch.manual_seed(0)
    bare, watched = torchvision.models.resnet18(num_classes=10), torchvision.models.resnet18(num_classes=10)
    inputs, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    viz = actviz.watch(watched, tempfile.mkdtemp(), every=1, image_every=1)
    optimizers = {id(model): torch.optim.SGD(model.parameters(), lr=0.0, foreach=True) for model in (bare, watched)}

    def step(model):
        optimizers[id(model)].zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizers[id(model)].step()
        if model is watched:
            viz.flush()

    for model in (bare, watched) * 3:  # warm: plans and layouts are made once, the optimizer audit has judged
        step(model)
    extra = python_calls(lambda: step(watched)) - python_calls(lambda: step(bare))
    viz.close()
    hooked = 2 * 41 + 9  # 41 watched layers' outputs and their gradients; 9 ReLUs' outputs for their dead channels
    parameters = len(list(watched.parameters()))  # each has a gradient-norm hook, on every step (gradient_clipping)
    assert hooked * 8 < extra <= hooked * 23 + parameters * 3, extra  # the hooks ran, and cheaply (2,226 calls)


def test_a_logging_step_creates_few_python_objects():
    # Objects alive when the step is handed over, per watched tensor: its Reduction and its one or two tensors.
    import gc

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=10**9)
    counted: list[int] = []
    original = PendingStep.send

    def send(pending):
        counted.append(len(gc.get_objects()) - before)
        original(pending)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
        optimizer.step()
        viz.flush()

    step()
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        PendingStep.send = send
        step()
    finally:
        PendingStep.send = original
        gc.enable()
        viz.close()
    tensors = 2 * 41 + 2 * 62  # activations and their gradients; parameters and theirs
    assert counted and counted[0] <= 4 * tensors, counted  # 618 measured (2,431 with a 0-dim tensor per number)
