"""Vocabulary-parallel draws and cuts on their boundaries, with chosen uniforms.

``distributed.sample`` without seeds draws its uniforms from one source (rank 0's, sent in the
first collective), so a controlled source goes in through the checked call, and the ranks run
as threads over an in-process collective (``ThreadGroup``: the same all-gather and all-reduce
results as a process group, no processes). The draw picks a *slot* (grid slots of 256 entries,
then one head slot per rank for the entries before its first grid boundary) by the documented
rule, the first slot with ``P_J > t``, then the owner scans it (``shard.draw_in_slot``). So the
boundary cases are those of one process, in slot order: ``u = 0`` draws the first positive
weight (never a zero slot, an empty head slot or a zero neighbour), ``u`` on a prefix the next
positive one, ``u`` just below 1 the last one (never the empty slots after it); subnormal rows
reach the total itself. The cuts across shards (candidates and radix rounds) keep ``>=``, with
``top_p`` equal to a cumulative mass and ``min_p`` equal to a weight.

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
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

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
from fastsample.distributed.agree import check_call
from fastsample.distributed.sampling import _sample
from fastsample.distributed.shard import make_layout
from uniforms import BELOW_ONE, ControlledUniforms, first_above, on_prefix


class ThreadGroup:
    """An in-process stand-in for a process group of ``world`` ranks run as threads: each
    collective waits for every rank and combines their tensors in rank order."""

    def __init__(self, world: int):
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read them
        return every


class ThreadComm:
    """The :class:`fastsample.distributed.comm.Comm` interface over a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world = group, rank, group.world

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        parts = self.group.exchange(self.rank, tensor)
        combined = parts[0]
        for part in parts[1:]:
            combined = combined + part if op == "sum" else torch.maximum(combined, part)
        return tensor.copy_(combined)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.group.exchange(self.rank, tensor.contiguous()))


def sample_sharded(x, spans, uniforms, num_samples=1, logits=False, **controls):
    """``distributed.sample`` over ``spans`` (one ``(start, end)`` per rank) with the chosen
    ``(B, n)`` uniforms: every rank's output, checked equal; rank 0's is returned."""
    vocab = x.shape[1]
    group = ThreadGroup(len(spans))
    ctl = tuple(controls.get(k) for k in ("temperature", "top_k", "top_p", "min_p"))

    def rank_run(rank: int):
        start, end = spans[rank]
        comm = ThreadComm(group, rank)
        shard = x[:, start:end].contiguous()
        source = (shard, None) if logits else (None, shard)
        try:
            call = check_call(comm, *source, start, vocab, ctl, num_samples, None, None, 0)
            return _sample(comm, replace(call, uniforms=ControlledUniforms(uniforms)))
        except BaseException:
            group.barrier.abort()  # the other ranks stop waiting in their collective
            raise

    with ThreadPoolExecutor(len(spans)) as pool:
        outs = list(pool.map(rank_run, range(len(spans))))
    for out in outs[1:]:
        for a, b in zip(out, outs[0], strict=True):
            assert a is None or torch.equal(a, b)
    return outs[0]


def slot_order(vocab: int, spans: list[tuple[int, int]]) -> list[int]:
    """Global ids in the order of the slots' prefix: grid slots, then each rank's head."""
    world = len(spans)
    layouts = [make_layout(a, b - a, vocab, r, world) for r, (a, b) in enumerate(spans)]
    per, order = layouts[0].per_slot, []
    for slot in range(layouts[0].grid):
        low = slot * per
        owner = next(lay for lay in layouts if lay.start <= low < lay.start + lay.local)
        order += range(low, min(low + per, owner.start + owner.local))
    for lay in layouts:
        order += range(lay.start, min(lay.start + lay.head, vocab))
    assert sorted(order) == list(range(vocab))
    return order


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
