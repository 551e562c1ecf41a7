"""The sampler chain's stages as pure ops on a batch of logits: each keeps a set of tokens.

Every function takes ``x``, ``(B, V)`` float32 (float64 for float64 input) logits in which a
removed token is ``-inf``, and returns the logits after its stage (removed tokens ``-inf``,
temperature stages divided). A stage sees the distribution the stages before it left,
renormalized over its survivors, which is the chain's law (llama.cpp's samplers, Hugging
Face's warpers): :mod:`fastsample.stages.chain` calls them in the chosen order.

Shared numbers (:func:`row_weights`): ``w = exp(x - max x)`` in ``x``'s dtype (1 at the
row's maximum), ``S = sum w`` in float64, so ``p = w / S``. Each cut is a threshold on these
weights or on a per-token key, found without sorting (:mod:`fastsample.ops.select`'s radix
selection, with a separate mass for typical-p); ties at a threshold are kept, as in the
existing controls. A setting is a Python number or a ``(B,)`` tensor; rows whose tensor value
is off keep every token. Fixed shapes, no host sync.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import scratch
from .select import descending_threshold

Setting = float | int | Tensor


_PIECE_ENTRIES = 1 << 19  # a float32 piece of 2 MiB stays in cache between its passes


class RowWeights(NamedTuple):
    weights: Tensor  # (B, V) exp(x - max x), 0 for removed tokens
    total: Tensor  # (B,) float64 sum of the weights
    peak: Tensor  # (B, 1) max x (the shift)


def row_weights(x: Tensor, out: Tensor | None = None, peak: Tensor | None = None) -> RowWeights:
    """The weights of the current survivors (see the module docstring), in ``out`` if given
    (a kept buffer spares a long row's fresh pages). The total is summed in ``x``'s dtype
    (torch sums pairwise; a float64 accumulation is ~30x slower on CPU), then widened.
    ``peak``: the ``(B, 1)`` row maxima when the caller has them (a pass saved)."""
    if peak is None:
        peak = x.amax(-1, keepdim=True)
    # An all-removed row (peak -inf) gets weights NaN: the chain flags it invalid later.
    weights = torch.sub(x, peak, out=out).exp_() if out is not None else torch.exp(x - peak)
    return RowWeights(weights, weights.sum(-1).to(torch.float64), peak)


def entropy(x: Tensor, got: RowWeights) -> Tensor:
    """``(B,)`` float64 entropy (nats) of the survivors' distribution:
    ``H = log S - sum w (x - max) / S`` (removed tokens add nothing)."""
    shifted = torch.where(got.weights > 0, x - got.peak, 0.0)
    spread = (got.weights * shifted).sum(-1, dtype=torch.float64)
    return got.total.log() - spread / got.total


def _rows(value: Setting, like: Tensor) -> Tensor:
    """``(B, 1)`` float64 from a number or a ``(B,)`` tensor."""
    if isinstance(value, Tensor):
        return value.to(torch.float64)[:, None]
    return torch.full((like.shape[0], 1), float(value), dtype=torch.float64, device=like.device)


def at_least(threshold: Tensor, dtype: torch.dtype) -> Tensor:
    """The smallest ``dtype`` number ``>= threshold`` (float64): ``w >= it`` in ``dtype`` is
    exactly ``w >= threshold`` for weights of that dtype."""
    if dtype == torch.float64:
        return threshold
    rounded = threshold.to(dtype)
    above = torch.nextafter(rounded, rounded.new_tensor(math.inf))
    return torch.where(rounded.to(torch.float64) < threshold, above, rounded)


def _keep(x: Tensor, keep: Tensor) -> Tensor:
    return torch.where(keep, x, -math.inf)


# ---------------------------------------------------------------------------- temperature


def temperature(x: Tensor, value: Setting) -> Tensor:
    """``x / T``; ``T == 0`` keeps only the row's first maximal token (greedy)."""
    t = _rows(value, x).to(x.dtype)
    first = x.argmax(-1, keepdim=True)
    greedy = torch.where(torch.arange(x.shape[1], device=x.device)[None, :] == first, x, -math.inf)
    divided = x / torch.where(t > 0, t, 1.0)
    return torch.where(t == 0, greedy, divided)


# ---------------------------------------------------------------------------- the cuts


def top_k(x: Tensor, k: Setting) -> Tensor:
    """Keep the tokens whose weight is at least the ``k``-th largest (ties kept); ``k == 0``
    or ``k >= V`` keeps all."""
    got = row_weights(x)
    vocab = x.shape[1]
    k_rows = _rows(k, x).squeeze(1)
    cut = descending_threshold(got.weights.contiguous(), k_rows.clamp(1, vocab), "count")
    on = (k_rows > 0) & (k_rows < vocab)
    return _keep(x, ~on[:, None] | (got.weights >= cut[:, None]))


def top_p(x: Tensor, p: Setting) -> Tensor:
    """Keep the smallest most-likely set whose mass reaches ``p`` of the survivors' (ties
    kept); ``p >= 1`` keeps all."""
    got = row_weights(x)
    p_rows = _rows(p, x).squeeze(1)
    cut = descending_threshold(got.weights.contiguous(), p_rows.clamp(1e-300, 1), "share")
    return _keep(x, (p_rows >= 1)[:, None] | (got.weights >= cut[:, None]))


def min_p(x: Tensor, p: Setting) -> Tensor:
    """Keep ``p_i >= min_p * max p`` (``w_i >= min_p``: the largest weight is 1)."""
    got = row_weights(x)
    cut = at_least(_rows(p, x), got.weights.dtype)
    return _keep(x, got.weights >= cut)


def _closeness_keys(d: Tensor) -> Tensor:
    """Non-negative float32 keys ordered the opposite way to ``d >= 0`` (float32): the bit
    pattern ``inf - bits(d)``, so the radix selection's largest keys are the smallest ``d``."""
    bits = d.view(torch.int32)
    return (0x7F800000 - bits).clamp_(0, 0x7F800000).view(torch.float32)


def typical_p(x: Tensor, p: Setting) -> Tensor:
    """Locally typical sampling (Hugging Face's ``TypicalLogitsWarper``, llama.cpp's
    ``typical``): with ``H`` the entropy, order the tokens by ``|-log p_i - H|`` (closest
    first) and keep the shortest prefix whose mass reaches ``p``, with every token as close as
    its last (ties kept). ``p >= 1`` keeps all."""
    got = row_weights(x)
    h = entropy(x, got)
    # -log p_i - H = (max - x_i) + log S - H, in float32 as the weights are.
    offset = (got.total.log() - h).to(torch.float32)[:, None]
    d = (offset - (x - got.peak).to(torch.float32)).abs_()
    d = torch.where(got.weights > 0, d, math.inf)
    keys = _closeness_keys(d)
    p_rows = _rows(p, x).squeeze(1)
    mass = got.weights.to(torch.float32)
    cut = descending_threshold(keys, p_rows.clamp(1e-300, 1), "share", mass=mass)
    return _keep(x, (p_rows >= 1)[:, None] | ((keys >= cut[:, None]) & (got.weights > 0)))


def epsilon_cutoff(x: Tensor, epsilon: Setting) -> Tensor:
    """Keep ``p_i >= epsilon`` and the most likely token (Hugging Face's
    ``EpsilonLogitsWarper``); ``epsilon == 0`` keeps all."""
    got = row_weights(x)
    threshold = torch.clamp_max(_rows(epsilon, x) * got.total[:, None], 1.0)
    return _keep(x, got.weights >= at_least(threshold, got.weights.dtype))


def eta_cutoff(x: Tensor, eta: Setting) -> Tensor:
    """Keep ``p_i >= min(eta, sqrt(eta) exp(-H))`` and the most likely token (Hugging Face's
    ``EtaLogitsWarper``, ``H`` the entropy); ``eta == 0`` keeps all."""
    got = row_weights(x)
    e = _rows(eta, x)
    bound = torch.minimum(e, e.sqrt() * torch.exp(-entropy(x, got))[:, None])
    threshold = torch.clamp_max(bound * got.total[:, None], 1.0)
    return _keep(x, got.weights >= at_least(threshold, got.weights.dtype))


def top_n_sigma_threshold(x: Tensor, n: Setting, peak: Tensor | None = None) -> Tensor:
    """``(B, 1)`` top-nσ's threshold ``max x - n sigma`` in ``x``'s dtype (``-inf`` where
    ``n <= 0``): ``sigma`` the population standard deviation of the surviving logits.
    ``peak``: the ``(B, 1)`` row maxima when the caller has them."""
    if peak is None:
        peak = x.amax(-1, keepdim=True)
    n_rows = _rows(n, x)
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        # Two cheap reductions when no row holds a removed (-inf) token (its sum is then
        # finite: a host read, free on CPU): the sum and the Euclidean norm (torch's fused
        # var_mean is ~25x slower on CPU), combined in float64; else the masked moments below.
        total = x.sum(-1, keepdim=True)
        if bool(torch.isfinite(total).all()):
            size = x.shape[1]
            mean = total.to(torch.float64) / size
            square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).to(torch.float64) ** 2
            sigma = (square / size - mean * mean).clamp_min(0).sqrt()
            threshold = peak.to(torch.float64) - n_rows * sigma
            return torch.where(n_rows > 0, threshold.to(x.dtype), -math.inf)
    alive = x > -math.inf
    count = alive.sum(-1, keepdim=True).clamp_min(1).to(torch.float64)
    # Moments of x - max over the survivors: sums in x's dtype (torch sums pairwise), the
    # variance E[d^2] - E[d]^2 in float64 (d spans a few tens: no harmful cancellation).
    d = torch.where(alive, x - peak, 0.0)
    mean = d.sum(-1, keepdim=True).to(torch.float64) / count
    square = d.square_().sum(-1, keepdim=True).to(torch.float64) / count
    sigma = (square - mean * mean).clamp_min(0).sqrt()
    threshold = (peak.to(torch.float64) - n_rows * sigma).to(x.dtype)
    return torch.where(n_rows > 0, threshold, -math.inf)


def top_n_sigma(x: Tensor, n: Setting, threshold: Tensor | None = None) -> Tensor:
    """Top-nσ (llama.cpp's ``top_n_sigma``; "Top-nσ: Not All Logits Are You Need"): keep
    ``x_i >= max x - n sigma``, ``sigma`` the population standard deviation of the surviving
    logits (removed ``-inf`` ones excluded). ``n <= 0`` keeps all; a row with one survivor
    keeps it. ``threshold``: already found on the whole row (the chain on candidates)."""
    if threshold is None:
        threshold = top_n_sigma_threshold(x, n)
    return _keep(x, x >= threshold)


def xtc(x: Tensor, probability: Setting, threshold: Setting, coin: Tensor) -> Tensor:
    """Exclude Top Choices (llama.cpp's ``xtc``): where the row's ``coin`` (a uniform of its
    seed stream) is below ``probability``, remove every token with ``p_i >= threshold``
    except the least likely of them (all tokens tied at that least weight stay); nothing
    when fewer than two tokens reach the threshold. ``threshold > 0.5`` never removes."""
    got = row_weights(x)
    bound = at_least(_rows(threshold, x) * got.total[:, None], got.weights.dtype)
    top = got.weights >= bound
    least = torch.where(top, got.weights, math.inf).amin(-1, keepdim=True)
    fires = (coin[:, None] < _rows(probability, x)) & (top.sum(-1, keepdim=True) >= 2)
    fires &= _rows(threshold, x) <= 0.5
    return _keep(x, ~(fires & top & (got.weights > least)))


def _entropy_sums(x: Tensor, peak: Tensor) -> tuple[Tensor, Tensor]:
    """``(S, sum w x)`` in float64 for ``w = exp(x - peak)``, a piece of columns at a time in a
    kept buffer: the exponentials, their sum and ``w *= x``'s sum read a piece while it is in
    cache, so the row is read from memory once (~2.5x faster than whole-row passes on CPU)."""
    batch, vocab = x.shape
    width = min(vocab, max(8192, _PIECE_ENTRIES // max(batch, 1)))
    piece = scratch.buffer("entropy", (batch, width), x.dtype, x.device)
    total = torch.zeros(batch, dtype=torch.float64, device=x.device)
    spread = torch.zeros(batch, dtype=torch.float64, device=x.device)
    for start in range(0, vocab, width):
        columns = x[:, start : start + width]
        w = piece[:, : columns.shape[1]]
        torch.sub(columns, peak, out=w).exp_()
        total += w.sum(-1)
        spread += w.mul_(columns).sum(-1)
    return total, spread


def dynamic_temperature_value(
    x: Tensor, t: Setting, spread: Setting, exponent: Setting, finite: bool | None = False,
    peak: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``(B,)`` float64 temperature of :func:`dynamic_temperature` on ``x``. ``finite``: no
    entry of ``x`` is ``-inf``, so ``sum w x`` is one dot product (``None``: unknown, found
    from that product, NaN where a ``-inf`` entry meets its 0 weight: a host read, for CPU
    eager callers; False: the masked entropy); ``peak``: the ``(B, 1)`` row maxima when the
    caller has them."""
    if peak is None:
        peak = x.amax(-1, keepdim=True)
    h = None
    if finite is not False:  # H = log S - sum w (x - max) / S, without a masked copy
        total, spread_sum = _entropy_sums(x, peak)
        spread_sum = spread_sum - peak.squeeze(1).to(torch.float64) * total
        if finite or bool(torch.isfinite(spread_sum).all()):
            h = total.log() - spread_sum / total
            count = torch.full_like(h, float(x.shape[1]))
    if h is None:  # a -inf entry (its 0 weight times -inf is NaN): the masked entropy
        h = entropy(x, row_weights(x, None, peak))
        count = (x > -math.inf).sum(-1).to(torch.float64)
    t_rows, spread_rows = _rows(t, x).squeeze(1), _rows(spread, x).squeeze(1)
    lo, hi = (t_rows - spread_rows).clamp_min(0), t_rows + spread_rows
    normalized = h / count.clamp_min(2).log()
    dynamic = lo + (hi - lo) * normalized.clamp_min(0).pow(_rows(exponent, x).squeeze(1))
    chosen = torch.where(spread_rows > 0, dynamic, t_rows)
    return torch.where((spread_rows > 0) & (count <= 1), 1.0, chosen)


def dynamic_temperature(x: Tensor, t: Setting, spread: Setting, exponent: Setting) -> Tensor:
    """Dynamic temperature (llama.cpp's ``temp_ext``): with ``spread > 0``, ``x / T`` for
    ``T = lo + (hi - lo) (H / log n) ** exponent``, ``lo = max(0, t - spread)``, ``hi = t +
    spread``, ``H`` the survivors' entropy and ``n`` their count; a row with one survivor is
    left as it is. ``spread == 0``: the plain temperature ``t``. ``T == 0`` is greedy."""
    return temperature(x, dynamic_temperature_value(x, t, spread, exponent).to(x.dtype))


def mirostat(x: Tensor, mu: Tensor, tau: Setting) -> Tensor:
    """Mirostat v2's truncation (llama.cpp's ``mirostat_v2``): keep the tokens whose surprise
    ``-log2 p_i`` is at most ``mu`` (NaN: not started, ``2 tau``), and always the most likely;
    the draw follows. The state's ``mu`` moves after the step
    (:func:`fastsample.stages.state.mirostat_update`). Rows with ``tau <= 0`` keep all."""
    got = row_weights(x)
    tau_rows = _rows(tau, x).squeeze(1)
    level = torch.where(torch.isnan(mu), 2 * tau_rows, mu.to(torch.float64))
    bound = torch.clamp_max(torch.exp2(-level)[:, None] * got.total[:, None], 1.0)
    keep = got.weights >= at_least(bound, got.weights.dtype)
    return _keep(x, keep | (tau_rows <= 0)[:, None])
