"""The new stages on their exact boundaries, deterministically (no statistics).

* bitmask: the tokens at word edges (31, 32, 63, 64) and the last, partial word (V = 70:
  six bits of word 2; the unused high bits of that word never matter), a word of -1 (all
  allowed), a word of 0, bit 31 of a word (the sign bit of an int32); ``bitmask_indices``
  rows only; combined with allowed ids (intersection);
* bias: on a masked token it stays masked; duplicates add; padding (-1) changes nothing;
* min-tokens: active while ``output_len < min_tokens`` exactly (off at equality);
* penalties: a logit of exactly 0 (neither divided nor multiplied: 0 either way), a token
  seen only in the prompt (repetition yes, frequency and presence no), counts 1 and 2;
* greedy after the stages: the argmax of the staged logits, ties by the lower index.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fastsample as fs
from fastsample.ops import bitmask
from stage_reference import Row, stage_logits

INF = math.inf


def staged(x: torch.Tensor, params, **kwargs) -> torch.Tensor:
    """The staged logits as the controls see them: log of the processed distribution at T = 1
    (no cut), shifted to the row maximum; ``-inf`` where the step keeps nothing."""
    probs = fs.process_step(x, params, **kwargs)
    return probs.double().log()


def words_with(vocab: int, allowed: list[int]) -> torch.Tensor:
    bits = torch.zeros(1, vocab, dtype=torch.bool)
    bits[0, allowed] = True
    return bitmask.pack(bits)


@pytest.mark.parametrize(
    "allowed", [[31], [32], [63], [64], [69], [0, 31, 32, 63, 64, 69], list(range(64, 70))]
)
def test_bitmask_word_edges_and_the_partial_last_word(allowed):
    vocab = 70
    x = torch.zeros(1, vocab)
    words = words_with(vocab, allowed)
    words[0, -1] |= torch.tensor(-(2**31), dtype=torch.int32)  # bits past V: ignored
    got = fs.process_step(x, fs.StepParams(1, vocab), token_bitmask=words)
    assert torch.nonzero(got[0])[:, 0].tolist() == sorted(set(allowed))
    # The same words read MSB-first would allow other tokens: the layout is pinned.
    want = Row(bitmask_words=words[0].numpy())
    assert np.isfinite(stage_logits(np.zeros(vocab), want)).nonzero()[0].tolist() == sorted(
        set(allowed)
    )


def test_bitmask_whole_words_sign_bit_and_indices():
    vocab = 64
    x = torch.zeros(3, vocab)
    words = torch.tensor([[-1, 0], [0, -(2**31)], [1, 1]], dtype=torch.int32)
    got = fs.process_step(x, fs.StepParams(3, vocab), token_bitmask=words)
    assert (got[0, :32] > 0).all() and (got[0, 32:] == 0).all()  # -1: all 32, 0: none
    assert torch.nonzero(got[1])[:, 0].tolist() == [63]  # bit 31 of word 1, the sign bit
    assert torch.nonzero(got[2])[:, 0].tolist() == [0, 32]
    # Only row 1 is masked, by the bitmask's row 1 (xgrammar's indices); rows 0, 2 keep all.
    for indices in ([1], torch.tensor([1])):
        got = fs.process_step(x, fs.StepParams(3, vocab), token_bitmask=words,
                              bitmask_indices=indices)  # fmt: skip
        assert (got[[0, 2]] > 0).all() and torch.nonzero(got[1])[:, 0].tolist() == [63]
    # An index beyond the rows matches none (a tensor: no sync to check it).
    got = fs.process_step(x, fs.StepParams(3, vocab), token_bitmask=words,
                          bitmask_indices=torch.tensor([7]))  # fmt: skip
    assert (got > 0).all()


def test_bitmask_and_allowed_ids_intersect():
    vocab = 40
    params = fs.StepParams(2, vocab, allowed_token_ids=[[1, 2, 33, 39], None])
    words = torch.cat([words_with(vocab, [2, 3, 33]), words_with(vocab, [5])])
    got = fs.process_step(torch.zeros(2, vocab), params, token_bitmask=words)
    assert torch.nonzero(got[0])[:, 0].tolist() == [2, 33]
    assert torch.nonzero(got[1])[:, 0].tolist() == [5]
    # Nothing left: the row is invalid (all zeros), the other row untouched.
    params = fs.StepParams(2, vocab, allowed_token_ids=[[1], None])
    out = fs.sample_step(torch.zeros(2, vocab), params=params, token_bitmask=words)
    assert out.valid.tolist() == [False, True] and out.token_ids[1, 0] == 5


def test_bias_on_a_masked_token_duplicates_and_padding():
    vocab = 8
    x = torch.zeros(1, vocab)
    ids = torch.tensor([[3, 3, 5, -1]])
    values = torch.tensor([[1.0, 0.5, 50.0, 100.0]])
    params = fs.StepParams(1, vocab, logit_bias=(ids, values), allowed_token_ids=[[0, 1, 2, 3]])
    got = staged(x, params)[0]
    assert got[5] == -INF  # +50 on a masked token: still masked
    assert got[3] - got[0] == pytest.approx(1.5, abs=1e-6)  # both entries of id 3 add up
    assert got[0] == got[1] == got[2]  # padding (-1, bias 100) changed nothing


@pytest.mark.parametrize(("emitted", "active"), [(0, True), (2, True), (3, False), (5, False)])
def test_min_tokens_is_active_strictly_below_the_minimum(emitted, active):
    vocab = 10
    params = fs.StepParams(1, vocab, min_tokens=3, stop_token_ids=[[2, 7]])
    got = staged(torch.zeros(1, vocab), params, output_len=torch.tensor([emitted]))[0]
    assert bool((got[[2, 7]] == -INF).all()) == active
    assert (got[[0, 1, 3]] > -INF).all()
    stats = fs.TokenStats.from_prompts([[]], vocab)
    stats.update(torch.tensor([[0] * emitted]) if emitted else torch.empty(1, 0, dtype=torch.long))
    assert torch.equal(staged(torch.zeros(1, vocab), params, state=stats)[0], got)


def test_penalties_at_zero_prompt_only_and_counts():
    vocab = 6
    x = torch.tensor([[0.0, 2.0, -2.0, 1.0, 1.0, 0.5]])
    stats = fs.TokenStats.from_prompts([[0, 1, 2]], vocab)  # prompt only: repetition only
    stats.update(torch.tensor([[3, 4, 4]]))  # counts 1 and 2
    params = fs.StepParams(1, vocab, repetition_penalty=2.0, frequency_penalty=0.25,
                           presence_penalty=0.5)  # fmt: skip
    probs = fs.process_step(x, params, state=stats).double()
    want = torch.tensor([0.0, 1.0, -4.0, 0.5 - 0.25 - 0.5, 0.5 - 0.5 - 0.5, 0.5],
                        dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(probs[0], torch.softmax(want, -1), rtol=0, atol=1e-7)


def test_greedy_reads_the_staged_logits_ties_by_the_lower_index():
    vocab = 6
    x = torch.tensor([[3.0, 1.0, 2.0, 2.5, 0.0, 2.0]])
    for bias, want in (({2: 1.0, 5: 1.0}, 0), ({5: 1.5}, 5)):  # a three-way tie at 3.0; 3.5
        params = fs.StepParams(1, vocab, temperature=0.0, logit_bias=[bias])
        out = fs.sample_step(x, params=params)
        assert out.token_ids[0, 0] == want and out.probs[0, 0] == 1 and out.valid.all()
