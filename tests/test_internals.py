"""Each private API in actviz.common._internals does what actviz assumes: these fail loudly when one changes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import record_writer
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from actviz.common import _internals, _tensorboard_internals

PACKAGE = Path(_internals.__file__).parent
CAT = Path(__file__).parent / "data" / "chelsea.jpg"


def test_queue_end_of_backward_runs_once_after_every_gradient() -> None:
    x = torch.ones(3, requires_grad=True)
    w = torch.ones(3, requires_grad=True)
    seen: list[str] = []

    def on_grad(grad: torch.Tensor) -> None:
        seen.append("grad")
        _internals.queue_end_of_backward(lambda: seen.append(f"end, x.grad={x.grad is not None}"))

    y = x * 2
    y.register_hook(on_grad)
    (y * w).sum().backward()
    # Called once, after the leaves' gradients are accumulated: the end of the backward pass.
    assert seen == ["grad", "end, x.grad=True"]
    with pytest.raises(RuntimeError):  # outside a backward pass there is nothing to queue on
        _internals.queue_end_of_backward(lambda: None)


def test_tensor_version_counts_in_place_ops_only() -> None:
    t = torch.zeros(4)
    start = _internals.tensor_version(t)
    _ = t + 1
    assert _internals.tensor_version(t) == start
    t.relu_()
    t[1:].add_(1)  # through a view
    assert _internals.tensor_version(t) == start + 2


def test_norm_base_is_the_private_class_and_covers_every_batch_and_instance_norm() -> None:
    from torch.nn.modules.batchnorm import _NormBase

    assert _internals.batch_and_instance_norm_types() == (_NormBase,)  # not the fallback
    for norm in (nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2),
                 nn.InstanceNorm1d(2), nn.InstanceNorm2d(2), nn.InstanceNorm3d(2), nn.LazyBatchNorm2d()):
        assert isinstance(norm, _internals.batch_and_instance_norm_types()), type(norm).__name__
    for other in (nn.LayerNorm(2), nn.GroupNorm(1, 2), nn.Conv2d(2, 2, 1)):
        assert not isinstance(other, _internals.batch_and_instance_norm_types()), type(other).__name__


def test_event_file_writer_takes_a_summary_proto(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as writer:
        file_writer = _tensorboard_internals.event_file_writer(writer)
        values = [SummaryProto.Value(tag="a", simple_value=1.5), SummaryProto.Value(tag="b", simple_value=-2.0)]
        file_writer.add_summary(SummaryProto(value=values), 3)
    records = RawEventFileLoader(str(next(tmp_path.glob("events.*")))).Load()
    events = [e for e in map(Event.FromString, records) if e.HasField("summary")]
    assert [(e.step, [(v.tag, v.simple_value) for v in e.summary.value]) for e in events] == [
        (3, [("a", 1.5), ("b", -2.0)])
    ]


def test_record_checksum_is_looked_up_when_each_record_is_written(tmp_path: Path, monkeypatch) -> None:
    # The swap only helps if RecordWriter reads the module's global at write time.
    calls: list[int] = []

    def counting(data: bytes) -> int:
        calls.append(len(data))
        return pywrap_tensorflow.masked_crc32c(data)

    monkeypatch.setattr(record_writer, "masked_crc32c", pywrap_tensorflow.masked_crc32c)
    assert _tensorboard_internals.replace_record_checksum(counting) is True
    assert record_writer.masked_crc32c is counting
    calls.clear()  # the probe it was checked on
    with open(tmp_path / "records", "wb") as handle:
        record_writer.RecordWriter(handle).write(b"0123456789")
    assert calls == [8, 10]  # the length header's checksum, then the data's


def test_a_wrong_checksum_is_refused_and_tensorboard_left_alone(monkeypatch) -> None:
    monkeypatch.setattr(record_writer, "masked_crc32c", pywrap_tensorflow.masked_crc32c)
    with pytest.raises(ValueError, match="checksum"):
        _tensorboard_internals.replace_record_checksum(lambda data: 0)
    assert record_writer.masked_crc32c is pywrap_tensorflow.masked_crc32c


def test_image_classification_is_what_pretrained_weights_preprocess_with() -> None:
    weights = torchvision.models.AlexNet_Weights.DEFAULT  # transforms() needs no download
    preset = weights.transforms()
    made = _internals.image_classification(
        crop_size=preset.crop_size[0], resize_size=preset.resize_size[0], mean=preset.mean, std=preset.std,
        interpolation=preset.interpolation,
    )
    assert type(made) is type(preset)
    assert (made.crop_size, made.resize_size, made.mean, made.std) == (
        [224], [256], [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    image = Image.open(CAT).convert("RGB")
    assert torch.equal(made(image), preset(image))


def test_grad_scaler_keeps_its_scale_as_a_tensor_and_marks_unscaled_optimizers() -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert _internals.grad_scaler_scale(scaler) is None  # made by the first scale()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scale = _internals.grad_scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == scaler.get_scale() == 2.0**10
    assert not _internals.grad_scaler_unscaled(scaler, optimizer)
    scaler.unscale_(optimizer)
    assert _internals.grad_scaler_unscaled(scaler, optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert not _internals.grad_scaler_unscaled(scaler, optimizer)  # a new iteration


def test_compiled_modules_keep_the_original_and_the_compiled_call() -> None:
    model = torch.nn.Linear(2, 2)
    assert _internals.compiled_original(model) is None and _internals.compiled_call(model) is None
    assert _internals.compiled_original(torch.compile(model, backend="eager")) is model
    model.compile(backend="eager")
    compiled = _internals.compiled_call(model)
    assert callable(compiled)
    calls = []
    _internals.set_compiled_call(model, lambda *args: calls.append(args) or compiled(*args))
    model(torch.ones(1, 2))  # Module.__call__ goes through the compiled call
    assert len(calls) == 1
    _internals.set_compiled_call(model, compiled)


def test_foreach_ops_do_what_the_summaries_rely_on() -> None:
    x = torch.tensor([1.0, float("nan"), 0.0, float("inf"), -2.0])
    z = torch.nan_to_num(x, 0.0, 0.0, 0.0)
    counts = torch._foreach_norm([x, z], 0, dtype=torch.float64)  # L0: NaN and Inf count as non-zero
    assert [c.item() for c in counts] == [4.0, 2.0] and counts[0].dtype == torch.float64
    (squares,) = torch._foreach_powsum([z.bfloat16()], 2, dtype=torch.float64)
    assert squares.item() == 5.0 and squares.dtype == torch.float64
    (absolute,) = torch._foreach_powsum([z], 1, dtype=torch.float64)
    assert absolute.item() == 3.0  # |x|, not x
    assert [m.item() for m in torch._foreach_max([z, -z])] == [1.0, 2.0]


def test_compiler_internals_do_what_actviz_fused_relies_on() -> None:
    assert callable(_internals.inductor_backend())
    assert _internals.compiler_stance() == "default"
    with torch.compiler.set_stance("force_eager"):
        assert _internals.compiler_stance() == "force_eager"
    values = torch.zeros(5)
    _internals.mark_size_unbacked(values, 0, 256)
    assert values.shape == (5,)  # marks it; changes nothing else


def test_no_other_module_touches_these_private_apis() -> None:
    private = {"_execution_engine", "_version", "_NormBase", "_get_file_writer", "masked_crc32c", "_presets",
               "_scale", "_per_optimizer_states", "_orig_mod", "_compiled_call_impl", "lookup_backend",
               "mark_unbacked", "_stance", "common", "_dynamo_marked_constant", "_functorch", "_forward_hooks",
               "_forward_pre_hooks", "_modules"}
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("_internals.py", "_tensorboard_internals.py"):
            continue
        tree = ast.parse(path.read_text())
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        names |= {node.module.rsplit(".", 1)[-1] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        assert not names & private, f"{path.relative_to(PACKAGE.parent)} uses {sorted(names & private)}"


def test_swap_stance_sets_what_compiled_calls_read_even_inside_a_compiled_region() -> None:
    import torch._dynamo

    prior = _internals.swap_stance("force_eager")
    try:
        assert _internals.compiler_stance() == "force_eager"
        calls = []

        @torch.compile(backend="eager")
        def double(x):
            calls.append(torch.compiler.is_compiling())
            return x * 2

        double(torch.ones(2))
        assert calls == [False]  # ran eagerly
    finally:
        _internals.swap_stance(prior)
    assert _internals.compiler_stance() == "default"


def test_a_trace_time_constant_runs_while_dynamo_traces_and_leaves_no_op() -> None:
    import torch._dynamo

    seen = []

    def constant():
        seen.append(torch.compiler.is_compiling())
        return 3

    _internals.mark_trace_time_constant(constant)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()

    @torch.compile(backend="eager", fullgraph=True)
    def scaled(x):
        return x * constant()

    assert torch.equal(scaled(torch.ones(2)), torch.full((2,), 3.0))
    scaled(torch.ones(2))
    assert len(seen) == 1  # called once, at trace time, not at each run


def test_functorch_checks_tell_transformed_calls_from_plain_ones() -> None:
    from torch.func import grad, vmap

    seen = []

    def f(x):
        seen.append((_internals.functorch_wrapped(x), _internals.inside_functorch_transform()))
        return x.sum()

    f(torch.ones(3))
    vmap(grad(f))(torch.ones(2, 3))
    assert seen == [(False, False), (True, True)]


def test_forward_hooks_are_the_dicts_module_hooks_live_in() -> None:
    layer = torch.nn.Linear(2, 2)
    handle = layer.register_forward_hook(lambda *args: None)
    pre = layer.register_forward_pre_hook(lambda *args: None)
    assert list(_internals.forward_hooks(layer)) == [handle.id]
    assert list(_internals.forward_hooks(layer, pre=True)) == [pre.id]
    del _internals.forward_hooks(layer)[handle.id]  # a hook taken off this way is off
    calls = []
    layer.register_forward_hook(lambda *args: calls.append(1))
    layer(torch.ones(2))
    assert calls == [1] and len(_internals.forward_hooks(layer)) == 1


def test_child_modules_is_the_live_dict_that_attribute_assignment_changes() -> None:
    """What ``layer_slots.LayerSlots.follow`` relies on: a replaced, deleted or added child shows in the dict at once."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    model.head = torch.nn.Linear(2, 1)
    children = _internals.child_modules(model)
    assert children == {"0": model[0], "1": model[1], "head": model.head}
    model.head = replaced = torch.nn.Linear(2, 3)
    model[0] = torch.nn.Tanh()
    assert children["head"] is replaced and isinstance(children["0"], torch.nn.Tanh)
    del model.head
    assert "head" not in children and _internals.child_modules(model) is children


def test_a_hook_put_straight_into_the_dict_runs_in_order_and_torch_ids_are_never_negative() -> None:
    """What ``owned_hooks.ForwardHooks`` relies on: torch calls every entry of the dict, in order, as a plain hook."""
    layer, calls = torch.nn.Linear(2, 2), []
    first = layer.register_forward_hook(lambda *args: calls.append("first"))
    _internals.forward_hooks(layer)[-5] = lambda module, args, output: calls.append(("ours", output.shape))
    layer.register_forward_hook(lambda *args: calls.append("last"))
    layer(torch.ones(1, 2))
    assert calls == ["first", ("ours", torch.Size([1, 2])), "last"]
    assert first.id >= 0  # torch counts its ids up from 0: a negative key never meets one
    del _internals.forward_hooks(layer)[-5]
    calls.clear()
    layer(torch.ones(1, 2))
    assert calls == ["first", "last"]


def test_replace_event_records_puts_a_record_writer_in_the_event_file_threads_path(tmp_path: Path) -> None:
    # actviz.output.event_records relies on it: TensorBoard's thread writes every record through what is swapped in.
    seen: list[int] = []

    class Counting:
        def __init__(self, records, path: str) -> None:
            self.records, self.path = records, path

        def write(self, data: bytes) -> None:
            seen.append(len(data))
            self.records.write(data)

        def flush(self) -> None:
            self.records.flush()

        def close(self) -> None:
            self.records.close()

    with SummaryWriter(tmp_path) as writer:
        file_writer = _tensorboard_internals.event_file_writer(writer)
        counting = _tensorboard_internals.replace_event_records(file_writer, Counting)
        file_writer.add_summary(SummaryProto(value=[SummaryProto.Value(tag="a", simple_value=1.5)]), 3)
        file_writer.flush()
        assert len(seen) == 1
    assert Path(counting.path) == next(tmp_path.glob("events.*"))
    events = [Event.FromString(record) for record in RawEventFileLoader(counting.path).Load()]
    assert [event.step for event in events if event.HasField("summary")] == [3]


def test_scalar_arrays_send_the_grpc_providers_request_and_give_its_points_as_arrays() -> None:
    import math

    from tensorboard.context import RequestContext
    from tensorboard.data import grpc_provider, provider
    from tensorboard.data.proto import data_provider_pb2

    tags = ["~gradient_stats/norm@fc", "~activation_stats/std@fc"]
    response = data_provider_pb2.ReadScalarsResponse()
    run = response.runs.add(run_name="a")
    for number, tag in enumerate(tags):
        points = run.tags.add(tag_name=tag).data
        points.step.extend([0, 5, 10 + number])
        points.wall_time.extend([1.0, 2.0, 3.0])
        points.value.extend([0.5, math.nan, 1e30 * (number + 1)])

    class Stub:  # the data server's answer, and the requests it got
        requests: list = []

        def ReadScalars(self, request):  # the gRPC method's name
            self.requests.append(request)
            return response

    grpc_data = grpc_provider.GrpcDataProvider("localhost:0", Stub())
    public = grpc_data.read_scalars(RequestContext(), experiment_id="", plugin_name="scalars", downsample=1000,
                                    run_tag_filter=provider.RunTagFilter(runs=["a"], tags=sorted(tags)))
    arrays = _tensorboard_internals.scalar_arrays(grpc_data, "", "a", sorted(tags), 1000)
    assert Stub.requests[0] == Stub.requests[1]  # the request read_scalars sends
    assert sorted(arrays) == sorted(public["a"]) == sorted(tags)
    for tag in tags:
        steps, values = arrays[tag]
        assert steps.dtype == "int64" and values.dtype == "float64"
        assert steps.tolist() == [datum.step for datum in public["a"][tag]]
        assert repr(values.tolist()) == repr([datum.value for datum in public["a"][tag]])  # NaN too
    assert _tensorboard_internals.scalar_arrays(object(), "", "a", tags, 1000) is None  # another provider: read_scalars


def test_the_cpu_flash_kernel_returns_each_query_rows_logsumexp_as_output_one():
    kernels, mode = _internals.attention_kernels()
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in kernels
    assert issubclass(mode, torch.utils._python_dispatch.TorchDispatchMode)
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)[1]
    exact = (q.double() @ k.double().transpose(-2, -1) / 2.0).logsumexp(-1)  # scale 1/√4
    torch.testing.assert_close(logsumexp.double(), exact, rtol=1e-5, atol=1e-5)


def test_default_store_is_the_process_groups_key_value_store_and_none_without_one(tmp_path) -> None:
    import torch.distributed as dist

    assert _internals.default_store() is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        store = _internals.default_store()
        assert store.add("actviz/test", 2) == 2 and store.add("actviz/test", 0) == 2  # add(key, 0) reads the count
        store.set("actviz/test/said", "1")
        assert store.get("actviz/test/said") == b"1"
    finally:
        dist.destroy_process_group()
