"""Chain verification in one Triton launch: :func:`fastsample.verify_chain`'s Triton path.

One program per request (a tile of requests in the interpreter) walks its ``K`` positions:

1. the drafts' gathered probabilities ``p_i(x_i)`` (and ``q_i(x_i)``), float64, one load each;
2. acceptance ``u_i q_i(x_i) < p_i(x_i)`` and ``p_i(x_i) > 0`` (``q = 1`` without draft
   probabilities), ``u_i`` the ``ACCEPT`` stream's uniform at position ``i`` from the in-kernel
   Philox (or read from a tensor for ``torch.Generator`` calls); the number of leading
   acceptances ``a`` (at most ``draft_lengths``);
3. one draw at position ``a`` (:func:`~fastsample.kernels.verify_draw.final_draw`): after a
   rejection from ``max(p_a - q_a, 0)`` (or ``p_a`` without the rejected draft for point-mass
   drafts), else the bonus token from ``p_a``, with uniform 0 of the ``RECOVERY`` or ``BONUS``
   stream. Only the two rows at position ``a`` are read in full.

Shapes and dtypes: ``target_probs (B, K+1, V)`` and ``draft_probs (B, K, V)`` any float dtype and
strides; ``draft_token_ids (B, K)`` int64; ``draft_lengths (B,)`` int64 or None; ``seed``/``step``
``(B,)`` int64 (strides may be 0). Outputs as :class:`fastsample.verify.chain.VerifyOutput`:
``token_ids (B, K+1)``, ``num_accepted``, ``num_emitted`` int64, ``valid`` bool; bad rows as the
torch path (ids out of range, lengths out of ``[0, K]``, non-finite or negative gathered values,
a bad row drawn from: ``valid`` False, nothing emitted).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.inverse_cdf import BLOCK
from ..ops.seeds import Purpose, Stream
from . import launch
from .philox import INTERPRETED, counter_words, row_key, uniform_at
from .verify_draw import final_draw

DRAW = tl.constexpr(int(Purpose.DRAW))
ACCEPT = tl.constexpr(int(Stream.ACCEPT))
RECOVERY = tl.constexpr(int(Stream.RECOVERY))
BONUS = tl.constexpr(int(Stream.BONUS))
INTERPRETER_ELEMENTS = 1 << 20  # entries of the largest tile in the interpreter (its maximum)


@triton.jit
def stream_uniform(position, seed, step, STREAM: tl.constexpr):
    """The ``DRAW`` uniform of ``STREAM`` at ``position`` (int64, broadcasting with the rows)."""
    k0, k1 = row_key(seed)
    c1, c2, c3 = counter_words(step, tl.zeros_like(step) + STREAM, DRAW)
    return uniform_at(position, c1, c2, c3, k0, k1)


@triton.jit
def _chain_kernel(
    p_ptr, p_sb, p_sk, p_sv, q_ptr, q_sb, q_sk, q_sv, x_ptr, x_sb, x_sk, len_ptr, len_sb,
    seed_ptr, seed_sb, step_ptr, step_sb,
    ua_ptr, ua_sb, ua_sk, ur_ptr, ur_sb, ub_ptr, ub_sb,
    scratch_ptr, tokens_ptr, accepted_ptr, emitted_ptr, valid_ptr,
    batch, k, vocab, num_blocks,
    HAS_Q: tl.constexpr, HAS_LEN: tl.constexpr, SEEDED: tl.constexpr, RESIDUAL: tl.constexpr,
    WORK_F64: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr, P_PAD: tl.constexpr,
    SUMS_TILE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0).to(tl.int64)  # padding rows read row 0 and store nothing
    valid = live
    if HAS_LEN:
        length = tl.load(len_ptr + rows * len_sb, mask=live, other=0)
        valid = valid & (length >= 0) & (length <= k)
        length = tl.minimum(tl.maximum(length, 0), k)
    else:
        length = tl.zeros((ROWS,), tl.int64) + k
    positions = tl.arange(0, P_PAD)[None, :].to(tl.int64)
    drafts = live[:, None] & (positions < k)
    x = tl.load(x_ptr + rows[:, None] * x_sb + positions * x_sk, mask=drafts, other=0)
    in_range = (x >= 0) & (x < vocab)
    x = tl.minimum(tl.maximum(x, 0), vocab - 1)
    p_x = tl.load(p_ptr + rows[:, None] * p_sb + positions * p_sk + x * p_sv, mask=drafts)
    p_x = tl.where(drafts, p_x.to(tl.float64), 0.0)
    clean = (p_x >= 0) & (p_x < float("inf")) & in_range  # NaN fails both comparisons
    if SEEDED:
        seed = tl.load(seed_ptr + rows * seed_sb, mask=live, other=0)
        step = tl.load(step_ptr + rows * step_sb, mask=live, other=0)
        u = stream_uniform(positions, seed[:, None], step[:, None], ACCEPT)
    else:
        u = tl.load(ua_ptr + rows[:, None] * ua_sb + positions * ua_sk, mask=drafts, other=0.0)
    if HAS_Q:
        q_x = tl.load(q_ptr + rows[:, None] * q_sb + positions * q_sk + x * q_sv, mask=drafts)
        q_x = tl.where(drafts, q_x.to(tl.float64), 0.0)
        clean = clean & (q_x >= 0) & (q_x < float("inf"))
        accept = (u * q_x < p_x) & (p_x > 0)
    else:
        accept = (u < p_x) & (p_x > 0)
    used = positions < length[:, None]
    accept = accept & used
    clean = clean | ~used  # padding positions are never judged
    valid = valid & (tl.sum((~clean).to(tl.int32), 1) == 0)
    # The first rejection: the number of leading acceptances.
    num_accepted = tl.min(tl.where(accept, P_PAD, positions), 1)
    num_accepted = tl.minimum(num_accepted, length)
    rejected = num_accepted < length
    if SEEDED:
        first = tl.zeros((ROWS,), tl.int64)
        u_final = tl.where(
            rejected,
            stream_uniform(first, seed, step, RECOVERY),
            stream_uniform(first, seed, step, BONUS),
        )
    else:
        u_recovery = tl.load(ur_ptr + rows * ur_sb, mask=live, other=0.0)
        u_final = tl.where(rejected, u_recovery, tl.load(ub_ptr + rows * ub_sb, mask=live))

    # One draw at the first rejected position, or the bonus position.
    p_row = p_ptr + rows * p_sb + num_accepted * p_sk
    last = tl.minimum(num_accepted, tl.maximum(k - 1, 0))
    scratch_row = scratch_ptr + rows * (2 * num_blocks)
    at_last = positions == last[:, None]
    removed = tl.sum(tl.where(at_last & drafts, x, 0), 1)[:, None]  # (ROWS, 1)
    ones = tl.zeros((ROWS,), tl.float64) + 1.0
    if RESIDUAL:
        q_row = q_ptr + rows * q_sb + last * q_sk
        token, ok = final_draw(
            p_row, q_row, p_sv, q_sv, live, vocab, rejected, u_final, ones, removed,
            removed >= 0, removed < 0, ones[:, None], scratch_row, num_blocks,
            True, False, WORK_F64, ROWS, TILE, 1, SUMS_TILE,
        )  # fmt: skip
    else:
        # Point-mass drafts: p without the rejected draft (listed even when not rejected).
        token, ok = final_draw(
            p_row, p_row, p_sv, p_sv, live, vocab, rejected, u_final, ones, removed,
            removed >= 0, rejected[:, None], ones[:, None], scratch_row, num_blocks,
            False, True, WORK_F64, ROWS, TILE, 1, SUMS_TILE,
        )  # fmt: skip
    valid = valid & ok

    emitted = tl.where(positions < num_accepted[:, None], x, -1)
    emitted = tl.where(positions == num_accepted[:, None], token[:, None], emitted)
    emitted = tl.where(valid[:, None], emitted, -1)
    width = k + 1
    tl.store(
        tokens_ptr + rows[:, None] * width + positions, emitted,
        mask=live[:, None] & (positions < width),
    )  # fmt: skip
    tl.store(accepted_ptr + rows, tl.where(valid, num_accepted, 0), mask=live)
    tl.store(emitted_ptr + rows, tl.where(valid, num_accepted + 1, 0), mask=live)
    tl.store(valid_ptr + rows, valid, mask=live)


def interpreter_rows(batch: int, elements: int) -> int:
    """``ROWS``: 1 on a GPU; in the interpreter a power-of-two tile of rows whose largest tile
    holds about :data:`INTERPRETER_ELEMENTS` (every op costs ~0.1 ms whatever its size)."""
    if not INTERPRETED:
        return 1
    cap = max(1, INTERPRETER_ELEMENTS // max(elements, 1))
    return min(triton.next_power_of_2(max(batch, 1)), 1 << (cap.bit_length() - 1))


def sums_tile(num_blocks: int) -> int:
    return min(max(16, triton.next_power_of_2(num_blocks)), 1024)


def verify_chain(
    p: Tensor,
    x: Tensor,
    q: Tensor | None,
    lengths: Tensor | None,
    seed: Tensor | None,
    step: Tensor | None,
    u_accept: Tensor | None,
    u_recovery: Tensor | None,
    u_bonus: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One launch: ``(token_ids (B, K+1), num_accepted, num_emitted, valid)``.

    Arguments already checked (:func:`fastsample.verify_chain`); either ``seed``/``step``
    (``(B,)`` int64, the in-kernel Philox) or the three uniform tensors of
    :func:`fastsample.verify.randomness.uniforms` (a ``torch.Generator`` call).
    """
    batch, positions, vocab = p.shape
    k = positions - 1
    device = p.device
    tokens = torch.empty((batch, positions), dtype=torch.int64, device=device)
    accepted = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty(batch, dtype=torch.int64, device=device)
    valid = torch.empty(batch, dtype=torch.bool, device=device)
    if batch == 0:
        return tokens, accepted, emitted, valid
    num_blocks = triton.cdiv(vocab, BLOCK)
    scratch = torch.empty((batch, 2 * num_blocks), dtype=torch.float64, device=device)
    tile = launch.tile_width(vocab)
    p_pad = triton.next_power_of_2(positions)
    rows = interpreter_rows(batch, max(tile, p_pad))
    seeded = seed is not None
    residual = q is not None and k > 0
    # The torch path's working dtype: float64 if a row it reads in full is float64.
    wide = p.dtype == torch.float64 or (residual and q.dtype == torch.float64)
    qq = q if q is not None else p
    lq = lengths if lengths is not None else x
    s0 = seed if seeded else x
    s1 = step if seeded else x
    ua = u_accept if not seeded else p
    ur = u_recovery if not seeded else p
    ub = u_bonus if not seeded else p
    launch.count_launch()
    launch.launcher(_chain_kernel, INTERPRETED)[launch.grid(batch, rows)](
        p, p.stride(0), p.stride(1), p.stride(2), qq, qq.stride(0), qq.stride(1), qq.stride(2),
        x, x.stride(0), x.stride(1), lq, lq.stride(0),
        s0, s0.stride(0), s1, s1.stride(0),
        ua, ua.stride(0), ua.stride(-1), ur, ur.stride(0), ub, ub.stride(0),
        scratch, tokens, accepted, emitted, valid,
        batch, k, vocab, num_blocks,
        HAS_Q=q is not None, HAS_LEN=lengths is not None, SEEDED=seeded,
        RESIDUAL=residual, WORK_F64=wide, ROWS=rows, TILE=tile, P_PAD=p_pad,
        SUMS_TILE=sums_tile(num_blocks),
    )  # fmt: skip
    return tokens, accepted, emitted, valid
