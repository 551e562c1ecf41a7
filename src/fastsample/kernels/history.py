"""The history stages inside the stages kernel: windowed penalties, DRY and no-repeat n-grams.

:func:`history_edits` is a device function the stages kernel (:mod:`.stages`) calls last, on
the row it has written, so a step with these stages on stays at three launches. It is
:func:`fastsample.stages.history.apply_` for one row, with the same float operations:

* the context ``c`` (``W = H + E`` entries, oldest first): the row's history (``(S, H)``,
  read at its state row) with its valid drafts (``extra``) appended and as many of its oldest
  entries dropped (:func:`fastsample.stages.state.shift_in`), one ``W_PAD`` tile in registers
  and in a scratch row (shifted reads go through memory);
* match lengths (:func:`fastsample.stages.history.match_lengths`): a loop over ``s`` with
  every position at once, stopping when no repeat still grows (as the torch path on CPU);
* per token, the largest value and the count over the entries naming it: the keys ``id *
  SPAN + value + 1`` sorted in the tile (``tl.sort``), then each token's last sorted entry
  carries its largest value and (by a running maximum of group starts) its count, so every
  token is edited once, by one lane: no two writes meet;
* windowed penalties (``penalty_last_n``), then DRY, then no-repeat n-grams, each a gather,
  its formula and a store at the window's tokens, a barrier between them.

Histories longer than :data:`MAX_CONTEXT` entries (drafts included) take the torch ops (the
tile is the whole context); the step says so by not taking the kernels
(:func:`fastsample.stages.kernel_step.applies`).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from torch import Tensor

from .controls import _div, _mul, _power, _setting
from .select import largest as max_of
from .select import total as sum_of

MAX_CONTEXT = 4096
"""The longest context (history plus drafts) the kernel holds in one tile."""

class History(NamedTuple):
    """The history stages of a step as the stages kernel takes them: the state's ``(S, H)``
    history, each setting as a ``(B,)`` tensor (unit stride) or a Python number (None: off;
    ``last_n`` off also when the penalties are), DRY's breaker tables
    (:func:`fastsample.stages.samplers.breaker_tables`)."""

    history: Tensor
    last_n: Tensor | None = None
    last_n_value: float | None = None
    dry_multiplier: Tensor | None = None
    dry_multiplier_value: float | None = None
    dry_base: Tensor | None = None
    dry_base_value: float | None = None
    dry_allowed: Tensor | None = None
    dry_allowed_value: float | None = None
    dry_window: Tensor | None = None
    dry_window_value: float | None = None
    ngram: Tensor | None = None
    ngram_value: float | None = None
    breakers: Tensor | None = None
    singles: Tensor | None = None


_BIG = tl.constexpr(2**62)  # a key past every real one (ids * SPAN stay below 2**40)

_larger = tl.standard._elementwise_max


@triton.jit
def _both(tile, scalar):
    """``tile & scalar`` (the interpreter refuses a scalar bool and-ed into a block)."""
    return tl.where(scalar, tile, tl.zeros_like(tile))


@triton.jit
def _match_lengths(seq_row, width, limit, W_PAD: tl.constexpr):
    """``(W_PAD,)`` int32: for each position ``j``, the largest ``m <= limit`` with
    ``seq[j-1-s] == seq[width-1-s] >= 0`` for every ``s < m`` (``seq`` at ``seq_row``)."""
    j = tl.arange(0, W_PAD)
    length = tl.zeros((W_PAD,), tl.int32)
    alive = j < width
    s = tl.full((), 0, tl.int32)
    going = width > 1
    while going:
        last = tl.load(seq_row + (width - 1 - s))
        back = j - 1 - s
        earlier = tl.load(seq_row + back, mask=(back >= 0) & (j < width), other=-2)
        alive = _both(alive & (earlier == last), (last >= 0) & (s < limit))
        length += alive.to(tl.int32)
        s += 1
        going = (s < width - 1) & (max_of(alive.to(tl.int32), 0) > 0)
    return length


@triton.jit
def _per_token(ids, values, valid, scratch_row, W_PAD: tl.constexpr):
    """One entry per distinct token of ``ids`` (where ``valid``): ``(token, largest, count,
    last)``, ``last`` marking the entry that carries the token's largest ``values`` (in
    ``[-1, W_PAD]``) and how many entries name it."""
    SPAN: tl.constexpr = W_PAD + 2
    j = tl.arange(0, W_PAD)
    keys = tl.where(valid, ids * SPAN + values.to(tl.int64) + 1, _BIG)
    keys = tl.sort(keys, 0)
    tl.store(scratch_row + j, keys)
    tl.debug_barrier()
    following = tl.load(scratch_row + j + 1, mask=j + 1 < W_PAD, other=_BIG)
    preceding = tl.load(scratch_row + j - 1, mask=j >= 1, other=-SPAN)
    token = keys // SPAN
    real = keys < _BIG
    last = real & (following // SPAN != token)
    first = real & (preceding // SPAN != token)
    start = tl.associative_scan(tl.where(first, j, 0), 0, _larger)
    tl.debug_barrier()  # the scratch row is written again by the next caller
    return token, keys - token * SPAN - 1, j - start + 1, last


@triton.jit
def penalized(x, seen, count, rep, freq, pres, REP: tl.constexpr, FREQ: tl.constexpr,
              PRES: tl.constexpr, IS_F64: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """:func:`fastsample.stages.penalties.penalize` on a tile: ``seen`` (bool) and ``count``
    (``x``'s dtype) per entry, each penalty on unless its mode is 0; correctly rounded
    division and products (:func:`.controls._mul`), so the numbers are the torch op's bit for
    bit. The stages kernel's output-count penalties and the windowed ones here."""
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    if REP != 0:
        r = tl.where(seen, rep, 1.0).to(FLOAT)
        x = tl.where(x > 0, _div(x, r, IS_F64), _mul(x, r, IS_F64, PRECISE))
    if FREQ != 0:
        x = x - _mul(count, tl.broadcast_to(freq, count.shape), IS_F64, PRECISE)
    if PRES != 0:
        x = tl.where(count > 0, x - pres, x)
    return x


@triton.jit
def _context(hist_row, hist_width, extra_row, num_extra, drafted, W_PAD: tl.constexpr):
    """The context tile: the history with the ``drafted`` valid drafts appended, as many of its
    oldest entries dropped (``-1`` before the context starts and past ``W``)."""
    j = tl.arange(0, W_PAD)
    width = hist_width + num_extra
    at = j + drafted  # in [-1] * E ++ history ++ drafts
    in_hist = (at >= num_extra) & (at < num_extra + hist_width) & (j < width)
    in_extra = (at >= num_extra + hist_width) & (j < width)
    h = tl.load(hist_row + (at - num_extra), mask=in_hist, other=-1)
    # (Without drafts the pointer is a dummy of another dtype, never read.)
    e = tl.load(extra_row + (at - num_extra - hist_width), mask=in_extra, other=-1).to(tl.int64)
    return tl.where(in_hist, h, tl.where(in_extra & (e >= 0), e, -1))


@triton.jit
def _breaker_limit(seq_row, width, table_row, num_breakers, breaker_len, W_PAD: tl.constexpr):
    """How many of the window's last tokens follow its last complete sequence breaker
    (:func:`fastsample.stages.history._breaker_limit`; ``width`` when none occurs)."""
    j = tl.arange(0, W_PAD)
    last_end = tl.full((), -1, tl.int32)
    for i in range(0, num_breakers):
        sequence = table_row + i * breaker_len
        real = tl.load(sequence + breaker_len - 1) >= 0  # a padding sequence occurs nowhere
        here = _both(j < width, real)
        for t in range(0, breaker_len):
            want = tl.load(sequence + t)  # -3: before a shorter breaker's start, any token
            back = j - (breaker_len - 1 - t)
            seen = tl.load(seq_row + back, mask=(back >= 0) & (j < width), other=-2)
            here = here & ((seen == want) | (tl.zeros_like(seen) + want == -3))
        last_end = tl.maximum(last_end, max_of(tl.where(here, j, -1), 0))
    return tl.minimum(width - 1 - last_end, width)


@triton.jit
def _dry_cap(base32):
    """llama.cpp's cap on DRY's exponent (:func:`fastsample.stages.history._max_exponent`):
    ``trunc(88.7228391f / logf(base))`` in float32, none (inf) for ``base <= 1.000001``."""
    floor = tl.full((), 1.000001, tl.float32)
    cap = tl.math.div_rn(tl.full((), 88.7228391, tl.float32), tl.log(tl.maximum(base32, floor)))
    return tl.where(base32 > floor, cap.to(tl.int64).to(tl.float64), float("inf"))


@triton.jit
def history_edits(
    out, n, row, hist_row, hist_width, extra_row, num_extra, drafted, scratch_row,
    last_n_ptr, last_n_bits, rep, freq, pres, mult_ptr, mult_bits, base_ptr, base_bits,
    allowed_ptr, allowed_bits, window_ptr, window_bits, ngram_ptr, ngram_bits, table_row,
    num_breakers, breaker_len, singles_row, num_singles,
    LAST_N_MODE: tl.constexpr, REP: tl.constexpr, FREQ: tl.constexpr, PRES: tl.constexpr,
    DRY_MODE: tl.constexpr, BASE_MODE: tl.constexpr, ALLOWED_MODE: tl.constexpr,
    WINDOW_MODE: tl.constexpr, NGRAM_MODE: tl.constexpr, W_PAD: tl.constexpr,
    IS_F64: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """The history stages on the written row ``out`` (see the module docstring). Settings
    are ``(ptr, bits, MODE)`` (0: off, 1: a Python number's float64 bits, 2: a ``(B,)``
    tensor); ``rep``/``freq``/``pres`` the row's penalties as the stages kernel reads them;
    ``scratch_row`` holds ``2 * W_PAD`` int64."""
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    j = tl.arange(0, W_PAD)
    width = hist_width + num_extra
    ctx = _context(hist_row, hist_width, extra_row, num_extra, drafted, W_PAD)
    named = (ctx >= 0) & (ctx < n)
    seq_row = scratch_row
    keys_row = scratch_row + W_PAD

    if LAST_N_MODE != 0:  # the penalties over the last n context tokens
        last_n = _setting(last_n_ptr, last_n_bits, row, LAST_N_MODE).to(tl.int32)
        size = tl.where(last_n < 0, width, last_n)
        counted = _both(named & (j >= width - size), last_n != 0)
        token, _, count, last = _per_token(ctx, tl.zeros_like(j), counted, keys_row, W_PAD)
        x = tl.load(out + token, mask=last, other=0.0)
        x = penalized(x, count > 0, count.to(FLOAT), rep, freq, pres, REP, FREQ, PRES, IS_F64,
                      PRECISE)  # fmt: skip
        tl.store(out + token, x, mask=last)
        tl.debug_barrier()

    if DRY_MODE != 0:
        mult = _setting(mult_ptr, mult_bits, row, DRY_MODE).to(tl.float32)
        base = _setting(base_ptr, base_bits, row, BASE_MODE).to(tl.float32)
        allowed = _setting(allowed_ptr, allowed_bits, row, ALLOWED_MODE).to(tl.float32)
        dry_n = _setting(window_ptr, window_bits, row, WINDOW_MODE).to(tl.int32)
        reach_n = tl.where(dry_n < 0, width, dry_n)
        window = tl.where((j >= width - reach_n) & (j < width), ctx, -1)
        tl.store(seq_row + j, window)
        tl.debug_barrier()
        present = window >= 0
        size = sum_of(present.to(tl.int32), 0)
        limit = _breaker_limit(seq_row, width, table_row, num_breakers, breaker_len, W_PAD)
        lengths = _match_lengths(seq_row, width, limit, W_PAD)
        # The window's first token extends nothing (it follows no position of the window).
        values = tl.where(j == width - size, -1, lengths)
        token, longest, _, last = _per_token(window, values, present & named, keys_row, W_PAD)
        single = tl.zeros_like(last)
        for i in range(0, num_singles):
            single = single | (token == tl.load(singles_row + i))
        on = ((size.to(tl.float32) > allowed) & (limit.to(tl.float32) >= allowed)
              & (mult != 0) & (dry_n != 0))  # fmt: skip
        hit = _both(last & (longest.to(tl.float32) >= allowed) & (single == 0), on)
        exponent = tl.minimum(longest.to(tl.float64) - allowed.to(tl.float64), _dry_cap(base))
        penalty = mult.to(tl.float64) * _power(base.to(tl.float64), exponent, PRECISE)
        x = tl.load(out + token, mask=hit, other=0.0)
        tl.store(out + token, x - penalty.to(FLOAT), mask=hit)
        tl.debug_barrier()

    if NGRAM_MODE != 0:  # no-repeat n-grams over the whole context
        need = _setting(ngram_ptr, ngram_bits, row, NGRAM_MODE).to(tl.int32) - 1
        tl.store(seq_row + j, ctx)
        tl.debug_barrier()
        lengths = _match_lengths(seq_row, width, width, W_PAD)
        token, longest, _, last = _per_token(ctx, lengths, named, keys_row, W_PAD)
        banned = _both(last & (longest >= need), need >= 0)
        tl.store(out + token, tl.full((W_PAD,), float("-inf"), FLOAT), mask=banned)
        tl.debug_barrier()
