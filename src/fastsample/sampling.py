"""Public samplers over probabilities: :func:`fast_sample` and :func:`sample_from_probs`.

This module orchestrates: it checks arguments (before any work), picks the method, calls
the pure draw ops in :mod:`fastsample.race` and :mod:`fastsample.inverse_cdf`, computes
per-row validity and replaces bad rows by their documented result. Nothing here syncs
with the host unless ``check=True``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import backend
from .ops import threads
from .ops import validation as v
from .ops.inverse_cdf import inverse_cdf_draw, row_summaries
from .ops.noise import UniformSource
from .ops.race import race_draw
from .ops.seeds import check_stream_values, make_source, stream_ok
from .ops.validation import check_source
from .stages import SampleOutput, StepParams, sample_step
from .stages.output import finish

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
    # Per-row fixed-shape reductions (batch-invariant, bitwise). The minimum propagates NaN,
    # so NaN rows fail `>= 0` below.
    sums, smallest = row_summaries(probs)
    if method == "race":
        total = sums.sum(-1)
        token_ids, genuine = race_draw(probs, num_samples, source)
    else:
        token_ids, genuine, total = inverse_cdf_draw(probs, num_samples, source, sums=sums)
    # `total > 0` fails for NaN and -inf, `total_fits` for +inf and float32 overflow (one op
    # each; isfinite is 3).
    clean = (smallest >= 0) & (total > 0) & v.total_fits(total, probs.dtype)
    ok = stream_ok(source)
    if ok is not None:  # an out-of-range tensor stream: flagged like a bad value
        clean = clean & ok

    return finish(probs, token_ids, genuine, total, clean)


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
        check_stream_values(source)
    return source


@threads.one_thread_calls
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
            to 1. Not modified. Sampling is not differentiable: a tensor that requires grad is
            detached (after the argument checks), so no output carries an autograd graph.
        num_samples: ``n``, a Python int with ``1 <= n <= V``.
        generator: a ``torch.Generator`` on ``probs``' device, or None for the default one.
        seed, step, stream: per-request counter-based randomness instead of ``generator``
            (see :mod:`fastsample.seeds`): Python ints or ``(B,)`` int64 tensors on
            ``probs``' device; row ``b``'s draw depends only on its own row of ``probs``
            and ``(seed[b], step[b], stream[b])``, never on the rest of the batch.
            ``step`` defaults to 0 and ``stream`` to ``Stream.SAMPLE`` (0). A Python
            ``stream`` outside ``[0, 2**24)`` raises; a tensor value out of range flags its row
            invalid (checking it would sync).
        method: ``"inverse_cdf"`` (one read pass, one uniform per row per draw),
            ``"race"`` (exponential race, one uniform per entry) or ``"auto"`` (the faster
            for this device and shape; see :func:`choose_method`). Same law either way.
        check: if True, first read the values on the host and raise ``ValueError`` naming
            the first row with NaN, inf, negative weights, a zero or overflowing total, or an
            out-of-range tensor ``stream`` (this syncs).

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
    probs = v.detached(probs)  # sampling is not differentiable: values only
    if method == "auto":
        method = choose_method(probs, num_samples, seeded=seed is not None)
    if backend.use_triton(probs.device.type):  # FASTSAMPLE_BACKEND; kernels/backend.py
        ids, token_probs, logprobs, valid = backend.kernel_ops().sample_from_probs(
            probs, num_samples, method, source
        )
        # The kernels apply the whole bad-row policy, out-of-range tensor streams included.
        return SampleOutput(ids, token_probs, valid, logprobs)
    return _draw(probs, num_samples, method, source)


@threads.one_thread_calls
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
            need not sum to 1. Detached if it requires grad: ``sample_p`` carries no graph
            (``probs.gather(1, sample_index)`` on your side does, if you need one).
        num_samples: ``n``, a Python int with ``1 <= n <= V``.
        generator: a ``torch.Generator`` on ``probs``' device, or None for the default one.
        seed, step, stream: per-request counter-based randomness, as in
            :func:`sample_from_probs`; the race's noise is keyed by vocabulary index.
        check: if True, raise ``ValueError`` naming the first bad row (syncs).

    Returns:
        ``sample_p = probs.gather(1, sample_index)`` (``(B, n)``, probs' dtype, not
        renormalized) and ``sample_index`` (``(B, n) int64``).

    Bad rows: this function keeps the helper's two-tensor return and has no validity
    output. A row with NaN, inf, negative weights, a zero or overflowing total (as in
    :class:`SampleOutput`) or an out-of-range tensor ``stream`` gets
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
    probs = v.detached(probs)  # sampling is not differentiable: values only
    if backend.use_triton(probs.device.type):  # FASTSAMPLE_BACKEND; kernels/backend.py
        # The kernel applies the bad-row policy, out-of-range tensor streams included.
        return backend.kernel_ops().fast_sample(probs, num_samples, source)
    token_ids = _draw(probs, num_samples, "race", source).token_ids
    return probs.gather(1, token_ids), token_ids


@threads.one_thread_calls
def sample(
    logits: Tensor | None = None,
    probs: Tensor | None = None,
    *,
    temperature: float | Tensor | None = None,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    num_samples: int = 1,
    seed: int | Tensor | None = None,
    step: int | Tensor | None = None,
    stream: int | Tensor = 0,
    generator: torch.Generator | None = None,
    top_logprobs: int = 0,
    cut_order: str = "transformers",
    check: bool = False,
) -> SampleOutput:
    """Sample with temperature, top-k, top-p, min-p and greedy, per row, exactly.

    Math: each row's processed distribution is ``w / sum(w)`` with weights
    ``w = exp((x - max x) / T)`` (``(p / max p)^(1/T)`` for ``probs``) kept where
    ``w_i >= max(cut_k, cut_p, cut_min)``:

    1. ``cut_k``: the k-th largest weight (ties at the boundary kept);
    2. ``cut_p``: on the top-k survivors renormalized, the largest threshold whose kept
       mass is ``>= top_p`` (the smallest most-likely set reaching ``top_p``, ties kept);
    3. ``cut_min = min_p * max w``.

    ``cut_order="vllm"`` applies min-p first, as vLLM does: top-p's mass is then that of the
    tokens surviving both min-p and top-k. ``cut_order="joint"`` takes top-p, like top-k, on
    the whole row (its mass is the whole row's; the kept sets are intersected), min-p after,
    as SGLang and FlashInfer's joint order do. In every order the kept set is ``w >= max`` of
    the cuts.

    Then ``num_samples`` ordered draws without replacement (blocked inverse CDF, one 53-bit
    uniform per row per draw). ``T == 0`` is greedy: the first index among the maximal
    entries (for ``n > 1``, the ``n`` largest, ties by the lower index), probability 1.
    No vocabulary sort: the cuts are exact radix selections (:mod:`fastsample.select`).

    Args:
        logits, probs: exactly one, ``(B, V)`` float16/bfloat16/float32/float64. ``-inf``
            logits (masks) and zero probabilities are never drawn. Sampling is not
            differentiable: a tensor that requires grad (logits straight from a model outside
            ``torch.no_grad()``) is detached after the checks; no output carries a graph.
        temperature: ``>= 0``; off (default): 1; 0 = greedy. A positive temperature below
            the smallest normal number of the weights' dtype (float32: ``2**-126``, about
            1.2e-38) is computed as that number, the ``T -> 0+`` limit: the row's maximal
            entries, ties drawn uniformly (a Python number or a tensor value alike).
        top_k: ``>= 0``; off: 0 or ``>= V``.
        top_p: in ``(0, 1]``; off: 1.
        min_p: in ``[0, 1]``; off: 0.
            Each control is None (off), a Python number (range-checked here) or a ``(B,)``
            tensor on the data's device (float; int for ``top_k``), so rows with different
            controls share one call; new tensor values never recompile or sync. A row whose
            tensor value is out of range is flagged invalid.
        num_samples: ``n``, ``1 <= n <= V``, draws without replacement from the kept set.
        seed, step, stream: counter-based per-request randomness (see
            :func:`sample_from_probs`); or ``generator``, a ``torch.Generator``.
        top_logprobs: ``N >= 0``: also return the N most likely tokens of the processed
            distribution and their log-probabilities.
        cut_order: ``"transformers"`` (default: min-p after top-k and top-p, Hugging Face's
            order), ``"vllm"`` (min-p before them; differs only with top-p and min-p on) or
            ``"joint"`` (top-p on the whole row's mass; differs only with top-k and top-p
            on).
        check: if True, first read the values on the host and raise naming the first bad
            row or control value (this syncs).

    Returns:
        :class:`SampleOutput` with ``token_ids (B, n)``, ``probs (B, n)`` and
        ``logprobs (B, n)`` under the processed distribution, ``valid (B,)`` and, with
        ``top_logprobs=N``, ``top_token_ids``/``top_logprobs (B, N)``. Invalid rows (NaN or
        +inf logits, all ``-inf``, bad probabilities, out-of-range tensor controls or
        ``stream``, or fewer kept tokens than ``n``) follow :class:`SampleOutput`'s policy;
        other rows are unaffected. Probabilities are judged as in :func:`sample_from_probs`
        whatever the controls: a total of ``2**128`` or more (float32 sums overflow) makes a
        sampled row invalid, even when top-k would keep less; greedy rows need no sum.

    Example:
        >>> logits = torch.randn(3, 1000)
        >>> out = sample(logits, temperature=torch.tensor([0.0, 0.7, 1.0]),
        ...              top_p=torch.tensor([1.0, 0.9, 0.5]), seed=7)
        >>> out.token_ids[0].item() == logits[0].argmax().item()
        True
    """
    source_tensor = check_source(logits, probs)
    batch, vocab = source_tensor.shape
    params = StepParams(
        batch, vocab, device=source_tensor.device, temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p, cut_order=cut_order, num_samples=num_samples, seed=seed,
        stream=stream, top_logprobs=top_logprobs,
    )  # fmt: skip
    return sample_step(logits, probs, params, step=step, generator=generator, check=check)
