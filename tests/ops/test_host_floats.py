"""The Python-float draw of a few rows (fastsample.ops.host_floats) against the blocked
inverse CDF on the dense weights (ops/inverse_cdf.py), uniform by uniform.

host_floats.draw_one never reads the logits again: the chosen block's prefix comes from its
kept entries. These tests give it rows whose blocks hold one, two or more kept weights
(neighbours, the block's first and last columns, a short last block; three or more are
summed by torch) and uniforms on every boundary (0, each block's prefix over the total, each
entry's prefix inside its block, just below 1) plus random ones, and require the same token
and weight as ``inverse_cdf_draw``.
"""

from __future__ import annotations

import math
import random

import torch

from fastsample.ops import host_floats
from fastsample.ops.inverse_cdf import BLOCK, inverse_cdf_draw
from uniforms import BELOW_ONE, ControlledUniforms


def _row(rng: random.Random, width: int) -> dict[int, float]:
    """Kept weights by column: 1-2 per chosen block (sometimes 3-6), at edges and neighbours
    too."""
    blocks = -(-width // BLOCK)
    kept: dict[int, float] = {}
    for block in rng.sample(range(blocks), min(blocks, rng.randint(1, 12))):
        size = min(BLOCK, width - block * BLOCK)
        first = rng.choice([0, size - 1, rng.randrange(size)])
        columns = {first}
        if rng.random() < 0.5 and size > 1:
            columns.add(rng.choice([first - 1 if first else first + 1, rng.randrange(size)]))
        if rng.random() < 0.3:  # a crowded block
            columns.update(rng.randrange(size) for _ in range(rng.randint(2, 5)))
        for column in columns:
            weight = rng.choice([1.0, 0.5, 0.25, rng.random(), rng.random() * 1e-6])
            kept[block * BLOCK + column] = torch.tensor(max(weight, 1e-30)).float().item()
    return kept


def _boundaries(blocks: list[host_floats.Block]) -> list[float]:
    """Uniforms at the boundaries the draw decides on, as float64 quotients by the total."""
    total = sum(block.total for block in blocks)
    out, running = [0.0, BELOW_ONE, 0.5], 0.0
    for block in blocks:
        inner = running
        for _, weight in block.entries:
            inner += weight
            out.append(min(inner / total, BELOW_ONE))
        running += block.total
        out.append(min(running / total, BELOW_ONE))
    return out


def _reference(kept: dict[int, float], width: int, u: float) -> tuple[int, float]:
    dense = torch.zeros(1, width, dtype=torch.float32)
    for column, weight in kept.items():
        dense[0, column] = weight
    weights: list[torch.Tensor] = []
    ids, _, _ = inverse_cdf_draw(dense, 1, ControlledUniforms([[u]]), weights_out=weights)
    return int(ids[0, 0]), float(weights[0][0, 0])


def _compare(draw, rows: int = 60) -> list[tuple]:
    """``(width, kept, u, expected, got)`` of every disagreement of ``draw`` with the dense
    inverse CDF over random rows and their boundary uniforms."""
    rng = random.Random(20261203)
    wrong = []
    for index in range(rows):
        width = [2 * BLOCK, 2000, 4096][index % 3]  # 2000: a short last block
        kept = _row(rng, width)
        columns = sorted(kept)
        blocks = host_floats.block_values([[kept[c] for c in columns]], [columns], width)
        for u in _boundaries(blocks[0]) + [rng.random() for _ in range(8)]:
            tokens, weights = draw(blocks, [u], width)
            expected = _reference(kept, width, u)
            if (tokens[0], weights[0]) != expected:
                wrong.append((width, kept, u, expected, (tokens[0], weights[0])))
    return wrong


def test_the_python_draw_is_the_inverse_cdf_on_the_dense_weights():
    assert _compare(host_floats.draw_one) == []


def test_negative_control_the_blocks_first_entry_is_caught():
    """A draw that takes the chosen block's first kept entry whatever the uniform (ignoring
    the prefix inside the block) disagrees on this test's rows."""

    def first_entry(blocks, uniforms, width):
        tokens, weights = host_floats.draw_one(blocks, uniforms, width)
        for b, token in enumerate(tokens):
            block = next(x for x in blocks[b] if x.index == token // BLOCK)
            column, weight = block.entries[0]
            tokens[b], weights[b] = block.index * BLOCK + column, weight
        return tokens, weights

    assert len(_compare(first_entry)) > 0


def test_a_block_of_three_kept_weights_is_summed_by_torch():
    weights = [0.1, 0.3, 1e-8, 0.7]  # float32 sums that depend on the order
    weights = torch.tensor(weights).tolist()
    blocks = host_floats.block_values([weights], [[3, 7, 200, 9]], 512)
    tile = torch.zeros(BLOCK)
    tile[[3, 7, 200, 9]] = torch.tensor(weights)
    entries = sorted(zip([3, 7, 200, 9], weights, strict=True))
    assert blocks == [[host_floats.Block(0, tile.sum().item(), entries)]]
    blocks = host_floats.block_values([[0.5, 0.0, 0.25]], [[300, 7, 3]], 512)
    assert blocks == [[host_floats.Block(0, 0.25, [(3, 0.25)]),
                       host_floats.Block(1, 0.5, [(300 - BLOCK, 0.5)])]]  # fmt: skip


def test_read_controls_flags_exactly_what_controls_in_range_flags():
    """The host paths' one read of the controls (host_floats.read_controls): ``fine`` is True
    exactly when ``controls_in_range`` passes every row, for legal values, edges (0, 1, a
    temperature of 0 and +inf) and each kind of bad value (NaN, infinities, negatives, > 1) in
    any row of any control. Negative control: a per-row check that skips NaN disagrees."""
    from fastsample.ops.validation import Controls
    from fastsample.ops.weights import controls_in_range

    rng = random.Random(3)
    legal = {
        "temperature": [0.0, 0.7, 1.0, 1e-30, 5.0],
        "top_k": [0, 1, 50, 10**6],
        "top_p": [1e-6, 0.9, 1.0],
        "min_p": [0.0, 0.05, 1.0],
    }
    bad = {
        "temperature": [math.nan, math.inf, -math.inf, -0.5],
        "top_k": [-1],
        "top_p": [math.nan, 0.0, 1.5, -0.1, math.inf],
        "min_p": [math.nan, -1e-9, 1.01, math.inf, -math.inf],
    }
    seen = {True: 0, False: 0}
    for _ in range(400):
        batch = rng.choice([1, 2, 7])
        values = {}
        for name in legal:
            if rng.random() < 0.3:
                continue  # a number or off: nothing to check on the host
            rows = [rng.choice(legal[name]) for _ in range(batch)]
            if rng.random() < 0.4:
                rows[rng.randrange(batch)] = rng.choice(bad[name])
            dtype = torch.int64 if name == "top_k" else torch.float32
            values[name] = torch.tensor(rows, dtype=dtype)
        controls = Controls(values.get("temperature", 1.0), values.get("top_k"),
                            values.get("top_p"), values.get("min_p"))  # fmt: skip
        want = bool(controls_in_range(controls, batch, torch.device("cpu")).all())
        assert host_floats.read_controls(controls, batch).fine == want, values
        seen[want] += 1
    assert min(seen.values()) > 50, seen
    # Negative control: min/max alone miss a NaN that is not first (NaN compares False).
    assert host_floats.within([0.5, math.nan], lambda v: v > 0, lambda v: v <= 1) is False
    assert (min([0.5, math.nan]) > 0 and max([0.5, math.nan]) <= 1) is True
