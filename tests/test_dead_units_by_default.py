"""Dead ReLU channels with the default options: the ReLUs of a conv → BN → ReLU network are not among the default
layers, and the dead-channel count runs on them all the same, alone (no summary, picture or gradient of theirs)."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from conftest import CountOps, Run
from torch import nn

import actviz


def conv_bn_relu(dead: int) -> nn.Sequential:
    """Two conv → BN → in-place ReLU blocks; ``dead`` of the first block's 10 channels pushed below 0 by BN's bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 10, 3, padding=1), nn.BatchNorm2d(10), nn.ReLU(inplace=True),
                          nn.Conv2d(10, 10, 3, padding=1), nn.BatchNorm2d(10), nn.ReLU(inplace=True),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(10, 4))
    with torch.no_grad():
        model[1].bias[:dead] = -10.0
    return model


def one_step(model: nn.Module, **watch_args):
    inputs, labels = torch.randn(8, 3, 12, 12), torch.randint(0, 4, (8,))
    seen = {}
    handles = [model[i].register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, out.detach().clone()))
               for i in (2, 5)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, **watch_args)
        nn.functional.cross_entropy(model(inputs), labels).backward()
        viz.flush()
        viz.close()
    for handle in handles:
        handle.remove()
    return viz, seen, [str(w.message) for w in caught]


def test_the_default_options_count_the_dead_channels_of_relus_they_do_not_watch():
    viz, seen, messages = one_step(conv_bn_relu(dead=9))
    results = viz.latest
    assert "2" not in results.activations and "5" not in results.activations  # the ReLUs are not watched
    counted = results.layer_values["dead_channels"]
    for name, index in (("2", 2), ("5", 5)):
        by_hand = float((seen[index].amax(dim=(0, 2, 3)) == 0).double().mean())
        assert counted[name]["dead_channel_fraction"] == pytest.approx(by_hand)
    assert counted["2"]["dead_channel_fraction"] == pytest.approx(0.9)
    assert [(alert.rule, alert.layer) for alert in viz.alerts if alert.rule == "dead_units"] == [("dead_units", "2")]
    assert any("dead units at step 0 in '2'" in message for message in messages), messages


def test_a_healthy_network_raises_nothing_and_alerts_false_counts_nothing():
    viz, _, _ = one_step(conv_bn_relu(dead=0))
    assert viz.latest.layer_values["dead_channels"]["2"]["dead_channel_fraction"] == 0.0
    assert not [alert for alert in viz.alerts if alert.rule == "dead_units"]
    quiet, _, _ = one_step(conv_bn_relu(dead=9), alerts=False)
    assert "dead_channels" not in quiet.latest.layer_values


def test_an_unwatched_relu_costs_three_small_ops_and_no_sync(monkeypatch):
    # On the accelerator path: one read of its output (the sums of |x| over all but the channels), then two ops on C
    # numbers.
    # The step's statistics join the cat that packs the step's other tensors for the copy to the host: no op more.
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    model = conv_bn_relu(dead=0)
    inputs, labels = torch.randn(8, 3, 12, 12), torch.randint(0, 4, (8,))
    counts = {}
    for counting in (False, True):
        viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, alerts=counting)
        model.zero_grad(set_to_none=True)  # both steps make their gradients afresh
        with CountOps() as count:
            nn.functional.cross_entropy(model(inputs), labels).backward()
            viz.flush()
        viz.close()
        assert count.syncs == []
        counts[counting] = count.kernels
    added = list(counts[True])
    for kernel in counts[False]:
        added.remove(kernel)
    assert sorted(added) == sorted(["aten.linalg_vector_norm.default", "aten.eq.Scalar", "aten.mean.default"] * 2), added


def test_dormant_units_of_an_unwatched_relu_share_the_dead_channel_counts_read(monkeypatch):
    # Both statistics of the unwatched ReLU take its per-channel sums of |x|: named together, one read, not two.
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    model = conv_bn_relu(dead=0)
    inputs = torch.randn(8, 3, 12, 12)
    reads = {}
    for statistics in (["default"], ["default", "dormant_units"]):
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, statistics=statistics) as viz:
            with CountOps() as count:
                model(inputs).sum().backward()
                viz.flush()
        reads[len(statistics)] = count.kernels.count("aten.linalg_vector_norm.default")
        assert count.syncs == []
    assert reads[2] == reads[1] >= 1  # dormant units add no read of their own (they would add one per ReLU output)
    assert "2" in viz.latest.layer_values["dormant_units"]


def sequence_mlp(dead: int) -> nn.Sequential:
    """A transformer's MLP on (B, T, 16) tokens: Linear(16, 128) → ReLU → Linear(128, 16), ``dead`` units of 128 off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 16))
    with torch.no_grad():
        model[0].bias[:dead] = -1e4
    return model


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize(("positions", "layers"), [(8, None), (8, "all"), (512, "all")],
                         ids=["an unwatched ReLU", "batched with the step's small tensors", "the one-pass op's read"])
def test_the_dead_units_of_a_sequence_output_are_counted_over_its_features(positions, layers):
    # (B, T, 128): 122 of the 128 features are zero at every token; the token positions are all alive.
    model = sequence_mlp(dead=122)
    x = torch.randn(4, positions, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, layers=layers) as viz:
            model(x).square().mean().backward()
            viz.flush()
    with torch.no_grad():
        by_hand = float((model[1](model[0](x)).amax(dim=(0, 1)) == 0).double().mean())
    assert by_hand == 122 / 128
    assert viz.latest.layer_values["dead_channels"]["1"]["dead_channel_fraction"] == pytest.approx(by_hand)
    assert [(alert.rule, alert.layer) for alert in viz.alerts if alert.rule == "dead_units"] == [("dead_units", "1")]
    assert any("dead units at step 0 in '1'" in str(w.message) for w in caught)


@pytest.mark.usefixtures("both_paths")
def test_a_conv1d_relu_output_keeps_its_channels_in_dimension_1():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 10, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(10 * 600, 2))
    with torch.no_grad():
        model[0].bias[:9] = -1e4  # 9 of 10 channels dead at every position
    x = torch.randn(4, 3, 600)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False) as viz:
            model(x).square().mean().backward()
            viz.flush()
    assert viz.latest.layer_values["dead_channels"]["1"]["dead_channel_fraction"] == pytest.approx(0.9)


def generator(scale: float) -> nn.Sequential:
    """A DCGAN-shaped generator in miniature: its final Tanh's input is multiplied by ``scale``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(8, 4, 4, 1, 0, bias=False), nn.BatchNorm2d(4), nn.ReLU(True),
                          nn.ConvTranspose2d(4, 1, 4, 2, 1, bias=False), nn.Tanh())
    with torch.no_grad():
        model[3].weight.mul_(scale)
    return model


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("scale", [1.0, 100.0], ids=["healthy", "saturated"])
def test_the_default_options_judge_the_saturation_of_a_tanh_they_do_not_watch(scale):
    model = generator(scale)
    noise = torch.randn(16, 8, 1, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False) as viz:
            model(noise).square().mean().backward()
            viz.flush()
    with torch.no_grad():
        by_hand = float((model(noise).double().abs() > 0.97).double().mean())
    assert "4" not in viz.latest.activations  # the Tanh is not watched
    assert viz.latest.layer_values["saturation"]["4"]["saturated_fraction"] == pytest.approx(by_hand, abs=1e-6)
    fired = [(alert.rule, alert.layer) for alert in viz.alerts if alert.rule == "saturation"]
    if scale == 1.0:
        assert by_hand < 0.05 and fired == []
    else:
        assert by_hand > 0.5 and fired == [("saturation", "4")]
        assert any("saturation at step 0 in '4'" in str(w.message) for w in caught)


def test_an_unwatched_relu_writes_its_zero_fraction_and_a_watched_one_keeps_its_exact_one(tmp_path, monkeypatch):
    # The default layers leave the ReLU out: its zero fraction, read back from the event file, is the exact one for
    # an output of 4 × 8 × 48 × 48 values, and within half a point from a strided sample of 4 × 8 × 192 × 192.
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")  # the accelerator's code path, on the CPU
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    for side, layers, tolerance in ((48, None, 1e-6), (192, None, 0.005), (48, "all", 1e-6)):
        inputs = torch.randn(4, 3, side, side) + 0.3
        run = tmp_path / f"{side}-{layers}"
        with actviz.watch(model, run, every=1, image_every=False, layers=layers) as viz:
            model(inputs).sum().backward()
        exact = (model[2](model[1](model[0](inputs))) == 0).double().mean().item()
        assert 0.3 < exact < 0.7
        assert Run(run).scalar("activation_stats/zero_fraction@2", 0) == pytest.approx(exact, abs=tolerance)
        assert ("2" in viz.layer_names) == (layers == "all")
        assert ("relu_zeros" in viz.latest.layer_values) == (layers is None)  # a watched one: its summary's alone
