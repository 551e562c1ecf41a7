"""A controlled uniform source for boundary tests: the uniforms a test chooses, no randomness.

:class:`ControlledUniforms` implements :class:`fastsample.ops.noise.UniformSource`, so a test
can hand it to any sampler that draws through that interface (``inverse_cdf_draw``,
``race_draw``, ``small_top_k.draw``, the unseeded distributed round) and force ``u = 0``, ``u``
exactly on a prefix sum, or ``u`` just below 1. The helpers build such uniforms and state the
documented rule the draws must follow, with exact float64 arithmetic (dyadic or subnormal
weights, whose sums and products round nowhere).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# The largest float64 uniform the samplers can see: 53 random bits scaled to [0, 1).
BELOW_ONE = 1.0 - 2.0**-53
# The smallest positive float64 (subnormal): weights in units of it make ``u * total`` round
# onto a prefix, or up to the total, for ordinary uniforms (see ``subnormal_target``).
TINY = 2.0**-1074


class ControlledUniforms:
    """A :class:`~fastsample.ops.noise.UniformSource` that returns chosen uniforms.

    Args:
        rows: ``(B, n)`` uniforms (nested lists or a tensor), column ``k`` for draw ``k``.
        entries: ``(B, V)`` uniforms indexed by global vocabulary position, for the race;
            None if the test draws no per-entry noise.

    Every value must lie in ``[0, 1)``, as the protocol promises; each call returns a fresh
    float64 copy (samplers may consume it in place) and is logged in ``calls``.
    """

    def __init__(
        self, rows: Sequence | Tensor | None = None, entries: Sequence | Tensor | None = None
    ):
        self.rows = None if rows is None else _uniform_table(rows)
        self.entries = None if entries is None else _uniform_table(entries)
        self.calls: list[tuple] = []

    def row_uniforms(self, num: int) -> Tensor:
        assert self.rows is not None, "this source has no row uniforms"
        assert num <= self.rows.shape[1], f"asked for {num} draws, {self.rows.shape[1]} chosen"
        self.calls.append(("row_uniforms", num))
        return self.rows[:, :num].clone()

    def entry_uniforms(self, start: int, length: int) -> Tensor:
        assert self.entries is not None, "this source has no entry uniforms"
        assert start + length <= self.entries.shape[1]
        self.calls.append(("entry_uniforms", start, length))
        return self.entries[:, start : start + length].clone()


def _uniform_table(values: Sequence | Tensor) -> Tensor:
    table = torch.as_tensor(values, dtype=torch.float64)
    assert table.dim() == 2, "uniforms are (B, columns)"
    assert bool(((table >= 0) & (table < 1)).all()), "uniforms must lie in [0, 1)"
    return table.clone()


def on_prefix(weights: Sequence[float], j: int) -> float:
    """The uniform ``u`` with ``u * total == P_j`` exactly, ``P_j`` the inclusive prefix sum
    of ``weights`` up to entry ``j`` (asserted exact: use dyadic weights)."""
    prefix = math.fsum(weights[: j + 1])
    total = math.fsum(weights)
    u = prefix / total
    assert u * total == prefix and 0 <= u < 1, "not an exact boundary: use dyadic weights"
    return u


def first_above(weights: Sequence[float], u: float) -> int:
    """The documented pick for uniform ``u``: the first ``j`` with ``P_j > t``, where
    ``t = min(u * total, nextafter(total, 0))`` (float64, prefixes summed exactly)."""
    total = math.fsum(weights)
    target = min(u * total, math.nextafter(total, 0.0))
    running = 0.0
    for j, w in enumerate(weights):
        running = math.fsum((running, w))
        if running > target:
            return j
    raise AssertionError("no positive weight")


def subnormal_target(units: Sequence[int], u: float) -> int:
    """``t / TINY`` for weights ``units * TINY`` (float64 subnormals): ``u * total`` rounds to
    a whole number of units, so an ordinary uniform lands exactly on a prefix, or on the total
    itself (then kept one unit below it)."""
    total = sum(units) * TINY
    return round(min(u * total, math.nextafter(total, 0.0)) / TINY)
