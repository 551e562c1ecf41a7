"""Verification's acceptance tests and final draw on their boundaries, with chosen uniforms.

The final draw (``fastsample/verify/draw.py``) is the blocked inverse CDF with the documented
pick, the first ``j`` with ``P_j > t``: ``u = 0`` draws the first positive weight (never a
zero residual, a removed token or an emptied block), ``u`` on a prefix draws the next positive
one, ``u`` just below 1 the last one. The acceptance rule is strict: ``u * q(x) < p(x)``, so
``u = p/q`` exactly rejects and ``u = 0`` never accepts a token of target probability 0. The
uniforms reach ``verify_chain`` and ``verify_tree`` through their one source of randomness
(``randomness.uniforms``, patched here), and ``draw.pick`` is also driven directly.

Mutants these tests were run against (each planted by hand, each caught, then reverted):
``searchsorted(right=False)`` in ``draw.pick``'s in-block step (by every test here) and in its
block step (by the direct draw tests); the ``nextafter`` clamp of its block target dropped (by
``test_target_draw_on_subnormal_rows``); ``u * q <= p`` in ``acceptance.accept_drafts``, with
or without its ``p > 0`` (by ``test_chain_boundaries`` and
``test_tree_siblings_rejected_on_the_boundary``).
"""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
from boundary_rows import (
    CHAIN_BLOCK_ROWS,
    CHAIN_WITH_DRAFT,
    CHAIN_WITHOUT_DRAFT,
    LEADING_ZERO_BLOCKS,
    SUBNORMAL_ROWS,
    ZERO_BLOCK_BETWEEN,
    chain_batch,
    chain_block_batch,
    expected_subnormal,
    sparse,
)
from fastsample.verify import chain, tree
from fastsample.verify.draw import Weights, draw_residual, draw_target_without
from uniforms import BELOW_ONE, first_above, on_prefix


@pytest.fixture
def chosen(monkeypatch):
    """``chosen(accept, recovery, bonus)``: the uniforms verify_chain/verify_tree will use."""
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "torch")

    def use(*uniforms: torch.Tensor) -> None:
        for module in (chain, tree):
            monkeypatch.setattr(module, "uniforms", lambda *args: uniforms)

    return use


@pytest.mark.parametrize("with_draft", [True, False])
def test_chain_boundaries(chosen, with_draft):
    cases = CHAIN_WITH_DRAFT if with_draft else CHAIN_WITHOUT_DRAFT
    p, x, q, uniforms, emitted = chain_batch(cases, with_draft)
    chosen(*uniforms)
    out = fs.verify_chain(p, x, q, generator=torch.Generator())
    assert out.token_ids.tolist() == emitted.tolist()
    assert out.valid.all()


def test_chain_final_draw_across_blocks(chosen):
    for row, us in CHAIN_BLOCK_ROWS:
        p, x, q, uniforms, emitted = chain_block_batch(row, us)
        chosen(*uniforms)
        out = fs.verify_chain(p, x, q, generator=torch.Generator())
        assert out.token_ids.tolist() == emitted.tolist()


def test_tree_siblings_rejected_on_the_boundary(chosen):
    """Mode a: child 1 (p = .25) is rejected at u = .25 exactly, child 3 at u = .5
    (.5 * (1 - .25) >= .25); the final draw skips both removed siblings and the zeros."""
    p = torch.tensor([0.0, 0.25, 0.25, 0.25, 0.25, 0.0], dtype=torch.float64)
    target = p.expand(3, 3, 6).contiguous()
    nodes = fs.TokenTree(torch.tensor([[0, 1, 3]] * 3), [-1, 0, 0])
    accept = torch.tensor([[0.25, 0.5]] * 3, dtype=torch.float64)
    recovery = torch.tensor([[0.0], [0.5], [BELOW_ONE]], dtype=torch.float64)
    chosen(accept, recovery, torch.zeros(3, 1, dtype=torch.float64))
    out = fs.verify_tree(target, nodes, generator=torch.Generator())
    assert out.token_ids[:, 0].tolist() == [2, 4, 4] and out.num_accepted.tolist() == [0] * 3


def table(rows: list[list[float]], dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(rows, dtype=dtype), torch.arange(len(rows))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_target_draw_on_block_boundaries(dtype):
    """draw_target_without with nothing removed: the inverse CDF's block cases."""
    for row in (LEADING_ZERO_BLOCKS, ZERO_BLOCK_BETWEEN):
        ids = [j for j, w in enumerate(row) if w > 0]
        us = [0.0, *(on_prefix(row, j) for j in ids[:-1]), BELOW_ONE]
        target, rows = table([row] * len(us), dtype)
        removed = torch.zeros(len(us), 0, dtype=torch.int64)
        u = torch.tensor(us, dtype=torch.float64)[:, None]
        got = draw_target_without(target, rows, removed, removed.bool(), u).token
        assert got[:, 0].tolist() == [first_above(row, x) for x in us]


def test_target_draw_on_subnormal_rows():
    """u * total rounds onto a prefix, or up to a one-unit total (kept below it, so the zero
    blocks after the last positive weight are never picked)."""
    us = [i / 16 for i in range(16)] + [BELOW_ONE]
    for row in SUBNORMAL_ROWS:
        target, rows = table([row] * len(us))
        removed = torch.zeros(len(us), 0, dtype=torch.int64)
        u = torch.tensor(us, dtype=torch.float64)[:, None]
        got = draw_target_without(target, rows, removed, removed.bool(), u).token
        assert got[:, 0].tolist() == [expected_subnormal(row, x) for x in us]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_target_draw_skips_removed_tokens(dtype):
    """A removed token weighs 0 (its block re-summed exactly): u = 0 skips it, and a block
    whose only positive entry was removed is never picked."""
    row = sparse(600, {3: 0.5, 520: 0.25, 530: 0.25})
    target, rows = table([row] * 4, dtype)
    removed = torch.tensor([[3], [3], [3], [520]])
    mask = torch.tensor([[True], [True], [False], [True]])
    u = torch.tensor([[0.0], [0.5], [0.0], [on_prefix([0.5, 0.25], 0)]], dtype=torch.float64)
    got = draw_target_without(target, rows, removed, mask, u).token[:, 0].tolist()
    # Without 3 the mass .5 sits in block 2: u = 0 -> 520, u = .5 -> t = .25 = P(520) -> 530.
    assert got == [520, 530, 3, 530]


def test_residual_draw_boundaries():
    """draw_residual: zero residuals (p == 0, p < q, p == q) are never drawn, a removed token's
    frozen weight (tree mode b) takes its place, and without mass the target is drawn."""
    p = [0.0, 0.25, 0.25, 0.25, 0.25, 0.0]
    q = [0.25, 0.0, 0.5, 0.25, 0.0, 0.0]  # residual [0, .25, 0, 0, .25, 0]
    us = [0.0, 0.5, BELOW_ONE]
    target, rows = table([p] * 3)
    draft, _ = table([q] * 3)
    u = torch.tensor(us, dtype=torch.float64)[:, None]
    yes = torch.ones(3, dtype=torch.bool)
    assert draw_residual(target, rows, draft, rows, yes, u).token[:, 0].tolist() == [1, 4, 4]
    # Not using the residual: the target, whose prefix .5 ends at token 2.
    got = draw_residual(target, rows, draft, rows, ~yes, u).token[:, 0].tolist()
    assert got == [1, 3, 4]
    # Token 1 removed with frozen weight 0, token 3 with frozen .25: residual [0, 0, 0, .25,
    # .25, 0], so u = 0 draws 3 and u = .5 (on 3's prefix) draws 4.
    weights = Weights(
        removed=torch.tensor([[1, 3]] * 3),
        removed_mask=torch.ones(3, 2, dtype=torch.bool),
        frozen=torch.tensor([[0.0, 0.25]] * 3, dtype=torch.float64),
    )
    got = draw_residual(target, rows, draft, rows, yes, u, weights).token[:, 0].tolist()
    assert got == [3, 4, 4]
