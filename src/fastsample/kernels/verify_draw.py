"""Device functions shared by the verification kernels: the pass over one row pair and the
final draw (as :mod:`fastsample.verify.draw`, which is the reference).

Entry points (``@triton.jit``; ``(ROWS,)`` vectors per tile of rows, ``(ROWS, W_PAD)`` slot
tiles of removed tokens):

* :func:`row_pass` -- one read of a target row ``p`` (and a draft row ``q``): float64 block sums
  of ``p`` (blocks of 256, float32 accumulation, float64 for float64 input) and, with
  ``RESIDUAL``, of the weights ``w = max(p' - c q', 0)`` where ``p', q'`` are ``p, q`` with the
  masked removed tokens set to 0; optionally stored to a ``(2, n_blocks)`` float64 scratch per
  row. Returns the totals, the draft mass ``sum q'``, and the clean flags (no NaN, no negative).
* :func:`final_draw` -- the one inverse-CDF draw at the end of a verification, per row from
  region 1 of the scratch (the residual with the removed tokens' frozen weights added, or the
  target with the removed tokens taken out) when ``flag`` and it has mass, else from region 0
  (the target). Returns the token (``[0, V)``) and the row's ``ok`` flag.

Math (see :func:`fastsample.verify.draw.pick`): ``t = min(u * S, nextafter(S, 0))`` over the
float64 prefix of the chosen block sums picks block ``j`` (the number of prefixes ``<= t``), the
leftover ``f = (t - P_{j-1}) / S_j`` is rescaled to the block's own float64 prefix ``c`` of its
recomputed weights, and the entry is the number of ``c_i <= min(f c_last, nextafter(c_last,
0))``. Weights are recomputed in the block with the same elementwise operations as in the pass
(``p`` and ``q`` widened to the working dtype, ``c`` rounded to it, ``max(p - c q, 0)``), so both
stages see the same numbers; the removed tokens carry their frozen float64 weights (residual) or
0 (target). Block sums that hold a removed token are fixed up in the same order as the torch
path (frozen weights added slot by slot; target blocks re-summed in float64 from what is left).

Order of additions: within a block the sums are tree sums (the torch path's are vectorized), so
a token can differ from the torch path only where ``t`` falls within rounding of a boundary.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.inverse_cdf import BLOCK as _BLOCK
from .rowwise import toward_zero

BLOCK = tl.constexpr(_BLOCK)  # 256, the torch path's block


@triton.jit
def slot_hits(columns, removed, mask):
    """``(ROWS, TILE)`` bool: the column holds one of the row's masked removed tokens."""
    hit = (columns[:, :, None] == removed[:, None, :]) & mask[:, None, :]
    return tl.max(hit.to(tl.int32), 2) > 0


@triton.jit
def block_has_removed(start, removed, mask):
    """Scalar: any row of the tile has a masked removed token in ``[start, start + BLOCK)``."""
    inside = mask & (removed >= start) & (removed < start + BLOCK)
    return tl.max(tl.max(inside.to(tl.int32), 1), 0) > 0


@triton.jit
def residual_values(p, q, coef, WORK_F64: tl.constexpr):
    """``max(p - c q, 0)`` in the working dtype, then float64 (NaN counts as 0: such rows are
    invalid whatever is drawn)."""
    if WORK_F64:
        r = p.to(tl.float64) - q.to(tl.float64) * coef[:, None]
    else:
        r = p.to(tl.float32) - q.to(tl.float32) * coef.to(tl.float32)[:, None]
    return tl.where(r > 0, r, 0.0).to(tl.float64)


@triton.jit
def row_pass(
    p_row,
    q_row,
    p_sv,
    q_sv,
    live,
    vocab,
    coef,
    removed,
    mask,
    scratch_row,
    num_blocks,
    RESIDUAL: tl.constexpr,
    HAS_REMOVED: tl.constexpr,
    STORE: tl.constexpr,
    WORK_F64: tl.constexpr,
    ROWS: tl.constexpr,
    TILE: tl.constexpr,
):
    """One read of the rows at ``p_row`` (and ``q_row``), ``(ROWS,)`` pointers.

    Returns ``(total_p, total_w, q_mass, p_clean, q_clean)``: float64 sums of the block sums of
    ``p`` and of ``w`` (removed tokens left out), the draft mass ``sum q'`` (working dtype
    accumulation, as float64), and ``(ROWS,)`` flags: no NaN and no negative entry. With
    ``STORE``, block ``j``'s sums go to ``scratch_row + j`` (target) and ``+ num_blocks + j``
    (the weights; a copy of the target's without ``RESIDUAL``, for later fix-ups).
    """
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    total_p = tl.zeros((ROWS,), tl.float64)
    total_w = tl.zeros((ROWS,), tl.float64)
    if WORK_F64:  # noqa: SIM108 (a constexpr branch reads better in a kernel)
        q_mass = tl.zeros((ROWS,), tl.float64)
    else:
        q_mass = tl.zeros((ROWS,), tl.float32)
    bad_p = tl.zeros((ROWS,), tl.int32)
    bad_q = tl.zeros((ROWS,), tl.int32)
    for start in range(0, vocab, TILE):
        columns = start + offsets
        inside = live[:, None] & (columns < vocab)
        if WORK_F64:
            p = tl.load(p_row[:, None] + columns * p_sv, mask=inside, other=0.0).to(tl.float64)
        else:
            p = tl.load(p_row[:, None] + columns * p_sv, mask=inside, other=0.0).to(tl.float32)
        block_p = tl.sum(p, 1).to(tl.float64)
        total_p += block_p
        bad_p += tl.sum(((p < 0) | (p != p)).to(tl.int32), 1)
        if STORE:
            tl.store(scratch_row + start // TILE, block_p, mask=live)
        if RESIDUAL:
            if WORK_F64:
                q = tl.load(q_row[:, None] + columns * q_sv, mask=inside, other=0.0).to(tl.float64)
            else:
                q = tl.load(q_row[:, None] + columns * q_sv, mask=inside, other=0.0).to(tl.float32)
            bad_q += tl.sum(((q < 0) | (q != q)).to(tl.int32), 1)
            if HAS_REMOVED:  # noqa: SIM102 (constexpr, then a runtime scalar test)
                if block_has_removed(start, removed, mask):
                    # Removed tokens leave both rows (a product with 0, as the torch path).
                    keep = tl.where(slot_hits(columns, removed, mask), 0.0, 1.0)
                    p = p * keep.to(p.dtype)
                    q = q * keep.to(q.dtype)
            q_mass += tl.sum(q, 1)
            block_w = tl.sum(residual_values(p, q, coef, WORK_F64), 1)
            total_w += block_w
            if STORE:
                tl.store(scratch_row + num_blocks + start // TILE, block_w, mask=live)
        elif STORE:
            tl.store(scratch_row + num_blocks + start // TILE, block_p, mask=live)
    return total_p, total_w, q_mass.to(tl.float64), bad_p == 0, bad_q == 0


@triton.jit
def _last(tile, WIDTH: tl.constexpr):
    """The last column of a ``(ROWS, WIDTH)`` tile, exactly."""
    last = tl.arange(0, WIDTH)[None, :] == WIDTH - 1
    return tl.sum(tl.where(last, tile, tl.zeros_like(tile)), 1)


@triton.jit
def fix_up(
    p_row,
    p_sv,
    live,
    vocab,
    removed,
    listed,
    mask,
    frozen,
    scratch_row,
    num_blocks,
    RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    TILE: tl.constexpr,
    W_PAD: tl.constexpr,
):
    """Region 1 of the scratch after :func:`row_pass`, for the removed tokens, slot by slot.

    ``RESIDUAL``: each masked slot's frozen weight is added to its block (the order of the torch
    path's ``scatter_add``). Else every listed slot's block is re-summed in float64 from its
    target entries less every masked removed token (the torch path's ``sums_without``).
    """
    slots = tl.arange(0, W_PAD)[None, :]
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    for s in tl.static_range(W_PAD):
        here = slots == s
        token = tl.sum(tl.where(here, removed, 0), 1)
        block = token // BLOCK
        target = scratch_row + num_blocks + block
        if RESIDUAL:
            on = live & (tl.sum(tl.where(here & mask, 1, 0), 1) > 0)
            added = tl.sum(tl.where(here & mask, frozen, 0.0), 1)
            value = tl.load(target, mask=on, other=0.0)
            tl.debug_barrier()
            tl.store(target, value + added, mask=on)
        else:
            on = live & (tl.sum(tl.where(here & listed, 1, 0), 1) > 0)
            columns = block[:, None] * BLOCK + offsets
            inside = on[:, None] & (columns < vocab) & (offsets < BLOCK)
            values = tl.load(p_row[:, None] + columns * p_sv, mask=inside, other=0.0)
            values = tl.where(slot_hits(columns, removed, mask), 0.0, values.to(tl.float64))
            tl.store(target, tl.sum(values, 1), mask=on)
        tl.debug_barrier()


@triton.jit
def final_draw(
    p_row,
    q_row,
    p_sv,
    q_sv,
    live,
    vocab,
    flag,
    u,
    coef,
    removed,
    listed,
    mask,
    frozen,
    scratch_row,
    num_blocks,
    RESIDUAL: tl.constexpr,
    HAS_REMOVED: tl.constexpr,
    WORK_F64: tl.constexpr,
    ROWS: tl.constexpr,
    TILE: tl.constexpr,
    W_PAD: tl.constexpr,
    SUMS_TILE: tl.constexpr,
):
    """The final draw of a verification; returns ``(token (ROWS,) int64, ok (ROWS,) bool)``.

    ``RESIDUAL``: from ``w = max(p - c q, 0)`` (removed tokens at their ``frozen`` weights) where
    ``flag`` (the row rejected a draft) and ``w`` has mass, else from ``p``; ``ok`` needs ``p``
    clean with ``0 < sum p < inf`` and, where ``flag``, ``q`` clean with a finite mass. Else:
    from ``p`` without the masked removed tokens when any is masked and mass is left, else from
    ``p``; ``listed`` slots are those the torch path lists (their blocks are re-summed).
    """
    total_p, _, q_mass, p_clean, q_clean = row_pass(
        p_row, q_row, p_sv, q_sv, live, vocab, coef, removed, mask, scratch_row, num_blocks,
        RESIDUAL, HAS_REMOVED, True, WORK_F64, ROWS, TILE,
    )  # fmt: skip
    tl.debug_barrier()  # the sums just stored are read back (and fixed up) below
    if HAS_REMOVED:
        fix_up(
            p_row, p_sv, live, vocab, removed, listed, mask, frozen, scratch_row, num_blocks,
            RESIDUAL, ROWS, TILE, W_PAD,
        )  # fmt: skip
    if not RESIDUAL:
        flag = tl.max(mask.to(tl.int32), 1) > 0
    # Totals of both candidates, as the prefixes below see them.
    carry0 = tl.zeros((ROWS,), tl.float64)
    carry1 = tl.zeros((ROWS,), tl.float64)
    chunk = tl.arange(0, SUMS_TILE)[None, :].to(tl.int64)
    for first in range(0, num_blocks, SUMS_TILE):
        index = first + chunk
        inside = live[:, None] & (index < num_blocks)
        s0 = tl.load(scratch_row[:, None] + index, mask=inside, other=0.0)
        s1 = tl.load(scratch_row[:, None] + num_blocks + index, mask=inside, other=0.0)
        carry0 = _last(carry0[:, None] + tl.cumsum(s0, 1), SUMS_TILE)
        carry1 = _last(carry1[:, None] + tl.cumsum(s1, 1), SUMS_TILE)
    # A candidate without mass (p <= q everywhere, or every token removed) only happens with
    # probability 0 up to rounding: draw from p then, so the token stays valid.
    chosen = flag & (carry1 > 0)
    region = tl.where(chosen, num_blocks, 0)
    total = tl.where(chosen, carry1, carry0)
    target = tl.minimum(u * total, toward_zero(total))
    carry = tl.zeros((ROWS,), tl.float64)
    count = tl.zeros((ROWS,), tl.int64)
    prefix_at = tl.zeros((ROWS,), tl.float64)
    sum_at = tl.zeros((ROWS,), tl.float64)
    for first in range(0, num_blocks, SUMS_TILE):
        index = first + chunk
        inside = live[:, None] & (index < num_blocks)
        sums = tl.load(scratch_row[:, None] + region[:, None] + index, mask=inside, other=0.0)
        prefix = carry[:, None] + tl.cumsum(sums, 1)
        carry = _last(prefix, SUMS_TILE)
        count += tl.sum(((prefix <= target[:, None]) & (index < num_blocks)).to(tl.int64), 1)
        at = tl.minimum(count, num_blocks - 1)
        here = index == at[:, None]
        seen = (at >= first) & (at < first + SUMS_TILE)
        prefix_at = tl.where(seen, tl.sum(tl.where(here, prefix, 0.0), 1), prefix_at)
        sum_at = tl.where(seen, tl.sum(tl.where(here, sums, 0.0), 1), sum_at)
    block = tl.minimum(count, num_blocks - 1)
    fraction = (target - (prefix_at - sum_at)) / tl.where(sum_at > 0, sum_at, 1.0)
    fraction = tl.minimum(tl.maximum(fraction, 0.0), 1.0)

    # The chosen block's weights, recomputed as the pass computed them.
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    columns = block[:, None] * BLOCK + offsets
    inside = live[:, None] & (columns < vocab) & (offsets < BLOCK)
    p = tl.load(p_row[:, None] + columns * p_sv, mask=inside, other=0.0)
    values = p.to(tl.float64)
    if RESIDUAL:
        q = tl.load(q_row[:, None] + columns * q_sv, mask=inside, other=0.0)
        w = residual_values(p, q, coef, WORK_F64)
        if HAS_REMOVED:
            hit = (columns[:, :, None] == removed[:, None, :]) & mask[:, None, :]
            fixed = tl.sum(tl.where(hit, frozen[:, None, :], 0.0), 2)
            w = tl.where(tl.max(hit.to(tl.int32), 2) > 0, fixed, w)
        values = tl.where(chosen[:, None], w, values)
    elif HAS_REMOVED:
        gone = slot_hits(columns, removed, mask) & chosen[:, None]
        values = tl.where(gone, 0.0, values)
    within = tl.cumsum(values, 1)
    block_total = _last(within, TILE)
    inner_target = tl.minimum(fraction * block_total, toward_zero(block_total))
    inner = tl.sum((within <= inner_target[:, None]).to(tl.int64), 1)
    inner = tl.minimum(inner, tl.minimum(vocab, BLOCK) - 1)
    token = tl.minimum(block * BLOCK + inner, vocab - 1)
    ok = p_clean & (total_p > 0) & (total_p < float("inf"))
    if RESIDUAL:
        ok = ok & ((q_clean & (q_mass < float("inf"))) | ~flag)
    return token, ok
