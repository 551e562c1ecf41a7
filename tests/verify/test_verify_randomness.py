"""Verification's randomness (fastsample.verify.randomness): stream and counter layout,
reproducibility, and argument errors raised before any random draw."""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
import fastsample.ops.seeds
from fastsample.verify import randomness
from verify_helpers import P3, Q2, X2, random_chain_batch


def test_uniform_streams_and_counters():
    source = randomness.random_source(None, torch.arange(5), 9, 5, torch.device("cpu"))
    a4, r4, b4 = randomness.uniforms(source, 5, 4)
    a9, r9, b9 = randomness.uniforms(source, 5, 20_000 // 5 + 1)  # the two-call layout
    assert torch.equal(a9[:, :4], a4) and torch.equal(r9, r4) and torch.equal(b9, b4)
    for stream, u in ((fs.Stream.ACCEPT, a4), (fs.Stream.RECOVERY, r4), (fs.Stream.BONUS, b4)):
        direct = fastsample.ops.seeds.CounterSource(
            torch.arange(5), torch.full((5,), 9), torch.full((5,), stream)
        )
        assert torch.equal(direct.row_uniforms(u.shape[1]), u)


def test_generator_and_seed_reproducibility():
    target, tokens, draft = random_chain_batch(64, 4, 30)
    runs = [
        fs.verify_chain(target, tokens, draft, generator=torch.Generator().manual_seed(5))
        for _ in range(2)
    ]
    assert torch.equal(runs[0].token_ids, runs[1].token_ids)
    a = fs.verify_chain(target, tokens, draft, seed=torch.arange(64), step=0).token_ids
    b = fs.verify_chain(target, tokens, draft, seed=torch.arange(64), step=1).token_ids
    assert torch.equal(a, fs.verify_chain(target, tokens, draft, seed=torch.arange(64)).token_ids)
    assert not torch.equal(a, b)


def test_errors_come_before_any_random_draw():
    gen = torch.Generator().manual_seed(3)
    want = fs.verify_chain(P3, X2, Q2, generator=gen).token_ids
    gen.manual_seed(3)
    with pytest.raises(ValueError):
        fs.verify_chain(P3, X2 + 9, Q2, generator=gen, check=True)
    with pytest.raises(ValueError):
        fs.verify_tree(P3, fs.TokenTree(X2.repeat(1, 2)[:, :3], [-1, 0, 2]), generator=gen)
    assert torch.equal(fs.verify_chain(P3, X2, Q2, generator=gen).token_ids, want)
