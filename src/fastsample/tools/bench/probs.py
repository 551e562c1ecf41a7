"""The default mode of ``python -m fastsample bench``: samplers on probabilities.

The rows (read pass, ``torch.multinomial``, the eager race, fastsample's methods, seeded
sampling) live in a registry of named groups (:data:`GROUPS`); :func:`register_group` adds
one. What the rows measure and how to read them: :mod:`fastsample.tools.bench`.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import TextIO

import torch
from torch import Tensor

from ...sampling import fast_sample, sample_from_probs
from .harness import (
    LOGIT_SCALE,
    Call,
    Case,
    Contender,
    Result,
    Timing,
    make_case,
    pick_device,
    run_case,
    timing_from_args,
)
from .report import Progress, Table, machine_info, require_matplotlib, save_json, save_plot

READ_PASS = "read_pass"
MULTINOMIAL = "torch.multinomial"

FULL_BATCHES = (1, 8, 64, 256)
FULL_VOCABS = (32000, 128256, 151936)
FULL_DTYPES = ("float32", "bfloat16")
QUICK_CASES = ((64, 128256, "float32"), (8, 32000, "bfloat16"))


# ---------------------------------------------------------------------------- registry


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


# ---------------------------------------------------------------------------- the rows


def eager_race(probs: Tensor) -> tuple[Tensor, Tensor]:
    """The original inference-engine helper, verbatim."""
    q = torch.empty_like(probs).exponential_(1)
    idx = (probs / q).argmax(-1, keepdim=True)
    return probs.gather(1, idx), idx


def _baselines() -> list[Contender]:
    return [
        Contender(READ_PASS, lambda case: lambda: case.probs.sum(-1)),
        Contender(MULTINOMIAL, lambda case: lambda: torch.multinomial(case.probs, 1)),
        Contender("eager_race", lambda case: lambda: eager_race(case.probs)),
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


# ---------------------------------------------------------------------------- running


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


def case_grid(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    """The cases from ``--quick``, ``--batch``, ``--vocab``, ``--dtype``."""
    if args.quick and not (args.batch or args.vocab or args.dtype):
        return list(QUICK_CASES)
    axes = (args.batch or FULL_BATCHES, args.vocab or FULL_VOCABS, args.dtype or FULL_DTYPES)
    return list(itertools.product(*axes))


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
    group_of = {c.name: g for g, cs in GROUPS.items() for c in cs}
    table.header()
    rows: list[Result] = []
    for batch, vocab, dtype in grid:
        case = make_case(batch, vocab, dtype, device, seed)
        progress.step(f"{case.label} ({len(contenders)} contenders, interleaved)")
        case_rows = run_case(case, contenders, timing, group_of)
        add_ratios(case_rows)
        progress.clear()
        table.case(case_rows)
        rows.extend(case_rows)
        del case
    return rows


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m fastsample bench`` (no mode flag)."""
    if args.plot:
        require_matplotlib()  # fail before minutes of benchmarking, not after
    device = pick_device(args.device)
    grid, timing = case_grid(args), timing_from_args(args)
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
        save_plot(args.plot, rows, title, baseline=MULTINOMIAL, hatched=READ_PASS)
        print(f"saved {args.plot}")
    return 0
