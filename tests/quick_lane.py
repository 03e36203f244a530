"""The quick lane: ``pytest --quick`` (or ``bash scripts/test.sh --quick``) runs all but the slow tests.

The slow set is named here, in one place, from ``pytest --durations=0`` on a 2-core machine:
whole files that start processes, servers, browsers or big models, and single tests over
about a second (the quick lane then ran in under a minute on 2 shared cores). A test can also mark itself with ``@pytest.mark.slow``. The full suite,
slow tests included, is what CI runs (``.ci/run`` calls ``scripts/test.sh`` with no option).
Loaded from tests/conftest.py (``pytest_plugins``).
"""

from __future__ import annotations

import warnings

import pytest

SLOW_FILES = {
    "test_bench_smoke.py",  # runs the benchmarks' quick modes in fresh processes
    "test_compile.py",  # torch.compile with Inductor
    "test_distributed.py",  # gloo process groups, DDP and FSDP in subprocesses
    "test_fused.py",  # compiles summaries with Inductor: about 10 s warm, 26 s with a cold cache
    "test_notebook.py",  # a Jupyter kernel
    "test_scripts.py",  # install.sh dry runs
    "test_tensorboard_server.py",  # a TensorBoard server and a browser
    "test_zoo.py",  # every torchvision model family
}

SLOW_TESTS = {
    "test_interrupted_steps.py::test_ctrl_c_at_any_stage_leaves_no_hook_and_the_next_steps_log[probe pictures-True]",
    "test_amp.py::test_lightning_passes_its_scaler_with_fp16_mixed_precision",
    "test_cli.py::test_corrupt_image_exits_1_names_it_and_keeps_the_others",
    "test_cli.py::test_default_weights_offline_gives_a_clear_message",
    "test_device_path.py::test_logging_step_budget_on_a_small_resnet",
    "test_docs.py::test_python_blocks_run_as_written[docs/integrations.md]",
    "test_docs.py::test_python_blocks_run_as_written[docs/training-setups.md]",  # two gloo processes
    "test_docstrings.py::test_docstring_examples[actviz.summaries.fused]",
    "test_docstrings.py::test_docstring_examples[actviz.integrations.huggingface]",
    "test_docstrings.py::test_docstring_examples[actviz.integrations.lightning]",
    "test_insight.py::test_report_gradcam_draws_the_top_class_over_the_input",
    "test_kernel_compile.py::test_every_variant_compiles_for_sm80_and_sm90_without_spills_divisions_or_ordered_atomics",  # 110 Triton compiles
    "test_integrations.py::test_import_actviz_needs_no_framework",
    "test_package.py::test_torchvision_is_imported_when_the_first_picture_is_drawn",
    "test_package.py::test_watch_runs_without_torchvision_and_tqdm_when_it_draws_no_picture",
    "test_report.py::test_every_guaranteed_vgg_variant_reports_each_conv",
    "test_report.py::test_random_weights_are_unmissable_on_the_page_in_tensorboard_and_the_command",
    "test_report.py::test_report_writes_tensorboard_runs_and_html",
    "test_report.py::test_two_models_get_their_own_runs_and_say_which_they_are",
    "test_sinks.py::test_one_atexit_entry_writes_the_pending_steps_of_every_watcher",
    "test_watch.py::test_torchvision_models_with_inplace_relus",
    # from `--durations=30` of the quick lane, 2 cores shared with other jobs (load 2 to 4), November 2026
    "test_alerts.py::test_300_steps_of_a_tiny_gpt2_raise_no_alert",
    "test_check_gpu.py::test_smoke_mode_runs_every_phase_on_the_cpu_and_writes_its_table",  # the Triton interpreter
    "test_alerts.py::test_300_steps_of_resnet18_at_a_small_size_raise_no_alert",
    "test_alerts.py::test_300_steps_of_the_demo_cnn_raise_no_alert",
    "test_amp.py::test_gradients_are_logged_unscaled_against_a_twin_without_scaling[fused]",
    "test_attention.py::test_compiled_gpt2_keeps_one_graph_and_never_recompiles",
    "test_device_path.py::test_a_logging_step_creates_few_python_objects",
    "test_doctor.py::test_a_lightning_run",
    "test_doctor.py::test_the_command_runs_as_a_program_and_its_help_teaches",
    "test_loop_shapes.py::test_mnist_hogwild_workers_run_the_watched_model",  # worker processes
    "test_never_break.py::test_a_forked_child_writes_nothing_and_exits_at_once",
    "test_never_break.py::test_compiling_after_watch_gives_the_graphs_and_steps_of_compiling_first",
    "test_never_break.py::test_copies_in_a_fresh_process_with_and_without_dynamo",
    "test_never_break.py::test_inductor_after_watch_with_fullgraph",
    "test_never_break.py::test_onnx_export_of_a_watched_model_takes_no_step",
    "test_never_break.py::test_spawned_workers_get_an_unwatched_model",
    "test_report.py::test_progress_bar_counts_images_times_layers",
    "test_summaries.py::test_extra_memory_of_an_integer_output_is_at_most_its_size",  # tracemalloc over big outputs
    # and the next ones, over 1.3 s in --durations=60 of the quick lane then (the lane took 67 s at load 2)
    "test_attention.py::test_every_tag_on_four_transformers[gpt2]",
    "test_device_path.py::test_many_parameters_take_the_same_ops_whatever_their_count",
    "test_doctor.py::test_a_hugging_face_run",
    "test_integrations.py::test_lightning_logs_at_global_steps_into_the_loggers_run",
    "test_watch.py::test_logged_values_equal_values_computed_by_hand[fused]",  # compiles the summaries
    "test_watch.py::test_nan_in_a_layer_is_counted_and_training_goes_on[fused]",  # the first compile pays 2 to 3 s
    "test_watch_api.py::test_on_step_hands_over_each_steps_statistics_and_latest_keeps_the_last[fused]",
    "test_watch.py::test_bad_arguments",  # builds an AlexNet for each of its 11 cases: 7 s together
    "test_integrations.py::test_lightning_gradient_accumulation_logs_once_per_optimizer_step",
    "test_integrations.py::test_huggingface_logs_at_global_steps",
    "test_integrations.py::test_huggingface_gradient_accumulation_logs_once_per_optimizer_step",
    "test_report.py::test_a_run_folder_that_already_holds_events_gets_a_warning",
    "test_report.py::test_html_numbers_are_formatted_one_way",
    "test_report.py::test_report_grid_is_the_watchers_rendering_of_the_conv_output",
    # and those over 1.1 s in --durations=40 of the quick lane on an idle 2-core machine, 2026-11-28 (118 s then)
    "test_one_pass.py::test_the_triton_kernels_match_float64_under_the_interpreter",  # Triton's interpreter: 20 s
    "test_one_pass.py::test_a_watched_step_logs_the_same_numbers_through_the_triton_kernels",
    "test_no_step_lost.py::test_strict_on_alert_exit_stops_training_after_its_step_is_written",
    "test_no_step_lost.py::test_on_alert_that_exits_leaves_its_step_on_disk_and_doctor_finds_the_alert",
    "test_no_step_lost.py::test_dropped_watchers_end_their_writer_threads",
    "test_report.py::test_html_prints_one_image_per_page",
    "test_doctor.py::test_a_folder_name_that_is_not_utf8_and_control_characters_are_escaped_on_the_terminal",
    "test_doctor.py::test_an_intact_file_written_by_actviz_is_not_damaged",
    "test_doctor.py::test_one_flipped_byte_in_an_event_file_is_damage_from_the_step_where_it_stops",
    "test_doctor.py::test_a_layers_text_with_no_string_a_folder_named_like_an_event_file_and_a_tag_not_utf8",
    "test_doctor.py::test_a_record_claiming_2_to_the_40_bytes_is_damage_and_the_other_runs_are_read",
    "test_doctor.py::test_exit_statuses_are_distinct_and_documented",
    "test_doctor.py::test_a_fifo_named_like_an_event_file_is_skipped_not_waited_on",
    "test_full_disk.py::test_a_file_size_limit_costs_the_steps_past_it_and_the_run_goes_on_once_it_is_lifted",
    "test_bounded_growth.py::test_flow_pictures_cost_the_same_bytes_at_every_image_step_once_the_window_is_full",
    "test_bounded_waits.py::test_a_slow_sink_that_answers_loses_nothing",
    "test_diff.py::test_the_command_runs_as_a_process",
    "test_device_path.py::test_a_logging_step_makes_few_python_calls_per_hooked_tensor",
    "test_step_objects.py::test_hooks_and_weak_references_do_not_grow_with_the_layers",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", help="skip the slow tests (see tests/quick_lane.py)")


def _name(item: pytest.Item) -> str:
    """``file.py::test_name[params]``, without the folder."""
    path, _, rest = item.nodeid.partition("::")
    return f"{path.rsplit('/', 1)[-1]}::{rest}"


def is_slow(item: pytest.Item) -> bool:
    name = _name(item)
    return (
        item.get_closest_marker("slow") is not None
        or name.split("::", 1)[0] in SLOW_FILES
        or name in SLOW_TESTS
        or name.split("[", 1)[0] in SLOW_TESTS
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    collected_files = {_name(item).split("::", 1)[0] for item in items}
    names = {_name(item) for item in items} | {_name(item).split("[", 1)[0] for item in items}
    stale = sorted(entry for entry in SLOW_TESTS if entry.split("::", 1)[0] in collected_files and entry not in names)
    if stale:
        warnings.warn(f"tests/quick_lane.py names tests that no longer exist: {stale}", pytest.PytestWarning,
                      stacklevel=1)
    if not config.getoption("--quick"):
        return
    slow = [item for item in items if is_slow(item)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not is_slow(item)]
