"""``fastsample.distributed.sample(cut_order=...)``: the three orders of tests/test_cut_order.py
across vocabulary shards, on 2 and 4 gloo processes (torch path; world 2 also the Triton
round, interpreted on CPU).

Top-p's mass is the top-k survivors' (``"transformers"``), min-p's and top-k's (``"vllm"``:
the ties at ``max(cut_k, cut_min)``) or the whole row's (``"joint"``: each shard's mass,
summed), whichever way the cuts are taken: candidates and their SUM (Python ``top_k`` and
``top_p``), candidates then radix top-p (a tensor ``top_p``), radix rounds for both (tensor
controls). Rows of tests/test_cut_order.py's ``order_batch`` (top-p placed robustly for the
order; top-k on in every row, min-p above it in most), each drawn with 32 seeds on aligned and
uneven shards:

* every rank returns the same; every drawn token has the float64 reference's probability in
  that order (``reference_probs(..., cut_order=order)``), so it lies in the order's kept set;
  the same draws checked against another order's reference fail (negative control);
* on aligned shards the torch path's outputs are bitwise one process's (``fastsample.sample``
  with the same seeds and order); the Triton round's tokens and validity are the torch
  path's, probabilities to 1e-6;
* each call costs as many collectives (and, on the Triton round, launches: one per
  collective) as the same call in the default order.

Law (world 2, torch path): the joint law row of tests/test_cut_order.py, the token the orders
disagree on on another shard than the top two, 1,157,000 draws with Python controls (the
candidates and the whole row's mass): the joint law at 2%, the sequential one rejected at the
same size; tensor controls (the radix rounds) draw the same tokens seed for seed.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np
import pytest
import torch

import fastsample as fs
import test_cut_order
from distributed_helpers import (
    ALIGNED,
    ALIGNED_VOCAB,
    UNEVEN,
    UNEVEN_VOCAB,
    results,
    run_group,
    shard,
)  # fmt: skip
from reference import min_p_keeping, reference_probs, robust_top_p, top_p_keeping
from stattests import LawCase, assert_law, law_rejected
from test_controls import make_logits

WORLDS = (2, 4)
ORDERS = test_cut_order.ORDERS
HAS_TRITON = importlib.util.find_spec("triton") is not None
FORMS = ("python", "mixed", "tensors")
KINDS = ("peaked", "flat", "ties", "masked")
DRAWS_PER_ROW = 32
# Config rows per (layout, order) and backend: the interpreter runs each launch in Python.
ROWS = {"torch": 6, "triton": 2}
LAYOUTS = {"aligned": (ALIGNED_VOCAB, ALIGNED, (2, 60)), "uneven": (UNEVEN_VOCAB, UNEVEN, (2, 20))}

# The law: tests/test_cut_order.py's joint row (weights 8, 4, 2, 1 and a tail) with top_k=4,
# top_p=0.75, min_p=0.1: the joint order keeps {8, 4, 2}, the sequential {8, 4}. Rank 1 holds
# tokens 0 and 1, rank 0 the third and the rest of the row's mass.
LAW_SPANS = [(2, 16), (0, 2)]
LAW_DRAWS = test_cut_order.JOINT_DRAWS
LAW_CHUNK = 65_536
EQUAL_ROWS = 1024


def configs(layout: str, order: str, rows: int):
    """Rows of every kind with top-k on and top-p robust on the mass ``order`` takes; in the
    "vllm" order min-p keeps fewer values than top-k, in the joint order top-p's cut falls
    inside the top-k set where it can (so the orders keep other sets in most rows)."""
    vocab, _, (low, high) = LAYOUTS[layout]
    rng = np.random.default_rng(vocab + len(order))
    xs, controls = [], []
    for i in range(rows):
        x = make_logits(KINDS[i % len(KINDS)], vocab, rng)
        t = float(rng.choice([0.6, 1.0, 1.5]))
        k = int(rng.integers(low, high))
        weights = np.exp((x - x.max()) / t)
        distinct = len(np.unique(reference_probs(x, t, k)[weights > 0])) - 1  # kept values
        m, p = 0.0, None
        if order == "vllm":
            m = fitting(min_p_keeping, weights, distinct, rng) or 0.0
        if order == "joint":
            p = fitting(top_p_keeping, weights, distinct, rng)
        if p is None:
            p = robust_top_p(reference_probs(x, t, k, 1.0, m, cut_order="vllm"), rng)
        xs.append(x)
        controls.append((t, k, p, m))
    return np.stack(xs), controls


def joined(outputs: list) -> list[torch.Tensor]:
    """The fields ``(token_ids, probs, valid, logprobs)`` of several calls, concatenated."""
    return [torch.cat([o[i] for o in outputs]) for i in range(4)]


def fitting(keeping, weights: np.ndarray, distinct: int, rng) -> float | None:
    """``keeping(weights, n)`` (a cut keeping the ``n`` largest values) for a random ``n``
    below ``distinct`` whose cut is robust (well apart from its neighbours), or None."""
    for n in rng.permutation(np.arange(1, max(distinct, 1))):
        try:
            return keeping(weights, int(n))
        except AssertionError:
            continue
    return None


def expanded(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(x[None], dtype=torch.float32).expand(DRAWS_PER_ROW, -1)


def seeds(row: int) -> torch.Tensor:
    return torch.arange(DRAWS_PER_ROW) + 1000 * row


def calls(layout: str, order: str, form: str, rows: int):
    """``(logits, controls, seeds)`` of each call: one per config row (Python numbers; Python
    top_k with tensor t, p, min_p), or every row at once (tensors)."""
    xs, ctl = configs(layout, order, rows)
    if form == "tensors":
        x = torch.cat([expanded(r) for r in xs])
        names = ("temperature", "top_k", "top_p", "min_p")
        controls = {n: torch.tensor(v).repeat_interleave(DRAWS_PER_ROW)
                    for n, v in zip(names, zip(*ctl, strict=True), strict=True)}  # fmt: skip
        yield x, controls, torch.cat([seeds(r) for r in range(rows)])
        return
    for r, (t, k, p, m) in enumerate(ctl):
        controls = dict(temperature=t, top_k=k, top_p=p, min_p=m)
        if form == "mixed":
            full = lambda v: torch.full((DRAWS_PER_ROW,), v)  # noqa: E731
            controls = dict(temperature=full(t), top_k=k, top_p=full(p), min_p=full(m))
        yield expanded(xs[r]), controls, seeds(r)


def measured(x: torch.Tensor, args: dict):
    """One call's output and cost: (collectives, kernel launches)."""
    from fastsample import distributed as fsd
    from launch_budget import device_work

    found = []
    with fsd.record_traffic() as traffic:
        _, _, launches = device_work(lambda: found.append(fsd.sample(x, **args)))
    return found[0], (traffic.count, launches)


def scenario_orders(rank: int, world: int, backends) -> dict:
    out = {}
    for backend in backends:
        os.environ["FASTSAMPLE_BACKEND"] = backend
        for layout, (vocab, spans, _) in LAYOUTS.items():
            span = spans[world][rank]
            for order in ORDERS:
                for form in FORMS:
                    got = []
                    for x, controls, seed in calls(layout, order, form, ROWS[backend]):
                        args = dict(vocab_start=span[0], vocab_size=vocab, cut_order=order,
                                    seed=seed, **controls)  # fmt: skip
                        o, cost = measured(shard(x, span), args)
                        got.append(o[:4])
                    # The last call's cost, and the same call's in the default order.
                    args["cut_order"] = "transformers"
                    default = measured(shard(x, span), args)[1]
                    out["cost", backend, layout, order, form] = (cost, default)
                    out[backend, layout, order, form] = joined(got)
    os.environ["FASTSAMPLE_BACKEND"] = "torch"
    return out


def scenario_law(rank: int, world: int) -> dict:
    from fastsample import distributed as fsd

    span = LAW_SPANS[rank]
    row = torch.tensor(test_cut_order.LAW_ROW, dtype=torch.float32)[None, span[0] : span[1]]
    t, k, p, m = test_cut_order.JOINT_CONTROLS
    common = dict(vocab_start=span[0], vocab_size=len(test_cut_order.LAW_ROW), cut_order="joint")
    counts = torch.zeros(len(test_cut_order.LAW_ROW), dtype=torch.int64)
    for start in range(0, LAW_DRAWS, LAW_CHUNK):
        rows = min(LAW_CHUNK, LAW_DRAWS - start)
        o = fsd.sample(row.expand(rows, -1), **common, temperature=t, top_k=k, top_p=p,
                       min_p=m, seed=torch.arange(start, start + rows))  # fmt: skip
        assert bool(o.valid.all())
        counts += torch.bincount(o.token_ids[:, 0], minlength=len(counts))
    x = row.expand(EQUAL_ROWS, -1)
    names = ("temperature", "top_k", "top_p", "min_p")
    tensors = {n: torch.full((EQUAL_ROWS,), v) for n, v in zip(names, (t, k, p, m), strict=True)}
    equal = {
        "python": fsd.sample(x, **common, temperature=t, top_k=k, top_p=p, min_p=m,
                             seed=torch.arange(EQUAL_ROWS)).token_ids,
        "tensors": fsd.sample(x, **common, **tensors, seed=torch.arange(EQUAL_ROWS)).token_ids,
    }  # fmt: skip
    return {"counts": counts.numpy(), "equal": equal}


def backends_for(world: int) -> tuple[str, ...]:
    return ("torch", "triton") if world == 2 and HAS_TRITON else ("torch",)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def group(request):
    """``(world, results per rank)`` of one run of both scenarios on ``world`` gloo ranks."""
    world = request.param
    scenarios = {"orders": functools.partial(scenario_orders, backends=backends_for(world))}
    if world == 2:
        scenarios["law"] = scenario_law
    # The ranks run the Triton round on CPU tensors: the interpreter is on from their start.
    saved = os.environ.get("TRITON_INTERPRET")
    if saved is None and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        out = run_group(world, scenarios)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
    for name in scenarios:
        results((world, out), name)  # fails the test with a rank's traceback
    return world, out


def check_against_reference(out, layout: str, order: str, rows: int, judge: str) -> bool:
    """Whether every draw of ``out`` is valid, kept in ``judge``'s order and has its
    reference probability (the rows were made for ``order``)."""
    ids, probs, valid, _ = out
    xs, ctl = configs(layout, order, rows)
    laws = [reference_probs(x, *c, cut_order=judge) for x, c in zip(xs, ctl, strict=True)]
    want = np.repeat(np.stack(laws), DRAWS_PER_ROW, 0)
    expected = want[np.arange(len(want)), ids[:, 0].numpy()]
    close = np.allclose(probs[:, 0].double().numpy(), expected, rtol=0, atol=1e-6)
    return bool(valid.all()) and close and bool((expected > 0).all())


def cases(backends):
    for backend in backends:
        for layout in LAYOUTS:
            for order in ORDERS:
                for form in FORMS:
                    yield backend, layout, order, form


def test_every_rank_draws_the_orders_reference_probabilities(group):
    world, got = group
    for key in cases(backends_for(world)):
        backend, layout, order, _ = key
        for rank in range(1, world):
            for a, b in zip(got[rank]["orders"][key], got[0]["orders"][key], strict=True):
                assert torch.equal(a, b), f"world {world} rank {rank} {key}"
        out = got[0]["orders"][key]
        assert check_against_reference(out, layout, order, ROWS[backend], order), key


def test_negative_control_other_orders_references_fail(group):
    """Each order's draws fail the references of the orders that differ on its rows (the
    sequential orders agree without min-p, as in the rows made for "transformers"), on the
    torch path's draws of every form and layout."""
    _, got = group
    for layout in LAYOUTS:
        for order in ORDERS:
            for form in FORMS:
                out = got[0]["orders"]["torch", layout, order, form]
                for judge in ORDERS:
                    if judge != order and (order, judge) != ("transformers", "vllm"):
                        fits = check_against_reference(out, layout, order, ROWS["torch"], judge)
                        assert not fits, (layout, order, form, judge)


def test_aligned_shards_are_bitwise_one_process(group):
    world, got = group
    for order in ORDERS:
        for form in FORMS:
            each = calls("aligned", order, form, ROWS["torch"])
            want = joined([fs.sample(x, cut_order=order, seed=seed, **controls)
                           for x, controls, seed in each])  # fmt: skip
            out = got[0]["orders"]["torch", "aligned", order, form]
            for a, b in zip(out, want, strict=True):
                assert torch.equal(a, b), (world, order, form)


def test_triton_round_draws_the_torch_paths_tokens(group):
    world, got = group
    if "triton" not in backends_for(world):
        pytest.skip("the Triton round runs in world 2 with triton installed")
    for layout in LAYOUTS:
        for order in ORDERS:
            for form in FORMS:
                ours = got[0]["orders"]["triton", layout, order, form]
                theirs = got[0]["orders"]["torch", layout, order, form]
                rows = ROWS["triton"] * DRAWS_PER_ROW  # the torch path's first config rows
                assert torch.equal(ours[0], theirs[0][:rows]), (layout, order, form)
                assert torch.equal(ours[2], theirs[2][:rows]), (layout, order, form)
                torch.testing.assert_close(ours[1], theirs[1][:rows], rtol=1e-6, atol=0)


def test_the_orders_cost_the_same_collectives_and_launches(group):
    """The order changes what the collectives carry, not how many there are (nor, on the
    Triton round, the launches: one per collective)."""
    world, got = group
    for key in cases(backends_for(world)):
        cost, default = got[0]["orders"][("cost", *key)]
        assert cost == default, key
        if key[0] == "triton":
            collectives, launches = cost
            assert launches == collectives, key


def test_joint_law_across_shards_and_its_negative_control(group):
    world, got = group
    if world != 2:
        pytest.skip("the law runs in world 2")
    counts = got[0]["law"]["counts"]
    for r in got[1:]:
        assert np.array_equal(r["law"]["counts"], counts)
    assert counts.sum() == LAW_DRAWS
    assert_law(counts, test_cut_order.joint_law("joint"), what="distributed cut_order='joint'")
    assert law_rejected(counts, test_cut_order.joint_law("transformers"))
    equal = got[0]["law"]["equal"]
    assert torch.equal(equal["python"], equal["tensors"])


def law_cases():
    yield LawCase("world 2 cut_order='joint' V=16", test_cut_order.joint_law("joint"),
                  LAW_DRAWS, test_cut_order.CLAIM)  # fmt: skip
