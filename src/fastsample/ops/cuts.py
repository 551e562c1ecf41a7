"""Thresholds of the cuts, top-k, top-p and min-p, and applying them to weights.

Every cut is a threshold on the same weights (:mod:`fastsample.ops.weights`): the kept set
of a row is ``{i : w_i >= max(cut_k, cut_p, cut_min)}``. The thresholds are exact
selections on those weights (:mod:`fastsample.ops.select`); nothing is sorted.
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from . import top_p_entries
from .inverse_cdf import block_sums
from .pieces import piece_rows
from .select import CANDIDATE_MAX_K, descending_threshold, largest_entries
from .validation import Controls


def as_rows(value: float | int | Tensor, batch: int, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(like.dtype)
    return torch.full((batch,), value, dtype=like.dtype, device=like.device)


def top_p_cut(
    weights: Tensor,
    top_p: float | Tensor,
    mass: Tensor | None,
    peak: Tensor | None = None,
    maxima: Tensor | None = None,
    vocab: int | None = None,
    floor: Tensor | None = None,
) -> Tensor:
    """Top-p threshold on ``weights`` by radix selection: ``top_p`` of ``mass`` (the top-k
    survivors' mass), or of the whole row's if None. For the whole row on CPU in eager mode,
    given ``peak`` (each row's largest weight), the same cut from the entries above an
    estimated bound where that can be shown to hold (:mod:`.top_p_entries`; ``maxima``: the
    input's block maxima if known, ``vocab``: the row's entries before any padding,
    ``floor``: min-p's cut, which the caller applies after; where top-p's cut lies below it
    the result may be ``floor`` instead)."""
    rows = torch.empty(weights.shape[0], dtype=torch.float64, device=weights.device)
    p = as_rows(top_p, rows.shape[0], rows)
    cut = None
    if mass is None and peak is not None and top_p_entries.applies(weights):
        # Rows with top-p off (or invalid) get 0 below whatever their cut: any share serves.
        share = torch.where((p > 0) & (p < 1), p, 0.5)
        cut = top_p_entries.top_p_cut(
            weights, peak, share, maxima, weights.shape[1] if vocab is None else vocab, floor
        )
    if cut is None and mass is None:
        cut = descending_threshold(weights, p, "share")
    elif cut is None:
        cut = descending_threshold(weights, p * mass, "mass")
    return torch.where(p < 1, cut, 0.0)


def top_p_cut_from_candidates(
    candidates: Tensor,
    cut_k: Tensor,
    top_p: float | Tensor,
    ties: Tensor,
    on: bool = False,
    mass: Tensor | None = None,
) -> Tensor:
    """Top-p threshold after a top-k cut taken from candidates.

    Every survivor above ``cut_k`` is among the candidates (sorted, largest first; there may
    be more candidates than a row's ``k``), and ``ties`` (``(B,)`` float64) entries equal
    ``cut_k``. The survivors' mass is the candidates' above ``cut_k`` plus the ties'; the cut
    is the first candidate where the mass from the top reaches ``top_p`` of it, or ``cut_k``
    itself if none does (the boundary ties, wherever they are, complete it). Masses are
    running float64 sums from the top (a sequential ``cumsum``), so the numbers do not depend
    on how many candidates follow the row's own ``k``. A tensor ``top_p`` of 1 or more (off,
    or invalid) gives 0, like :func:`top_p_cut`; ``on=True`` says no row's is (read on the
    host), which skips that mask.

    ``mass`` (``(B,)`` float64), when given, replaces the survivors' mass: the whole row's in
    the ``"joint"`` order. Where the candidates above ``cut_k`` do not reach ``top_p`` of it,
    top-p keeps at least the top-k set and the cut is ``cut_k``.
    """
    above = torch.where(candidates > cut_k[:, None], candidates, 0.0).to(torch.float64)
    running = above.cumsum(-1)
    if mass is None:
        mass = running[:, -1] + ties * cut_k.to(torch.float64)
    target = (top_p.to(torch.float64) if isinstance(top_p, Tensor) else top_p) * mass
    reached = running >= target[:, None]
    first = reached.to(torch.uint8).argmax(-1, keepdim=True)
    cut = candidates.gather(1, first).squeeze(1)
    cut = torch.where(reached.any(-1), cut, cut_k)
    return torch.where(top_p < 1, cut, 0.0) if isinstance(top_p, Tensor) and not on else cut


# Cuts are applied by dividing each row by its cut and zeroing what falls below 1, one scalar
# threshold for the whole batch (fast), instead of a per-row comparison and a masked fill.
# The division keeps every comparison with the cut exact (``w >= c`` iff ``fl(w / c) >= 1``)
# and scales a row uniformly, which the inverse CDF does not see. Cuts below a floor are
# raised to it so the scaled weights, their block sums and row totals stay finite in float32
# (totals up to V * 2**100 < 2**128): in a row whose cut is 0 (or tinier), weights under
# 2**-100 of the row's largest (float64: 2**-1000) are dropped, tokens ~69 T below the top
# logit with probability < 1e-30 each.
CUT_FLOOR = {torch.float32: 2.0**-100, torch.float64: 2.0**-1000}
BELOW_ONE = {torch.float32: 1.0 - 2.0**-24, torch.float64: 1.0 - 2.0**-53}


def predecessor(value: float, dtype: torch.dtype) -> float:
    """The largest ``dtype`` number below ``value`` rounded to ``dtype`` (``value >= 0``), in
    Python (no tensor, so no host read under ``torch.compile``)."""
    if dtype == torch.float64:
        return math.nextafter(value, 0.0)
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    if bits == 0:  # value rounds to 0 in float32: every weight is >= it
        return -1.0
    (below,) = struct.unpack("<f", struct.pack("<I", bits - 1))
    return below


def count_equal(weights: Tensor, value: Tensor) -> Tensor:
    """``(B,)`` count of entries equal to ``value[b]`` per row, as float64.

    ``w - v`` is exactly 0 iff ``w == v``; comparing that difference with 0 in place gives
    float 0/1 whose sum is exact (below 2**24 per row). On CPU this is ~4x faster than a
    broadcast ``==`` followed by a sum of the bool tensor.
    """
    return (weights - value[:, None]).eq_(0).sum(-1).to(torch.float64)


def keep_at_least(weights: Tensor, cut: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(weights / s) * [weights >= cut]`` per row with ``s = max(cut, floor)``; returns it
    (written to ``out`` if given, which may be ``weights``) and ``s``."""
    scale = cut.clamp_min(CUT_FLOOR[weights.dtype])
    scaled = (
        torch.div(weights, scale[:, None], out=out) if out is not None else weights / scale[:, None]
    )
    return torch.nn.functional.threshold_(scaled, BELOW_ONE[weights.dtype], 0.0), scale


# The survivors' mass is taken a few rows at a time through a scratch of this many elements
# (8 MiB of float32): a (B, V) temporary was a fresh, page-faulted block every call (~5 ms
# of a ~6 ms pass at B=64, V=128256).
_MASS_PIECE_ELEMENTS = 1 << 21


def kept_mass(weights: Tensor, cut: Tensor) -> Tensor:
    """``(B,)`` float64 mass of the entries ``>= cut`` per row: the block sums of
    :func:`keep_at_least`, times its scale (the same numbers as on the whole batch)."""
    batch, width = weights.shape
    rows = piece_rows(batch, width, weights.device, _MASS_PIECE_ELEMENTS)
    scratch = torch.empty(min(rows, batch), width, dtype=weights.dtype, device=weights.device)
    masses = []
    for piece, piece_cut in zip(weights.split(rows), cut.split(rows), strict=True):
        kept, scale = keep_at_least(piece, piece_cut, out=scratch[: piece.shape[0]])
        masses.append(block_sums(kept).sum(-1) * scale.to(torch.float64))
    return masses[0] if len(masses) == 1 else torch.cat(masses)


def row_cuts(
    weights: Tensor, peak: Tensor, controls: Controls, order: Tensor, maxima: Tensor | None
) -> Tensor | None:
    """The per-row threshold ``max(cut_k, cut_p, cut_min)`` on ``weights``, or None.

    ``order`` is the input (logits or probabilities, which order like ``weights``) and
    ``maxima`` its block maxima, for the candidate-block path of a static small ``top_k``.
    """
    batch, vocab = order.shape
    f64 = torch.zeros(batch, dtype=torch.float64, device=weights.device)
    cut: Tensor | None = None
    candidates: Tensor | None = None
    k = controls.top_k
    if isinstance(k, int) and k <= CANDIDATE_MAX_K:
        # The k-th largest input's weight is the k-th largest weight (the map is monotone);
        # read it from the buffer itself so the comparisons below are bitwise consistent.
        values, ids = largest_entries(order, k, maxima)
        # Past-the-end padding (and -inf logits) weigh 0, whatever id it was clamped to.
        candidates = torch.where(values > -math.inf, weights.gather(1, ids), 0.0)
        cut = candidates[:, -1]
    elif k is not None:
        k_rows = as_rows(k, batch, f64)
        cut = descending_threshold(weights, k_rows, "count")
        cut = torch.where((k_rows > 0) & (k_rows < vocab), cut, 0.0)
    cut_min = None
    if controls.min_p is not None:
        cut_min = as_rows(controls.min_p, batch, f64).to(weights.dtype) * peak
    if controls.top_p is not None:
        # Top-p's mass is that of the survivors of the cuts before it: top-k, and min-p too
        # in the "vllm" order (none in the "joint" order: the whole row's mass). Every such
        # cut is a threshold (the floor), and for thresholds at or above it the mass above
        # them is the same with or without the earlier cuts, so top-p needs only the
        # survivors' mass, not a masked copy.
        floor = None if controls.top_p_on_whole_row else cut
        if controls.top_p_on_whole_row:
            candidates = None  # the whole row's mass: the radix's first round reads it
        if controls.min_p_first:
            assert cut_min is not None
            floor = cut_min if floor is None else torch.maximum(floor, cut_min)
        if candidates is not None:
            # Every survivor above the floor is a candidate; the rest are ties at the floor,
            # anywhere in the row: count them (one compare pass, no masked copy).
            assert floor is not None
            ties = count_equal(weights, floor)
            cut_p = top_p_cut_from_candidates(candidates, floor, controls.top_p, ties)
        else:
            # None: the whole row's mass, read off the radix's first round.
            mass = None if floor is None else kept_mass(weights, floor)
            cut_p = top_p_cut(weights, controls.top_p, mass, peak, maxima, vocab, cut_min)
        cut = cut_p if cut is None else torch.maximum(cut, cut_p)
    if cut_min is not None:
        cut = cut_min if cut is None else torch.maximum(cut, cut_min)
    return cut
