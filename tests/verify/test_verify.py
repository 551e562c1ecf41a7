"""Speculative-decoding verification: exactness, bad input, batch invariance, graph safety.

Exactness is tested end to end on a toy language model (:class:`ToyModel`: the next-token
distributions of a target and a draft model are rows of two tables, picked by a hash of the
prefix). Drafts are drawn from the draft model, verified, and the *emitted* tokens are
compared with the target model's exact float64 law: the first emitted token, and the first
two (when a round emits only one token, a second round from the new context supplies the
second, as a decoding loop would). Many independent requests run as rows of one batch with
per-row seeds, so one call gives many samples. Every family has a negative control: the same
test code, run on a verifier with one small realistic bug, rejects it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._inductor.config

import fastsample as fs
import fastsample.ops.seeds
from fastsample import verify as verify_mod
from fastsample.verify import draw as _verify_draw
from stattests import ALPHA, _normal_isf, assert_law, law_rejected

NAN, INF = float("nan"), float("inf")
TABLE_ROWS = 4099  # prime: the toy model's prefix hash is taken modulo it
GROUPS = 4  # requests start from this many contexts (equal shares of the batch)
KINDS = ["random", "draft_extra", "target_extra", "identical", "disjoint", "mixed"]


# ---------------------------------------------------------------------------- the toy model


def _zero_some(weights: torch.Tensor, count: int, gen: torch.Generator, offset: int = 0):
    """Zero ``count`` random entries per row (a different random set per row)."""
    order = torch.rand(weights.shape, generator=gen, dtype=torch.float64).argsort(-1)
    return weights.scatter(1, order[:, offset : offset + count], 0.0)


def _tables(kind: str, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (TABLE_ROWS, vocab)
    w1 = torch.rand(shape, generator=gen, dtype=torch.float64) ** 2 + 0.02
    w2 = torch.rand(shape, generator=gen, dtype=torch.float64) ** 2 + 0.02
    if kind == "random":
        target, draft = w1, w2
    elif kind == "draft_extra":  # the draft has mass where the target has none
        target, draft = _zero_some(w1, vocab // 3, gen), w2
    elif kind == "target_extra":  # the target has mass where the draft has none
        target, draft = w1, _zero_some(w2, vocab // 4, gen)
    elif kind == "identical":
        target, draft = w1, w1.clone()
    elif kind == "disjoint":
        order = torch.rand(shape, generator=gen).argsort(-1)
        half = vocab // 2
        target = w1.scatter(1, order[:, :half], 0.0)
        draft = w2.scatter(1, order[:, half:], 0.0)
    elif kind == "mixed":  # every table row of its own kind
        parts = [_tables(k, vocab, gen) for k in KINDS[:-1]]
        pick = torch.randint(len(parts), (TABLE_ROWS,), generator=gen)
        target = torch.stack([t for t, _ in parts])[pick, torch.arange(TABLE_ROWS)]
        draft = torch.stack([d for _, d in parts])[pick, torch.arange(TABLE_ROWS)]
    else:
        raise ValueError(kind)
    return target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)


class ToyModel:
    """Target and draft next-token distributions: table rows chosen by a hash of the prefix."""

    def __init__(self, kind: str, vocab: int, seed: int = 0):
        self.kind, self.vocab = kind, vocab
        self.target, self.draft = _tables(kind, vocab, torch.Generator().manual_seed(seed))
        self.starts = torch.arange(GROUPS, dtype=torch.int64) * 977 + 13  # start contexts

    @staticmethod
    def child(key: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return (key * 1_000_003 + token + 1) % TABLE_ROWS

    def start_keys(self, batch: int) -> torch.Tensor:
        return self.starts[torch.arange(batch) % GROUPS]

    def exact_laws(self) -> tuple[np.ndarray, np.ndarray]:
        """Exact law of (start group, first token) and (group, first, second token)."""
        t = self.target.numpy()
        first = np.stack([t[s] for s in self.starts.tolist()]) / GROUPS  # (G, V)
        second = np.stack(
            [
                t[self.child(torch.full((self.vocab,), s), torch.arange(self.vocab)).numpy()]
                for s in self.starts.tolist()
            ]
        )  # (G, V, V): law of the second token given the first
        return first.ravel(), (first[:, :, None] * second).ravel()

    def expected_accepted(self, draft_count: int) -> float:
        """Mean accepted drafts of a K-draft chain: sum over k of P(first k accepted), where
        accepting a prefix has probability prod_i min(p_i(x_i), q_i(x_i)) summed over paths."""
        t, d = self.target.numpy(), self.draft.numpy()

        def expect(key: int, depth: int) -> float:
            if depth == 0:
                return 0.0
            both = np.minimum(t[key], d[key])
            nexts = (key * 1_000_003 + np.arange(self.vocab) + 1) % TABLE_ROWS
            return float(
                sum(
                    both[x] * (1 + expect(int(nexts[x]), depth - 1))
                    for x in range(self.vocab)
                    if both[x] > 0
                )
            )

        return float(np.mean([expect(s, draft_count) for s in self.starts.tolist()]))


# ---------------------------------------------------------------------------- trials


class Trial(NamedTuple):
    first: torch.Tensor  # (B,) first emitted token
    second: torch.Tensor  # (B,) second emitted token (from a second round if needed)
    num_accepted: torch.Tensor  # (B,) first round's accepted count


def chain_round(model, keys, draft_count, seed, *, probs=True, greedy=False, lengths=None):
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = keys.shape[0], model.vocab
    target = torch.empty(batch, draft_count + 1, vocab, dtype=torch.float64)
    draft = torch.empty(batch, draft_count, vocab, dtype=torch.float64)
    tokens = torch.empty(batch, draft_count, dtype=torch.int64)
    key = keys
    for i in range(draft_count):
        target[:, i], draft[:, i] = model.target[key], model.draft[key]
        if greedy:
            tokens[:, i] = draft[:, i].argmax(-1)
        else:
            tokens[:, i] = torch.multinomial(draft[:, i], 1, generator=gen)[:, 0]
        key = model.child(key, tokens[:, i])
    target[:, draft_count] = model.target[key]
    return fs.verify_chain(
        target,
        tokens,
        draft if probs else None,
        draft_lengths=lengths,
        seed=torch.arange(batch) + seed * 10_000_019,
        step=7,
    )


def chain_trial(model, batch, draft_count=4, seed=0, **kwargs) -> Trial:
    keys = model.start_keys(batch)
    one = chain_round(model, keys, draft_count, seed, **kwargs)
    assert bool(one.valid.all())
    first = one.token_ids[:, 0]
    two = chain_round(model, model.child(keys, first), draft_count, seed + 1, **kwargs)
    second = torch.where(one.num_emitted >= 2, one.token_ids[:, 1], two.token_ids[:, 0])
    return Trial(first, second, one.num_accepted)


def children_lists(parents):
    kids = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        kids[parent].append(node)
    return kids


def tree_round(model, keys, parents, seed, *, mode, children):
    """Build a token tree per request from the draft model and verify it.

    ``children="sampled"``: each node's children are drawn without replacement from the
    draft at that node; ``"topk"``: they are the draft's top tokens (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    batch, n = keys.shape[0], len(parents)
    node_keys = torch.empty(batch, n, dtype=torch.int64)
    node_keys[:, 0] = keys
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    for node, kids in enumerate(children_lists(parents)):
        if not kids:
            continue
        dist = model.draft[node_keys[:, node]]
        if children == "topk":
            chosen = dist.topk(len(kids), -1).indices
        else:
            chosen = torch.multinomial(dist, len(kids), replacement=False, generator=gen)
        for i, kid in enumerate(kids):
            tokens[:, kid] = chosen[:, i]
            node_keys[:, kid] = model.child(node_keys[:, node], chosen[:, i])
    target = model.target[node_keys].float()
    draft = model.draft[node_keys].float() if mode == "b" else None
    seeds = torch.arange(batch) + seed * 10_000_019
    return fs.verify_tree(target, fs.TokenTree(tokens, parents), draft, seed=seeds, step=3)


def tree_trial(model, batch, parents, seed=0, *, mode, children) -> Trial:
    keys = model.start_keys(batch)
    one = tree_round(model, keys, parents, seed, mode=mode, children=children)
    assert bool(one.valid.all())
    first = one.token_ids[:, 0]
    two = tree_round(
        model, model.child(keys, first), parents, seed + 1, mode=mode, children=children
    )
    second = torch.where(one.num_emitted >= 2, one.token_ids[:, 1], two.token_ids[:, 0])
    return Trial(first, second, one.num_accepted)


def law_counts(model, trial):
    vocab = model.vocab
    group = torch.arange(trial.first.shape[0]) % GROUPS
    first = group * vocab + trial.first
    joint = first * vocab + trial.second
    c1 = torch.bincount(first, minlength=GROUPS * vocab).numpy()
    c2 = torch.bincount(joint, minlength=GROUPS * vocab * vocab).numpy()
    p1, p2 = model.exact_laws()
    return (c1, p1), (c2, p2)


def assert_laws(model, trial, what):
    (c1, p1), (c2, p2) = law_counts(model, trial)
    assert_law(c1, p1, what=f"{what}: first token")
    assert_law(c2, p2, what=f"{what}: first two tokens")


def laws_rejected(model, trial) -> tuple[bool, bool]:
    (c1, p1), (c2, p2) = law_counts(model, trial)
    return law_rejected(c1, p1), law_rejected(c2, p2)


CHAIN_BATCH = 200_000
V_CHAIN = 6


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(kind, vocab=V_CHAIN, seed=0):
        if (kind, vocab, seed) not in cache:
            cache[kind, vocab, seed] = ToyModel(kind, vocab, seed)
        return cache[kind, vocab, seed]

    return get


# ---------------------------------------------------------------------------- chain exactness


@pytest.mark.parametrize("kind", KINDS)
def test_chain_law_of_first_and_first_two_tokens(models, kind):
    model = models(kind)
    assert_laws(model, chain_trial(model, CHAIN_BATCH, seed=1), f"chain {kind}")


@pytest.mark.parametrize(
    "options", [{"probs": False}, {"probs": False, "greedy": True}], ids=["point", "greedy"]
)
def test_chain_without_draft_probs_law(models, options):
    """Drafts without probabilities are point masses: exact for sampled and greedy drafts."""
    model = models("mixed")
    assert_laws(model, chain_trial(model, CHAIN_BATCH, seed=2, **options), f"chain {options}")


def test_chain_law_with_ragged_draft_lengths(models):
    model = models("random")
    lengths = torch.randint(0, 5, (CHAIN_BATCH,), generator=torch.Generator().manual_seed(5))
    trial = chain_trial(model, CHAIN_BATCH, seed=3, lengths=lengths)
    assert bool((trial.num_accepted <= lengths).all())
    assert_laws(model, trial, "chain with draft_lengths")


def mean_accepted_rejected(model, num_accepted, draft_count) -> tuple[bool, float]:
    """Two-sided z-test of the mean accepted count against theory, at false alarm ALPHA."""
    expected = model.expected_accepted(draft_count)
    values = num_accepted.double()
    z = (values.mean().item() - expected) / (values.std().item() / math.sqrt(len(values)))
    return abs(z) > _normal_isf(ALPHA / 2), z


@pytest.mark.parametrize("kind", ["random", "mixed"])
def test_chain_mean_accepted_matches_theory(models, kind):
    model = models(kind)
    out = chain_round(model, model.start_keys(CHAIN_BATCH), 4, seed=11)
    rejected, z = mean_accepted_rejected(model, out.num_accepted, 4)
    assert not rejected, f"mean accepted off by {z:.1f} standard errors"


# ------------------------------------------------------------------ chain negative controls


def quantize_acceptance_uniforms(monkeypatch, bits=12):
    """Acceptance uniforms on a 2^-bits grid, so u == 0 happens (about every 4096th draw)."""
    real = verify_mod._uniforms

    def coarse(source, batch, num_accept):
        accept, recovery, bonus = real(source, batch, num_accept)
        return torch.floor(accept * 2**bits) / 2**bits, recovery, bonus

    monkeypatch.setattr(verify_mod, "_uniforms", coarse)


def test_chain_control_acceptance_with_less_or_equal(models, monkeypatch):
    """``u * q <= p`` accepts a zero-probability draft when u == 0: the law test sees it.
    With the same coarse uniforms the strict verifier still passes."""
    model = models("draft_extra")
    quantize_acceptance_uniforms(monkeypatch)
    assert_laws(model, chain_trial(model, CHAIN_BATCH, seed=4), "strict, coarse uniforms")
    monkeypatch.setattr(
        verify_mod, "accept_drafts", lambda u, p, q: (u if q is None else u * q) <= p
    )
    first, joint = laws_rejected(model, chain_trial(model, CHAIN_BATCH, seed=4))
    assert first and joint


def test_chain_control_residual_not_renormalized(models, monkeypatch):
    """An inverse CDF over the residual without dividing by its mass (``u`` against the raw
    prefix, overflow clamped to the last token) is caught."""
    real = _verify_draw.pick

    def unnormalized(sums, uniform, vocab, values_of):
        total = sums.sum(-1, keepdim=True)
        return real(sums, uniform.clamp(max=1.0) / total.clamp(min=1e-300), vocab, values_of)

    model = models("random")
    monkeypatch.setattr(_verify_draw, "pick", unnormalized)
    first, joint = laws_rejected(model, chain_trial(model, CHAIN_BATCH, seed=5))
    assert first and joint


def test_chain_control_mean_accepted_with_two_percent_fewer_acceptances(models, monkeypatch):
    real = verify_mod.accept_drafts
    monkeypatch.setattr(verify_mod, "accept_drafts", lambda u, p, q: real(u, 0.98 * p, q))
    model = models("random")
    out = chain_round(model, model.start_keys(CHAIN_BATCH), 4, seed=11)
    assert mean_accepted_rejected(model, out.num_accepted, 4)[0]


# ---------------------------------------------------------------------------- tree exactness

V_TREE = 8
TREE_BATCH = 50_000
TREES = {
    # root with 4 children, each continued by a chain: width 4, depth 4
    "top4_chains": [-1, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    # full binary tree of depth 4
    "binary": [-1] + [(node - 1) // 2 for node in range(1, 31)],
    # irregular: widths 3, 4, 1, 2, 1, 4 at different depths, depth 4
    "irregular": [-1, 0, 0, 0, 1, 1, 1, 1, 2, 4, 4, 8, 9, 11, 11, 11, 11],
}


def tree_depth(parents):
    depth = [0] * len(parents)
    for node in range(1, len(parents)):
        depth[node] = depth[parents[node]] + 1
    return max(depth)


def test_tree_shapes_are_within_width_and_depth_four():
    for parents in TREES.values():
        widths = [len(kids) for kids in children_lists(parents)]
        assert max(widths) <= 4 and tree_depth(parents) <= 4
    assert max(len(k) for k in children_lists(TREES["irregular"])) == 4
    assert tree_depth(TREES["top4_chains"]) == tree_depth(TREES["irregular"]) == 4


@pytest.mark.parametrize(
    "tree,kind,children",
    [
        ("irregular", "mixed", "topk"),
        ("top4_chains", "draft_extra", "topk"),
        ("binary", "disjoint", "topk"),
        ("binary", "random", "sampled"),  # mode a is exact for any tree
    ],
)
def test_tree_mode_a_law(models, tree, kind, children):
    model = models(kind, V_TREE)
    trial = tree_trial(model, TREE_BATCH, TREES[tree], seed=21, mode="a", children=children)
    assert_laws(model, trial, f"tree a {tree} {kind} {children}")


@pytest.mark.parametrize(
    "tree,kind",
    [
        ("irregular", "mixed"),
        ("top4_chains", "disjoint"),
        ("binary", "target_extra"),
        ("irregular", "identical"),
        ("top4_chains", "draft_extra"),
    ],
)
def test_tree_mode_b_law(models, tree, kind):
    model = models(kind, V_TREE)
    trial = tree_trial(model, TREE_BATCH, TREES[tree], seed=31, mode="b", children="sampled")
    assert_laws(model, trial, f"tree b {tree} {kind}")


def test_tree_control_mode_a_final_draw_keeps_rejected_siblings(models, monkeypatch):
    real = verify_mod.draw_target_without

    def keeps(target, rows, removed, mask, uniform):
        return real(target, rows, removed, torch.zeros_like(mask), uniform)

    monkeypatch.setattr(verify_mod, "draw_target_without", keeps)
    model = models("mixed", V_TREE)
    trial = tree_trial(model, TREE_BATCH, TREES["irregular"], seed=21, mode="a", children="topk")
    assert any(laws_rejected(model, trial))


def test_tree_control_mode_a_siblings_not_renormalized(models, monkeypatch):
    """Accepting a later sibling with p(t) instead of p(t) / (1 - rejected mass)."""
    real = verify_mod.accept_drafts
    monkeypatch.setattr(verify_mod, "accept_sibling", lambda u, left, p: real(u, p, None))
    model = models("mixed", V_TREE)
    trial = tree_trial(model, TREE_BATCH, TREES["irregular"], seed=21, mode="a", children="topk")
    assert any(laws_rejected(model, trial))


def test_tree_control_mode_b_residual_not_renormalized(models, monkeypatch):
    """After a rejection, testing the next sibling against max(p - q, 0) without dividing by
    its mass."""
    real = verify_mod.accept_child

    def unnormalized(u, w_t, q_t, mass, draft_mass):
        return real(u, w_t, q_t, torch.ones_like(mass), draft_mass)

    monkeypatch.setattr(verify_mod, "accept_child", unnormalized)
    model = models("mixed", V_TREE)
    trial = tree_trial(model, TREE_BATCH, TREES["irregular"], seed=31, mode="b", children="sampled")
    assert any(laws_rejected(model, trial))


def test_tree_control_mode_b_draft_not_renormalized(models, monkeypatch):
    """Keeping q as it was after a rejection (the rule for children drawn with replacement)
    on children drawn without replacement."""
    accept, update = verify_mod.accept_child, verify_mod.next_coefficient
    monkeypatch.setattr(
        verify_mod, "accept_child", lambda u, w, q, m, d: accept(u, w, q, m, torch.ones_like(d))
    )
    monkeypatch.setattr(
        verify_mod, "next_coefficient", lambda c, m, d: update(c, m, torch.ones_like(d))
    )
    model = models("mixed", V_TREE)
    trial = tree_trial(model, TREE_BATCH, TREES["irregular"], seed=31, mode="b", children="sampled")
    assert any(laws_rejected(model, trial))


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


# ---------------------------------------------------------------------------- large vocabulary


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_first_token_law_over_several_blocks(with_probs):
    """V = 1000 (three full blocks and a short one): the residual and the point-mass removal
    go through the blocked draw; zero weights included on both sides."""
    from stattests import binned

    gen = torch.Generator().manual_seed(8)
    vocab, total = 1000, 40_000
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, 0)
    q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, 0)
    p[torch.rand(vocab, generator=gen) < 0.3] = 0
    q[torch.rand(vocab, generator=gen) < 0.3] = 0
    p, q = p / p.sum(), q / q.sum()
    counts = torch.zeros(vocab, dtype=torch.int64)
    chunk = 10_000
    for start in range(0, total, chunk):
        draft = torch.multinomial(q.expand(chunk, -1), 1, generator=gen)
        target = torch.stack((p, torch.full_like(p, 1 / vocab))).float().expand(chunk, 2, vocab)
        out = fs.verify_chain(
            target.contiguous(),
            draft,
            q.float().expand(chunk, 1, vocab).contiguous() if with_probs else None,
            seed=torch.arange(chunk) + start,
        )
        assert bool(out.valid.all())
        counts += torch.bincount(out.token_ids[:, 0], minlength=vocab)
    exact = p.float().double().numpy()
    assert_law(*binned(counts.numpy(), exact, num_bins=40), what="chain V=1000")


# ---------------------------------------------------------------------------- structure of outputs


def random_chain_batch(batch, k, vocab, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, -1).to(dtype)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, -1).to(dtype)
    tokens = torch.multinomial(draft.float().view(-1, vocab), 1, generator=gen).view(batch, k)
    return target, tokens, draft


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_output_structure(with_probs):
    target, tokens, draft = random_chain_batch(300, 5, 50)
    if not with_probs:  # point-mass drafts: pick likely tokens so some are accepted
        tokens = target[:, :5].argmax(-1)
    lengths = torch.arange(300) % 6
    out = fs.verify_chain(
        target, tokens, draft if with_probs else None, draft_lengths=lengths, seed=torch.arange(300)
    )
    assert out.token_ids.shape == (300, 6) and out.token_ids.dtype == torch.int64
    assert bool(out.valid.all())
    assert torch.equal(out.num_emitted, out.num_accepted + 1)
    assert bool((out.num_accepted <= lengths).all())
    slots = torch.arange(6)
    emitted = slots < out.num_emitted[:, None]
    assert bool((out.token_ids[~emitted] == -1).all())
    assert bool(((out.token_ids >= 0) & (out.token_ids < 50))[emitted].all())
    accepted = slots[:5] < out.num_accepted[:, None]
    assert torch.equal(out.token_ids[:, :5][accepted], tokens[accepted])
    assert 0 < out.num_accepted.float().mean() < 5  # some accepted, some rejected


def test_chain_without_drafts_draws_the_bonus():
    target = torch.softmax(torch.randn(4, 1, 9), -1)
    out = fs.verify_chain(target, torch.zeros(4, 0, dtype=torch.int64), seed=1)
    assert out.token_ids.shape == (4, 1) and out.num_emitted.tolist() == [1] * 4
    out = fs.verify_chain(target, torch.zeros(4, 0, dtype=torch.int64), target[:, :0], seed=1)
    assert out.num_accepted.tolist() == [0] * 4


def test_chain_zero_residual_falls_back_to_the_target():
    """p == q and a draft the target cannot emit: the rejection is certain and the residual
    is empty; the token comes from p (valid, in range, never the rejected one)."""
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]]).expand(2000, -1, -1)
    q = p[:, :1]
    draft = torch.zeros(2000, 1, dtype=torch.int64)  # p(0) = q(0) = 0
    out = fs.verify_chain(p.contiguous(), draft, q.contiguous(), seed=torch.arange(2000))
    assert bool(out.valid.all()) and out.num_accepted.max() == 0
    assert set(out.token_ids[:, 0].tolist()) == {1, 2}


def test_tree_output_structure():
    gen = torch.Generator().manual_seed(0)
    parents = TREES["irregular"]
    batch, n, vocab = 500, len(parents), 12
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen), -1)
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
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


# ---------------------------------------------------------------------------- randomness


def test_uniform_streams_and_counters():
    source = verify_mod._random_source(None, torch.arange(5), 9, 5, torch.device("cpu"))
    a4, r4, b4 = verify_mod._uniforms(source, 5, 4)
    a9, r9, b9 = verify_mod._uniforms(source, 5, 20_000 // 5 + 1)  # the two-call layout
    assert torch.equal(a9[:, :4], a4) and torch.equal(r9, r4) and torch.equal(b9, b4)
    for stream, u in ((fs.Stream.ACCEPT, a4), (fs.Stream.RECOVERY, r4), (fs.Stream.BONUS, b4)):
        direct = fastsample.ops.seeds.CounterSource(
            torch.arange(5), torch.full((5,), 9), torch.full((5,), stream)
        )
        assert torch.equal(direct.row_uniforms(u.shape[1]), u)


def test_generator_and_seed_reproducibility():
    target, tokens, draft = random_chain_batch(64, 4, 30)
    runs = [
        fs.verify_chain(target, tokens, draft, generator=torch.Generator().manual_seed(5))
        for _ in range(2)
    ]
    assert torch.equal(runs[0].token_ids, runs[1].token_ids)
    a = fs.verify_chain(target, tokens, draft, seed=torch.arange(64), step=0).token_ids
    b = fs.verify_chain(target, tokens, draft, seed=torch.arange(64), step=1).token_ids
    assert torch.equal(a, fs.verify_chain(target, tokens, draft, seed=torch.arange(64)).token_ids)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_batch_invariance(with_probs):
    target, tokens, draft = random_chain_batch(257, 4, 40, seed=1)
    q = draft if with_probs else None
    gen = torch.Generator().manual_seed(2)
    seeds = torch.randint(-(2**62), 2**62, (257,), generator=gen)
    steps = torch.randint(0, 2**40, (257,), generator=gen)
    lengths = torch.randint(0, 5, (257,), generator=gen)

    def run(rows):
        return fs.verify_chain(
            target[rows],
            tokens[rows],
            None if q is None else q[rows],
            draft_lengths=lengths[rows],
            seed=seeds[rows],
            step=steps[rows],
        )

    full = run(torch.arange(257))
    order = torch.randperm(257, generator=gen)
    shuffled = run(order)
    for field in full._fields:
        assert torch.equal(getattr(shuffled, field), getattr(full, field)[order])
    for row in (0, 100, 256):
        alone = run(torch.tensor([row]))
        for field in full._fields:
            assert torch.equal(getattr(alone, field), getattr(full, field)[row : row + 1])


def test_chain_batch_invariance_at_full_vocabulary():
    """Rows are gathered and reduced in pieces of 8 at V = 128,256: a row's result does not
    depend on the piece it lands in."""
    target, tokens, draft = random_chain_batch(11, 2, 128_256, seed=3)
    seeds = torch.arange(11) * 7
    full = fs.verify_chain(target, tokens, draft, seed=seeds)
    for row in (0, 7, 8, 10):
        sl = slice(row, row + 1)
        alone = fs.verify_chain(target[sl], tokens[sl], draft[sl], seed=seeds[sl])
        assert torch.equal(alone.token_ids, full.token_ids[sl])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_its_float32_copy(dtype):
    target, tokens, draft = random_chain_batch(200, 3, 700, seed=4, dtype=dtype)
    seeds = torch.arange(200)
    half = fs.verify_chain(target, tokens, draft, seed=seeds)
    wide = fs.verify_chain(target.float(), tokens, draft.float(), seed=seeds)
    assert torch.equal(half.token_ids, wide.token_ids) and bool(half.valid.all())


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
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
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

P3 = torch.full((2, 3, 5), 0.2)  # B=2, K=2, V=5
X2 = torch.zeros(2, 2, dtype=torch.int64)
Q2 = torch.full((2, 2, 5), 0.2)


@pytest.mark.parametrize(
    "args,kwargs,error,words",
    [
        (([[0.5]], X2), {}, TypeError, "target_probs must be a torch.Tensor"),
        ((P3[0], X2), {}, ValueError, "target_probs must have shape (batch, K+1, vocab)"),
        ((P3.long(), X2), {}, TypeError, "float16, bfloat16, float32 or float64"),
        ((P3[:, :, :0], X2), {}, ValueError, "at least one vocabulary entry"),
        ((P3[:, :0], X2[:, :0]), {}, ValueError, "K+1 >= 1 positions"),
        ((P3, X2.float()), {}, TypeError, "draft_token_ids must be int64"),
        ((P3, X2[:, :1]), {}, ValueError, "draft_token_ids must have shape (2, 2)"),
        ((P3, [[0, 0], [0, 0]]), {}, TypeError, "draft_token_ids must be an int64 tensor"),
        ((P3, X2, Q2[:, :1]), {}, ValueError, "draft_probs must have shape (batch, K, vocab)"),
        ((P3, X2, Q2[0]), {}, ValueError, "draft_probs must have shape"),
        ((P3, X2, Q2.long()), {}, TypeError, "draft_probs must be float16"),
        ((P3, X2), {"draft_lengths": 3}, ValueError, "draft_lengths must be between 0 and 2"),
        ((P3, X2), {"draft_lengths": True}, TypeError, "draft_lengths must be None, an int"),
        ((P3, X2), {"draft_lengths": torch.ones(3).long()}, ValueError, "shape (2,)"),
        ((P3, X2), {"draft_lengths": torch.ones(2)}, TypeError, "draft_lengths must be int64"),
        ((P3, X2), {"seed": 1, "generator": torch.Generator()}, ValueError, "mutually exclusive"),
        ((P3, X2), {"step": 1}, ValueError, "step was given without seed"),
        ((P3, X2), {"seed": torch.arange(3)}, ValueError, "seed must have shape (2,)"),
        ((P3, X2), {"generator": 1}, TypeError, "generator must be a torch.Generator"),
        ((P3, X2), {"check": 1}, TypeError, "check must be True or False"),
    ],
)
def test_chain_argument_errors(args, kwargs, error, words):
    with pytest.raises(error) as info:
        fs.verify_chain(*args, **kwargs)
    assert words in str(info.value)


def test_errors_come_before_any_random_draw():
    gen = torch.Generator().manual_seed(3)
    want = fs.verify_chain(P3, X2, Q2, generator=gen).token_ids
    gen.manual_seed(3)
    with pytest.raises(ValueError):
        fs.verify_chain(P3, X2 + 9, Q2, generator=gen, check=True)
    with pytest.raises(ValueError):
        fs.verify_tree(P3, fs.TokenTree(X2.repeat(1, 2)[:, :3], [-1, 0, 2]), generator=gen)
    assert torch.equal(fs.verify_chain(P3, X2, Q2, generator=gen).token_ids, want)


@pytest.mark.parametrize(
    "change,words,flagged",
    [
        ({"ids": (1, 0, 5)}, "row 1 draft position 0 has an id outside [0, 5)", 1),
        ({"ids": (0, 1, -1)}, "row 0 draft position 1 has an id outside [0, 5)", 1),
        ({"target": (1, 2, 0, NAN)}, "row 1 target_probs position 2 contains NaN", 1),
        ({"target": (0, 0, 3, -0.1)}, "row 0 target_probs position 0 contains negative", 0),
        ({"draft": (1, 1, 3, INF)}, "row 1 draft_probs position 1 contains +-inf", 0),
        ({"draft": (1, 1, 0, INF)}, "row 1 draft_probs position 1 contains +-inf", 1),
        ({"lengths": torch.tensor([2, 3])}, "row 1 draft_lengths 0 outside [0, 2]", 1),
    ],
)
def test_chain_check_true_names_the_first_bad_row(change, words, flagged):
    """check=True reads every used row. Without it, only the values the verifier reads
    are judged: here p == q, so every draft is accepted and the bad entries off the drafted
    tokens at positions 0 and 1 are never read (flagged == 0)."""
    p, x, q = P3.clone(), X2.clone(), Q2.clone()
    lengths = change.get("lengths")
    if "ids" in change:
        b, k, value = change["ids"]
        x[b, k] = value
    if "target" in change:
        b, k, i, value = change["target"]
        p[b, k, i] = value
    if "draft" in change:
        b, k, i, value = change["draft"]
        q[b, k, i] = value
    with pytest.raises(ValueError) as info:
        fs.verify_chain(p, x, q, draft_lengths=lengths, seed=1, check=True)
    assert words in str(info.value)
    out = fs.verify_chain(p, x, q, draft_lengths=lengths, seed=1)
    assert out.valid.tolist().count(False) == flagged


def test_chain_padding_is_never_judged():
    """Garbage after draft_lengths (ids, draft rows, target rows) is ignored, even by
    check=True; the bonus position's target row is used and judged."""
    p, x, q = P3.clone(), X2.clone(), Q2.clone()
    lengths = torch.tensor([0, 1])
    x[0] = -7
    q[0] = NAN
    p[0, 1:] = NAN
    x[1, 1] = 99
    q[1, 1] = -1
    p[1, 2] = INF
    out = fs.verify_chain(p, x, q, draft_lengths=lengths, seed=1, check=True)
    assert out.valid.tolist() == [True, True]


def bad_rows_batch():
    target, tokens, draft = random_chain_batch(8, 3, 300, seed=9)
    target[1, 0, 7] = NAN  # gathered or recovery row: row 1 bad
    target[1, :, :] = torch.where(torch.arange(300) == 7, NAN, target[1])
    target[2, :, 5] = -0.5
    target[3] = 0
    draft[4, :, 2] = INF
    tokens[5, 1] = 300  # out of range
    target[6, :, 0] = INF
    draft[7] = NAN
    return target, tokens, draft


def test_chain_bad_rows_are_flagged_and_other_rows_unchanged():
    target, tokens, draft = bad_rows_batch()
    clean_target, clean_tokens, clean_draft = random_chain_batch(8, 3, 300, seed=9)
    seeds = torch.arange(8) * 3
    out = fs.verify_chain(target, tokens, draft, seed=seeds)
    clean = fs.verify_chain(clean_target, clean_tokens, clean_draft, seed=seeds)
    assert out.valid.tolist() == [True] + [False] * 7
    for field in out._fields:
        assert torch.equal(getattr(out, field)[0], getattr(clean, field)[0])
    assert bool((out.token_ids[1:] == -1).all()) and out.num_emitted[1:].max() == 0
    # Point-mass drafts: same policy (row 4 and 7 only had bad draft rows: valid now).
    out = fs.verify_chain(target, tokens, None, seed=seeds)
    clean = fs.verify_chain(clean_target, clean_tokens, None, seed=seeds)
    assert out.valid.tolist() == [True, False, False, False, True, False, False, True]
    for row in (0, 4, 7):
        assert torch.equal(out.token_ids[row], clean.token_ids[row])


def test_chain_fuzz_garbage_rows_stay_in_range():
    gen = torch.Generator().manual_seed(12)
    batch, k, vocab = 400, 3, 37
    values = torch.tensor([0.0, 1.0, -1.0, NAN, INF, -INF, 1e-30, 1e30])
    target = values[torch.randint(0, 8, (batch, k + 1, vocab), generator=gen)]
    draft = values[torch.randint(0, 8, (batch, k, vocab), generator=gen)]
    tokens = torch.randint(-3, vocab + 3, (batch, k), generator=gen)
    for q in (draft, None):
        out = fs.verify_chain(target, tokens, q, seed=torch.arange(batch))
        ids = out.token_ids
        assert bool(((ids == -1) | ((ids >= 0) & (ids < vocab))).all())
        assert bool((out.num_emitted <= k + 1).all())


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
        ((None, [-1, 0, 1]), Q2, {}, ValueError, "draft_probs must have shape (2, 3, 5)"),
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
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
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
    parents = TREES["irregular"]
    batch, n, vocab = 40, len(parents), 30
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 3, -1)
    draft = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 3, -1)
    tokens = draft.argmax(-1)  # likely tokens, so walks go deep
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


@pytest.fixture
def eager_equivalent_random():
    # Inductor normally swaps in its own RNG; fallback_random keeps torch.rand's stream so
    # compiled and eager results can be compared bitwise.
    old = torch._inductor.config.fallback_random
    torch._inductor.config.fallback_random = True
    torch._dynamo.reset()
    yield
    torch._inductor.config.fallback_random = old


def compile_batch():
    target, tokens, draft = random_chain_batch(6, 3, 700, seed=13)
    target[2, :, 9] = NAN  # a bad row goes through the compiled graph too
    return target, tokens, draft, torch.tensor([3, 3, 3, 1, 0, 2])


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_fullgraph_seeded_matches_eager(eager_equivalent_random, with_probs):
    target, tokens, draft, lengths = compile_batch()
    q = draft if with_probs else None

    def run(p, x, d, n, s, t):
        return fs.verify_chain(p, x, d, draft_lengths=n, seed=s, step=t)

    # aot_eager: dynamo with fullgraph (no graph break: no sync, no Python branch on values)
    # and AOT tracing with fake tensors (no data-dependent shape), without inductor's code
    # generation (tens of seconds for the Philox rounds), which the next test exercises.
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    seeds, step = torch.arange(6) * 11, torch.zeros(6, dtype=torch.int64)
    for _ in range(2):
        got, want = (
            compiled(target, tokens, q, lengths, seeds, step),
            run(target, tokens, q, lengths, seeds, step),
        )
        for field in want._fields:
            assert torch.equal(getattr(got, field), getattr(want, field))
        fs.advance_step(step)
    assert got.valid.tolist() == [True, True, False, True, True, True]


def test_chain_fullgraph_generator_free_matches_eager(eager_equivalent_random):
    """Inductor end to end: the compiled kernels draw exactly what eager draws (a small
    graph: inductor's code generation is the slow part of compiling)."""
    target, tokens, draft = random_chain_batch(4, 2, 256, seed=13)
    target[1, :, 5] = NAN
    compiled = torch.compile(lambda p, x, d: fs.verify_chain(p, x, d), fullgraph=True)
    torch.manual_seed(5)
    got = compiled(target, tokens, draft)
    torch.manual_seed(5)
    want = fs.verify_chain(target, tokens, draft)
    for field in want._fields:
        assert torch.equal(getattr(got, field), getattr(want, field))
    assert want.valid.tolist() == [True, False, True, True]


@pytest.mark.parametrize(
    "mode,shared", [("a", True), ("b", False)], ids=["a-host-parents", "b-tensor-parents"]
)
def test_tree_fullgraph_matches_eager(eager_equivalent_random, mode, shared):
    gen = torch.Generator().manual_seed(14)
    parents = [-1, 0, 0, 1, 1, 2]
    batch, n, vocab = 5, len(parents), 300
    target = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 3, -1)
    draft = torch.softmax(torch.randn(batch, n, vocab, generator=gen) * 3, -1)
    tokens = draft.argmax(-1)
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


def capture(fn):
    """Warm up on a side stream, then capture ``fn`` with host syncs turned into errors."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")  # the step only, not the capture's own sync
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return graph, out


def chain_inputs(model, batch, draft_count, seed):
    """One round of drafts from the toy model: (target, draft, tokens), float32."""
    gen = torch.Generator().manual_seed(seed)
    target, draft, tokens = [], [], []
    key = model.start_keys(batch)
    for _ in range(draft_count):
        target.append(model.target[key])
        draft.append(model.draft[key])
        tokens.append(torch.multinomial(draft[-1], 1, generator=gen)[:, 0])
        key = model.child(key, tokens[-1])
    target.append(model.target[key])
    return torch.stack(target, 1).float(), torch.stack(draft, 1).float(), torch.stack(tokens, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_cuda_graph_capture_replays_fresh_exact_draws(with_probs):
    """Captured once under sync-debug "error"; each replay gets new drafts copied into the
    static inputs and a new step (advanced inside the graph): every replay equals eager, and
    the first emitted tokens over all replays follow the target's law."""
    model = ToyModel("mixed", V_CHAIN)
    batch, k, replays = 65_536, 2, 4
    cuda = torch.device("cuda")
    rounds = [[t.to(cuda) for t in chain_inputs(model, batch, k, seed)] for seed in range(replays)]
    p, q, x = (t.clone() for t in rounds[0])
    q_arg = q if with_probs else None
    seeds = torch.arange(batch, device=cuda)
    step = torch.zeros(batch, dtype=torch.int64, device=cuda)

    def decode():
        out = fs.verify_chain(p, x, q_arg, seed=seeds, step=step)
        fs.advance_step(step)
        return out

    graph, out = capture(decode)
    step.zero_()
    counts = np.zeros(GROUPS * V_CHAIN)
    group = torch.arange(batch, device=cuda) % GROUPS
    for replay, (new_p, new_q, new_x) in enumerate(rounds):
        p.copy_(new_p)
        q.copy_(new_q)
        x.copy_(new_x)
        graph.replay()
        eager = fs.verify_chain(
            new_p, new_x, new_q if with_probs else None, seed=seeds, step=replay
        )
        for field in eager._fields:
            assert torch.equal(getattr(out, field), getattr(eager, field))
        ids = out.token_ids[:, 0]
        counts += torch.bincount(group * V_CHAIN + ids, minlength=counts.size).cpu().numpy()
    assert_law(counts, model.exact_laws()[0], what="captured verify_chain")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["a", "b"])
def test_tree_cuda_graph_capture(mode):
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    parents = TREES["irregular"]
    batch, n, vocab = 64, len(parents), 32000
    target = torch.softmax(torch.randn(batch, n, vocab, device=cuda, generator=gen) * 3, -1)
    draft = torch.softmax(torch.randn(batch, n, vocab, device=cuda, generator=gen) * 3, -1)
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


def test_empty_batch():
    p = torch.rand(0, 3, 10)
    x = torch.zeros(0, 2, dtype=torch.int64)
    for q in (None, p[:, :2]):
        out = fs.verify_chain(p, x, q, seed=torch.zeros(0, dtype=torch.int64))
        assert out.token_ids.shape == (0, 3) and out.valid.shape == (0,)
        tree = fs.TokenTree(torch.zeros(0, 3, dtype=torch.int64), [-1, 0, 0])
        assert fs.verify_tree(p, tree, q if q is None else p).token_ids.shape == (0, 3)


def test_host_tree_tables_are_made_once_per_device():
    """Shared host trees become device tables on the first call only (for a CUDA graph, the
    warm-up before capture), so captured calls do no host-to-device copy."""
    parents = [-1, 0, 0, 2, 2, 2]
    device = torch.device("cpu")
    first = verify_mod._host_structure(parents, device)
    again = verify_mod._host_structure(list(parents), device)
    assert first.first_child is again.first_child and first.next_sibling is again.next_sibling
    assert first.first_child.tolist() == [[1, 6, 3, 6, 6, 6]]
    assert first.next_sibling.tolist() == [[6, 2, 6, 4, 5, 6]]
    assert (first.steps, first.width) == (5, 3)  # root: 2 children; node 2 (rank 2): 3 more


def test_bench_verify_runs_and_saves_json(tmp_path, capsys):
    import json

    from fastsample.__main__ import main

    path = tmp_path / "verify.json"
    args = ["bench", "--verify", "--device", "cpu", "--batch", "2", "--vocab", "300"]
    fast = ["--warmup", "1", "--min-repeats", "2", "--repeats", "2", "--budget", "0.01"]
    assert main([*args, *fast, "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["results"]
    names = [r["contender"] for r in rows]
    assert names[:3] == ["read_pass", "gather", "reference"] and "fs.verify_chain" in names
    assert all(r["median_ms"] > 0 and r["speedup_vs_reference"] > 0 for r in rows)
    assert "fs.verify_tree b" in capsys.readouterr().out
    from fastsample.tools.bench.verify import make_case, reference_verify

    case = make_case(3, 2, 50, "float32", torch.device("cpu"))
    accepted, token = reference_verify(case.target, case.draft, case.tokens)
    assert accepted.shape == (3,) and token.shape == (3, 1)
