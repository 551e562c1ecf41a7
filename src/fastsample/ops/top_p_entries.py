"""Top-p's cut on the whole row's mass from the entries above a bound (CPU eager), not the
radix selection over the row.

With no top-k, top-p keeps ``{w >= t}`` for the largest ``t`` whose upper set holds
``top_p`` of the row's mass ``Z``. On smooth rows that set is large and spread over every
block (1-2% of a 128k vocabulary at ``T = 0.8`` on ``N(0, 3^2)`` logits), so no candidate
shortcut of :mod:`.small_top_k` serves it, and the radix selection of
:mod:`.select` histograms every weight twice (two ``scatter_add`` rounds, ~16-19 ms at B=64,
V=128,256 on the 2-core CPU). On CPU in eager mode, where data-dependent shapes and host reads
cost nothing, :func:`top_p_cut` finds the same cut from a small part of the row:

1. ``Z``, the row's block sums added (the numbers :func:`~fastsample.ops.joint.row_mass`
   gives for the same weights);
2. a bound ``w_lo``: one weight in :data:`_STRIDE` goes into a histogram of log-weights
   (buckets :data:`_BUCKET` wide below the row's maximum), and ``w_lo`` is one bucket below
   the first edge under which the sample, scaled to the row, leaves out less than
   :data:`_MARGIN` of ``(1 - top_p) Z``. The mass below a bound is carried by many entries of
   moderate weight, which a sample estimates well; the mass above it is never estimated (a
   few entries near the maximum can carry much of it). ``w_lo`` is also kept at or below the
   weight of the row's :data:`_FLOOR_BLOCKS`-th largest block maximum, so that a peaked row
   (a few heavy entries, which a sample estimates poorly) holds its few candidates;
3. the entries ``>= w_lo`` (a compare and ``nonzero``: ~1.5-2x top-p's set on smooth rows)
   in a ``(B, L)`` table, and the cut among them by the radix selection on that table
   (:func:`~fastsample.ops.select.descending_threshold`, mass target ``top_p * Z``), or a
   sort of a small table;
4. a proof, read on the host, that the table holds top-p's set: its mass reaches the target
   and its cut lies above every entry outside it (those weigh less than ``w_lo``). Where it
   fails (an estimate that missed, NaN rows, a kept set past :data:`_MAX_SHARE` of the row)
   the caller runs the radix over the row.

The estimate decides only the work, never a number. The cut is the same kept set and tie
rule as the radix over the row (every entry equal to ``t`` is kept); both sum masses in
float32 buckets, in different orders, so the two cuts can differ only where ``top_p * Z``
lies within float32 rounding (~1e-7 relative) of a cumulative mass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .inverse_cdf import BLOCK, block_sums
from .select import block_maxima, descending_threshold

# One weight in _STRIDE estimates the bound (8,000 a row at V = 128,256), in runs of _RUN.
_STRIDE = 16
_RUN = 64
# The estimate's histogram: buckets of log-weight this wide below the row's maximum, the last
# one holding everything further down (weights under e^-25.6, ~7e-12 of the maximum).
_BUCKET = 0.05
_BUCKETS = 512
# The bound leaves out at most this share of (1 - top_p) Z by the sample's estimate (then one
# bucket lower). Measured on N(0, s^2) logits (s = 2..12, T = 0.7..1, top_p = 0.5..0.95, 128
# rows each): no row's table missed top-p's set, and the tables held 1.3-1.8x its entries.
_MARGIN = 0.7
# w_lo is at most the weight of this largest block maximum (at least as many entries reach it).
_FLOOR_BLOCKS = 64
# Rows at least this long (a shorter row's radix costs little), and at most this share of a
# row expected in the table (past it the table costs what the radix does).
_MIN_VOCAB = 4096
_MAX_SHARE = 0.25
# The table's entries are looked for among the columns of the row cut into this many slices
# side by side when the slices' maximum is expected to reach w_lo in under this share of the
# columns (else every entry is compared).
_SLICES = 4
_SPARSE_SHARE = 0.5
# Tables of at most this many entries are sorted rather than radix-selected (measured on the
# 2-core Xeon: (1, 2,000) 0.05 ms sorted against 0.33; (8, 3,000) 0.59 against 0.54).
_SORT_ENTRIES = 1 << 14


def applies(weights: Tensor) -> bool:
    """Whether :func:`top_p_cut` may serve these weights: float32, on CPU in eager mode (the
    proof and the table's width are host reads), rows of :data:`_MIN_VOCAB` or more."""
    return (
        weights.device.type == "cpu"
        and weights.dtype == torch.float32
        and weights.shape[0] > 0
        and weights.shape[1] >= _MIN_VOCAB
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )


def top_p_cut(
    weights: Tensor,
    peak: Tensor,
    top_p: Tensor,
    maxima: Tensor | None,
    vocab: int,
    floor: Tensor | None = None,
) -> Tensor | None:
    """``(B,)`` top-p threshold on the whole row's mass: the largest ``t`` whose upper set
    holds ``top_p`` of the row's mass, as :func:`~fastsample.ops.select.descending_threshold`
    with ``by="share"`` gives it; or None when the table cannot be shown to hold top-p's set.

    Args:
        weights: ``(B, W)`` float32 non-negative weights (:func:`applies`), contiguous; the
            columns past ``vocab`` (padding) weigh 0.
        peak: ``(B,)`` each row's largest weight.
        top_p: ``(B,)`` float64, every value in ``(0, 1)`` (rows with top-p off are the
            caller's).
        maxima: ``(B, blocks)`` block maxima of an input that orders like ``weights`` (the
            logits or probabilities), or None (those of ``weights`` are taken).
        vocab: ``V``, the row's entries (``W - V`` padding columns).
        floor: ``(B,)`` a cut the caller applies after (min-p's), or None: where top-p's cut
            lies below it, only that matters (``max(cut, floor)`` is ``floor`` either way),
            so the table need not go lower, and a row whose entries at or above it fall
            short of the target gets ``floor`` itself.
    """
    if maxima is None:
        maxima = block_maxima(weights[:, :vocab])
    mass = block_sums(weights).sum(-1)
    bound = _bound(weights, peak, (1 - top_p) * mass, maxima, vocab, floor)
    if bound is None:
        return None
    w_lo, share = bound
    table = _table(weights, w_lo, vocab, sparse=share * _SLICES < _SPARSE_SHARE)
    target = top_p * mass
    cut = _table_cut(table, target)
    # The proof (one host read): the table's mass reaches the target, and its cut lies above
    # every entry outside (each weighs less than w_lo), so the two selections agree.
    reaches = table.sum(-1, dtype=torch.float64) >= target
    holds = reaches & (cut >= w_lo)
    if floor is not None:
        # A table of every entry >= floor short of the target: top-p's cut is below floor.
        below = ~reaches & (w_lo == floor)
        holds |= below
        cut = torch.where(below, floor, cut)
    return cut if bool(holds.all()) else None


def _bound(
    weights: Tensor,
    peak: Tensor,
    left_out: Tensor,
    maxima: Tensor,
    vocab: int,
    floor: Tensor | None,
) -> tuple[Tensor, float] | None:
    """``(B,)`` float32 ``w_lo`` (module docstring, step 2; at least ``floor``) and the
    largest share of a row the sample expects in the table; None where that is more than
    :data:`_MAX_SHARE`."""
    batch, width = weights.shape
    # Runs of _RUN entries every _STRIDE * _RUN columns: a sixteenth of the row's cache lines
    # (a stride of 16 floats would touch every line), spread over the whole vocabulary.
    runs = vocab // (_STRIDE * _RUN)
    sample = weights.as_strided((batch, runs, _RUN), (width, _STRIDE * _RUN, 1))
    sample = sample.reshape(batch, runs * _RUN)
    # Log-weights below the maximum (-inf for 0: the last bucket); NaN rows fail the proof.
    scaled = sample.div(peak[:, None]).log_()
    buckets = scaled.div(-_BUCKET).nan_to_num_(0.0).clamp_(0, _BUCKETS - 1).to(torch.int64)
    hist = torch.zeros(batch, _BUCKETS, dtype=torch.float32, device=weights.device)
    hist.scatter_add_(1, buckets, sample)
    hist = hist.to(torch.float64)
    # The sample's mass under each bucket's lower edge, scaled to the row.
    under = hist.flip(-1).cumsum(-1).flip(-1).sub_(hist).mul_(vocab / sample.shape[1])
    # The first edge leaving out less than the margin, then one bucket lower.
    edge = (under > (left_out * _MARGIN)[:, None]).sum(-1, keepdim=True) + 2
    low = peak[:, None] * edge.to(torch.float32).mul_(-_BUCKET).exp_()
    # No higher than the weight of the _FLOOR_BLOCKS-th largest block maximum (weights are
    # monotone in the input, so that block's largest weight is it).
    blocks = maxima.shape[1]
    nth = torch.topk(maxima, min(_FLOOR_BLOCKS, blocks), dim=1, sorted=False)
    block = nth.indices.gather(1, nth.values.argmin(-1, keepdim=True))
    columns = (block * BLOCK + torch.arange(BLOCK, device=weights.device)).clamp_max_(vocab - 1)
    low = torch.minimum(low, weights.gather(1, columns).amax(-1, keepdim=True))
    if floor is not None:
        low = torch.maximum(low, floor[:, None])
    # The share of the row expected in the table, from the sample.
    share = float((sample >= low).sum(-1).max()) / sample.shape[1]
    return None if share > _MAX_SHARE else (low.squeeze(1), share)


def _table_cut(table: Tensor, target: Tensor) -> Tensor:
    """``(B,)`` the largest value of each row of ``table`` whose upper set's mass reaches
    ``target`` (the smallest value where it does not): the radix selection, or for a small
    table (:data:`_SORT_ENTRIES`) a sort and running float64 sums (fewer ops: at B=1 the
    radix's ~100 small ops cost 6x the sort). The first running sum that reaches the target
    ends at a value whose ties all come before the next smaller one, so their mass is in it."""
    if table.numel() > _SORT_ENTRIES:
        return descending_threshold(table, target, "mass")
    ranked = table.sort(-1, descending=True).values
    short = (ranked.to(torch.float64).cumsum(-1) < target[:, None]).sum(-1, keepdim=True)
    return ranked.gather(1, short.clamp_max_(table.shape[1] - 1)).squeeze(1)


def _table(weights: Tensor, w_lo: Tensor, vocab: int, sparse: bool) -> Tensor:
    """``(B, L)`` float32: each row's weights ``>= w_lo`` (any order), then zeros (at least
    one a row). ``sparse`` (few entries reach ``w_lo``): the row is read as :data:`_SLICES`
    slices side by side, and only the columns whose maximum over the slices reaches ``w_lo``
    are compared entry by entry (``nonzero`` over a sixteenth of the row, then over the picked
    columns: ~2x cheaper than over every entry)."""
    batch, width = weights.shape
    device = weights.device
    span = vocab // _SLICES if sparse else 0
    if span:
        side = weights.as_strided((batch, _SLICES, span), (width, span, 1)).amax(1)
        rows, columns = (side >= w_lo[:, None]).nonzero(as_tuple=True)
        # Column c of the side-by-side view is entry c + s * span of the row, s < _SLICES.
        offsets = torch.arange(0, _SLICES * span, span, device=device)
        flat = columns.add_(rows * width)[:, None] + offsets
        values = weights.view(-1).gather(0, flat.view(-1)).view(-1, _SLICES)
        picked, slot = (values >= w_lo.gather(0, rows)[:, None]).nonzero(as_tuple=True)
        rows, values = rows.gather(0, picked), values[picked, slot]
        tail = weights[:, _SLICES * span : vocab]  # the last few columns, as they are
    else:
        rows, columns = (weights >= w_lo[:, None]).nonzero(as_tuple=True)
        values = weights.view(-1).gather(0, columns.add_(rows * width))
        tail = weights[:, :0]
    per_row = torch.bincount(rows, minlength=batch)
    wide = int(per_row.max()) + 1
    first = per_row.cumsum(0).sub_(per_row)
    place = torch.arange(rows.shape[0], device=device).sub_(first.gather(0, rows))
    place = place.add_(rows.mul(wide))
    table = torch.zeros(batch * wide, dtype=torch.float32, device=device)
    table = table.scatter_(0, place, values).view(batch, wide)
    if tail.shape[1]:  # those below w_lo weigh 0 here
        table = torch.cat((table, torch.where(tail >= w_lo[:, None], tail, 0.0)), dim=1)
    return table
