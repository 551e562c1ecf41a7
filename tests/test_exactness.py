"""Exactness of both draw methods against exact float64 probabilities.

Families: single-draw law over many row shapes, dtypes and vocabulary sizes; the joint law
of 2 and 3 draws without replacement (Plackett-Luce); the far tail; zero-probability
tokens. Each family has a negative control: the same test rejects a sampler biased by 2%
of the probability mass (or, for the tail, the classic coarse-grid implementation).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import fastsample as fs
from stattests import (
    assert_law,
    binned,
    count_draws,
    law_rejected,
    plackett_luce,
    poisson_bounds,
)

METHODS = ["inverse_cdf", "race"]
# The race draws one uniform per entry (~15 ns each on CPU): cap its work per test.
ENTRY_BUDGET = {"inverse_cdf": 4e9, "race": 1.5e8}


def make_row(kind: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A float64 row of non-negative weights of a given shape (not normalized)."""
    if kind == "flat":
        w = torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.5
    elif kind == "peaked":
        w = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 4, 0)
    elif kind == "long_tailed":  # Zipf-like, shuffled
        w = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
        w = w[torch.randperm(vocab, generator=gen)]
    elif kind == "zeros":  # half the entries exactly 0, including the first and last
        w = torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.1
        w[torch.rand(vocab, generator=gen) < 0.5] = 0
        if vocab > 2:
            w[0] = w[-1] = 0
            w[vocab // 2] = 1.0
    else:
        raise ValueError(kind)
    return w


# (kind, vocab, dtype): V from 2 to 200,000, every dtype, ragged and exact block multiples.
CASES = [
    ("flat", 2, torch.float32),
    ("peaked", 3, torch.float16),
    ("zeros", 17, torch.bfloat16),
    ("long_tailed", 256, torch.float64),
    ("peaked", 1000, torch.float32),
    ("zeros", 4099, torch.float16),
    ("flat", 32000, torch.bfloat16),
    ("long_tailed", 50_000, torch.float32),
    ("peaked", 128_256, torch.bfloat16),
    ("zeros", 200_000, torch.float64),
    ("long_tailed", 200_000, torch.float16),
]


def sampler(method: str, gen: torch.Generator):
    def draw(batch: torch.Tensor) -> torch.Tensor:
        out = fs.sample_from_probs(batch, 1, generator=gen, method=method)
        assert bool(out.valid.all())
        return out.token_ids

    return draw


def draws_for(method: str, vocab: int) -> int:
    return int(min(200_000, ENTRY_BUDGET[method] / vocab))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind,vocab,dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_single_draw_law(method, kind, vocab, dtype):
    gen = torch.Generator().manual_seed(vocab * 7 + len(kind))
    row = make_row(kind, vocab, gen).to(dtype)
    exact = row.double().numpy()  # the law of the row exactly as given, in float64
    total = draws_for(method, vocab)
    counts = count_draws(sampler(method, gen), row, total, chunk=max(1, int(2e7 // vocab)))
    assert counts.sum() == total
    if vocab > 64:  # enough cells for power, each expecting plenty of draws
        counts, exact = binned(counts, exact, num_bins=min(64, max(8, total // 200)))
    assert_law(counts, exact, what=f"{method} {kind} V={vocab} {dtype}")


@pytest.mark.parametrize("method", METHODS)
def test_single_draw_law_rejects_biased_sampler(method):
    """Negative control: 2% of the mass moved onto one token is caught by the same test."""
    gen = torch.Generator().manual_seed(5)
    vocab = 1000
    row = make_row("peaked", vocab, gen)
    exact = (row / row.sum()).numpy()
    biased = row / row.sum()
    biased = biased * 0.98
    biased[int(torch.argmin(biased))] += 0.02
    total = draws_for(method, vocab)
    counts = count_draws(sampler(method, gen), biased.float(), total, chunk=20_000)
    counts, exact = binned(counts, exact, num_bins=min(64, max(8, total // 200)))
    assert law_rejected(counts, exact)


def all_ordered_tuples(vocab: int, n: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(vocab), n)))


def joint_counts(draw, row: torch.Tensor, n: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    vocab = row.shape[0]
    tuples = all_ordered_tuples(vocab, n)
    index = {tuple(t): i for i, t in enumerate(tuples)}
    ids = draw(row.expand(total, -1), n).numpy()
    codes = np.zeros(len(ids), dtype=np.int64)
    for j in range(n):
        codes = codes * vocab + ids[:, j]
    uniq, cnt = np.unique(codes, return_counts=True)
    counts = np.zeros(len(tuples))
    for code, c in zip(uniq, cnt, strict=True):
        tup = tuple(int(code // vocab ** (n - 1 - j) % vocab) for j in range(n))
        assert tup in index, f"drew a repeated token: {tup}"
        counts[index[tup]] += c
    return counts, tuples


JOINT_ROW = [0.05, 0.4, 0.0, 0.2, 0.15, 0.2]  # includes an exact zero


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [2, 3])
def test_joint_law_without_replacement(method, n):
    gen = torch.Generator().manual_seed(11 + n)
    row = torch.tensor(JOINT_ROW, dtype=torch.float32)

    def draw(batch, k):
        out = fs.sample_from_probs(batch, k, generator=gen, method=method)
        assert bool(out.valid.all())
        return out.token_ids

    counts, tuples = joint_counts(draw, row, n, 300_000)
    assert_law(counts, plackett_luce(np.array(JOINT_ROW), tuples), what=f"{method} n={n}")


@pytest.mark.parametrize("method", METHODS)
def test_joint_law_rejects_biased_sampler(method):
    """Negative control: a second draw biased by 2% of the mass is caught."""
    gen = torch.Generator().manual_seed(3)
    row = torch.tensor(JOINT_ROW, dtype=torch.float64)

    def draw(batch, k):
        first = fs.sample_from_probs(batch, 1, generator=gen, method=method).token_ids
        rest = batch.scatter(1, first, 0.0)
        rest = rest / rest.sum(-1, keepdim=True) * 0.98
        rest[:, 0] += 0.02 * (first[:, 0] != 0)
        second = fs.sample_from_probs(rest, 1, generator=gen, method=method).token_ids
        return torch.cat([first, second], 1)

    counts, tuples = joint_counts(draw, row, 2, 300_000)
    assert law_rejected(counts, plackett_luce(np.array(JOINT_ROW), tuples))


def test_fast_sample_joint_law_matches_multinomial_law():
    gen = torch.Generator().manual_seed(21)
    row = torch.tensor(JOINT_ROW, dtype=torch.bfloat16)

    def draw(batch, k):
        sample_p, sample_index = fs.fast_sample(batch, k, generator=gen)
        assert torch.equal(sample_p, batch.gather(1, sample_index))
        return sample_index

    counts, tuples = joint_counts(draw, row, 3, 300_000)
    assert_law(counts, plackett_luce(row.double().numpy(), tuples), what="fast_sample n=3")


# --- the far tail -------------------------------------------------------------------------

TAIL_TOKENS = 250_000
TAIL_RATIO = 1e-9


def tail_row(dtype=torch.float32) -> tuple[torch.Tensor, float]:
    """One dominant token (index 0) and 250,000 tokens each 1e-9 as likely."""
    row = torch.full((TAIL_TOKENS + 1,), TAIL_RATIO, dtype=torch.float64)
    row[0] = 1.0
    tail_mass = TAIL_TOKENS * TAIL_RATIO / (1 + TAIL_TOKENS * TAIL_RATIO)
    return row.to(dtype), tail_mass


def tail_hits(draw, row: torch.Tensor, total: int, chunk: int) -> int:
    counts = count_draws(draw, row, total, chunk)
    return int(counts[1:].sum())


def flat_float32_inverse_cdf(row: torch.Tensor, total: int, gen: torch.Generator) -> np.ndarray:
    """The classic bug, as counts: a running float32 sum over the vocabulary (as a GPU
    cumsum does) and a float32 uniform. Past the dominant token, 1 + 1e-9 rounds to 1."""
    cdf = np.cumsum(row.numpy().astype(np.float32), dtype=np.float32)
    u = torch.rand(total, generator=gen).numpy() * cdf[-1]
    ids = np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)
    return np.bincount(ids, minlength=len(cdf))


def test_tail_mass_inverse_cdf():
    gen = torch.Generator().manual_seed(99)
    row, tail_mass = tail_row()
    total = 160_000
    lo, hi = poisson_bounds(total * tail_mass)
    hits = tail_hits(sampler("inverse_cdf", gen), row, total, chunk=4096)
    assert lo <= hits <= hi, f"{hits} tail draws, expected {total * tail_mass:.0f} [{lo}, {hi}]"
    # Negative control: the same bounds reject the flat float32 cumsum.
    bad = int(flat_float32_inverse_cdf(row, total, gen)[1:].sum())
    assert not lo <= bad <= hi


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="race tail test needs ~1e11 "
    "uniforms: CUDA only (the CPU checks the noise resolution in test_noise)",
)
def test_tail_mass_race_cuda():
    gen = torch.Generator(device="cuda").manual_seed(99)
    row, tail_mass = tail_row()
    row = row.cuda()
    total = 160_000
    lo, hi = poisson_bounds(total * tail_mass)

    def race(batch):
        return fs.sample_from_probs(batch, 1, generator=gen, method="race").token_ids

    assert lo <= tail_hits(race, row, total, chunk=2048) <= hi

    def coarse_race(batch):  # negative control: noise from float32 uniforms (2^-24 grid)
        u = torch.rand(batch.shape, device=batch.device, generator=gen)
        return (batch / -torch.log1p(-u).clamp_min(2.0**-25)).argmax(-1, keepdim=True)

    assert not lo <= tail_hits(coarse_race, row, total, chunk=2048) <= hi


# --- zero-probability tokens --------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_zero_probability_never_drawn(method):
    """Millions of draws from rows whose zeros sit next to tiny and huge weights."""
    gen = torch.Generator().manual_seed(17)
    vocab = 600  # spans three blocks, one of them short
    row = torch.zeros(vocab, dtype=torch.float32)
    row[1::3] = 1e-30  # tiny, next to zeros
    row[2::7] = 1.0
    row[vocab - 1] = 0.0
    zeros = (row == 0).numpy()
    draws = 0
    target = 2_000_000 if method == "inverse_cdf" else 1_000_000
    hits = 0
    while draws < target:
        ids = fs.sample_from_probs(row.expand(50_000, -1), 2, generator=gen, method=method)
        assert bool(ids.valid.all())
        hits += int(zeros[ids.token_ids.numpy()].sum())
        draws += ids.token_ids.numel()
    assert hits == 0


def test_zero_probability_check_rejects_leaky_sampler():
    """Negative control: a sampler leaking 2% of the mass uniformly is caught at once."""
    gen = torch.Generator().manual_seed(18)
    row = torch.zeros(600)
    row[2::7] = 1.0
    leaky = row / row.sum() * 0.98 + 0.02 / row.numel()
    ids = fs.sample_from_probs(leaky.expand(50_000, -1), 1, generator=gen).token_ids
    assert int((row[ids] == 0).sum()) > 0


@pytest.mark.parametrize("method", METHODS)
def test_all_tokens_drawn_is_a_permutation(method):
    """num_samples == V: every row comes out as a permutation, first slot by its law."""
    gen = torch.Generator().manual_seed(31)
    row = torch.tensor([0.5, 0.1, 0.25, 0.15, 0.0001])
    ids = fs.sample_from_probs(row.expand(100_000, -1), 5, generator=gen, method=method)
    assert bool(ids.valid.all())
    assert torch.equal(ids.token_ids.sort(-1).values, torch.arange(5).expand(100_000, -1))
    counts = np.bincount(ids.token_ids[:, 0].numpy(), minlength=5)
    assert_law(counts, row.double().numpy(), what=f"{method} first of a full permutation")


@pytest.mark.parametrize("method", METHODS)
def test_float64_weights_below_float32_range(method):
    """float64 rows are summed and raced in float64: 1e-300-scale weights keep their law."""
    gen = torch.Generator().manual_seed(32)
    row = torch.tensor([1e-300, 2e-300, 0.0, 3e-300, 4e-310], dtype=torch.float64)
    out = fs.sample_from_probs(row.expand(200_000, -1), 1, generator=gen, method=method)
    assert bool(out.valid.all())
    counts = np.bincount(out.token_ids[:, 0].numpy(), minlength=5)
    assert_law(counts, row.numpy(), what=f"{method} float64 tiny weights")
