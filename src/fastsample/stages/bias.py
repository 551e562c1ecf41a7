"""Stage b: logit bias, then min-tokens, on the logits after the allowed tokens.

Definitions (vLLM's ``LogitBiasLogitsProcessor`` and ``MinTokensLogitsProcessor``):

* logit bias: ``x[b, i] += bias[b, i]`` for every listed ``(i, bias)`` of row ``b`` (float32
  addition; an id listed twice gets both, in list order). A masked token stays ``-inf``.
* min-tokens: while row ``b`` has emitted fewer than ``min_tokens[b]`` tokens (its
  ``output_len``), ``x[b, s] = -inf`` for each of its stop ids ``s``.

Both are sparse: a scatter-add over the listed ids (padding ``-1`` adds 0 to column 0, which
changes no logit), so a row with 300 biased tokens costs 300 updates, not a pass over ``V``.
Min-tokens adds ``-inf`` (or 0 when inactive): ``x + -inf = -inf`` for every finite or
``-inf`` logit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def apply_bias_(x: Tensor, ids: Tensor, values: Tensor) -> Tensor:
    """``x[b, ids[b, m]] += values[b, m]`` in place for ids in range (padding adds nothing; an
    out-of-range tensor id was flagged with its row by :class:`StepParams`)."""
    inside = (ids >= 0) & (ids < x.shape[1])
    add = torch.where(inside, values, 0.0).to(x.dtype)
    return x.scatter_add_(1, torch.where(inside, ids, 0), add)


def apply_min_tokens_(
    x: Tensor, stop_ids: Tensor, min_tokens: int | Tensor, output_len: Tensor | int
) -> Tensor:
    """``x[b, stop_ids[b]] = -inf`` in place where ``output_len[b] < min_tokens[b]``."""
    active = torch.as_tensor(output_len, device=x.device) < min_tokens
    if active.dim() == 0:
        active = active.expand(x.shape[0])
    inside = (stop_ids >= 0) & (stop_ids < x.shape[1])
    add = torch.where(inside & active[:, None], -math.inf, 0.0).to(x.dtype)
    return x.scatter_add_(1, torch.where(inside, stop_ids, 0), add)
