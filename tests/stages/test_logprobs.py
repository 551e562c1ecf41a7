"""Stage f: logprobs in both modes against float64, ranks exact, requested ids.

* ``"processed"``: the drawn tokens' log-probabilities, the top-N and the requested ids equal
  the float64 log of the reference step distribution (tests/stage_reference.py) within 1e-5;
  tokens outside the kept set are ``-inf``.
* ``"raw"``: those of the logits after the allowed-token masks only (``x - logsumexp x``),
  within 1e-5, whatever the later stages (penalties, bias, temperature) did.
* ranks: vLLM's convention (tokens at least as likely, itself included), counted exactly on
  the scores that order each distribution; greedy rows rank their j-th draw j.
* invalid rows: ranks 0, every logprob ``-inf``; padding ids ``-1`` give ``-inf``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_step_exact import batch_of

import fastsample as fs
from stage_reference import Row, fastsample_args, rank_of, raw_logprobs, stage_logits, step_probs

STAGES = ("bitmask", "allowed", "bias", "penalties", "controls")
TOL = 1e-5


def _requested(vocab: int, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, 6), generator=gen)
    ids[:, -1] = -1  # padding
    return ids


@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("form", ["list", "tensor"])
def test_logprobs_ranks_and_requested_ids_match_float64(mode, form):
    vocab, batch = 70, 24
    xs, rows = batch_of(vocab, batch, seed=31 + len(mode) + len(form), stages=STAGES)
    requested = _requested(vocab, batch, 5)
    params, stats, bitmask = fastsample_args(
        rows, vocab, form, top_logprobs=4, logprobs_mode=mode, token_ranks=True,
        logprob_token_ids=requested, seed=torch.arange(batch), num_samples=2,
    )  # fmt: skip
    x = torch.tensor(xs, dtype=torch.float32)
    out = fs.sample_step(x, params=params, state=stats, token_bitmask=bitmask, step=3)
    for b, (row_x, row) in enumerate(zip(xs, rows, strict=True)):
        staged = stage_logits(row_x, row)
        processed = step_probs(row_x, row) if np.isfinite(staged).any() else None
        if processed is None or (processed > 0).sum() < 2:  # nothing (or too little) to draw
            assert not out.valid[b] and (out.ranks[b] == 0).all()
            assert (out.requested_logprobs[b] == -math.inf).all()
            continue
        assert out.valid[b]
        with np.errstate(divide="ignore"):
            want = np.log(processed) if mode == "processed" else raw_logprobs(row_x, row)
        scores = (staged if mode == "processed" else stage_logits(
            row_x, Row(allowed=row.allowed, bitmask_words=row.bitmask_words)))  # fmt: skip
        ids = out.token_ids[b].numpy()
        np.testing.assert_allclose(out.logprobs[b].double().numpy(), want[ids], atol=TOL)
        assert out.ranks[b].tolist() == [rank_of(scores, int(i)) for i in ids]
        top = out.top_token_ids[b].numpy()
        np.testing.assert_allclose(out.top_logprobs[b].double().numpy(), want[top], atol=TOL)
        # The top ids are the most likely (ties may come in either order).
        assert np.allclose(np.sort(want[top])[::-1], np.sort(want)[::-1][:4], atol=TOL)
        asked = requested[b].numpy()
        got = out.requested_logprobs[b].double().numpy()
        np.testing.assert_allclose(got[:-1], want[asked[:-1]], atol=TOL)
        assert got[-1] == -math.inf  # the padding id


def test_processed_probs_stay_the_processed_ones_in_raw_mode():
    """``probs`` is always the drawn token's processed probability; the raw mode changes the
    logprob fields only."""
    vocab = 70
    xs, rows = batch_of(vocab, 12, seed=3, stages=STAGES)
    x = torch.tensor(xs, dtype=torch.float32)
    outs = {}
    for mode in ("processed", "raw"):
        params, stats, bitmask = fastsample_args(rows, vocab, "tensor", logprobs_mode=mode,
                                                 seed=torch.arange(12))  # fmt: skip
        outs[mode] = fs.sample_step(x, params=params, state=stats, token_bitmask=bitmask)
    assert torch.equal(outs["processed"].token_ids, outs["raw"].token_ids)
    assert torch.equal(outs["processed"].probs, outs["raw"].probs)
    ok = outs["raw"].valid
    assert not torch.allclose(outs["processed"].logprobs[ok], outs["raw"].logprobs[ok])


def test_greedy_rows_rank_their_draws_in_order():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.5, 2.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
    params = fs.StepParams(2, 5, temperature=torch.tensor([0.0, 1.0]), num_samples=3,
                           token_ranks=True, seed=0)  # fmt: skip
    out = fs.sample_step(x, params=params, step=0)
    assert out.token_ids[0].tolist() == [1, 2, 4]
    assert out.ranks[0].tolist() == [1, 2, 3]
    # A sampled row counts ties: every token at least as likely.
    ids = out.token_ids[1]
    assert out.ranks[1].tolist() == [int((x[1] >= x[1, i]).sum()) for i in ids]


def test_raw_logprobs_never_build_a_full_log_softmax(monkeypatch):
    """The raw mode's normalizer builds no log_softmax and no (B, V) float64 tensor (its
    softmax goes to a float32 scratch buffer kept between calls, fastsample.ops.scratch)."""
    calls = []
    real = torch.Tensor.to

    def spy(self, *args, **kwargs):
        got = real(self, *args, **kwargs)
        if got.dtype == torch.float64 and got.dim() == 2 and got.shape[1] == 5000:
            calls.append(tuple(got.shape))
        return got

    monkeypatch.setattr(torch.Tensor, "to", spy)
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: pytest.fail("log_softmax"))
    params = fs.StepParams(4, 5000, temperature=0.7, top_logprobs=3, logprobs_mode="raw",
                           token_ranks=True, seed=1)  # fmt: skip
    fs.sample_step(torch.randn(4, 5000), params=params, step=0)
    assert calls == []


def test_ranks_from_the_reaching_blocks_equal_the_compare_pass():
    """CPU eager ranks read only the blocks whose maximum reaches the drawn score: the counts
    equal a compare pass over the row, with ties (integer rows), masked and NaN rows, a short
    last block, values far down a row (too many blocks: the compare pass) and at the top."""
    from fastsample.ops.select import block_maxima
    from fastsample.stages.logprobs import count_at_least

    gen = torch.Generator().manual_seed(9)
    for vocab in (5000, 5120, 40_000):
        x = torch.randn(6, vocab, generator=gen) * 3
        x[1] = torch.randint(-3, 4, (vocab,), generator=gen).float()  # ties everywhere
        x[2, ::2] = -math.inf
        x[3, 7] = math.nan
        ids = torch.stack([torch.randint(0, vocab, (6,), generator=gen), x.argmax(-1),
                           x.topk(20, -1).indices[:, -1]], 1)  # fmt: skip
        values = x.gather(1, ids)
        want = torch.stack([(x >= values[:, j : j + 1]).sum(-1) for j in range(3)], 1)
        got = count_at_least(x, values, block_maxima(x))
        assert torch.equal(got, want)
        clean = x[[0, 2, 4, 5]]
        top = clean.gather(1, clean.topk(3, -1).indices)
        want = torch.stack([(clean >= top[:, j : j + 1]).sum(-1) for j in range(3)], 1)
        assert torch.equal(count_at_least(clean, top, block_maxima(clean)), want)


@pytest.mark.parametrize("serial", ["0", "1"])
def test_raw_normalizer_is_the_float64_logsumexp(monkeypatch, serial):
    """The raw mode's normalizer (the row maximum, the softmax at it and its mass) is the
    float64 logsumexp within 2e-7 on vocabulary-sized rows, and the same bits one row at a
    time in pieces (the small-batch, serial way) as for the batch in one op."""
    from fastsample.stages.logprobs import raw_normalizer

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 128_256, generator=gen) * torch.tensor([3.0, 0.1, 10.0, 1.0, 30.0])[:, None]
    x[3, 1000:] = -math.inf  # a masked row
    monkeypatch.setenv("FASTSAMPLE_CPU_SERIAL", serial)
    got = raw_normalizer(x, True).log_total
    want = torch.logsumexp(x.double(), -1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-7)
    monkeypatch.setenv("FASTSAMPLE_CPU_SERIAL", "1" if serial == "0" else "0")
    assert torch.equal(raw_normalizer(x, True).log_total, got)
