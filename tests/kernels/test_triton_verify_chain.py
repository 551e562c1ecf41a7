"""verify_chain on the Triton backend (interpreted on CPU): the emitted law on the toy model,
the mean accepted count against theory, negative controls, identical uniforms and tokens to the
torch path, bad rows as the torch path, and the launch budget (at most 4 per call)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

import fastsample as fs
from fastsample.kernels import launch
from fastsample.kernels import verify_chain as kc
from fastsample.kernels.philox import INTERPRETED
from fastsample.ops.seeds import CounterSource, Purpose, Stream
from fastsample.verify import chain as chain_mod
from launch_budget import device_work
from stattests import ALPHA, LawCase, _normal_isf, law_rejected
from verify_helpers import (
    CHAIN_BATCH,
    GROUPS,
    INF,
    NAN,
    V_CHAIN,
    ToyModel,
    assert_laws,
    chain_round,
    chain_trial,
    random_chain_batch,
)

# Smaller than the torch path's tests (the interpreter runs ~1e5 rows a second), still large
# enough that the negative controls below are rejected with a wide margin.
BATCH = CHAIN_BATCH  # as the torch path's tests: the same power


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "triton")


def on(backend: str, fn, *args, **kwargs):
    """``fn`` with ``FASTSAMPLE_BACKEND=backend`` (read at call time)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTSAMPLE_BACKEND", backend)
        return fn(*args, **kwargs)


_MODELS: dict[tuple[str, int], ToyModel] = {}


def model(kind: str, vocab: int = V_CHAIN) -> ToyModel:
    if (kind, vocab) not in _MODELS:
        _MODELS[kind, vocab] = ToyModel(kind, vocab)
    return _MODELS[kind, vocab]


# ---------------------------------------------------------------------------- exactness


def mean_accepted_z(toy: ToyModel, num_accepted: torch.Tensor, draft_count: int) -> float:
    expected = toy.expected_accepted(draft_count)
    values = num_accepted.double()
    return (values.mean().item() - expected) / (values.std().item() / math.sqrt(len(values)))


def test_chain_law_and_mean_accepted_with_draft_probs(triton_backend):
    """The laws of the first and first two tokens, and the first round's mean accepted count
    against theory (a two-sided z-test at the same false-alarm rate)."""
    toy = model("mixed")
    trial = chain_trial(toy, BATCH, seed=1)
    assert_laws(toy, trial, "triton chain mixed")
    assert abs(mean_accepted_z(toy, trial.num_accepted, 4)) <= _normal_isf(ALPHA / 2)


def test_chain_law_point_drafts_ragged_lengths(triton_backend):
    toy = model("mixed")
    lengths = torch.randint(0, 5, (BATCH // 2,), generator=torch.Generator().manual_seed(5))
    trial = chain_trial(toy, BATCH // 2, seed=2, probs=False, lengths=lengths)
    assert bool((trial.num_accepted <= lengths).all())
    assert_laws(toy, trial, "triton chain, point drafts, ragged lengths")


def test_chain_control_mismatched_draft_probs_rejected(triton_backend):
    """Negative control: drafts drawn from the draft model but verified against other draft
    probabilities (the draft's sharpened by ^1.3) emit a biased law; the same test sees it."""
    toy = model("random")
    SMALL = 40_000  # rejected already at a fifth of the main tests' rows
    sharp = toy.draft**1.3
    sharp = sharp / sharp.sum(-1, keepdim=True)
    keys, k = toy.start_keys(SMALL), 4
    gen = torch.Generator().manual_seed(9)
    target = torch.empty(SMALL, k + 1, toy.vocab, dtype=torch.float64)
    claimed = torch.empty(SMALL, k, toy.vocab, dtype=torch.float64)
    tokens = torch.empty(SMALL, k, dtype=torch.int64)
    key = keys
    for i in range(k):
        target[:, i], claimed[:, i] = toy.target[key], sharp[key]
        tokens[:, i] = torch.multinomial(toy.draft[key], 1, generator=gen)[:, 0]
        key = toy.child(key, tokens[:, i])
    target[:, k] = toy.target[key]
    out = fs.verify_chain(target, tokens, claimed, seed=torch.arange(SMALL), step=9)
    group = torch.arange(SMALL) % GROUPS
    counts = torch.bincount(group * toy.vocab + out.token_ids[:, 0], minlength=GROUPS * toy.vocab)
    assert law_rejected(counts.numpy(), toy.exact_laws()[0])


def test_chain_control_mean_accepted_with_two_percent_fewer_acceptances(triton_backend):
    """Negative control of the mean test: target probabilities scaled by 0.98 (2% fewer
    acceptances, as the torch path's control) are rejected by the same z-test."""
    toy = model("random")
    scaled = ToyModel("random", V_CHAIN)
    scaled.target = toy.target * 0.98
    out = chain_round(scaled, toy.start_keys(BATCH), 4, seed=11)
    assert abs(mean_accepted_z(toy, out.num_accepted, 4)) > _normal_isf(ALPHA / 2)


# ---------------------------------------------------------------------------- same as torch


@triton.jit
def _streams_kernel(seed_ptr, step_ptr, out_ptr, WIDTH: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    positions = tl.arange(0, WIDTH).to(tl.int64)
    base = out_ptr + row * 3 * WIDTH + positions
    tl.store(base, kc.stream_uniform(positions, seed, step, kc.ACCEPT))
    tl.store(base + WIDTH, kc.stream_uniform(positions, seed, step, kc.RECOVERY))
    tl.store(base + 2 * WIDTH, kc.stream_uniform(positions, seed, step, kc.BONUS))


def test_acceptance_recovery_bonus_uniform_bits_identical():
    gen = torch.Generator().manual_seed(3)
    seed = torch.randint(-(2**63), 2**63 - 1, (6,), generator=gen)
    step = torch.randint(0, 2**40, (6,), generator=gen)
    seed[:2] = torch.tensor([0, -1])
    out = torch.empty(6, 3, 16, dtype=torch.float64)
    launch.launcher(_streams_kernel, INTERPRETED)[(6,)](seed, step, out, WIDTH=16)
    for i, stream in enumerate((Stream.ACCEPT, Stream.RECOVERY, Stream.BONUS)):
        source = CounterSource(seed, step, torch.full((6,), int(stream)))
        assert torch.equal(out[:, i], source.uniforms(Purpose.DRAW, 0, 16))


CASES = [  # (batch, K, V, dtype): V not a multiple of the block, several blocks, V=1
    (2000, 4, 50, torch.float32),
    (1000, 3, 700, torch.float64),
    (1000, 5, 300, torch.float16),
    (60, 2, 1, torch.float32),
]
CALLS = 4  # per case: with and without draft probabilities, with and without draft lengths
# Rows and allowed mismatches of each case (V=1 draws nothing random): together they detect a
# law 2% off on 10% of the mass (stattests.equality_bias), what the law tests carry. The
# interpreter runs a batch in tiles of rows, so rows cost little here.
EQUALITY_CHECKS = [(b * CALLS, b * CALLS // 1000) for b, _, v, _ in CASES if v > 1]


@pytest.mark.parametrize("batch,k,vocab,dtype", CASES)
def test_chain_tokens_identical_to_torch_path(batch, k, vocab, dtype):
    target, tokens, draft = random_chain_batch(batch, k, vocab, seed=vocab, dtype=dtype)
    gen = torch.Generator().manual_seed(vocab)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    lengths = torch.randint(0, k + 1, (batch,), generator=gen)
    rows = same_rows = 0
    for q in (draft, None):
        for kwargs in ({}, {"draft_lengths": lengths}):
            args = (target, tokens, q)
            ref = on("torch", fs.verify_chain, *args, seed=seeds, step=9, **kwargs)
            out = on("triton", fs.verify_chain, *args, seed=seeds, step=9, **kwargs)
            same = (out.token_ids == ref.token_ids).all(1) & (out.valid == ref.valid)
            rows, same_rows = rows + batch, same_rows + int(same.sum())
            # Acceptances are exact float64 tests: only the final draw may differ (by rounding).
            assert torch.equal(out.num_accepted, ref.num_accepted)
    assert rows == batch * CALLS
    assert rows - same_rows <= rows // 1000, f"{rows - same_rows} of {rows} rows differ"


def test_chain_generator_path_matches_torch_path():
    """Unseeded calls: the kernel reads the torch path's uniforms (one torch.rand)."""
    target, tokens, draft = random_chain_batch(300, 4, 40, seed=4)
    ref = on("torch", fs.verify_chain, target, tokens, draft, generator=torch.manual_seed(5))
    out = on("triton", fs.verify_chain, target, tokens, draft, generator=torch.manual_seed(5))
    for field in ref._fields:
        assert torch.equal(getattr(out, field), getattr(ref, field)), field


def test_chain_bad_rows_as_torch_path():
    target, tokens, draft = random_chain_batch(12, 3, 20, seed=6)
    target, tokens, draft = target.clone(), tokens.clone(), draft.clone()
    target[0, 1, 3] = NAN  # a NaN in a row that may or may not be drawn from
    target[1] = NAN
    target[2, :, 5] = INF
    target[3, 0, 0] = -0.5
    draft[4] = NAN
    draft[5, 1, 2] = -1.0
    tokens[6, 1] = 20  # out of range
    tokens[7, 0] = -3
    target[8] = 0.0  # no mass anywhere
    lengths = torch.tensor([3, 3, 3, 3, 3, 3, 3, 3, 3, 4, -1, 1])  # rows 9, 10 out of range
    for q in (draft, None):
        for kwargs in ({}, {"draft_lengths": lengths}):
            ref = on("torch", fs.verify_chain, target, tokens, q, seed=torch.arange(12), **kwargs)
            out = on("triton", fs.verify_chain, target, tokens, q, seed=torch.arange(12), **kwargs)
            for field in ref._fields:
                assert torch.equal(getattr(out, field), getattr(ref, field)), field
    assert not bool(ref.valid[1])


def test_chain_batch_invariance_bitwise(triton_backend):
    target, tokens, draft = random_chain_batch(70, 4, 30, seed=7)
    seeds = torch.arange(70) * 3 + 1
    full = fs.verify_chain(target, tokens, draft, seed=seeds, step=2)
    for row in (0, 33, 69):
        pick = slice(row, row + 1)
        alone = fs.verify_chain(target[pick], tokens[pick], draft[pick], seed=seeds[pick], step=2)
        for field in full._fields:
            assert torch.equal(getattr(alone, field), getattr(full, field)[pick])


# ---------------------------------------------------------------------------- launch budget


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_launch_budget(triton_backend, with_probs):
    target, tokens, draft = random_chain_batch(4, 4, 1000, seed=8)
    seeds, steps = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    q = draft if with_probs else None
    fs.verify_chain(target, tokens, q, seed=seeds, step=steps)  # warm-up (caches)
    total, ops, launches = device_work(
        lambda: fs.verify_chain(target, tokens, q, seed=seeds, step=steps)
    )
    assert launches == 1 and total <= 4, ops
    lengths = torch.full((4,), 3)
    total, ops, _ = device_work(
        lambda: fs.verify_chain(target, tokens, q, draft_lengths=lengths, seed=seeds, step=0)
    )
    assert total <= 4, ops  # an int step becomes one (B,) tensor


def test_torch_backend_unchanged(monkeypatch):
    """FASTSAMPLE_BACKEND=torch keeps the torch path (the reference) and never launches."""
    from fastsample.kernels import launch

    monkeypatch.setenv("FASTSAMPLE_BACKEND", "torch")
    target, tokens, draft = random_chain_batch(8, 2, 16, seed=9)
    before = launch.launches()
    ref = chain_mod._verify_chain  # the reference implementation is still what runs
    assert callable(ref)
    fs.verify_chain(target, tokens, draft, seed=torch.arange(8))
    assert launch.launches() == before


def test_chain_and_tree_trace_under_torch_compile(triton_backend):
    """The operators trace with fullgraph=True and give the eager results."""
    target, tokens, draft = random_chain_batch(8, 3, 40, seed=10)
    seeds, steps = torch.arange(8), torch.zeros(8, dtype=torch.int64)
    eager = fs.verify_chain(target, tokens, draft, seed=seeds, step=steps)
    compiled = torch.compile(
        lambda: fs.verify_chain(target, tokens, draft, seed=seeds, step=steps), fullgraph=True
    )()
    for field in eager._fields:
        assert torch.equal(getattr(compiled, field), getattr(eager, field))
    tree = fs.TokenTree(torch.cat((torch.zeros(8, 1, dtype=torch.int64), tokens), 1), [-1, 0, 0, 1])
    eager = fs.verify_tree(target, tree, seed=seeds, step=steps)
    compiled = torch.compile(
        lambda: fs.verify_tree(target, tree, seed=seeds, step=steps), fullgraph=True
    )()
    for field in eager._fields:
        assert torch.equal(getattr(compiled, field), getattr(eager, field))


def law_cases():
    """The laws judged here, their sizes and claims: ``stattests.detectable_bias`` rounded up
    (tests/test_power.py checks them)."""
    from test_triton_law import carried

    same = (
        "tests/kernels/test_triton_verify_chain.py::test_chain_tokens_identical_to_torch_path, "
        "uniform bits: ::test_acceptance_recovery_bonus_uniform_bits_identical"
    )
    first, joint = model("mixed").exact_laws()
    runs = (  # (name, draws, claims: first token, first two; the torch path's law test)
        ("draft probs", BATCH, (0.10, 0.10), "test_chain_law_with_draft_probs"),
        ("point drafts, ragged lengths", BATCH // 2, (0.14, 0.13),
         "test_chain_law_of_point_drafts and ::test_chain_law_with_ragged_draft_lengths"),
    )  # fmt: skip
    for name, draws, claims, torch_test in runs:
        for which, law, claim in (("first token", first, claims[0]),
                                  ("first two tokens", joint, claims[1])):  # fmt: skip
            yield LawCase(
                f"chain mixed V={V_CHAIN} {name}: {which}", law, draws, claim,
                carried(EQUALITY_CHECKS, same, f"tests/verify/test_chain.py::{torch_test}"),
            )  # fmt: skip
