"""The README's Python examples run as written (so the documentation cannot rot)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# A block whose first line starts with SKIP says why it is not run here (a standalone
# multi-process script, which tests/test_distributed.py runs as a script; code that needs an
# inference engine).
SKIP = "# not run here:"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
EXAMPLES = [block for block in BLOCKS if not block.startswith(SKIP)]


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, capsys):
    exec(compile(EXAMPLES[index], f"README.md example {index}", "exec"), {})


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2
