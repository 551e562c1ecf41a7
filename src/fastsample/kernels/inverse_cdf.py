"""The blocked inverse CDF in Triton: ``sample_from_probs(method="inverse_cdf")`` in one launch.

Entry points:

* :func:`inverse_cdf` (launcher) ``(probs, num_samples, seed, step, stream)`` -> ``(token_ids,
  probs, logprobs, valid)``: block sums, draws and the bad-row finish in one kernel.
* :func:`draw_from_sums` (launcher) ``(weights, sums, total, clean, num_samples, seed, step,
  stream)`` -> the same four outputs, for weights whose float64 block sums, total and
  validity were computed elsewhere (the fused controls kernel): the second stage alone.
* :func:`block_sums_stage` and :func:`draw_stage` (``@triton.jit``): the two stages, for a
  kernel that wants to run them itself.

Math (as :func:`fastsample.ops.inverse_cdf.inverse_cdf_draw`, with the same counters): blocks
of 256 entries, float32 block sums (float64 for float64 input) widened to float64; for draw
``k`` one uniform ``u_k`` (purpose ``DRAW``, position ``k``), the float64 prefix ``P`` of the
block sums, ``t = min(u_k * P_last, nextafter(P_last, 0))``, the block ``j`` = the number of
prefixes ``<= t``, then inside block ``j`` the float64 prefix ``c`` of its weights, ``t' =
min(f * c_last, nextafter(c_last, 0))`` with ``f = (t - (P_j - S_j)) / S_j`` clamped to
``[0, 1]``, and the entry = the number of ``c_i <= t'``. Later draws remove the drawn entries
(zeroed in their block; the block's sum replaced by the float64 sum of what is left). Zero
weights are never drawn (strict comparisons); every index is clamped into range.

Order of additions: the interpreter's cumulative sums run left to right like the torch
path's, so with up to 1024 blocks (V <= 262,144) the prefixes are the torch path's numbers;
on a GPU the scans run as trees, and a draw can differ from the torch path only where ``t``
falls within rounding of a block or entry boundary. Block sums are float32 tree sums either
way (a last-bit difference from torch's vectorized sum is possible, with the same effect).

Rows: one program per row on a GPU, a tile of rows in the interpreter (see
:mod:`fastsample.kernels.launch`); the block sums go to a ``(B, ceil(V / 256))`` float64
scratch that only the row's own program reads back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.seeds import Purpose
from . import launch
from .philox import INTERPRETED, uniform_at
from .rowwise import finish, row_counters, stream_in_range, total_fits, toward_zero

DRAW = tl.constexpr(int(Purpose.DRAW))  # the counter purpose of per-draw uniforms
MAX_SUMS_TILE = 1024  # block sums scanned per step (all of them for V <= 262,144)
STEP_BLOCKS = 4  # blocks read per step of the block-sums pass (4 KiB of float32 per program)


@triton.jit
def block_sums_stage(
    probs_ptr,
    row_stride,
    col_stride,
    rows,
    live,
    vocab,
    sums_ptr,
    sums_stride,
    ROWS: tl.constexpr,
    TILE: tl.constexpr,
    SUM_F64: tl.constexpr,
    STEP_BLOCKS: tl.constexpr = 1,
):
    """Store each row's float64 block sums to ``sums``; return ``(total, clean)``, ``(ROWS,)``.

    ``clean``: no NaN, no negative weight, ``0 < total``, no overflow (the torch path's test).
    Each step reads ``STEP_BLOCKS`` blocks of ``TILE`` entries as one ``(ROWS, STEP_BLOCKS,
    TILE)`` tile: more bytes in flight per program on a GPU, fewer steps in the interpreter.
    """
    num_blocks = tl.cdiv(vocab, TILE)
    row_base = probs_ptr + rows[:, None, None].to(tl.int64) * row_stride
    step = tl.arange(0, STEP_BLOCKS)[None, :]
    offsets = (step[:, :, None] * TILE + tl.arange(0, TILE)[None, None, :]).to(tl.int64)
    sums_row = sums_ptr + rows[:, None].to(tl.int64) * sums_stride
    total = tl.zeros((ROWS,), tl.float64)
    bad = tl.zeros((ROWS,), tl.int32)
    for first in range(0, num_blocks, STEP_BLOCKS):
        columns = first * TILE + offsets
        x = tl.load(row_base + columns * col_stride, mask=columns < vocab, other=0.0)
        # Sums and checks in the accumulation dtype (half types compare unreliably as such
        # in the interpreter, and torch widens them first too).
        wide = x.to(tl.float64) if SUM_F64 else x.to(tl.float32)
        block_sums = tl.sum(wide, 2).to(tl.float64)  # (ROWS, STEP_BLOCKS)
        index = first + step
        tl.store(sums_row + index, block_sums, mask=live[:, None] & (index < num_blocks))
        total += tl.sum(block_sums, 1)
        bad += tl.sum(tl.sum(((wide < 0) | (wide != wide)).to(tl.int32), 2), 1)
    return total, (bad == 0) & total_fits(total, SUM_F64)


@triton.jit
def _last(tile, WIDTH: tl.constexpr):
    """The last column of a ``(ROWS, WIDTH)`` tile, exactly."""
    last = tl.arange(0, WIDTH)[None, :] == WIDTH - 1
    return tl.sum(tl.where(last, tile, tl.zeros_like(tile)), 1)


@triton.jit
def _sums_tile(sums_base, first, num_blocks, live, drawn_blocks, lefts, slots, k, WIDTH, REMOVALS):
    """Block sums ``first .. first + WIDTH - 1`` with the removals of draws ``< k`` applied.

    A block drawn from before holds what was left after its latest draw (``lefts``).
    """
    index = first + tl.arange(0, WIDTH)[None, :].to(tl.int64)
    sums = tl.load(sums_base[:, None] + index, mask=live[:, None] & (index < num_blocks), other=0.0)
    if REMOVALS:
        earlier = slots[:, None, :] < k
        match = (index[:, :, None] == drawn_blocks[:, None, :]) & earlier
        latest = tl.max(tl.where(match, slots[:, None, :], -1), 2)
        left = tl.sum(tl.where(slots[:, None, :] == latest[:, :, None], lefts[:, None, :], 0.0), 2)
        sums = tl.where(latest >= 0, left, sums)
    return index, sums


@triton.jit
def _pick_block(index, sums, prefix, target, block, num_blocks):
    """The number of prefixes ``<= target`` so far, and the prefix and sum at ``block``."""
    below = (prefix <= target[:, None]) & (index < num_blocks)
    here = index == block[:, None]
    at_prefix = tl.sum(tl.where(here, prefix, 0.0), 1)
    return tl.sum(below.to(tl.int64), 1), at_prefix, tl.sum(tl.where(here, sums, 0.0), 1)


@triton.jit
def draw_stage(
    weights_ptr,
    row_stride,
    col_stride,
    sums_ptr,
    sums_stride,
    rows,
    live,
    vocab,
    c1,
    c2,
    c3,
    k0,
    k1,
    NUM_SAMPLES: tl.constexpr,
    N_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    TILE: tl.constexpr,
    SUMS_TILE: tl.constexpr,
    ONE_SUMS_TILE: tl.constexpr,
):
    """``NUM_SAMPLES`` ordered draws without replacement for a tile of rows.

    ``weights`` ``(B, V)`` any float dtype and strides; ``sums`` ``(B, ceil(V / TILE))``
    float64 block sums of those weights (read only); Philox words ``(ROWS,)`` of purpose
    ``DRAW``. Returns ``(tokens, genuine)``, ``(ROWS, N_PAD)`` int64 / bool: slot ``k`` is
    genuine when weight was left for draw ``k``; a non-genuine slot repeats the previous token.
    """
    num_blocks = tl.cdiv(vocab, TILE)
    width = tl.minimum(vocab, TILE)
    sums_base = sums_ptr + rows.to(tl.int64) * sums_stride
    row_base = weights_ptr + rows[:, None].to(tl.int64) * row_stride
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    slots = tl.arange(0, N_PAD)[None, :]
    tokens = tl.zeros((ROWS, N_PAD), tl.int64)
    genuine = tl.zeros((ROWS, N_PAD), tl.int1)
    drawn_blocks = tl.full((ROWS, N_PAD), -1, tl.int64)
    lefts = tl.zeros((ROWS, N_PAD), tl.float64)
    previous = tl.zeros((ROWS,), tl.int64)
    for k in range(0, NUM_SAMPLES):
        u = uniform_at(tl.zeros((ROWS,), tl.int64) + k, c1, c2, c3, k0, k1)
        if ONE_SUMS_TILE:  # every block sum in one tile: one pass finds the block
            index, sums = _sums_tile(
                sums_base, 0, num_blocks, live, drawn_blocks, lefts, slots, k, SUMS_TILE,
                NUM_SAMPLES > 1,
            )  # fmt: skip
            prefix = tl.cumsum(sums, 1)
            remaining = _last(prefix, SUMS_TILE)
            target = tl.minimum(u * remaining, toward_zero(remaining))
            count = tl.sum(((prefix <= target[:, None]) & (index < num_blocks)).to(tl.int64), 1)
            _, prefix_at, sum_at = _pick_block(
                index, sums, prefix, target, tl.minimum(count, num_blocks - 1), num_blocks
            )
        else:
            # The remaining mass: the last prefix, exactly as the search below computes it.
            carry = tl.zeros((ROWS,), tl.float64)
            for first in range(0, num_blocks, SUMS_TILE):
                index, sums = _sums_tile(
                    sums_base, first, num_blocks, live, drawn_blocks, lefts, slots, k,
                    SUMS_TILE, NUM_SAMPLES > 1,
                )  # fmt: skip
                carry = _last(carry[:, None] + tl.cumsum(sums, 1), SUMS_TILE)
            remaining = carry
            target = tl.minimum(u * remaining, toward_zero(remaining))
            # The block: the number of prefixes <= target, with its prefix and sum.
            carry = tl.zeros((ROWS,), tl.float64)
            count = tl.zeros((ROWS,), tl.int64)
            prefix_at = tl.zeros((ROWS,), tl.float64)
            sum_at = tl.zeros((ROWS,), tl.float64)
            for first in range(0, num_blocks, SUMS_TILE):
                index, sums = _sums_tile(
                    sums_base, first, num_blocks, live, drawn_blocks, lefts, slots, k,
                    SUMS_TILE, NUM_SAMPLES > 1,
                )  # fmt: skip
                prefix = carry[:, None] + tl.cumsum(sums, 1)
                carry = _last(prefix, SUMS_TILE)
                below = (prefix <= target[:, None]) & (index < num_blocks)
                count += tl.sum(below.to(tl.int64), 1)
                at = tl.minimum(count, num_blocks - 1)
                seen = (at >= first) & (at < first + SUMS_TILE)
                _, tile_prefix, tile_sum = _pick_block(index, sums, prefix, target, at, num_blocks)
                prefix_at = tl.where(seen, tile_prefix, prefix_at)
                sum_at = tl.where(seen, tile_sum, sum_at)
        block = tl.minimum(count, num_blocks - 1)
        # A valid row's chosen block has positive mass; 0 only on rows that are replaced
        # anyway (no weight left, padding rows), where 1 avoids a meaningless 0 / 0.
        fraction = (target - (prefix_at - sum_at)) / tl.where(sum_at > 0, sum_at, 1.0)
        fraction = tl.minimum(tl.maximum(fraction, 0.0), 1.0)

        # Inside the block: its weights less earlier draws, their float64 prefix, the entry.
        start = block * TILE
        columns = start[:, None] + offsets
        inside = live[:, None] & (columns < vocab)
        values = tl.load(row_base + columns * col_stride, mask=inside, other=0.0).to(tl.float64)
        if NUM_SAMPLES > 1:  # earlier draws leave the block
            drawn_before = (columns[:, :, None] == tokens[:, None, :]) & (slots[:, None, :] < k)
            values = tl.where(tl.max(drawn_before.to(tl.int32), 2) > 0, 0.0, values)
        within = tl.cumsum(values, 1)
        block_total = _last(within, TILE)
        inner_target = tl.minimum(fraction * block_total, toward_zero(block_total))
        inner = tl.sum((within <= inner_target[:, None]).to(tl.int64), 1)
        inner = tl.minimum(inner, width - 1)
        is_genuine = remaining > 0
        token = tl.minimum(start + inner, vocab - 1)
        token = tl.where(is_genuine | (k == 0), token, previous)
        tokens = tl.where(slots == k, token[:, None], tokens)
        genuine = tl.where(slots == k, is_genuine[:, None], genuine)
        if NUM_SAMPLES > 1:  # its block's sum becomes the float64 sum of what is left in it
            left = tl.sum(tl.where(offsets == inner[:, None], 0.0, values), 1)
            drawn_blocks = tl.where(slots == k, block[:, None], drawn_blocks)
            lefts = tl.where(slots == k, left[:, None], lefts)
        previous = token
    return tokens, genuine


@triton.jit
def _inverse_cdf_kernel(
    probs_ptr, batch, vocab, row_stride, col_stride, sums_ptr, sums_stride,
    seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride, stream_value,
    ids_ptr, p_ptr, logp_ptr, valid_ptr,
    NUM_SAMPLES: tl.constexpr, N_PAD: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
    SUMS_TILE: tl.constexpr, ONE_SUMS_TILE: tl.constexpr, HAS_STEP: tl.constexpr,
    STREAM_ROWS: tl.constexpr,
    SUM_F64: tl.constexpr, STEP_BLOCKS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0)  # padding rows read row 0 and store nothing
    total, clean = block_sums_stage(
        probs_ptr, row_stride, col_stride, rows, live, vocab, sums_ptr, sums_stride,
        ROWS, TILE, SUM_F64, STEP_BLOCKS,
    )  # fmt: skip
    clean = clean & stream_in_range(rows, live, stream_ptr, stream_stride, STREAM_ROWS)
    tl.debug_barrier()  # the sums just stored are read back by other threads of the program
    c1, c2, c3, k0, k1 = row_counters(
        rows, live, seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride,
        stream_value, HAS_STEP, STREAM_ROWS, DRAW,
    )  # fmt: skip
    tokens, genuine = draw_stage(
        probs_ptr, row_stride, col_stride, sums_ptr, sums_stride, rows, live, vocab,
        c1, c2, c3, k0, k1, NUM_SAMPLES, N_PAD, ROWS, TILE, SUMS_TILE, ONE_SUMS_TILE,
    )  # fmt: skip
    finish(
        probs_ptr, row_stride, col_stride, rows, live, tokens, genuine, total, clean,
        ids_ptr, p_ptr, logp_ptr, valid_ptr, NUM_SAMPLES, N_PAD, False,
    )  # fmt: skip


@triton.jit
def _draw_kernel(
    weights_ptr, batch, vocab, row_stride, col_stride, sums_ptr, sums_stride,
    total_ptr, clean_ptr,
    seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride, stream_value,
    ids_ptr, p_ptr, logp_ptr, valid_ptr,
    NUM_SAMPLES: tl.constexpr, N_PAD: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
    SUMS_TILE: tl.constexpr, ONE_SUMS_TILE: tl.constexpr, HAS_STEP: tl.constexpr,
    STREAM_ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0)
    total = tl.load(total_ptr + rows, mask=live, other=0.0)
    clean = tl.load(clean_ptr + rows, mask=live, other=0) != 0
    clean = clean & stream_in_range(rows, live, stream_ptr, stream_stride, STREAM_ROWS)
    c1, c2, c3, k0, k1 = row_counters(
        rows, live, seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride,
        stream_value, HAS_STEP, STREAM_ROWS, DRAW,
    )  # fmt: skip
    tokens, genuine = draw_stage(
        weights_ptr, row_stride, col_stride, sums_ptr, sums_stride, rows, live, vocab,
        c1, c2, c3, k0, k1, NUM_SAMPLES, N_PAD, ROWS, TILE, SUMS_TILE, ONE_SUMS_TILE,
    )  # fmt: skip
    finish(
        weights_ptr, row_stride, col_stride, rows, live, tokens, genuine, total, clean,
        ids_ptr, p_ptr, logp_ptr, valid_ptr, NUM_SAMPLES, N_PAD, False,
    )  # fmt: skip


def _outputs(weights: Tensor, num_samples: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch, device = weights.shape[0], weights.device
    out_dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
    ids = torch.empty((batch, num_samples), dtype=torch.int64, device=device)
    p_out = torch.empty((batch, num_samples), dtype=out_dtype, device=device)
    return ids, p_out, torch.empty_like(p_out), torch.empty(batch, dtype=torch.bool, device=device)


def counter_arguments(seed: Tensor, step: Tensor | None, stream: Tensor | int) -> tuple:
    """Kernel arguments for the counters: pointers, strides and the stream number."""
    stream_rows = isinstance(stream, Tensor)
    return (
        seed, seed.stride(0), seed if step is None else step, 0 if step is None else step.stride(0),
        stream if stream_rows else seed, stream.stride(0) if stream_rows else 0,
        0 if stream_rows else stream,
    )  # fmt: skip


def draw_sizes(batch: int, vocab: int, num_samples: int) -> dict:
    tile = launch.tile_width(vocab)
    num_blocks = triton.cdiv(vocab, tile)
    sums_tile = min(max(16, triton.next_power_of_2(num_blocks)), MAX_SUMS_TILE)
    return dict(
        NUM_SAMPLES=num_samples, N_PAD=triton.next_power_of_2(num_samples),
        ROWS=launch.rows_per_program(batch, INTERPRETED, vocab, num_samples), TILE=tile,
        SUMS_TILE=sums_tile,
        ONE_SUMS_TILE=num_blocks <= sums_tile,
    )  # fmt: skip


def inverse_cdf(
    probs: Tensor, num_samples: int, seed: Tensor, step: Tensor | None, stream: Tensor | int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One launch: ``(token_ids (B, n), probs (B, n), logprobs (B, n), valid (B,))``.

    Arguments already checked; ``seed``/``step`` ``(B,)`` int64 (``step`` None for 0),
    ``stream`` a ``(B,)`` int64 tensor or an int.
    """
    batch, vocab = probs.shape
    ids, p_out, logp_out, valid = _outputs(probs, num_samples)
    if batch:
        sizes = draw_sizes(batch, vocab, num_samples)
        step_blocks = min(STEP_BLOCKS, triton.next_power_of_2(triton.cdiv(vocab, sizes["TILE"])))
        sizes["ROWS"] = max(1, sizes["ROWS"] // step_blocks)  # the same interpreter tile size
        sums = torch.empty(
            (batch, triton.cdiv(vocab, sizes["TILE"])), dtype=torch.float64, device=probs.device
        )
        launch.count_launch()
        launch.launcher(_inverse_cdf_kernel, INTERPRETED)[launch.grid(batch, sizes["ROWS"])](
            probs, batch, vocab, probs.stride(0), probs.stride(1), sums, sums.stride(0),
            *counter_arguments(seed, step, stream), ids, p_out, logp_out, valid,
            HAS_STEP=step is not None, STREAM_ROWS=isinstance(stream, Tensor),
            SUM_F64=probs.dtype == torch.float64, STEP_BLOCKS=step_blocks, **sizes,
        )  # fmt: skip
    return ids, p_out, logp_out, valid


def draw_from_sums(
    weights: Tensor,
    sums: Tensor,
    total: Tensor,
    clean: Tensor,
    num_samples: int,
    seed: Tensor,
    step: Tensor | None,
    stream: Tensor | int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The draw stage alone, one launch, over precomputed block sums.

    Args:
        weights: ``(B, V)`` non-negative weights, any float dtype and strides.
        sums: ``(B, ceil(V / 256))`` float64 block sums of ``weights`` over blocks of 256
            (one block when ``V < 256``), row stride free, unit column stride.
        total: ``(B,)`` float64, the normalizer of the returned probabilities.
        clean: ``(B,)`` bool; False rows get the bad-row result (so do rows whose tensor
            ``stream`` is out of range).
        num_samples, seed, step, stream: as in :func:`inverse_cdf`.

    Returns ``(token_ids, probs, logprobs, valid)`` as :func:`inverse_cdf`.
    """
    batch, vocab = weights.shape
    ids, p_out, logp_out, valid = _outputs(weights, num_samples)
    sizes = draw_sizes(batch, vocab, num_samples)
    if sums.shape != (batch, triton.cdiv(vocab, sizes["TILE"])) or sums.stride(1) != 1:
        raise ValueError(f"sums must be ({batch}, ceil(V / 256)) float64 with unit column stride")
    if batch:
        launch.count_launch()
        launch.launcher(_draw_kernel, INTERPRETED)[launch.grid(batch, sizes["ROWS"])](
            weights, batch, vocab, weights.stride(0), weights.stride(1), sums, sums.stride(0),
            total, clean, *counter_arguments(seed, step, stream), ids, p_out, logp_out, valid,
            HAS_STEP=step is not None, STREAM_ROWS=isinstance(stream, Tensor), **sizes,
        )  # fmt: skip
    return ids, p_out, logp_out, valid
