"""Structured outputs: the grammar bitmask reaches fastsample instead of the logits.

vLLM's runner calls ``apply_grammar_bitmask(scheduler_output, grammar_output, input_batch,
logits)`` before sampling: it puts the scheduler's bitmask (one row per structured-output
request and draft position, in the scheduler's order) into the batch's order and writes
``-inf`` into the logits with xgrammar. With the plugin the runner calls
:func:`intercept_grammar_bitmask` instead: it puts the bitmask in batch order, one row per
logits row (``-1``, every token allowed, for rows without a grammar), and leaves it for the
sampler that receives those logits (:func:`take`), which hands it to
:func:`fastsample.sample_step` (``token_bitmask=``) or, per draft position, to
:func:`fastsample.verify_chain`. The logits are not written.

When the sampler runs vLLM's own code instead (:func:`fastsample.vllm.vllm_sampling`, or a
batch the plugin leaves to vLLM) it first applies the bitmask to the logits (:func:`apply`),
as vLLM would have. A runner that is not the plugin's gets vLLM's function unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..ops import bitmask as bits
from .batch import FastsampleInputBatch
from .state import CALLS, STATE

_pending: tuple[Tensor, Tensor] | None = None  # (the logits, their bitmask)


def batch_order_bitmask(scheduler_output: Any, grammar_output: Any, req_ids: list[str],
                        rows: int) -> Tensor:  # fmt: skip
    """``(rows, W)`` int32: the scheduler's bitmask rows moved to the logits rows of their
    requests (a request's draft positions follow its first row), ``-1`` elsewhere."""
    words = np.asarray(grammar_output.grammar_bitmask)
    drafts = scheduler_output.scheduled_spec_decode_tokens
    first_row: dict[str, int] = {}
    row = 0
    for req_id in req_ids:
        first_row[req_id] = row
        row += 1 + len(drafts.get(req_id, ()))
    out = np.full((rows, words.shape[1]), -1, dtype=np.int32)
    source = 0
    for req_id in grammar_output.structured_output_request_ids:
        count = 1 + len(drafts.get(req_id, ()))
        start = first_row.get(req_id)
        if start is not None:
            out[start : start + count] = words[source : source + count]
        source += count
    return torch.from_numpy(out)


def intercept_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits) -> None:
    """The runner's ``apply_grammar_bitmask`` with the plugin installed."""
    global _pending
    if STATE.delegate or not isinstance(input_batch, FastsampleInputBatch):
        return _original()(scheduler_output, grammar_output, input_batch, logits)
    mask = batch_order_bitmask(scheduler_output, grammar_output, list(input_batch.req_ids),
                               logits.shape[0])  # fmt: skip
    _pending = (logits, fit_words(mask, logits.shape[1]).to(logits.device))
    return None


def fit_words(words: Tensor, vocab: int) -> Tensor:
    """The bitmask over exactly ``ceil(vocab / 32)`` words: extra words dropped, missing ones
    (a tokenizer smaller than the model's vocabulary) all ones, as xgrammar leaves the
    logits past the bitmask alone."""
    need = bits.words_for(vocab)
    if words.shape[1] >= need:
        return words[:, :need]
    pad = torch.full((words.shape[0], need - words.shape[1]), -1, dtype=words.dtype)
    return torch.cat((words, pad), 1)


def take(logits: Tensor) -> Tensor | None:
    """The bitmask left for these logits (and forget it), or None."""
    global _pending
    pending, _pending = _pending, None
    if pending is None or pending[0] is not logits:
        return None
    CALLS["bitmasks"] += 1
    return pending[1]


def apply(logits: Tensor) -> None:
    """Write the bitmask left for these logits into them (vLLM's own code samples them)."""
    mask(logits, take(logits))


def mask(logits: Tensor, words: Tensor | None) -> None:
    """``-inf`` where ``words`` (one row per logits row) disallow a token, in place."""
    if words is not None:
        allowed = bits.unpack(words, logits.shape[1])
        logits.masked_fill_(~allowed, -math.inf)


def _original():
    for _module, name, value in STATE.replaced:
        if name == "apply_grammar_bitmask":
            return value
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    return apply_grammar_bitmask
