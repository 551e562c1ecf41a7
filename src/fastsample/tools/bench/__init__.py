"""``python -m fastsample bench``: fastsample against ``torch.multinomial``, side by side.

What is measured, per case (batch ``B`` x vocabulary ``V`` x dtype, input the softmax of
seeded random logits of scale 3, so rows look like a model's next-token distribution):

* ``read_pass``: ``probs.sum(-1)``, one read of the input. Any sampler has to look at
  every probability at least once, so this is the physical floor; every row is also shown as
  a multiple of it ("passes"). A sampler at 2-3 passes is close to what the memory allows.
* ``torch.multinomial``: ``torch.multinomial(probs, 1)``, what the speed-ups are against.
* ``eager_race``: the inference-engine helper fastsample replaces
  (``argmax(probs / Exp(1) noise)`` in eager PyTorch).
* ``fs.inverse_cdf``, ``fs.race``, ``fs.auto``: :func:`fastsample.sample_from_probs` with
  each ``method``; ``fs.fast_sample``: :func:`fastsample.fast_sample`.

Everything runs in one process, one case after the other, all contenders of a case on the
same input: absolute times depend on the machine, its load and its clocks, but ratios taken
within one run on one input are what carry over from machine to machine. That is why the
table reports the speed-up over ``torch.multinomial`` and the multiple of one read pass
next to each median.

Timing: a few warm-up calls (allocator, lazy init, kernel caches), then the contenders of a
case are timed round-robin, one call each per round, until each has spent its budget (at
least ``min_repeats``, at most ``max_repeats`` calls); the median is reported. Interleaving
exposes all contenders to the same drifts of a shared machine; slow contenders simply
drop out of the rounds earlier. On CUDA each timed call is
bracketed by ``torch.cuda.synchronize`` and CUDA events, so the time is the call's
completion on the device, launch overhead included; on CPU it is ``time.perf_counter``.

Extra memory (the ``mem`` column, for fastsample rows): the peak of bytes allocated during
one call above what was live before it, minus what is still live when it returns (the
returned tensors, tiny next to the input), as a fraction of the input's bytes. On CUDA it
comes from ``torch.cuda.reset_peak_memory_stats``/``max_memory_allocated``. On CPU, where
torch keeps no peak counter, one call runs under
``torch.profiler.profile(profile_memory=True)``; the profiler's raw ``[memory]`` events
(``prof.profiler.kineto_results.events()``: signed allocation/free sizes with timestamps,
including allocations made and freed inside one op) are summed in time order and the
running maximum is the peak. Where that is unavailable the column says ``n/a``.

Adding rows: contenders live in a registry of named groups (:data:`GROUPS`), each a list of
:class:`Contender` (a name and a ``build(case) -> callable`` factory). Call
:func:`register_group` to add a group; its rows appear after the existing ones, in every
case, in the table, the JSON and the plot.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import glob
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch
from torch import Tensor

from ...sampling import fast_sample, sample_from_probs

READ_PASS = "read_pass"
MULTINOMIAL = "torch.multinomial"

FULL_BATCHES = (1, 8, 64, 256)
FULL_VOCABS = (32000, 128256, 151936)
FULL_DTYPES = ("float32", "bfloat16")
QUICK_CASES = ((64, 128256, "float32"), (8, 32000, "bfloat16"))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGIT_SCALE = 3.0
DESCRIPTION = (__doc__ or "").split("\n\nAdding rows:", 1)[0]
"""The module docstring without the developer part: the ``bench --help`` description."""


# ---------------------------------------------------------------------------- registry


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


Call = Callable[[], Any]
"""A zero-argument callable that does one timed operation."""


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


GROUPS: dict[str, list[Contender]] = {}
"""The registry: group name -> its contenders, in display order (insertion order)."""


def register_group(name: str, contenders: Iterable[Contender], *, replace: bool = False) -> None:
    """Add a named group of contenders after the existing ones.

    Raises ``ValueError`` if the group exists (unless ``replace``) or a contender name is
    already taken by another group.
    """
    items = list(contenders)
    if name in GROUPS and not replace:
        raise ValueError(f"contender group {name!r} is already registered")
    names = [c.name for c in items]
    taken = {c.name for group, cs in GROUPS.items() if group != name for c in cs}
    clashes = sorted({n for n in names if n in taken or names.count(n) > 1})
    if clashes:
        raise ValueError(f"duplicate contender names in group {name!r}: {clashes}")
    GROUPS[name] = items


def all_contenders(patterns: Sequence[str] | None = None) -> list[Contender]:
    """Registered contenders in order; with ``patterns`` (fnmatch), only the matching ones
    plus the two references (``read_pass`` and ``torch.multinomial``) the ratios need."""
    contenders = [c for group in GROUPS.values() for c in group]
    if not patterns:
        return contenders
    keep = {READ_PASS, MULTINOMIAL}
    return [
        c for c in contenders if c.name in keep or any(fnmatch.fnmatch(c.name, p) for p in patterns)
    ]


def _eager_race(probs: Tensor) -> tuple[Tensor, Tensor]:
    """The original inference-engine helper, verbatim."""
    q = torch.empty_like(probs).exponential_(1)
    idx = (probs / q).argmax(-1, keepdim=True)
    return probs.gather(1, idx), idx


def _baselines() -> list[Contender]:
    return [
        Contender(READ_PASS, lambda case: lambda: case.probs.sum(-1)),
        Contender(MULTINOMIAL, lambda case: lambda: torch.multinomial(case.probs, 1)),
        Contender("eager_race", lambda case: lambda: _eager_race(case.probs)),
    ]


def _method(method: str) -> Callable[[Case], Call]:
    return lambda case: lambda: sample_from_probs(case.probs, 1, method=method)


def _fastsample_rows() -> list[Contender]:
    rows = [Contender(f"fs.{m}", _method(m), True) for m in ("inverse_cdf", "race", "auto")]
    rows.append(Contender("fs.fast_sample", lambda case: lambda: fast_sample(case.probs, 1), True))
    return rows


def _per_request_generators(case: Case) -> Call:
    """What engines do for seeded requests today: one ``torch.Generator`` per row, a Python
    loop filling each row's noise from its own generator, then the exponential race."""
    generators = [
        torch.Generator(device=case.device).manual_seed(1000 + b) for b in range(case.batch)
    ]

    def call() -> Tensor:
        noise = torch.empty_like(case.probs, dtype=torch.float32)
        for row, generator in enumerate(generators):
            noise[row].exponential_(generator=generator)
        return (case.probs / noise).argmax(-1, keepdim=True)

    return call


# The seeded race evaluates Philox per vocabulary entry: on a CPU that is seconds per call at
# B=256, so the CPU grid shows it only up to this many entries (it is a GPU method).
CPU_SEEDED_RACE_MAX_ENTRIES = 1 << 21


def _seeded(method: str) -> Callable[[Case], Call | None]:
    def build(case: Case) -> Call | None:
        entries = case.batch * case.vocab
        if method == "race" and case.device.type == "cpu" and entries > CPU_SEEDED_RACE_MAX_ENTRIES:
            return None
        seeds = torch.arange(case.batch, device=case.device) * 7919 + case.seed
        steps = torch.full((case.batch,), 12345, dtype=torch.int64, device=case.device)
        return lambda: sample_from_probs(case.probs, 1, seed=seeds, step=steps, method=method)

    return build


def _seeded_rows() -> list[Contender]:
    return [
        Contender("per_request_generators", _per_request_generators),
        Contender("fs.inverse_cdf+seed", _seeded("inverse_cdf"), True),
        Contender("fs.race+seed", _seeded("race"), True),
    ]


register_group("baseline", _baselines())
register_group("fastsample", _fastsample_rows())
register_group("seeded", _seeded_rows())


# ---------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Timing:
    """How long to time each contender."""

    warmup: int = 2
    min_repeats: int = 5
    max_repeats: int = 50
    budget_s: float = 0.3


QUICK_TIMING = Timing(warmup=1, min_repeats=3, max_repeats=20, budget_s=0.1)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(fn: Call, device: torch.device, seconds: float) -> None:
    """Untimed calls of ``fn``: at least one, until ``seconds`` have passed."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < seconds:
        fn()
    _sync(device)


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


def extra_memory_fraction(fn: Call, case: Case) -> float | None:
    """Peak extra bytes of one call over the input's bytes, or None if not measurable."""
    try:
        if case.device.type == "cuda":
            extra = _cuda_extra_bytes(fn, case.device)
        else:
            extra = _cpu_extra_bytes(fn)
    except Exception:  # any profiler or platform problem: report n/a, never crash
        return None
    return extra / (case.probs.numel() * case.probs.element_size())


def make_case(batch: int, vocab: int, dtype: str, device: torch.device, seed: int = 0) -> Case:
    """The input: softmax (in float32) of seeded N(0, 3^2) logits, cast to ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen, device=device) * LOGIT_SCALE
    probs = torch.softmax(logits, dim=-1).to(DTYPES[dtype])
    return Case(batch, vocab, dtype, device, probs, seed)


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
    _sync(device)
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


def run_case(case: Case, contenders: Sequence[Contender], timing: Timing) -> list[Result]:
    """Time all contenders that apply to ``case``, interleaved; one row each."""
    group_of = {c.name: g for g, cs in GROUPS.items() for c in cs}
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
                calls[contender.name], case
            )
    return [rows[c.name] for c in contenders if c.name in rows]


def add_ratios(rows: list[Result]) -> None:
    """Fill speed-up over ``torch.multinomial`` and multiple of the read pass (one case)."""
    by_name = {r.contender: r.median_ms for r in rows}
    multinomial, read_pass = by_name.get(MULTINOMIAL), by_name.get(READ_PASS)
    for r in rows:
        if r.median_ms is None or r.median_ms <= 0:
            continue
        if multinomial:
            r.speedup_vs_multinomial = multinomial / r.median_ms
        if read_pass:
            r.read_passes = r.median_ms / read_pass


# ---------------------------------------------------------------------------- output


class Progress:
    """A single self-overwriting status line on a terminal's stderr (silent otherwise)."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total, self.done, self.width = total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        self._write(f"[{self.done}/{self.total}] {label}")

    def clear(self) -> None:
        self._write("")

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        self.stream.write("\r" + text.ljust(self.width) + ("\r" if not text else ""))
        self.stream.flush()
        self.width = len(text)


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "failed"
    return f"{ms:.0f}" if ms >= 1000 else f"{ms:.4g}"


def _fmt_ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def _fmt_mem(r: Result, measured: bool) -> str:
    if not measured or r.median_ms is None:
        return ""
    if r.extra_mem_fraction is None:
        return "n/a"
    pct = 100 * r.extra_mem_fraction
    return f"+{pct:.1f}%" if pct < 10 else f"+{pct:.0f}%"


class Table:
    """The stdout table, printed one case at a time as results come in."""

    HEADERS = ("case", "contender", "median ms", "vs multinomial", "read passes", "mem")

    def __init__(self, contenders: Sequence[Contender], out: TextIO) -> None:
        self.out = out
        self.measured = {c.name for c in contenders if c.measure_memory}
        name_width = max([len(self.HEADERS[1]), *(len(c.name) for c in contenders)])
        self.widths = (23, name_width, 10, 14, 11, 7)

    def _line(self, cells: Sequence[str]) -> str:
        left = [f"{cells[0]:<{self.widths[0]}}", f"{cells[1]:<{self.widths[1]}}"]
        right = [f"{c:>{w}}" for c, w in zip(cells[2:], self.widths[2:], strict=True)]
        return "  ".join(left + right).rstrip()

    def header(self) -> None:
        print(self._line(self.HEADERS), file=self.out)
        print("-" * len(self._line(self.HEADERS)), file=self.out)

    def case(self, rows: Sequence[Result]) -> None:
        for r in rows:
            label = f"B={r.batch} V={r.vocab} {r.dtype}"
            cells = (
                label,
                r.contender,
                _fmt_ms(r.median_ms),
                _fmt_ratio(r.speedup_vs_multinomial),
                _fmt_ratio(r.read_passes),
                _fmt_mem(r, r.contender in self.measured),
            )
            print(self._line(cells), file=self.out)
            if r.error:
                print(f"    ({r.contender} failed: {r.error})", file=self.out)
        print(file=self.out, flush=True)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_name() -> str:
    cache = last_level_cache()
    return f"{cpu_model()}, {cache}" if cache else cpu_model()


def last_level_cache() -> str | None:
    """The CPU's largest cache, e.g. ``"L3 32 MiB"``, from Linux's sysfs; None elsewhere.

    It says what a "read pass" measures: an input that fits in it is read from cache, not
    from memory, so the same code shows more read passes on a host with a bigger cache.
    """
    best: tuple[int, int] | None = None
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level"), encoding="utf-8") as f:
                level = int(f.read())
            with open(os.path.join(index, "size"), encoding="utf-8") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            size_bytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (ValueError, IndexError):
            continue
        if best is None or (level, size_bytes) > best:
            best = (level, size_bytes)
    if best is None:
        return None
    level, size_bytes = best
    return f"L{level} {size_bytes / (1 << 20):g} MiB"


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers depend on, saved next to them."""
    is_cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if is_cuda else _cpu_name(),
        "cuda": torch.version.cuda if is_cuda else None,
        "cpu_model": cpu_model(),
        "cpu_cache": last_level_cache(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def save_json(path: str, rows: Sequence[Result], info: dict[str, Any], settings: dict) -> None:
    doc = {"machine": info, "settings": settings, "results": [asdict(r) for r in rows]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def _require_matplotlib() -> Any:
    """Import matplotlib (Agg backend) or exit with how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "error: --plot needs matplotlib, an optional extra: "
            'pip install "fastsample[plot]"  (or: pip install matplotlib)'
        ) from None
    return plt


def save_plot(path: str, rows: Sequence[Result], title: str) -> None:
    """Grouped bars: speed-up over torch.multinomial per case and contender (log scale)."""
    plt = _require_matplotlib()
    cases = list(dict.fromkeys((r.batch, r.vocab, r.dtype) for r in rows))
    names = [n for n in dict.fromkeys(r.contender for r in rows) if n != MULTINOMIAL]
    speedup = {(r.batch, r.vocab, r.dtype, r.contender): r.speedup_vs_multinomial for r in rows}
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cases) + 2), 4.5))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(cases))]
        ys = [speedup.get((*c, name)) or math.nan for c in cases]
        bars = ax.bar(xs, ys, width, label=name, hatch="//" if name == READ_PASS else None)
        ax.bar_label(bars, fmt="%.3g", fontsize=5, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"B={b}\nV={v}\n{d}" for b, v, d in cases], fontsize=7)
    ax.set_ylabel("speed-up over torch.multinomial (x)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where to run (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"two cases {QUICK_CASES} and fewer repeats (under a minute on a "
        "2-core CPU); with --batch/--vocab/--dtype, only fewer repeats",
    )
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        metavar="B",
        help=f"batch sizes (default {' '.join(map(str, FULL_BATCHES))})",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        nargs="+",
        metavar="V",
        help=f"vocabulary sizes (default {' '.join(map(str, FULL_VOCABS))})",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=sorted(DTYPES),
        help=f"dtypes (default {' '.join(FULL_DTYPES)})",
    )
    parser.add_argument(
        "--contender",
        nargs="+",
        metavar="GLOB",
        help="only these contenders (fnmatch globs, e.g. 'fs.*'); the read "
        "pass and torch.multinomial always run, the ratios need them",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="at most this many timed calls per contender (default 50)",
    )
    parser.add_argument(
        "--min-repeats",
        type=int,
        default=None,
        help="at least this many timed calls per contender (default 5)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop timing a contender after this long (default 0.3)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input logits")
    parser.add_argument(
        "--controls",
        action="store_true",
        help="benchmark fastsample.sample's controls (temperature, top-k, top-p, min-p, "
        "greedy) on float32 logits against an HF-style pipeline, at the first --batch and "
        "--vocab (default 64 x 128256)",
    )
    parser.add_argument(
        "--distributed",
        type=int,
        metavar="W",
        help="benchmark fastsample.distributed.sample on W gloo processes (loopback) against "
        "gather-then-sample, at the first --batch and --vocab (default 64 x 128256)",
    )
    parser.add_argument("--json", metavar="PATH", help="save results and machine info as JSON")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="save a PNG bar chart of the speed-ups (needs fastsample[plot])",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="benchmark speculative-decoding verification instead (fastsample.bench_verify)",
    )


def _pick_device(name: str | None) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch.cuda.is_available() is False")
    return torch.device(name)


def _case_grid(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    if args.quick and not (args.batch or args.vocab or args.dtype):
        return list(QUICK_CASES)
    axes = (args.batch or FULL_BATCHES, args.vocab or FULL_VOCABS, args.dtype or FULL_DTYPES)
    return list(itertools.product(*axes))


def _timing(args: argparse.Namespace) -> Timing:
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


def run_bench(
    grid: Sequence[tuple[int, int, str]],
    device: torch.device,
    timing: Timing,
    contenders: Sequence[Contender],
    seed: int = 0,
    out: TextIO | None = None,
) -> list[Result]:
    """Run every contender on every case; print the table as it goes; return all rows."""
    out = out if out is not None else sys.stdout
    table, progress = Table(contenders, out), Progress(len(grid))
    table.header()
    rows: list[Result] = []
    for batch, vocab, dtype in grid:
        case = make_case(batch, vocab, dtype, device, seed)
        progress.step(f"{case.label} ({len(contenders)} contenders, interleaved)")
        case_rows = run_case(case, contenders, timing)
        add_ratios(case_rows)
        progress.clear()
        table.case(case_rows)
        rows.extend(case_rows)
        del case
    return rows


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m fastsample bench``."""
    if getattr(args, "verify", False):
        from .verify import run_verify

        return run_verify(args)
    if args.distributed is not None:
        from . import distributed as bench_distributed

        return bench_distributed.run(args)
    if args.controls:
        from . import controls as bench_controls

        return bench_controls.run(args)
    if args.plot:
        _require_matplotlib()  # fail before minutes of benchmarking, not after
    device = _pick_device(args.device)
    grid, timing = _case_grid(args), _timing(args)
    contenders = all_contenders(args.contender)
    info = machine_info(device)
    print(
        f"fastsample bench: torch {info['torch']}, {info['device_name']} ({device}), "
        f"{info['torch_threads']} threads; {len(grid)} cases x {len(contenders)} contenders; "
        f"median of {timing.min_repeats}-{timing.max_repeats} calls "
        f"(budget {timing.budget_s:g} s each)\n"
    )
    start = time.perf_counter()
    rows = run_bench(grid, device, timing, contenders, args.seed)
    elapsed = time.perf_counter() - start
    print(
        f"done in {elapsed:.1f} s. vs multinomial: its time / this time (higher is better);\n"
        "read passes: this time / one probs.sum(-1) (1x is the floor); "
        "mem: peak extra bytes of one call / input bytes"
    )
    settings = {
        **asdict(timing),
        "grid": grid,
        "seed": args.seed,
        "elapsed_s": elapsed,
        "logit_scale": LOGIT_SCALE,
    }
    if args.json:
        save_json(args.json, rows, info, settings)
        print(f"saved {args.json}")
    if args.plot:
        title = f"fastsample bench: {info['device_name']}, torch {info['torch']}"
        save_plot(args.plot, rows, title)
        print(f"saved {args.plot}")
    return 0
