"""Packed token bitmasks: xgrammar's layout, made and read with torch integer ops.

A bitmask over a vocabulary of ``V`` tokens is an int32 tensor ``(..., ceil(V / 32))``; token
``j`` is bit ``j % 32`` (least significant first) of word ``j // 32``, 1 = set. A word of -1
sets all 32 tokens. This is the layout of xgrammar's ``allocate_token_bitmask`` (grammar
masks, 1 = allowed) and the one fastsample keeps for allowed-token lists and for the tokens a
request has seen (:class:`fastsample.stages.TokenStats`). 1 bit per token: a 128,256-token
row is 16,032 bytes.

Everything here is fixed-shape, sync-free torch (scatter and gather over the words), except
:func:`set_bits` (the set bits as positions: a data-dependent size, for the CPU's eager paths).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .threads import GRAIN

WORD_BITS = 32


def words_for(vocab: int) -> int:
    """Words of a bitmask over ``vocab`` tokens: ``ceil(vocab / 32)``."""
    return (vocab + WORD_BITS - 1) // WORD_BITS


def _lanes(device: torch.device) -> Tensor:
    return torch.arange(WORD_BITS, dtype=torch.int32, device=device)


def unpack(words: Tensor, vocab: int) -> Tensor:
    """``(..., vocab)`` bool: the bits of ``(..., W)`` int32 ``words`` (``W * 32 >= vocab``)."""
    bits = (words[..., None] >> _lanes(words.device)) & 1  # arithmetic shift: & 1 is the bit
    return bits.flatten(-2)[..., :vocab].bool()


def pack(bits: Tensor) -> Tensor:
    """``(..., ceil(V / 32))`` int32 words of ``(..., V)`` bool ``bits`` (the inverse of
    :func:`unpack`)."""
    vocab = bits.shape[-1]
    padded = torch.nn.functional.pad(bits.to(torch.int64), (0, words_for(vocab) * 32 - vocab))
    lanes = padded.unflatten(-1, (-1, WORD_BITS)) << _lanes(bits.device).to(torch.int64)
    return as_int32(lanes.sum(-1))


def as_int32(value: Tensor) -> Tensor:
    """int64 values in ``[0, 2**32)`` as the int32 words of the same 32 bits."""
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def from_ids(ids: Tensor, vocab: int) -> Tensor:
    """``(B, ceil(V / 32))`` int32 bitmask with the bits of ``(B, M)`` int64 ``ids`` set;
    ids outside ``[0, vocab)`` (``-1`` padding) set nothing. Duplicates are fine."""
    batch = ids.shape[0]
    inside = (ids >= 0) & (ids < vocab)
    bits = torch.zeros(batch, words_for(vocab) * WORD_BITS, dtype=torch.bool, device=ids.device)
    # Padding writes False onto column 0 only where no real id 0 writes True: take the max.
    bits = bits.to(torch.uint8).scatter_reduce_(
        1, torch.where(inside, ids, 0), inside.to(torch.uint8), "amax"
    )
    return pack(bits[:, :vocab].bool())


def bits_at(words: Tensor, ids: Tensor) -> Tensor:
    """``(B, M)`` bool: the bits of ``(B, W)`` ``words`` at ``(B, M)`` int64 ``ids`` (which must
    lie in ``[0, 32 * W)``)."""
    word = words.gather(1, ids // WORD_BITS)
    return ((word >> (ids % WORD_BITS).to(torch.int32)) & 1).bool()


def refresh_words(words: Tensor, word_ids: Tensor, bits: Tensor) -> Tensor:
    """Write, in place, the words ``word_ids`` (``(B, M)`` int64) of ``words`` from ``bits``
    (``(B, M, 32)`` bool, lane ``i`` = bit ``i``); duplicate word ids must carry equal bits."""
    lanes = bits.to(torch.int64) << _lanes(bits.device).to(torch.int64)
    return words.scatter_(1, word_ids, as_int32(lanes.sum(-1)))


def set_bits(words: Tensor, width: int | None = None) -> tuple[Tensor, Tensor]:
    """``(row, column)`` of every set bit of ``(R, W)`` int32 ``words`` (as 64-bit words when
    ``W`` is even: half as many to scan), only the columns below ``width`` if given (a bit
    past the vocabulary in the last word means nothing). The nonzero words are a few hundred
    per row of a 128k vocabulary and most hold one bit, so rounds take each word's lowest set
    bit (its index is the exponent of a power of two, exact in float64) until the few words
    left can give all their bits at once (one shift per bit) with fewer entries than the
    parallel grain."""
    if words.shape[1] % 2 == 0 and words.is_contiguous():
        words, bits = words.view(torch.int64), 64
    else:
        bits = WORD_BITS
    row, word = words.nonzero(as_tuple=True)
    value = words.view(-1).gather(0, row * words.shape[1] + word)
    if bits == 32:
        value = value.to(torch.int64).bitwise_and_(0xFFFFFFFF)
    rows_out, columns_out = [], []
    while value.shape[0]:
        if value.shape[0] * bits < GRAIN:  # the rest, every bit at once
            lanes = torch.arange(bits, device=words.device)
            which, lane = ((value[:, None] >> lanes) & 1).nonzero(as_tuple=True)
            rows_out.append(row.index_select(0, which))
            columns_out.append(word.index_select(0, which).mul_(bits).add_(lane))
            break
        low = value & -value  # the lowest set bit (bit 63: the int64 minimum, exponent 64)
        rows_out.append(row)
        columns_out.append(torch.frexp(low.to(torch.float64)).exponent.sub_(1).add_(word * bits))
        left = (value.bitwise_xor_(low) != 0).nonzero().squeeze(1)
        row, word, value = row[left], word[left], value[left]
    if len(rows_out) == 1:
        rows, columns = rows_out[0], columns_out[0]
    else:
        rows, columns = torch.cat(rows_out), torch.cat(columns_out)
    if width is not None and width % WORD_BITS:
        inside = columns < width
        rows, columns = rows[inside], columns[inside]
    return rows, columns
