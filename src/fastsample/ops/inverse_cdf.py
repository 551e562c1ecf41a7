"""The blocked inverse CDF: one read pass and one uniform per row per draw.

Algorithm, for one row of weights ``p`` (length ``V``) split into blocks of ``BLOCK``:

1. Block sums ``S_j`` (one read pass; float32 accumulation, float64 for float64 input) and
   their float64 inclusive prefix ``P_j``; ``total = P_last``.
2. One float64 uniform ``u`` (53 random bits); ``t = u * total``. The chosen block is the
   first ``j`` with ``P_j > t``: a batched binary search over the sorted prefix.
3. Inside block ``j`` only: gather its ``BLOCK`` weights, float64 prefix ``c``, rescale the
   leftover ``t - P_{j-1}`` from ``S_j`` to ``c_last``, and pick the first ``c_i >`` it.

Why exact: step 2 picks block ``j`` with probability ``S_j / total``; the leftover is
uniform on ``[0, S_j)`` given ``j``, so step 3 picks entry ``i`` with probability
``p_i / S_j``. The strict ``>`` means a zero weight is never chosen (its prefix equals its
predecessor's), and both targets are kept strictly below their totals (``nextafter``), so
a rounding of ``t`` up to the total cannot step past the last positive block or entry.
The only approximation is the float32 rounding of the block sums (relative ~1e-7), far
below what any test can see.
The float64 prefix over blocks resolves far-tail mass that a flat float32 cumsum over a
128k vocabulary would lose.

Several draws without replacement (Plackett-Luce, the same law as the race) repeat steps
2-3 with the drawn entries removed: the drawn token is zeroed in its block, that block's
sum is recomputed exactly from its remaining entries, and the small block prefix is redone.
Each extra draw touches ``O(n_blocks + BLOCK)`` values, never the whole row again.

Memory: the block sums and one gathered block per row, ~3% of a 128k-vocabulary float32
input; half-precision input is widened to float32 a few rows at a time (2 MiB pieces).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .noise import UniformSource

BLOCK = 256
"""Entries per block. Vocabulary shards that start on a multiple of BLOCK see the same
blocks as the full vocabulary (the vocab-parallel sampler relies on this)."""

BLOCK_SHIFT = BLOCK.bit_length() - 1
"""``log2(BLOCK)``: an id's block is ``id >> BLOCK_SHIFT``, its place ``id & (BLOCK - 1)``
(vectorized shifts and masks where torch's int64 ``//`` and ``%`` are scalar)."""
assert BLOCK == 1 << BLOCK_SHIFT


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
    sums = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return sums.to(torch.float64)


# float16/bfloat16 rows are widened to float32 this many elements at a time (2 MiB): torch's
# CPU sum(dtype=float32) and amin on half types would otherwise copy the whole input to
# float32 (+200% memory) and run slower than converting cache-sized pieces.
HALF_CHUNK_ELEMENTS = 1 << 19


def row_summaries(probs: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`block_sums` and the per-row minimum (NaN if the row has one), in one helper.

    Half-precision rows are processed a few rows at a time in float32, so both reductions
    read a cache-resident copy; each row's results are the same whatever rows share its piece.
    """
    if probs.dtype in (torch.float32, torch.float64):
        return block_sums(probs), probs.amin(-1)
    rows = max(1, HALF_CHUNK_ELEMENTS // probs.shape[1])
    sums, smallest = [], []
    for start in range(0, probs.shape[0], rows):
        piece = probs[start : start + rows].float()
        sums.append(block_sums(piece))
        smallest.append(piece.amin(-1))
    if not sums:  # an empty batch
        return block_sums(probs.float()), probs.float().amin(-1)
    return torch.cat(sums), torch.cat(smallest)


_CONSTANTS: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}


def _constants(width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``arange(width)`` and a float64 zero on ``device``: kept for CPU eager calls (two
    small ops fewer per draw); made anew elsewhere (CUDA graphs, ``torch.compile``)."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return torch.arange(width, device=device), zero
    cached = _CONSTANTS.get((width, device))
    if cached is None:
        with torch.inference_mode(False):  # ordinary tensors, usable in any mode
            cached = (torch.arange(width, device=device), torch.zeros((), dtype=torch.float64))
        _CONSTANTS[(width, device)] = cached
    return cached


def inverse_cdf_draw(
    probs: Tensor,
    num_samples: int,
    source: UniformSource,
    sums: Tensor | None = None,
    read: Callable[[Tensor], Tensor] | None = None,
    weights_out: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Ordered draws without replacement by the blocked inverse CDF.

    Args:
        probs: ``(B, V)`` non-negative weights, any float dtype; rows need not sum to 1.
        num_samples: ``n``, static, ``1 <= n <= V``.
        source: uniforms; ``row_uniforms(n)`` is consumed once.
        sums: precomputed :func:`block_sums` (to reuse a pass), or None.
        read: for weights that are never materialized: ``read(columns)`` returns the
            weights at ``columns`` (``(B, c)`` int64, in range), as ``probs.gather`` would;
            ``probs`` then only gives the shape and device, and ``sums`` is required.
        weights_out: a list to which each draw's ``(B, 1)`` float64 weight of the drawn token is
            appended (as ``probs.gather`` or ``read`` gives it at the returned ids), or None.

    Returns:
        ``token_ids (B, n) int64``, ``genuine (B, n) bool`` (as in
        :func:`fastsample.race.race_draw`: later slots of a row that ran out of positive
        weights repeat its last genuine draw) and ``total (B,) float64``, the row's weight.
        Rows with NaN, inf or negative weights get arbitrary in-range ids (the caller
        replaces them); every index below is clamped, so no value can push one out of range.
    """
    vocab = probs.shape[1]
    device = probs.device
    if sums is None:
        sums = block_sums(probs)
    num_blocks = sums.shape[1]
    total = sums.sum(-1)
    uniforms = source.row_uniforms(num_samples)
    width = min(BLOCK, vocab)  # a vocabulary shorter than a block is one short block
    offsets, floor = _constants(width, device)
    token_ids: list[Tensor] = []
    genuine: list[Tensor] = []
    for k in range(num_samples):
        prefix = sums.cumsum(-1)
        remaining = prefix[:, -1:]
        # Keep the target strictly below the remaining mass: then the first prefix above
        # it ends a block with positive mass, even when u * remaining rounds up.
        target = torch.minimum(uniforms[:, k : k + 1] * remaining, remaining.nextafter(floor))
        # Count of prefixes <= target, by binary search (prefixes of non-negative weights are
        # sorted; for a bad row the search still returns an in-range index).
        block = torch.searchsorted(prefix, target, right=True).clamp_max_(num_blocks - 1)
        block_sum = sums.gather(1, block)
        fraction = ((target - (prefix.gather(1, block) - block_sum)) / block_sum).clamp_(0, 1)

        start = block * BLOCK
        columns = start + offsets
        clamped = columns.clamp_max(vocab - 1)
        values = (probs.gather(1, clamped) if read is None else read(clamped)).to(torch.float64)
        if vocab > BLOCK and vocab % BLOCK:  # a short last block: drop clamped duplicates
            values = values * (columns < vocab)
        if token_ids:
            drawn = torch.cat(token_ids, dim=1)
            values = values * (columns[:, :, None] != drawn[:, None, :]).all(-1)
        within = values.cumsum(-1)
        block_total = within[:, -1:]
        # Same strictness inside the block: the first prefix above the target belongs to a
        # positive weight, so zero weights (and removed draws) are never chosen.
        inner_target = torch.minimum(fraction * block_total, block_total.nextafter(floor))
        inner = torch.searchsorted(within, inner_target, right=True).clamp_max_(width - 1)

        # In range for any input: a valid row never selects past its last positive weight,
        # but a NaN row's search may land in the short last block's padding.
        token = (start + inner).clamp_max_(vocab - 1)
        if weights_out is not None:  # its weight, as read at the (clamped) token
            weights_out.append(values.gather(1, inner))
        is_genuine = remaining > 0
        if token_ids:  # a row that ran out of positive weights repeats its previous draw
            token = torch.where(is_genuine, token, token_ids[-1])
        token_ids.append(token)
        genuine.append(is_genuine)
        if k + 1 < num_samples:
            # Remove the drawn entry: recompute its block's sum exactly from what is left,
            # so a block whose last positive entry was drawn becomes exactly 0.
            left = values.scatter(1, inner, 0.0).sum(-1, keepdim=True)
            sums = sums.scatter(1, block, left)
    if num_samples == 1:  # skip two concatenations of one piece (per-op cost, small B)
        return token_ids[0], genuine[0], total
    return torch.cat(token_ids, dim=1), torch.cat(genuine, dim=1), total


def kept_block_sums(
    kept: Tensor, block_ids: Tensor, columns: Tensor, blocks: int, width: int
) -> Tensor:
    """``(B, blocks)`` float32 block sums of ``kept`` (``(B, c)`` kept weights of the entries
    at ``columns`` of blocks ``block_ids``; every other entry weighs 0), bitwise the general
    path's: at most two nonzero weights into a zero table (one rounding in any order), a
    block of three or more laid out in a ``BLOCK`` tile and summed as the general path does.
    CPU eager only (the small-top-k host paths): ``nonzero`` sizes the tiles."""
    batch = kept.shape[0]
    zeros = torch.zeros(batch, blocks, dtype=torch.float32, device=kept.device)
    table = zeros.clone().scatter_add_(1, block_ids, kept)
    present = (kept > 0).to(torch.float32)
    crowded = zeros.scatter_add_(1, block_ids, present) >= 3
    rows, crowded_blocks = crowded.nonzero(as_tuple=True)
    if rows.shape[0] == 0:
        return table
    tile_of = torch.full((batch, blocks), -1, dtype=torch.int64, device=kept.device)
    tile_of[rows, crowded_blocks] = torch.arange(rows.shape[0], device=kept.device)
    tile = tile_of.gather(1, block_ids)
    members = (tile >= 0) & (kept > 0)
    tiles = torch.zeros(rows.shape[0], BLOCK, dtype=torch.float32, device=kept.device)
    tiles[tile[members], columns[members]] = kept[members]
    table[rows, crowded_blocks] = tile_sums(tiles, crowded_blocks, width)
    return table


def tile_sums(tiles: Tensor, blocks: Tensor, width: int) -> Tensor:
    """Sums of ``tiles`` (``(..., BLOCK)``, the kept weights of the ``blocks`` of a ``width``
    -wide buffer) as :func:`~fastsample.ops.inverse_cdf.block_sums` sums those blocks: a short
    last block over its own entries only (another reduction order than over ``BLOCK``)."""
    sums = tiles.sum(-1)
    last, tail = divmod(width, BLOCK)
    if tail:
        sums = torch.where(blocks == last, tiles[..., :tail].sum(-1), sums)
    return sums
