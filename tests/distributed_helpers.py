"""Shared by the tests of tests/distributed/: shards, inputs, the scenarios and the process group.

Each world size starts one process group (a session-scoped fixture, ``group`` in
tests/distributed/conftest.py) that runs every scenario below in order and saves each rank's
results; the test modules then compare them with one-process :func:`fastsample.sample`, the
float64 reference and each other.

Bounded in time: ``init_process_group`` and every collective time out after 60 s and the whole
group is killed after ``GROUP_TIMEOUT`` seconds; processes are cleaned up on any failure.
"""

from __future__ import annotations

import ctypes
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastsample import distributed as fsd
from fastsample.distributed import shard as _shard
from reference import reference_probs, robust_min_p, robust_top_p
from stattests import plackett_luce, target_bias

WORLDS = (2, 4)
# Seconds for one world's whole run: ~40 s of draws per rank on a quiet 2-core machine (the
# full-power law tests), up to ~4x that when the machine is shared.
GROUP_TIMEOUT = 600.0

# Shards as (vocab_start, vocab_end) per rank, deliberately not in vocabulary order.
ALIGNED_VOCAB = 1999  # odd: the last shard carries the single-process padding column
ALIGNED = {
    2: [(1024, 1999), (0, 1024)],
    4: [(768, 1536), (0, 256), (1536, 1999), (256, 768)],
}
UNEVEN_VOCAB = 50
UNEVEN = {  # one shard holds a single token; none starts on a block boundary but the first
    2: [(1, 50), (0, 1)],
    4: [(20, 21), (0, 20), (37, 50), (21, 37)],
}
COARSE_VOCAB = 1600  # with MAX_SLOTS patched to 8: slots of 512 entries (m = 2)
COARSE = {2: [(700, 1600), (0, 700)], 4: [(999, 1000), (0, 999), (1300, 1600), (1000, 1300)]}


def shard(x: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return x[:, span[0] : span[1]]


# ----------------------------------------------------------------------------- inputs


def mixed_logits(vocab: int, batch: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=gen) * 3
    x[1, vocab // 3 :] = -math.inf  # a grammar mask
    x[2] = torch.randint(-2, 3, (vocab,), generator=gen).float()  # many exact ties
    x[3, 7] = x[3, vocab - 2] = 40.0  # a greedy tie across shards
    return x.to(dtype)


def tensor_controls(batch: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ctl = dict(
        temperature=torch.rand(batch, generator=gen) * 1.5 + 0.2,
        top_k=torch.randint(0, vocab + 5, (batch,), generator=gen),
        top_p=torch.rand(batch, generator=gen) * 0.6 + 0.4,
        min_p=torch.rand(batch, generator=gen) * 0.1,
    )
    ctl["temperature"][::5] = 0.0  # some greedy rows
    ctl["top_k"][::3] = 0
    ctl["top_p"][1::4] = 1.0
    return ctl


# name -> controls (given the tensor controls of the batch); each runs with n = 1 and n = 3.
BITWISE_SETTINGS = {
    "tensor": lambda c: c,
    "T=0.7 k=50 p=0.9": lambda c: dict(temperature=0.7, top_k=50, top_p=0.9),
    "k=1500 (radix)": lambda c: dict(top_k=1500),
    "k=50, tensor p": lambda c: dict(top_k=50, top_p=c["top_p"]),
    "min_p=0.05": lambda c: dict(min_p=0.05),
    "plain": lambda c: {},
    "greedy": lambda c: dict(temperature=0.0),
}
SEEDS = torch.arange(48) * 7919 + 5


def bitwise_cases():
    """``(key, source name, dtype, setting, n)``."""
    for name in BITWISE_SETTINGS:
        for n in (1, 3):
            yield (name, "logits", "float32", n)
            if name in ("k=1500 (radix)", "min_p=0.05", "plain", "T=0.7 k=50 p=0.9"):
                yield (name, "probs", "float32", n)
    for dtype in ("float16", "bfloat16", "float64"):
        yield ("tensor", "logits", dtype, 1)
        yield ("T=0.7 k=50 p=0.9", "logits", dtype, 3)


def bitwise_input(source: str, dtype: str) -> tuple[torch.Tensor, dict]:
    x = mixed_logits(ALIGNED_VOCAB, 48, seed=1, dtype=getattr(torch, dtype))
    if source == "probs":
        x = torch.softmax(x.double(), -1).to(x.dtype)
    return x, tensor_controls(48, ALIGNED_VOCAB, seed=2)


# ----------------------------------------------------------------------------- scenarios
# Each runs on every rank and returns what the tests compare; exceptions are recorded.


def scenario_bitwise(rank: int, world: int) -> dict:
    span = ALIGNED[world][rank]
    out = {}
    for case in bitwise_cases():
        name, source, dtype, n = case
        x, ctl = bitwise_input(source, dtype)
        kwargs = BITWISE_SETTINGS[name](ctl)
        out[case] = fsd.sample(
            **{source: shard(x, span)},
            vocab_start=span[0],
            vocab_size=ALIGNED_VOCAB,
            num_samples=n,
            seed=SEEDS,
            step=11,
            **kwargs,
        )
    x, ctl = bitwise_input("logits", "float32")
    out["stream"] = fsd.sample(
        shard(x, span), vocab_start=span[0], vocab_size=ALIGNED_VOCAB, seed=SEEDS, stream=7
    )
    # seed=None: every rank's generator differs, rank 0's uniforms are used.
    torch.manual_seed(1000 + rank)
    out["generator"] = fsd.sample(
        shard(x, span), vocab_start=span[0], vocab_size=ALIGNED_VOCAB, num_samples=2, **ctl
    )
    return out


def uneven_input() -> tuple[torch.Tensor, dict]:
    x = mixed_logits(UNEVEN_VOCAB, 40, seed=3)
    x[5, 20] = 50.0  # a greedy row whose maximum is the single-token shard's (W=4)
    return x, tensor_controls(40, UNEVEN_VOCAB, seed=4)


def scenario_uneven(rank: int, world: int) -> dict:
    span = UNEVEN[world][rank]
    x, ctl = uneven_input()
    common = dict(vocab_start=span[0], vocab_size=UNEVEN_VOCAB, seed=SEEDS[:40], step=2)
    return {
        "tensor": fsd.sample(shard(x, span), **common, **ctl),
        "tensor n=3": fsd.sample(shard(x, span), **common, **ctl, num_samples=3),
        "scalar": fsd.sample(shard(x, span), **common, temperature=0.9, top_k=7, top_p=0.8),
        "probs": fsd.sample(probs=shard(x.softmax(-1), span), **common, top_k=9, min_p=0.02),
    }


# ----------------------------------------------------------------------------- exactness
# Full-power law tests: one row drawn LawSpec.draws times, one counter-based seed per draw
# (seeds 0, 1, ...), in calls of LAW_CHUNK_ROWS rows; each rank reduces its ids
# to counts, which are all that comes back. Sizes are stattests.draws_needed(law, claim), so
# each test detects a bias of ``claim`` on about 10% of the mass with probability 0.99
# (tests/test_power.py checks the registered sizes). Draws cost ~4 us of CPU per row and rank
# (2 us for plain probs), so each code path gets one full-power law in one world rather than
# every configuration in both. Tensor controls run the radix rounds, ~20x dearer per row (a
# (B, 1024) histogram and all-reduce per round): their tokens are instead checked equal, seed
# for seed, to the Python-control tokens of the same rows (the cuts are the same numbers).


@dataclass(frozen=True)
class LawSpec:
    """A full-power law test: ``row`` (logits or probabilities) sampled with Python
    ``controls`` ``(temperature, top_k, top_p, min_p)`` on the ranks of ``world``."""

    world: int
    source: str  # "logits" or "probs"
    row: np.ndarray
    controls: tuple[float, int, float, float]
    draws: int
    num_samples: int = 1
    coarse: bool = False  # COARSE shards with MAX_SLOTS patched to 8 (slots of 512 entries)

    @property
    def vocab(self) -> int:
        return len(self.row)

    @property
    def claim(self) -> float:
        """The detectable bias it reaches: the target of tests/test_power.py (stattests)."""
        return target_bias(self.vocab)

    def spans(self) -> list[tuple[int, int]]:
        return (COARSE if self.coarse else UNEVEN)[self.world]

    def law(self) -> np.ndarray:
        """The exact float64 law of one draw (``num_samples=1``) or of the ordered pairs of
        JOINT_TOKENS (``num_samples=2``, :func:`joint_tuples` order)."""
        if self.num_samples == 2:
            weights = reference_probs(self.row, *self.controls)[JOINT_TOKENS]
            return plackett_luce(weights, joint_tuples())
        return reference_probs(self.row, *self.controls, is_logits=self.source == "logits")


def _peaked_at_the_single_token_shard():
    """World 2, logits: token 0, rank 1's only token, is the row's maximum; top-k 12 binds (so the
    shard-local top-k bug keeps a 13th token), min-p halfway between the next two ratios."""
    x = np.random.default_rng(104).normal(size=UNEVEN_VOCAB) * 1.5
    x[0] = x.max() + 0.3
    t, k = 0.8, 12
    ratios = np.sort(np.exp((x - x.max()) / t))[::-1]
    return x, (t, k, 1.0, float((ratios[k] + ratios[k + 1]) / 2))


def _probs_on_both_shards():
    """World 2: probabilities whose top-k (then top-p) survivors include token 0."""
    rng = np.random.default_rng(400)
    x = rng.normal(size=UNEVEN_VOCAB) * 2.0
    x[0] = x.max() - rng.random() * 0.5
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    t, k = 1.3, 10
    return probs, (t, k, robust_top_p(reference_probs(probs, t, k, is_logits=False), rng), 0.0)


def _coarse_row():
    """World 4: top tokens at slot (511 | 512) and shard borders (999: the single-token shard);
    min-p only (no collective for the cut: the draw over coarse slots is what is tested)."""
    rng = np.random.default_rng(300)
    x = rng.normal(size=COARSE_VOCAB)
    for token in (999, 511, 512, 1000, 1599, 0, 1300, 1299):
        x[token] = x.max() - rng.random() * 0.5
    t = 0.8
    return x, (t, 0, 1.0, robust_min_p(np.exp((x - x.max()) / t), rng))


# Joint law of two draws without replacement: 8 finite tokens spread over both shards of
# world 2 (0 is the single-token one); the other logits are -inf.
JOINT_TOKENS = [0, 19, 20, 21, 36, 37, 45, 49]
JOINT_LOGITS = [1.0, 0.2, -0.5, 0.7, 0.0, 1.3, -1.0, 0.4]


def _joint_row() -> np.ndarray:
    x = np.full(UNEVEN_VOCAB, -np.inf)
    x[JOINT_TOKENS] = JOINT_LOGITS
    return x


def joint_tuples() -> np.ndarray:
    """The ordered pairs of distinct positions in JOINT_TOKENS."""
    k = len(JOINT_TOKENS)
    return np.array([(a, b) for a in range(k) for b in range(k) if a != b])


# One law per code path: Python top-k (the candidates all-gather, a shard shorter than k) with
# min-p; probabilities with top-k and top-p (the tie count all-reduce); num_samples=2; coarse
# slots on four shards. Top-p and min-p lie halfway between distinct values (robust_top_p).
LAWS = {
    "logits top-k min-p": LawSpec(2, "logits", *_peaked_at_the_single_token_shard(), 2_860_000),
    "probs top-k top-p": LawSpec(2, "probs", *_probs_on_both_shards(), 1_450_000),
    "joint n=2": LawSpec(2, "logits", _joint_row(), (1.0, 0, 1.0, 0.0), 4_120_000, 2),
    "coarse min-p": LawSpec(4, "logits", *_coarse_row(), 630_000, coarse=True),
}
LAW_CHUNK_ROWS = 16384  # rows per call (~4 us a row; fewer rows pay more per-call overhead)
LAW_CHUNK_ELEMENTS = 1 << 22  # and at most this many weights per call on the widest shard
EQUAL_ROWS = 1024  # seeds per row whose tensor-control tokens are compared with Python's


def law_counts(spec: LawSpec, rank: int) -> np.ndarray:
    """Counts of ``spec.draws`` draws: per token, or per pair ``a * vocab + b``."""
    span = spec.spans()[rank]
    local = shard(torch.tensor(spec.row[None], dtype=torch.float32), span)
    t, k, p, m = spec.controls
    widest = max(end - start for start, end in spec.spans())  # the same on every rank
    chunk = min(LAW_CHUNK_ROWS, LAW_CHUNK_ELEMENTS // widest)
    vocab = spec.vocab
    counts = torch.zeros(vocab**spec.num_samples, dtype=torch.int64)
    for start in range(0, spec.draws, chunk):
        rows = min(chunk, spec.draws - start)
        out = fsd.sample(
            **{spec.source: local.expand(rows, -1)},
            vocab_start=span[0],
            vocab_size=vocab,
            temperature=t,
            top_k=k,
            top_p=p,
            min_p=m,
            num_samples=spec.num_samples,
            seed=torch.arange(start, start + rows),
        )
        assert bool(out.valid.all())
        ids = out.token_ids[:, 0]
        if spec.num_samples == 2:
            ids = ids * vocab + out.token_ids[:, 1]
        counts += torch.bincount(ids, minlength=len(counts))
    return counts.numpy()


def exact_configs(vocab: int, seed: int, rows: int):
    """Rows of logits and per-row controls with cuts placed robustly between distinct values
    (as tests/test_controls.py does)."""
    rng = np.random.default_rng(seed)
    kinds = ("peaked", "flat", "ties", "masked")
    xs, controls = [], []
    for i in range(rows):
        kind = kinds[i % len(kinds)]
        if kind == "peaked":
            x = rng.normal(size=vocab) * 2.5
        elif kind == "flat":
            x = rng.normal(size=vocab) * 0.4
        elif kind == "ties":
            x = rng.integers(-2, 3, size=vocab).astype(np.float64)
        else:
            x = rng.normal(size=vocab)
            x[rng.random(vocab) < 0.5] = -np.inf
            x[rng.integers(vocab)] = 1.0
        t = float(rng.choice([0.6, 1.0, 1.5]))
        k = int(rng.choice([0, int(rng.integers(2, vocab // 2)), vocab + 1]))
        p = robust_top_p(reference_probs(x, t, k), rng) if rng.random() < 0.7 else 1.0
        m = robust_min_p(np.exp((x - x.max()) / t), rng) if rng.random() < 0.4 else 0.0
        xs.append(x)
        controls.append((t, k, p, m))
    return np.stack(xs), controls


def tensor_and_python_tokens(span, source: str, x: np.ndarray, controls) -> dict:
    """Ids of EQUAL_ROWS draws of row ``x`` (seeds 0, 1, ...) with the controls as Python
    numbers and as ``(B,)`` tensors."""
    data = shard(torch.tensor(x[None], dtype=torch.float32), span).expand(EQUAL_ROWS, -1)
    names = ("temperature", "top_k", "top_p", "min_p")
    python = dict(zip(names, controls, strict=True))
    tensors = {name: torch.full((EQUAL_ROWS,), value) for name, value in python.items()}
    common = dict(vocab_start=span[0], vocab_size=len(x), seed=torch.arange(EQUAL_ROWS))
    out = {}
    for kind, ctl in (("python", python), ("tensor", tensors)):
        got = fsd.sample(**{source: data}, **common, **ctl)
        assert bool(got.valid.all())
        out[kind] = got.token_ids[:, 0]
    return out


CONFIGS = 4  # tensor against Python controls: one row of each kind (peaked, flat, ties, masked)


def scenario_exact(rank: int, world: int) -> dict:
    out: dict = {"laws": {}, "equal": {}}
    for name, spec in LAWS.items():
        if spec.world != world:
            continue
        saved = _shard.MAX_SLOTS
        _shard.MAX_SLOTS = 8 if spec.coarse else saved
        try:
            out["laws"][name] = law_counts(spec, rank)
            if spec.coarse:
                span = spec.spans()[rank]
                layout = _shard.make_layout(span[0], span[1] - span[0], spec.vocab, rank, world)
                out["coarse per_slot"] = layout.per_slot
            if spec.num_samples == 1:
                span = spec.spans()[rank]
                out["equal"][name] = tensor_and_python_tokens(
                    span, spec.source, spec.row, spec.controls
                )
        finally:
            _shard.MAX_SLOTS = saved
    xs, controls = exact_configs(UNEVEN_VOCAB, seed=world, rows=CONFIGS)
    for row, (x, c) in enumerate(zip(xs, controls, strict=True)):
        out["equal"][f"config {row}"] = tensor_and_python_tokens(
            UNEVEN[world][rank], "logits", x, c
        )
    return out


def ties_input() -> torch.Tensor:
    x = torch.randn(4, UNEVEN_VOCAB, generator=torch.Generator().manual_seed(5))
    x[0, [45, 20, 3]] = 9.0  # maximum on three shards: id 3 wins
    x[1, [49, 21]] = 9.0  # on the last shards only: id 21
    x[2] = 0.0  # every token ties: id 0 (n=3: 0, 1, 2)
    x[3, [30, 0, 12]] = torch.tensor([5.0, 5.0, 5.0])  # id 0, then 12, 30
    return x


def scenario_greedy_ties(rank: int, world: int) -> dict:
    span = UNEVEN[world][rank]
    x = ties_input()
    common = dict(vocab_start=span[0], vocab_size=UNEVEN_VOCAB)
    mixed = torch.tensor([0.0, 0.0, 1.0, 0.0])
    return {
        "n=1": fsd.sample(shard(x, span), **common, temperature=0.0),
        "n=3": fsd.sample(shard(x, span), **common, temperature=0.0, num_samples=3),
        "mixed n=1": fsd.sample(shard(x, span), **common, temperature=mixed, seed=1),
        "mixed n=3": fsd.sample(shard(x, span), **common, temperature=mixed, seed=1, num_samples=3),
    }


def invalid_input(world: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    x = torch.randn(8, UNEVEN_VOCAB, generator=torch.Generator().manual_seed(6))
    last = UNEVEN[world][-1]  # a shard held by the last rank
    x[1, last[0]] = math.nan  # NaN on one shard only
    x[2, last[0]] = math.inf  # +inf on one shard only
    x[3] = -math.inf  # everything masked
    x[4, :] = -math.inf  # masked on every shard but one token
    x[4, 30] = 0.0
    probs = x.softmax(-1)
    probs[5, last[0]] = -0.5  # a negative probability on one shard
    probs[6] = 0.0  # nothing to draw
    top_p = torch.full((8,), 0.9)
    top_p[7] = 1.5  # out of range: invalid row, not an error
    return x, probs, dict(top_p=top_p, top_k=torch.full((8,), 5), seed=torch.arange(8), step=4)


def scenario_invalid(rank: int, world: int) -> dict:
    span = UNEVEN[world][rank]
    x, probs, ctl = invalid_input(world)
    common = dict(vocab_start=span[0], vocab_size=UNEVEN_VOCAB, **ctl)
    return {
        "logits": fsd.sample(shard(x, span), **common, num_samples=2),
        "probs": fsd.sample(probs=shard(probs.nan_to_num(0.0), span), **common),
    }


def scenario_traffic(rank: int, world: int) -> dict:
    vocab, batch = 128256, 8
    step = -(-vocab // world // 256) * 256
    span = (rank * step, min(vocab, (rank + 1) * step))
    x = mixed_logits(vocab, batch, seed=7)[:, span[0] : span[1]]
    ctl = tensor_controls(batch, vocab, seed=8)
    settings = {
        "plain": {},
        "T=0.7 k=50 p=0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
        "tensor": ctl,
        "tensor n=2": dict(ctl, num_samples=2),
        "greedy": dict(temperature=0.0),
        "no seed": dict(temperature=0.8, seed=None),
    }
    out = {}
    for name, kwargs in settings.items():
        kwargs = dict(kwargs)
        seed = kwargs.pop("seed", torch.arange(batch))
        with fsd.record_traffic() as traffic:
            fsd.sample(x, vocab_start=span[0], vocab_size=vocab, seed=seed, **kwargs)
        out[name] = [(c.kind, c.shape, c.payload_bytes, c.wire_bytes) for c in traffic.collectives]
    return out


def check_cases(rank: int, world: int):
    """``(name, kwargs)`` per bad-argument case, as this rank would pass them."""
    span = UNEVEN[world][rank]
    x = torch.randn(6, UNEVEN_VOCAB, generator=torch.Generator().manual_seed(9))
    good = dict(logits=shard(x, span), vocab_start=span[0], vocab_size=UNEVEN_VOCAB, seed=3)
    nan = shard(x, span).clone()
    if rank == world - 1:
        nan[2, 0] = math.nan
    masked = shard(x, span).clone()
    masked[4] = -math.inf
    yield "batch", dict(good, logits=shard(x, span)[: 6 if rank else 5])
    yield "vocab_size", dict(good, vocab_size=UNEVEN_VOCAB + (rank == 1))
    yield "overlap", dict(good, vocab_start=span[0] - (rank == 0))  # rank 0 starts past 0
    yield "gap", dict(good, logits=shard(x, span)[:, : -1 if span[1] - span[0] > 1 else None])
    yield "top_k", dict(good, top_k=5 + rank)
    yield "seed", dict(good, seed=torch.arange(6) + (rank == 1))
    yield "nan", dict(good, logits=nan)
    yield "all masked", dict(good, logits=masked)
    yield "type", dict(good, vocab_start=float(span[0]) if rank == 0 else span[0])


def scenario_check(rank: int, world: int) -> dict:
    out: dict = {}
    for name, kwargs in check_cases(rank, world):
        try:
            fsd.sample(**kwargs, check=True)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    span = UNEVEN[world][rank]
    x, ctl = uneven_input()
    common = dict(vocab_start=span[0], vocab_size=UNEVEN_VOCAB, seed=SEEDS[:40], **ctl)
    checked = fsd.sample(shard(x, span), **common, check=True)
    plain = fsd.sample(shard(x, span), **common)
    out["checked equals unchecked"] = all(
        torch.equal(a, b) for a, b in zip(checked[:4], plain[:4], strict=True)
    )
    return out


def scenario_large_vocab(rank: int, world: int) -> dict:
    """A 300,000-token vocabulary: slots of 512 entries keep collectives at <= 1024 values."""
    vocab = 300_000
    bounds = [round(vocab * i / world) + 37 * (0 < i < world) for i in range(world + 1)]
    span = (bounds[rank], bounds[rank + 1])
    x = mixed_logits(vocab, 4, seed=12)
    with fsd.record_traffic() as traffic:
        out = fsd.sample(
            shard(x, span), vocab_start=span[0], vocab_size=vocab, temperature=0.8, seed=4
        )
    widest = max(c.values_per_row for c in traffic.collectives)
    return {"out": out, "widest": widest}


SCENARIOS = {
    "bitwise": scenario_bitwise,
    "uneven": scenario_uneven,
    "exact": scenario_exact,
    "greedy_ties": scenario_greedy_ties,
    "invalid": scenario_invalid,
    "traffic": scenario_traffic,
    "check": scenario_check,
    "large_vocab": scenario_large_vocab,
}


# ----------------------------------------------------------------------------- process group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keep_freed_memory() -> None:
    """Keep freed blocks of up to 256 MiB in the heap: by default glibc unmaps every large
    block freed and the next call faults it back in, a third of the law draws' CPU time."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return
        libc.mallopt(-3, 256 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 512 << 20)  # M_TRIM_THRESHOLD


def _worker(rank: int, world: int, port: int, outdir: str, scenarios: dict | None) -> None:
    # Loopback only (macOS names it lo0).
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    torch.set_num_threads(1)  # world processes share 2 cores
    _keep_freed_memory()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    results: dict = {}
    try:
        for name, scenario in (SCENARIOS if scenarios is None else scenarios).items():
            start = time.perf_counter()
            try:
                results[name] = scenario(rank, world)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name + " seconds"] = time.perf_counter() - start
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_group(world: int, scenarios: dict | None = None) -> list[dict]:
    """Run every scenario on ``world`` gloo processes; each rank's results.

    ``scenarios``: name -> ``scenario(rank, world)`` (picklable: module-level functions or
    partials of them), :data:`SCENARIOS` if None. A scenario that raises leaves
    ``{"error": traceback}`` under its name (:func:`results` fails the test with it)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, outdir, scenarios))
                 for r in range(world)]  # fmt: skip
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + GROUP_TIMEOUT
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            assert not hung, f"ranks {hung} still running after {GROUP_TIMEOUT} s"
            codes = [p.exitcode for p in procs]
            assert codes == [0] * world, f"exit codes {codes}"
            return [
                torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)
            ]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def results(group, name: str) -> list:
    world, per_rank = group
    got = [r[name] for r in per_rank]
    for rank, value in enumerate(got):
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"world {world}, rank {rank}, scenario {name}:\n{value['error']}")
    return got


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[:4], b[:4], strict=True))
