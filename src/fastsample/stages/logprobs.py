"""Stage f: logprobs of the drawn tokens, the top-N tokens, ranks and requested ids.

Two modes (:data:`~fastsample.stages.params.LOGPROBS_MODES`):

* ``"processed"``: the distribution the tokens were drawn from, after every stage. A kept
  token's log-probability is ``log w - log W`` (its kept weight over the kept mass, float64),
  any other token's ``-inf``; a greedy row is the point mass at its first maximal index.
* ``"raw"``: the logits as the engine gave them, after the allowed-token masks only (vLLM's
  ``raw_logprobs``): ``x - logsumexp(x)``, the logsumexp in float64 from one pass over the
  row (``max``, then ``sum exp(x - max)`` a few rows at a time). For probabilities,
  ``log p - log sum p``.

Nothing here materializes a ``(B, V)`` log-softmax: the row's normalizer is one number, the
top-N come from the block maxima (:func:`fastsample.ops.select.top_entries`), and the values
at the drawn, top and requested ids are gathered.

Ranks follow vLLM: the number of tokens at least as likely as the drawn one, itself
included. They are counted on the scores that order the distribution exactly (the processed
logits, or the raw ones), not on rounded log-probabilities: one compare pass per draw. A
greedy row's ``j``-th draw has rank ``j`` in the processed mode (its ``j`` largest, in order).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..ops.pieces import row_pieces
from ..ops.select import block_maxima, top_entries
from .draw import Drawn
from .output import SampleOutput

# Rows per piece of the normalizer's pass: a few MiB of scratch that stays in cache.
_PIECE_ELEMENTS = 1 << 20


class RawNormalizer(NamedTuple):
    """What the raw mode needs of a row: its scores and their float64 log normalizer."""

    scores: Tensor  # (B, V) logits after the masks (or probabilities)
    log_total: Tensor  # (B,) float64: logsumexp of the logits, or log of the sum of probs
    is_logits: bool


def raw_normalizer(scores: Tensor, is_logits: bool) -> RawNormalizer:
    """One pass over ``scores``: the float64 log normalizer of each row."""
    batch, vocab = scores.shape
    if not is_logits:
        total = scores.sum(-1, dtype=torch.float64)
        return RawNormalizer(scores, total.log(), False)
    peak = block_maxima(scores).amax(-1).to(torch.float32)
    shift = torch.where(peak.abs() < math.inf, peak, 0.0)
    sums = []
    for rows in row_pieces(batch, vocab, scores.device, _PIECE_ELEMENTS):
        part = scores[rows].to(torch.float32) - shift[rows, None]
        sums.append(part.exp_().sum(-1, dtype=torch.float64))
    total = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64, device=scores.device)
    return RawNormalizer(scores, total.log() + shift.to(torch.float64), True)


def _raw_at(raw: RawNormalizer, ids: Tensor) -> Tensor:
    """float64 raw log-probabilities at ``(B, c)`` ids in range."""
    values = raw.scores.gather(1, ids).to(torch.float64)
    if not raw.is_logits:
        values = values.log()
    return values - raw.log_total[:, None]


def count_at_least(scores: Tensor, values: Tensor) -> Tensor:
    """``(B, n)`` int64: entries of each row of ``scores`` that are ``>= values[:, j]``."""
    columns = [torch.ge(scores, values[:, j : j + 1]).sum(-1) for j in range(values.shape[1])]
    return torch.stack(columns, 1)


def attach(
    drawn: Drawn,
    scores: Tensor,
    raw: RawNormalizer | None,
    num_top: int,
    ranks: bool,
    requested: Tensor | None,
) -> SampleOutput:
    """The logprob fields of ``drawn.out``: raw ones when ``raw`` is given (then the drawn
    tokens' ``logprobs`` and ``top_logprobs`` are replaced), ranks and requested ids in the
    same mode. ``scores`` orders the processed distribution (the logits the draw read)."""
    out = drawn.out
    ids = out.token_ids
    valid = out.valid
    out_dtype = out.probs.dtype
    if raw is not None:
        logp = _raw_at(raw, ids)
        out = out._replace(logprobs=torch.where(valid[:, None], logp, -math.inf).to(out_dtype))
        if num_top:
            top_ids = top_entries(raw.scores, num_top)[1]
            top = torch.where(valid[:, None], _raw_at(raw, top_ids), -math.inf)
            out = out._replace(top_token_ids=top_ids, top_logprobs=top.to(out_dtype))
    if ranks:
        source = raw.scores if raw is not None else scores
        rank = count_at_least(source, source.gather(1, ids))
        if raw is None and drawn.greedy is not None:  # the j largest, in order
            order = torch.arange(1, ids.shape[1] + 1, device=ids.device).expand_as(ids)
            rank = torch.where(drawn.greedy[:, None], order, rank)
        out = out._replace(ranks=torch.where(valid[:, None], rank, 0))
    if requested is not None:
        vocab = scores.shape[1]
        inside = (requested >= 0) & (requested < vocab)
        safe = torch.where(inside, requested, 0)
        logp = _raw_at(raw, safe) if raw is not None else _processed_at(drawn, safe, ids)
        keep = inside & valid[:, None]
        out = out._replace(requested_logprobs=torch.where(keep, logp, -math.inf).to(out_dtype))
    return out


def _processed_at(drawn: Drawn, ids: Tensor, drawn_ids: Tensor) -> Tensor:
    """float64 processed log-probabilities at ``(B, c)`` ids in range."""
    point = torch.where(ids == drawn_ids[:, :1], 0.0, -math.inf).to(torch.float64)
    if drawn.weights_at is None:  # every row greedy
        return point
    assert drawn.total is not None
    kept = drawn.weights_at(ids).to(torch.float64)
    logp = kept.log() - drawn.total.log()[:, None]
    if drawn.greedy is not None:
        logp = torch.where(drawn.greedy[:, None], point, logp)
    return logp
