"""The small-top-k draw on CPU in eager mode: few ops, none over torch's parallel grain.

:mod:`fastsample.ops.small_top_k` draws from the ``k`` best blocks without weighing the row.
On CPU in eager mode host reads cost nothing (no device to wait for), so this path decides on
the host what the fixed-shape steps compute for every row, and keeps only the ops the usual
call needs (about a hundred at B=1 instead of ~300; ``docs/cpu-primitive-costs.md``):

1. the ``need`` blocks with the largest maxima (``need`` = ``max(k)`` plus spares for ties,
   plus one) and ``floor``, the smallest of those maxima: the ``need`` largest entries of the
   row are among the entries of these blocks that reach ``floor``, which for continuous
   logits are barely more than ``need``. The blocks are scanned in pieces of fewer than
   :data:`~fastsample.ops.threads.GRAIN` entries (a row of them is 13,056 at ``k = 50``), so
   no op opens a parallel region, up to the batch where the scan is a pass of its own
   (:func:`~fastsample.ops.threads.serial_scan`, B >= 41 at ``k = 50``): then each of its
   steps is one op on torch's threads;
2. the weights of those candidates only, the k-th weight of each row, and one host read that
   decides the common case: ``x_low``, the smallest logit reaching the k-th weight, is the
   k-th logit or one of the few floats below it that weigh as much, and the
   ``need``-th largest entry lies below ``x_low`` (no entry outside the candidates can be
   kept). Top-N logprobs ask the same read whether the N largest are all candidates;
3. the cuts (:func:`~fastsample.ops.cuts.top_p_cut_from_candidates`, min-p) and the block
   sums of the kept candidate weights (bitwise the general path's: a block holding three or
   more is summed as a tile, as :func:`~fastsample.ops.inverse_cdf.block_sums` sums it);
4. the blocked inverse CDF (:func:`~fastsample.ops.inverse_cdf.inverse_cdf_draw`), which
   returns the drawn tokens' kept weights as well, and the top-N from the candidates.

One or two rows with one draw go to :mod:`.host_rows` first (the scalar work in Python
floats, ~20 tensor ops); this module serves them when that declines.

A short row (fewer blocks than ``need``) is its own candidates: one ``topk`` over the row, for
as many rows as stay under the grain.

Anything else (NaN or mostly masked rows, greedy rows of a tensor temperature, ties at the
k-th weight beyond the candidates, more short rows than the grain holds) returns None
before any uniform is drawn, and the caller takes :mod:`~fastsample.ops.small_top_k`'s general
steps: same numbers, more ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from . import host_floats, threads
from .cuts import BELOW_ONE, CUT_FLOOR, predecessor, top_p_cut_from_candidates
from .host_floats import any_value, below_one, finite, positive
from .inverse_cdf import BLOCK, BLOCK_SHIFT, inverse_cdf_draw, kept_block_sums
from .joint import joint_top_p_cut
from .noise import UniformSource
from .select import _largest_first
from .threads import GRAIN
from .validation import Controls
from .weights import logit_weights_divided_

# Entries reaching the floor per candidate past which the ties are too many for a short table
# (integer logits, masked rows): the general steps serve those calls.
_REACHING_MAX = 4
LOW_STEPS = 4
"""Floats below the k-th logit weighed for ``x_low`` (here and in :mod:`.host_rows`): past
them the tensor steps search."""

# Candidates beyond k for ties at the k-th logit, per dtype (as small_top_k._TIE_SPARES).
_TIE_SPARES = {torch.float32: 0, torch.bfloat16: 16, torch.float16: 16}
_TINY = torch.finfo(torch.float32).tiny


class HostDrawn(NamedTuple):
    """What :func:`draw` returns (the fields of :class:`~fastsample.ops.small_top_k.Drawn`
    plus the drawn tokens' kept weights and the top-N)."""

    token_ids: Tensor  # (B, n) int64, not yet clamped to V - 1
    genuine: Tensor  # (B, n) bool
    total: Tensor  # (B,) float64
    valid: Tensor  # (B,) bool
    read: object  # kept weights at (B, c) columns
    weights: Tensor  # (B, n) float64 kept weights of the drawn tokens
    top_ids: Tensor | None  # (B, N) the N largest logits' ids, ties by the lower index
    top_weights: Tensor | None  # (B, N) float64 their kept weights
    clean: bool = False  # every row valid and every draw genuine, known on the host
    token_probs: tuple[Tensor, Tensor] | None = None  # (B, n) float32 probs and logprobs


def candidate_sizes(
    dtype: torch.dtype, vocab: int, blocks: int, count: int, num_top: int
) -> tuple[int, int, bool]:
    """``(wide, need, short)``: the candidates that can be kept (the largest ``k``, spares for
    ties at the k-th logit, at least ``num_top``), one more (it tells whether they hold every
    entry that can be kept), and whether a row has fewer blocks than that (a short row: its
    own candidates)."""
    spare = min(_TIE_SPARES[dtype], vocab - count - 1)
    wide = max(count + spare, num_top)  # more candidates change no number, only the work
    return wide, wide + 1, wide + 1 > blocks


def draw(
    logits: Tensor,
    maxima: Tensor,
    controls: Controls,
    count: int,
    num_samples: int,
    source: UniformSource,
    num_top: int,
    few_survivors: bool = False,
) -> HostDrawn | None:
    """The draw of :func:`fastsample.ops.small_top_k.draw` for CPU eager calls (``logits``
    float32 or half, ``maxima`` its block maxima, ``count`` the largest ``k``), or None when
    the call needs the general steps (decided before any uniform is drawn); with
    ``few_survivors``, also when the k-th weight reaches min-p's cut in some row
    (:func:`~fastsample.ops.small_top_k.min_p_candidates`)."""
    batch, vocab = logits.shape
    blocks = maxima.shape[1]
    wide, need, short = candidate_sizes(logits.dtype, vocab, blocks, count, num_top)
    if batch == 0 or need > vocab or (short and batch * vocab >= GRAIN):
        return None
    temperature = controls.temperature
    host = host_floats.read_controls(controls, batch)
    t_rows = host.temperature
    if isinstance(temperature, Tensor) and not host_floats.within(t_rows, positive, any_value):
        return None  # greedy (or invalid) rows: the general steps handle them
    if short:  # the row's need largest directly (one op under the grain)
        top = torch.topk(logits, need, dim=1)
        floor = top.values[:, -1]
    else:
        chosen = torch.topk(maxima, need, dim=1, sorted=False)
        floor = chosen.values.amin(-1)
    # The row maximum from every block (a NaN propagates: topk need not pick a NaN block).
    peak = maxima.amax(-1)
    if not host_floats.within(floor.tolist() + peak.tolist(), finite, finite):
        return None  # a NaN, +inf or mostly masked row
    if short:
        values, ids = top.values, top.indices
    else:
        found = _reaching(logits, chosen.indices, floor, need)
        if found is None:
            return None
        values, ids = found  # (B, need) largest first, ids unclamped
    best = peak.to(torch.float32)
    divisor = _divisor(temperature, t_rows)

    def weigh(x: Tensor) -> Tensor:  # the general path's formula, on a few columns
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return logit_weights_divided_(out, x, best, divisor, in_pieces=True)

    wide_values = values[:, :wide]
    wide_weights = weigh(wide_values)
    k_lists = host.top_k
    k_low, k_high = (count, count) if k_lists is None else (min(k_lists), max(k_lists))
    if min(max(k_low, 1), count) == min(max(k_high, 1), count):  # one k for every row
        kth = min(max(k_low, 1), count)
        cut_k, x_k = wide_weights[:, kth - 1], wide_values[:, kth - 1]
    else:
        k_rows = [min(max(k, 1), count) for k in k_lists]  # type: ignore[union-attr]
        kth = torch.tensor(k_rows, device=logits.device).sub_(1)[:, None]
        cut_k, x_k = wide_weights.gather(1, kth).squeeze(1), wide_values.gather(1, kth).squeeze(1)
    if few_survivors and not top_k_cuts_no_survivor(cut_k, controls):
        return None
    # One host read: x_low, the smallest float32 reaching the k-th weight, is x_k or one of
    # the few floats below it (where the subtraction or the division rounds them together),
    # and the need-th largest lies below it, so every entry >= x_low is among the wide
    # candidates; and the num_top largest are candidates too (strictly above the need-th
    # largest). Also whether the num_top largest are distinct: then the candidates' order is
    # theirs.
    x_low = x_k.float()  # float32, as x_low is
    below = torch.nextafter(x_low, _NEG_INF.expand(batch))
    if bool((weigh(below[:, None]).squeeze(1) >= cut_k).any()):  # rarely: search lower
        x_low, found = _lowest_reaching(weigh, x_low, cut_k)
        common = found & (values[:, wide] < x_low)
    else:
        common = values[:, wide] < x_low
    distinct = True
    if num_top:
        common &= values[:, num_top - 1] > values[:, wide]
        steps = values[:, :num_top] > values[:, 1 : num_top + 1]  # none ties the next
        found_flags = torch.cat((common[:, None], steps), dim=1).all(0).tolist()
        if not found_flags[0]:
            return None
        distinct = all(found_flags[1:])
    elif not bool(common.all()):
        return None
    joint = None
    if controls.top_p_on_whole_row:  # top-p on the whole row's mass, bounded from the maxima
        # min-p's cut (the largest weight is 1): where top-p's cut lies below it, its exact
        # place does not matter
        cut_min = None if controls.min_p is None else _rows(controls.min_p, batch, logits.device)

        def joint(candidates: Tensor, cut_k: Tensor, ties: Tensor) -> Tensor:
            return joint_top_p_cut(logits, maxima, candidates, cut_k, ties, controls.top_p,
                                   best, divisor, readable=True, floor=cut_min)  # fmt: skip

    scale = _scale(wide_weights, wide_values, cut_k, x_low, count, controls, host, joint)
    below = BELOW_ONE[torch.float32]
    if few_survivors and (threshold := unscaled_min_p(controls)) is not None:
        scale, below = torch.ones_like(scale), threshold  # the general path's min-p alone

    def keep(w: Tensor) -> Tensor:  # controls.keep_at_least, on a few columns
        return torch.nn.functional.threshold_(w.div_(scale), below, 0.0)

    width = vocab + vocab % 2  # the general path's even-width weight buffer

    def read(columns: Tensor) -> Tensor:  # columns below width (the draw clamps them)
        if width == vocab:
            return keep(weigh(logits.gather(1, columns)))
        w = weigh(logits.gather(1, columns.clamp_max(vocab - 1)))
        return keep(torch.where(columns < vocab, w, 0.0))  # the buffer's padding weighs 0

    kept = keep(wide_weights.clone())
    sums = _block_sums(kept, ids[:, :wide], blocks, width).to(torch.float64)
    shape = torch.empty((), dtype=torch.float32, device=logits.device).expand(batch, width)
    drawn: list[Tensor] = []
    token_ids, genuine, total = inverse_cdf_draw(
        shape, num_samples, source, sums=sums, read=read, weights_out=drawn
    )
    weights = drawn[0] if num_samples == 1 else torch.cat(drawn, dim=1)
    valid = (total > 0) & (total < math.inf)
    if not host.fine:
        from .weights import controls_in_range

        valid = valid & controls_in_range(controls, batch, logits.device)
    top_ids = top_weights = None
    if num_top and distinct:  # the candidates come largest first
        top_ids, top_weights = ids[:, :num_top], kept[:, :num_top].to(torch.float64)
    elif num_top:  # equal values among them: ties by the lower index
        order = _largest_first(values[:, :wide], ids[:, :wide], num_top)
        top_ids = ids[:, :wide].gather(1, order)
        top_weights = kept.gather(1, order).to(torch.float64)
    return HostDrawn(token_ids, genuine, total, valid, read, weights, top_ids, top_weights)


def top_k_cuts_no_survivor(cut_k: Tensor, controls: Controls) -> bool:
    """Whether min-p's cut lies above the k-th weight ``cut_k`` (float32) in every row (the
    largest weight is 1): then the top-k cuts nothing min-p keeps, which
    :func:`~fastsample.ops.small_top_k.min_p_candidates` relies on (one host read)."""
    assert controls.min_p is not None
    return bool((cut_k < _rows(controls.min_p, cut_k.shape[0], cut_k.device)).all())


def unscaled_min_p(controls: Controls) -> float | None:
    """The threshold ``predecessor(min_p)`` where the general path cuts these controls as
    min-p alone with a Python number (one threshold for the batch, ``w > it``, with no
    division by the cut: :func:`fastsample.controls.processed_weights`), else None. The
    candidates of :func:`~fastsample.ops.small_top_k.min_p_candidates` keep their weights
    the same way (scale 1)."""
    if controls.top_p is None and isinstance(controls.min_p, float):
        return predecessor(controls.min_p, torch.float32)
    return None


def _lowest_reaching(weigh, x_k: Tensor, cut_k: Tensor) -> tuple[Tensor, Tensor]:
    """``x_low`` (``(B,)`` float32), the smallest float reaching the k-th weight ``cut_k``
    among ``x_k`` and the :data:`LOW_STEPS` floats below it, and whether it lies above the
    last of them (else the row needs the tensor steps' search)."""
    lows = [torch.nextafter(x_k, _NEG_INF.expand(x_k.shape[0]))]
    for _ in range(LOW_STEPS - 1):
        lows.append(torch.nextafter(lows[-1], _NEG_INF.expand(x_k.shape[0])))
    below = torch.stack(lows, dim=1)
    reach = (weigh(below) >= cut_k[:, None]).sum(-1)  # weights never rise below x_k
    lowest = below.gather(1, (reach - 1).clamp_min_(0)[:, None]).squeeze(1)
    return torch.where(reach > 0, lowest, x_k), reach < LOW_STEPS


def _scale(
    wide_weights: Tensor, wide_values: Tensor, cut_k: Tensor, x_low: Tensor, count: int,
    controls: Controls, host: host_floats.HostControls, joint: Callable | None = None,
) -> Tensor:  # fmt: skip
    """``(B, 1)`` float32 ``max(cut_k, cut_p, cut_min, CUT_FLOOR)`` by tensor ops; ``joint``
    gives top-p's cut in the joint order (from the candidates, ``cut_k`` and the ties)."""
    batch = wide_weights.shape[0]
    candidates = wide_weights[:, :count]
    cut = cut_k
    cut_min = None
    if controls.min_p is not None:  # the largest weight is 1
        cut_min = _rows(controls.min_p, batch, wide_weights.device)
    if controls.top_p is not None:
        floor_p = cut_k
        # The entries reaching x_low weigh cut_k or more: those not above it tie it.
        reaching = (wide_values >= x_low[:, None]).sum(-1, dtype=torch.float64)
        ties = reaching - (candidates > cut_k[:, None]).sum(-1)
        if controls.min_p_first:  # top-p's mass: the survivors of min-p and top-k
            assert cut_min is not None
            floor_p = torch.maximum(cut_k, cut_min)
            at_floor = (candidates == floor_p[:, None]).sum(-1, dtype=torch.float64)
            ties = torch.where(floor_p > cut_k, at_floor, ties)
        top_p = controls.top_p
        cut_on = host.top_p is None or host_floats.within(host.top_p, any_value, below_one)
        if joint is not None:
            cut_p = joint(candidates, cut_k, ties)
        else:
            cut_p = top_p_cut_from_candidates(candidates, floor_p, top_p, ties, cut_on)
        cut = torch.maximum(cut, cut_p)
    if cut_min is not None:
        cut = torch.maximum(cut, cut_min)
    return cut.clamp_min(CUT_FLOOR[torch.float32])[:, None]


_NEG_INF = torch.full((), -math.inf, dtype=torch.float32)


def _divisor(temperature: object, t_rows: list) -> Tensor | float | None:
    """:func:`~fastsample.ops.weights.temperature_divisor` for float32 weights, in one op or
    none when every row's value is usable as it is (checked on the host)."""
    if not isinstance(temperature, Tensor):
        if temperature is None or temperature == 0.0:
            return None
        return max(float(temperature), _TINY)  # type: ignore[arg-type]
    if host_floats.within(t_rows, _TINY.__le__, finite):
        divisor = temperature if temperature.dtype == torch.float32 else temperature.float()
        return divisor[:, None]
    from .weights import temperature_divisor

    return temperature_divisor(temperature, torch.float32)


def _rows(value: float | Tensor, batch: int, device: torch.device) -> Tensor:
    """A control as ``(B,)`` float32 (through float64, as :func:`~fastsample.ops.cuts.as_rows`
    and the general path round it)."""
    if isinstance(value, Tensor):
        return value.to(torch.float64).to(torch.float32)
    return torch.full((batch,), value, dtype=torch.float64, device=device).to(torch.float32)


def _reaching(
    logits: Tensor, blocks: Tensor, floor: Tensor, need: int
) -> tuple[Tensor, Tensor] | None:
    """The ``need`` largest entries of each row (values largest first, unclamped ids), from
    the entries of ``blocks`` (``(B, need)``) that reach ``floor``; None when a row has too
    many such entries (ties) for a short table.

    The blocks are read in pieces of fewer than :data:`GRAIN` entries and the hits go through
    ``gather``/``scatter`` on flat views (advanced indexing opens a parallel region from 3,000
    elements), so no op here opens one."""
    batch = logits.shape[0]
    pair, col, value = _scan(logits, blocks, floor, need)
    if batch == 1:  # one row: no table, the hits themselves
        if value.shape[0] > _REACHING_MAX * need:
            return None
        best = torch.topk(value, need)
        ids = blocks.view(-1).gather(0, pair).mul_(BLOCK).add_(col).gather(0, best.indices)
        return best.values[None], ids[None]
    row = pair // need
    per_row = torch.bincount(row, minlength=batch)
    width = max(per_row.tolist())
    if width > _REACHING_MAX * need:
        return None
    start = per_row.cumsum(0).sub_(per_row)
    place = row.mul(width).add_(torch.arange(row.shape[0], device=row.device)).sub_(
        start.gather(0, row)
    )  # row * width + the hit's slot in its row
    table = torch.full((batch * width,), -math.inf, dtype=logits.dtype, device=logits.device)
    table.scatter_(0, place, value)
    where = torch.empty(batch * width, dtype=torch.int64, device=logits.device)
    where.scatter_(0, place, blocks.view(-1).gather(0, pair).mul_(BLOCK).add_(col))
    best = torch.topk(table.view(batch, width), need, dim=1)
    return best.values, where.view(batch, width).gather(1, best.indices)


def _scan(
    logits: Tensor, blocks: Tensor, floor: Tensor, need: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(pair, column, value)`` of the entries of the candidate blocks that reach ``floor``:
    pair ``j`` is block ``blocks[j // need, j % need]``, column the entry's place in it.
    Blocks go in pieces of fewer than :data:`GRAIN` entries (no parallel region)."""
    batch, vocab = logits.shape
    pairs, cols, values = [], [], []
    if vocab % BLOCK == 0 and logits.is_contiguous():  # whole blocks: a (B * n, BLOCK) view
        return _scan_whole_blocks(logits, blocks, floor, need)
    else:  # a short last block or strided rows: per-entry gathers, whole rows per piece
        per_row = need * BLOCK
        rows_per = max(1, (GRAIN - 1) // per_row)
        spans = max(1, -(-per_row // (GRAIN - 1)))  # pieces of one row's blocks
        span = -(-need // spans)
        offsets = _offsets(logits.device)
        for first in range(0, batch, rows_per):
            last = min(first + rows_per, batch)
            for lo in range(0, need, span):
                chosen = blocks[first:last, lo : lo + span]
                width = chosen.shape[1]
                columns = (chosen[:, :, None] * BLOCK + offsets).view(last - first, -1)
                content = logits[first:last].gather(1, columns.clamp_max(vocab - 1))
                if vocab % BLOCK:
                    content.masked_fill_(columns >= vocab, -math.inf)
                floors = floor[first:last, None].expand(-1, width).reshape(-1)
                pair, col, value = _hits(content.view(-1, BLOCK), floors)
                # block i of this piece is pair (first + i // width) * need + lo + i % width
                pairs.append((pair // width + first).mul_(need).add_(pair % width + lo))
                cols.append(col)
                values.append(value)
    if len(pairs) == 1:
        return pairs[0], cols[0], values[0]
    return torch.cat(pairs), torch.cat(cols), torch.cat(values)


def _scan_whole_blocks(
    logits: Tensor, blocks: Tensor, floor: Tensor, need: int
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_scan` for contiguous rows of whole blocks, in two sweeps: the maxima of the
    candidate blocks' groups of 32 (a block copy and an ``amax`` per piece), then, over all
    pieces at once, the groups reaching the floor and their entries (a few per candidate)."""
    batch, vocab = logits.shape
    full = vocab // BLOCK
    per_block = BLOCK // _GROUP
    pairs = batch * need
    if batch == 1:  # the candidate blocks as rows of the view
        rows = blocks.view(-1)
    else:
        rows = blocks.add(torch.arange(0, batch * full, full, device=logits.device)[:, None])
        rows = rows.view(-1)
    source = logits.view(batch * full, BLOCK)
    per_row = need * per_block  # group g belongs to row g // per_row
    if threads.serial_scan(logits.device, pairs * BLOCK):
        step = (GRAIN - 1) // BLOCK  # blocks a piece
        maxima = torch.empty(pairs * per_block, dtype=logits.dtype, device=logits.device)
        for start in range(0, pairs, step):
            content = source.index_select(0, rows[start : start + step])
            piece = maxima[start * per_block : (start + step) * per_block]
            torch.amax(content.view(-1, _GROUP), -1, out=piece)
        rows_per, groups_per = max(1, (GRAIN - 1) // per_row), step * per_block
    else:  # a large batch: each step one op over all blocks (torch's threads)
        maxima = threads.watched(
            logits.device, lambda: source.index_select(0, rows).view(-1, _GROUP).amax(-1)
        )
        rows_per, groups_per = batch, pairs * per_block
    groups = source.view(-1, _GROUP)
    if batch > 1:  # each candidate group's floor (its row's)
        group_floors = floor[:, None].expand(batch, per_row).reshape(-1)
    out_pairs, out_cols, out_values = [], [], []
    for first_row in range(0, batch, rows_per):
        piece = maxima[first_row * per_row : (first_row + rows_per) * per_row]
        reached = piece.view(-1, per_row) >= floor[first_row : first_row + rows_per, None]
        group = reached.view(-1).nonzero().squeeze(1)
        if first_row:
            group = group.add_(first_row * per_row)
        for first in range(0, group.shape[0], groups_per):
            chosen = group[first : first + groups_per]
            # shifts and masks, not // and %: torch's int64 division is scalar (~3 ns an
            # element), shifts are vectorized
            pair = chosen >> _GROUPS_SHIFT
            where = rows.gather(0, pair).mul_(per_block).add_(chosen & (per_block - 1))
            picked = groups.index_select(0, where)
            floor_of = group_floors.gather(0, chosen) if batch > 1 else floor
            # flat positions of the hits: entry e of picked group i is i * _GROUP + e
            hit = (picked >= floor_of[:, None]).view(-1).nonzero().squeeze(1)
            which, place = hit >> _GROUP_SHIFT, hit & (_GROUP - 1)
            out_values.append(picked.view(-1).gather(0, hit))
            out_pairs.append(pair.gather(0, which))
            column = chosen.gather(0, which).bitwise_and_(per_block - 1).mul_(_GROUP)
            out_cols.append(column.add_(place))
    if len(out_pairs) == 1:
        return out_pairs[0], out_cols[0], out_values[0]
    return torch.cat(out_pairs), torch.cat(out_cols), torch.cat(out_values)


_GROUP = 32  # entries per group of the two-level scan
_GROUP_SHIFT = 5  # log2(_GROUP)
_GROUPS_SHIFT = 3  # log2(BLOCK // _GROUP): a candidate block's groups
assert _GROUP == 1 << _GROUP_SHIFT and BLOCK == _GROUP << _GROUPS_SHIFT


def _hits(content: Tensor, floors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(block, column, value)`` of the entries of ``content`` (``(c, BLOCK)``) reaching their
    block's floor (``floors``, ``(c,)``): the groups of 32 whose maximum reaches it, then their
    entries (a compare and ``nonzero`` over a few groups, not over every entry: ~4x fewer
    microseconds a piece). Rows with NaN never get here (:func:`draw` checks)."""
    blocks = content.shape[0]
    per_block = BLOCK // _GROUP
    groups = content.view(blocks * per_block, _GROUP)
    reach = (groups.amax(-1).view(blocks, per_block) >= floors[:, None]).view(-1)
    group = reach.nonzero().squeeze(1)
    picked = groups.index_select(0, group)
    floor_of = floors.gather(0, group // per_block)
    which, place = (picked >= floor_of[:, None]).nonzero(as_tuple=True)
    value = picked.view(-1).gather(0, which * _GROUP + place)
    group = group.gather(0, which)
    return group // per_block, (group % per_block).mul_(_GROUP).add_(place), value


_OFFSETS: dict[torch.device, Tensor] = {}


def _offsets(device: torch.device) -> Tensor:
    cached = _OFFSETS.get(device)
    if cached is None:
        with torch.inference_mode(False):
            cached = _OFFSETS[device] = torch.arange(BLOCK, device=device)
    return cached


def _block_sums(kept: Tensor, ids: Tensor, blocks: int, width: int) -> Tensor:
    """``(B, blocks)`` float32 block sums of the candidates' kept weights (``kept``, ``ids``
    ``(B, c)``; every other entry is cut): bitwise the general path's block sums."""
    return kept_block_sums(kept, ids >> BLOCK_SHIFT, ids & (BLOCK - 1), blocks, width)
