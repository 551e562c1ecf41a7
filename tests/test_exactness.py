"""Exactness of both draw methods against exact float64 probabilities.

Families: single-draw law over row shapes, dtypes and vocabulary sizes; the joint law of 2
and 3 draws without replacement (Plackett-Luce); the far tail; zero-probability tokens. Each
law test judges its counts with stattests.law_test (p < 1e-6, cells that mix heavy tokens,
index ranges split by parity, probability tiers and hashed indices) at a size chosen from
stattests.detectable_bias; tests/test_power.py checks every claimed size and runs broken
copies of the sampler through these procedures. Each family has a negative control at the
size of the test it guards; each law test also rejects its own draws thinned to a mid-mass
bias of 1.5x its claim (mid_mass_thinned) and reported one index off.
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
from torch_threads import one_thread

METHODS = ["inverse_cdf", "race"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the single-draw tests draw


def serial():
    """The draw loops run on one CPU thread: 2-thread parallel regions over these calls'
    tensors (thousands of rows) stall on a shared machine (measured 5-40x slower per draw at
    V=1,000; fastsample.ops.threads). Draws do not depend on the thread count."""
    return one_thread(torch.device("cpu"))


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
# multiples. Each size is stattests.draws_needed(law, claim_of(vocab)): the draws at which the
# law test detects a relative bias on 10% of the mass (stattests.detectable_bias) of at most
# the target (2% at V <= 1,000, 5% below 32k, 10% at V >= 32k; tests/test_power.py checks
# each). Fewer cases than shapes x dtypes x methods: each costs millions of draws at V <= 1,000.
CASES = [
    ("flat", 2, torch.float32, 640_000),
    ("zeros", 17, torch.bfloat16, 2_900_000),
    ("long_tailed", 256, torch.float64, 5_100_000),
    ("peaked", 1000, torch.float32, 4_623_000),
    ("zeros", 4099, torch.float16, 600_000),
    ("flat", 32000, torch.bfloat16, 104_000),
    ("zeros", 200_000, torch.float64, 104_000),
]
# The race draws one uniform per entry (~30 ns each on CPU): the CPU runs it on the shortest
# rows; CUDA runs it on all of them. Its ops do not depend on V (an elementwise division and
# an argmax over the noise), and its noise is checked at every scale of position elsewhere:
# tests/ops/test_noise.py::test_noise_resolves_the_far_tail and
# ::test_generator_uniforms_carry_53_bits (generator noise), and
# tests/ops/test_seeds.py::test_entry_uniforms_match_the_mapping_at_every_scale_of_position
# (seeded noise bitwise the documented mapping up to position 2**18).
RACE_CPU = [0, 1]


def claim_of(vocab: int) -> float:
    """The detectable bias a single-draw case claims: the target at its V."""
    return 0.02 if vocab <= 1000 else 0.05 if vocab < 32_000 else 0.10


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


def mid_mass_thinned(counts: np.ndarray, exact: np.ndarray, delta: float, seed: int):
    """Negative control on a test's own draws: the counts of a sampler drawing the
    mid-mass tokens ``1 + delta`` times more likely (stattests.mid_mass_biased). Each draw
    outside them is kept with probability ``1 / (1 + delta)``: given their number, the kept
    draws are independent draws of exactly that biased law (a few % fewer than the test's)."""
    p = np.asarray(exact, dtype=np.float64) / np.sum(exact)
    q = mid_mass_biased(p, delta)
    ratio = np.divide(q, p, out=np.zeros_like(p), where=p > 0)
    boosted = ratio > ratio[p > 0].min() * (1 + 1e-9)
    thin = np.random.default_rng(seed).binomial(counts.astype(np.int64), 1 / (1 + delta))
    return np.where(boosted, counts, thin)


def single_draw_counts(draw, row: torch.Tensor, draws: int) -> np.ndarray:
    """The single-draw procedure: ``draws`` draws of ``row`` through ``draw``, in calls of
    2**17 / min(V, 256) rows (at most 200,000 rows and 2e7 entries): the sampler's per-draw
    work (the gathered 256-entry block, its float64 prefix) then stays in cache, about 2x
    faster on CPU than calls of 2e7 entries at V=256 and V=1,000."""
    vocab = row.shape[0]
    chunk = max(1, min(200_000, 2**17 // min(vocab, 256), int(2e7 // vocab)))
    with serial():
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
    # Negative controls at this size, from the same draws: thinned to the law with the
    # mid-mass tokens 1.5x the claim more likely, and reported one index off, they fail.
    assert law_rejected(mid_mass_thinned(counts, exact, 1.5 * claim_of(vocab), vocab), exact)
    assert law_rejected(np.roll(counts, 1), exact)


@pytest.mark.parametrize("method", METHODS)
def test_single_draw_law_rejects_biased_sampler(method):
    """Negative control, at the size of the test it guards: the mid-mass tokens (the
    probability decile around the median of the mass) 1.5x the claimed detectable bias
    more likely, drawn by the real sampler, are caught by the law test at V=2, at its size."""
    kind, vocab, dtype, draws = CASES[0]
    gen = torch.Generator(DEVICE).manual_seed(5)
    exact = case_row(kind, vocab, dtype).double().numpy()
    wrong = torch.tensor(mid_mass_biased(exact, 1.5 * claim_of(vocab)))
    counts = single_draw_counts(sampler(method, gen), wrong, draws)
    assert law_rejected(counts, exact)


def all_ordered_tuples(vocab: int, n: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(vocab), n)))


def tuple_codes(tuples: np.ndarray, vocab: int) -> np.ndarray:
    """Each ordered tuple as one integer, base ``vocab``, first token most significant."""
    codes = np.zeros(len(tuples), dtype=np.int64)
    for j in range(tuples.shape[1]):
        codes = codes * vocab + tuples[:, j]
    return codes


JOINT_CHUNK = 8192  # rows per call: the fastest on CPU for these 6-token rows


def joint_counts(draw, row: torch.Tensor, n: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """The joint procedure: ``total`` draws of ``n`` tokens of ``row`` through ``draw``
    (``draw(batch, n)`` -> ``(B, n)`` ids), in calls of JOINT_CHUNK rows; the counts of every
    ordered tuple of distinct tokens (``tuples``, in itertools.permutations order). A tuple
    with a repeated token fails the test."""
    vocab = row.shape[0]
    tuples = all_ordered_tuples(vocab, n)
    weights = torch.tensor([vocab ** (n - 1 - j) for j in range(n)])
    by_code = torch.zeros(vocab**n, dtype=torch.int64)
    with serial():
        for start in range(0, total, JOINT_CHUNK):
            ids = draw(row.expand(min(JOINT_CHUNK, total - start), -1), n).cpu()
            by_code += torch.bincount(ids @ weights, minlength=vocab**n)
    counts = by_code.numpy()[tuple_codes(tuples, vocab)]
    assert counts.sum() == total, f"{total - counts.sum()} draws repeat a token"
    return counts, tuples


def joint_sampler(method: str, gen: torch.Generator):
    def draw(batch: torch.Tensor, n: int) -> torch.Tensor:
        out = fs.sample_from_probs(batch, n, generator=gen, method=method)
        assert bool(out.valid.all())
        return out.token_ids

    return draw


def shifted_tuples(counts: np.ndarray, tuples: np.ndarray) -> np.ndarray:
    """The counts a sampler reporting every token one index off would give (same draws)."""
    vocab = int(tuples.max()) + 1
    index_of = np.zeros(vocab ** tuples.shape[1], dtype=np.int64)
    index_of[tuple_codes(tuples, vocab)] = np.arange(len(tuples))
    out = np.zeros_like(counts)
    out[index_of[tuple_codes((tuples + 1) % vocab, vocab)]] = counts
    return out


JOINT_ROW = [0.05, 0.4, 0.0, 0.2, 0.15, 0.2]  # includes an exact zero
# stattests.draws_needed(plackett_luce(JOINT_ROW, tuples), 0.02): 3.3M pairs, 5.1M triples.
JOINT_DRAWS = {2: 3_275_000, 3: 5_067_000}
JOINT_CLAIM = 0.02
# fast_sample draws from JOINT_ROW in bfloat16: draws_needed of that law (5.6M triples).
FAST_JOINT_DRAWS = 5_582_000


def joint_law(n: int) -> tuple[np.ndarray, np.ndarray]:
    tuples = all_ordered_tuples(len(JOINT_ROW), n)
    return plackett_luce(np.array(JOINT_ROW), tuples), tuples


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [2, 3])
def test_joint_law_without_replacement(method, n):
    gen = torch.Generator().manual_seed(11 + n)
    row = torch.tensor(JOINT_ROW, dtype=torch.float32)
    counts, tuples = joint_counts(joint_sampler(method, gen), row, n, JOINT_DRAWS[n])
    law, _ = joint_law(n)
    assert_law(counts, law, what=f"{method} n={n}")
    # Negative controls at this size, from the same draws: thinned to the law with the
    # mid-mass tuples 1.5x the claim more likely, and reported one index off, they fail.
    assert law_rejected(mid_mass_thinned(counts, law, 1.5 * JOINT_CLAIM, n), law)
    assert law_rejected(shifted_tuples(counts, tuples), law)


def test_joint_law_rejects_biased_sampler():
    """Negative control, at the size of the pair test: pairs drawn by the real sampler (one
    draw over the ordered pairs) from the joint law with its mid-mass pairs 1.5x the claim
    more likely are caught. (The triple test rejects its own draws thinned to that bias: a
    drawn control over the 120 triples would cost ~3 us a draw.)"""
    n = 2
    gen = torch.Generator().manual_seed(3 + n)
    law, tuples = joint_law(n)
    wrong = torch.tensor(mid_mass_biased(law, 1.5 * JOINT_CLAIM))
    as_tuples = torch.tensor(tuples)

    def draw(batch, k):  # a tuple index per row, reported as the tuple's k tokens
        rows = wrong.expand(batch.shape[0], -1)
        picks = fs.sample_from_probs(rows, 1, generator=gen, method="inverse_cdf")
        return as_tuples[picks.token_ids[:, 0]]

    row = torch.tensor(JOINT_ROW)
    counts, _ = joint_counts(draw, row, n, JOINT_DRAWS[n])
    assert law_rejected(counts, law)


def test_fast_sample_joint_law_matches_multinomial_law():
    gen = torch.Generator().manual_seed(21)
    row = torch.tensor(JOINT_ROW, dtype=torch.bfloat16)

    def draw(batch, k):
        sample_p, sample_index = fs.fast_sample(batch, k, generator=gen)
        assert torch.equal(sample_p, batch.gather(1, sample_index))
        return sample_index

    counts, tuples = joint_counts(draw, row, 3, FAST_JOINT_DRAWS)
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
    1,024 times per call (cache-resident work, faster on CPU than larger calls) until
    ``target`` tokens are drawn; the draws of zero weights."""
    zeros = (row == 0).numpy()
    draws = hits = 0
    with serial():
        while draws < target:
            ids = draw(row.expand(1024, -1))
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


PERMUTATION_ROW = [0.5, 0.1, 0.25, 0.15, 0.0001]
PERMUTATION_DRAWS = 1_733_000  # stattests.draws_needed(PERMUTATION_ROW, 0.02)


@pytest.mark.parametrize("method", METHODS)
def test_all_tokens_drawn_is_a_permutation(method):
    """num_samples == V: every row comes out as a permutation, first slot by its law."""
    gen = torch.Generator().manual_seed(31)
    row = torch.tensor(PERMUTATION_ROW)
    draw = joint_sampler(method, gen)
    every_token = torch.arange(5)

    def first_of_permutation(batch: torch.Tensor) -> torch.Tensor:
        ids = draw(batch, 5)
        assert torch.equal(ids.sort(-1).values, every_token.expand_as(ids))
        return ids

    with serial():
        counts = count_draws(first_of_permutation, row, PERMUTATION_DRAWS, JOINT_CHUNK)
    assert_law(counts, row.double().numpy(), what=f"{method} first of a full permutation")


TINY_ROW = [1e-300, 2e-300, 0.0, 3e-300, 4e-310]
TINY_DRAWS = 1_021_000  # stattests.draws_needed(TINY_ROW, 0.02)


@pytest.mark.parametrize("method", METHODS)
def test_float64_weights_below_float32_range(method):
    """float64 rows are summed and raced in float64: 1e-300-scale weights keep their law."""
    gen = torch.Generator().manual_seed(32)
    row = torch.tensor(TINY_ROW, dtype=torch.float64)
    with serial():
        counts = count_draws(sampler(method, gen), row, TINY_DRAWS, JOINT_CHUNK)
    assert_law(counts, row.numpy(), what=f"{method} float64 tiny weights")


# --- the registry (tests/test_power.py checks each claim) ---------------------------------


def law_cases():
    for kind, vocab, dtype, draws in CASES:
        law = case_row(kind, vocab, dtype).double().numpy()
        yield LawCase(f"single draw {kind} V={vocab}", law, draws, claim_of(vocab))
    for n in (2, 3):
        yield LawCase(f"joint n={n}", joint_law(n)[0], JOINT_DRAWS[n], JOINT_CLAIM)
    fast_row = torch.tensor(JOINT_ROW, dtype=torch.bfloat16).double().numpy()
    fast_law = plackett_luce(fast_row, all_ordered_tuples(len(JOINT_ROW), 3))
    yield LawCase("fast_sample joint n=3", fast_law, FAST_JOINT_DRAWS, JOINT_CLAIM)
    yield LawCase("first of a full permutation", PERMUTATION_ROW, PERMUTATION_DRAWS, 0.02)
    # The law of TINY_ROW, scaled by 1e300 (4e-310 is a float64 subnormal: 4e-10 relative).
    tiny = np.array([1.0, 2.0, 0.0, 3.0, 4e-10])
    yield LawCase("float64 tiny weights", tiny, TINY_DRAWS, 0.02)
