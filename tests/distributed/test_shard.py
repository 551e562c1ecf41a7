"""Shard-local pieces (:mod:`fastsample.distributed.shard`), without a process group: the slot
layout and one shard's radix histogram.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed_helpers import ALIGNED, ALIGNED_VOCAB, COARSE, COARSE_VOCAB, UNEVEN, UNEVEN_VOCAB
from fastsample.distributed import shard as _shard


def test_layout_owns_every_slot_once(monkeypatch):
    """Pure layout arithmetic: over a partition, each grid slot has exactly one owner and each
    rank's slots cover exactly its entries (plus the padding column of an odd vocabulary)."""
    cases = (
        (ALIGNED_VOCAB, ALIGNED[4], 1024),
        (UNEVEN_VOCAB, UNEVEN[4], 1024),
        (COARSE_VOCAB, COARSE[4], 8),
        (COARSE_VOCAB, COARSE[2], 8),
        (7, [(0, 7)], 1024),
        (300_000, [(0, 150_037), (150_037, 300_000)], 1024),
    )
    for vocab, spans, max_slots in cases:
        monkeypatch.setattr(_shard, "MAX_SLOTS", max_slots)
        world = len(spans)
        layouts = [
            _shard.make_layout(a, b - a, vocab, rank, world) for rank, (a, b) in enumerate(spans)
        ]
        assert layouts[0].slots <= max_slots
        owners = np.zeros(layouts[0].grid, dtype=int)
        covered = 0
        for lay in layouts:
            owners[lay.first : lay.first + lay.owned] += 1
            covered += lay.head + sum(
                min(lay.per_slot, lay.width - lay.head - i * lay.per_slot) for i in range(lay.owned)
            )
        assert (owners == 1).all(), (vocab, owners)
        assert covered == vocab + vocab % 2


@pytest.mark.parametrize("keys", ["int32", "int64"])
@pytest.mark.parametrize("by", ["count", "mass"])
def test_radix_histogram_counts_the_next_digit_of_the_prefix(keys, by, monkeypatch):
    """One shard's histogram of a radix round against numpy: only patterns sharing the prefix
    count, on their next digit; patterns below and above it (and -0.0) are left out. With
    int64 keys (torch < 2.8) and int32 keys, in one- and several-row pieces."""
    from fastsample.ops import select

    monkeypatch.setattr(select, "_FLOAT32_KEYS", getattr(torch, keys))
    gen = torch.Generator().manual_seed(11)
    values = torch.rand(5, 3001, generator=gen) ** 3
    values[1, ::3] = 0.5  # many entries on one pattern
    values[2, ::2] = -0.0
    shift, width = 10, 10
    patterns = values.view(torch.int32).numpy().astype(np.int64)  # -0.0 is negative
    prefix = torch.tensor(patterns[:, 7] >> (shift + width))[:, None]  # some entry's prefix
    for rows in (1, 2, 5):
        scratch = select.key_scratch(values, rows)
        got = _shard.radix_histogram(values, scratch, prefix, shift, width, torch.float64, by)
        for r in range(values.shape[0]):
            row = patterns[r]
            inside = (row >= 0) & ((row >> (shift + width)) == int(prefix[r]))
            digits = (row[inside] >> shift) & ((1 << width) - 1)
            amount = np.ones(inside.sum()) if by == "count" else values[r].numpy()[inside]
            want = np.bincount(digits, weights=amount, minlength=1 << width)
            np.testing.assert_allclose(got[r].numpy(), want, rtol=1e-6, atol=0)
