"""Vocabulary-parallel draws and cuts on their boundaries, with chosen uniforms.

``distributed.sample`` without seeds draws its uniforms from one source (rank 0's, sent in the
first collective), so a controlled source goes in through the checked call, and the ranks run
as threads over an in-process collective (``tests/thread_group.py``: the same all-gather and
all-reduce results as a process group, no processes). The draw picks a *slot* (grid slots of
256 entries, then one head slot per rank for the entries before its first grid boundary) by
the documented rule, the first slot with ``P_J > t``, then the owner scans it
(``shard.draw_in_slot``). So the boundary cases are those of one process, in slot order:
``u = 0`` draws the first positive weight (never a zero slot, an empty head slot or a zero
neighbour), ``u`` on a prefix the next positive one, ``u`` just below 1 the last one (never the
empty slots after it); subnormal rows reach the total itself. The cuts across shards
(candidates and radix rounds) keep ``>=``, with ``top_p`` equal to a cumulative mass and
``min_p`` equal to a weight.

Mutants these tests were run against (each planted by hand, each caught, then reverted):
``searchsorted(right=False)`` in the slot choice of ``sampling._sample`` and in
``shard.draw_in_slot`` (by ``test_draws_on_slot_boundaries``, ``test_several_draws_in_slot_order``
and ``test_subnormal_rows``), the ``nextafter`` clamp of the slot target dropped (by
``test_subnormal_rows``), ``running > target`` in the candidate top-p, ``>`` in the radix
rounds' ``select.descend`` and the top-k survivors of the radix top-p taken as ``w > cut_k``
(by ``test_cuts_across_shards``). Dropping the in-slot ``nextafter`` clamp alone is not
caught: with the slot target kept below the total, the in-slot fraction stays below 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from boundary_rows import (
    LEADING_ZERO_BLOCKS,
    ROW,
    SUBNORMAL_ROWS,
    ZERO_BLOCK_BETWEEN,
    expected_subnormal,
    sparse,
)
from thread_group import sample_sharded, slot_order
from uniforms import BELOW_ONE, first_above, on_prefix


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "torch")


UNEVEN = [(300, 600), (0, 300)]  # rank 0's shard starts off the grid: a head slot
# (row, spans): one rank, and two uneven ranks whose slot order is not the vocabulary order.
SLOT_CASES = [
    (ROW, None),
    (LEADING_ZERO_BLOCKS, None),
    (ZERO_BLOCK_BETWEEN, None),
    (sparse(600, {10: 0.25, 310: 0.25, 520: 0.5}), UNEVEN),  # 310 sits in rank 0's head slot
    (sparse(600, {299: 0.5, 512: 0.5}), UNEVEN),  # empty head slots after the last positive
]


def test_draws_on_slot_boundaries():
    for row, spans in SLOT_CASES:
        spans = spans or [(0, len(row))]
        order = slot_order(len(row), spans)
        ordered = [row[j] for j in order]
        positive = [i for i, w in enumerate(ordered) if w > 0]
        us = [0.0, *(on_prefix(ordered, i) for i in positive[:-1]), BELOW_ONE]
        x = torch.tensor([row] * len(us), dtype=torch.float64)
        out = sample_sharded(x, spans, [[u] for u in us])
        want = [order[first_above(ordered, u)] for u in us]
        assert out.token_ids[:, 0].tolist() == want, (spans, want)
        assert bool(out.valid.all())


def test_several_draws_in_slot_order():
    row = sparse(600, {10: 0.25, 310: 0.25, 520: 0.5})
    x = torch.tensor([row] * 2, dtype=torch.float64)
    out = sample_sharded(x, UNEVEN, [[0.0] * 3, [BELOW_ONE] * 3], num_samples=3)
    # Slot order 10, 520, 310: u = 0 takes them in that order, u near 1 from the back.
    assert out.token_ids.tolist() == [[10, 520, 310], [310, 520, 10]]


@pytest.mark.parametrize("world", [1, 2])
def test_subnormal_rows(world):
    """u * total rounds onto a slot prefix, or up to a one-unit total, which is kept below it:
    never the zero slots (or empty head slots) after the last positive weight."""
    us = [i / 16 for i in range(16)] + [BELOW_ONE]
    for row in SUBNORMAL_ROWS:
        vocab = len(row)
        cut = vocab * 2 // 5  # two ranks: the second shard starts off the grid (a head slot)
        spans = [(0, vocab)] if world == 1 else [(cut, vocab), (0, cut)]
        order = slot_order(vocab, spans)
        x = torch.tensor([row] * len(us), dtype=torch.float64)
        out = sample_sharded(x, spans, [[u] for u in us])
        ordered = [row[j] for j in order]
        assert out.token_ids[:, 0].tolist() == [order[expected_subnormal(ordered, u)] for u in us]


# Dyadic logits across both shards: weights 1, .5, .25, .25 at 10, 310, 520, 599.
CUT_IDS = [10, 310, 520, 599]
CUT_CASES = [
    (dict(top_k=3, top_p=0.5), [10]),  # the example: candidates, then their top-p
    (dict(top_k=3, top_p=0.75), [10, 310]),
    (dict(top_k=3), CUT_IDS),  # ties at the k-th weight, on two shards
    (dict(top_p=0.75), [10, 310]),  # radix rounds across shards
    (dict(top_p=0.875), CUT_IDS),
    (dict(top_k=torch.tensor([3, 3]), top_p=torch.tensor([0.5, 0.5])), [10]),  # radix both
    # The survivors' mass counts the ties at cut_k (2 of 4 here): .875 of it is reached at .25.
    (dict(top_k=torch.tensor([3, 3]), top_p=torch.tensor([0.875, 0.875])), CUT_IDS),
    (dict(min_p=0.5), [10, 310]),
    (dict(top_k=3, min_p=0.25), CUT_IDS),
]


@pytest.mark.parametrize("spans", [[(0, 600)], UNEVEN], ids=["one rank", "two ranks"])
def test_cuts_across_shards(spans):
    """u = 0 draws the first kept token in slot order, u near 1 the last; the probabilities
    are the kept weights over the kept mass, exactly."""
    weights = dict(zip(CUT_IDS, [1.0, 0.5, 0.25, 0.25], strict=True))
    x = torch.full((2, 600), -math.inf)
    x[:, CUT_IDS] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    order = slot_order(600, spans)
    for controls, kept in CUT_CASES:
        out = sample_sharded(x, spans, [[0.0], [BELOW_ONE]], logits=True, **controls)
        in_order = [j for j in order if j in kept]
        assert out.token_ids[:, 0].tolist() == [in_order[0], in_order[-1]], controls
        mass = sum(weights[j] for j in kept)
        want = torch.tensor([weights[in_order[0]], weights[in_order[-1]]]) / mass
        assert torch.equal(out.probs[:, 0], want.float()), controls
