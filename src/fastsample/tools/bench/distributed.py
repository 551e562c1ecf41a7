"""``python -m fastsample bench --distributed W``: vocabulary-parallel sampling on W processes.

Starts ``W`` gloo processes on loopback (127.0.0.1). Input: float32 logits ``N(0, 3^2)``
(seeded), ``B x V`` (default 64 x 128256), split into ``W`` equal contiguous shards (the last
one shorter when ``W`` does not divide ``V``). For each setting (plain, temperature with
top-k/top-p as Python numbers, all four controls as ``(B,)`` tensors, greedy) every rank times,
interleaved, call after call:

* ``fs.distributed``: :func:`fastsample.distributed.sample` on its shard;
* ``gather+fs.sample``: what engines do today: all-gather the shards (padded to equal size)
  into the full ``(B, V)`` logits on every rank, then :func:`fastsample.sample`;
* ``fs.sample (1 proc)``: :func:`fastsample.sample` on the full logits in one process with no
  communication (timed on rank 0 while the others wait): the floor without sharding.

Reported per row: the median over ``--repeats`` calls of the slowest rank's time, the speed-up
of ``fs.distributed`` over the gather, the collectives per call, and the bytes each rank hands
to collectives (payload) and sends with ring algorithms (wire: ``2 (W-1)/W`` x payload for an
all-reduce, ``(W-1)`` x for an all-gather). Every rank runs the same fixed number of calls (no
time budget: ranks must issue the same collectives). On a machine with fewer cores than
processes, the collectives' latency is dominated by scheduling; compare ratios and bytes.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ... import distributed as fsd
from ...sampling import sample
from .harness import LOGIT_SCALE
from .report import machine_info, save_json

SETTINGS: dict[str, str] = {
    "T=1 (plain)": "plain",
    "T=0.7 k=50 p=0.9": "scalar",
    "tensor T,k,p,min_p": "tensor",
    "greedy": "greedy",
}
"""Setting label -> kind, in display order."""

DEFAULT_REPEATS = 20
DEFAULT_WARMUP = 2


@dataclass
class Row:
    setting: str
    contender: str
    median_ms: float
    speedup_vs_gather: float | None = None
    collectives: int | None = None
    payload_bytes: int | None = None
    wire_bytes: int | None = None


def controls_for(kind: str, batch: int) -> dict[str, Any]:
    if kind == "plain":
        return {}
    if kind == "scalar":
        return dict(temperature=0.7, top_k=50, top_p=0.9)
    if kind == "greedy":
        return dict(temperature=0.0)
    return dict(
        temperature=torch.full((batch,), 0.7),
        top_k=torch.full((batch,), 50),
        top_p=torch.full((batch,), 0.9),
        min_p=torch.full((batch,), 0.01),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather_then_sample(shard: Tensor, vocab: int, width: int, controls: dict, seed: Tensor):
    """The baseline: all-gather the (padded) shards, rebuild ``(B, V)``, sample on it."""
    batch, local = shard.shape
    padded = shard if local == width else torch.nn.functional.pad(shard, (0, width - local))
    world = dist.get_world_size()
    out = padded.new_empty(world * batch, width)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, padded.contiguous())
    full = out.view(world, batch, width).permute(1, 0, 2).reshape(batch, world * width)
    return sample(full[:, :vocab], seed=seed, **controls)


def _rank_main(rank: int, world: int, port: int, opts: dict, outdir: str) -> None:
    # Loopback only (macOS names it lo0); an explicit setting wins.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        rows = _rank_bench(rank, world, opts)
        if rank == 0:
            torch.save({"rows": rows}, os.path.join(outdir, "result.pt"))
    except Exception:
        with open(os.path.join(outdir, f"error{rank}.txt"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _rank_bench(rank: int, world: int, opts: dict) -> list[Row]:
    batch, vocab = opts["batch"], opts["vocab"]
    gen = torch.Generator().manual_seed(opts["seed"])
    full = torch.randn(batch, vocab, generator=gen) * LOGIT_SCALE
    width = math.ceil(vocab / world)
    start, end = rank * width, min(vocab, (rank + 1) * width)
    shard = full[:, start:end].contiguous()
    seed = torch.arange(batch)
    rows: list[Row] = []
    for label, kind in SETTINGS.items():
        controls = controls_for(kind, batch)
        calls = {
            "fs.distributed": lambda c=controls: fsd.sample(
                shard, vocab_start=start, vocab_size=vocab, seed=seed, **c
            ),
            "gather+fs.sample": lambda c=controls: _gather_then_sample(
                shard, vocab, width, c, seed
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(opts["warmup"]):
            for fn in calls.values():
                fn()
        for _ in range(opts["repeats"]):
            for name, fn in calls.items():  # interleaved: both see the same drifts
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        # The slowest rank's time per call (a step waits for every rank).
        mine = torch.tensor([times[name] for name in calls], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        medians = {name: statistics.median(mine[i].tolist()) for i, name in enumerate(calls)}
        with fsd.record_traffic() as traffic:
            calls["fs.distributed"]()
        gather_payload = batch * width * 4
        rows.append(
            Row(
                label,
                "fs.distributed",
                medians["fs.distributed"] * 1e3,
                medians["gather+fs.sample"] / medians["fs.distributed"],
                traffic.count,
                traffic.payload_bytes,
                traffic.wire_bytes,
            )
        )
        rows.append(
            Row(
                label,
                "gather+fs.sample",
                medians["gather+fs.sample"] * 1e3,
                None,
                1,
                gather_payload,
                (world - 1) * gather_payload,
            )
        )
        one = []
        dist.barrier()
        if rank == 0:  # the one-process floor, the other ranks idle at the barrier
            for i in range(opts["warmup"] + opts["repeats"]):
                t0 = time.perf_counter()
                sample(full, seed=seed, **controls)
                if i >= opts["warmup"]:
                    one.append(time.perf_counter() - t0)
            rows.append(
                Row(label, "fs.sample (1 proc)", statistics.median(one) * 1e3, None, 0, 0, 0)
            )
        dist.barrier()
    return rows


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def print_rows(rows: list[Row]) -> None:
    header = ("setting", "contender", "median ms", "vs gather", "coll.", "payload", "wire")
    print(
        f"{header[0]:<20}  {header[1]:<20}  {header[2]:>10}  {header[3]:>9}  {header[4]:>5}  "
        f"{header[5]:>11}  {header[6]:>11}"
    )
    for r in rows:
        speed = "-" if r.speedup_vs_gather is None else f"{r.speedup_vs_gather:.2f}x"
        count = "-" if r.collectives is None else str(r.collectives)
        print(
            f"{r.setting:<20}  {r.contender:<20}  {r.median_ms:>10.3f}  {speed:>9}  {count:>5}  "
            f"{_fmt_bytes(r.payload_bytes):>11}  {_fmt_bytes(r.wire_bytes):>11}"
        )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m fastsample bench --distributed W``."""
    import torch.multiprocessing as mp

    world = args.distributed
    if world < 1:
        raise SystemExit("error: --distributed needs a world size >= 1")
    opts = {
        "batch": (args.batch or [64])[0],
        "vocab": (args.vocab or [128256])[0],
        "seed": args.seed,
        "repeats": args.repeats or DEFAULT_REPEATS,
        "warmup": DEFAULT_WARMUP if args.warmup is None else args.warmup,
    }
    if opts["vocab"] < world:
        raise SystemExit("error: --vocab must be at least the world size")
    info = machine_info(torch.device("cpu"))
    print(
        f"fastsample bench --distributed {world}: torch {info['torch']}, {info['device_name']}, "
        f"{info['cpu_count']} cores, gloo on loopback, {world} processes x "
        f"{max(1, (os.cpu_count() or 1) // world)} threads; float32 logits "
        f"B={opts['batch']} V={opts['vocab']}; median of {opts['repeats']} calls "
        "(slowest rank)\n"
    )
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, opts, outdir))
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join()
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        errors = sorted(f for f in os.listdir(outdir) if f.startswith("error"))
        if errors:
            with open(os.path.join(outdir, errors[0]), encoding="utf-8") as f:
                print(f.read())
            return 1
        if any(p.exitcode != 0 for p in procs):
            print(f"error: exit codes {[p.exitcode for p in procs]}")
            return 1
        rows: list[Row] = torch.load(os.path.join(outdir, "result.pt"), weights_only=False)["rows"]
    print_rows(rows)
    print(
        f"\ndone in {time.perf_counter() - start:.1f} s. vs gather: gather+fs.sample's time / "
        "this time; payload: bytes this rank hands to collectives per call; wire: bytes it "
        "sends with ring algorithms"
    )
    if args.json:
        save_json(args.json, rows, info, dict(opts, world=world, controls=SETTINGS))
        print(f"saved {args.json}")
    return 0
