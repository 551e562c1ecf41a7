"""The final draw (fastsample.verify.draw), through verify_chain: a negative control on
its renormalization, the blocked inverse CDF over several blocks, row pieces at full
vocabulary, and half-precision inputs."""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
from fastsample.verify import draw as draw_mod
from stattests import assert_law
from verify_helpers import CHAIN_BATCH, chain_trial, laws_rejected, random_chain_batch


def test_chain_control_residual_not_renormalized(models, monkeypatch):
    """An inverse CDF over the residual without dividing by its mass (``u`` against the raw
    prefix, overflow clamped to the last token) is caught."""
    real = draw_mod.pick

    def unnormalized(sums, uniform, vocab, values_of):
        total = sums.sum(-1, keepdim=True)
        return real(sums, uniform.clamp(max=1.0) / total.clamp(min=1e-300), vocab, values_of)

    model = models("random")
    monkeypatch.setattr(draw_mod, "pick", unnormalized)
    first, joint = laws_rejected(model, chain_trial(model, CHAIN_BATCH, seed=5))
    assert first and joint


# ---------------------------------------------------------------------------- large vocabulary


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_first_token_law_over_several_blocks(with_probs):
    """V = 1000 (three full blocks and a short one): the residual and the point-mass removal
    go through the blocked draw; zero weights included on both sides."""
    from stattests import binned

    gen = torch.Generator().manual_seed(8)
    vocab, total = 1000, 40_000
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, 0)
    q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, 0)
    p[torch.rand(vocab, generator=gen) < 0.3] = 0
    q[torch.rand(vocab, generator=gen) < 0.3] = 0
    p, q = p / p.sum(), q / q.sum()
    counts = torch.zeros(vocab, dtype=torch.int64)
    chunk = 10_000
    for start in range(0, total, chunk):
        draft = torch.multinomial(q.expand(chunk, -1), 1, generator=gen)
        target = torch.stack((p, torch.full_like(p, 1 / vocab))).float().expand(chunk, 2, vocab)
        out = fs.verify_chain(
            target.contiguous(),
            draft,
            q.float().expand(chunk, 1, vocab).contiguous() if with_probs else None,
            seed=torch.arange(chunk) + start,
        )
        assert bool(out.valid.all())
        counts += torch.bincount(out.token_ids[:, 0], minlength=vocab)
    exact = p.float().double().numpy()
    assert_law(*binned(counts.numpy(), exact, num_bins=40), what="chain V=1000")


def test_chain_batch_invariance_at_full_vocabulary():
    """Rows are gathered and reduced in pieces of 8 at V = 128,256: a row's result does not
    depend on the piece it lands in."""
    target, tokens, draft = random_chain_batch(11, 2, 128_256, seed=3)
    seeds = torch.arange(11) * 7
    full = fs.verify_chain(target, tokens, draft, seed=seeds)
    for row in (0, 7, 8, 10):
        sl = slice(row, row + 1)
        alone = fs.verify_chain(target[sl], tokens[sl], draft[sl], seed=seeds[sl])
        assert torch.equal(alone.token_ids, full.token_ids[sl])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_its_float32_copy(dtype):
    target, tokens, draft = random_chain_batch(200, 3, 700, seed=4, dtype=dtype)
    seeds = torch.arange(200)
    half = fs.verify_chain(target, tokens, draft, seed=seeds)
    wide = fs.verify_chain(target.float(), tokens, draft.float(), seed=seeds)
    assert torch.equal(half.token_ids, wide.token_ids) and bool(half.valid.all())
