"""Philox4x32: published known answers, an independent pure-Python reference, the rounds
parameter, bitwise agreement under torch.compile and on CUDA, and a byte-uniformity check
with a negative control showing the check has the power to reject a biased source."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fastsample.ops.philox import philox4x32, philox4x32_few

# Both layouts compute the same function; every exactness test runs on each.
IMPLS = pytest.mark.parametrize("impl", [philox4x32, philox4x32_few], ids=["words", "few"])

MASK32 = 0xFFFFFFFF


# --- Independent reference: Python ints, straight from the specification ----------------


def ref_philox4x32(ctr: tuple[int, ...], key: tuple[int, ...], rounds: int = 10) -> tuple:
    """Random123 philox4x32_R with exact (unbounded) Python integer arithmetic."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + 0x9E3779B9) & MASK32
            k1 = (k1 + 0xBB67AE85) & MASK32
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


def run(ctrs, keys, rounds=10, device="cpu", impl=philox4x32):
    """philox4x32 on lists of counter/key tuples; returns a list of output 4-tuples."""

    def col(rows, j):
        return torch.tensor([row[j] for row in rows], dtype=torch.int64, device=device)

    out = impl(tuple(col(ctrs, j) for j in range(4)), (col(keys, 0), col(keys, 1)), rounds)
    return list(zip(*(w.cpu().tolist() for w in out), strict=True))


def random_cases(n: int = 2000):
    rng = random.Random(1234)
    extremes = [0, 1, MASK32 - 1, MASK32]
    ctrs = [tuple(rng.getrandbits(32) for _ in range(4)) for _ in range(n)]
    keys = [tuple(rng.getrandbits(32) for _ in range(2)) for _ in range(n)]
    # Every word at each extreme value, alone and all together, with random and extreme keys.
    for e in extremes:
        ctrs += [(e, e, e, e), (e, e, e, e)]
        keys += [(e, e), (rng.getrandbits(32), rng.getrandbits(32))]
        for j in range(4):
            c = [rng.getrandbits(32) for _ in range(4)]
            c[j] = e
            ctrs.append(tuple(c))
            keys.append((e, MASK32 - e))
    return ctrs, keys


# --- Known answers ---------------------------------------------------------------------

# Random123 kat_vectors, philox4x32_10: counter, key, expected output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@IMPLS
@pytest.mark.parametrize(("ctr", "key", "want"), KAT)
def test_known_answers(ctr, key, want, impl):
    assert ref_philox4x32(ctr, key) == want  # the reference agrees with Random123 too
    assert run([ctr], [key], impl=impl) == [want]


@IMPLS
def test_matches_reference_on_random_and_extreme_inputs(impl):
    ctrs, keys = random_cases()
    got = run(ctrs, keys, impl=impl)
    want = [ref_philox4x32(c, k) for c, k in zip(ctrs, keys, strict=True)]
    assert got == want


@IMPLS
@pytest.mark.parametrize("rounds", [1, 7])
def test_rounds_parameter(rounds, impl):
    ctrs, keys = random_cases(500)
    got = run(ctrs, keys, rounds=rounds, impl=impl)
    assert got == [ref_philox4x32(c, k, rounds) for c, k in zip(ctrs, keys, strict=True)]
    assert got != run(ctrs, keys, impl=impl)  # really a different number of rounds


@IMPLS
def test_broadcasting_and_range(impl):
    ctr = (
        torch.arange(6, dtype=torch.int64).view(2, 3, 1),
        torch.tensor(MASK32, dtype=torch.int64),
        torch.zeros(1, 1, dtype=torch.int64),
        torch.full((4,), MASK32, dtype=torch.int64),
    )
    key = (torch.tensor([7], dtype=torch.int64), torch.tensor(MASK32, dtype=torch.int64))
    for rounds in (1, 10):
        out = impl(ctr, key, rounds)
        for w in out:
            assert w.shape == (2, 3, 4) and w.dtype == torch.int64
            assert int(w.min()) >= 0 and int(w.max()) <= MASK32
    # Element [1, 2, 3] sees counter (5, 2**32 - 1, 0, 2**32 - 1) and key (7, 2**32 - 1).
    want = ref_philox4x32((5, MASK32, 0, MASK32), (7, MASK32))
    assert tuple(int(w[1, 2, 3]) for w in out) == want


@IMPLS
def test_compile_fullgraph_is_bitwise_eager(impl):
    torch._dynamo.reset()
    ctrs, keys = random_cases(64)

    def cols(rows, n):
        return tuple(torch.tensor([r[j] for r in rows], dtype=torch.int64) for j in range(n))

    ctr, key = cols(ctrs, 4), cols(keys, 2)
    compiled = torch.compile(impl, fullgraph=True)
    got, want = compiled(ctr, key), impl(ctr, key)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert list(zip(*(g.tolist() for g in got), strict=True)) == [
        ref_philox4x32(c, k) for c, k in zip(ctrs, keys, strict=True)
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@IMPLS
def test_cuda_matches_cpu(impl):
    ctrs, keys = random_cases()
    assert run(ctrs, keys, device="cuda", impl=impl) == run(ctrs, keys)
    # Compiled for CUDA (Triton) too: int64 products must wrap there as well.
    compiled = torch.compile(impl, fullgraph=True)
    assert run(ctrs, keys, device="cuda", impl=compiled) == run(ctrs, keys)
    big = torch.arange(1 << 20, dtype=torch.int64)
    z, k = torch.zeros((), dtype=torch.int64), torch.tensor(MASK32, dtype=torch.int64)
    cpu = philox4x32((big, z, big, z), (k, z))
    dev = philox4x32((big.cuda(), z.cuda(), big.cuda(), z.cuda()), (k.cuda(), z.cuda()))
    for a, b in zip(cpu, dev, strict=True):
        assert torch.equal(a, b.cpu())


# --- Statistics -------------------------------------------------------------------------

ALPHA = 1e-6
N = 1 << 16  # samples per test: 256 expected per cell of 256


def chi2_isf(alpha: float, df: int) -> float:
    """Upper ``alpha`` quantile of chi-square(df): scipy, else Wilson-Hilferty."""
    try:
        from scipy.stats import chi2

        return float(chi2.isf(alpha, df))
    except ImportError:
        # Normal quantile by bisection on erfc; Wilson-Hilferty is within ~1% for df = 255.
        lo, hi = 0.0, 40.0
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if 0.5 * math.erfc(mid / math.sqrt(2)) > alpha else (lo, mid)
        z, h = lo, 2.0 / (9.0 * df)
        return df * (1.0 - h + z * math.sqrt(h)) ** 3


THRESHOLD = chi2_isf(ALPHA, 255)


def chi2_stat(byte_values: torch.Tensor) -> float:
    counts = torch.bincount(byte_values, minlength=256).double()
    assert counts.numel() == 256
    expected = byte_values.numel() / 256
    return float(((counts - expected) ** 2 / expected).sum())


def philox_words(key=(0x12345678, 0x9ABCDEF0)):
    i = torch.arange(N, dtype=torch.int64)  # consecutive counters in word 0
    z = torch.zeros((), dtype=torch.int64)
    return philox4x32((i, z, z, z), tuple(torch.tensor(k, dtype=torch.int64) for k in key))


def test_threshold_is_sane():
    # chi-square(255) has mean 255 and sd ~22.6; its 1e-6 quantile is 377.08 (scipy),
    # 377.25 by Wilson-Hilferty.
    assert 376 < THRESHOLD < 379


@pytest.mark.parametrize("word", range(4))
@pytest.mark.parametrize("shift", [0, 24], ids=["low_byte", "high_byte"])
def test_output_bytes_are_uniform(word, shift):
    w = philox_words()[word]
    assert chi2_stat((w >> shift) & 0xFF) < THRESHOLD


def test_uniformity_test_rejects_a_biased_source():
    """Negative control: Philox bytes with 1% of them forced to 0 must be rejected.

    Then P(0) = 0.01 + 0.99/256, 3.55 times the uniform 1/256. The statistic's expectation
    is 255 + lam with noncentrality lam = n * sum((p - 1/256)**2 * 256). A small bias such
    as "0 is 2% too frequent" gives lam = n * 0.02**2 / 256 ~ 0.1 at n = 2**16: no test of
    this size can see it. Here lam = n * 0.01**2 * 255 ~ 1671, so the statistic is
    ~1926 +- 85 (sd = sqrt(2 * (255 + 2 * lam))) against a threshold of ~377: rejected by
    ~18 sd. The sample is fixed (Philox, fixed key), so the outcome is deterministic.
    """
    w0, w1, _, _ = philox_words()
    biased = torch.where(w1 < int(0.01 * 2**32), 0, w0 & 0xFF)
    frac_zeroed = float((w1 < int(0.01 * 2**32)).double().mean())
    assert 0.009 < frac_zeroed < 0.011
    stat = chi2_stat(biased)
    assert stat > THRESHOLD
    assert stat > 4 * THRESHOLD  # with a wide margin, not by luck
