"""verify_tree on the Triton backend (interpreted on CPU): the emitted law of both modes on the
toy model with negative controls, identical tokens to the torch path on random host and
per-request trees, malformed trees and bad values as the torch path, and the launch budget (at
most 6 per call in both modes)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import fastsample as fs
from launch_budget import device_work
from stattests import LawCase
from verify_helpers import (
    INF,
    NAN,
    ToyModel,
    Trial,
    assert_laws,
    children_lists,
    laws_rejected,
    tree_trial,
)

V_TREE = 8
TREE_BATCH = 50_000  # as the torch path's tests
IRREGULAR = [-1, 0, 0, 0, 1, 1, 1, 1, 2, 4, 4, 8, 9, 11, 11, 11, 11]  # widths 3,4,1,2,1,4
TOP4_CHAINS = [-1, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]

_MODELS: dict[str, ToyModel] = {}


def model(kind: str) -> ToyModel:
    if kind not in _MODELS:
        _MODELS[kind] = ToyModel(kind, V_TREE)
    return _MODELS[kind]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "triton")


def on(backend: str, fn, *args, **kwargs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTSAMPLE_BACKEND", backend)
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------- exactness


def test_tree_mode_a_law(triton_backend):
    toy = model("mixed")
    trial = tree_trial(toy, TREE_BATCH, IRREGULAR, seed=21, mode="a", children="topk")
    assert_laws(toy, trial, "triton tree a irregular mixed topk")


def test_tree_mode_b_law(triton_backend):
    toy = model("mixed")
    trial = tree_trial(toy, TREE_BATCH, IRREGULAR, seed=31, mode="b", children="sampled")
    assert_laws(toy, trial, "triton tree b irregular mixed")


def test_tree_control_mode_b_on_top_k_children_rejected(triton_backend):
    """Negative control: mode b assumes children drawn without replacement; on the draft's
    top-k children (a realistic misuse, mode a's case) the law is biased and the test sees it."""
    toy = model("mixed")
    trial = tree_trial(toy, TREE_BATCH // 2, TOP4_CHAINS, seed=31, mode="b", children="topk")
    assert any(laws_rejected(toy, trial))


def stale_round(toy, keys, parents, seed):
    """A mode-a round (top-k children) whose nodes get their parent's target row (a caller's
    off-by-one in the tree attention); the root's row is right."""
    batch, n = keys.shape[0], len(parents)
    node_keys = torch.empty(batch, n, dtype=torch.int64)
    node_keys[:, 0] = keys
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    for node, kids in enumerate(children_lists(parents)):
        if kids:
            chosen = toy.draft[node_keys[:, node]].topk(len(kids), -1).indices
            for i, kid in enumerate(kids):
                tokens[:, kid] = chosen[:, i]
                node_keys[:, kid] = toy.child(node_keys[:, node], chosen[:, i])
    stale = node_keys.clone()
    stale[:, 1:] = node_keys[:, torch.tensor(parents[1:])]
    seeds = torch.arange(batch) + seed * 10_000_019
    tree = fs.TokenTree(tokens, parents)
    return fs.verify_tree(toy.target[stale].float(), tree, seed=seeds, step=3)


def test_tree_control_mode_a_stale_target_rows_rejected(triton_backend):
    """Negative control for mode a: the same law test rejects the output of the kernel fed
    each node's parent's target row (the first token stays exact, the second does not)."""
    toy = model("mixed")
    keys = toy.start_keys(TREE_BATCH // 2)
    one = stale_round(toy, keys, IRREGULAR, 21)
    first = one.token_ids[:, 0]
    two = stale_round(toy, toy.child(keys, first), IRREGULAR, 22)
    second = torch.where(one.num_emitted >= 2, one.token_ids[:, 1], two.token_ids[:, 0])
    first_rejected, joint_rejected = laws_rejected(toy, Trial(first, second, one.num_accepted))
    assert joint_rejected and not first_rejected


# ---------------------------------------------------------------------------- same as torch


def random_trees(batch, n, vocab, gen, dtype=torch.float32):
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 2, -1).to(dtype)
    draft = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 2, -1).to(dtype)
    # Distinct siblings (mode b's assumption), many of them likely under the target.
    tokens = torch.stack(
        [torch.randperm(max(vocab, n), generator=gen)[:n] % vocab for _ in range(batch)]
    )
    tokens[::2, 1] = target[::2, 0].float().argmax(-1)
    return target, draft, tokens


# (V, dtype, batch): the interpreter runs a batch in tiles of rows, so rows cost little but
# at V=300 in float64. Rows (two calls per case) and allowed mismatches together detect a law
# 2% off on 10% of the mass (stattests.equality_bias), what the law tests carry.
HOST_TREE_CASES = [(24, torch.float32, 2000), (300, torch.float64, 400), (40, torch.float16, 2000)]
EQUALITY_CHECKS = [(2 * batch, 2 * batch // 1000) for _, _, batch in HOST_TREE_CASES]


@pytest.mark.parametrize("vocab,dtype,batch", HOST_TREE_CASES)
def test_tree_tokens_identical_to_torch_path_host_tree(vocab, dtype, batch):
    gen = torch.Generator().manual_seed(vocab)
    target, draft, tokens = random_trees(batch, len(IRREGULAR), vocab, gen, dtype)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    rows = same_rows = 0
    for q in (None, draft):
        tree = fs.TokenTree(tokens, IRREGULAR)
        ref = on("torch", fs.verify_tree, target, tree, q, seed=seeds, step=4)
        out = on("triton", fs.verify_tree, target, tree, q, seed=seeds, step=4)
        same = (out.token_ids == ref.token_ids).all(1) & (out.valid == ref.valid)
        rows, same_rows = rows + batch, same_rows + int(same.sum())
        assert ref.valid.float().mean() > 0.7  # b: a likely token may repeat a sibling
    assert rows - same_rows <= rows // 1000, f"{rows - same_rows} of {rows} rows differ"


@pytest.mark.parametrize("mode", ["a", "b"])
def test_tree_per_request_trees_malformed_and_bad_rows_as_torch_path(mode):
    """Per-request tensor trees with num_nodes, malformed parents, a root that is not -1, bad
    token ids, NaN/inf/negative probabilities and (mode b) repeated siblings: every output
    equal to the torch path's."""
    gen = torch.Generator().manual_seed(5)
    batch, n, vocab = 64, 9, 20
    target, draft, tokens = random_trees(batch, n, vocab, gen)
    parents = (torch.rand(batch, n, generator=gen) * torch.arange(n)).long()
    parents[:, 0] = -1
    sizes = torch.randint(1, n + 1, (batch,), generator=gen)
    parents[0, 3] = 3  # not listed before itself
    parents[1, 5] = -1  # an orphan
    parents[2, 0] = 0  # the root is not -1
    tokens[3, 2] = vocab  # out of range
    target[4] = NAN
    target[5, :, 2] = INF
    draft[6, 0] = -1.0
    draft[7] = NAN
    target[8] = 0.0
    sizes[9] = 0  # out of range
    sizes[10] = n + 1
    parents[11, 1:4] = 0  # three children of the root with one token: repeated siblings
    tokens[11, 1:4] = 7
    q = draft if mode == "b" else None
    for tree in (fs.TokenTree(tokens, parents, sizes), fs.TokenTree(tokens, parents)):
        seeds = torch.arange(batch)
        ref = on("torch", fs.verify_tree, target, tree, q, seed=seeds, step=1)
        out = on("triton", fs.verify_tree, target, tree, q, seed=seeds, step=1)
        for field in ref._fields:
            assert torch.equal(getattr(out, field), getattr(ref, field)), field
    assert not bool(ref.valid[:3].any()) and bool(ref.valid[12:].any())


def test_tree_generator_path_matches_torch_path():
    gen = torch.Generator().manual_seed(8)
    target, draft, tokens = random_trees(100, len(TOP4_CHAINS), 16, gen)
    tree = fs.TokenTree(tokens, TOP4_CHAINS)
    for q in (None, draft):
        ref = on("torch", fs.verify_tree, target, tree, q, generator=torch.manual_seed(3))
        out = on("triton", fs.verify_tree, target, tree, q, generator=torch.manual_seed(3))
        for field in ref._fields:
            assert torch.equal(getattr(out, field), getattr(ref, field)), field


def test_tree_of_width_one_is_the_chain(triton_backend):
    """A chain-shaped tree in mode b verifies exactly as verify_chain (same streams)."""
    gen = torch.Generator().manual_seed(2)
    batch, k, vocab = 300, 4, 30
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, -1)
    drafts = torch.multinomial(draft.view(-1, vocab), 1, generator=gen).view(batch, k)
    seeds = torch.arange(batch)
    chain = fs.verify_chain(target, drafts, draft, seed=seeds, step=6)
    tree_tokens = torch.cat((torch.zeros(batch, 1, dtype=torch.int64), drafts), 1)
    tree_draft = torch.cat((draft, torch.zeros(batch, 1, vocab)), 1)
    tree = fs.TokenTree(tree_tokens, list(range(-1, k)))
    out = fs.verify_tree(target, tree, tree_draft, seed=seeds, step=6)
    assert torch.equal(out.num_accepted, chain.num_accepted)
    assert torch.equal(out.token_ids[:, : k + 1], chain.token_ids)


# ---------------------------------------------------------------------------- launch budget


@pytest.mark.parametrize("mode", ["a", "b"])
def test_tree_launch_budget(triton_backend, mode):
    gen = torch.Generator().manual_seed(1)
    target, draft, tokens = random_trees(4, len(IRREGULAR), 300, gen)
    q = draft if mode == "b" else None
    seeds, steps = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    tree = fs.TokenTree(tokens, IRREGULAR)
    fs.verify_tree(target, tree, q, seed=seeds, step=steps)  # warm-up: the parents' device copy
    total, ops, launches = device_work(
        lambda: fs.verify_tree(target, tree, q, seed=seeds, step=steps)
    )
    assert launches == 1 and total <= 6, ops
    per_request = fs.TokenTree(tokens, torch.tensor(IRREGULAR).expand(4, -1), 12)
    total, ops, _ = device_work(lambda: fs.verify_tree(target, per_request, q, seed=seeds, step=0))
    assert total <= 6, ops


def test_tree_shapes_used_here():
    assert max(len(kids) for kids in children_lists(IRREGULAR)) == 4


def law_cases():
    """The laws judged here, their sizes and claims: ``stattests.detectable_bias`` rounded up
    (tests/test_power.py checks them)."""
    from test_triton_law import carried

    same = (
        "tests/kernels/test_triton_verify_tree.py::test_tree_tokens_identical_to_torch_path_host"
        "_tree, uniform bits: tests/kernels/test_triton_verify_chain.py::test_acceptance_"
        "recovery_bonus_uniform_bits_identical (the same streams)"
    )
    first, joint = model("mixed").exact_laws()
    for mode in ("a", "b"):
        torch_law = f"tests/verify/test_tree.py::test_tree_law (mode {mode})"
        for which, law in (("first token", first), ("first two tokens", joint)):
            yield LawCase(
                f"tree mode {mode} mixed V={V_TREE}: {which}", law, TREE_BATCH, 0.20,
                carried(EQUALITY_CHECKS, same, torch_law),
            )  # fmt: skip
