"""Sampling controls (fastsample.controls, fastsample.sample) against a float64 sort reference.

Families: ``process`` equals the reference (same support, 1e-6) for mixed per-row tensor
controls and for Python scalars (the static fast paths); the sampler's frequencies pass the
law test against the reference (a 2% bias detected at V=24: one configuration of each kind
per variant, 0.7-3M draws each), never leave its support and reach every likely token;
greedy, logprobs and top_logprobs; bad input; batch invariance with seeds; graph safety.
Negative controls: the same law test, at each configuration's size, rejects the classic
top-p bug (mass taken before the top-k cut), a mid-mass bias, a parity bias and an
off-by-one id.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import fastsample as fs
import fastsample.ops.cuts
import fastsample.ops.select
from reference import min_p_keeping, reference_probs, robust_min_p, robust_top_p, top_p_keeping
from stattests import (
    LawCase,
    assert_law,
    law_rejected,
    mid_mass_biased,
    parity_biased,
    shifted_law,
)
from torch_threads import one_thread

KINDS = ("peaked", "flat", "ties", "masked", "equal", "single")
CLAIM = 0.02  # the relative bias on 10% of the mass each frequency test detects (p < 1e-6)
# Draws per row of the tests that import it (tests/ops/test_small_top_k.py).
DRAWS = 60000


def make_logits(kind: str, vocab: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "peaked":
        return rng.normal(size=vocab) * 3
    if kind == "flat":
        return rng.normal(size=vocab) * 0.3
    if kind == "ties":  # integer logits: many exact ties at every cut
        return rng.integers(-2, 3, size=vocab).astype(np.float64)
    if kind == "masked":  # grammar-style mask: about half the tokens -inf
        x = rng.normal(size=vocab)
        x[rng.random(vocab) < 0.5] = -np.inf
        x[rng.integers(vocab)] = 1.0
        return x
    if kind == "equal":
        return np.zeros(vocab)
    if kind == "single":  # one finite entry
        x = np.full(vocab, -np.inf)
        x[rng.integers(vocab)] = 0.5
        return x
    raise ValueError(kind)


def random_controls(x: np.ndarray, rng: np.random.Generator, greedy_ok: bool = True):
    """Per-row controls with cuts placed robustly between distinct values."""
    vocab = x.shape[0]
    temperature = float(rng.choice([0.5, 1.0, 1.7] + ([0.0] if greedy_ok else [])))
    top_k = int(rng.choice([0, int(rng.integers(1, vocab + 1)), vocab + 3]))
    t = temperature or 1.0
    weights = np.exp((x - x.max()) / t)
    survivors = reference_probs(x, t, top_k)
    top_p = robust_top_p(survivors, rng) if rng.random() < 0.7 else 1.0
    min_p = robust_min_p(weights, rng) if rng.random() < 0.4 else 0.0
    return temperature, top_k, top_p, min_p


def make_batch(vocab: int, rows: int, seed: int, greedy_ok: bool = True):
    rng = np.random.default_rng(seed)
    xs, controls = [], []
    for i in range(rows):
        x = make_logits(KINDS[i % len(KINDS)], vocab, rng)
        xs.append(x)
        controls.append(random_controls(x, rng, greedy_ok))
    return np.stack(xs), controls


def as_tensors(controls):
    t, k, p, m = zip(*controls, strict=True)
    return dict(
        temperature=torch.tensor(t, dtype=torch.float32),
        top_k=torch.tensor(k, dtype=torch.int64),
        top_p=torch.tensor(p, dtype=torch.float32),
        min_p=torch.tensor(m, dtype=torch.float32),
    )


def reference_rows(xs, controls) -> np.ndarray:
    return np.stack([reference_probs(x, *c) for x, c in zip(xs, controls, strict=True)])


def assert_matches_reference(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    got64 = got.double().numpy()
    for row in range(want.shape[0]):
        support = np.flatnonzero(want[row] > 0)
        got_support = np.flatnonzero(got64[row] > 0)
        assert np.array_equal(support, got_support), f"{what} row {row}: support differs"
    np.testing.assert_allclose(got64, want, rtol=0, atol=1e-6, err_msg=what)


# ----------------------------------------------------------------------------- process


@pytest.mark.parametrize("vocab", [20, 700, 2999, 40_000])
def test_process_matches_reference_with_mixed_tensor_controls(vocab):
    # 40,000: rows long enough for the radix selection's 16-bit digits (select._WIDE_FROM).
    xs, controls = make_batch(vocab, 48, seed=vocab)
    got = fs.process(torch.tensor(xs, dtype=torch.float32), **as_tensors(controls))
    assert_matches_reference(got, reference_rows(xs, controls), f"V={vocab}")


@pytest.mark.parametrize("vocab", [20, 700])
def test_process_matches_reference_with_scalar_controls(vocab):
    """Python scalars take the static paths (stages skipped, candidate-block top-k)."""
    xs, controls = make_batch(vocab, 30, seed=100 + vocab)
    for x, (t, k, p, m) in zip(xs, controls, strict=True):
        got = fs.process(
            torch.tensor(x[None], dtype=torch.float32), temperature=t, top_k=k, top_p=p, min_p=m
        )
        assert_matches_reference(got, reference_probs(x, t, k, p, m)[None], f"{t, k, p, m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_process_other_dtypes(dtype):
    xs, controls = make_batch(300, 24, seed=7)
    x = torch.tensor(xs).to(dtype)
    got = fs.process(x, **as_tensors(controls))
    want = reference_rows(x.double().numpy(), controls)  # the reference sees the same values
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_matches_reference(got, want, str(dtype))


def test_process_from_probs_matches_reference():
    rng = np.random.default_rng(3)
    xs, controls = make_batch(200, 30, seed=11)
    probs = np.exp(xs - xs.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    probs[::5] *= 7.0  # unnormalized rows are fine
    got = fs.process(probs=torch.tensor(probs), **as_tensors(controls))
    want = np.stack(
        [reference_probs(p, *c, is_logits=False) for p, c in zip(probs, controls, strict=True)]
    )
    assert_matches_reference(got, want, "probs")
    del rng


def test_equal_probabilities_stay_ties_under_temperature():
    """Equal inputs get bitwise equal weights wherever they sit in the row (torch's CPU pow
    does not guarantee this between its vector body and loop tail; exp(log) does)."""
    gen = torch.Generator().manual_seed(8)
    values = torch.rand(1007, generator=gen)
    probs = torch.cat([values, values.flip(0)])[None].expand(3, -1)
    for temperature in (0.7, torch.tensor([0.7, 1.3, 2.0])):
        got = fs.process(probs=probs, temperature=temperature, top_k=600)
        assert torch.equal(got[:, :1007], got[:, 1007:].flip(1))


def test_process_top_k_ties_and_greedy_ties():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, -math.inf, 0.0]])
    # k = 3: the third largest is 2, so every 2 is kept (ties at the boundary).
    kept = fs.process(x, top_k=3)[0] > 0
    assert kept.tolist() == [False, True, True, True, True, True, False, False]
    # Greedy: the first maximal index.
    assert fs.process(x, temperature=0.0)[0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]


def test_row_pieces_give_the_same_bits_as_one_piece(monkeypatch):
    """The survivors' mass (tensor top-k then top-p) and the radix run a few rows at a time
    on CPU; one row per piece must give the same distribution, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 40_000, generator=gen) * 3  # long rows: the 16-bit radix digits
    x[1, ::3] = x[1, 0]  # ties at the cuts
    controls = dict(
        temperature=torch.tensor([0.7, 1.0, 1.5, 0.9, 1.0]),
        top_k=torch.tensor([50, 0, 20_000, 3, 40_000]),
        top_p=torch.tensor([0.9, 0.5, 0.99, 1.0, 0.3]),
    )
    whole = fs.process(x, **controls)
    monkeypatch.setattr(fastsample.ops.cuts, "_MASS_PIECE_ELEMENTS", 1)
    monkeypatch.setattr(fastsample.ops.select, "_CHUNK_BYTES", 1)
    assert torch.equal(fs.process(x, **controls), whole)


def test_far_tail_survives_cut_stages_down_to_the_documented_floor():
    """Rows whose cut is off keep tokens down to 2**-100 of the top weight (here 8.7e-27);
    the whole batch of 2999 weights of 2**100 after scaling must not overflow."""
    x = torch.tensor([[0.0, -60.0, -200.0], [0.0, -60.0, -200.0]])
    got = fs.process(x, top_p=torch.tensor([1.0, 0.5]), top_k=torch.tensor([0, 3]))
    assert got[0, 1] > 0 and got[0, 2] == 0  # exp(-200) is 0 in float32 anyway
    assert got[1].tolist() == [1.0, 0.0, 0.0]
    flat = fs.process(torch.zeros(2, 2999), top_k=torch.tensor([0, 5]))
    assert torch.allclose(flat.sum(-1), torch.ones(2)) and (flat[0] > 0).all()


# ----------------------------------------------------------------------------- sampling


def draw_counts(x: torch.Tensor, controls, draws, *, scalar: bool, is_logits=True, step=5):
    """Token counts per configuration (row of ``x``): ``draws[r]`` (or ``draws``) single draws
    of row ``r``, one seed per draw, in calls of up to ``CHUNK`` rows. Tensor controls: the
    configurations share each call, every row carrying its own values; Python scalars: one
    configuration per call. On one thread: chains of small ops over a few thousand rows
    stall in torch's parallel regions on a busy machine (fastsample.ops.threads), 5-10x here;
    the test sets the count, the library never does."""
    with one_thread(x.device):
        return _draw_counts(x, controls, draws, scalar, is_logits, step)


def _draw_counts(x, controls, draws, scalar, is_logits, step) -> np.ndarray:
    rows, vocab = x.shape
    draws = np.broadcast_to(np.asarray(draws, dtype=np.int64), (rows,))
    ends = torch.tensor(np.cumsum(draws))
    counts = torch.zeros(rows * vocab, dtype=torch.int64)
    spans = [(int(e - n), int(e)) for e, n in zip(ends, draws, strict=True)]
    for first, last in spans if scalar else [(0, int(ends[-1]))]:
        for start in range(first, last, CHUNK):
            draw = torch.arange(start, min(start + CHUNK, last))
            which = torch.searchsorted(ends, draw, right=True)  # the configuration of each
            if scalar:
                t, k, p, m = controls[int(which[0])]
                ctl = dict(temperature=t, top_k=k, top_p=p, min_p=m)
                data = x[which[:1]].expand(len(draw), -1)
            else:
                ctl = {n: v[which] for n, v in as_tensors(controls).items()}
                data = x[which]
            src = {"logits": data} if is_logits else {"probs": data}
            out = fs.sample(**src, seed=draw, step=step, **ctl)
            assert out.valid.all()
            counts += torch.bincount(which * vocab + out.token_ids[:, 0], minlength=rows * vocab)
    return counts.view(rows, vocab).numpy()


def assert_sampler_exact(counts: np.ndarray, want: np.ndarray, what: str) -> None:
    for row in range(want.shape[0]):
        assert_law(counts[row], want[row], what=f"{what} row {row}")
        likely = want[row] * counts[row].sum() >= 20
        assert (counts[row][likely] > 0).all(), f"{what} row {row}: a likely token never drawn"


V = 24
# One configuration of each kind per variant: (kind, temperature, top_k, distinct values
# top-p keeps of the top-k survivors, distinct values min-p keeps (0: off), draws). Each
# variant has every control; ties at a top-k cut (tensor) and a top-p cut (scalar); top-k
# and top-p where top-p on the whole row would keep other tokens (tensor flat, scalar
# masked: the negative control's classic bug); top_k > V. The draws are
# stattests.draws_needed(law, CLAIM) (2% at V <= 1,000; tests/test_power.py checks them):
# fewer, smaller supports cost fewer draws (3 tokens 0.9-1.9M, 24 equal ones 3M).
PLANS = {
    "tensor": (
        ("peaked", 0.5, 8, 3, 0, 1_913_000),
        ("flat", 1.7, 8, 4, 0, 844_000),
        ("ties", 1.0, 3, 0, 0, 979_000),
        ("masked", 1.0, V + 3, 5, 4, 937_000),
        ("equal", 0.5, 3, 1, 0, 2_959_000),
        ("single", 1.7, 2, 1, 1, 1_000),
    ),
    "scalar": (
        ("peaked", 1.0, 0, 4, 0, 1_629_000),
        ("flat", 0.5, 5, 0, 3, 685_000),
        ("ties", 1.7, 0, 1, 0, 1_368_000),
        ("masked", 0.5, 4, 3, 0, 858_000),
        ("equal", 1.0, 0, 1, 1, 2_959_000),
        ("single", 0.5, V + 3, 0, 0, 1_000),
    ),
}
CHUNK = 1 << 14  # rows per sampling call
VARIANT_SEEDS = {"tensor": 6, "scalar": 5}


def configurations(variant: str):
    """``(xs, controls, laws, draws)`` of a variant's plan: float64 logits ``(6, V)``, the
    controls, the reference laws and the draws per configuration."""
    rng = np.random.default_rng(VARIANT_SEEDS[variant])
    xs, controls = [], []
    for kind, t, k, p_values, min_p_values, _ in PLANS[variant]:
        x = make_logits(kind, V, rng)
        p = top_p_keeping(reference_probs(x, t, k), p_values) if p_values else 1.0
        weights = np.exp((x - x.max()) / t)
        m = min_p_keeping(weights, min_p_values) if min_p_values else 0.0
        xs.append(x)
        controls.append((t, k, p, m))
    draws = [plan[-1] for plan in PLANS[variant]]
    return np.stack(xs), controls, reference_rows(xs, controls), draws


@pytest.mark.parametrize("scalar", [False, True], ids=["tensor_controls", "scalar_controls"])
def test_sample_frequencies_match_reference(scalar):
    variant = "scalar" if scalar else "tensor"
    xs, controls, want, draws = configurations(variant)
    x = torch.tensor(xs, dtype=torch.float32)
    counts = draw_counts(x, controls, draws, scalar=scalar, step=5 if scalar else 6)
    assert_sampler_exact(counts, want, variant)


MANY_BLOCKS_DRAWS = 20000  # per row: detects 37% (a V=1,300 draw costs ~55 V=24 draws)
MANY_BLOCKS_CLAIM = 0.37
MANY_BLOCKS_CARRIED = (
    "a smoke test of several blocks: its law is process()'s distribution, equal to the float64 "
    "reference within 1e-6 (test_process_matches_reference_with_mixed_tensor_controls[700, "
    "2999]), drawn by the blocked inverse CDF (ops.inverse_cdf.inverse_cdf_draw, as "
    "sample_from_probs: tests/test_exactness.py::test_single_draw_law at V=1000 and 4099, full "
    "power); the controls' law at 2%: test_sample_frequencies_match_reference"
)


def many_blocks_configurations():
    """``(x, controls, logits laws, probs, probs laws)``: two rows of V=1300 (6 blocks),
    top-k 400 then top-p, and min-p."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(2, 1300)) * 2
    survivors = reference_probs(x[0], 0.8, 400)
    controls = [
        (0.8, 400, robust_top_p(survivors, rng), 0.0),
        (1.3, 0, 1.0, robust_min_p(np.exp((x[1] - x[1].max()) / 1.3), rng)),
    ]
    probs = torch.softmax(torch.tensor(x), -1)
    want_p = np.stack(
        [
            reference_probs(p, *c, is_logits=False)
            for p, c in zip(probs.numpy(), controls, strict=True)
        ]
    )
    return x, controls, reference_rows(x, controls), probs, want_p


def test_sample_frequencies_many_blocks_and_probs_input():
    x, controls, want, probs, want_p = many_blocks_configurations()
    x32 = torch.tensor(x, dtype=torch.float32)
    counts = draw_counts(x32, controls, MANY_BLOCKS_DRAWS, scalar=False)
    assert_sampler_exact(counts, want, "V=1300")
    counts_p = draw_counts(probs, controls, MANY_BLOCKS_DRAWS, scalar=True, is_logits=False)
    assert_sampler_exact(counts_p, want_p, "probs V=1300")


def test_negative_controls_are_rejected():
    """At each configuration's size, the frequency test rejects top-p taken before the top-k
    cut (where it changes the law), a bias on the mid-mass tokens (1.5x CLAIM), even-index
    tokens x1.5 and ids one place off. The wrong laws' counts are drawn by numpy's multinomial
    (the same law as counting that many single draws); the real sampler's counts at these
    sizes pass: test_sample_frequencies_match_reference."""
    rng = np.random.default_rng(21)
    for variant in PLANS:
        xs, controls, want, draws = configurations(variant)
        top_p_bugs, rejected = 0, 0
        for x, c, law, n in zip(xs, controls, want, draws, strict=True):
            buggy = reference_probs(x, *c, top_p_on_all=True)
            top_p_bugs += not np.allclose(buggy, law)
            wrongs = (
                buggy,
                mid_mass_biased(law, 1.5 * CLAIM),
                parity_biased(law),
                shifted_law(law),
            )
            for wrong in wrongs:
                if not np.allclose(wrong, law, rtol=0, atol=1e-12):  # else it is no bug here
                    assert law_rejected(rng.multinomial(n, wrong), law), f"{variant} {c}"
                    rejected += 1
        assert top_p_bugs >= 1, f"{variant}: no configuration where the classic bug shows"
        assert rejected >= 3 * (len(PLANS[variant]) - 1), variant  # all but the single token


# ----------------------------------------------------------------------------- greedy, logprobs


def test_greedy_rows_are_deterministic_and_mixed_freely():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3000, generator=gen)
    x[2, 17] = x[2, 2999] = 50.0  # a tie: the first index wins
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0, 1.3])
    a = fs.sample(x, temperature=temperature, top_p=0.9, seed=1)
    b = fs.sample(x, temperature=temperature, top_p=0.9, seed=2)
    greedy = temperature == 0
    first = x.argmax(-1)
    assert torch.equal(a.token_ids[greedy, 0], first[greedy])
    assert a.token_ids[2, 0] == 17
    assert torch.equal(a.token_ids[greedy], b.token_ids[greedy])
    assert a.probs[greedy].eq(1).all() and a.logprobs[greedy].eq(0).all()
    assert a.valid.all()
    alone = fs.sample(x, temperature=0.0)
    assert torch.equal(alone.token_ids[:, 0], first)


def test_greedy_several_draws_are_the_largest_in_order():
    x = torch.tensor(
        [
            [0.0, 5.0, 3.0, 5.0, -math.inf, 4.0],
            [1.0, -math.inf, -math.inf, -math.inf, 2.0, -math.inf],
        ]
    )
    out = fs.sample(x, temperature=0.0, num_samples=3)
    assert out.token_ids[0].tolist() == [1, 3, 5]
    # Row 1 has two finite entries: its later slots repeat the last genuine draw, invalid.
    assert out.token_ids[1].tolist() == [4, 0, 0]
    assert out.valid.tolist() == [True, False]
    assert out.probs[1].tolist() == [1.0, 1.0, 0.0]
    mixed = fs.sample(x, temperature=torch.tensor([0.0, 0.0]), num_samples=3, seed=1)
    assert torch.equal(mixed.token_ids, out.token_ids) and torch.equal(mixed.valid, out.valid)
    probs = torch.tensor([[0.1, 0.4, 0.4, 0.1], [0.2, -0.1, 0.5, 0.4], [0.0, 0.0, 0.3, 0.7]])
    for n, ids in ((1, [[1], [0], [3]]), (2, [[1, 2], [0, 1], [3, 2]])):
        greedy = fs.sample(probs=probs, temperature=0.0, num_samples=n)
        assert greedy.token_ids.tolist() == ids  # row 1 has a negative entry: invalid
        assert greedy.valid.tolist() == [True, False, True]


def test_logprobs_and_top_logprobs_match_reference():
    xs, controls = make_batch(500, 18, seed=31)
    x = torch.tensor(xs, dtype=torch.float32)
    out = fs.sample(x, **as_tensors(controls), num_samples=2, seed=4, top_logprobs=5)
    want = reference_rows(xs, controls)
    for row in range(len(xs)):
        if controls[row][0] == 0:  # greedy: the two largest, probability 1 each (checked above)
            continue
        if not out.valid[row]:  # fewer than 2 kept tokens: only the first slot is genuine
            assert (want[row] > 0).sum() < 2
            continue
        ids = out.token_ids[row].numpy()
        assert (want[row][ids] > 0).all()
        np.testing.assert_allclose(
            out.logprobs[row].double().numpy(), np.log(want[row][ids]), atol=1e-5
        )
    for row in range(len(xs)):
        order = np.lexsort((np.arange(500), -xs[row]))[:5]  # largest logits, ties by index
        assert out.top_token_ids[row].tolist() == order.tolist()
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose(
                out.top_logprobs[row].double().numpy(), np.log(want[row][order]), atol=1e-5
            )


# ----------------------------------------------------------------------------- bad input


def test_bad_arguments_raise_before_work():
    x = torch.randn(3, 50)
    cases = [
        (dict(), "exactly one of logits= or probs="),
        (dict(logits=x, probs=x.softmax(-1)), "exactly one"),
        (dict(logits=x, temperature=-0.5), "temperature must be >= 0"),
        (dict(logits=x, top_p=0.0), "top_p must be in (0, 1]"),
        (dict(logits=x, top_p=1.5), "top_p must be in (0, 1]"),
        (dict(logits=x, min_p=2.0), "min_p must be in [0, 1]"),
        (dict(logits=x, top_k=-1), "top_k must be >= 0"),
        (dict(logits=x, top_k=2.5), "top_k must be an int"),
        (dict(logits=x, temperature=math.nan), "temperature must be finite"),
        (dict(logits=x, top_k=torch.tensor([1.0, 2.0, 3.0])), "top_k must be an integer tensor"),
        (dict(logits=x, top_p=torch.tensor([1, 1, 1])), "top_p must be a floating tensor"),
        (dict(logits=x, temperature=torch.ones(4)), "shape (3,)"),
        (dict(logits=x, top_logprobs=51), "top_logprobs must be between 0"),
        (dict(logits=x, num_samples=0), "num_samples must be between 1"),
        (dict(logits=x[0]), "shape (batch, vocab)"),
        (dict(logits=x.long()), "float16, bfloat16, float32 or float64"),
        (dict(logits=x, seed=1, generator=torch.Generator()), "mutually exclusive"),
    ]
    for kwargs, message in cases:
        with pytest.raises((TypeError, ValueError), match=re_escape(message)):
            fs.sample(**kwargs)
    with pytest.raises(ValueError, match="exactly one"):
        fs.process()


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_bad_rows_and_bad_control_values_are_flagged_not_raised():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 400, generator=gen)
    x[1, 3] = math.nan
    x[2, 9] = math.inf
    x[3] = -math.inf
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 1.0])
    top_p = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.9, math.nan, 0.9])
    top_k = torch.tensor([5, 5, 5, 5, 5, 5, -3])
    out = fs.sample(
        x, temperature=temperature, top_p=top_p, top_k=top_k, seed=3, num_samples=2, top_logprobs=2
    )
    assert out.valid.tolist() == [True] + [False] * 6
    assert out.token_ids[1:].eq(torch.tensor([0, 1])).all()
    assert out.probs[1:].eq(0).all() and out.logprobs[1:].eq(-math.inf).all()
    assert out.top_logprobs[1:].eq(-math.inf).all()
    clean = fs.sample(
        x[:1],
        temperature=temperature[:1],
        top_p=top_p[:1],
        top_k=top_k[:1],
        seed=3,
        num_samples=2,
        top_logprobs=2,
    )
    assert torch.equal(clean.token_ids, out.token_ids[:1])
    assert torch.equal(clean.probs, out.probs[:1])
    processed = fs.process(x, temperature=temperature, top_p=top_p, top_k=top_k)
    assert processed[1:].eq(0).all() and torch.allclose(processed[0].sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="logits row 1 contains NaN"):
        fs.sample(x, check=True)
    with pytest.raises(ValueError, match=re_escape("top_k[6] = -3")):
        fs.sample(x[:1].expand(7, -1), top_k=top_k, check=True)


def test_garbage_never_gives_out_of_range_ids():
    gen = torch.Generator().manual_seed(4)
    for trial in range(20):
        vocab = int(torch.randint(1, 600, (1,), generator=gen))
        x = torch.randn(5, vocab, generator=gen) * 1e30
        x[torch.rand(5, vocab, generator=gen) < 0.3] = math.nan
        x[torch.rand(5, vocab, generator=gen) < 0.3] = math.inf
        x[torch.rand(5, vocab, generator=gen) < 0.3] = -math.inf
        out = fs.sample(
            x,
            temperature=torch.rand(5, generator=gen) * 3,
            top_k=torch.randint(-2, vocab + 2, (5,), generator=gen),
            top_p=torch.rand(5, generator=gen) * 1.2,
            min_p=torch.rand(5, generator=gen),
            num_samples=min(3, vocab),
            seed=trial,
            top_logprobs=min(2, vocab),
        )
        assert ((out.token_ids >= 0) & (out.token_ids < vocab)).all()
        assert ((out.top_token_ids >= 0) & (out.top_token_ids < vocab)).all()


# ----------------------------------------------------------------------------- reproducibility


@pytest.mark.parametrize("vocab", [300, 2048, 40_000])
def test_empty_batch_with_every_control(vocab):
    """A batch of 0 rows (an engine step with no sampling request) runs every stage, radix
    selections included, and returns empty results."""
    none = torch.zeros(0)
    settings = (
        {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
        {"top_p": 0.9},
        {"top_k": 2000, "min_p": 0.1},
        {"temperature": none, "top_k": none.long(), "top_p": none + 1, "min_p": none},
    )
    for logits in (torch.zeros(0, vocab), None):
        probs = None if logits is not None else torch.zeros(0, vocab)
        for controls in settings:
            out = fs.sample(logits, probs, num_samples=2, top_logprobs=3, **controls)
            assert out.token_ids.shape == (0, 2) and out.valid.shape == (0,)
            assert fs.process(logits, probs, **controls).shape == (0, vocab)


def test_seeded_rows_are_batch_invariant():
    xs, controls = make_batch(900, 40, seed=17)
    x = torch.tensor(xs, dtype=torch.float32)
    ctl = as_tensors(controls)
    seeds = torch.arange(40) * 7919 + 3
    steps = torch.arange(40) + 100
    full = fs.sample(x, **ctl, seed=seeds, step=steps, num_samples=2)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    shuffled = fs.sample(
        x[perm],
        **{n: v[perm] for n, v in ctl.items()},
        seed=seeds[perm],
        step=steps[perm],
        num_samples=2,
    )
    assert torch.equal(shuffled.token_ids, full.token_ids[perm])
    for row in (0, 13, 39):
        alone = fs.sample(
            x[row : row + 1],
            **{n: v[row : row + 1] for n, v in ctl.items()},
            seed=seeds[row : row + 1],
            step=steps[row : row + 1],
            num_samples=2,
        )
        assert torch.equal(alone.token_ids, full.token_ids[row : row + 1])


# ----------------------------------------------------------------------------- graph safety


def test_compiles_fullgraph_without_recompiling_for_new_control_values():
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()

    @torch.compile(backend=counter, fullgraph=True)
    def step(x, t, k, p, m, seeds):
        return fs.sample(x, temperature=t, top_k=k, top_p=p, min_p=m, seed=seeds, top_logprobs=2)

    xs, controls = make_batch(300, 6, seed=41)
    x = torch.tensor(xs, dtype=torch.float32)
    seeds = torch.arange(6)
    for trial in range(3):
        _, controls = make_batch(300, 6, seed=41 + trial)
        ctl = as_tensors(controls)
        got = step(x, ctl["temperature"], ctl["top_k"], ctl["top_p"], ctl["min_p"], seeds)
        want = fs.sample(x, **ctl, seed=seeds, top_logprobs=2)
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.top_token_ids, want.top_token_ids)
    assert counter.frame_count == 1


def test_inductor_compiled_sample_matches_eager():
    torch._dynamo.reset()
    xs, controls = make_batch(700, 6, seed=43, greedy_ok=True)
    x = torch.tensor(xs, dtype=torch.float32)
    ctl = as_tensors(controls)
    compiled = torch.compile(lambda x, c: fs.sample(x, **c, seed=9, num_samples=2), fullgraph=True)
    got, want = compiled(x, ctl), fs.sample(x, **ctl, seed=9, num_samples=2)
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.valid, want.valid)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-5, atol=0)


def law_cases():
    """test_sample_frequencies_match_reference's laws (tests/test_power.py checks them)."""
    for variant in PLANS:
        _, _, want, draws = configurations(variant)
        for (kind, *_), law, n in zip(PLANS[variant], want, draws, strict=True):
            yield LawCase(f"controls {variant} V={V} {kind}", law, n, CLAIM)
    _, _, want, _, want_p = many_blocks_configurations()
    for source, laws in (("logits", want), ("probs", want_p)):
        for row, law in enumerate(laws):
            name = f"many blocks {source} V=1300 row {row}"
            yield LawCase(name, law, MANY_BLOCKS_DRAWS, MANY_BLOCKS_CLAIM, MANY_BLOCKS_CARRIED)


def test_the_general_paths_weights_buffer_is_kept_and_never_reaches_the_caller(monkeypatch):
    """On CPU the general path's (B, V) weights live in a per-thread buffer kept between calls
    (fastsample.ops.scratch: a fresh 32 MB block page-faulted after any heap trim). Nothing a
    call returns may view it: the first call's results stay the same after a second call on
    other logits refills the buffer."""
    from fastsample.ops import scratch

    slots = []
    real = scratch.buffer

    buffers = []

    def spy(slot, shape, dtype, device):
        got = real(slot, shape, dtype, device)
        slots.append((slot, got.data_ptr()))
        if slot == "general weights":
            buffers.append(got)
        return got

    monkeypatch.setattr(scratch, "buffer", spy)
    gen = torch.Generator().manual_seed(3)
    first, second = (torch.randn(4, 5001, generator=gen) * 3 for _ in range(2))
    controls = dict(temperature=0.8, top_p=0.9)
    processed = fs.process(first, **controls)
    drawn = fs.sample(first, **controls, num_samples=2, seed=5, top_logprobs=3)
    returned = [t for t in (processed, *drawn) if isinstance(t, torch.Tensor)]
    assert len(returned) >= 5  # the probabilities, and the draw's ids, probs, logprobs, top-N
    kept = [t.clone() for t in returned]
    weights_then = buffers[-1].clone()
    fs.process(second, **controls)
    fs.sample(second, **controls, num_samples=2, seed=5, top_logprobs=3)
    assert all(torch.equal(a, b) for a, b in zip(kept, returned, strict=True))
    # The control: the buffer itself was refilled, so a view of it would have changed.
    assert not torch.equal(weights_then, buffers[-1])
    pointers = {ptr for slot, ptr in slots if slot == "general weights"}
    assert len(pointers) == 1 and len([s for s, _ in slots if s == "general weights"]) == 4
