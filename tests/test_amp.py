"""Mixed precision: gradients logged unscaled, the scale logged, overflow steps readable."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import small_cnn

import actviz

LAYERS = ["0", "2", "3", "6"]


def capture_grads(model):
    """Output gradients of LAYERS, per forward, from plain hooks on a twin."""
    found: list[dict[str, torch.Tensor]] = []

    def hook(name):
        def forward_hook(module, inputs, output):
            if name == "0":
                found.append({})
            record = found[-1]
            output.register_hook(lambda grad: record.__setitem__(name, grad.detach().clone()))
        return forward_hook

    for name in LAYERS:
        model.get_submodule(name).register_forward_hook(hook(name))
    return found


def batches(count):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(count)]


@pytest.mark.usefixtures("every_path")
def test_gradients_are_logged_unscaled_against_a_twin_without_scaling(tmp_path, read_run):
    model, twin = small_cnn(inplace=False), small_cnn(inplace=False)
    grads = capture_grads(twin)
    data = batches(3)
    for batch in data:
        twin.zero_grad()
        twin(batch).square().mean().backward()
    twin_param_grads = {name: param.grad.clone() for name, param in twin.named_parameters()}

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)  # the scale doubles every step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scales = []
    with actviz.watch(model, tmp_path, every=1, options=actviz.Options(grad_scaler=scaler)):
        for batch in data:
            optimizer.zero_grad()
            scales.append(scaler.get_scale())
            scaler.scale(model(batch).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
    assert scales == [2.0**16, 2.0**17, 2.0**18]
    run = read_run(tmp_path)
    for step, scale in enumerate(scales):
        assert run.scalar("amp/grad_scale", step) == scale
        for name in LAYERS:
            expected = grads[step][name].double()
            logged = run.histogram(f"gradients/{name}", step)
            assert logged.sum_squares == pytest.approx((expected**2).sum().item(), rel=1e-4)
            assert logged.max == pytest.approx(expected.max().item(), rel=1e-4)
            assert run.scalar(f"gradient_stats/norm@{name}", step) == pytest.approx(expected.norm().item(), rel=1e-4)
    for name, grad in twin_param_grads.items():  # the last step's gradients, unscaled by scaler.step
        logged = run.histogram(f"weight_grads/{name}", 2)
        assert logged.sum_squares == pytest.approx((grad.double() ** 2).sum().item(), rel=1e-4)


@pytest.mark.usefixtures("both_paths")
def test_an_overflow_step_stays_readable(tmp_path, read_run):
    model = small_cnn(inplace=False)
    twin = small_cnn(inplace=False)
    grads = capture_grads(twin)
    outputs = {}
    for name in LAYERS:
        twin.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: outputs.update({name: o.detach()}))
    batch = batches(1)[0].clone()
    batch[0, 0, 2, 2] = float("inf")  # the gradients overflow: the scaler skips this step
    torch.amp.GradScaler("cpu", init_scale=2.0**16).scale(twin(batch).square().mean()).backward()

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with actviz.watch(model, tmp_path, every=1, options=actviz.Options(grad_scaler=scaler)):
        scaler.scale(model(batch).square().mean()).backward()
        nonfinite = {name: int((~torch.isfinite(param.grad)).sum()) for name, param in model.named_parameters()}
        scaler.step(optimizer)  # skipped: no optimizer step, so the step ends at the next forward
        scaler.update()
        scaler.scale(model(batches(1)[0]).square().mean()).backward()
    assert scaler.get_scale() == 2.0**15  # the scaler saw the overflow
    run = read_run(tmp_path)
    assert run.scalar("amp/grad_scale", 0) == 2.0**16 and run.scalar("amp/grad_scale", 1) == 2.0**15
    for name in LAYERS:
        true_activations = int((~torch.isfinite(outputs[name])).sum())
        true_gradients = int((~torch.isfinite(grads[0][name])).sum())
        assert true_activations > 0 and true_gradients > 0
        assert run.scalar(f"activation_stats/nonfinite@{name}", 0) == true_activations  # > 0: written
        assert run.scalar(f"gradient_stats/nonfinite@{name}", 0) == true_gradients
    for name, count in nonfinite.items():
        numel = model.get_parameter(name).numel()
        if count < numel:  # the finite values' histogram, with the non-finite ones left out
            assert run.histogram(f"weight_grads/{name}", 0).num == numel - count
        else:  # none finite: no histogram, nothing raised
            assert f"weight_grads/{name}" not in run.histogram_tags
    assert 1 in run.histogram_steps("gradients/0")  # the next step is logged as usual


def test_grad_scaler_must_be_a_grad_scaler(tmp_path):
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler.*got float"):
        actviz.watch(small_cnn(), tmp_path / "run", options=actviz.Options(grad_scaler=65536.0))
    assert not (tmp_path / "run").exists()


def test_lightning_passes_its_scaler_with_fp16_mixed_precision(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from actviz.integrations.lightning import ActvizCallback, trainer_grad_scaler

    scaler = torch.amp.GradScaler("cpu")
    plugin = types.SimpleNamespace(scaler=scaler)
    fp16 = types.SimpleNamespace(precision_plugin=plugin, strategy=types.SimpleNamespace(precision_plugin=plugin))
    assert trainer_grad_scaler(fp16) is scaler
    bf16 = types.SimpleNamespace(strategy=types.SimpleNamespace(precision_plugin=types.SimpleNamespace()))
    assert trainer_grad_scaler(bf16) is None
    assert "grad_scaler" not in ActvizCallback().watch_kwargs  # taken from the trainer, not given


def test_huggingface_passes_its_scaler_with_fp16(tmp_path):
    pytest.importorskip("transformers")
    from actviz.integrations.huggingface import ActvizCallback

    scaler = torch.amp.GradScaler("cpu")
    model = small_cnn()
    callback = ActvizCallback(tmp_path / "viz")
    state = types.SimpleNamespace(is_world_process_zero=True)
    args = types.SimpleNamespace(logging_dir=None, output_dir=str(tmp_path))
    accelerated_optimizer = types.SimpleNamespace(scaler=scaler)  # as accelerate wraps it with fp16
    callback.on_train_begin(args, state, None, model=model, optimizer=accelerated_optimizer)
    assert callback.viz.grad_scaler is scaler
    callback.close()
    callback.on_train_begin(args, state, None, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert callback.viz.grad_scaler is None  # bf16 or fp32: nothing to unscale
    callback.close()


def test_a_pending_steps_loss_scale_divides_only_the_scaled_summaries_and_is_written():
    from actviz.output.pending_step import PendingStep
    from actviz.summaries.one_tensor import start_summary

    values = torch.tensor([4.0, -8.0, 2.0])
    pending = PendingStep(7, bins=4)
    pending.loss_scale = torch.tensor(4.0)
    assert not pending.empty  # the scale alone is a step's scalar
    pending.activations.add_many({"fc": start_summary(values)})
    pending.gradients.add_many({"fc": start_summary(values)}, scaled=True)
    pending.weights.add_many({"fc.weight": start_summary(values)})
    pending.weight_grads.add_many({"fc.weight": start_summary(values), "fc.bias": start_summary(values)}, scaled=True,
                                  mergeable={"fc.bias"})
    assert [tag for tag, _ in pending.mergeable] == ["weight_grads/fc.bias"]
    results = pending.resolve()
    assert results.scalars == {"amp/grad_scale": 4.0}
    assert (results.activations["fc"].max, results.weights["fc.weight"].max) == (4.0, 4.0)
    assert (results.gradients["fc"].max, results.weight_grads["fc.bias"].min) == (1.0, -2.0)
    assert list(results.weight_grads) == ["fc.weight", "fc.bias"]
