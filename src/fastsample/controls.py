"""Sampling controls: temperature, top-k, top-p, min-p and greedy, per row, without sorting.

This module turns logits (or probabilities) and per-row controls into the *processed*
distribution, as unnormalized kept weights; :func:`fastsample.sample` draws from them and
:func:`process` returns them normalized.

Semantics, applied in this order (the README has the same list):

1. temperature ``T``: weights ``exp((x - max x) / T)`` for logits (``(p / max p)^(1/T)``
   for probabilities). ``T == 0`` is greedy: the first index among the maximal entries,
   no randomness consumed. Off: ``T == 1``.
2. top-k: keep the entries whose weight is ``>=`` the k-th largest (ties at the boundary
   kept). Off: ``k == 0`` or ``k >= V``.
3. top-p, on the distribution renormalized over the top-k survivors: keep the entries
   ``>= tau``, ``tau`` the largest threshold whose kept mass is ``>= top_p`` of the
   survivors' mass (the smallest most-likely set reaching ``top_p``, ties kept). Off: 1.
4. min-p: keep the entries ``>= min_p`` times the largest weight. Off: 0. With
   ``cut_order="vllm"`` min-p comes first instead, so top-p's mass is that of the tokens
   surviving min-p and top-k (vLLM's order); with ``cut_order="joint"`` top-p's mass is the
   whole row's, as top-k's (SGLang's and FlashInfer's joint order).

All cuts are thresholds on the same float32 weights (float64 for float64 input), so the kept
set is ``{i : w_i >= max(cut_k, cut_p, cut_min)}`` and every cut is exact on those weights
(:mod:`fastsample.ops.cuts`, :mod:`fastsample.ops.select`); logits that round to the same
weight are ties. ``-inf`` logits (grammar or bad-word masks) get weight 0 and are never drawn.

:func:`fastsample.sample` with a small ``top_k`` on logits (not float64; a Python int, or on
CPU a ``(B,)`` tensor with top-k on in every row) skips these weights altogether
(:mod:`fastsample.ops.small_top_k`), with the same draws (bitwise on CPU).

Controls are Python scalars (checked here; an off value skips its stage entirely) or
``(B,)`` tensors (every stage runs, values can change between calls without a recompile;
rows with out-of-range values are flagged invalid instead of raising, since checking them
would sync).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .kernels import backend as kernel_backend  # imports no triton
from .ops import threads
from .ops.cuts import keep_at_least, predecessor, row_cuts
from .ops.inverse_cdf import block_sums
from .ops.select import block_maxima, first_argmax
from .ops.validation import Control, Controls, check_controls, check_source, detached
from .ops.weights import (
    Processed,
    controls_in_range,
    probs_total_fits,
    weights_from_logits,
    weights_from_probs,
)

__all__ = [
    "Controls",
    "Processed",
    "check_controls",
    "check_source",
    "process",
    "processed_weights",
]


def processed_weights(
    logits: Tensor | None, probs: Tensor | None, controls: Controls, keep_maxima: bool = False
) -> Processed:
    """Kept weights of every row, with their block sums, total and validity.

    Arguments are already checked (exactly one of ``logits``/``probs``; ``controls`` from
    :func:`check_controls`). No host sync, fixed shapes.
    """
    source = logits if logits is not None else probs
    assert source is not None
    batch = source.shape[0]
    temperature = controls.temperature
    greedy_possible = isinstance(temperature, Tensor) or controls.all_greedy
    maxima = None
    if logits is not None:
        maxima = block_maxima(logits)
        weights, peak, valid = weights_from_logits(logits, temperature, maxima)
    else:
        weights, peak, valid = weights_from_probs(probs, temperature, need_copy=controls.filters)
        if greedy_possible or keep_maxima:
            maxima = block_maxima(probs)
    valid = valid & controls_in_range(controls, batch, source.device)
    if controls.top_k is not None and maxima is None:
        maxima = block_maxima(source)
    only_min_p = controls.top_k is None and controls.top_p is None
    if only_min_p and isinstance(controls.min_p, float) and logits is not None:
        # Every row's largest weight is exactly 1, so the cut is one number for the batch:
        # keep w >= float(min_p) as w > its predecessor, in place, no division.
        torch.nn.functional.threshold_(weights, predecessor(controls.min_p, weights.dtype), 0.0)
    else:
        cut = row_cuts(weights, peak, controls, source, maxima)
        if cut is not None:
            weights, _ = keep_at_least(weights, cut, out=weights)
    sums = block_sums(weights)
    total = sums.sum(-1)
    valid = valid & (total > 0) & (total < math.inf)
    greedy = greedy_ids = None
    if greedy_possible:
        assert maxima is not None
        greedy_ids = first_argmax(source, maxima)
        if isinstance(temperature, Tensor):
            greedy = temperature == 0
        else:
            greedy = torch.ones(batch, dtype=torch.bool, device=source.device)
    return Processed(weights, sums, total, valid, greedy, greedy_ids, maxima)


@threads.one_thread_calls
def process(
    logits: Tensor | None = None,
    probs: Tensor | None = None,
    *,
    temperature: Control = None,
    top_k: Control = None,
    top_p: Control = None,
    min_p: Control = None,
    cut_order: str = "transformers",
) -> Tensor:
    """The processed, renormalized distribution that :func:`fastsample.sample` draws from.

    Math: with weights ``w = exp((x - max x) / T)`` (``(p / max p)^(1/T)`` for
    ``probs``), keep ``w_i >= max(cut_k, cut_p, cut_min)`` (top-k, then top-p on the
    top-k survivors renormalized, then min-p, in the default ``cut_order``; see
    :mod:`fastsample.controls`) and divide by the kept mass. Greedy rows (``T == 0``) are
    one-hot at the first maximal index.

    Args:
        logits, probs: exactly one, ``(B, V)`` float16/bfloat16/float32/float64.
        temperature, top_k, top_p, min_p: Python numbers or ``(B,)`` tensors (same rules as
            :func:`fastsample.sample`).
        cut_order: ``"transformers"``, ``"vllm"`` (min-p first) or ``"joint"`` (top-p on
            the whole row), as in :func:`fastsample.sample`.

    Returns:
        ``(B, V)`` float32 (float64 for float64 input), rows summing to 1. Invalid rows
        (NaN/inf input, all ``-inf``, out-of-range tensor controls, probabilities whose total
        is ``2**128`` or more unless greedy: the rows :func:`fastsample.sample` flags) are
        all zeros. Never differentiable (the cuts are thresholds, greedy rows one-hot): an
        input that requires grad is detached, and the result has ``requires_grad=False``.

    Example:
        >>> process(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), top_k=2).round(decimals=3)
        tensor([[0.7310, 0.2690, 0.0000, 0.0000]])
    """
    source = check_source(logits, probs)
    batch, vocab = source.shape
    controls = check_controls(
        temperature, top_k, top_p, min_p, batch, vocab, source.device, cut_order
    )
    # Not differentiable (thresholds and a one-hot): values only, and no autograd graph.
    source = detached(source)
    logits, probs = (source, None) if logits is not None else (None, source)
    return process_checked(logits, probs, controls)


def process_checked(logits: Tensor | None, probs: Tensor | None, controls: Controls) -> Tensor:
    """:func:`process` once its arguments are checked (exactly one of ``logits``/``probs``,
    detached; ``controls`` from :func:`check_controls`)."""
    source = logits if logits is not None else probs
    assert source is not None
    vocab = source.shape[1]
    if kernel_backend.use_triton(source.device.type):  # FASTSAMPLE_BACKEND
        from .kernels import controls_ops

        return controls_ops.process(logits, probs, controls)
    got = processed_weights(logits, probs, controls)
    out = got.weights[:, :vocab] / got.total.to(got.weights.dtype)[:, None]
    if got.greedy is not None and got.greedy_ids is not None:
        one_hot = torch.zeros_like(out).scatter_(1, got.greedy_ids[:, None], 1.0)
        out = torch.where(got.greedy[:, None], one_hot, out)
    valid = got.valid
    fits = None if probs is None else probs_total_fits(probs, controls, got.total)
    if fits is not None:  # invalid where sample() is: an overflowing plain total
        valid = valid & (fits if got.greedy is None else fits | got.greedy)
    return torch.where(valid[:, None], out, 0.0)
