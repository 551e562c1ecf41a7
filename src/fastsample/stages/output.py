"""What every sampler returns, and the bad-row policy that fills it.

:class:`SampleOutput` is the result of :func:`fastsample.sample`, :func:`fastsample.sample_step`,
:func:`fastsample.sample_from_probs` and ``distributed.sample``. :func:`finish` turns drawn ids
into it (probabilities, log-probabilities, invalid rows' documented result) and
:func:`flag_rows` applies the policy to rows found bad after the draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor


class SampleOutput(NamedTuple):
    """What every sampler returns.

    Attributes:
        token_ids: ``(B, n) int64``, ordered draws without replacement, always in
            ``[0, V)``. Invalid rows hold ``0, 1, ..., n-1``.
        probs: ``(B, n)``, each drawn token's probability under its row's normalized
            distribution (float32; float64 for float64 input). 0 for invalid rows and
            for padding slots (see ``valid``).
        valid: ``(B,) bool``. False for rows with NaN, +-inf or negative weights, a zero
            total or one of ``2**128`` or more (float32 sums overflow; float64 input: an
            infinite one), or an out-of-range tensor ``stream``; also False for rows with
            fewer positive weights than ``n``: their genuine draws come first and the later
            slots repeat the last genuine draw with ``probs`` 0 (never a zero-weight token).
        logprobs: ``(B, n)`` float32 (float64 for float64 input), ``log`` of ``probs``
            computed in float64 (``-inf`` where ``probs`` is 0).
        top_token_ids: ``(B, N) int64`` with ``top_logprobs=N`` in :func:`sample`: the N
            most likely tokens of the processed distribution, most likely first (ties by
            the lower index); None otherwise.
        top_logprobs: ``(B, N)`` their log-probabilities (``-inf`` outside the kept set
            and for invalid rows); None unless requested.
        ranks: ``(B, n) int64`` with ``token_ranks=True`` (:func:`fastsample.sample_step`):
            each drawn token's rank, vLLM's convention: the number of tokens at least as
            likely as it, itself included (1 for the most likely); 0 for invalid rows.
        requested_logprobs: ``(B, M)`` with ``logprob_token_ids``: the log-probabilities of
            those tokens (``-inf`` for padding ids, invalid rows, and tokens that cannot be
            drawn).

    With :func:`fastsample.sample_step`'s ``logprobs_mode="raw"``, ``logprobs``,
    ``top_logprobs``, ``ranks`` and ``requested_logprobs`` are those of the raw logits (after
    the allowed-token masks only); ``probs`` is always the processed probability.
    """

    token_ids: Tensor
    probs: Tensor
    valid: Tensor
    logprobs: Tensor | None = None
    top_token_ids: Tensor | None = None
    top_logprobs: Tensor | None = None
    ranks: Tensor | None = None
    requested_logprobs: Tensor | None = None


def finish(
    weights: Tensor,
    token_ids: Tensor,
    genuine: Tensor,
    total: Tensor,
    clean: Tensor,
    read: Callable[[Tensor], Tensor] | None = None,
    drawn: Tensor | None = None,
    all_clean: bool = False,
) -> SampleOutput:
    """Probabilities, log-probabilities and the bad-row policy for drawn ``token_ids``.

    ``read(columns)`` gives the weights when they were never materialized (``weights`` then
    only gives the dtype and device); ``drawn`` (``(B, n)`` float64), when given, are the
    weights at ``token_ids`` already read by the draw. ``all_clean``: every row is clean and
    every draw genuine (read on the host by the caller), so no row needs the policy."""
    batch, num_samples = token_ids.shape
    out_dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
    if drawn is None:
        drawn = weights.gather(1, token_ids) if read is None else read(token_ids)
        drawn = drawn.to(torch.float64)
    if all_clean:  # the same numbers as below where every row is kept
        token_probs = drawn / total[:, None]
        logprobs = drawn.log() - total.log()[:, None]
        return SampleOutput(token_ids, token_probs.to(out_dtype), clean, logprobs.to(out_dtype))
    keep = clean[:, None] & genuine
    token_probs = torch.where(keep, drawn / total[:, None], 0.0)
    logprobs = torch.where(keep, drawn.log() - total.log()[:, None], -math.inf)
    fallback = torch.arange(num_samples, device=weights.device).expand(batch, num_samples)
    token_ids = torch.where(clean[:, None], token_ids, fallback)
    all_genuine = genuine[:, 0] if num_samples == 1 else genuine.all(-1)
    return SampleOutput(
        token_ids, token_probs.to(out_dtype), clean & all_genuine, logprobs.to(out_dtype)
    )


def flag_rows(out: SampleOutput, ok: Tensor | None) -> SampleOutput:
    """The bad-row policy for rows that ``ok`` rejects (out-of-range tensor ``stream``)."""
    if ok is None:
        return out
    keep = ok[:, None]
    fallback = torch.arange(out.token_ids.shape[1], device=ok.device).expand_as(out.token_ids)
    logprobs, top, ranks = out.logprobs, out.top_logprobs, out.ranks
    requested = out.requested_logprobs
    return out._replace(
        token_ids=torch.where(keep, out.token_ids, fallback),
        probs=torch.where(keep, out.probs, 0.0),
        valid=out.valid & ok,
        logprobs=None if logprobs is None else torch.where(keep, logprobs, -math.inf),
        top_logprobs=None if top is None else torch.where(keep, top, -math.inf),
        ranks=None if ranks is None else torch.where(keep, ranks, 0),
        requested_logprobs=None if requested is None else torch.where(keep, requested, -math.inf),
    )
