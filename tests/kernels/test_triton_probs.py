"""The Triton backend of fast_sample and sample_from_probs against the torch path.

Same counters, so the same tokens (on all but one row in 10,000: float sums may be added in
another order); the same bad-row policy and argument checks; batch invariance bitwise; the edges
(V=1, B=1, B=0, V a multiple of the block or not, strided input); the launch budget (at
most 3 device ops per call); torch.compile(fullgraph=True) through the operators. On CPU the
kernels run in Triton's interpreter (tests/kernels/conftest.py), so sizes are small.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import fastsample as fs
from fastsample.kernels import backend
from fastsample.tools.bench.launches import device_work

METHODS = ["inverse_cdf", "race"]
NAN, INF = math.nan, math.inf


@pytest.fixture
def use_backend(monkeypatch):
    """``use_backend(name)`` sets FASTSAMPLE_BACKEND for the rest of the test."""
    return lambda name: monkeypatch.setenv("FASTSAMPLE_BACKEND", name)


def random_rows(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of varied shapes: peaked and flat softmaxes, with about a fifth exact zeros."""
    scale = torch.rand(batch, 1, generator=gen) * 6
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * scale, -1)
    return probs * (torch.rand(batch, vocab, generator=gen) > 0.2)


def counters(batch: int, gen: torch.Generator) -> dict:
    return dict(
        seed=torch.randint(0, 2**62, (batch,), generator=gen),
        step=torch.randint(0, 1000, (batch,), generator=gen),
        stream=torch.randint(0, 2**24, (batch,), generator=gen),
    )


def both(use_backend, call):
    use_backend("torch")
    reference = call()
    use_backend("triton")
    return reference, call()


# (num_samples, dtype, vocab): ragged and exact blocks, every dtype, several draws.
CASES = [
    (1, torch.float32, 700),
    (3, torch.bfloat16, 257),
    (2, torch.float16, 40),
    (1, torch.float64, 512),
]
# Rows per case: with at most allowed_mismatches(rows) differing, the 4 x 768 rows detect a law
# 2% off on 10% of the mass (stattests.equality_bias), what the Triton law tests carry.
SEEDED_ROWS = 768


def allowed_mismatches(rows: int) -> int:
    """Rows that may draw another token than the torch path: only where a uniform falls within
    float32 rounding (~1e-7) of a boundary (a GPU adds sums in another order), so one in
    10,000 is already far more than rounding explains."""
    return rows // 10_000


@pytest.mark.parametrize("method", METHODS)
def test_seeded_tokens_match_torch_path(use_backend, method):
    gen = torch.Generator().manual_seed(1 if method == "race" else 2)
    rows = mismatches = 0
    for num_samples, dtype, vocab in CASES:
        probs = random_rows(SEEDED_ROWS, vocab, gen).to(dtype)
        keys = counters(SEEDED_ROWS, gen)
        ref, out = both(
            use_backend,
            lambda p=probs, n=num_samples, k=keys: fs.sample_from_probs(p, n, method=method, **k),
        )
        assert out.token_ids.dtype == torch.int64 and out.probs.dtype == ref.probs.dtype
        assert torch.equal(out.valid, ref.valid)
        same = (out.token_ids == ref.token_ids).all(-1)
        rows += len(same)
        mismatches += int((~same).sum())
        # Probabilities: the same numbers up to the order of the float sums.
        close = dict(rtol=1e-12 if dtype == torch.float64 else 3e-7, atol=0)
        torch.testing.assert_close(out.probs[same], ref.probs[same], **close)
        torch.testing.assert_close(out.logprobs[same], ref.logprobs[same], rtol=1e-6, atol=1e-6)
    allowed = allowed_mismatches(rows)
    assert mismatches <= allowed, f"{mismatches} of {rows} rows differ from the torch path"


def test_fast_sample_matches_torch_path(use_backend):
    gen = torch.Generator().manual_seed(3)
    probs = random_rows(128, 300, gen).to(torch.bfloat16)
    keys = counters(128, gen)
    (_, ref_i), (p, i) = both(use_backend, lambda: fs.fast_sample(probs, 2, **keys))
    assert (i == ref_i).all(-1).float().mean() >= 0.999
    assert p.dtype == probs.dtype and torch.equal(p, probs.gather(1, i))


@pytest.mark.parametrize("method", METHODS)
def test_batch_invariance_bitwise(use_backend, method):
    use_backend("triton")
    gen = torch.Generator().manual_seed(4)
    probs = random_rows(24, 300, gen)
    keys = counters(24, gen)
    full = fs.sample_from_probs(probs, 2, method=method, **keys)
    order = torch.randperm(24, generator=gen)[:9]  # a smaller batch, shuffled
    part = fs.sample_from_probs(
        probs[order], 2, method=method, **{k: v[order] for k, v in keys.items()}
    )
    for name in ("token_ids", "probs", "logprobs", "valid"):
        assert torch.equal(getattr(part, name), getattr(full, name)[order]), name
    one = fs.sample_from_probs(probs[5:6], 2, method=method, **{k: v[5:6] for k, v in keys.items()})
    assert torch.equal(one.token_ids, full.token_ids[5:6])


BAD_ROWS = {
    "nan": lambda r: r.index_fill(0, torch.tensor([5]), NAN),
    "plus_inf": lambda r: r.index_fill(0, torch.tensor([650]), INF),
    "minus_inf": lambda r: r.index_fill(0, torch.tensor([3]), -INF),
    "negative": lambda r: r.index_fill(0, torch.tensor([299]), -1e-6),
    "all_zero": lambda r: torch.zeros_like(r),
    "all_nan": lambda r: torch.full_like(r, NAN),
    "float32_overflow": lambda r: r.index_fill(0, torch.tensor([1, 400]), 3e38),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bad_rows_as_torch_path(use_backend, method, dtype):
    gen = torch.Generator().manual_seed(5)
    clean = random_rows(10, 700, gen).to(dtype)
    dirty = clean.clone()
    for i, spoil in enumerate(BAD_ROWS.values()):
        dirty[i] = spoil(clean[i].float()).to(dtype)
    keys = counters(10, gen)
    for num_samples in (1, 3):

        def call(probs, n=num_samples):
            return fs.sample_from_probs(probs, n, method=method, **keys)

        ref, out = both(use_backend, lambda: call(dirty))
        good = call(clean)  # triton, clean batch
        assert torch.equal(out.valid, ref.valid)
        assert torch.equal(out.token_ids, ref.token_ids)
        ok = ref.valid
        untouched = torch.arange(10) >= len(BAD_ROWS)  # rows the same in both batches
        for name in ("token_ids", "probs", "logprobs"):
            got, expected = getattr(out, name)[untouched], getattr(good, name)[untouched]
            assert torch.equal(got, expected), name
        assert torch.equal(
            out.token_ids[~ok], torch.arange(num_samples).expand(int((~ok).sum()), -1)
        )
        assert not out.probs[~ok].any() and (out.logprobs[~ok] == -INF).all()
    overflow_row = len(BAD_ROWS) - 1
    assert bool(out.valid[overflow_row]) == (dtype == torch.float64)


def test_fast_sample_bad_rows(use_backend):
    use_backend("triton")
    probs = random_rows(6, 500, torch.Generator().manual_seed(6))
    probs[2, 10] = NAN
    probs[4] = 0
    sample_p, sample_index = fs.fast_sample(probs, 2, seed=3)
    assert sample_index[2].tolist() == [0, 1] and sample_index[4].tolist() == [0, 1]
    assert torch.equal(sample_p, probs.gather(1, sample_index))


@pytest.mark.parametrize("method", METHODS)
def test_more_draws_than_positive_weights(use_backend, method):
    use_backend("triton")
    probs = torch.tensor(
        [[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [0.2, 0.2, 0.2, 0.2, 0.2]]
    )
    out = fs.sample_from_probs(probs.repeat(60, 1), 4, method=method)
    ids, valid = out.token_ids.view(60, 3, 4), out.valid.view(60, 3)
    assert not valid[:, :2].any() and valid[:, 2].all()
    assert (ids[:, 0, :2].sort(-1).values == torch.tensor([1, 3])).all()
    assert (ids[:, 0, 2:] == ids[:, 0, 1:2]).all() and (ids[:, 1] == 4).all()
    assert (out.probs.view(60, 3, 4)[:, 1] == torch.tensor([1.0, 0, 0, 0])).all()


@pytest.mark.parametrize("method", METHODS)
def test_edges(use_backend, method):
    use_backend("triton")
    out = fs.sample_from_probs(torch.empty(0, 5), 2, method=method)
    assert out.token_ids.shape == (0, 2) and out.valid.shape == (0,)
    out = fs.sample_from_probs(torch.tensor([[3.0], [0.0]]), method=method, seed=1)
    assert out.token_ids.tolist() == [[0], [0]] and out.valid.tolist() == [True, False]
    assert out.probs.tolist() == [[1.0], [0.0]]
    one = fs.sample_from_probs(torch.tensor([[0.0, 0.0, 5.0]]), method=method)  # B=1
    assert one.token_ids.tolist() == [[2]] and one.probs.tolist() == [[1.0]]
    # Column-major input: the same draws as the contiguous copy.
    base = random_rows(4, 600, torch.Generator().manual_seed(7))
    strided = base.t().contiguous().t()
    a = fs.sample_from_probs(strided, 2, method=method, seed=5)
    assert torch.equal(a.token_ids, fs.sample_from_probs(base, 2, method=method, seed=5).token_ids)
    # Unseeded: a torch.Generator drives it, reproducibly.
    gen = torch.Generator()
    first = fs.sample_from_probs(base, 2, method=method, generator=gen.manual_seed(9)).token_ids
    again = fs.sample_from_probs(base, 2, method=method, generator=gen.manual_seed(9)).token_ids
    assert torch.equal(first, again)
    # An out-of-range tensor stream flags its row, as on the torch path.
    streams = torch.tensor([0, 2**24, -1, 5])
    out = fs.sample_from_probs(base, 2, seed=1, stream=streams, method=method)
    assert out.valid.tolist() == [True, False, False, True]
    assert out.token_ids[1:3].tolist() == [[0, 1], [0, 1]] and not out.probs[1:3].any()
    sample_p, sample_index = fs.fast_sample(base, 2, seed=1, stream=streams)
    assert sample_index[1:3].tolist() == [[0, 1], [0, 1]]
    assert torch.equal(sample_p, base.gather(1, sample_index))


def test_switch_and_argument_errors(use_backend, monkeypatch):
    probs = torch.softmax(torch.randn(2, 30), -1)
    use_backend("gpu")
    with pytest.raises(ValueError, match="FASTSAMPLE_BACKEND"):
        fs.fast_sample(probs)
    use_backend("triton")
    with pytest.raises(ValueError, match="num_samples"):
        fs.sample_from_probs(probs, 31)
    with pytest.raises(TypeError, match="probs must be float16"):
        fs.fast_sample(probs.long())
    monkeypatch.setattr(backend, "_TRITON_INSTALLED", [False])
    with pytest.raises(ImportError, match="pip install"):
        fs.fast_sample(probs)
    use_backend("auto")  # CPU tensors: the torch ops, whether triton is installed or not
    assert fs.fast_sample(probs)[1].shape == (2, 1)


LAUNCH_BUDGET = 3


def test_launch_budget(use_backend):
    use_backend("triton")
    probs = torch.softmax(torch.randn(4, 300), -1)
    seeds, steps = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    calls = {
        "fast_sample": lambda: fs.fast_sample(probs),
        "fast_sample n=2 seed=int": lambda: fs.fast_sample(probs, 2, seed=7),
        "fast_sample tensors": lambda: fs.fast_sample(probs, seed=seeds, step=steps),
        "sample_from_probs": lambda: fs.sample_from_probs(probs),
        "sample_from_probs race": lambda: fs.sample_from_probs(probs, 2, method="race"),
        "sample_from_probs seed=int": lambda: fs.sample_from_probs(probs, seed=7),
        "sample_from_probs n=2 tensors": lambda: fs.sample_from_probs(
            probs, 2, seed=seeds, step=steps, stream=seeds
        ),
        "fast_sample stream tensors": lambda: fs.fast_sample(
            probs, seed=seeds, step=steps, stream=seeds
        ),
    }
    for name, call in calls.items():
        call()
        work = device_work(call)
        assert work.kernels == 1, name
        assert work.total <= LAUNCH_BUDGET, f"{name}: {work}"
        if "tensors" in name:
            assert work.total == 1, f"{name}: {work}"


def test_launch_counter_sees_the_torch_path(use_backend):
    """Negative control for the budget: the counter does count the torch path's ops."""
    use_backend("torch")
    probs = torch.softmax(torch.randn(4, 1000), -1)
    work = device_work(lambda: fs.sample_from_probs(probs, seed=7))
    assert work.kernels == 0 and work.aten > 3 * LAUNCH_BUDGET


def test_compile_fullgraph(use_backend):
    use_backend("triton")
    probs = torch.softmax(torch.randn(6, 300), -1)
    seeds, steps = torch.arange(6), torch.full((6,), 2)

    def step(p, seed, step):
        out = fs.sample_from_probs(p, 2, seed=seed, step=step, method="inverse_cdf")
        sample_p, sample_index = fs.fast_sample(p, seed=seed, step=step)
        return out.token_ids, out.probs, out.valid, sample_p, sample_index

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(probs, seeds, steps), step(probs, seeds, steps), strict=True):
        assert torch.equal(got, expected)
