"""The blocked inverse CDF: one read pass and one uniform per row per draw.

Algorithm, for one row of weights ``p`` (length ``V``) split into blocks of ``BLOCK``:

1. Block sums ``S_j`` (one read pass; float32 accumulation, float64 for float64 input) and
   their float64 inclusive prefix ``P_j``; ``total = P_last``.
2. One float64 uniform ``u`` (53 random bits); ``t = u * total``. The chosen block is the
   first ``j`` with ``P_j > t``, found by counting ``P_j <= t`` (a reduction, no search).
3. Inside block ``j`` only: gather its ``BLOCK`` weights, float64 prefix ``c``, rescale the
   leftover ``t - P_{j-1}`` from ``S_j`` to ``c_last``, and pick the first ``c_i >`` it.

Why exact: step 2 picks block ``j`` with probability ``S_j / total``; the leftover is
uniform on ``[0, S_j)`` given ``j``, so step 3 picks entry ``i`` with probability
``p_i / S_j``. The strict ``>`` means a zero weight is never chosen (its prefix equals its
predecessor's), and both searches are clamped to the last positive block/entry so that a
rounding of ``t`` up to the total cannot step past it. The only approximation is the
float32 rounding of the block sums (relative ~1e-7), far below what any test can see.
The float64 prefix over blocks resolves far-tail mass that a flat float32 cumsum over a
128k vocabulary would lose.

Several draws without replacement (Plackett-Luce, the same law as the race) repeat steps
2-3 with the drawn entries removed: the drawn token is zeroed in its block, that block's
sum is recomputed exactly from its remaining entries, and the small block prefix is redone.
Each extra draw touches ``O(n_blocks + BLOCK)`` values, never the whole row again.

Memory: the block sums and one gathered block per row, under 1% of a 128k-vocabulary input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .noise import UniformSource

BLOCK = 1024
"""Entries per block. Vocabulary shards that start on a multiple of BLOCK see the same
blocks as the full vocabulary (the vocab-parallel sampler relies on this)."""


def block_sums(probs: Tensor) -> Tensor:
    """``(B, ceil(V / BLOCK))`` float64 sums of consecutive blocks, without copying ``probs``.

    Accumulates in float32 (float64 for float64 input): a float64 accumulator costs ~25x
    more on CPU, and float32 sums of non-negative numbers are accurate to ~1e-7 relative.
    """
    batch, vocab = probs.shape
    acc = torch.float64 if probs.dtype == torch.float64 else torch.float32
    full = vocab // BLOCK
    # The full blocks are a (B, full, BLOCK) view of the row-major rows: no copy.
    parts = [probs[:, : full * BLOCK].reshape(batch, full, BLOCK).sum(-1, dtype=acc)]
    if vocab % BLOCK:
        parts.append(probs[:, full * BLOCK :].sum(-1, keepdim=True, dtype=acc))
    return torch.cat(parts, dim=1).to(torch.float64)


def _last_positive(values: Tensor) -> Tensor:
    """Index of the last positive entry along dim 1 (0 when there is none)."""
    positions = torch.arange(values.shape[1], device=values.device)
    return torch.where(values > 0, positions, 0).amax(-1)


def inverse_cdf_draw(
    probs: Tensor, num_samples: int, source: UniformSource, sums: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Ordered draws without replacement by the blocked inverse CDF.

    Args:
        probs: ``(B, V)`` non-negative weights, any float dtype; rows need not sum to 1.
        num_samples: ``n``, static, ``1 <= n <= V``.
        source: uniforms; ``row_uniforms(n)`` is consumed once.
        sums: precomputed :func:`block_sums` (to reuse a pass), or None.

    Returns:
        ``token_ids (B, n) int64``, ``genuine (B, n) bool`` (as in
        :func:`fastsample.race.race_draw`: later slots of a row that ran out of positive
        weights repeat its last genuine draw) and ``total (B,) float64``, the row's weight.
    """
    batch, vocab = probs.shape
    device = probs.device
    if sums is None:
        sums = block_sums(probs)
    # Rows whose sums are not finite positive numbers are invalid and get replaced by the
    # caller; give them harmless sums so their arithmetic stays in range.
    total = sums.sum(-1)
    usable = torch.isfinite(total) & (total > 0)
    sums = torch.where(usable[:, None], sums, 1.0)

    uniforms = source.row_uniforms(num_samples)
    offsets = torch.arange(BLOCK, device=device)
    zero = torch.zeros((batch, 1), dtype=torch.float64, device=device)
    token_ids: list[Tensor] = []
    genuine: list[Tensor] = []
    for k in range(num_samples):
        prefix = sums.cumsum(-1)
        remaining = prefix[:, -1]
        target = uniforms[:, k] * remaining
        block = torch.minimum((prefix <= target[:, None]).sum(-1), _last_positive(sums))
        before = torch.cat([zero, prefix[:, :-1]], dim=1).gather(1, block[:, None])[:, 0]
        block_sum = sums.gather(1, block[:, None])[:, 0]
        fraction = torch.where(block_sum > 0, (target - before) / block_sum, 0.0)

        columns = block[:, None] * BLOCK + offsets
        values = probs.gather(1, columns.clamp(max=vocab - 1)).to(torch.float64)
        values = torch.where(columns < vocab, values, 0.0)
        if token_ids:
            drawn = torch.stack(token_ids, dim=1)
            already = (columns[:, :, None] == drawn[:, None, :]).any(-1)
            values = torch.where(already, 0.0, values)
        within = values.cumsum(-1)
        inner_target = fraction * within[:, -1]
        inner = torch.minimum((within <= inner_target[:, None]).sum(-1), _last_positive(values))

        token = block * BLOCK + inner
        is_genuine = remaining > 0
        if token_ids:  # a row that ran out repeats its previous draw
            token = torch.where(is_genuine, token, token_ids[-1])
        token_ids.append(token)
        genuine.append(is_genuine)
        if k + 1 < num_samples:
            # Remove the drawn entry: recompute its block's sum exactly from what is left,
            # so a block whose last positive entry was drawn becomes exactly 0.
            left = torch.where(offsets == inner[:, None], 0.0, values).sum(-1)
            left = torch.where(is_genuine, left, 0.0)
            sums = sums.scatter(1, block[:, None], left[:, None])
    return torch.stack(token_ids, dim=1), torch.stack(genuine, dim=1), total
