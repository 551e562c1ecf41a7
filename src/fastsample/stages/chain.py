"""The sampler chain: the truncation stages and temperature in a chosen order, then the draw.

The step takes the chain when a stage of :mod:`fastsample.stages.samplers` is on (typical-p,
epsilon, eta, top-n-sigma, XTC, dynamic temperature, mirostat) or the order is one the
controls' own paths do not know (``"llama.cpp"``, a custom list). Otherwise the controls'
paths run as before, bitwise.

Definition (the law): the stages of ``params.samplers.order`` that are on run one after
another, each on the distribution the ones before it left, renormalized over its survivors
(:mod:`fastsample.ops.truncation` has each stage's rule); the token is drawn from what is
left. Temperature is a stage like the others (``T == 0``: the first maximal survivor), so
``"llama.cpp"``'s temperature-last order cuts top-p on the untempered distribution. The
joint preset's ``("top_k", "top_p")`` runs both cuts on the same distribution and keeps
their intersection. Mirostat, last, keeps the tokens whose surprise ``-log2 p`` is at most
the request's ``mu`` (:attr:`~fastsample.stages.state.TokenStats.mirostat_mu`).

The chain hands logits (removed tokens ``-inf``, temperature applied) to the draw with every
control off, so the draw, processed probabilities and logprobs are the general path's on
them. Rows whose input holds NaN or ``+inf`` stay invalid whatever the stages removed.

**On the top-k candidates** (:func:`candidates`, CPU eager): when a Python ``top_k`` comes
before every stage that weighs the whole row (only temperature, min-p and top-n-sigma may
precede it: each keeps an upper set of the row, so it commutes with taking the ``k`` largest),
the chain runs on the ``k`` largest entries of each row (and a few more, to see ties at the
``k``-th), ordered by value then index, and the draw maps its token back. Top-n-sigma's
threshold is found on the whole row first. Same law, a few passes over the row instead of
the chain's dozens; a row whose ties at the ``k``-th run past the candidates sends the call
to the whole-row chain (a host read: free on CPU).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops import truncation as cut
from ..ops.noise import UniformSource
from ..ops.select import block_maxima, largest_entries
from ..ops.validation import Controls
from .samplers import Samplers


def bad_rows(x: Tensor) -> Tensor:
    """``(B,)`` rows holding NaN or ``+inf``: invalid, whatever the stages would remove."""
    return torch.isnan(x).any(-1) | (x == math.inf).any(-1)


def _temperature(
    x: Tensor, controls: Controls, samplers: Samplers, fixed: Tensor | None = None
) -> Tensor:
    t = controls.temperature
    if fixed is not None:  # found on the whole row already (the chain on candidates)
        return cut.temperature(x, fixed)
    if samplers.dynatemp_on:
        return cut.dynamic_temperature(
            x, 1.0 if t is None else t, samplers.dynatemp_range,  # type: ignore[attr-defined]
            samplers.dynatemp_exponent,  # type: ignore[attr-defined]
        )  # fmt: skip
    return x if t is None else cut.temperature(x, t)


def _stage(
    name: str, x: Tensor, controls: Controls, samplers: Samplers, rng: UniformSource,
    mu: Tensor | None, sigma_cut: Tensor | None = None, fixed_t: Tensor | None = None,
) -> Tensor:  # fmt: skip
    s = samplers
    if name == "top_n_sigma" and sigma_cut is not None:
        return cut.top_n_sigma(x, None, threshold=sigma_cut)  # type: ignore[arg-type]
    if name == "temperature":
        return _temperature(x, controls, s, fixed_t)
    if name in ("top_k", "top_p", "min_p"):
        value = getattr(controls, name)
        return x if value is None else getattr(cut, name)(x, value)
    if not s.on(name):
        return x
    if name == "xtc":
        coin = rng.stage_uniforms(1)[:, 0]
        return cut.xtc(x, s.xtc_probability, s.xtc_threshold, coin)  # type: ignore[attr-defined]
    if name == "mirostat":
        assert mu is not None
        return cut.mirostat(x, mu, s.mirostat_tau)  # type: ignore[attr-defined]
    return getattr(cut, name)(x, getattr(s, name))


def run(
    scores: Tensor, controls: Controls, samplers: Samplers, rng: UniformSource,
    mu: Tensor | None = None, sigma_cut: Tensor | None = None, fixed_t: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The chain on ``scores`` (``(B, V)`` logits after the stages before it): the logits to
    draw from, removed tokens ``-inf``, rows with NaN/``+inf`` input all NaN. ``mu``:
    mirostat's ``(B,)`` per-request ``mu`` (NaN: not started, ``2 tau``); ``sigma_cut``:
    top-n-sigma's threshold, ``fixed_t`` the (dynamic) temperature, when found elsewhere
    (:func:`candidates`)."""
    x = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
    bad = bad_rows(x)
    x = torch.where(torch.isnan(x), -math.inf, x)
    for entry in samplers.order:
        if isinstance(entry, tuple):  # the joint order: both cuts on the same distribution
            kept = [_stage(name, x, controls, samplers, rng, mu) > -math.inf for name in entry]
            x = torch.where(kept[0] & kept[1], x, -math.inf)
        else:
            x = _stage(entry, x, controls, samplers, rng, mu, sigma_cut, fixed_t)
    return torch.where(bad[:, None], math.nan, x)


CANDIDATES_MAX_K = 1024
"""The largest Python ``top_k`` whose candidates the chain runs on."""
_TIE_MARGIN = 8  # candidates past the k-th: ties at the k-th up to this many stay exact


def candidates(
    scores: Tensor, controls: Controls, samplers: Samplers, rng: UniformSource,
    mu: Tensor | None,
) -> tuple[Tensor, Tensor] | None:  # fmt: skip
    """The chain on each row's top-k candidates: ``(logits (B, C), ids (B, C))`` to draw from
    (ids map a drawn column back to the vocabulary), or None when the whole row is needed
    (see the module docstring)."""
    k = controls.top_k
    if (scores.device.type != "cpu" or torch.compiler.is_compiling() or not isinstance(k, int)
            or k > CANDIDATES_MAX_K or scores.dtype == torch.float64):  # fmt: skip
        return None
    before: list[str] = []  # the stages that are on ahead of top-k
    for entry in samplers.order:
        if entry == "top_k":
            break
        if isinstance(entry, tuple):
            return None
        if samplers.stage_on(entry, controls):
            if entry not in ("temperature", "min_p", "top_n_sigma"):
                return None  # it weighs the whole row
            before.append(entry)
    if samplers.dynatemp_on and "temperature" in before and before[0] != "temperature":
        return None  # its entropy would be that of an earlier cut's survivors
    if "top_n_sigma" in before and "min_p" in before[: before.index("top_n_sigma")]:
        return None  # its deviation would be the min-p survivors'
    x = scores if scores.dtype == torch.float32 else scores.float()
    maxima = block_maxima(x)  # NaN propagates into its block's maximum, +inf is one
    if bool((torch.isnan(maxima) | (maxima == math.inf)).any()):
        return None  # the whole-row chain flags such rows
    vocab = x.shape[1]
    count = min(vocab, k + _TIE_MARGIN)
    values, ids = largest_entries(x, count, maxima)
    # Value first, then index: the first maximal survivor is the lowest index (greedy).
    by_id = ids.argsort(dim=1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.argsort(dim=1, descending=True, stable=True)
    values, ids = values.gather(1, by_value), ids.gather(1, by_value)
    if count < vocab and bool((values[:, -1] == values[:, k - 1]).any()):
        return None  # ties at the k-th beyond the candidates
    # The whole-row numbers, once the candidates are sure to be used; the row maximum from
    # the block maxima (no NaN or +inf here), not another pass.
    peak = maxima.amax(-1, keepdim=True)
    fixed_t = None
    if samplers.dynatemp_on and "temperature" in before:
        # First in the chain: its temperature comes from the whole row's entropy, then it
        # scales every entry alike (it commutes with taking the k largest).
        fixed_t = cut.dynamic_temperature_value(
            x, 1.0 if controls.temperature is None else controls.temperature,
            samplers.dynatemp_range, samplers.dynatemp_exponent,  # type: ignore[attr-defined]
            finite=None, peak=peak,
        ).to(x.dtype)  # fmt: skip
    sigma_cut = None
    if "top_n_sigma" in before:
        sigma_cut = cut.top_n_sigma_threshold(x, samplers.top_n_sigma, peak)  # type: ignore[attr-defined]
        t = controls.temperature if fixed_t is None else fixed_t
        if "temperature" in before[: before.index("top_n_sigma")] and t is not None:
            t_rows = torch.as_tensor(t, dtype=x.dtype).reshape(-1, 1)
            sigma_cut = sigma_cut / torch.where(t_rows > 0, t_rows, 1.0)
    return run(values, controls, samplers, rng, mu, sigma_cut, fixed_t), ids


class FixedCoin:
    """A :class:`~fastsample.ops.noise.UniformSource` whose stage uniforms are one fixed
    value (the two branches of XTC's coin in :func:`fastsample.process_step`)."""

    def __init__(self, batch: int, value: float, device: torch.device) -> None:
        self.batch, self.value, self.device = batch, value, device

    def stage_uniforms(self, num: int) -> Tensor:
        return torch.full((self.batch, num), self.value, dtype=torch.float64, device=self.device)

    def row_uniforms(self, num: int) -> Tensor:  # the chain draws nothing
        raise AssertionError("the chain draws no token")

    entry_uniforms = row_uniforms


def off_controls(controls: Controls) -> Controls:
    """The controls the draw gets after the chain: every stage already applied."""
    return Controls(cut_order=controls.cut_order)
