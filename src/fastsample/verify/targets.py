"""The target's distributions at every draft position, through the engine step's stages.

Speculative decoding is exact when the target distribution at each position is the one the
target alone would sample from there. With the engine step's stages
(:mod:`fastsample.stages`) that distribution depends on what was emitted before: at chain
position ``i`` (or tree node ``n``) the drafts before it count as emitted tokens, for the
penalties (output counts, seen tokens) and for min-tokens (the output length), as vLLM's
rejection sampler counts them. So position ``i`` is processed with the request's
:class:`~fastsample.stages.TokenStats` plus the tokens ``x_1..x_i`` (a tree node: the tokens on
its path from the root), and the request's :class:`~fastsample.stages.StepParams`.

All positions go through :func:`fastsample.stages.process_step` at once, as a
``(B * positions, V)`` batch whose rows map to their request's statistics (no copy of the
state), with the drafts before each position as its extra tokens.

Mirostat is the exception: its ``mu`` moves with every emitted token by that token's
processed probability, so position ``j``'s ``mu`` is its parent's moved by the draft that
leads to ``j``, read from the parent's processed distribution. With mirostat on, the
positions are processed one after another in index order (a parent comes before its
children), each with its ``mu``; after verification ``TokenStats.update(token_ids,
probs=target_probs, params=params)`` moves the state's ``mu`` by the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..stages import StepParams, TokenStats, process_step
from ..stages.state import mirostat_update


def _flat_bitmask(token_bitmask: Tensor | None, batch: int, positions: int) -> Tensor | None:
    if token_bitmask is None:
        return None
    if token_bitmask.dim() != 3 or tuple(token_bitmask.shape[:2]) != (batch, positions):
        raise ValueError(
            f"token_bitmask for verification must be (batch, positions, words) = "
            f"({batch}, {positions}, ceil(V / 32)), got {tuple(token_bitmask.shape)}"
        )
    return token_bitmask.flatten(0, 1)


def processed_positions(
    target_logits: Tensor,
    prefixes: Tensor,
    params: StepParams,
    state: TokenStats | None,
    token_bitmask: Tensor | None,
    parents: Sequence[int] | Tensor | None = None,
    state_rows: Tensor | None = None,
) -> Tensor:
    """``(B, P, V)`` processed distributions of ``(B, P, V)`` logits, position ``j`` of row ``b``
    counting ``prefixes[b, j]`` (``(B, P, E)`` int64, -1 = none, oldest first) as already
    emitted. ``parents``: each position's parent (``-1``: the root; None: a chain, ``j - 1``),
    read by mirostat only. ``state_rows`` (``(B,)`` int64): each request's row of ``state``."""
    if not isinstance(target_logits, Tensor) or target_logits.dim() != 3:
        raise ValueError("target_logits must be a (batch, positions, vocab) tensor")
    batch, positions, vocab = target_logits.shape
    if not isinstance(params, StepParams) or (params.batch, params.vocab) != (batch, vocab):
        raise ValueError(
            f"params must be a StepParams built for the requests: ({batch}, {vocab})"
        )
    if params.samplers.on("mirostat"):
        return _with_mirostat(target_logits, prefixes, params, state, token_bitmask, parents,
                              state_rows)  # fmt: skip
    rows = torch.arange(batch, device=target_logits.device).repeat_interleave(positions)
    if state_rows is not None:
        rows = state_rows.index_select(0, rows)
    probs = process_step(
        target_logits.reshape(batch * positions, vocab),
        params.repeat_rows(positions),
        state=state,
        token_bitmask=_flat_bitmask(token_bitmask, batch, positions),
        rows=rows,
        extra=prefixes.reshape(batch * positions, -1),
    )
    return probs.view(batch, positions, vocab)


def _with_mirostat(
    target_logits: Tensor, prefixes: Tensor, params: StepParams, state: TokenStats | None,
    token_bitmask: Tensor | None, parents: Sequence[int] | Tensor | None,
    state_rows: Tensor | None,
) -> Tensor:  # fmt: skip
    """:func:`processed_positions` one position at a time, each with its ``mu``."""
    batch, positions, vocab = target_logits.shape
    device = target_logits.device
    if state is None:
        raise ValueError("mirostat keeps mu in the state: pass state=")
    if parents is None:  # a chain
        parents = torch.arange(positions, device=device) - 1
    parent = parent_table(parents, batch, positions, device)
    depth = (prefixes >= 0).sum(-1)  # (B, P): the draft leading to j is prefixes[j][depth - 1]
    leading = torch.full_like(depth, -1)
    if prefixes.shape[-1]:  # no drafts at all: every position is a root
        leading = prefixes.gather(-1, (depth - 1).clamp_min(0)[..., None]).squeeze(-1)
    start = state.mirostat_mu if state_rows is None else state.mirostat_mu.index_select(
        0, state_rows)  # fmt: skip
    mus: list[Tensor] = []
    probs: list[Tensor] = []
    for j in range(positions):
        mu = start
        if j:  # the parent's mu, moved by the draft leading here at the parent's probability
            par = parent[:, j]
            token = torch.where((depth[:, j] > 0) & (par >= 0), leading[:, j], -1)
            at = token.clamp_min(0)[:, None]
            mu_par, p_par = start, torch.zeros(batch, dtype=probs[0].dtype, device=device)
            for i in range(j):
                here = par == i
                mu_par = torch.where(here, mus[i], mu_par)
                p_par = torch.where(here, probs[i].gather(1, at).squeeze(1), p_par)
            mu = mirostat_update(mu_par, token[:, None], p_par[:, None], params.mirostat_tau,
                                 params.mirostat_eta, vocab)  # fmt: skip
        words = None if token_bitmask is None else token_bitmask[:, j]
        probs.append(process_step(target_logits[:, j], params, state=state,
                                  token_bitmask=words, rows=state_rows, extra=prefixes[:, j],
                                  mirostat_mu=mu))  # fmt: skip
        mus.append(mu)
    return torch.stack(probs, 1)


def chain_prefixes(draft_token_ids: Tensor) -> Tensor:
    """``(B, K+1, K)``: position ``i`` holds ``x_1..x_i``, then -1."""
    k = draft_token_ids.shape[1]
    device = draft_token_ids.device
    upto = torch.arange(k + 1, device=device)[:, None] > torch.arange(k, device=device)
    return torch.where(upto, draft_token_ids[:, None, :], -1)


def parent_table(parents: Sequence[int] | Tensor, batch: int, n: int,
                 device: torch.device) -> Tensor:  # fmt: skip
    """``(B, N)`` int64 parents of ``N`` nodes; a malformed entry (not an earlier node) and
    the root are -1: they end a walk (the verifier flags such rows anyway)."""
    if isinstance(parents, Tensor):
        parent = parents.long().to(device).expand(batch, n)
    else:
        parent = torch.tensor(list(parents), dtype=torch.int64, device=device).expand(batch, n)
    return torch.where((parent >= 0) & (parent < torch.arange(n, device=device)), parent, -1)


def tree_prefixes(token_ids: Tensor, parents: Sequence[int] | Tensor) -> Tensor:
    """``(B, N, N - 1)``: node ``n`` holds the tokens on its path from the root (the root's own
    token excluded: it is already in the sequence), oldest first as a chain's prefixes, then
    -1 (the history stages read the order: DRY, no-repeat n-grams, windowed penalties)."""
    batch, n = token_ids.shape
    device = token_ids.device
    parent = parent_table(parents, batch, n, device)
    current = torch.arange(n, device=device).expand(batch, n)
    steps = []
    for _ in range(n - 1):  # a path has at most N - 1 nodes below the root
        inside = current > 0
        steps.append(torch.where(inside, token_ids.gather(1, current.clamp_min(0)), -1))
        current = torch.where(inside, parent.gather(1, current.clamp_min(0)), -1)
    if not steps:
        return torch.full((batch, n, 0), -1, dtype=torch.int64, device=device)
    deepest_first = torch.stack(steps, -1)
    # Oldest first: entry i of a path of d tokens is the walk's entry d - 1 - i.
    depth = (deepest_first >= 0).sum(-1, keepdim=True)
    at = torch.arange(n - 1, device=device)
    oldest_first = deepest_first.gather(-1, (depth - 1 - at).clamp_min(0))
    return torch.where(at < depth, oldest_first, -1)
