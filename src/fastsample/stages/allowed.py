"""Stage a: allowed tokens, from a grammar bitmask and from per-request allowed-id lists.

Definition: token ``j`` of row ``b`` stays only if its bit is set in the row's grammar
bitmask (when the row has one this step) and in its allowed-ids mask (when it has one);
every other token gets logit ``-inf`` (probability 0). Nothing else changes.

The grammar bitmask is xgrammar's (``allocate_token_bitmask`` / ``fill_next_token_bitmask``):
int32 ``(B', W)`` with ``32 * W >= V``, token ``j`` is bit ``j % 32`` of word ``j // 32``,
1 = allowed. Without ``bitmask_indices`` it has one row per logits row (``B' == B``); with
them (as xgrammar's ``apply_token_bitmask_inplace(..., indices=...)``), only the listed rows
are masked, each by the bitmask row of the same index, and the others are left alone; a
listed index outside ``[0, min(B, B'))`` masks nothing. Allowed ids (``StepParams``) were
packed into the same layout when the parameters were built.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops import bitmask


def check_bitmask(
    token_bitmask: object, bitmask_indices: object, batch: int, vocab: int, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Check the per-step grammar bitmask and its indices (raises naming the argument)."""
    if token_bitmask is None:
        if bitmask_indices is not None:
            raise ValueError("bitmask_indices was given without token_bitmask")
        return None, None
    if not isinstance(token_bitmask, Tensor):
        kind = type(token_bitmask).__name__
        raise TypeError(f"token_bitmask must be an int32 tensor, got {kind}")
    if token_bitmask.dtype != torch.int32 or token_bitmask.dim() != 2:
        raise ValueError(
            "token_bitmask must be int32 of shape (batch, ceil(vocab / 32)) (xgrammar's "
            f"allocate_token_bitmask), got {token_bitmask.dtype} {tuple(token_bitmask.shape)}"
        )
    if token_bitmask.device != device:
        raise ValueError(f"token_bitmask is on {token_bitmask.device}, the logits on {device}")
    if token_bitmask.shape[1] * bitmask.WORD_BITS < vocab:
        raise ValueError(
            f"token_bitmask covers {token_bitmask.shape[1] * 32} tokens, the logits have "
            f"{vocab}: allocate it with the full vocabulary (ceil({vocab} / 32) words)"
        )
    indices = None
    if bitmask_indices is None:
        if token_bitmask.shape[0] != batch:
            raise ValueError(
                f"token_bitmask has {token_bitmask.shape[0]} rows, the logits {batch}; pass "
                "bitmask_indices to mask only some rows"
            )
    elif isinstance(bitmask_indices, Tensor):
        if bitmask_indices.dim() != 1 or bitmask_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError("bitmask_indices must be a 1-D int tensor or a list of ints")
        if bitmask_indices.device != device:
            raise ValueError(f"bitmask_indices is on {bitmask_indices.device}, not {device}")
        indices = bitmask_indices.long()
    else:
        values = list(bitmask_indices)  # type: ignore[call-overload]
        for index in values:
            if isinstance(index, bool) or not isinstance(index, int):
                raise TypeError("bitmask_indices must hold Python ints")
            if not 0 <= index < min(batch, token_bitmask.shape[0]):
                raise ValueError(
                    f"bitmask_indices holds {index}, outside the rows of the logits ({batch}) "
                    f"and of token_bitmask ({token_bitmask.shape[0]})"
                )
        indices = torch.tensor(values, dtype=torch.int64, device=device)
    return token_bitmask[:, : bitmask.words_for(vocab)], indices


def allowed_words(
    token_bitmask: Tensor | None, indices: Tensor | None, allowed_mask: Tensor | None, batch: int
) -> Tensor | None:
    """``(B, W)`` int32 words of the tokens each row may draw, or None when every token may."""
    words = None
    if token_bitmask is not None:
        if indices is None:
            words = token_bitmask
        else:
            # Rows named by an index take the bitmask row of the same number, the others all
            # ones; an index outside the rows matches none (fixed shapes, no sync).
            rows = torch.arange(batch, device=token_bitmask.device)
            listed = (rows[:, None] == indices[None, :]).any(-1)
            mine = token_bitmask.index_select(0, rows.clamp_max(token_bitmask.shape[0] - 1))
            listed = listed & (rows < token_bitmask.shape[0])
            words = torch.where(listed[:, None], mine, -1)
    if allowed_mask is not None:
        words = allowed_mask if words is None else words & allowed_mask
    return words


def apply(source: Tensor, words: Tensor, out: Tensor, is_logits: bool) -> Tensor:
    """``out = source`` where allowed, ``-inf`` (probabilities: 0) elsewhere; returns ``out``
    (``source``'s shape, the dtype of the stages that follow)."""
    allowed = bitmask.unpack(words, source.shape[1])
    fill = torch.tensor(-math.inf if is_logits else 0.0, dtype=out.dtype, device=out.device)
    return torch.where(allowed, source.to(out.dtype), fill, out=out)
