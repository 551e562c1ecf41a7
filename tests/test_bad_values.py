"""Values at the edges of the argument ranges (issue 18, item 5): each has one documented
behaviour, the same whichever path or control form serves the row.

* A positive temperature too small for the weights' dtype computes as the dtype's smallest
  normal number: the ``T -> 0+`` limit, never a NaN row.
* A tensor ``stream`` outside ``[0, 2**24)`` flags its row (a Python int raises; check=True
  raises for the tensor too).
* Probabilities whose total is ``2**128`` or more (float32 sums overflow) are invalid for
  every sampled row whatever the controls; greedy rows need no sum.
* An out-of-range tensor control flags its row whatever the temperature: a Python 0 (the
  greedy shortcuts, which never weigh the row), a tensor of zeros, or 1.
"""

from __future__ import annotations

import pytest
import torch

import fastsample as fs

INF = float("inf")


# ---------------------------------------------------------------------------- tiny temperatures


@pytest.mark.parametrize("temperature", [1e-46, 1e-300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("source", ["logits", "probs"])
def test_tiny_temperature_is_the_greedy_limit(source, dtype, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 500, generator=gen) * 3).to(dtype)
    x = logits if source == "logits" else torch.softmax(logits.double(), -1).to(dtype)
    best = x.argmax(-1)
    as_tensor = torch.full((6,), temperature, dtype=torch.float64)
    for t in (temperature, as_tensor):
        for kwargs in ({}, {"top_k": torch.full((6,), 50)}, {"top_p": 0.9}):
            out = fs.sample(**{source: x}, temperature=t, seed=torch.arange(6), **kwargs)
            assert out.valid.all()
            assert torch.equal(out.token_ids[:, 0], best)
            assert (out.probs == 1).all()
        processed = fs.process(**{source: x}, temperature=t)
        assert torch.equal(processed.argmax(-1), best) and (processed.amax(-1) == 1).all()


def test_tiny_temperature_draws_ties_uniformly():
    """The T -> 0+ limit keeps every maximal entry (ties), unlike T = 0 (the first one)."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0, 0.5]]).expand(4000, 5)
    out = fs.sample(logits, temperature=1e-46, seed=torch.arange(4000))
    assert out.valid.all()
    counts = torch.bincount(out.token_ids[:, 0], minlength=5)
    assert counts[[0, 2, 4]].sum() == 0
    assert 1800 < counts[1] < 2200  # 2000 +- 6.3 standard deviations
    assert (fs.sample(logits[:3], temperature=0.0).token_ids == 1).all()


# ---------------------------------------------------------------------------- tensor controls

OUT_OF_RANGE = {
    "min_p": torch.tensor([0.1, -0.1, 0.0]),
    "top_p": torch.tensor([0.9, 1.5, 1.0]),
    "top_k": torch.tensor([3, -3, 0]),
}


@pytest.mark.parametrize("num_samples", [1, 2])
@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_out_of_range_tensor_control_flags_its_row_at_any_temperature(name, num_samples):
    """Found by fuzzing: with a Python ``temperature=0.0`` the greedy shortcut left such a row
    valid, while a zero-temperature tensor or ``temperature=1.0`` flagged it. (The Triton
    backend runs this in tests/kernels/test_triton_controls_edges.py.)"""
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    for temperature in (0.0, torch.zeros(3), 1.0):
        out = fs.sample(logits, temperature=temperature, num_samples=num_samples, seed=3,
                        **{name: OUT_OF_RANGE[name]})  # fmt: skip
        assert out.valid.tolist() == [True, False, True], (temperature, out.valid)
        assert out.token_ids[1].tolist() == list(range(num_samples))
        assert (out.probs[1] == 0).all()


# ---------------------------------------------------------------------------- tensor streams


def test_stream_out_of_range_flags_its_row():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen)
    probs = torch.softmax(logits, -1)
    good = torch.tensor([0, 7, 2**24 - 1, 3, 5])
    stream = torch.tensor([0, -1, 2**24 - 1, 2**24, 2**40])
    bad = [1, 3, 4]
    seed = {"seed": torch.arange(5), "step": 2}
    for run in (
        lambda s: fs.sample(logits, temperature=0.8, stream=s, **seed),
        lambda s: fs.sample(logits, top_k=5, stream=s, top_logprobs=2, **seed),
        lambda s: fs.sample(logits, temperature=0.0, stream=s, **seed),
        lambda s: fs.sample(probs=probs, stream=s, num_samples=2, **seed),
        lambda s: fs.sample_from_probs(probs, 2, stream=s, method="race", **seed),
        lambda s: fs.sample_from_probs(probs, 2, stream=s, method="inverse_cdf", **seed),
    ):
        out, ref = run(stream), run(good)
        assert out.valid.tolist() == [row not in bad for row in range(5)]
        n = out.token_ids.shape[1]
        assert (out.token_ids[bad] == torch.arange(n)).all()
        assert (out.probs[bad] == 0).all() and (out.logprobs[bad] == -INF).all()
        if out.top_logprobs is not None:
            assert (out.top_logprobs[bad] == -INF).all()
        for field in ("token_ids", "probs", "logprobs"):  # rows 0 and 2 have the same streams
            assert torch.equal(getattr(out, field)[[0, 2]], getattr(ref, field)[[0, 2]])
    _, index = fs.fast_sample(probs, 2, stream=stream, **seed)
    assert (index[bad] == torch.tensor([0, 1])).all()


def test_stream_out_of_range_raises_as_int_or_with_check():
    probs = torch.softmax(torch.randn(3, 50), -1)
    with pytest.raises(ValueError, match=r"stream must be in \[0, 2\*\*24\)"):
        fs.sample_from_probs(probs, seed=1, stream=-1)
    stream = torch.tensor([0, 2**24, 1])
    with pytest.raises(ValueError, match=r"stream\[1\] = 16777216 must be in \[0, 2\*\*24\)"):
        fs.sample_from_probs(probs, seed=1, stream=stream, check=True)
    with pytest.raises(ValueError, match=r"stream\[1\]"):
        fs.sample(probs=probs, seed=1, stream=stream, check=True)
    with pytest.raises(ValueError, match=r"stream\[1\]"):
        fs.fast_sample(probs, seed=1, stream=stream, check=True)


# ---------------------------------------------------------------------------- overflowing totals


def overflow_batch(vocab, dtype):
    """Row 0: finite weights with a total of ~4e38 (>= 2**128); row 1: ~2e38 (fine);
    row 2: an ordinary distribution. The large weights sit at both ends of the row: in one
    block of the block sums for a short row (that block's float32 sum overflows), in two
    blocks for a long one (no block overflows, the float64 total is still >= 2**128)."""
    probs = torch.zeros(3, vocab, dtype=torch.float64)
    probs[0, [0, -1]] = 2e38
    probs[1, [0, -1]] = 1e38
    probs[2] = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(2)), -1)
    return probs.to(dtype)


CONTROLS = [
    {},
    {"top_k": torch.tensor([1, 1, 1])},
    {"top_k": 1},
    {"temperature": 0.5},
    {"top_p": torch.full((3,), 0.5)},
    {"min_p": 0.2},
]


# Even widths: the raw probabilities are summed; odd: a scaled copy (and the plain total).
@pytest.mark.parametrize("vocab", [8, 9, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overflowing_total_is_invalid_whatever_the_controls(dtype, vocab):
    probs = overflow_batch(vocab, dtype)
    for kwargs in CONTROLS:
        out = fs.sample(probs=probs, seed=torch.arange(3), **kwargs)
        assert out.valid.tolist() == [False, True, True], kwargs
        processed = fs.process(probs=probs, **kwargs)
        assert not processed[0].any() and processed[1:].sum(-1).allclose(torch.ones(2))
    for method in ("race", "inverse_cdf"):
        assert fs.sample_from_probs(probs, method=method).valid.tolist() == [False, True, True]
    # Greedy rows need no sum: valid, as a Python 0 or a tensor 0.
    for t in (0.0, torch.tensor([0.0, 1.0, 0.0])):
        out = fs.sample(probs=probs, temperature=t, top_k=torch.full((3,), 2), seed=1)
        assert out.valid.tolist() == [True, True, True]
        assert out.token_ids[0, 0] == 0
    with pytest.raises(ValueError, match="row 0 has a total of 2\\*\\*128 or more"):
        fs.sample_from_probs(probs, check=True)
    with pytest.raises(ValueError, match="row 0 has a total of 2\\*\\*128 or more"):
        fs.sample(probs=probs, top_k=1, check=True)


def test_float64_totals_only_overflow_float64():
    probs = overflow_batch(8, torch.float64)
    for kwargs in CONTROLS:
        assert fs.sample(probs=probs, seed=1, **kwargs).valid.all()
    assert fs.sample_from_probs(probs, check=True).valid.all()
    probs[0, :4] = 1e308  # the total overflows float64 itself
    for kwargs in CONTROLS:
        assert fs.sample(probs=probs, seed=1, **kwargs).valid.tolist() == [False, True, True]
    assert fs.sample_from_probs(probs).valid.tolist() == [False, True, True]
