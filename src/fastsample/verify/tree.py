"""Tree verification: :func:`verify_tree` walks a :class:`TokenTree` of drafts per request.

Two parts: the walk tables (first child and next sibling of every node), built in Python
and cached on the device for trees shared by all requests, or with fixed-shape ops for
per-request tensor trees; and the walk itself, a static loop over tested children. Why both
acceptance modes are exact is in :mod:`fastsample.verify`; the rules are in
:mod:`fastsample.verify.acceptance`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..kernels import backend
from ..ops import threads
from ..ops import validation as v
from ..stages import StepParams, TokenStats
from . import targets
from .acceptance import accept_child, accept_sibling, next_coefficient
from .checks import (
    INT_DTYPES,
    VALUE_REASONS,
    check_counts,
    check_draft_probs,
    check_ids,
    check_probs,
    check_same_device,
    raise_bad_values,
    value_flags,
)
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
from .randomness import Seeds, random_source, uniforms


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


class _Structure(NamedTuple):
    """Walk tables of a batch of trees (``(B, N)`` int64 or broadcastable ``(1, N)``)."""

    first_child: Tensor  # first child of each node, N if none
    next_sibling: Tensor  # next sibling in node order, N if none
    ok: Tensor  # (B,) bool, parents well formed
    steps: int  # static number of walk steps that covers every row
    width: int  # static bound on the children of one node
    parent: Tensor  # parent of each node; N for the root and malformed entries


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
    parent = (n, *parents[1:])
    first, following, ok, parent_row = _host_tables(
        tuple(first_child), tuple(next_sibling), parent, device
    )
    return _Structure(first, following, ok, steps, max(children), parent_row)


# Device copies of host trees' walk tables, by (tables, device): made on the first call (for a
# CUDA graph, the warm-up call before capture), so later calls do no host-to-device copy.
_HOST_TABLES: OrderedDict[tuple, tuple[Tensor, Tensor, Tensor, Tensor]] = OrderedDict()
_HOST_TABLES_MAX = 256


def _host_tables(
    first_child: tuple[int, ...],
    next_sibling: tuple[int, ...],
    parent: tuple[int, ...],
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(first_child (1, N), next_sibling (1, N), ok (1,), parent (1, N))`` on ``device``,
    cached."""

    def build() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        def row(values: tuple[int, ...]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)[None]

        ok = torch.ones(1, dtype=torch.bool, device=device)
        return row(first_child), row(next_sibling), ok, row(parent)

    if torch.compiler.is_compiling():  # constants of the compiled graph
        return build()
    key = (first_child, next_sibling, parent, device)
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
    ok = well_formed[:, 1:].all(-1) & (parents[:, 0] == -1)
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
    return _Structure(first_child[:, :n], next_sibling, ok, bound, bound, parent)


@threads.one_thread_calls
def verify_tree(
    target_probs: Tensor | None = None,
    tree: TokenTree | None = None,
    draft_probs: Tensor | None = None,
    *,
    target_logits: Tensor | None = None,
    params: StepParams | None = None,
    state: TokenStats | None = None,
    token_bitmask: Tensor | None = None,
    seed: int | Tensor | None = None,
    step: int | Tensor | None = None,
    generator: torch.Generator | None = None,
    check: bool = False,
) -> TreeVerifyOutput:
    """Verify a token tree per request; the emitted tokens follow the target exactly.

    Math (see :mod:`fastsample.verify` for why each mode is exact): from the root, test the
    current node's children in node order; an accepted child becomes the current node;
    when all its children are rejected (or it has none), draw the final token there.

    * ``draft_probs=None`` (mode a, any tree, e.g. top-k children): accept child ``t`` iff
      ``u * (1 - R) < p(t)`` with ``R`` the target mass of the already rejected siblings
      (``p(t)`` counted as 0 if ``t`` was already rejected); final token from ``p`` with the
      rejected siblings removed.
    * ``draft_probs`` given (mode b, children drawn without replacement from ``q``): accept
      iff ``u * q(t) < p(t)``; on rejection ``p <- norm(max(p - q, 0))`` and
      ``q <- norm(q`` without ``t)``; final token from the current ``p`` (computed without
      updating ``(B, V)`` rows, see :mod:`fastsample.verify`; masses are exact, so rows need not
      be normalized). If a residual has no mass (``p <= q`` up to rounding: the rejection had
      probability 0), the later siblings are rejected and the final token is drawn from the
      node's target distribution.

    Args:
        target_probs: ``(B, N, V)`` float: the target's processed next-token distribution
            after each node's path (tree attention), rows summing to 1; node 0 is the root.
        tree: a :class:`TokenTree` ``(token_ids (B, N), parents, num_nodes=None)``.
        target_logits, params, state, token_bitmask: instead of ``target_probs``, the raw
            ``(B, N, V)`` logits and the engine step's stages, as in :func:`verify_chain`:
            node ``n`` counts the tokens on its path from the root as emitted.
        draft_probs: ``(B, N, V)`` float or None. Row ``n`` is the distribution node ``n``'s
            children were drawn from, without replacement (rows of leaves are not read), so
            siblings are distinct: a row repeating a sibling's token is invalid (mode b only).
            Inputs that require grad are detached after the checks (not differentiable).
        seed, step, generator, check: as in :func:`verify_chain` (streams
            ``Stream.ACCEPT`` with one counter per node, ``RECOVERY`` when a child of the
            last node was rejected, ``BONUS`` otherwise). ``check=True`` also checks the
            parents, the token ids, ``num_nodes``, and (mode b) that siblings are distinct.

    Returns:
        :class:`TreeVerifyOutput` ``(token_ids (B, N), accepted_nodes (B, N),
        num_accepted (B,), num_emitted (B,), valid (B,))``.

    Bad values (without ``check``): a row gets ``valid=False`` and emits nothing if its
    parents are malformed (tensor parents, the root's entry included: it must be -1), two
    present siblings share a token (mode b), a used token id is outside ``[0, V)``, its
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
    if target_logits is not None or params is not None:
        if target_probs is not None or target_logits is None or params is None:
            raise ValueError(
                "pass target_probs, or target_logits with params (the engine step's stages), "
                "not both"
            )
        if not isinstance(tree, TokenTree):
            raise TypeError(f"tree must be a fastsample.TokenTree, got {type(tree).__name__}")
        prefixes = targets.tree_prefixes(tree.token_ids.long(), tree.parents)
        target_probs = targets.processed_positions(
            target_logits, prefixes, params, state, token_bitmask, tree.parents
        )
    elif state is not None or token_bitmask is not None:
        raise ValueError("state and token_bitmask go with target_logits and params")
    p = check_probs(target_probs, "target_probs", "(batch, nodes, vocab)")
    batch, n = p.shape[:2]
    device = p.device
    if not isinstance(tree, TokenTree):
        raise TypeError(f"tree must be a fastsample.TokenTree, got {type(tree).__name__}")
    tokens = check_ids(tree.token_ids, "tree.token_ids", (batch, n), device)
    parents = tree.parents
    if isinstance(parents, Tensor):
        if parents.dtype not in INT_DTYPES:
            raise TypeError(f"tree.parents must be int64, got {parents.dtype}")
        if tuple(parents.shape) not in ((n,), (batch, n)):
            raise ValueError(
                f"tree.parents must have shape ({n},) or ({batch}, {n}), got {tuple(parents.shape)}"
            )
        check_same_device(parents, "tree.parents", device)
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
    sizes = check_counts(tree.num_nodes, "tree.num_nodes", batch, 1, n, device)
    q = check_draft_probs(draft_probs, p, n, "(batch, nodes, vocab)")
    source = random_source(generator, seed, step, batch, device)
    if v.check_flag(check, "check"):
        _check_tree_values(p, q, tokens, parents, sizes)
    # Verification is not differentiable: values only, once, after the checks.
    p, q = v.detached(p), None if q is None else v.detached(q)
    if backend.use_triton(device.type):  # FASTSAMPLE_BACKEND (kernels/backend.py): one kernel
        from ..kernels import verify_ops

        seeds = tuple(source) if isinstance(source, Seeds) else None
        u = None if seeds is not None else uniforms(source, batch, n - 1)
        width = max(structure.width if structure is not None else n - 1, 1)
        out = verify_ops.tree(p, q, tokens, parents, sizes, width, seeds, u)
        return TreeVerifyOutput(*out)
    if structure is None:
        structure = _device_structure(parents.long(), batch)  # type: ignore[union-attr]
    u_accept, u_recovery, u_bonus = uniforms(source, batch, n - 1)
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
        raise_bad_values(
            ((sizes < 1) | (sizes > n))[:, None, None], "num_nodes", [f"is outside [1, {n}]"]
        )
        present = nodes < sizes[:, None]
    else:
        present = torch.ones(batch, n, dtype=torch.bool, device=device)
    raise_bad_values(
        (parent[:, :1] != -1)[:, :, None], "tree.parents entry", ["is not -1 (node 0 is the root)"]
    )
    bad_parent = ~((parent >= 0) & (parent < nodes)) & present & (nodes > 0)
    raise_bad_values(
        bad_parent[:, :, None],
        "tree node",
        ["has a parent outside [0, node) (parents must be listed before children)"],
    )
    bad_ids = ((tokens < 0) | (tokens >= vocab)) & present & (nodes > 0)
    raise_bad_values(bad_ids[:, :, None], "tree node", [f"has a token id outside [0, {vocab})"])
    raise_bad_values(value_flags(p) & present[:, :, None], "target_probs node", VALUE_REASONS)
    if q is not None:
        child = present & (nodes > 0)
        has_children = torch.zeros(batch, n + 1, dtype=torch.bool, device=device)
        has_children.scatter_(1, torch.where(child, parent, n), child)
        inner = has_children[:, :n] & present
        raise_bad_values(value_flags(q) & inner[:, :, None], "draft_probs node", VALUE_REASONS)
        twin = (
            (tokens[:, :, None] == tokens[:, None, :])
            & (parent[:, :, None] == parent[:, None, :])
            & child[:, :, None]
            & child[:, None, :]
            & (nodes[:, None] < nodes[None, :])
        )
        raise_bad_values(
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
    if q is not None:  # mode b is exact only for distinct siblings (drawn without replacement)
        valid = valid & ~_repeated_siblings(
            structure.parent.expand(batch, n), tokens, present, vocab
        )
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
    # for the rejected siblings, whose weights were frozen when they left q (package docstring).
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


def _repeated_siblings(parent: Tensor, tokens: Tensor, present: Tensor, vocab: int) -> Tensor:
    """``(B,)`` rows where two present children of one node carry the same token: one sort
    of ``(parent, token)`` keys per row instead of an ``(N, N)`` comparison (no sync)."""
    n = parent.shape[1]
    nodes = torch.arange(n, device=parent.device)
    # Tokens are clamped into [0, V) and parents into [0, N], so keys of present nodes are
    # >= 0 and equal only for the same (parent, token); absent nodes get distinct negatives.
    key = torch.where(present, parent * vocab + tokens, -1 - nodes)
    ordered = key.sort(dim=1).values
    return ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(-1)


def _finite_non_negative(values: Tensor) -> Tensor:
    """``(B, 1)`` gathered values -> ``(B,)``: no NaN, no inf, no negative."""
    return ((values >= 0) & (values < math.inf))[:, 0]
