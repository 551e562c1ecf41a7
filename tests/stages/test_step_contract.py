"""The samplers' contract, held by the engine step with every stage on.

* No host sync, fixed shapes: ``torch.compile(fullgraph=True)`` takes ``sample_step`` and the
  state update (the dense penalty path), with the eager result's tokens, bitwise.
* The dense and sparse penalty paths give bitwise the same logits.
* Good rows are bitwise unchanged by bad rows (NaN logits, nothing allowed, an out-of-range
  tensor setting of every kind), which get ``valid=False`` and the in-range result.
* Bad Python arguments raise before any work, naming the argument; ``check=True`` raises
  naming the first bad row.
* A seeded request draws the same tokens whatever batch it shares.
"""

from __future__ import annotations

import math

import pytest
import torch

import fastsample as fs
import fastsample.stages.penalties as penalties
from fastsample.stages import staged_logits

V = 300


def full_params(batch: int, **overrides) -> fs.StepParams:
    gen = torch.Generator().manual_seed(batch)
    settings = dict(
        temperature=torch.rand(batch, generator=gen) + 0.3,
        top_k=torch.randint(0, 60, (batch,), generator=gen),
        top_p=torch.rand(batch, generator=gen) * 0.5 + 0.5,
        min_p=torch.rand(batch, generator=gen) * 0.05,
        repetition_penalty=torch.rand(batch, generator=gen) + 0.6,
        frequency_penalty=torch.rand(batch, generator=gen) - 0.5,
        presence_penalty=torch.rand(batch, generator=gen) - 0.5,
        logit_bias=(torch.randint(-1, V, (batch, 4), generator=gen),
                    torch.randn(batch, 4, generator=gen)),
        min_tokens=torch.randint(0, 4, (batch,), generator=gen),
        stop_token_ids=torch.randint(-1, V, (batch, 2), generator=gen),
        allowed_token_ids=torch.randint(-1, V, (batch, 200), generator=gen),
        seed=torch.arange(batch) + 100, top_logprobs=3, token_ranks=True,
        logprob_token_ids=torch.randint(-1, V, (batch, 3), generator=gen),
    )  # fmt: skip
    settings.update(overrides)
    return fs.StepParams(batch, V, **settings)


def full_inputs(batch: int):
    gen = torch.Generator().manual_seed(7 + batch)
    logits = torch.randn(batch, V, generator=gen) * 2
    prompts = torch.randint(-1, V, (batch, 30), generator=gen)
    stats = fs.TokenStats.from_prompts(prompts, V)
    stats.update(torch.randint(-1, V, (batch, 5), generator=gen))
    words = torch.randint(-(2**31), 2**31 - 1, (batch, (V + 31) // 32), dtype=torch.int32,
                          generator=gen)  # fmt: skip
    return logits, stats, words | 0x00FF00FF  # enough allowed tokens per word


def test_compiles_fullgraph_with_every_stage():
    logits, stats, words = full_inputs(6)
    params = full_params(6)
    eager = fs.sample_step(logits, params=params, state=stats, token_bitmask=words, step=2)

    def step(logits, step, words):
        return fs.sample_step(logits, params=params, state=stats, token_bitmask=words, step=step)

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(logits, torch.full((6,), 2), words)
    assert torch.equal(got.token_ids, eager.token_ids) and torch.equal(got.valid, eager.valid)
    assert torch.equal(got.ranks, eager.ranks) and torch.equal(got.top_token_ids,
                                                               eager.top_token_ids)
    torch.testing.assert_close(got.requested_logprobs, eager.requested_logprobs)


def test_dense_and_sparse_penalties_agree_bitwise(monkeypatch):
    logits, stats, _ = full_inputs(8)
    params = full_params(8)
    monkeypatch.setattr(penalties, "SPARSE_FROM", 1)
    sparse = staged_logits(logits, params, state=stats)
    monkeypatch.setattr(penalties, "SPARSE_FROM", 10**9)
    dense = staged_logits(logits, params, state=stats)
    assert torch.equal(sparse, dense)
    # With verification's rows map and extra tokens too.
    rows, extra = torch.tensor([0, 0, 3, 7]), torch.tensor([[5, -1], [5, 5], [9, 1], [-1, -1]])
    p4 = params.repeat_rows(1)  # same settings object for the 4 rows
    got = {}
    for limit in (1, 10**9):
        monkeypatch.setattr(penalties, "SPARSE_FROM", limit)
        x = logits[rows].clone()
        got[limit] = penalties.apply_(x, stats, _take(p4.repetition_penalty, rows),
                                      _take(p4.frequency_penalty, rows),
                                      _take(p4.presence_penalty, rows), rows, extra)  # fmt: skip
    assert torch.equal(got[1], got[10**9])


def test_sparse_penalties_in_row_pieces_agree_with_dense(monkeypatch):
    """Long rows, many seen tokens per row (several bits in some words), rows in several
    pieces under the parallel grain, per-row tensor penalties, a vocabulary that is not a
    multiple of 32, verification's rows map and drafts: the sparse path equals the dense."""
    gen = torch.Generator().manual_seed(4)
    batch, vocab = 40, 40_003
    prompts = torch.randint(0, vocab, (batch, 300), generator=gen)
    prompts[:, :40] = torch.randint(0, 64, (batch, 40), generator=gen)  # crowded words
    prompts[3, 0] = vocab - 1
    outputs = torch.randint(0, vocab, (batch, 100), generator=gen)
    outputs[:, :10] = outputs[:, 10:20]  # repeated output tokens: counts above 1
    stats = fs.TokenStats.from_prompts(prompts, vocab, outputs=outputs)
    x = torch.randn(batch, vocab, generator=gen) * 3
    rep = torch.rand(batch, generator=gen) + 0.5
    freq, pres = torch.randn(batch, generator=gen), 0.25
    rows, extra = torch.tensor([0, 0, 3, 39, 7]), torch.randint(-1, vocab, (5, 3), generator=gen)
    got = {}
    for limit in (1, 10**9):
        monkeypatch.setattr(penalties, "SPARSE_FROM", limit)
        got[limit] = (
            penalties.apply_(x.clone(), stats, rep, freq, pres),
            penalties.apply_(x[rows].clone(), stats, rep[rows], freq[rows], pres, rows, extra),
        )
    for sparse, dense in zip(got[1], got[10**9], strict=True):
        assert torch.equal(sparse, dense)
    assert not torch.equal(got[1][0], x)


def _take(value, rows):
    return value[rows] if isinstance(value, torch.Tensor) else value


BAD = {
    "nan logits": lambda p, x: x.__setitem__(2, math.nan),
    "nothing allowed": lambda p, x: p.__setattr__(
        "allowed_mask", torch.where(torch.arange(8)[:, None] == 2, 0, p.allowed_mask)),
    "repetition <= 0": "repetition_penalty",
    "frequency inf": "frequency_penalty",
    "presence nan": "presence_penalty",
    "bias id out of range": "logit_bias",
    "bias value nan": "logit_bias values",
    "stop id out of range": "stop_token_ids",
    "min_tokens < 0": "min_tokens",
    "allowed id out of range": "allowed_token_ids",
    "requested id out of range": "logprob_token_ids",
    "top_p 1.5": "top_p",
}  # fmt: skip


def _spoiled(kind: str):
    """``(spoiled params, clean params, spoiled logits, clean logits, stats, words)``: row 2
    spoiled by ``kind``, every other setting the same."""
    logits, stats, words = full_inputs(8)
    clean_logits = logits.clone()
    spoil = BAD[kind]
    if callable(spoil):
        params = full_params(8)
        spoil(params, logits)
        return params, full_params(8), logits, clean_logits, stats, words

    def base():
        gen = torch.Generator().manual_seed(8)
        return dict(
            repetition_penalty=torch.rand(8, generator=gen) + 0.6,
            frequency_penalty=torch.rand(8, generator=gen) - 0.5,
            presence_penalty=torch.rand(8, generator=gen) - 0.5,
            logit_bias=(torch.randint(-1, V, (8, 4), generator=gen),
                        torch.randn(8, 4, generator=gen)),
            stop_token_ids=torch.randint(-1, V, (8, 2), generator=gen),
            min_tokens=torch.randint(0, 4, (8,), generator=gen),
            allowed_token_ids=torch.randint(-1, V, (8, 200), generator=gen),
            logprob_token_ids=torch.randint(-1, V, (8, 3), generator=gen),
            top_p=torch.rand(8, generator=gen) * 0.5 + 0.5,
        )  # fmt: skip

    bad_value = {
        "repetition_penalty": 0.0, "frequency_penalty": math.inf, "presence_penalty": math.nan,
        "stop_token_ids": V, "min_tokens": -1, "allowed_token_ids": V + 4,
        "logprob_token_ids": -7, "top_p": 1.5,
    }  # fmt: skip
    bad = base()
    if spoil == "logit_bias":
        bad["logit_bias"][0][2, 1] = V
    elif spoil == "logit_bias values":
        bad["logit_bias"][1][2, 1] = math.nan
    else:
        bad[spoil][2] = bad_value[spoil]
    return full_params(8, **bad), full_params(8, **base()), logits, clean_logits, stats, words


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_rows_are_flagged_and_do_not_touch_good_rows(kind):
    params, clean_params, logits, clean_logits, stats, words = _spoiled(kind)
    got = fs.sample_step(logits, params=params, state=stats, token_bitmask=words, step=1)
    want = fs.sample_step(clean_logits, params=clean_params, state=stats, token_bitmask=words,
                          step=1)  # fmt: skip
    assert not got.valid[2]
    assert got.token_ids[2].tolist() == [0] and got.ranks[2].tolist() == [0]
    assert (got.requested_logprobs[2] == -math.inf).all() and got.probs[2, 0] == 0
    good = [0, 1, 3, 4, 5, 6, 7]
    for field in ("token_ids", "probs", "valid", "logprobs", "top_token_ids", "top_logprobs",
                  "ranks", "requested_logprobs"):  # fmt: skip
        a, b = getattr(got, field)[good], getattr(want, field)[good]
        assert torch.equal(a, b), (kind, field)
    if not callable(BAD[kind]):
        with pytest.raises(ValueError, match=r"row 2|\[2\]"):
            fs.sample_step(logits, params=params, state=stats, token_bitmask=words, step=1,
                           check=True)  # fmt: skip


def test_bad_arguments_raise_naming_them():
    stats = fs.TokenStats.empty(2, V)
    cases = [
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(frequency_penalty=math.inf), "frequency_penalty must be finite"),
        (dict(logit_bias=[{V: 1.0}, None]), r"logit_bias\[0\] holds 300"),
        (dict(logit_bias=[{"a": 1.0}, None]), "keys must be int token ids"),
        (dict(min_tokens=2), "min_tokens and stop_token_ids go together"),
        (dict(min_tokens=-1, stop_token_ids=[[1], [2]]), "min_tokens must be >= 0"),
        (dict(allowed_token_ids=[[], None]), "allowed_token_ids\\[0\\] is empty"),
        (dict(allowed_token_ids=[[1]]), "one entry per row"),
        (dict(logprobs_mode="logits"), "logprobs_mode must be one of"),
        (dict(top_logprobs=V + 1), "top_logprobs must be between 0"),
        (dict(cut_order="x"), "cut_order must be one of"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            fs.StepParams(2, V, **kwargs)
    params = fs.StepParams(2, V, presence_penalty=0.5)
    logits = torch.randn(2, V)
    with pytest.raises(ValueError, match="need state="):
        fs.sample_step(logits, params=params)
    with pytest.raises(ValueError, match="params were built for"):
        fs.sample_step(torch.randn(3, V), params=params, state=stats)
    with pytest.raises(ValueError, match="need logits="):
        fs.sample_step(probs=torch.rand(2, V), params=params, state=stats)
    with pytest.raises(ValueError, match="token_bitmask covers 288 tokens"):
        fs.sample_step(logits, params=params, state=stats,
                       token_bitmask=torch.zeros(2, 9, dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="bitmask_indices holds 5"):
        fs.sample_step(logits, params=params, state=stats, bitmask_indices=[5],
                       token_bitmask=torch.zeros(2, 10, dtype=torch.int32))  # fmt: skip


def test_a_seeded_request_draws_the_same_tokens_in_any_batch():
    logits, stats, words = full_inputs(8)
    params = full_params(8)
    whole = fs.sample_step(logits, params=params, state=stats, token_bitmask=words, step=4)
    order = torch.tensor([5, 2, 7])
    sub = fs.StepParams(3, V, **{
        name: value[order] if isinstance(value, torch.Tensor) else value
        for name, value in dict(
            temperature=params.controls.temperature, top_k=params.controls.top_k,
            top_p=params.controls.top_p, min_p=params.controls.min_p,
            repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
            min_tokens=params.min_tokens, stop_token_ids=params.stop_ids, seed=params.seed,
            logprob_token_ids=params.logprob_token_ids,
        ).items()
    }, logit_bias=(params.bias_ids[order], params.bias_values[order]), top_logprobs=3,
        token_ranks=True)  # fmt: skip
    sub.allowed_mask = params.allowed_mask[order]
    part = fs.sample_step(logits[order], params=sub, state=stats.select(order),
                          token_bitmask=words[order], step=4)  # fmt: skip
    for field in ("token_ids", "probs", "valid", "ranks", "top_token_ids", "requested_logprobs"):
        assert torch.equal(getattr(part, field), getattr(whole, field)[order]), field
