"""The sampling controls in one Triton launch: :func:`fastsample.controls.processed_weights`.

One program per row makes every pass over its row inside the kernel, so rows never meet
(batch invariance by construction) and a call is one launch whatever controls are on:

1. the input's maximum and first maximal index, NaN flag, and for probabilities the minimum
   and the plain total (for :func:`~fastsample.ops.validation.plain_total_fits`);
2. the weights ``exp((x - max) / T)`` for logits, ``(p / max p)^(1/T)`` (as
   ``exp(log(p / max p) / T)``) for probabilities, written to the ``(B, V)`` weights buffer;
   a greedy row (``T == 0``) gets the point mass at its first maximal index instead (what one
   draw needs; with several draws the draw launch, :func:`fastsample.kernels.greedy.several`,
   takes a greedy row's ``n`` largest inputs from the input itself);
3. the exact cuts on those weights (:mod:`fastsample.kernels.select`): ``cut_k`` the k-th
   largest weight (ties kept), ``cut_p`` the largest threshold whose kept mass is
   ``>= top_p`` of the top-k survivors' mass (``cut_order="vllm"``: of min-p's and top-k's;
   ``"joint"``: of the whole row's), ``cut_min = min_p`` (the largest weight is 1);
4. the kept weights ``fl(w / s)`` zeroed below 1, ``s = max(cut, floor)``, exactly as
   :func:`fastsample.ops.cuts.keep_at_least` (a Python ``min_p`` alone on logits keeps
   ``w > pred(min_p)`` unscaled, as the torch path does), their float64 block sums
   (float32 accumulation inside each block of 256, float64 for float64 input), the total
   and the validity flag;
5. optionally ``top_logprobs`` (N more passes) and, for :func:`fastsample.process`, the
   weights divided by the total.

Every float operation is the torch path's, in the same order (sub, correctly rounded div,
exp), so the weights and the cuts are the same numbers up to one ulp of ``exp``/``log`` where
the libraries differ (none on a GPU: libdevice is what torch's CUDA ops call), and the block
sums up to the order of float32 additions.

Shapes and dtypes: source ``(B, V)`` float16/bfloat16/float32/float64; weights ``(B, V)``
float32 (float64 for float64 input); sums ``(B, ceil(V / 256))`` float64; total ``(B,)``
float64; valid ``(B,)`` bool; top ids ``(B, N)`` int64, top log-probabilities ``(B, N)`` in
the weights' dtype. Controls are ``(B,)`` tensors (read per row, out-of-range values flag the
row invalid) or Python numbers (passed by their float64 bits: no host-to-device copy, no
tensor op).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.cuts import predecessor
from ..ops.inverse_cdf import BLOCK
from ..ops.validation import Controls
from ..ops.weights import Processed, keeps_raw_probs
from . import launch
from .philox import INTERPRETED
from .select import largest as max_of
from .select import radix_threshold, tile_for
from .select import smallest as min_of
from .select import total as sum_of

try:  # libdevice's correctly rounded-to-1-ulp exp/log on a GPU (torch's CUDA exp is the same)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - old triton
    libdevice = None

OFF, NUMBER, TENSOR, ZERO = 0, 1, 2, 3  # how a control is given (ZERO: Python temperature 0)
NO_CUT, SCALED_CUT, PLAIN_MIN_P = 0, 1, 2
# The same numbers as the kernels see them (a @triton.jit function reads only constexprs).
_OFF, _TENSOR, _ZERO = tl.constexpr(OFF), tl.constexpr(TENSOR), tl.constexpr(ZERO)
_SCALED_CUT, _PLAIN_MIN_P = tl.constexpr(SCALED_CUT), tl.constexpr(PLAIN_MIN_P)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    # if/else, not an early return: code after a constexpr-if return is still compiled.
    if PRECISE:  # noqa: SIM108 (a ternary would compile both calls)
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:  # noqa: SIM108 (a ternary would compile both calls)
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _power(base, exponent, PRECISE: tl.constexpr):
    """``base ** exponent`` for ``base >= 0`` in float64, ``0 ** 0 = 1`` (torch's ``pow``)."""
    if PRECISE:
        y = libdevice.pow(base, exponent)
    else:
        y = tl.where(base > 0, tl.exp(exponent * tl.log(tl.where(base > 0, base, 1.0))), 0.0)
        y = tl.where(exponent == 0, 1.0, y)
    return y


@triton.jit
def _setting(ptr, bits, row, MODE: tl.constexpr):
    """A row's setting as a float64 scalar: read from its ``(B,)`` tensor (``MODE`` TENSOR),
    or a Python number passed by its float64 bits (an off setting reads as its bits too: never
    used). The chain's and the history stages' kernels read every setting so."""
    if MODE == _TENSOR:  # noqa: SIM108 (a ternary would compile the load for numbers too)
        value = tl.load(ptr + row).to(tl.float64)
    else:
        value = _as_float64(bits)
    return value


@triton.jit
def _div(a, b, IS_F64: tl.constexpr):
    """Correctly rounded division (Triton's float32 ``/`` is approximate on a GPU)."""
    if IS_F64:  # noqa: SIM108 (a ternary would compile both calls)
        q = a / b
    else:
        q = tl.math.div_rn(a, b)
    return q


@triton.jit
def _mul(a, b, IS_F64: tl.constexpr, PRECISE: tl.constexpr):
    """Correctly rounded product, never fused with a following add into an FMA (PTX
    ``mul.rn``: an explicit rounding mode is not contracted) and without flushing subnormals
    (libdevice's ``mul_rn`` flushes them here)."""
    if PRECISE:
        if IS_F64:
            y = tl.inline_asm_elementwise(
                "mul.rn.f64 $0, $1, $2;", "=d,d,d", [a, b], dtype=tl.float64, is_pure=True,
                pack=1,
            )  # fmt: skip
        else:
            y = tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                pack=1,
            )  # fmt: skip
    else:
        y = a * b
    return y


@triton.jit
def _as_float64(bits):
    """A Python float passed by its IEEE bits (an int of any width) as a float64 scalar."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def scan_row(src, n, IS_LOGITS: tl.constexpr, IS_F64: tl.constexpr, TILE: tl.constexpr,
             BLOCK: tl.constexpr):  # fmt: skip
    """Pass 1 over a row of the input: ``(best, first maximal index, finite, plain total)``.

    ``finite``: for logits no NaN, a finite maximum (an all ``-inf`` row has none); for
    probabilities no NaN, no negative entry, ``0 < max < inf``. The plain total (probabilities
    only, else 0) is the float64 sum of the input's block sums accumulated in float32 (float64
    for float64 input), the numbers :func:`fastsample.ops.validation.plain_total_fits` tests.
    """
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    lanes = tl.arange(0, TILE)
    best = tl.full((), float("-inf"), FLOAT)
    least = tl.full((), float("inf"), FLOAT)
    has_nan = tl.full((), 0, tl.int1)
    best_id = tl.full((), 0, tl.int64)
    plain = tl.full((), 0, tl.float64)
    for start in range(0, n, TILE):
        offs = start + lanes
        inside = offs < n
        x = tl.load(src + offs, mask=inside, other=float("-inf")).to(FLOAT)
        has_nan = has_nan | (sum_of((x != x).to(tl.int32), 0) > 0)
        top = max_of(x, 0)
        first = min_of(tl.where(x == top, offs, n), 0).to(tl.int64)
        better = top > best  # strictly: the first tile holding the maximum wins ties
        best_id = tl.where(better, first, best_id)
        best = tl.maximum(best, top)
        if not IS_LOGITS:
            least = tl.minimum(least, min_of(tl.where(inside, x, float("inf")), 0))
            kept = tl.where(inside, x, 0.0)
            plain += sum_of(sum_of(tl.reshape(kept, (TILE // BLOCK, BLOCK)), 1).to(tl.float64), 0)
    if IS_LOGITS:
        # NaN rows, a +inf maximum and all -inf rows are bad (nothing to keep in the last).
        finite = (best > float("-inf")) & (best < float("inf")) & (has_nan == 0)
    else:
        finite = (least >= 0) & (best > 0) & (best < float("inf")) & (has_nan == 0)
    return best, tl.minimum(best_id, n - 1), finite, plain


@triton.jit
def stream_in_range(stream_ptr, row, STREAM_ROWS: tl.constexpr):
    """Whether this row's tensor ``stream`` is in ``[0, 2**24)`` (always, for a number)."""
    if STREAM_ROWS:
        stream = tl.load(stream_ptr + row)
        fine = (stream >= 0) & (stream < 16777216)
    else:
        fine = tl.full((), 1, tl.int1)
    return fine


@triton.jit(do_not_specialize=["t_bits", "k_value", "p_bits", "m_bits"])
def _controls_kernel(
    src_ptr, src_stride, n, weights_ptr, sums_ptr, num_blocks, total_ptr, valid_ptr,
    t_ptr, t_bits, k_ptr, k_value, p_ptr, p_bits, m_ptr, m_bits, stream_ptr,
    top_ids_ptr, top_logp_ptr, NUM_TOP: tl.constexpr, NORMALIZED: tl.constexpr,
    IS_LOGITS: tl.constexpr,
    IS_F64: tl.constexpr, NORMALIZE: tl.constexpr,
    T_MODE: tl.constexpr, DIVIDE: tl.constexpr, K_MODE: tl.constexpr, P_MODE: tl.constexpr,
    M_MODE: tl.constexpr, CUT: tl.constexpr, GREEDY: tl.constexpr, STREAM_ROWS: tl.constexpr,
    MIN_P_FIRST: tl.constexpr, P_ON_ROW: tl.constexpr, TILE: tl.constexpr,
    BLOCK: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    if IS_F64:
        FLOAT: tl.constexpr = tl.float64
        FLOOR: tl.constexpr = 2.0**-1000
        BELOW_ONE: tl.constexpr = 1.0 - 2.0**-53
        TINY: tl.constexpr = 2.2250738585072014e-308
        FITS_BELOW: tl.constexpr = float("inf")
    else:
        FLOAT: tl.constexpr = tl.float32
        FLOOR: tl.constexpr = 2.0**-100
        BELOW_ONE: tl.constexpr = 1.0 - 2.0**-24
        TINY: tl.constexpr = 1.1754943508222875e-38
        FITS_BELOW: tl.constexpr = 2.0**128  # float32 block sums overflow there
    row = tl.program_id(0).to(tl.int64)
    src = src_ptr + row * src_stride
    out = weights_ptr + row * n
    sums_row = sums_ptr + row * num_blocks
    lanes = tl.arange(0, TILE)

    best, best_id, finite, plain = scan_row(src, n, IS_LOGITS, IS_F64, TILE, BLOCK)
    shift = tl.where(finite, best, 0.0 if IS_LOGITS else 1.0)
    ok = finite & stream_in_range(stream_ptr, row, STREAM_ROWS)

    # The controls of this row (Python numbers arrive as float64 bits). Temperatures below
    # the dtype's smallest normal number divide by it (the torch path's T -> 0+ limit).
    if T_MODE == _TENSOR:
        t = tl.load(t_ptr + row)
        ok = ok & (t >= 0) & (t < float("inf"))
        usable = (t > 0) & (t < float("inf"))
        divisor = tl.maximum(tl.where(usable, t, 1.0).to(FLOAT), TINY)
        greedy = t == 0
    else:
        divisor = tl.maximum(_as_float64(t_bits), TINY).to(FLOAT)
        greedy = tl.full((), T_MODE == _ZERO, tl.int1)
    if K_MODE == _TENSOR:
        k_raw = tl.load(k_ptr + row)
        ok = ok & (k_raw >= 0)
        k = k_raw.to(tl.float64)
    else:
        k = k_value.to(tl.float64)
    if P_MODE == _TENSOR:
        p = tl.load(p_ptr + row).to(tl.float64)
        ok = ok & (p > 0) & (p <= 1)
    else:
        p = _as_float64(p_bits)
    if M_MODE == _TENSOR:
        min_p = tl.load(m_ptr + row).to(tl.float64)
        ok = ok & (min_p >= 0) & (min_p <= 1)
    else:
        min_p = _as_float64(m_bits)

    # Pass 2: the weights (block sums too when nothing will be cut). A greedy row's weights
    # are the point mass at its first maximal index: every later stage then serves it.
    total = tl.full((), 0, tl.float64)
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
        if GREEDY:
            w = tl.where(greedy, tl.where(offs == best_id, 1.0, 0.0).to(FLOAT), w)
        if CUT == _PLAIN_MIN_P:  # threshold_(w, pred(min_p), 0): NaN stays NaN
            w = tl.where(w <= _as_float64(m_bits).to(FLOAT), 0.0, w)
        w = tl.where(inside, w, 0.0)
        tl.store(out + offs, w, mask=inside)
        if CUT != _SCALED_CUT:
            total += _store_block_sums(w, sums_row, start, num_blocks, BLOCK)

    if CUT == _SCALED_CUT:
        # The threshold passes read the weights this program wrote, in another layout.
        tl.debug_barrier()
        cut = tl.full((), 0, FLOAT)
        if K_MODE != _OFF:
            cut_k = tl.full((), 0, FLOAT)
            if (k > 0) & (k < n):  # an off row skips the rounds
                cut_k = radix_threshold(out, n, k, False, False, IS_F64, TILE)
            cut = cut_k
        if P_MODE != _OFF:
            cut_p = tl.full((), 0, FLOAT)
            if p < 1:
                if ((K_MODE != _OFF) & (not P_ON_ROW)) | MIN_P_FIRST:
                    # The survivors' mass of the cuts before top-p (top-k; min-p too in the
                    # "vllm" order): what keep_at_least(w, floor) keeps. In the "joint"
                    # order (P_ON_ROW) top-p takes the whole row's mass, as without top-k.
                    floor = cut
                    if MIN_P_FIRST:
                        floor = tl.maximum(floor, min_p.to(FLOAT))
                    mass = _kept_mass(out, n, tl.maximum(floor, FLOOR), TILE)
                    cut_p = radix_threshold(out, n, p * mass, True, False, IS_F64, TILE)
                else:
                    cut_p = radix_threshold(out, n, p, True, True, IS_F64, TILE)
            cut = tl.maximum(cut, cut_p)
        if M_MODE != _OFF:
            cut = tl.maximum(cut, min_p.to(FLOAT))
        scale = tl.where(greedy, 1.0, tl.maximum(cut, FLOOR))
        # Pass 3: the kept weights fl(w / s), zeroed where below 1, and their block sums.
        for start in range(0, n, TILE):
            offs = start + lanes
            inside = offs < n
            w = tl.load(out + offs, mask=inside, other=0.0)
            q = _div(w, scale, IS_F64)
            q = tl.where(q <= BELOW_ONE, 0.0, q)
            tl.store(out + offs, q, mask=inside)
            total += _store_block_sums(q, sums_row, start, num_blocks, BLOCK)

    valid = ok & (total > 0) & (total < float("inf"))
    if not IS_LOGITS:  # sample_from_probs' overflow rule; a greedy row needs no sum
        valid = valid & ((plain < FITS_BELOW) | greedy)
    tl.store(total_ptr + row, total)
    tl.store(valid_ptr + row, valid)
    if NUM_TOP > 0:
        tl.debug_barrier()  # single kept weights are read back, in another layout
        _store_top(src, out, n, valid, total, top_ids_ptr + row * NUM_TOP,
                   top_logp_ptr + row * NUM_TOP, NUM_TOP, IS_F64, TILE, PRECISE)  # fmt: skip
    if NORMALIZED:  # process(): w / total in the weights' dtype, invalid rows all zeros
        tl.debug_barrier()
        norm = total.to(FLOAT)
        for start in range(0, n, TILE):
            offs = start + lanes
            inside = offs < n
            w = tl.load(out + offs, mask=inside, other=0.0)
            tl.store(out + offs, tl.where(valid, _div(w, norm, IS_F64), 0.0), mask=inside)


@triton.jit
def next_largest(row, n, previous, previous_id, FLOAT: tl.constexpr, TILE: tl.constexpr):
    """``(value, index)`` of the largest of the ``n`` entries at ``row`` after ``(previous,
    previous_id)`` in the order largest first, ties by the lower index (one pass; index ``n``
    when none is left; NaN is never taken). Start from ``(inf, -1)`` for the largest."""
    lanes = tl.arange(0, TILE)
    best = tl.full((), float("-inf"), FLOAT)
    best_id = tl.full((), 0, tl.int32) + n  # n: none found yet
    for start in range(0, n, TILE):
        offs = start + lanes
        x = tl.load(row + offs, mask=offs < n, other=float("-inf")).to(FLOAT)
        after = (x < previous) | ((x == previous) & (offs > previous_id))
        eligible = (offs < n) & after  # NaN is never eligible
        top = max_of(tl.where(eligible, x, float("-inf")), 0)
        first = min_of(tl.where(eligible & (x == top), offs, n), 0)
        take = (top > best) | ((top == best) & (first < best_id))
        best_id = tl.where(take, first, best_id)
        best = tl.where(take, top, best)
    return best, best_id


@triton.jit
def _store_top(src, out, n, valid, total, ids_row, logp_row, NUM_TOP: tl.constexpr,
               IS_F64: tl.constexpr, TILE: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """``top_logprobs``: the ``NUM_TOP`` largest inputs, largest first, ties by the lower index
    (as :func:`fastsample.ops.select.top_entries`), one pass each: the next one is the
    largest entry after the previous one in that order. Their log-probabilities are
    ``log w - log total`` in float64 from the kept weights (``-inf`` outside the kept set and
    on invalid rows)."""
    FLOAT: tl.constexpr = tl.float64 if IS_F64 else tl.float32
    previous = tl.full((), float("inf"), FLOAT)
    previous_id = tl.full((), -1, tl.int32)
    log_total = _log(tl.where(total > 0, total, 1.0), PRECISE)
    for j in range(NUM_TOP):
        previous, previous_id = next_largest(src, n, previous, previous_id, FLOAT, TILE)
        token = tl.minimum(previous_id, n - 1)
        w = tl.load(out + token).to(tl.float64)
        logp = _log(tl.where(w > 0, w, 1.0), PRECISE) - log_total
        tl.store(ids_row + j, token.to(tl.int64))
        tl.store(logp_row + j, tl.where(valid & (w > 0), logp, float("-inf")))


@triton.jit
def _store_block_sums(w, sums_row, start, num_blocks, BLOCK: tl.constexpr):
    """Store the float64 sums of the tile's blocks of ``BLOCK`` (accumulated in the weights'
    dtype, as :func:`fastsample.ops.inverse_cdf.block_sums`); return their float64 sum."""
    TILE: tl.constexpr = w.shape[0]  # a multiple of BLOCK (zeros past the row)
    sums = sum_of(tl.reshape(w, (TILE // BLOCK, BLOCK)), 1).to(tl.float64)
    ids = start // BLOCK + tl.arange(0, TILE // BLOCK)
    tl.store(sums_row + ids, sums, mask=ids < num_blocks)
    return sum_of(sums, 0)


@triton.jit
def _kept_mass(row_ptr, n, scale, TILE: tl.constexpr):
    """float64 mass of the entries ``>= scale`` (those ``keep_at_least`` keeps)."""
    mass = tl.full((), 0, tl.float64)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        w = tl.load(row_ptr + offs, mask=offs < n, other=0.0)
        mass += sum_of(tl.where(w >= scale, w, 0.0).to(tl.float64), 0)
    return mass


def _bits(value: float) -> int:
    """The IEEE float64 bits of ``value`` as a Python int (what ``_as_float64`` reads)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _mode(value: object) -> int:
    if value is None:
        return OFF
    return TENSOR if isinstance(value, Tensor) else NUMBER


def outputs(source: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Empty ``(weights, sums, total, valid)`` for ``source`` (also the fake kernel's)."""
    batch, vocab = source.shape
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    return (
        source.new_empty((batch, vocab), dtype=dtype),
        source.new_empty((batch, -(-vocab // BLOCK)), dtype=torch.float64),
        source.new_empty((batch,), dtype=torch.float64),
        source.new_empty((batch,), dtype=torch.bool),
    )


def top_outputs(source: Tensor, num_top: int) -> tuple[Tensor, Tensor]:
    """Empty ``(top_ids, top_logprobs)``, ``(B, num_top)``, for ``source``."""
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
    shape = (source.shape[0], num_top)
    return source.new_empty(shape, dtype=torch.int64), source.new_empty(shape, dtype=dtype)


def processed_weights(
    logits: Tensor | None,
    probs: Tensor | None,
    controls: Controls,
    stream: Tensor | None = None,
    num_top: int = 0,
    normalized: bool = False,
) -> tuple[Processed, Tensor, Tensor]:
    """:func:`fastsample.controls.processed_weights` in one launch, as a sampler needs it.

    Differences from the torch function, all on the sampler's side of the contract: greedy
    rows' weights are already the point mass at their first maximal index (so ``greedy``,
    ``greedy_ids`` and ``maxima`` are None); ``valid`` already includes
    :func:`~fastsample.ops.weights.probs_total_fits` for probabilities (greedy rows exempt)
    and, with a ``(B,)`` tensor ``stream``, whether it is in ``[0, 2**24)``.

    Arguments are already checked (exactly one of ``logits``/``probs``; ``controls`` from
    :func:`fastsample.ops.validation.check_controls`). No host sync; no tensor op but the
    launch and its empty outputs.

    Also returns ``top_logprobs``' ``(B, num_top)`` token ids (int64) and log-probabilities
    (the weights' dtype), as :func:`fastsample.stages.draw._with_top_logprobs` computes them.
    With ``normalized`` the weights come out divided by the total (:func:`fastsample.process`'s
    result: rows summing to 1, invalid rows all zeros); sums and total stay those of before.
    """
    source = logits if logits is not None else probs
    assert source is not None
    if source.stride(-1) != 1:
        source = source.contiguous()
    batch, vocab = source.shape
    weights, sums, total, valid = outputs(source)
    top_ids, top_logp = top_outputs(source, num_top)
    if batch == 0:
        return Processed(weights, sums, total, valid, None, None, None), top_ids, top_logp
    t, k, p, m = controls.temperature, controls.top_k, controls.top_p, controls.min_p
    t_mode = ZERO if controls.all_greedy else _mode(t)
    is_logits = logits is not None
    if not controls.filters or t_mode == ZERO:
        cut = NO_CUT
    elif is_logits and k is None and p is None and isinstance(m, float):
        cut = PLAIN_MIN_P  # every weight <= 1 = the largest: one threshold, no scaling
    else:
        cut = SCALED_CUT
    dtype = weights.dtype
    # weights_from_probs hands probabilities over untouched when nothing will change them:
    # the same numbers here, not p / max p.
    normalize = not keeps_raw_probs(source, t, controls.filters)
    if cut == PLAIN_MIN_P:
        min_p_bits = _bits(predecessor(m, dtype))  # type: ignore[arg-type]
    else:
        min_p_bits = _bits(m if isinstance(m, float) else 0.0)
    dummy = total  # the pointer of a control given as a number (never read)
    launch.count_launch()
    launch.launcher(_controls_kernel, INTERPRETED)[(batch,)](
        source, source.stride(0), vocab, weights, sums, sums.shape[1], total, valid,
        t if isinstance(t, Tensor) else dummy, _bits(t if isinstance(t, float) else 1.0),
        k if isinstance(k, Tensor) else dummy, k if isinstance(k, int) else 0,
        p if isinstance(p, Tensor) else dummy, _bits(p if isinstance(p, float) else 1.0),
        m if isinstance(m, Tensor) else dummy, min_p_bits,
        stream if stream is not None else dummy, top_ids, top_logp, NUM_TOP=num_top,
        NORMALIZED=normalized,
        IS_LOGITS=is_logits, IS_F64=dtype == torch.float64, NORMALIZE=normalize,
        T_MODE=t_mode, DIVIDE=t_mode in (NUMBER, TENSOR), K_MODE=_mode(k), P_MODE=_mode(p),
        M_MODE=_mode(m), CUT=cut, GREEDY=t_mode in (TENSOR, ZERO),
        STREAM_ROWS=stream is not None, MIN_P_FIRST=controls.min_p_first,
        P_ON_ROW=controls.top_p_on_whole_row,
        TILE=max(tile_for(vocab, INTERPRETED), BLOCK), BLOCK=BLOCK,
        PRECISE=not INTERPRETED and libdevice is not None,
    )  # fmt: skip
    return Processed(weights, sums, total, valid, None, None, None), top_ids, top_logp
