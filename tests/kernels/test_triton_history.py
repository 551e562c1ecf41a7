"""The history stages on the Triton backend (:mod:`fastsample.kernels.history`, inside the
stages kernel) against the torch path's :mod:`fastsample.stages.history`, the reference.

Run on CPU tensors through Triton's interpreter at small sizes, on contexts built to repeat
(periodic runs, a repeated phrase) so that DRY and the n-gram ban fire with long matches:

* ``staged_logits`` equals the torch path's for each stage alone and all together: windowed
  penalties (a window, ``-1``, a ``(B,)`` window with rows at 0 that keep the output
  penalties), DRY (multiplier, base, allowed length and window as numbers and tensors,
  single- and multi-token sequence breakers, a base whose exponent hits llama.cpp's cap, an
  allowed length of 0 where the window's first token is left out),
  no-repeat n-grams (``n`` = 1, 2, 3 and a tensor with an off row); the removed tokens exactly,
  the penalized values up to the last ulp of ``pow`` (numpy's ``exp``/``log`` in the
  interpreter against torch's ``pow``);
* with drafts appended (``extra``, speculative verification) and rows mapped to state rows;
* ``sample_step`` with every stage of the step (history, chain, masks, penalties, logprobs)
  draws the torch path's tokens in 3 launches; a context longer than
  :data:`~fastsample.kernels.history.MAX_CONTEXT` takes the torch ops, with the same tokens;
* out-of-range tensor settings flag their row and leave the others bitwise unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import fastsample as fs
from fastsample.kernels.history import MAX_CONTEXT
from fastsample.kernels.philox import INTERPRETED
from fastsample.stages import staged_logits
from fastsample.tools.bench.launches import device_work

pytestmark = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors need the interpreter (TRITON_INTERPRET=1)"
)

BATCH, VOCAB, WIDTH = 4, 60, 48


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv("FASTSAMPLE_BACKEND", name)

    return use


def _contexts(width: int = WIDTH) -> tuple[list[list[int]], list[int]]:
    """Four prompts that repeat and each one's next token, which continues the repeat: a
    2-token cycle longer than the history (matches run to its start), a phrase holding a
    breaker (5) said over and over, random tokens whose first half comes back, and a short
    one whose first token comes only once."""
    gen = torch.Generator().manual_seed(5)
    phrase = [11, 12, 13, 5, 14, 15, 16]
    noise = torch.randint(17, VOCAB, (width // 2,), generator=gen).tolist()
    prompts = [
        [7, 8] * width,
        (phrase * width)[: width + 3],
        noise + noise[: width // 4],
        [3, 4, 9, 4, 9, 4],
    ]
    following = [7, phrase[(width + 3) % len(phrase)], noise[width // 4], 9]
    return prompts, following


def _state(width: int = WIDTH, batch: int = BATCH) -> fs.TokenStats:
    prompts, following = _contexts(width)
    stats = fs.TokenStats.from_prompts((prompts * batch)[:batch], vocab=VOCAB, history=width)
    stats.update(torch.tensor((following * batch)[:batch])[:, None])
    return stats


def _logits(seed: int = 0, batch: int = BATCH) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, VOCAB, generator=gen) * 2


def _both_staged(backend, params, stats, **kwargs):
    x = _logits(kwargs.pop("seed", 1), params.batch)
    backend("torch")
    want = staged_logits(x, params=params, state=stats, **kwargs)
    backend("triton")
    got = staged_logits(x, params=params, state=stats, **kwargs)
    return x, want, got


def _assert_same(want, got):
    removed = want == -math.inf
    assert torch.equal(removed, got == -math.inf)
    torch.testing.assert_close(got[~removed], want[~removed], rtol=1e-6, atol=0)


def _rows(*values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


_CASES = {
    "last_n": dict(penalty_last_n=8, repetition_penalty=1.3, frequency_penalty=0.2,
                   presence_penalty=0.4),
    "last_n_whole": dict(penalty_last_n=-1, repetition_penalty=_rows(1.3, 1.1, 0.8, 1.6),
                         frequency_penalty=0.3),
    "last_n_rows": dict(penalty_last_n=_rows(0, 8, -1, 3, dtype=torch.int64),
                        repetition_penalty=_rows(1.3, 1.1, 1.5, 0.9), presence_penalty=0.5),
    "dry": dict(dry_multiplier=0.8),
    "dry_rows": dict(dry_multiplier=_rows(0.8, 0.0, 1.2, 0.5), dry_base=_rows(1.75, 2.0, 1.1, 3.0),
                     dry_allowed_length=_rows(2, 1, 0, 3, dtype=torch.int64),
                     dry_penalty_last_n=_rows(-1, 20, 0, 5, dtype=torch.int64)),
    # Row 1's breaker (14) caps its matches at the 5 tokens after it; row 3's (9, 4) leaves
    # too few after it for any penalty.
    "dry_breakers": dict(dry_multiplier=0.8, dry_penalty_last_n=30,
                         dry_sequence_breakers=[[[5]], [[14]], [], [[9, 4], [7]]]),
    # Allowed length 0: every token of the window but the first (which extends nothing).
    "dry_zero": dict(dry_multiplier=0.5, dry_allowed_length=0),
    "dry_cap": dict(dry_multiplier=1.0, dry_base=10.0, dry_allowed_length=1),
    "ngram": dict(no_repeat_ngram_size=3),
    "ngram_rows": dict(no_repeat_ngram_size=_rows(1, 2, 3, 0, dtype=torch.int64)),
    "all": dict(penalty_last_n=16, repetition_penalty=1.2, frequency_penalty=0.1,
                dry_multiplier=0.6, dry_sequence_breakers=[[[5]], [[13]], [], []],
                no_repeat_ngram_size=4),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_CASES))
def test_staged_logits_equal_the_torch_paths(backend, case):
    params = fs.StepParams(BATCH, VOCAB, **_CASES[case])
    x, want, got = _both_staged(backend, params, _state())
    _assert_same(want, got)
    assert bool((want != x).any())  # the stage acted


def test_dry_exponent_reaches_the_cap():
    """The ``dry_cap`` case holds matches longer than llama.cpp's cap (38 at base 10): the
    penalty saturates at ``10**38`` instead of overflowing to inf."""
    stats = _state()
    params = fs.StepParams(BATCH, VOCAB, **_CASES["dry_cap"])
    edited = staged_logits(_logits(1), params=params, state=stats)
    assert bool((edited < -1e37).any()) and bool(torch.isfinite(edited).all())


@pytest.mark.parametrize("case", ["all", "dry_breakers", "last_n_rows"])
def test_with_drafts_and_state_rows(backend, case):
    """Verification rows: each reads its state row (``state_rows``) and counts its drafts
    (``extra``, -1-padded) as the context's latest tokens."""
    stats = _state()
    rows = torch.tensor([2, 0, 1, 3, 2, 1])
    extra = torch.tensor([[1, 2, 3], [7, 8, -1], [-1, -1, -1], [4, 9, 4], [12, 13, 5],
                          [11, 12, 13]])  # fmt: skip
    settings = {}
    for name, value in _CASES[case].items():
        if isinstance(value, torch.Tensor):
            value = value[torch.tensor([0, 1, 2, 3, 0, 1])]
        elif name == "dry_sequence_breakers":
            value = [value[i] for i in (0, 1, 2, 3, 0, 1)]
        settings[name] = value
    params = fs.StepParams(6, VOCAB, **settings)
    _, want, got = _both_staged(backend, params, stats, state_rows=rows, extra=extra)
    _assert_same(want, got)


def _every_stage(batch: int, stats_width: int) -> dict:
    gen = torch.Generator().manual_seed(2)
    return dict(
        temperature=_rows(0.8, 1.2, 0.0, 0.6), top_k=30, top_p=_rows(0.9, 0.95, 0.8, 1.0),
        min_p=0.01, typical_p=0.97, top_n_sigma=2.5, xtc_probability=_rows(0.5, 1.0, 0.0, 0.7),
        dynatemp_range=0.2, mirostat_tau=_rows(5.0, 0.0, 4.0, 6.0),
        repetition_penalty=_rows(1.2, 1.1, 1.3, 0.9), frequency_penalty=0.1,
        penalty_last_n=_rows(0, 16, -1, 4, dtype=torch.int64), dry_multiplier=0.7,
        dry_sequence_breakers=[[[5]], [[13]], [], [[9, 4]]], no_repeat_ngram_size=3,
        logit_bias=(torch.randint(0, VOCAB, (batch, 3), generator=gen),
                    torch.randn(batch, 3, generator=gen)),
        min_tokens=2, stop_token_ids=torch.tensor([[0, 1]] * batch),
        seed=torch.arange(batch) + 30, top_logprobs=3, token_ranks=True,
        logprob_token_ids=torch.randint(0, VOCAB, (batch, 2), generator=gen),
    )  # fmt: skip


def test_sample_step_with_every_stage_is_three_launches(backend):
    params = fs.StepParams(BATCH, VOCAB, order="llama.cpp", **_every_stage(BATCH, WIDTH))
    stats, steps = _state(), torch.arange(BATCH) + 3
    x = _logits(4)
    backend("torch")
    theirs = fs.sample_step(x, params=params, state=stats, step=steps)
    backend("triton")
    ours = fs.sample_step(x, params=params, state=stats, step=steps)
    work = device_work(lambda: fs.sample_step(x, params=params, state=stats, step=steps))
    assert work.kernels == 3 and work.total <= 3, (work.total, work.names)
    assert torch.equal(ours.token_ids, theirs.token_ids)
    assert torch.equal(ours.valid, theirs.valid) and bool(ours.valid.all())
    assert torch.equal(ours.ranks, theirs.ranks)
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, rtol=0, atol=1e-6)


def test_a_context_past_the_tile_takes_the_torch_ops(backend):
    width = MAX_CONTEXT + 4
    stats = fs.TokenStats.from_prompts([[1, 2] * (width // 2)] * 2, vocab=VOCAB, history=width)
    params = fs.StepParams(2, VOCAB, dry_multiplier=0.8, no_repeat_ngram_size=3,
                           seed=torch.arange(2))  # fmt: skip
    x = _logits(5, 2)
    backend("torch")
    theirs = fs.sample_step(x, params=params, state=stats, step=1)
    backend("triton")
    work = device_work(lambda: fs.sample_step(x, params=params, state=stats, step=1))
    assert work.kernels < work.total  # the history's torch ops, then the controls kernels
    ours = fs.sample_step(x, params=params, state=stats, step=1)
    assert torch.equal(ours.token_ids, theirs.token_ids)


def test_bad_settings_flag_their_row_only(backend):
    """A DRY base below 1, a negative allowed length and an n-gram size below 0 (tensors) flag
    their rows; every other row draws as it does alone."""
    stats = _state()
    params = fs.StepParams(
        BATCH, VOCAB, dry_multiplier=0.8, dry_base=_rows(1.75, 0.5, 1.75, 1.75),
        dry_allowed_length=_rows(2, 2, -1, 2, dtype=torch.int64),
        no_repeat_ngram_size=_rows(3, 3, 3, -2, dtype=torch.int64), seed=torch.arange(BATCH),
    )  # fmt: skip
    backend("triton")
    x = _logits(6)
    out = fs.sample_step(x, params=params, state=stats, step=2)
    assert out.valid.tolist() == [True, False, False, False]
    assert bool(((out.token_ids >= 0) & (out.token_ids < VOCAB)).all())
    alone = fs.StepParams(1, VOCAB, dry_multiplier=0.8, no_repeat_ngram_size=3,
                          seed=torch.tensor([0]))  # fmt: skip
    single = fs.sample_step(x[:1], params=alone, state=stats.select(torch.tensor([0])), step=2)
    assert torch.equal(out.token_ids[0], single.token_ids[0])
    assert torch.equal(out.logprobs[0], single.logprobs[0])
