"""The chain's new stages against Hugging Face transformers' own warpers and processors, on
the same logits (the module is skipped where transformers does not import).

Each stage claims Hugging Face's rule (:mod:`fastsample.ops.truncation`,
:mod:`fastsample.stages.history`), so the peer's code is the reference: the tokens it keeps
(finite after the warper) must be exactly the tokens :func:`fastsample.process_step` gives
probability > 0, and its softmax must match our probabilities to 1e-6.

* ``TypicalLogitsWarper(mass=p)``, ``EpsilonLogitsWarper(epsilon=e)``,
  ``EtaLogitsWarper(epsilon=e)`` (``min_tokens_to_keep`` at its default 1, which our stages
  also keep: the closest token, the most likely one; Eta's ``device`` at its default
  ``"cpu"``) on random float32 rows of several scales and on rows with many ties (logits on a
  grid of 0.5), V = 50 and 1000;
* the warpers in Hugging Face's order (temperature, top-k, top-p, typical, epsilon, eta) vs
  ``order="transformers"``;
* ``NoRepeatNGramLogitsProcessor(n)``, n = 1..4, with the whole context as ``input_ids``
  and ``TokenStats.from_prompts(..., history=H)`` holding all of it: the banned set (HF's
  ``-inf``) is our zero-probability set at T = 1. The contexts draw from a few tokens, so
  n-grams repeat; every other one uses token id 0 (an edit of token 0 was once lost to the
  scatter's placeholder writes: ``[3, 0, 3]`` with n = 2 banned nothing, HF bans 0).

No seed or setting was picked to dodge a float boundary: typical, epsilon and eta agreed,
kept sets exactly, on every seed tried (30 per vocabulary, ties included).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: its warpers are the reference"
)

VOCABS = (50, 1000)
SEEDS = (0, 1, 2)
SCALES = (0.3, 1.0, 3.0, 8.0, 0.3, 1.0, 3.0, 8.0)


def _logits(seed: int, vocab: int) -> torch.Tensor:
    """Rows of several scales, then two rows on a grid of 0.5 (many ties)."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(len(SCALES) + 2, vocab)) * np.array([*SCALES, 2.0, 2.0])[:, None]
    rows[len(SCALES) :] = np.round(rows[len(SCALES) :] * 2) / 2
    return torch.from_numpy(rows.astype(np.float32))


def _assert_same(theirs_scores: torch.Tensor, ours: torch.Tensor, what: str) -> None:
    """HF's kept set (finite scores) is ours (probability > 0); the probabilities agree."""
    kept = torch.isfinite(theirs_scores)
    assert torch.equal(ours > 0, kept), what
    torch.testing.assert_close(ours, theirs_scores.softmax(-1), rtol=0, atol=1e-6, msg=what)


def _warp(warpers, x: torch.Tensor) -> torch.Tensor:
    for w in warpers:
        x = w(None, x)
    return x


@pytest.mark.parametrize("vocab", VOCABS)
def test_typical_p_equals_transformers(vocab):
    for seed in SEEDS:
        x = _logits(seed, vocab)
        for p in (0.2, 0.5, 0.9, 0.99):
            theirs = transformers.TypicalLogitsWarper(mass=p)(None, x.clone())
            ours = fs.process_step(x, fs.StepParams(x.shape[0], vocab, typical_p=p))
            _assert_same(theirs, ours, f"seed {seed}, typical_p {p}")


@pytest.mark.parametrize("vocab", VOCABS)
def test_epsilon_and_eta_cutoff_equal_transformers(vocab):
    for seed in SEEDS:
        x = _logits(seed, vocab)
        for e in (3e-4, 1e-3, 0.01, 0.05):
            theirs = transformers.EpsilonLogitsWarper(epsilon=e)(None, x.clone())
            ours = fs.process_step(x, fs.StepParams(x.shape[0], vocab, epsilon_cutoff=e))
            _assert_same(theirs, ours, f"seed {seed}, epsilon {e}")
            theirs = transformers.EtaLogitsWarper(epsilon=e)(None, x.clone())
            ours = fs.process_step(x, fs.StepParams(x.shape[0], vocab, eta_cutoff=e))
            _assert_same(theirs, ours, f"seed {seed}, eta {e}")


# (temperature, top_k, top_p, typical_p, epsilon, eta); 0 / 1: off
HF_ORDER_SETTINGS = (
    (0.7, 40, 0.95, 0.5, 0, 0),
    (1.3, 200, 0.9, 0.9, 0, 0),
    (0.5, 10, 1.0, 0.3, 0, 0),
    (2.0, 0, 0.8, 0.95, 0, 0),
    (0.8, 30, 1.0, 0.7, 2.5e-4, 1e-3),
    (1.1, 0, 0.97, 0.8, 1e-3, 0.02),
)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("setting", HF_ORDER_SETTINGS, ids=str)
def test_chain_in_transformers_order_equals_warpers(vocab, setting):
    t, k, top_p, typical, eps, eta = setting
    T = transformers
    warpers = [T.TemperatureLogitsWarper(t)]
    warpers += [T.TopKLogitsWarper(k)] if k else []
    warpers += [T.TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [T.TypicalLogitsWarper(mass=typical)]
    warpers += [T.EpsilonLogitsWarper(epsilon=eps)] if eps else []
    warpers += [T.EtaLogitsWarper(epsilon=eta)] if eta else []
    for seed in SEEDS:
        x = _logits(seed, vocab)[: len(SCALES)]  # top-p breaks ties by sort order: none here
        params = fs.StepParams(x.shape[0], vocab, temperature=t, top_k=k or None, top_p=top_p,
                               typical_p=typical, epsilon_cutoff=eps, eta_cutoff=eta,
                               order="transformers")  # fmt: skip
        _assert_same(_warp(warpers, x.clone()), fs.process_step(x, params), f"seed {seed}")


def _contexts(seed: int, vocab: int) -> list[list[int]]:
    """Eight contexts of lengths 0 to 80, each drawn from 2 to 7 tokens (token 0 among them
    in every other one), so n-grams repeat."""
    rng = np.random.default_rng(seed)
    contexts = []
    for i, length in enumerate((0, 2, 5, 12, 30, 50, 70, 80)):
        alphabet = rng.choice(np.arange(1, vocab), size=int(rng.integers(2, 8)), replace=False)
        alphabet[0] = 0 if i % 2 else alphabet[0]
        contexts.append(rng.choice(alphabet, size=length).tolist())
    return contexts


def _no_repeat_both(contexts, vocab: int, n: int, seed: int):
    """(HF's processed scores, ours) for each context as ``input_ids``, at T = 1."""
    x = torch.from_numpy(np.random.default_rng(seed).normal(size=(len(contexts), vocab)) * 3)
    x = x.float()
    processor = transformers.NoRepeatNGramLogitsProcessor(n)
    theirs = torch.stack([processor(torch.tensor([c], dtype=torch.long), x[b : b + 1].clone())[0]
                          for b, c in enumerate(contexts)])  # fmt: skip
    state = fs.TokenStats.from_prompts(contexts, vocab, history=max(1, *map(len, contexts)))
    params = fs.StepParams(len(contexts), vocab, no_repeat_ngram_size=n)
    return theirs, fs.process_step(x, params, state=state)


@pytest.mark.parametrize("vocab", VOCABS)
def test_no_repeat_ngram_equals_transformers(vocab):
    for seed in SEEDS:
        contexts = _contexts(seed, vocab)
        for n in (1, 2, 3, 4):
            theirs, ours = _no_repeat_both(contexts, vocab, n, seed)
            _assert_same(theirs, ours, f"seed {seed}, n {n}")
            assert (ours == 0).any(), "the planted repeats ban tokens"
            assert n > 1 or (ours[1::2, 0] == 0).any(), "token 0 itself is banned"


def test_no_repeat_ngram_bans_token_zero():
    # [3, 0, 3], n = 2: the 2-gram (3, 0) occurred, so 0 is banned (it once was not).
    theirs, ours = _no_repeat_both([[3, 0, 3]], 8, 2, seed=0)
    assert torch.isinf(theirs[0]).nonzero().flatten().tolist() == [0]
    _assert_same(theirs, ours, "[3, 0, 3]")


def test_tensor_settings_equal_numbers_row_by_row():
    vocab, rows = 200, 8
    x = _logits(3, vocab)[:rows]
    contexts = _contexts(3, vocab)
    history = max(map(len, contexts))
    settings = {  # per row; the off values included (typical 1, cutoffs 0, n-gram size 0)
        "temperature": [0.7, 1.0, 1.5, 0.9, 1.2, 0.8, 1.0, 0.6],
        "typical_p": [0.5, 1.0, 0.9, 0.3, 1.0, 0.95, 0.7, 0.2],
        "epsilon_cutoff": [0.0, 1e-3, 0.0, 3e-4, 0.01, 0.0, 2e-3, 0.0],
        "eta_cutoff": [1e-3, 0.0, 0.02, 0.0, 3e-4, 0.0, 0.0, 0.05],
        "no_repeat_ngram_size": [0, 1, 2, 3, 4, 2, 0, 3],
    }
    tensors = {k: torch.tensor(v) for k, v in settings.items()}
    state = fs.TokenStats.from_prompts(contexts, vocab, history=history)
    batched = fs.process_step(x, fs.StepParams(rows, vocab, **tensors), state=state)
    for b in range(rows):
        one = {k: v[b] for k, v in settings.items()}
        state = fs.TokenStats.from_prompts(contexts[b : b + 1], vocab, history=history)
        alone = fs.process_step(x[b : b + 1], fs.StepParams(1, vocab, **one), state=state)
        assert torch.equal(batched[b : b + 1], alone), b
