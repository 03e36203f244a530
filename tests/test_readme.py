"""The README's options table is ``actviz.watch``'s signature: every argument, once, with its default.

The README's code blocks are run by tests/test_docs.py, with every other page's.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import actviz
import actviz.statistics

README = Path(__file__).resolve().parents[1] / "README.md"


def options_table(text: str) -> dict[str, str]:
    """``argument -> default cell`` of the table in the README's "## Options" section."""
    section = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table: dict[str, str] = {}
    for row in rows:
        name, default = (cell.strip() for cell in row.strip("|").split("|")[:2])
        name = name.strip("`")
        assert name not in table, f"the README's options table lists {name!r} twice"
        table[name] = default
    return table


def documented_default(value: object) -> str:
    """How the table writes a default: ``required``, or the Python literal in backticks (double quotes)."""
    if value is inspect.Parameter.empty:
        return "required"
    return f"`{value!r}`".replace("'", '"')


def test_the_options_table_lists_every_argument_of_watch_and_no_other() -> None:
    table = options_table(README.read_text())
    parameters = inspect.signature(actviz.watch).parameters
    missing = [name for name in parameters if name not in table]
    unknown = [name for name in table if name not in parameters]
    assert not missing and not unknown, (
        f"README.md's options table: add a row for {missing}, remove the rows for {unknown} (not in actviz.watch)"
    )
    assert list(table) == list(parameters), "list the options in the order watch() takes them"


def test_the_options_table_gives_each_default_as_watch_has_it() -> None:
    table = options_table(README.read_text())
    wrong = {
        name: (table[name], documented_default(parameter.default))
        for name, parameter in inspect.signature(actviz.watch).parameters.items()
        if name in table and table[name] != documented_default(parameter.default)
    }
    assert not wrong, f"README.md's options table, (written, actual) defaults: {wrong}"


def test_the_table_reader_sees_a_wrong_table() -> None:
    text = "# t\n\n## Options\n\n| argument | default | meaning |\n|---|---|---|\n| `every` | `100` | x |\n| `bogus` | `1` | y |\n"
    assert options_table(text) == {"every": "`100`", "bogus": "`1`"}
    assert documented_default("first") == '`"first"`' and documented_default(16384) == "`16384`"
    assert documented_default(inspect.Parameter.empty) == "required"


def _section_table(heading: str) -> dict[str, str]:
    """``first cell -> second cell`` of the first table under ``heading`` of the README."""
    section = README.read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {row.strip("|").split("|")[0].strip().strip("`"): row.strip("|").split("|")[1].strip() for row in rows}


def test_the_options_object_table_is_actviz_options_with_its_defaults() -> None:
    table = _section_table("## actviz.Options")
    fields = dataclasses.fields(actviz.Options)
    assert list(table) == [field.name for field in fields], "list actviz.Options' fields in its order"
    assert {name: documented_default(field.default) for name, field in zip(table, fields)} == table


def test_the_statistics_table_names_every_name_statistics_takes() -> None:
    table = _section_table("## Statistics")
    assert sorted(name.strip('"') for name in table) == sorted(actviz.statistics.NAMES)
