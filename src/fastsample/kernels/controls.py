"""The sampling controls in one Triton launch: :func:`fastsample.controls.processed_weights`.

One program per row makes every pass over its row inside the kernel, so rows never meet
(batch invariance by construction) and a call is one launch whatever controls are on:

1. the row's maximum (minimum and NaN flag for probabilities) and first maximal index;
2. the weights ``exp((x - max) / T)`` for logits, ``(p / max p)^(1/T)`` (as
   ``exp(log(p / max p) / T)``) for probabilities, written to the ``(B, V)`` weights buffer;
3. the exact cuts on those weights (:mod:`fastsample.kernels.select`): ``cut_k`` the k-th
   largest weight (ties kept), ``cut_p`` the largest threshold whose kept mass is
   ``>= top_p`` of the top-k survivors' mass, ``cut_min = min_p`` (the largest weight is 1);
4. the kept weights ``fl(w / s)`` zeroed below 1, ``s = max(cut, floor)``, exactly as
   :func:`fastsample.ops.cuts.keep_at_least` (a Python ``min_p`` alone on logits keeps
   ``w > pred(min_p)`` unscaled, as the torch path does), their float64 block sums
   (float32 accumulation inside each block of 256, float64 for float64 input), the total,
   the validity flag, and the greedy rows and ids.

Every float operation is the torch path's, in the same order (sub, correctly rounded div,
exp), so the weights and the cuts are the same numbers up to one ulp of ``exp``/``log`` where
the libraries differ, and the block sums up to the order of float32 additions.

Shapes and dtypes: source ``(B, V)`` float16/bfloat16/float32/float64; weights ``(B, V)``
float32 (float64 for float64 input); sums ``(B, ceil(V / 256))`` float64; total ``(B,)``
float64; valid, greedy ``(B,)`` bool; greedy ids ``(B,)`` int64. Controls are ``(B,)``
tensors (read per row, out-of-range values flag the row invalid) or Python numbers (passed
by their float64 bits, so no host-to-device copy and no tensor op).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..controls import Processed
from ..ops.cuts import predecessor
from ..ops.inverse_cdf import BLOCK
from ..ops.validation import Controls
from .select import radix_threshold, tile_for

try:  # libdevice's correctly rounded-to-1-ulp exp/log on a GPU (torch's CUDA exp is the same)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - old triton
    libdevice = None

OFF, NUMBER, TENSOR, ZERO = 0, 1, 2, 3  # how a control is given (ZERO: Python temperature 0)
NO_CUT, SCALED_CUT, PLAIN_MIN_P = 0, 1, 2


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _div(a, b, IS_F64: tl.constexpr):
    """Correctly rounded division (Triton's float32 ``/`` is approximate on a GPU)."""
    if IS_F64:
        return a / b
    return tl.math.div_rn(a, b)


@triton.jit
def _as_float64(bits):
    """A Python float passed by its IEEE bits (an int of any width) as a float64 scalar."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit(do_not_specialize=["t_bits", "k_value", "p_bits", "m_bits"])
def _controls_kernel(
    src_ptr,
    src_stride,
    n,
    weights_ptr,
    sums_ptr,
    num_blocks,
    total_ptr,
    valid_ptr,
    greedy_ptr,
    greedy_ids_ptr,
    t_ptr,
    t_bits,
    k_ptr,
    k_value,
    p_ptr,
    p_bits,
    m_ptr,
    m_bits,
    IS_LOGITS: tl.constexpr,
    IS_F64: tl.constexpr,
    NORMALIZE: tl.constexpr,
    T_MODE: tl.constexpr,
    DIVIDE: tl.constexpr,
    K_MODE: tl.constexpr,
    P_MODE: tl.constexpr,
    M_MODE: tl.constexpr,
    CUT: tl.constexpr,
    GREEDY: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
    PRECISE: tl.constexpr,
):
    if IS_F64:
        FLOAT: tl.constexpr = tl.float64
        FLOOR: tl.constexpr = 2.0**-1000
        BELOW_ONE: tl.constexpr = 1.0 - 2.0**-53
    else:
        FLOAT: tl.constexpr = tl.float32
        FLOOR: tl.constexpr = 2.0**-100
        BELOW_ONE: tl.constexpr = 1.0 - 2.0**-24
    row = tl.program_id(0).to(tl.int64)
    src = src_ptr + row * src_stride
    out = weights_ptr + row * n
    lanes = tl.arange(0, TILE)

    # Pass 1: maximum, minimum, NaN flag and the first maximal index of the input.
    best = tl.full((), float("-inf"), FLOAT)
    smallest = tl.full((), float("inf"), FLOAT)
    has_nan = tl.zeros((), dtype=tl.int1)
    best_id = tl.zeros((), dtype=tl.int64)
    for start in range(0, n, TILE):
        offs = start + lanes
        inside = offs < n
        x = tl.load(src + offs, mask=inside, other=float("-inf")).to(FLOAT)
        has_nan = has_nan | (tl.sum((x != x).to(tl.int32), 0) > 0)
        top = tl.max(x, 0)
        first = tl.min(tl.where(x == top, offs, n), 0).to(tl.int64)
        better = top > best  # strictly: the first tile holding the maximum wins ties
        best_id = tl.where(better, first, best_id)
        best = tl.maximum(best, top)
        if not IS_LOGITS:
            smallest = tl.minimum(smallest, tl.min(tl.where(inside, x, float("inf")), 0))
    if IS_LOGITS:
        # NaN rows, a +inf maximum and all -inf rows are bad (nothing to keep in the last).
        finite = (best > float("-inf")) & (best < float("inf")) & (has_nan == 0)
        shift = tl.where(finite, best, 0.0)
    else:
        finite = (smallest >= 0) & (best > 0) & (best < float("inf")) & (has_nan == 0)
        shift = tl.where(finite, best, 1.0)
    ok = finite

    # The controls of this row (Python numbers arrive as float64 bits).
    if T_MODE == TENSOR:
        t = tl.load(t_ptr + row)
        ok = ok & (t >= 0) & (t < float("inf"))
        usable = (t > 0) & (t < float("inf"))
        divisor = tl.where(usable, t, 1.0).to(FLOAT)
        greedy = t == 0
    else:
        divisor = _as_float64(t_bits).to(FLOAT)
        greedy = tl.full((), T_MODE == ZERO, tl.int1)
    if K_MODE == TENSOR:
        k_raw = tl.load(k_ptr + row)
        ok = ok & (k_raw >= 0)
        k = k_raw.to(tl.float64)
    else:
        k = k_value.to(tl.float64)
    if P_MODE == TENSOR:
        p = tl.load(p_ptr + row).to(tl.float64)
        ok = ok & (p > 0) & (p <= 1)
    else:
        p = _as_float64(p_bits)
    if M_MODE == TENSOR:
        min_p = tl.load(m_ptr + row).to(tl.float64)
        ok = ok & (min_p >= 0) & (min_p <= 1)
    else:
        min_p = _as_float64(m_bits)

    # Pass 2: the weights (block sums too when nothing will be cut).
    total = tl.zeros((), dtype=tl.float64)
    for start in range(0, n, TILE):
        offs = start + lanes
        inside = offs < n
        x = tl.load(src + offs, mask=inside, other=0.0).to(FLOAT)
        if IS_LOGITS:
            w = x - shift
            if DIVIDE:
                w = _div(w, divisor, IS_F64)
            w = _exp(w, PRECISE)
        else:
            w = x
            if NORMALIZE:
                w = _div(w, shift, IS_F64)
            if DIVIDE:
                w = _exp(_div(_log(w, PRECISE), divisor, IS_F64), PRECISE)
        if CUT == PLAIN_MIN_P:  # threshold_(w, pred(min_p), 0): NaN stays NaN
            w = tl.where(w <= _as_float64(m_bits).to(FLOAT), 0.0, w)
        w = tl.where(inside, w, 0.0)
        tl.store(out + offs, w, mask=inside)
        if CUT != SCALED_CUT:
            total += _store_block_sums(w, sums_ptr + row * num_blocks, start, num_blocks, BLOCK)

    if CUT == SCALED_CUT:
        # The threshold passes read the weights this program wrote, in another layout.
        tl.debug_barrier()
        cut = tl.zeros((), dtype=FLOAT)
        if K_MODE != OFF:
            cut_k = tl.zeros((), dtype=FLOAT)
            if (k > 0) & (k < n):  # an off row skips the rounds
                cut_k = radix_threshold(out, n, k, False, False, IS_F64, TILE)
            cut = cut_k
        if P_MODE != OFF:
            cut_p = tl.zeros((), dtype=FLOAT)
            if p < 1:
                if K_MODE != OFF:
                    # The top-k survivors' mass: what keep_at_least(w, cut_k) keeps.
                    mass = _kept_mass(out, n, tl.maximum(cut, FLOOR), TILE)
                    cut_p = radix_threshold(out, n, p * mass, True, False, IS_F64, TILE)
                else:
                    cut_p = radix_threshold(out, n, p, True, True, IS_F64, TILE)
            cut = tl.maximum(cut, cut_p)
        if M_MODE != OFF:
            cut = tl.maximum(cut, min_p.to(FLOAT))
        scale = tl.maximum(cut, FLOOR)
        # Pass 3: the kept weights fl(w / s), zeroed where below 1, and their block sums.
        for start in range(0, n, TILE):
            offs = start + lanes
            inside = offs < n
            w = tl.load(out + offs, mask=inside, other=0.0)
            q = _div(w, scale, IS_F64)
            q = tl.where(q <= BELOW_ONE, 0.0, q)
            tl.store(out + offs, q, mask=inside)
            total += _store_block_sums(q, sums_ptr + row * num_blocks, start, num_blocks, BLOCK)

    valid = ok & (total > 0) & (total < float("inf"))
    tl.store(total_ptr + row, total)
    tl.store(valid_ptr + row, valid)
    if GREEDY:
        tl.store(greedy_ptr + row, greedy)
        tl.store(greedy_ids_ptr + row, tl.minimum(best_id, n - 1))


@triton.jit
def _store_block_sums(w, sums_row, start, num_blocks, BLOCK: tl.constexpr):
    """Store the float64 sums of the tile's blocks of ``BLOCK`` (accumulated in the weights'
    dtype, as :func:`fastsample.ops.inverse_cdf.block_sums`); return their float64 sum."""
    TILE: tl.constexpr = w.shape[0]  # a multiple of BLOCK (zeros past the row)
    sums = tl.sum(tl.reshape(w, (TILE // BLOCK, BLOCK)), 1).to(tl.float64)
    ids = start // BLOCK + tl.arange(0, TILE // BLOCK)
    tl.store(sums_row + ids, sums, mask=ids < num_blocks)
    return tl.sum(sums, 0)


@triton.jit
def _kept_mass(row_ptr, n, scale, TILE: tl.constexpr):
    """float64 mass of the entries ``>= scale`` (those ``keep_at_least`` keeps)."""
    mass = tl.zeros((), dtype=tl.float64)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        w = tl.load(row_ptr + offs, mask=offs < n, other=0.0)
        mass += tl.sum(tl.where(w >= scale, w, 0.0).to(tl.float64), 0)
    return mass


def _bits(value: float) -> int:
    """The IEEE float64 bits of ``value`` as a Python int (what ``_as_float64`` reads)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _mode(value: object) -> int:
    if value is None:
        return OFF
    return TENSOR if isinstance(value, Tensor) else NUMBER


def processed_weights(logits: Tensor | None, probs: Tensor | None, controls: Controls) -> Processed:
    """:func:`fastsample.controls.processed_weights` in one launch (``maxima`` is None).

    Arguments are already checked (exactly one of ``logits``/``probs``; ``controls`` from
    :func:`fastsample.ops.validation.check_controls`). No host sync, no tensor op besides
    the launch and the empty outputs.
    """
    source = logits if logits is not None else probs
    assert source is not None
    if source.stride(-1) != 1:
        source = source.contiguous()
    batch, vocab = source.shape
    device = source.device
    is_f64 = source.dtype == torch.float64
    dtype = torch.float64 if is_f64 else torch.float32
    num_blocks = -(-vocab // BLOCK)
    weights = torch.empty(batch, vocab, dtype=dtype, device=device)
    sums = torch.empty(batch, num_blocks, dtype=torch.float64, device=device)
    total = torch.empty(batch, dtype=torch.float64, device=device)
    valid = torch.empty(batch, dtype=torch.bool, device=device)
    t, k, p, m = controls.temperature, controls.top_k, controls.top_p, controls.min_p
    t_mode = ZERO if controls.all_greedy else _mode(t)
    greedy_possible = t_mode in (TENSOR, ZERO)
    greedy = torch.empty(batch, dtype=torch.bool, device=device) if greedy_possible else None
    greedy_ids = torch.empty(batch, dtype=torch.int64, device=device) if greedy_possible else None
    if batch == 0:
        return Processed(weights, sums, total, valid, greedy, greedy_ids, None)
    is_logits = logits is not None
    filters = controls.filters
    if not filters:
        cut = NO_CUT
    elif is_logits and k is None and p is None and isinstance(m, float):
        cut = PLAIN_MIN_P  # every weight <= 1 = the largest: one threshold, no scaling
    else:
        cut = SCALED_CUT
    # weights_from_probs hands float32 probabilities of an even width over untouched when
    # nothing will change them; the same numbers here, not p / max p.
    normalize = not (t is None and not filters and source.dtype == dtype and vocab % 2 == 0)
    dummy = total  # a pointer for controls given as numbers (never read)
    if cut == PLAIN_MIN_P:
        min_p_bits = _bits(predecessor(m, dtype))
    else:
        min_p_bits = _bits(m if isinstance(m, float) else 0.0)
    _controls_kernel[(batch,)](
        source,
        source.stride(0),
        vocab,
        weights,
        sums,
        num_blocks,
        total,
        valid,
        greedy if greedy is not None else valid,
        greedy_ids if greedy_ids is not None else dummy,
        t if isinstance(t, Tensor) else dummy,
        _bits(t if isinstance(t, float) else 1.0),
        k if isinstance(k, Tensor) else dummy,
        k if isinstance(k, int) else 0,
        p if isinstance(p, Tensor) else dummy,
        _bits(p if isinstance(p, float) else 1.0),
        m if isinstance(m, Tensor) else dummy,
        min_p_bits,
        IS_LOGITS=is_logits,
        IS_F64=is_f64,
        NORMALIZE=normalize,
        T_MODE=t_mode,
        DIVIDE=t_mode in (NUMBER, TENSOR),
        K_MODE=_mode(k),
        P_MODE=_mode(p),
        M_MODE=_mode(m),
        CUT=cut,
        GREEDY=greedy_possible,
        TILE=max(tile_for(vocab, device.type == "cpu"), BLOCK),
        BLOCK=BLOCK,
        PRECISE=device.type != "cpu" and libdevice is not None,
    )
    return Processed(weights, sums, total, valid, greedy, greedy_ids, None)
