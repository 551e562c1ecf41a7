"""Chain verification: :func:`verify_chain` checks ``K`` drafts per request against the target.

Why it is exact, and how the randomness is laid out, is in :mod:`fastsample.verify`. The
acceptance rule is :func:`~fastsample.verify.acceptance.accept_drafts`; the one ``(B, V)``
draw at the end is :mod:`fastsample.verify.draw`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..kernels import backend
from ..ops import threads
from ..ops import validation as v
from ..stages import StepParams, TokenStats
from . import targets
from .acceptance import accept_drafts
from .checks import (
    VALUE_REASONS,
    check_counts,
    check_draft_probs,
    check_ids,
    check_probs,
    raise_bad_values,
    value_flags,
)
from .draw import draw_residual, draw_target_without
from .randomness import Seeds, random_source, uniforms


class VerifyOutput(NamedTuple):
    """What :func:`verify_chain` returns.

    Attributes:
        token_ids: ``(B, K+1) int64``: the emitted tokens, left-aligned (accepted drafts,
            then the recovery or bonus token), ``-1`` after them.
        num_accepted: ``(B,) int64``, accepted drafts, ``0..K`` (at most ``draft_lengths``).
        num_emitted: ``(B,) int64``, ``num_accepted + 1`` (0 for invalid rows).
        valid: ``(B,) bool``. False for rows with bad values (see :func:`verify_chain`);
            such rows emit nothing: ``token_ids`` all ``-1`` and both counts 0.
    """

    token_ids: Tensor
    num_accepted: Tensor
    num_emitted: Tensor
    valid: Tensor


@threads.one_thread_calls
def verify_chain(
    target_probs: Tensor | None = None,
    draft_token_ids: Tensor | None = None,
    draft_probs: Tensor | None = None,
    *,
    target_logits: Tensor | None = None,
    params: StepParams | None = None,
    state: TokenStats | None = None,
    token_bitmask: Tensor | None = None,
    draft_lengths: Tensor | int | None = None,
    seed: int | Tensor | None = None,
    step: int | Tensor | None = None,
    generator: torch.Generator | None = None,
    check: bool = False,
) -> VerifyOutput:
    """Verify a chain of ``K`` draft tokens per request; the output follows the target exactly.

    Math (standard speculative sampling, see :mod:`fastsample.verify`): accept draft ``x_i``
    with probability ``min(1, p_i(x_i) / q_i(x_i))`` (tested as ``u * q < p``, strict,
    float64, 53-bit ``u``); at the first rejection ``j`` emit a token from
    ``max(p_j - q_j, 0)`` renormalized; if every draft is accepted emit a bonus token from
    ``p_{K+1}``. Without ``draft_probs`` the draft is a point mass: accept with probability
    ``p(x)``, otherwise draw from ``p`` without ``x``. If a residual has no mass at all
    (``p <= q`` everywhere, i.e. ``p == q`` up to rounding, where a rejection has probability
    0) the token is drawn from ``p``.

    Args:
        target_probs: ``(B, K+1, V)`` float16/bfloat16/float32/float64: the target model's
            processed next-token distributions (rows sum to 1) after each draft prefix:
            position ``i`` predicts draft ``i``, position ``K`` the bonus token. Contiguous
            input avoids a copy.
        draft_token_ids: ``(B, K)`` int64 (or int32), the drafted tokens.
        target_logits, params, state, token_bitmask: instead of ``target_probs``, the
            target's raw ``(B, K+1, V)`` logits and the engine step's stages
            (:func:`fastsample.sample_step`'s ``params`` for the ``B`` requests, their
            :class:`~fastsample.TokenStats`, and a ``(B, K+1, ceil(V / 32))`` grammar
            bitmask per position): position ``i`` is processed as the target alone would
            sample there, the drafts ``x_1..x_i`` counted as emitted (penalties, min-tokens;
            :mod:`fastsample.verify.targets`). Update ``state`` with the output's
            ``token_ids`` afterwards.
        draft_probs: ``(B, K, V)`` float: the processed distributions the drafts were drawn
            from (the *same* temperature/top-k/top-p as used for drawing), or None for
            drafts without probabilities (point masses).
        draft_lengths: optional ``(B,)`` int64 tensor (or an int): row ``b`` uses only its
            first ``draft_lengths[b]`` drafts (``0..K``); the other positions are padding
            and are never read except for the target at position ``draft_lengths[b]``
            (which then holds the bonus distribution).
            Inputs that require grad are detached after the checks (verification is not
            differentiable); no output carries a graph.
        seed, step: per-request counter-based randomness (Python ints or ``(B,)`` int64
            tensors): streams ``Stream.ACCEPT``, ``Stream.RECOVERY`` and ``Stream.BONUS``.
        generator: a ``torch.Generator`` instead (mutually exclusive with ``seed``).
        check: if True, first read the inputs on the host (this syncs) and raise
            ``ValueError`` naming the first bad row: draft ids outside ``[0, V)``, lengths
            outside ``[0, K]``, NaN/inf/negative/zero-mass distributions at used positions.

    Returns:
        :class:`VerifyOutput` ``(token_ids (B, K+1), num_accepted (B,), num_emitted (B,),
        valid (B,))``.

    Bad values (without ``check``) never raise and never touch other rows: a row gets
    ``valid=False`` (and emits nothing) if a used draft id is outside ``[0, V)`` (ids are
    clamped into range for the gathers), its length is outside ``[0, K]``, a gathered
    ``p(x)`` or ``q(x)`` is NaN, infinite or negative, or the row drawn from at the end
    (the target at the first rejection or bonus position; the draft there too if its
    residual is used) contains NaN, inf or negative entries or has no mass. Other entries of
    the target rows at accepted positions are not read (that would cost a pass per
    position); use ``check=True`` to have every used row checked.

    No host sync, no data-dependent shapes: safe under ``torch.compile(fullgraph=True)``
    and in CUDA graphs.

    Example:
        >>> B, K, V = 2, 3, 10
        >>> target = torch.softmax(torch.randn(B, K + 1, V), -1)
        >>> draft = torch.softmax(torch.randn(B, K, V), -1)
        >>> drafts = torch.multinomial(draft.view(-1, V), 1).view(B, K)
        >>> out = verify_chain(target, drafts, draft, seed=torch.tensor([1, 2]), step=0)
        >>> out.token_ids.shape, bool((out.num_emitted == out.num_accepted + 1).all())
        (torch.Size([2, 4]), True)
    """
    if target_logits is not None or params is not None:
        if target_probs is not None or target_logits is None or params is None:
            raise ValueError(
                "pass target_probs, or target_logits with params (the engine step's stages), "
                "not both"
            )
        if not isinstance(draft_token_ids, Tensor) or draft_token_ids.dim() != 2:
            raise ValueError("draft_token_ids must be a (batch, K) integer tensor")
        prefixes = targets.chain_prefixes(draft_token_ids.long())
        target_probs = targets.processed_positions(
            target_logits, prefixes, params, state, token_bitmask
        )
    elif state is not None or token_bitmask is not None:
        raise ValueError("state and token_bitmask go with target_logits and params")
    p = check_probs(target_probs, "target_probs", "(batch, K+1, vocab)")
    batch, positions = p.shape[:2]
    if positions < 1:
        raise ValueError("target_probs must have K+1 >= 1 positions (the bonus position)")
    k = positions - 1
    device = p.device
    x = check_ids(draft_token_ids, "draft_token_ids", (batch, k), device)
    q = check_draft_probs(draft_probs, p, k, "(batch, K, vocab)")
    lengths = check_counts(draft_lengths, "draft_lengths", batch, 0, k, device)
    source = random_source(generator, seed, step, batch, device)
    if v.check_flag(check, "check"):
        _check_chain_values(p, x, q, lengths)
    # Verification is not differentiable: values only, once, after the checks.
    p, q = v.detached(p), None if q is None else v.detached(q)
    if backend.use_triton(device.type):  # FASTSAMPLE_BACKEND (kernels/backend.py): one kernel
        from ..kernels import verify_ops

        seeds = tuple(source) if isinstance(source, Seeds) else None
        u = None if seeds is not None else uniforms(source, batch, k)
        return VerifyOutput(*verify_ops.chain(p, x, q, lengths, seeds, u))
    u_accept, u_recovery, u_bonus = uniforms(source, batch, k)
    return _verify_chain(p, x, q, lengths, u_accept, u_recovery, u_bonus)


def _check_chain_values(p: Tensor, x: Tensor, q: Tensor | None, lengths: Tensor | None) -> None:
    """``check=True``: read everything used on the host and raise on the first problem."""
    batch, positions, vocab = p.shape
    k = positions - 1
    if lengths is not None:
        bad_len = (lengths < 0) | (lengths > k)
        raise_bad_values(bad_len[:, None, None], "draft_lengths", [f"outside [0, {k}]"])
        used = torch.arange(k, device=p.device) < lengths[:, None]
        last = lengths
    else:
        used = torch.ones(batch, k, dtype=torch.bool, device=p.device)
        last = torch.full((batch,), k, device=p.device)
    bad_ids = ((x < 0) | (x >= vocab)) & used
    raise_bad_values(bad_ids[:, :, None], "draft position", [f"has an id outside [0, {vocab})"])
    target_used = torch.arange(positions, device=p.device) <= last[:, None]
    raise_bad_values(
        value_flags(p) & target_used[:, :, None], "target_probs position", VALUE_REASONS
    )
    if q is not None:
        raise_bad_values(value_flags(q) & used[:, :, None], "draft_probs position", VALUE_REASONS)


def _verify_chain(
    p: Tensor,
    x: Tensor,
    q: Tensor | None,
    lengths: Tensor | None,
    u_accept: Tensor,
    u_recovery: Tensor,
    u_bonus: Tensor,
) -> VerifyOutput:
    """The chain verifier proper; arguments already checked, uniforms already drawn."""
    batch, positions, vocab = p.shape
    k = positions - 1
    device = p.device
    rows = torch.arange(batch, device=device)
    valid = torch.ones(batch, dtype=torch.bool, device=device)
    if lengths is not None:
        valid = valid & (lengths >= 0) & (lengths <= k)
        lengths = lengths.clamp(0, k)
        used = torch.arange(k, device=device) < lengths[:, None]
    else:
        used = None

    # Acceptances from the gathered probabilities only: (B, K) values, no (B, V) work.
    ids_in_range = (x >= 0) & (x < vocab)
    x = x.clamp(0, vocab - 1)
    p_x = p[:, :k].gather(2, x[:, :, None])[:, :, 0].to(torch.float64)
    clean = (p_x >= 0) & (p_x < math.inf) & ids_in_range  # NaN fails both comparisons
    accept = accept_drafts(u_accept, p_x, None)
    if q is not None:
        q_x = q.gather(2, x[:, :, None])[:, :, 0].to(torch.float64)
        clean = clean & (q_x >= 0) & (q_x < math.inf)
        accept = accept_drafts(u_accept, p_x, q_x)
    if used is not None:
        accept = accept & used
        clean = clean | ~used  # padding positions are never judged
    valid = valid & clean.all(-1)
    # The first rejection: the number of leading acceptances (cumprod keeps the prefix).
    num_accepted = accept.to(torch.int64).cumprod(-1).sum(-1)
    limit = lengths if lengths is not None else k
    rejected = num_accepted < limit
    u_final = torch.where(rejected[:, None], u_recovery, u_bonus)

    # One (B, V) draw: at the first rejected position, or the bonus position.
    target_rows = rows * positions + num_accepted
    p_table = p.reshape(batch * positions, vocab).contiguous()
    if q is not None and k > 0:
        draft_rows = rows * k + num_accepted.clamp_max(k - 1)
        q_table = q.reshape(batch * k, vocab).contiguous()
        recovery = draw_residual(p_table, target_rows, q_table, draft_rows, rejected, u_final)
    else:
        if k > 0:
            rejected_id = x.gather(1, num_accepted.clamp_max(k - 1)[:, None])
        else:
            rejected_id = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        recovery = draw_target_without(
            p_table, target_rows, rejected_id, rejected[:, None], u_final
        )
    valid = valid & recovery.ok

    slots = torch.arange(positions, device=device)
    drafted = torch.cat((x, x.new_zeros(batch, 1)), dim=1)
    emitted = torch.where(slots < num_accepted[:, None], drafted, -1)
    emitted = torch.where(slots == num_accepted[:, None], recovery.token, emitted)
    return VerifyOutput(
        torch.where(valid[:, None], emitted, -1),
        torch.where(valid, num_accepted, 0),
        torch.where(valid, num_accepted + 1, 0),
        valid,
    )
