"""Tree verification in one Triton launch: :func:`fastsample.verify_tree`'s Triton path.

One program per request (a tile of requests in the interpreter) walks its tree. The torch
path's walk tests, from the current node ``c``, the next node after the last tested one whose
parent is ``c`` (its first child after an acceptance, its next sibling after a rejection), so
the tested nodes come in increasing order: the kernel visits nodes ``m = 1 .. N-1`` once and
tests ``m`` when ``m < num_nodes`` and ``parent[m] == c``. No walk tables are needed, per-request
tensor parents cost nothing extra, and malformed parents (``parent[m]`` outside ``[0, m)``) are
never anybody's child (the row is reported invalid).

At a tested child ``t`` with acceptance uniform ``u`` (``ACCEPT`` stream, position ``m - 1``):

* mode a (``draft_probs=None``): accept iff ``u * left < p_c(t)`` and ``p_c(t) > 0``, ``left = 1 -``
  the target mass of the rejected siblings (a repeated rejected token counts 0);
* mode b: one read of the current rows gives the residual's mass ``W`` (``max(p - c q, 0)`` with
  the rejected siblings at their frozen weights) and the draft mass ``Q`` left; accept iff
  ``u * q(t) * W < Q * w(t)``; after a rejection ``c <- c + W / Q`` and ``w(t)`` is frozen.

The final token is drawn at the last accepted node by
:func:`~fastsample.kernels.verify_draw.final_draw` (``RECOVERY`` uniform after a rejection there,
``BONUS`` otherwise): mode a from ``p`` without the rejected siblings, mode b from the residual.
All arithmetic is the torch path's (:mod:`fastsample.verify.tree`, :mod:`fastsample.verify.
acceptance`): float64 tests, weights in the working dtype.

Shapes and dtypes: ``target_probs``, ``draft_probs`` ``(B, N, V)`` any float dtype and strides;
``token_ids`` ``(B, N)`` int64; ``parents`` ``(B, N)`` or ``(1, N)`` int64 (batch stride 0);
``num_nodes`` ``(B,)`` int64 or None; outputs as :class:`fastsample.verify.tree.TreeVerifyOutput`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.inverse_cdf import BLOCK
from . import launch
from .philox import INTERPRETED
from .verify_chain import ACCEPT, BONUS, RECOVERY, interpreter_rows, stream_uniform, sums_tile
from .verify_draw import final_draw, residual_values, row_pass


@triton.jit
def _slot(tile, slots, s):
    """Slot ``s`` of a ``(ROWS, W_PAD)`` tile, as ``(ROWS,)`` (exact)."""
    return tl.sum(tl.where(slots == s[:, None], tile, tl.zeros_like(tile)), 1)


@triton.jit
def _tree_kernel(
    p_ptr, p_sb, p_sn, p_sv, q_ptr, q_sb, q_sn, q_sv, t_ptr, t_sb, t_sn, par_ptr, par_sb, par_sn,
    size_ptr, size_sb, seed_ptr, seed_sb, step_ptr, step_sb,
    ua_ptr, ua_sb, ua_sn, ur_ptr, ur_sb, ub_ptr, ub_sb,
    scratch_ptr, tokens_ptr, nodes_ptr, accepted_ptr, emitted_ptr, valid_ptr,
    batch, n, vocab, num_blocks, width,
    MODE_B: tl.constexpr, HAS_SIZE: tl.constexpr, SEEDED: tl.constexpr,
    WORK_F64: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr, N_PAD: tl.constexpr,
    W_PAD: tl.constexpr, SUMS_TILE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    rows = tl.where(live, rows, 0).to(tl.int64)
    valid = live
    if HAS_SIZE:
        size = tl.load(size_ptr + rows * size_sb, mask=live, other=1)
        valid = valid & (size >= 1) & (size <= n)
        size = tl.minimum(tl.maximum(size, 1), n)
    else:
        size = tl.zeros((ROWS,), tl.int64) + n
    if SEEDED:
        seed = tl.load(seed_ptr + rows * seed_sb, mask=live, other=0)
        step = tl.load(step_ptr + rows * step_sb, mask=live, other=0)
    slots = tl.arange(0, W_PAD)[None, :]
    columns = tl.arange(0, N_PAD)[None, :]
    listed = slots < width  # the torch path's rejected-token slots
    current = tl.zeros((ROWS,), tl.int64)
    num_accepted = tl.zeros((ROWS,), tl.int64)
    path = tl.full((ROWS, N_PAD), -1, tl.int64)
    path_tokens = tl.zeros((ROWS, N_PAD), tl.int64)
    num_rejected = tl.zeros((ROWS,), tl.int64)
    rejected = tl.zeros((ROWS, W_PAD), tl.int64)
    left = tl.zeros((ROWS,), tl.float64) + 1.0  # mode a: 1 - rejected target mass
    coef = tl.zeros((ROWS,), tl.float64)  # mode b: current target max(p - c q, 0)
    frozen = tl.zeros((ROWS, W_PAD), tl.float64)  # mode b: the rejected siblings' weights
    root = tl.load(par_ptr + rows * par_sb, mask=live, other=-1)
    valid = valid & (root == -1)
    keys = -1 - columns.to(tl.int64)  # mode b: (parent, token) of the present nodes seen so far
    for m in range(1, n):
        parent = tl.load(par_ptr + rows * par_sb + m * par_sn, mask=live, other=-1)
        # Parents listed before children (this also rules out cycles and orphans).
        well_formed = (parent >= 0) & (parent < m)
        valid = valid & well_formed
        token = tl.load(t_ptr + rows * t_sb + m * t_sn, mask=live, other=0)
        present = m < size
        valid = valid & ((token >= 0) & (token < vocab) | ~present)
        token = tl.minimum(tl.maximum(token, 0), vocab - 1)
        if MODE_B:
            # Mode b is exact only for distinct siblings (drawn without replacement).
            key = tl.where(well_formed, parent, n) * vocab + token
            twin = tl.max(((keys == key[:, None]) & present[:, None]).to(tl.int32), 1) > 0
            valid = valid & ~twin
            keys = tl.where((columns == m) & present[:, None], key[:, None], keys)
        active = present & (parent == current) & live
        if SEEDED:
            u = stream_uniform(tl.zeros((ROWS,), tl.int64) + (m - 1), seed, step, ACCEPT)
        else:
            u = tl.load(ua_ptr + rows * ua_sb + (m - 1) * ua_sn, mask=live, other=0.0)
        node_p = p_ptr + rows * p_sb + current * p_sn
        p_t = tl.load(node_p + token * p_sv, mask=live, other=0.0)
        good_p = (p_t >= 0) & (p_t < float("inf"))
        removed = listed & (slots < num_rejected[:, None])
        same = (rejected == token[:, None]) & removed
        repeated = tl.max(same.to(tl.int32), 1) > 0
        if MODE_B:
            node_q = q_ptr + rows * q_sb + current * q_sn
            q_t = tl.load(node_q + token * q_sv, mask=live, other=0.0)
            good_q = (q_t >= 0) & (q_t < float("inf"))
            valid = valid & (good_p & good_q | ~active)
            mass = tl.zeros((ROWS,), tl.float64)
            draft_mass = tl.zeros((ROWS,), tl.float64)
            if tl.max(active.to(tl.int32), 0) > 0:  # the current rows, read once per test
                _, weight_sum, draft_mass, p_clean, q_clean = row_pass(
                    node_p, node_q, p_sv, q_sv, live, vocab, coef, rejected, removed,
                    scratch_ptr, num_blocks, True, True, False, WORK_F64, ROWS, TILE,
                )  # fmt: skip
                mass = weight_sum + tl.sum(tl.where(removed, frozen, 0.0), 1)
                ok = p_clean & q_clean & (draft_mass < float("inf"))
                valid = valid & (ok | ~active)
            w_t = tl.sum(residual_values(p_t[:, None], q_t[:, None], coef, WORK_F64), 1)
            # An already rejected token left q: its weight is frozen, its draft probability 0.
            w_t = tl.where(repeated, tl.sum(tl.where(same, frozen, 0.0), 1), w_t)
            q_left = tl.where(repeated, 0.0, q_t.to(tl.float64))
            bar = draft_mass * w_t
            accept = active & (u * (q_left * mass) < bar) & (bar > 0)
            reject = active & ~accept
            record = reject & ~repeated  # a repeated token was not drawn again: no update
            share = mass / tl.where(draft_mass > 0, draft_mass, 1.0)
            new_coef = coef + tl.where(draft_mass > 0, share, 0.0)
            weight_now = tl.sum(residual_values(p_t[:, None], q_t[:, None], new_coef, WORK_F64), 1)
            coef = tl.where(accept, 0.0, tl.where(record, new_coef, coef))
            at = tl.minimum(num_rejected, width - 1)
            frozen = tl.where((slots == at[:, None]) & record[:, None], weight_now[:, None], frozen)
        else:
            valid = valid & (good_p | ~active)
            p_t = tl.where(repeated, 0.0, p_t.to(tl.float64))
            accept = active & (u * left < p_t) & (p_t > 0)
            reject = active & ~accept
            left = tl.where(accept, 1.0, tl.where(reject, left - p_t, left))
            record = reject
        at = tl.minimum(num_rejected, width - 1)
        rejected = tl.where((slots == at[:, None]) & record[:, None], token[:, None], rejected)
        num_rejected = tl.where(accept, 0, num_rejected + record.to(tl.int64))
        depth = tl.minimum(num_accepted, n - 1)
        into = (columns == depth[:, None]) & accept[:, None]
        path = tl.where(into, m, path)
        path_tokens = tl.where(into, token[:, None], path_tokens)
        num_accepted = num_accepted + accept.to(tl.int64)
        current = tl.where(accept, m, current)

    after_rejection = num_rejected > 0
    if SEEDED:
        first = tl.zeros((ROWS,), tl.int64)
        u_final = tl.where(
            after_rejection,
            stream_uniform(first, seed, step, RECOVERY),
            stream_uniform(first, seed, step, BONUS),
        )
    else:
        u_recovery = tl.load(ur_ptr + rows * ur_sb, mask=live, other=0.0)
        u_final = tl.where(after_rejection, u_recovery, tl.load(ub_ptr + rows * ub_sb, mask=live))
    node_p = p_ptr + rows * p_sb + current * p_sn
    scratch_row = scratch_ptr + rows * (2 * num_blocks)
    removed = listed & (slots < num_rejected[:, None])
    if MODE_B:
        node_q = q_ptr + rows * q_sb + current * q_sn
        token, ok = final_draw(
            node_p, node_q, p_sv, q_sv, live, vocab, after_rejection, u_final, coef, rejected,
            listed, removed, frozen, scratch_row, num_blocks,
            True, True, WORK_F64, ROWS, TILE, W_PAD, SUMS_TILE,
        )  # fmt: skip
    else:
        token, ok = final_draw(
            node_p, node_p, p_sv, p_sv, live, vocab, after_rejection, u_final, coef, rejected,
            listed, removed, frozen, scratch_row, num_blocks,
            False, True, WORK_F64, ROWS, TILE, W_PAD, SUMS_TILE,
        )  # fmt: skip
    valid = valid & ok

    emitted = tl.where(columns < num_accepted[:, None], path_tokens, -1)
    emitted = tl.where(columns == num_accepted[:, None], token[:, None], emitted)
    out = rows[:, None] * n + columns
    stored = live[:, None] & (columns < n)
    tl.store(tokens_ptr + out, tl.where(valid[:, None], emitted, -1), mask=stored)
    tl.store(nodes_ptr + out, tl.where(valid[:, None], path, -1), mask=stored)
    tl.store(accepted_ptr + rows, tl.where(valid, num_accepted, 0), mask=live)
    tl.store(emitted_ptr + rows, tl.where(valid, num_accepted + 1, 0), mask=live)
    tl.store(valid_ptr + rows, valid, mask=live)


# Device copies of shared host parent lists, by (parents, device): made on the first call (the
# warm-up call before a CUDA graph capture), so later calls copy nothing to the device.
_HOST_PARENTS: OrderedDict[tuple, Tensor] = OrderedDict()
_HOST_PARENTS_MAX = 256


def host_parents(parents: tuple[int, ...], device: torch.device) -> Tensor:
    """``(1, N)`` int64 parents on ``device``, cached (a constant under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return torch.tensor(parents, dtype=torch.int64, device=device)[None]
    key = (parents, device)
    table = _HOST_PARENTS.get(key)
    if table is None:
        table = _HOST_PARENTS[key] = torch.tensor(parents, dtype=torch.int64, device=device)[None]
        if len(_HOST_PARENTS) > _HOST_PARENTS_MAX:
            _HOST_PARENTS.popitem(last=False)
    else:
        _HOST_PARENTS.move_to_end(key)
    return table


def verify_tree(
    p: Tensor,
    q: Tensor | None,
    tokens: Tensor,
    parents: Tensor,
    sizes: Tensor | None,
    width: int,
    seed: Tensor | None,
    step: Tensor | None,
    u_accept: Tensor | None,
    u_recovery: Tensor | None,
    u_bonus: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One launch: ``(token_ids, accepted_nodes, num_accepted, num_emitted, valid)``.

    Arguments already checked (:func:`fastsample.verify_tree`); ``parents`` ``(B, N)`` or
    ``(1, N)`` int64; ``width`` the torch path's number of rejected-token slots (the widest node
    of a host tree, ``N - 1`` for tensor parents, at least 1); randomness as in
    :func:`fastsample.kernels.verify_chain.verify_chain`.
    """
    batch, n, vocab = p.shape
    device = p.device
    tokens_out = torch.empty((batch, n), dtype=torch.int64, device=device)
    nodes_out = torch.empty((batch, n), dtype=torch.int64, device=device)
    accepted = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty(batch, dtype=torch.int64, device=device)
    valid = torch.empty(batch, dtype=torch.bool, device=device)
    if batch == 0:
        return tokens_out, nodes_out, accepted, emitted, valid
    num_blocks = triton.cdiv(vocab, BLOCK)
    scratch = torch.empty((batch, 2 * num_blocks), dtype=torch.float64, device=device)
    tile = launch.tile_width(vocab)
    n_pad = triton.next_power_of_2(n)
    w_pad = triton.next_power_of_2(max(width, 1))
    rows = interpreter_rows(batch, max(tile * w_pad, n_pad))  # (rows, tile, slots) tiles
    seeded = seed is not None
    wide = p.dtype == torch.float64 or (q is not None and q.dtype == torch.float64)
    qq = q if q is not None else p
    par_sb = parents.stride(0) if parents.shape[0] > 1 else 0
    sz = sizes if sizes is not None else tokens
    s0 = seed if seeded else tokens
    s1 = step if seeded else tokens
    ua = u_accept if not seeded else p
    ur = u_recovery if not seeded else p
    ub = u_bonus if not seeded else p
    launch.count_launch()
    launch.launcher(_tree_kernel, INTERPRETED)[launch.grid(batch, rows)](
        p, p.stride(0), p.stride(1), p.stride(2), qq, qq.stride(0), qq.stride(1), qq.stride(2),
        tokens, tokens.stride(0), tokens.stride(1), parents, par_sb, parents.stride(1),
        sz, sz.stride(0), s0, s0.stride(0), s1, s1.stride(0),
        ua, ua.stride(0), ua.stride(-1), ur, ur.stride(0), ub, ub.stride(0),
        scratch, tokens_out, nodes_out, accepted, emitted, valid,
        batch, n, vocab, num_blocks, max(width, 1),
        MODE_B=q is not None, HAS_SIZE=sizes is not None, SEEDED=seeded, WORK_F64=wide,
        ROWS=rows, TILE=tile, N_PAD=n_pad, W_PAD=w_pad, SUMS_TILE=sums_tile(num_blocks),
    )  # fmt: skip
    return tokens_out, nodes_out, accepted, emitted, valid
