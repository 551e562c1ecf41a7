"""The cuts, block sums and draw of one or two rows (:mod:`.host_rows`), in Python floats.

At B = 1-2 on CPU (eager) every tensor op costs a few microseconds whatever its size, and
the candidates are ~50 numbers a row: Python floats do the scalar work with fewer
microseconds, and bitwise the same numbers:

* Python floats are IEEE float64, as torch's CPU float64 ops: the top-p masses (a sequential
  ``cumsum``, then ``ties * cut`` and ``top_p * mass``), the block prefix, the target and the
  fraction of the blocked inverse CDF, the prefix inside the chosen block;
* float32 values (the weights, the cuts) are exact Python floats, and a float32 sum,
  difference or quotient is the float64 one rounded once to float32 (``_f32``: double
  rounding is innocuous for these operations when 53 >= 2 * 24 + 2);
* a block holding three or more kept weights is summed by torch (its order is the
  vectorized one), and the weights themselves (``exp``) come from torch.

:func:`scales` gives each row's cut (as :func:`fastsample.ops.cuts.top_p_cut_from_candidates`
and the maxima of the cuts), :func:`block_values` the blocks holding kept weights (their sums
and entries), :func:`draw_one` one draw (as :func:`fastsample.ops.inverse_cdf.inverse_cdf_draw`,
from those blocks alone: no entry of the logits is read again)."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import NamedTuple

import torch

from .cuts import CUT_FLOOR
from .inverse_cdf import BLOCK, BLOCK_SHIFT, tile_sums
from .validation import Controls

HOST_ROWS = 2
"""Rows up to which :mod:`.host_rows` does the scalar work here (measured on the 2-core Xeon,
T/k/p tensors at V = 128,256: 85 us saved at B=1, 50 at B=2, even at B=4, 0.15 ms lost at B=8)."""

_CUT_FLOOR = CUT_FLOOR[torch.float32]


def rounded(values: Sequence[float]) -> array:
    """``values`` rounded to float32 (to nearest, ties to even; past float32's range, an
    infinity, as torch's float32 arithmetic gives it), all in one C loop."""
    return array("f", values)


def _f32(value: float) -> float:
    return rounded((value,))[0]


class HostControls(NamedTuple):
    """A call's controls read on the host once (:func:`read_controls`), for the host paths:
    each row's temperature, and the rows of the tensor controls (None where a control is a
    number or off)."""

    temperature: list  # per row (a number or None repeated when not a tensor)
    top_k: list | None
    top_p: list | None
    min_p: list | None
    fine: bool  # every tensor control holds a legal value (then no row is flagged for it)
    controls: Controls  # what was read

    def rows(self, name: str) -> list | None:
        """A control's per-row values (None when off): the host copy of a tensor, else its
        number once a row."""
        value = getattr(self.controls, name)
        if value is None:
            return None
        read = getattr(self, name)
        return read if read is not None else [value] * len(self.temperature)


def read_controls(controls: Controls, batch: int) -> HostControls:
    """One host read of each tensor control, and whether all of them are legal (the range
    check of :func:`~fastsample.ops.weights.controls_in_range`, by C-level ``min``/``max``)."""
    t, k, p, mp = controls.temperature, controls.top_k, controls.top_p, controls.min_p
    lists = [v.tolist() if isinstance(v, torch.Tensor) else None for v in (t, k, p, mp)]
    t_rows = lists[0] if lists[0] is not None else [t] * batch
    fine = (
        within(lists[0], _non_negative, _below_inf)
        and within(lists[1], _non_negative, any_value)
        and within(lists[2], positive, _at_most_one)
        and within(lists[3], _non_negative, _at_most_one)
    )
    return HostControls(t_rows, lists[1], lists[2], lists[3], fine, controls)


def within(values: list | None, low_ok: Callable, high_ok: Callable) -> bool:
    """Whether every value passes both bounds (``low_ok`` on the smallest, ``high_ok`` on the
    largest; a NaN fails), by C-level ``sum``, ``min`` and ``max`` rather than a Python loop
    per row. True for None or no values."""
    if not values:
        return True
    if len(values) == 1:  # one row (the common serving batch): no reductions
        value = values[0]
        return value == value and low_ok(value) and high_ok(value)
    total = sum(values)  # NaN if any value is (or if +inf and -inf meet: then a bound fails)
    return total == total and low_ok(min(values)) and high_ok(max(values))


# Bounds for within():
def positive(value: float) -> bool:
    return value > 0


def any_value(value: float) -> bool:
    return True


def below_one(value: float) -> bool:
    return value < 1


def finite(value: float) -> bool:
    return -math.inf < value < math.inf


def _non_negative(value: float) -> bool:
    return value >= 0


def _below_inf(value: float) -> bool:
    return value < math.inf


def _at_most_one(value: float) -> bool:
    return value <= 1


def scales(
    weights: Sequence[Sequence[float]],
    values: Sequence[Sequence[float]],
    k_rows: Sequence[int],
    count: int,
    x_lows: Sequence[float],
    host: HostControls,
    row_mass_bounds: Callable[[int, float, float], tuple[float, float, Callable[[], float]]]
    | None = None,
) -> list[float]:
    """Each row's ``max(cut, CUT_FLOOR)`` (float32 values): the k-th weight, top-p's cut on
    the candidates (``weights[b][:count]``, largest first; ``values`` their logits, which hold
    every entry at or above ``x_lows[b]``, the smallest logit reaching the k-th weight), min-p.

    ``row_mass_bounds(b, cut_k, top_k_mass)``, in the ``"joint"`` order: bounds on row ``b``'s
    whole mass and a function giving it exactly (see :mod:`.joint`); top-p's cut is taken on
    it, from the bounds where they agree."""
    batch, controls = len(weights), host.controls
    p_rows, mp_rows = host.rows("top_p"), host.rows("min_p")
    tensor_p = controls.top_p is not None and not isinstance(controls.top_p, float)
    out = []
    for b in range(batch):
        w, v, k = weights[b], values[b], k_rows[b]
        cut_k, x_low = w[k - 1], x_lows[b]
        cut = cut_k
        cut_min = None if mp_rows is None else _f32(float(mp_rows[b]))  # via float64, as torch
        if p_rows is not None:
            candidates = w[:count]
            floor = cut_k
            # The entries reaching x_low weigh cut_k or more: those not above it tie it.
            ties = float(sum(map(x_low.__le__, v)) - sum(map(cut_k.__lt__, candidates)))
            if controls.min_p_first:
                assert cut_min is not None
                floor = max(cut_k, cut_min)
                if floor > cut_k:
                    ties = float(sum(map(floor.__eq__, candidates)))
            p = float(p_rows[b])
            if row_mass_bounds is not None:  # the joint order: the whole row's mass
                cut_p = _joint_top_p_cut(candidates, cut_k, p, ties, tensor_p,
                                         row_mass_bounds, b, cut_min)  # fmt: skip
            else:
                cut_p = _top_p_cut(candidates, floor, p, ties, tensor_p)
            cut = max(cut, cut_p)
        if cut_min is not None:
            cut = max(cut, cut_min)
        out.append(max(cut, _CUT_FLOOR))
    return out


def _joint_top_p_cut(
    candidates, cut_k, p, ties, tensor, row_mass_bounds, b, cut_min=None
) -> float:  # fmt: skip
    """:func:`fastsample.ops.joint.joint_top_p_cut` for one row (``cut_min``: its ``floor``)."""
    top_k_mass = sum(x for x in candidates if x > cut_k) + ties * cut_k
    low, high, exact = row_mass_bounds(b, cut_k, top_k_mass)
    at_low = _top_p_cut(candidates, cut_k, p, ties, tensor, mass=low)
    if cut_min is not None and at_low <= cut_min:  # min-p cuts deeper whatever the mass
        return at_low
    if at_low == _top_p_cut(candidates, cut_k, p, ties, tensor, mass=high):
        return at_low
    return _top_p_cut(candidates, cut_k, p, ties, tensor, mass=exact())


def _top_p_cut(
    candidates: Sequence[float], floor: float, p: float, ties: float, tensor: bool,
    mass: float | None = None,
) -> float:  # fmt: skip
    """:func:`fastsample.ops.cuts.top_p_cut_from_candidates` for one row (``mass``: the
    mass top-p takes its share of, if not the survivors')."""
    if tensor and not p < 1:  # off (1) or out of range: no cut
        return 0.0
    # The float64 masses left to right, as torch's cumsum; they never decrease, so the first
    # one reaching the target is found by bisection.
    runs = list(accumulate(x if x > floor else 0.0 for x in candidates))
    target = p * (runs[-1] + ties * floor if mass is None else mass)
    first = bisect_left(runs, target)
    return candidates[first] if first < len(runs) else floor


_block = tuple.__new__
_IN_BLOCK = BLOCK - 1  # a column's place in its block: column & this


class Block(NamedTuple):
    """A block holding kept weights: its index, its float32 sum, its nonzero entries
    ``(column in the block, weight)`` in column order."""

    index: int
    total: float
    entries: list[tuple[int, float]]


def block_values(
    kept: Sequence[Sequence[float]], ids: Sequence[Sequence[int]], width: int
) -> list[list[Block]]:
    """Per row, the blocks holding kept weights, in block order. ``kept``, ``ids``: the
    candidates' kept weights and token ids (below ``width``, the even-width weight buffer's);
    no other entry is kept (the caller checked). A block holding three or more is summed by
    torch as the general path sums it (:func:`~fastsample.ops.inverse_cdf.tile_sums`, one
    call for all of them): that order is the vectorized one."""
    out, crowded = [], []
    for weights, columns in zip(kept, ids, strict=True):
        groups: dict[int, list[tuple[int, float]]] = {}  # block -> its (column, weight)
        for column, weight in zip(columns, weights, strict=True):
            if weight > 0:
                groups.setdefault(column >> BLOCK_SHIFT, []).append((column & _IN_BLOCK, weight))
        row: list[Block] = []
        for block in sorted(groups):
            members = groups[block]
            if len(members) == 1:
                total = members[0][1]
            else:
                members.sort()  # column order
                if len(members) == 2:  # one rounding whatever the order
                    total = _f32(members[0][1] + members[1][1])
                else:
                    crowded.append((len(out), len(row)))
                    total = 0.0  # below
            row.append(_block(Block, (block, total, members)))  # no Python-level __new__
        out.append(row)
    if crowded:
        sums = _tile_sums([out[b][i] for b, i in crowded], width)
        for (b, i), total in zip(crowded, sums, strict=True):
            out[b][i] = out[b][i]._replace(total=total)
    return out


def _tile_sums(blocks: list[Block], width: int) -> list[float]:
    """The float32 sums of ``blocks`` laid out in ``BLOCK`` tiles, as torch sums them."""
    tiles = torch.zeros(len(blocks), BLOCK, dtype=torch.float32)
    places = [(t, column, weight) for t, b in enumerate(blocks) for column, weight in b.entries]
    rows, columns, weights = zip(*places, strict=True)
    tiles.index_put_((torch.tensor(rows), torch.tensor(columns)),
                     torch.tensor(weights, dtype=torch.float32))  # fmt: skip
    return tile_sums(tiles, torch.tensor([b.index for b in blocks]), width).tolist()


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
