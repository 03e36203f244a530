"""What a new user meets: results in Python, the layer table, turning parts off, errors that teach."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import NO_HOOKS, hooks_left, small_cnn, train_step

import actviz


@pytest.mark.usefixtures("every_path")
def test_on_step_hands_over_each_steps_statistics_and_latest_keeps_the_last(tmp_path, read_run):
    model = small_cnn(inplace=False)
    seen = []
    outputs = {}
    model[0].register_forward_hook(lambda module, inputs, output: outputs.update({len(outputs): output.detach()}))
    with actviz.watch(model, tmp_path, every=2, on_step=seen.append) as viz:
        assert viz.latest is None
        for _ in range(4):
            train_step(model)
        viz.flush()
        assert viz.latest is seen[-1]
    assert [results.step for results in seen] == [0, 2]
    stats = seen[0].statistics()["activations/0"]
    expected = outputs[0].double()
    assert stats["count"] == expected.numel() and stats["nonfinite"] == 0
    assert stats["mean"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert stats["std"] == pytest.approx(expected.std().item(), rel=1e-5)
    assert (stats["min"], stats["max"]) == pytest.approx((expected.min().item(), expected.max().item()))
    assert stats["norm"] == pytest.approx(expected.norm().item(), rel=1e-5)
    assert {"gradients/6", "weights/6.weight", "weight_grads/6.weight"} <= set(seen[0].statistics())
    run = read_run(tmp_path)
    assert run.scalar("activation_stats/0/mean", 0) == pytest.approx(stats["mean"], rel=1e-6)


def test_a_failing_on_step_warns_once_and_training_goes_on(tmp_path):
    def fails(results):
        raise ValueError("my tracker is down")

    model = small_cnn()
    with pytest.warns(RuntimeWarning, match="on_step callback raised ValueError: my tracker is down") as caught:
        with actviz.watch(model, tmp_path, every=1, on_step=fails) as viz:
            for _ in range(3):
                train_step(model)
            viz.flush()
    assert sum("on_step" in str(w.message) for w in caught) == 1
    assert viz.latest.step == 2


def test_the_layer_table_names_type_shape_and_parameters(tmp_path, read_run):
    model = small_cnn()
    with actviz.watch(model, tmp_path, every=1) as viz:
        train_step(model, batch=4, size=8)
        train_step(model)
        viz.flush()
        table = viz.layer_table
    run = read_run(tmp_path)
    events = run.events.Tensors("layers")
    assert [event.step for event in events] == [0]  # once, at the first stats step
    assert events[0].tensor_proto.string_val[0].decode() == table
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert rows["0"] == "| 0 | Conv2d | 4 × 6 × 8 × 8 | 168 |"  # 6*3*3*3 + 6
    assert rows["3"] == "| 3 | BatchNorm2d | 4 × 5 × 4 × 4 | 10 |"
    assert rows["6"] == "| 6 | Linear | 4 × 3 | 243 |"  # 80*3 + 3
    assert list(rows) == viz.layer_names


def test_pictures_off_and_histograms_off(tmp_path, read_run):
    model = small_cnn()
    with actviz.watch(model, tmp_path / "no_pictures", every=1, image_every=False):
        train_step(model)
    run = read_run(tmp_path / "no_pictures")
    assert run.image_tags == set() and "activations/0" in run.histogram_tags
    with actviz.watch(model, tmp_path / "pictures_only", every=False, image_every=2):
        for _ in range(3):
            train_step(model)
    run = read_run(tmp_path / "pictures_only")
    assert run.histogram_tags == set() and run.scalar_tags == set()
    assert run.image_steps("feature_maps/0") == [0, 2]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"layers": 42}, TypeError, r"layers= must be None .*got int: 42\. A spec is a module type"),
        ({"every": False}, ValueError, r"logs nothing; turn off one kind only: every=False, image_every=100"),
        ({"every": False, "image_every": False}, ValueError, r"logs nothing"),
        ({"image_every": True}, TypeError, r"image_every=True is ambiguous; give a number of steps, for example"),
        ({"on_step": "print"}, TypeError, r"on_step must be a function results -> None, got str"),
        ({"merge_ranks": "yes"}, TypeError, r"merge_ranks must be True or False"),
    ],
)
def test_errors_name_the_argument_and_the_fix(kwargs, error, message, tmp_path):
    model = small_cnn()
    with pytest.raises(error, match=message):
        actviz.watch(model, tmp_path / "run", **kwargs)
    assert hooks_left(model) == NO_HOOKS and not (tmp_path / "run").exists()


@pytest.mark.usefixtures("both_paths")
def test_results_statistics_of_an_all_nan_tensor_are_nan_not_errors(tmp_path):
    model = small_cnn()
    seen = []
    with actviz.watch(model, tmp_path, every=1, on_step=seen.append) as viz:
        model(torch.full((2, 3, 8, 8), float("nan"))).sum().backward()
        viz.flush()
    stats = seen[0].statistics()["activations/0"]
    assert stats["nonfinite"] == stats["count"] == 2 * 6 * 8 * 8
    assert math.isnan(stats["mean"]) and math.isnan(stats["std"])


# --- Arguments checked at watch(), where the mistake is made.


def test_an_empty_probe_batch_is_rejected_at_watch_naming_it(tmp_path):
    model = small_cnn()
    for empty in (torch.zeros(0, 3, 8, 8), (torch.zeros(0, 3, 8, 8),), {"x": torch.zeros(0, 3, 8, 8)}):
        with pytest.raises(ValueError, match=r"probe= is an empty batch \(.*0, 3, 8, 8.*\).*probe=inputs\[:1\]"):
            actviz.watch(model, tmp_path / "run", probe=empty)
    assert hooks_left(model) == NO_HOOKS and not (tmp_path / "run").exists()


def test_numpy_integers_are_step_numbers(tmp_path):
    np = pytest.importorskip("numpy")
    model = small_cnn()
    written = []
    with actviz.watch(model, tmp_path, every=[np.int64(0), np.int32(2)], image_every=np.int64(2),
                      on_step=lambda results: written.append(results.step)) as viz:
        for _ in range(3):
            train_step(model)
        viz.flush()
    assert written == [0, 2]


def test_an_over_long_log_dir_name_is_a_value_error_naming_the_limit(tmp_path):
    model = small_cnn()
    with pytest.raises(ValueError, match=r"folder name of 300 bytes .* 255 bytes .*NAME_MAX.*log_dir='runs/exp1'"):
        actviz.watch(model, tmp_path / ("a" * 300))
    assert hooks_left(model) == NO_HOOKS
