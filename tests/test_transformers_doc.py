"""docs/transformers.md's code runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "transformers.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_the_doc_has_its_two_examples():
    assert len(BLOCKS) == 2


@pytest.mark.parametrize("block", BLOCKS, ids=["gpt2", "vit"])
def test_each_block_runs(block):
    exec(compile(block, str(DOC), "exec"), {})
