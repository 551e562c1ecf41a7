"""The statistical battery on the Triton kernels (Triton's interpreter on CPU), at small sizes.

Families, for the race and the blocked inverse CDF: the single-draw law (a row spanning two
blocks, the second short, with exact zeros), the joint law of two ordered draws without
replacement (Plackett-Luce), and a tail token alone in the short last block behind a dominant
block. Each family has a negative control: the same test, at the same size, rejects draws from
a law biased by 2% of the mass (single, joint) or with the tail token twice as likely, and a
sampler that never draws the tail. False-alarm rate 1e-6 per test (tests/stattests.py).

The far tail (a token 1e-9 as likely as the top one) needs ~1e10 draws, beyond the interpreter:
the kernels' uniforms are the torch path's bit for bit and their prefixes are the same float64
sums (test_triton_philox.py, test_triton_probs.py), and the torch path's far-tail tests cover
the rest.

**Power.** The interpreter affords laws of 12k-60k draws here, detecting 15-43% biases on 10%
of the mass (``law_cases``), not the 2% target. The target is carried by the torch path's law
tests at full power and by equality checks: with the torch path's counters the kernels draw the
torch path's tokens on random rows. :func:`stattests.equality_bias` computes what such a check
detects, and
``test_equality_checks_carry_the_target`` holds every Triton module's checks to the target.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import fastsample as fs
from stattests import (
    LawCase,
    assert_law,
    equality_bias,
    law_rejected,
    plackett_luce,
    poisson_bounds,
    target_bias,
)

METHODS = ["inverse_cdf", "race"]
SINGLE_DRAWS = 12_000  # V=300 runs at ~2-3k rows/s in the interpreter on a loaded 2-core box
JOINT_DRAWS = 60_000  # V=6 runs at ~20-40k rows/s
JOINT_ROW = [0.05, 0.4, 0.0, 0.2, 0.15, 0.2]  # includes an exact zero


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "triton")


def two_block_row() -> torch.Tensor:
    """V=300 (a full block and a short one): peaked weights, a third of them exact zeros."""
    gen = torch.Generator().manual_seed(300)
    row = torch.softmax(torch.randn(300, generator=gen, dtype=torch.float64) * 2, 0)
    row[torch.rand(300, generator=gen) < 0.33] = 0
    row[0] = row[299] = 0.0
    return row


def single_counts(row: torch.Tensor, method: str, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    out = fs.sample_from_probs(row.expand(SINGLE_DRAWS, -1), method=method, generator=gen)
    assert bool(out.valid.all())
    return np.bincount(out.token_ids[:, 0].numpy(), minlength=row.shape[0])


@pytest.mark.parametrize("method", METHODS)
def test_single_draw_law(method):
    row = two_block_row()
    counts = single_counts(row.float(), method, seed=1)
    assert_law(counts, row.float().double().numpy(), what=f"triton {method} V=300")


def test_single_draw_law_rejects_biased_sampler():
    """Negative control: 2% of the mass moved onto the least likely token is caught."""
    row = two_block_row()
    exact = (row / row.sum()).numpy()
    biased = row / row.sum() * 0.98
    positive = torch.where(row > 0, row, torch.inf)
    biased[int(positive.argmin())] += 0.02
    assert law_rejected(single_counts(biased.float(), "inverse_cdf", seed=2), exact)


def joint_counts(draw, n: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Counts of every ordered pair of distinct tokens of JOINT_ROW from ``draw(batch, n)``."""
    vocab = len(JOINT_ROW)
    tuples = np.array(list(itertools.permutations(range(vocab), n)))
    ids = draw(torch.tensor(JOINT_ROW, dtype=torch.float32).expand(JOINT_DRAWS, -1), n).numpy()
    assert (ids[:, 0] != ids[:, 1]).all(), "drew a token twice"
    codes = np.bincount(ids[:, 0] * vocab + ids[:, 1], minlength=vocab * vocab)
    return codes[tuples[:, 0] * vocab + tuples[:, 1]], tuples


@pytest.mark.parametrize("method", METHODS)
def test_joint_law_of_two_draws(method):
    keys = torch.arange(JOINT_DRAWS) * 7919 + (1 if method == "race" else 2)

    def draw(batch, n):  # per-row seeds: the counter-based path
        out = fs.sample_from_probs(batch, n, method=method, seed=keys, step=3)
        assert bool(out.valid.all())
        return out.token_ids

    counts, tuples = joint_counts(draw)
    assert_law(counts, plackett_luce(np.array(JOINT_ROW), tuples), what=f"triton {method} n=2")


def test_joint_law_rejects_biased_second_draw():
    """Negative control: a second draw biased by 2% of the mass is caught."""
    gen = torch.Generator().manual_seed(3)

    def draw(batch, n):
        first = fs.sample_from_probs(batch, 1, generator=gen).token_ids
        rest = batch.scatter(1, first, 0.0)
        rest = rest / rest.sum(-1, keepdim=True) * 0.98
        rest[:, 0] += 0.02 * (first[:, 0] != 0)
        second = fs.sample_from_probs(rest, 1, generator=gen).token_ids
        return torch.cat([first, second], 1)

    counts, tuples = joint_counts(draw)
    assert law_rejected(counts, plackett_luce(np.array(JOINT_ROW), tuples))


TAIL_WEIGHT = 1e-2  # ~119 expected hits in SINGLE_DRAWS


def tail_row(weight: float) -> torch.Tensor:
    """A dominant block (entries 0..255) and one tail token, alone in the short last block."""
    row = torch.zeros(300, dtype=torch.float32)
    row[:256] = 1.0 / 256
    row[299] = weight
    return row


def tail_hits(method: str, weight: float, seed: int) -> int:
    return int(single_counts(tail_row(weight), method, seed)[299])


@pytest.mark.parametrize("method", METHODS)
def test_tail_token(method):
    mean = SINGLE_DRAWS * TAIL_WEIGHT / (1 + TAIL_WEIGHT)
    lo, hi = poisson_bounds(mean)
    hits = tail_hits(method, TAIL_WEIGHT, seed=4)
    assert lo <= hits <= hi, f"{hits} tail draws, expected {mean:.0f} [{lo}, {hi}]"
    assert lo > 0  # negative control: a sampler that never reaches the tail is rejected


def test_tail_token_rejects_doubled_tail():
    """Negative control: the same bounds reject a tail token twice as likely."""
    lo, hi = poisson_bounds(SINGLE_DRAWS * TAIL_WEIGHT / (1 + TAIL_WEIGHT))
    assert not lo <= tail_hits("inverse_cdf", 2 * TAIL_WEIGHT, seed=5) <= hi


# ----------------------------------------------------------------------------- the registry


def carried(checks: list[tuple[int, int]], names: str, torch_law: str) -> str:
    return (
        f"tokens equal to the torch path's with the same counters ({names}: "
        f"{sum(n for n, _ in checks)} random rows, detect {equality_bias(checks):.1%} on 10% "
        f"of the mass); the torch path's law test: {torch_law}; the interpreter affords "
        "no more draws here"
    )


def _probs_checks() -> list[tuple[int, int]]:
    import test_triton_probs as probs

    rows = len(probs.CASES) * probs.SEEDED_ROWS
    return [(rows, probs.allowed_mismatches(rows))]


SAME_AS_TORCH = (
    "tests/kernels/test_triton_probs.py::test_seeded_tokens_match_torch_path, "
    "uniform bits: tests/kernels/test_triton_philox.py::test_uniform_bits_identical_to_torch_path"
)


def _joint_law() -> np.ndarray:
    tuples = np.array(list(itertools.permutations(range(len(JOINT_ROW)), 2)))
    return plackett_luce(np.array(JOINT_ROW), tuples)


def law_cases():
    """The laws judged here, their sizes and claims: ``stattests.detectable_bias`` rounded up
    (tests/test_power.py checks them)."""
    checks = _probs_checks()
    single = two_block_row().float().double().numpy()
    joint = _joint_law()
    for method in METHODS:
        torch_law = f"tests/test_exactness.py::test_single_draw_law ({method})"
        yield LawCase(
            f"single draw {method} V=300", single, SINGLE_DRAWS, 0.43,
            carried(checks, SAME_AS_TORCH, torch_law),
        )  # fmt: skip
        torch_law = f"tests/test_exactness.py::test_joint_law_without_replacement ({method})"
        yield LawCase(
            f"joint n=2 {method}", joint, JOINT_DRAWS, 0.15,
            carried(checks, SAME_AS_TORCH, torch_law),
        )  # fmt: skip


def test_equality_checks_carry_the_target():
    """Each Triton module's equality checks with the torch path detect the target bias of the
    laws they carry (2% on 10% of the mass: every law here has V <= 1,000)."""
    import test_triton_controls
    import test_triton_verify_chain
    import test_triton_verify_tree

    checks = {
        "sample_from_probs": _probs_checks(),
        "sample (draws from the controls kernel)": test_triton_controls.EQUALITY_CHECKS,
        "verify_chain": test_triton_verify_chain.EQUALITY_CHECKS,
        "verify_tree": test_triton_verify_tree.EQUALITY_CHECKS,
    }
    for name, pairs in checks.items():
        bias = equality_bias(pairs)
        assert bias <= target_bias(1000), f"{name}: {pairs} detect only {bias:.2%}"
    # Negative control: the 768 rows per method this check first had detect only 6.7%.
    assert equality_bias([(768, 0)]) > target_bias(1000)


def test_carrying_tests_exist():
    """Every test a Triton law case names as carrying its law (``path::name``, or ``::name``
    in the last path named) is defined in that file."""
    import re

    import test_triton_controls
    import test_triton_verify_chain
    import test_triton_verify_tree

    root = Path(__file__).parents[2]
    for module in (sys.modules[__name__], test_triton_controls, test_triton_verify_chain,
                   test_triton_verify_tree):  # fmt: skip
        for case in module.law_cases():
            named = re.findall(r"(tests/[\w/]+\.py)?::(test_\w+)", case.carried_by)
            # The Triton path's equality checks (tokens, uniforms) and the torch path's test.
            assert len(named) >= 3, case.name
            path = None
            for file, test in named:
                path = file or path
                assert path and f"def {test}(" in (root / path).read_text(), (case.name, test)
