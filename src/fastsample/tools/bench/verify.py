"""``python -m fastsample bench --verify``: speculative-decoding verification, side by side.

What is measured, per case (batch ``B`` x ``K`` drafts x vocabulary ``V`` x dtype; the target
distributions are the softmax of seeded N(0, 3^2) logits, the draft's those logits plus N(0, 1)
noise, so drafts are accepted about as often as with a good draft model; the drafts are drawn
from the draft distributions before timing):

* ``read_pass``: ``target_probs[:, 0].sum(-1)``, one read of one ``(B, V)`` slice: the unit of
  the "read passes" column (any verifier must read at least the row it draws from).
* ``gather``: gathering ``p(x)`` and ``q(x)`` for the drafts (``(B, K)`` each), the part every
  verifier needs; "passes beyond gather" subtracts it.
* ``reference``: a straightforward batched port of the speculative sampling of Hugging Face
  transformers: residuals ``max(p - q, 0)`` renormalized at *every* draft position, the
  bonus distribution appended, the row of the first rejection picked, ``torch.multinomial``.
* ``fs.verify_chain`` (with draft probabilities), ``+seed`` (per-request counter-based
  randomness), ``fs.verify_chain(no q)`` (point-mass drafts).
* ``fs.verify_tree a`` / ``b``: a 9-node tree (3 first tokens, 2 + 1 + 1 children, two of
  them with one more), deterministic children and children drawn without replacement.

Timing and output as in :mod:`fastsample.tools.bench` (round-robin over contenders, medians). The
``mem`` column is the peak extra memory of one call over the bytes of one ``(B, V)`` slice.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...verify import TokenTree, verify_chain, verify_tree
from .harness import (
    DTYPES,
    LOGIT_SCALE,
    Timing,
    extra_memory_fraction,
    pick_device,
    time_interleaved,
    timing_from_args,
)
from .report import machine_info, save_json

DEFAULT_CASES = ((64, 4, 128256, "float32"),)
QUICK_CASES = ((64, 4, 128256, "float32"),)
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 6]
READ_PASS, GATHER, REFERENCE = "read_pass", "gather", "reference"


def reference_verify(target: Tensor, draft: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Batched port of Hugging Face's ``_speculative_sampling``: ``(num_accepted, token)``.

    Residuals for every position, one ``torch.multinomial`` over the picked rows. (HF
    accepts with ``r <= p / q``; strict here, which costs the same.)
    """
    batch, positions, _ = target.shape
    k = positions - 1
    p_x = target[:, :k].gather(-1, tokens[..., None])[..., 0]
    q_x = draft.gather(-1, tokens[..., None])[..., 0]
    accepted = torch.rand_like(p_x) < p_x / q_x
    num_accepted = ((~accepted).cumsum(-1) < 1).sum(-1)
    residual = (target[:, :k] - draft).clamp(min=0)
    residual = residual / residual.sum(-1, keepdim=True)
    dists = torch.cat((residual, target[:, k:]), dim=1)
    final = dists[torch.arange(batch, device=target.device), num_accepted]
    return num_accepted, torch.multinomial(final, 1)


@dataclass
class VerifyCase:
    batch: int
    drafts: int
    vocab: int
    dtype: str
    device: torch.device
    target: Tensor
    draft: Tensor
    tokens: Tensor

    @property
    def label(self) -> str:
        return f"B={self.batch} K={self.drafts} V={self.vocab} {self.dtype}"


def make_case(
    batch: int, drafts: int, vocab: int, dtype: str, device: torch.device, seed: int = 0
) -> VerifyCase:
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, drafts + 1, vocab, generator=gen, device=device) * LOGIT_SCALE
    noise = torch.randn(batch, drafts, vocab, generator=gen, device=device)
    target = torch.softmax(logits, -1)
    draft = torch.softmax(logits[:, :drafts] + noise, -1)
    flat = draft.reshape(-1, vocab)
    tokens = torch.multinomial(flat, 1, generator=gen).view(batch, drafts)
    cast = DTYPES[dtype]
    return VerifyCase(batch, drafts, vocab, dtype, device, target.to(cast), draft.to(cast), tokens)


def tree_inputs(case: VerifyCase) -> tuple[Tensor, Tensor, TokenTree]:
    """A 9-node tree per request: the chain's rows, repeated to fill the nodes."""
    n = len(TREE_PARENTS)
    index = torch.arange(n, device=case.device) % (case.drafts + 1)
    target = case.target[:, index].contiguous()
    draft = case.draft[:, index.clamp_max(case.drafts - 1)].contiguous()
    tokens = draft.float().argmax(-1)
    return target, draft, TokenTree(tokens, TREE_PARENTS)


def contenders(case: VerifyCase) -> dict[str, Callable[[], Any]]:
    """Name -> zero-argument call, in display order (setup is not timed)."""
    p, q, x = case.target, case.draft, case.tokens
    k = case.drafts
    seeds = torch.arange(case.batch, device=case.device) * 7919
    steps = torch.full((case.batch,), 12345, dtype=torch.int64, device=case.device)
    index = x[..., None]
    calls: dict[str, Callable[[], Any]] = {
        READ_PASS: lambda: p[:, 0].sum(-1),
        GATHER: lambda: (p[:, :k].gather(-1, index), q.gather(-1, index)),
        REFERENCE: lambda: reference_verify(p, q, x),
        "fs.verify_chain": lambda: verify_chain(p, x, q),
        "fs.verify_chain+seed": lambda: verify_chain(p, x, q, seed=seeds, step=steps),
        "fs.verify_chain(no q)": lambda: verify_chain(p, x),
    }
    if k >= 1:
        tree_p, tree_q, tree = tree_inputs(case)
        calls["fs.verify_tree a"] = lambda: verify_tree(tree_p, tree)
        calls["fs.verify_tree b"] = lambda: verify_tree(tree_p, tree, tree_q)
    return calls


@dataclass
class VerifyResult:
    batch: int
    drafts: int
    vocab: int
    dtype: str
    contender: str
    median_ms: float
    min_ms: float
    repeats: int
    times_ms: list[float] = field(default_factory=list)
    speedup_vs_reference: float | None = None
    read_passes: float | None = None
    passes_beyond_gather: float | None = None
    extra_mem_fraction: float | None = None


def run_case(case: VerifyCase, timing: Timing) -> list[VerifyResult]:
    calls = contenders(case)
    seconds = time_interleaved(calls, case.device, timing)
    rows = []
    for name, times in seconds.items():
        ms = [t * 1e3 for t in times]
        rows.append(
            VerifyResult(
                case.batch,
                case.drafts,
                case.vocab,
                case.dtype,
                name,
                statistics.median(ms),
                min(ms),
                len(ms),
                ms,
            )
        )
    by_name = {r.contender: r.median_ms for r in rows}
    one_slice = case.target[:, 0]  # memory is counted in (B, V) slices: what one row reads
    for r in rows:
        r.speedup_vs_reference = by_name[REFERENCE] / r.median_ms
        r.read_passes = r.median_ms / by_name[READ_PASS]
        r.passes_beyond_gather = (r.median_ms - by_name[GATHER]) / by_name[READ_PASS]
        if r.contender.startswith("fs."):
            r.extra_mem_fraction = extra_memory_fraction(calls[r.contender], one_slice)
    return rows


def _fmt(x: float | None, digits: str = ".2f") -> str:
    return "-" if x is None else f"{x:{digits}}"


def print_table(rows: list[VerifyResult]) -> None:
    header = (
        f"{'case':<32} {'contender':<22} {'median ms':>10} {'vs reference':>13} "
        f"{'read passes':>12} {'beyond gather':>14} {'mem':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        label = f"B={r.batch} K={r.drafts} V={r.vocab} {r.dtype}"
        mem = "" if r.extra_mem_fraction is None else f"+{100 * r.extra_mem_fraction:.0f}%"
        print(
            f"{label:<32} {r.contender:<22} {r.median_ms:>10.4g} "
            f"{_fmt(r.speedup_vs_reference, '.1f') + 'x':>13} {_fmt(r.read_passes) + 'x':>12} "
            f"{_fmt(r.passes_beyond_gather) + 'x':>14} {mem:>7}",
            flush=True,
        )
    print()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m fastsample bench --verify``."""
    device = pick_device(args.device)
    timing = timing_from_args(args)
    if args.batch or args.vocab or args.dtype:
        grid = [
            (b, 4, v, d)
            for b in (args.batch or [64])
            for v in (args.vocab or [128256])
            for d in (args.dtype or ["float32"])
        ]
    else:
        grid = list(QUICK_CASES if args.quick else DEFAULT_CASES)
    info = machine_info(device)
    print(
        f"fastsample bench --verify: torch {info['torch']}, {info['device_name']} ({device}), "
        f"{info['torch_threads']} threads; median of {timing.min_repeats}-{timing.max_repeats} "
        f"calls (budget {timing.budget_s:g} s each)\n"
    )
    start = time.perf_counter()
    rows: list[VerifyResult] = []
    for batch, drafts, vocab, dtype in grid:
        case = make_case(batch, drafts, vocab, dtype, device, args.seed)
        case_rows = run_case(case, timing)
        print_table(case_rows)
        rows.extend(case_rows)
    print(
        f"done in {time.perf_counter() - start:.1f} s. vs reference: its time / this time; read "
        "passes: this time / one target_probs[:, 0].sum(-1);\nbeyond gather: (this time - "
        "gather time) / read pass; mem: peak extra bytes / one (B, V) slice"
    )
    if args.json:
        save_json(args.json, rows, info, asdict(timing))
        print(f"saved {args.json}")
    return 0
