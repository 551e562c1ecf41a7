"""Model Runner V2 runs end to end on the CPU under the shim (``mrv2_shim``).

* vLLM picks MRV2 by default, as on a GPU (no ``VLLM_USE_V2_MODEL_RUNNER``): Triton counts as
  usable, and the engine's runner is MRV2's CPU runner with MRV2's ``Sampler`` (or a
  subclass: the plugin's), not the V1 runner;
* greedy ``LLM.generate`` gives the model's argmax tokens (checked against transformers);
* a seeded request at temperature 0.8 draws the same tokens again, alone and in a batch;
* the shim itself: idempotent, and its fix of Triton's interpreter (a comparison of scalars
  used as a mask) holds.
"""

from __future__ import annotations

import inspect
import os

import pytest
from mrv2_helpers import engine_mrv2, is_mrv2, model_runner, teacher_forced_argmax
from vllm_helpers import VOCAB, close, generated, tiny_llama, tokens_prompt

PROMPTS = [[5, 17, 3, 42, 9], [100, 200, 300], [7] * 12, [400, 401, 402, 403, 404, 405, 406]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def llm(path):
    llm = engine_mrv2(path)
    yield llm
    close(llm)


def run(llm, prompts, params):
    return generated(llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False))


def test_vllm_picks_model_runner_v2_by_default(llm):
    import vllm.triton_utils
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as MRV2Runner
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    assert vllm.triton_utils.HAS_TRITON and not topk_topp.HAS_TRITON
    assert llm.llm_engine.vllm_config.use_v2_model_runner
    runner = model_runner(llm)
    assert runner is llm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert is_mrv2(runner) and isinstance(runner, MRV2Runner) and not isinstance(runner, V1Runner)
    source = inspect.getfile(type(runner)).replace(os.sep, "/")
    assert source.endswith("vllm/v1/worker/cpu/model_runner.py"), source
    assert isinstance(runner.sampler, Sampler) and runner.rejection_sampler is None


def test_greedy_generation_gives_the_models_argmax_tokens(llm, path):
    out = run(llm, PROMPTS, _params(temperature=0.0, max_tokens=6))
    assert all(len(tokens) == 6 and all(0 <= t < VOCAB for t in tokens) for tokens in out)
    assert run(llm, PROMPTS, _params(temperature=0.0, max_tokens=6)) == out
    # Teacher-forced: each token is transformers' argmax after the prompt and the tokens
    # before it.
    expected, got = teacher_forced_argmax(path, PROMPTS, out)
    assert got == expected


def test_a_seeded_request_at_temperature_08_is_reproducible(llm):
    seeded = _params(temperature=0.8, seed=4242, max_tokens=20)
    alone = run(llm, [PROMPTS[0]], seeded)[0]
    assert run(llm, [PROMPTS[0]], seeded)[0] == alone
    neighbours = [_params(temperature=1.0, max_tokens=3), _params(temperature=0.0, max_tokens=9),
                  _params(temperature=0.7, seed=7, max_tokens=30)]  # fmt: skip
    batch = generated(llm.generate(
        [tokens_prompt(p) for p in [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]]],
        [neighbours[0], seeded, neighbours[1], neighbours[2]], use_tqdm=False,
    ))  # fmt: skip
    assert batch[1] == alone
    assert run(llm, [PROMPTS[0]], _params(temperature=0.8, seed=4243, max_tokens=20))[0] != alone


def test_the_shim_is_idempotent_and_comparisons_are_int1_under_the_interpreter():
    import torch
    import triton
    import triton.language as tl
    from triton.backends import backends

    from fastsample.tools import mrv2_shim

    backend = backends["cpu"]
    mrv2_shim.install()
    assert mrv2_shim.installed() and backends["cpu"] is backend
    assert backend.driver.is_active()
    assert backend.driver().get_current_target().backend == "cpu"

    @triton.jit
    def masked_fill(out_ptr, flag_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        # A scalar comparison broadcast into a mask: Triton 3.9's interpreter hands it to
        # the store as int32 ("mask has unsupported dtype") without the shim's fix.
        active = tl.load(flag_ptr) > 0
        tl.store(out_ptr + offsets, 1.0, mask=active & (offsets < n))

    out = torch.zeros(16)
    masked_fill[(1,)](out, torch.tensor([1], dtype=torch.int32), 5, BLOCK=16)
    assert out.tolist() == [1.0] * 5 + [0.0] * 11


def _params(**settings):
    from vllm import SamplingParams

    return SamplingParams(ignore_eos=True, **settings)
