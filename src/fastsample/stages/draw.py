"""Stage d-e: the controls (temperature, top-k, top-p, min-p, greedy) and the draw.

Definition: :func:`fastsample.controls.process` (the README's "Sampling controls"); the
draw takes ``n`` ordered draws without replacement from the processed distribution with the
blocked inverse CDF (one 53-bit uniform per row per draw). The stage reads logits (or
probabilities) as the stages before it left them and returns a :class:`Drawn`: the
:class:`~fastsample.stages.output.SampleOutput` and what the logprobs stage needs of the
processed distribution.

Paths, each drawing the general path's tokens (tested bitwise on CPU):

* every row greedy (a Python ``temperature=0``, or on CPU a tensor of zeros): one blocked max
  pass, no weights;
* a small ``top_k`` on logits (:mod:`fastsample.ops.small_top_k`): the ``k`` best blocks;
* the general path: the kept weights of every row (:func:`fastsample.controls.
  processed_weights`), then :func:`~fastsample.ops.inverse_cdf.inverse_cdf_draw`;
* on the Triton backend, the controls kernel and the draw kernel (two launches;
  :mod:`fastsample.kernels.controls_ops`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..controls import Processed, processed_weights
from ..kernels import backend as kernel_backend  # imports no triton
from ..ops import small_top_k
from ..ops import validation as v
from ..ops.eager import host_readable
from ..ops.inverse_cdf import inverse_cdf_draw
from ..ops.noise import UniformSource
from ..ops.race import repeat_last_genuine
from ..ops.select import block_maxima, first_in_block, top_entries
from ..ops.weights import controls_in_range, probs_total_fits
from .output import SampleOutput, finish, flag_rows


class Drawn(NamedTuple):
    """The draw stage's result.

    Attributes:
        out: the drawn tokens with their processed probabilities and log-probabilities (and
            ``top_logprobs`` when asked), invalid rows already given their result; rows with
            an out-of-range tensor ``stream`` are not yet flagged.
        weights_at: ``(B, c)`` ids -> the kept (unnormalized) weights there, or None when no
            weights were made (every row greedy).
        total: ``(B,)`` float64 kept mass (the normalizer of ``weights_at``), or None.
        greedy: ``(B,)`` bool, the rows drawn as point masses at their first maximal index
            (temperature 0), or None when no row is (on the Triton backend: None unless
            ``want_greedy``).
        streams_flagged: whether ``out`` already flags rows with an out-of-range tensor
            ``stream`` (the kernels do).
        maxima: ``(B, blocks)`` block maxima of the source, when the draw computed them (the
            logprobs stage reuses them), or None.
    """

    out: SampleOutput
    weights_at: Callable[[Tensor], Tensor] | None = None
    total: Tensor | None = None
    greedy: Tensor | None = None
    streams_flagged: bool = False
    maxima: Tensor | None = None


def draw(
    source: Tensor,
    is_logits: bool,
    controls: v.Controls,
    num_samples: int,
    rng: UniformSource,
    num_top: int,
    want_greedy: bool = False,
) -> Drawn:
    """The controls and the draw on ``source`` (arguments already checked); ``num_top`` most
    likely tokens of the processed distribution come back in ``out.top_logprobs``.
    ``want_greedy``: report the greedy rows even where it costs an op (the kernels')."""
    batch, vocab = source.shape
    logits, probs = (source, None) if is_logits else (None, source)
    if kernel_backend.use_triton(source.device.type):  # FASTSAMPLE_BACKEND
        from ..kernels import controls_ops

        # The kernels flag rows with an out-of-range tensor stream themselves.
        *fields, weights, total = controls_ops.sample(
            logits, probs, controls, num_samples, rng, num_top
        )
        out = SampleOutput(*fields)
        if controls.all_greedy and num_top == 0:  # the greedy kernels weigh no control
            out = flag_rows(out, _shortcut_ok(controls, batch, source.device))
        greedy = None
        if want_greedy:
            t = controls.temperature
            greedy = _all_rows(batch, source.device) if controls.all_greedy else None
            greedy = t == 0 if isinstance(t, Tensor) else greedy
        if weights is None:
            return Drawn(out, greedy=greedy, streams_flagged=True)
        # The kernel's weights already hold greedy rows as their point masses.
        return Drawn(out, lambda ids: weights.gather(1, ids), total, greedy, True)

    # No weights needed: one blocked max pass (a Python 0, or a tensor of zeros read on CPU).
    if num_top == 0 and (controls.all_greedy or _greedy_everywhere(controls)):
        rows_ok = _shortcut_ok(controls, batch, source.device)
        out = _all_greedy(source, is_logits, num_samples, rows_ok)
        return Drawn(out, greedy=_all_rows(batch, source.device))
    count = small_top_k.applies(logits, controls)  # the k best blocks and one count
    got = None
    if count:
        assert logits is not None
        got = small_top_k.draw(logits, controls, num_samples, rng, num_top, count)
    elif (few := small_top_k.min_p_candidates(logits, controls)) is not None:
        # No top-k, but min-p keeps few tokens: the candidates of a top-k that cuts none of them
        assert logits is not None
        got = small_top_k.draw(logits, few, num_samples, rng, num_top, few_survivors=True)
    if got is not None:
        token_ids, genuine = got.token_ids.clamp_max_(vocab - 1), got.genuine
        if got.greedy is not None:  # tensor temperature: greedy rows as the general path
            greedy_ids, greedy_genuine = _greedy_draws(logits, True, num_samples, got)
            token_ids = torch.where(got.greedy[:, None], greedy_ids, token_ids)
            genuine = torch.where(got.greedy[:, None], greedy_genuine, genuine)
        # CPU eager (the draw's weights came back): one host read spares the bad-row policy's
        # ops when every row is clean.
        clean = got.clean or (
            got.weights is not None and bool((got.valid[:, None] & genuine).all())
        )
        if got.token_probs is not None:  # finish()'s numbers, computed by the draw
            out = SampleOutput(token_ids, got.token_probs[0], got.valid, got.token_probs[1])
        else:
            out = finish(logits, token_ids, genuine, got.total, got.valid, got.read,
                         got.weights, clean)  # fmt: skip
        if got.greedy is not None:  # a point mass, as below
            out = _point_masses(out, got.valid, genuine, got.greedy)
        if num_top and got.top_ids is not None:  # the top-N came with the draw (CPU eager)
            assert got.top_weights is not None
            out = _top_logprobs(
                out, got.top_ids, got.top_weights, got.total, got.valid, all_clean=clean
            )
        elif num_top:
            out = _with_top_logprobs(
                out, logits, num_top, got.maxima, got.read, got.total, got.valid, got.greedy
            )
        return Drawn(out, got.read, got.total, got.greedy, maxima=got.maxima)
    processed = processed_weights(logits, probs, controls, keep_maxima=num_top > 0)
    if controls.all_greedy:  # nothing random: skip the draw
        token_ids, genuine = _greedy_draws(source, is_logits, num_samples, processed)
        total = processed.total
    else:
        token_ids, genuine, total = inverse_cdf_draw(
            processed.weights, num_samples, rng, sums=processed.sums
        )
        token_ids = token_ids.clamp_max_(vocab - 1)
        if processed.greedy is not None:
            greedy_ids, greedy_genuine = _greedy_draws(source, is_logits, num_samples, processed)
            token_ids = torch.where(processed.greedy[:, None], greedy_ids, token_ids)
            genuine = torch.where(processed.greedy[:, None], greedy_genuine, genuine)
    valid = processed.valid
    fits = None if probs is None else probs_total_fits(probs, controls, processed.total)
    if fits is not None:  # the overflow rule of sample_from_probs; greedy rows need no sum
        valid = valid & (fits if processed.greedy is None else fits | processed.greedy)
    out = finish(processed.weights, token_ids, genuine, total, valid)
    if processed.greedy is not None:
        out = _point_masses(out, valid, genuine, processed.greedy)

    def weights_at(ids: Tensor) -> Tensor:
        return processed.weights.gather(1, ids)

    if num_top:
        out = _with_top_logprobs(
            out, source, num_top, processed.maxima, weights_at, processed.total, valid,
            processed.greedy,
        )  # fmt: skip
    return Drawn(out, weights_at, processed.total, processed.greedy, maxima=processed.maxima)


def _all_rows(batch: int, device: torch.device) -> Tensor:
    return torch.ones(batch, dtype=torch.bool, device=device)


def _point_masses(out: SampleOutput, valid: Tensor, genuine: Tensor, greedy: Tensor):
    """Probability 1 for every genuine greedy draw of a clean row, as :func:`_all_greedy`
    (also where fewer than n are genuine: valid False)."""
    point = valid[:, None] & genuine & greedy[:, None]
    return out._replace(
        probs=torch.where(point, 1.0, out.probs).to(out.probs.dtype),
        logprobs=torch.where(point, 0.0, out.logprobs).to(out.logprobs.dtype),  # type: ignore[arg-type]
    )


def _greedy_draws(
    source: Tensor, is_logits: bool, num_samples: int, processed: Processed | small_top_k.Drawn
) -> tuple[Tensor, Tensor]:
    """Greedy ids ``(B, n)`` and which are genuine: the first maximal index, and for ``n > 1``
    the ``n`` largest entries in order (the ``T -> 0`` limit of draws without replacement);
    masked entries (``-inf`` logits, zero probabilities) are never genuine."""
    assert processed.greedy_ids is not None
    if num_samples == 1:
        ids = processed.greedy_ids[:, None]
        return ids, torch.ones_like(ids, dtype=torch.bool)
    values, ids = top_entries(source, num_samples, processed.maxima)
    genuine = values > (-math.inf if is_logits else 0.0)
    return repeat_last_genuine(ids, genuine), genuine


def _shortcut_ok(controls: v.Controls, batch: int, device: torch.device) -> Tensor | None:
    """Rows whose tensor controls are in range, for the greedy shortcuts (they weigh no
    control, yet an out-of-range value flags its row at any temperature); None if no control
    is a tensor."""
    tensors = (controls.temperature, controls.top_k, controls.top_p, controls.min_p)
    if any(isinstance(c, Tensor) for c in tensors):
        return controls_in_range(controls, batch, device)
    return None


def _greedy_everywhere(controls: v.Controls) -> bool:
    """Whether a tensor temperature holds zeros only, read where that is free (a CPU tensor
    in eager mode, :func:`~fastsample.ops.eager.host_readable`): every row is greedy,
    and the call is served as with a Python 0 (one blocked max pass, no weights). Elsewhere
    (CUDA, ``torch.compile``) such rows take the general path: no sync."""
    t = controls.temperature
    if not isinstance(t, Tensor) or t.numel() == 0 or not host_readable(t):
        return False
    if t.numel() <= 1024:  # the values themselves: fewer ops
        return not any(t.tolist())
    return bool((t == 0).all())


def _all_greedy(
    source: Tensor, is_logits: bool, num_samples: int, rows_ok: Tensor | None = None
) -> SampleOutput:
    """``temperature=0`` for every row: the first maximal index (or the ``n`` largest),
    probability 1, from block maxima alone (plus the minimum for probabilities).
    ``rows_ok`` (``(B,)`` bool, tensor controls in range) flags the other rows invalid."""
    maxima = block_maxima(source)
    # The row maximum and the first block holding it.
    block = maxima.argmax(-1, keepdim=True)  # the first maximal index (documented)
    best = maxima.gather(1, block)
    if is_logits:
        valid = best.isfinite()  # (B, 1); NaN, +inf and an all -inf row are not
    else:
        valid = (source.amin(-1, keepdim=True) >= 0) & (best > 0) & (best < math.inf)
    if rows_ok is not None:
        valid = valid & rows_ok[:, None]
    out_dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    if num_samples == 1:  # every draw genuine: fewer small ops on the per-token path
        ids = first_in_block(source, block)[:, None]
        probability = valid.to(out_dtype)
        # log(1) = 0 and log(0) = -inf exactly: the log-probability in one op.
        return SampleOutput(
            torch.where(valid, ids, 0), probability, valid.squeeze(1), probability.log()
        )
    values, ids = top_entries(source, num_samples, maxima)
    genuine = values > (-math.inf if is_logits else 0.0)
    ids = repeat_last_genuine(ids, genuine)
    keep = valid & genuine
    fallback = torch.arange(num_samples, device=source.device).expand_as(ids)
    return SampleOutput(
        torch.where(valid, ids, fallback),
        keep.to(out_dtype),
        valid.squeeze(1) & genuine.all(-1),
        torch.where(keep, 0.0, -math.inf).to(out_dtype),
    )


def _with_top_logprobs(
    out: SampleOutput,
    source: Tensor,
    num_top: int,
    maxima: Tensor | None,
    weights_at: Callable[[Tensor], Tensor],
    total: Tensor,
    valid: Tensor,
    greedy: Tensor | None = None,
) -> SampleOutput:
    """Attach the ``num_top`` most likely tokens and their processed log-probabilities.

    The kept set is an upper set of the weights, which order like the input values, so the
    most likely tokens are the largest inputs: one candidate-block pass, no log_softmax.
    ``weights_at(ids)`` gives the kept weights (normalized by ``total``) at ``ids``.
    """
    _, top_ids = top_entries(source, num_top, maxima)
    kept = weights_at(top_ids).to(torch.float64)
    return _top_logprobs(out, top_ids, kept, total, valid, greedy)


def _top_logprobs(
    out: SampleOutput,
    top_ids: Tensor,
    kept: Tensor,
    total: Tensor,
    valid: Tensor,
    greedy: Tensor | None = None,
    all_clean: bool = False,
) -> SampleOutput:
    """``out`` with the top tokens ``top_ids`` and their log-probabilities from their kept
    weights ``kept`` (float64) over ``total`` (``all_clean``: every row valid, read on the
    host)."""
    logprobs = kept.log() - total.log()[:, None]
    if greedy is not None:  # a point mass on the first (greedy) token
        rank = torch.arange(top_ids.shape[1], device=top_ids.device)
        point = torch.where(rank == 0, 0.0, -math.inf).to(torch.float64)
        logprobs = torch.where(greedy[:, None], point, logprobs)
    if not all_clean:
        logprobs = torch.where(valid[:, None], logprobs, -math.inf)
    return out._replace(top_token_ids=top_ids, top_logprobs=logprobs.to(out.probs.dtype))
