"""The engine step's processed distribution against the float64 reference of its stages.

For random rows with every combination of stages on (allowed ids, grammar bitmask, logit bias,
min-tokens, the three penalties, the controls in both orders), given as Python lists and as
tensors, :func:`fastsample.process_step` equals tests/stage_reference.py's distribution (same
support, values within 1e-6). Cuts are placed between distinct values (robust_top_p,
robust_min_p on the staged logits), so the kept set does not hinge on float rounding; the
boundaries themselves are tested exactly in test_step_boundaries.py. The laws of the draws are
in test_step_law.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
from reference import reference_probs, robust_min_p, robust_top_p
from stage_reference import Row, fastsample_args, stage_logits, step_probs

STAGES = ("allowed", "bitmask", "bias", "min_tokens", "penalties", "controls")


def random_row(x: np.ndarray, rng: np.random.Generator, stages, order="transformers") -> Row:
    vocab = x.shape[0]
    row = Row(cut_order=order)
    if "allowed" in stages and rng.random() < 0.7:
        row.allowed = rng.choice(vocab, size=int(rng.integers(3, vocab)), replace=False).tolist()
    if "bitmask" in stages and rng.random() < 0.7:
        words = rng.integers(-(2**31), 2**31, size=(vocab + 31) // 32, dtype=np.int64)
        row.bitmask_words = words.astype(np.int32)
    if "bias" in stages and rng.random() < 0.8:
        ids = rng.choice(vocab, size=int(rng.integers(1, 6)), replace=False)
        row.bias = {int(i): float(rng.normal() * 2) for i in ids}
    if "min_tokens" in stages and rng.random() < 0.8:
        row.min_tokens = int(rng.integers(1, 5))
        row.stop = rng.choice(vocab, size=int(rng.integers(1, 4)), replace=False).tolist()
    if "penalties" in stages or "min_tokens" in stages:
        row.outputs = rng.integers(0, vocab, size=int(rng.integers(0, 8))).tolist()
    if "penalties" in stages:
        row.prompt = rng.integers(0, vocab, size=int(rng.integers(0, 10))).tolist()
        row.repetition = float(rng.choice([1.0, 0.7, 1.3, 2.0]))
        row.frequency = float(rng.choice([0.0, 0.4, -0.3]))
        row.presence = float(rng.choice([0.0, 0.6, -0.5]))
    if "controls" in stages:
        row.temperature = float(rng.choice([0.6, 1.0, 1.5]))
        row.top_k = int(rng.choice([0, int(rng.integers(1, vocab))]))
        staged = stage_logits(x, row)
        if np.isfinite(staged).any():
            weights = np.exp((staged - staged.max()) / row.temperature)
            if rng.random() < 0.5:
                row.min_p = robust_min_p(weights, rng)
            m = row.min_p if order == "vllm" else 0.0
            survivors = reference_probs(staged, row.temperature, row.top_k, 1.0, m,
                                        cut_order="vllm")  # fmt: skip
            if rng.random() < 0.7:
                row.top_p = robust_top_p(survivors, rng)
    return row


def batch_of(vocab, rows, seed, stages, order="transformers"):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(rows, vocab)) * 2
    return xs, [random_row(x, rng, stages, order) for x in xs]


def expected(xs, rows):
    out = []
    for x, row in zip(xs, rows, strict=True):
        staged = stage_logits(x, row)
        out.append(step_probs(x, row) if np.isfinite(staged).any() else np.zeros_like(x))
    return np.stack(out)


def assert_close_support(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    got64 = got.double().numpy()
    for b in range(want.shape[0]):
        assert np.array_equal(np.flatnonzero(want[b]), np.flatnonzero(got64[b])), f"{what} row {b}"
    np.testing.assert_allclose(got64, want, rtol=0, atol=1e-6, err_msg=what)


@pytest.mark.parametrize("form", ["list", "tensor"])
@pytest.mark.parametrize(
    "stages", [(s,) for s in STAGES[:-1]] + [STAGES], ids=[*STAGES[:-1], "all"]
)
def test_process_step_matches_the_reference(stages, form):
    vocab = 70  # three bitmask words, the last one partial
    seed = sum(map(ord, "".join(stages))) + len(form)  # stable across processes
    xs, rows = batch_of(vocab, 24, seed=seed, stages=stages)
    params, stats, bitmask = fastsample_args(rows, vocab, form)
    got = fs.process_step(torch.tensor(xs, dtype=torch.float32), params, state=stats,
                          token_bitmask=bitmask)  # fmt: skip
    assert_close_support(got, expected(xs, rows), f"{stages} {form}")


@pytest.mark.parametrize("order", ["transformers", "vllm"])
@pytest.mark.parametrize("vocab", [300, 5000])
def test_every_stage_on_longer_rows(vocab, order):
    xs, rows = batch_of(vocab, 12, seed=vocab, stages=STAGES, order=order)
    params, stats, bitmask = fastsample_args(rows, vocab, "tensor")
    x = torch.tensor(xs, dtype=torch.float32)
    got = fs.process_step(x, params, state=stats, token_bitmask=bitmask)
    assert_close_support(got, expected(xs, rows), f"V={vocab} {order}")
    # The draws come from that distribution: never outside its support.
    out = fs.sample_step(x, params=params, state=stats, token_bitmask=bitmask)
    support = got.gather(1, out.token_ids)
    assert ((support > 0) | ~out.valid[:, None]).all()


def test_stages_off_leave_sample_bitwise_unchanged():
    """With no stage on, the step reads the logits themselves: ``sample_step`` with empty
    parameters draws bitwise what ``sample`` draws, and penalties of 1/0/0 are off."""
    x = torch.randn(8, 500)
    seed = torch.arange(8)
    plain = fs.sample(x, temperature=0.7, top_k=40, seed=seed, top_logprobs=2)
    params = fs.StepParams(8, 500, temperature=0.7, top_k=40, seed=seed, top_logprobs=2,
                           repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0)
    assert not params.edits_logits
    stepped = fs.sample_step(x, params=params, step=0)
    for a, b in zip(plain, stepped, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
