"""Stages a-c of the engine step in one Triton launch: :func:`fastsample.stages.step._prepare`.

One program per row reads the logits row (any float dtype) and writes the float32 buffer
(float64 for float64 logits) that the controls kernel reads, applying the stages in the torch
path's order, each with the same float operations (:mod:`fastsample.stages`):

1. pass 1, stage a: ``x = where(allowed, float(logits), -inf)`` (0 for probabilities), where
   ``allowed`` is the row's grammar bitmask word (``GRAMMAR``: every row, or the rows listed
   in ``bitmask_indices``, as :func:`fastsample.stages.allowed.allowed_words`) AND its allowed
   mask word, read from both pointers (no combined tensor is made). With the raw logprobs on,
   the row's maximum (and NaN flag) is taken here; without a stage that follows, the
   penalties are applied in this same pass (a single read and write of the row).
2. raw logprobs (``RAW``), after a barrier, from the stage-a values just written (or the
   logits when nothing is written): the float64 sum of ``exp(float32(x) - shift)`` (``shift``:
   the float32 maximum, 0 when not finite), ``log_total = log(sum) + shift`` (for
   probabilities ``log(sum p)``), then ``NUM_TOP`` passes for the raw top-N (largest first,
   ties by the lower index, as :func:`fastsample.ops.select.top_entries`) and their
   ``x - log_total`` (float64, before the validity known only after the draw).
3. stage b, after a barrier: the row's logit-bias entries, then its stop ids (``-inf`` while
   ``output_len < min_tokens``; ``+0.0`` otherwise), as the torch path's ``scatter_add_``: an
   entry outside ``[0, V)`` adds 0 to column 0, and an id listed several times gets its
   additions one after the other in list order. Entries go in tiles; within a tile each
   entry's occurrence number among the earlier entries of its column is counted (a
   ``(T, T)`` compare) and the entries are applied in rounds by occurrence (one round when no
   id repeats), each round a read-modify-write of distinct columns followed by a barrier, so
   duplicates add sequentially and the rest in parallel.
4. pass 2, stage c, after a barrier: the penalties on the biased values (bias before the
   penalty, as the torch path, which is why they take their own pass when stage b is on):
   ``seen`` is the row's bit of ``seen_mask`` or a positive count, the count is
   ``float(output_counts) + float(extra occurrences)``; repetition ``x > 0 ? x / r : x * r``
   (``r`` = float32 of a Python number, as ``torch.where(seen, r, 1.0)`` makes it), frequency
   ``x - f * count`` and presence ``x - p`` where ``count > 0``: correctly rounded division
   and products (``div_rn``, PTX ``mul.rn`` on a GPU: never fused into an FMA), so the numbers
   are :func:`fastsample.stages.penalties.penalize`'s bit for bit.

5. the history stages, after a barrier (``HISTORY``): windowed penalties, DRY and no-repeat
   n-grams on the written row (:func:`.history.history_edits`); with a ``(B,)``
   ``penalty_last_n`` the rows with a window skip the output-count penalties of passes 1-2.

Speculative verification (``rows``, ``extra``): row ``r`` reads its statistics (seen bits,
counts, and the output length for min-tokens) from stats row ``rows[r]``; its ``extra``
tokens (``(R, E)``, -1-padded) count as output on top (for the length: every entry ``>= 0``).

Outputs: the buffer ``(B, V)``; ``log_total`` ``(B,)`` float64; top ids ``(B, N)`` int64 and
their raw log-probabilities ``(B, N)`` float64; the row's allowed words ``(B, W)`` int32 when
asked (the draw kernel reads them for raw ranks and requested ids). Arguments are checked by
the step; per-row settings are ``(B,)`` tensors with unit stride or Python numbers (passed by
value: no tensor is made for them).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import launch
from .controls import _as_float64, _exp, _log, libdevice, next_largest
from .history import History, history_edits, penalized
from .philox import INTERPRETED
from .select import largest as max_of
from .select import tile_for
from .select import total as sum_of

OFF, NUMBER, TENSOR = 0, 1, 2  # how a setting is given
NO_GRAMMAR, GRAMMAR_ROWS, GRAMMAR_LISTED = 0, 1, 2  # a bitmask for every row, or listed rows
_OFF, _TENSOR = tl.constexpr(OFF), tl.constexpr(TENSOR)
_NO_GRAMMAR, _LISTED = tl.constexpr(NO_GRAMMAR), tl.constexpr(GRAMMAR_LISTED)
ENTRY_TILE = tl.constexpr(64)  # bias / stop entries per round of stage b: a (64, 64) compare
INDEX_TILE = tl.constexpr(128)  # bitmask_indices read per step
WORD_TILE = tl.constexpr(128)  # allowed words written per step


@triton.jit
def _words(grammar_row, g_on, allowed_row, index, inside, GRAMMAR: tl.constexpr,
           ALLOWED: tl.constexpr):  # fmt: skip
    """The allowed words at word ``index``: the grammar's (where this row is masked: ``g_on``,
    an int32 0/1) AND the allowed mask's (-1 where absent)."""
    if GRAMMAR != _NO_GRAMMAR:
        # (A scalar bool and-ed into a block is an int block in the interpreter: go by where.)
        on = tl.where(inside, g_on, 0) != 0
        word = tl.load(grammar_row + index, mask=on, other=-1)
        if ALLOWED:
            word = word & tl.load(allowed_row + index, mask=inside, other=-1)
    else:
        word = tl.load(allowed_row + index, mask=inside, other=-1)
    return word


@triton.jit
def bit_of(word, cols):
    """Bit ``cols % 32`` of ``word`` (xgrammar's layout: least significant first)."""
    return ((word >> (cols % 32).to(tl.int32)) & 1) != 0


@triton.jit
def _penalize(x, cols, inside, seen_row, counts_row, extra, extra_in, rep, freq, pres,
              REP: tl.constexpr, FREQ: tl.constexpr, PRES: tl.constexpr, EXTRA: tl.constexpr,
              IS_F64: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """:func:`fastsample.stages.penalties.penalize` on a tile (see the module docstring)."""
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    count = tl.load(counts_row + cols, mask=inside, other=0).to(FLOAT)
    if EXTRA:
        hits = (cols[:, None] == extra[None, :]) & extra_in[None, :]
        count = count + sum_of(hits.to(tl.int32), 1).to(FLOAT)
    word = tl.load(seen_row + cols // 32, mask=inside, other=0)
    seen = bit_of(word, cols) | (count > 0)
    return penalized(x, seen, count, rep, freq, pres, REP, FREQ, PRES, IS_F64, PRECISE)


@triton.jit
def _scatter_add(row, n, ids_row, values_row, count, block_inf, IS_BIAS: tl.constexpr,
                 FLOAT: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """``row[ids] += values`` as ``scatter_add_`` on CPU (see the module docstring): bias
    values (``IS_BIAS``), or ``-inf`` at stop ids where ``block_inf`` (int32 0/1; else
    ``+0.0``)."""
    slots = tl.arange(0, TILE)
    for first in range(0, count, TILE):
        idx = first + slots
        live = idx < count
        ids = tl.load(ids_row + idx, mask=live, other=-1)
        inside = (ids >= 0) & (ids < n)
        col = tl.where(inside, ids, 0)
        if IS_BIAS:
            value = tl.load(values_row + idx, mask=live, other=0.0)
            add = tl.where(inside, value, 0.0).to(FLOAT)
        else:
            active = tl.where(inside, block_inf, 0) != 0
            add = tl.where(active, float("-inf"), 0.0).to(FLOAT)
        # Occurrence number of each entry among the earlier live entries of its column.
        same = (col[:, None] == col[None, :]) & live[None, :]
        earlier = same & (slots[None, :] < slots[:, None])
        occurrence = sum_of(earlier.to(tl.int32), 1)
        rounds = max_of(tl.where(live, occurrence, 0), 0) + 1
        for r in range(0, rounds):
            now = live & (occurrence == r)
            value_now = tl.load(row + col, mask=now, other=0.0)
            tl.store(row + col, value_now + add, mask=now)
            tl.debug_barrier()  # the next round (or tile) reads what this one wrote


@triton.jit(
    do_not_specialize=[
        "num_indices", "grammar_rows", "min_value", "len_value", "rep_bits", "freq_bits",
        "pres_bits", "num_bias", "num_stops", "num_extra",
    ]
)  # fmt: skip
def _stages_kernel(
    src_ptr, src_stride, n, out_ptr,
    grammar_ptr, grammar_stride, grammar_rows, index_ptr, num_indices,
    allowed_ptr, allowed_stride,
    bias_ids_ptr, bias_ids_stride, bias_values_ptr, bias_values_stride, num_bias,
    stop_ptr, stop_stride, num_stops, min_ptr, min_value, len_ptr, len_value,
    rows_ptr, seen_ptr, seen_stride, counts_ptr, counts_stride,
    extra_ptr, extra_stride, num_extra,
    rep_ptr, rep_bits, freq_ptr, freq_bits, pres_ptr, pres_bits,
    log_total_ptr, top_ids_ptr, top_logp_ptr, words_out_ptr, num_words,
    hist_ptr, hist_stride, hist_width, scratch_ptr, last_n_ptr, last_n_bits, mult_ptr,
    mult_bits, base_ptr, base_bits, allowed_ptr_h, allowed_bits, window_ptr, window_bits,
    ngram_ptr, ngram_bits, table_ptr, num_breakers, breaker_len, singles_ptr, num_singles,
    IS_LOGITS: tl.constexpr, IS_F64: tl.constexpr, GRAMMAR: tl.constexpr,
    ALLOWED: tl.constexpr, WRITE: tl.constexpr, BIAS: tl.constexpr, STOPS: tl.constexpr,
    MIN_MODE: tl.constexpr, LEN_MODE: tl.constexpr, ROWS_MAP: tl.constexpr, MASKED: tl.constexpr,
    FUSED: tl.constexpr, SECOND: tl.constexpr, REP: tl.constexpr, FREQ: tl.constexpr,
    PRES: tl.constexpr, E_PAD: tl.constexpr, RAW: tl.constexpr, NUM_TOP: tl.constexpr,
    WORDS_OUT: tl.constexpr, HISTORY: tl.constexpr, LAST_N_MODE: tl.constexpr,
    DRY_MODE: tl.constexpr, BASE_MODE: tl.constexpr, ALLOWED_MODE: tl.constexpr,
    WINDOW_MODE: tl.constexpr, NGRAM_MODE: tl.constexpr, W_PAD: tl.constexpr,
    TILE: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    FILL: tl.constexpr = float("-inf") if IS_LOGITS else 0.0
    row = tl.program_id(0).to(tl.int64)
    src = src_ptr + row * src_stride
    out = out_ptr + row * n
    lanes = tl.arange(0, TILE)

    # Stage a's rows: with bitmask_indices only the listed rows (inside the bitmask) are masked.
    g_on = tl.full((), 1, tl.int32)
    g_row = row
    if GRAMMAR == _LISTED:
        listed = tl.full((), 0, tl.int32)
        for first in range(0, num_indices, INDEX_TILE):
            k = first + tl.arange(0, INDEX_TILE)
            index = tl.load(index_ptr + k, mask=k < num_indices, other=-1)
            listed += sum_of((index == row).to(tl.int32), 0)
        g_on = tl.where((listed > 0) & (row < grammar_rows), 1, 0)
        g_row = tl.minimum(row, grammar_rows - 1)
    grammar_row = grammar_ptr + g_row * grammar_stride
    allowed_row = allowed_ptr + row * allowed_stride
    if WORDS_OUT:
        for first in range(0, num_words, WORD_TILE):
            k = first + tl.arange(0, WORD_TILE)
            word = _words(grammar_row, g_on, allowed_row, k, k < num_words, GRAMMAR, ALLOWED)
            tl.store(words_out_ptr + row * num_words + k, word, mask=k < num_words)

    # Statistics row, extra tokens and penalty values of this row.
    stat = row
    if ROWS_MAP:
        stat = tl.load(rows_ptr + row).to(tl.int64)
    seen_row = seen_ptr + stat * seen_stride
    counts_row = counts_ptr + stat * counts_stride
    drafted = tl.full((), 0, tl.int64)
    if E_PAD > 0:
        slot = tl.arange(0, E_PAD)
        extra = tl.load(extra_ptr + row * extra_stride + slot, mask=slot < num_extra, other=-1)
        extra_in = (extra >= 0) & (extra < n)
        drafted = sum_of((extra >= 0).to(tl.int64), 0)
    else:
        extra = tl.full((1,), -1, tl.int64)
        extra_in = extra >= 0
    if REP == _TENSOR:
        rep = tl.load(rep_ptr + row).to(FLOAT)
    else:  # torch.where(seen, r, 1.0) makes a Python r a float32 first
        rep = _as_float64(rep_bits).to(tl.float32).to(FLOAT)
    if FREQ == _TENSOR:
        freq = tl.load(freq_ptr + row).to(FLOAT)
    else:
        freq = _as_float64(freq_bits).to(FLOAT)
    if PRES == _TENSOR:
        pres = tl.load(pres_ptr + row).to(FLOAT)
    else:
        pres = _as_float64(pres_bits).to(FLOAT)
    # A (B,) penalty_last_n: rows with a window take the penalties there (history_edits);
    # the others count the output here.
    counted_here = tl.full((), 1, tl.int1)
    if LAST_N_MODE == _TENSOR:
        counted_here = tl.load(last_n_ptr + row) == 0

    # Pass 1: stage a (and the penalties when nothing comes between), the raw maximum.
    peak = tl.full((), float("-inf"), FLOAT)
    nans = tl.full((), 0, tl.int32)
    plain = tl.full((), 0, tl.float64)
    for start in range(0, n, TILE):
        cols = start + lanes
        inside = cols < n
        x = tl.load(src + cols, mask=inside, other=0.0).to(FLOAT)
        if MASKED:
            word = _words(grammar_row, g_on, allowed_row, cols // 32, inside, GRAMMAR, ALLOWED)
            x = tl.where(bit_of(word, cols), x, FILL)
        if RAW:
            if IS_LOGITS:
                nans += sum_of(((x != x) & inside).to(tl.int32), 0)
                peak = tl.maximum(peak, max_of(tl.where(inside & (x == x), x, FILL), 0))
            else:
                plain += sum_of(tl.where(inside, x, 0.0).to(tl.float64), 0)
        if FUSED:
            x = tl.where(counted_here, _penalize(x, cols, inside, seen_row, counts_row, extra,
                                          extra_in, rep, freq, pres, REP, FREQ, PRES,
                                          E_PAD > 0, IS_F64, PRECISE), x)  # fmt: skip
        if WRITE:
            tl.store(out + cols, x, mask=inside)

    if RAW:
        tl.debug_barrier()  # the raw values are read back in other layouts
        if IS_LOGITS:
            # The torch path's shift: the float32 maximum where finite (NaN rows: 0).
            top32 = peak.to(tl.float32)
            finite = (top32 > float("-inf")) & (top32 < float("inf")) & (nans == 0)
            shift = tl.where(finite, top32, 0.0)
            mass = tl.full((), 0, tl.float64)
            for start in range(0, n, TILE):
                cols = start + lanes
                inside = cols < n
                x = _raw_tile(src, out, cols, inside, WRITE, FLOAT).to(tl.float32)
                terms = _exp(x - shift, PRECISE)
                mass += sum_of(tl.where(inside, terms, 0.0).to(tl.float64), 0)
            log_total = _log(mass, PRECISE) + shift.to(tl.float64)
        else:
            log_total = _log(plain, PRECISE)
        tl.store(log_total_ptr + row, log_total)
        if NUM_TOP > 0:
            _store_raw_top(src, out, n, log_total, top_ids_ptr + row * NUM_TOP,
                           top_logp_ptr + row * NUM_TOP, NUM_TOP, IS_LOGITS, WRITE, FLOAT, TILE,
                           PRECISE)  # fmt: skip

    # Stage b: logit bias, then min-tokens, entry by entry on the written row.
    if BIAS:
        tl.debug_barrier()
        _scatter_add(out, n, bias_ids_ptr + row * bias_ids_stride,
                     bias_values_ptr + row * bias_values_stride, num_bias, 0, True, FLOAT,
                     ENTRY_TILE)  # fmt: skip
    if STOPS:
        if LEN_MODE == _TENSOR:
            length = tl.load(len_ptr + stat).to(tl.int64)
        else:
            length = len_value.to(tl.int64)
        if MIN_MODE == _TENSOR:
            least = tl.load(min_ptr + row).to(tl.int64)
        else:
            least = min_value.to(tl.int64)
        tl.debug_barrier()
        _scatter_add(out, n, stop_ptr + row * stop_stride, stop_ptr, num_stops,
                     tl.where(length + drafted < least, 1, 0), False, FLOAT,
                     ENTRY_TILE)  # fmt: skip

    # Pass 2: stage c on the biased values.
    if SECOND:
        tl.debug_barrier()
        for start in range(0, n, TILE):
            cols = start + lanes
            inside = cols < n
            x = tl.load(out + cols, mask=inside, other=0.0)
            x = tl.where(counted_here, _penalize(x, cols, inside, seen_row, counts_row, extra,
                                          extra_in, rep, freq, pres, REP, FREQ, PRES,
                                          E_PAD > 0, IS_F64, PRECISE), x)  # fmt: skip
            tl.store(out + cols, x, mask=inside)

    # Stage c, continued: windowed penalties, DRY and no-repeat n-grams on the written row.
    if HISTORY:
        tl.debug_barrier()
        history_edits(
            out, n, row, hist_ptr + stat * hist_stride, hist_width,
            extra_ptr + row * extra_stride, num_extra, drafted, scratch_ptr + row * 2 * W_PAD,
            last_n_ptr, last_n_bits, rep, freq, pres, mult_ptr, mult_bits, base_ptr, base_bits,
            allowed_ptr_h, allowed_bits, window_ptr, window_bits, ngram_ptr, ngram_bits,
            table_ptr + row * num_breakers * breaker_len, num_breakers, breaker_len,
            singles_ptr + row * num_singles, num_singles, LAST_N_MODE, REP, FREQ, PRES,
            DRY_MODE, BASE_MODE, ALLOWED_MODE, WINDOW_MODE, NGRAM_MODE, W_PAD, IS_F64, PRECISE,
        )  # fmt: skip


@triton.jit
def _raw_tile(src, out, cols, inside, WRITE: tl.constexpr, FLOAT: tl.constexpr):
    """The raw scores (after stage a) at ``cols``: the written row, else the input."""
    if WRITE:
        x = tl.load(out + cols, mask=inside, other=float("-inf"))
    else:
        x = tl.load(src + cols, mask=inside, other=float("-inf")).to(FLOAT)
    return x


@triton.jit
def _store_raw_top(src, out, n, log_total, ids_row, logp_row, NUM_TOP: tl.constexpr,
                   IS_LOGITS: tl.constexpr, WRITE: tl.constexpr, FLOAT: tl.constexpr,
                   TILE: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """The ``NUM_TOP`` largest raw scores, largest first, ties by the lower index (one pass
    each: the largest entry after the previous one in that order), and their float64 raw
    log-probabilities ``x - log_total`` (``log x - log_total`` for probabilities)."""
    # The raw scores: the written row (float), else the input.
    if WRITE:  # noqa: SIM108 (a constexpr branch, as the kernels write them)
        row = out
    else:
        row = src
    previous = tl.full((), float("inf"), FLOAT)
    previous_id = tl.full((), -1, tl.int32)
    for j in range(NUM_TOP):
        previous, previous_id = next_largest(row, n, previous, previous_id, FLOAT, TILE)
        token = tl.minimum(previous_id, n - 1)
        value = _raw_tile(src, out, token, token < n, WRITE, FLOAT).to(tl.float64)
        if not IS_LOGITS:
            value = _log(value, PRECISE)
        tl.store(ids_row + j, token.to(tl.int64))
        tl.store(logp_row + j, value - log_total)


def _bits(value: float) -> int:
    """The IEEE float64 bits of ``value`` as a Python int (what ``_as_float64`` reads)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _mode(tensor: Tensor | None, value: float | int | None) -> int:
    if tensor is not None:
        return TENSOR
    return OFF if value is None else NUMBER


def outputs(
    source: Tensor, write: bool, raw: bool, num_top: int, words_out: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Empty ``(buffer, log_total, top_ids, top_logprobs, words)`` for ``source`` (also the
    fake kernel's): unused outputs have no columns (no rows for ``log_total``)."""
    batch, vocab = source.shape
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    words = -(-vocab // 32)
    return (
        source.new_empty((batch, vocab if write else 0), dtype=dtype),
        source.new_empty((batch if raw else 0,), dtype=torch.float64),
        source.new_empty((batch, num_top if raw else 0), dtype=torch.int64),
        source.new_empty((batch, num_top if raw else 0), dtype=torch.float64),
        source.new_empty((batch, words if words_out else 0), dtype=torch.int32),
    )


def _rows_of(value: Tensor | None) -> Tensor | None:
    """A 2-D tensor with unit column stride (copied only when it has none)."""
    if value is not None and value.dim() == 2 and value.shape[1] > 1 and value.stride(1) != 1:
        return value.contiguous()
    return value


def stages(
    source: Tensor,
    is_logits: bool,
    grammar: Tensor | None,
    indices: Tensor | None,
    allowed: Tensor | None,
    bias_ids: Tensor | None,
    bias_values: Tensor | None,
    stop_ids: Tensor | None,
    min_tokens: Tensor | None,
    min_tokens_value: int,
    length: Tensor | None,
    length_value: int,
    rows: Tensor | None,
    seen: Tensor | None,
    counts: Tensor | None,
    extra: Tensor | None,
    rep: Tensor | None,
    rep_value: float | None,
    freq: Tensor | None,
    freq_value: float | None,
    pres: Tensor | None,
    pres_value: float | None,
    write: bool,
    raw: bool,
    num_top: int,
    words_out: bool,
    history: History | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One launch: ``(buffer, log_total, top_ids, top_logprobs, words)`` (see the module
    docstring; :func:`outputs` for the shapes). ``history``: the history stages
    (:class:`.history.History`, the context at most :data:`.history.MAX_CONTEXT` entries
    with the drafts), applied last.

    Arguments already checked by the step: ``grammar`` ``(B', W')`` int32 with unit column
    stride (rows picked by ``indices``, int64, when given), ``allowed`` ``(B, W)``; stop ids
    with ``min_tokens`` (a ``(B,)`` tensor or ``min_tokens_value``) and ``length`` (``(S,)``
    tensor indexed by stats row, or ``length_value``); the penalties' ``seen``/``counts`` rows
    are stats rows (``rows`` maps to them, None: the same row); a penalty is a ``(B,)`` tensor,
    a Python number or None (off). Per-row ``(B,)`` tensors need unit stride.
    """
    if source.stride(-1) != 1:
        source = source.contiguous()
    batch, vocab = source.shape
    buffer, log_total, top_ids, top_logp, words = outputs(source, write, raw, num_top, words_out)
    if batch == 0:
        return buffer, log_total, top_ids, top_logp, words
    grammar, allowed, bias_ids, bias_values, stop_ids, seen, counts, extra = map(
        _rows_of, (grammar, allowed, bias_ids, bias_values, stop_ids, seen, counts, extra)
    )
    dummy = source  # the pointer of anything absent (never read)
    penalties = seen is not None  # the step passes the statistics when a penalty is on
    sparse = bias_ids is not None or stop_ids is not None
    num_extra = extra.shape[1] if extra is not None else 0

    def ptr(value: Tensor | None) -> Tensor:
        return value if value is not None else dummy

    def stride(value: Tensor | None) -> int:
        return value.stride(0) if value is not None else 0

    h = history
    hist_width = h.history.shape[1] if h is not None else 0
    w_pad = max(16, triton.next_power_of_2(hist_width + num_extra)) if h is not None else 16
    scratch = (source.new_empty((batch, 2 * w_pad), dtype=torch.int64) if h is not None
               else dummy)  # fmt: skip
    breakers = h.breakers if h is not None and h.breakers is not None else None
    singles = h.singles if h is not None and h.singles is not None else None

    def setting(tensor: Tensor | None, value: float | None) -> tuple[Tensor, int]:
        return ptr(tensor), _bits(value if tensor is None and value is not None else 0.0)

    def mode(tensor: Tensor | None, value: float | None) -> int:
        return OFF if h is None else _mode(tensor, value)

    none = History(dummy) if h is None else h
    hist = _rows_of(h.history) if h is not None else dummy
    launch.count_launch()
    launch.launcher(_stages_kernel, INTERPRETED)[(batch,)](
        source, source.stride(0), vocab, buffer if write else dummy,
        ptr(grammar), stride(grammar), grammar.shape[0] if grammar is not None else 0,
        ptr(indices), indices.shape[0] if indices is not None else 0,
        ptr(allowed), stride(allowed),
        ptr(bias_ids), stride(bias_ids), ptr(bias_values), stride(bias_values),
        bias_ids.shape[1] if bias_ids is not None else 0,
        ptr(stop_ids), stride(stop_ids), stop_ids.shape[1] if stop_ids is not None else 0,
        ptr(min_tokens), min_tokens_value, ptr(length), length_value,
        ptr(rows), ptr(seen), stride(seen), ptr(counts), stride(counts),
        ptr(extra), stride(extra), num_extra,
        ptr(rep), _bits(rep_value or 1.0), ptr(freq), _bits(freq_value or 0.0),
        ptr(pres), _bits(pres_value or 0.0),
        log_total if raw else dummy, top_ids if raw and num_top else dummy,
        top_logp if raw and num_top else dummy, words if words_out else dummy,
        words.shape[1] if words_out else 0,
        hist, hist.stride(0), hist_width, scratch,
        *setting(none.last_n, none.last_n_value),
        *setting(none.dry_multiplier, none.dry_multiplier_value),
        *setting(none.dry_base, none.dry_base_value),
        *setting(none.dry_allowed, none.dry_allowed_value),
        *setting(none.dry_window, none.dry_window_value),
        *setting(none.ngram, none.ngram_value),
        ptr(breakers), breakers.shape[1] if breakers is not None else 0,
        breakers.shape[2] if breakers is not None else 0,
        ptr(singles), singles.shape[1] if singles is not None else 0,
        IS_LOGITS=is_logits, IS_F64=source.dtype == torch.float64,
        GRAMMAR=NO_GRAMMAR if grammar is None else (
            GRAMMAR_ROWS if indices is None else GRAMMAR_LISTED),
        ALLOWED=allowed is not None, WRITE=write, BIAS=bias_ids is not None,
        STOPS=stop_ids is not None, MIN_MODE=_mode(min_tokens, min_tokens_value),
        LEN_MODE=_mode(length, length_value), ROWS_MAP=rows is not None,
        MASKED=grammar is not None or allowed is not None,
        FUSED=penalties and not sparse and not raw, SECOND=penalties and (sparse or raw),
        REP=_mode(rep, rep_value), FREQ=_mode(freq, freq_value), PRES=_mode(pres, pres_value),
        E_PAD=triton.next_power_of_2(num_extra) if num_extra else 0,
        RAW=raw, NUM_TOP=num_top if raw else 0, WORDS_OUT=words_out, HISTORY=h is not None,
        LAST_N_MODE=mode(none.last_n, none.last_n_value),
        DRY_MODE=mode(none.dry_multiplier, none.dry_multiplier_value),
        BASE_MODE=mode(none.dry_base, none.dry_base_value),
        ALLOWED_MODE=mode(none.dry_allowed, none.dry_allowed_value),
        WINDOW_MODE=mode(none.dry_window, none.dry_window_value),
        NGRAM_MODE=mode(none.ngram, none.ngram_value), W_PAD=w_pad,
        TILE=tile_for(vocab, INTERPRETED), PRECISE=not INTERPRETED and libdevice is not None,
    )  # fmt: skip
    return buffer, log_total, top_ids, top_logp, words
