"""``python -m fastsample bench --controls``: sampling controls against an HF-style pipeline.

Input: float32 logits, ``N(0, 3^2)`` per entry (seeded), ``B x V`` (default 64 x 128256).
For each setting (temperature, top-k, top-p, min-p, greedy, and all four as per-row
tensors) the same call is timed, round-robin in one process, for:

* ``hf``: the pipeline of Hugging Face ``generate``, written here after its logits warpers
  (temperature divides; top-k masks below ``topk(k)[-1]``; top-p **sorts the vocabulary**,
  takes ``softmax().cumsum()`` and masks the tail; min-p masks below ``min_p * max`` of the
  softmax), then ``softmax`` and ``torch.multinomial``; greedy is ``argmax``;
* ``hf.transformers``: the same with the warpers of an installed ``transformers``
  (optional extra ``fastsample[peers]``; the row is skipped without it);
* ``vllm``, ``sglang``: the engines' own pure-PyTorch samplers (sort, cumsum, mask; vLLM's
  exponential race, SGLang's ``torch.multinomial``), written from their published code in
  :mod:`.peers` (no package needed), with per-row tensors as the engines pass them;
* ``llama.cpp``: llama.cpp's own sampler chain for the setting, through ``llama-cpp-python``
  where it is installed (:mod:`.llama_cpp_chain`: llama.cpp's default order, temperature last;
  one row at a time, the candidate array's fill included);
* ``fs``: :func:`fastsample.sample` with the same controls as Python scalars;
* ``fs.tensor``: the same controls as ``(B,)`` tensors (every stage runs for every row:
  what an engine with mixed requests pays).

In the setting ``T=0.7 k=50 p=0.9``, the engine step as an engine calls it
(:func:`fastsample.sample_step` with a :class:`~fastsample.StepParams` built once, per-row
tensors for the controls and the seeds, a ``(B,)`` step counter):

* ``fs.step``: the controls and the seeded draw;
* ``fs.step+pen+lp``: with repetition, frequency and presence penalties (1.1, 0.2, 0.1 per
  row; :class:`~fastsample.TokenStats` of 512 prompt and 128 output tokens a row) and the
  top-5 logprobs with the drawn tokens' ranks, processed;
* ``fs.step+pen+lp.raw``: the same with raw logprobs (vLLM's default);
* ``fs.step+pen``: the penalties without the logprobs, beside ``llama.cpp+pen``, llama.cpp's
  chain with its penalties (the same three values, over its default window of the last 64
  tokens) before the setting's samplers.

``--fresh N`` gives every call of every contender the next of ``N`` logits tensors (fresh
logits every call, as in an engine, where the logits are new each step: ``N >= 4`` keeps
them out of a 2-core machine's caches at B=64); the default reuses one.

Reported: the median of each, the speed-ups of ``fs`` and ``fs.tensor`` over ``hf``, ``vllm``
and ``sglang``, and the multiple of one read pass over the logits (``logits.sum(-1)``). Every
``--batch`` given is run in turn (default 64). With ``--busy N`` each setting is timed twice,
quiet and then beside ``N`` busy-loop processes (:mod:`.busy`; bounded, stopped at the end):
the ``busy ms`` column and the ``slowdown`` (busy / quiet) of every row show how a sampler
fares on a shared machine. With ``--cold`` each fastsample contender is also timed right
after a large unrelated workload, as an engine calls its sampler right after the model's
forward (:func:`cold_workloads`: a model-sized matmul, and HF's sort pipeline on other
logits): the ``matmul ms`` and ``sort ms`` columns, and ``cold`` (the larger of the two over
the steady median). Timing as in the main benchmark
(:func:`.harness.time_interleaved`), with every timed call right after untimed
calls of the same contender (:data:`WARM_S`): each is timed in its own steady state, as a
sampler called step after step, whichever contender ran before it (``hf`` and
``fs.tensor`` sweep enough memory to evict the logits, which made the others' medians depend
on how many rounds those two stayed in).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import TextIO

import torch
from torch import Tensor

from ...ops import threads
from ...sampling import sample
from .busy import busy_loops
from .harness import LOGIT_SCALE, Call, Timing, pick_device, time_interleaved, timing_from_args
from .llama_cpp_chain import chain_call, controls_chain
from .peers import sglang_sample, vllm_sample
from .report import machine_info, save_json

WARM_S = 0.005
"""Untimed calls of a contender before each of its timed calls, in seconds (at least one)."""

SETTINGS: dict[str, dict[str, float | int]] = {
    "T=0.7 k=50 p=0.9": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
    # No top-k (the OpenAI API's default; issue 36): top-p alone takes its cut from the
    # entries above a sampled bound (ops/top_p_entries.py), min-p's few survivors take the
    # candidate path.
    "T=0.8 p=0.9": {"temperature": 0.8, "top_p": 0.9},
    "T=0.8 p=0.9 min_p=0.05": {"temperature": 0.8, "top_p": 0.9, "min_p": 0.05},
    "T=0.8 min_p=0.05": {"temperature": 0.8, "min_p": 0.05},
    "p=0.9": {"top_p": 0.9},
    "k=50": {"top_k": 50},
    "min_p=0.05": {"min_p": 0.05},
    "T=0.7": {"temperature": 0.7},
    "greedy": {"temperature": 0.0},
}
"""Setting name -> controls, in display order."""


# ---------------------------------------------------------------------------- HF-style


def hf_pipeline(logits: Tensor, controls: dict[str, float | int]) -> Tensor:
    """Token ids ``(B, 1)`` the way HF ``generate`` samples (warpers, softmax, multinomial)."""
    scores = logits
    temperature = controls.get("temperature", 1.0)
    if temperature == 0:
        return scores.argmax(-1, keepdim=True)
    if temperature != 1.0:
        scores = scores / temperature
    top_k = int(controls.get("top_k", 0))
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    top_p = float(controls.get("top_p", 1.0))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, order, remove), -torch.inf)
    min_p = float(controls.get("min_p", 0.0))
    if min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -torch.inf)
    return torch.multinomial(scores.softmax(-1), 1)


def transformers_pipeline(controls: dict[str, float | int]) -> Callable[[Tensor], Tensor] | None:
    """The same with ``transformers``' own warpers, or None if it is not installed."""
    try:
        from transformers import (
            LogitsProcessorList,
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )
    except Exception:  # not installed (optional extra), or an incompatible version
        return None
    temperature = controls.get("temperature", 1.0)
    if temperature == 0:
        return lambda logits: logits.argmax(-1, keepdim=True)
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if controls.get("top_k"):
        warpers.append(TopKLogitsWarper(int(controls["top_k"])))
    if controls.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(float(controls["top_p"])))
    if controls.get("min_p", 0.0) > 0:
        warpers.append(MinPLogitsWarper(float(controls["min_p"])))

    def call(logits: Tensor) -> Tensor:
        scores = warpers(None, logits)  # type: ignore[arg-type]
        return torch.multinomial(scores.softmax(-1), 1)

    return call


# ---------------------------------------------------------------------------- running


def tensor_controls(controls: dict[str, float | int], batch: int, device: torch.device) -> dict:
    """The same controls as ``(B,)`` tensors."""
    out: dict[str, Tensor] = {}
    for name, value in controls.items():
        dtype = torch.int64 if name == "top_k" else torch.float32
        out[name] = torch.full((batch,), value, dtype=dtype, device=device)
    return out


@dataclass
class Row:
    setting: str
    contender: str
    median_ms: float | None
    speedup_vs_hf: float | None = None
    read_passes: float | None = None
    speedup_vs_vllm: float | None = None
    speedup_vs_sglang: float | None = None
    speedup_vs_llama_cpp: float | None = None  # llama.cpp's chain, where it is installed
    busy_ms: float | None = None  # the median beside --busy N busy loops
    slowdown: float | None = None  # busy_ms / median_ms
    batch: int | None = None
    after_matmul_ms: float | None = None  # --cold: the median right after each workload
    after_sort_ms: float | None = None
    cold: float | None = None  # the larger of the two / median_ms


PEERS = {"hf": "speedup_vs_hf", "vllm": "speedup_vs_vllm", "sglang": "speedup_vs_sglang"}
"""The sort-based pipelines every fastsample row is compared with, and its field for each."""

LLAMA_CPP = {"fs.step+pen": "llama.cpp+pen"}
"""The llama.cpp chain a fastsample row is compared with where not ``llama.cpp``."""

ALWAYS = ("read_pass", *PEERS, "llama.cpp", "llama.cpp+pen")
"""Contenders that run whatever ``--contender`` says: the ratios need them."""


STEP_SETTING = "T=0.7 k=50 p=0.9"
"""The setting whose rows include the engine step (``fs.step*``)."""

PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1}
"""The step rows' penalties (every row), and llama.cpp's chain's beside them."""

PROMPT_TOKENS, OUTPUT_TOKENS = 512, 128
"""Tokens a row of the step rows' TokenStats has seen (prompt, output)."""


def _cycle(pool: list[Tensor]) -> Callable[[], Tensor]:
    """The next tensor of ``pool`` at every call (round-robin)."""
    state = [-1]

    def next_logits() -> Tensor:
        state[0] = (state[0] + 1) % len(pool)
        return pool[state[0]]

    return next_logits


def step_calls(
    controls: dict, nxt: Callable[[], Tensor], batch: int, vocab: int, device: torch.device
) -> dict:
    """The engine-step contenders (module docstring), on ``nxt()`` logits."""
    from ...stages import StepParams, TokenStats, sample_step

    gen = torch.Generator(device="cpu").manual_seed(1)
    rows = {name: torch.full((batch,), value, device=device) for name, value in controls.items()}
    rows["top_k"] = rows["top_k"].long()
    seeded = dict(rows, seed=torch.arange(batch, device=device) * 7919 + 1)
    step = torch.zeros(batch, dtype=torch.int64, device=device)
    seen = torch.randint(0, vocab, (batch, PROMPT_TOKENS + OUTPUT_TOKENS), generator=gen)
    stats = TokenStats.from_prompts(
        seen[:, :PROMPT_TOKENS].to(device), vocab, outputs=seen[:, PROMPT_TOKENS:].to(device)
    )
    penalties = {
        name: torch.full((batch,), value, device=device) for name, value in PENALTIES.items()
    }
    plain = StepParams(batch, vocab, device=device, **seeded)
    calls: dict[str, Call] = {"fs.step": lambda: sample_step(nxt(), params=plain, step=step)}
    penalized = StepParams(batch, vocab, device=device, **seeded, **penalties)
    calls["fs.step+pen"] = lambda: sample_step(nxt(), params=penalized, state=stats, step=step)
    if device.type == "cpu":
        chain = chain_call(nxt, vocab, controls_chain(controls, PENALTIES), seen[0].tolist())
        if chain is not None:
            calls["llama.cpp+pen"] = chain
    for label, mode in (("fs.step+pen+lp", "processed"), ("fs.step+pen+lp.raw", "raw")):
        params = StepParams(
            batch, vocab, device=device, **seeded, **penalties, top_logprobs=5,
            logprobs_mode=mode, token_ranks=True,
        )  # fmt: skip
        calls[label] = lambda params=params: sample_step(
            nxt(), params=params, state=stats, step=step
        )
    return calls


def setting_calls(
    name: str,
    logits: Tensor,
    peers: bool = True,
    only: list[str] | None = None,
    pool: list[Tensor] | None = None,
) -> dict[str, Call]:
    """The contenders of one setting, in display order (``only``: fnmatch globs of the
    optional ones to keep; ``pool``: logits to cycle through, call after call, instead of
    ``logits`` alone)."""
    controls = SETTINGS[name]
    batch, vocab = logits.shape
    nxt = _cycle(pool or [logits])
    calls: dict[str, Call] = {
        "read_pass": lambda: nxt().sum(-1),
        "hf": lambda: hf_pipeline(nxt(), controls),
    }
    transformers_call = transformers_pipeline(controls) if peers else None
    if transformers_call is not None:
        calls["hf.transformers"] = lambda: transformers_call(nxt())
    calls["vllm"] = lambda: vllm_sample(nxt(), controls)
    calls["sglang"] = lambda: sglang_sample(nxt(), controls)
    if logits.device.type == "cpu":
        chain = chain_call(nxt, vocab, controls_chain(controls))
        if chain is not None:
            calls["llama.cpp"] = chain
    as_tensors = tensor_controls(controls, batch, logits.device)
    calls["fs"] = lambda: sample(nxt(), **controls)  # type: ignore[arg-type]
    calls["fs.tensor"] = lambda: sample(nxt(), **as_tensors)
    if name == STEP_SETTING:
        calls.update(step_calls(controls, nxt, batch, vocab, logits.device))
    if only:
        keep = [c for c in calls if c in ALWAYS or any(fnmatch(c, g) for g in only)]
        calls = {c: calls[c] for c in keep}
    return calls


COLD_HIDDEN, COLD_WIDTH = 4096, 14336
"""The matmul workload: ``(B, 4096) @ (4096, 14336)``, a 7-8B model's MLP projection (a
235 MB float32 weight read at every call)."""

COLD_ROUNDS = 6
"""Cold calls timed per contender and workload (the median is reported)."""


def cold_workloads(batch: int, vocab: int, device: torch.device) -> dict[str, Call]:
    """The large unrelated workloads a cold call follows (``--cold``), built once: a
    model-sized matmul and HF's sort pipeline (top-p 0.9) on logits of their own."""
    gen = torch.Generator(device=device).manual_seed(12345)
    hidden = torch.randn(batch, COLD_HIDDEN, generator=gen, device=device)
    weight = torch.randn(COLD_HIDDEN, COLD_WIDTH, generator=gen, device=device)
    other = torch.randn(max(batch, 64), vocab, generator=gen, device=device) * LOGIT_SCALE
    sort_controls = {"temperature": 0.7, "top_p": 0.9}
    return {
        "matmul": lambda: hidden @ weight,
        "sort": lambda: hf_pipeline(other, sort_controls),
    }


def cold_medians(
    calls: dict[str, Call], workloads: dict[str, Call], rounds: int = COLD_ROUNDS
) -> dict[str, dict[str, float]]:
    """Median ms of each fastsample contender's call right after each workload (two
    untimed calls of its own between rounds, so each round starts from its steady state)."""
    out: dict[str, dict[str, float]] = {}
    for contender, call in calls.items():
        if not contender.startswith("fs"):
            continue
        out[contender] = {}
        for name, workload in workloads.items():
            seconds = []
            for _ in range(rounds):
                call(), call()
                workload()
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
            out[contender][name] = statistics.median(seconds) * 1e3
    return out


def _medians(calls: dict[str, Call], device: torch.device, timing: Timing) -> dict[str, float]:
    times = time_interleaved(calls, device, timing, warm_s=WARM_S)
    return {contender: statistics.median(seconds) * 1e3 for contender, seconds in times.items()}


def run_setting(
    name: str,
    logits: Tensor,
    timing: Timing,
    peers: bool = True,
    busy: int = 0,
    only: list[str] | None = None,
    pool: list[Tensor] | None = None,
    workloads: dict[str, Call] | None = None,
) -> list[Row]:
    """Time every contender for one setting, interleaved (then right after each of
    ``workloads`` if given, and beside ``busy`` busy-loop processes if ``busy``); rows in
    display order."""
    calls = setting_calls(name, logits, peers, only, pool)
    # A quiet machine: no hold left from an earlier busy phase (fastsample.ops.threads).
    threads.forget_stalls()
    quiet = _medians(calls, logits.device, timing)
    cold = cold_medians(calls, workloads) if workloads else {}
    loaded = None
    if busy:
        with busy_loops(busy):
            loaded = _medians(calls, logits.device, timing)
    rows = []
    for contender, median in quiet.items():
        row = Row(name, contender, median, batch=logits.shape[0])
        if contender != "read_pass":
            row.read_passes = median / quiet["read_pass"]
        if contender.startswith("fs"):
            for peer, field in PEERS.items():
                setattr(row, field, quiet[peer] / median)
            chain = LLAMA_CPP.get(contender, "llama.cpp")
            if chain in quiet:
                row.speedup_vs_llama_cpp = quiet[chain] / median
        if loaded is not None:
            row.busy_ms = loaded[contender]
            row.slowdown = row.busy_ms / median
        if contender in cold:
            row.after_matmul_ms = cold[contender]["matmul"]
            row.after_sort_ms = cold[contender]["sort"]
            row.cold = max(cold[contender].values()) / median
        rows.append(row)
    return rows


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.3g}{unit}" if x < 100 else f"{x:.0f}{unit}"


HEADER = ("setting", "contender", "median ms", "vs hf", "vs vllm", "vs sglang", "vs llama.cpp",
          "read passes")  # fmt: skip
BUSY_HEADER = ("busy ms", "slowdown")
COLD_HEADER = ("matmul ms", "sort ms", "cold")


_WIDTH_LIST = (18, 19, 10, 8, 8, 9, 12, 11, 10, 9, 10, 9, 7)
WIDTHS = dict(zip(HEADER + BUSY_HEADER + COLD_HEADER, _WIDTH_LIST, strict=True))
"""Each column's width, by its header."""


def _line(cells: tuple[str, ...], columns: tuple[str, ...]) -> str:
    widths = [WIDTHS[c] for c in columns]
    return "  ".join(
        f"{c:<{w}}" if i < 2 else f"{c:>{w}}"
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ).rstrip()


def columns(busy: bool, cold: bool) -> tuple[str, ...]:
    """The table's headers: the base ones, then the busy and cold ones if measured."""
    return HEADER + (BUSY_HEADER if busy else ()) + (COLD_HEADER if cold else ())


def print_rows(rows: list[Row], out: TextIO, busy: bool = False, cold: bool = False) -> None:
    for r in rows:
        cells = (
            r.setting,
            r.contender,
            _fmt(r.median_ms),
            _fmt(r.speedup_vs_hf, "x"),
            _fmt(r.speedup_vs_vllm, "x"),
            _fmt(r.speedup_vs_sglang, "x"),
            _fmt(r.speedup_vs_llama_cpp, "x"),
            _fmt(r.read_passes, "x"),
        )
        if busy:
            cells += (_fmt(r.busy_ms), _fmt(r.slowdown, "x"))
        if cold:
            cells += (_fmt(r.after_matmul_ms), _fmt(r.after_sort_ms), _fmt(r.cold, "x"))
        print(_line(cells, columns(busy, cold)), file=out)
    print(file=out, flush=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m fastsample bench --controls``."""
    device = pick_device(args.device)
    batches = args.batch or [64]
    vocab = (args.vocab or [128256])[0]
    busy = getattr(args, "busy", None) or 0
    if busy < 0:
        raise SystemExit("--busy must be >= 0")
    globs = getattr(args, "setting", None)
    settings = [n for n in SETTINGS if not globs or any(fnmatch(n, g) for g in globs)]
    if not settings:
        raise SystemExit(f"--setting {' '.join(globs or [])} matches none of {list(SETTINGS)}")
    timing = timing_from_args(args)
    info = machine_info(device)
    cold = bool(getattr(args, "cold", False))
    load = f"; each setting also beside {busy} busy-loop processes" if busy else ""
    load += "; fastsample also right after a matmul and a sort pipeline (cold)" if cold else ""
    print(
        f"fastsample bench --controls: torch {info['torch']}, {info['device_name']} ({device}), "
        f"{info['torch_threads']} threads; float32 logits V={vocab}{load}\n"
    )
    rows: list[Row] = []
    start = time.perf_counter()
    fresh = max(1, getattr(args, "fresh", None) or 1)
    for batch in batches:
        gen = torch.Generator(device=device).manual_seed(args.seed)
        pool = [
            torch.randn(batch, vocab, generator=gen, device=device) * LOGIT_SCALE
            for _ in range(fresh)
        ]
        logits = pool[0]
        print(f"B={batch} V={vocab}" + (f", {fresh} logits tensors in turn" if fresh > 1 else ""))
        header = columns(bool(busy), cold)
        print(_line(header, header))
        workloads = cold_workloads(batch, vocab, device) if cold else None
        for name in settings:
            setting_rows = run_setting(
                name, logits, timing, busy=busy, only=args.contender, pool=pool,
                workloads=workloads,
            )  # fmt: skip
            print_rows(setting_rows, sys.stdout, busy=bool(busy), cold=cold)
            rows.extend(setting_rows)
    print(
        f"done in {time.perf_counter() - start:.1f} s. vs hf/vllm/sglang/llama.cpp: that "
        "pipeline's time / this time (llama.cpp's chain: where llama-cpp-python is installed; "
        "fs.step+pen against llama.cpp+pen); read passes: this time / one logits.sum(-1)"
        + ("; slowdown: busy ms / median ms" if busy else "")
        + ("; cold: the slower of matmul ms and sort ms / median ms" if cold else "")
    )
    if args.json:
        config = {"batch": batches, "vocab": vocab, "busy": busy, "fresh": fresh, "cold": cold}
        config["controls"] = {n: SETTINGS[n] for n in settings}
        save_json(args.json, rows, info, config)
        print(f"saved {args.json}")
    return 0
