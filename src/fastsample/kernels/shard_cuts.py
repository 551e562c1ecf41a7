"""The shard-local steps of one vocabulary-parallel round after the summaries, as one kernel
(:mod:`fastsample.distributed.cuts` and :mod:`fastsample.distributed.shard` are the
references; the collectives stay with the caller, :mod:`fastsample.distributed.triton_round`).

Each launch of :func:`step` does the local work between two collectives: it reads what the
previous collectives left (the gathered summaries, the merged candidates, the global radix
histograms, the global tie count), recomputes from them, identically on every rank, the cuts
known so far, and writes the payload of the next collective:

* ``TOP``: the shard's ``k`` largest weights (the torch path's candidates, as a multiset: the
  local ``k``-th largest ``t`` by radix rounds inside the kernel, the weights ``> t``
  compacted, the rest of the ``k`` slots ``t``; a shard with fewer than ``k`` entries pads
  with 0). All-gathered;
* ``HIST_K`` / ``HIST_P``: one radix round's ``(B, 2**width)`` histogram of counts (top-k) or
  masses (top-p, of the survivors ``w >= floor`` of the cuts before it: top-k's ``cut_k``,
  with ``cut_order="vllm"`` ``max(cut_k, cut_min)``, with ``"joint"`` none) over the digit
  after the prefix chosen so far, float32 (float64 for float64 weights or
  ``vocab >= 2**24``). Summed;
* ``TIES``: ``(B,)`` float64 count of the weights equal to that floor after a candidate top-k
  (in the joint order the shard's float64 mass instead: top-p's is the whole row's). Summed;
* ``APPLY``: the final cut ``max(cut_k, cut_p, cut_min)`` applied as
  :func:`fastsample.ops.cuts.keep_at_least` (``fl(w / s)`` zeroed below 1,
  ``s = max(cut, floor)``), or a Python min-p alone on logits as ``w > pred(min_p)``
  unscaled, and the ``(B, slots)`` slot masses. Summed.

The first launch of a round also computes the weights (``WEIGHTS``): ``exp((x - top) / T)``
or ``(p / top)^(1/T)`` as ``exp(log(p / top) / T)`` with the global ``top`` of the gathered
summaries, written to the ``(B, width)`` buffer the later launches read.

Digits are the torch path's (:data:`fastsample.distributed.shard.RADIX_ROUNDS`: 10 bits x 3
for float32, 8 then 9 x 6 for float64). A round's histogram is a sum over tiles of one-hot
products ``(32, TILE) @ (TILE, 32)`` (high and low 5 bits of the digit; ``tl.dot`` in IEEE
precision: no scatter, no atomics, the same numbers on every run). The descent through a
global histogram is one level (the torch path takes two); counts are exact integers, so the
digit and the top-k cut are bitwise the torch path's; bucket masses are float sums in another
order, so a radix top-p cut may differ where ``top_p`` times the mass lies within float32
rounding of a cumulative mass, as the torch path's own docstring allows. The candidate
top-p cut is the torch path's float64 running sum over the sorted merged candidates, bitwise
(in the joint order the row's mass is a float64 sum in another order: the same exception).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.cuts import BELOW_ONE, CUT_FLOOR
from . import launch
from .controls import _div, _exp, _log, libdevice
from .philox import INTERPRETED

# How a control reaches the kernels (Python numbers by their float64 bits).
OFF, NUMBER, TENSOR = 0, 1, 2
# Top-k: candidates (Python k <= 1024) or radix; top-p: from candidates and ties, or radix.
CAND, RADIX = 1, 2
# Min-p: a Python number alone on logits is the unscaled ``w > pred(min_p)`` (PLAIN); else a
# cut like the others (MIN_NUMBER, MIN_TENSOR).
PLAIN, MIN_NUMBER, MIN_TENSOR = 1, 2, 3
# Which mass top-p takes (the cut order): the top-k survivors', min-p's and top-k's ("vllm"),
# the whole row's ("joint").
P_ON_K, P_ON_MIN_AND_K, P_ON_ROW = 0, 1, 2
# What a launch produces.
APPLY, TOP, HIST_K, TIES, HIST_P = 0, 1, 2, 3, 4
STEP_NAMES = {APPLY: "apply", TOP: "top", HIST_K: "hist_k", TIES: "ties", HIST_P: "hist_p"}
# Radix digit widths (first round, later rounds) and rounds, as the torch path's.
WIDTHS = {torch.float32: (10, 10, 3), torch.float64: (8, 9, 7)}
SIDE = 32  # a round's buckets as a (SIDE, SIDE) grid: high and low 5 bits of the digit

_TENSOR = tl.constexpr(TENSOR)
_CAND, _RADIX = tl.constexpr(CAND), tl.constexpr(RADIX)
_PLAIN, _MIN_NUMBER = tl.constexpr(PLAIN), tl.constexpr(MIN_NUMBER)
_APPLY, _TOP, _HIST_K = tl.constexpr(APPLY), tl.constexpr(TOP), tl.constexpr(HIST_K)
_TIES, _HIST_P = tl.constexpr(TIES), tl.constexpr(HIST_P)
_P_ON_MIN_AND_K, _P_ON_ROW = tl.constexpr(P_ON_MIN_AND_K), tl.constexpr(P_ON_ROW)
_RANK_SORT = tl.constexpr(INTERPRETED)  # see _merged


def round_layout(dtype: torch.dtype, r: int) -> tuple[int, int, int]:
    """``(width, shift, offset)`` of radix round ``r``: digit bits, bits below the digit, and
    the round's first bucket in the flat per-row layout of every round's histogram."""
    first, later, rounds = WIDTHS[dtype]
    total = first + later * (rounds - 1)
    width = first if r == 0 else later
    shift = total - first - later * r
    offset = 0 if r == 0 else (1 << first) + (r - 1) * (1 << later)
    return width, shift, offset


def histogram_buckets(dtype: torch.dtype) -> int:
    """Buckets per row of every round's histogram together."""
    first, later, rounds = WIDTHS[dtype]
    return (1 << first) + (rounds - 1) * (1 << later)


# ---------------------------------------------------------------------------- helpers

# Reductions and scans as tl.reduce/tl.associative_scan with the standard library's combine
# functions (what tl.sum/tl.cumsum emit on a GPU): the interpreter runs those with numpy
# directly, where each call of a @jit helper such as tl.sum costs ~0.5 ms of patching.
_ADD = tl.standard._sum_combine
_LARGER = tl.standard._elementwise_max
_SMALLER = tl.standard._elementwise_min





@triton.jit
def control(ptr, sb, bits, rows, live, MODE: tl.constexpr):
    """A per-row control as float64: a tensor's rows, or a Python number's float64 bits."""
    if MODE == _TENSOR:
        value = tl.load(ptr + rows * sb, mask=live, other=0).to(tl.float64)
    else:
        value = tl.zeros(rows.shape, tl.float64) + bits.to(tl.int64).to(tl.float64, bitcast=True)
    return value


@triton.jit
def global_top(table_ptr, rows, live, batch, world, COLS: tl.constexpr, IS_LOGITS: tl.constexpr):
    """``(top, finite)`` per row from the gathered ``(world, B, COLS)`` summaries."""
    top = tl.full(rows.shape, float("-inf"), tl.float64)
    bad = tl.zeros(rows.shape, tl.float64)
    for r in range(0, world):
        at = table_ptr + (r * batch + rows) * COLS
        top = tl.maximum(top, tl.load(at, mask=live, other=0.0))
        bad = tl.maximum(bad, tl.load(at + 1, mask=live, other=0.0))
    clean = ~(bad > 0)
    if IS_LOGITS:
        finite = clean & (top > float("-inf")) & (top < float("inf"))
    else:
        finite = clean & (top > 0) & (top < float("inf"))
    return top, finite


@triton.jit
def _as_cut(prefix, F64: tl.constexpr):
    """A radix prefix (a full bit pattern) as the weight it spells."""
    if F64:
        value = prefix.to(tl.float64, bitcast=True)
    else:
        value = prefix.to(tl.int32).to(tl.float32, bitcast=True)
    return value


@triton.jit
def _round_hist(w_ptr, rows, live, width, prefix, cut_k, SHIFT: tl.constexpr,
                WIDTH: tl.constexpr, BY_MASS: tl.constexpr, SURVIVORS: tl.constexpr,
                F64: tl.constexpr, HIST_F64: tl.constexpr, ROWS: tl.constexpr,
                TILE: tl.constexpr):  # fmt: skip
    """``(ROWS, 32, 32)`` local histogram of one radix round: bucket ``d = 32 h + l`` holds
    the count (or mass) of the weights whose pattern is ``prefix`` followed by digit ``d``
    (``SHIFT`` bits below it). With ``SURVIVORS`` weights below ``cut_k`` count as 0."""
    HIST: tl.constexpr = tl.float64 if HIST_F64 else tl.float32
    side = tl.arange(0, 32)
    acc = tl.zeros((ROWS, 32, 32), HIST)
    base = prefix[:, None] << WIDTH
    for start in range(0, width, TILE):
        columns = start + tl.arange(0, TILE)[None, :]
        inside = live[:, None] & (columns < width)
        w = tl.load(w_ptr + rows[:, None] * width + columns, mask=inside, other=0.0)
        if SURVIVORS:
            w = tl.where(w >= cut_k[:, None], w, 0.0)
        if F64:  # noqa: SIM108 (constexpr branches; patterns as int64, -0.0 negative)
            pattern = w.to(tl.int64, bitcast=True)
        else:
            pattern = w.to(tl.int32, bitcast=True).to(tl.int64)
        digit = (pattern >> SHIFT) - base
        take = inside & (digit >= 0) & (digit < (1 << WIDTH))
        digit = tl.where(take, digit, 0)
        if BY_MASS:  # noqa: SIM108 (constexpr branches)
            amount = tl.where(take, w.to(HIST), 0.0)
        else:
            amount = tl.where(take, 1.0, 0.0).to(HIST)
        high = ((digit >> 5)[:, None, :] == side[None, :, None]).to(HIST)  # (ROWS, 32, TILE)
        low = tl.where((digit & 31)[:, :, None] == side[None, None, :], amount[:, :, None], 0.0)
        acc += tl.dot(high, low.to(HIST), input_precision="ieee", out_dtype=HIST)
    return acc


@triton.jit
def _descend(hist, target, above, BUCKETS: tl.constexpr):
    """Last bucket ``d < BUCKETS`` of ``hist`` (``(ROWS, 1024)`` float64) with ``above +
    sum(hist[d:]) >= target`` (0 if none), and ``above`` plus the buckets after it (as
    :func:`fastsample.ops.select.descend`)."""
    buckets = tl.arange(0, 1024)[None, :]
    suffix = tl.associative_scan(hist, 1, _ADD, reverse=True)
    meets = ((above[:, None] + suffix) >= target[:, None]) & (buckets < BUCKETS)
    last = tl.reduce(meets.to(tl.int32), 1, _ADD) - 1
    last = tl.minimum(tl.maximum(last, 0), BUCKETS - 1)
    chosen = buckets == last[:, None]
    above = above + tl.reduce(tl.where(chosen, suffix - hist, 0.0), 1, _ADD)
    return last.to(tl.int64), above


@triton.jit
def _load_hist(hists_ptr, rows, live, batch, OFFSET: tl.constexpr, WIDTH: tl.constexpr):
    buckets = tl.arange(0, 1024)[None, :]
    at = hists_ptr + OFFSET * batch + rows[:, None] * (1 << WIDTH) + buckets
    hist = tl.load(at, mask=live[:, None] & (buckets < (1 << WIDTH)), other=0.0)
    return hist.to(tl.float64)


@triton.jit
def _store_hist(hists_ptr, hist, rows, live, batch, OFFSET: tl.constexpr, WIDTH: tl.constexpr):
    high = tl.arange(0, 32)[None, :, None]
    low = tl.arange(0, 32)[None, None, :]
    digit = high * 32 + low
    at = hists_ptr + OFFSET * batch + rows[:, None, None] * (1 << WIDTH) + digit
    tl.store(at, hist, mask=live[:, None, None] & (digit < (1 << WIDTH)))


@triton.jit
def _radix_prefix(hists_ptr, rows, live, batch, target, DONE: tl.constexpr, W0: tl.constexpr,
                  WN: tl.constexpr, SHARE: tl.constexpr):  # fmt: skip
    """The prefix chosen by the first ``DONE`` rounds of the global histograms (and the
    target: for ``SHARE`` a fraction of the mass, the total read off round 0)."""
    prefix = tl.zeros(rows.shape, tl.int64)
    above = tl.zeros(rows.shape, tl.float64)
    for r in tl.static_range(DONE):
        if r == 0:
            hist = _load_hist(hists_ptr, rows, live, batch, 0, W0)
            if SHARE:
                target = target * tl.reduce(hist, 1, _ADD)
            digit, above = _descend(hist, target, above, 1 << W0)
            prefix = (prefix << W0) | digit
        else:
            hist = _load_hist(hists_ptr, rows, live, batch, (1 << W0) + (r - 1) * (1 << WN), WN)
            digit, above = _descend(hist, target, above, 1 << WN)
            prefix = (prefix << WN) | digit
    return prefix, target


@triton.jit
def _local_top(w_ptr, out_ptr, rows, live, width, k, W0: tl.constexpr, WN: tl.constexpr,
               ROUNDS: tl.constexpr, KPAD: tl.constexpr, F64: tl.constexpr, ROWS: tl.constexpr,
               TILE: tl.constexpr):  # fmt: skip
    """The shard's ``k`` largest weights as a multiset into ``out`` (``(B, k)``): the local
    ``k``-th largest ``t`` by radix rounds, the weights ``> t`` in column order, then ``t``."""
    target = tl.zeros(rows.shape, tl.float64) + k
    prefix = tl.zeros(rows.shape, tl.int64)
    above = tl.zeros(rows.shape, tl.float64)
    unused = tl.zeros(rows.shape, tl.float64)
    for r in tl.static_range(ROUNDS):
        if r == 0:
            hist = _round_hist(w_ptr, rows, live, width, prefix, unused, WN * (ROUNDS - 1), W0,
                               False, False, F64, False, ROWS, TILE)  # fmt: skip
            digit, above = _descend(tl.reshape(hist, (ROWS, 1024)).to(tl.float64), target,
                                    above, 1 << W0)  # fmt: skip
            prefix = (prefix << W0) | digit
        else:
            hist = _round_hist(w_ptr, rows, live, width, prefix, unused,
                               WN * (ROUNDS - 1 - r), WN, False, False, F64, False, ROWS,
                               TILE)  # fmt: skip
            digit, above = _descend(tl.reshape(hist, (ROWS, 1024)).to(tl.float64), target,
                                    above, 1 << WN)  # fmt: skip
            prefix = (prefix << WN) | digit
    t = _as_cut(prefix, F64)
    count = tl.zeros(rows.shape, tl.int32)
    for start in range(0, width, TILE):
        columns = start + tl.arange(0, TILE)[None, :]
        inside = live[:, None] & (columns < width)
        w = tl.load(w_ptr + rows[:, None] * width + columns, mask=inside, other=0.0)
        larger = inside & (w > t[:, None])
        place = count[:, None] + tl.associative_scan(larger.to(tl.int32), 1, _ADD) - 1
        tl.store(out_ptr + rows[:, None] * k + place, w, mask=larger & (place < k))
        count += tl.reduce(larger.to(tl.int32), 1, _ADD)
    tl.debug_barrier()
    slots = tl.arange(0, KPAD)[None, :]
    fill = live[:, None] & (slots >= count[:, None]) & (slots < k)
    tl.store(out_ptr + rows[:, None] * k + slots, t[:, None] + tl.zeros((ROWS, KPAD), t.dtype),
             mask=fill)  # fmt: skip


@triton.jit
def _merged(merged_ptr, rows, live, batch, world, k, KPAD: tl.constexpr,
            RANK_SORT: tl.constexpr):
    """Every rank's candidates of a row, sorted largest first (``(ROWS, KPAD)``, -1 past
    ``world * k``), and the ``k``-th largest: ``cut_k``."""
    j = tl.arange(0, KPAD)[None, :]
    inside = live[:, None] & (j < world * k)
    at = merged_ptr + ((j // k) * batch + rows[:, None]) * k + j % k
    values = tl.load(at, mask=inside, other=-1.0)
    if RANK_SORT:
        # The interpreter runs tl.sort's xor_sum one element at a time in Python; sorting by
        # rank (ties by position) gives the same values in the same order, at O(KPAD**2).
        i = tl.arange(0, KPAD)[None, :, None]
        before = (values[:, :, None] > values[:, None, :]) | (
            (values[:, :, None] == values[:, None, :]) & (i < j[:, None, :])
        )
        rank = tl.reduce(before.to(tl.int32), 1, _ADD)  # (ROWS, KPAD): where each value goes
        placed = tl.where(rank[:, None, :] == i, values[:, None, :], 0.0)
        merged = tl.reduce(placed, 2, _ADD)
    else:
        merged = tl.sort(values, 1, descending=True)
    cut_k = tl.reduce(tl.where(j == k - 1, merged, 0.0), 1, _ADD)
    return merged, cut_k


@triton.jit
def _candidate_top_p(merged, cut_k, ties, p, k, KPAD: tl.constexpr, MASS: tl.constexpr):
    """As :func:`fastsample.ops.cuts.top_p_cut_from_candidates` on the first ``k``; with
    ``MASS`` the row's mass is ``ties`` (its ``mass=`` argument)."""
    j = tl.arange(0, KPAD)[None, :]
    above = tl.where((j < k) & (merged > cut_k[:, None]), merged.to(tl.float64), 0.0)
    running = tl.associative_scan(above, 1, _ADD)
    if MASS:
        mass = ties
    else:
        mass = tl.reduce(tl.where(j == KPAD - 1, running, 0.0), 1, _ADD) + ties * cut_k.to(
            tl.float64
        )
    target = p * mass
    reached = (running >= target[:, None]) & (j < k)
    first = tl.reduce(tl.where(reached, j, KPAD), 1, _SMALLER)
    cut = tl.reduce(tl.where(j == first[:, None], merged, 0.0), 1, _ADD)
    return tl.where(first < KPAD, cut, cut_k)


# ---------------------------------------------------------------------------- the step


@triton.jit
def _slot_tile(j, head, width, grid, rank, first, offsets, live, ROWS: tl.constexpr,
               TILE: tl.constexpr):  # fmt: skip
    """The shard's tile ``j`` of the weight buffer (``j = -1``: the head slot ``[0, head)``;
    then tiles of ``TILE`` from ``head`` up to ``width``, one slot each): ``columns`` and
    ``inside`` ``(ROWS, TILE)`` (which columns lie in it, for the live rows), its global
    ``slot`` and ``filled`` ``(ROWS,)`` (a live row and a non-empty tile)."""
    tile = tl.zeros((ROWS,), tl.int64) + j
    begin = tl.where(tile < 0, 0, head + tile * TILE)
    end = tl.where(tile < 0, head, tl.minimum(head + (tile + 1) * TILE, width))
    columns = begin[:, None] + offsets
    slot = tl.where(tile < 0, grid + rank, first + tile)
    return columns, live[:, None] & (columns < end[:, None]), slot, live & (end > begin)


@triton.jit
def _step_kernel(
    x_ptr, x_sb, x_sv, table_ptr, w_ptr, sums_ptr, cand_ptr, merged_ptr, hists_k_ptr,
    hists_p_ptr, ties_ptr,
    t_ptr, t_sb, t_bits, k_ptr, k_sb, k_bits, p_ptr, p_sb, p_bits, m_ptr, m_sb, m_bits,
    tiny_bits, floor_bits, below_bits,
    batch, world, local, width, head, first, owned, grid, rank, slots, vocab, k_static,
    IS_LOGITS: tl.constexpr, NO_COPY: tl.constexpr, F64: tl.constexpr, COLS: tl.constexpr,
    WEIGHTS: tl.constexpr, STEP: tl.constexpr, ROUND: tl.constexpr, SHIFT: tl.constexpr,
    WIDTH: tl.constexpr, OFFSET: tl.constexpr, W0: tl.constexpr, WN: tl.constexpr,
    ROUNDS: tl.constexpr, T_SRC: tl.constexpr, K_SRC: tl.constexpr, P_SRC: tl.constexpr,
    M_SRC: tl.constexpr, K_MODE: tl.constexpr, P_MODE: tl.constexpr, M_MODE: tl.constexpr,
    HAS_KP: tl.constexpr, HAS_CUT: tl.constexpr, HIST_F64: tl.constexpr, KPAD: tl.constexpr,
    ROWS: tl.constexpr, TILE: tl.constexpr, SLOTS_PAD: tl.constexpr, PRECISE: tl.constexpr,
    P_MASS: tl.constexpr, P_SURVIVORS: tl.constexpr,
):  # fmt: skip
    FLOAT: tl.constexpr = tl.float64 if F64 else tl.float32
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0).to(tl.int64)
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    if STEP == _APPLY:  # every slot starts at 0; this rank's own slots are written below
        every = tl.arange(0, SLOTS_PAD)[None, :]
        zero = tl.zeros((ROWS, SLOTS_PAD), FLOAT)
        tl.store(sums_ptr + rows[:, None] * slots + every, zero,
                 mask=live[:, None] & (every < slots))  # fmt: skip
        tl.debug_barrier()
    if WEIGHTS:
        top, finite = global_top(table_ptr, rows, live, batch, world, COLS, IS_LOGITS)
        shift = tl.where(finite, top, 0.0 if IS_LOGITS else 1.0).to(FLOAT)
        if T_SRC == _TENSOR:  # as temperature_divisor: T where usable, else 1, floored
            t = tl.load(t_ptr + rows * t_sb, mask=live, other=1.0)
            usable = (t > 0) & (t < float("inf"))
            divisor = tl.maximum(tl.where(usable, t, 1.0).to(FLOAT),
                                 tiny_bits.to(tl.int64).to(tl.float64, bitcast=True).to(FLOAT))
        else:  # a Python T, floored by the caller
            divisor = control(t_ptr, 0, t_bits, rows, live, T_SRC).to(FLOAT)
        min_p_below = m_bits.to(tl.int64).to(tl.float64, bitcast=True).to(FLOAT)
        for j in range(-1, owned):
            columns, inside, slot, filled = _slot_tile(
                j, head, width, grid, rank, first, offsets, live, ROWS, TILE
            )
            mine = inside & (columns < local)
            x = tl.load(x_ptr + rows[:, None] * x_sb + columns * x_sv, mask=mine).to(FLOAT)
            if IS_LOGITS:
                w = x - shift[:, None]
                if T_SRC != 0:
                    w = _div(w, divisor[:, None], F64)
                w = _exp(w, PRECISE)
                if M_MODE == _PLAIN:
                    w = tl.where(w > min_p_below, w, 0.0)
            elif NO_COPY:
                w = x
            else:
                w = _div(x, shift[:, None], F64)
                if T_SRC != 0:
                    w = _exp(_div(_log(w, PRECISE), divisor[:, None], F64), PRECISE)
            w = tl.where(mine, w, 0.0)  # the padding column is 0
            tl.store(w_ptr + rows[:, None] * width + columns, w, mask=inside)
            if STEP == _APPLY and not HAS_CUT:
                tl.store(sums_ptr + rows * slots + slot, tl.reduce(w, 1, _ADD), mask=filled)
        tl.debug_barrier()  # the steps below read the weights back, in other layouts

    # The cuts known so far, identical on every rank (they read only collective results).
    cut_k = tl.zeros((ROWS,), FLOAT)
    if K_MODE == _CAND:  # noqa: SIM102 (constexpr branches)
        if STEP != _TOP:
            merged, cut_k = _merged(merged_ptr, rows, live, batch, world, k_static, KPAD,
                                    _RANK_SORT)
    if K_MODE == _RADIX:
        k = control(k_ptr, k_sb, k_bits, rows, live, K_SRC)
        if STEP == _HIST_K:
            prefix_k, _ = _radix_prefix(hists_k_ptr, rows, live, batch, k, ROUND, W0, WN, False)
        else:
            prefix_k, _ = _radix_prefix(hists_k_ptr, rows, live, batch, k, ROUNDS, W0, WN, False)
            cut_k = tl.where((k > 0) & (k < vocab), _as_cut(prefix_k, F64), 0.0)

    # Top-p's floor: the cuts before it (top-k; min-p too in the "vllm" order). In the joint
    # order the candidates' cut_k, with the whole row's mass (TIES) and no survivors' radix.
    floor_p = cut_k
    if P_MASS == _P_ON_MIN_AND_K:
        floor_p = tl.maximum(cut_k, control(m_ptr, m_sb, m_bits, rows, live, M_SRC).to(FLOAT))

    if STEP == _TOP:
        _local_top(w_ptr, cand_ptr, rows, live, width, k_static, W0, WN, ROUNDS, KPAD, F64,
                   ROWS, TILE)  # fmt: skip
    if STEP == _HIST_K:
        hist = _round_hist(w_ptr, rows, live, width, prefix_k, cut_k, SHIFT, WIDTH, False,
                           False, F64, HIST_F64, ROWS, TILE)  # fmt: skip
        _store_hist(hists_k_ptr, hist, rows, live, batch, OFFSET, WIDTH)
    if STEP == _TIES:  # as count_equal over the whole buffer (the padding column too)
        ties = tl.zeros((ROWS,), tl.float64)
        for start in range(0, width, TILE):
            columns = start + offsets
            inside = live[:, None] & (columns < width)
            w = tl.load(w_ptr + rows[:, None] * width + columns, mask=inside, other=0.0)
            if P_MASS == _P_ON_ROW:  # the shard's mass (float64 sum of its weights)
                ties += tl.reduce(w.to(tl.float64), 1, _ADD)
            else:
                ties += tl.reduce((inside & (w == floor_p[:, None])).to(tl.float64), 1, _ADD)
        tl.store(ties_ptr + rows, ties, mask=live)
    if P_MODE == _RADIX:
        p = control(p_ptr, p_sb, p_bits, rows, live, P_SRC)
        if STEP == _HIST_P:
            prefix_p, _ = _radix_prefix(hists_p_ptr, rows, live, batch, p, ROUND, W0, WN, True)
            hist = _round_hist(w_ptr, rows, live, width, prefix_p, floor_p, SHIFT, WIDTH, True,
                               P_SURVIVORS, F64, HIST_F64, ROWS, TILE)  # fmt: skip
            _store_hist(hists_p_ptr, hist, rows, live, batch, OFFSET, WIDTH)
        if STEP == _APPLY:
            prefix_p, _ = _radix_prefix(hists_p_ptr, rows, live, batch, p, ROUNDS, W0, WN, True)
            cut_p = tl.where(p < 1, _as_cut(prefix_p, F64), 0.0)
    if STEP == _APPLY and HAS_CUT:
        if P_MODE == _CAND:
            ties = tl.load(ties_ptr + rows, mask=live, other=0.0)
            p = control(p_ptr, 0, p_bits, rows, live, P_SRC)
            cut_p = _candidate_top_p(merged, floor_p, ties, p, k_static, KPAD,
                                     P_MASS == _P_ON_ROW)  # fmt: skip
        cut = cut_k
        if P_MODE != 0:
            if K_MODE != 0:  # noqa: SIM108 (constexpr branches)
                cut = tl.maximum(cut, cut_p)
            else:
                cut = cut_p
        if M_MODE >= _MIN_NUMBER:
            cut_min = control(m_ptr, m_sb, m_bits, rows, live, M_SRC).to(FLOAT)
            if HAS_KP:  # noqa: SIM108 (constexpr branches)
                cut = tl.maximum(cut, cut_min)
            else:
                cut = cut_min
        # keep_at_least: fl(w / s) zeroed below 1, s = max(cut, floor).
        floor = floor_bits.to(tl.int64).to(tl.float64, bitcast=True).to(FLOAT)
        below = below_bits.to(tl.int64).to(tl.float64, bitcast=True).to(FLOAT)
        scale = tl.maximum(cut, floor)
        for j in range(-1, owned):
            columns, inside, slot, filled = _slot_tile(
                j, head, width, grid, rank, first, offsets, live, ROWS, TILE
            )
            at = w_ptr + rows[:, None] * width + columns
            q = _div(tl.load(at, mask=inside, other=0.0), scale[:, None], F64)
            q = tl.where(q > below, q, 0.0)
            tl.store(at, q, mask=inside)
            tl.store(sums_ptr + rows * slots + slot, tl.reduce(q, 1, _ADD), mask=filled)


def rows_per_program(batch: int, elements: int) -> int:
    """1 on a GPU; in the interpreter a power-of-two tile of rows whose largest tensor (a
    row's ``elements``) stays within Triton's 2**20 elements."""
    if not INTERPRETED:
        return 1
    most = max(1, (1 << 20) // elements)
    return min(triton.next_power_of_2(max(batch, 1)), 1 << (most.bit_length() - 1))


def bits(value: float) -> int:
    """The float64 bit pattern of ``value`` as a Python int."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def control_args(value: Tensor | float | None, x: Tensor) -> tuple[Tensor, int, int, int]:
    """``(pointer, row stride, float64 bits, source)`` of a control for the kernels."""
    if isinstance(value, Tensor):
        return value, value.stride(0), 0, TENSOR
    return x, 0, bits(0.0 if value is None else float(value)), OFF if value is None else NUMBER


def step(
    x: Tensor,
    table: Tensor,
    weights: Tensor,
    sums: Tensor,
    candidates: Tensor,
    merged: Tensor,
    hists_k: Tensor,
    hists_p: Tensor,
    ties: Tensor,
    controls: tuple[Tensor | float | None, ...],
    sizes: tuple[int, ...],
    plan: tuple[int, ...],
) -> None:
    """One launch of :func:`_step_kernel`: the local work before one collective (see the
    module docstring). ``controls`` is ``(T, k, p, min_p)`` (a Python ``T`` already floored,
    a PLAIN ``min_p`` already its predecessor); ``sizes`` is ``(local, width, head, first,
    owned, grid, rank, slots, vocab, k)`` with 256-entry grid slots; ``plan`` is
    ``(is_logits, no_copy, weights, step, round, k_mode, p_mode, m_mode, p_mass)``
    (``p_mass``: :data:`P_ON_K`, :data:`P_ON_MIN_AND_K` or :data:`P_ON_ROW`). Writes the step's
    outputs in place: ``weights`` and ``sums`` (APPLY), ``candidates`` (TOP), round
    ``round`` of ``hists_k``/``hists_p`` (HIST_K/HIST_P), ``ties`` (TIES)."""
    is_logits, no_copy, first_launch, kind, r, k_mode, p_mode, m_mode, p_mass = plan
    local, width, head, first, owned, grid, rank, slots, vocab, k_static = sizes
    batch = x.shape[0]
    dtype = weights.dtype
    f64 = dtype == torch.float64
    if kind not in STEP_NAMES or not 0 <= r < WIDTHS[dtype][2]:
        raise ValueError(f"no step {kind} round {r}")
    if weights.shape != (batch, width) or sums.shape != (batch, slots):
        raise ValueError("weights must be (B, width) and sums (B, slots)")
    if batch == 0:
        return
    round_width, shift, offset = round_layout(dtype, r)
    w0, wn, rounds = WIDTHS[dtype]
    t, k, p, m = (control_args(c, x) for c in controls)
    slots_pad = triton.next_power_of_2(slots)
    kpad = triton.next_power_of_2(max(table.shape[0] * k_static, 16))
    # The largest tensor of a row: a round's one-hot, the merged candidates (by rank: squared).
    rows = rows_per_program(batch, max(SIDE * launch.SUM_BLOCK, kpad * kpad, slots_pad))
    launch.count_launch()
    launch.launcher(_step_kernel, INTERPRETED)[launch.grid(batch, rows)](
        x, x.stride(0), x.stride(1), table, weights, sums, candidates, merged, hists_k, hists_p,
        ties, t[0], t[1], t[2], k[0], k[1], k[2], p[0], p[1], p[2], m[0], m[1], m[2],
        bits(torch.finfo(dtype).tiny), bits(CUT_FLOOR[dtype]), bits(BELOW_ONE[dtype]),
        batch, table.shape[0], local, width, head, first, owned, grid, rank, slots, vocab,
        max(k_static, 1),
        IS_LOGITS=bool(is_logits), NO_COPY=bool(no_copy), F64=f64, COLS=table.shape[2],
        WEIGHTS=bool(first_launch), STEP=kind, ROUND=r, SHIFT=shift, WIDTH=round_width,
        OFFSET=offset, W0=w0, WN=wn, ROUNDS=rounds, T_SRC=t[3], K_SRC=k[3], P_SRC=p[3],
        M_SRC=m[3], K_MODE=k_mode, P_MODE=p_mode, M_MODE=m_mode,
        HAS_KP=bool(k_mode or p_mode), HAS_CUT=bool(k_mode or p_mode or m_mode >= MIN_NUMBER),
        HIST_F64=hists_k.dtype == torch.float64 or hists_p.dtype == torch.float64,
        KPAD=kpad, ROWS=rows, TILE=launch.SUM_BLOCK, SLOTS_PAD=slots_pad,
        PRECISE=not INTERPRETED and libdevice is not None, P_MASS=p_mass,
        P_SURVIVORS=bool((k_mode and p_mass != P_ON_ROW) or p_mass == P_ON_MIN_AND_K),
    )  # fmt: skip
