"""The collectives of fastsample.distributed (:mod:`fastsample.distributed.comm`): the bytes
each call sends against the documented bound, and the error without a process group.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from distributed_helpers import results
from fastsample import distributed as fsd


def test_bytes_per_call_within_the_bound(group):
    """Each collective carries <= 1024 values per row, the collectives are the documented
    ones, and a call sends < 5% of what gathering the shards sends (< 20% with the six radix
    rounds of tensor top-k and top-p)."""
    world, _ = group
    got = results(group, "traffic")
    batch, vocab = 8, 128256
    # What gather-then-sample sends per rank: its shard to the W - 1 others (ring).
    gather_bytes = (world - 1) * batch * math.ceil(vocab / world) * 4
    slots = math.ceil(vocab / 256) + world
    expected = {  # (kind, values per row) in call order
        "plain": [("all_gather", 2), ("all_reduce(sum)", slots), ("all_reduce(max)", 2)],
        "T=0.7 k=50 p=0.9": [
            ("all_gather", 2),
            ("all_gather", 50),
            ("all_reduce(sum)", 1),  # the ties at cut_k
            ("all_reduce(sum)", slots),
            ("all_reduce(max)", 2),
        ],
        "tensor": [("all_gather", 3)]
        + [("all_reduce(sum)", 1024)] * 6
        + [("all_reduce(sum)", slots), ("all_reduce(max)", 2)],
        "tensor n=2": [("all_gather", 2 + 2 * 2)]
        + [("all_reduce(sum)", 1024)] * 6
        + [("all_reduce(sum)", slots), ("all_reduce(max)", 3), ("all_reduce(max)", 2)],
        "greedy": [("all_gather", 3)],
        "no seed": [("all_gather", 3), ("all_reduce(sum)", slots), ("all_reduce(max)", 2)],
    }
    for rank_results in got:
        for name, calls in rank_results.items():
            shape = [(kind, math.prod(dims[1:])) for kind, dims, _, _ in calls]
            assert shape == expected[name], (name, shape)
            for _, dims, payload, _ in calls:
                assert dims[0] == batch and math.prod(dims[1:]) <= 1024
                assert payload <= batch * 1024 * 8
            sent = sum(wire for *_, wire in calls)
            radix = name.startswith("tensor")  # six rounds of (B, 1024) float32 histograms
            assert sent < gather_bytes / (5 if radix else 20), (name, sent, gather_bytes)


def test_bad_arguments_without_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="initialized process group"):
        fsd.sample(torch.zeros(1, 4), vocab_start=0, vocab_size=4)
