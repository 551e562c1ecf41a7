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
4. min-p: keep the entries ``>= min_p`` times the largest weight. Off: 0.

All cuts are thresholds on the same float32 weights (float64 for float64 input), so the kept
set is ``{i : w_i >= max(cut_k, cut_p, cut_min)}`` and every cut is exact on those weights
(:mod:`fastsample.select`); logits that round to the same weight are ties. ``-inf`` logits
(grammar or bad-word masks) get weight 0 and are never drawn.

:func:`fastsample.sample` with a small Python ``top_k`` on logits (not float64) skips these
weights altogether (:mod:`fastsample.small_top_k`), with the same draws (bitwise on CPU).

Controls are Python scalars (checked here; an off value skips its stage entirely) or
``(B,)`` tensors (every stage runs, values can change between calls without a recompile;
rows with out-of-range values are flagged invalid instead of raising, since checking them
would sync).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from . import _validation as v
from ._pieces import piece_rows
from .inverse_cdf import block_sums
from .select import (
    CANDIDATE_MAX_K,
    block_maxima,
    descending_threshold,
    first_argmax,
    largest_entries,
)

Control = float | int | Tensor | None


@dataclass(frozen=True)
class Controls:
    """Checked per-row controls: None (stage off), a Python number, or a ``(B,)`` tensor."""

    temperature: float | Tensor | None = None
    top_k: int | Tensor | None = None
    top_p: float | Tensor | None = None
    min_p: float | Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        """Every row is greedy (a Python ``temperature=0``): nothing to sample."""
        return isinstance(self.temperature, float) and self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """At least one of top-k, top-p, min-p is on (or may be, for tensors)."""
        return any(c is not None for c in (self.top_k, self.top_p, self.min_p))


def _check_tensor(value: Tensor, name: str, batch: int, device: torch.device, kind: str) -> Tensor:
    integral = not value.dtype.is_floating_point and value.dtype != torch.bool
    if kind == "int" and not integral:
        raise TypeError(f"{name} must be an integer tensor (int32/int64), got {value.dtype}")
    if kind == "float" and not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {value.dtype}; use {name}.float()")
    if value.device != device:
        raise ValueError(
            f"{name} is on {value.device} but the data is on {device}; move it with "
            f"{name}.to('{device}') once, outside the sampling loop"
        )
    if value.dim() == 0:
        return value.expand(batch)
    if tuple(value.shape) != (batch,):
        raise ValueError(
            f"{name} must be a Python number or a tensor of shape ({batch},) (one per row), "
            f"got shape {tuple(value.shape)}"
        )
    return value


def _check_number(value: object, name: str, kind: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{name} must be None, a Python {'int' if kind == 'int' else 'float'} or a tensor "
            f"of shape (batch,), got {type(value).__name__}"
        )
    if kind == "int" and not isinstance(value, int):
        raise TypeError(f"{name} must be an int (0 switches it off), got {value!r}")
    if value != value or value in (math.inf, -math.inf):  # math.isfinite breaks dynamo
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_controls(
    temperature: object,
    top_k: object,
    top_p: object,
    min_p: object,
    batch: int,
    vocab: int,
    device: torch.device,
) -> Controls:
    """Check the four controls before any work; Python off-values become None.

    Raises ``TypeError``/``ValueError`` naming the control, its range and its off-value.
    """
    found: dict[str, float | int | Tensor | None] = {}
    specs = (
        ("temperature", temperature, "float", "temperature must be >= 0 (0 = greedy, 1 = off)"),
        ("top_k", top_k, "int", "top_k must be >= 0 (0 or >= vocabulary size = off)"),
        ("top_p", top_p, "float", "top_p must be in (0, 1] (1 = off)"),
        ("min_p", min_p, "float", "min_p must be in [0, 1] (0 = off)"),
    )
    for name, value, kind, rule in specs:
        if value is None:
            found[name] = None
        elif isinstance(value, Tensor):
            found[name] = _check_tensor(value, name, batch, device, kind)
        else:
            number = _check_number(value, name, kind)
            ok = {
                "temperature": number >= 0,
                "top_k": number >= 0,
                "top_p": 0 < number <= 1,
                "min_p": 0 <= number <= 1,
            }[name]
            if not ok:
                raise ValueError(f"{rule}, got {number!r}")
            off = {
                "temperature": number == 1,
                "top_k": number == 0 or number >= vocab,
                "top_p": number == 1,
                "min_p": number == 0,
            }[name]
            found[name] = None if off else (float(number) if kind == "float" else int(number))
    return Controls(**found)  # type: ignore[arg-type]


class Processed(NamedTuple):
    """The processed distribution of each row, before normalization.

    Attributes:
        weights: ``(B, W)`` kept weights (``W >= V``; columns past ``V`` are 0), float32
            (float64 for float64 input). Zero outside the kept set.
        sums: their :func:`~fastsample.inverse_cdf.block_sums`, ``(B, blocks)`` float64.
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


def divide_by_temperature_(out: Tensor, temperature: Control) -> Tensor:
    """``out /= T`` in place, per row; greedy rows (``T == 0``) and bad tensor values use
    ``T = 1`` (they are resolved later), a Python ``None`` or ``0`` leaves ``out`` alone."""
    if isinstance(temperature, Tensor):
        usable = (temperature > 0) & (temperature < math.inf)
        out.div_(torch.where(usable, temperature, 1.0).to(out.dtype)[:, None])
    elif temperature is not None and temperature != 0.0:
        out.div_(temperature)
    return out


def logit_weights_(out: Tensor, logits: Tensor, shift: Tensor, temperature: Control) -> Tensor:
    """``out = exp((logits - shift[:, None]) / T)``, the one formula of weights from logits.

    The general path, the small-``top_k`` path and the vocabulary shards all call this, so a
    logit gets bitwise the same weight on each (sub, then div, then exp, in ``out``'s dtype).
    """
    torch.sub(logits, shift[:, None], out=out)
    # exp, not exp2 (2.6x faster on an AMD host): torch's CPU exp2 rounds the scalar tail of
    # its loop differently from the vector body, which would split ties and make a row's bits
    # depend on its place in the batch.
    return divide_by_temperature_(out, temperature).exp_()


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


def _weights_from_logits(
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
    weights = torch.empty(batch, width, dtype=dtype, device=logits.device)
    if width > vocab:
        weights[:, vocab:] = 0.0
    logit_weights_(weights[:, :vocab], logits, torch.where(finite, best, 0.0), temperature)
    return weights, torch.ones_like(best), finite


def _weights_from_probs(
    probs: Tensor, temperature: float | Tensor | None, need_copy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(p / max p)^(1/T)`` (or ``p`` itself); returns the weights, their row maximum and
    the row-validity flag (no NaN, inf or negative entry, positive finite total)."""
    batch, vocab = probs.shape
    dtype = compute_dtype(probs.dtype)
    smallest = probs.amin(-1).to(dtype)
    best = probs.amax(-1).to(dtype)
    finite = (smallest >= 0) & (best > 0) & (best < math.inf)
    if temperature is None and not need_copy and probs.dtype == dtype and vocab % 2 == 0:
        return probs.contiguous(), best, finite
    width = vocab + vocab % 2
    weights = torch.zeros(batch, width, dtype=dtype, device=probs.device)
    # Copies that will be cut are normalized to a largest weight of 1 (same cost as a copy),
    # so dividing by a cut can never overflow.
    prob_weights_(weights[:, :vocab], probs, torch.where(finite, best, 1.0), temperature)
    return weights, torch.ones_like(best), finite


def _controls_in_range(controls: Controls, batch: int, device: torch.device) -> Tensor:
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


def _as_rows(value: float | int | Tensor, batch: int, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(like.dtype)
    return torch.full((batch,), value, dtype=like.dtype, device=like.device)


def _top_p_cut(weights: Tensor, top_p: float | Tensor, mass: Tensor | None) -> Tensor:
    """Top-p threshold on ``weights`` by radix selection: ``top_p`` of ``mass`` (the top-k
    survivors' mass), or of the whole row's if None."""
    rows = torch.empty(weights.shape[0], dtype=torch.float64, device=weights.device)
    p = _as_rows(top_p, rows.shape[0], rows)
    if mass is None:
        cut = descending_threshold(weights, p, "share")
    else:
        cut = descending_threshold(weights, p * mass, "mass")
    return torch.where(p < 1, cut, 0.0)


def _top_p_cut_from_candidates(
    candidates: Tensor, cut_k: Tensor, top_p: float, mass: Tensor
) -> Tensor:
    """Top-p threshold after a top-k cut taken from candidates (static ``k``).

    Every survivor above ``cut_k`` is among the candidates (sorted, largest first), so the
    cut is the first candidate where the mass from the top reaches ``top_p * mass``, or
    ``cut_k`` itself if none does (the boundary ties, wherever they are, complete it).
    """
    above = torch.where(candidates > cut_k[:, None], candidates, 0.0).to(torch.float64)
    reached = above.cumsum(-1) >= top_p * mass[:, None]
    first = reached.to(torch.uint8).argmax(-1, keepdim=True)
    cut = candidates.gather(1, first).squeeze(1)
    return torch.where(reached.any(-1), cut, cut_k)


# Cuts are applied by dividing each row by its cut and zeroing what falls below 1, one scalar
# threshold for the whole batch (fast), instead of a per-row comparison and a masked fill.
# The division keeps every comparison with the cut exact (``w >= c`` iff ``fl(w / c) >= 1``)
# and scales a row uniformly, which the inverse CDF does not see. Cuts below a floor are
# raised to it so the scaled weights, their block sums and row totals stay finite in float32
# (totals up to V * 2**100 < 2**128): in a row whose cut is 0 (or tinier), weights under
# 2**-100 of the row's largest (float64: 2**-1000) are dropped, tokens ~69 T below the top
# logit with probability < 1e-30 each.
_CUT_FLOOR = {torch.float32: 2.0**-100, torch.float64: 2.0**-1000}
_BELOW_ONE = {torch.float32: 1.0 - 2.0**-24, torch.float64: 1.0 - 2.0**-53}


def _predecessor(value: float, dtype: torch.dtype) -> float:
    """The largest ``dtype`` number below ``value`` rounded to ``dtype`` (``value >= 0``), in
    Python (no tensor, so no host read under ``torch.compile``)."""
    if dtype == torch.float64:
        return math.nextafter(value, 0.0)
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    if bits == 0:  # value rounds to 0 in float32: every weight is >= it
        return -1.0
    (below,) = struct.unpack("<f", struct.pack("<I", bits - 1))
    return below


def count_equal(weights: Tensor, value: Tensor) -> Tensor:
    """``(B,)`` count of entries equal to ``value[b]`` per row, as float64.

    ``w - v`` is exactly 0 iff ``w == v``; comparing that difference with 0 in place gives
    float 0/1 whose sum is exact (below 2**24 per row). On CPU this is ~4x faster than a
    broadcast ``==`` followed by a sum of the bool tensor.
    """
    return (weights - value[:, None]).eq_(0).sum(-1).to(torch.float64)


def keep_at_least(weights: Tensor, cut: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(weights / s) * [weights >= cut]`` per row with ``s = max(cut, floor)``; returns it
    (written to ``out`` if given, which may be ``weights``) and ``s``."""
    scale = cut.clamp_min(_CUT_FLOOR[weights.dtype])
    scaled = (
        torch.div(weights, scale[:, None], out=out) if out is not None else weights / scale[:, None]
    )
    return torch.nn.functional.threshold_(scaled, _BELOW_ONE[weights.dtype], 0.0), scale


# The survivors' mass is taken a few rows at a time through a scratch of this many elements
# (8 MiB of float32): a (B, V) temporary was a fresh, page-faulted block every call (~5 ms
# of a ~6 ms pass at B=64, V=128256).
_MASS_PIECE_ELEMENTS = 1 << 21


def _kept_mass(weights: Tensor, cut: Tensor) -> Tensor:
    """``(B,)`` float64 mass of the entries ``>= cut`` per row: the block sums of
    :func:`keep_at_least`, times its scale (the same numbers as on the whole batch)."""
    batch, width = weights.shape
    rows = piece_rows(batch, width, weights.device, _MASS_PIECE_ELEMENTS)
    scratch = torch.empty(min(rows, batch), width, dtype=weights.dtype, device=weights.device)
    masses = []
    for piece, piece_cut in zip(weights.split(rows), cut.split(rows), strict=True):
        kept, scale = keep_at_least(piece, piece_cut, out=scratch[: piece.shape[0]])
        masses.append(block_sums(kept).sum(-1) * scale.to(torch.float64))
    return masses[0] if len(masses) == 1 else torch.cat(masses)


def _cuts(
    weights: Tensor, peak: Tensor, controls: Controls, order: Tensor, maxima: Tensor | None
) -> Tensor | None:
    """The per-row threshold ``max(cut_k, cut_p, cut_min)`` on ``weights``, or None.

    ``order`` is the input (logits or probabilities, which order like ``weights``) and
    ``maxima`` its block maxima, for the candidate-block path of a static small ``top_k``.
    """
    batch, vocab = order.shape
    f64 = torch.zeros(batch, dtype=torch.float64, device=weights.device)
    cut: Tensor | None = None
    candidates: Tensor | None = None
    k = controls.top_k
    if isinstance(k, int) and k <= CANDIDATE_MAX_K:
        # The k-th largest input's weight is the k-th largest weight (the map is monotone);
        # read it from the buffer itself so the comparisons below are bitwise consistent.
        values, ids = largest_entries(order, k, maxima)
        # Past-the-end padding (and -inf logits) weigh 0, whatever id it was clamped to.
        candidates = torch.where(values > -math.inf, weights.gather(1, ids), 0.0)
        cut = candidates[:, -1]
    elif k is not None:
        k_rows = _as_rows(k, batch, f64)
        cut = descending_threshold(weights, k_rows, "count")
        cut = torch.where((k_rows > 0) & (k_rows < vocab), cut, 0.0)
    if controls.top_p is not None:
        # For thresholds at or above cut_k the mass above them is the same with or without
        # the top-k cut, so top-p needs only the survivors' mass, not a masked copy.
        mass: Tensor | None = None  # None: the whole row's, read off the radix's first round
        if candidates is not None:
            # Every survivor above cut_k is a candidate; the rest are ties at cut_k, anywhere
            # in the row: count them (one compare pass, no masked copy).
            ties = count_equal(weights, cut)
            strictly_above = torch.where(candidates > cut[:, None], candidates, 0.0)
            mass = strictly_above.sum(-1, dtype=torch.float64) + ties * cut.to(torch.float64)
        elif cut is not None:
            mass = _kept_mass(weights, cut)
        if candidates is not None and isinstance(controls.top_p, float):
            assert cut is not None and mass is not None
            cut_p = _top_p_cut_from_candidates(candidates, cut, controls.top_p, mass)
        else:
            cut_p = _top_p_cut(weights, controls.top_p, mass)
        cut = cut_p if cut is None else torch.maximum(cut, cut_p)
    if controls.min_p is not None:
        cut_min = _as_rows(controls.min_p, batch, f64).to(weights.dtype) * peak
        cut = cut_min if cut is None else torch.maximum(cut, cut_min)
    return cut


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
        weights, peak, valid = _weights_from_logits(logits, temperature, maxima)
    else:
        weights, peak, valid = _weights_from_probs(probs, temperature, need_copy=controls.filters)
        if greedy_possible or keep_maxima:
            maxima = block_maxima(probs)
    valid = valid & _controls_in_range(controls, batch, source.device)
    if controls.top_k is not None and maxima is None:
        maxima = block_maxima(source)
    only_min_p = controls.top_k is None and controls.top_p is None
    if only_min_p and isinstance(controls.min_p, float) and logits is not None:
        # Every row's largest weight is exactly 1, so the cut is one number for the batch:
        # keep w >= float(min_p) as w > its predecessor, in place, no division.
        torch.nn.functional.threshold_(weights, _predecessor(controls.min_p, weights.dtype), 0.0)
    else:
        cut = _cuts(weights, peak, controls, source, maxima)
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


def check_source(logits: object, probs: object) -> Tensor:
    """Exactly one of ``logits``/``probs``, a floating ``(B, V)`` tensor; returns it."""
    if (logits is None) == (probs is None):
        raise ValueError(
            "pass exactly one of logits= or probs= (got "
            + ("neither" if logits is None else "both")
            + ")"
        )
    name = "logits" if logits is not None else "probs"
    return v.check_probs_tensor(logits if logits is not None else probs, name)


def process(
    logits: Tensor | None = None,
    probs: Tensor | None = None,
    *,
    temperature: Control = None,
    top_k: Control = None,
    top_p: Control = None,
    min_p: Control = None,
) -> Tensor:
    """The processed, renormalized distribution that :func:`fastsample.sample` draws from.

    Math: with weights ``w = exp((x - max x) / T)`` (``(p / max p)^(1/T)`` for
    ``probs``), keep ``w_i >= max(cut_k, cut_p, cut_min)`` (top-k, then top-p on the
    top-k survivors renormalized, then min-p; see :mod:`fastsample.controls`) and divide
    by the kept mass. Greedy rows (``T == 0``) are one-hot at the first maximal index.

    Args:
        logits, probs: exactly one, ``(B, V)`` float16/bfloat16/float32/float64.
        temperature, top_k, top_p, min_p: Python numbers or ``(B,)`` tensors (same rules as
            :func:`fastsample.sample`).

    Returns:
        ``(B, V)`` float32 (float64 for float64 input), rows summing to 1. Invalid rows
        (NaN/inf input, all ``-inf``, out-of-range tensor controls) are all zeros.

    Example:
        >>> process(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), top_k=2).round(decimals=3)
        tensor([[0.7310, 0.2690, 0.0000, 0.0000]])
    """
    source = check_source(logits, probs)
    batch, vocab = source.shape
    controls = check_controls(temperature, top_k, top_p, min_p, batch, vocab, source.device)
    got = processed_weights(logits, probs, controls)
    out = got.weights[:, :vocab] / got.total.to(got.weights.dtype)[:, None]
    if got.greedy is not None and got.greedy_ids is not None:
        one_hot = torch.zeros_like(out).scatter_(1, got.greedy_ids[:, None], 1.0)
        out = torch.where(got.greedy[:, None], one_hot, out)
    return torch.where(got.valid[:, None], out, 0.0)
