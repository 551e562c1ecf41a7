"""Greedy sampling in Triton: ``temperature=0``, and greedy rows among several draws.

* :func:`greedy` -- one draw, every row greedy (one launch). Math (as
  :func:`fastsample.stages.draw._all_greedy` with ``n = 1``): the token is the first index among
  the row's maximal entries, with probability 1 (log-probability 0). No weights, no
  randomness: one pass over the row per program (:func:`fastsample.kernels.controls.scan_row`).
* :func:`several` -- ``n > 1`` draws where rows may be greedy (one launch): a greedy row's
  draws are its ``n`` largest inputs in order, ties by the lower index
  (:func:`fastsample.stages.draw._greedy_draws`: the ``T -> 0`` limit of draws without
  replacement), one pass over the row per draw (:func:`top_entries_tile`: ``n`` reads of a
  greedy row, skipped by programs without one; meant for the small ``n`` of decoding, though
  any ``n <= V`` is exact); a draw is genuine
  where its input is above ``-inf`` (logits) or 0 (probabilities), later slots repeat the
  last genuine one and make the row invalid; genuine draws of a clean greedy row have
  probability 1. With a ``(B,)`` temperature the other rows draw in the same launch with the
  inverse-CDF draw stage over the controls kernel's block sums, exactly as
  :func:`fastsample.kernels.inverse_cdf.draw_from_sums`.

Bad rows: logits with NaN, a ``+inf`` maximum or all ``-inf``; probabilities with NaN, a
negative entry, or no positive finite maximum; and, with a ``(B,)`` tensor ``stream``, a
value outside ``[0, 2**24)`` (with the controls kernel first: also what it flags). They get
tokens ``0..n-1``, probability 0, log-probability ``-inf`` and ``valid`` False; other rows
never see them.

Shapes and dtypes: source ``(B, V)`` float16/bfloat16/float32/float64; outputs ``ids (B, n)``
int64, ``probs``/``logprobs (B, n)`` float32 (float64 for float64 input), ``valid (B,)`` bool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.inverse_cdf import BLOCK
from . import launch
from .controls import scan_row, stream_in_range
from .inverse_cdf import DRAW, counter_arguments, draw_sizes, draw_stage
from .philox import INTERPRETED
from .rowwise import row_counters
from .rowwise import stream_in_range as rows_stream_in_range
from .select import largest as max_of
from .select import smallest as min_of
from .select import tile_for
from .select import total as sum_of


@triton.jit
def _greedy_kernel(
    src_ptr, src_stride, n, stream_ptr, ids_ptr, p_ptr, logp_ptr, valid_ptr,
    IS_LOGITS: tl.constexpr, IS_F64: tl.constexpr, STREAM_ROWS: tl.constexpr,
    TILE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    _, best_id, finite, _ = scan_row(src_ptr + row * src_stride, n, IS_LOGITS, IS_F64, TILE, BLOCK)
    valid = finite & stream_in_range(stream_ptr, row, STREAM_ROWS)
    tl.store(ids_ptr + row, tl.where(valid, best_id, 0))
    tl.store(p_ptr + row, tl.where(valid, 1.0, 0.0))
    tl.store(logp_ptr + row, tl.where(valid, 0.0, float("-inf")))
    tl.store(valid_ptr + row, valid)


def outputs(source: Tensor, num_samples: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Empty ``(ids, probs, logprobs, valid)`` of :func:`greedy` (``num_samples = 1``) or
    :func:`several` for ``source`` (also the fake kernels')."""
    batch = source.shape[0]
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    return (
        source.new_empty((batch, num_samples), dtype=torch.int64),
        source.new_empty((batch, num_samples), dtype=dtype),
        source.new_empty((batch, num_samples), dtype=dtype),
        source.new_empty((batch,), dtype=torch.bool),
    )


def greedy(
    source: Tensor, is_logits: bool, stream: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(token_ids, probs, logprobs, valid)`` of an all-greedy single draw, one launch."""
    if source.stride(-1) != 1:
        source = source.contiguous()
    batch, vocab = source.shape
    ids, p_out, logp_out, valid = outputs(source)
    if batch:
        launch.count_launch()
        launch.launcher(_greedy_kernel, INTERPRETED)[(batch,)](
            source, source.stride(0), vocab, stream if stream is not None else ids,
            ids, p_out, logp_out, valid,
            IS_LOGITS=is_logits, IS_F64=source.dtype == torch.float64,
            STREAM_ROWS=stream is not None,
            TILE=max(tile_for(vocab, INTERPRETED), BLOCK), BLOCK=BLOCK,
        )  # fmt: skip
    return ids, p_out, logp_out, valid


# Several draws with greedy rows (``num_samples > 1``): how the kernel below gets its rows.
SOME, ALL, SCAN = 0, 1, 2  # greedy where a tensor T is 0 / every row, after the controls
#                            kernel / every row, validity scanned here (no controls kernel)
_SOME, _SCAN = tl.constexpr(SOME), tl.constexpr(SCAN)


@triton.jit
def top_entries_tile(src_ptr, src_stride, rows, take, vocab, NUM_SAMPLES: tl.constexpr,
                     N_PAD: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
                     IS_LOGITS: tl.constexpr, IS_F64: tl.constexpr):  # fmt: skip
    """Greedy draws of a tile of rows: ``(tokens, genuine)``, ``(ROWS, N_PAD)``.

    As :func:`fastsample.stages.draw._greedy_draws`: the ``NUM_SAMPLES`` largest inputs in order,
    ties by the lower index (:func:`fastsample.ops.select.top_entries`; ``-0.0`` equals
    ``0.0``), one pass over the row each (the next entry after the previous one in that
    order, as ``top_logprobs`` in :mod:`.controls`). A slot is genuine where its input is
    above ``-inf`` (logits) or 0 (probabilities); genuine slots come first and later ones
    repeat the last genuine token (``repeat_last_genuine``). Rows where ``take`` is False
    read nothing and get token 0.
    """
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    FLOOR: tl.constexpr = float("-inf") if IS_LOGITS else 0.0
    base = src_ptr + rows[:, None].to(tl.int64) * src_stride
    lanes = tl.arange(0, TILE)[None, :]
    slots = tl.arange(0, N_PAD)[None, :]
    tokens = tl.zeros((ROWS, N_PAD), tl.int64)
    genuine = tl.zeros((ROWS, N_PAD), tl.int1)
    previous = tl.full((ROWS,), float("inf"), FLOAT)
    previous_id = tl.full((ROWS,), -1, tl.int32)
    token = tl.zeros((ROWS,), tl.int64)
    for k in range(0, NUM_SAMPLES):
        best = tl.full((ROWS,), float("-inf"), FLOAT)
        best_id = tl.zeros((ROWS,), tl.int32) + vocab  # vocab: none found yet
        for start in range(0, vocab, TILE):
            offs = start + lanes
            inside = take[:, None] & (offs < vocab)
            x = tl.load(base + offs, mask=inside, other=float("-inf")).to(FLOAT)
            tied = (x == previous[:, None]) & (offs > previous_id[:, None])
            eligible = inside & ((x < previous[:, None]) | tied)  # NaN is never eligible
            top = max_of(tl.where(eligible, x, float("-inf")), 1)
            first = min_of(tl.where(eligible & (x == top[:, None]), offs, vocab), 1)
            better = (top > best) | ((top == best) & (first < best_id))
            best_id = tl.where(better, first, best_id)
            best = tl.where(better, top, best)
        previous, previous_id = best, best_id
        found = best > FLOOR
        # The first slot always takes what it found (only bad rows find nothing there).
        token = tl.where(found | (k == 0), tl.minimum(best_id, vocab - 1).to(tl.int64), token)
        tokens = tl.where(slots == k, token[:, None], tokens)
        genuine = tl.where(slots == k, found[:, None], genuine)
    return tokens, genuine


@triton.jit
def with_greedy_rows(tokens, genuine, greedy, clean, src_ptr, src_stride, rows, vocab,
                     NUM_SAMPLES: tl.constexpr, N_PAD: tl.constexpr, ROWS: tl.constexpr,
                     TILE: tl.constexpr, IS_LOGITS: tl.constexpr,
                     IS_F64: tl.constexpr):  # fmt: skip
    """``(tokens, genuine)`` drawn for a tile of rows, the ``greedy`` rows' replaced by
    :func:`top_entries_tile` where they are ``clean`` (bad rows get ``0, 1, ..., n-1`` whatever
    they draw); the top entries are read only when the tile has such a row."""
    take = greedy & clean
    if max_of(take.to(tl.int32), 0) > 0:
        top, top_genuine = top_entries_tile(
            src_ptr, src_stride, rows, take, vocab, NUM_SAMPLES, N_PAD, ROWS, TILE,
            IS_LOGITS, IS_F64,
        )  # fmt: skip
        tokens = tl.where(greedy[:, None], top, tokens)
        genuine = tl.where(greedy[:, None], top_genuine, genuine)
    return tokens, genuine


@triton.jit
def _rows_clean(base, live, vocab, IS_LOGITS: tl.constexpr, IS_F64: tl.constexpr,
                ROWS: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """:func:`fastsample.stages.draw._all_greedy`'s row test for a tile of rows (as
    :func:`.controls.scan_row`): logits without NaN with a finite maximum; probabilities
    without NaN or negative entries, ``0 < max < inf``."""
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    lanes = tl.arange(0, TILE)[None, :]
    # Element-wise over the tiles, reduced once after the loop (max, min and a NaN count are
    # exact in any order). A reduction per tile inside the loop crashes Triton 3.6's
    # TritonGPUOptimizeThreadLocality pass in the step draw kernel's SCAN mode.
    highs = tl.full((ROWS, TILE), float("-inf"), FLOAT)
    lows = tl.full((ROWS, TILE), float("inf"), FLOAT)
    nan_tiles = tl.zeros((ROWS, TILE), tl.int32)
    for start in range(0, vocab, TILE):
        offs = start + lanes
        inside = live[:, None] & (offs < vocab)
        x = tl.load(base + offs, mask=inside, other=float("-inf")).to(FLOAT)
        nan_tiles += (x != x).to(tl.int32)
        highs = tl.maximum(highs, tl.where(x != x, float("-inf"), x))
        lows = tl.minimum(lows, tl.where(inside & (x == x), x, float("inf")))
    nans = sum_of(nan_tiles, 1)
    best = max_of(highs, 1)
    least = min_of(lows, 1)
    if IS_LOGITS:
        clean = (best > float("-inf")) & (best < float("inf")) & (nans == 0)
    else:
        clean = (least >= 0) & (best > 0) & (best < float("inf")) & (nans == 0)
    return clean


@triton.jit
def _finish(weights_ptr, w_stride, rows, live, tokens, genuine, greedy, total, clean, ids_ptr,
            p_ptr, logp_ptr, valid_ptr, NUM_SAMPLES: tl.constexpr, N_PAD: tl.constexpr,
            WEIGHTED: tl.constexpr):  # fmt: skip
    """:func:`.rowwise.finish` with greedy rows: a genuine draw of a clean greedy row has
    probability 1 (log-probability 0), as the torch path's point mass; other rows' drawn
    weights over ``total`` (``WEIGHTED``: there are weights; without, every row is greedy)."""
    slots = tl.arange(0, N_PAD)[None, :]
    stored = live[:, None] & (slots < NUM_SAMPLES)
    out = rows[:, None].to(tl.int64) * NUM_SAMPLES + slots
    tl.store(ids_ptr + out, tl.where(clean[:, None], tokens, slots.to(tl.int64)), mask=stored)
    keep = clean[:, None] & genuine & stored
    probability = tl.where(keep, 1.0, 0.0).to(tl.float64)
    logprob = tl.where(keep, 0.0, float("-inf")).to(tl.float64)
    if WEIGHTED:
        drawn = tl.load(
            weights_ptr + rows[:, None].to(tl.int64) * w_stride + tokens, mask=stored, other=0.0
        ).to(tl.float64)
        weighed = keep & ~greedy[:, None]
        # 1 where not weighed: no 0 / 0 or log(0) to evaluate (the interpreter would warn).
        drawn = tl.where(weighed, drawn, 1.0)
        total_column = tl.where(weighed, total[:, None], 1.0)
        probability = tl.where(weighed, drawn / total_column, probability)
        logprob = tl.where(weighed, tl.log(drawn) - tl.log(total_column), logprob)
    tl.store(p_ptr + out, probability, mask=stored)
    tl.store(logp_ptr + out, logprob, mask=stored)
    missing = sum_of((~genuine & (slots < NUM_SAMPLES)).to(tl.int32), 1)
    tl.store(valid_ptr + rows, clean & (missing == 0), mask=live)


@triton.jit
def _draws_kernel(
    src_ptr, src_stride, batch, vocab, weights_ptr, w_stride, sums_ptr, sums_stride,
    total_ptr, clean_ptr, t_ptr,
    seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride, stream_value,
    ids_ptr, p_ptr, logp_ptr, valid_ptr,
    MODE: tl.constexpr, IS_LOGITS: tl.constexpr, IS_F64: tl.constexpr,
    NUM_SAMPLES: tl.constexpr, N_PAD: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
    SUMS_TILE: tl.constexpr, ONE_SUMS_TILE: tl.constexpr, HAS_STEP: tl.constexpr,
    STREAM_ROWS: tl.constexpr,
):  # fmt: skip
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
    clean = clean & rows_stream_in_range(rows, live, stream_ptr, stream_stride, STREAM_ROWS)
    if MODE == _SOME:
        greedy = (tl.load(t_ptr + rows, mask=live, other=1.0) == 0) & live
        c1, c2, c3, k0, k1 = row_counters(
            rows, live, seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride,
            stream_value, HAS_STEP, STREAM_ROWS, DRAW,
        )  # fmt: skip
        tokens, genuine = draw_stage(
            weights_ptr, w_stride, 1, sums_ptr, sums_stride, rows, live, vocab,
            c1, c2, c3, k0, k1, NUM_SAMPLES, N_PAD, ROWS, TILE, SUMS_TILE, ONE_SUMS_TILE,
        )  # fmt: skip
        tokens, genuine = with_greedy_rows(
            tokens, genuine, greedy, clean, src_ptr, src_stride, rows, vocab, NUM_SAMPLES,
            N_PAD, ROWS, TILE, IS_LOGITS, IS_F64,
        )  # fmt: skip
    else:
        greedy = live
        tokens, genuine = top_entries_tile(
            src_ptr, src_stride, rows, clean & live, vocab, NUM_SAMPLES, N_PAD, ROWS, TILE,
            IS_LOGITS, IS_F64,
        )  # fmt: skip
    _finish(
        weights_ptr, w_stride, rows, live, tokens, genuine, greedy, total, clean, ids_ptr,
        p_ptr, logp_ptr, valid_ptr, NUM_SAMPLES, N_PAD, MODE == _SOME,
    )  # fmt: skip


def several(
    source: Tensor,
    is_logits: bool,
    num_samples: int,
    processed: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    temperature: Tensor | None = None,
    seed: Tensor | None = None,
    step: Tensor | None = None,
    stream: Tensor | int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(token_ids, probs, logprobs, valid)`` of ``num_samples`` draws with greedy rows, one
    launch.

    * ``processed`` None: every row greedy, the rows judged here (``temperature=0``);
    * ``processed = (weights, sums, total, valid)`` of the controls kernel and ``temperature``
      None: every row greedy, judged there (``temperature=0`` with ``top_logprobs``);
    * with a ``(B,)`` ``temperature`` too: rows where it is 0 are greedy, the others draw
      from ``processed`` with the counters ``seed``/``step``/``stream`` (as
      :func:`.inverse_cdf.draw_from_sums`).

    A ``(B,)`` tensor ``stream`` out of ``[0, 2**24)`` flags its row in every mode.
    """
    if source.stride(-1) != 1:
        source = source.contiguous()
    batch, vocab = source.shape
    ids, p_out, logp_out, valid = outputs(source, num_samples)
    if batch == 0:
        return ids, p_out, logp_out, valid
    mode = SCAN if processed is None else (ALL if temperature is None else SOME)
    weights, sums, total, clean = processed if processed is not None else (source, ids, ids, ids)
    if weights.stride(-1) != 1 or (mode == SOME and sums.stride(-1) != 1):
        raise ValueError("weights and sums must have unit column stride")
    sizes = draw_sizes(batch, vocab, num_samples)
    counter_args = counter_arguments(seed if seed is not None else ids, step, stream)
    launch.count_launch()
    launch.launcher(_draws_kernel, INTERPRETED)[launch.grid(batch, sizes["ROWS"])](
        source, source.stride(0), batch, vocab, weights, weights.stride(0), sums, sums.stride(0),
        total, clean, temperature if temperature is not None else total, *counter_args,
        ids, p_out, logp_out, valid,
        MODE=mode, IS_LOGITS=is_logits, IS_F64=source.dtype == torch.float64,
        HAS_STEP=step is not None, STREAM_ROWS=isinstance(stream, Tensor), **sizes,
    )  # fmt: skip
    return ids, p_out, logp_out, valid
