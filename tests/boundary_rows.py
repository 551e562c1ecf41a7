"""Rows whose draws and cuts sit exactly on their boundaries, shared by the boundary tests of
the torch ops, the kernels, verification and vocabulary-parallel sampling.

Dyadic weights make ``u * total`` land exactly on a prefix sum for a chosen ``u``
(:func:`uniforms.on_prefix`). Subnormal float64 weights (whole units of ``2**-1074``) make
``u * total`` round to a whole number of units, so ordinary (seeded) uniforms land on a prefix
or, for a one-unit total and ``u > 1/2``, on the total itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from fractions import Fraction

import torch

from fastsample.ops.inverse_cdf import BLOCK
from fastsample.ops.noise import exponential_from_uniform
from fastsample.ops.seeds import make_source
from uniforms import TINY, first_above, subnormal_target


def sparse(vocab: int, entries: dict[int, float]) -> list[float]:
    """A row of ``vocab`` zeros with the given entries."""
    row = [0.0] * vocab
    for j, w in entries.items():
        row[j] = w
    return row


# One block: zero neighbours on both sides of every positive weight, leading and trailing zeros.
ROW = [0.0, 0.0, 0.5, 0.0, 0.0, 0.25, 0.0, 0.25, 0.0, 0.0]
# Four blocks, the last one short (V = 808): zero blocks before the first positive one,
# leading zeros inside it, a positive block whose prefix is crossed exactly, trailing zeros.
LEADING_ZERO_BLOCKS = sparse(3 * BLOCK + 40, {515: 0.25, 521: 0.25, 770: 0.5})
# A zero block between two positive ones, and a trailing zero block (V = 1024).
ZERO_BLOCK_BETWEEN = sparse(4 * BLOCK, {255: 0.5, 512: 0.5})


def units_row(vocab: int, units: dict[int, int]) -> list[float]:
    """A float64 row of subnormal weights: ``units[j] * 2**-1074`` at ``j``."""
    return sparse(vocab, {j: m * TINY for j, m in units.items()})


SUBNORMAL_ROWS = [
    units_row(10, {1: 1, 4: 1, 7: 2}),
    units_row(3 * BLOCK - 88, {3: 1}),  # one unit, then two zero blocks
    units_row(3 * BLOCK - 88, {3: 1, 300: 1, 520: 1, 521: 1}),
]


def expected_subnormal(row: list[float], u: float) -> int:
    """The documented pick on a subnormal row: the first entry whose prefix, in units of
    ``2**-1074``, exceeds the rounded target (kept one unit below the total)."""
    units = [round(w / TINY) for w in row]
    target = subnormal_target(units, u)
    return next(j for j, c in enumerate(itertools.accumulate(units)) if c > target)


def check_seeded_subnormal_draws(sampler: Callable, seeds: int = 24) -> None:
    """``sampler(probs, seed)`` (one draw, ``seed`` a ``(B,)`` tensor) on each subnormal row:
    every token is the documented pick for its row's DRAW uniform (purpose DRAW, position 0 of
    ``(seed, step 0, stream 0)``), and the seeds put some target exactly on a prefix and some
    ``u * total`` on the total."""
    on_prefix = on_total = 0
    seed = torch.arange(seeds, dtype=torch.int64) * 7919 + 17
    for row in SUBNORMAL_ROWS:
        probs = torch.tensor([row] * seeds, dtype=torch.float64)
        u = make_source(None, seed, None, 0, seeds, probs.device).row_uniforms(1)[:, 0].tolist()
        out = sampler(probs, seed)
        assert out.token_ids[:, 0].tolist() == [expected_subnormal(row, x) for x in u]
        assert bool(out.valid.all())
        units = [round(w / TINY) for w in row]
        prefixes = set(itertools.accumulate(units))
        on_prefix += sum(subnormal_target(units, x) in prefixes for x in u)
        on_total += sum(x * sum(units) * TINY >= sum(units) * TINY for x in u)
    assert on_prefix > 0 and on_total > 0, (on_prefix, on_total)


# ---------------------------------------------------------------------------- verification

# Chain verification, one draft (K = 1), V = 6; each batch row is one case. Target at the
# draft position P0, at the bonus position P1; draft Q0. The residual max(P0 - Q0, 0) is
# [0, .25, 0, 0, .25, 0]: zero where p == 0, p < q (token 2) and p == q (token 3).
P0 = [0.0, 0.25, 0.25, 0.25, 0.25, 0.0]
P1 = [0.0, 0.0, 0.5, 0.0, 0.5, 0.0]
Q0 = [0.25, 0.0, 0.5, 0.25, 0.0, 0.0]
JUST_BELOW_HALF = 0.5 - 2.0**-54  # the largest uniform below 1/2
# (draft token, (accept, recovery, bonus) uniforms, emitted tokens) with draft probabilities:
# accept iff u * q(x) < p(x) (strict); for token 2, p/q = 1/2, so u = 1/2 sits on the boundary.
CHAIN_WITH_DRAFT = [
    (2, (0.5, 0.0, 0.0), [1, -1]),  # rejected on the boundary; residual at u = 0
    (2, (0.5, 0.5, 0.0), [4, -1]),  # the residual's prefix .25 crossed exactly: next positive
    (2, (0.5, 1.0 - 2.0**-53, 0.0), [4, -1]),  # never the trailing zero
    (2, (JUST_BELOW_HALF, 0.0, 0.0), [2, 2]),  # accepted; the bonus at u = 0
    (2, (0.0, 0.0, 0.5), [2, 4]),  # the bonus on P1's prefix .5
    (2, (0.0, 0.0, 1.0 - 2.0**-53), [2, 4]),
    (0, (0.0, 0.0, 0.0), [1, -1]),  # p(x) = 0: u = 0 does not accept it
    (5, (0.0, 0.5, 0.0), [4, -1]),  # p(x) = q(x) = 0: rejected too
]
# Without draft probabilities (a point-mass draft): accept iff u < p(x); the rejected token is
# removed from P0 for the recovery draw.
CHAIN_WITHOUT_DRAFT = [
    (1, (0.25, 0.0, 0.0), [2, -1]),  # rejected on the boundary; 1 removed, zeros skipped
    (1, (0.25, 1.0 - 2.0**-53, 0.0), [4, -1]),
    (1, (0.25 - 2.0**-55, 0.0, 0.0), [1, 2]),  # just below: accepted
    (0, (0.0, 0.0, 0.0), [1, -1]),  # p(x) = 0: never accepted
]


def chain_batch(cases: list, with_draft: bool) -> tuple:
    """``(target (B, 2, V), drafts (B, 1), draft_probs (B, 1, V) or None, uniforms, emitted)``
    for a list of chain cases; ``uniforms`` are the ``(accept, recovery, bonus)`` columns."""
    batch = len(cases)
    p = torch.tensor([P0, P1], dtype=torch.float64).expand(batch, 2, 6).contiguous()
    q = torch.tensor([Q0], dtype=torch.float64).expand(batch, 1, 6).contiguous()
    x = torch.tensor([[c[0]] for c in cases])
    u = torch.tensor([c[1] for c in cases], dtype=torch.float64)
    uniforms = (u[:, :1].contiguous(), u[:, 1:2].contiguous(), u[:, 2:3].contiguous())
    emitted = torch.tensor([c[2] for c in cases])
    return p, x, q if with_draft else None, uniforms, emitted


def chain_block_batch(row: list[float], us: list[float]) -> tuple:
    """Chain verification whose final draw is an inverse CDF over ``row`` (float64, any
    length): the draft is token 0 with probability 0 there (always rejected, and removed), and
    ``us`` are the recovery uniforms. Same tuple as :func:`chain_batch`; the emitted token is
    the documented pick for each uniform (:func:`uniforms.first_above`)."""
    assert row[0] == 0
    batch, vocab = len(us), len(row)
    p = torch.tensor([row, row], dtype=torch.float64).expand(batch, 2, vocab).contiguous()
    x = torch.zeros(batch, 1, dtype=torch.int64)
    zeros = torch.zeros(batch, 1, dtype=torch.float64)
    recovery = torch.tensor(us, dtype=torch.float64)[:, None]
    emitted = torch.tensor([[first_above(row, u), -1] for u in us])
    return p, x, None, (zeros, recovery, zeros.clone()), emitted


# The final draw across blocks: a zero block between two positive ones (u = 1/2 on their
# prefix), and a one-unit subnormal total (u > 1/2 reaches it) followed by two zero blocks.
CHAIN_BLOCK_ROWS = [
    (sparse(600, {255: 0.5, 512: 0.5}), [0.0, 0.5, 1.0 - 2.0**-53]),
    (units_row(3 * BLOCK - 88, {3: 1}), [0.0, 0.5, 0.75, 1.0 - 2.0**-53]),
]


# ---------------------------------------------------------------------------- the race

# float64 rows at the ends of float64's range: unscaled, the race's scores p / E underflow to 0
# on subnormal weights and overflow to inf near the float64 maximum, and a weight far below
# the row's largest scores 0 (its later draw would not be genuine).
RACE_EXTREME_ROWS = [
    units_row(8, {1: 1, 3: 1, 6: 3}),
    sparse(8, {0: 6e307, 2: 6e307, 5: 3e307}),  # total 1.5e308: finite
    sparse(8, {1: 1.0, 6: TINY}),
    sparse(8, {0: 1e308, 4: 1e-310}),
]


def race_order(row: list[float], noise: list[float], num: int) -> list[int]:
    """The race's first ``num`` draws by exact rational comparison of ``p_i / E_i`` (largest
    first, ties to the lower index), positive weights only."""
    pairs = enumerate(zip(row, noise, strict=True))
    scores = [(Fraction(p) / Fraction(e), -i) for i, (p, e) in pairs if p > 0]
    return [-i for _, i in sorted(scores, reverse=True)[:num]]


def check_seeded_race(sampler: Callable, seeds: int = 16, num: int = 2) -> None:
    """``sampler(probs, seed, num)`` -> ``(ids (B, num), valid (B,))`` on RACE_EXTREME_ROWS:
    every row is valid and its draws are the exact race order for its ENTRY noise."""
    seed = torch.arange(seeds, dtype=torch.int64) * 7919 + 5
    for row in RACE_EXTREME_ROWS:
        probs = torch.tensor([row] * seeds, dtype=torch.float64)
        source = make_source(None, seed, None, 0, seeds, probs.device)
        noise = exponential_from_uniform(source.entry_uniforms(0, len(row))).tolist()
        ids, valid = sampler(probs, seed, num)
        assert bool(valid.all())
        assert ids.tolist() == [race_order(row, e, num) for e in noise]
