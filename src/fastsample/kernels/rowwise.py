"""Device functions every sampling kernel shares: per-row counters and the bad-row finish.

Entry points (``@triton.jit``; rows are a ``(ROWS,)`` tile, slots a ``(ROWS, N_PAD)`` tile):

* :func:`row_counters` -> ``(c1, c2, c3, k0, k1)``: the Philox words of each row from its
  seed/step/stream, however they were given (per-row tensors or one number).
* :func:`finish` -- the contract of :func:`fastsample.stages.output.finish`: drawn tokens'
  probabilities ``w / total`` and log-probabilities ``log w - log total`` in float64, stored
  as float32 (float64 for float64 input); bad rows (``clean`` False) get ids ``0..n-1``,
  probability 0, log-probability ``-inf``; ``valid = clean and every slot genuine``. With
  ``FAST`` it stores ``fast_sample``'s ``(sample_p, sample_index)`` instead.
* :func:`stream_in_range` -- rows whose tensor ``stream`` is in ``[0, 2^24)``; and
  :func:`total_fits` -- the torch path's overflow rule for row totals.
* :func:`toward_zero` -- ``nextafter(x, 0)`` by the bit pattern (no libdevice in the
  interpreter); :func:`column` -- slot ``k`` of a ``(ROWS, N_PAD)`` tile.

NaN: the interpreter's ``max``/``min`` skip NaN while the GPU's may not, so no kernel relies on
either for NaN; bad values are found by explicit comparisons.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .philox import counter_words, row_key


@triton.jit
def row_counters(
    rows,
    live,
    seed_ptr,
    seed_stride,
    step_ptr,
    step_stride,
    stream_ptr,
    stream_stride,
    stream_value,
    HAS_STEP: tl.constexpr,
    STREAM_ROWS: tl.constexpr,
    PURPOSE: tl.constexpr,
):
    """Philox words ``(c1, c2, c3, k0, k1)``, each ``(ROWS,)``, for ``PURPOSE``.

    ``step`` is 0 without ``HAS_STEP``; ``stream`` is ``stream_value`` for every row without
    ``STREAM_ROWS``. Strides may be 0 (a broadcast value).
    """
    seed = tl.load(seed_ptr + rows * seed_stride, mask=live, other=0)
    if HAS_STEP:
        step = tl.load(step_ptr + rows * step_stride, mask=live, other=0)
    else:
        step = tl.zeros_like(seed)
    if STREAM_ROWS:
        stream = tl.load(stream_ptr + rows * stream_stride, mask=live, other=0)
    else:
        stream = tl.zeros_like(seed) + stream_value
    k0, k1 = row_key(seed)
    c1, c2, c3 = counter_words(step, stream, PURPOSE)
    return c1, c2, c3, k0, k1


@triton.jit
def stream_in_range(rows, live, stream_ptr, stream_stride, STREAM_ROWS: tl.constexpr):
    """``(ROWS,)`` bool: the row's tensor ``stream`` is in ``[0, 2^24)`` (always, for a Python
    int, checked when given). Out of range is bad data: the row draws with the low 24 bits and
    is flagged invalid, as on the torch path (``CounterSource.stream_ok``)."""
    if STREAM_ROWS:
        stream = tl.load(stream_ptr + rows * stream_stride, mask=live, other=0)
        ok = (stream >= 0) & (stream < 0x1000000)
    else:
        ok = rows >= 0
    return ok


@triton.jit
def toward_zero(x):
    """``nextafter(x, 0)`` for float64 ``x``: 0 stays 0, NaN stays NaN, inf -> max finite."""
    bits = x.to(tl.int64, bitcast=True)
    # The magnitude lives in the low 63 bits whatever the sign: one step down is bits - 1.
    stepped = (bits - 1).to(tl.float64, bitcast=True)
    return tl.where((x == 0.0) | (x != x), x, stepped)


@triton.jit
def total_fits(total, SUM_F64: tl.constexpr):
    """``0 < total`` and no overflow of the accumulation dtype: ``< inf`` for float64 input,
    ``< 2^128`` (float32 overflow) otherwise (``fastsample.ops.validation.total_fits``)."""
    # 2^128 as a float64 constant (a bare literal could be narrowed to float32, i.e. inf).
    limit = tl.full((), float("inf") if SUM_F64 else 2.0**128, tl.float64)
    return (total > 0) & (total < limit)


@triton.jit
def column(tile, slots, k):
    """Slot ``k`` of a ``(ROWS, N_PAD)`` tile, as ``(ROWS,)`` (exact: one value, zeros)."""
    return tl.sum(tl.where(slots == k, tile, tl.zeros_like(tile)), 1)


@triton.jit
def finish(
    probs_ptr,
    row_stride,
    col_stride,
    rows,
    live,
    tokens,
    genuine,
    total,
    clean,
    ids_ptr,
    p_ptr,
    logp_ptr,
    valid_ptr,
    NUM_SAMPLES: tl.constexpr,
    N_PAD: tl.constexpr,
    FAST: tl.constexpr,
):
    """Store one tile's results under the bad-row policy (see the module docstring).

    ``tokens``/``genuine`` are ``(ROWS, N_PAD)`` (slots ``>= NUM_SAMPLES`` ignored),
    ``total`` ``(ROWS,)`` float64, ``clean`` ``(ROWS,)`` bool. Outputs are ``(B, n)``
    contiguous, ``valid`` ``(B,)``; ``FAST`` stores ``probs[ids]`` to ``p_ptr`` only.
    """
    slots = tl.arange(0, N_PAD)[None, :]
    stored = live[:, None] & (slots < NUM_SAMPLES)
    ids = tl.where(clean[:, None], tokens, slots.to(tl.int64))
    out = rows[:, None].to(tl.int64) * NUM_SAMPLES + slots
    tl.store(ids_ptr + out, ids, mask=stored)
    if FAST:
        # sample_p = probs.gather(1, sample_index): the raw entry, in probs' dtype.
        raw = tl.load(probs_ptr + rows[:, None] * row_stride + ids * col_stride, mask=stored)
        tl.store(p_ptr + out, raw, mask=stored)
    else:
        drawn = tl.load(
            probs_ptr + rows[:, None] * row_stride + tokens * col_stride, mask=stored, other=0.0
        ).to(tl.float64)
        keep = clean[:, None] & genuine & stored
        # 1 where not kept: no 0 / 0 or log(0) to evaluate (the interpreter would warn).
        drawn = tl.where(keep, drawn, 1.0)
        total_column = tl.where(keep, total[:, None], 1.0)
        probability = tl.where(keep, drawn / total_column, 0.0)
        logprob = tl.where(keep, tl.log(drawn) - tl.log(total_column), -float("inf"))
        tl.store(p_ptr + out, probability, mask=stored)
        tl.store(logp_ptr + out, logprob, mask=stored)
        missing = tl.sum((~genuine & (slots < NUM_SAMPLES)).to(tl.int32), 1)
        tl.store(valid_ptr + rows, clean & (missing == 0), mask=live)
