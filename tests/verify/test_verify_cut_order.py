"""Verification with ``target_logits`` and ``params`` processes the targets in the params'
``cut_order``; here the joint order (top-k and top-p each on the whole tempered row).

The row of tests/test_cut_order.py's joint law test (weights 8, 4, 2, 1 and a tail; top_k=4,
top_p=0.75, min_p=0.1) at every position: the joint order keeps {8, 4, 2}, the sequential
orders {8, 4}. The drafts follow the sequential order's law (drawn from it in the chain, its
two tokens as the root's children in the tree), so a verifier that processed the target in
the sequential order would accept them and never emit the third token.

``verify_chain``: the first emitted token's law is the joint-processed target's at 2%; the
sequential law is rejected at the same size, and the verifier run with the sequential order's
params is rejected by the joint law test. ``verify_tree`` (and the chain again): bitwise the
verification of the targets processed by ``fs.process(..., cut_order="joint")``, whose law
tests/verify/test_tree.py judges; with the sequential order's probabilities instead, rows
differ.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
import test_cut_order
from stattests import LawCase, assert_law, law_rejected

V, K = len(test_cut_order.LAW_ROW), 1
CLAIM = test_cut_order.CLAIM
DRAWS = test_cut_order.JOINT_DRAWS  # the joint law's size at 2%
CHUNK = 200_000
ROW = torch.tensor(test_cut_order.LAW_ROW, dtype=torch.float32)
SEQUENTIAL = torch.tensor(test_cut_order.joint_law("transformers"), dtype=torch.float32)


def params(rows: int, order: str) -> fs.StepParams:
    t, k, p, m = test_cut_order.JOINT_CONTROLS
    return fs.StepParams(rows, V, temperature=t, top_k=k, top_p=p, min_p=m, cut_order=order)


def first_tokens(kind: str, rows: int, offset: int, order: str) -> np.ndarray:
    seed = torch.arange(offset, offset + rows)
    if kind == "chain":
        gen = torch.Generator().manual_seed(offset)
        drafts = torch.multinomial(SEQUENTIAL, rows * K, replacement=True, generator=gen)
        out = fs.verify_chain(
            draft_token_ids=drafts.view(rows, K), draft_probs=SEQUENTIAL.expand(rows, K, V),
            target_logits=ROW.expand(rows, K + 1, V), params=params(rows, order), seed=seed,
        )  # fmt: skip
    else:  # the root's children: the sequential order's two tokens (mode a: no draft probs)
        tree = fs.TokenTree(torch.tensor([[0, 0, 1]]).expand(rows, 3), [-1, 0, 0])
        out = fs.verify_tree(tree=tree, target_logits=ROW.expand(rows, 3, V),
                             params=params(rows, order), seed=seed)  # fmt: skip
    assert bool(out.valid.all())
    return out.token_ids[:, 0].numpy()


def counts(kind: str, draws: int, order: str) -> np.ndarray:
    found = np.zeros(V, dtype=np.int64)
    with torch.inference_mode():
        for offset in range(0, draws, CHUNK):
            rows = min(CHUNK, draws - offset)
            found += np.bincount(first_tokens(kind, rows, offset, order), minlength=V)
    return found


def test_chain_joint_order_law_of_the_first_token_and_its_negative_control():
    got = counts("chain", DRAWS, "joint")
    assert_law(got, test_cut_order.joint_law("joint"), what="verify_chain cut_order='joint'")
    assert law_rejected(got, test_cut_order.joint_law("transformers"))
    # A verifier whose targets ignore the order: the test above rejects it.
    sequential = counts("chain", CHUNK // 4, "transformers")
    assert law_rejected(sequential, test_cut_order.joint_law("joint"))


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_targets_are_processed_in_the_joint_order(kind):
    """Bitwise the verification of targets processed by hand in the joint order; rows differ
    from that of targets processed in the sequential order."""
    rows = 256
    gen = torch.Generator().manual_seed(7)
    logits = ROW + torch.randn(rows, K + 1 if kind == "chain" else 3, V, generator=gen) * 0.05
    t, k, p, m = test_cut_order.JOINT_CONTROLS

    def by_hand(order):
        flat = logits.reshape(-1, V)
        out = fs.process(flat, temperature=t, top_k=k, top_p=p, min_p=m, cut_order=order)
        return out.view(logits.shape)

    seed = torch.arange(rows) + 11
    if kind == "chain":
        drafts = torch.multinomial(SEQUENTIAL, rows * K, replacement=True, generator=gen)
        args = dict(draft_token_ids=drafts.view(rows, K),
                    draft_probs=SEQUENTIAL.expand(rows, K, V), seed=seed)  # fmt: skip
        verify = fs.verify_chain
    else:
        tree = fs.TokenTree(torch.tensor([[0, 0, 1]]).expand(rows, 3), [-1, 0, 0])
        args = dict(tree=tree, seed=seed)
        verify = fs.verify_tree
    staged = verify(target_logits=logits, params=params(rows, "joint"), **args)
    joint = verify(by_hand("joint"), **args)
    for a, b in zip(staged, joint, strict=True):
        assert torch.equal(a, b)
    sequential = verify(by_hand("transformers"), **args)
    assert int((sequential.token_ids != staged.token_ids).any(-1).sum()) >= rows // 20


def law_cases():
    yield LawCase(f"verify_chain cut_order='joint' first token (V={V})",
                  test_cut_order.joint_law("joint"), DRAWS, CLAIM)  # fmt: skip
