"""Shared by the tests in tests/verify: a toy language model, verification rounds on it, and
small fixed inputs.

Exactness is tested end to end on a toy language model (:class:`ToyModel`: the next-token
distributions of a target and a draft model are rows of two tables, picked by a hash of the
prefix). Drafts are drawn from the draft model, verified, and the *emitted* tokens are
compared with the target model's exact float64 law: the first emitted token, and the first
two (when a round emits only one token, a second round from the new context supplies the
second, as a decoding loop would). Many independent requests run as rows of one batch with
per-row seeds, so one call gives many samples.

Lives in tests/ (on ``sys.path`` through ``pythonpath``) under a name unique in the tree.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

import fastsample as fs
from stattests import assert_law, law_rejected

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


def random_chain_batch(batch, k, vocab, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, -1).to(dtype)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, -1).to(dtype)
    tokens = torch.multinomial(draft.float().view(-1, vocab), 1, generator=gen).view(batch, k)
    return target, tokens, draft


P3 = torch.full((2, 3, 5), 0.2)  # B=2, K=2, V=5
X2 = torch.zeros(2, 2, dtype=torch.int64)
Q2 = torch.full((2, 2, 5), 0.2)


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
