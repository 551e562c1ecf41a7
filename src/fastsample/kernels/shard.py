"""Shard-local work of one vocabulary-parallel sampling round in three Triton launches
(:mod:`fastsample.distributed.shard` is the reference; the collectives stay with the caller).

One round (one draw; temperature and a logits min-p cut, no top-k/top-p) on a rank holding
columns ``[start, start + local)`` of a ``vocab``-entry vocabulary:

1. :func:`summaries` -> ``(B, 2)`` float64: the shard's row maximum (``-inf`` on a bad row) and
   its badness (NaN anywhere for logits; NaN or a negative entry for probabilities). All-gathered.
2. :func:`weights_and_sums` reads the gathered ``(world, B, 2)`` table (global maximum ``top``,
   validity), writes the shard's weights ``(B, width)`` (logits: ``exp((x - top) / T)``, kept
   where ``> min_p_below``; probabilities: ``(p / top)^(1/T)`` as ``exp(log(p / top) / T)``, or
   ``p`` itself in the torch path's no-copy case) and the ``(B, slots)`` slot masses: this rank's
   head slot and its grid slots of 256 entries (block sums, float32 for float32 weights), zero
   elsewhere. All-reduced with SUM.
3. :func:`draw_record` reads the summed masses: float64 prefix, one uniform (Philox, purpose
   ``DRAW``, position 0, the torch path's counters), the slot ``J`` = the number of prefixes
   ``<= min(u S, nextafter(S, 0))``; the rank that owns ``J`` scans its entries (float64 prefix,
   as :func:`fastsample.distributed.shard.draw_in_slot`) and writes the finished result (token
   id, probability ``w / total`` and log-probability ``log w - log total`` in the output dtype,
   valid) into a ``(B, 4)`` int64 record; the other ranks write ``INT64_MIN``, and every rank
   writes the same fallback record for an invalid row. A MAX all-reduce of the records leaves
   every rank with the owner's result, and the outputs are views of it (no unpacking launch).

Record layout (int64 words): ``[token, bits(prob), bits(logprob), valid]``; float32 outputs sit
in the low 32 bits (little-endian: the even float32 column of the int64 word's pair).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.inverse_cdf import BLOCK
from ..ops.seeds import Purpose
from . import launch
from .philox import INTERPRETED, counter_words, row_key, uniform_at
from .rowwise import toward_zero

DRAW = tl.constexpr(int(Purpose.DRAW))
INT64_MIN = tl.constexpr(-(2**63))
RECORD = 4  # int64 words per row of the record


def _rows(batch: int, elements: int) -> int:
    """1 on a GPU; a power-of-two tile of rows in the interpreter (largest tile <= 2^20)."""
    if not INTERPRETED:
        return 1
    cap = max(1, (1 << 20) // max(elements, 1))
    return min(triton.next_power_of_2(max(batch, 1)), 1 << (cap.bit_length() - 1))


@triton.jit
def _summary_kernel(
    x_ptr, x_sb, x_sv, batch, local, out_ptr,
    IS_LOGITS: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0).to(tl.int64)
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    best = tl.full((ROWS,), float("-inf"), tl.float64)
    bad = tl.zeros((ROWS,), tl.int32)
    for start in range(0, local, TILE):
        columns = start + offsets
        inside = live[:, None] & (columns < local)
        x = tl.load(x_ptr + rows[:, None] * x_sb + columns * x_sv, mask=inside, other=0.0)
        x = x.to(tl.float64)
        if IS_LOGITS:  # noqa: SIM108 (constexpr branches)
            wrong = x != x
        else:
            wrong = (x != x) | (x < 0)
        bad += tl.sum(wrong.to(tl.int32), 1)
        best = tl.maximum(best, tl.max(tl.where(inside & ~wrong, x, float("-inf")), 1))
    bad_row = bad > 0
    tl.store(out_ptr + rows * 2, tl.where(bad_row, float("-inf"), best), mask=live)
    tl.store(out_ptr + rows * 2 + 1, bad_row.to(tl.float64), mask=live)


@triton.jit
def _global_top(table_ptr, rows, live, batch, world, IS_LOGITS: tl.constexpr):
    """``(top, finite)`` per row from the gathered ``(world, B, 2)`` summaries."""
    top = tl.full(rows.shape, float("-inf"), tl.float64)
    bad = tl.zeros(rows.shape, tl.float64)
    for r in range(0, world):
        top = tl.maximum(top, tl.load(table_ptr + (r * batch + rows) * 2, mask=live, other=0.0))
        bad = tl.maximum(bad, tl.load(table_ptr + (r * batch + rows) * 2 + 1, mask=live, other=0.0))
    clean = ~(bad > 0)
    if IS_LOGITS:
        finite = clean & (top > float("-inf")) & (top < float("inf"))
    else:
        finite = clean & (top > 0) & (top < float("inf"))
    return top, finite


@triton.jit
def _weights_kernel(
    x_ptr, x_sb, x_sv, table_ptr, w_ptr, sums_ptr,
    batch, world, local, width, head, first, owned, grid, rank, slots,
    temperature_bits, min_p_bits,
    IS_LOGITS: tl.constexpr, HAS_T: tl.constexpr, HAS_MIN_P: tl.constexpr,
    NO_COPY: tl.constexpr, F64: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0).to(tl.int64)
    top, finite = _global_top(table_ptr, rows, live, batch, world, IS_LOGITS)
    # Python floats reach the kernel as their float64 bits (a float argument would be float32).
    temperature = temperature_bits.to(tl.int64).to(tl.float64, bitcast=True)
    min_p_below = min_p_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if F64:
        shift = tl.where(finite, top, 0.0 if IS_LOGITS else 1.0)
        divisor = temperature
    else:
        shift = tl.where(finite, top, 0.0 if IS_LOGITS else 1.0).to(tl.float32)
        divisor = temperature.to(tl.float32)
        min_p_below = min_p_below.to(tl.float32)  # a float32 number already (exact)
    # Every slot starts at 0; this rank's own slots are written below.
    every = tl.arange(0, SLOTS_PAD)[None, :]
    sums_row = sums_ptr + rows * slots
    zero = tl.zeros((ROWS, SLOTS_PAD), tl.float64 if F64 else tl.float32)
    tl.store(sums_row[:, None] + every, zero, mask=live[:, None] & (every < slots))
    tl.debug_barrier()
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    # Tile -1 is the head slot (columns [0, head)); tile j >= 0 is grid slot first + j.
    for j in range(-1, owned):
        tile = tl.zeros((ROWS,), tl.int64) + j
        begin = tl.where(tile < 0, 0, head + tile * TILE)
        end = tl.where(tile < 0, head, tl.minimum(head + (tile + 1) * TILE, width))
        columns = begin[:, None] + offsets
        inside = live[:, None] & (columns < end[:, None])
        x = tl.load(x_ptr + rows[:, None] * x_sb + columns * x_sv, mask=inside & (columns < local))
        if F64:  # noqa: SIM108 (constexpr branches)
            x = x.to(tl.float64)
        else:
            x = x.to(tl.float32)
        if IS_LOGITS:
            w = x - shift[:, None]
            if HAS_T:
                w = w / divisor
            w = tl.exp(w)
            if HAS_MIN_P:
                w = tl.where(w > min_p_below, w, 0.0)
        elif NO_COPY:
            w = x
        else:
            w = x / shift[:, None]
            if HAS_T:
                w = tl.exp(tl.log(w) / divisor)
        w = tl.where(inside & (columns < local), w, 0.0)  # the padding column is 0
        tl.store(w_ptr + rows[:, None] * width + columns, w, mask=inside)
        slot = tl.where(tile < 0, grid + rank, first + tile)
        tl.store(sums_row + slot, tl.sum(w, 1), mask=live & (end > begin))


@triton.jit
def _draw_kernel(
    w_ptr, sums_ptr, table_ptr, record_ptr,
    seed_ptr, seed_sb, step_ptr, step_sb, stream_ptr, stream_sb, stream_value,
    batch, world, width, head, first, owned, grid, rank, slots, start_id, vocab, draw_width,
    IS_LOGITS: tl.constexpr, HAS_STEP: tl.constexpr, STREAM_ROWS: tl.constexpr,
    F64: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr, SLOTS_PAD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0).to(tl.int64)
    _, finite = _global_top(table_ptr, rows, live, batch, world, IS_LOGITS)
    every = tl.arange(0, SLOTS_PAD)[None, :]
    in_slots = live[:, None] & (every < slots)
    sums = tl.load(sums_ptr + rows[:, None] * slots + every, mask=in_slots, other=0.0)
    sums = sums.to(tl.float64)
    total = tl.sum(tl.where(every < grid, sums, 0.0), 1) + tl.sum(
        tl.where(every >= grid, sums, 0.0), 1
    )
    valid = finite & (total > 0) & (total < float("inf"))
    prefix = tl.cumsum(sums, 1)
    remaining = tl.sum(tl.where(every == slots - 1, prefix, 0.0), 1)
    seed = tl.load(seed_ptr + rows * seed_sb, mask=live, other=0)
    if HAS_STEP:
        step = tl.load(step_ptr + rows * step_sb, mask=live, other=0)
    else:
        step = tl.zeros_like(seed)
    if STREAM_ROWS:
        stream = tl.load(stream_ptr + rows * stream_sb, mask=live, other=0)
    else:
        stream = tl.zeros_like(seed) + stream_value
    k0, k1 = row_key(seed)
    c1, c2, c3 = counter_words(step, stream, DRAW)
    u = uniform_at(tl.zeros_like(seed), c1, c2, c3, k0, k1)
    target = tl.minimum(u * remaining, toward_zero(remaining))
    slot = tl.sum(((prefix <= target[:, None]) & in_slots).to(tl.int64), 1)
    slot = tl.minimum(slot, slots - 1)
    here = every == slot[:, None]
    slot_sum = tl.sum(tl.where(here, sums, 0.0), 1)
    before = tl.sum(tl.where(here, prefix, 0.0), 1) - slot_sum
    fraction = (target - before) / tl.where(slot_sum != 0, slot_sum, 1.0)
    fraction = tl.minimum(tl.maximum(fraction, 0.0), 1.0)
    # The slot's span in this shard (its count is 0 where another rank owns it).
    is_head = slot == grid + rank
    in_grid = (slot >= first) & (slot < first + owned)
    grid_start = head + (slot - first) * TILE
    begin = tl.where(is_head, 0, grid_start)
    count = tl.where(in_grid, tl.minimum(width - grid_start, TILE), 0)
    count = tl.where(is_head, head, count)
    begin = tl.minimum(tl.maximum(begin, 0), width - 1)
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    columns = tl.minimum(begin[:, None] + offsets, width - 1)
    scanned = live[:, None] & (offsets < count[:, None]) & (offsets < draw_width)
    values = tl.load(w_ptr + rows[:, None] * width + columns, mask=scanned, other=0.0)
    values = values.to(tl.float64)
    within = tl.cumsum(values, 1)
    slot_total = tl.sum(tl.where(offsets == draw_width - 1, within, 0.0), 1)
    inner_target = tl.minimum(fraction * slot_total, toward_zero(slot_total))
    inner = tl.sum(((within <= inner_target[:, None]) & (offsets < draw_width)).to(tl.int64), 1)
    inner = tl.minimum(inner, draw_width - 1)
    picked = offsets == inner[:, None]
    token = start_id + begin + inner  # the torch path's unclamped column
    weight = tl.sum(tl.where(picked, values, 0.0), 1)
    owner = count > 0
    # The finished result, as fastsample.distributed.sampling's finish computes it.
    keep = valid & (remaining > 0)
    safe_weight = tl.where(keep, weight, 1.0)
    safe_total = tl.where(keep, total, 1.0)
    prob = tl.where(keep, safe_weight / safe_total, 0.0)
    logprob = tl.where(keep, tl.log(safe_weight) - tl.log(safe_total), float("-inf"))
    if F64:
        prob_bits = prob.to(tl.int64, bitcast=True)
        logprob_bits = logprob.to(tl.int64, bitcast=True)
    else:
        prob_bits = prob.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        logprob_bits = logprob.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
        logprob_bits = logprob_bits & 0xFFFFFFFF
    token = tl.minimum(tl.maximum(token, 0), vocab - 1)
    # Invalid rows: the same fallback on every rank (probability 0, log-probability -inf);
    # valid rows: the owner's values, INT64_MIN elsewhere.
    mine = valid & owner
    words = (
        tl.where(valid, tl.where(mine, token, INT64_MIN), 0),
        tl.where(valid, tl.where(mine, prob_bits, INT64_MIN), prob_bits),
        tl.where(valid, tl.where(mine, logprob_bits, INT64_MIN), logprob_bits),
        tl.where(valid, tl.where(mine, 1, INT64_MIN), 0),
    )
    for i in tl.static_range(4):
        tl.store(record_ptr + rows * 4 + i, words[i], mask=live)


def _bits(value: float) -> int:
    """The float64 bit pattern of ``value`` as a Python int."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def summaries(x: Tensor, is_logits: bool) -> Tensor:
    """Launch 1: ``(B, 2)`` float64 ``[max or -inf, bad]`` of this shard (to all-gather)."""
    batch, local = x.shape
    out = torch.empty((batch, 2), dtype=torch.float64, device=x.device)
    if batch:
        tile = min(1024, max(16, triton.next_power_of_2(local)))
        rows = _rows(batch, tile)
        launch.count_launch()
        launch.launcher(_summary_kernel, INTERPRETED)[launch.grid(batch, rows)](
            x, x.stride(0), x.stride(1), batch, local, out,
            IS_LOGITS=is_logits, ROWS=rows, TILE=tile,
        )  # fmt: skip
    return out


def weights_and_sums(
    x: Tensor,
    table: Tensor,
    is_logits: bool,
    layout: tuple[int, ...],
    temperature: float | None,
    min_p_below: float | None,
    no_copy: bool,
) -> tuple[Tensor, Tensor]:
    """Launch 2: the shard's ``(B, width)`` weights and ``(B, slots)`` slot masses (to
    all-reduce with SUM). ``layout`` is ``(local, width, head, first, owned, grid, rank,
    slots)`` with 256-entry grid slots; ``temperature`` already floored at the smallest
    normal number; ``min_p_below`` the largest weight that min-p removes (logits only)."""
    batch = x.shape[0]
    local, width, head, first, owned, grid, rank, slots = layout
    f64 = x.dtype == torch.float64
    dtype = torch.float64 if f64 else torch.float32
    weights = torch.empty((batch, width), dtype=dtype, device=x.device)
    sums = torch.empty((batch, slots), dtype=dtype, device=x.device)
    if batch:
        slots_pad = triton.next_power_of_2(slots)
        rows = _rows(batch, max(BLOCK, slots_pad))
        launch.count_launch()
        launch.launcher(_weights_kernel, INTERPRETED)[launch.grid(batch, rows)](
            x, x.stride(0), x.stride(1), table, weights, sums,
            batch, table.shape[0], local, width, head, first, owned, grid, rank, slots,
            _bits(1.0 if temperature is None else temperature),
            _bits(0.0 if min_p_below is None else min_p_below),
            IS_LOGITS=is_logits, HAS_T=temperature is not None, HAS_MIN_P=min_p_below is not None,
            NO_COPY=no_copy, F64=f64, ROWS=rows, TILE=BLOCK, SLOTS_PAD=slots_pad,
        )  # fmt: skip
    return weights, sums


def draw_record(
    weights: Tensor,
    sums: Tensor,
    table: Tensor,
    is_logits: bool,
    layout: tuple[int, ...],
    start: int,
    vocab: int,
    draw_width: int,
    seed: Tensor,
    step: Tensor | None,
    stream: Tensor | int,
) -> Tensor:
    """Launch 3: the ``(B, 4)`` int64 result record of this rank (to all-reduce with MAX)."""
    batch = weights.shape[0]
    _, width, head, first, owned, grid, rank, slots = layout
    record = torch.empty((batch, RECORD), dtype=torch.int64, device=weights.device)
    if batch:
        slots_pad = triton.next_power_of_2(slots)
        rows = _rows(batch, max(BLOCK, slots_pad))
        stream_rows = isinstance(stream, Tensor)
        launch.count_launch()
        launch.launcher(_draw_kernel, INTERPRETED)[launch.grid(batch, rows)](
            weights, sums, table, record,
            seed, seed.stride(0), seed if step is None else step,
            0 if step is None else step.stride(0),
            stream if stream_rows else seed, stream.stride(0) if stream_rows else 0,
            0 if stream_rows else stream,
            batch, table.shape[0], width, head, first, owned, grid, rank, slots, start, vocab,
            draw_width,
            IS_LOGITS=is_logits, HAS_STEP=step is not None, STREAM_ROWS=stream_rows,
            F64=weights.dtype == torch.float64, ROWS=rows, TILE=BLOCK, SLOTS_PAD=slots_pad,
        )  # fmt: skip
    return record


def unpack(record: Tensor, f64: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Views of a MAX-reduced record: ``(token_ids (B, 1), probs (B, 1), valid (B,),
    logprobs (B, 1))``; float32 outputs are the low halves (little-endian) of their words."""
    ids = record[:, 0:1]
    if f64:
        floats = record.view(torch.float64)
        probs, logprobs = floats[:, 1:2], floats[:, 2:3]
    else:
        floats = record.view(torch.float32)
        probs, logprobs = floats[:, 2:3], floats[:, 4:5]
    valid = record.view(torch.bool)[:, 24]
    return ids, probs, valid, logprobs


# ---------------------------------------------------------------------------- operators


def _register(name: str, launcher, fake):
    """``triton_op`` when compiled (``torch.compile`` sees the kernel), else ``custom_op``
    with a fake (the interpreter needs real data pointers)."""
    qualified = f"fastsample::{name}"
    if INTERPRETED:
        op = torch.library.custom_op(qualified, launcher, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(qualified, launcher, mutates_args=())


def _summaries_op(x: Tensor, is_logits: bool) -> Tensor:
    return summaries(x, is_logits)


def _weights_op(
    x: Tensor,
    table: Tensor,
    is_logits: bool,
    layout: list[int],
    temperature: float | None,
    min_p_below: float | None,
    no_copy: bool,
) -> tuple[Tensor, Tensor]:
    return weights_and_sums(x, table, is_logits, tuple(layout), temperature, min_p_below, no_copy)


def _weights_fake(x, table, is_logits, layout, temperature, min_p_below, no_copy):
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty((x.shape[0], layout[1]), dtype=dtype), x.new_empty(
        (x.shape[0], layout[7]), dtype=dtype
    )


def _draw_op(
    weights: Tensor,
    sums: Tensor,
    table: Tensor,
    is_logits: bool,
    layout: list[int],
    start: int,
    vocab: int,
    draw_width: int,
    seed: Tensor,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream: int,
) -> Tensor:
    chosen = stream_rows if stream_rows is not None else stream
    return draw_record(
        weights, sums, table, is_logits, tuple(layout), start, vocab, draw_width, seed, step, chosen
    )


def _draw_fake(weights, sums, table, is_logits, layout, start, vocab, draw_width, seed, step,
               stream_rows, stream):  # fmt: skip
    return weights.new_empty((weights.shape[0], RECORD), dtype=torch.int64)


summaries_op = _register(
    "shard_summaries",
    _summaries_op,
    lambda x, is_logits: x.new_empty((x.shape[0], 2), dtype=torch.float64),
)
weights_op = _register("shard_weights", _weights_op, _weights_fake)
draw_op = _register("shard_draw", _draw_op, _draw_fake)
