"""Speculative decoding and structured outputs on Model Runner V2 under the shim.

* draft-model speculative decoding (the target as its own draft, 2 drafts a step), with
  greedy drafts (vLLM's default ``draft_sample_method``) and probabilistic ones: the runner
  verifies with MRV2's ``RejectionSampler``, drafts are proposed and accepted (vLLM's own
  counters), greedy output equals the model's argmax, a seeded request is reproducible;
* n-gram speculative decoding (MRV2's own n-gram proposer, which runs as Triton kernels):
  drafts are proposed, greedy output equals the model's argmax, a seeded request is
  reproducible;
* structured outputs (xgrammar; MRV2 writes the grammar's mask into the logits with a Triton
  kernel before sampling): a JSON schema and a regex come out as the grammar allows.

Probabilistic drafts, the n-gram proposer and the grammar mask need the shim's fix of Triton's
interpreter (a scalar comparison used as a mask); greedy draft-model drafts run without it.
"""

from __future__ import annotations

import json
import re

import pytest
from mrv2_helpers import engine_mrv2, model_runner, spec_counters, teacher_forced_argmax
from vllm_helpers import (
    PROMPT_SPEC,
    add_tokenizer,
    checkpoint,
    close,
    generated,
    speculative,
    tiny_llama,
    tokens_prompt,
)

PROMPTS = [PROMPT_SPEC, [5, 17, 3, 42, 9], [100, 200, 300]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


def run(llm, prompts, params):
    return generated(llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False))


@pytest.mark.parametrize("drafts", ["greedy", "probabilistic"])
def test_draft_model_speculative_decoding(path, drafts):
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    config = dict(speculative(path, drafts=2), draft_sample_method=drafts)
    llm = engine_mrv2(path, speculative_config=config, disable_log_stats=False)
    try:
        runner = model_runner(llm)
        assert isinstance(runner.rejection_sampler, RejectionSampler)
        assert runner.rejection_sampler.sampler is runner.sampler

        out = run(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        counters = spec_counters(llm)
        assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0
        expected, got = teacher_forced_argmax(path, PROMPTS, out)
        assert got == expected

        seeded = SamplingParams(temperature=0.8, seed=99, max_tokens=16, ignore_eos=True)
        alone = run(llm, [PROMPTS[0]], seeded)[0]
        other = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
        batch = generated(llm.generate([tokens_prompt(PROMPTS[1]), tokens_prompt(PROMPTS[0])],
                                       [other, seeded], use_tqdm=False))  # fmt: skip
        assert len(alone) == 16 and batch[1] == alone
        assert spec_counters(llm)["num_drafts"] > counters["num_drafts"]
    finally:
        close(llm)


def test_ngram_speculative_decoding(path):
    from vllm import SamplingParams

    config = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
              "prompt_lookup_max": 3}  # fmt: skip
    llm = engine_mrv2(path, speculative_config=config, disable_log_stats=False)
    try:
        prompts = [[5, 17, 3, 42, 9] * 3, [250, 3, 250, 3, 250, 3], [100, 200, 300]]
        out = run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        assert spec_counters(llm)["num_drafts"] > 0
        expected, got = teacher_forced_argmax(path, prompts, out)
        assert got == expected
        seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
        alone = run(llm, [prompts[0]], seeded)[0]
        other = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
        batch = generated(llm.generate([tokens_prompt(prompts[1]), tokens_prompt(prompts[0])],
                                       [other, seeded], use_tqdm=False))  # fmt: skip
        assert batch[1] == alone
    finally:
        close(llm)


def test_structured_outputs_with_xgrammar():
    pytest.importorskip("xgrammar", reason="xgrammar (vLLM's structured-output backend) is missing")
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    path = add_tokenizer(checkpoint("tokenizer"))
    # No free whitespace: the random model would otherwise fill max_tokens with it.
    llm = engine_mrv2(path, skip_tokenizer_init=False, max_num_seqs=16,
                      structured_outputs_config={"backend": "xgrammar",
                                                 "disable_any_whitespace": True})  # fmt: skip
    try:
        schema = {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
                  "properties": {"color": {"enum": ["red", "green", "blue"]},
                                 "ok": {"type": "boolean"}}}  # fmt: skip
        so = StructuredOutputsParams(json=schema)
        params = [SamplingParams(structured_outputs=so, max_tokens=40, temperature=0.0),
                  SamplingParams(structured_outputs=so, max_tokens=40, temperature=0.8, seed=5),
                  SamplingParams(max_tokens=8, temperature=1.0)]  # fmt: skip
        outs = llm.generate(["hello", "fox", "free"], params, use_tqdm=False)
        for out in outs[:2]:
            value = json.loads(out.outputs[0].text)
            assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
            assert set(value) == {"color", "ok"}

        regex = "(fox|dog|cat) [0-9]{2}"
        so = StructuredOutputsParams(regex=regex)
        outs = llm.generate(["x", "y", "z"], SamplingParams(structured_outputs=so, max_tokens=12,
                                                           temperature=0.9, seed=1),
                            use_tqdm=False)  # fmt: skip
        assert all(re.fullmatch(regex, out.outputs[0].text) for out in outs)
    finally:
        close(llm)
