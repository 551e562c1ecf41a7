"""Graph-captured sampling on CUDA: the Triton backend against the torch ops and the field.

Run it with ``python -m fastsample.tools.bench.sampling_cuda`` (``--repeats``, ``--json``);
``scripts/device_check.sh`` does. Per case (``B`` in {1, 8, 64, 256}, ``V`` in {32000,
128256}, float32), each call captured once in a CUDA graph and replayed (microseconds per
call, medians):

* ``read pass``: ``probs.sum(-1)``, one HBM read of the batch (the physical floor);
* ``torch.multinomial(probs, 1)`` and the seed's race (``exponential_``, div, ``argmax``,
  ``gather``);
* ``fs.fast_sample`` and ``fs.sample_from_probs`` (seeded, ``(B,)`` seed/step tensors) on the
  Triton and the torch backends;
* ``fs.sample`` with temperature, top-k and top-p as ``(B,)`` tensors (and as Python numbers),
  both backends, and greedy;
* FlashInfer's ``sampling_from_probs`` and ``top_k_top_p_sampling_from_logits`` when
  ``flashinfer`` imports.

The issue's targets read off this table: ``fast_sample`` >= 7x faster than
``torch.multinomial`` and faster than the seed's race everywhere; ``sample`` with T/top-k/top-p
at most FlashInfer's time; within 2x of the read pass at ``B >= 64``. Without a CUDA device
this module says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from ... import sampling as fs
from .cuda_graphs import time_contenders

BATCHES = (1, 8, 64, 256)
VOCABS = (32000, 128256)


def seed_race(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-decoding helper fastsample started from: four eager ops."""
    noise = torch.empty_like(probs).exponential_()
    index = (probs / noise).argmax(-1, keepdim=True)
    return probs.gather(1, index), index


def flashinfer_calls(
    probs: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> list[tuple[str, Callable[[], object]]]:
    try:
        from flashinfer import sampling as fi
    except Exception:  # not installed, or built for another CUDA/torch
        return []
    calls: list[tuple[str, Callable[[], object]]] = []
    if hasattr(fi, "sampling_from_probs"):
        calls.append(("flashinfer sampling_from_probs", lambda: fi.sampling_from_probs(probs)))
    if hasattr(fi, "top_k_top_p_sampling_from_logits"):
        calls.append((
            "flashinfer top_k_top_p_sampling_from_logits (T=0.7 applied first)",
            lambda: fi.top_k_top_p_sampling_from_logits(logits / 0.7, top_k, top_p),
        ))  # fmt: skip
    return calls


def case(batch: int, vocab: int, repeats: int) -> list[dict]:
    """Every contender on one ``(B, V)``; one dict per contender."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(batch * 7 + vocab)
    logits = torch.randn(batch, vocab, device=device, generator=gen) * 3
    probs = torch.softmax(logits, -1)
    seeds = torch.arange(batch, device=device)
    steps = torch.zeros(batch, dtype=torch.int64, device=device)
    temperature = torch.full((batch,), 0.7, device=device)
    top_k = torch.full((batch,), 50, dtype=torch.int64, device=device)
    top_p = torch.full((batch,), 0.9, device=device)
    seeded = dict(seed=seeds, step=steps)
    controls = dict(temperature=temperature, top_k=top_k, top_p=top_p, **seeded)
    numbers = dict(temperature=0.7, top_k=50, top_p=0.9, **seeded)
    contenders: list[tuple[str, str, Callable[[], object]]] = [
        ("read pass (probs.sum(-1))", "-", lambda: probs.sum(-1)),
        ("torch.multinomial(probs, 1)", "-", lambda: torch.multinomial(probs, 1)),
        ("seed's race", "-", lambda: seed_race(probs)),
    ]
    for name in ("triton", "torch"):
        contenders += [
            ("fast_sample(probs)", name, lambda: fs.fast_sample(probs, **seeded)),
            ("sample_from_probs(probs)", name, lambda: fs.sample_from_probs(probs, **seeded)),
            ("sample(logits, T/top-k/top-p tensors)", name, lambda: fs.sample(logits, **controls)),
            ("sample(logits, T/top-k/top-p numbers)", name, lambda: fs.sample(logits, **numbers)),
            ("sample(logits, temperature=0)", name, lambda: fs.sample(logits, temperature=0)),
        ]
    contenders += [
        (label, "-", fn)
        for label, fn in flashinfer_calls(probs, logits, top_k.to(torch.int32), top_p)
    ]
    rows = time_contenders(contenders, batch, vocab, repeats)
    floor = next((r["us"] for r in rows if r["call"].startswith("read pass") and "us" in r), None)
    for row in rows:
        if floor and "us" in row:
            row["read_passes"] = round(row["us"] / floor, 2)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("# sampling_cuda: no CUDA device here; the graph-captured sampling benchmark "
              "needs a GPU (skipped, nothing measured)")  # fmt: skip
        return 0
    print(f"# graph-captured sampling, {torch.cuda.get_device_name()}, float32, us per call")
    rows = []
    print("| call | backend | B | V | us | read passes | graph |")
    print("|---|---|---:|---:|---:|---:|---|")
    for vocab in VOCABS:
        for batch in BATCHES:
            for row in case(batch, vocab, args.repeats):
                rows.append(row)
                timing = row.get("us", row.get("error"))
                print(f"| {row['call']} | {row['backend']} | {batch} | {vocab} | {timing} | "
                      f"{row.get('read_passes', '')} | "
                      f"{'yes' if row.get('graph') else 'eager'} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
