"""verify_tree: exactness of both modes on the toy model (with negative controls), output
structure, batch invariance with per-request trees, malformed trees and bad values, graph
safety, and the cached walk tables of host trees."""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
from fastsample.verify import acceptance
from fastsample.verify import tree as tree_mod
from stattests import LawCase
from verify_helpers import (
    CHAIN_DRAWS,
    INF,
    LAW_KIND,
    NAN,
    P3,
    Q2,
    V_CHAIN,
    X2,
    assert_drawn_laws,
    capture,
    children_lists,
    drawn_laws_rejected,
    law_draws,
    law_model_laws,
    tree_rounds,
)

# ---------------------------------------------------------------------------- tree exactness

# Irregular: widths 3, 4, 1, 2, 1, 1, 4 at different depths, depth 4 (structure, bad values and
# graph tests).
IRREGULAR = [-1, 0, 0, 0, 1, 1, 1, 1, 2, 4, 4, 8, 9, 11, 11, 11, 11]


def tree_depth(parents):
    depth = [0] * len(parents)
    for node in range(1, len(parents)):
        depth[node] = depth[parents[node]] + 1
    return max(depth)


# Full power (issue 18): CHAIN_DRAWS requests, on the chain tests' model and laws (24 and
# 144 cells: see verify_helpers), detect a 2% bias on 10% of the mass with probability 0.99
# at p < 1e-6. One full-power test per mode, on LAW_TREE: a second sibling tested after a
# rejection, the final draw with both siblings removed, an accepted path of depth 2 and the
# bonus token below it, at 4 nodes and 2 walk steps per request (IRREGULAR: 17 and 8; a
# third sibling costs a third walk step, over the time budget of issue 18 with the controls).
# Uniforms from a generator (the seeded streams are the chain's, shared: randomness.uniforms,
# checked bitwise in test_verify_randomness, law at full power in test_chain). The negative
# controls run at the same size.
LAW_TREE = [-1, 0, 0, 1]  # root: 2 children; node 1: 1 child
TREE_DRAWS = CHAIN_DRAWS
TREE_CLAIM = 0.02
MODES = {"a": "topk", "b": "sampled"}  # mode a on the draft's top-k children, b on drawn ones


def law_cases():
    """The laws this module judges, with their sizes (tests/test_power.py checks them)."""

    def first():
        return law_model_laws()[0]

    def joint():
        return law_model_laws()[1]

    for mode in MODES:
        yield LawCase(f"tree mode {mode}: first token", first, TREE_DRAWS, TREE_CLAIM)
        yield LawCase(f"tree mode {mode}: first two tokens", joint, TREE_DRAWS, TREE_CLAIM)


def law_tree_rounds(model, mode, seed):
    return tree_rounds(model, LAW_TREE, seed, mode=mode, children=MODES[mode], seeded=False)


def test_tree_shapes():
    assert children_lists(LAW_TREE) == [[1, 2], [3], [], []]
    widths = [len(kids) for kids in children_lists(IRREGULAR)]
    assert [w for w in widths if w] == [3, 4, 1, 2, 1, 1, 4] and tree_depth(IRREGULAR) == 4


@pytest.mark.parametrize("mode", MODES)
def test_tree_law(models, mode):
    model = models(LAW_KIND)
    draws = law_draws(model, TREE_DRAWS, law_tree_rounds(model, mode, seed=21))
    assert_drawn_laws(model, draws, f"tree mode {mode}")


def rejected_in_mode(models, mode):
    """Whether the law test of test_tree_law, at its size, rejects the (patched) verifier."""
    model = models(LAW_KIND)
    return drawn_laws_rejected(model, TREE_DRAWS, law_tree_rounds(model, mode, seed=22))


def test_tree_control_mode_a_final_draw_keeps_rejected_siblings(models, monkeypatch):
    real = tree_mod.draw_target_without

    def keeps(target, rows, removed, mask, uniform):
        return real(target, rows, removed, torch.zeros_like(mask), uniform)

    monkeypatch.setattr(tree_mod, "draw_target_without", keeps)
    assert rejected_in_mode(models, "a")


def test_tree_control_mode_a_siblings_not_renormalized(models, monkeypatch):
    """Accepting a later sibling with p(t) instead of p(t) / (1 - rejected mass)."""
    real = acceptance.accept_drafts
    monkeypatch.setattr(tree_mod, "accept_sibling", lambda u, left, p: real(u, p, None))
    assert rejected_in_mode(models, "a")


def test_tree_control_mode_b_residual_not_renormalized(models, monkeypatch):
    """After a rejection, testing the next sibling against max(p - q, 0) without dividing by
    its mass."""
    real = tree_mod.accept_child

    def unnormalized(u, w_t, q_t, mass, draft_mass):
        return real(u, w_t, q_t, torch.ones_like(mass), draft_mass)

    monkeypatch.setattr(tree_mod, "accept_child", unnormalized)
    assert rejected_in_mode(models, "b")


def test_tree_control_mode_b_draft_not_renormalized(models, monkeypatch):
    """Keeping q as it was after a rejection (the rule for children drawn with replacement)
    on children drawn without replacement."""
    accept, update = tree_mod.accept_child, tree_mod.next_coefficient
    monkeypatch.setattr(
        tree_mod, "accept_child", lambda u, w, q, m, d: accept(u, w, q, m, torch.ones_like(d))
    )
    monkeypatch.setattr(
        tree_mod, "next_coefficient", lambda c, m, d: update(c, m, torch.ones_like(d))
    )
    assert rejected_in_mode(models, "b")


def distinct_tokens(batch, n, vocab, gen):
    """``(batch, n)`` tokens, distinct within each row (so siblings never repeat one)."""
    return torch.rand(batch, vocab, generator=gen).argsort(-1)[:, :n]


def chain_as_tree(target, tokens, draft):
    batch, k = tokens.shape
    parents = list(range(-1, k))
    tree_tokens = torch.cat((torch.zeros(batch, 1, dtype=torch.int64), tokens), 1)
    tree_draft = None
    if draft is not None:
        tree_draft = torch.cat((draft, torch.full_like(draft[:, :1], 1 / draft.shape[2])), 1)
    return fs.TokenTree(tree_tokens, parents), tree_draft


@pytest.mark.parametrize("with_probs", [True, False])
def test_tree_of_width_one_is_the_chain(models, with_probs):
    """Mode b on a chain is verify_chain; mode a on a chain is verify_chain without probs
    (same acceptance counters, so the same decisions and tokens)."""
    model = models("mixed")
    gen = torch.Generator().manual_seed(3)
    batch, k = 5000, 4
    keys = model.start_keys(batch)
    target = torch.empty(batch, k + 1, V_CHAIN, dtype=torch.float64)
    draft = torch.empty(batch, k, V_CHAIN, dtype=torch.float64)
    tokens = torch.empty(batch, k, dtype=torch.int64)
    for i in range(k):
        target[:, i], draft[:, i] = model.target[keys], model.draft[keys]
        tokens[:, i] = torch.multinomial(draft[:, i], 1, generator=gen)[:, 0]
        keys = model.child(keys, tokens[:, i])
    target[:, k] = model.target[keys]
    q = draft if with_probs else None
    seeds = torch.arange(batch)
    chain = fs.verify_chain(target, tokens, q, seed=seeds, step=5)
    tree, tree_q = chain_as_tree(target, tokens, q)
    out = fs.verify_tree(target, tree, tree_q, seed=seeds, step=5)
    assert torch.equal(out.num_accepted, chain.num_accepted)
    assert torch.equal(out.token_ids, chain.token_ids)
    depth = torch.arange(k + 1)
    want_nodes = torch.where(depth < chain.num_accepted[:, None], depth + 1, -1)
    assert torch.equal(out.accepted_nodes, want_nodes)


# ---------------------------------------------------------------------------- structure of outputs


def test_tree_output_structure():
    gen = torch.Generator().manual_seed(0)
    parents = IRREGULAR
    batch, n, vocab = 500, len(parents), 20
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen), -1)
    tokens = distinct_tokens(batch, n, vocab, gen)  # mode b needs distinct siblings
    for draft in (None, torch.softmax(torch.randn(batch, n, vocab, generator=gen), -1)):
        out = fs.verify_tree(target, fs.TokenTree(tokens, parents), draft, seed=torch.arange(batch))
        assert bool(out.valid.all())
        assert torch.equal(out.num_emitted, out.num_accepted + 1)
        for b in range(0, batch, 7):
            nodes = out.accepted_nodes[b, : out.num_accepted[b]].tolist()
            assert (out.accepted_nodes[b, out.num_accepted[b] :] == -1).all()
            previous = 0
            for node in nodes:  # a path from the root
                assert parents[node] == previous
                previous = node
            assert out.token_ids[b, : len(nodes)].tolist() == tokens[b, nodes].tolist()
            assert 0 <= out.token_ids[b, len(nodes)] < vocab
            assert (out.token_ids[b, len(nodes) + 1 :] == -1).all()


@pytest.mark.parametrize("mode", ["a", "b"])
def test_tree_batch_invariance_with_per_request_trees(mode):
    gen = torch.Generator().manual_seed(6)
    batch, n, vocab = 97, 9, 20
    # Random per-request trees: parent of node n drawn from [0, n).
    parents = (torch.rand(batch, n, generator=gen) * torch.arange(n)).long()
    parents[:, 0] = -1
    sizes = torch.randint(1, n + 1, (batch,), generator=gen)
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 2, -1)
    tokens = distinct_tokens(batch, n, vocab, gen)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)

    def run(rows):
        tree = fs.TokenTree(tokens[rows], parents[rows], sizes[rows])
        q = draft[rows] if mode == "b" else None
        return fs.verify_tree(target[rows], tree, q, seed=seeds[rows], step=2)

    full = run(torch.arange(batch))
    assert bool(full.valid.all())
    order = torch.randperm(batch, generator=gen)
    shuffled = run(order)
    for field in full._fields:
        assert torch.equal(getattr(shuffled, field), getattr(full, field)[order])
    for row in (0, 50, 96):
        alone = run(torch.tensor([row]))
        for field in full._fields:
            assert torch.equal(getattr(alone, field), getattr(full, field)[row : row + 1])
    # The same trees given as shared host data give the same result row by row.
    host = fs.verify_tree(
        target[:1],
        fs.TokenTree(tokens[:1], parents[0].tolist(), sizes[:1]),
        draft[:1] if mode == "b" else None,
        seed=seeds[:1],
        step=2,
    )
    for field in full._fields:
        assert torch.equal(getattr(host, field), getattr(full, field)[:1])


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "parents,error,words",
    [
        ([-1, 0, 2], ValueError, "node 2 has parent 2, which is not listed before it"),
        ([-1, 2, 1], ValueError, "node 1 has parent 2, which is not listed before it"),
        ([-1, 0, -1], ValueError, "node 2 has parent -1"),
        ([-1, 0, 7], ValueError, "node 2 has parent 7"),
        ([0, 0, 1], ValueError, "parents[0] must be -1"),
        ([-1, 0], ValueError, "tree.parents has 2 entries but target_probs has 3 nodes"),
        ([-1, 0, 1.0], TypeError, "tree.parents must hold ints"),
        (torch.tensor([-1, 0, 1.0]), TypeError, "tree.parents must be int64"),
        (torch.tensor([[-1, 0, 1]] * 3), ValueError, "tree.parents must have shape (3,) or (2, 3)"),
        ("010", TypeError, "tree.parents must be a list of ints or an int64 tensor"),
    ],
)
def test_malformed_host_trees_raise(parents, error, words):
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(error) as info:
        fs.verify_tree(P3, fs.TokenTree(tokens, parents), seed=1)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "tree,draft,kwargs,error,words",
    [
        ((X2, [-1, 0, 1]), None, {}, ValueError, "tree.token_ids must have shape (2, 3)"),
        ((X2.float(), [-1, 0]), None, {}, TypeError, "tree.token_ids must be int64"),
        ((None, [-1, 0, 1], 0), None, {}, ValueError, "tree.num_nodes must be between 1 and 3"),
        ((None, [-1, 0, 1]), Q2, {}, ValueError, "shape (batch, nodes, vocab) = (2, 3, 5)"),
        ((None, [-1, 0, 1]), None, {"seed": 1.5}, TypeError, "seed must be an int"),
    ],
)
def test_tree_argument_errors(tree, draft, kwargs, error, words):
    tokens = torch.zeros(2, 3, dtype=torch.int64) if tree[0] is None else tree[0]
    with pytest.raises(error) as info:
        fs.verify_tree(P3, fs.TokenTree(tokens, *tree[1:]), draft, **kwargs)
    assert words in str(info.value)
    with pytest.raises(TypeError, match=r"tree must be a fastsample\.TokenTree"):
        fs.verify_tree(P3, (tokens, [-1, 0, 1]))


def test_malformed_tensor_trees_are_flagged_or_raise_with_check():
    gen = torch.Generator().manual_seed(1)
    batch, n, vocab = 6, 5, 11
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen), -1)
    draft = torch.softmax(torch.randn(batch, n, vocab, generator=gen), -1)
    tokens = distinct_tokens(batch, n, vocab, gen)
    parents = torch.tensor([-1, 0, 0, 1, 2]).repeat(batch, 1)
    parents[1, 3] = 3  # itself: a cycle
    parents[2, 2] = 4  # a parent listed after its child
    parents[3, 4] = -1  # an orphan
    tokens[4, 2] = vocab  # a token out of range
    sizes = torch.tensor([5, 5, 5, 5, 5, 9])  # row 5: num_nodes out of range
    tree = fs.TokenTree(tokens, parents, sizes)
    seeds = torch.arange(batch)
    for q in (None, draft):
        out = fs.verify_tree(target, tree, q, seed=seeds)
        assert out.valid.tolist() == [True] + [False] * 5
        assert bool((out.token_ids[1:] == -1).all())
        clean = fs.verify_tree(
            target[:1],
            fs.TokenTree(tokens[:1], parents[:1]),
            None if q is None else q[:1],
            seed=seeds[:1],
        )
        for field in out._fields:
            assert torch.equal(getattr(out, field)[:1], getattr(clean, field))
    messages = [
        (1, "row 1 tree node 3 has a parent outside [0, node)"),
        (2, "row 2 tree node 2 has a parent outside [0, node)"),
        (3, "row 3 tree node 4 has a parent outside [0, node)"),
        (4, "row 4 tree node 2 has a token id outside [0, 11)"),
        (5, "row 5 num_nodes 0 is outside [1, 5]"),
    ]
    for row, words in messages:
        rows = torch.tensor([0, row])
        sub = fs.TokenTree(tokens[rows], parents[rows], sizes[rows])
        with pytest.raises(ValueError) as info:
            fs.verify_tree(target[rows], sub, seed=1, check=True)
        assert words.replace(f"row {row}", "row 1") in str(info.value)


def test_tree_check_true_on_values_and_duplicate_siblings():
    gen = torch.Generator().manual_seed(2)
    target = torch.softmax(torch.randn(2, 4, 9, generator=gen), -1)
    draft = torch.softmax(torch.randn(2, 4, 9, generator=gen), -1)
    tokens = torch.tensor([[0, 1, 2, 3], [0, 4, 4, 5]])
    tree = fs.TokenTree(tokens, [-1, 0, 0, 1])
    fs.verify_tree(target, tree, check=True)  # duplicates are fine in mode a
    with pytest.raises(ValueError, match="row 1 tree node 2 repeats a sibling's token"):
        fs.verify_tree(target, tree, draft, check=True)
    draft[0, 1, 3] = NAN  # node 1 has a child: its draft row is used
    with pytest.raises(ValueError, match="row 0 draft_probs node 1 contains NaN"):
        fs.verify_tree(target[:1], fs.TokenTree(tokens[:1], [-1, 0, 0, 1]), draft[:1], check=True)
    draft[0, 3] = NAN  # node 3 is a leaf: its draft row is never read
    draft[0, 1, 3] = 0.1
    fs.verify_tree(target[:1], fs.TokenTree(tokens[:1], [-1, 0, 0, 1]), draft[:1], check=True)
    target[1, 2, 0] = -INF
    with pytest.raises(ValueError, match="row 1 target_probs node 2 contains"):
        fs.verify_tree(target, tree, check=True)


def test_tree_bad_values_flag_only_their_row():
    gen = torch.Generator().manual_seed(3)
    parents = IRREGULAR
    batch, n, vocab = 40, len(parents), 30
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 3, -1)
    draft = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 3, -1)
    # Likely tokens, so walks go deep: each node's draft mode, made distinct among siblings
    # (mode b flags repeated siblings).
    draft = draft.scatter(2, distinct_tokens(batch, n, vocab, gen)[:, :, None], 1.0)
    tokens = draft.argmax(-1)
    seeds = torch.arange(batch)
    for q in (None, draft):
        clean = fs.verify_tree(target, fs.TokenTree(tokens, parents), q, seed=seeds)
        bad_target = target.clone()
        bad_target[5] = NAN
        bad_target[9, :, 3] = -1.0
        out = fs.verify_tree(bad_target, fs.TokenTree(tokens, parents), q, seed=seeds)
        assert out.valid.tolist() == [row not in (5, 9) for row in range(batch)]
        keep = torch.tensor([row not in (5, 9) for row in range(batch)])
        for field in out._fields:
            assert torch.equal(getattr(out, field)[keep], getattr(clean, field)[keep])


# ---------------------------------------------------------------------------- graph safety


@pytest.mark.parametrize(
    "mode,shared", [("a", True), ("b", False)], ids=["a-host-parents", "b-tensor-parents"]
)
def test_tree_fullgraph_matches_eager(eager_equivalent_random, mode, shared):
    gen = torch.Generator().manual_seed(14)
    parents = [-1, 0, 0, 1, 1, 2]
    batch, n, vocab = 5, len(parents), 300
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 3, -1)
    draft = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 3, -1)
    draft = draft.scatter(2, distinct_tokens(batch, n, vocab, gen)[:, :, None], 1.0)
    tokens = draft.argmax(-1)  # distinct among siblings: every row valid in mode b
    tree_parents = parents if shared else torch.tensor(parents).repeat(batch, 1)
    sizes = torch.tensor([6, 6, 3, 1, 5])
    q = draft if mode == "b" else None

    def run(p, tok, d, sz, s):
        return fs.verify_tree(p, fs.TokenTree(tok, tree_parents, sz), d, seed=s, step=1)

    # aot_eager, as for the seeded chain.
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    seeds = torch.arange(batch)
    got, want = compiled(target, tokens, q, sizes, seeds), run(target, tokens, q, sizes, seeds)
    for field in want._fields:
        assert torch.equal(getattr(got, field), getattr(want, field))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["a", "b"])
def test_tree_cuda_graph_capture(mode):
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    parents = IRREGULAR
    batch, n, vocab = 64, len(parents), 32000
    target = torch.softmax(torch.randn(batch, n, vocab, device=cuda, generator=gen) * 3, -1)
    draft = torch.softmax(torch.randn(batch, n, vocab, device=cuda, generator=gen) * 3, -1)
    distinct = distinct_tokens(batch, n, vocab, torch.Generator().manual_seed(0)).to(cuda)
    draft = draft.scatter(2, distinct[:, :, None], 1.0)  # distinct siblings: valid in mode b
    tree = fs.TokenTree(draft.argmax(-1), torch.tensor(parents, device=cuda))
    target[3, 0] = NAN
    seeds = torch.arange(batch, device=cuda)
    step = torch.zeros(batch, dtype=torch.int64, device=cuda)
    q = draft if mode == "b" else None

    def decode():
        out = fs.verify_tree(target, tree, q, seed=seeds, step=step)
        fs.advance_step(step)
        return out

    graph, out = capture(decode)
    step.zero_()
    for replay in range(3):
        graph.replay()
        eager = fs.verify_tree(target, tree, q, seed=seeds, step=replay)
        for field in eager._fields:
            assert torch.equal(getattr(out, field), getattr(eager, field))
    assert out.valid.tolist() == [row != 3 for row in range(batch)]


def test_host_tree_tables_are_made_once_per_device():
    """Shared host trees become device tables on the first call only (for a CUDA graph, the
    warm-up before capture), so captured calls do no host-to-device copy."""
    parents = [-1, 0, 0, 2, 2, 2]
    device = torch.device("cpu")
    first = tree_mod._host_structure(parents, device)
    again = tree_mod._host_structure(list(parents), device)
    assert first.first_child is again.first_child and first.next_sibling is again.next_sibling
    assert first.first_child.tolist() == [[1, 6, 3, 6, 6, 6]]
    assert first.next_sibling.tolist() == [[6, 2, 6, 4, 5, 6]]
    assert (first.steps, first.width) == (5, 3)  # root: 2 children; node 2 (rank 2): 3 more
