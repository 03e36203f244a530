"""The examples in the core modules' docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = [
    "actviz.api",
    "actviz.batch_summaries",
    "actviz.capture",
    "actviz.fused",
    "actviz.layer_outputs",
    "actviz.options",
    "actviz.png",
    "actviz.rendering",
    "actviz.schedule",
    "actviz.selection",
    "actviz.summaries",
    "actviz.watcher",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
