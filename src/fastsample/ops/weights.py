"""Weights from logits or probabilities: the one formula every path shares.

``exp((x - max x) / T)`` for logits, ``(p / max p)^(1/T)`` for probabilities, in float32
(float64 for float64 input). The general control path (:mod:`fastsample.controls`), the
small-``top_k`` path (:mod:`fastsample.ops.small_top_k`) and the vocabulary shards
(:mod:`fastsample.distributed.shard`) all call :func:`logit_weights_` / :func:`prob_weights_`,
so a token gets bitwise the same weight on each.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import scratch, threads
from .validation import Control, Controls, plain_total_fits, total_fits


class Processed(NamedTuple):
    """The processed distribution of each row, before normalization.

    Attributes:
        weights: ``(B, W)`` kept weights (``W >= V``; columns past ``V`` are 0), float32
            (float64 for float64 input). Zero outside the kept set.
        sums: their :func:`~fastsample.ops.inverse_cdf.block_sums`, ``(B, blocks)`` float64.
        total: ``(B,)`` float64, the kept mass (the normalizer).
        valid: ``(B,)`` bool: finite input, sane control values, something kept.
        greedy: ``(B,)`` bool rows with temperature 0, or None when no row can be greedy.
        greedy_ids: ``(B,)`` the first maximal index (meaningful where ``greedy``), or None.
        maxima: block maxima of the input (reused for ``top_logprobs``), or None.
    """

    weights: Tensor
    sums: Tensor
    total: Tensor
    valid: Tensor
    greedy: Tensor | None
    greedy_ids: Tensor | None
    maxima: Tensor | None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of weights and cuts: float64 for float64 input, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# The smallest temperature divided by: positive temperatures below the smallest normal number
# of the weights' dtype would round to 0 (or a subnormal, which flush-to-zero turns into 0)
# and make every weight NaN. At this temperature the weights already are the T -> 0+ limit
# (1 at the row maximum, 0 elsewhere) unless two inputs differ by less than ~1e-36.
_SMALLEST_T = {dtype: torch.finfo(dtype).tiny for dtype in (torch.float32, torch.float64)}


def temperature_divisor(temperature: Control, dtype: torch.dtype) -> Tensor | float | None:
    """What :func:`divide_by_temperature_` divides by: a ``(B, 1)`` tensor of ``dtype`` for a
    tensor ``T``, a Python float, or None (nothing to divide). Greedy rows (``T == 0``) and bad
    tensor values use ``T = 1`` (they are resolved later); ``0 < T < tiny`` uses ``tiny`` (the
    dtype's smallest normal number, the T -> 0+ limit; see ``_SMALLEST_T``). Computed once, it
    can be reused for many columns of the same rows (:func:`logit_weights_divided_`)."""
    smallest = _SMALLEST_T.get(dtype) or torch.finfo(dtype).tiny
    if isinstance(temperature, Tensor):
        usable = (temperature > 0) & (temperature < math.inf)
        return torch.where(usable, temperature, 1.0).to(dtype).clamp_min_(smallest)[:, None]
    if temperature is not None and temperature != 0.0:
        return max(temperature, smallest)
    return None


def divide_by_temperature_(out: Tensor, temperature: Control) -> Tensor:
    """``out /= T`` in place, per row (see :func:`temperature_divisor`); a Python ``None`` or
    ``0`` leaves ``out`` alone."""
    divisor = temperature_divisor(temperature, out.dtype)
    return out if divisor is None else out.div_(divisor)


def logit_weights_(out: Tensor, logits: Tensor, shift: Tensor, temperature: Control) -> Tensor:
    """``out = exp((logits - shift[:, None]) / T)``, the one formula of weights from logits.

    The general path, the small-``top_k`` path and the vocabulary shards all call this (or
    :func:`logit_weights_divided_` with its divisor), so a logit gets bitwise the same weight
    on each (sub, then div, then exp, in ``out``'s dtype).
    """
    return logit_weights_divided_(out, logits, shift, temperature_divisor(temperature, out.dtype))


def logit_weights_divided_(
    out: Tensor,
    logits: Tensor,
    shift: Tensor,
    divisor: Tensor | float | None,
    in_pieces: bool = False,
) -> Tensor:
    """:func:`logit_weights_` with the :func:`temperature_divisor` computed beforehand.

    ``in_pieces``: for the chains of small ops (``out`` under torch's parallel grain), the
    ``exp`` in pieces that open no parallel region (:func:`fastsample.ops.threads.exp_`); the
    same numbers.
    """
    torch.sub(logits, shift[:, None], out=out)
    if divisor is not None:
        out.div_(divisor)
    # exp, not exp2 (2.6x faster on an AMD host): torch's CPU exp2 rounds the scalar tail of
    # its loop differently from the vector body, which would split ties and make a row's bits
    # depend on its place in the batch.
    return threads.exp_(out) if in_pieces else out.exp_()


def prob_weights_(out: Tensor, probs: Tensor, scale: Tensor, temperature: Control) -> Tensor:
    """``out = (probs / scale[:, None])^(1/T)``, the one formula of weights from
    probabilities (no power for ``T`` None or a Python 0), shared like :func:`logit_weights_`.
    """
    torch.div(probs, scale[:, None], out=out)
    if temperature is None or (not isinstance(temperature, Tensor) and temperature == 0.0):
        return out
    # (p / max p)^(1/T) as exp(log(.) / T): torch's CPU pow rounds the same input differently
    # in the vectorized body and the tail of its loop, which would split ties.
    return divide_by_temperature_(out.log_(), temperature).exp_()


def weights_from_logits(
    logits: Tensor, temperature: float | Tensor | None, maxima: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``exp((x - max) / T)`` into an even-width buffer (a zero column past an odd
    vocabulary); returns it, its row maximum (1 except for bad rows) and the finite-row flag."""
    batch, vocab = logits.shape
    dtype = compute_dtype(logits.dtype)
    best = maxima.amax(-1).to(dtype)
    # NaN fails both comparisons; a +inf maximum is a bad row, a -inf one has nothing left.
    finite = (best > -math.inf) & (best < math.inf)
    # Even: the radix once read float32 pairs as int64 and no longer needs it, but the block
    # layouts of small_top_k and the vocabulary shards mirror this buffer bitwise.
    width = vocab + vocab % 2
    # Kept per thread on CPU (32 MB at B=64, V=128,256): a fresh block that size came from
    # the OS whenever glibc had just trimmed its heap (after any large free, e.g. a sort
    # pipeline), ~8,000 page faults and 2-4 ms. It never outlives the call: the draw and
    # process() read from it and return tensors of their own.
    weights = scratch.buffer("general weights", (batch, width), dtype, logits.device)
    if width > vocab:
        weights[:, vocab:] = 0.0
    logit_weights_(weights[:, :vocab], logits, torch.where(finite, best, 0.0), temperature)
    return weights, torch.ones_like(best), finite


def weights_from_probs(
    probs: Tensor, temperature: float | Tensor | None, need_copy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(p / max p)^(1/T)`` (or ``p`` itself); returns the weights, their row maximum and
    the row-validity flag (no NaN, inf or negative entry, positive finite total)."""
    batch, vocab = probs.shape
    dtype = compute_dtype(probs.dtype)
    smallest = probs.amin(-1).to(dtype)
    best = probs.amax(-1).to(dtype)
    finite = (smallest >= 0) & (best > 0) & (best < math.inf)
    if keeps_raw_probs(probs, temperature, need_copy):
        return probs.contiguous(), best, finite
    width = vocab + vocab % 2
    weights = torch.zeros(batch, width, dtype=dtype, device=probs.device)
    # Copies that will be cut are normalized to a largest weight of 1 (same cost as a copy),
    # so dividing by a cut can never overflow.
    prob_weights_(weights[:, :vocab], probs, torch.where(finite, best, 1.0), temperature)
    return weights, torch.ones_like(best), finite


def keeps_raw_probs(probs: Tensor, temperature: Control, need_copy: bool) -> bool:
    """Whether :func:`weights_from_probs` hands ``probs`` over unscaled (nothing changes them
    and their dtype and even width suit the block sums)."""
    return (
        temperature is None
        and not need_copy
        and probs.dtype == compute_dtype(probs.dtype)
        and probs.shape[1] % 2 == 0
    )


def probs_total_fits(probs: Tensor, controls: Controls, total: Tensor) -> Tensor | None:
    """Rows of ``probs`` whose plain total fits float32 sums (:func:`~fastsample.ops.validation.
    total_fits`), so that a row is valid or not whatever the controls: ``total`` (the processed
    one) when the weights are the raw probabilities, None for float16 (65504 times any
    vocabulary stays far below 2**128), else one read pass (weights scaled to a maximum of 1
    never overflow, so their total cannot tell)."""
    if probs.dtype == torch.float16:
        return None
    if keeps_raw_probs(probs, controls.temperature, controls.filters):
        return total_fits(total, probs.dtype)
    return plain_total_fits(probs)


def controls_in_range(controls: Controls, batch: int, device: torch.device) -> Tensor:
    """Rows whose tensor controls hold legal values (NaN fails every comparison)."""
    ok = torch.ones(batch, dtype=torch.bool, device=device)
    t, k, p, mp = controls.temperature, controls.top_k, controls.top_p, controls.min_p
    if isinstance(t, Tensor):
        ok = ok & (t >= 0) & (t < math.inf)
    if isinstance(k, Tensor):
        ok = ok & (k >= 0)
    if isinstance(p, Tensor):
        ok = ok & (p > 0) & (p <= 1)
    if isinstance(mp, Tensor):
        ok = ok & (mp >= 0) & (mp <= 1)
    return ok
