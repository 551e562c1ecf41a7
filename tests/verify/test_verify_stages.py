"""Speculative decoding with the engine step's stages: exact with penalties.

``verify_chain(target_logits=..., params=..., state=...)`` processes the target at position
``i`` with the drafts before it counted as emitted (penalties, min-tokens), as the target
alone would sample there. The test: a bigram target with repetition, frequency and presence
penalties, a logit bias and a temperature; a draft model proposing K = 2 tokens; the joint law
of the first two emitted tokens (from one round when it emits two, else from a second round
after updating the statistics with the first) equals sampling twice from the penalized target
alone, in float64 (tests/stage_reference.py), at 2% (36 pairs). Negative control at the same
size: the law in which the second token's penalties ignore the first (what a verifier that
processed every position with the request's statistics alone would approach) is rejected.
``verify_tree`` takes the same stages; its node prefixes (the path from the root) are checked
against the chain's on a chain-shaped tree, bitwise.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import fastsample as fs
from fastsample.verify import targets
from stage_reference import Row, step_probs
from stattests import LawCase, assert_law, draws_needed, law_rejected

V, K = 6, 2
CLAIM = 0.02
CHUNK = 200_000
PROMPT = [0, 0, 3]
ROW = dict(repetition=1.5, frequency=0.6, presence=0.3, bias={1: 0.8}, temperature=0.9)
_gen = np.random.default_rng(17)
TARGET = _gen.normal(size=(V, V)) * 1.5  # target logits after each token
DRAFT = TARGET + _gen.normal(size=(V, V)) * 0.8  # a close draft model


def target_law(outputs: list[int]) -> np.ndarray:
    last = outputs[-1] if outputs else PROMPT[-1]
    return step_probs(TARGET[last], Row(prompt=PROMPT, outputs=outputs, **ROW))


@functools.cache
def joint_law(ignore_first: bool = False) -> np.ndarray:
    first = target_law([])
    pairs = np.zeros((V, V))
    for t in range(V):
        second = step_probs(TARGET[t], Row(prompt=PROMPT, outputs=[] if ignore_first else [t],
                                           **ROW))  # fmt: skip
        pairs[t] = first[t] * second
    return pairs.ravel()


DRAWS = draws_needed(joint_law(), CLAIM)


def params_for(rows: int) -> fs.StepParams:
    return fs.StepParams(
        rows, V, temperature=ROW["temperature"], repetition_penalty=ROW["repetition"],
        frequency_penalty=ROW["frequency"], presence_penalty=ROW["presence"],
        logit_bias=(torch.tensor([[1]]).expand(rows, 1), torch.tensor([[0.8]]).expand(rows, 1)),
    )  # fmt: skip


def one_round(last, params, stats, gen):
    target = torch.tensor(TARGET, dtype=torch.float32)
    draft = torch.softmax(torch.tensor(DRAFT, dtype=torch.float32), -1)
    drafts, q, token = [], [], last
    for _ in range(K):
        row = draft[token]
        token = fs.sample_from_probs(row, generator=gen).token_ids[:, 0]
        drafts.append(token)
        q.append(row)
    drafts_t = torch.stack(drafts, 1)
    logits = target[torch.cat((last[:, None], drafts_t), 1)]  # (B, K+1, V)
    return fs.verify_chain(draft_token_ids=drafts_t, draft_probs=torch.stack(q, 1),
                           target_logits=logits, params=params, state=stats, generator=gen)


def first_two_tokens(rows: int, offset: int) -> np.ndarray:
    params = params_for(rows)
    stats = fs.TokenStats.from_prompts([PROMPT], V).select([0] * rows)
    gen = torch.Generator().manual_seed(offset)  # drafts and verifier: independent draws
    last = torch.full((rows,), PROMPT[-1])
    out = one_round(last, params, stats, gen)
    assert out.valid.all()
    first = out.token_ids[:, 0]
    stats.update(first[:, None])  # the second round starts after the first token only
    again = one_round(first, params, stats, gen)
    second = torch.where(out.num_emitted >= 2, out.token_ids[:, 1], again.token_ids[:, 0])
    return (first * V + second).numpy()


def test_chain_with_penalties_keeps_the_target_law_of_two_tokens():
    counts = np.zeros(V * V, dtype=np.int64)
    done = 0
    with torch.inference_mode():
        while done < DRAWS:
            rows = min(CHUNK, DRAWS - done)
            counts += np.bincount(first_two_tokens(rows, done), minlength=V * V)
            done += rows
    assert_law(counts, joint_law(), what="verify_chain with penalties")
    assert law_rejected(counts, joint_law(ignore_first=True))


def test_chain_positions_count_the_drafts_before_them():
    """Position i's distribution is process_step with x_1..x_i emitted (bitwise)."""
    rows = 3
    stats = fs.TokenStats.from_prompts([PROMPT] * rows, V)
    drafts = torch.tensor([[1, 2], [4, 4], [0, 5]])
    logits = torch.randn(rows, K + 1, V)
    got = targets.processed_positions(logits, targets.chain_prefixes(drafts), params_for(rows),
                                      stats, None)  # fmt: skip
    for b in range(rows):
        for i in range(K + 1):
            alone = fs.TokenStats.from_prompts([PROMPT], V, outputs=[drafts[b, :i].tolist()])
            want = fs.process_step(logits[b, i][None], params_for(1), state=alone)
            assert torch.equal(got[b, i], want[0]), (b, i)


# Per-row settings: each request its own temperature and repetition penalty, its own prompt.
ROW_TEMPERATURE = [0.5, 1.0, 1.5]
ROW_REPETITION = [1.0, 1.5, 2.0]
ROW_PROMPTS = [[0, 0, 3], [1, 4], [2, 5, 5]]


def per_row_params(rows: list[int]) -> fs.StepParams:
    return fs.StepParams(
        len(rows), V, temperature=torch.tensor([ROW_TEMPERATURE[b] for b in rows]),
        repetition_penalty=torch.tensor([ROW_REPETITION[b] for b in rows]),
    )  # fmt: skip


def check_positions_follow_their_own_row() -> None:
    """Every (request, position) processed distribution of ``processed_positions`` equals
    ``process_step`` of that request alone, with the drafts before the position counted as
    its output (bitwise)."""
    drafts = torch.tensor([[1, 2], [4, 4], [0, 5]])
    logits = torch.randn(3, K + 1, V, generator=torch.Generator().manual_seed(3)) * 2
    stats = fs.TokenStats.from_prompts(ROW_PROMPTS, V)
    got = targets.processed_positions(logits, targets.chain_prefixes(drafts),
                                      per_row_params([0, 1, 2]), stats, None)  # fmt: skip
    for b in range(3):
        for i in range(K + 1):
            alone = fs.TokenStats.from_prompts([ROW_PROMPTS[b]], V,
                                               outputs=[drafts[b, :i].tolist()])  # fmt: skip
            want = fs.process_step(logits[b, i][None], per_row_params([b]), state=alone)
            assert torch.equal(got[b, i], want[0]), (b, i)


def test_chain_positions_keep_their_requests_own_settings():
    """Positions are rows ``b * (K+1) + i`` (``StepParams.repeat_rows``: repeat_interleave),
    so each position takes its own request's temperature and penalty."""
    check_positions_follow_their_own_row()


def test_negative_control_tiled_settings_are_caught(monkeypatch):
    """``repeat_rows`` tiling the per-row settings (``Tensor.repeat``: rows b, b+1, ... in
    turn) gives position i of request b the settings of request ``(b * (K+1) + i) % B``."""
    real = fs.StepParams.repeat_rows

    def tiled(self, times):
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "repeat_interleave",
                          lambda t, n, dim=0: t.repeat(n, *[1] * (t.dim() - 1)))  # fmt: skip
            return real(self, times)

    monkeypatch.setattr(fs.StepParams, "repeat_rows", tiled)
    with pytest.raises(AssertionError):
        check_positions_follow_their_own_row()


def test_tree_prefixes_follow_the_paths():
    tokens = torch.tensor([[9, 1, 2, 3, 4]])
    parents = [-1, 0, 0, 1, 3]  # node 4's path: 1, 3, 4 (the root's token is not counted)
    got = targets.tree_prefixes(tokens, parents)[0]
    # In order from the root, as a chain's prefixes (DRY and no-repeat n-grams read the order).
    assert got.tolist() == [[-1] * 4, [1, -1, -1, -1], [2, -1, -1, -1], [1, 3, -1, -1],
                            [1, 3, 4, -1]]  # fmt: skip
    paths = [sorted(t for t in row.tolist() if t >= 0) for row in got]
    assert paths == [[], [1], [2], [1, 3], [1, 3, 4]]
    assert torch.equal(targets.tree_prefixes(tokens, torch.tensor(parents)), got[None])
    # A chain-shaped tree gives the chain's prefixes (as sets).
    chain = targets.chain_prefixes(torch.tensor([[1, 3, 4]]))[0]
    assert [sorted(t for t in r.tolist() if t >= 0) for r in chain] == [
        [], [1], [1, 3], [1, 3, 4]
    ]


def test_tree_with_stages_matches_probs_processed_by_hand():
    rows, n = 2, 4
    parents = [-1, 0, 0, 1]
    tokens = torch.tensor([[3, 1, 2, 5], [3, 0, 4, 4]])
    stats = fs.TokenStats.from_prompts([PROMPT] * rows, V)
    logits = torch.randn(rows, n, V)
    prefixes = targets.tree_prefixes(tokens, parents)
    probs = targets.processed_positions(logits, prefixes, params_for(rows), stats, None)
    tree = fs.TokenTree(tokens, parents)
    seed = torch.tensor([5, 6])
    by_hand = fs.verify_tree(probs, tree, seed=seed)
    staged = fs.verify_tree(tree=tree, target_logits=logits, params=params_for(rows),
                            state=stats, seed=seed)  # fmt: skip
    for a, b in zip(by_hand, staged, strict=True):
        assert torch.equal(a, b)


def test_a_tree_node_with_history_stages_is_the_step_after_its_path():
    """DRY, no-repeat n-grams and windowed penalties read the path in order: each node's
    distribution is the step's after the prompt and its path (a reversed path fails)."""
    vocab = 20
    prompt = [1, 2, 5, 6, 3, 1, 2, 4, 5]
    settings = dict(temperature=1.0, dry_multiplier=1.0, dry_allowed_length=1,
                    no_repeat_ngram_size=3, penalty_last_n=4, presence_penalty=0.5)
    params = fs.StepParams(2, vocab, **settings)
    stats = fs.TokenStats.from_prompts([prompt] * 2, vocab, history=32)
    parents = [-1, 0, 1, 0, 3]
    tokens = torch.tensor([[0, 5, 6, 3, 1], [0, 4, 5, 6, 3]])
    logits = torch.randn(2, 5, vocab, generator=torch.Generator().manual_seed(4))
    got = targets.processed_positions(logits, targets.tree_prefixes(tokens, parents), params,
                                      stats, None)  # fmt: skip
    for b in range(2):
        for node, path in enumerate(([], [1], [1, 2], [3], [3, 4])):
            after = fs.TokenStats.from_prompts([prompt + tokens[b, path].tolist()], vocab,
                                               history=32)  # fmt: skip
            one = fs.StepParams(1, vocab, **settings)
            want = fs.process_step(logits[b, node][None], one, state=after)[0]
            torch.testing.assert_close(got[b, node], want, rtol=0, atol=1e-6)


def test_bad_combinations_raise():
    probs = torch.softmax(torch.randn(1, 2, V), -1)
    with pytest.raises(ValueError, match="not both"):
        fs.verify_chain(probs, torch.tensor([[1]]), target_logits=probs, params=params_for(1))
    with pytest.raises(ValueError, match="state and token_bitmask go with"):
        fs.verify_chain(probs, torch.tensor([[1]]), state=fs.TokenStats.empty(1, V))
    with pytest.raises(ValueError, match="penalties and min-tokens need state"):
        fs.verify_chain(draft_token_ids=torch.tensor([[1]]), target_logits=probs,
                        params=params_for(1))  # fmt: skip


def law_cases():
    yield LawCase(f"verify_chain with penalties: first two tokens (V={V})", joint_law(),
                  DRAWS, CLAIM)  # fmt: skip


def _stepped(stats, params, logits_rows, path):
    """The processed distribution after stepping ``path`` (one token per row at a time, each
    moving mirostat's mu by its own processed probability): the reference of a position."""
    state = stats.select(torch.arange(stats.batch))
    for logits, token in zip(logits_rows, path, strict=False):
        p = fs.process_step(logits, params, state=state)
        ids = torch.tensor(token)[:, None]
        state.update(ids, probs=p.gather(1, ids), params=params)
    return state


def test_mirostat_positions_are_the_steps_after_their_drafts():
    """Mirostat's mu moves with each draft by its processed probability at its parent: every
    chain position and tree node equals the step after its path; ``update`` with the targets
    moves the state's mu as the steps did. Negative control: one mu for every position."""
    vocab, gen = 30, torch.Generator().manual_seed(8)
    settings = dict(temperature=1.0, mirostat_tau=torch.tensor([2.0, 3.0, 0.0]),
                    mirostat_eta=0.5, typical_p=0.95)  # fmt: skip
    params = fs.StepParams(3, vocab, **settings)
    stats = fs.TokenStats.from_prompts([[1, 2], [3], []], vocab, history=8)
    stats.mirostat_mu = torch.tensor([3.0, float("nan"), float("nan")])
    logits = torch.randn(3, 4, vocab, generator=gen) * 2
    drafts = torch.randint(0, vocab, (3, 3), generator=gen)
    got = targets.processed_positions(logits, targets.chain_prefixes(drafts), params, stats, None)
    for j in range(4):
        state = _stepped(stats, params, [logits[:, i] for i in range(j)],
                         [drafts[:, i].tolist() for i in range(j)])  # fmt: skip
        want = fs.process_step(logits[:, j], params, state=state)
        torch.testing.assert_close(got[:, j], want, rtol=0, atol=1e-6)
    # After verification: the emitted tokens' probabilities read from the targets.
    emitted = torch.cat((drafts[:, :2], torch.full((3, 2), -1)), 1)
    after = stats.select(torch.arange(3))
    after.update(emitted, probs=got, params=params)
    first_two = [drafts[:, 0].tolist(), drafts[:, 1].tolist()]
    want = _stepped(stats, params, [logits[:, 0], logits[:, 1]], first_two)
    torch.testing.assert_close(after.mirostat_mu, want.mirostat_mu, equal_nan=True)
    # A tree: node n's path from the root; siblings share their parent's mu.
    parents = [-1, 0, 0, 1]
    tokens = torch.cat((torch.zeros(3, 1, dtype=torch.int64), drafts), 1)
    tree_got = targets.processed_positions(logits, targets.tree_prefixes(tokens, parents),
                                           params, stats, None, parents)  # fmt: skip
    for node, path in enumerate(([], [1], [2], [1, 3])):
        state = _stepped(stats, params, [logits[:, 0]] + [logits[:, n] for n in path[:-1]],
                         [tokens[:, n].tolist() for n in path])  # fmt: skip
        want = fs.process_step(logits[:, node], params, state=state)
        torch.testing.assert_close(tree_got[:, node], want, rtol=0, atol=1e-6)
    # Negative control: the state's mu at every position differs where drafts moved it.
    frozen = torch.stack([fs.process_step(logits[:, j], params, state=stats,
                                          extra=targets.chain_prefixes(drafts)[:, j],
                                          mirostat_mu=stats.mirostat_mu)
                          for j in range(4)], 1)  # fmt: skip
    assert (frozen[:2, 1:] - got[:2, 1:]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="mirostat_mu"):
        fs.process_step(logits[:, 1], params, state=stats, extra=drafts[:, :1])
