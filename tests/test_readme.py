"""The README's Python examples run as written (so the documentation cannot rot)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, capsys):
    exec(compile(EXAMPLES[index], f"README.md example {index}", "exec"), {})


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2
