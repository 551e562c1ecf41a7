"""The final draw (fastsample.verify.draw), through verify_chain: a negative control on
its renormalization, the law of the blocked inverse CDF over several blocks, row pieces at
full vocabulary, and half-precision inputs."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import fastsample as fs
from fastsample.ops import inverse_cdf
from fastsample.verify import draw as draw_mod
from stattests import LawCase, assert_law
from verify_helpers import (
    CHAIN_DRAWS,
    LAW_KIND,
    chain_rounds,
    draw_from,
    drawn_laws_rejected,
    one_thread,
    random_chain_batch,
)


def test_chain_control_residual_not_renormalized(models, monkeypatch):
    """An inverse CDF over the residual without dividing by its mass (``u`` against the raw
    prefix, overflow clamped to the last token) is caught by the law test of
    test_chain.test_chain_law_with_draft_probs at its size (uniforms from a generator: the
    bug is in the draw)."""
    real = draw_mod.pick

    def unnormalized(sums, uniform, vocab, values_of):
        total = sums.sum(-1, keepdim=True)
        return real(sums, uniform.clamp(max=1.0) / total.clamp(min=1e-300), vocab, values_of)

    model = models(LAW_KIND)
    monkeypatch.setattr(draw_mod, "pick", unnormalized)
    assert drawn_laws_rejected(model, CHAIN_DRAWS, chain_rounds(model, seed=5, seeded=False))


# ---------------------------------------------------------------------------- several blocks

# The blocked draw over several blocks at full power: blocks of SMALL_BLOCK entries instead
# of inverse_cdf.BLOCK (256), the same code, so V = 40 has two full blocks and a short one
# and BLOCK_DRAWS requests detect a 2% bias on 10% of the mass (stattests.draws_needed:
# 4.06M) at about a tenth of V = 1,000's cost per request. The law at the real block size is
# judged on V = 1,000 with fewer draws (carried by the small-block test).
SMALL_BLOCK = 16
BLOCK_VOCAB = 40
BLOCK_DRAWS = 4_100_000
BLOCK_CLAIM = 0.02
REAL_BLOCK_VOCAB = 1000  # three full blocks of 256 and a short one
REAL_BLOCK_DRAWS = 40_000
REAL_BLOCK_CLAIM = 0.25
CHUNK = 32_768


@functools.cache
def block_case(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target ``p`` and a draft ``q`` over ``vocab`` tokens (float64), each with about 30%
    zero weights."""
    gen = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, 0)
    q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, 0)
    p[torch.rand(vocab, generator=gen) < 0.3] = 0
    q[torch.rand(vocab, generator=gen) < 0.3] = 0
    return p / p.sum(), q / q.sum()


def block_law(vocab: int) -> np.ndarray:
    """The law of the first emitted token: the target, as rounded to float32 for the call."""
    return block_case(vocab)[0].float().double().numpy()


def law_cases():
    """The laws this module judges, with their sizes (tests/test_power.py checks them)."""
    yield LawCase(
        f"chain residual, blocks of {SMALL_BLOCK}, V={BLOCK_VOCAB}: first token",
        functools.partial(block_law, BLOCK_VOCAB),
        BLOCK_DRAWS,
        BLOCK_CLAIM,
    )
    yield LawCase(
        f"chain residual, blocks of 256, V={REAL_BLOCK_VOCAB}: first token",
        functools.partial(block_law, REAL_BLOCK_VOCAB),
        REAL_BLOCK_DRAWS,
        REAL_BLOCK_CLAIM,
        carried_by="the same code with blocks of 16 at full power: "
        "test_chain_first_token_law_over_several_blocks",
    )


@one_thread()
def first_token_counts(vocab: int, draws: int) -> np.ndarray:
    """First emitted tokens of one-draft chains: the draft drawn from ``q``, the target ``p``
    at the draft's position (a uniform bonus row after it), uniforms from a generator."""
    p, q = block_case(vocab)
    gen = torch.Generator().manual_seed(8)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for start in range(0, draws, CHUNK):
        size = min(CHUNK, draws - start)
        draft = draw_from(q.expand(size, -1), gen)[:, None]
        target = torch.stack((p, torch.full_like(p, 1 / vocab))).float().expand(size, 2, vocab)
        out = fs.verify_chain(
            target.contiguous(),
            draft,
            q.float().expand(size, 1, vocab).contiguous(),
            generator=gen,
        )
        assert bool(out.valid.all())
        counts += torch.bincount(out.token_ids[:, 0], minlength=vocab)
    return counts.numpy()


def test_chain_first_token_law_over_several_blocks(monkeypatch):
    """The residual goes through the blocked draw (block sums, the block picked, the scan of
    one block); zero weights on both sides. (The point-draft draw removes the rejected token
    with the same blocked draw; one full-power test of the blocked draw fits the budget.)"""
    monkeypatch.setattr(inverse_cdf, "BLOCK", SMALL_BLOCK)
    monkeypatch.setattr(draw_mod, "BLOCK", SMALL_BLOCK)
    assert inverse_cdf.block_sums(torch.ones(1, BLOCK_VOCAB)).tolist() == [[16.0, 16.0, 8.0]]
    counts = first_token_counts(BLOCK_VOCAB, BLOCK_DRAWS)
    assert_law(counts, block_law(BLOCK_VOCAB), what=f"chain V={BLOCK_VOCAB}, blocks of 16")


def test_chain_first_token_law_at_the_real_block_size():
    """V = 1,000 at the real block size (three full blocks of 256 and a short one): 40k
    draws detect a 25% bias; the full-power law of this code is the small-block test's."""
    counts = first_token_counts(REAL_BLOCK_VOCAB, REAL_BLOCK_DRAWS)
    assert_law(counts, block_law(REAL_BLOCK_VOCAB), what=f"chain V={REAL_BLOCK_VOCAB}")


# ---------------------------------------------------------------------------- full vocabulary


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
