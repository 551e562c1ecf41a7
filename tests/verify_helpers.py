"""Shared by the tests in tests/verify: a toy language model, verification rounds on it, and
small fixed inputs.

Exactness is tested end to end on a toy language model (:class:`ToyModel`: the next-token
distributions of a target and a draft model are rows of two tables, picked by a hash of the
prefix). Drafts are drawn from the draft model, verified, and the *emitted* tokens are
compared with the target model's exact float64 law: the first emitted token, and the first
two (when a round emits only one token, a second round from the new context supplies the
second, as a decoding loop would). Many independent requests run as rows of one batch with
per-row seeds (or a generator), so one call gives many samples; :func:`law_draws` runs the
millions of requests a full-power law test needs in chunks (bounded memory), with the second
round only for the requests whose first round emitted one token.

Lives in tests/ (on ``sys.path`` through ``pythonpath``) under a name unique in the tree.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

import fastsample as fs
from stattests import assert_law, law_rejected
from torch_threads import one_thread

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


def draw_from(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``(B, V)`` float64 ``probs`` (inverse CDF; 30x cheaper than
    ``torch.multinomial`` on millions of short rows). ``u * total < total``, so a
    probability-0 token (a flat step of the CDF) is never picked."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]


def draw_without_replacement(probs: torch.Tensor, count: int, gen) -> torch.Tensor:
    """``count`` distinct tokens per row in drawing order (the exponential race: the smallest
    ``Exp(1) / p`` come in the order successive draws without replacement give them)."""
    noise = -torch.log1p(-torch.rand(probs.shape, generator=gen, dtype=torch.float64))
    return (noise / probs).topk(count, -1, largest=False).indices


class Trial(NamedTuple):
    first: torch.Tensor  # (B,) first emitted token
    second: torch.Tensor  # (B,) second emitted token (from a second round if needed)
    num_accepted: torch.Tensor  # (B,) first round's accepted count


def round_generator(seed: int, rows: torch.Tensor) -> torch.Generator:
    """The generator of one call: its own for each seed and first row (so chunks of one
    trial draw different drafts)."""
    return torch.Generator().manual_seed(seed * 10_000_019 + int(rows[0]) if len(rows) else 0)


def chain_round(
    model,
    keys,
    draft_count,
    seed,
    *,
    probs=True,
    greedy=False,
    lengths=None,
    rows=None,
    seeded=True,
):
    """Drafts from the draft model and one verify_chain call. Request ``rows[b]`` (default
    ``b``) gets seed ``rows[b] + seed * 10_000_019`` (its verification uniforms do not depend
    on the batch it runs in); ``seeded=False`` draws them from a generator instead."""
    batch, vocab = keys.shape[0], model.vocab
    rows = torch.arange(batch) if rows is None else rows
    gen = round_generator(seed, rows)
    target = torch.empty(batch, draft_count + 1, vocab, dtype=torch.float64)
    draft = torch.empty(batch, draft_count, vocab, dtype=torch.float64)
    tokens = torch.empty(batch, draft_count, dtype=torch.int64)
    key = keys
    for i in range(draft_count):
        target[:, i], draft[:, i] = model.target[key], model.draft[key]
        tokens[:, i] = draft[:, i].argmax(-1) if greedy else draw_from(draft[:, i], gen)
        key = model.child(key, tokens[:, i])
    target[:, draft_count] = model.target[key]
    randomness = {"seed": rows + seed * 10_000_019, "step": 7} if seeded else {"generator": gen}
    return fs.verify_chain(
        target, tokens, draft if probs else None, draft_lengths=lengths, **randomness
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


def tree_round(model, keys, parents, seed, *, mode, children, rows=None, seeded=True):
    """Build a token tree per request from the draft model and verify it.

    ``children="sampled"``: each node's children are drawn without replacement from the
    draft at that node; ``"topk"``: they are the draft's top tokens (deterministic). Seeds
    and ``seeded`` as in :func:`chain_round`."""
    batch, n = keys.shape[0], len(parents)
    rows = torch.arange(batch) if rows is None else rows
    gen = round_generator(seed, rows)
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
            chosen = draw_without_replacement(dist, len(kids), gen)
        for i, kid in enumerate(kids):
            tokens[:, kid] = chosen[:, i]
            node_keys[:, kid] = model.child(node_keys[:, node], chosen[:, i])
    target = model.target[node_keys].float()
    draft = model.draft[node_keys].float() if mode == "b" else None
    randomness = {"seed": rows + seed * 10_000_019, "step": 3} if seeded else {"generator": gen}
    return fs.verify_tree(target, fs.TokenTree(tokens, parents), draft, **randomness)


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


class LawDraws(NamedTuple):
    """Counts of (group, first token) and of (group, first, second token) over requests."""

    first: np.ndarray
    joint: np.ndarray | None


CHUNK = 32_768  # requests per call: bounded memory, and temporaries the allocator reuses
# (chunks of 250k cost a third more CPU time in page faults)


@one_thread()
def law_draws(model, requests, run_round, *, joint=True, chunk=CHUNK) -> LawDraws:
    """``requests`` independent requests, ``chunk`` at a time: ``run_round(keys, rows, i)``
    runs round ``i`` (0 or 1) of requests ``rows`` from contexts ``keys``. The second round
    runs only for the requests whose first round emitted a single token (the others' second
    token is their first round's second), and only with ``joint``."""
    vocab = model.vocab
    first = np.zeros(GROUPS * vocab)
    pairs = np.zeros(GROUPS * vocab * vocab) if joint else None
    for start in range(0, requests, chunk):
        rows = torch.arange(start, min(requests, start + chunk))
        keys = model.starts[rows % GROUPS]
        one = run_round(keys, rows, 0)
        assert bool(one.valid.all())
        cell = (rows % GROUPS) * vocab + one.token_ids[:, 0]
        first += torch.bincount(cell, minlength=first.size).numpy()
        if pairs is None:
            continue
        second = one.token_ids[:, 1].clone()
        again = one.num_emitted < 2
        if bool(again.any()):
            two = run_round(model.child(keys[again], one.token_ids[again, 0]), rows[again], 1)
            assert bool(two.valid.all())
            second[again] = two.token_ids[:, 0]
        pairs += torch.bincount(cell * vocab + second, minlength=pairs.size).numpy()
    return LawDraws(first, pairs)


def assert_drawn_laws(model, draws: LawDraws, what: str) -> None:
    first, joint = model.exact_laws()
    assert_law(draws.first, first, what=f"{what}: first token")
    if draws.joint is not None:
        assert_law(draws.joint, joint, what=f"{what}: first two tokens")


def drawn_laws_rejected(model, requests, run_round) -> bool:
    """Whether the law test of :func:`assert_drawn_laws` rejects ``requests`` requests: the
    first token's law alone when it already rejects (one round), else both laws."""
    first, joint = model.exact_laws()
    if law_rejected(law_draws(model, requests, run_round, joint=False).first, first):
        return True
    draws = law_draws(model, requests, run_round)
    return law_rejected(draws.first, first) or law_rejected(draws.joint, joint)


def chain_rounds(model, draft_count=4, seed=0, **options):
    """``run_round`` for :func:`law_draws`: :func:`chain_round` with ``options``
    (``lengths``: a function of the rows)."""
    lengths = options.pop("lengths", None)

    def run(keys, rows, i):
        rows_lengths = None if lengths is None else lengths(rows)
        return chain_round(
            model, keys, draft_count, 2 * seed + i, rows=rows, lengths=rows_lengths, **options
        )

    return run


def tree_rounds(model, parents, seed=0, **options):
    """``run_round`` for :func:`law_draws`: :func:`tree_round` with ``options``."""

    def run(keys, rows, i):
        return tree_round(model, keys, parents, 2 * seed + i, rows=rows, **options)

    return run


# Full power (issue 18): CHAIN_DRAWS requests detect a 2% bias on 10% of the mass of the law
# of the first token (24 cells: 4 start contexts x V = 6) and of the first two (144 cells),
# with probability 0.99 at p < 1e-6 (stattests.draws_needed: 4.45M and 4.10M on LAW_KIND,
# the model whose table rows are of every kind).
CHAIN_DRAWS = 4_500_000
LAW_KIND = "mixed"
CHAIN_BATCH = 200_000  # the Triton interpreter's tests (tests/kernels)
V_CHAIN = 6


@functools.cache
def law_model_laws() -> tuple[np.ndarray, np.ndarray]:
    """Exact laws of the first emitted token and of the first two on the law tests' model
    (``ToyModel(LAW_KIND, V_CHAIN)``), for the modules' registries (``law_cases``)."""
    return ToyModel(LAW_KIND, V_CHAIN).exact_laws()


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
