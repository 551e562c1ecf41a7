"""The collectives of :func:`fastsample.distributed.sample`, and the record of their traffic.

:class:`Comm` wraps the process group and is the only place a collective is issued, so that
:func:`record_traffic` sees every one of them (kind, shape, payload and ring wire bytes).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Collective", "Comm", "Traffic", "record_traffic"]


@dataclass(frozen=True)
class Collective:
    """One collective of a call, as seen from one rank.

    Attributes:
        kind: ``"all_gather"``, ``"all_reduce(sum)"`` or ``"all_reduce(max)"``.
        shape: the shape of the tensor this rank contributes.
        dtype: its dtype.
        payload_bytes: ``numel * element_size`` of that tensor.
        wire_bytes: what a ring implementation sends from this rank: ``2 (W-1)/W`` x the
            payload for an all-reduce, ``(W-1)`` x for an all-gather.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload_bytes: int
    wire_bytes: int

    @property
    def values_per_row(self) -> int:
        """Values per batch row (the tensor's trailing size)."""
        return int(math.prod(self.shape[1:])) if len(self.shape) > 1 else 1


@dataclass
class Traffic:
    """The collectives recorded by :func:`record_traffic` (in call order)."""

    collectives: list[Collective] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.collectives)

    @property
    def payload_bytes(self) -> int:
        """Bytes this rank handed to collectives."""
        return sum(c.payload_bytes for c in self.collectives)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends with ring algorithms (see :class:`Collective`)."""
        return sum(c.wire_bytes for c in self.collectives)


_RECORDERS: list[Traffic] = []


@contextlib.contextmanager
def record_traffic() -> Iterator[Traffic]:
    """Record the collectives that :func:`sample` issues on this rank inside the block.

    Example:
        >>> with record_traffic() as traffic:  # doctest: +SKIP
        ...     out = sample(shard, vocab_start=start, vocab_size=vocab, seed=seeds)
        >>> traffic.count, traffic.payload_bytes  # doctest: +SKIP
        (3, 130560)
    """
    traffic = Traffic()
    _RECORDERS.append(traffic)
    try:
        yield traffic
    finally:
        _RECORDERS.remove(traffic)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class Comm:
    """The process group, and the only place collectives are issued (so they are counted)."""

    def __init__(self, group: dist.ProcessGroup | None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "fastsample.distributed.sample needs an initialized process group: call "
                "torch.distributed.init_process_group(...) on every rank first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given group")

    def _record(self, kind: str, tensor: Tensor, factor: float) -> None:
        size = tensor.numel() * tensor.element_size()
        entry = Collective(kind, tuple(tensor.shape), tensor.dtype, size, round(size * factor))
        for traffic in _RECORDERS:
            traffic.collectives.append(entry)

    def all_reduce(self, tensor: Tensor, op: str) -> Tensor:
        """In-place all-reduce of a contiguous tensor; returns it."""
        tensor = tensor.contiguous()
        self._record(f"all_reduce({op})", tensor, 2 * (self.world - 1) / self.world)
        dist.all_reduce(tensor, op=_OPS[op], group=self.group)
        return tensor

    def all_gather(self, tensor: Tensor) -> Tensor:
        """``(world, *tensor.shape)``: every rank's tensor, in group-rank order."""
        tensor = tensor.contiguous()
        self._record("all_gather", tensor, self.world - 1)
        out = tensor.new_empty((self.world * tensor.shape[0], *tensor.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, tensor, group=self.group)
        return out.view(self.world, *tensor.shape)

    def device(self, like: object) -> torch.device:
        """Where this group's tensors live: the data's device, else the backend's."""
        if isinstance(like, Tensor):
            return like.device
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
