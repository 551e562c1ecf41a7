"""One draw for one or two rows on CPU in eager mode: after the block maxima, ~20 tensor ops.

At B = 1-2 (where CPU serving runs) every tensor op costs a few microseconds whatever its
size, and the call is a chain of them: :mod:`.host_top_k`'s tensor steps are ~100 ops and
~0.3 ms at V = 128,256. Here the tensors only do what needs their numbers (a pass or a
selection over many entries, ``exp``, torch's summation orders); every scalar step runs in
Python floats on ~50 candidates, with exactly the numbers of the general path:

1. the ``need`` blocks with the largest maxima (``need`` = ``max(k)`` plus spares for ties,
   plus one), copied out (``need * BLOCK`` entries, under the parallel grain); the maxima of
   their groups of 32, the ``need`` best groups, and the ``need`` largest entries among those:
   the ``need`` largest entries of the row (each of the row's ``need`` largest is in one of
   ``need`` groups whose maxima reach it). A row of fewer blocks than that is its own
   candidates (one ``topk``);
2. the candidates' weights: ``x - peak`` and ``/ T`` in Python (float32 subtraction and
   division, correctly rounded, are the float64 result rounded once to float32), ``exp`` by
   torch (its rounding is its own), with the few floats just below the k-th logit weighed
   alongside for ``x_low``, the smallest logit reaching the k-th weight: the same check as
   :mod:`.host_top_k` that the candidates hold every entry that can be kept;
3. the cuts (:func:`.host_floats.scales`), the kept weights (``w / s``, rounded to float32,
   and the threshold), the blocks holding them (:func:`.host_floats.block_values`, a block
   of three or more summed by torch as the general path sums it) and the draw
   (:func:`.host_floats.draw_one`), its uniform from the host
   (:meth:`~.seeds.CounterSource.host_row_uniforms`: computed for the next
   :data:`~.seeds.LOOKAHEAD` steps at once, then looked up);
4. the outputs: the row's total (torch's float64 sum over its block table, the general
   path's order), the drawn ids and weights and, for clean rows, their probabilities and
   log-probabilities (:func:`~fastsample.stages.output.finish`'s numbers), the top-N in the
   order of value then index.

Anything it does not serve (a NaN, ``+inf`` or mostly masked row, greedy rows, a temperature
below float32's tiny, ties at the k-th weight beyond the candidates, too many candidates for
a piece under the grain, two or more draws) returns None before any uniform is drawn, and
:mod:`.host_top_k` serves the call.
"""

from __future__ import annotations

import math
import struct
from array import array

import torch
from torch import Tensor

from . import host_floats, host_top_k, joint
from .cuts import BELOW_ONE
from .host_floats import rounded
from .host_top_k import LOW_STEPS, HostDrawn, candidate_sizes, unscaled_min_p
from .inverse_cdf import BLOCK
from .noise import UniformSource
from .threads import GRAIN
from .validation import Controls

ROWS = host_floats.HOST_ROWS
"""Rows up to which :func:`draw` serves a call (with one draw)."""

_GROUP = 32  # entries per group: a candidate block is 8 groups
_TINY = torch.finfo(torch.float32).tiny
_BELOW_ONE = BELOW_ONE[torch.float32]
_F32 = struct.Struct("<f")
_I32 = struct.Struct("<i")


def _below(value: float) -> float:
    """The largest float32 below the finite float32 ``value`` (``torch.nextafter`` to -inf)."""
    if value == 0.0:
        return -(2.0**-149)
    bits = _I32.unpack(_F32.pack(value))[0]
    return _F32.unpack(_I32.pack(bits - 1 if value > 0 else bits + 1))[0]


def _divisors(temperature: object, t_rows: list) -> list[float | None] | None:
    """Each row's float32 temperature divisor as :func:`.host_top_k._divisor` applies it
    (None: no division), or None where a row needs :func:`~.weights.temperature_divisor`."""
    if not isinstance(temperature, Tensor):
        if temperature is None or temperature == 0.0:
            return [None] * len(t_rows)
        return [rounded([max(float(temperature), _TINY)])[0]] * len(t_rows)  # type: ignore[arg-type]
    if host_floats.within(t_rows, _TINY.__le__, host_floats.finite):  # every row positive, finite
        return list(rounded(t_rows))
    return None


def draw(
    logits: Tensor,
    maxima: Tensor,
    controls: Controls,
    count: int,
    source: UniformSource,
    num_top: int,
    few_survivors: bool = False,
) -> HostDrawn | None:
    """One draw per row of :func:`fastsample.ops.small_top_k.draw` for at most :data:`ROWS`
    CPU rows in eager mode (``logits`` float32 or half, ``maxima`` its block maxima,
    ``count`` the largest ``k``), or None (decided before any uniform is drawn; with
    ``few_survivors``, also where the k-th weight reaches min-p's cut, as in
    :func:`.host_top_k.draw`)."""
    batch, vocab = logits.shape
    blocks = maxima.shape[1]
    wide, need, short = candidate_sizes(logits.dtype, vocab, blocks, count, num_top)
    if not 0 < batch <= ROWS or need > vocab or need * BLOCK >= GRAIN:
        return None
    if short and batch * vocab >= GRAIN:
        return None
    temperature = controls.temperature
    host = host_floats.read_controls(controls, batch)
    t_rows = host.temperature
    divisors = _divisors(temperature, t_rows)
    if divisors is None:
        return None  # greedy, invalid or sub-tiny temperatures: the tensor steps
    # The row maximum from every block (a NaN propagates: topk need not pick a NaN block).
    peaks = maxima.amax(-1).tolist()
    if short:  # the row's need largest directly
        top = torch.topk(logits, need, dim=1)
        values, ids = top.values.tolist(), top.indices.tolist()
        floors = [row[-1] for row in values]
    else:
        chosen = torch.topk(maxima, need, dim=1, sorted=False)
        floors = [min(row) for row in chosen.values.tolist()]
    if not all(-math.inf < f and p < math.inf for f, p in zip(floors, peaks, strict=True)):
        return None  # a NaN, +inf or mostly masked row (NaN fails every comparison)
    if not short:
        values, ids = _largest(logits, chosen.indices, need)  # per row, largest first
    if host.top_k is not None:
        k_rows = [min(max(k, 1), count) for k in host.top_k]
    else:
        k_rows = [count] * batch
    # The candidates' logits and the floats just below each k-th one, scaled as the tensor
    # path scales them, then one exp for all: weights[b][wide + i] weighs lows[b][i].
    scaled, lows = array("f"), []  # float32, as the tensor ops would hold them
    for row, peak, divisor, k in zip(values, peaks, divisors, k_rows, strict=True):
        below = [_below(row[k - 1])]
        for _ in range(LOW_STEPS - 1):
            below.append(_below(below[-1]))
        lows.append(below)
        shifted = rounded([x - peak for x in row[:wide]] + [x - peak for x in below])
        scaled.extend(shifted if divisor is None else rounded([x / divisor for x in shifted]))
    # exp in place in the float32 array (the tensor shares its buffer): no list to parse
    torch.frombuffer(scaled, dtype=torch.float32).exp_()
    per_row = wide + LOW_STEPS
    weights = [scaled[b * per_row : (b + 1) * per_row] for b in range(batch)]
    if few_survivors:  # the k-th weights, float32 as the tensor steps hold them
        kth = torch.tensor([w[k - 1] for w, k in zip(weights, k_rows, strict=True)])
        if not host_top_k.top_k_cuts_no_survivor(kth, controls):
            return None
    # x_low, the smallest float32 reaching the k-th weight: the k-th logit, or a few floats
    # below it where the subtraction or the division rounds them together.
    x_lows = []
    for row, weight, below, k in zip(values, weights, lows, k_rows, strict=True):
        reach = sum(map(weight[k - 1].__le__, weight[wide:]))  # weights never rise below x_k
        if reach == LOW_STEPS:
            return None  # a wide flat stretch: the tensor steps search it
        x_low = below[reach - 1] if reach else row[k - 1]
        if not row[wide] < x_low:
            return None  # an entry outside the candidates may reach the k-th weight
        if num_top and not row[num_top - 1] > row[wide]:
            return None  # the num_top largest are not all candidates
        x_lows.append(x_low)
    bounds = None
    if controls.top_p_on_whole_row:  # top-p on the whole row's mass (joint order)
        bounds = joint.host_mass_bounds(logits, maxima, peaks, divisors)
    scales = host_floats.scales(
        [row[:wide] for row in weights], [row[:wide] for row in values], k_rows, count, x_lows,
        host, bounds,
    )  # fmt: skip
    below = _BELOW_ONE
    if few_survivors and (threshold := unscaled_min_p(controls)) is not None:
        scales, below = [1.0] * batch, threshold  # the general path's min-p alone
    kept = []
    for row, scale in zip(weights, scales, strict=True):
        quotients = rounded([w / scale for w in row[:wide]])  # keep_at_least, in float32
        kept.append([q if q > below else 0.0 for q in quotients])
    width = vocab + vocab % 2  # the general path's even-width weight buffer
    rows = host_floats.block_values(kept, [row[:wide] for row in ids], width)
    if not all(rows):
        return None  # nothing kept: an out-of-range tensor setting (the tensor path flags it)
    uniforms = (
        source.host_row_uniforms(1)
        if hasattr(source, "host_row_uniforms")
        else source.row_uniforms(1).tolist()
    )
    tokens, drawn = host_floats.draw_one(rows, [u[0] for u in uniforms], width)
    device = logits.device
    # The float64 table of block sums, for the total: torch's sum over the row (its order).
    table = array("d", bytes(8 * batch * blocks))
    for b, row in enumerate(rows):
        for block in row:
            table[b * blocks + block.index] = block.total
    total = torch.frombuffer(table, dtype=torch.float64).view(batch, blocks).sum(-1)
    valid = torch.ones(batch, dtype=torch.bool, device=device)  # every row keeps a weight
    clean = host.fine
    token_probs = None
    if clean:  # every row valid: the drawn tokens' probabilities, as finish() computes them
        token_probs = _token_probs(drawn, total.tolist(), device)
    else:
        from .weights import controls_in_range

        valid = valid & controls_in_range(controls, batch, device)
    top_ids = top_weights = None
    if num_top:
        order = [
            _by_value_then_index(row, where, num_top)
            for row, where in zip(values, ids, strict=True)
        ]
        top_ids = torch.tensor([[ids[b][i] for i in o] for b, o in enumerate(order)],
                               device=device)  # fmt: skip
        top_weights = torch.tensor([[kept[b][i] for i in o] for b, o in enumerate(order)],
                                   dtype=torch.float64, device=device)  # fmt: skip
    read = _reader(logits, peaks, divisors, scales, below)
    if batch == 1:  # torch.full takes a Python number in a third of torch.tensor's time
        token_ids = torch.full((1, 1), tokens[0], device=device)
        weights = torch.full((1, 1), drawn[0], dtype=torch.float64, device=device)
    else:
        token_ids = torch.tensor(tokens, device=device)[:, None]
        weights = torch.tensor(drawn, dtype=torch.float64, device=device)[:, None]
    genuine = torch.ones((batch, 1), dtype=torch.bool, device=device)
    return HostDrawn(
        token_ids, genuine, total, valid, read, weights, top_ids, top_weights, clean, token_probs
    )


def _largest(logits: Tensor, blocks: Tensor, need: int) -> tuple[list, list]:
    """Per row the ``need`` largest entries (values largest first, and their ids) from the
    candidate ``blocks`` (``(B, need)``), as many rows at a time as stay under the grain."""
    rows = max(1, (GRAIN - 1) // (need * BLOCK))
    if logits.shape[0] <= rows:
        return _largest_in_piece(logits, blocks, need)
    values, ids = [], []
    for first in range(0, logits.shape[0], rows):
        got = _largest_in_piece(logits[first : first + rows], blocks[first : first + rows], need)
        values += got[0]
        ids += got[1]
    return values, ids


def _largest_in_piece(logits: Tensor, blocks: Tensor, need: int) -> tuple[list, list]:
    """:func:`_largest` for rows whose candidate blocks hold fewer entries than the grain:
    their copy, its group maxima, the ``need`` best groups, the ``need`` best of their
    entries."""
    batch, vocab = logits.shape
    device = logits.device
    full = vocab // BLOCK
    per_block = BLOCK // _GROUP
    if vocab % BLOCK == 0 and logits.is_contiguous():  # whole blocks: rows of a block view
        rows = blocks
        if batch > 1:
            rows = blocks + torch.arange(0, batch * full, full, device=device)[:, None]
        content = logits.view(batch * full, BLOCK).index_select(0, rows.view(-1))
    else:  # a short last block or strided rows: gathered columns, the padding at -inf
        columns = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=device)).view(batch, -1)
        content = logits.gather(1, columns.clamp_max(vocab - 1))
        if vocab % BLOCK:
            content.masked_fill_(columns >= vocab, -math.inf)
    groups = content.view(batch, need * per_block, _GROUP)
    best_groups = torch.topk(groups.amax(-1), need, dim=1, sorted=False).indices
    if batch > 1:  # as rows of the flat group view
        best_groups = (
            best_groups
            + torch.arange(0, batch * need * per_block, need * per_block, device=device)[:, None]
        )
    picked = content.view(-1, _GROUP).index_select(0, best_groups.view(-1))
    best = torch.topk(picked.view(batch, need * _GROUP), need, dim=1)
    values, places = best.values.tolist(), best.indices.tolist()
    group_rows, block_rows = best_groups.tolist(), blocks.tolist()
    ids = []
    for b in range(batch):
        block_of, first = block_rows[b], b * need * per_block
        # The id of each picked group's first entry: its block's, plus its place in the block.
        starts = [
            block_of[group // per_block] * BLOCK + group % per_block * _GROUP
            for group in (g - first for g in group_rows[b])
        ]
        ids.append([starts[place // _GROUP] + place % _GROUP for place in places[b]])
    return values, ids


def _token_probs(drawn: list[float], totals: list[float], device: torch.device):
    """``(probs, logprobs)`` ``(B, 1)`` float32 of the drawn weights over the rows' totals,
    bitwise :func:`fastsample.stages.output.finish`'s: a float64 quotient (Python's is the
    same IEEE division), the difference of torch's float64 logs (one op for all of them, the
    same function per element), each rounded once to float32."""
    batch = len(drawn)
    logs = array("d", drawn + totals)
    torch.frombuffer(logs, dtype=torch.float64).log_()  # in place in the array
    probs = [d / t for d, t in zip(drawn, totals, strict=True)]
    logprobs = [logs[b] - logs[batch + b] for b in range(batch)]
    if batch == 1:
        return (torch.full((1, 1), probs[0], dtype=torch.float32, device=device),
                torch.full((1, 1), logprobs[0], dtype=torch.float32, device=device))  # fmt: skip
    return (torch.tensor(probs, dtype=torch.float32, device=device)[:, None],
            torch.tensor(logprobs, dtype=torch.float32, device=device)[:, None])  # fmt: skip


def _by_value_then_index(values: list, ids: list, num: int) -> list[int]:
    """Positions of the ``num`` largest candidates, ties by the lower id (the candidates come
    largest first; only equal values need reordering)."""
    if all(values[i] > values[i + 1] for i in range(num)):  # no tie at or across the num-th
        return list(range(num))
    return sorted(range(len(values)), key=lambda i: (-values[i], ids[i]))[:num]


def _reader(logits: Tensor, peaks: list, divisors: list, scales: list, below: float):
    """``read(columns)``: the kept weights at ``(B, c)`` columns below the even width, as the
    general path's weight buffer holds them (the padding column weighs 0): scaled, then
    kept where above ``below``."""
    vocab = logits.shape[1]

    def read(columns: Tensor) -> Tensor:
        device = logits.device
        best = torch.tensor(peaks, dtype=torch.float32, device=device)[:, None]
        x = logits.gather(1, columns.clamp_max(vocab - 1))
        w = torch.sub(x, best, out=torch.empty(x.shape, dtype=torch.float32, device=device))
        if divisors[0] is not None:
            w.div_(torch.tensor(divisors, dtype=torch.float32, device=device)[:, None])
        w.exp_().div_(torch.tensor(scales, dtype=torch.float32, device=device)[:, None])
        kept = torch.nn.functional.threshold_(w, below, 0.0)
        return kept if vocab % 2 == 0 else torch.where(columns < vocab, kept, 0.0)

    return read
