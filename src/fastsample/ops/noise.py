"""Where the samplers get their randomness: one small interface, several sources.

Every sampler asks a :class:`UniformSource` for exactly two kinds of uniforms:

* ``row_uniforms(num)``: ``(B, num)`` float64 in ``[0, 1)`` with 53 random bits, column
  ``k`` for draw ``k`` (the inverse-CDF method needs one per row per draw);
* ``entry_uniforms(start, length)``: ``(B, length)`` float64 in ``[0, 1)`` with 53 random
  bits, column ``i`` for global vocabulary index ``start + i`` (the exponential race needs
  one per entry).

Keeping the samplers behind this interface is what lets a torch.Generator and the
counter-based per-request keys of :mod:`fastsample.seeds` drive the same code.

:func:`exponential_from_uniform` turns such uniforms into Exp(1) noise for the race without
the two classic traps: ``-log(u)`` with ``u`` on a coarse grid cannot produce the tiny
values that let a far-tail token win, and a noise of exactly 0 makes ``p / 0 = inf`` win
for any ``p``. We use ``-log1p(-u)``: small ``u`` maps to small noise with the full 2^-53
resolution of the float64 grid near 0, and ``u == 0`` (probability 2^-53) is moved to half
a grid step, which is where the continuous law puts that cell's mass, not an outlier.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

# Half of the float64 uniform grid step 2^-53: the midpoint of the cell [0, 2^-53).
_HALF_GRID = 2.0**-54


class UniformSource(Protocol):
    """A source of float64 uniforms in ``[0, 1)`` for a batch of ``B`` rows."""

    def row_uniforms(self, num: int) -> Tensor:
        """``(B, num)`` uniforms, one per draw."""
        ...

    def entry_uniforms(self, start: int, length: int) -> Tensor:
        """``(B, length)`` uniforms for global vocabulary indices ``start .. start+length-1``."""
        ...

    def stage_uniforms(self, num: int) -> Tensor:
        """``(B, num)`` uniforms for the random stages of the sampler chain (XTC), apart
        from the draws' and the entries'."""
        ...


class GeneratorSource:
    """Uniforms from a ``torch.Generator`` (or the default one when ``generator`` is None).

    Draws are consumed from the generator in call order, so results depend on the batch as
    a whole; use :class:`fastsample.seeds.CounterSource` for per-request reproducibility.
    """

    def __init__(self, generator: torch.Generator | None, batch: int, device: torch.device):
        self.generator = generator
        self.batch = batch
        self.device = device

    def _rand(self, cols: int) -> Tensor:
        # torch.rand in float64 carries 53 random bits on CPU and CUDA.
        return torch.rand(
            (self.batch, cols), dtype=torch.float64, device=self.device, generator=self.generator
        )

    def row_uniforms(self, num: int) -> Tensor:
        return self._rand(num)

    def entry_uniforms(self, start: int, length: int) -> Tensor:
        del start  # a stateful generator has no notion of position
        return self._rand(length)

    def stage_uniforms(self, num: int) -> Tensor:
        return self._rand(num)


def exponential_from_uniform(u: Tensor) -> Tensor:
    """Exp(1) noise ``-log1p(-u)`` from float64 uniforms in ``[0, 1)``; never 0 or inf.

    Consumes ``u`` (computed in place) to keep the race at one extra float64 buffer.
    """
    # The smallest nonzero grid value is 2^-53, so this only moves u == 0 to its cell's
    # midpoint; it never reaches into values that occur naturally.
    return u.clamp_(min=_HALF_GRID).neg_().log1p_().neg_()
