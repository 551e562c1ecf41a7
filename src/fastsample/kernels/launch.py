"""What every launcher shares: rows per program, block widths, and a launch counter.

Rows per program. On a GPU each program handles one row (``ROWS = 1``): rows never share a
reduction, so batch invariance holds by construction. Triton's interpreter runs programs one
after another in Python at ~0.1 ms per tensor op whatever the tile size, so there a program
takes a tile of rows (:func:`rows_per_program`); every reduction in the kernels is along
the row's own axis, so a row's result still never depends on its neighbours (the batch
invariance tests check it bitwise on the interpreter).

Launch counter. :func:`count_launch` is called by every launcher once per kernel launch, and
:func:`launches` reads the running total, so tests and ``bench --launches`` can count device
work per call (together with a dispatch mode for the aten ops).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from ..ops.inverse_cdf import BLOCK as SUM_BLOCK  # the torch path's block, shared (256)

INTERPRETER_ELEMENTS = 1 << 18  # per (ROWS, TILE) tile: numpy-sized work per interpreted op
_MAX_NUMEL = 1 << 20  # Triton's largest tensor
INTERPRETER_ROWS = 64  # rows per program when the caller gives no vocabulary size

_total = 0


def count_launch() -> None:
    """Record one kernel launch (called by the launchers, eagerly)."""
    global _total
    _total += 1


def launches() -> int:
    """Kernel launches made by this package's launchers so far in this process."""
    return _total


def rows_per_program(
    batch: int, interpreted: bool, vocab: int | None = None, num_samples: int = 1
) -> int:
    """``ROWS``: 1 on a GPU. In the interpreter, a power-of-two tile of rows: with ``vocab``,
    holding up to :data:`INTERPRETER_ELEMENTS` entries of a ``(ROWS, tile_width(vocab))`` tile
    whose ``(ROWS, tile, num_samples)`` tiles (several draws) stay within Triton's tensor
    limit; without it, up to :data:`INTERPRETER_ROWS` rows."""
    if not interpreted:
        return 1
    most = INTERPRETER_ROWS
    if vocab is not None:
        tile = tile_width(vocab)
        slots = triton.next_power_of_2(num_samples)
        most = max(1, min(INTERPRETER_ELEMENTS // tile, _MAX_NUMEL // (tile * slots)))
    return min(triton.next_power_of_2(max(batch, 1)), most)


def tile_width(vocab: int) -> int:
    """Entries per tile: the torch path's sum block (256), or the whole row if shorter.

    Block sums must be taken over the same blocks as :func:`fastsample.ops.inverse_cdf
    .block_sums` (``SUM_BLOCK`` entries, the last one short) for the draws to agree; a row
    shorter than a block is one block either way (at least 16 wide: tiny tiles gain nothing).
    """
    return SUM_BLOCK if vocab >= SUM_BLOCK else max(16, triton.next_power_of_2(vocab))


def grid(batch: int, rows: int) -> tuple[int]:
    return (triton.cdiv(batch, rows),)


def launcher(kernel, interpreted: bool):
    """``kernel`` as a launcher should launch it: ``launcher(k, INTERPRETED)[grid](*args)``.

    Compiled: through ``wrap_triton``, so ``torch.compile`` traces the ``triton_op`` around it.
    Interpreted: with numpy's floating-point warnings off (bad rows overflow and divide by zero
    by design; the GPU is silent about it too), and, when ``triton.language`` was imported
    before ``TRITON_INTERPRET`` was set (``torch._dynamo`` imports it, e.g. after a
    ``torch.compile``), with its ``@jit`` helpers (``tl.sum``, ``tl.zeros``...), which are then
    compiled-mode functions the interpreter cannot call, interpreted for the launch too.
    """
    if not interpreted:
        return torch.library.wrap_triton(kernel)
    return _Interpreted(kernel)


class _Interpreted:
    """``kernel[grid](...)`` run by the interpreter (see :func:`launcher`)."""

    _standard: ClassVar[dict] = {}

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            import numpy as np  # the interpreter's own dependency (not needed when compiled)

            original = JITFunction.__call__
            patch = not isinstance(tl.zeros, InterpretedFunction)
            if patch:
                JITFunction.__call__ = _Interpreted._call  # type: ignore[method-assign]
            try:
                with np.errstate(all="ignore"):
                    return self.kernel[grid](*args, **kwargs)
            finally:
                if patch:
                    JITFunction.__call__ = original  # type: ignore[method-assign]

        return launch

    @staticmethod
    def _call(function, *args, **kwargs):
        interpreted = _Interpreted._standard.get(function.fn)
        if interpreted is None:
            interpreted = InterpretedFunction(function.fn)
            _Interpreted._standard[function.fn] = interpreted
        return interpreted(*args, **kwargs)
