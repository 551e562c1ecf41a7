"""The Triton kernels' draws and cuts on their boundaries (interpreted on CPU), exact outputs.

The kernels draw their uniforms from Philox counters inside the kernel, not from a source
object, so the boundaries are reached two ways. Where a kernel takes uniforms as a tensor
(unseeded verification and vocabulary-parallel rounds), it gets chosen ones: ``u = 0``, ``u``
exactly on a prefix, ``u`` just below 1. Where it does not (``sample_from_probs``' inverse CDF),
the rows are made of subnormal float64 weights, on which ordinary seeded uniforms land exactly
on prefix sums or on the total, and each token is checked against the documented pick for its
own uniform (the torch path's Philox, bit for bit the kernel's). The cuts need no randomness:
``process`` on the controls kernel and the in-kernel radix selection get ``top_p`` equal to a
cumulative mass, ``min_p`` equal to a weight and ties at the k-th weight (dyadic rows), as the
torch path does in ``tests/ops/test_cut_boundaries.py``. Sizes stay tiny (interpreter).

Mutants these tests were run against (each planted by hand, each caught, then reverted):
``<`` for ``<=`` in the block count and in the in-block count of ``kernels/inverse_cdf``'s
draw stage and its ``nextafter`` clamp dropped (by ``test_inverse_cdf_kernel_on_subnormal_rows``
and ``test_inverse_cdf_kernel_several_draws_match_the_torch_path``); ``>`` for ``>=`` in
``kernels/select.radix_threshold`` (by ``test_kernel_thresholds_on_exact_boundaries``,
``test_controls_kernel_cuts`` and ``test_issue_example_on_the_controls_kernel``); the controls
kernel keeping ``w / cut > 1`` (by ``test_controls_kernel_cuts``); the slot count, the in-slot
count and the ``nextafter`` clamp of ``kernels/shard``'s draw (by
``test_shard_round_on_slot_boundaries``); ``>`` for ``>=`` in ``kernels/shard_cuts``' candidate
top-p and radix rounds (by ``test_shard_round_cuts``); the block count, the in-block count and
the ``nextafter`` clamp of ``kernels/verify_draw``'s final draw (by
``test_verify_chain_kernel_boundaries``).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import fastsample as fs
from boundary_rows import (
    CHAIN_BLOCK_ROWS,
    CHAIN_WITH_DRAFT,
    CHAIN_WITHOUT_DRAFT,
    LEADING_ZERO_BLOCKS,
    ROW,
    SUBNORMAL_ROWS,
    ZERO_BLOCK_BETWEEN,
    chain_batch,
    chain_block_batch,
    check_seeded_race,
    check_seeded_subnormal_draws,
    expected_subnormal,
)
from fastsample.kernels import select as kernel_select
from fastsample.kernels.philox import INTERPRETED
from fastsample.verify import chain
from thread_group import sample_sharded
from uniforms import BELOW_ONE, first_above, on_prefix

pytestmark = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors need the interpreter (TRITON_INTERPRET=1)"
)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "triton")


def test_inverse_cdf_kernel_on_subnormal_rows():
    """One launch of the blocked inverse CDF: block sums, block and in-block choice, with the
    seeded uniforms on prefixes and on one-unit totals (kept below them)."""
    check_seeded_subnormal_draws(
        lambda probs, seed: fs.sample_from_probs(probs, seed=seed, method="inverse_cdf"),
        seeds=12,
    )


def test_inverse_cdf_kernel_several_draws_match_the_torch_path(monkeypatch):
    """Three draws without replacement on subnormal rows (every draw on a boundary): the
    kernel's tokens and validity are the torch path's."""
    seed = torch.arange(6, dtype=torch.int64) * 104729 + 3
    for row in SUBNORMAL_ROWS[::2]:
        probs = torch.tensor([row] * 6, dtype=torch.float64)
        ours = fs.sample_from_probs(probs, 3, seed=seed, method="inverse_cdf")
        monkeypatch.setenv("FASTSAMPLE_BACKEND", "torch")
        want = fs.sample_from_probs(probs, 3, seed=seed, method="inverse_cdf")
        monkeypatch.setenv("FASTSAMPLE_BACKEND", "triton")
        assert torch.equal(ours.token_ids, want.token_ids)
        assert torch.equal(ours.valid, want.valid)


def test_race_kernel_on_float64_rows_at_the_ends_of_their_range():
    """The race kernel scales float64 rows by a power of two as the torch path does: on
    subnormal rows no score underflows (no zero-weight token, every row valid), near the
    float64 maximum none overflows; the draws are the exact race order of the ENTRY noise."""

    def race(probs, seed, num):
        out = fs.sample_from_probs(probs, num, seed=seed, method="race")
        sample_p, sample_index = fs.fast_sample(probs, num, seed=seed)
        assert torch.equal(sample_index, out.token_ids) and bool((sample_p > 0).all())
        return out.token_ids, out.valid

    check_seeded_race(race, seeds=8)


def test_kernel_thresholds_on_exact_boundaries():
    """The in-kernel radix selection: a count, a mass or a share equal to what the entries
    from the top hold gives the entry where that amount is first reached (ties included)."""
    cases = {
        "count": {1: 1.0, 2: 0.5, 3: 0.25, 4: 0.25, 5: 0.0},
        "mass": {1.0: 1.0, 1.5: 0.5, 1.75: 0.25, 2.0: 0.25},
        "share": {0.5: 1.0, 0.75: 0.5, 0.875: 0.25, 1.0: 0.25},
    }
    for dtype in (torch.float32, torch.float64):
        for by, table in cases.items():
            values = torch.tensor([[0.25, 1.0, 0.0, 0.25, 0.5, 0.0]] * len(table), dtype=dtype)
            target = torch.tensor([float(t) for t in table], dtype=torch.float64)
            got = kernel_select.descending_threshold(values, target, by)
            assert got.tolist() == list(table.values()), (dtype, by)


P = [0.5, 0.25, 0.125, 0.125]
Q = [0.5, 0.25, 0.25, 0.125, 0.125]
# (row, controls, kept ids): the torch path's boundary cases, on the controls kernel.
CONTROLS_CASES = [
    (P, dict(top_p=0.5), [0]),
    (P, dict(top_p=0.75), [0, 1]),
    (P, dict(top_p=0.875), [0, 1, 2, 3]),
    (P, dict(top_k=3, top_p=0.5), [0]),  # the issue's example
    (Q, dict(top_k=2, top_p=0.5), [0]),
    (Q, dict(top_k=3, top_p=0.75), [0, 1, 2]),
    (P, dict(top_k=3), [0, 1, 2, 3]),
    (P, dict(top_k=2), [0, 1]),
    (P, dict(min_p=0.5), [0, 1]),
    (P, dict(min_p=0.25), [0, 1, 2, 3]),
    (P, dict(top_k=3, min_p=0.5), [0, 1]),
]


def expected(p: list[float], kept: list[int]) -> torch.Tensor:
    w = torch.tensor([p[j] if j in kept else 0.0 for j in range(len(p))])
    return (w / w.sum())[None, :]


@pytest.mark.parametrize("tensors", [False, True])
@pytest.mark.parametrize("logits", [False, True])
def test_controls_kernel_cuts(logits, tensors):
    for p, controls, kept in CONTROLS_CASES:
        x = torch.tensor([p])
        if tensors:
            controls = {
                k: torch.tensor([v], dtype=torch.int64 if k == "top_k" else torch.float32)
                for k, v in controls.items()
            }
        got = fs.process(x.log(), **controls) if logits else fs.process(probs=x, **controls)
        assert torch.equal(got, expected(p, kept)), (p, controls)


def test_issue_example_on_the_controls_kernel():
    got = fs.process(torch.tensor([0.5, 0.25, 0.125, 0.125]).log()[None], top_k=3, top_p=0.5)
    assert got.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_shard_round_on_slot_boundaries():
    """The vocabulary-parallel round's draw kernel (one rank, unseeded: it reads the chosen
    uniforms): u = 0, u on each slot or entry prefix, u just below 1."""
    for row in (ROW, LEADING_ZERO_BLOCKS, ZERO_BLOCK_BETWEEN):
        positive = [j for j, w in enumerate(row) if w > 0]
        us = [0.0, *(on_prefix(row, j) for j in positive[:-1]), BELOW_ONE]
        x = torch.tensor([row] * len(us), dtype=torch.float64)
        out = sample_sharded(x, [(0, len(row))], [[u] for u in us])
        assert out.token_ids[:, 0].tolist() == [first_above(row, u) for u in us]
    us = [i / 8 for i in range(8)] + [BELOW_ONE]
    for row in SUBNORMAL_ROWS[1:]:
        x = torch.tensor([row] * len(us), dtype=torch.float64)
        out = sample_sharded(x, [(0, len(row))], [[u] for u in us])
        assert out.token_ids[:, 0].tolist() == [expected_subnormal(row, u) for u in us]


@pytest.mark.parametrize(
    ("controls", "kept"),
    [
        (dict(top_k=3, top_p=0.5), [10]),  # candidates and their top-p (shard_cuts)
        (dict(top_k=3, top_p=0.75), [10, 310]),
        (dict(top_p=0.75), [10, 310]),  # radix rounds
        (dict(top_k=3), [10, 310, 520, 599]),
        (dict(min_p=0.5), [10, 310]),
    ],
)
def test_shard_round_cuts(controls, kept):
    ids = [10, 310, 520, 599]
    weights = dict(zip(ids, [1.0, 0.5, 0.25, 0.25], strict=True))
    x = torch.full((2, 600), -math.inf)
    x[:, ids] = torch.tensor(P).log()
    out = sample_sharded(x, [(0, 600)], [[0.0], [BELOW_ONE]], logits=True, **controls)
    assert out.token_ids[:, 0].tolist() == [kept[0], kept[-1]]
    mass = sum(weights[j] for j in kept)
    want = torch.tensor([weights[kept[0]], weights[kept[-1]]]) / mass
    assert torch.equal(out.probs[:, 0], want.float())


@pytest.mark.parametrize("case", ["with draft", "without draft", "blocks", "subnormal"])
def test_verify_chain_kernel_boundaries(monkeypatch, case):
    """The chain kernel with the chosen acceptance, recovery and bonus uniforms (unseeded
    calls hand the kernel their uniforms): the torch path's boundary cases, same tokens."""
    if case in ("blocks", "subnormal"):
        p, x, q, uniforms, emitted = chain_block_batch(*CHAIN_BLOCK_ROWS[case == "subnormal"])
    else:
        with_draft = case == "with draft"
        cases = CHAIN_WITH_DRAFT if with_draft else CHAIN_WITHOUT_DRAFT
        p, x, q, uniforms, emitted = chain_batch(cases, with_draft)
    monkeypatch.setattr(chain, "uniforms", lambda *args: uniforms)
    out = fs.verify_chain(p, x, q, generator=torch.Generator())
    assert out.token_ids.tolist() == emitted.tolist()
    assert out.valid.all()
