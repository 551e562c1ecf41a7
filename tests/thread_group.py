"""Vocabulary-parallel sampling in one process: ranks as threads over an in-process collective.

:class:`ThreadGroup` stands in for a process group (each collective waits for every rank and
combines their tensors in rank order, as a process group's results are), so a test can run
:func:`fastsample.distributed.sample`'s orchestration on several shards without processes, and
hand it a controlled uniform source (unseeded calls take rank 0's uniforms).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from fastsample.distributed.agree import check_call
from fastsample.distributed.sampling import _sample
from fastsample.distributed.shard import make_layout
from uniforms import ControlledUniforms


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

    if len(spans) == 1:  # no thread: the Triton interpreter is not shared between threads
        return rank_run(0)
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
