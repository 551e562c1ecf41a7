"""The exponential race in one Triton launch: ``fast_sample`` and ``method="race"``.

Entry point: :func:`race` (launcher) ``(probs, num_samples, seed, step, stream, fast)``.

Math (as :func:`fastsample.ops.race.race_draw`): scores ``s_i = p_i / E_i`` in float64 with
``E_i = -log1p(-u_i)``, ``u_i`` the Philox uniform of vocabulary index ``i`` (purpose
``ENTRY``), so the same counters give the torch path's noise; float64 rows whose largest
weight is below ``2**-961`` or at least ``2**969`` are first scaled by a power of two (one more
read of the row, :func:`fastsample.ops.race.power_of_two_scales`: the largest scores neither
lose precision nor overflow) and a positive weight's score is at least the smallest positive
float64. The ordered draws without replacement are the ``n`` largest scores (ties to the lower
index). A draw is genuine when its score is positive; later slots of a row that ran out of
positive weights repeat its last genuine draw. Alongside the first draw the same pass takes the
float32 block sums (float64 for float64 input) of :func:`fastsample.ops.inverse_cdf.block_sums`,
their float64 total and the bad-value flags that decide ``clean`` (no NaN, no negative weight,
``0 < total`` and no float32 overflow, a tensor ``stream`` in range).

One program per row (a tile of rows in the interpreter); draw ``k > 0`` makes one more pass
that takes the largest score ranked after draw ``k - 1`` (score descending, index
ascending), recomputing the noise rather than storing ``V`` scores: Philox is cheaper than a
round trip through memory, and ``n`` is small in practice.

Shapes and dtypes: ``probs (B, V)`` float16/bfloat16/float32/float64, any strides; seed,
step ``(B,)`` int64 (stride 0 for a broadcast value); outputs ``token_ids (B, n) int64``,
``probs``/``logprobs (B, n)`` float32 (float64 for float64 input), ``valid (B,) bool``; with
``fast``, ``sample_p (B, n)`` in ``probs``' dtype and ``sample_index (B, n) int64``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.seeds import Purpose
from . import launch
from .philox import INTERPRETED, entry_uniforms, exponential_noise
from .rowwise import finish, row_counters, stream_in_range, total_fits

ENTRY = tl.constexpr(int(Purpose.ENTRY))  # the counter purpose of per-entry noise


@triton.jit
def _best_in_tile(scores, columns, prev_score, prev_column, best_score, best_column):
    """Merge a tile's largest eligible score (after ``prev`` in the race order) into the best.

    Eligible: ranked after the previous draw (a smaller score, or an equal one at a higher
    index); NaN is never eligible. Strict ``>`` keeps the earlier tile on ties.
    """
    after = (scores < prev_score[:, None]) | (
        (scores == prev_score[:, None]) & (columns > prev_column[:, None])
    )
    masked = tl.where(after, scores, -1.0)
    top = tl.max(masked, 1)
    at = tl.min(tl.where(masked == top[:, None], columns, 2**62), 1)
    better = top > best_score
    return tl.where(better, top, best_score), tl.where(better, at, best_column)


@triton.jit
def _power_of_two_scales(peak):
    """``(up, down) = (2**h1, 2**-h2)`` of :func:`fastsample.ops.race.power_of_two_scales` for
    the row maxima ``peak``, by the same integer steps on the bit pattern."""
    usable = (peak > 0) & (peak < float("inf"))
    subnormal = ((peak.to(tl.int64, bitcast=True) >> 52) & 0x7FF) == 0
    lifted = tl.where(subnormal, peak * 18446744073709551616.0, peak)  # 2**64: exact
    field = (lifted.to(tl.int64, bitcast=True) >> 52) & 0x7FF
    exponent = field - tl.where(subnormal, 1086, 1022)  # peak = m 2**exponent, m in [.5, 1)
    n = tl.where(exponent < -960, -exponent, tl.where(exponent > 969, 969 - exponent, 0))
    n = tl.where(usable, n, 0)
    h1 = n >> 1
    h2 = n - h1
    up = ((h1 + 1023) << 52).to(tl.float64, bitcast=True)
    down = ((1023 - h2) << 52).to(tl.float64, bitcast=True)
    return up, down


@triton.jit
def _scores(x, u, up, down, LOG1P: tl.constexpr, SCALE: tl.constexpr):
    """Race scores ``p / E`` in float64; float64 rows as ``(p / (E down)) up`` (exact steps), a
    positive weight's score at least the smallest positive float64 (as the torch path)."""
    noise = exponential_noise(u, LOG1P)
    if SCALE:
        scores = (x.to(tl.float64) / (noise * down)) * up
        smallest = tl.full(scores.shape, 1, tl.int64).to(tl.float64, bitcast=True)
        return tl.where((scores == 0) & (x > 0), smallest, scores)
    return x.to(tl.float64) / noise


@triton.jit
def _race_kernel(
    probs_ptr,
    batch,
    vocab,
    row_stride,
    col_stride,
    seed_ptr,
    seed_stride,
    step_ptr,
    step_stride,
    stream_ptr,
    stream_stride,
    stream_value,
    ids_ptr,
    p_ptr,
    logp_ptr,
    valid_ptr,
    NUM_SAMPLES: tl.constexpr,
    N_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    TILE: tl.constexpr,
    HAS_STEP: tl.constexpr,
    STREAM_ROWS: tl.constexpr,
    FAST: tl.constexpr,
    LOG1P: tl.constexpr,
    SUM_F64: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0)  # padding rows read row 0 and store nothing
    c1, c2, c3, k0, k1 = row_counters(
        rows, live, seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride,
        stream_value, HAS_STEP, STREAM_ROWS, ENTRY,
    )  # fmt: skip
    c1, c2, c3, k0, k1 = c1[:, None], c2[:, None], c3[:, None], k0[:, None], k1[:, None]
    row_base = probs_ptr + rows[:, None].to(tl.int64) * row_stride
    offsets = tl.arange(0, TILE)[None, :]
    slots = tl.arange(0, N_PAD)[None, :]

    # float64 rows: the power of two that keeps the row's largest scores normal and finite.
    up = tl.full((ROWS, 1), 1.0, tl.float64)
    down = tl.full((ROWS, 1), 1.0, tl.float64)
    if SUM_F64:
        peak = tl.zeros((ROWS,), tl.float64)
        for start in range(0, vocab, TILE):
            columns = start + offsets.to(tl.int64)
            x = tl.load(row_base + columns * col_stride, mask=columns < vocab, other=0.0)
            x = x.to(tl.float64)
            # NaN (a bad row, whose draws are replaced) is left out of the maximum.
            peak = tl.maximum(peak, tl.max(tl.where(x == x, x, 0.0), 1))
        up, down = _power_of_two_scales(peak)
        up, down = up[:, None], down[:, None]

    # Pass 1: block sums (the validity of the row) and the first draw.
    total = tl.zeros((ROWS,), tl.float64)
    bad = tl.zeros((ROWS,), tl.int32)
    best_score = tl.full((ROWS,), -2.0, tl.float64)
    best_column = tl.zeros((ROWS,), tl.int64)
    first = tl.full((ROWS,), float("inf"), tl.float64)
    none = tl.full((ROWS,), -1, tl.int64)
    for start in range(0, vocab, TILE):
        columns = start + offsets.to(tl.int64)
        inside = columns < vocab
        x = tl.load(row_base + columns * col_stride, mask=inside, other=0.0)
        # Sums and checks in the accumulation dtype (half types compare unreliably as such
        # in the interpreter, and torch widens them first too).
        wide = x.to(tl.float64) if SUM_F64 else x.to(tl.float32)
        block_sum = tl.sum(wide, 1).to(tl.float64)
        total += block_sum
        bad += tl.sum(((wide < 0) | (wide != wide)).to(tl.int32), 1)
        u = entry_uniforms(start // 2, ROWS, TILE // 2, c1, c2, c3, k0, k1)
        scores = tl.where(inside, _scores(x, u, up, down, LOG1P, SUM_F64), -1.0)
        best_score, best_column = _best_in_tile(
            scores, columns, first, none, best_score, best_column
        )
    clean = (bad == 0) & total_fits(total, SUM_F64)
    clean = clean & stream_in_range(rows, live, stream_ptr, stream_stride, STREAM_ROWS)
    tokens = tl.where(slots == 0, best_column[:, None], 0)
    genuine = tl.where(slots == 0, (best_score > 0)[:, None], False)

    # Passes 2..n: the next score in the race order, from recomputed noise.
    previous_score, previous_column, previous_token = best_score, best_column, best_column
    for k in range(1, NUM_SAMPLES):
        best_score = tl.full((ROWS,), -2.0, tl.float64)
        best_column = tl.zeros((ROWS,), tl.int64)
        for start in range(0, vocab, TILE):
            columns = start + offsets.to(tl.int64)
            inside = columns < vocab
            x = tl.load(row_base + columns * col_stride, mask=inside, other=0.0)
            u = entry_uniforms(start // 2, ROWS, TILE // 2, c1, c2, c3, k0, k1)
            scores = tl.where(inside, _scores(x, u, up, down, LOG1P, SUM_F64), -1.0)
            best_score, best_column = _best_in_tile(
                scores, columns, previous_score, previous_column, best_score, best_column
            )
        is_genuine = best_score > 0
        token = tl.where(is_genuine, best_column, previous_token)
        tokens = tl.where(slots == k, token[:, None], tokens)
        genuine = tl.where(slots == k, is_genuine[:, None], genuine)
        previous_score, previous_column, previous_token = best_score, best_column, token

    finish(
        probs_ptr, row_stride, col_stride, rows, live, tokens, genuine, total, clean,
        ids_ptr, p_ptr, logp_ptr, valid_ptr, NUM_SAMPLES, N_PAD, FAST,
    )  # fmt: skip


def race(
    probs: Tensor,
    num_samples: int,
    seed: Tensor,
    step: Tensor | None,
    stream: Tensor | int,
    fast: bool,
) -> tuple[Tensor, ...]:
    """Launch the race over checked arguments; one launch, no other device op.

    Returns ``(token_ids, probs, logprobs, valid)`` or, with ``fast``, ``(sample_p,
    sample_index)`` (see the module docstring for shapes).
    """
    batch, vocab = probs.shape
    device = probs.device
    ids = torch.empty((batch, num_samples), dtype=torch.int64, device=device)
    if fast:
        p_out = torch.empty((batch, num_samples), dtype=probs.dtype, device=device)
        logp_out, valid = p_out, ids  # unused by the FAST kernel
    else:
        out_dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
        p_out = torch.empty((batch, num_samples), dtype=out_dtype, device=device)
        logp_out = torch.empty_like(p_out)
        valid = torch.empty((batch,), dtype=torch.bool, device=device)
    if batch:
        rows = launch.rows_per_program(batch, INTERPRETED, vocab)
        stream_rows = isinstance(stream, Tensor)
        launch.count_launch()
        launch.launcher(_race_kernel, INTERPRETED)[launch.grid(batch, rows)](
            probs, batch, vocab, probs.stride(0), probs.stride(1),
            seed, seed.stride(0), seed if step is None else step,
            0 if step is None else step.stride(0),
            stream if stream_rows else seed, stream.stride(0) if stream_rows else 0,
            0 if stream_rows else stream,
            ids, p_out, logp_out, valid,
            NUM_SAMPLES=num_samples, N_PAD=triton.next_power_of_2(num_samples), ROWS=rows,
            TILE=launch.tile_width(vocab), HAS_STEP=step is not None, STREAM_ROWS=stream_rows,
            FAST=fast, LOG1P=not INTERPRETED, SUM_F64=probs.dtype == torch.float64,
        )  # fmt: skip
    if fast:
        return p_out, ids
    return ids, p_out, logp_out, valid
