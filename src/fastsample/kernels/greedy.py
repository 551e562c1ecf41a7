"""Greedy sampling in one Triton launch: ``sample(..., temperature=0)`` with one draw.

Math (as :func:`fastsample.sampling._all_greedy` with ``n = 1``): the token is the first index
among the row's maximal entries, with probability 1 (log-probability 0). No weights, no
randomness: one pass over the row per program (:func:`fastsample.kernels.controls.scan_row`).

Bad rows: logits with NaN, a ``+inf`` maximum or all ``-inf``; probabilities with NaN, a
negative entry, or no positive finite maximum; and, with a ``(B,)`` tensor ``stream``, a
value outside ``[0, 2**24)``. They get token 0, probability 0, log-probability ``-inf`` and
``valid`` False; other rows never see them.

Shapes and dtypes: source ``(B, V)`` float16/bfloat16/float32/float64; outputs ``ids (B, 1)``
int64, ``probs``/``logprobs (B, 1)`` float32 (float64 for float64 input), ``valid (B,)`` bool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.inverse_cdf import BLOCK
from . import launch
from .controls import scan_row, stream_in_range
from .philox import INTERPRETED
from .select import tile_for


@triton.jit
def _greedy_kernel(
    src_ptr, src_stride, n, stream_ptr, ids_ptr, p_ptr, logp_ptr, valid_ptr,
    IS_LOGITS: tl.constexpr, IS_F64: tl.constexpr, STREAM_ROWS: tl.constexpr,
    TILE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    _, best_id, finite, _ = scan_row(src_ptr + row * src_stride, n, IS_LOGITS, IS_F64, TILE, BLOCK)
    valid = finite & stream_in_range(stream_ptr, row, STREAM_ROWS)
    tl.store(ids_ptr + row, tl.where(valid, best_id, 0))
    tl.store(p_ptr + row, tl.where(valid, 1.0, 0.0))
    tl.store(logp_ptr + row, tl.where(valid, 0.0, float("-inf")))
    tl.store(valid_ptr + row, valid)


def outputs(source: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Empty ``(ids, probs, logprobs, valid)`` for ``source`` (also the fake kernel's)."""
    batch = source.shape[0]
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    return (
        source.new_empty((batch, 1), dtype=torch.int64),
        source.new_empty((batch, 1), dtype=dtype),
        source.new_empty((batch, 1), dtype=dtype),
        source.new_empty((batch,), dtype=torch.bool),
    )


def greedy(
    source: Tensor, is_logits: bool, stream: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(token_ids, probs, logprobs, valid)`` of an all-greedy single draw, one launch."""
    if source.stride(-1) != 1:
        source = source.contiguous()
    batch, vocab = source.shape
    ids, p_out, logp_out, valid = outputs(source)
    if batch:
        launch.count_launch()
        launch.launcher(_greedy_kernel, INTERPRETED)[(batch,)](
            source, source.stride(0), vocab, stream if stream is not None else ids,
            ids, p_out, logp_out, valid,
            IS_LOGITS=is_logits, IS_F64=source.dtype == torch.float64,
            STREAM_ROWS=stream is not None,
            TILE=max(tile_for(vocab, INTERPRETED), BLOCK), BLOCK=BLOCK,
        )  # fmt: skip
    return ids, p_out, logp_out, valid
