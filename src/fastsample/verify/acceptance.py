"""The acceptance tests of chain and tree verification, on gathered ``(B,)`` float64 values.

One small function per rule, kept apart from the walks that call them so the rules read as
the math they implement (and tests can swap one out for a buggy variant). The tree rules
are the chain rule with renormalized arguments, so they all live here.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
