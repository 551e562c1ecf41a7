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
   (a few heavy entries, which a sample estimates poorly) holds its few candidates. Before
   ``Z`` is summed, a first look at a quarter of the sample (its own mass standing in for
   ``Z``) declines sets far past the table's reach (:data:`_GATE_SHARE` of the row);
3. the entries ``>= w_lo`` (a compare and ``nonzero`` over the weights: ~1.3-1.8x top-p's
   set on smooth rows) in a ``(B, L)`` table, and the cut among them by the radix selection
   on that table (:func:`~fastsample.ops.select.descending_threshold`, mass target
   ``top_p * Z``), or a sort of a small table;
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

from .eager import host_readable
from .inverse_cdf import BLOCK, block_sums
from .select import block_maxima, descending_threshold, key_dtype

# One weight in _STRIDE estimates the bound (8,000 a row at V = 128,256), in runs of _RUN.
_STRIDE = 16
_RUN = 64
# The first look, which declines sets far past the table's reach (this share of the row, by
# a rougher estimate: a quarter of the sample, its own mass for the row's), takes one run in
# _GATE_PART of the sample.
_GATE_PART = 4
_GATE_SHARE = 0.12
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
# row expected in the table: past it the table costs more than the radix (B=64, V=128,256 on
# the 2-core Xeon: 1.27x faster at 2.3%, 1.10x at 3.3%, 0.91x at 4.9%, 0.57x at 8.6%).
_MIN_VOCAB = 4096
_MAX_SHARE = 0.03
# Tables of at most this many entries are sorted rather than radix-selected (measured on the
# 2-core Xeon: (1, 2,000) 0.05 ms sorted against 0.33; (8, 3,000) 0.59 against 0.54).
_SORT_ENTRIES = 1 << 14


def applies(weights: Tensor) -> bool:
    """Whether :func:`top_p_cut` may serve these weights: float32, contiguous, on CPU in eager
    mode (the proof and the table's width are host reads), a batch of rows of
    :data:`_MIN_VOCAB` or more."""
    return (
        weights.dtype == torch.float32
        and weights.is_contiguous()
        and weights.shape[0] > 0
        and weights.shape[1] >= _MIN_VOCAB
        and host_readable(weights)
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
    # First, from a quarter of the sample and without the row's mass (a pass): a set far
    # past the table's reach (_GATE_SHARE) declines. The sample's mass stands in for the
    # row's, and so does the largest weight where it is more (a sample can miss a peaked
    # row's few heavy entries, which would put the bound too low and the set too large).
    sample, under, total = _look(weights, peak, vocab, _GATE_PART)
    guess = torch.maximum(total, peak.to(torch.float64))
    if _bound(under, sample, peak, (1 - top_p) * guess, None, floor)[1] > _GATE_SHARE:
        return None
    sample, under, _ = _look(weights, peak, vocab, 1)
    # The _FLOOR_BLOCKS-th largest block maximum's weight: that block's largest weight (the
    # weights are monotone in the input).
    block = _nth_largest_block(maxima)
    columns = (block * BLOCK + torch.arange(BLOCK, device=weights.device)).clamp_max_(vocab - 1)
    highest = weights.gather(1, columns).amax(-1)
    mass = block_sums(weights).sum(-1)
    w_lo, share = _bound(under, sample, peak, (1 - top_p) * mass, highest, floor)
    if share > _MAX_SHARE:
        return None
    return _proven_cut(_table(weights, w_lo), top_p * mass, w_lo, floor)


def _proven_cut(table: Tensor, target: Tensor, w_lo: Tensor, floor: Tensor | None) -> Tensor | None:
    """Top-p's cut from the table (:func:`_table_cut`) where the proof holds in every row (one
    host read: the table's mass reaches the target, and its cut lies above every entry
    outside, each of which weighs less than ``w_lo``), else None."""
    cut = _table_cut(table, target)
    reaches = table.sum(-1, dtype=torch.float64) >= target
    holds = reaches & (cut >= w_lo)
    if floor is not None:
        # A table of every entry >= floor short of the target: top-p's cut is below floor.
        below = ~reaches & (w_lo == floor)
        holds |= below
        cut = torch.where(below, floor, cut)
    return cut if bool(holds.all()) else None


def _look(weights: Tensor, peak: Tensor, vocab: int, part: int) -> tuple[Tensor, Tensor, Tensor]:
    """The sample (:func:`_sample`) and its :func:`_under` numbers."""
    sample = _sample(weights, vocab, part)
    # Log-weights below the maximum (-inf for 0: the last bucket); NaN rows fail the proof.
    return sample, *_under(sample.div(peak[:, None]).log_(), sample, vocab)


def _sample(rows: Tensor, vocab: int, part: int) -> Tensor:
    """``(B, n)`` copy of one entry in :data:`_STRIDE` of each row, in runs of :data:`_RUN`:
    a sixteenth of the row's cache lines (a stride of 16 floats would touch every line),
    spread over the whole vocabulary; ``part > 1``: every ``part``-th run of those only."""
    step = _STRIDE * _RUN * part
    runs = max(vocab // step, 1)  # rows of _MIN_VOCAB or more hold a run
    view = rows.as_strided((rows.shape[0], runs, _RUN), (rows.stride(0), step, 1))
    return view.reshape(rows.shape[0], runs * _RUN)


def _nth_largest_block(maxima: Tensor) -> Tensor:
    """``(B, 1)`` the block with the :data:`_FLOOR_BLOCKS`-th largest maximum."""
    nth = torch.topk(maxima, min(_FLOOR_BLOCKS, maxima.shape[1]), dim=1, sorted=False)
    return nth.indices.gather(1, nth.values.argmin(-1, keepdim=True))


def _under(log_weights: Tensor, sample: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """``(B, _BUCKETS)`` float64: the sample's mass under each bucket's lower edge, and
    ``(B,)`` its whole mass, scaled to the row; ``sample`` (``(B, n)`` weights, one in
    :data:`_STRIDE` of the row) and their ``log_weights`` below the row's maximum."""
    batch, count = sample.shape
    # The radix's key dtype: int32 indices on CPU where scatter_add_ takes them
    buckets = log_weights.mul_(-1 / _BUCKET).nan_to_num_(0.0).clamp_(0, _BUCKETS - 1)
    buckets = buckets.to(key_dtype(sample.dtype, sample.device))
    hist = torch.zeros(batch, _BUCKETS, dtype=torch.float32, device=sample.device)
    hist = hist.scatter_add_(1, buckets, sample).to(torch.float64).mul_(vocab / count)
    from_top = hist.flip(-1).cumsum(-1).flip(-1)
    return from_top - hist, from_top[:, 0]


def _bound(
    under: Tensor,
    sample: Tensor,
    peak: Tensor,
    left_out: Tensor,
    highest: Tensor | None,
    floor: Tensor | None,
) -> tuple[Tensor, float]:
    """``(B,)`` float32 ``w_lo`` (module docstring, step 2) and the largest share of a row
    the sample puts at or above it. ``under``: :func:`_under`'s; ``left_out`` ``(B,)``
    float64; ``highest``: ``w_lo`` goes no higher (None: no such limit); ``floor``: nor
    lower."""
    # The first edge leaving out less than the margin, then one bucket lower.
    edge = (under > (left_out * _MARGIN)[:, None]).sum(-1, keepdim=True) + 2
    low = peak[:, None] * edge.to(torch.float32).mul_(-_BUCKET).exp_()
    if highest is not None:
        low = torch.minimum(low, highest[:, None])
    if floor is not None:
        low = torch.maximum(low, floor[:, None])
    share = float((sample >= low).sum(-1).max()) / sample.shape[1]
    return low.squeeze(1), share


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


def _table(weights: Tensor, w_lo: Tensor) -> Tensor:
    """``(B, L)`` float32: each row's weights ``>= w_lo`` (any order), then zeros (at least
    one a row), by one compare and ``nonzero`` over the weights (the buffer the general path
    has just written, still in cache: cheaper here than a first look at a coarser level)."""
    batch = weights.shape[0]
    rows, columns = (weights >= w_lo[:, None]).nonzero(as_tuple=True)
    values = weights.view(-1).gather(0, columns.add_(rows * weights.stride(0)))
    per_row = torch.bincount(rows, minlength=batch)
    wide = int(per_row.max()) + 1
    first = per_row.cumsum(0).sub_(per_row)
    place = torch.arange(rows.shape[0], device=weights.device).sub_(first.gather(0, rows))
    table = torch.zeros(batch * wide, dtype=torch.float32, device=weights.device)
    return table.scatter_(0, place.add_(rows.mul(wide)), values).view(batch, wide)
