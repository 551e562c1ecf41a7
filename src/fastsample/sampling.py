"""Public samplers over probabilities: :func:`fast_sample` and :func:`sample_from_probs`.

This module orchestrates: it checks arguments (before any work), picks the method, calls
the pure draw ops in :mod:`fastsample.race` and :mod:`fastsample.inverse_cdf`, computes
per-row validity and replaces bad rows by their documented result. Nothing here syncs
with the host unless ``check=True``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import _validation as v
from .inverse_cdf import inverse_cdf_draw, row_summaries
from .noise import UniformSource
from .race import race_draw
from .seeds import make_source


class SampleOutput(NamedTuple):
    """What every sampler returns.

    Attributes:
        token_ids: ``(B, n) int64``, ordered draws without replacement, always in
            ``[0, V)``. Invalid rows hold ``0, 1, ..., n-1``.
        probs: ``(B, n)``, each drawn token's probability under its row's normalized
            distribution (float32; float64 for float64 input). 0 for invalid rows and
            for padding slots (see ``valid``).
        valid: ``(B,) bool``. False for rows with NaN, +-inf or negative weights, or a
            zero (or float32-overflowing) total; also False for rows with fewer positive
            weights than ``n``: their genuine draws come first and the later slots
            repeat the last genuine draw with ``probs`` 0 (never a zero-weight token).
    """

    token_ids: Tensor
    probs: Tensor
    valid: Tensor


# Method choice for method="auto", from medians measured with `python -m fastsample bench`
# and a B x V sweep (2-core Xeon, torch 2.13, float32, one draw), in ms:
#
#   B x V          inverse_cdf   race      B x V           inverse_cdf   race
#   1 x 2048         0.205       0.148     64 x 2048         0.333       1.741
#   64 x 128         0.243       0.231     1024 x 8          0.318       0.278
#   1024 x 32        0.478       0.541     64 x 128256       1.9       ~110
#
# Below ~8k entries both are overhead-bound and the race has fewer ops; above, the race's
# per-entry uniform and log (~10 ns each on CPU) lose to one read pass. Seeded races pay
# Philox per entry, so seeded calls keep the inverse CDF.
# CUDA: not measured in this project yet (no GPU run so far). The race is ~6 kernels and the
# inverse CDF ~15 small kernels per draw plus one read pass, so by that count we take the
# race up to 2^20 entries and the inverse CDF above, until a GPU run of the benchmark says.
_CPU_RACE_MAX_ENTRIES = 8192
_CUDA_RACE_MAX_ENTRIES = 1 << 20


def choose_method(probs: Tensor, num_samples: int, seeded: bool = False) -> str:
    """The method ``"auto"`` resolves to for this input (see the measurements above)."""
    del num_samples
    entries = probs.shape[0] * probs.shape[1]
    limit = _CUDA_RACE_MAX_ENTRIES if probs.is_cuda else _CPU_RACE_MAX_ENTRIES
    return "race" if entries <= limit and not (seeded and not probs.is_cuda) else "inverse_cdf"


def _draw(probs: Tensor, num_samples: int, method: str, source: UniformSource) -> SampleOutput:
    """Draw with ``method`` and apply the bad-row policy. Arguments already checked."""
    batch = probs.shape[0]
    # Per-row fixed-shape reductions (batch-invariant, bitwise). The minimum propagates NaN,
    # so NaN rows fail `>= 0` below.
    sums, smallest = row_summaries(probs)
    if method == "race":
        total = sums.sum(-1)
        token_ids, genuine = race_draw(probs, num_samples, source)
    else:
        token_ids, genuine, total = inverse_cdf_draw(probs, num_samples, source, sums=sums)
    # `total > 0` fails for NaN and -inf, `total < inf` for +inf (one op each; isfinite is 3).
    clean = (smallest >= 0) & (total > 0) & (total < math.inf)

    out_dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    token_probs = (probs.gather(1, token_ids).to(torch.float64) / total[:, None]).to(out_dtype)
    fallback = torch.arange(num_samples, device=probs.device).expand(batch, num_samples)
    token_ids = torch.where(clean[:, None], token_ids, fallback)
    token_probs = torch.where(clean[:, None] & genuine, token_probs, 0.0)
    all_genuine = genuine[:, 0] if num_samples == 1 else genuine.all(-1)
    return SampleOutput(token_ids, token_probs, clean & all_genuine)


def _checked_source(
    probs: object,
    num_samples: object,
    generator: object,
    seed: object,
    step: object,
    stream: object,
    check: object,
) -> UniformSource:
    """Every argument check both samplers share, in order, then their uniform source.

    Raises before any work; with ``check=True`` also reads the values (a host sync).
    """
    probs = v.check_probs_tensor(probs)
    v.check_num_samples(num_samples, probs.shape[1])
    v.check_generator(generator, probs.device)
    source = make_source(generator, seed, step, stream, probs.shape[0], probs.device)  # type: ignore[arg-type]
    if v.check_flag(check, "check"):
        v.check_probs_values(probs)
    return source


def sample_from_probs(
    probs: Tensor,
    num_samples: int = 1,
    *,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    step: int | Tensor | None = None,
    stream: int | Tensor = 0,
    method: str = "auto",
    check: bool = False,
) -> SampleOutput:
    """Draw ``num_samples`` tokens per row, without replacement, from non-negative weights.

    Math: row ``b`` draws token ``i`` with probability ``p[b, i] / sum_j p[b, j]``; further
    draws repeat this with the drawn tokens removed (ordered draws without replacement, the
    law of ``torch.multinomial(probs, n, replacement=False)``).

    Args:
        probs: ``(B, V)`` float16, bfloat16, float32 or float64 weights; rows need not sum
            to 1. Not modified.
        num_samples: ``n``, a Python int with ``1 <= n <= V``.
        generator: a ``torch.Generator`` on ``probs``' device, or None for the default one.
        seed, step, stream: per-request counter-based randomness instead of ``generator``
            (see :mod:`fastsample.seeds`): Python ints or ``(B,)`` int64 tensors on
            ``probs``' device; row ``b``'s draw depends only on its own row of ``probs``
            and ``(seed[b], step[b], stream[b])``, never on the rest of the batch.
            ``step`` defaults to 0 and ``stream`` to ``Stream.SAMPLE`` (0).
        method: ``"inverse_cdf"`` (one read pass, one uniform per row per draw),
            ``"race"`` (exponential race, one uniform per entry) or ``"auto"`` (the faster
            for this device and shape; see :func:`choose_method`). Same law either way.
        check: if True, first read the values on the host and raise ``ValueError`` naming
            the first row with NaN, inf, negative weights or zero total (this syncs).

    Returns:
        :class:`SampleOutput` ``(token_ids (B, n) int64, probs (B, n), valid (B,) bool)``.
        Bad rows never raise (unless ``check``): they get ``valid=False`` and token ids
        ``0..n-1``; other rows are unaffected, bitwise.

    No host sync, no data-dependent shapes: safe under ``torch.compile(fullgraph=True)``
    (with ``generator=None``) and CUDA-graph capture.

    Example:
        >>> probs = torch.tensor([[0.1, 0.6, 0.3], [0.0, 0.0, 1.0]])
        >>> out = sample_from_probs(probs, generator=torch.Generator().manual_seed(0))
        >>> out.token_ids.shape, out.valid.tolist()
        (torch.Size([2, 1]), [True, True])
    """
    method = v.check_method(method)
    source = _checked_source(probs, num_samples, generator, seed, step, stream, check)
    if method == "auto":
        method = choose_method(probs, num_samples, seeded=seed is not None)
    return _draw(probs, num_samples, method, source)


def fast_sample(
    probs: Tensor,
    num_samples: int = 1,
    *,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    step: int | Tensor | None = None,
    stream: int | Tensor = 0,
    check: bool = False,
) -> tuple[Tensor, Tensor]:
    """Drop-in for the speculative-decoding helper: ``(sample_p, sample_index)``.

    Math: the exponential race, ``sample_index = topk(p / E, n)`` with ``E ~ Exp(1)`` per
    entry, i.e. ordered draws without replacement distributed exactly like
    ``torch.multinomial(probs, n, replacement=False)``, minus its host sync and device
    assert. Scores are float64 and the noise is never 0 or inf (see :mod:`fastsample.race`).

    Args:
        probs: ``(B, V)`` float16, bfloat16, float32 or float64 non-negative weights; rows
            need not sum to 1.
        num_samples: ``n``, a Python int with ``1 <= n <= V``.
        generator: a ``torch.Generator`` on ``probs``' device, or None for the default one.
        seed, step, stream: per-request counter-based randomness, as in
            :func:`sample_from_probs`; the race's noise is keyed by vocabulary index.
        check: if True, raise ``ValueError`` naming the first bad row (syncs).

    Returns:
        ``sample_p = probs.gather(1, sample_index)`` (``(B, n)``, probs' dtype, not
        renormalized) and ``sample_index`` (``(B, n) int64``).

    Bad rows: this function keeps the helper's two-tensor return and has no validity
    output. A row with NaN, inf, negative weights or zero total gets
    ``sample_index = 0, 1, ..., n-1`` (so ``sample_p`` shows that row's raw, bad entries);
    a row with fewer than ``n`` positive weights repeats its last genuine draw in the later
    slots. Use :func:`sample_from_probs` for a per-row ``valid`` flag, or ``check=True``.

    Example:
        >>> probs = torch.softmax(torch.randn(4, 32000), -1)
        >>> sample_p, sample_index = fast_sample(probs, 2)
        >>> sample_index.shape
        torch.Size([4, 2])
    """
    source = _checked_source(probs, num_samples, generator, seed, step, stream, check)
    token_ids = _draw(probs, num_samples, "race", source).token_ids
    return probs.gather(1, token_ids), token_ids
