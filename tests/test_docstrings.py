"""The examples in the modules' docstrings run and print what they say (from the repository root)."""

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULES = [
    "actviz._internals",
    "actviz.api",
    "actviz.batch_summaries",
    "actviz.capture",
    "actviz.cli",
    "actviz.compiled",
    "actviz.delivery",
    "actviz.gradcam",
    "actviz.probe",
    "actviz.hooks",
    "actviz.fused",
    "actviz.layer_outputs",
    "actviz.open_watchers",
    "actviz.options",
    "actviz.png",
    "actviz.report",
    "actviz.report.capture",
    "actviz.report.errors",
    "actviz.report.html",
    "actviz.report.images",
    "actviz.report.models",
    "actviz.report.results",
    "actviz.reduction",
    "actviz.rendering",
    "actviz.run_folders",
    "actviz.schedule",
    "actviz.selection",
    "actviz.silences",
    "actviz.sinks",
    "actviz.summaries",
    "actviz.watcher",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # the report's examples read tests/data/chelsea.jpg
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
