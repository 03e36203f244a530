"""Every public module under actviz/ has a docstring example, and every example runs and prints what it says.

Modules are found by walking the package, so a new module is checked without a change here.
A module is public unless its own name starts with an underscore (``_version``, ``__main__``);
``actviz.common._internals`` is private but its examples run all the same. The examples run from the
repository root: the report's read ``tests/data/chelsea.jpg``.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import actviz

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["actviz", *sorted(info.name for info in pkgutil.walk_packages(actviz.__path__, "actviz."))]


def is_public(name: str) -> bool:
    return not name.rsplit(".", 1)[-1].startswith("_")


def examples(module: object) -> list[doctest.DocTest]:
    return [test for test in doctest.DocTestFinder().find(module) if test.examples]


def test_every_module_is_found() -> None:
    files = {path for path in (ROOT / "actviz").rglob("*.py")}
    assert len(MODULES) == len(files), "a module pkgutil does not see: a folder without __init__.py?"
    assert {"actviz.common.results", "actviz.report.html", "actviz.integrations.lightning"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    module = importlib.import_module(name)
    found = examples(module)
    if is_public(name):
        assert found, f"{name} is a public module without a docstring example: add a short runnable one"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in found:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
