"""``bench --engine vllm``'s runner table: the plugin's sampler step inside vLLM's two runners.

vLLM 0.32 builds Model Runner V2 (MRV2) by default on every GPU and the V1 runner on its CPU
build; the plugin hooks both. This part times the plugin's sampler call inside each runner on
the same batches: one child process (Python's ``-m`` of this module) applies the MRV2 CPU shim
(:mod:`fastsample.tools.mrv2_shim`: vLLM's own MRV2 bookkeeping then runs in Triton's
interpreter, which is why no vLLM-MRV2-versus-plugin ratio is reported on CPU), then runs a
tiny random Llama (``V = 128,256``) on each runner in turn (ABBA order, one engine at a time),
``B`` seeded requests of ``STEPS`` tokens each. Seeded requests draw the same tokens on both
runners (the plugin's seed contract), so both runners sample the same logits at every step.
Each sampler call (V1: ``FastsampleSampler.forward``; MRV2: ``FastsampleSamplerV2.__call__``)
is timed with ``perf_counter``; the first two steps of a batch (prefill and the plan's build)
are left out; medians over the decode steps of both rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

SETTINGS = {
    "T/k/p seeded": dict(temperature=0.7, top_k=50, top_p=0.9),
    "T/k/p seeded, rows differ": None,  # per row: T 0.6-0.9, k 40-60, p 0.85-0.95
    "T/k/p + penalties + 5 logprobs": dict(temperature=0.7, top_k=50, top_p=0.9, logprobs=5,
                                           repetition_penalty=1.1, frequency_penalty=0.2,
                                           presence_penalty=0.1),
}
STEPS = 12
ORDER = ("mrv2", "v1", "v1", "mrv2")
"""The engines, one after the other (one at a time in a process), in ABBA order."""
TARGET = 1.1
"""The MRV2 step with the plugin costs at most this multiple of the V1 plugin's step."""


@dataclass
class RunnerResult:
    setting: str
    batch: int
    v1_ms: float
    mrv2_ms: float
    steps: int
    ratio: float
    target: float = TARGET


def tiny_model(vocab: int) -> str:
    """A random Llama with head_dim 64 (vLLM's CPU attention), saved once per vocabulary."""
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(tempfile.gettempdir(), f"fastsample-bench-llama-{vocab}")
    if not os.path.exists(os.path.join(path, "config.json")):
        config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                             head_dim=64, max_position_embeddings=512, initializer_range=0.5,
                             tie_word_embeddings=False)  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            LlamaForCausalLM(config).save_pretrained(path)
    return path


def _params(setting: str, batch: int):
    from vllm import SamplingParams

    out = []
    for b in range(batch):
        settings = SETTINGS[setting]
        if settings is None:
            settings = dict(temperature=0.6 + 0.1 * (b % 4), top_k=40 + 10 * (b % 3),
                            top_p=0.85 + 0.05 * (b % 3))  # fmt: skip
        out.append(SamplingParams(**settings, seed=1000 + b, max_tokens=STEPS, ignore_eos=True))
    return out


def _timed(cls, name: str, times: list[float]):
    """Wrap ``cls.name`` to record each call's seconds (returns the original)."""
    original = getattr(cls, name)

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    setattr(cls, name, timed)
    return original


def _runner_steps(runner: str, path: str, batches: list[int], settings: list[str]) -> dict:
    import vllm.envs
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    from ...vllm import CALLS, runners
    from ...vllm.mrv2_sampler import FastsampleSamplerV2
    from ...vllm.sampler import FastsampleSampler

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "mrv2" else "0"
    vllm.envs.disable_envs_cache()
    cls, name = (FastsampleSamplerV2, "__call__") if runner == "mrv2" else \
        (FastsampleSampler, "forward")  # fmt: skip
    times: list[float] = []
    original = _timed(cls, name, times)
    llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
              max_num_seqs=max(batches), max_num_batched_tokens=4096,
              kv_cache_memory_bytes=256 << 20, dtype="float32", seed=0)  # fmt: skip
    out: dict = {}
    try:
        if runner not in runners()["built"]:
            raise SystemExit(f"vLLM did not build the {runner} runner with the plugin")
        for setting in settings:
            for batch in batches:
                prompts = [TokensPrompt(prompt_token_ids=[(7 * b + j) % 1000 + 3
                                                          for j in range(16)])
                           for b in range(batch)]  # fmt: skip
                before = CALLS["delegated"]
                times.clear()
                llm.generate(prompts, _params(setting, batch), use_tqdm=False)
                if CALLS["delegated"] != before:
                    raise SystemExit(f"{runner}: steps were handed to vLLM's own code")
                out[f"{setting}|{batch}"] = list(times[2:])
    finally:
        setattr(cls, name, original)
        llm.llm_engine.engine_core.shutdown()
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        vllm.envs.disable_envs_cache()
    return out


def child(argv: list[str]) -> None:
    """The child process: shim, both runners, JSON on the last line of stdout."""
    from .. import mrv2_shim

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_PLUGINS"] = "fastsample"
    mrv2_shim.install()
    request = json.loads(argv[0])
    path = tiny_model(request["vocab"])
    result: dict[str, dict[str, list[float]]] = {"mrv2": {}, "v1": {}}
    for runner in ORDER:  # ABBA: a drift of the machine's load falls on both runners alike
        steps = _runner_steps(runner, path, request["batches"], request["settings"])
        for key, times in steps.items():
            result[runner].setdefault(key, []).extend(times)
    print(json.dumps(result))


def measure_runners(batches: list[int], settings: list[str], vocab: int) -> list[RunnerResult]:
    """Run the child and read its step times."""
    request = json.dumps(dict(batches=batches, settings=settings, vocab=vocab))
    proc = subprocess.run([sys.executable, "-m", "fastsample.tools.bench.runners", request],
                          capture_output=True, text=True, timeout=3000)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the runner comparison failed:\n{proc.stderr[-3000:]}")
    times = json.loads(proc.stdout.strip().splitlines()[-1])
    results = []
    for setting in settings:
        for batch in batches:
            key = f"{setting}|{batch}"
            v1, mrv2 = times["v1"][key], times["mrv2"][key]
            v1_ms, mrv2_ms = statistics.median(v1) * 1e3, statistics.median(mrv2) * 1e3
            results.append(RunnerResult(setting, batch, v1_ms, mrv2_ms, min(len(v1), len(mrv2)),
                                        mrv2_ms / v1_ms))  # fmt: skip
    return results


def print_runners(results: list[RunnerResult]) -> None:
    print("\nthe plugin's sampler step inside each runner (same model, same seeded requests, so "
          f"the same logits every step; median of the decode steps; target MRV2/V1 <= {TARGET})")
    header = (f"{'setting':<32} {'B':>3} {'V1 ms':>8} {'MRV2 ms':>8} {'MRV2/V1':>8} "
              f"{'steps':>6}  target")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in results:
        verdict = "met" if r.ratio <= r.target else "MISSED"
        print(f"{r.setting:<32} {r.batch:>3} {r.v1_ms:>8.3f} {r.mrv2_ms:>8.3f} "
              f"{r.ratio:>7.2f}x {r.steps:>6}  <= {r.target}x: {verdict}", flush=True)


if __name__ == "__main__":
    child(sys.argv[1:])
