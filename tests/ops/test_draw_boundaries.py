"""The draws on their boundaries, with uniforms we choose: exact token ids, no statistics.

The law tests draw random uniforms, which almost surely never sit on a boundary; these tests
put them there. The documented rule of the blocked inverse CDF: with ``t = min(u * total,
nextafter(total, 0))``, the block is the first ``j`` with ``P_j > t`` and, inside it, the entry
is the first ``i`` with ``c_i > t'``. So ``u = 0`` picks the first positive entry (never a
leading zero, a zero neighbour or a zero block), ``u`` exactly on a prefix sum picks the next
positive entry, and ``u`` just below 1 picks the last positive entry (never a trailing zero).
Dyadic weights make ``u * total == P_j`` exact; subnormal float64 weights (units of
``2**-1074``) make ``u * total`` round onto a prefix, or up to the total, for ordinary
uniforms, which is how the seeded public samplers are driven onto their boundaries.

Covered: ``inverse_cdf_draw`` (block step, in-block step, several draws without
replacement), ``race_draw`` (noise extremes, rows with fewer positive weights than draws,
float64 rows at the ends of their range), and the public ``sample_from_probs``/``sample``
with the source swapped for a controlled one and, on subnormal rows, with seeds.

A bug these tests found, fixed beside them: the race divided float64 weights by the noise
unscaled, so on a row of subnormal weights the scores underflowed to 0 (``fast_sample``
returned a zero-weight token, ``method="race"`` flagged the row invalid: ~1.6% of seeds on two
one-unit weights), a weight far below the row's largest could score 0 (``[1, 2**-1074]`` with
two draws: the second not genuine, the row invalid, whenever its noise exceeds 2, ~13%), and
weights near the float64 maximum overflowed to ``inf`` (ties won by the lower index: a
``[8e307, 8e307]`` row drew token 0 56% of the time).

Mutants these tests were run against (each planted by hand, each caught, then reverted):
``searchsorted(right=False)`` in the in-block step (the issue's; caught by
``test_issue_example_u_zero_draws_no_leading_zero``) and in the block step (by
``test_block_step_boundaries``); the ``nextafter`` clamp of the block target dropped (by
``test_subnormal_rows_keep_the_target_below_the_total`` and the seeded test); the
``u == 0`` clamp of ``exponential_from_uniform`` dropped and ``genuine = score >= 0`` in the
race (by ``test_race_never_draws_zero_weights_at_the_noise_extremes``). Dropping the in-block
``nextafter`` clamp alone is not caught: with the block target kept below the total, the
in-block fraction stays below 1 in float64 (the clamp is a guard, not reachable here).
"""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
from boundary_rows import (
    LEADING_ZERO_BLOCKS,
    RACE_EXTREME_ROWS,
    ROW,
    SUBNORMAL_ROWS,
    ZERO_BLOCK_BETWEEN,
    check_seeded_race,
    check_seeded_subnormal_draws,
    expected_subnormal,
    sparse,
)
from fastsample import sampling
from fastsample.ops import small_top_k
from fastsample.ops.inverse_cdf import BLOCK, inverse_cdf_draw
from fastsample.ops.race import race_draw
from fastsample.ops.validation import check_controls
from fastsample.stages import step as stages_step
from uniforms import BELOW_ONE, ControlledUniforms, first_above, on_prefix

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def draw(rows: list[list[float]], uniforms, n: int = 1, dtype=torch.float64):
    """Token ids and genuine flags of ``inverse_cdf_draw`` with the chosen uniforms."""
    probs = torch.tensor(rows, dtype=torch.float64).to(dtype)
    ids, genuine, _ = inverse_cdf_draw(probs, n, ControlledUniforms(uniforms))
    return ids.tolist(), genuine.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_issue_example_u_zero_draws_no_leading_zero(dtype):
    """The issue's example: p = [0, 0, .5, .5] at u = 0 draws token 2."""
    assert draw([[0.0, 0.0, 0.5, 0.5]], [[0.0]], dtype=dtype)[0] == [[2]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_block_boundaries(dtype):
    """One block: u = 0, u on each prefix (a zero entry's prefix equals its predecessor's),
    u just below 1."""
    cases = {
        0.0: 2,
        on_prefix(ROW, 2): 5,  # t == P_2: the next positive entry, over two zeros
        on_prefix(ROW, 4): 5,  # the same prefix, reached through the zeros
        on_prefix(ROW, 5): 7,
        BELOW_ONE: 7,  # never the trailing zeros
    }
    us = list(cases)
    got, genuine = draw([ROW] * len(us), [[u] for u in us], dtype=dtype)
    assert [g[0] for g in got] == list(cases.values()) == [first_above(ROW, u) for u in us]
    assert all(g[0] for g in genuine)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_step_boundaries(dtype):
    """The block choice: u = 0 skips the zero blocks, u on a block prefix skips a zero block
    to the next positive one (P_0 == P_1 == t), u just below 1 stops at the last positive."""
    cases = [
        (LEADING_ZERO_BLOCKS, 0.0, 515),
        (LEADING_ZERO_BLOCKS, on_prefix(LEADING_ZERO_BLOCKS, 515), 521),  # inside block 2
        (LEADING_ZERO_BLOCKS, on_prefix(LEADING_ZERO_BLOCKS, 600), 770),  # P_2: into block 3
        (LEADING_ZERO_BLOCKS, BELOW_ONE, 770),
        (ZERO_BLOCK_BETWEEN, 0.0, 255),
        (ZERO_BLOCK_BETWEEN, on_prefix(ZERO_BLOCK_BETWEEN, 300), 512),  # P_0 == P_1 == t
        (ZERO_BLOCK_BETWEEN, BELOW_ONE, 512),
    ]
    for row, u, want in cases:
        assert first_above(row, u) == want  # the documented rule, on the exact prefixes
        assert draw([row], [[u]], dtype=dtype)[0] == [[want]], (u, want)


# Uniforms over [0, 1): on the subnormal rows most land on a prefix, those above 1/2 on a
# one-unit total.
GRID = [i / 16 for i in range(16)] + [BELOW_ONE]


def test_subnormal_rows_keep_the_target_below_the_total():
    """u * total rounds onto a prefix (the next positive entry is drawn) or, for a one-unit
    total, up to the total itself (the target is kept below it: never the zero blocks after)."""
    for row in SUBNORMAL_ROWS:
        got, genuine = draw([row] * len(GRID), [[u] for u in GRID])
        want = [expected_subnormal(row, u) for u in GRID]
        assert [g[0] for g in got] == want
        assert all(g[0] for g in genuine)
        assert {row[j] > 0 for j in want} == {True}


@pytest.mark.parametrize("dtype", DTYPES)
def test_several_draws_remove_exactly(dtype):
    """Draws without replacement: a drawn entry (and a block it empties) weighs exactly 0
    afterwards, so u = 0 moves on to the next positive entry, u on the reduced prefix picks
    the entry after it, and a row out of positive weights repeats its last genuine draw."""
    row = [0.0, 0.5, 0.0, 0.25, 0.25, 0.0]
    assert draw([row], [[0.0, 0.0, 0.0]], 3, dtype) == ([[1, 3, 4]], [[True] * 3])
    # After 1 is drawn, t = .5 * .5 lies on the prefix of entry 3: entry 4.
    assert draw([row], [[0.0, 0.5, BELOW_ONE]], 3, dtype)[0] == [[1, 4, 3]]
    blocks = sparse(3 * BLOCK - 88, {10: 0.5, 520: 0.25, 530: 0.25})
    assert draw([blocks], [[0.0, 0.0, 0.0]], 3, dtype)[0] == [[10, 520, 530]]  # block 0 emptied
    assert draw([blocks], [[0.0, 0.5, 0.0]], 3, dtype)[0] == [[10, 530, 520]]
    assert draw([blocks], [[BELOW_ONE] * 3], 3, dtype)[0] == [[530, 520, 10]]
    two = [0.0, 0.5, 0.0, 0.5]
    assert draw([two], [[0.0] * 4], 4, dtype) == ([[1, 3, 3, 3]], [[True, True, False, False]])


def test_race_never_draws_zero_weights_at_the_noise_extremes():
    """Zero weights get the smallest noise (u = 0, E = 2**-54), positive weights the largest
    (u just below 1): the positive weights still win, in order, and a third draw repeats the
    last genuine one. All-zero uniforms too."""
    row = [0.0, 0.5, 0.0, 0.25, 0.0, 0.0]
    worst = [[BELOW_ONE if w > 0 else 0.0 for w in row]]
    for entries in (worst, [[0.0] * len(row)]):
        for dtype in DTYPES:
            probs = torch.tensor([row], dtype=dtype)
            ids, genuine = race_draw(probs, 3, ControlledUniforms(entries=entries))
            assert ids.tolist() == [[1, 3, 3]] and genuine.tolist() == [[True, True, False]]


def test_race_scores_float64_rows_at_the_ends_of_their_range():
    """float64 rows of subnormal weights, and of weights near the float64 maximum: scaled by
    a power of two before the division, the scores neither underflow to 0 (a zero-weight token,
    draws not genuine) nor overflow to inf (ties won by the lower index)."""
    tiny = RACE_EXTREME_ROWS[0]  # units 1, 1, 3 at 1, 3, 6
    # The largest noises (u just below 1) on 1 and 6, slightly less on 3: unscaled, all three
    # scores underflow to 0.
    entries = [[0.0, BELOW_ONE, 0.0, 1 - 2.0**-52, 0.0, 0.0, BELOW_ONE, 0.0]]
    ids, genuine = race_draw(
        torch.tensor([tiny], dtype=torch.float64), 4, ControlledUniforms(entries=entries)
    )
    assert ids.tolist() == [[6, 3, 1, 1]] and genuine.tolist() == [[True, True, True, False]]
    huge = RACE_EXTREME_ROWS[1]  # 6e307 at 0 and 2, 3e307 at 5
    # Noises .288 and .223 make both 6e307 / E overflow unscaled: 2 must still beat 0.
    entries = [[0.25, 0.0, 0.2, 0.0, 0.0, 0.5, 0.0, 0.0]]
    ids, genuine = race_draw(
        torch.tensor([huge], dtype=torch.float64), 3, ControlledUniforms(entries=entries)
    )
    assert ids.tolist() == [[2, 0, 5]] and genuine.tolist() == [[True] * 3]


def test_seeded_race_on_float64_rows_at_the_ends_of_their_range(monkeypatch):
    """The public race samplers with seeds: valid rows, positive weights, the exact order."""
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "torch")

    def race(probs, seed, num):
        out = fs.sample_from_probs(probs, num, seed=seed, method="race")
        sample_p, sample_index = fs.fast_sample(probs, num, seed=seed)
        assert torch.equal(sample_index, out.token_ids) and bool((sample_p > 0).all())
        return out.token_ids, out.valid

    check_seeded_race(race)


@pytest.fixture
def controlled(monkeypatch):
    """Make the public samplers draw from a controlled source: ``controlled(rows, entries)``."""

    def use(rows=None, entries=None) -> ControlledUniforms:
        source = ControlledUniforms(rows, entries)
        monkeypatch.setattr(sampling, "make_source", lambda *args: source)
        monkeypatch.setattr(stages_step, "make_source", lambda *args: source)  # sample()
        return source

    return use


def test_public_samplers_with_a_controlled_source(controlled, monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "torch")
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.5]] * 2)
    controlled([[0.0], [BELOW_ONE]])
    out = fs.sample_from_probs(probs, method="inverse_cdf")
    assert out.token_ids.tolist() == [[2], [3]] and out.probs.tolist() == [[0.5], [0.5]]
    controlled(entries=[[0.0, 0.0, BELOW_ONE, BELOW_ONE]] * 2)
    assert fs.sample_from_probs(probs, 2, method="race").token_ids.tolist() == [[2, 3]] * 2
    # sample: the issue's top-p example keeps token 0 alone, so even u just below 1 draws it.
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    controlled([[BELOW_ONE]])
    out = fs.sample(logits, top_k=3, top_p=0.5)
    assert out.token_ids.tolist() == [[0]] and out.probs.tolist() == [[1.0]]
    # The small-top-k path (logits, Python top_k, V >= 256), -inf neighbours around the kept.
    wide = torch.full((1, 300), -torch.inf)
    wide[0, [40, 41, 290, 299]] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    assert small_top_k.applies(wide, check_controls(None, 3, 0.75, None, 1, 300, wide.device))
    for top_p, u, want in (
        (0.75, 0.0, 40),
        (0.75, BELOW_ONE, 41),  # kept: 40 and 41 (the top-p boundary), never 290 or 299
        (0.875, on_prefix([4, 2, 1, 1], 0), 41),  # all four kept (ties), weights 4, 2, 1, 1
        (0.875, on_prefix([4, 2, 1, 1], 1), 290),
        (0.875, BELOW_ONE, 299),
    ):
        controlled([[u]])
        assert fs.sample(wide, top_k=3, top_p=top_p).token_ids.tolist() == [[want]]


def test_seeded_sampler_on_subnormal_rows(monkeypatch):
    """With seeds (nothing injected): on subnormal rows the seeded uniforms land on the
    boundaries, and every draw is the documented pick for its own uniform."""
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "torch")
    check_seeded_subnormal_draws(
        lambda probs, seeds: fs.sample_from_probs(probs, seed=seeds, method="inverse_cdf")
    )
