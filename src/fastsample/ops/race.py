"""The exponential race (Gumbel-max): ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)``.

Why it is exact: ``E_i / p_i ~ Exp(p_i)`` are independent, and the smallest of independent
exponentials is index ``i`` with probability ``p_i / sum(p)``. Sorting the ``E_i / p_i``
(equivalently, ``topk`` of ``p_i / E_i``) gives the arrival order of the race, which is an
ordered draw without replacement (the Plackett-Luce law), the same as
``torch.multinomial(probs, n, replacement=False)``.

Numerics: scores are computed in float64 whatever the input dtype, so for float32 and half
inputs neither a large weight over a tiny noise overflows nor a tiny weight over a large noise
underflows; the noise comes from :func:`fastsample.noise.exponential_from_uniform` (never 0 or
inf, 2^-53 resolution where far-tail tokens win). float64 weights span float64's own range,
which the scores cannot: a row whose largest weight is below ``2**-961`` is scaled up by a
power of two (into ``[1/2, 1)``), one whose largest weight is ``2**969`` or more is scaled down
just below it (:func:`power_of_two_scales`; other rows are left as they are), and a positive
weight's score is never below the smallest positive float64. Without that, a row of subnormal
weights scored 0 (a zero-weight token drawn, the row flagged invalid), a positive weight far
below the others could score 0 (its later draw not genuine), and weights near the float64
maximum scored ``inf`` (ties won by the lower index: a biased law). Scaling by a power of two
is exact, so the order of the scores is unchanged wherever they were representable. It costs
one uniform per vocabulary entry: cheap on a GPU, about 100x one read pass on a CPU, where the
inverse-CDF method is used.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .noise import UniformSource, exponential_from_uniform

_LIFT = 2.0**64  # lifts a subnormal float64 into the normal range, exactly
_SMALLEST = 2.0**-1074  # the smallest positive float64


def power_of_two_scales(probs: Tensor) -> tuple[Tensor, Tensor]:
    """``(up, down)``, ``(B, 1)`` float64 powers of two ``2**h1`` and ``2**-h2`` with
    ``h1 + h2 = n`` per row: with the row's largest weight ``m 2**e`` (``m`` in ``[1/2, 1)``),
    ``n = -e`` if ``e < -960`` (into ``[1/2, 1)``: its scores are normal numbers), ``n = 969 - e``
    if ``e > 969`` (below ``2**969``: no score reaches ``2**1024``), else 0 (as are rows whose
    largest weight is 0, infinite, NaN or negative: their draws are not used).

    Scores are ``(p / (E * down)) * up = p * 2**n / E`` rounded once: ``E * down`` and the
    product by ``up`` are exact (``|h1|, |h2| <= 537``; every intermediate is normal). The
    exponent is read from the bit pattern (a subnormal maximum lifted by ``2**64`` first), the
    same integer steps as the Triton race kernel.
    """
    peak = probs.amax(-1, keepdim=True)
    usable = (peak > 0) & (peak < math.inf)
    subnormal = ((peak.view(torch.int64) >> 52) & 0x7FF) == 0
    lifted = torch.where(subnormal, peak * _LIFT, peak)
    field = (lifted.view(torch.int64) >> 52) & 0x7FF
    exponent = field - torch.where(subnormal, 1086, 1022)  # peak = m 2**exponent, m in [.5, 1)
    n = torch.where(exponent < -960, -exponent, torch.where(exponent > 969, 969 - exponent, 0))
    n = torch.where(usable, n, 0)
    h1 = n >> 1
    h2 = n - h1
    up = ((h1 + 1023) << 52).view(torch.float64)
    down = ((1023 - h2) << 52).view(torch.float64)
    return up, down


def race_draw(probs: Tensor, num_samples: int, source: UniformSource) -> tuple[Tensor, Tensor]:
    """Ordered draws without replacement by the exponential race.

    Args:
        probs: ``(B, V)`` non-negative weights, any float dtype; rows need not sum to 1.
        num_samples: ``n``, static, ``1 <= n <= V``.
        source: uniforms; ``entry_uniforms(0, V)`` is consumed once.

    Returns:
        ``token_ids (B, n) int64`` and ``genuine (B, n) bool``: slot ``k`` is a real draw
        (a positive-weight token). A row with fewer than ``n`` positive weights has its
        later slots filled with its last genuine draw (``genuine`` False there), so a
        zero-weight token is never returned.
    """
    vocab = probs.shape[1]
    noise = exponential_from_uniform(source.entry_uniforms(0, vocab))
    # Scores overwrite the float64 noise buffer. Memory: the noise is 2x a float32 input,
    # and CPU kernels also make a float64 copy of probs for the mixed-dtype division (CUDA
    # kernels cast on the fly); the CPU default is the inverse CDF, at ~3% extra.
    if probs.dtype == torch.float64:  # scaled into range (see the module docstring)
        up, down = power_of_two_scales(probs)
        scores = torch.div(probs, noise.mul_(down), out=noise).mul_(up)
        # A positive weight whose score underflowed stays positive (ahead of zero weights).
        scores = torch.where((scores == 0) & (probs > 0), _SMALLEST, scores)
    else:
        scores = torch.div(probs, noise, out=noise)
    if num_samples == 1:
        token_ids = scores.argmax(-1, keepdim=True)
        top_scores = scores.gather(1, token_ids)
    else:
        top_scores, token_ids = scores.topk(num_samples, dim=-1, sorted=True)
    genuine = top_scores > 0
    return repeat_last_genuine(token_ids, genuine), genuine


def repeat_last_genuine(token_ids: Tensor, genuine: Tensor) -> Tensor:
    """Replace slots after the last genuine draw by that draw (``genuine`` is a prefix)."""
    num_samples = token_ids.shape[1]
    if num_samples == 1:
        return token_ids
    count = genuine.sum(-1, keepdim=True)
    slots = torch.arange(num_samples, device=token_ids.device)
    source_slot = torch.minimum(slots, count - 1).clamp_(min=0)
    return token_ids.gather(1, source_slot)
