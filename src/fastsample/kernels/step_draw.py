"""The engine step's draw launch: the draw, the bad-row finish and stage f's logprobs.

One launch after the controls kernel (or alone, for an all-greedy step without controls to
weigh), a tile of rows per program (one row on a GPU), composed of the device functions of
the sampling kernels, with the same results as the launches of :mod:`.controls_ops` (which
:func:`fastsample.stages.draw.draw` uses) plus what the logprobs stage adds
(:mod:`fastsample.stages.logprobs`), so a full step is the stages, controls and draw
launches:

* ``MODE``: ``DRAW`` (:func:`.inverse_cdf.draw_stage` over the controls kernel's block sums,
  as :func:`.inverse_cdf.draw_from_sums`), ``SOME`` (rows where a ``(B,)`` temperature is 0
  take their ``n`` largest inputs, the others draw), ``ALL`` (every row greedy, judged by the
  controls kernel) or ``SCAN`` (every row greedy, judged here): as
  :func:`.greedy.several`'s modes. Bad rows get ``0..n-1``, probability 0, log-probability
  ``-inf``; ``valid`` is clean and every draw genuine. ``rows_ok`` (the step parameters'
  in-range rows) is and-ed into clean, as :func:`fastsample.stages.output.flag_rows`.
* raw mode (``RAW``): the drawn tokens' log-probabilities ``x - log_total`` (``log x`` for
  probabilities) of the raw scores (the input, after the allowed words when given) and the
  stages kernel's normalizer, ``-inf`` on invalid rows;
* ``top_logprobs`` finished: the stages kernel's raw ones ``-inf`` on invalid rows, or the
  controls kernel's processed ones ``-inf`` on rows outside ``rows_ok``;
* ranks (``RANKS``): per draw the number of scores ``>=`` the drawn token's (the staged
  scores, or the raw ones), one compare of each tile against every draw; greedy rows rank
  their ``j``-th draw ``j`` in the processed mode; 0 on invalid rows;
* requested ids: raw ``x - log_total``, or processed ``log w - log total`` from the kept
  weights (the point mass at the first draw when every row is greedy and no weights were
  made); ``-inf`` for ids outside ``[0, V)`` and on invalid rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import launch
from .greedy import _rows_clean, top_entries_tile, with_greedy_rows
from .inverse_cdf import DRAW as DRAW_PURPOSE
from .inverse_cdf import counter_arguments, draw_sizes, draw_stage
from .philox import INTERPRETED
from .rowwise import column, row_counters, stream_in_range
from .select import total as sum_of
from .stages import bit_of

DRAW, SOME, ALL, SCAN = 0, 1, 2, 3
_DRAW, _SOME, _SCAN = tl.constexpr(DRAW), tl.constexpr(SOME), tl.constexpr(SCAN)


@triton.jit
def _scores_at(scores_base, words_base, ids, mask, WORDS: tl.constexpr, FILL: tl.constexpr,
               SF: tl.constexpr):  # fmt: skip
    """The scores at ``ids`` (a tile of ``(ROWS, c)`` ids in range): the input in ``SF``,
    ``FILL`` where the allowed words clear the bit."""
    x = tl.load(scores_base + ids, mask=mask, other=FILL).to(SF)
    if WORDS:
        word = tl.load(words_base + ids // 32, mask=mask, other=-1)
        x = tl.where(bit_of(word, ids), x, FILL)
    return x


@triton.jit
def _raw_logprobs(x, log_total, IS_LOGITS: tl.constexpr):
    """float64 raw log-probabilities of raw scores ``x`` (``(ROWS, c)``)."""
    value = x.to(tl.float64)
    if not IS_LOGITS:
        value = tl.log(value)
    return value - log_total[:, None]


@triton.jit
def _step_draw_kernel(
    src_ptr, src_stride, batch, vocab, weights_ptr, w_stride, sums_ptr, sums_stride,
    total_ptr, clean_ptr, t_ptr,
    seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride, stream_value,
    ok_ptr, scores_ptr, scores_stride, words_ptr, words_stride, log_total_ptr,
    top_in_ptr, top_out_ptr, req_ptr, req_stride, num_req, req_out_ptr,
    ids_ptr, p_ptr, logp_ptr, valid_ptr, ranks_ptr,
    MODE: tl.constexpr, IS_LOGITS: tl.constexpr, IS_F64: tl.constexpr,
    NUM_SAMPLES: tl.constexpr, N_PAD: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
    SUMS_TILE: tl.constexpr, ONE_SUMS_TILE: tl.constexpr, HAS_STEP: tl.constexpr,
    STREAM_ROWS: tl.constexpr, T_ROWS: tl.constexpr, ROWS_OK: tl.constexpr, RAW: tl.constexpr,
    WORDS: tl.constexpr, SCORES_F64: tl.constexpr, NUM_TOP: tl.constexpr,
    TOP_PAD: tl.constexpr, RANKS: tl.constexpr, REQ_PAD: tl.constexpr,
):  # fmt: skip
    FILL: tl.constexpr = float("-inf") if IS_LOGITS else 0.0
    SF: tl.constexpr = tl.float64 if SCORES_F64 else tl.float32
    WEIGHTED: tl.constexpr = MODE != _SCAN  # the controls kernel made weights
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0)  # padding rows read row 0 and store nothing
    if MODE == _SCAN:
        base = src_ptr + rows[:, None].to(tl.int64) * src_stride
        clean = _rows_clean(base, live, vocab, IS_LOGITS, IS_F64, ROWS, TILE)
        total = tl.zeros((ROWS,), tl.float64)
    else:
        total = tl.load(total_ptr + rows, mask=live, other=0.0)
        clean = tl.load(clean_ptr + rows, mask=live, other=0) != 0
    clean = clean & stream_in_range(rows, live, stream_ptr, stream_stride, STREAM_ROWS)
    ok = live
    if ROWS_OK:
        ok = tl.load(ok_ptr + rows, mask=live, other=0) != 0
        clean = clean & ok

    # The draws, and which rows are greedy (for the finish, and for the ranks).
    if T_ROWS:  # noqa: SIM108 (a constexpr branch: the load only with a tensor)
        zero_t = (tl.load(t_ptr + rows, mask=live, other=1.0) == 0) & live
    else:
        zero_t = rows < 0
    if MODE == _DRAW or MODE == _SOME:  # noqa: SIM109 (`in` fails in Triton's interpreter)
        c1, c2, c3, k0, k1 = row_counters(
            rows, live, seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride,
            stream_value, HAS_STEP, STREAM_ROWS, DRAW_PURPOSE,
        )  # fmt: skip
        tokens, genuine = draw_stage(
            weights_ptr, w_stride, 1, sums_ptr, sums_stride, rows, live, vocab,
            c1, c2, c3, k0, k1, NUM_SAMPLES, N_PAD, ROWS, TILE, SUMS_TILE, ONE_SUMS_TILE,
        )  # fmt: skip
        if MODE == _DRAW:
            greedy = rows < 0  # point masses weigh as any row (the controls kernel made them)
            ranked_greedy = zero_t
        else:
            greedy = zero_t
            tokens, genuine = with_greedy_rows(
                tokens, genuine, greedy, clean, src_ptr, src_stride, rows, vocab, NUM_SAMPLES,
                N_PAD, ROWS, TILE, IS_LOGITS, IS_F64,
            )  # fmt: skip
            ranked_greedy = greedy
    else:  # ALL, SCAN: every row greedy
        greedy = live
        tokens, genuine = top_entries_tile(
            src_ptr, src_stride, rows, clean & live, vocab, NUM_SAMPLES, N_PAD, ROWS, TILE,
            IS_LOGITS, IS_F64,
        )  # fmt: skip
        ranked_greedy = live

    # The finish (as .greedy._finish), the raw log-probabilities in the raw mode.
    slots = tl.arange(0, N_PAD)[None, :]
    stored = live[:, None] & (slots < NUM_SAMPLES)
    out = rows[:, None].to(tl.int64) * NUM_SAMPLES + slots
    tl.store(ids_ptr + out, tl.where(clean[:, None], tokens, slots.to(tl.int64)), mask=stored)
    keep = clean[:, None] & genuine & stored
    probability = tl.where(keep, 1.0, 0.0).to(tl.float64)
    logprob = tl.where(keep, 0.0, float("-inf")).to(tl.float64)
    w_base = weights_ptr + rows[:, None].to(tl.int64) * w_stride
    if WEIGHTED:
        drawn = tl.load(w_base + tokens, mask=stored, other=0.0).to(tl.float64)
        weighed = keep & ~greedy[:, None]
        # 1 where not weighed: no 0 / 0 or log(0) to evaluate.
        drawn = tl.where(weighed, drawn, 1.0)
        total_column = tl.where(weighed, total[:, None], 1.0)
        probability = tl.where(weighed, drawn / total_column, probability)
        logprob = tl.where(weighed, tl.log(drawn) - tl.log(total_column), logprob)
    missing = sum_of((~genuine & (slots < NUM_SAMPLES)).to(tl.int32), 1)
    valid = clean & (missing == 0)
    scores_base = scores_ptr + rows[:, None].to(tl.int64) * scores_stride
    words_base = words_ptr + rows[:, None].to(tl.int64) * words_stride
    if RAW:
        log_total = tl.load(log_total_ptr + rows, mask=live, other=0.0)
        at_drawn = _scores_at(scores_base, words_base, tokens, stored, WORDS, FILL, SF)
        raw_logp = _raw_logprobs(at_drawn, log_total, IS_LOGITS)
        logprob = tl.where(valid[:, None], raw_logp, float("-inf"))
    tl.store(p_ptr + out, probability, mask=stored)
    tl.store(logp_ptr + out, logprob, mask=stored)
    tl.store(valid_ptr + rows, valid, mask=live)

    if NUM_TOP > 0:
        j = tl.arange(0, TOP_PAD)[None, :]
        at = rows[:, None].to(tl.int64) * NUM_TOP + j
        top_mask = live[:, None] & (j < NUM_TOP)
        top = tl.load(top_in_ptr + at, mask=top_mask, other=float("-inf"))
        kept_rows = valid if RAW else ok  # raw: the draw's validity; processed: rows_ok only
        tl.store(top_out_ptr + at, tl.where(kept_rows[:, None], top, float("-inf")), mask=top_mask)

    if RANKS:
        values = _scores_at(scores_base, words_base, tokens, stored, WORDS, FILL, SF)
        lanes = tl.arange(0, TILE)[None, :]
        count = tl.zeros((ROWS, N_PAD), tl.int64)
        for start in range(0, vocab, TILE):
            cols = start + lanes
            inside = live[:, None] & (cols < vocab)
            tile = _scores_at(scores_base, words_base, cols, inside, WORDS, FILL, SF)
            at_least = (tile[:, :, None] >= values[:, None, :]) & inside[:, :, None]
            count += sum_of(at_least.to(tl.int64), 1)
        if not RAW:  # a greedy row's j-th draw is its j-th largest
            count = tl.where(ranked_greedy[:, None], (slots + 1).to(tl.int64), count)
        tl.store(ranks_ptr + out, tl.where(valid[:, None], count, 0), mask=stored)

    if REQ_PAD > 0:
        m = tl.arange(0, REQ_PAD)[None, :]
        asked = live[:, None] & (m < num_req)
        req = tl.load(req_ptr + rows[:, None].to(tl.int64) * req_stride + m, mask=asked, other=-1)
        inside = (req >= 0) & (req < vocab)
        safe = tl.where(inside, req, 0)
        if RAW:
            at_asked = _scores_at(scores_base, words_base, safe, asked, WORDS, FILL, SF)
            logp = _raw_logprobs(at_asked, log_total, IS_LOGITS)
        elif WEIGHTED:
            w = tl.load(w_base + safe, mask=asked, other=0.0).to(tl.float64)
            logp = tl.log(w) - tl.log(total)[:, None]
        else:  # every row greedy: the point mass at the first draw
            first = column(tokens, slots, 0)
            logp = tl.where(safe == first[:, None], 0.0, float("-inf")).to(tl.float64)
        keep_req = inside & valid[:, None]
        at = rows[:, None].to(tl.int64) * num_req + m
        tl.store(req_out_ptr + at, tl.where(keep_req, logp, float("-inf")), mask=asked)


def outputs(
    source: Tensor, num_samples: int, num_top: int, ranks: bool, num_requested: int
) -> tuple[Tensor, ...]:
    """Empty ``(ids, probs, logprobs, valid, top_logprobs, ranks, requested_logprobs)`` for a
    draw source (also the fake kernel's); unused outputs have no columns."""
    batch = source.shape[0]
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    shape = (batch, num_samples)
    return (
        source.new_empty(shape, dtype=torch.int64),
        source.new_empty(shape, dtype=dtype),
        source.new_empty(shape, dtype=dtype),
        source.new_empty((batch,), dtype=torch.bool),
        source.new_empty((batch, num_top), dtype=dtype),
        source.new_empty((batch, num_samples if ranks else 0), dtype=torch.int64),
        source.new_empty((batch, num_requested), dtype=dtype),
    )


def step_draw(
    source: Tensor,
    is_logits: bool,
    mode: int,
    num_samples: int,
    processed: tuple[Tensor, Tensor, Tensor, Tensor] | None,
    temperature: Tensor | None,
    seed: Tensor | None,
    step: Tensor | None,
    stream: Tensor | int,
    rows_ok: Tensor | None,
    scores: Tensor,
    words: Tensor | None,
    log_total: Tensor | None,
    top: Tensor | None,
    ranks: bool,
    requested: Tensor | None,
) -> tuple[Tensor, ...]:
    """One launch: see the module docstring; returns :func:`outputs`.

    ``source``: what the controls read (the staged buffer, or the input); ``processed``:
    the controls kernel's ``(weights, sums, total, valid)`` (None in ``SCAN`` mode);
    ``temperature``: the ``(B,)`` tensor when there is one (greedy rows where 0);
    ``seed``/``step``/``stream``: the counters (``DRAW`` and ``SOME``); ``rows_ok`` ``(B,)``
    bool or None; ``scores``: what ranks and requested ids read (``source`` in the processed
    mode, the input in the raw mode, with its allowed ``words`` ``(B, W)`` when masked);
    ``log_total``: the raw normalizer (raw mode, else None); ``top``: ``(B, N)`` top
    log-probabilities to finish (raw: float64 from the stages kernel, processed: the controls
    kernel's) or None; ``requested``: ``(B, M)`` int64 ids or None.
    """
    if source.stride(-1) != 1:
        source = source.contiguous()
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    batch, vocab = source.shape
    num_top = top.shape[1] if top is not None else 0
    num_requested = requested.shape[1] if requested is not None else 0
    results = outputs(source, num_samples, num_top, ranks, num_requested)
    ids, p_out, logp_out, valid, top_out, ranks_out, requested_out = results
    if batch == 0:
        return results
    weights, sums, total, clean = processed if processed is not None else (source, ids, ids, ids)
    if weights.stride(-1) != 1 or sums.stride(-1) != 1:
        raise ValueError("weights and sums must have unit column stride")
    sizes = draw_sizes(batch, vocab, num_samples)
    counter_args = counter_arguments(seed if seed is not None else ids, step, stream)
    raw = log_total is not None
    launch.count_launch()
    launch.launcher(_step_draw_kernel, INTERPRETED)[launch.grid(batch, sizes["ROWS"])](
        source, source.stride(0), batch, vocab, weights, weights.stride(0), sums, sums.stride(0),
        total, clean, temperature if temperature is not None else ids, *counter_args,
        rows_ok if rows_ok is not None else valid, scores, scores.stride(0),
        words if words is not None else ids, words.stride(0) if words is not None else 0,
        log_total if raw else ids, top if top is not None else top_out, top_out,
        requested if requested is not None else ids,
        requested.stride(0) if requested is not None else 0, num_requested, requested_out,
        ids, p_out, logp_out, valid, ranks_out,
        MODE=mode, IS_LOGITS=is_logits, IS_F64=source.dtype == torch.float64,
        HAS_STEP=step is not None, STREAM_ROWS=isinstance(stream, Tensor),
        T_ROWS=temperature is not None, ROWS_OK=rows_ok is not None, RAW=raw,
        WORDS=words is not None, SCORES_F64=scores.dtype == torch.float64, NUM_TOP=num_top,
        TOP_PAD=triton.next_power_of_2(max(num_top, 1)), RANKS=ranks,
        REQ_PAD=triton.next_power_of_2(num_requested) if num_requested else 0, **sizes,
    )  # fmt: skip
    return results
