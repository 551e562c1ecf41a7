"""Stage f: logprobs of the drawn tokens, the top-N tokens, ranks and requested ids.

Two modes (:data:`~fastsample.stages.params.LOGPROBS_MODES`):

* ``"processed"``: the distribution the tokens were drawn from, after every stage. A kept
  token's log-probability is ``log w - log W`` (its kept weight over the kept mass, float64),
  any other token's ``-inf``; a greedy row is the point mass at its first maximal index.
* ``"raw"``: the logits as the engine gave them, after the allowed-token masks only (vLLM's
  ``raw_logprobs``): ``x - logsumexp(x)`` in float64, with ``logsumexp(x) = m + log sum p -
  log p_m``, ``m`` the row maximum, ``p`` the row's softmax (torch's fused CPU kernel) and
  ``p_m`` its value at the first maximal entry; ``sum p`` from float32 block sums and a
  float64 total. Within ~5e-8 of the float64 logsumexp (the softmax's own float32 sum is only
  good to ~4e-6, which the second sum removes). On CPU in eager mode the softmax goes piece
  by piece (a row, or rows of up to 2^18 entries) through a scratch buffer that stays in
  cache, summed before the next piece: one read of the logits and no ``(B, V)`` write. For
  probabilities, ``log p - log sum p`` (float32 block sums, float64 total).

Nothing here returns a ``(B, V)`` log-softmax: the row's normalizer is one number, the top-N
come from the block maxima (:func:`fastsample.ops.select.top_entries`; the draw's own when the
raw and processed scores are one tensor), and the values at the drawn, top and requested ids
are gathered.

Ranks follow vLLM: the number of tokens at least as likely as the drawn one, itself
included. They are counted on the scores that order the distribution exactly (the processed
logits, or the raw ones), not on rounded log-probabilities. On CPU in eager mode only the
blocks whose maximum reaches the drawn score are read (a drawn token is most often among the
few largest: a few blocks), in pieces under torch's parallel grain; elsewhere one compare pass
per draw. A greedy row's ``j``-th draw has rank ``j`` in the processed mode (its ``j``
largest, in order).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..ops import scratch, threads
from ..ops.eager import host_readable
from ..ops.inverse_cdf import BLOCK, row_summaries
from ..ops.select import block_maxima, first_in_block, top_entries
from .draw import Drawn
from .output import SampleOutput


class RawNormalizer(NamedTuple):
    """What the raw mode needs of a row: its scores and their float64 log normalizer."""

    scores: Tensor  # (B, V) logits after the masks (or probabilities)
    log_total: Tensor  # (B,) float64: logsumexp of the logits, or log of the sum of probs
    is_logits: bool
    maxima: Tensor | None = None  # (B, blocks) block maxima of scores, when computed


def raw_normalizer(scores: Tensor, is_logits: bool, maxima: Tensor | None = None) -> RawNormalizer:
    """The float64 log normalizer of each row of ``scores`` (``maxima``: their block maxima,
    if the draw has them)."""
    if not is_logits:
        total = row_summaries(scores)[0].sum(-1)
        return RawNormalizer(scores, total.log(), False, maxima)
    if maxima is None:
        maxima = block_maxima(scores)
    block = maxima.argmax(-1, keepdim=True)  # the first block holding the row maximum
    peak = maxima.gather(1, block)
    first = first_in_block(scores, block)[:, None]
    # p = e / s with e = exp(x - m) and s their float32 sum; the e are exact to float32, the
    # sum of ~1e5 of them in float32 is not (~4e-6 relative): sum p again (float32 blocks,
    # float64 total), so that log(sum e) = log(sum p) - log(p at m) (e there is 1) to ~5e-8.
    mass, at_peak = _softmax_mass(scores, first)
    log_total = peak.squeeze(1).to(torch.float64) + mass.log() - at_peak.log()
    return RawNormalizer(scores, log_total, True, maxima)


# Elements of a piece of the softmax outside the serial mode: its buffer stays in cache.
_SOFTMAX_PIECE = 1 << 18


def _softmax_mass(scores: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
    """``(B,)`` float64 sums of each row's softmax ``p`` (float32 block sums, float64 total)
    and ``(B,)`` float64 ``p`` at column ``first`` (``(B, 1)``).

    The softmax goes piece by piece through a small scratch buffer that stays in cache,
    summed before the next piece overwrites it: one read of the logits, no ``(B, V)`` write.
    A piece is one row in the serial mode (torch's softmax opens no parallel region for one
    row; its block sums in pieces under the grain), else rows of up to ``_SOFTMAX_PIECE``
    entries; every row's numbers are the same whatever its piece."""
    batch, vocab = scores.shape
    full = vocab // BLOCK
    dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    serial = threads.serial_passes(scores.device, scores.numel())
    rows_per = 1 if serial else max(1, min(batch, _SOFTMAX_PIECE // max(vocab, 1)))
    if scores.device.type != "cpu" or torch.compiler.is_compiling():
        rows_per = batch  # one softmax: the pieces only save memory traffic on CPU
    buffer = scratch.buffer("raw softmax", (rows_per, vocab), dtype, scores.device)
    sums = torch.empty(batch, full, dtype=dtype, device=scores.device)
    tails = torch.empty(batch, dtype=dtype, device=scores.device) if vocab % BLOCK else None
    at_first = torch.empty(batch, 1, dtype=dtype, device=scores.device)
    def pieces() -> None:
        for start in range(0, batch, rows_per):
            stop = min(start + rows_per, batch)
            probs = _softmax(scores[start:stop], buffer[: stop - start])
            if serial:
                threads.blockwise_(probs, sums[start:stop], BLOCK, "sum")
            else:
                whole = probs[:, : full * BLOCK].reshape(stop - start, full, BLOCK)
                torch.sum(whole, -1, out=sums[start:stop])
            if tails is not None:  # the short last block
                torch.sum(probs[:, full * BLOCK :], -1, out=tails[start:stop])
            torch.gather(probs, 1, first[start:stop], out=at_first[start:stop])

    if serial:
        pieces()
    else:  # parallel regions over a long input: watched for stalls (fastsample.ops.threads)
        threads.watched(scores.device, pieces)
    mass = sums.to(torch.float64).sum(-1)
    if tails is not None:
        mass += tails.to(torch.float64)
    return mass, at_first.squeeze(1).to(torch.float64)


def _softmax(scores: Tensor, out: Tensor) -> Tensor:
    if scores.dtype in (torch.float16, torch.bfloat16):  # in float32, as the weights are
        scores = scores.float()
    return torch.ops.aten._softmax.out(scores, -1, False, out=out)


def _raw_at(raw: RawNormalizer, ids: Tensor) -> Tensor:
    """float64 raw log-probabilities at ``(B, c)`` ids in range."""
    values = raw.scores.gather(1, ids).to(torch.float64)
    if not raw.is_logits:
        values = values.log()
    return values - raw.log_total[:, None]


def count_at_least(scores: Tensor, values: Tensor, maxima: Tensor | None = None) -> Tensor:
    """``(B, n)`` int64: entries of each row of ``scores`` that are ``>= values[:, j]``
    (``maxima``: the block maxima of ``scores``, which let CPU eager calls read only the blocks
    that can hold such entries)."""
    columns = []
    for j in range(values.shape[1]):
        value = values[:, j]
        counted = None
        if maxima is not None and host_readable(scores) and scores.is_contiguous():
            counted = _count_in_reaching_blocks(scores, value, maxima)
        if counted is None:
            counted = torch.ge(scores, value[:, None]).sum(-1)
        columns.append(counted)
    return columns[0][:, None] if len(columns) == 1 else torch.stack(columns, 1)


# Blocks read per row (on average) past which the plain compare pass is cheaper.
_RANK_BLOCKS = 32


def _count_in_reaching_blocks(scores: Tensor, value: Tensor, maxima: Tensor) -> Tensor | None:
    """``(B,)`` count of entries ``>= value`` per row from the blocks whose maximum reaches it
    (the others hold none), read in pieces under the parallel grain (whole blocks are copied
    rows of a block view: ~4x faster than gathering by computed columns); None when too many
    blocks reach it (a drawn token far down the row, or a NaN value)."""
    batch, vocab = scores.shape
    # A NaN block maximum hides the block's other entries: such a block is read too.
    row, block = (maxima < value[:, None]).logical_not_().nonzero(as_tuple=True)
    if row.shape[0] > _RANK_BLOCKS * batch or row.shape[0] < batch:
        return None  # many blocks, or a row with none (NaN): the compare pass
    step = (threads.GRAIN - 1) // BLOCK
    if vocab % BLOCK == 0:  # whole blocks: rows of a (B * blocks, BLOCK) view, no index math
        full = vocab // BLOCK
        source = scores.view(batch * full, BLOCK)
        picked = row * full + block
        counts = torch.zeros(batch, dtype=torch.int32, device=scores.device)
        for start in range(0, row.shape[0], step):
            rows = row[start : start + step]
            content = source.index_select(0, picked[start : start + step])
            reached = content >= value.gather(0, rows)[:, None]
            counts.scatter_add_(0, rows, reached.sum(-1, dtype=torch.int32))
        return counts.to(torch.int64)
    offsets = torch.arange(BLOCK, device=scores.device)
    flat = scores.view(-1)
    counts = torch.zeros(batch, dtype=torch.int64, device=scores.device)
    for start in range(0, row.shape[0], step):
        rows, blocks = row[start : start + step], block[start : start + step]
        columns = blocks[:, None] * BLOCK + offsets
        entries = flat.gather(0, (rows[:, None] * vocab + columns.clamp_max(vocab - 1)).view(-1))
        reached = (entries.view(-1, BLOCK) >= value.gather(0, rows)[:, None]) & (columns < vocab)
        counts.scatter_add_(0, rows, reached.sum(-1))
    return counts


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
            top_ids = top_entries(raw.scores, num_top, raw.maxima)[1]
            top = torch.where(valid[:, None], _raw_at(raw, top_ids), -math.inf)
            out = out._replace(top_token_ids=top_ids, top_logprobs=top.to(out_dtype))
    if ranks:
        source = raw.scores if raw is not None else scores
        maxima = raw.maxima if raw is not None else drawn.maxima
        rank = count_at_least(source, source.gather(1, ids), maxima)
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
