"""The llama.cpp-style stages against llama.cpp's own samplers (llama-cpp-python's ctypes API),
a few rows each: the comparisons of ``scripts/compare_llama_cpp.py`` (imported from there),
which runs thousands of rows and documents the setup. Skipped where ``llama_cpp`` does not
import (``.ci/run`` builds it; the script says how to elsewhere).

Run with a venv that has llama-cpp-python 0.3.36::

    PYTHONPATH=src:tests /path/to/llama-venv/bin/python -m pytest -q \\
        tests/stages/test_llama_cpp_peers.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed (scripts/compare_llama_cpp.py says how)",
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_llama_cpp.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("compare_llama_cpp", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cmp = _load_script()


def _explain(outcomes) -> str:
    return "\n".join(f"{o.inputs}\n{o.detail}" for o in outcomes)


@pytest.mark.parametrize("stage", cmp.STAGES)
def test_random_rows_agree(stage):
    """Small random rows (V in [20, 200]): no disagreement beyond the known boundary cases
    (ties, a threshold within float rounding), and most rows agree outright."""
    count = 3 if stage == "mirostat_v2" else 25  # mirostat: 8 steps per row
    outcomes = list(cmp.rows_for(stage, count, seed=1, small=True))
    failed = [o for o in outcomes if o.status == "fail"]
    assert not failed, _explain(failed)
    agree = sum(o.status == "agree" for o in outcomes)
    assert agree >= 0.7 * len(outcomes), _explain(o for o in outcomes if o.status != "agree")


@pytest.mark.parametrize("stage", cmp.STAGES)
def test_llama_cpp_test_cases(stage):
    """llama.cpp's own test-sampling inputs (and the penalty window's edges) agree; the
    uniform typical row, where the mass hits p exactly, is a boundary row. DRY's exponent cap
    rows are below."""
    outcomes = [o for o in cmp.fixed_rows(stage) if "exponent cap" not in o.inputs]
    assert outcomes
    for o in outcomes:
        expected = "boundary" if "mass hits p" in o.inputs else "agree"
        assert o.status == expected, _explain([o])


def test_ties_are_boundary_rows():
    """Two tokens tied as the least likely above XTC's threshold: llama.cpp removes one of
    them, fastsample keeps both (nothing removed): a tie, not a failure."""
    logits = np.log(np.array([0.3, 0.3, 0.2, 0.2])).astype(np.float32)
    outcome = cmp.compare_xtc(logits, 0.25, 3, "tie")
    assert outcome.status == "boundary", _explain([outcome])
    assert "tie:" in outcome.detail


def _cap_row(base: float, multiplier: float):
    rng = np.random.default_rng(12345)
    logits = (rng.standard_normal(50) * 2).astype(np.float32)
    # 200 tokens of "5 6": token 5 would extend a repeat of 198 (exponent 196, capped).
    return cmp.compare_dry(logits, [5, 6] * 100, multiplier, base, 2, 256, "cap")


@pytest.mark.parametrize("base", [1.75, 3.0, 8.0])
def test_dry_exponent_cap_agrees(base):
    outcome = _cap_row(base, 0.25)
    assert outcome.status == "agree", _explain([outcome])


@pytest.mark.parametrize("base", [2.0, 4.0, 16.0])
def test_dry_exponent_cap_at_powers_of_two(base):
    """llama.cpp's cap is computed in float (128 at base 2: base**cap overflows to inf, so a
    multiplier >= 1 sends the token to -inf); fastsample computes it the same way."""
    outcome = _cap_row(base, 0.25)
    assert outcome.status == "agree", _explain([outcome])
