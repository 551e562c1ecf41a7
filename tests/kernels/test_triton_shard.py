"""distributed.sample on the Triton backend (two gloo ranks, kernels interpreted on CPU): the same
tokens and validity as the torch path and as one-process sampling, probabilities to the last
bits (float32 block sums in another order), on aligned and unaligned shards, logits and
probabilities, bad rows, ties, out-of-range tensor controls; every control as a Python number
or a tensor (candidate and radix top-k, candidate and radix top-p, min-p, greedy rows),
several draws (a row running out of kept tokens), unseeded calls (rank 0's generator). One
round (summaries, slot masses, one draw) costs three launches per rank; every call one launch
per collective and no other device work; calls the kernels do not cover take the torch path."""

from __future__ import annotations

import math
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch

pytest.importorskip("triton")

import torch.distributed as dist
import torch.multiprocessing as mp

import fastsample as fs

WORLD = 2
BATCH = 48
# (vocab, shards per rank): aligned on 256-entry blocks (the bitwise case of the torch path),
# and unaligned with an odd vocabulary (head slots, the padding column).
LAYOUTS = {"aligned": (1000, [(512, 1000), (0, 512)]), "unaligned": (999, [(300, 999), (0, 300)])}
CONTROLS = [
    {"temperature": 0.8},
    {},
    {"temperature": 0.7, "min_p": 0.05},
]
# Rows whose tensor controls are out of range (invalid on every rank, as on one process).
OUT_OF_RANGE = [7, 8]


def tensor_controls() -> dict:
    """Per-row controls: greedy rows (T == 0), k from 1 to 60 and p in (0, 1] by row, k and
    p off in some rows, one negative k and one p above 1 (OUT_OF_RANGE)."""
    rows = torch.arange(BATCH)
    temperature = torch.where(rows % 5 == 0, 0.0, 0.5 + (rows % 7) / 4)
    top_k = (rows * 7) % 61
    top_p = torch.where(rows % 6 == 0, 1.0, 0.3 + (rows % 11) / 16)
    min_p = (rows % 4) / 40
    top_k[OUT_OF_RANGE[0]] = -1
    top_p[OUT_OF_RANGE[1]] = 1.5
    # EXHAUSTED is greedy (T == 0) with two finite logits: its third greedy draw is not
    # genuine; no top-p or min-p there, so its random draws keep both tokens too (where the
    # random draws run out before the greedy ones the torch path reports -inf probabilities).
    top_p[EXHAUSTED], min_p[EXHAUSTED] = 1.0, 0.0
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}


# The cuts on the Triton round (each adds collectives, one launch each): candidates
# (Python top_k <= 1024) and their ties for a Python top_p, radix rounds for the others.
CUTS = [
    {"temperature": 0.9, "top_k": 6},
    {"top_k": 10, "top_p": 0.8, "min_p": 0.01},
    {"temperature": 1.3, "top_p": 0.9},
    "tensors",
    # Several draws without replacement: one launch and one MAX per draw; row EXHAUSTED runs
    # out of kept tokens (invalid, its last draws repeat), as on one process.
    {"top_k": 10, "num_samples": 3},
    {"temperature": 0.9, "min_p": 0.002, "num_samples": 4},
    "tensors, 3 draws",  # greedy rows draw the 3 largest (EXHAUSTED is one of them)
]
EXHAUSTED = 25  # two finite logits


def inputs(vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(BATCH, vocab, generator=gen) * 3
    logits[9:24] = (logits[9:24] * 2).round() / 2  # ties at every cut
    logits[EXHAUSTED, 2:] = -math.inf
    logits[1, vocab // 3 :] = -math.inf  # a grammar mask
    logits[2, 5] = math.nan  # bad on one shard only
    logits[3] = -math.inf  # nothing to draw
    logits[4, 700:] = 30.0  # most mass on rank 0's shard
    probs = torch.softmax(logits.nan_to_num(nan=0.0), -1)
    probs[5, 10] = -1.0  # a negative probability
    probs[3] = 0.0
    return logits.to(dtype), probs.to(dtype)


def cases():
    for name, (vocab, _) in LAYOUTS.items():
        for dtype in (torch.float32, torch.float16) if name == "aligned" else (torch.float64,):
            for source in ("logits", "probs"):
                for i, controls in enumerate(CONTROLS):
                    if source == "probs" and "min_p" in controls:
                        continue
                    yield (name, str(dtype), source, i), (vocab, dtype, source, controls)
                # The cuts on float32 logits and probabilities (aligned) and float64 logits
                # (unaligned, odd vocabulary): each case runs every round step.
                if dtype == torch.float16 or (dtype == torch.float64 and source == "probs"):
                    continue
                for i, controls in enumerate(CUTS):
                    if isinstance(controls, str):
                        draws = 3 if controls.endswith("3 draws") else 1
                        controls = {**tensor_controls(), "num_samples": draws}
                    key = (name, str(dtype), source, f"cut{i}")
                    yield key, (vocab, dtype, source, controls)


def call(x: torch.Tensor, source: str, controls: dict, **kwargs):
    seeds = torch.arange(x.shape[0]) * 11 + 5
    steps = torch.full((x.shape[0],), 3, dtype=torch.int64)
    return dict(seed=seeds, step=steps, **{source: x}, **controls, **kwargs)


# Extra controls of the launch-budget calls (on T=0.8 float32 logits) and their collectives.
BUDGET_CALLS = {
    "no cut": {},
    "min_p": {"min_p": 0.05},
    "candidate top_k": {"top_k": 6},
    "candidate top_k, top_p": {"top_k": 6, "top_p": 0.8},
    "radix top_p": {"top_p": 0.9},
    "tensor T, k, p, min_p": "tensors",
    "three draws": {"num_samples": 3},
}
BUDGET_CALLS_COLLECTIVES = {
    "no cut": 3,
    "min_p": 3,
    "candidate top_k": 4,  # + all-gather of the candidates
    "candidate top_k, top_p": 5,  # + SUM of the ties at cut_k
    "radix top_p": 6,  # + 3 radix rounds
    "tensor T, k, p, min_p": 9,  # + 3 + 3 radix rounds
    "three draws": 5,  # + 2 MAX (one per draw)
}


UNSEEDED = {"T=0.8": {}, "T=0.8, top_k=10, 3 draws": {"top_k": 10, "num_samples": 3}}
GENERATOR_SEED = 100


def _worker(rank: int, port: int, outdir: str, tests_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    os.environ["FASTSAMPLE_BACKEND"] = "triton"
    sys.path.insert(0, tests_dir)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    from fastsample.distributed import record_traffic, sample
    from launch_budget import device_work

    results: dict = {}
    try:
        for key, (vocab, dtype, source, controls) in cases():
            spans = LAYOUTS[key[0]][1]
            start, end = spans[rank]
            x = inputs(vocab, dtype)[0 if source == "logits" else 1][:, start:end]
            kwargs = call(x, source, controls, vocab_start=start, vocab_size=vocab)
            for backend in ("triton", "torch"):
                os.environ["FASTSAMPLE_BACKEND"] = backend
                out = sample(**kwargs)
                fields = (out.token_ids, out.probs, out.valid, out.logprobs)
                results[(backend, *key)] = tuple(t.clone() for t in fields)
        os.environ["FASTSAMPLE_BACKEND"] = "triton"
        vocab, spans = LAYOUTS["aligned"]
        x = inputs(vocab, torch.float32)[0][:, slice(*spans[rank])]
        kwargs = call(
            x, "logits", {"temperature": 0.8}, vocab_start=spans[rank][0], vocab_size=vocab
        )
        for name, extra in BUDGET_CALLS.items():
            extra = tensor_controls() if extra == "tensors" else extra
            with record_traffic() as traffic:
                total, _, launches = device_work(lambda e=extra: sample(**{**kwargs, **e}))
            results[("budget", name)] = (total, launches, traffic.count)
        # Unseeded: every rank draws from its generator, rank 0's draws are used; the same
        # launches plus the generator's draw (one aten op).
        unseeded = {k: v for k, v in kwargs.items() if k not in ("seed", "step")}
        for name, extra in UNSEEDED.items():
            for backend in ("triton", "torch"):
                os.environ["FASTSAMPLE_BACKEND"] = backend
                torch.manual_seed(GENERATOR_SEED + rank)  # rank 1's state differs
                out = sample(**unseeded, **extra)
                fields = (out.token_ids, out.probs, out.valid, out.logprobs)
                results[(backend, "unseeded", name)] = tuple(t.clone() for t in fields)
        os.environ["FASTSAMPLE_BACKEND"] = "triton"
        with record_traffic() as traffic:
            total, _, launches = device_work(lambda: sample(**unseeded))
        results[("budget", "unseeded")] = (total, launches, traffic.count)
        # Not covered by the kernels (a Python temperature 0: nothing random, one all-gather):
        # the torch path.
        results["fallback"] = device_work(lambda: sample(**{**kwargs, "temperature": 0.0}))[2]
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks():
    """Each rank's results from one run of every case on two gloo processes."""
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, port, outdir, tests_dir)) for r in range(WORLD)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + 300
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            assert not any(p.is_alive() for p in procs), "ranks still running after 300 s"
            out = [
                torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
                for r in range(WORLD)
            ]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
    for r in out:
        assert "error" not in r, r.get("error")
    return out


def on(backend: str, fn, **kwargs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTSAMPLE_BACKEND", backend)
        return fn(**kwargs)


CASES = list(cases())


@pytest.mark.parametrize("key,case", CASES, ids=["-".join(map(str, key)) for key, _ in CASES])
def test_equals_torch_path_and_one_process_sampling(ranks, key, case):
    """Every rank returns the same result; it equals the torch path's distributed result and,
    on block-aligned shards (where the torch path is bitwise one-process sampling), one-process
    sampling on both backends: ids and validity exactly, probabilities to rounding."""
    vocab, dtype, source, controls = case
    x = inputs(vocab, dtype)[0 if source == "logits" else 1]
    first, second = ranks[0][("triton", *key)], ranks[1][("triton", *key)]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    references = {"torch distributed": ranks[0][("torch", *key)]}
    if key[0] == "aligned":
        # One process on the Triton backend equals the torch backend in its own tests; the
        # cut cases compare with the torch backend only (the interpreter's radix is slow).
        for backend in ("torch",) if str(key[3]).startswith("cut") else ("torch", "triton"):
            one = on(backend, fs.sample, **call(x, source, controls))
            references[f"{backend} one process"] = (
                one.token_ids,
                one.probs,
                one.valid,
                one.logprobs,
            )
    ids, probs, valid, logprobs = first
    tight = 1e-12 if dtype == torch.float64 else 1e-6
    rows = torch.ones(BATCH, dtype=torch.bool)
    for name, (ids_ref, probs_ref, valid_ref, logprobs_ref) in references.items():
        assert torch.equal(ids, ids_ref) and torch.equal(valid, valid_ref), name
        if name.endswith("one process") and isinstance(controls.get("temperature"), torch.Tensor):
            # A greedy row with fewer genuine draws than asked (EXHAUSTED) is invalid on both,
            # but its genuine draws' probabilities differ: the random draws' on the torch
            # distributed path (which the Triton round follows), not on one process.
            rows[EXHAUSTED] = controls.get("num_samples", 1) == 1
        torch.testing.assert_close(probs[rows], probs_ref[rows], rtol=tight, atol=0)
        assert torch.equal(logprobs.isinf(), logprobs_ref.isinf()), name
        finite = ~logprobs.isinf() & rows[:, None]
        torch.testing.assert_close(logprobs[finite], logprobs_ref[finite], rtol=tight, atol=tight)
    bad_rows = [2, 3] if source == "logits" else [3, 5]  # NaN on one shard; no mass; p < 0
    good = torch.ones(BATCH, dtype=torch.bool)
    good[:6] = False
    if isinstance(controls.get("top_k"), torch.Tensor):
        bad_rows += OUT_OF_RANGE
        good[OUT_OF_RANGE] = False
    if controls.get("num_samples", 1) > 2:
        bad_rows.append(EXHAUSTED)
        good[EXHAUSTED] = False
        if isinstance(controls.get("top_k"), torch.Tensor):  # small k or p: fewer than 3 kept
            good[:] = False
    assert not bool(valid[bad_rows].any()) and bool(valid[good].all())


def test_one_launch_per_collective(ranks):
    """The launch budget of triton_round: one launch before each collective and no other
    device work (no aten op); the draw round without cuts is 3 launches; each cut step adds
    one collective and one launch (EXPECTED_COLLECTIVES, the table of triton_round)."""
    for rank in ranks:
        for name, expected in BUDGET_CALLS_COLLECTIVES.items():
            total, launches, collectives = rank[("budget", name)]
            assert collectives == expected, (name, collectives)
            assert launches == collectives and total == launches, (name, total, launches)
        total, launches, collectives = rank[("budget", "unseeded")]
        assert launches == collectives == 3 and total == 4  # + the generator's draw
        assert rank["fallback"] == 0  # all greedy: the torch path


@pytest.mark.parametrize("name", list(UNSEEDED))
def test_unseeded_uses_rank_zero_generator(ranks, name):
    """Unseeded calls: both ranks return the same result, the torch path's, and one process's
    with rank 0's generator state (block-aligned shards)."""
    first, second = ranks[0][("triton", "unseeded", name)], ranks[1][("triton", "unseeded", name)]
    vocab = LAYOUTS["aligned"][0]
    logits = inputs(vocab, torch.float32)[0]
    with pytest.MonkeyPatch.context() as patch, torch.random.fork_rng():
        patch.setenv("FASTSAMPLE_BACKEND", "torch")
        torch.manual_seed(GENERATOR_SEED)
        one = fs.sample(logits, temperature=0.8, **UNSEEDED[name])
    one_process = (one.token_ids, one.probs, one.valid, one.logprobs)
    references = [ranks[0][("torch", "unseeded", name)], one_process]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    for ids, probs, valid, _ in references:
        assert torch.equal(first[0], ids) and torch.equal(first[2], valid)
        torch.testing.assert_close(first[1], probs, rtol=1e-6, atol=0)
