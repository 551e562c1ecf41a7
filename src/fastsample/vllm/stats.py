"""The penalties' state when vLLM's batch changes: carried over, new requests built fast.

Every time a request joins or leaves, vLLM rebuilds its metadata and the plugin its plan. The
:class:`~fastsample.TokenStats` of the requests that stay are still right (they were updated
with every token they emitted), so they are carried over by request id (one gather of their
rows); only the requests that joined are built, from their prompt and emitted tokens.

Building a row never makes a ``(B, V)`` pass beyond zeroing its counts: the prompt and seen
bitmasks are set word by word from the ids (sorted, duplicates dropped, one bit per id added
into its word: with no duplicate the sum is the OR), and the counts by one scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..ops import bitmask
from ..stages import TokenStats
from ..stages.state import counts_dtype, shift_in

MAX_OUTPUT_TOKENS = 32767
"""The counts' range (int16): a request emitting more saturates its counts at this value."""


def id_words(ids: Tensor, vocab: int) -> Tensor:
    """``(B, ceil(V / 32))`` int32 bitmask of ``(B, L)`` int64 ids (outside ``[0, V)``: none)."""
    batch = ids.shape[0]
    words = torch.zeros(batch, bitmask.words_for(vocab), dtype=torch.int64, device=ids.device)
    if ids.shape[1] == 0:
        return bitmask.as_int32(words)
    inside = (ids >= 0) & (ids < vocab)
    ordered = torch.where(inside, ids, -1).sort(-1).values
    fresh = torch.ones_like(ordered, dtype=torch.bool)
    fresh[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    keep = fresh & (ordered >= 0)
    safe = ordered.clamp_min(0)
    bits = torch.where(keep, torch.ones_like(safe) << (safe % bitmask.WORD_BITS), 0)
    words.scatter_add_(1, safe // bitmask.WORD_BITS, bits)
    return bitmask.as_int32(words)


def stats_from_ids(prompts: Tensor, outputs: Tensor, vocab: int, history: int = 0) -> TokenStats:
    """The state of requests with these prompts and emitted tokens (``(B, L)`` int64, padded
    at the end with ids outside ``[0, V)``); ``history``: how many of the latest context tokens
    it keeps (DRY, no-repeat n-grams, ``penalty_last_n``)."""
    batch, device = prompts.shape[0], prompts.device
    outputs = outputs.to(device)
    inside = (outputs >= 0) & (outputs < vocab)
    counts = torch.zeros(batch, vocab, dtype=counts_dtype(MAX_OUTPUT_TOKENS), device=device)
    if outputs.shape[1]:
        counts.scatter_add_(1, torch.where(inside, outputs, 0), inside.to(counts.dtype))
    prompt = id_words(prompts, vocab)
    seen = prompt | id_words(outputs, vocab)
    window = None
    if history:
        window = torch.full((batch, history), -1, dtype=torch.int64, device=device)
        for ids in (prompts, outputs):  # each padded at the end: valid entries first
            window = shift_in(window, torch.where((ids >= 0) & (ids < vocab), ids, -1))
    return TokenStats(prompt, counts, inside.sum(-1), seen, MAX_OUTPUT_TOKENS, window)


def carried(previous: TokenStats, source: Sequence[int], build) -> TokenStats:
    """The batch's state: row ``b`` is ``previous``'s row ``source[b]``, or, where that is -1,
    comes from ``build(rows)`` (the state of those rows only, in order)."""
    new_rows = [row for row, s in enumerate(source) if s < 0]
    if len(new_rows) == len(source):
        return build(new_rows)
    index = torch.tensor([max(s, 0) for s in source], dtype=torch.int64)
    state = previous.select(index.to(previous.device))
    if new_rows:
        state.assign(new_rows, build(new_rows))
    return state
