"""Tree inputs that used to pass unnoticed (issue 18, item 5): a tensor ``parents`` whose root
entry is not -1, and repeated sibling tokens in mode b (children drawn without replacement
are distinct). Without ``check`` both flag their row only; with ``check=True`` both raise."""

from __future__ import annotations

import pytest
import torch

import fastsample as fs

B, V = 6, 40
PARENTS = [-1, 0, 0, 0, 1, 1, 2]
N = len(PARENTS)


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(B, N, V, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(B, N, V, generator=gen) * 2, -1)
    tokens = torch.rand(B, V, generator=gen).argsort(-1)[:, :N]  # distinct in each row
    return target, draft, tokens


def assert_rows_untouched(out, ref, rows):
    for field in out._fields:
        assert torch.equal(getattr(out, field)[rows], getattr(ref, field)[rows]), field


@pytest.mark.parametrize("mode", ["a", "b"])
def test_tensor_parents_need_a_root_of_minus_one(mode):
    target, draft, tokens = batch(1)
    q = draft if mode == "b" else None
    parents = torch.tensor(PARENTS).repeat(B, 1)
    ref = fs.verify_tree(target, fs.TokenTree(tokens, parents), q, seed=torch.arange(B))
    assert ref.valid.all()
    for root in (0, 3, -2):
        parents[2, 0] = root
        tree = fs.TokenTree(tokens, parents)
        out = fs.verify_tree(target, tree, q, seed=torch.arange(B))
        assert out.valid.tolist() == [row != 2 for row in range(B)]
        assert (out.token_ids[2] == -1).all() and out.num_emitted[2] == 0
        assert_rows_untouched(out, ref, [0, 1, 3, 4, 5])
        with pytest.raises(ValueError, match=r"row 2 tree.parents entry 0 is not -1"):
            fs.verify_tree(target, tree, q, seed=1, check=True)
    shared = torch.tensor([0, *PARENTS[1:]])  # one (N,) tensor for every request
    out = fs.verify_tree(target, fs.TokenTree(tokens, shared), q, seed=1)
    assert not out.valid.any()
    with pytest.raises(ValueError, match=r"row 0 tree.parents entry 0 is not -1"):
        fs.verify_tree(target, fs.TokenTree(tokens, shared), q, seed=1, check=True)
    with pytest.raises(ValueError, match=r"parents\[0\] must be -1"):  # host lists: at once
        fs.verify_tree(target, fs.TokenTree(tokens, [0, *PARENTS[1:]]), q, seed=1)


@pytest.mark.parametrize("tensor_parents", [False, True])
def test_repeated_siblings_flag_their_row_in_mode_b(tensor_parents):
    target, draft, tokens = batch(2)
    parents = torch.tensor(PARENTS).repeat(B, 1) if tensor_parents else PARENTS
    seeds = torch.arange(B) + 11
    ref = fs.verify_tree(target, fs.TokenTree(tokens, parents), draft, seed=seeds)
    assert ref.valid.all()
    tokens = tokens.clone()
    tokens[1, 3] = tokens[1, 1]  # children 1 and 3 of the root
    tokens[4, 5] = tokens[4, 4]  # children 4 and 5 of node 1
    tokens[3, 6] = tokens[3, 4]  # cousins (parents 2 and 1): allowed
    tokens[5, 6] = tokens[5, 2]  # a child and its parent: allowed
    sizes = torch.full((B,), N)
    tokens[0, 6] = tokens[0, 2]
    tokens[0, 5] = tokens[0, 4]
    sizes[0] = 5  # the repeats are in nodes beyond num_nodes: padding, never judged
    tree = fs.TokenTree(tokens, parents, sizes)
    out = fs.verify_tree(target, tree, draft, seed=seeds)
    assert out.valid.tolist() == [True, False, True, True, False, True]
    assert (out.token_ids[[1, 4]] == -1).all() and (out.num_emitted[[1, 4]] == 0).all()
    assert_rows_untouched(out, ref, [2])
    with pytest.raises(ValueError, match="row 1 tree node 3 repeats a sibling's token"):
        fs.verify_tree(target, tree, draft, seed=1, check=True)
    # Mode a tests repeated tokens exactly (a rejected token has no mass left): valid.
    assert fs.verify_tree(target, tree, seed=seeds).valid.all()
    fs.verify_tree(target, tree, seed=1, check=True)


def chain_and_tree():
    """``(run, rank hint, draft shape)`` for verify_chain on (B=2, K=2, V=5) and verify_tree
    on (B=2, N=3, V=5); ``run`` takes draft_probs."""
    p, x = torch.full((2, 3, 5), 0.2), torch.zeros(2, 2, dtype=torch.int64)
    tree = fs.TokenTree(torch.zeros(2, 3, dtype=torch.int64), [-1, 0, 1])
    return [
        (lambda q: fs.verify_chain(p, x, q, seed=1), "(batch, K, vocab)", (2, 2, 5)),
        (lambda q: fs.verify_tree(p, tree, q, seed=1), "(batch, nodes, vocab)", (2, 3, 5)),
    ]


@pytest.mark.parametrize(
    "draft,error,words",
    [
        (lambda s: torch.full((2, s[1] - 1, 5), 0.2), ValueError, "= {s} to match target_probs"),
        (lambda s: torch.full((2, 5), 0.2), ValueError, "shape {hint}, got 2 dimensions (2, 5)"),
        (lambda s: torch.ones(s, dtype=torch.int64), TypeError, "must be float16, bfloat16"),
        (lambda s: [[0.2] * 5], TypeError, "must be a torch.Tensor of shape {hint}"),
        (lambda s: torch.full(s, 0.2, device="meta"), ValueError, "is on meta but target_probs"),
    ],
    ids=["positions", "rank", "dtype", "type", "device"],
)
def test_draft_probs_errors_name_the_argument_in_both_verifiers(draft, error, words):
    """One check (verify.checks.check_draft_probs) serves both verifiers: the same messages,
    naming the argument, with each verifier's shape."""
    for run, hint, shape in chain_and_tree():
        with pytest.raises(error) as info:
            run(draft(shape))
        assert str(info.value).startswith("draft_probs ")
        assert words.format(hint=hint, s=shape) in str(info.value)
