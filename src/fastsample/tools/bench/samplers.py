"""``python -m fastsample bench --samplers``: each new stage's cost on top of the engine step.

Input: float32 logits ``N(0, 3^2)`` (seeded), ``B x V`` for every ``--batch`` (default 1 and
64) at the first ``--vocab`` (default 128,256), fresh every call (``--fresh N`` tensors in
turn, default 4). Each request has a 512-token prompt (random ids) in a
:class:`~fastsample.TokenStats` keeping a 1,024-token history.

Contenders, all :func:`fastsample.sample_step` with one :class:`~fastsample.StepParams`:

* ``step``: the current stages in llama.cpp's defaults: temperature 0.8, top-k 40, top-p
  0.95, min-p 0.05, repetition penalty 1.1 (the baseline of every ratio);
* ``+typical``, ``+epsilon``, ``+eta``, ``+top_n_sigma``, ``+xtc``, ``+dynatemp``,
  ``+mirostat``, ``+last_n``, ``+dry``, ``+no_repeat``, ``+llama.cpp order``: one stage (or the
  order) on top of ``step``;
* ``all``: every new stage on, in llama.cpp's order.

Beside them, the peers' own code on the same logits, where it installs:

* ``hf.typical``, ``hf.epsilon``, ``hf.eta``, ``hf.no_repeat``: transformers' warper or
  processor alone on the ``(B, V)`` logits (then ``softmax`` and ``torch.multinomial``, as
  its sampling loop does);
* ``llama.cpp``: llama-cpp-python's sampler chain (penalties, DRY, top-n-sigma, top-k,
  typical, top-p, min-p, XTC, temp_ext, dist) applied row by row to a candidate array filled
  from the logits (the array's fill included: llama.cpp pays it every token).

Timed round-robin (:func:`~.harness.time_interleaved`): fastsample's rows and llama.cpp's in
the same rounds, transformers' in rounds of their own (their sorts would evict the next
call's logits). Reported: medians, and each row as a multiple of ``step`` (the issue's
targets: ``all`` at most 1.5x, each stage at most 1.15x).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...stages import StepParams, TokenStats, sample_step
from .harness import LOGIT_SCALE, Timing, pick_device, time_interleaved, timing_from_args
from .llama_cpp_chain import chain_call
from .report import machine_info, save_json

BASE = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
STAGES: dict[str, dict] = {
    "+typical": {"typical_p": 0.95},
    "+epsilon": {"epsilon_cutoff": 3e-4},
    "+eta": {"eta_cutoff": 1e-3},
    "+top_n_sigma": {"top_n_sigma": 2.0},
    "+xtc": {"xtc_probability": 0.5, "xtc_threshold": 0.1},
    "+dynatemp": {"dynatemp_range": 0.3},
    "+mirostat": {"mirostat_tau": 5.0},
    "+last_n": {"penalty_last_n": 64},
    "+dry": {"dry_multiplier": 0.8},
    "+no_repeat": {"no_repeat_ngram_size": 3},
    "+llama.cpp order": {"order": "llama.cpp"},
}
ALL = {k: v for stage in STAGES.values() for k, v in stage.items()} | {"order": "llama.cpp"}
PROMPT, HISTORY = 512, 1024


def _fastsample_calls(logits: list[Tensor], batch: int, vocab: int) -> dict[str, Callable]:
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, vocab, (batch, PROMPT), generator=gen)
    calls = {}
    turn = [0]
    for name, extra in {"step": {}, **STAGES, "all": ALL}.items():
        params = StepParams(batch, vocab, seed=torch.arange(batch), **BASE, **extra)
        state = TokenStats.from_prompts(prompts, vocab, history=HISTORY)

        def call(params=params, state=state) -> None:
            turn[0] += 1
            x = logits[turn[0] % len(logits)]
            sample_step(x, params=params, state=state, step=turn[0])

        calls[name] = call
    return calls


def _hf_calls(logits: list[Tensor], batch: int, vocab: int) -> dict[str, Callable]:
    try:
        from transformers.generation import logits_process as lp
    except ImportError:
        return {}
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, vocab, (batch, PROMPT), generator=gen)
    warpers = {
        "hf.typical": lp.TypicalLogitsWarper(0.95),
        "hf.epsilon": lp.EpsilonLogitsWarper(3e-4),
        "hf.eta": lp.EtaLogitsWarper(1e-3),
        "hf.no_repeat": lp.NoRepeatNGramLogitsProcessor(3),
    }
    calls = {}
    turn = [0]
    for name, warper in warpers.items():

        def call(warper=warper) -> None:
            turn[0] += 1
            scores = warper(ids, logits[turn[0] % len(logits)].clone())
            torch.multinomial(torch.softmax(scores, -1), 1)

        calls[name] = call
    return calls


def _llama_cpp_call(logits: list[Tensor], vocab: int) -> dict[str, Callable]:
    """llama.cpp's chain with every stage (module docstring), where ``llama_cpp`` installs."""

    def samplers(lc: Any, vocab: int) -> list:
        return [
            lc.llama_sampler_init_penalties(vocab, 64, 1.1, 0.0, 0.0),
            lc.llama_sampler_init_dry(None, 0.8, 1.75, 2, 64, None, 0),
            lc.llama_sampler_init_top_n_sigma(2.0), lc.llama_sampler_init_top_k(40),
            lc.llama_sampler_init_typical(0.95, 0), lc.llama_sampler_init_top_p(0.95, 0),
            lc.llama_sampler_init_min_p(0.05, 0), lc.llama_sampler_init_xtc(0.5, 0.1, 0, 1),
            lc.llama_sampler_init_temp_ext(0.8, 0.3, 1.0), lc.llama_sampler_init_dist(1),
        ]  # fmt: skip

    history = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(7))
    turn = [0]

    def next_logits() -> Tensor:
        turn[0] += 1
        return logits[turn[0] % len(logits)]

    call = chain_call(next_logits, vocab, samplers, history[-64:].tolist())
    return {} if call is None else {"llama.cpp": call}


def run(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    if device.type != "cpu":
        print("bench --samplers measures the CPU path; bench --launches counts the Triton "
              "step's launches with every stage on")
        return 2
    timing: Timing = timing_from_args(args)
    vocab = (args.vocab or [128256])[0]
    rows = []
    for batch in args.batch or [1, 64]:
        gen = torch.Generator().manual_seed(args.seed)
        fresh = max(1, args.fresh or 4)
        logits = [torch.randn(batch, vocab, generator=gen) * LOGIT_SCALE for _ in range(fresh)]
        calls = _fastsample_calls(logits, batch, vocab)
        calls |= _llama_cpp_call(logits, vocab)
        times = time_interleaved(calls, device, timing)
        # transformers' warpers sort the vocabulary (hundreds of MB a call at B=64): in the
        # same rounds the call after them would find its logits evicted, so their own rounds.
        times |= time_interleaved(_hf_calls(logits, batch, vocab), device, timing)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"\nB={batch} V={vocab} ({machine_info(device)['cpu_model']})")
        print(f"{'contender':<18} {'median ms':>10} {'vs step':>8}")
        for name, ms in medians.items():
            ratio = ms / medians["step"]
            print(f"{name:<18} {ms:>10.3f} {ratio:>7.2f}x")
            rows.append({"batch": batch, "vocab": vocab, "contender": name, "median_ms": ms,
                         "vs_step": ratio})  # fmt: skip
    if args.json:
        save_json(args.json, rows, machine_info(device), {"mode": "samplers"})
    return 0
