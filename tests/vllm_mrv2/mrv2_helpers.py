"""Helpers of the Model Runner V2 tests: where the runner lives, an engine that must be MRV2.

* :func:`model_runner` -- the engine's model runner object, in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``llm.llm_engine.engine_core.engine_core
  .model_executor.driver_worker.worker.model_runner`` (``llm.llm_engine.model_executor`` is
  the same executor in-process). Its ``sampler`` and ``rejection_sampler`` are the objects
  vLLM samples and verifies drafts with (``rejection_sampler`` is ``None`` without
  speculative decoding; ``speculator`` proposes the drafts).
* :func:`is_mrv2` -- whether a runner is MRV2's (``vllm/v1/worker/gpu/model_runner.py``,
  subclassed on CPU by ``vllm/v1/worker/cpu/model_runner.py``) rather than the V1 runner
  (``vllm/v1/worker/gpu_model_runner.py``, ``cpu_model_runner.py``).
* :func:`engine_mrv2` -- ``vllm_helpers.engine`` (MRV2 needs no other setting under the shim)
  that fails at once, naming the runner, when vLLM built another runner: vLLM falls back to
  V1 with only a warning for the features MRV2 lacks.
* :func:`spec_counters` -- vLLM's speculative-decoding counters (``disable_log_stats=False``).
* :func:`teacher_forced_argmax` -- transformers' greedy tokens for vLLM's greedy outputs.
* :func:`skip_unless_shim_installed` -- for a module imported outside pytest's collection of
  this folder, where ``conftest.py`` has not run: ``tests/test_power.py`` imports every module
  that judges a law, in the plain run too. Called before the module imports vLLM, it skips
  the module (``load`` there reads the skip as "not here") unless this process applied the
  shim.

Nothing here imports vLLM at import time (the folder's modules are collected, and skipped,
in runs without the shim).
"""

from __future__ import annotations

MRV2_MODULES = ("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")
"""Where MRV2's classes live (V1's runner modules are ``vllm.v1.worker.gpu_model_runner``
and ``vllm.v1.worker.cpu_model_runner``)."""


def skip_unless_shim_installed() -> None:
    import pytest

    from fastsample.tools import mrv2_shim

    if not mrv2_shim.installed():
        pytest.skip(
            "Model Runner V2 tests run alone, with the shim: FASTSAMPLE_MRV2=1 python -m pytest "
            "tests/vllm_mrv2", allow_module_level=True,
        )  # fmt: skip


def model_runner(llm):
    """The model runner of an in-process ``vllm.LLM``."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError(
            f"the engine core is not in this process ({type(client).__name__}): set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before building the engine"
        )
    return core.model_executor.driver_worker.worker.model_runner


def is_mrv2(runner) -> bool:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as MRV2Runner

    cls = type(runner)
    return isinstance(runner, MRV2Runner) and cls.__module__.startswith(MRV2_MODULES)


def engine_mrv2(path: str, **overrides):
    """``vllm_helpers.engine(path, **overrides)``, asserted to have built MRV2."""
    from vllm_helpers import close, engine

    llm = engine(path, **overrides)
    runner = model_runner(llm)
    if not is_mrv2(runner):
        name = f"{type(runner).__module__}.{type(runner).__qualname__}"
        close(llm)
        raise AssertionError(
            f"vLLM built {name}, not Model Runner V2 (is the shim installed, or does MRV2 "
            "lack a feature of these settings? vLLM's log says which)"
        )
    return llm


def spec_counters(llm) -> dict[str, int]:
    """vLLM's ``vllm:spec_decode_*`` counters since the engine started (cumulative):
    ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``."""
    prefix = "vllm:spec_decode_"
    counters = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if metric.name.startswith(prefix) and isinstance(value, int | float):
            counters[metric.name.removeprefix(prefix)] = int(value)
    return counters


def teacher_forced_argmax(path: str, prompts: list[list[int]], outputs: list[list[int]]):
    """``(expected, got)``: transformers' argmax after each prompt and the tokens generated
    before each position, beside the generated tokens, both flattened."""
    from vllm_helpers import next_token_logits

    contexts = [
        prompt + tokens[:i] for prompt, tokens in zip(prompts, outputs, strict=True)
        for i in range(len(tokens))
    ]  # fmt: skip
    expected = next_token_logits(path, contexts).argmax(dim=-1).tolist()
    return expected, [t for tokens in outputs for t in tokens]
