"""The small-top-k path's cuts, block sums and draw for a few rows, in Python floats.

At B = 1-8 on CPU (eager) every tensor op of :mod:`fastsample.ops.host_top_k` costs a few
microseconds whatever its size, and its candidates are ~50 numbers a row: below a few rows,
Python floats do the scalar work with fewer microseconds, and bitwise the same numbers:

* Python floats are IEEE float64, as torch's CPU float64 ops: the top-p masses (a sequential
  ``cumsum``, then ``ties * cut`` and ``top_p * mass``), the block prefix, the target and the
  fraction of the blocked inverse CDF, the prefix inside the chosen block;
* float32 values (the weights, the cuts) are exact Python floats; the only float32 arithmetic
  here is the sum of a block holding two kept weights, which rounds once (``_f32(a + b)``: a
  float64 sum rounded to float32 is the float32 sum, 53 >= 2 * 24 + 2). A block holding three
  or more is summed by torch (its order is the vectorized one): the caller's tensor path;
* the weights themselves (``exp``), the cut division and the threshold stay torch ops.

:func:`scales` gives each row's cut (as :func:`fastsample.ops.cuts.top_p_cut_from_candidates`
and the maxima of the cuts), :func:`block_values` the blocks holding kept weights (their sums
and entries), :func:`draw_one` one draw (as :func:`fastsample.ops.inverse_cdf.inverse_cdf_draw`,
from those blocks alone: no entry of the logits is read again).
"""

from __future__ import annotations

import math
import struct
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import torch

from .cuts import CUT_FLOOR
from .inverse_cdf import BLOCK
from .validation import Controls

HOST_ROWS = 2
"""Rows up to which :mod:`.host_top_k` does the scalar work here (measured on the 2-core Xeon,
T/k/p tensors at V = 128,256: 85 us saved at B=1, 50 at B=2, even at B=4, 0.15 ms lost at B=8)."""

_CUT_FLOOR = CUT_FLOOR[torch.float32]
_PACK = struct.Struct("f")


def _f32(value: float) -> float:
    """``value`` rounded to float32 (to nearest, ties to even)."""
    return _PACK.unpack(_PACK.pack(value))[0]


def _rows(value: object, batch: int) -> list | None:
    if value is None:
        return None
    return value.tolist() if hasattr(value, "tolist") else [value] * batch  # type: ignore[union-attr]


def scales(
    weights: Sequence[Sequence[float]],
    values: Sequence[Sequence[float]],
    k_rows: Sequence[int],
    count: int,
    controls: Controls,
) -> list[float]:
    """Each row's ``max(cut, CUT_FLOOR)`` (float32 values): the k-th weight, top-p's cut on
    the candidates (``weights[b][:count]``, largest first; ``values`` their logits), min-p."""
    batch = len(weights)
    p_rows, mp_rows = _rows(controls.top_p, batch), _rows(controls.min_p, batch)
    tensor_p = controls.top_p is not None and not isinstance(controls.top_p, float)
    out = []
    for b in range(batch):
        w, v, k = weights[b], values[b], k_rows[b]
        cut_k, x_k = w[k - 1], v[k - 1]
        cut = cut_k
        cut_min = None if mp_rows is None else _f32(float(mp_rows[b]))  # via float64, as torch
        if p_rows is not None:
            candidates = w[:count]
            floor = cut_k
            # Only ties at cut_k reach x_k besides the candidates above it (host_top_k).
            ties = float(sum(x >= x_k for x in v) - sum(x > cut_k for x in candidates))
            if controls.min_p_first:
                assert cut_min is not None
                floor = max(cut_k, cut_min)
                if floor > cut_k:
                    ties = float(sum(x == floor for x in candidates))
            cut = max(cut, _top_p_cut(candidates, floor, float(p_rows[b]), ties, tensor_p))
        if cut_min is not None:
            cut = max(cut, cut_min)
        out.append(max(cut, _CUT_FLOOR))
    return out


def _top_p_cut(candidates: Sequence[float], floor: float, p: float, ties: float, tensor: bool):
    """:func:`fastsample.ops.cuts.top_p_cut_from_candidates` for one row."""
    if tensor and not p < 1:  # off (1) or out of range: no cut
        return 0.0
    running, runs = 0.0, []
    for x in candidates:
        running += x if x > floor else 0.0
        runs.append(running)
    target = p * (running + ties * floor)
    for x, reached in zip(candidates, runs, strict=True):
        if reached >= target:
            return x
    return floor


class Block(NamedTuple):
    """A block holding kept weights: its index, its float32 sum, its nonzero entries
    ``(column in the block, weight)`` in column order (one or two)."""

    index: int
    total: float
    entries: list[tuple[int, float]]


def block_values(
    kept: Sequence[Sequence[float]], ids: Sequence[Sequence[int]]
) -> list[list[Block]] | None:
    """Per row, the blocks holding kept weights, in block order, or None if a block holds
    three or more (its sum is torch's). ``kept``, ``ids``: the candidates' kept weights and
    token ids; no other entry is kept (the caller checked)."""
    out = []
    for weights, columns in zip(kept, ids, strict=True):
        per_block: dict[int, list[tuple[int, float]]] = {}
        for weight, column in zip(weights, columns, strict=True):
            if weight > 0:
                entries = per_block.setdefault(column // BLOCK, [])
                if len(entries) == 2:
                    return None
                entries.append((column % BLOCK, weight))
        row = []
        for block, entries in sorted(per_block.items()):
            entries.sort()
            total = entries[0][1] if len(entries) == 1 else _f32(entries[0][1] + entries[1][1])
            row.append(Block(block, total, entries))
        out.append(row)
    return out


def draw_one(
    blocks: Sequence[Sequence[Block]], uniforms: Sequence[float], width: int
) -> tuple[list[int], list[float]]:
    """One draw per row by the blocked inverse CDF over the blocks holding kept weights
    (every row has one): the token ids (below ``width``) and their weights (float64), as
    :func:`~fastsample.ops.inverse_cdf.inverse_cdf_draw` draws them.

    Inside the chosen block the float64 prefix over its ``BLOCK`` weights is zero before
    its first kept entry and steps at each of its (one or two) entries, so the first prefix
    above the target is at one of them: no need to read the block's other entries."""
    tokens, weights = [], []
    for row, u in zip(blocks, uniforms, strict=True):
        # The float64 prefix over the blocks, left to right (zero blocks add nothing).
        prefix = list(accumulate(block.total for block in row))
        running = prefix[-1]
        target = min(u * running, math.nextafter(running, 0.0))
        chosen = bisect_right(prefix, target)  # the first prefix above the target
        block = row[chosen]
        fraction = (target - (prefix[chosen] - block.total)) / block.total
        fraction = min(max(fraction, 0.0), 1.0)
        # The prefix inside the block, left to right as torch's cumsum (its zeros add 0).
        within = list(accumulate(weight for _, weight in block.entries))
        running = within[-1]
        target = min(fraction * running, math.nextafter(running, 0.0))
        # target >= 0, so the zeros before the first entry never lie above it.
        column, weight = block.entries[min(bisect_right(within, target), len(within) - 1)]
        tokens.append(min(block.index * BLOCK + column, width - 1))
        weights.append(weight)
    return tokens, weights
