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
    assert run.scalar("activation_stats/mean@0", 0) == pytest.approx(stats["mean"], rel=1e-6)


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


# -- the API's shape: 12 parameters, names for numbers, objects for features, one options object ------------------


def test_watch_takes_twelve_parameters_at_most():
    import inspect

    assert list(inspect.signature(actviz.watch).parameters) == [
        "model", "log_dir", "sink", "every", "image_every", "layers", "statistics", "extras", "alerts", "on_step",
        "on_alert", "options"]


REMOVED = {  # written out here, not read from actviz.api: the messages are the contract
    "writer": "watch() no longer takes writer=; pass sink=writer (a SummaryWriter given as a sink is written to and "
              "never closed)",
    "max_channels": "watch() no longer takes max_channels=; pass options=actviz.Options(max_channels=...)",
    "bins": "watch() no longer takes bins=; pass options=actviz.Options(bins=...)",
    "histogram_sample_size": "watch() no longer takes histogram_sample_size=; pass "
                             "options=actviz.Options(histogram_sample_size=...)",
    "outputs": "watch() no longer takes outputs=; pass options=actviz.Options(outputs=...)",
    "auto_step": "watch() no longer takes auto_step=; pass options=actviz.Options(auto_step=...)",
    "strict": "watch() no longer takes strict=; pass options=actviz.Options(strict=...)",
    "grad_scaler": "watch() no longer takes grad_scaler=; pass options=actviz.Options(grad_scaler=...)",
    "merge_ranks": "watch() no longer takes merge_ranks=; pass options=actviz.Options(merge_ranks=...)",
    "transformer_stats": "watch() no longer takes transformer_stats=; pass statistics=['default', 'transformer'] to "
                         "turn them on, or a list without 'transformer' (e.g. statistics=['moments', 'dead_channels', "
                         "'saturation']) to turn them off",
    "moe": "watch() no longer takes moe=; pass statistics=['default', 'moe'] to turn it on, or a list without 'moe' "
           "to turn it off",
    "update_ratio": "watch() no longer takes update_ratio=; pass statistics=['default', 'update_ratio']",
    "gradient_noise": "watch() no longer takes gradient_noise=; pass statistics=['default', 'gradient_noise']",
    "probe": "watch() no longer takes probe=; pass extras=[actviz.Probe(batch)]",
    "gradcam": "watch() no longer takes gradcam=; pass extras=[actviz.Probe(batch, gradcam=...)]",
    "spikes": "watch() no longer takes spikes=; pass extras=[actviz.Spikes()]",
}


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_each_removed_keyword_raises_a_type_error_that_names_its_new_spelling(tmp_path, name):
    model = small_cnn()
    with pytest.raises(TypeError) as raised:
        actviz.watch(model, tmp_path / "run", every=1, **{name: True})
    assert str(raised.value) == REMOVED[name]
    assert hooks_left(model) == NO_HOOKS and not (tmp_path / "run").exists()


def test_a_list_of_statistics_runs_what_it_names_and_default_adds_the_default_set(tmp_path, read_run):
    def tags(statistics, folder):
        model = small_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with actviz.watch(model, tmp_path / folder, every=1, image_every=False, statistics=statistics):
            for _ in range(2):
                train_step(model)
                optimizer.step()
        return {tag.split("@")[0] for tag in read_run(tmp_path / folder).scalar_tags}

    default, added, alone = tags(None, "default"), tags(["default", "update_ratio"], "added"), tags(["update_ratio"],
                                                                                                      "alone")
    assert "activation_stats/mean" in default and not any(tag.startswith("update_ratio/") for tag in default)
    assert default < added and {tag for tag in added - default} == {tag for tag in alone if "update_ratio" in tag}
    assert not any(tag.startswith("activation_stats/") for tag in alone)
    with pytest.raises(ValueError, match=r"^unknown statistic 'update_ratios'; did you mean 'update_ratio'\?$"):
        actviz.watch(small_cnn(), tmp_path / "bad", statistics=["default", "update_ratios"])


@pytest.mark.parametrize(("extras", "error", "message"), [
    (actviz.Spikes(), TypeError, r"^extras must be a list, got Spikes: Spikes\(\); for example extras=\[actviz.Spikes\(\)\]$"),
    ([actviz.Probe], TypeError, r"^extras takes objects, got the class Probe; for example extras=\[actviz.Probe\(batch\)\]$"),
    (["spikes"], TypeError, r"^each extra must be an actviz.Probe or actviz.Spikes, got str: 'spikes'$"),
    ([actviz.Spikes(), actviz.Spikes()], ValueError, r"^extras holds two Spikes objects; give one$"),
])
def test_extras_are_checked_before_anything_is_touched(tmp_path, extras, error, message):
    model = small_cnn()
    with pytest.raises(error, match=message):
        actviz.watch(model, tmp_path / "run", extras=extras)
    assert hooks_left(model) == NO_HOOKS and not (tmp_path / "run").exists()


def test_a_summary_writer_and_a_sink_of_your_own_in_one_list_both_get_each_step(tmp_path, read_run):
    from torch.utils.tensorboard import SummaryWriter

    class ListSink:
        def __init__(self):
            self.steps = []

        def write(self, results):
            self.steps.append(results.step)

        def flush(self):
            pass

        def close(self):
            pass

    writer, mine, model = SummaryWriter(tmp_path / "mine"), ListSink(), small_cnn()
    with actviz.watch(model, sink=[writer, mine], every=1, image_every=False):
        train_step(model)
        train_step(model)
    writer.flush()
    assert mine.steps == [0, 1] and [event.step for event in read_run(tmp_path / "mine").scalar_events("activation_stats/mean@0")] == [0, 1]
    assert writer.file_writer is not None  # yours: written to, never closed
    writer.close()


# --- Arguments checked at watch(), where the mistake is made.


def test_an_empty_probe_batch_is_rejected_at_watch_naming_it(tmp_path):
    model = small_cnn()
    for empty in (torch.zeros(0, 3, 8, 8), (torch.zeros(0, 3, 8, 8),), {"x": torch.zeros(0, 3, 8, 8)}):
        with pytest.raises(ValueError, match=r"actviz.Probe\(batch\) got an empty batch \(.*0, 3, 8, 8.*\).*actviz.Probe\(inputs\[:1\]\)"):
            actviz.watch(model, tmp_path / "run", extras=[actviz.Probe(empty)])
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
