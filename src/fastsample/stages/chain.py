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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops import truncation as cut
from ..ops.noise import UniformSource
from ..ops.validation import Controls
from .samplers import Samplers


def bad_rows(x: Tensor) -> Tensor:
    """``(B,)`` rows holding NaN or ``+inf``: invalid, whatever the stages would remove."""
    return torch.isnan(x).any(-1) | (x == math.inf).any(-1)


def _temperature(x: Tensor, controls: Controls, samplers: Samplers) -> Tensor:
    t = controls.temperature
    if samplers.dynatemp_on:
        return cut.dynamic_temperature(
            x, 1.0 if t is None else t, samplers.dynatemp_range,  # type: ignore[attr-defined]
            samplers.dynatemp_exponent,  # type: ignore[attr-defined]
        )  # fmt: skip
    return x if t is None else cut.temperature(x, t)


def _stage(
    name: str, x: Tensor, controls: Controls, samplers: Samplers, rng: UniformSource,
    mu: Tensor | None,
) -> Tensor:  # fmt: skip
    s = samplers
    if name == "temperature":
        return _temperature(x, controls, s)
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
    mu: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The chain on ``scores`` (``(B, V)`` logits after the stages before it): the logits to
    draw from, removed tokens ``-inf``, rows with NaN/``+inf`` input all NaN. ``mu``:
    mirostat's ``(B,)`` per-request ``mu`` (NaN: not started, ``2 tau``)."""
    x = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
    bad = bad_rows(x)
    x = torch.where(torch.isnan(x), -math.inf, x)
    for entry in samplers.order:
        if isinstance(entry, tuple):  # the joint order: both cuts on the same distribution
            kept = [_stage(name, x, controls, samplers, rng, mu) > -math.inf for name in entry]
            x = torch.where(kept[0] & kept[1], x, -math.inf)
        else:
            x = _stage(entry, x, controls, samplers, rng, mu)
    return torch.where(bad[:, None], math.nan, x)


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
