"""Shard-local work of vocabulary-parallel sampling as Triton launches, one before each
collective (:mod:`fastsample.distributed.shard` and :mod:`fastsample.distributed.cuts` are the
references; the collectives stay with the caller, :mod:`fastsample.distributed.triton_round`).

One call (one draw, seeded) on a rank holding columns ``[start, start + local)`` of a
``vocab``-entry vocabulary:

1. :func:`summaries` -> ``(B, 2)`` float64: the shard's row maximum (``-inf`` on a bad row) and
   its badness (NaN anywhere for logits; NaN or a negative entry for probabilities; an
   out-of-range tensor control); with a tensor temperature, for greedy rows, the shard's first
   maximal global index (one draw) or its ``n`` largest entries and their global ids (``n``
   draws); unseeded, this rank's ``n`` generator draws. All-gathered.
2. :func:`fastsample.kernels.shard_cuts.step` (op ``step_op``), once per cut collective and
   once for the slot masses: the first launch reads the gathered ``(world, B, c)`` table
   (global maximum ``top``, validity) and writes the shard's weights ``(B, width)`` (logits:
   ``exp((x - top) / T)``; probabilities: ``(p / top)^(1/T)`` as ``exp(log(p / top) / T)``, or
   ``p`` itself in the torch path's no-copy case); the cut steps produce candidates, radix
   histograms or tie counts; the last (``APPLY``) applies the final cut and writes the
   ``(B, slots)`` slot masses: this rank's head slot and its grid slots of 256 entries (block
   sums, float32 for float32 weights), zero elsewhere. All-reduced with SUM.
3. :func:`draw_record` reads the summed masses: float64 prefix, one uniform (Philox, purpose
   ``DRAW``, position 0, the torch path's counters), the slot ``J`` = the number of prefixes
   ``<= min(u S, nextafter(S, 0))``; the rank that owns ``J`` scans its entries (float64 prefix,
   as :func:`fastsample.distributed.shard.draw_in_slot`) and writes the finished result (token
   id, probability ``w / total`` and log-probability ``log w - log total`` in the output dtype,
   valid) into a ``(B, 4)`` int64 record; the other ranks write ``INT64_MIN``, and every rank
   writes the same record for an invalid row (the fallback) and for a valid greedy row (its
   first global maximal index, or the ``k``-th of the merged largest entries, probability 1).
   A MAX all-reduce of the records leaves every rank with the owner's result, and the outputs
   are views of them (no unpacking launch). Draw ``k > 0`` (one launch each) first sets the
   previous draw's slot to the mass it left and removes the earlier draws' tokens.

Record layout (int64 words): ``[token, bits(prob), bits(logprob), valid]``; float32 outputs sit
in the low 32 bits (little-endian: the even float32 column of the int64 word's pair).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.inverse_cdf import BLOCK
from ..ops.seeds import Purpose
from . import launch
from . import shard_cuts as cuts
from .philox import INTERPRETED, uniform_at
from .rowwise import row_counters, toward_zero
from .shard_cuts import _TENSOR, control, control_args, global_top

DRAW = tl.constexpr(int(Purpose.DRAW))
ONE_BITS_F64 = tl.constexpr(0x3FF0000000000000)  # 1.0 as float64 bits
ONE_BITS_F32 = tl.constexpr(0x3F800000)  # 1.0 as float32 bits (the low word)
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
    x_ptr, x_sb, x_sv, batch, local, start_id, vocab, out_ptr, u_ptr,
    t_ptr, t_sb, k_ptr, k_sb, p_ptr, p_sb, m_ptr, m_sb,
    IS_LOGITS: tl.constexpr, GREEDY: tl.constexpr, T_SRC: tl.constexpr, K_SRC: tl.constexpr,
    P_SRC: tl.constexpr, M_SRC: tl.constexpr, UNIFORMS: tl.constexpr, COLS: tl.constexpr,
    TOP_N: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0).to(tl.int64)
    offsets = tl.arange(0, TILE)[None, :].to(tl.int64)
    best = tl.full((ROWS,), float("-inf"), tl.float64)
    best_id = tl.zeros((ROWS,), tl.int64)
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
        if GREEDY:  # the first maximal entry: the first tile holding the maximum wins ties
            top = tl.max(tl.where(inside, x, float("-inf")), 1)
            first = tl.min(tl.where(inside & (x == top[:, None]), columns, local), 1)
            best_id = tl.where((top > best) | (start == 0), first, best_id)
        best = tl.maximum(best, tl.max(tl.where(inside & ~wrong, x, float("-inf")), 1))
    # Out-of-range tensor controls make the row bad: invalid on every rank, as the torch
    # path's controls_in_range (the controls are the same on every rank).
    if T_SRC == _TENSOR:
        t = control(t_ptr, t_sb, 0, rows, live, T_SRC)
        bad += (~((t >= 0) & (t < float("inf")))).to(tl.int32)
    if K_SRC == _TENSOR:
        bad += (~(control(k_ptr, k_sb, 0, rows, live, K_SRC) >= 0)).to(tl.int32)
    if P_SRC == _TENSOR:
        p = control(p_ptr, p_sb, 0, rows, live, P_SRC)
        bad += (~((p > 0) & (p <= 1))).to(tl.int32)
    if M_SRC == _TENSOR:
        m = control(m_ptr, m_sb, 0, rows, live, M_SRC)
        bad += (~((m >= 0) & (m <= 1))).to(tl.int32)
    bad_row = bad > 0
    tl.store(out_ptr + rows * COLS, tl.where(bad_row, float("-inf"), best), mask=live)
    tl.store(out_ptr + rows * COLS + 1, bad_row.to(tl.float64), mask=live)
    if TOP_N == 1:  # greedy rows, one draw: the first maximal index (TOP_N is 0 otherwise)
        tl.store(out_ptr + rows * COLS + 2, (best_id + start_id).to(tl.float64), mask=live)
    if TOP_N > 1:
        # Several greedy draws: the shard's TOP_N largest entries, largest first, ties by the
        # lower index (as top_entries), one pass each; past the shard: -inf and id vocab.
        previous = tl.full((ROWS,), float("inf"), tl.float64)
        previous_id = tl.full((ROWS,), -1, tl.int64)
        for i in tl.static_range(TOP_N):
            value = tl.full((ROWS,), float("-inf"), tl.float64)
            chosen = tl.zeros((ROWS,), tl.int64) + local
            for start in range(0, local, TILE):
                columns = start + offsets
                inside = live[:, None] & (columns < local)
                x = tl.load(x_ptr + rows[:, None] * x_sb + columns * x_sv, mask=inside,
                            other=float("-inf")).to(tl.float64)  # fmt: skip
                after = (x < previous[:, None]) | (
                    (x == previous[:, None]) & (columns > previous_id[:, None])
                )
                eligible = inside & after
                top = tl.max(tl.where(eligible, x, float("-inf")), 1)
                first = tl.min(tl.where(eligible & (x == top[:, None]), columns, local), 1)
                better = (top > value) | ((top == value) & (first < chosen))
                chosen = tl.where(better, first, chosen)
                value = tl.maximum(value, top)
            ident = tl.where(chosen < local, chosen + start_id, vocab)
            tl.store(out_ptr + rows * COLS + 2 + i, value, mask=live)
            tl.store(out_ptr + rows * COLS + 2 + TOP_N + i, ident.to(tl.float64), mask=live)
            previous = value
            previous_id = chosen
    for j in tl.static_range(UNIFORMS):  # this rank's generator draws (rank 0's are used)
        u = tl.load(u_ptr + rows * UNIFORMS + j, mask=live, other=0.0)
        tl.store(out_ptr + rows * COLS + (COLS - UNIFORMS + j), u, mask=live)


@triton.jit
def _draw_kernel(
    w_ptr, sums_ptr, table_ptr, records_ptr, live_ptr, chosen_ptr,
    seed_ptr, seed_sb, step_ptr, step_sb, stream_ptr, stream_sb, stream_value, t_ptr, t_sb,
    batch, world, width, head, first, owned, grid, rank, slots, start_id, vocab, draw_width,
    IS_LOGITS: tl.constexpr, HAS_STEP: tl.constexpr, STREAM_ROWS: tl.constexpr,
    GREEDY: tl.constexpr, F64: tl.constexpr, K: tl.constexpr, MORE: tl.constexpr,
    WORDS: tl.constexpr, COLS: tl.constexpr, UNSEEDED: tl.constexpr, N: tl.constexpr,
    TOKEN_WORD: tl.constexpr, MERGED: tl.constexpr, ROWS: tl.constexpr,
    TILE: tl.constexpr, SLOTS_PAD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0).to(tl.int64)
    top, finite = global_top(table_ptr, rows, live, batch, world, COLS, IS_LOGITS)
    every = tl.arange(0, SLOTS_PAD)[None, :]
    in_slots = live[:, None] & (every < slots)
    sums = tl.load(sums_ptr + rows[:, None] * slots + every, mask=in_slots, other=0.0)
    sums = sums.to(tl.float64)
    total = tl.sum(tl.where(every < grid, sums, 0.0), 1) + tl.sum(
        tl.where(every >= grid, sums, 0.0), 1
    )
    valid = finite & (total > 0) & (total < float("inf"))
    if K > 0:
        # Draw K > 0: the masses left by the earlier draws, with the previous draw's slot set
        # to its mass without the drawn entry (the previous record's last word).
        previous = records_ptr + ((K - 1) * batch + rows) * WORDS
        sums = tl.load(live_ptr + rows[:, None] * slots + every, mask=in_slots, other=0.0)
        left = tl.load(previous + 4, mask=live, other=0).to(tl.float64, bitcast=True)
        chosen = tl.load(chosen_ptr + rows, mask=live, other=0)
        sums = tl.where(every == chosen[:, None], left[:, None], sums)
        previous_token = tl.load(previous + TOKEN_WORD, mask=live, other=0)
        previous_ok = tl.load(previous + 3, mask=live, other=0) > 0
    prefix = tl.cumsum(sums, 1)
    remaining = tl.sum(tl.where(every == slots - 1, prefix, 0.0), 1)
    if UNSEEDED:  # rank 0's generator draw K, from the gathered table (its last N columns)
        u = tl.load(table_ptr + rows * COLS + (COLS - N + K), mask=live, other=0.0)
    else:
        c1, c2, c3, k0, k1 = row_counters(
            rows, live, seed_ptr, seed_sb, step_ptr, step_sb, stream_ptr, stream_sb,
            stream_value, HAS_STEP, STREAM_ROWS, DRAW,
        )  # fmt: skip
        u = uniform_at(tl.zeros_like(rows).to(tl.int64) + K, c1, c2, c3, k0, k1)
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
    ids = start_id + begin[:, None] + offsets
    for j in tl.static_range(K):  # earlier draws are removed
        taken = tl.load(records_ptr + (j * batch + rows) * WORDS + TOKEN_WORD, mask=live,
                        other=-1)  # fmt: skip
        values = tl.where(ids == taken[:, None], 0.0, values)
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
    ok = valid & (remaining > 0)
    if K > 0:  # a row out of kept tokens repeats its previous draw, on every rank
        token = tl.where(remaining > 0, token, previous_token)
        mine = mine | (valid & (remaining <= 0))
        ok = ok & previous_ok
    # The random chain's own state (the next draw's removal and mass left).
    chain_token = token
    chain_mine = mine
    chain_ok = valid & (remaining > 0)
    tokens_all = mine
    probs_all = mine
    ok_all = mine
    if GREEDY:  # T == 0 rows: the first global maximal index(es), on every rank
        greedy = (tl.load(t_ptr + rows * t_sb, mask=live, other=1.0) == 0) & valid
        if N == 1:  # the point mass at the first maximal index
            greedy_id = tl.full(rows.shape, vocab, tl.int64)
            for r in range(0, world):
                at = table_ptr + (r * batch + rows) * COLS
                maximal = tl.load(at, mask=live, other=0.0) == top
                candidate = tl.load(at + 2, mask=live, other=0.0).to(tl.int64)
                greedy_id = tl.minimum(greedy_id, tl.where(maximal, candidate, vocab))
            token = tl.where(greedy, tl.minimum(tl.maximum(greedy_id, 0), vocab - 1), token)
            one_bits = tl.full(rows.shape, ONE_BITS_F64 if F64 else ONE_BITS_F32, tl.int64)
            prob_bits = tl.where(greedy, one_bits, prob_bits)
            logprob_bits = tl.where(greedy, 0, logprob_bits)
            tokens_all = tokens_all | greedy
            probs_all = probs_all | greedy
            ok_all = ok_all | greedy
        else:
            # Draw K of the merged N largest of every shard (value, then lower id first):
            # by rank; rows with fewer genuine ones repeat the last (repeat_last_genuine).
            c = tl.arange(0, MERGED)[None, :]
            inside = live[:, None] & (c < world * N)
            at = table_ptr + ((c // N) * batch + rows[:, None]) * COLS + 2 + c % N
            v = tl.load(at, mask=inside, other=float("-inf"))
            ident = tl.load(at + N, mask=inside, other=0.0).to(tl.int64)
            ident = tl.where(inside, ident, vocab + 1 + c)  # pads last, distinct
            before = (v[:, :, None] > v[:, None, :]) | (
                (v[:, :, None] == v[:, None, :]) & (ident[:, :, None] < ident[:, None, :])
            )
            place = tl.sum(before.to(tl.int32), 1)
            floor = float("-inf") if IS_LOGITS else 0.0
            genuine = tl.sum((inside & (v > floor)).to(tl.int32), 1)
            source = tl.maximum(tl.minimum(genuine - 1, K), 0)
            greedy_id = tl.sum(tl.where(place == source[:, None], ident, 0), 1)
            token = tl.where(greedy, tl.minimum(tl.maximum(greedy_id, 0), vocab - 1), token)
            every_genuine = genuine >= N
            # Every greedy draw genuine: probability 1; else the row is invalid and a genuine
            # draw keeps the random draw's numbers (as the torch path), the others 0.
            fixed = greedy & (every_genuine | (genuine <= K))
            one = tl.where(every_genuine, 1.0, 0.0).to(tl.float64)
            zero_or_ninf = tl.where(every_genuine, 0.0, float("-inf")).to(tl.float64)
            if F64:
                one_bits = one.to(tl.int64, bitcast=True)
                fixed_logprob = zero_or_ninf.to(tl.int64, bitcast=True)
            else:
                one_bits = one.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
                fixed_logprob = zero_or_ninf.to(tl.float32).to(tl.int32, bitcast=True)
                fixed_logprob = fixed_logprob.to(tl.int64) & 0xFFFFFFFF
            prob_bits = tl.where(fixed, one_bits, prob_bits)
            logprob_bits = tl.where(fixed, fixed_logprob, logprob_bits)
            ok = tl.where(greedy, every_genuine, ok)
            tokens_all = tokens_all | greedy
            probs_all = probs_all | fixed
            ok_all = ok_all | greedy
    record = records_ptr + (K * batch + rows) * WORDS
    words = (
        tl.where(valid, tl.where(tokens_all, token, INT64_MIN), K),
        tl.where(valid, tl.where(probs_all, prob_bits, INT64_MIN), prob_bits),
        tl.where(valid, tl.where(probs_all, logprob_bits, INT64_MIN), logprob_bits),
        tl.where(valid, tl.where(ok_all, ok.to(tl.int64), INT64_MIN), 0),
    )
    for i in tl.static_range(4):
        tl.store(record + i, words[i], mask=live)
    if MORE:  # what the next draw needs: the slot's mass left (shared), the slot, the masses
        left = tl.sum(tl.where(picked, 0.0, values), 1)
        left_bits = tl.where(chain_ok, left, 0.0).to(tl.int64, bitcast=True)
        tl.store(record + 4, tl.where(chain_ok & ~chain_mine, INT64_MIN, left_bits), mask=live)
        tl.store(chosen_ptr + rows, slot, mask=live)
        tl.store(live_ptr + rows[:, None] * slots + every, sums, mask=in_slots)
    if TOKEN_WORD != 0:  # greedy rows drew other tokens: the random chain's, for its removals
        chain = tl.where(valid, tl.where(chain_mine, chain_token, INT64_MIN), K)
        tl.store(record + TOKEN_WORD, chain, mask=live)


def summaries(
    x: Tensor,
    start: int,
    is_logits: bool,
    greedy: bool,
    controls: tuple[Tensor | float | None, ...],
    uniforms: Tensor | None = None,
    top_n: int = 1,
    vocab: int = 0,
) -> Tensor:
    """Launch 1: ``(B, 2)`` float64 ``[max or -inf, bad]`` of this shard (to all-gather), with
    a third column, the shard's first maximal global index, when a row may be ``greedy``
    (tensor temperature). ``controls`` ``(T, k, p, min_p)``: out-of-range tensor values make
    the row bad. ``uniforms``: ``(B, n)`` float64 draws of this rank's generator (unseeded
    calls), appended as the last ``n`` columns (every rank draws; rank 0's are used)."""
    batch, local = x.shape
    count = 0 if uniforms is None else uniforms.shape[1]
    cols = 2 + (0 if not greedy else 1 if top_n == 1 else 2 * top_n) + count
    out = torch.empty((batch, cols), dtype=torch.float64, device=x.device)
    if batch:
        tile = min(1024, max(16, triton.next_power_of_2(local)))
        rows = _rows(batch, tile)
        t, k, p, m = (control_args(c, x) for c in controls)
        launch.count_launch()
        launch.launcher(_summary_kernel, INTERPRETED)[launch.grid(batch, rows)](
            x, x.stride(0), x.stride(1), batch, local, start, vocab, out,
            x if uniforms is None else uniforms.contiguous(),
            t[0], t[1], k[0], k[1], p[0], p[1], m[0], m[1],
            IS_LOGITS=is_logits, GREEDY=greedy, T_SRC=t[3], K_SRC=k[3], P_SRC=p[3],
            M_SRC=m[3], UNIFORMS=count, COLS=cols, TOP_N=top_n if greedy else 0, ROWS=rows,
            TILE=tile,
        )  # fmt: skip
    return out


def draw_record(
    weights: Tensor,
    sums: Tensor,
    table: Tensor,
    is_logits: bool,
    layout: tuple[int, ...],
    start: int,
    vocab: int,
    draw_width: int,
    seed: Tensor | None,
    step: Tensor | None,
    stream: Tensor | int,
    temperature: Tensor | None,
    records: Tensor,
    live: Tensor,
    chosen: Tensor,
    k: int,
) -> None:
    """The launch of draw ``k``: this rank's ``(B, words)`` int64 record of the draw, written
    to ``records[k]`` (to all-reduce with MAX; ``records`` is ``(n, B, words)``, 4 words for
    one draw, 5 for several: the last carries the drawn slot's mass left for the next draw).
    Draw ``k > 0`` reads the reduced ``records[:k]``, and ``live`` (``(B, slots)`` float64
    masses) and ``chosen`` (``(B,)`` int64 slot) left by draw ``k - 1``. ``temperature``: the
    tensor temperature when rows may be greedy (one draw; the table has the greedy column)."""
    batch = weights.shape[0]
    _, width, head, first, owned, grid, rank, slots = layout
    n, words = records.shape[0], records.shape[2]
    greedy = temperature is not None
    columns = 2 + (0 if not greedy else 1 if n == 1 else 2 * n) + (n if seed is None else 0)
    if table.shape[2] != columns:
        raise ValueError(
            "the summaries need the greedy columns for a tensor temperature and the "
            "generator's draws for an unseeded call"
        )
    if not 0 <= k < n or words != record_words(n, greedy):
        raise ValueError(f"draw {k} of {n} needs records of {record_words(n, greedy)} words")
    if batch:
        slots_pad = triton.next_power_of_2(slots)
        rows = _rows(batch, max(BLOCK, slots_pad))
        stream_rows = isinstance(stream, Tensor)
        launch.count_launch()
        launch.launcher(_draw_kernel, INTERPRETED)[launch.grid(batch, rows)](
            weights, sums, table, records, live, chosen,
            table if seed is None else seed, 0 if seed is None else seed.stride(0),
            table if step is None else step, 0 if step is None else step.stride(0),
            stream if stream_rows else table, stream.stride(0) if stream_rows else 0,
            0 if stream_rows else stream,
            table if temperature is None else temperature,
            0 if temperature is None else temperature.stride(0),
            batch, table.shape[0], width, head, first, owned, grid, rank, slots, start, vocab,
            draw_width,
            IS_LOGITS=is_logits, HAS_STEP=step is not None, STREAM_ROWS=stream_rows,
            GREEDY=greedy, F64=weights.dtype == torch.float64, K=k, MORE=k + 1 < n,
            WORDS=words, COLS=table.shape[2], UNSEEDED=seed is None, N=n,
            TOKEN_WORD=5 if words == 6 else 0,
            MERGED=triton.next_power_of_2(max(table.shape[0] * n, 2)), ROWS=rows, TILE=BLOCK,
            SLOTS_PAD=slots_pad,
        )  # fmt: skip


def record_words(n: int, greedy: bool) -> int:
    """int64 words per row of a draw's record: 4 for one draw; 5 for several (the drawn slot's
    mass left); 6 when greedy rows draw several (the random chain's own token)."""
    return RECORD if n == 1 else 6 if greedy else 5


def unpack(records: Tensor, f64: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Views of the MAX-reduced ``(n, B, words)`` records: ``(token_ids (B, n), probs (B, n),
    valid (B,), logprobs (B, n))``; float32 outputs are the low halves (little-endian) of
    their words; validity is the last draw's (every draw's ``ok`` and-ed in)."""
    if records.shape[0] == 1:
        return unpack_one(records[0], f64)
    ids = records[:, :, 0].t()
    floats = records.view(torch.float64 if f64 else torch.float32)
    probs = floats[:, :, 1 if f64 else 2].t()
    logprobs = floats[:, :, 2 if f64 else 4].t()
    valid = records[-1].view(torch.bool)[:, 24]
    return ids, probs, valid, logprobs


def unpack_one(record: Tensor, f64: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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


def _register(name: str, launcher, fake, mutates: tuple[str, ...] = ()):
    """``triton_op`` when compiled (``torch.compile`` sees the kernel), else ``custom_op``
    with a fake (the interpreter needs real data pointers)."""
    qualified = f"fastsample::{name}"
    if INTERPRETED:
        op = torch.library.custom_op(qualified, launcher, mutates_args=mutates)
        op.register_fake(fake)
        return op
    return torch.library.triton_op(qualified, launcher, mutates_args=mutates)


def _summaries_op(
    x: Tensor,
    start: int,
    is_logits: bool,
    greedy: bool,
    temperature: Tensor | None,
    top_k: Tensor | None,
    top_p: Tensor | None,
    min_p: Tensor | None,
    uniforms: Tensor | None,
    top_n: int,
    vocab: int,
) -> Tensor:
    controls = (temperature, top_k, top_p, min_p)
    return summaries(x, start, is_logits, greedy, controls, uniforms, top_n, vocab)


def _summaries_fake(x, start, is_logits, greedy, temperature, top_k, top_p, min_p, uniforms,
                    top_n, vocab):  # fmt: skip
    count = 0 if uniforms is None else uniforms.shape[1]
    cols = 2 + (0 if not greedy else 1 if top_n == 1 else 2 * top_n) + count
    return x.new_empty((x.shape[0], cols), dtype=torch.float64)


def _step_op(
    x: Tensor,
    table: Tensor,
    weights: Tensor,
    sums: Tensor,
    candidates: Tensor,
    merged: Tensor,
    hists_k: Tensor,
    hists_p: Tensor,
    ties: Tensor,
    temperature: Tensor | None,
    temperature_number: float | None,
    top_k: Tensor | None,
    top_k_number: float | None,
    top_p: Tensor | None,
    top_p_number: float | None,
    min_p: Tensor | None,
    min_p_number: float | None,
    sizes: list[int],
    plan: list[int],
) -> None:
    controls = (
        temperature if temperature is not None else temperature_number,
        top_k if top_k is not None else top_k_number,
        top_p if top_p is not None else top_p_number,
        min_p if min_p is not None else min_p_number,
    )
    cuts.step(x, table, weights, sums, candidates, merged, hists_k, hists_p, ties, controls,
              tuple(sizes), tuple(plan))  # fmt: skip


def _step_fake(*args) -> None:
    return None


def _draw_op(
    weights: Tensor,
    sums: Tensor,
    table: Tensor,
    is_logits: bool,
    layout: list[int],
    start: int,
    vocab: int,
    draw_width: int,
    seed: Tensor | None,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream: int,
    temperature: Tensor | None,
    records: Tensor,
    live: Tensor,
    chosen: Tensor,
    k: int,
) -> None:
    streams = stream_rows if stream_rows is not None else stream
    draw_record(
        weights, sums, table, is_logits, tuple(layout), start, vocab, draw_width, seed, step,
        streams, temperature, records, live, chosen, k,
    )  # fmt: skip


def _draw_fake(*args) -> None:
    return None


summaries_op = _register("shard_summaries", _summaries_op, _summaries_fake)
step_op = _register(
    "shard_step",
    _step_op,
    _step_fake,
    ("weights", "sums", "candidates", "hists_k", "hists_p", "ties"),
)
draw_op = _register("shard_draw", _draw_op, _draw_fake, ("records", "live", "chosen"))
