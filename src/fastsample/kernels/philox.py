"""Philox 4x32-10 in Triton, with exactly the counters of :mod:`fastsample.ops.seeds`.

Entry points (``@triton.jit`` device functions unless said otherwise):

* :func:`philox4x32_10` ``(c0, c1, c2, c3, k0, k1) -> (x0, x1, x2, x3)``: uint32 words of
  any broadcastable shapes; the same function as :func:`fastsample.ops.philox.philox4x32`.
* :func:`row_key` ``(seed) -> (k0, k1)`` and :func:`counter_words` ``(step, stream,
  PURPOSE) -> (c1, c2, c3)``: the per-row key and counter words from int64 ``seed``/``step``
  and an int ``stream`` (low 24 bits kept); ``PURPOSE`` is a :class:`~fastsample.ops.seeds
  .Purpose` value (0: per-entry race noise, 1: per-draw uniforms).
* :func:`uniform_at` ``(position, c1, c2, c3, k0, k1) -> float64``: the uniform of one
  position (any shape), bit-identical to ``CounterSource.uniforms``.
* :func:`entry_uniforms` ``(first_pair, ROWS, HALF, c1, c2, c3, k0, k1) -> (ROWS, 2*HALF)``
  float64: positions ``2*first_pair .. 2*first_pair + 2*HALF - 1``, one Philox block per
  two positions (the race's per-entry noise).
* :func:`exponential_noise` ``(u, LOG1P) -> float64``: Exp(1) noise ``-log1p(-u)`` as in
  :func:`fastsample.ops.noise.exponential_from_uniform` (never 0 or inf).
* :func:`counter_uniforms` (a launcher, host side): ``(B, length)`` uniforms for given
  counters, the reference the tests compare with the torch path.

Layout (see :class:`fastsample.ops.seeds.CounterSource`): key ``(seed mod 2^32, seed >> 32)``;
counter ``c0 = position // 2``, ``c1 = purpose << 24 | stream``, ``c2 = step mod 2^32``,
``c3 = step >> 32``. Position ``2p`` takes output words ``(x0, x3)``, ``2p + 1`` takes
``(x2, x1)``; a pair ``(a, b)`` becomes ``(a << 21 | b >> 11) * 2^-53``, a float64 in
``[0, 1)`` with 53 random bits. Words are uint32: products wrap mod 2^32 and ``tl.umulhi``
gives the high word, which is exactly the torch path's 64-bit product split in two.

Exponential noise: on a GPU ``LOG1P=True`` uses libdevice's ``log1p`` (the function torch's
CUDA ``log1p`` calls). Triton's interpreter has no libdevice, so there ``LOG1P=False`` takes
``-log(1 - u)``: ``u`` is a multiple of 2^-53 below 1, so ``1 - u`` is exact and ``log`` of an
exact argument near 1 keeps full relative precision (the tail stays resolved); it may differ
from torch's ``log1p`` in the last bit, which moves a race winner only on an exact near-tie.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from ..ops.seeds import Purpose
from . import launch

# Round multipliers and Weyl key increments of Random123 (as in fastsample.ops.philox).
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
# 2^-53 scales a 53-bit integer to [0, 1); 2^-54 is the midpoint of the cell [0, 2^-53).
INV_2_53 = tl.constexpr(1.1102230246251565e-16)
HALF_GRID = tl.constexpr(5.551115123125783e-17)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on uint32 words (shapes broadcast); returns the four output words."""
    for _ in tl.static_range(10):
        # uint32 products wrap: the low word; umulhi: the high word of the 64-bit product.
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = c0 * PHILOX_M0
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + PHILOX_W0  # wraps mod 2^32, like the torch path's masked k + r * W
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def row_key(seed):
    """Key words ``(seed mod 2^32, seed >> 32)`` of int64 seeds."""
    return seed.to(tl.uint32), (seed >> 32).to(tl.uint32)


@triton.jit
def counter_words(step, stream, PURPOSE: tl.constexpr):
    """Counter words ``(c1, c2, c3)``: ``PURPOSE << 24 | stream`` and the int64 step's halves."""
    stream_word = ((stream & 0xFFFFFF) | (PURPOSE << 24)).to(tl.uint32)
    return stream_word, step.to(tl.uint32), (step >> 32).to(tl.uint32)


@triton.jit
def uniform53(high_word, low_word):
    """``(high << 21 | low >> 11) * 2^-53``: 53 random bits as a float64 in [0, 1) (exact)."""
    bits = (high_word.to(tl.uint64) << 21) | (low_word >> 11).to(tl.uint64)
    return bits.to(tl.float64) * INV_2_53


@triton.jit
def pair_uniforms(pair, c1, c2, c3, k0, k1):
    """Uniforms of positions ``2 * pair`` and ``2 * pair + 1`` (one Philox block)."""
    x0, x1, x2, x3 = philox4x32_10(pair.to(tl.uint32), c1, c2, c3, k0, k1)
    return uniform53(x0, x3), uniform53(x2, x1)


@triton.jit
def uniform_at(position, c1, c2, c3, k0, k1):
    """The uniform of ``position`` (int tensor of any shape broadcasting with the words)."""
    even, odd = pair_uniforms(position // 2, c1, c2, c3, k0, k1)
    return tl.where(position % 2 == 0, even, odd)


@triton.jit
def entry_uniforms(first_pair, ROWS: tl.constexpr, HALF: tl.constexpr, c1, c2, c3, k0, k1):
    """``(ROWS, 2 * HALF)`` uniforms of positions ``2 * first_pair + j``; words ``(ROWS, 1)``."""
    pairs = first_pair + tl.arange(0, HALF)[None, :]
    even, odd = pair_uniforms(pairs, c1, c2, c3, k0, k1)
    # join puts the two positions of a pair side by side; the reshape interleaves them.
    return tl.reshape(tl.join(even, odd), (ROWS, 2 * HALF))


@triton.jit
def exponential_noise(u, LOG1P: tl.constexpr):
    """Exp(1) noise from float64 uniforms in [0, 1): ``-log1p(-max(u, 2^-54))``."""
    if LOG1P:
        noise = -libdevice.log1p(-tl.maximum(u, HALF_GRID))
    else:
        # 1 - u is exact on the 2^-53 grid; u == 0 maps to 2^-54 (= -log1p(-2^-54) exactly).
        noise = tl.where(u == 0.0, HALF_GRID, -tl.log(1.0 - u))
    return noise


@triton.jit
def _counter_uniforms_kernel(
    seed_ptr,
    step_ptr,
    stream_ptr,
    out_ptr,
    batch,
    start,
    length,
    seed_stride,
    step_stride,
    stream_stride,
    PURPOSE: tl.constexpr,
    NOISE: tl.constexpr,
    LOG1P: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < batch
    seed = tl.load(seed_ptr + rows * seed_stride, mask=live, other=0)
    step = tl.load(step_ptr + rows * step_stride, mask=live, other=0)
    stream = tl.load(stream_ptr + rows * stream_stride, mask=live, other=0)
    k0, k1 = row_key(seed[:, None])
    c1, c2, c3 = counter_words(step[:, None], stream[:, None], PURPOSE)
    for first in range(0, length, WIDTH):
        columns = first + tl.arange(0, WIDTH)[None, :]
        u = uniform_at(start + columns.to(tl.int64), c1, c2, c3, k0, k1)
        if NOISE:
            u = exponential_noise(u, LOG1P)
        inside = live[:, None] & (columns < length)
        tl.store(out_ptr + rows[:, None] * length + columns, u, mask=inside)


def _interpreted() -> bool:
    return isinstance(_counter_uniforms_kernel, InterpretedFunction)


INTERPRETED = _interpreted()
"""True when this process runs the kernels in Triton's interpreter (see fastsample.kernels)."""


def counter_uniforms(
    seed: Tensor,
    step: Tensor,
    stream: Tensor,
    purpose: Purpose,
    start: int,
    length: int,
    *,
    noise: bool = False,
) -> Tensor:
    """``(B, length)`` float64 uniforms of positions ``start ..`` for ``(B,)`` int64 counters.

    The same numbers as ``CounterSource(seed, step, stream).uniforms(purpose, start, length)``
    bit for bit; with ``noise=True``, :func:`exponential_noise` of them instead.
    """
    batch = seed.shape[0]
    out = torch.empty((batch, length), dtype=torch.float64, device=seed.device)
    rows = launch.rows_per_program(batch, INTERPRETED)
    if batch and length:
        launch.count_launch()
        launch.launcher(_counter_uniforms_kernel, INTERPRETED)[launch.grid(batch, rows)](
            seed, step, stream, out, batch, start, length,
            seed.stride(0), step.stride(0), stream.stride(0),
            PURPOSE=int(purpose), NOISE=noise, LOG1P=not INTERPRETED, ROWS=rows,
            WIDTH=min(256, triton.next_power_of_2(length)),
        )  # fmt: skip
    return out
