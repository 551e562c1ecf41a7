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
* ``fs``: :func:`fastsample.sample` with the same controls as Python scalars;
* ``fs.tensor``: the same controls as ``(B,)`` tensors (every stage runs for every row:
  what an engine with mixed requests pays).

Reported: the median of each, the speed-up of ``fs`` over ``hf`` and the multiple of one
read pass over the logits (``logits.sum(-1)``). Timing as in the main benchmark
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
from typing import TextIO

import torch
from torch import Tensor

from ...sampling import sample
from .harness import LOGIT_SCALE, Call, Timing, pick_device, time_interleaved, timing_from_args
from .report import machine_info, save_json

WARM_S = 0.005
"""Untimed calls of a contender before each of its timed calls, in seconds (at least one)."""

SETTINGS: dict[str, dict[str, float | int]] = {
    "T=0.7 k=50 p=0.9": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
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


def run_setting(name: str, logits: Tensor, timing: Timing, peers: bool = True) -> list[Row]:
    """Time every contender for one setting, interleaved; rows in display order."""
    controls = SETTINGS[name]
    batch = logits.shape[0]
    calls: dict[str, Call] = {
        "read_pass": lambda: logits.sum(-1),
        "hf": lambda: hf_pipeline(logits, controls),
    }
    transformers_call = transformers_pipeline(controls) if peers else None
    if transformers_call is not None:
        calls["hf.transformers"] = lambda: transformers_call(logits)
    as_tensors = tensor_controls(controls, batch, logits.device)
    calls["fs"] = lambda: sample(logits, **controls)  # type: ignore[arg-type]
    calls["fs.tensor"] = lambda: sample(logits, **as_tensors)
    medians = {
        contender: statistics.median(times) * 1e3
        for contender, times in time_interleaved(
            calls, logits.device, timing, warm_s=WARM_S
        ).items()
    }
    rows = []
    for contender, median in medians.items():
        row = Row(name, contender, median)
        if contender != "read_pass":
            row.read_passes = median / medians["read_pass"]
        if contender.startswith("fs"):
            row.speedup_vs_hf = medians["hf"] / median
        rows.append(row)
    return rows


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.3g}{unit}" if x < 100 else f"{x:.0f}{unit}"


def print_rows(rows: list[Row], out: TextIO) -> None:
    for r in rows:
        cells = (
            f"{r.setting:<18}",
            f"{r.contender:<16}",
            f"{_fmt(r.median_ms):>10}",
            f"{_fmt(r.speedup_vs_hf, 'x'):>9}",
            f"{_fmt(r.read_passes, 'x'):>11}",
        )
        print("  ".join(cells).rstrip(), file=out)
    print(file=out, flush=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m fastsample bench --controls``."""
    device = pick_device(args.device)
    batch = (args.batch or [64])[0]
    vocab = (args.vocab or [128256])[0]
    timing = timing_from_args(args)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    logits = torch.randn(batch, vocab, generator=gen, device=device) * LOGIT_SCALE
    info = machine_info(device)
    print(
        f"fastsample bench --controls: torch {info['torch']}, {info['device_name']} ({device}), "
        f"{info['torch_threads']} threads; float32 logits B={batch} V={vocab}\n"
    )
    header = ("setting", "contender", "median ms", "vs hf", "read passes")
    print(f"{header[0]:<18}  {header[1]:<16}  {header[2]:>10}  {header[3]:>9}  {header[4]:>11}")
    rows: list[Row] = []
    start = time.perf_counter()
    for name in SETTINGS:
        setting_rows = run_setting(name, logits, timing)
        print_rows(setting_rows, sys.stdout)
        rows.extend(setting_rows)
    print(
        f"done in {time.perf_counter() - start:.1f} s. vs hf: the HF-style pipeline's time / "
        "this time; read passes: this time / one logits.sum(-1)"
    )
    if args.json:
        save_json(args.json, rows, info, {"batch": batch, "vocab": vocab, "controls": SETTINGS})
        print(f"saved {args.json}")
    return 0
