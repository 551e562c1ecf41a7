"""Top-p in the ``"joint"`` order from a row's top-k candidates, without weighing the row.

In the joint order (SGLang's sampler, FlashInfer's ``filter_apply_order="joint"``) top-p's
mass is the whole row's, ``Z``, not the top-k survivors'. The candidate paths
(:mod:`.small_top_k`, :mod:`.host_top_k`, :mod:`.host_rows`) weigh only the ``k`` largest
entries, so ``Z`` is first bounded from the block maxima they already have; rows whose cut
those bounds leave open get a tighter lower bound from the maxima of 32-entry groups (a max
pass over the row), and only rows still open pay one pass of ``exp`` for the exact ``Z``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from itertools import accumulate

import torch
from torch import Tensor

from . import threads
from .cuts import top_p_cut_from_candidates
from .inverse_cdf import BLOCK, block_sums
from .pieces import piece_rows
from .weights import logit_weights_divided_

__all__ = ["exact_masses", "host_mass_bounds", "joint_top_p_cut", "row_mass"]


# Relative slack on the bounds of a row's mass: far above the float rounding of a float64 sum
# of float32 weights, far below any top-p gap that matters (a row whose cut the slack could
# move takes the exact mass instead).
_MASS_SLACK = 1e-5
# The exact mass is summed a few rows at a time through pieces of this many elements.
_MASS_PIECE_ELEMENTS = 1 << 21


def joint_top_p_cut(
    logits: Tensor,
    maxima: Tensor,
    candidates: Tensor,
    cut_k: Tensor,
    ties: Tensor,
    top_p: float | Tensor,
    shift: Tensor,
    divisor: Tensor | float | None,
    readable: bool,
    floor: Tensor | None = None,
) -> Tensor:
    """Top-p's cut on the whole row's mass (the ``"joint"`` order), from the candidates.

    The cut is the first candidate whose running mass reaches ``top_p`` of the row's mass
    ``Z``, or ``cut_k`` when none above it does (top-p then keeps the whole top-k set); it only
    moves one way as ``Z`` grows. ``Z`` is bounded from the block maxima alone: the top-k set's
    mass plus, outside it, at least each block's largest entry below ``cut_k`` and at most
    ``BLOCK`` entries of ``min(block maximum, cut_k)`` a block. Where the cuts at both bounds
    agree (read on the host, CPU eager: real logits' tails are light, and a heavy tail puts
    the cut at ``cut_k`` either way), that is the cut; otherwise (and on CUDA or under
    ``torch.compile``, where reading would sync) the exact ``Z``, one pass of ``exp`` over the
    row, decides. ``floor`` (``(B,)``, min-p's cut, which the caller applies after): a row
    whose cut at the lower bound, the highest it can be, is at most ``floor`` is settled too,
    with that cut (the kept set is min-p's either way, and ``max(cut, floor)`` the same).
    """
    f64 = torch.float64
    kept_k = torch.where(candidates > cut_k[:, None], candidates, 0.0).sum(-1, dtype=f64)
    kept_k = kept_k + ties * cut_k.to(f64)
    if readable:
        blocks = maxima.shape[1]
        block_weights = torch.where(
            maxima > -math.inf,
            logit_weights_divided_(
                torch.empty_like(maxima, dtype=torch.float32), maxima.float(), shift, divisor,
                in_pieces=True,
            ),
            0.0,
        )
        sizes = torch.full((blocks,), float(BLOCK), dtype=f64, device=logits.device)
        sizes[-1] = logits.shape[1] - (blocks - 1) * BLOCK
        below = torch.where(block_weights < cut_k[:, None], block_weights, 0.0)
        low = kept_k + below.sum(-1, dtype=f64)
        high = kept_k + torch.minimum(block_weights, cut_k[:, None]).to(f64).mv(sizes)
        at_low = top_p_cut_from_candidates(
            candidates, cut_k, top_p, ties, mass=low * (1 - _MASS_SLACK)
        )
        at_high = top_p_cut_from_candidates(
            candidates, cut_k, top_p, ties, mass=high * (1 + _MASS_SLACK)
        )
        # Rows with a NaN or infinite logit are invalid whatever their cut.
        settled = (at_low == at_high) | ~torch.isfinite(low) | ~torch.isfinite(high)
        if floor is not None:
            settled |= at_low <= floor
        if bool(settled.all()):
            return at_low
        # The unsettled rows only (host indices: CPU eager): a tighter lower bound from the
        # maxima of groups of GROUP entries (a max pass, no exp over the row), then the
        # exact mass of the rows that bound leaves open.

        def cut_of(rows: Tensor, mass: Tensor) -> Tensor:  # top-p's cut of those rows
            p_rows = top_p.index_select(0, rows) if isinstance(top_p, Tensor) else top_p
            return top_p_cut_from_candidates(
                candidates.index_select(0, rows), cut_k.index_select(0, rows), p_rows,
                ties.index_select(0, rows), mass=mass,
            )  # fmt: skip

        rows = (~settled).nonzero().squeeze(1)
        finer = _group_bound(logits, rows.tolist(), shift, divisor, cut_k, kept_k)
        at_finer = cut_of(rows, finer * (1 - _MASS_SLACK))
        at_low = at_low.index_copy(0, rows, at_finer)
        now_settled = at_finer == at_high.index_select(0, rows)
        if floor is not None:
            now_settled |= at_finer <= floor.index_select(0, rows)
        settled = settled.index_copy(0, rows, now_settled)
        if bool(settled.all()):
            return at_low
        rows = (~settled).nonzero().squeeze(1)
        exact = exact_masses(logits, rows.tolist(), shift, divisor)
        return at_low.index_copy(0, rows, cut_of(rows, exact))
    return top_p_cut_from_candidates(
        candidates, cut_k, top_p, ties, mass=row_mass(logits, shift, divisor)
    )


def row_mass(logits: Tensor, shift: Tensor, divisor: Tensor | float | None) -> Tensor:
    """``(B,)`` float64 sum of every entry's weight (the general path's formula), a few rows at
    a time."""
    batch, vocab = logits.shape
    rows = piece_rows(batch, vocab, logits.device, _MASS_PIECE_ELEMENTS)
    scratch = torch.empty(min(rows, batch), vocab, dtype=torch.float32, device=logits.device)
    masses = []
    for start in range(0, batch, rows):
        piece = slice(start, min(start + rows, batch))
        out = scratch[: piece.stop - piece.start]
        part = divisor[piece] if isinstance(divisor, Tensor) else divisor
        masses.append(
            block_sums(logit_weights_divided_(out, logits[piece], shift[piece], part)).sum(-1)
        )
    return masses[0] if len(masses) == 1 else torch.cat(masses)


GROUP = 32
"""Entries per group in the finer lower bound of the row's mass."""


def _group_bound(
    logits: Tensor, rows: list[int], shift: Tensor, divisor: Tensor | float | None,
    cut_k: Tensor, kept_k: Tensor,
) -> Tensor:  # fmt: skip
    """``(len(rows),)`` float64 lower bounds on the listed rows' mass: the top-k set's mass
    plus, outside it, each group's largest entry below ``cut_k`` (entries below ``cut_k``
    are outside the top-k set; a group's maximum is one of its entries)."""
    vocab = logits.shape[1]
    full = vocab // GROUP
    bounds = []
    for b in rows:
        # Group maxima in pieces under the grain (a row is past it: no parallel region).
        row = torch.empty(1, full, dtype=logits.dtype, device=logits.device)
        threads.blockwise_(logits[b : b + 1, : full * GROUP], row, GROUP, "amax")
        if vocab % GROUP:
            row = torch.cat([row, logits[b : b + 1, full * GROUP :].amax(-1, keepdim=True)], 1)
        part = divisor[b : b + 1] if isinstance(divisor, Tensor) else divisor
        out = torch.empty(1, row.shape[1], dtype=torch.float32, device=logits.device)
        weights = logit_weights_divided_(out, row.float(), shift[b : b + 1], part, in_pieces=True)
        below = torch.where(weights < cut_k[b], weights, 0.0)
        bounds.append(below.sum(-1, dtype=torch.float64) + kept_k[b])
    return torch.cat(bounds)


def exact_masses(
    logits: Tensor, rows: list[int], shift: Tensor, divisor: Tensor | float | None
) -> Tensor:
    """:func:`row_mass` of the listed rows (the same numbers), one at a time and in pieces of
    whole blocks under torch's parallel grain, so that no op opens a parallel region
    (:mod:`fastsample.ops.threads`); through one piece of scratch (no copy of the rows, no
    fresh block per row: large fresh blocks cost page faults)."""
    vocab = logits.shape[1]
    step = (threads.GRAIN - 1) // BLOCK * BLOCK
    scratch = torch.empty(1, min(step, vocab), dtype=torch.float32, device=logits.device)
    masses = []
    for b in rows:
        part = divisor[b : b + 1] if isinstance(divisor, Tensor) else divisor
        sums = []
        for start in range(0, vocab, step):
            stop = min(start + step, vocab)
            out = scratch[:, : stop - start]
            piece = logits[b : b + 1, start:stop]
            weights = logit_weights_divided_(out, piece, shift[b : b + 1], part, in_pieces=True)
            sums.append(block_sums(weights))
        masses.append(torch.cat(sums, 1).sum(-1))
    return torch.cat(masses)


def host_mass_bounds(
    logits: Tensor, maxima: Tensor, peaks: list[float], divisors: list[float | None]
) -> Callable[[int, float, float], tuple[float, float, Callable[[], float]]]:
    """For :mod:`.host_rows` (one or two rows, Python floats): ``bounds(b, cut_k,
    top_k_mass)`` gives row ``b``'s mass bounds (slack included, as in
    :func:`joint_top_p_cut`) and a function computing its exact mass.

    Each row's block-maximum weights are sorted once (a few tensor ops); a bound is then a
    bisection and two prefix sums in Python. The upper bound counts ``BLOCK`` entries in the
    last block too (a bound still)."""
    shift = torch.tensor(peaks, dtype=torch.float32, device=logits.device)
    rows = []
    for b, divisor in enumerate(divisors):
        out = torch.empty(1, maxima.shape[1], dtype=torch.float32, device=logits.device)
        weights = logit_weights_divided_(out, maxima[b : b + 1].float(), shift[b : b + 1],
                                         divisor)[0].sort().values  # fmt: skip
        ascending = weights.tolist()
        rows.append((ascending, list(accumulate(ascending, initial=0.0))))

    def bounds(b: int, cut_k: float, top_k_mass: float):
        ascending, prefix = rows[b]
        below = bisect_left(ascending, cut_k)  # block maxima < cut_k
        tail = prefix[below]
        low = top_k_mass + tail
        high = top_k_mass + BLOCK * (tail + (len(ascending) - below) * cut_k)

        def exact() -> float:
            return float(exact_masses(logits, [b], shift, divisors[b])[0])

        return low * (1 - _MASS_SLACK), high * (1 + _MASS_SLACK), exact

    return bounds
