"""The sampler chain in one Triton launch: :func:`fastsample.stages.chain.run`, then the draw's
weights, for :func:`fastsample.stages.sample_step` on the Triton backend.

It takes the place of the controls kernel (:mod:`.controls`) in a step whose chain is on
(typical-p, epsilon, eta, top-n-sigma, XTC, dynamic temperature, mirostat, or an order the
controls do not know), so the step stays at three launches: stages a-c, this, the draw.

One program per row (rows never meet: batch invariance by construction):

1. copy the row (the staged scores, any float dtype) into the chained buffer ``x`` (float32,
   float64 for float64 input), NaN as ``-inf``; a row holding NaN or ``+inf`` is flagged
   invalid whatever the stages remove (:func:`fastsample.stages.chain.bad_rows`);
2. the stages of the order that are on, one after another, each on what the ones before it
   left (``ORDER``: up to :data:`SLOTS` stage codes, 4 bits each, constexpr). A stage that
   weighs the survivors first writes their weights ``w = exp(x - max x)`` to the weights
   buffer with their float64 total ``S`` (:func:`_survivors`), then removes tokens (``x =
   -inf``) by the rule of :mod:`fastsample.ops.truncation`, with the same float operations:
   thresholds ``at_least`` of a float64 bound, cuts by the radix rounds of :mod:`.select`
   (typical-p's keys in a third buffer, weighed by ``w``), entropies in float64;
3. the draw's weights of the chained logits with every control off (``exp(x - max x)``),
   their float64 block sums, total and validity, exactly as the controls kernel makes them,
   and ``top_logprobs`` (N more passes).

XTC's coin is the row's uniform of purpose ``STAGE`` at position 0, the counters of the
torch path's :meth:`~fastsample.ops.seeds.CounterSource.stage_uniforms` (so a seeded row
removes the same tokens on both paths); mirostat reads ``mu`` at the row's state row.

Tensor controls out of range flag the row here (as the controls kernel); the new stages'
tensor settings are flagged by ``StepParams.rows_ok``, read by the draw. A flagged row's
result stays in range. Differences from the torch ops are float rounding only: the total
``S`` is summed tile by tile (float32 inside a tile, float64 across) where torch sums the row
pairwise in float32, so a bound within rounding of a weight can fall the other way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.inverse_cdf import BLOCK
from . import launch
from .controls import (
    _TENSOR,
    NUMBER,
    OFF,
    TENSOR,
    _bits,
    _div,
    _exp,
    _log,
    _power,
    _setting,
    _store_block_sums,
    _store_top,
    libdevice,
    stream_in_range,
    top_outputs,
)
from .controls import outputs as weight_outputs
from .philox import INTERPRETED, counter_words, pair_uniforms, row_key
from .select import largest as max_of
from .select import radix_threshold, radix_threshold_weighed, tile_for
from .select import smallest as min_of
from .select import total as sum_of

# Stage codes (ORDER's 4-bit digits). JOINT is the "joint" order's top-k and top-p on the
# same distribution, intersected.
NONE, TEMPERATURE, TOP_K, TOP_P, MIN_P, JOINT = 0, 1, 2, 3, 4, 5
TOP_N_SIGMA, TYPICAL, EPSILON, ETA, XTC, MIROSTAT = 6, 7, 8, 9, 10, 11
CODES = {
    "temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P, "min_p": MIN_P,
    "top_n_sigma": TOP_N_SIGMA, "typical_p": TYPICAL, "epsilon_cutoff": EPSILON,
    "eta_cutoff": ETA, "xtc": XTC, "mirostat": MIROSTAT,
}  # fmt: skip
SLOTS = 10
"""The most stages an order holds (every truncation stage once)."""

SETTINGS = (
    "temperature", "top_k", "top_p", "min_p", "top_n_sigma", "typical_p", "epsilon_cutoff",
    "eta_cutoff", "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent",
    "mirostat_tau",
)  # fmt: skip
"""The settings the kernel reads, in its argument order (each a Python number or ``(B,)``)."""
DRAWN, REMOVES, KEEPS = 0, 1, 2
"""XTC's coin (``COIN``): the row's seeded uniform (a draw), or fixed at 0 (XTC removes
wherever it is on) or 1 (it never does): :func:`fastsample.process_step` mixes the two."""
_DRAWN, _REMOVES = tl.constexpr(DRAWN), tl.constexpr(REMOVES)
# The same numbers as the kernel sees them (a @triton.jit function reads only constexprs).
_TEMPERATURE, _TOP_K, _TOP_P, _MIN_P, _JOINT = (
    tl.constexpr(c) for c in (TEMPERATURE, TOP_K, TOP_P, MIN_P, JOINT)
)
_TOP_N_SIGMA, _TYPICAL, _EPSILON, _ETA, _XTC, _MIROSTAT = (
    tl.constexpr(c) for c in (TOP_N_SIGMA, TYPICAL, EPSILON, ETA, XTC, MIROSTAT)
)
_STAGE_PURPOSE = tl.constexpr(2)  # fastsample.ops.seeds.Purpose.STAGE


@triton.jit
def _exp2(x, PRECISE: tl.constexpr):
    if PRECISE:  # noqa: SIM108
        y = libdevice.exp2(x)
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def _at_least(threshold, IS_F64: tl.constexpr):
    """The smallest weight-dtype number ``>= threshold`` (float64), as
    :func:`fastsample.ops.truncation.at_least`."""
    if IS_F64:
        bound = threshold
    else:
        rounded = threshold.to(tl.float32)
        bits = rounded.to(tl.int32, bitcast=True)
        up = tl.where(rounded >= 0, bits + 1, bits - 1).to(tl.float32, bitcast=True)
        bound = tl.where(rounded.to(tl.float64) < threshold, up, rounded)
    return bound


@triton.jit
def _peak(x_ptr, n, FLOAT: tl.constexpr, TILE: tl.constexpr):
    best = tl.full((), float("-inf"), FLOAT)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        x = tl.load(x_ptr + offs, mask=offs < n, other=float("-inf"))
        best = tl.maximum(best, max_of(x, 0))
    return best


@triton.jit
def _survivors(x_ptr, w_ptr, n, FLOAT: tl.constexpr, TILE: tl.constexpr,
               PRECISE: tl.constexpr):  # fmt: skip
    """Write the survivors' weights ``exp(x - max x)`` (0 for removed tokens; NaN when none
    survives, as torch); return ``(max x, float64 total)``."""
    peak = _peak(x_ptr, n, FLOAT, TILE)
    total = tl.full((), 0, tl.float64)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=float("-inf"))
        w = tl.where(inside, _exp(x - peak, PRECISE), 0.0)
        tl.store(w_ptr + offs, w, mask=inside)
        total += sum_of(w, 0).to(tl.float64)
    tl.debug_barrier()  # the cuts read the weights in another layout
    return peak, total


@triton.jit
def _entropy(x_ptr, w_ptr, n, peak, total, TILE: tl.constexpr, PRECISE: tl.constexpr):
    """``(H, count)``: the survivors' entropy ``log S - sum w (x - max) / S`` (float64) and
    how many survive."""
    spread = tl.full((), 0, tl.float64)
    count = tl.full((), 0, tl.int64)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=float("-inf"))
        w = tl.load(w_ptr + offs, mask=inside, other=0.0)
        product = tl.where(w > 0, w * (x - peak), 0.0)
        spread += sum_of(product.to(tl.float64), 0)
        count += sum_of((x > float("-inf")).to(tl.int64), 0)
    return _log(total, PRECISE) - spread / total, count


@triton.jit
def _keep_weights(x_ptr, w_ptr, n, bound, TILE: tl.constexpr):
    """Remove the tokens whose weight is below ``bound`` (NaN weights too)."""
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=float("-inf"))
        w = tl.load(w_ptr + offs, mask=inside, other=0.0)
        tl.store(x_ptr + offs, tl.where(w >= bound, x, float("-inf")), mask=inside)
    tl.debug_barrier()


@triton.jit(do_not_specialize=[
    "t_bits", "k_bits", "p_bits", "m_bits", "sigma_bits", "typical_bits", "eps_bits",
    "eta_bits", "xp_bits", "xt_bits", "dr_bits", "de_bits", "tau_bits", "stream_value",
])  # fmt: skip
def _chain_kernel(
    src_ptr, src_stride, n, x_ptr, keys_ptr, weights_ptr, sums_ptr, num_blocks, total_ptr,
    valid_ptr, t_ptr, t_bits, k_ptr, k_bits, p_ptr, p_bits, m_ptr, m_bits, sigma_ptr,
    sigma_bits, typical_ptr, typical_bits, eps_ptr, eps_bits, eta_ptr, eta_bits, xp_ptr,
    xp_bits, xt_ptr, xt_bits, dr_ptr, dr_bits, de_ptr, de_bits, tau_ptr, tau_bits, mu_ptr,
    rows_ptr, seed_ptr, seed_stride, step_ptr, step_stride, stream_ptr, stream_stride,
    stream_value, top_ids_ptr, top_logp_ptr,
    T_MODE: tl.constexpr, K_MODE: tl.constexpr, P_MODE: tl.constexpr, M_MODE: tl.constexpr,
    SIGMA_MODE: tl.constexpr, TYPICAL_MODE: tl.constexpr, EPS_MODE: tl.constexpr,
    ETA_MODE: tl.constexpr, XP_MODE: tl.constexpr, XT_MODE: tl.constexpr,
    DR_MODE: tl.constexpr, DE_MODE: tl.constexpr, TAU_MODE: tl.constexpr,
    ORDER: tl.constexpr, DYNATEMP: tl.constexpr, HAS_ROWS: tl.constexpr,
    HAS_STEP: tl.constexpr, STREAM_ROWS: tl.constexpr, NUM_TOP: tl.constexpr,
    COIN: tl.constexpr, NORMALIZED: tl.constexpr, IS_F64: tl.constexpr, TILE: tl.constexpr,
    BLOCK: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    row = tl.program_id(0).to(tl.int64)
    src = src_ptr + row * src_stride
    x_row = x_ptr + row * n
    w_row = weights_ptr + row * n
    lanes = tl.arange(0, TILE)

    # The controls (Python numbers by their float64 bits) and their range (tensors only).
    t = _setting(t_ptr, t_bits, row, T_MODE)
    k = _setting(k_ptr, k_bits, row, K_MODE)
    p = _setting(p_ptr, p_bits, row, P_MODE)
    min_p = _setting(m_ptr, m_bits, row, M_MODE)
    ok = stream_in_range(stream_ptr, row * stream_stride, STREAM_ROWS)
    if T_MODE == _TENSOR:
        ok = ok & (t >= 0) & (t < float("inf"))
    if K_MODE == _TENSOR:
        ok = ok & (k >= 0)
    if P_MODE == _TENSOR:
        ok = ok & (p > 0) & (p <= 1)
    if M_MODE == _TENSOR:
        ok = ok & (min_p >= 0) & (min_p <= 1)
    if T_MODE == 0:
        t = tl.full((), 1.0, tl.float64)

    # Pass 1: the row into the chained buffer, NaN as -inf; NaN or +inf flags it.
    bad = tl.full((), 0, tl.int1)
    for start in range(0, n, TILE):
        offs = start + lanes
        inside = offs < n
        x = tl.load(src + offs, mask=inside, other=float("-inf")).to(FLOAT)
        bad = bad | (max_of(((x != x) | (x == float("inf"))).to(tl.int32), 0) > 0)
        tl.store(x_row + offs, tl.where(x != x, float("-inf"), x), mask=inside)
    tl.debug_barrier()

    for slot in tl.static_range(10):
        code = (ORDER >> (4 * slot)) & 15  # a constexpr: the tests below are resolved statically
        if code == _TEMPERATURE:
            t_used = t
            if DYNATEMP:
                peak, s = _survivors(x_row, w_row, n, FLOAT, TILE, PRECISE)
                h, count = _entropy(x_row, w_row, n, peak, s, TILE, PRECISE)
                spread = _setting(dr_ptr, dr_bits, row, DR_MODE)
                exponent = _setting(de_ptr, de_bits, row, DE_MODE)
                lo = tl.maximum(t - spread, 0.0)
                hi = t + spread
                normalized = h / _log(tl.maximum(count, 2).to(tl.float64), PRECISE)
                dynamic = lo + (hi - lo) * _power(tl.maximum(normalized, 0.0), exponent, PRECISE)
                t_used = tl.where(spread > 0, dynamic, t)
                t_used = tl.where((spread > 0) & (count <= 1), 1.0, t_used)
            t_row = t_used.to(FLOAT)
            greedy = t_row == 0
            divisor = tl.where(t_row > 0, t_row, 1.0)
            # The first maximal entry (a greedy row keeps it alone).
            best = tl.full((), float("-inf"), FLOAT)
            first = tl.full((), 0, tl.int64) + n
            for start in range(0, n, TILE):
                offs = start + lanes
                x = tl.load(x_row + offs, mask=offs < n, other=float("-inf"))
                top = max_of(x, 0)
                here = min_of(tl.where(x == top, offs, n), 0).to(tl.int64)
                first = tl.where(top > best, here, first)
                best = tl.maximum(best, top)
            first = tl.minimum(first, n - 1)
            for start in range(0, n, TILE):
                offs = start + lanes
                inside = offs < n
                x = tl.load(x_row + offs, mask=inside, other=float("-inf"))
                single = tl.where(offs == first, x, float("-inf"))
                x = tl.where(greedy, single, _div(x, divisor, IS_F64))
                tl.store(x_row + offs, x, mask=inside)
            tl.debug_barrier()
        if (code == _TOP_K) | (code == _TOP_P) | (code == _JOINT):
            peak, s = _survivors(x_row, w_row, n, FLOAT, TILE, PRECISE)
            cut = tl.full((), 0, FLOAT)
            if code != _TOP_P:  # noqa: SIM102 (a constexpr test, then a runtime one)
                if (k > 0) & (k < n):
                    target = tl.minimum(tl.maximum(k, 1.0), n.to(tl.float64))
                    cut = radix_threshold(w_row, n, target, False, False, IS_F64, TILE)
            if code != _TOP_K:
                share = tl.minimum(tl.maximum(p, 1e-300), 1.0)
                if p < 1:
                    cut = tl.maximum(cut, radix_threshold(w_row, n, share, True, True, IS_F64,
                                                          TILE))  # fmt: skip
            _keep_weights(x_row, w_row, n, cut, TILE)
        if code == _MIN_P:
            peak, s = _survivors(x_row, w_row, n, FLOAT, TILE, PRECISE)
            _keep_weights(x_row, w_row, n, _at_least(min_p, IS_F64), TILE)
        if code == _TOP_N_SIGMA:
            n_sigma = _setting(sigma_ptr, sigma_bits, row, SIGMA_MODE)
            peak = _peak(x_row, n, FLOAT, TILE)
            alive = tl.full((), 0, tl.int64)
            first_moment = tl.full((), 0, tl.float64)
            second_moment = tl.full((), 0, tl.float64)
            for start in range(0, n, TILE):
                offs = start + lanes
                x = tl.load(x_row + offs, mask=offs < n, other=float("-inf"))
                live = x > float("-inf")
                d = tl.where(live, x - peak, 0.0)
                alive += sum_of(live.to(tl.int64), 0)
                first_moment += sum_of(d, 0).to(tl.float64)
                second_moment += sum_of(d * d, 0).to(tl.float64)
            size = tl.maximum(alive, 1).to(tl.float64)
            mean = first_moment / size
            sigma = tl.sqrt(tl.maximum(second_moment / size - mean * mean, 0.0))
            threshold = (peak.to(tl.float64) - n_sigma * sigma).to(FLOAT)
            threshold = tl.where(n_sigma > 0, threshold, float("-inf"))
            for start in range(0, n, TILE):
                offs = start + lanes
                inside = offs < n
                x = tl.load(x_row + offs, mask=inside, other=float("-inf"))
                tl.store(x_row + offs, tl.where(x >= threshold, x, float("-inf")), mask=inside)
            tl.debug_barrier()
        if code == _TYPICAL:
            mass_p = _setting(typical_ptr, typical_bits, row, TYPICAL_MODE)
            peak, s = _survivors(x_row, w_row, n, FLOAT, TILE, PRECISE)
            h, count = _entropy(x_row, w_row, n, peak, s, TILE, PRECISE)
            # -log p_i - H = (max - x_i) + log S - H, in float32 (the torch op's keys).
            offset = (_log(s, PRECISE) - h).to(tl.float32)
            keys_row = keys_ptr + row * n
            for start in range(0, n, TILE):
                offs = start + lanes
                inside = offs < n
                x = tl.load(x_row + offs, mask=inside, other=float("-inf"))
                w = tl.load(w_row + offs, mask=inside, other=0.0)
                d = tl.abs(offset - (x - peak).to(tl.float32))
                d = tl.where(w > 0, d, float("inf"))
                # Closer (smaller d) is a larger key: the radix rounds' largest first.
                key_bits = 0x7F800000 - d.to(tl.int32, bitcast=True)
                key_bits = tl.minimum(tl.maximum(key_bits, 0), 0x7F800000)
                tl.store(keys_row + offs, key_bits.to(tl.float32, bitcast=True), mask=inside)
            tl.debug_barrier()
            cut = tl.full((), 0, tl.float32)
            if mass_p < 1:
                share = tl.maximum(mass_p, 1e-300)
                cut = radix_threshold_weighed(keys_row, w_row, n, share, True, True, True,
                                              False, TILE)  # fmt: skip
            for start in range(0, n, TILE):
                offs = start + lanes
                inside = offs < n
                x = tl.load(x_row + offs, mask=inside, other=float("-inf"))
                w = tl.load(w_row + offs, mask=inside, other=0.0)
                key = tl.load(keys_row + offs, mask=inside, other=0.0)
                # (a scalar | a tile fails in the interpreter: counted instead)
                keep = ((key >= cut) & (w > 0)).to(tl.int32) + (mass_p >= 1).to(tl.int32) > 0
                tl.store(x_row + offs, tl.where(keep, x, float("-inf")), mask=inside)
            tl.debug_barrier()
        if (code == _EPSILON) | (code == _ETA):
            peak, s = _survivors(x_row, w_row, n, FLOAT, TILE, PRECISE)
            if code == _EPSILON:
                bound = _setting(eps_ptr, eps_bits, row, EPS_MODE)
            else:
                eta = _setting(eta_ptr, eta_bits, row, ETA_MODE)
                h, count = _entropy(x_row, w_row, n, peak, s, TILE, PRECISE)
                bound = tl.minimum(eta, tl.sqrt(eta) * _exp(-h, PRECISE))
            _keep_weights(x_row, w_row, n, _at_least(tl.minimum(bound * s, 1.0), IS_F64), TILE)
        if code == _XTC:
            chance = _setting(xp_ptr, xp_bits, row, XP_MODE)
            level = _setting(xt_ptr, xt_bits, row, XT_MODE)
            if COIN == _DRAWN:
                seed = tl.load(seed_ptr + row * seed_stride)
                k0, k1 = row_key(seed)
                step = tl.full((), 0, tl.int64)
                if HAS_STEP:
                    step = tl.load(step_ptr + row * step_stride)
                stream = tl.full((), 0, tl.int64) + stream_value
                if STREAM_ROWS:
                    stream = tl.load(stream_ptr + row * stream_stride)
                c1, c2, c3 = counter_words(step, stream, _STAGE_PURPOSE)
                coin, _ = pair_uniforms(tl.full((), 0, tl.int32), c1, c2, c3, k0, k1)
            else:  # a fixed coin: 0 removes wherever XTC is on, 1 never does (coin < q)
                coin = tl.full((), 0.0 if COIN == _REMOVES else 1.0, tl.float64)
            peak, s = _survivors(x_row, w_row, n, FLOAT, TILE, PRECISE)
            bound = _at_least(level * s, IS_F64)
            above = tl.full((), 0, tl.int64)
            least = tl.full((), float("inf"), FLOAT)
            for start in range(0, n, TILE):
                offs = start + lanes
                w = tl.load(w_row + offs, mask=offs < n, other=0.0)
                top = w >= bound
                above += sum_of(top.to(tl.int64), 0)
                least = tl.minimum(least, min_of(tl.where(top, w, float("inf")), 0))
            fires = (coin < chance) & (above >= 2) & (level <= 0.5)
            for start in range(0, n, TILE):
                offs = start + lanes
                inside = offs < n
                x = tl.load(x_row + offs, mask=inside, other=float("-inf"))
                w = tl.load(w_row + offs, mask=inside, other=0.0)
                removed = (w >= bound) & (w > least)
                x = tl.where(removed, tl.where(fires, float("-inf"), x), x)
                tl.store(x_row + offs, x, mask=inside)
            tl.debug_barrier()
        if code == _MIROSTAT:
            tau = _setting(tau_ptr, tau_bits, row, TAU_MODE)
            state_row = row
            if HAS_ROWS:
                state_row = tl.load(rows_ptr + row)
            mu = tl.load(mu_ptr + state_row).to(tl.float64)
            surprise = tl.where(mu != mu, 2 * tau, mu)
            peak, s = _survivors(x_row, w_row, n, FLOAT, TILE, PRECISE)
            bound = _at_least(tl.minimum(_exp2(-surprise, PRECISE) * s, 1.0), IS_F64)
            _keep_weights(x_row, w_row, n, tl.where(tau <= 0, 0.0, bound), TILE)

    # The draw's weights of the chained logits, every control off (the controls kernel's).
    best = _peak(x_row, n, FLOAT, TILE)
    finite = (best > float("-inf")) & (best < float("inf"))
    shift = tl.where(finite, best, 0.0)
    sums_row = sums_ptr + row * num_blocks
    total = tl.full((), 0, tl.float64)
    for start in range(0, n, TILE):
        offs = start + lanes
        inside = offs < n
        x = tl.load(x_row + offs, mask=inside, other=0.0)
        w = tl.where(inside, _exp(x - shift, PRECISE), 0.0)
        tl.store(w_row + offs, w, mask=inside)
        total += _store_block_sums(w, sums_row, start, num_blocks, BLOCK)
    valid = ok & finite & (bad == 0) & (total > 0) & (total < float("inf"))
    tl.store(total_ptr + row, total)
    tl.store(valid_ptr + row, valid)
    if NUM_TOP > 0:
        tl.debug_barrier()
        _store_top(x_row, w_row, n, valid, total, top_ids_ptr + row * NUM_TOP,
                   top_logp_ptr + row * NUM_TOP, NUM_TOP, IS_F64, TILE, PRECISE)  # fmt: skip
    if NORMALIZED:  # process_step: w / total, invalid rows all zeros (the controls kernel's)
        tl.debug_barrier()
        norm = total.to(FLOAT)
        for start in range(0, n, TILE):
            offs = start + lanes
            inside = offs < n
            w = tl.load(w_row + offs, mask=inside, other=0.0)
            tl.store(w_row + offs, tl.where(valid, _div(w, norm, IS_F64), 0.0), mask=inside)


def order_word(stages: list[int]) -> int:
    """``ORDER``: the stage codes, first in the lowest 4 bits."""
    if len(stages) > SLOTS:
        raise ValueError(f"an order holds at most {SLOTS} stages, got {len(stages)}")
    word = 0
    for slot, code in enumerate(stages):
        word |= code << (4 * slot)
    return word


def outputs(scores: Tensor, num_top: int) -> tuple[Tensor, ...]:
    """Empty ``(chained, weights, sums, total, valid, top_ids, top_logprobs)`` for ``scores``
    (also the fake kernel's)."""
    weights, sums, total, valid = weight_outputs(scores)
    return (torch.empty_like(weights), weights, sums, total, valid,
            *top_outputs(scores, num_top))  # fmt: skip


def chain_weights(
    scores: Tensor,
    settings: list[Tensor | float | None],
    stages: list[int],
    dynatemp: bool,
    mu: Tensor | None,
    rows: Tensor | None,
    seed: Tensor,
    step: Tensor | None,
    stream: Tensor | int,
    num_top: int,
    coin: int = DRAWN,
    normalized: bool = False,
) -> tuple[Tensor, ...]:
    """The chain and the draw's weights in one launch (see the module docstring).

    Args:
        scores: ``(B, V)`` logits after stages a-c, any float dtype, rows contiguous.
        settings: one per name of :data:`SETTINGS`: a ``(B,)`` tensor with unit stride, a
            Python number, or None (off).
        stages: the codes of the stages that are on, in the chain's order.
        dynatemp: whether the temperature stage is dynamic.
        mu: mirostat's ``mu`` (float32, one per state row) when mirostat is on; ``rows``:
            each row's state row (None: row ``b``).
        seed, step, stream: the kernel counters of :func:`.ops.counters` (XTC's coin).
        num_top: ``top_logprobs`` of the chained distribution.
        coin: XTC's coin, :data:`DRAWN` from the counters or fixed (:data:`REMOVES`,
            :data:`KEEPS`; the counters are then never read).
        normalized: the weights come out divided by the total (:func:`fastsample.process_step`'s
            rows summing to 1, invalid rows all zeros); sums and total stay those of before.

    Returns:
        ``(chained (B, V), weights (B, V), sums, total, valid, top_ids, top_logprobs)``:
        the chained logits (removed ``-inf``), then the controls kernel's outputs for them.
    """
    batch, vocab = scores.shape
    chained, weights, sums, total, valid, top_ids, top_logp = outputs(scores, num_top)
    if batch == 0:
        return chained, weights, sums, total, valid, top_ids, top_logp
    keys = (torch.empty((batch, vocab), dtype=torch.float32, device=scores.device)
            if TYPICAL in stages else total)  # fmt: skip
    dummy = total  # the pointer of a setting given as a number (never read)
    args: list[object] = []
    modes = {}
    for name, value in zip(SETTINGS, settings, strict=True):
        is_tensor = isinstance(value, Tensor)
        args += [value if is_tensor else dummy, 0 if is_tensor or value is None
                 else _bits(float(value))]  # fmt: skip
        modes[name] = TENSOR if is_tensor else (OFF if value is None else NUMBER)
    mode_names = ("T_MODE", "K_MODE", "P_MODE", "M_MODE", "SIGMA_MODE", "TYPICAL_MODE", "EPS_MODE",
                  "ETA_MODE", "XP_MODE", "XT_MODE", "DR_MODE", "DE_MODE", "TAU_MODE")  # fmt: skip
    stream_rows = isinstance(stream, Tensor)
    launch.count_launch()
    launch.launcher(_chain_kernel, INTERPRETED)[(batch,)](
        scores, scores.stride(0), vocab, chained, keys, weights, sums, sums.shape[1], total,
        valid, *args, mu if mu is not None else dummy, rows if rows is not None else dummy,
        seed, seed.stride(0), step if step is not None else seed,
        step.stride(0) if step is not None else 0, stream if stream_rows else seed,
        stream.stride(0) if stream_rows else 0, 0 if stream_rows else int(stream),
        top_ids, top_logp,
        **{mode_name: modes[name] for mode_name, name in zip(mode_names, SETTINGS, strict=True)},
        ORDER=order_word(stages), DYNATEMP=dynatemp, HAS_ROWS=rows is not None,
        HAS_STEP=step is not None, STREAM_ROWS=stream_rows, NUM_TOP=num_top, COIN=coin,
        NORMALIZED=normalized, IS_F64=scores.dtype == torch.float64,
        TILE=max(tile_for(vocab, INTERPRETED), BLOCK), BLOCK=BLOCK,
        PRECISE=not INTERPRETED and libdevice is not None,
    )  # fmt: skip
    return chained, weights, sums, total, valid, top_ids, top_logp
