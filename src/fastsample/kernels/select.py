"""Exact threshold selection inside a Triton program: the radix rounds of one row.

The question is :func:`fastsample.ops.select.descending_threshold`'s: for a row of
non-negative weights ``w`` (float32 or float64) and a target, the largest ``t`` whose upper
set ``{i : w_i >= t}`` holds at least ``target`` entries (``BY_MASS=False``: the k-th
largest, top-k) or at least ``target`` mass (``BY_MASS=True``: the top-p cut; with
``SHARE=True`` the target is a fraction of the row's mass). Ties at ``t`` are in the set.

How: non-negative IEEE floats order like their bit patterns read as integers, so the answer
is found digit by digit, most significant first. Each round reads the row once (tile by
tile) and histograms, over the entries whose pattern shares the prefix chosen so far, the
next ``RADIX_BITS`` bits: ``2**RADIX_BITS`` counts or float64 masses, kept in registers as a
one-hot reduction of each tile (no scatter, no shared-memory atomics). A suffix sum over the
buckets picks the last bucket where the amount from the top (plus what lies above the
prefix) still reaches the target. float32 takes 8 rounds of 4 bits, float64 16. The result
is an exact bit pattern: the same answer as the torch radix, bit for bit, for counts; for
masses the sums are float64 here (float32 buckets there), so the two can differ only when
the target lies within rounding of a cumulative mass.

The sign bit is masked off (``-0.0`` counts as ``0.0``); rows with NaN or negative entries
give an arbitrary pattern, never a fault. ``target <= 0`` gives an all-ones pattern: callers
mask rows whose control is off, as the torch ops do.

:func:`radix_threshold` is the device function the fused controls kernel calls;
:func:`descending_threshold` launches it once per row, for tests and as a standalone op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

RADIX_BITS = 4


# Reductions go through tl.reduce with the standard library's combine functions, not through
# tl.sum/tl.max: those are @triton.jit functions decorated when triton is imported, so if
# anything imported triton before TRITON_INTERPRET was set (pytest, torch's inductor) they are
# compiled-mode functions the interpreter refuses to call. The interpreter recognises these
# combine functions and reduces with numpy; on a GPU this is exactly what tl.sum/tl.max emit.
_add = tl.standard._sum_combine
_larger = tl.standard._elementwise_max
_smaller = tl.standard._elementwise_min


@triton.jit
def total(x, axis):
    """Sum along ``axis`` in ``x``'s dtype."""
    return tl.reduce(x, axis, _add)


@triton.jit
def largest(x, axis):
    return tl.reduce(x, axis, _larger)


@triton.jit
def smallest(x, axis):
    return tl.reduce(x, axis, _smaller)


@triton.jit
def radix_threshold(
    row_ptr,
    n,
    target,
    BY_MASS: tl.constexpr,
    SHARE: tl.constexpr,
    IS_F64: tl.constexpr,
    TILE: tl.constexpr,
    RADIX_BITS: tl.constexpr = 4,
):
    """Threshold pattern of the row at ``row_ptr`` (``n`` entries, contiguous): see the
    module docstring. ``target`` is a float64 scalar; returns the threshold in the row's
    float dtype."""
    return radix_threshold_weighed(row_ptr, row_ptr, n, target, BY_MASS, SHARE, False, IS_F64,
                                   TILE, RADIX_BITS)  # fmt: skip


@triton.jit
def radix_threshold_weighed(
    row_ptr,
    mass_ptr,
    n,
    target,
    BY_MASS: tl.constexpr,
    SHARE: tl.constexpr,
    OWN_MASS: tl.constexpr,
    IS_F64: tl.constexpr,
    TILE: tl.constexpr,
    RADIX_BITS: tl.constexpr = 4,
):
    """:func:`radix_threshold`, with ``OWN_MASS`` each entry's mass read at ``mass_ptr``
    instead of being its value (typical-p orders tokens by a key but counts their
    probability: the ``mass=`` of :func:`fastsample.ops.select.descending_threshold`)."""
    BUCKETS: tl.constexpr = 1 << RADIX_BITS
    if IS_F64:
        KEY_BITS: tl.constexpr = 64
        KEY: tl.constexpr = tl.int64
        FLOAT: tl.constexpr = tl.float64
        MAGNITUDE: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    else:
        KEY_BITS: tl.constexpr = 32
        KEY: tl.constexpr = tl.int32
        FLOAT: tl.constexpr = tl.float32
        MAGNITUDE: tl.constexpr = 0x7FFFFFFF
    ROUNDS: tl.constexpr = KEY_BITS // RADIX_BITS
    digits = tl.arange(0, BUCKETS)
    # at_or_after[i, j]: bucket j is at or after bucket i (for suffix sums in registers).
    at_or_after = digits[None, :] >= digits[:, None]
    prefix = tl.full((), 0, KEY)
    above = tl.full((), 0, tl.float64)
    goal = target.to(tl.float64)
    for r in tl.static_range(ROUNDS):
        shift = KEY_BITS - (r + 1) * RADIX_BITS  # a constexpr: r is one
        hist = tl.full((BUCKETS,), 0.0, tl.float64)
        for start in range(0, n, TILE):
            offs = start + tl.arange(0, TILE)
            inside = offs < n
            w = tl.load(row_ptr + offs, mask=inside, other=0.0)
            key = w.to(KEY, bitcast=True) & MAGNITUDE
            digit = ((key >> shift) & (BUCKETS - 1)).to(tl.int32)
            take = inside
            if r > 0:  # round 1 holds every entry; later ones only the chosen prefix's
                take = take & ((key >> (shift + RADIX_BITS)) == prefix)
            hit = (digit[:, None] == digits[None, :]) & take[:, None]
            if BY_MASS:
                if OWN_MASS:
                    mass = tl.load(mass_ptr + offs, mask=inside, other=0.0).to(tl.float64)
                else:
                    mass = w.to(tl.float64)
                hist += total(tl.where(hit, mass[:, None], 0.0), 0)
            else:
                hist += total(hit.to(tl.int32), 0).to(tl.float64)
        if SHARE and r == 0:  # round 1 holds every weight: the row's mass
            goal = goal * total(hist, 0)
        suffix = total(tl.where(at_or_after, hist[None, :], 0.0), 1)
        # Suffix sums fall as the bucket rises, so the buckets meeting the goal are a prefix.
        meets = (above + suffix) >= goal
        last = tl.maximum(total(meets.to(tl.int32), 0) - 1, 0)
        above += total(tl.where(digits == last, suffix - hist, 0.0), 0)
        prefix = (prefix << RADIX_BITS) | last.to(KEY)
    return prefix.to(FLOAT, bitcast=True)


@triton.jit
def _threshold_kernel(
    values_ptr,
    target_ptr,
    out_ptr,
    n,
    stride,
    BY_MASS: tl.constexpr,
    SHARE: tl.constexpr,
    IS_F64: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    cut = radix_threshold(values_ptr + row * stride, n, target, BY_MASS, SHARE, IS_F64, TILE)
    tl.store(out_ptr + row, cut)


def tile_for(vocab: int, interpreted: bool) -> int:
    """Tile width of the row loops: the whole row up to 4096 entries when interpreted (numpy
    pays per op, not per element), 512 on a GPU (a ``(512, 16)`` one-hot stays in
    registers)."""
    if interpreted:
        return min(max(triton.next_power_of_2(vocab), 16), 4096)
    return 512


def descending_threshold(values: Tensor, target: Tensor, by: str) -> Tensor:
    """:func:`fastsample.ops.select.descending_threshold` in one launch, one program per row.

    Args:
        values: ``(B, V)`` float32 or float64, rows contiguous.
        target: ``(B,)`` float64 (a fraction of the row's mass for ``by="share"``).
        by: ``"count"``, ``"mass"`` or ``"share"``.

    Returns:
        ``(B,)`` thresholds in ``values``' dtype.
    """
    if by not in ("count", "mass", "share"):
        raise ValueError(f"by must be 'count', 'mass' or 'share', got {by!r}")
    if values.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"values must be float32 or float64, got {values.dtype}")
    values = values if values.stride(-1) == 1 else values.contiguous()
    batch, vocab = values.shape
    out = torch.empty(batch, dtype=values.dtype, device=values.device)
    if batch == 0:
        return out
    _threshold_kernel[(batch,)](
        values,
        target.to(torch.float64),
        out,
        vocab,
        values.stride(0),
        BY_MASS=by != "count",
        SHARE=by == "share",
        IS_F64=values.dtype == torch.float64,
        TILE=tile_for(vocab, values.device.type == "cpu"),
    )
    return out
