"""The verification kernels as torch operators, and the entry points ``verify/`` calls.

Entry points (arguments already checked by :mod:`fastsample.verify`, the same checks as the
torch path):

* :func:`chain` ``(p, x, q, lengths, seeds, uniforms)`` -> ``(token_ids, num_accepted,
  num_emitted, valid)`` of :func:`fastsample.verify_chain`;
* :func:`tree` ``(p, q, tokens, parents, sizes, width, seeds, uniforms)`` -> ``(token_ids,
  accepted_nodes, num_accepted, num_emitted, valid)`` of :func:`fastsample.verify_tree`;
  ``parents`` a host list/tuple (copied to the device once and cached) or an int64 tensor.

``seeds`` is ``(seed, step)``, ``(B,)`` int64: the kernels compute the ``ACCEPT``, ``RECOVERY``
and ``BONUS`` uniforms with the in-kernel Philox on the torch path's counters. Otherwise
``uniforms`` are the three tensors of :func:`fastsample.verify.randomness.uniforms` (a
``torch.Generator`` call: one ``torch.rand``, as on the torch path).

Operators ``fastsample::verify_chain`` and ``fastsample::verify_tree``: ``triton_op`` when the
kernels are compiled (``torch.compile`` sees the kernel), ``custom_op`` with a fake
implementation in the interpreter (which needs real data pointers). One launch per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import verify_chain as _chain
from . import verify_tree as _tree
from .philox import INTERPRETED


def _register(name: str, launcher, fake):
    qualified = f"fastsample::{name}"
    if INTERPRETED:
        op = torch.library.custom_op(qualified, launcher, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(qualified, launcher, mutates_args=())


def _chain_launcher(
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
    return _chain.verify_chain(p, x, q, lengths, seed, step, u_accept, u_recovery, u_bonus)


def _chain_fake(p, x, q, lengths, seed, step, u_accept, u_recovery, u_bonus):
    batch, positions = p.shape[0], p.shape[1]
    ids = p.new_empty((batch, positions), dtype=torch.int64)
    counts = p.new_empty((batch,), dtype=torch.int64)
    return ids, counts, torch.empty_like(counts), p.new_empty((batch,), dtype=torch.bool)


def _tree_launcher(
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
    return _tree.verify_tree(
        p, q, tokens, parents, sizes, width, seed, step, u_accept, u_recovery, u_bonus
    )


def _tree_fake(p, q, tokens, parents, sizes, width, seed, step, u_accept, u_recovery, u_bonus):
    batch, n = p.shape[0], p.shape[1]
    ids = p.new_empty((batch, n), dtype=torch.int64)
    counts = p.new_empty((batch,), dtype=torch.int64)
    return (
        ids,
        torch.empty_like(ids),
        counts,
        torch.empty_like(counts),
        p.new_empty((batch,), dtype=torch.bool),
    )


verify_chain_op = _register("verify_chain", _chain_launcher, _chain_fake)
verify_tree_op = _register("verify_tree", _tree_launcher, _tree_fake)

Uniforms = tuple[Tensor, Tensor, Tensor]


def _randomness(seeds: tuple[Tensor, Tensor] | None, uniforms: Uniforms | None) -> tuple:
    if seeds is not None:
        return (*seeds, None, None, None)
    assert uniforms is not None
    return (None, None, *uniforms)


def chain(
    p: Tensor,
    x: Tensor,
    q: Tensor | None,
    lengths: Tensor | None,
    seeds: tuple[Tensor, Tensor] | None,
    uniforms: Uniforms | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`fastsample.verify_chain` by one kernel."""
    return verify_chain_op(p, x, q, lengths, *_randomness(seeds, uniforms))


def tree(
    p: Tensor,
    q: Tensor | None,
    tokens: Tensor,
    parents: Sequence[int] | Tensor,
    sizes: Tensor | None,
    width: int,
    seeds: tuple[Tensor, Tensor] | None,
    uniforms: Uniforms | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`fastsample.verify_tree` by one kernel."""
    if isinstance(parents, Tensor):
        table = parents.long()
        table = table[None] if table.dim() == 1 else table
    else:
        table = _tree.host_parents(tuple(parents), p.device)
    return verify_tree_op(p, q, tokens, table, sizes, width, *_randomness(seeds, uniforms))
