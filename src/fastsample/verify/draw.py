"""The one draw at the end of a verification: from a target row, a residual, or a target row
with a few tokens removed, picked per batch row at a per-row position.

This is the blocked inverse CDF of :mod:`fastsample.ops.inverse_cdf` (block sums, a float64
prefix over blocks, one uniform per row, a scan of one block), restated for the
verifier's needs:

* the row to draw from sits at a different position for every batch row (the first
  rejection), so its block sums are computed from rows gathered with ``index_select``, a few
  rows at a time on CPU (cache-sized pieces: no batch-sized temporaries, whose page faults
  cost more than the arithmetic);
* the distribution is chosen per row between two candidates with the same block layout
  (the residual, or the target when the residual is all zero or the row accepted every
  draft), so the block choice runs on per-row selected block sums and the scan gathers the
  chosen block from both candidates and keeps one;
* the scan recomputes the chosen block's entries from the original tensors with the same
  elementwise operations as the block sums, so both stages see bit-identical weights.

Exactness is that of the inverse CDF: the block is picked with probability
``S_j / total`` (strict comparisons against targets kept below the totals, so empty blocks
and zero weights are never picked) and the entry with probability ``w_i / S_j``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..ops.inverse_cdf import BLOCK, block_sums
from ..ops.pieces import row_pieces as pieces_of_rows

# CPU rows are gathered and reduced this many elements at a time (8 MiB of float32): the
# pieces stay in cache and the allocator reuses them, where one (B, V) temporary per call
# would be page-faulted anew every time.
PIECE_ELEMENTS = 1 << 21


def work_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (half inputs are widened)."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


def row_pieces(batch: int, vocab: int, device: torch.device) -> list[slice]:
    """Static row ranges to process together: the whole batch off CPU, cache-sized on CPU."""
    return pieces_of_rows(batch, vocab, device, PIECE_ELEMENTS)


class Weights(NamedTuple):
    """The weights ``w(y) = max(p(y) - c q(y), 0)``, except ``w(y) = frozen`` for removed tokens.

    ``coef`` is ``c`` per row (float64, rounded to the working precision before use; None means
    1, the plain residual); ``removed (B, M)`` int64 tokens in ``[0, V)``, taken into account
    where ``removed_mask (B, M)``; ``frozen (B, M)`` float64, their weights (same scale as w).
    Tree mode b uses them for recursive rejection sampling without updating ``(B, V)`` rows.
    """

    coef: Tensor | None = None
    removed: Tensor | None = None
    removed_mask: Tensor | None = None
    frozen: Tensor | None = None


class Summary(NamedTuple):
    """Per-row summaries of the gathered rows (all ``(B, ...)``)."""

    target_sums: Tensor  # (B, n_blocks) float64 block sums of the target row
    residual_sums: Tensor | None  # (B, n_blocks) float64 block sums of w (removed tokens: 0)
    target_ok: Tensor  # (B,) bool: target row has no NaN and no negative entry
    draft_ok: Tensor | None  # (B,) bool: draft row has no NaN, no negative, no +inf
    draft_mass: Tensor | None  # (B,) float64: draft mass of the tokens not removed


def summarize(
    target: Tensor,
    target_rows: Tensor,
    draft: Tensor | None,
    draft_rows: Tensor | None,
    weights: Weights | None = None,
) -> Summary:
    """Block sums of ``p = target[target_rows]`` and of the :class:`Weights` at the paired
    draft rows ``q = draft[draft_rows]`` (default: ``max(p - q, 0)``).

    ``target`` and ``draft`` are contiguous ``(R, V)`` tables of rows; ``*_rows`` are ``(B,)``
    int64 indices into them. Each output row depends only on its own input rows. The block sums
    of the weights leave the removed tokens out (0); add their frozen weights to use them.
    """
    weights = weights if weights is not None else Weights()
    batch, vocab = target_rows.shape[0], target.shape[1]
    work = work_dtype(target, draft)
    pieces = row_pieces(batch, vocab, target.device)
    rows = pieces[0].stop - pieces[0].start if pieces else 0  # the first piece is the largest
    tables = [(target, target_rows)]
    if draft is not None and draft_rows is not None:
        tables.append((draft, draft_rows))
    scratch = _scratch([table for table, _ in tables], rows, vocab, work)
    coef = weights.coef.to(work)[:, None] if weights.coef is not None else None
    keep = None
    if weights.removed is not None and weights.removed_mask is not None:
        keep = (~weights.removed_mask).to(work)  # multiplies removed tokens by 0, others by 1
    sums_p, sums_r, ok_p, ok_q, mass_q = [], [], [], [], []
    for piece in pieces:
        size = piece.stop - piece.start
        gathered = []
        for (table, table_rows), (raw, wide) in zip(tables, scratch, strict=True):
            rows_here = torch.index_select(table, 0, table_rows[piece], out=raw[:size])
            gathered.append(rows_here if wide is None else wide[:size].copy_(rows_here))
        p = gathered[0]
        sums_p.append(block_sums(p))
        ok_p.append(p.amin(-1) >= 0)  # NaN fails too; +inf shows in the sums
        if len(gathered) == 2:
            q = gathered[1]
            ok = q.amin(-1) >= 0  # NaN and negatives
            if keep is not None and weights.removed is not None:
                # Removed tokens leave both rows (a product with 0 or 1: duplicates are fine).
                p.scatter_reduce_(1, weights.removed[piece], keep[piece], "prod")
                q.scatter_reduce_(1, weights.removed[piece], keep[piece], "prod")
            mass = q.sum(-1)
            ok_q.append(ok & (mass < torch.inf))  # +inf, which max(p - q, 0) would hide
            mass_q.append(mass.to(torch.float64))
            if coef is not None:
                q.mul_(coef[piece])  # c q, then p - c q: two roundings, as in weight_values
            residual = torch.sub(p, q, out=q).clamp_(min=0)
            sums_r.append(block_sums(residual))
    with_draft = len(tables) == 2
    if not sums_p:  # an empty batch
        nb = -(-vocab // BLOCK)
        empty = torch.zeros(0, nb, dtype=torch.float64, device=target.device)
        flag = torch.zeros(0, dtype=torch.bool, device=target.device)
        none = torch.zeros(0, dtype=torch.float64, device=target.device)
        if not with_draft:
            return Summary(empty, None, flag, None, None)
        return Summary(empty, empty, flag, flag, none)
    cat = torch.cat
    if not with_draft:
        return Summary(cat(sums_p), None, cat(ok_p), None, None)
    return Summary(cat(sums_p), cat(sums_r), cat(ok_p), cat(ok_q), cat(mass_q))


def _scratch(
    tables: list[Tensor], rows: int, vocab: int, work: torch.dtype
) -> list[tuple[Tensor, Tensor | None]]:
    """Per table: a ``(rows, V)`` buffer of its dtype to gather into and, if that is not
    ``work``, a ``(rows, V)`` buffer of ``work`` to widen into.

    Everything lives in ONE allocation: on CPU, glibc then keeps the freed block for the next
    call (it returns the heap top to the OS only above twice the largest block), where
    separate buffers would be unmapped and page-faulted again on every call.
    """
    slots = len(tables) + sum(table.dtype != work for table in tables)
    memory = torch.empty(slots, rows, vocab, dtype=work, device=tables[0].device)
    out, extra = [], len(tables)
    for i, table in enumerate(tables):
        if table.dtype == work:
            out.append((memory[i], None))
        else:  # gather into the front of a spare slot, widen into the table's own slot
            raw = memory[extra].view(-1).view(table.dtype)[: rows * vocab].view(rows, vocab)
            out.append((raw, memory[i]))
            extra += 1
    return out


def gather_block(table: Tensor, rows: Tensor, columns: Tensor) -> Tensor:
    """``table[rows[b], columns[b, i]]`` for a contiguous ``(R, V)`` table: ``(B, W)``."""
    flat = rows[:, None] * table.shape[1] + columns
    return table.view(-1).gather(0, flat.reshape(-1)).view(columns.shape)


def weight_values(p: Tensor, q: Tensor, work: torch.dtype, coef: Tensor | None = None) -> Tensor:
    """``max(p - c q, 0)`` in ``work`` precision (``c = 1`` if ``coef`` is None), with the same
    elementwise operations, hence the same bits, as :func:`summarize`. ``coef``: ``(B,)``."""
    q = q.to(work)
    if coef is not None:
        q = q * coef.to(work).view(-1, *([1] * (q.dim() - 1)))
    return (p.to(work) - q).clamp_(min=0)


def sums_without(
    target: Tensor, rows: Tensor, sums: Tensor, removed: Tensor, removed_mask: Tensor
) -> Tensor:
    """Block sums of ``target[rows]`` with the tokens ``removed[b, m]`` (where
    ``removed_mask[b, m]``) set to 0.

    Every block that holds one of the listed tokens is re-summed exactly from its remaining
    entries (float64), so a block whose positive entries were all removed becomes exactly 0
    and can never be picked. Listed but unmasked tokens only cause a re-sum of their block
    with nothing removed; every write into one block carries the same value (deterministic).
    """
    vocab = target.shape[1]
    width = min(BLOCK, vocab)
    blocks = removed // BLOCK  # (B, M)
    columns = blocks[:, :, None] * BLOCK + torch.arange(width, device=rows.device)  # (B, M, W)
    inside = columns < vocab
    batch, count = removed.shape
    values = gather_block(target, rows, columns.clamp_max(vocab - 1).view(batch, count * width))
    values = values.view(batch, count, width).to(torch.float64) * inside
    gone = removed_token_mask(columns, removed, removed_mask)
    left = values.masked_fill(gone, 0.0).sum(-1)  # (B, M)
    return sums.scatter(1, blocks, left)


def removed_token_mask(columns: Tensor, removed: Tensor, removed_mask: Tensor) -> Tensor:
    """True where ``columns[b, ...]`` equals a masked-in removed token of row ``b``."""
    shape = (removed.shape[0],) + (1,) * (columns.dim() - 1) + (removed.shape[1],)
    hits = (columns[..., None] == removed.view(shape)) & removed_mask.view(shape)
    return hits.any(-1)


def pick(
    sums: Tensor, uniform: Tensor, vocab: int, values_of: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor]:
    """One inverse-CDF draw per row from block sums and a block-value callback.

    Args:
        sums: ``(B, n_blocks)`` float64 block sums of the weights to draw from.
        uniform: ``(B, 1)`` float64 uniforms in ``[0, 1)``.
        vocab: ``V``.
        values_of: maps in-range columns ``(B, W)`` (the chosen block's) to their float64
            weights ``(B, W)``; entries past ``V`` are zeroed here.

    Returns:
        ``token (B, 1) int64`` (always in ``[0, V)``) and ``total (B,)`` float64.
    """
    num_blocks = sums.shape[1]
    prefix = sums.cumsum(-1)
    total = prefix[:, -1:]
    floor = torch.zeros((), dtype=torch.float64, device=sums.device)
    # Targets strictly below the totals: the first prefix above them ends a positive block
    # (and, below, a positive entry), even when u * total rounds up.
    target = torch.minimum(uniform * total, total.nextafter(floor))
    block = torch.searchsorted(prefix, target, right=True).clamp_max_(num_blocks - 1)
    block_sum = sums.gather(1, block)
    fraction = ((target - (prefix.gather(1, block) - block_sum)) / block_sum).clamp_(0, 1)
    width = min(BLOCK, vocab)
    columns = block * BLOCK + torch.arange(width, device=sums.device)
    values = values_of(columns.clamp_max(vocab - 1))
    if vocab > BLOCK and vocab % BLOCK:  # a short last block: drop the clamped duplicates
        values = values * (columns < vocab)
    within = values.cumsum(-1)
    block_total = within[:, -1:]
    inner_target = torch.minimum(fraction * block_total, block_total.nextafter(floor))
    inner = torch.searchsorted(within, inner_target, right=True).clamp_max_(width - 1)
    return (block * BLOCK + inner).clamp_max_(vocab - 1), total[:, 0]


class Recovery(NamedTuple):
    """The final token of each row and what the validity flag needs."""

    token: Tensor  # (B, 1) int64 in [0, V)
    ok: Tensor  # (B,) bool: the rows read were clean and the chosen weights have mass


def frozen_block_sums(sums: Tensor, weights: Weights) -> Tensor:
    """Add the removed tokens' frozen weights to block sums that left them out."""
    if weights.removed is None or weights.removed_mask is None or weights.frozen is None:
        return sums
    added = torch.where(weights.removed_mask, weights.frozen, 0.0)
    return sums.scatter_add(1, weights.removed // BLOCK, added)


def draw_residual(
    target: Tensor,
    target_rows: Tensor,
    draft: Tensor,
    draft_rows: Tensor,
    use_residual: Tensor,
    uniform: Tensor,
    weights: Weights | None = None,
) -> Recovery:
    """Per row: a draw from the :class:`Weights` (default ``max(p - q, 0)``) where
    ``use_residual`` and they have mass, else from ``p``; ``p = target[target_rows]``,
    ``q = draft[draft_rows]``.

    The draft row is only judged (NaN, negative, +inf) for rows that use the residual.
    """
    weights = weights if weights is not None else Weights()
    vocab = target.shape[1]
    work = work_dtype(target, draft)
    summary = summarize(target, target_rows, draft, draft_rows, weights)
    assert summary.residual_sums is not None and summary.draft_ok is not None
    sums_p = summary.target_sums
    sums_r = frozen_block_sums(summary.residual_sums, weights)
    total_p = sums_p.sum(-1)
    # A residual without mass (p <= q everywhere: p == q up to rounding) means the rejection
    # had probability 0; draw from p then, so the output stays a valid token.
    residual = use_residual & (sums_r.sum(-1) > 0)
    sums = torch.where(residual[:, None], sums_r, sums_p)

    def values_of(columns: Tensor) -> Tensor:
        p = gather_block(target, target_rows, columns)
        q = gather_block(draft, draft_rows, columns)
        w = weight_values(p, q, work, weights.coef).to(torch.float64)
        if weights.removed is not None and weights.removed_mask is not None:
            assert weights.frozen is not None
            hits = (columns[:, :, None] == weights.removed[:, None, :]) & weights.removed_mask[
                :, None, :
            ]
            frozen = (hits * weights.frozen[:, None, :]).sum(-1)
            w = torch.where(hits.any(-1), frozen, w)
        return torch.where(residual[:, None], w, p.to(torch.float64))

    token, _ = pick(sums, uniform, vocab, values_of)
    ok = summary.target_ok & (total_p > 0) & (total_p < torch.inf)
    ok = ok & (summary.draft_ok | ~use_residual)
    return Recovery(token, ok)


def draw_target_without(
    target: Tensor,
    target_rows: Tensor,
    removed: Tensor,
    removed_mask: Tensor,
    uniform: Tensor,
) -> Recovery:
    """Per row: a draw from ``p = target[target_rows]`` with the tokens ``removed[b, m]``
    (where ``removed_mask[b, m]``) set to 0; from ``p`` itself if nothing would be left.

    ``removed`` must be in ``[0, V)``. Used for drafts without probabilities (the rejected
    token is removed) and for tree siblings chosen deterministically.
    """
    vocab = target.shape[1]
    summary = summarize(target, target_rows, None, None)
    sums_p = summary.target_sums
    total_p = sums_p.sum(-1)
    if removed.shape[1] == 0:
        reduced, sums = torch.zeros_like(total_p, dtype=torch.bool), sums_p
    else:
        sums_left = sums_without(target, target_rows, sums_p, removed, removed_mask)
        # Nothing left (the removed tokens held all the mass) only happens with probability 0
        # up to rounding; draw from p then, so the output stays a valid token.
        reduced = removed_mask.any(-1) & (sums_left.sum(-1) > 0)
        sums = torch.where(reduced[:, None], sums_left, sums_p)

    def values_of(columns: Tensor) -> Tensor:
        values = gather_block(target, target_rows, columns).to(torch.float64)
        if removed.shape[1] == 0:
            return values
        gone = removed_token_mask(columns, removed, removed_mask) & reduced[:, None]
        return values.masked_fill(gone, 0.0)

    token, _ = pick(sums, uniform, vocab, values_of)
    ok = summary.target_ok & (total_p > 0) & (total_p < torch.inf)
    return Recovery(token, ok)
