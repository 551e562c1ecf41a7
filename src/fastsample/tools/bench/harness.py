"""The measuring half of the benchmark, shared by every mode: inputs, interleaved timing,
extra memory of one call, and the options every mode reads (device, repeats).

Nothing here knows a mode or a contender by name: the modes import this module, never the
other way round (see :mod:`fastsample.tools.bench.cli`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGIT_SCALE = 3.0
"""Every mode's input logits are ``N(0, LOGIT_SCALE^2)``: rows like a model's next token."""

Call = Callable[[], Any]
"""A zero-argument callable that does one timed operation."""


# ---------------------------------------------------------------------------- inputs and rows


@dataclass(frozen=True, eq=False)
class Case:
    """One benchmark input: ``probs`` is ``(batch, vocab)`` of ``dtype`` on ``device``."""

    batch: int
    vocab: int
    dtype: str
    device: torch.device
    probs: Tensor
    seed: int = 0

    @property
    def label(self) -> str:
        return f"B={self.batch} V={self.vocab} {self.dtype}"


@dataclass(frozen=True)
class Contender:
    """One row of the benchmark.

    Attributes:
        name: the row's label (unique across the registry).
        build: ``build(case)`` returns the zero-argument callable to time on that case, or
            None if the contender does not apply to it (the row is then left out). Do any
            setup (extra tensors, generators, seeds) here: it is not timed.
        measure_memory: report the peak extra memory of one call (the ``mem`` column).
    """

    name: str
    build: Callable[[Case], Call | None]
    measure_memory: bool = False


@dataclass
class Result:
    """One row: a contender on a case. Times in milliseconds; None where it failed."""

    batch: int
    vocab: int
    dtype: str
    contender: str
    group: str
    median_ms: float | None
    min_ms: float | None
    repeats: int
    times_ms: list[float] = field(default_factory=list)
    extra_mem_fraction: float | None = None
    speedup_vs_multinomial: float | None = None
    read_passes: float | None = None
    error: str | None = None


def make_case(batch: int, vocab: int, dtype: str, device: torch.device, seed: int = 0) -> Case:
    """The input: softmax (in float32) of seeded N(0, 3^2) logits, cast to ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen, device=device) * LOGIT_SCALE
    probs = torch.softmax(logits, dim=-1).to(DTYPES[dtype])
    return Case(batch, vocab, dtype, device, probs, seed)


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Timing:
    """How long to time each contender."""

    warmup: int = 2
    min_repeats: int = 5
    max_repeats: int = 50
    budget_s: float = 0.3


QUICK_TIMING = Timing(warmup=1, min_repeats=3, max_repeats=20, budget_s=0.1)


def pick_device(name: str | None) -> torch.device:
    """``--device``: cuda if available unless told; an unavailable cuda is an error."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch.cuda.is_available() is False")
    return torch.device(name)


def timing_from_args(args: argparse.Namespace) -> Timing:
    """``--quick``, ``--warmup``, ``--min-repeats``, ``--repeats``, ``--budget``."""
    base = QUICK_TIMING if args.quick else Timing()
    timing = Timing(
        warmup=base.warmup if args.warmup is None else args.warmup,
        min_repeats=base.min_repeats if args.min_repeats is None else args.min_repeats,
        max_repeats=base.max_repeats if args.repeats is None else args.repeats,
        budget_s=base.budget_s if args.budget is None else args.budget,
    )
    if timing.warmup < 0 or timing.min_repeats < 1 or timing.max_repeats < 1:
        raise SystemExit("error: --warmup must be >= 0, --repeats and --min-repeats >= 1")
    return Timing(
        timing.warmup,
        min(timing.min_repeats, timing.max_repeats),
        timing.max_repeats,
        timing.budget_s,
    )


# ---------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(fn: Call, device: torch.device, seconds: float) -> None:
    """Untimed calls of ``fn``: at least one, until ``seconds`` have passed."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < seconds:
        fn()
    sync(device)


def _time_once(fn: Call, device: torch.device) -> float:
    """Seconds for one call, to completion on the device."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3


def time_interleaved(
    calls: dict[str, Call], device: torch.device, timing: Timing, warm_s: float = 0.0
) -> dict[str, list[float]]:
    """Time several calls round-robin: one call of each per round, until each has spent its
    budget (at least ``min_repeats``, at most ``max_repeats``). Seconds per call.

    Interleaving puts every contender under the same slow drifts of a shared machine (clock,
    other tenants), so the ratios between them hold better than with back-to-back blocks.
    With ``warm_s > 0``, every timed call follows untimed calls of the same contender (at
    least one, until ``warm_s`` seconds have passed): the steady state of a sampler called
    step after step, its input and buffers in cache. Without them a call that follows a
    contender sweeping hundreds of MB finds its input evicted (up to 2x slower on the 2-core
    CPU; a 32 MB read needs two or three reads to get back to full speed), so a contender's
    median depends on which contenders are still in the rounds.
    """
    for fn in calls.values():
        for _ in range(timing.warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    spent = dict.fromkeys(calls, 0.0)

    def wants_more(name: str) -> bool:
        count = len(times[name])
        if count >= timing.max_repeats:
            return False
        return count < timing.min_repeats or spent[name] < timing.budget_s

    while any(wants_more(name) for name in calls):
        for name, fn in calls.items():
            if wants_more(name):
                if warm_s > 0:
                    _warm_up(fn, device, warm_s)
                seconds = _time_once(fn, device)
                times[name].append(seconds)
                spent[name] += seconds
    return times


def run_case(
    case: Case,
    contenders: Sequence[Contender],
    timing: Timing,
    group_of: Mapping[str, str] | None = None,
) -> list[Result]:
    """Time all contenders that apply to ``case``, interleaved; one row each.

    ``group_of`` names each contender's group for the ``group`` field (``"?"`` if absent).
    """
    group_of = group_of or {}
    rows: dict[str, Result] = {}
    calls: dict[str, Call] = {}
    for contender in contenders:
        row = Result(
            case.batch,
            case.vocab,
            case.dtype,
            contender.name,
            group_of.get(contender.name, "?"),
            None,
            None,
            0,
        )
        try:
            fn = contender.build(case)
            if fn is None:
                continue
            fn()  # fail here, alone, rather than inside the interleaved loop
        except Exception as exc:  # an unsupported dtype or device: report it, keep going
            row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            rows[contender.name] = row
            continue
        rows[contender.name], calls[contender.name] = row, fn
    for name, seconds in time_interleaved(calls, case.device, timing).items():
        row = rows[name]
        row.times_ms = [t * 1e3 for t in seconds]
        row.repeats = len(row.times_ms)
        row.median_ms, row.min_ms = statistics.median(row.times_ms), min(row.times_ms)
    for contender in contenders:
        if contender.measure_memory and contender.name in calls:
            rows[contender.name].extra_mem_fraction = extra_memory_fraction(
                calls[contender.name], case.probs
            )
    return [rows[c.name] for c in contenders if c.name in rows]


# ---------------------------------------------------------------------------- memory


def _peak_above_final(deltas: Iterable[int]) -> int:
    """Peak of the running sum of signed byte deltas, minus its final value."""
    live = peak = 0
    for delta in deltas:
        live += delta
        peak = max(peak, live)
    return max(peak - live, 0)


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ start/stop log lines) for a while."""
    try:
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    except (OSError, ValueError):  # no fd 2 to redirect: just stay noisy
        yield
        return
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_extra_bytes(fn: Call) -> int:
    """Peak extra CPU bytes of one call, from the profiler's raw memory events."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    del out
    if not events:
        raise RuntimeError("the profiler recorded no memory events")
    events.sort(key=lambda e: e.start_ns())
    return _peak_above_final(e.nbytes() for e in events)


def _cuda_extra_bytes(fn: Call, device: torch.device) -> int:
    """Peak extra CUDA bytes of one call, from the caching allocator's peak counter."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    final = torch.cuda.memory_allocated(device)
    del out
    return max(peak - before - (final - before), 0)


def extra_memory_fraction(fn: Call, unit: Tensor) -> float | None:
    """Peak extra bytes of one call over the bytes of ``unit`` (the input, or the slice a
    mode counts in), on ``unit``'s device; None if not measurable there."""
    try:
        if unit.device.type == "cuda":
            extra = _cuda_extra_bytes(fn, unit.device)
        else:
            extra = _cpu_extra_bytes(fn)
    except Exception:  # any profiler or platform problem: report n/a, never crash
        return None
    return extra / (unit.numel() * unit.element_size())
