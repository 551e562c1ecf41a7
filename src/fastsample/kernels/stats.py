"""``TokenStats.update`` in one Triton launch: :meth:`fastsample.stages.TokenStats.update`.

One program per row takes the row's ``n`` emitted ids (``(B, n)``, entries outside ``[0, V)``
such as ``-1`` add nothing) and, in place, exactly as the torch update:

1. counts: each touched count becomes its value plus its occurrences among the row's ids,
   capped at the count type's largest value (an entry outside the vocabulary names column 0
   and adds the real zeros' occurrences, so every entry naming a column writes the same
   number); all counts are read before any is written (a barrier between);
2. ``output_len += `` the number of ids inside the vocabulary;
3. after a barrier, the seen word of every touched id (column 0's word for the others) is
   rewritten as its prompt word OR the bits of the 32 counts it covers that are positive
   (columns past ``V`` give none).

Shapes: ``ids`` ``(B, n)`` integer; ``counts`` ``(B, V)`` uint8/int16/int32 with unit column
stride; ``output_len`` ``(B,)`` int64; ``seen``/``prompt`` ``(B, ceil(V / 32))`` int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import launch
from .philox import INTERPRETED
from .select import total as sum_of


@triton.jit
def _update_kernel(
    ids_ptr, ids_stride, num, counts_ptr, counts_stride, length_ptr, seen_ptr, seen_stride,
    prompt_ptr, prompt_stride, vocab, TOP: tl.constexpr, N_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, N_PAD)
    live = slots < num
    ids = tl.load(ids_ptr + row * ids_stride + slots, mask=live, other=-1).to(tl.int64)
    inside = live & (ids >= 0) & (ids < vocab)
    col = tl.where(inside, ids, 0)
    counts_row = counts_ptr + row * counts_stride
    occurrences = sum_of(((col[:, None] == col[None, :]) & inside[None, :]).to(tl.int64), 1)
    old = tl.load(counts_row + col, mask=live, other=0).to(tl.int64)
    new = tl.minimum(old + occurrences, TOP)
    tl.debug_barrier()  # every count is read before any is written
    tl.store(counts_row + col, new.to(counts_ptr.dtype.element_ty), mask=live)
    emitted = sum_of(inside.to(tl.int64), 0)
    tl.store(length_ptr + row, tl.load(length_ptr + row) + emitted)
    tl.debug_barrier()  # the words read the counts just written

    word = col // 32
    lanes = tl.arange(0, 32)
    columns = word[:, None] * 32 + lanes[None, :]
    positive = tl.load(
        counts_row + tl.minimum(columns, vocab - 1), mask=live[:, None], other=0
    ) > 0
    bits = (positive & (columns < vocab)).to(tl.int64) << lanes[None, :].to(tl.int64)
    packed = sum_of(bits, 1).to(tl.int32)  # distinct bits: their sum is their OR
    prompt = tl.load(prompt_ptr + row * prompt_stride + word, mask=live, other=0)
    tl.store(seen_ptr + row * seen_stride + word, prompt | packed, mask=live)


def update(counts: Tensor, length: Tensor, seen: Tensor, prompt: Tensor, ids: Tensor) -> None:
    """One launch, in place on ``counts``, ``length`` and ``seen`` (see the module docstring;
    arguments checked by :meth:`~fastsample.stages.TokenStats.update`, ``n >= 1``)."""
    batch, vocab = counts.shape
    if batch == 0:
        return
    if ids.shape[1] > 1 and ids.stride(1) != 1:
        raise ValueError("ids need unit column stride")
    if counts.stride(1) != 1 or seen.stride(1) != 1:  # TokenStats makes them contiguous
        raise ValueError("counts and seen need unit column stride (they are updated in place)")
    launch.count_launch()
    launch.launcher(_update_kernel, INTERPRETED)[(batch,)](
        ids, ids.stride(0), ids.shape[1], counts, counts.stride(0), length, seen, seen.stride(0),
        prompt, prompt.stride(0), vocab,
        TOP=torch.iinfo(counts.dtype).max, N_PAD=triton.next_power_of_2(ids.shape[1]),
    )  # fmt: skip
