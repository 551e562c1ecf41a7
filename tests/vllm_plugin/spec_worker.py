"""A separate process for the speculative-decoding negative control: vLLM's own rejection
sampler on CPU (vLLM 0.32), whose per-position temperature and top-p come from uninitialised
memory (vLLM issue #55005: the CPU ``expand`` kernel writes into a copy). After an exception
an in-process vLLM engine can spin forever, so this runs apart, under a timeout.

Run: ``python spec_worker.py '{"model": ..., "draws": N, "settings": {...}}'``; prints one
JSON line: ``{"pairs": [[t1, t2], ...]}`` or ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["VLLM_PLUGINS"] = "fastsample"


def first_two_tokens(model: str, draws: int, settings: dict, own_sampler: bool) -> list:
    from vllm import SamplingParams
    from vllm_helpers import PROMPT_SPEC, engine, speculative, tokens_prompt

    from fastsample.vllm import vllm_sampling

    llm = engine(model, max_num_seqs=256, max_num_batched_tokens=2048,
                 speculative_config=speculative(model))  # fmt: skip
    params = [SamplingParams(**settings, seed=i, max_tokens=2, ignore_eos=True)
              for i in range(draws)]  # fmt: skip
    prompts = [tokens_prompt(PROMPT_SPEC)] * draws
    if own_sampler:
        with vllm_sampling():
            outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids[:2]) for o in outs]


def main() -> int:
    job = json.loads(sys.argv[1])
    try:
        pairs = first_two_tokens(job["model"], job["draws"], job["settings"], job["own"])
        print(json.dumps({"pairs": pairs}), flush=True)
    except Exception as exc:  # reported to the test, which decides
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
    os._exit(0)  # skip the engine's teardown


if __name__ == "__main__":
    sys.exit(main())
