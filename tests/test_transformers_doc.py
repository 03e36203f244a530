"""docs/transformers.md's code runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "transformers.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_the_doc_has_its_three_examples():
    assert len(BLOCKS) == 3


@pytest.mark.parametrize("block", BLOCKS, ids=["gpt2", "vit", "fp8"])
def test_each_block_runs(block):
    exec(compile(block, str(DOC), "exec"), {})
