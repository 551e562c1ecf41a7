"""Philox-4x32-10, the counter-based random bit generator, in plain elementwise torch ops.

Philox is from Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3"
(SC'11), and is what cuRAND and Random123 ship. It maps a 128-bit *counter* (four 32-bit
words) and a 64-bit *key* (two words) to 128 random-looking bits through ``rounds`` rounds
(10 by default) of two 32x32->64 bit multiplies, XORs and a word shuffle, with the key bumped
by Weyl constants (derived from the golden ratio and sqrt(3)) between rounds.

Why counter-based: the output is a pure function of ``(counter, key)``, with no state to
carry or advance. Any element of the stream can be computed directly and in any order, so a
random number can be tied to *what it is for* (request key, draw index, vocabulary index)
rather than to the order in which a kernel happened to run. The result is the same on CPU
and CUDA, eager and compiled, for any batch size or tiling, and nothing needs a host sync.

Two layouts of the same function, because two regimes:

* :func:`philox4x32` keeps each word in its own tensor: for the race's per-entry noise
  (``B x V / 2`` blocks), where the cost is memory traffic, ten ops a round on full tensors.
* :func:`philox4x32_few` is for one or a few blocks per row (the inverse CDF's per-row
  uniforms), where the cost is per-op overhead (~1-2 us an op on CPU), not data. It packs the
  two multiply lanes of a round into one ``(..., 2)`` tensor, so a round is six small ops
  (multiply, shift, two XORs, mask, lane swap) instead of ten.

Words live in int64 tensors (torch has no uint32 arithmetic). The 32x32 -> 64-bit product
can exceed ``2**63``: it is taken as an int64 product that wraps modulo ``2**64`` (two's
complement), whose low 64 bits are exactly the unsigned product, so ``lo = p & 0xFFFFFFFF``
and ``hi = (p >> 32) & 0xFFFFFFFF`` are exact. Eager torch on CPU and CUDA, inductor's C++
and Triton all lower int64 multiply to wrapping machine multiplies; the known-answer tests
run eager, compiled and on CUDA to hold us to that. Words that only ever enter XORs (the
key, ``c1``, ``c3``) are allowed garbage above bit 31, since every XOR result is masked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# Round multipliers and key (Weyl) increments, as in Random123's philox.h.
PHILOX_M0 = 0xD2511F53  # multiplies counter word 0
PHILOX_M1 = 0xCD9E8D57  # multiplies counter word 2
PHILOX_W0 = 0x9E3779B9  # added to key word 0 between rounds (golden ratio - 1)
PHILOX_W1 = 0xBB67AE85  # added to key word 1 between rounds (sqrt(3) - 1)

_MASK32 = 0xFFFFFFFF


def philox4x32(
    counter: tuple[Tensor, Tensor, Tensor, Tensor],
    key: tuple[Tensor, Tensor],
    rounds: int = 10,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random123's Philox4x32 with ``rounds`` rounds, elementwise over broadcast tensors.

    ``counter`` and ``key`` are int64 tensors holding values in ``[0, 2**32)`` (not checked;
    ``c1``, ``c3`` and the key may carry garbage above bit 31); their shapes must broadcast
    together. Returns the four output words as int64 tensors in ``[0, 2**32)`` of the
    broadcast shape. Bit-identical on every device, eager or under
    ``torch.compile(fullgraph=True)``; ``rounds=10`` is the standard Philox-4x32-10.
    """
    # Broadcast up front: a round's words do not all depend on every input, so without this
    # the output shapes would depend on the input shapes and on ``rounds``.
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(*counter, *key)
    c0, c2 = c0 & _MASK32, c2 & _MASK32
    for r in range(rounds):  # ``rounds`` is a Python int: the loop unrolls when compiled
        p0, p1 = c0 * PHILOX_M0, c2 * PHILOX_M1  # wrap mod 2**64: low 64 bits exact
        c0, c1, c2, c3 = (
            ((p1 >> 32) ^ c1 ^ (k0 + r * PHILOX_W0)) & _MASK32,
            p1,  # only XORed later: its high garbage is masked off then
            ((p0 >> 32) ^ c3 ^ (k1 + r * PHILOX_W1)) & _MASK32,
            p0,
        )
    return c0, c1 & _MASK32, c2, c3 & _MASK32


def philox4x32_few(
    counter: tuple[Tensor, Tensor, Tensor, Tensor],
    key: tuple[Tensor, Tensor],
    rounds: int = 10,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Same function and contract as :func:`philox4x32`, laid out for few blocks.

    Packs words into ``(..., 2)`` lanes; use it when the broadcast shape is small (a few
    blocks per row), where it makes ~7 cheap ops a round instead of ~10 larger ones.
    """
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(*counter, *key)
    even, odd = philox4x32_pairs(
        torch.stack((c0, c2), -1), torch.stack((c3, c1), -1), torch.stack((k1, k0), -1), rounds
    )
    return even[..., 0], odd[..., 1], even[..., 1], odd[..., 0]


class _PairConstants(NamedTuple):
    multipliers: Tensor  # (M0, M1)
    bumps: list[Tensor]  # r * (W1, W0) for each round r
    shift32: Tensor  # 0-d 32: a tensor operand, so no scalar is wrapped per op
    mask32: Tensor  # 0-d 0xFFFFFFFF


_PAIR_CONSTANTS: dict[tuple[torch.device, int], _PairConstants] = {}


def _pair_constants(device: torch.device, rounds: int) -> _PairConstants:
    """Constants of the packed layout, made once per device and cached.

    Passing Python ints makes torch wrap a new scalar tensor per op, a measurable share of a
    1 us op. Built with arange/full on ``device`` (no host-to-device copy: capturable, and
    no CPU operand mixed into CUDA or compiled code).
    """
    cached = _PAIR_CONSTANTS.get((device, rounds))
    if cached is None:
        # Ordinary tensors even when first made inside inference mode: cached constants
        # must be usable in any mode, eager or compiled.
        with torch.inference_mode(False):
            lanes = torch.arange(2, device=device)
            weyl = PHILOX_W1 + (PHILOX_W0 - PHILOX_W1) * lanes  # pairs with key lanes (k1, k0)
            cached = _PairConstants(
                multipliers=PHILOX_M0 + (PHILOX_M1 - PHILOX_M0) * lanes,
                bumps=[weyl * r for r in range(rounds)],
                shift32=torch.full((), 32, dtype=torch.int64, device=device),
                mask32=torch.full((), _MASK32, dtype=torch.int64, device=device),
            )
        _PAIR_CONSTANTS[(device, rounds)] = cached
    return cached


def philox4x32_pairs(
    multiplied: Tensor, xored: Tensor, key: Tensor, rounds: int = 10
) -> tuple[Tensor, Tensor]:
    """The packed core of :func:`philox4x32_few`.

    Args:
        multiplied: ``(..., 2)`` counter words ``(c0, c2)`` in ``[0, 2**32)``.
        xored: ``(..., 2)`` counter words ``(c3, c1)``.
        key: ``(..., 2)`` key words ``(k1, k0)``. ``xored`` and ``key`` only need their low
            32 bits right. Shapes broadcast.

    Returns:
        The output words packed the same way: ``(x0, x2)`` and ``(x3, x1)``.
    """
    multipliers, bumps, shift32, mask32 = _pair_constants(multiplied.device, rounds)
    for r in range(rounds):  # ``rounds`` is a Python int: the loop unrolls when compiled
        product = multiplied * multipliers  # wraps mod 2**64: low 64 bits exact
        high = torch.bitwise_right_shift(product, shift32)
        # Round key (k1 + r W1, k0 + r W0): its carries above bit 31 are masked with the rest.
        high.bitwise_xor_(xored).bitwise_xor_(key + bumps[r] if r else key).bitwise_and_(mask32)
        # New (c0, c2) = (hi(M1 c2) ^ c1 ^ k0, hi(M0 c0) ^ c3 ^ k1): the lanes swap.
        multiplied = high.flip(-1)
        # New (c3, c1) = (lo(M0 c0), lo(M1 c2)): the low words, already in (c3, c1) order.
        xored = product
    return multiplied, xored & mask32


def philox4x32_host(
    c0: int, c1: int, c2: int, c3: int, k0: int, k1: int, rounds: int = 10, lanes: int = 1,
) -> tuple[int, int, int, int]:  # fmt: skip
    """:func:`philox4x32` on Python ints whose words are on the host, ``lanes`` blocks at once.

    Each argument packs ``lanes`` words, word ``i`` in bits ``64 i .. 64 i + 31`` of the int
    (``lanes = 1``: a plain word; the same contract otherwise: words in ``[0, 2**32)``,
    ``c1``, ``c3`` and the key may carry garbage above bit 31 of their lane, up to bit 63).
    A round's multiply by a 32-bit constant keeps every lane's product (``< 2**64``) in its
    own 64 bits, so each big-int op is every lane's op at once: ~60 ops for any number of
    lanes, where a loop over the blocks in Python costs ~3.5 us a block (the ops are
    linear in the int's length but nearly free per lane: 64 lanes ~15 us). Exact: Python
    ints do not wrap. Returns the four output words packed the same way (``[0, 2**32)``).
    """
    ones = lane_ones(lanes)
    mask = ones * _MASK32  # the low 32 bits of every lane
    c0, c1, c2, c3, k0, k1 = c0 & mask, c1 & mask, c2 & mask, c3 & mask, k0 & mask, k1 & mask
    w0, w1 = ones * PHILOX_W0, ones * PHILOX_W1
    for _ in range(rounds):
        p0 = c0 * PHILOX_M0
        p1 = c2 * PHILOX_M1
        # ``>> 32`` brings the next lane's low bits into this lane's high bits: masked off
        c0, c1, c2, c3 = (
            ((p1 >> 32) ^ c1 ^ k0) & mask, p1 & mask, ((p0 >> 32) ^ c3 ^ k1) & mask, p0 & mask
        )  # fmt: skip
        # the key's carries stay below bit 36 of a lane in 10 rounds and only enter XORs
        k0 += w0
        k1 += w1
    return c0, c1, c2, c3


_LANE_ONES: dict[int, int] = {}


def lane_ones(lanes: int) -> int:
    """``sum(2 ** (64 i) for i < lanes)``: a 1 in every lane (cached per count)."""
    ones = _LANE_ONES.get(lanes)
    if ones is None:
        ones = _LANE_ONES[lanes] = int.from_bytes(b"\x01\0\0\0\0\0\0\0" * lanes, "little")
    return ones
