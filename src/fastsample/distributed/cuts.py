"""The per-row thresholds of top-k, top-p and min-p across vocabulary shards.

A Python ``top_k <= CANDIDATE_MAX_K`` merges every shard's k largest weights (one all-gather);
otherwise the radix selection runs across shards, one SUM all-reduce of each round's digit
histogram (histograms are additive over shards). Min-p needs no communication. Top-p's mass
is that of the cuts before it (``cut_order``): the top-k survivors', min-p's and top-k's
(``"vllm"``), or the whole row's (``"joint"``); after a candidate top-k one SUM all-reduce of
a ``(B,)`` float64 gives it (the ties at the floor, or in the joint order each shard's mass).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops.cuts import as_rows, count_equal, top_p_cut_from_candidates
from ..ops.pieces import piece_rows
from ..ops.select import CANDIDATE_MAX_K, descend, key_scratch, largest_entries
from .agree import Call
from .comm import Comm
from .shard import RADIX_PIECE_BYTES, RADIX_ROUNDS, Layout, histogram_dtype, radix_histogram

__all__ = ["global_cut"]


def _radix_threshold(comm: Comm, values: Tensor, target: Tensor, by: str, layout: Layout) -> Tensor:
    """Across shards: the largest ``t`` whose upper set ``{w >= t}`` holds ``target`` entries
    (``by="count"``) or ``target`` times the total mass (``by="share"``: the total is read off
    the first round's histogram, which holds every weight in ``[0, 1]``).

    ``values``: ``(B, width)`` contiguous weights in ``[0, 1]`` (a padding zero column only
    adds an entry of weight 0, which no threshold of a valid row depends on). One SUM all-reduce
    of a ``(B, 2**width)`` histogram per round; the rounds of
    :data:`~fastsample.distributed.shard.RADIX_ROUNDS` cover the bit patterns of weights in
    ``[0, 1]``.
    """
    dtype = values.dtype
    hist_dtype = histogram_dtype(dtype, layout.vocab)
    batch, vocab = values.shape
    # One key scratch for every round, a few rows at a time on CPU (as select's radix).
    row_bytes = vocab * values.element_size()
    keys = key_scratch(values, piece_rows(batch, row_bytes, values.device, RADIX_PIECE_BYTES))
    rounds = RADIX_ROUNDS[dtype]
    remaining = sum(rounds)
    prefix = torch.zeros(batch, 1, dtype=torch.int64, device=values.device)
    above = torch.zeros(batch, dtype=torch.float64, device=values.device)
    for i, width in enumerate(rounds):
        remaining -= width
        hist = radix_histogram(values, keys, prefix, remaining, width, hist_dtype, by)
        hist = comm.all_reduce(hist, "sum")
        if i == 0 and by == "share":
            target = target * hist.sum(-1, dtype=torch.float64)
        digit, above = descend(hist, target, above)
        prefix = (prefix << width) | digit
    prefix = prefix.squeeze(1)
    if dtype == torch.float64:
        return prefix.view(torch.float64)
    return prefix.to(torch.int32).view(torch.float32)


def global_cut(comm: Comm, buffer: Tensor, call: Call, maxima: Tensor) -> Tensor | None:
    """The global per-row threshold ``max(cut_k, cut_p, cut_min)`` (as in
    :func:`fastsample.ops.cuts.row_cuts`), or None when no control cuts. ``buffer`` is the weight
    buffer of :func:`~fastsample.distributed.shard.shard_weights`."""
    controls, layout = call.controls, call.layout
    weights = buffer[:, : layout.width]
    batch = weights.shape[0]
    f64 = torch.zeros(batch, dtype=torch.float64, device=weights.device)
    cut: Tensor | None = None
    candidates: Tensor | None = None
    k = controls.top_k
    if isinstance(k, int) and k <= CANDIDATE_MAX_K:
        # The global k largest weights are among the union of every shard's k largest.
        mine = min(k, layout.local)
        values, ids = largest_entries(call.source, mine, maxima)
        local = torch.where(values > -math.inf, weights.gather(1, ids), 0.0)
        if mine < k:  # a small shard: pad with weight 0 (never above a real k-th weight)
            local = torch.nn.functional.pad(local, (0, k - mine))
        table = comm.all_gather(local)  # (world, B, k)
        merged = table.permute(1, 0, 2).reshape(batch, comm.world * k)
        candidates = merged.topk(k, dim=1).values
        cut = candidates[:, -1]
    elif k is not None:
        k_rows = as_rows(k, batch, f64)
        cut = _radix_threshold(comm, buffer, k_rows, "count", layout)
        cut = torch.where((k_rows > 0) & (k_rows < layout.vocab), cut, 0.0)
    cut_min = None
    if controls.min_p is not None:
        # Relative to the global maximum, which is 1 after the shift by the global maximum.
        cut_min = as_rows(controls.min_p, batch, f64).to(weights.dtype)
    if controls.top_p is not None:
        # Top-p's mass: the survivors of the cuts before it, all thresholds (the floor).
        whole = controls.top_p_on_whole_row
        floor = None if whole else cut
        if controls.min_p_first:
            assert cut_min is not None
            floor = cut_min if floor is None else torch.maximum(floor, cut_min)
        if candidates is not None and isinstance(controls.top_p, float):
            assert cut is not None
            if whole:  # the whole row's mass: every shard's, in one SUM
                mass = comm.all_reduce(weights.sum(-1, dtype=torch.float64), "sum")
                cut_p = top_p_cut_from_candidates(candidates, cut, controls.top_p, mass, mass=mass)
            else:
                # The survivors' mass as one process sums it: every survivor above the floor
                # is a (merged) candidate, the rest are ties at it, counted on every shard.
                assert floor is not None
                ties = comm.all_reduce(count_equal(buffer, floor), "sum")
                cut_p = top_p_cut_from_candidates(candidates, floor, controls.top_p, ties)
        else:
            # Radix on the survivors: above the floor their upper sets are the weights' own.
            survivors = buffer
            if floor is not None:
                survivors = torch.where(buffer >= floor[:, None], buffer, 0)
            p = as_rows(controls.top_p, batch, f64)
            cut_p = _radix_threshold(comm, survivors, p, "share", layout)
            cut_p = torch.where(p < 1, cut_p, 0.0)
        cut = cut_p if cut is None else torch.maximum(cut, cut_p)
    if cut_min is not None:
        cut = cut_min if cut is None else torch.maximum(cut, cut_min)
    return cut
