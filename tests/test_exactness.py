"""Exactness of both draw methods against exact float64 probabilities.

Families: single-draw law over row shapes, dtypes and vocabulary sizes; the joint law of 2
and 3 draws without replacement (Plackett-Luce); the far tail; zero-probability tokens. Each
law test judges its counts with stattests.law_test (p < 1e-6, cells that mix heavy tokens,
index ranges split by parity, probability tiers and hashed indices) at a size chosen from
stattests.detectable_bias; tests/test_power.py checks every claimed size and runs broken
copies of the sampler through these procedures. Each family has a negative control at the
size of the test it guards.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import fastsample as fs
from stattests import (
    LawCase,
    assert_law,
    count_draws,
    law_rejected,
    mid_mass_biased,
    plackett_luce,
    poisson_bounds,
    poisson_power,
)

METHODS = ["inverse_cdf", "race"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the single-draw tests draw


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


def case_row(kind: str, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    return make_row(kind, vocab, torch.Generator().manual_seed(vocab * 7 + len(kind))).to(dtype)


# (kind, vocab, dtype, draws): V from 2 to 200,000, every dtype, ragged and exact block
# multiples. Each size comes from stattests.draws_needed: the draws at which the law test
# detects a relative bias on 10% of the mass (stattests.detectable_bias) of at most the
# claim stated in tests/test_power.py (2% at V <= 1,000, 10% at V >= 32k). Fewer cases than
# shapes x dtypes x methods: each costs millions of draws at V <= 1,000.
CASES = [
    ("flat", 2, torch.float32, 640_000),
    ("zeros", 17, torch.bfloat16, 2_900_000),
    ("long_tailed", 256, torch.float64, 1_000_000),
    ("peaked", 1000, torch.float32, 1_000_000),
    ("zeros", 4099, torch.float16, 600_000),
    ("flat", 32000, torch.bfloat16, 104_000),
    ("zeros", 200_000, torch.float64, 104_000),
]
# The race draws one uniform per entry (~30 ns each on CPU): the CPU runs it on the shortest
# rows (its ops do not depend on V: an elementwise division and an argmax, and test_seeds
# checks the noise at every position up to 2**18 bitwise); CUDA runs it on all of them.
RACE_CPU = [0, 1]


def case_params():
    for i, (kind, vocab, dtype, draws) in enumerate(CASES):
        name = f"{kind}-{vocab}-{str(dtype).replace('torch.', '')}"
        yield pytest.param("inverse_cdf", kind, vocab, dtype, draws, id=f"inverse_cdf-{name}")
        marks = () if i in RACE_CPU else CUDA
        yield pytest.param("race", kind, vocab, dtype, draws, id=f"race-{name}", marks=marks)


def sampler(method: str, gen: torch.Generator):
    def draw(batch: torch.Tensor) -> torch.Tensor:
        out = fs.sample_from_probs(batch, 1, generator=gen, method=method)
        assert bool(out.valid.all())
        return out.token_ids

    return draw


def drawn_as(row: torch.Tensor) -> torch.Tensor:
    """Long half-precision rows are drawn from their float32 copy (the same law exactly): the
    CPU widens half rows a few rows at a time, slow for batches of thousands of one row, and
    test_seeds holds the half path bitwise to the float32 one at V=100,000."""
    long_half = row.shape[0] >= 4096 and row.dtype in (torch.float16, torch.bfloat16)
    return row.float() if long_half and DEVICE == "cpu" else row


def single_draw_counts(draw, row: torch.Tensor, draws: int) -> np.ndarray:
    """The single-draw procedure: ``draws`` draws of ``row`` through ``draw``, in chunks of
    about 2e7 entries (or 200,000 rows)."""
    chunk = max(1, min(200_000, int(2e7 // row.shape[0])))
    counts = count_draws(draw, row.to(DEVICE), draws, chunk)
    assert counts.sum() == draws
    return counts


@pytest.mark.parametrize("method,kind,vocab,dtype,draws", list(case_params()))
def test_single_draw_law(method, kind, vocab, dtype, draws):
    gen = torch.Generator(DEVICE).manual_seed(vocab * 7 + len(kind))
    row = case_row(kind, vocab, dtype)
    exact = row.double().numpy()  # the law of the row exactly as given, in float64
    counts = single_draw_counts(sampler(method, gen), drawn_as(row), draws)
    assert_law(counts, exact, what=f"{method} {kind} V={vocab} {dtype}")


@pytest.mark.parametrize("method", METHODS)
def test_single_draw_law_rejects_biased_sampler(method):
    """Negative control, at the size of the test it guards: the mid-mass tokens (the
    probability decile around the median of the mass) 1.5x the claimed detectable bias
    more likely, drawn by the real sampler, are caught by the law test at V=2, at its size."""
    kind, vocab, dtype, draws = CASES[0]
    gen = torch.Generator(DEVICE).manual_seed(5)
    exact = case_row(kind, vocab, dtype).double().numpy()
    wrong = torch.tensor(mid_mass_biased(exact, 0.03))
    counts = single_draw_counts(sampler(method, gen), wrong, draws)
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
JOINT_DRAWS = 300_000  # detects 7% (pairs) and 9% (triples): see tests/test_power.py


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [2, 3])
def test_joint_law_without_replacement(method, n):
    gen = torch.Generator().manual_seed(11 + n)
    row = torch.tensor(JOINT_ROW, dtype=torch.float32)

    def draw(batch, k):
        out = fs.sample_from_probs(batch, k, generator=gen, method=method)
        assert bool(out.valid.all())
        return out.token_ids

    counts, tuples = joint_counts(draw, row, n, JOINT_DRAWS)
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

    counts, tuples = joint_counts(draw, row, 2, JOINT_DRAWS)
    assert law_rejected(counts, plackett_luce(np.array(JOINT_ROW), tuples))


def test_fast_sample_joint_law_matches_multinomial_law():
    gen = torch.Generator().manual_seed(21)
    row = torch.tensor(JOINT_ROW, dtype=torch.bfloat16)

    def draw(batch, k):
        sample_p, sample_index = fs.fast_sample(batch, k, generator=gen)
        assert torch.equal(sample_p, batch.gather(1, sample_index))
        return sample_index

    counts, tuples = joint_counts(draw, row, 3, JOINT_DRAWS)
    assert_law(counts, plackett_luce(row.double().numpy(), tuples), what="fast_sample n=3")


# --- the far tail -------------------------------------------------------------------------

TAIL_TOKENS = 250_000
TAIL_RATIO = 1e-8  # below float32's half-ulp of 1 (6e-8): a float32 running sum never grows
TAIL_DRAWS = 75_000  # about 187 expected tail hits: the window rejects half (or twice) the rate


def tail_row(dtype=torch.float32) -> tuple[torch.Tensor, float]:
    """One dominant token (index 0) and 250,000 tokens each 1e-8 as likely."""
    row = torch.full((TAIL_TOKENS + 1,), TAIL_RATIO, dtype=torch.float64)
    row[0] = 1.0
    tail_mass = TAIL_TOKENS * TAIL_RATIO / (1 + TAIL_TOKENS * TAIL_RATIO)
    return row.to(dtype), tail_mass


def tail_window(total: int = TAIL_DRAWS) -> tuple[int, int]:
    """The acceptance window for the tail hits of ``total`` draws (p < 1e-6 two-sided)."""
    _, tail_mass = tail_row()
    return poisson_bounds(total * tail_mass)


def tail_hits(draw, row: torch.Tensor, total: int, chunk: int) -> int:
    counts = count_draws(draw, row, total, chunk)
    return int(counts[1:].sum())


def flat_float32_inverse_cdf(row: torch.Tensor, total: int, gen: torch.Generator) -> np.ndarray:
    """The classic bug, as counts: a running float32 sum over the vocabulary (as a GPU
    cumsum does) and a float32 uniform. Past the dominant token, 1 + 1e-8 rounds to 1."""
    cdf = np.cumsum(row.numpy().astype(np.float32), dtype=np.float32)
    u = torch.rand(total, generator=gen).numpy() * cdf[-1]
    ids = np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)
    return np.bincount(ids, minlength=len(cdf))


def test_tail_window_rejects_half_and_double_the_rate():
    """The power of the tail test, computed: half or twice the true tail rate falls outside
    the window with probability >= 0.99."""
    _, tail_mass = tail_row()
    mean = TAIL_DRAWS * tail_mass
    window = tail_window()
    assert poisson_power(window, mean / 2) >= 0.99
    assert poisson_power(window, mean * 2) >= 0.99
    assert poisson_power(window, mean) <= 1e-6


def test_tail_mass_inverse_cdf():
    gen = torch.Generator().manual_seed(99)
    row, tail_mass = tail_row()
    lo, hi = tail_window()
    hits = tail_hits(sampler("inverse_cdf", gen), row, TAIL_DRAWS, chunk=4096)
    expected = TAIL_DRAWS * tail_mass
    assert lo <= hits <= hi, f"{hits} tail draws, expected {expected:.0f} [{lo}, {hi}]"
    # Negative controls, judged by the same window: a sampler drawing the tail at half its
    # rate (the same draws with each tail hit kept with probability 1/2: exactly the count
    # such a sampler gives), and the flat float32 cumsum.
    half = int(np.random.default_rng(7).binomial(hits, 0.5))
    assert not lo <= half <= hi
    bad = int(flat_float32_inverse_cdf(row, TAIL_DRAWS, gen)[1:].sum())
    assert not lo <= bad <= hi


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="race tail test needs ~1e11 "
    "uniforms: CUDA only (the CPU checks the noise resolution in test_noise)",
)
def test_tail_mass_race_cuda():
    gen = torch.Generator(device="cuda").manual_seed(99)
    row, _ = tail_row()
    row = row.cuda()
    total = TAIL_DRAWS
    lo, hi = tail_window()

    def race(batch):
        return fs.sample_from_probs(batch, 1, generator=gen, method="race").token_ids

    assert lo <= tail_hits(race, row, total, chunk=2048) <= hi

    def coarse_race(batch):  # negative control: noise from float32 uniforms (2^-24 grid)
        u = torch.rand(batch.shape, device=batch.device, generator=gen)
        return (batch / -torch.log1p(-u).clamp_min(2.0**-25)).argmax(-1, keepdim=True)

    assert not lo <= tail_hits(coarse_race, row, total, chunk=2048) <= hi


# --- zero-probability tokens --------------------------------------------------------------


def zero_row() -> torch.Tensor:
    row = torch.zeros(600, dtype=torch.float32)  # spans three blocks, one of them short
    row[1::3] = 1e-30  # tiny, next to zeros
    row[2::7] = 1.0
    row[599] = 0.0
    return row


def zero_hits(draw, row: torch.Tensor, target: int) -> int:
    """The zero-weight procedure: pairs drawn without replacement from ``row`` repeated
    50,000 times per call until ``target`` tokens are drawn; the draws of zero weights."""
    zeros = (row == 0).numpy()
    draws = hits = 0
    while draws < target:
        ids = draw(row.expand(50_000, -1))
        hits += int(zeros[ids.numpy()].sum())
        draws += ids.numel()
    return hits


def pair_sampler(method: str, gen: torch.Generator):
    def draw(batch: torch.Tensor) -> torch.Tensor:
        out = fs.sample_from_probs(batch, 2, generator=gen, method=method)
        assert bool(out.valid.all())
        return out.token_ids

    return draw


ZERO_TARGET = {"inverse_cdf": 2_000_000, "race": 1_000_000}


@pytest.mark.parametrize("method", METHODS)
def test_zero_probability_never_drawn(method):
    """Millions of draws from rows whose zeros sit next to tiny and huge weights."""
    gen = torch.Generator().manual_seed(17)
    assert zero_hits(pair_sampler(method, gen), zero_row(), ZERO_TARGET[method]) == 0


def test_zero_probability_check_rejects_leaky_sampler():
    """Negative control: the same procedure, at its size, catches a sampler that leaks one
    draw in 100,000 onto a zero weight (the real sampler, its ids moved one place right
    with that probability: 1e-30 and 1.0 entries sit next to zeros)."""
    gen = torch.Generator().manual_seed(18)
    real = pair_sampler("race", gen)
    leak = torch.Generator().manual_seed(19)

    def leaky(batch):
        ids = real(batch)
        moved = torch.rand(ids.shape, generator=leak) < 1e-5
        return torch.where(moved, (ids + 1) % batch.shape[1], ids)

    assert zero_hits(leaky, zero_row(), ZERO_TARGET["race"]) > 0


@pytest.mark.parametrize("method", METHODS)
def test_all_tokens_drawn_is_a_permutation(method):
    """num_samples == V: every row comes out as a permutation, first slot by its law."""
    gen = torch.Generator().manual_seed(31)
    row = torch.tensor(PERMUTATION_ROW)
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


# --- the registry (tests/test_power.py checks each claim) ---------------------------------

PERMUTATION_ROW = [0.5, 0.1, 0.25, 0.15, 0.0001]  # test_all_tokens_drawn_is_a_permutation
GAP = "gap (issue 18): below the target at this size"


def _joint_law(n: int):
    tuples = all_ordered_tuples(len(JOINT_ROW), n)
    return plackett_luce(np.array(JOINT_ROW), tuples)


def law_cases():
    for kind, vocab, dtype, draws in CASES:
        claim = {256: 0.05, 1000: 0.05, 4099: 0.05}.get(vocab, 0.02 if vocab <= 1000 else 0.10)
        law = case_row(kind, vocab, dtype).double().numpy()
        gap = GAP if vocab in (256, 1000) else ""
        yield LawCase(f"single draw {kind} V={vocab}", law, draws, claim, gap)
    for n in (2, 3):
        claim = 0.07 if n == 2 else 0.09
        yield LawCase(f"joint n={n}", _joint_law(n), JOINT_DRAWS, claim, GAP)
    yield LawCase("fast_sample joint n=3", _joint_law(3), JOINT_DRAWS, 0.09, GAP)
    yield LawCase("first of a full permutation", np.array(PERMUTATION_ROW), 100_000, 0.09, GAP)
    tiny = np.array([1.0, 2.0, 0.0, 3.0, 4e-10])
    yield LawCase("float64 tiny weights", tiny, 200_000, 0.05, GAP)
