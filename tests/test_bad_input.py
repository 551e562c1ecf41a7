"""Bad input: argument errors before any work, bad rows flagged without touching good rows."""

from __future__ import annotations

import pytest
import torch

import fastsample as fs

NAN, INF = float("nan"), float("inf")
METHODS = ["inverse_cdf", "race"]


def clean_batch(batch=6, vocab=700, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, vocab, generator=gen) * 2, -1)


# --- argument errors: raised before any work, naming the argument -------------------------


@pytest.mark.parametrize(
    "probs,num_samples,kwargs,error,words",
    [
        ([[0.5, 0.5]], 1, {}, TypeError, "probs must be a torch.Tensor"),
        (torch.ones(3), 1, {}, ValueError, "probs must have shape (batch, vocab)"),
        (torch.ones(2, 3, 4), 1, {}, ValueError, "3 dimensions"),
        (torch.ones(2, 3, dtype=torch.int64), 1, {}, TypeError, "float16, bfloat16"),
        (torch.ones(2, 0), 1, {}, ValueError, "at least one vocabulary entry"),
        (torch.ones(2, 3), 0, {}, ValueError, "num_samples must be between 1 and"),
        (torch.ones(2, 3), 4, {}, ValueError, "vocabulary size 3"),
        (torch.ones(2, 3), 1.0, {}, TypeError, "num_samples must be a Python int"),
        (torch.ones(2, 3), True, {}, TypeError, "num_samples must be a Python int"),
        (torch.ones(2, 3), 1, {"generator": 7}, TypeError, "generator must be a torch.Generator"),
        (torch.ones(2, 3), 1, {"check": 1}, TypeError, "check must be True or False"),
    ],
)
@pytest.mark.parametrize("api", ["sample_from_probs", "fast_sample"])
def test_argument_errors(api, probs, num_samples, kwargs, error, words):
    with pytest.raises(error) as info:
        getattr(fs, api)(probs, num_samples, **kwargs)
    assert words in str(info.value)


def test_unknown_method():
    with pytest.raises(ValueError, match="method must be one of 'auto', 'race', 'inverse_cdf'"):
        fs.sample_from_probs(torch.ones(1, 3), method="multinomial")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_generator_device_mismatch():
    with pytest.raises(ValueError, match="generator is on cpu but probs is on cuda"):
        fs.sample_from_probs(torch.ones(1, 3, device="cuda"), generator=torch.Generator())


def test_errors_come_before_any_random_draw():
    """A rejected call consumes no randomness: the next draw is unchanged."""
    probs = clean_batch()
    gen = torch.Generator().manual_seed(1)
    expected = fs.sample_from_probs(probs, generator=gen).token_ids
    gen.manual_seed(1)
    with pytest.raises(ValueError):
        fs.sample_from_probs(probs, 10_000, generator=gen)
    assert torch.equal(fs.sample_from_probs(probs, generator=gen).token_ids, expected)


# --- bad rows ------------------------------------------------------------------------------

BAD_ROWS = {
    "nan": lambda r: r.index_fill(0, torch.tensor([5]), NAN),
    "plus_inf": lambda r: r.index_fill(0, torch.tensor([650]), INF),
    "minus_inf": lambda r: r.index_fill(0, torch.tensor([3]), -INF),
    "negative": lambda r: r.index_fill(0, torch.tensor([699]), -1e-6),
    "all_zero": lambda r: torch.zeros_like(r),
    "all_nan": lambda r: torch.full_like(r, NAN),
}


# Where the bad rows go in a batch of 10: good rows before, between and after them.
BAD_AT = [1, 3, 4, 6, 7, 9]


def spoil_rows(clean):
    """``clean`` with the rows of ``BAD_AT`` spoiled (one of each kind); the bad-row mask."""
    dirty = clean.clone()
    for row, spoil in zip(BAD_AT, BAD_ROWS.values(), strict=True):
        dirty[row] = spoil(clean[row])
    bad = torch.zeros(clean.shape[0], dtype=torch.bool)
    bad[BAD_AT] = True
    assert (~bad).sum() >= 4  # real good rows to compare
    return dirty, bad


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_samples", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bad_rows_are_flagged_and_do_not_touch_good_rows(method, num_samples, dtype):
    clean = clean_batch(batch=10).to(dtype)
    dirty, bad = spoil_rows(clean)

    def run(probs):
        gen = torch.Generator().manual_seed(42)  # the same random stream for both batches
        return fs.sample_from_probs(probs, num_samples, generator=gen, method=method)

    ref, out = run(clean), run(dirty)
    assert out.valid.tolist() == (~bad).tolist()
    assert ref.valid.all()
    # Good rows: bitwise the result they get in a clean batch (the same uniforms, since the
    # generator gives both batches the same stream).
    assert torch.equal(out.token_ids[~bad], ref.token_ids[~bad])
    assert torch.equal(out.probs[~bad], ref.probs[~bad])
    assert torch.equal(out.logprobs[~bad], ref.logprobs[~bad])
    # Bad rows: the documented result, ids 0..n-1 with probability 0.
    assert torch.equal(out.token_ids[bad], torch.arange(num_samples).expand(int(bad.sum()), -1))
    assert not out.probs[bad].any()


@pytest.mark.parametrize("randomness", ["generator", "seeded"])
def test_fast_sample_bad_rows(randomness):
    """fast_sample is always the race; its noise comes from a generator or from seeds."""
    clean = clean_batch(batch=10)
    dirty, bad = spoil_rows(clean)

    def run(probs):
        if randomness == "seeded":
            return fs.fast_sample(probs, 2, seed=torch.arange(10) + 5, step=1)
        return fs.fast_sample(probs, 2, generator=torch.Generator().manual_seed(3))

    (ref_p, ref_index), (sample_p, sample_index) = run(clean), run(dirty)
    assert (sample_index[bad] == torch.tensor([0, 1])).all()  # the documented bad-row ids
    assert torch.equal(sample_index[~bad], ref_index[~bad])  # good rows untouched, bitwise
    assert torch.equal(sample_p[~bad], ref_p[~bad])
    assert torch.equal(sample_p.nan_to_num(7.0), dirty.gather(1, sample_index).nan_to_num(7.0))
    assert ((sample_index >= 0) & (sample_index < dirty.shape[1])).all()


@pytest.mark.parametrize("method", METHODS)
def test_more_draws_than_positive_weights(method):
    """Genuine draws first, then the last genuine draw repeated; never a zero weight."""
    probs = torch.tensor(
        [[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [0.2, 0.2, 0.2, 0.2, 0.2]]
    )
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        out = fs.sample_from_probs(probs, 4, generator=gen, method=method)
        assert out.valid.tolist() == [False, False, True]
        assert sorted(out.token_ids[0, :2].tolist()) == [1, 3]
        assert out.token_ids[0, 2:].tolist() == [out.token_ids[0, 1].item()] * 2
        assert out.token_ids[1].tolist() == [4, 4, 4, 4]
        assert (out.probs[0, :2] > 0).all() and not out.probs[0, 2:].any()
        assert out.probs[1].tolist() == [1.0, 0.0, 0.0, 0.0]
        assert len(set(out.token_ids[2].tolist())) == 4
        assert (probs.gather(1, out.token_ids) > 0).all()


def test_check_true_names_first_bad_row():
    probs = clean_batch()
    probs[3, 7] = -0.5
    probs[5] = 0
    with pytest.raises(ValueError, match=r"probs row 3 contains negative weights \(2 bad"):
        fs.sample_from_probs(probs, check=True)
    with pytest.raises(ValueError, match="row 3"):
        fs.fast_sample(probs, check=True)
    probs[3, 7] = 0.0
    with pytest.raises(ValueError, match="row 5 has zero total weight"):
        fs.sample_from_probs(probs, check=True)
    probs[5, 0] = NAN
    with pytest.raises(ValueError, match="row 5 contains NaN and has zero total"):
        fs.sample_from_probs(probs, check=True)


def test_check_true_passes_clean_input_and_same_draws():
    probs = clean_batch()
    a = fs.sample_from_probs(probs, generator=torch.Generator().manual_seed(0), check=True)
    b = fs.sample_from_probs(probs, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.token_ids, b.token_ids)


@pytest.mark.parametrize("method", METHODS)
def test_empty_batch_and_single_token_vocab(method):
    out = fs.sample_from_probs(torch.empty(0, 5), 2, method=method)
    assert out.token_ids.shape == (0, 2) and out.valid.shape == (0,)
    out = fs.sample_from_probs(torch.tensor([[3.0], [0.0]]), method=method)
    assert out.token_ids.tolist() == [[0], [0]]
    assert out.valid.tolist() == [True, False]
    assert out.probs.tolist() == [[1.0], [0.0]]


@pytest.mark.parametrize("method", METHODS)
def test_huge_and_tiny_weights_stay_in_range(method):
    probs = torch.tensor([[3e38, 1.0, 0.0], [1e-45, 0.0, 0.0], [1e-40, 1e-40, 0.0]])
    out = fs.sample_from_probs(probs, generator=torch.Generator().manual_seed(0), method=method)
    assert out.token_ids[1].item() == 0
    assert out.valid[1:].all()
    assert ((out.token_ids >= 0) & (out.token_ids < 3)).all()


def test_input_not_modified_and_non_contiguous_input():
    base = clean_batch(4, 1500)
    probs = base.t().contiguous().t()  # same values, column-major strides
    before = probs.clone()
    gen = torch.Generator().manual_seed(0)
    a = fs.sample_from_probs(probs, 2, generator=gen).token_ids
    assert torch.equal(probs, before)
    gen.manual_seed(0)
    assert torch.equal(fs.sample_from_probs(base, 2, generator=gen).token_ids, a)


def test_auto_method_choice_is_documented_and_same_law():
    from fastsample.sampling import choose_method

    assert choose_method(torch.ones(64, 128), 1) == "race"
    assert choose_method(torch.ones(64, 128256), 1) == "inverse_cdf"
    assert choose_method(torch.ones(64, 128), 1, seeded=True) == "inverse_cdf"
    small = torch.softmax(torch.randn(8, 50), -1)
    gen = torch.Generator().manual_seed(0)
    auto = fs.sample_from_probs(small, 2, generator=gen).token_ids
    gen.manual_seed(0)
    assert torch.equal(auto, fs.sample_from_probs(small, 2, generator=gen, method="race").token_ids)


@pytest.mark.parametrize("method", METHODS)
def test_garbage_rows_always_give_in_range_ids(method):
    """Fuzz: rows mixing NaN, +-inf, negatives, huge, tiny and subnormal values."""
    gen = torch.Generator().manual_seed(123)
    specials = torch.tensor([NAN, INF, -INF, -1.0, 3e38, 1e-45, 0.0, 1.0, -0.0, 1e-30])
    for vocab in [1, 2, 255, 256, 257, 700, 1025]:
        for _ in range(5):
            picks = torch.randint(0, len(specials), (16, vocab), generator=gen)
            rows = torch.where(
                torch.rand(16, vocab, generator=gen) < 0.3, specials[picks], torch.rand(16, vocab)
            )
            n = min(3, vocab)
            out = fs.sample_from_probs(rows, n, generator=gen, method=method)
            assert ((out.token_ids >= 0) & (out.token_ids < vocab)).all()
            seeded = fs.sample_from_probs(rows, n, seed=7, step=1, method=method)
            assert ((seeded.token_ids >= 0) & (seeded.token_ids < vocab)).all()
            assert torch.equal(seeded.valid, out.valid)
