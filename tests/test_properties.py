"""Property tests (hypothesis) over shapes, dtypes and special values.

For ``sample``, ``sample_from_probs``, ``fast_sample`` and ``verify_chain``, on batches of
0..6 rows and 1..300 tokens in every float dtype, with rows of NaN, +-inf, negative, zero,
huge and tiny values mixed with ordinary ones:

* nothing raises but a clear ``ValueError``/``TypeError`` for a bad argument;
* every id is in range;
* the rows with bad values are flagged (and, where the rule is simple, exactly those);
* the good rows get bitwise the results they get in a batch of their own (seeded calls).

``derandomize=True``: the examples are a fixed function of the test, so CI is reproducible.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastsample as fs

NAN, INF = math.nan, math.inf
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Huge values: a single 3e38 fits float32 sums, two do not (2**128 ~ 3.4e38); the large
# values beside them (LARGE, at most 300 of them) add far less than that gap, so no total
# lands near the overflow boundary, where summation order could decide.
HUGE = {torch.float16: 6e4, torch.bfloat16: 3e38, torch.float32: 3e38, torch.float64: 1e308}
LARGE = {torch.float16: 10.0, torch.bfloat16: 1e34, torch.float32: 1e34, torch.float64: 1e34}
TINY = {torch.float16: 6e-8, torch.bfloat16: 1e-40, torch.float32: 1e-45, torch.float64: 1e-310}
PROB_ROWS = ["softmax", "sparse", "uniform", "zero", "nan", "huge", "tiny"]
LOGIT_ROWS = ["randn", "zero", "masked", "nan", "wide"]


@st.composite
def batches(draw, kinds, specials):
    """``(x, dtype)``: a ``(B, V)`` batch built row by row from ``kinds``, with up to four
    entries per row overwritten by ``specials`` (values, or ``"huge"``/``"tiny"``)."""
    batch = draw(st.integers(0, 6))
    vocab = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = []
    for _ in range(batch):
        kind = draw(st.sampled_from(kinds))
        rows.append(make_row(kind, vocab, dtype, gen))
    x = torch.stack(rows) if rows else torch.empty(0, vocab, dtype=torch.float64)
    x = x.to(dtype)
    for row in range(batch):
        for _ in range(draw(st.integers(0, 4)) if draw(st.booleans()) else 0):
            value = draw(st.sampled_from(specials))
            value = {"huge": HUGE[dtype], "tiny": TINY[dtype]}.get(value, value)
            x[row, draw(st.integers(0, vocab - 1))] = value
    return x, dtype


def make_row(kind: str, vocab: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(vocab, generator=gen, dtype=torch.float64)
    if kind == "softmax":
        return torch.softmax(noise * 3, -1)
    if kind == "sparse":
        return torch.softmax(noise * 3, -1) * (torch.rand(vocab, generator=gen) < 0.2)
    if kind == "uniform":
        return torch.ones(vocab, dtype=torch.float64)
    if kind == "zero":
        return torch.zeros(vocab, dtype=torch.float64)
    if kind == "nan":
        return torch.full((vocab,), NAN, dtype=torch.float64)
    if kind == "huge":
        return torch.where(noise > 1.0, HUGE[dtype], (noise > 0).double() * LARGE[dtype])
    if kind == "tiny":
        return torch.full((vocab,), TINY[dtype], dtype=torch.float64)
    if kind == "randn":
        return noise * 5
    if kind == "masked":
        return torch.full((vocab,), -INF, dtype=torch.float64)
    assert kind == "wide"  # logits in the 1e30s: the weights of all but the largest underflow
    return noise * 1e30


def bad_probs(x: torch.Tensor, greedy: bool = False) -> torch.Tensor:
    """The documented rule: NaN, +-inf or negative entries, a zero total, or (sampled rows)
    a total that overflows float32 sums (float64 input: an infinite total)."""
    x64 = x.double()
    bad = x64.isnan().any(-1) | x64.isinf().any(-1) | (x64 < 0).any(-1)
    total = x64.sum(-1)
    bad |= ~(total > 0)
    if not greedy:
        limit = INF if x.dtype == torch.float64 else 2.0**128
        bad |= ~(total < limit)
    return bad


def bad_logits(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64.isnan().any(-1) | (x64 == INF).any(-1) | (x64 == -INF).all(-1)


def seeds(batch: int) -> dict:
    return {"seed": torch.arange(batch) * 104729 + 1, "step": torch.arange(batch) % 4}


def assert_good_rows_alone(call, x, good, **kwargs):
    """``call(x, seeds, **kwargs)`` on the batch and on the rows of ``good`` alone."""
    full = call(x, **seeds(x.shape[0]), **kwargs)
    rows = good.nonzero()[:, 0]
    if len(rows) == 0:
        return full
    per_row = {k: v[rows] for k, v in seeds(x.shape[0]).items()}
    alone = call(x[rows], **per_row, **kwargs)
    full_parts = [full] if isinstance(full, torch.Tensor) else list(full)
    alone_parts = [alone] if isinstance(alone, torch.Tensor) else list(alone)
    for whole, part in zip(full_parts, alone_parts, strict=True):
        if whole is not None:
            assert torch.equal(whole[rows], part)
    return full


def in_range(ids: torch.Tensor, vocab: int) -> bool:
    return bool(((ids >= 0) & (ids < vocab)).all())


NUM_SAMPLES = st.integers(1, 4)
PROB_SPECIALS = [NAN, INF, -INF, -1.0, 0.0, -0.0, "huge", "tiny"]
LOGIT_SPECIALS = [NAN, INF, -INF, -1e30, 1e30, 0.0, "huge", "tiny"]


@SETTINGS
@given(batches(PROB_ROWS, PROB_SPECIALS), NUM_SAMPLES, st.sampled_from(["race", "inverse_cdf"]))
def test_sample_from_probs(data, num_samples, method):
    x, _ = data
    batch, vocab = x.shape
    if num_samples > vocab:
        with pytest.raises(ValueError, match="num_samples must be between 1 and"):
            fs.sample_from_probs(x, num_samples, method=method)
        return
    bad = bad_probs(x)
    enough = (x.double() > 0).sum(-1) >= num_samples
    call = fs.sample_from_probs
    out = assert_good_rows_alone(call, x, ~bad, num_samples=num_samples, method=method)
    assert out.token_ids.shape == (batch, num_samples) and in_range(out.token_ids, vocab)
    assert torch.equal(out.valid, ~bad & enough)
    assert (out.token_ids[bad] == torch.arange(num_samples)).all()
    assert (out.probs[bad] == 0).all()


@SETTINGS
@given(batches(PROB_ROWS, PROB_SPECIALS), NUM_SAMPLES)
def test_fast_sample(data, num_samples):
    x, _ = data
    batch, vocab = x.shape
    if num_samples > vocab:
        with pytest.raises(ValueError, match="num_samples"):
            fs.fast_sample(x, num_samples)
        return
    bad = bad_probs(x)
    sample_p, index = assert_good_rows_alone(fs.fast_sample, x, ~bad, num_samples=num_samples)
    assert index.shape == (batch, num_samples) and in_range(index, vocab)
    assert (index[bad] == torch.arange(num_samples)).all()
    assert torch.equal(sample_p.nan_to_num(1.5), x.gather(1, index).nan_to_num(1.5))


CONTROLS = st.sampled_from(
    [
        {},
        {"temperature": 0.7},
        {"temperature": 0.0},
        {"top_k": 3},
        {"top_p": 0.9, "min_p": 0.05},
        {"temperature": 1e-46, "top_k": 50},
        {"tensor": True},
    ]
)


def tensor_controls(batch: int) -> dict:
    """Per-row controls with legal values (greedy rows included)."""
    rows = torch.arange(batch)
    return {
        "temperature": (rows % 3).double() * 0.6,  # 0 (greedy), 0.6, 1.2
        "top_k": rows % 4 * 5,
        "top_p": 1.0 - (rows % 2) * 0.2,
        "min_p": (rows % 2) * 0.05,
    }


@SETTINGS
@given(
    st.one_of(
        batches(LOGIT_ROWS, LOGIT_SPECIALS).map(lambda d: ("logits", *d)),
        batches(PROB_ROWS, PROB_SPECIALS).map(lambda d: ("probs", *d)),
    ),
    NUM_SAMPLES,
    CONTROLS,
    st.integers(0, 3),
)
def test_sample(data, num_samples, controls, top_logprobs):
    source, x, _ = data
    batch, vocab = x.shape
    if controls.get("tensor"):
        controls = tensor_controls(batch)
        controls["temperature"] = controls["temperature"].float()
        controls["top_p"] = controls["top_p"].float()
        controls["min_p"] = controls["min_p"].float()
    kwargs = {source: x, "num_samples": num_samples, "top_logprobs": top_logprobs, **controls}
    if num_samples > vocab or top_logprobs > vocab:
        with pytest.raises(ValueError, match=r"num_samples|top_logprobs"):
            fs.sample(**kwargs)
        return
    temperature = controls.get("temperature")
    all_greedy = not isinstance(temperature, torch.Tensor) and temperature == 0.0
    if source == "logits":
        bad = bad_logits(x)
    else:
        bad = bad_probs(x, greedy=all_greedy)
        if isinstance(temperature, torch.Tensor):  # greedy rows need no sum
            bad = torch.where(temperature == 0, bad_probs(x, greedy=True), bad)

    def call(values, **rest):
        rows_controls = controls
        if isinstance(temperature, torch.Tensor):
            keep = (rest["seed"] - 1) // 104729  # the batch rows these seeds belong to
            rows_controls = {k: v[keep] for k, v in controls.items()}
        args = {source: values, "num_samples": num_samples, "top_logprobs": top_logprobs}
        return fs.sample(**args, **rows_controls, **rest)

    out = assert_good_rows_alone(call, x, ~bad)
    assert out.token_ids.shape == (batch, num_samples) and in_range(out.token_ids, vocab)
    assert not out.valid[bad].any()
    assert (out.token_ids[bad] == torch.arange(num_samples)).all()
    if num_samples == 1:  # one draw: every row with good values is valid, whatever the controls
        assert torch.equal(out.valid, ~bad)
    if top_logprobs:
        assert out.top_token_ids.shape == (batch, top_logprobs)
        assert in_range(out.top_token_ids, vocab)
        assert (out.top_logprobs[bad] == -INF).all()


@st.composite
def chains(draw):
    batch, k, vocab = draw(st.integers(0, 6)), draw(st.integers(0, 3)), draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 3, -1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 3, -1)
    ids = torch.randint(0, vocab, (batch, k), generator=gen)
    kinds = [draw(st.sampled_from(["clean", "nan", "id", "specials"])) for _ in range(batch)]
    target, draft = target.to(dtype), draft.to(dtype)
    for row, kind in enumerate(kinds):
        if kind == "nan":  # every position: whichever row the walk reads is bad
            target[row] = NAN
        elif kind == "id" and k > 0:
            ids[row, draw(st.integers(0, k - 1))] = draw(st.sampled_from([-1, vocab, 2**40]))
        elif kind == "specials":
            for _ in range(draw(st.integers(1, 4))):
                which = target if k == 0 or draw(st.booleans()) else draft
                position = draw(st.integers(0, which.shape[1] - 1))
                value = draw(st.sampled_from([NAN, INF, -INF, -1.0, 0.0, "huge"]))
                value = HUGE[dtype] if value == "huge" else value
                which[row, position, draw(st.integers(0, vocab - 1))] = value
    use_draft = draw(st.booleans())
    flagged = torch.tensor([kind == "nan" or (kind == "id" and k > 0) for kind in kinds])
    clean = torch.tensor([kind == "clean" or (kind == "id" and k == 0) for kind in kinds])
    return target, ids, draft if use_draft else None, flagged, clean


@SETTINGS
@given(chains())
def test_verify_chain(data):
    target, ids, draft, flagged, clean = data
    batch, positions, vocab = target.shape
    k = positions - 1

    def call(p, seed, step):
        rows = (seed - 1) // 104729
        return fs.verify_chain(
            p, ids[rows], None if draft is None else draft[rows], seed=seed, step=step
        )

    out = assert_good_rows_alone(call, target, clean.bool() if batch else torch.ones(0).bool())
    emitted = out.num_emitted
    assert out.token_ids.shape == (batch, k + 1)
    assert torch.equal(emitted, torch.where(out.valid, out.num_accepted + 1, 0))
    assert ((out.num_accepted >= 0) & (out.num_accepted <= k)).all()
    slots = torch.arange(k + 1)
    used = slots < emitted[:, None]
    assert ((out.token_ids >= 0) & (out.token_ids < vocab))[used].all()
    assert (out.token_ids[~used] == -1).all()
    if batch:
        assert not out.valid[flagged].any()
        assert out.valid[clean].all()
