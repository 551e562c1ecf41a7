"""One causal LM with its own KV cache and a per-row mask over the cached positions.

Every decoding loop here feeds a model through :class:`CachedModel`: it owns a fresh
``DynamicCache``, the ``(B, cached)`` key mask that goes with it, and calls the model with
explicit per-row position ids. Position ids count each row's real tokens only, so a row's
positions do not depend on its left padding or on the holes described next.

Speculative decoding writes every drafted token into the cache and then masks the rejected
ones (:meth:`CachedModel.mask_columns`): a masked key is invisible to every later query,
and position ids skip it, so a row with holes computes exactly what it would compute without
them. Rows can thus accept different numbers of tokens while the cache stays one
rectangular tensor; the cost is cache columns that are never read again.

A masked position is always preceded by at least one real token of its row (the prompt),
so no query attends to nothing (which would turn attention into NaN).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache


def prompt_positions(attention_mask: Tensor) -> Tensor:
    """Position ids of a left-padded prompt: real tokens count from 0, padding gets 1.

    The same rule as transformers' generate, so greedy decoding reproduces it exactly.
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


class CachedModel:
    """A causal LM, its ``DynamicCache`` and the key mask of every cached column."""

    def __init__(self, model: Any, batch: int, device: torch.device) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed the forward argument past_key_values to cache.
        self.cache_argument = "cache" if "cache" in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params
        # Without position ids a model counts positions from the cache length (holes included).
        self.takes_positions = "position_ids" in params
        self.cache = DynamicCache()
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)

    @property
    def length(self) -> int:
        """Columns cached so far (real, padding and masked)."""
        return self.mask.shape[1]

    def __call__(
        self, tokens: Tensor, valid: Tensor, positions: Tensor, last_only: bool = False
    ) -> Tensor:
        """Append ``tokens (B, n)`` to the cache and return their logits ``(B, n or 1, V)``.

        ``valid (B, n)`` marks real tokens (False: padding or a hole, never attended to);
        ``positions (B, n)`` are their position ids. ``last_only`` computes only the last
        column's logits where the model allows it.
        """
        self.mask = torch.cat((self.mask, valid.to(torch.long)), dim=1)
        kwargs: dict[str, Any] = {self.cache_argument: self.cache}
        if self.takes_positions:
            kwargs["position_ids"] = positions
        if last_only and self.keeps_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=tokens,
            attention_mask=self.mask,
            use_cache=True,
            return_dict=True,
            **kwargs,
        )
        returned = getattr(out, self.cache_argument, None)
        if returned is not None:
            self.cache = returned
        return out.logits

    def mask_columns(self, count: int, keep: Tensor) -> None:
        """Set the key mask of the last ``count`` cached columns to ``keep (B, count)``."""
        if count > 0:
            self.mask[:, self.length - count :] = keep.to(torch.long)
