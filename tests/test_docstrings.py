"""The examples in the core modules' docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = [
    "actviz._internals",
    "actviz.api",
    "actviz.batch_summaries",
    "actviz.capture",
    "actviz.layer_outputs",
    "actviz.options",
    "actviz.png",
    "actviz.rendering",
    "actviz.schedule",
    "actviz.selection",
    "actviz.sinks",
    "actviz.summaries",
    "actviz.watcher",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
