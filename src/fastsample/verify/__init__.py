"""Speculative-decoding verification, chain and tree, exact in distribution.

A draft model proposes tokens; the target model scores all of them in one forward pass;
the verifier decides which drafts to keep and draws one more token, so that the emitted
tokens are distributed exactly as if they had been sampled from the target alone.

Chain (:func:`verify_chain`), for drafts ``x_1..x_K`` with target distributions
``p_1..p_{K+1}`` and draft distributions ``q_1..q_K``:

1. Accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``, tested as
   ``u_i * q_i(x_i) < p_i(x_i)`` in float64 with ``u_i`` a 53-bit uniform in ``[0, 1)``.
   The comparison is strict, so a token with ``p_i(x_i) = 0`` is never accepted (not even
   for ``u_i = 0``), and no division is needed.
2. Stop at the first rejection ``j``: emit ``x_1..x_{j-1}`` and one token drawn from the
   residual ``max(p_j - q_j, 0)`` renormalized. If all drafts are accepted, emit them and
   a bonus token drawn from ``p_{K+1}``.

Why it is exact (Leviathan et al. 2023; Chen et al. 2023): at one position, the emitted
token is ``x`` with probability ``q(x) min(1, p(x)/q(x)) = min(p(x), q(x))`` through
acceptance, plus ``P(reject) r(x)`` with ``P(reject) = 1 - sum_y min(p(y), q(y)) =
sum_y max(p(y) - q(y), 0)`` and ``r`` the normalized residual: the sum is
``min(p, q) + max(p - q, 0) = p``. The next position is then reached only after an
acceptance, with the target's conditional distribution given the accepted prefix, so by
induction the emitted sequence follows the target. It needs ``q`` to be exactly the
distribution the draft token was drawn from (after the draft's own temperature, top-k,
top-p: the *processed* distribution) and the acceptance uniforms to be independent of the
draft's randomness (separate streams, see below).

Drafts without probabilities (n-gram, greedy or lookup drafters): pass
``draft_probs=None``. The draft is then a point mass, ``q = 1`` on ``x``: accept with
probability ``p(x)``, otherwise draw from ``p`` with ``x`` removed. Exact for any way of
choosing the drafts, as long as it does not look at the acceptance uniforms.

Trees (:func:`verify_tree`), for token trees as EAGLE, Medusa and SpecInfer build them:
walk from the root; at the current node, test its children one after the other (siblings
in node order); an accepted child becomes the current node; when every child of the
current node is rejected (or it has none), draw the final token there. Two rules for the
children, each exact under its own assumption about how the children were drafted:

(a) ``draft_probs=None`` ("deterministic children", e.g. the top-k of the draft as in EAGLE
    and Medusa): child ``t`` is accepted with the target's probability among the tokens not
    yet rejected, ``p(t) / (1 - sum of p over rejected siblings)``, and the final token is
    drawn from ``p`` with the rejected siblings removed. This is sampling from ``p`` by
    sequential inversion ("is it t_1? if not, is it t_2? ..."), so it is exact for *any*
    tree, whatever chose its tokens (top-k, sampling, heuristics), as long as the choice
    does not depend on the acceptance uniforms. It never looks at the draft's probabilities.
(b) ``draft_probs`` given ("children drawn without replacement", e.g. SpecTr/RSD-style
    trees): the children of a node were drawn one after the other from the node's draft
    distribution ``q`` *without replacement* (each sibling from ``q`` renormalized over the
    tokens not yet drawn). Recursive rejection sampling: child ``t`` is accepted with
    probability ``min(1, p(t) / q(t))``; after a rejection ``p <- norm(max(p - q, 0))`` and
    ``q <- q`` with ``t`` removed, renormalized; if all children are rejected the final token
    is drawn from the last ``p``. Each step is one speculative-sampling step whose proposal
    is distributed as the current ``q`` given the rejected siblings, so by induction the
    output follows ``p``. It is exact only for that drafting scheme: not for top-k children
    (use (a)) and not for children drawn *with* replacement (i.i.d.), where the draft
    distribution would have to stay unchanged after a rejection. With one child per node it
    is exactly :func:`verify_chain`.

Randomness: every uniform comes from an explicit source. With ``seed`` (and ``step``), row
``b`` uses the counter-based generator of :mod:`fastsample.seeds` with its own
``(seed[b], step[b])`` and three streams: ``Stream.ACCEPT`` (one uniform per draft position
or tree node, counter = position, so a position's uniform never depends on ``K`` or the
batch), ``Stream.RECOVERY`` (the draw after a rejection) and ``Stream.BONUS`` (the draw when
nothing was rejected). Give the draft model's sampler a different stream (``Stream.DRAFT``)
or step: the acceptance uniforms must be independent of the draft tokens. With a
``torch.Generator`` (or neither) the uniforms are drawn in one ``torch.rand`` call.

Cost: the acceptances only read the gathered ``p(x)``, ``q(x)`` (``(B, K)``); the first
rejection is found with a cumulative product; one ``(B, V)`` row per request is read (the
target, and the draft for the residual, at the first rejection or the bonus position) and
drawn from with the blocked inverse CDF of :mod:`fastsample.inverse_cdf`
(:mod:`fastsample._verify_draw`). Residuals are never built for the other positions. Tree
mode (a) costs the same. Tree mode (b) needs the mass of the current residual at every tested
child, one read of the current node's two rows per step, but never updates ``(B, V)``
distributions: after ``i`` rejections at a node with target ``p`` and draft ``q``, the current
target is ``max(p - c_i q, 0)`` renormalized, with one number ``c_i`` per row
(``c_1 = 0``, ``c_{i+1} = c_i + W_i / Q_i``, ``W_i`` its mass and ``Q_i`` the draft mass not yet
drawn), except at the rejected siblings, whose weights stop changing once they leave ``q``
(induction on ``max(max(p - c q, 0) / W - q / Q, 0) = max(p - (c + W / Q) q, 0) / W``).
So every acceptance ratio is computed from the original rows, with exact masses (rows need
not be normalized), and no error accumulates from step to step.

No host sync, no data-dependent shapes, no device asserts: loops run over static counts
(positions, tree nodes, row pieces), so everything compiles with
``torch.compile(fullgraph=True)`` and captures in a CUDA graph. Bad input is handled as in
the samplers: argument errors raise before any work; bad values give ``valid=False`` for
their row only, and ``check=True`` (which syncs) raises instead.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..ops import validation as v
from ..ops.noise import GeneratorSource
from ..ops.seeds import CounterSource, Stream, check_counter_args, make_source
from .draw import (
    Weights,
    draw_residual,
    draw_target_without,
    frozen_block_sums,
    gather_block,
    summarize,
    weight_values,
    work_dtype,
)

_INT_DTYPES = (torch.int64, torch.int32)


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


class TokenTree(NamedTuple):
    """A batch of draft token trees (the format :func:`verify_tree` reads).

    Nodes are numbered ``0..N-1`` per request, node 0 is the root: the last token already in
    the sequence, whose target distribution predicts the first new token. Every other node
    is one draft token whose parent comes *before* it.

    Attributes:
        token_ids: ``(B, N)`` int64 (or int32) tensor on the data's device, the token of each
            node; column 0 (the root) is ignored.
        parents: the parent of each node: ``parents[0] = -1`` and ``0 <= parents[n] < n`` for
            ``n >= 1`` (parents listed before children: this one rule excludes cycles,
            orphans and out-of-range parents). Either host data shared by all requests (a
            list or tuple of ints: checked at once, for free) or an int64 tensor of shape
            ``(N,)`` or ``(B, N)`` on the data's device (per-request trees: checked only with
            ``check=True``, otherwise a bad row gets ``valid=False``).
        num_nodes: optional ``(B,)`` int64 tensor (or a Python int): request ``b`` uses nodes
            ``0..num_nodes[b]-1`` and ignores the rest (padding), ``1 <= num_nodes <= N``.

    Siblings are tested in node order, so list each node's children in the order the draft
    produced them (by decreasing draft probability for top-k children; in drawing order for
    children drawn without replacement).

    Example (one shared tree: two first tokens, the first with two children)::

        #        0 (root)
        #       / \\
        #      1   2
        #     / \\
        #    3   4
        tree = TokenTree(token_ids=tokens, parents=[-1, 0, 0, 1, 1])
    """

    token_ids: Tensor
    parents: Sequence[int] | Tensor
    num_nodes: Tensor | int | None = None


class TreeVerifyOutput(NamedTuple):
    """What :func:`verify_tree` returns.

    Attributes:
        token_ids: ``(B, N) int64``: the emitted tokens, left-aligned (the accepted path's
            tokens from the root down, then the final token drawn at the last accepted
            node), ``-1`` after them. At most ``depth + 1`` are used.
        accepted_nodes: ``(B, N) int64``: node indices of the accepted path (root excluded),
            left-aligned, ``-1`` after them.
        num_accepted: ``(B,) int64``, the accepted path's length.
        num_emitted: ``(B,) int64``, ``num_accepted + 1`` (0 for invalid rows).
        valid: ``(B,) bool``; invalid rows emit nothing (all ``-1``, counts 0).
    """

    token_ids: Tensor
    accepted_nodes: Tensor
    num_accepted: Tensor
    num_emitted: Tensor
    valid: Tensor


# ---------------------------------------------------------------------------- randomness


class _Seeds(NamedTuple):
    """Checked per-request counters: ``(B,)`` int64 ``seed`` and ``step``."""

    seed: Tensor
    step: Tensor


def _random_source(
    generator: object, seed: object, step: object, batch: int, device: torch.device
) -> GeneratorSource | _Seeds:
    """Check the randomness arguments (before any work): a generator source, or seeds."""
    v.check_generator(generator, device)
    source = make_source(generator, seed, step, None, batch, device)  # type: ignore[arg-type]
    if isinstance(source, GeneratorSource):
        return source
    return _Seeds(*check_counter_args(seed, step, 0, batch, device)[:2])


def _counters(seeds: _Seeds, streams: Sequence[Stream]) -> CounterSource:
    """One counter source over ``len(streams)`` virtual copies of the batch, one per stream:
    row ``b`` of each copy depends only on ``seed[b]``, ``step[b]`` and the stream."""
    batch, copies, device = seeds.seed.shape[0], len(streams), seeds.seed.device
    # Filled on the device (no host-to-device copy: capturable in a CUDA graph).
    stream = torch.cat(
        [torch.full((batch,), int(s), dtype=torch.int64, device=device) for s in streams]
    )
    return CounterSource(seeds.seed.repeat(copies), seeds.step.repeat(copies), stream)


# Up to this many acceptance uniforms per call, one Philox evaluation serves all three
# streams (op count dominates); above, the final draw's streams, which need one uniform
# each, get their own evaluation (volume dominates).
_ONE_PHILOX_CALL_MAX = 8192


def _uniforms(
    source: GeneratorSource | _Seeds, batch: int, num_accept: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(accept (B, num_accept), recovery (B, 1), bonus (B, 1))`` float64 uniforms in [0, 1).

    Acceptance uniform ``i`` is counter ``i`` of the ``ACCEPT`` stream (draft position ``i``,
    or tree node ``i + 1``); the final draw uses counter 0 of ``RECOVERY`` or ``BONUS``. The
    values depend only on ``(seed, step, stream, counter)``, never on how they are batched.
    A ``torch.Generator`` gives all of them in one ``torch.rand`` call.
    """
    if isinstance(source, GeneratorSource):
        u = source.row_uniforms(num_accept + 2)
        return u[:, :num_accept], u[:, num_accept : num_accept + 1], u[:, num_accept + 1 :]
    if num_accept <= 2 or batch * num_accept <= _ONE_PHILOX_CALL_MAX:
        u = _counters(source, (Stream.ACCEPT, Stream.RECOVERY, Stream.BONUS))
        u = u.row_uniforms(max(num_accept, 1))
        return u[:batch, :num_accept], u[batch : 2 * batch, :1], u[2 * batch :, :1]
    accept = _counters(source, (Stream.ACCEPT,)).row_uniforms(num_accept)
    final = _counters(source, (Stream.RECOVERY, Stream.BONUS)).row_uniforms(1)
    return accept, final[:batch], final[batch:]


# ---------------------------------------------------------------------------- argument checks


def _check_probs(probs: object, name: str, rank_hint: str) -> Tensor:
    if not isinstance(probs, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {rank_hint}, got {type(probs)}")
    if probs.dim() != 3:
        raise ValueError(
            f"{name} must have shape {rank_hint}, got {probs.dim()} dimensions {tuple(probs.shape)}"
        )
    if probs.dtype not in v.FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {probs.dtype}; "
            f"convert with {name}.float()"
        )
    if probs.shape[2] < 1:
        raise ValueError(f"{name} must have at least one vocabulary entry, got {probs.shape}")
    return probs


def _check_ids(ids: object, name: str, shape: tuple[int, int], device: torch.device) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be an int64 tensor of shape {shape}, got {type(ids)}")
    if ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be int64 (or int32), got {ids.dtype}; use {name}.long()")
    if tuple(ids.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but target_probs is on {device}")
    return ids.long()


def _check_same_device(t: Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(
            f"{name} is on {t.device} but target_probs is on {device}; all inputs must be "
            "on one device"
        )


def _check_counts(
    counts: object, name: str, batch: int, low: int, high: int, device: torch.device
) -> Tensor | None:
    """None, a Python int in ``[low, high]`` (checked now) or a ``(B,)`` int64 tensor
    (values checked only with ``check=True``)."""
    if counts is None:
        return None
    if isinstance(counts, bool):
        raise TypeError(f"{name} must be None, an int or an int64 tensor, got bool")
    if isinstance(counts, int):
        if not low <= counts <= high:
            raise ValueError(f"{name} must be between {low} and {high}, got {counts}")
        return torch.full((batch,), counts, dtype=torch.int64, device=device)
    if not isinstance(counts, Tensor):
        raise TypeError(f"{name} must be None, an int or an int64 tensor, got {type(counts)}")
    if counts.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be int64, got {counts.dtype}; use {name}.long()")
    if tuple(counts.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(counts.shape)}")
    _check_same_device(counts, name, device)
    return counts.long()


def _raise_bad_values(bad: Tensor, where: str, reasons: Sequence[str]) -> None:
    """``bad``: ``(B, P, len(reasons))`` bool flags; raise naming the first bad (row, place)."""
    flags = bad.cpu()
    rows = flags.flatten(1).any(1)
    if not bool(rows.any()):
        return
    b = int(rows.to(torch.uint8).argmax())
    place = int(flags[b].any(-1).to(torch.uint8).argmax())
    why = [text for text, f in zip(reasons, flags[b, place].tolist(), strict=True) if f]
    raise ValueError(
        f"row {b} {where} {place} {' and '.join(why)} ({int(rows.sum())} bad row(s) in all). "
        "Without check=True such rows are reported as valid=False instead of raising."
    )


_VALUE_REASONS = ("contains NaN", "contains +-inf", "contains negative weights", "has no mass")


def _value_flags(probs: Tensor) -> Tensor:
    """``(B, P, 4)`` flags of :data:`_VALUE_REASONS` for ``(B, P, V)`` distributions."""
    total = probs.sum(-1, dtype=torch.float64)
    return torch.stack(
        (
            probs.isnan().any(-1),
            probs.isinf().any(-1),
            (probs < 0).any(-1),
            ~(total > 0),
        ),
        dim=-1,
    )


# ---------------------------------------------------------------------------- chain


def verify_chain(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None = None,
    *,
    draft_lengths: Tensor | int | None = None,
    seed: int | Tensor | None = None,
    step: int | Tensor | None = None,
    generator: torch.Generator | None = None,
    check: bool = False,
) -> VerifyOutput:
    """Verify a chain of ``K`` draft tokens per request; the output follows the target exactly.

    Math (standard speculative sampling, see the module docstring): accept draft ``x_i``
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
        draft_probs: ``(B, K, V)`` float: the processed distributions the drafts were drawn
            from (the *same* temperature/top-k/top-p as used for drawing), or None for
            drafts without probabilities (point masses).
        draft_lengths: optional ``(B,)`` int64 tensor (or an int): row ``b`` uses only its
            first ``draft_lengths[b]`` drafts (``0..K``); the other positions are padding
            and are never read except for the target at position ``draft_lengths[b]``
            (which then holds the bonus distribution).
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
    p = _check_probs(target_probs, "target_probs", "(batch, K+1, vocab)")
    batch, positions, vocab = p.shape
    if positions < 1:
        raise ValueError("target_probs must have K+1 >= 1 positions (the bonus position)")
    k = positions - 1
    device = p.device
    x = _check_ids(draft_token_ids, "draft_token_ids", (batch, k), device)
    q = None
    if draft_probs is not None:
        q = _check_probs(draft_probs, "draft_probs", "(batch, K, vocab)")
        if tuple(q.shape) != (batch, k, vocab):
            raise ValueError(
                f"draft_probs must have shape (batch, K, vocab) = {(batch, k, vocab)} to match "
                f"target_probs {tuple(p.shape)}, got {tuple(q.shape)}"
            )
        _check_same_device(q, "draft_probs", device)
    lengths = _check_counts(draft_lengths, "draft_lengths", batch, 0, k, device)
    source = _random_source(generator, seed, step, batch, device)
    if v.check_flag(check, "check"):
        _check_chain_values(p, x, q, lengths)
    u_accept, u_recovery, u_bonus = _uniforms(source, batch, k)
    return _verify_chain(p, x, q, lengths, u_accept, u_recovery, u_bonus)


def _check_chain_values(p: Tensor, x: Tensor, q: Tensor | None, lengths: Tensor | None) -> None:
    """``check=True``: read everything used on the host and raise on the first problem."""
    batch, positions, vocab = p.shape
    k = positions - 1
    if lengths is not None:
        bad_len = (lengths < 0) | (lengths > k)
        _raise_bad_values(bad_len[:, None, None], "draft_lengths", [f"outside [0, {k}]"])
        used = torch.arange(k, device=p.device) < lengths[:, None]
        last = lengths
    else:
        used = torch.ones(batch, k, dtype=torch.bool, device=p.device)
        last = torch.full((batch,), k, device=p.device)
    bad_ids = ((x < 0) | (x >= vocab)) & used
    _raise_bad_values(bad_ids[:, :, None], "draft position", [f"has an id outside [0, {vocab})"])
    target_used = torch.arange(positions, device=p.device) <= last[:, None]
    _raise_bad_values(
        _value_flags(p) & target_used[:, :, None], "target_probs position", _VALUE_REASONS
    )
    if q is not None:
        _raise_bad_values(
            _value_flags(q) & used[:, :, None], "draft_probs position", _VALUE_REASONS
        )


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


def accept_drafts(u: Tensor, p_x: Tensor, q_x: Tensor | None) -> Tensor:
    """Accept with probability ``min(1, p/q)``: ``u * q < p`` and ``p > 0`` (float64).

    Strict, so ``u == 0`` cannot accept a token of target probability 0; no division, so
    ``q == 0`` (a token the draft could not have drawn) accepts whenever ``p > 0``, which is
    ``min(1, p/0) = 1``. ``q_x=None`` is the point-mass draft (``q = 1``).
    """
    scaled = u if q_x is None else u * q_x
    return (scaled < p_x) & (p_x > 0)


def accept_sibling(u: Tensor, left: Tensor, p_t: Tensor) -> Tensor:
    """Tree mode a: accept with the target's probability among the tokens not yet rejected,
    ``p(t) / left`` with ``left = 1 - (mass of the rejected siblings)``, as ``u * left < p(t)``
    (strict, float64, ``p(t) > 0``)."""
    return accept_drafts(u * left, p_t, None)


# ---------------------------------------------------------------------------- tree


class _Structure(NamedTuple):
    """Walk tables of a batch of trees (``(B, N)`` int64 or broadcastable ``(1, N)``)."""

    first_child: Tensor  # first child of each node, N if none
    next_sibling: Tensor  # next sibling in node order, N if none
    ok: Tensor  # (B,) bool, parents well formed
    steps: int  # static number of walk steps that covers every row
    width: int  # static bound on the children of one node


def _host_structure(parents: Sequence[int], device: torch.device) -> _Structure:
    """Check a shared host-side parent list and build its walk tables in Python."""
    n = len(parents)
    if n < 1:
        raise ValueError("tree.parents must list at least the root (parents[0] = -1)")
    for node, parent in enumerate(parents):
        if isinstance(parent, bool) or not isinstance(parent, int):
            raise TypeError(f"tree.parents must hold ints, got {type(parent).__name__} at {node}")
        if node == 0:
            if parent != -1:
                raise ValueError(f"tree.parents[0] must be -1 (node 0 is the root), got {parent}")
        elif parent < 0:
            raise ValueError(
                f"tree node {node} has parent {parent}: every node but the root needs a parent "
                "in [0, node) (an orphan or negative parent)"
            )
        elif parent >= node:
            raise ValueError(
                f"tree node {node} has parent {parent}, which is not listed before it: list "
                "parents before children (parents[n] < n; this also rules out cycles)"
            )
    first_child, next_sibling, last_child = [n] * n, [n] * n, [-1] * n
    children = [0] * n
    cost = [0] * n  # walk steps to reach a node: each edge costs its sibling rank + 1
    for node in range(1, n):
        parent = parents[node]
        if last_child[parent] < 0:
            first_child[parent] = node
        else:
            next_sibling[last_child[parent]] = node
        last_child[parent] = node
        children[parent] += 1
        cost[node] = cost[parent] + children[parent]
    steps = max(cost[node] + children[node] for node in range(n))
    tables = _host_tables(tuple(first_child), tuple(next_sibling), device)
    return _Structure(*tables, steps, max(children))


# Device copies of host trees' walk tables, by (tables, device): made on the first call (for a
# CUDA graph, the warm-up call before capture), so later calls do no host-to-device copy.
_HOST_TABLES: OrderedDict[tuple, tuple[Tensor, Tensor, Tensor]] = OrderedDict()
_HOST_TABLES_MAX = 256


def _host_tables(
    first_child: tuple[int, ...], next_sibling: tuple[int, ...], device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """``(first_child (1, N), next_sibling (1, N), ok (1,))`` on ``device``, cached."""

    def build() -> tuple[Tensor, Tensor, Tensor]:
        def row(values: tuple[int, ...]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)[None]

        ok = torch.ones(1, dtype=torch.bool, device=device)
        return row(first_child), row(next_sibling), ok

    if torch.compiler.is_compiling():  # constants of the compiled graph
        return build()
    key = (first_child, next_sibling, device)
    tables = _HOST_TABLES.get(key)
    if tables is None:
        tables = _HOST_TABLES[key] = build()
        if len(_HOST_TABLES) > _HOST_TABLES_MAX:
            _HOST_TABLES.popitem(last=False)
    else:
        _HOST_TABLES.move_to_end(key)
    return tables


def _device_structure(parents: Tensor, batch: int) -> _Structure:
    """Walk tables of per-request parents with fixed-shape ops (no value read on the host)."""
    n = parents.shape[-1]
    device = parents.device
    parents = parents.expand(batch, n)
    nodes = torch.arange(n, device=device)
    well_formed = (parents >= 0) & (parents < nodes)
    ok = well_formed[:, 1:].all(-1)
    # Root and bad entries point to a sentinel parent n: they are nobody's child.
    parent = torch.where(well_formed & (nodes > 0), parents, n)
    first_child = torch.full((batch, n + 1), n, dtype=torch.int64, device=device)
    first_child.scatter_reduce_(1, parent, nodes.expand(batch, n), "amin")
    # Sorting by (parent, index) lists each node's children in node order, side by side.
    order = torch.argsort(parent * (n + 1) + nodes, dim=1)
    sorted_parent = parent.gather(1, order)
    same = sorted_parent[:, 1:] == sorted_parent[:, :-1]
    following = torch.where(same, order[:, 1:], n)
    next_sibling = torch.full((batch, n), n, dtype=torch.int64, device=device)
    next_sibling.scatter_(1, order[:, :-1], following)
    bound = max(n - 1, 0)  # each node is tested at most once
    return _Structure(first_child[:, :n], next_sibling, ok, bound, bound)


def verify_tree(
    target_probs: Tensor,
    tree: TokenTree,
    draft_probs: Tensor | None = None,
    *,
    seed: int | Tensor | None = None,
    step: int | Tensor | None = None,
    generator: torch.Generator | None = None,
    check: bool = False,
) -> TreeVerifyOutput:
    """Verify a token tree per request; the emitted tokens follow the target exactly.

    Math (see the module docstring for why each mode is exact): from the root, test the
    current node's children in node order; an accepted child becomes the current node;
    when all its children are rejected (or it has none), draw the final token there.

    * ``draft_probs=None`` (mode a, any tree, e.g. top-k children): accept child ``t`` iff
      ``u * (1 - R) < p(t)`` with ``R`` the target mass of the already rejected siblings
      (``p(t)`` counted as 0 if ``t`` was already rejected); final token from ``p`` with the
      rejected siblings removed.
    * ``draft_probs`` given (mode b, children drawn without replacement from ``q``): accept
      iff ``u * q(t) < p(t)``; on rejection ``p <- norm(max(p - q, 0))`` and
      ``q <- norm(q`` without ``t)``; final token from the current ``p`` (computed without
      updating ``(B, V)`` rows, see the module docstring; masses are exact, so rows need not
      be normalized). If a residual has no mass (``p <= q`` up to rounding: the rejection had
      probability 0), the later siblings are rejected and the final token is drawn from the
      node's target distribution.

    Args:
        target_probs: ``(B, N, V)`` float: the target's processed next-token distribution
            after each node's path (tree attention), rows summing to 1; node 0 is the root.
        tree: a :class:`TokenTree` ``(token_ids (B, N), parents, num_nodes=None)``.
        draft_probs: ``(B, N, V)`` float or None. Row ``n`` is the distribution node ``n``'s
            children were drawn from, without replacement (rows of leaves are not read).
        seed, step, generator, check: as in :func:`verify_chain` (streams
            ``Stream.ACCEPT`` with one counter per node, ``RECOVERY`` when a child of the
            last node was rejected, ``BONUS`` otherwise). ``check=True`` also checks the
            parents, the token ids, ``num_nodes``, and (mode b) that siblings are distinct.

    Returns:
        :class:`TreeVerifyOutput` ``(token_ids (B, N), accepted_nodes (B, N),
        num_accepted (B,), num_emitted (B,), valid (B,))``.

    Bad values (without ``check``): a row gets ``valid=False`` and emits nothing if its
    parents are malformed (tensor parents), a used token id is outside ``[0, V)``, its
    ``num_nodes`` is outside ``[1, N]``, a probability read by the walk is NaN, infinite or
    negative, or a row it draws from (or, in mode b, loads) has NaN/inf/negative entries or
    no mass. Other rows are bitwise unaffected.

    Cost: a static walk of at most ``steps`` tested children (for host parents, the most a
    root-to-node walk can test, e.g. 16 for a full 4-ary tree of depth 4; ``N - 1`` for
    tensor parents). Mode a does ``(B,)``-sized work per step and one ``(B, V)`` draw at the
    end; mode b also reads the current node's target and draft rows once per step (the mass
    of the current residual), and never writes ``(B, V)`` state.

    Example:
        >>> B, V = 2, 8
        >>> parents = [-1, 0, 0, 1]                      # root, two children, a grandchild
        >>> tokens = torch.tensor([[0, 3, 5, 1], [0, 2, 7, 7]])
        >>> target = torch.softmax(torch.randn(B, 4, V), -1)
        >>> out = verify_tree(target, TokenTree(tokens, parents), seed=torch.tensor([3, 4]))
        >>> out.token_ids.shape, out.num_emitted.tolist() == (out.num_accepted + 1).tolist()
        (torch.Size([2, 4]), True)
    """
    p = _check_probs(target_probs, "target_probs", "(batch, nodes, vocab)")
    batch, n, vocab = p.shape
    device = p.device
    if not isinstance(tree, TokenTree):
        raise TypeError(f"tree must be a fastsample.TokenTree, got {type(tree).__name__}")
    tokens = _check_ids(tree.token_ids, "tree.token_ids", (batch, n), device)
    parents = tree.parents
    if isinstance(parents, Tensor):
        if parents.dtype not in _INT_DTYPES:
            raise TypeError(f"tree.parents must be int64, got {parents.dtype}")
        if tuple(parents.shape) not in ((n,), (batch, n)):
            raise ValueError(
                f"tree.parents must have shape ({n},) or ({batch}, {n}), got {tuple(parents.shape)}"
            )
        _check_same_device(parents, "tree.parents", device)
        structure = None
    elif isinstance(parents, (list, tuple)):
        if len(parents) != n:
            raise ValueError(
                f"tree.parents has {len(parents)} entries but target_probs has {n} nodes"
            )
        structure = _host_structure(parents, device)
    else:
        raise TypeError(
            f"tree.parents must be a list of ints or an int64 tensor, got {type(parents)}"
        )
    sizes = _check_counts(tree.num_nodes, "tree.num_nodes", batch, 1, n, device)
    q = None
    if draft_probs is not None:
        q = _check_probs(draft_probs, "draft_probs", "(batch, nodes, vocab)")
        if tuple(q.shape) != (batch, n, vocab):
            raise ValueError(
                f"draft_probs must have shape {(batch, n, vocab)} to match target_probs, got "
                f"{tuple(q.shape)}"
            )
        _check_same_device(q, "draft_probs", device)
    source = _random_source(generator, seed, step, batch, device)
    if v.check_flag(check, "check"):
        _check_tree_values(p, q, tokens, parents, sizes)
    if structure is None:
        structure = _device_structure(parents.long(), batch)  # type: ignore[union-attr]
    u_accept, u_recovery, u_bonus = _uniforms(source, batch, n - 1)
    return _verify_tree(p, q, tokens, structure, sizes, u_accept, u_recovery, u_bonus)


def _check_tree_values(
    p: Tensor,
    q: Tensor | None,
    tokens: Tensor,
    parents: Sequence[int] | Tensor,
    sizes: Tensor | None,
) -> None:
    """``check=True`` for trees: structure, ids, sizes and every used distribution."""
    batch, n, vocab = p.shape
    device = p.device
    nodes = torch.arange(n, device=device)
    parent = torch.as_tensor(parents, dtype=torch.int64, device=device).expand(batch, n)
    if sizes is not None:
        _raise_bad_values(
            ((sizes < 1) | (sizes > n))[:, None, None], "num_nodes", [f"is outside [1, {n}]"]
        )
        present = nodes < sizes[:, None]
    else:
        present = torch.ones(batch, n, dtype=torch.bool, device=device)
    bad_parent = ~((parent >= 0) & (parent < nodes)) & present & (nodes > 0)
    _raise_bad_values(
        bad_parent[:, :, None],
        "tree node",
        ["has a parent outside [0, node) (parents must be listed before children)"],
    )
    bad_ids = ((tokens < 0) | (tokens >= vocab)) & present & (nodes > 0)
    _raise_bad_values(bad_ids[:, :, None], "tree node", [f"has a token id outside [0, {vocab})"])
    _raise_bad_values(_value_flags(p) & present[:, :, None], "target_probs node", _VALUE_REASONS)
    if q is not None:
        child = present & (nodes > 0)
        has_children = torch.zeros(batch, n + 1, dtype=torch.bool, device=device)
        has_children.scatter_(1, torch.where(child, parent, n), child)
        inner = has_children[:, :n] & present
        _raise_bad_values(_value_flags(q) & inner[:, :, None], "draft_probs node", _VALUE_REASONS)
        twin = (
            (tokens[:, :, None] == tokens[:, None, :])
            & (parent[:, :, None] == parent[:, None, :])
            & child[:, :, None]
            & child[:, None, :]
            & (nodes[:, None] < nodes[None, :])
        )
        _raise_bad_values(
            twin.any(1)[:, :, None],
            "tree node",
            ["repeats a sibling's token (children drawn without replacement are distinct)"],
        )


def _verify_tree(
    p: Tensor,
    q: Tensor | None,
    tokens: Tensor,
    structure: _Structure,
    sizes: Tensor | None,
    u_accept: Tensor,
    u_recovery: Tensor,
    u_bonus: Tensor,
) -> TreeVerifyOutput:
    """The tree walk; arguments already checked, uniforms already drawn."""
    batch, n, vocab = p.shape
    device = p.device
    rows = torch.arange(batch, device=device)
    nodes = torch.arange(n, device=device)
    valid = structure.ok.expand(batch)
    if sizes is not None:
        valid = valid & (sizes >= 1) & (sizes <= n)
        size = sizes.clamp(1, n)
    else:
        size = torch.full((batch,), n, dtype=torch.int64, device=device)
    present = (nodes < size[:, None]) & (nodes > 0)
    valid = valid & (((tokens >= 0) & (tokens < vocab)) | ~present).all(-1)
    tokens = tokens.clamp(0, vocab - 1)
    first_child = structure.first_child.expand(batch, n)
    next_sibling = structure.next_sibling.expand(batch, n)
    p_table = p.reshape(batch * n, vocab).contiguous()
    q_table = q.reshape(batch * n, vocab).contiguous() if q is not None else None

    width = max(structure.width, 1)
    current = torch.zeros(batch, dtype=torch.int64, device=device)
    candidate = first_child[:, 0]
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    path = torch.full((batch, n), -1, dtype=torch.int64, device=device)
    num_rejected = torch.zeros(batch, dtype=torch.int64, device=device)  # at `current`
    rejected_tokens = torch.zeros(batch, width, dtype=torch.int64, device=device)
    slots = torch.arange(width, device=device)
    left = torch.ones(batch, dtype=torch.float64, device=device)  # mode a: 1 - rejected mass
    # Mode b: the current target is max(p - c q, 0) renormalized at the current node, except
    # for the rejected siblings, whose weights were frozen when they left q (module docstring).
    coef = torch.zeros(batch, dtype=torch.float64, device=device)
    frozen = torch.zeros(batch, width, dtype=torch.float64, device=device)
    work = work_dtype(p, q)

    for _ in range(structure.steps):
        active = candidate < size  # size <= n, so also candidate < n
        node = candidate.clamp_max(n - 1)
        token = tokens.gather(1, node[:, None])  # (B, 1)
        u = u_accept.gather(1, (node - 1).clamp_min(0)[:, None])[:, 0]
        if q_table is None:
            p_t = gather_block(p_table, rows * n + current, token)[:, 0].to(torch.float64)
            valid = valid & ((p_t >= 0) & (p_t < math.inf) | ~active)
            repeated = ((rejected_tokens == token) & (slots < num_rejected[:, None])).any(-1)
            p_t = torch.where(repeated, 0.0, p_t)  # an already rejected token has no mass left
            accept = active & accept_sibling(u, left, p_t)
            reject = active & ~accept
            left = torch.where(accept, 1.0, torch.where(reject, left - p_t, left))
            record = reject
        else:
            node_rows = rows * n + current
            removed = slots < num_rejected[:, None]
            weights = Weights(coef, rejected_tokens, removed, frozen)
            summary = summarize(p_table, node_rows, q_table, node_rows, weights)
            assert summary.residual_sums is not None and summary.draft_mass is not None
            assert summary.draft_ok is not None
            valid = valid & ((summary.target_ok & summary.draft_ok) | ~active)
            mass = frozen_block_sums(summary.residual_sums, weights).sum(-1)
            p_t = gather_block(p_table, node_rows, token)
            q_t = gather_block(q_table, node_rows, token)
            valid = valid & (_finite_non_negative(p_t) & _finite_non_negative(q_t) | ~active)
            w_t = weight_values(p_t, q_t, work, coef)[:, 0].to(torch.float64)
            same = (rejected_tokens == token) & removed
            # An already rejected token left q: weight frozen, draft probability 0.
            repeated = same.any(-1)
            w_t = torch.where(repeated, (frozen * same).sum(-1), w_t)
            q_left = torch.where(repeated, 0.0, q_t[:, 0].to(torch.float64))
            accept = active & accept_child(u, w_t, q_left, mass, summary.draft_mass)
            reject = active & ~accept
            record = reject & ~repeated  # a repeated token was not drawn again: no update
            new_coef = next_coefficient(coef, mass, summary.draft_mass)
            weight_now = weight_values(p_t, q_t, work, new_coef)[:, 0].to(torch.float64)
            coef = torch.where(accept, 0.0, torch.where(record, new_coef, coef))
            slot = num_rejected.clamp_max(width - 1)[:, None]
            frozen = frozen.scatter(
                1, slot, torch.where(record[:, None], weight_now[:, None], frozen.gather(1, slot))
            )
        slot = num_rejected.clamp_max(width - 1)[:, None]
        rejected_tokens = rejected_tokens.scatter(
            1, slot, torch.where(record[:, None], token, rejected_tokens.gather(1, slot))
        )
        num_rejected = torch.where(accept, 0, num_rejected + record.to(torch.int64))
        depth = num_accepted.clamp_max(n - 1)[:, None]
        path = path.scatter(
            1, depth, torch.where(accept[:, None], node[:, None], path.gather(1, depth))
        )
        num_accepted = num_accepted + accept.to(torch.int64)
        current = torch.where(accept, node, current)
        candidate = torch.where(
            accept,
            first_child.gather(1, node[:, None])[:, 0],
            torch.where(reject, next_sibling.gather(1, node[:, None])[:, 0], candidate),
        )

    u_final = torch.where((num_rejected > 0)[:, None], u_recovery, u_bonus)
    if q_table is None:
        recovery = draw_target_without(
            p_table,
            rows * n + current,
            rejected_tokens,
            slots < num_rejected[:, None],
            u_final,
        )
    else:
        node_rows = rows * n + current
        removed = slots < num_rejected[:, None]
        weights = Weights(coef, rejected_tokens, removed, frozen)
        recovery = draw_residual(
            p_table, node_rows, q_table, node_rows, num_rejected > 0, u_final, weights
        )
    valid = valid & recovery.ok

    columns = torch.arange(n, device=device)
    path_tokens = tokens.gather(1, path.clamp_min(0))
    emitted = torch.where(columns < num_accepted[:, None], path_tokens, -1)
    emitted = torch.where(columns == num_accepted[:, None], recovery.token, emitted)
    return TreeVerifyOutput(
        torch.where(valid[:, None], emitted, -1),
        torch.where(valid[:, None], path, -1),
        torch.where(valid, num_accepted, 0),
        torch.where(valid, num_accepted + 1, 0),
        valid,
    )


def _finite_non_negative(values: Tensor) -> Tensor:
    """``(B, 1)`` gathered values -> ``(B,)``: no NaN, no inf, no negative."""
    return ((values >= 0) & (values < math.inf))[:, 0]


def accept_child(u: Tensor, w_t: Tensor, q_t: Tensor, mass: Tensor, draft_mass: Tensor) -> Tensor:
    """Tree mode b: accept with ``min(1, p_i(t) / q_i(t))`` where ``p_i(t) = w_t / mass`` (the
    current residual, renormalized) and ``q_i(t) = q_t / draft_mass`` (the draft renormalized
    over the tokens not yet drawn): ``u * q_t * mass < draft_mass * w_t`` (float64, strict)."""
    return accept_drafts(u, draft_mass * w_t, q_t * mass)


def next_coefficient(coef: Tensor, mass: Tensor, draft_mass: Tensor) -> Tensor:
    """Tree mode b after a rejection: ``norm(max(p_i - q_i, 0))`` with
    ``p_i = max(p - c q, 0) / mass`` and ``q_i = q / draft_mass`` is ``max(p - c' q, 0)``
    renormalized, ``c' = c + mass / draft_mass`` (no draft mass left: nothing changes)."""
    return coef + torch.where(draft_mass > 0, mass / draft_mass, 0.0)
