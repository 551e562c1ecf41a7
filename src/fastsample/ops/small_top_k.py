"""Sampling with a small Python ``top_k`` without computing the weights of the whole row.

When ``top_k`` is a Python int up to :data:`~fastsample.select.CANDIDATE_MAX_K` (temperature,
top-p and min-p Python numbers or off, float32/bfloat16/float16 logits),
every token that can survive the cuts lies in the ``k`` blocks with the largest maxima, except
ties at the k-th weight, which can sit anywhere in the row. So instead of the weights of every
entry (~25 read passes of eager CPU ops), this path computes:

1. the block maxima of the logits (one read pass), the ``k`` largest logits from the ``k``
   best blocks (:func:`fastsample.select.candidate_entries`), their weights and ``cut_k``,
   the k-th largest weight;
2. ``x_low``, the smallest float32 logit whose weight is ``>= cut_k``, by a 32-way search
   over the ordered bit patterns (7 rounds of ``(B, 33)`` ops). The weight map
   ``x -> exp((x - max) / T)`` is monotone, so ``w >= cut_k`` iff ``x >= x_low``;
3. one counting pass over the logits: per block, how many are ``>= x_low``. Outside the
   candidate blocks those are exactly the ties at ``cut_k``; top-p's mass needs their number
   (this pass is the price of exactness: integer or bfloat16-rounded logits tie often);
4. the cuts of :mod:`fastsample.controls` (the same functions on the same numbers) and the
   block sums of the kept weights: each candidate block summed from its own entries (the k
   largest and its ties, no ``exp``), every other block its tie count times the ties' scaled
   weight (exactly 1, or 0 if cut);
5. the blocked inverse CDF over that table, reading a chosen block's weights from its logits.

Per-row controls: temperature, top-p and min-p may be ``(B,)`` tensors (applied to the
candidates, as the general path applies them to the row; greedy rows, ``T == 0``, are drawn
at ``T = 1`` and replaced by the caller, as there). ``top_k`` may be a ``(B,)`` tensor too
where its values can be read without a device sync (a CPU tensor outside ``torch.compile``
and tracing): the candidates are then the ``max(k)`` largest and each row is cut at its own
``k`` (see :func:`candidate_count`; a row with top-k off sends the batch to the general path).
On CPU in eager mode, where data-dependent shapes and host reads cost nothing, three
shortcuts apply; on CUDA and under ``torch.compile`` the fixed-shape steps stay (no sync):

* step 1 picks the ``k`` largest from the few candidate-block entries that reach the
  smallest candidate block maximum (:func:`fastsample.select.candidate_entries` with
  ``host=True``), not by ``topk`` over 400 group maxima and 1,600 entries a row;
* a few candidates more than ``k`` are taken (spares for ties at the k-th logit, for the
  half types, then one more): when the last of them lies below ``x_low`` in every row
  (:func:`_only_candidates_reach`; continuous logits almost always), no entry outside the
  candidates can be kept, so step 3 disappears and step 4 adds the candidates' kept weights
  into their blocks (:func:`_candidate_block_sums`: bitwise the general path's sums, a
  block holding three or more summed from a tile as that path does);
* otherwise step 3 reads only the blocks whose maximum reaches ``x_low`` (for continuous
  logits, the candidate blocks alone), not the whole row.

Every number is computed by the same float operations as the general path
(:func:`fastsample.controls.processed_weights`, then
:func:`~fastsample.inverse_cdf.inverse_cdf_draw` over the kept weights), so the draws are
bitwise those of the general path with the same Python ``top_k`` (and, per row, with a
tensor one: the candidates' count does not change any row's numbers); the tests hold the
two paths to that
on CPU (and on CUDA where one is present: a reduction there could order its float32 block
sums differently for the two shapes, which would change a draw only when its uniform falls
within that rounding of a block boundary; the law is exact either way).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from . import host_rows, host_top_k
from .cuts import BELOW_ONE, CUT_FLOOR, as_rows, top_p_cut_from_candidates
from .eager import host_readable
from .inverse_cdf import BLOCK, inverse_cdf_draw, kept_block_sums, tile_sums
from .joint import joint_top_p_cut
from .noise import UniformSource
from .pieces import piece_rows
from .seeds import _small_op_mode
from .select import (
    CANDIDATE_MAX_K,
    Candidates,
    block_maxima,
    candidate_entries,
    first_argmax,
    order_key,
)
from .validation import Controls
from .weights import controls_in_range, logit_weights_divided_, temperature_divisor

# The counting pass works on pieces of this many logits (1 MiB of float32): its scratch stays
# in cache, so the pass costs little more than reading the logits.
_PIECE_ELEMENTS = 1 << 18
# Bit patterns of float32 keyed so that integer order is float order (see select.order_key).
_NEG_INF_KEY = -2139095041  # the key of -inf
_SEARCH_SHIFT = 5  # 2**5 = 32-way search: 31 probes a round divide the interval by 32
# Keys of -inf .. +inf span < 2**32; a round leaves at most ceil(span / 32) of them:
# 2**32 -> 2**27 -> ... -> 2**7 -> 4 -> 1 in 7 rounds. (Wider rounds cost more per probe
# than they save in rounds: 64-way 6 rounds 0.29 ms, 256-way 4 rounds 0.41 ms, here 0.26.)
_SEARCH_ROUNDS = 7
# The selective counting pass (CPU eager) reads the blocks outside the candidates whose
# maximum reaches x_low one by one; past this share of all blocks the pass over every block
# (cache-sized pieces) is cheaper (integer logits, say, tie in every block).
_SELECTIVE_MAX_SHARE = 0.125


# Candidates taken beyond k on CPU (eager) for ties at the k-th logit, per dtype: so that the
# candidates alone hold every entry >= x_low (:func:`_only_candidates_reach`). float32
# logits from a model rarely tie; bfloat16 ones do: at B=256, V=128,256, k=50, 1-2 entries
# past the k-th equal it on average, at most 8 (randn x 1, 3 or 10). A spare costs ~1/k of
# the candidate selection.
_TIE_SPARES = {torch.float32: 0, torch.bfloat16: 16, torch.float16: 16}

# Logits the path serves: float32 and the half types, whose weights the general path
# computes in float32 as well (float64 logits give float64 weights: the general path).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Drawn(NamedTuple):
    """What :func:`draw` returns: the general path's draw and the means to finish it."""

    token_ids: Tensor  # (B, n) int64, not yet clamped to V - 1
    genuine: Tensor  # (B, n) bool
    total: Tensor  # (B,) float64, the kept mass
    valid: Tensor  # (B,) bool
    read: Callable[[Tensor], Tensor]  # kept (scaled) weights at (B, c) columns
    maxima: Tensor  # (B, blocks) block maxima of the logits (for top_logprobs)
    greedy: Tensor | None = None  # (B,) bool rows with a tensor temperature of 0, or None
    greedy_ids: Tensor | None = None  # (B,) their first maximal index, or None
    weights: Tensor | None = None  # (B, n) float64 kept weights of the drawn ids, or None
    top_ids: Tensor | None = None  # (B, N) the N largest, ties by the lower index, or None
    top_weights: Tensor | None = None  # (B, N) float64 their kept weights
    clean: bool = False  # every row valid and every draw genuine, known on the host
    # (B, n) float32 probabilities and log-probabilities of the drawn ids, as
    # stages.output.finish computes them for clean rows, when the draw computed them
    token_probs: tuple[Tensor, Tensor] | None = None


def candidate_count(controls: Controls, vocab: int) -> int | None:
    """How many candidates :func:`draw` takes for these controls, or None if it cannot serve
    their ``top_k``: a Python int up to :data:`~fastsample.select.CANDIDATE_MAX_K`, or a
    host-readable tensor whose rows all cut (``1 <= k < V``, at most that many), the largest.

    Rows with a negative ``k`` are invalid (flagged by the caller) and are served as ``k = 1``;
    a row with top-k off (``0`` or ``>= V``) needs the general path's selection over its row.
    """
    k = controls.top_k
    if isinstance(k, int):
        return k if k <= CANDIDATE_MAX_K else None
    if not isinstance(k, Tensor) or k.numel() == 0 or not host_readable(k):
        return None
    # One host read: the largest k, with top-k off (0) counted as V so that it disqualifies.
    if k.numel() <= 1024:  # the values themselves: fewer ops
        largest = max(max(vocab if v == 0 else v for v in k.tolist()), 1)
    else:
        largest = max(int(torch.where(k == 0, vocab, k).max()), 1)
    return largest if largest < vocab and largest <= CANDIDATE_MAX_K else None


def applies(logits: Tensor | None, controls: Controls) -> int | None:
    """Whether :func:`draw` serves this call (otherwise the general path does): its
    :func:`candidate_count` (at least 1) if so, else None."""
    if logits is None or logits.dtype not in _DTYPES:
        return None
    batch, vocab = logits.shape
    t = controls.temperature
    if batch == 0 or vocab < BLOCK or not (t is None or isinstance(t, Tensor) or t > 0):
        return None
    return candidate_count(controls, vocab)


MIN_P_CANDIDATES = 64
"""The fewest candidates taken for a call without top-k whose min-p keeps few tokens
(:func:`min_p_candidates`)."""

# Blocks beyond the candidates' count (tie spares and one more) for the candidate path.
_SHORT_MARGIN = 32

MIN_P_CANDIDATE_ENTRIES = 1 << 14
"""At most this many candidates in the batch (``B x k``) for :func:`min_p_candidates`: past
it the general path is cheaper (B=64, V=128,256 on the 2-core AMD host: ``k = 256`` took
0.7x the general path's time for temperature and min-p, ``k = 512`` 1.8x)."""


def min_p_candidates(logits: Tensor | None, controls: Controls) -> Controls | None:
    """Controls the candidate path serves in place of ``controls`` when these have no top-k but
    a min-p on every row (CPU eager), or None.

    Min-p keeps ``w >= min_p`` (the largest weight is 1), usually a few tokens. A top-k with
    more candidates than min-p keeps in every row cuts none of them, so the kept set is the
    same with it and the candidate path gives the general path's numbers. Top-p's mass is
    unchanged too: in the ``"vllm"`` order it is min-p's survivors', in the others the whole
    row's, which the ``"joint"`` order reads. The returned ``top_k`` is the most candidates
    allowed (:data:`MIN_P_CANDIDATE_ENTRIES`); :func:`draw` with ``few_survivors=True`` picks
    the count from the block maxima (:func:`_survivor_candidates`), checks on the weighed
    candidates, before any uniform is drawn, that the survivors are fewer, and returns None
    otherwise (the caller then takes the general path with ``controls``).
    """
    min_p = controls.min_p
    if controls.top_k is not None or min_p is None or logits is None:
        return None
    if not host_readable(logits):
        return None  # the check reads the candidates' weights on the host
    if isinstance(min_p, Tensor):
        if not host_readable(min_p) or not bool((min_p > 0).all()):
            return None  # a row with min-p off (or NaN) keeps its whole row
    elif not min_p > 0:
        return None
    order = controls.cut_order
    if controls.top_p is not None and order != "vllm":
        order = "joint"  # top-p on the whole row's mass, as without a top-k
    largest = min(CANDIDATE_MAX_K, MIN_P_CANDIDATE_ENTRIES // max(logits.shape[0], 1))
    if largest < MIN_P_CANDIDATES:
        return None
    virtual = replace(controls, top_k=largest, cut_order=order)  # draw() picks the k
    return virtual if applies(logits, virtual) else None


def _survivor_slots(blocks: int) -> int:
    """Candidates for a row whose ``blocks`` blocks each hold a survivor: 1.5x and 8 more.
    On ``N(0, 3^2)`` logits at T 0.8 and min-p 0.05 (16 batches of 64 rows) the most
    survivors a row had was 1.24x its blocks holding one; a row with more makes the draw
    decline and the general path serve the call. (Twice the blocks, before: B=64 7.8 ms
    against 6.6 now, and one input in 8 past the candidates' limit.)"""
    return blocks + blocks // 2 + 8


def _survivor_candidates(maxima: Tensor, controls: Controls) -> int | None:
    """How many candidates :func:`min_p_candidates`'s draw takes: at least
    :data:`MIN_P_CANDIDATES` and :func:`_survivor_slots` of the most blocks of a row whose
    maximum min-p keeps (each holds a survivor; a few hold two or more), fewer than the row's
    blocks; None past ``controls.top_k`` (its most) or where that leaves no room. Read on the
    host from the block maxima, so a call with many survivors skips the candidates;
    approximate weights suffice (the draw checks the exact ones)."""
    scaled = maxima.float() - maxima.amax(-1, keepdim=True).float()
    t = controls.temperature
    if isinstance(t, Tensor):
        scaled = scaled / t.float()[:, None]
    elif t is not None:
        scaled = scaled / t
    min_p = controls.min_p
    assert min_p is not None
    log_min = torch.log(min_p.float())[:, None] if isinstance(min_p, Tensor) else math.log(min_p)
    # A NaN row counts none here; the draw declines it.
    blocks = int((scaled >= log_min).sum(-1).max())
    # The candidate path takes its candidates from more blocks than it has candidates.
    count = min(max(MIN_P_CANDIDATES, _survivor_slots(blocks)), maxima.shape[1] - _SHORT_MARGIN)
    assert isinstance(controls.top_k, int)
    return count if blocks < count <= controls.top_k else None


def draw(
    logits: Tensor,
    controls: Controls,
    num_samples: int,
    source: UniformSource,
    num_top: int = 0,
    count: int | None = None,
    few_survivors: bool = False,
) -> Drawn | None:
    """Draws from the processed distribution of ``logits`` (:func:`applies` holds).

    ``read`` in the result gives the kept (scaled) weight at any ``(B, c)`` columns, as the
    general path's weight buffer would hold it. With a tensor temperature, ``greedy`` and
    ``greedy_ids`` tell the rows to replace by their first maximal index (drawn at ``T = 1``
    here, like the general path draws them). On CPU in eager mode the result may also carry
    the drawn ids' kept weights and the ``num_top`` largest (:mod:`.host_top_k`).
    ``count``: :func:`candidate_count`'s value when the caller has it. ``few_survivors``:
    ``controls`` come from :func:`min_p_candidates`; None when a row's min-p keeps as many
    tokens as there are candidates (decided before any uniform is drawn).
    """
    # One pass over the logits (torch's threads), then a chain of small ops
    # (see fastsample.ops.threads).
    maxima = block_maxima(logits)
    if host_readable(logits):
        if count is None:
            count = candidate_count(controls, logits.shape[1])
        assert count is not None
        if few_survivors:
            count = _survivor_candidates(maxima, controls)
            if count is None:
                return None
            controls = replace(controls, top_k=count)
        got = None
        if num_samples == 1 and logits.shape[0] <= host_rows.ROWS:
            got = host_rows.draw(logits, maxima, controls, count, source, num_top, few_survivors)
        if got is None:
            got = host_top_k.draw(logits, maxima, controls, count, num_samples, source, num_top,
                                  few_survivors)  # fmt: skip
        if got is not None:
            return Drawn(
                got.token_ids, got.genuine, got.total, got.valid, got.read, maxima,  # type: ignore[arg-type]
                weights=got.weights, top_ids=got.top_ids, top_weights=got.top_weights,
                clean=got.clean, token_probs=got.token_probs,
            )  # fmt: skip
    if few_survivors:
        return None  # the fixed-shape steps cannot check the survivors
    return _draw_from_maxima(logits, maxima, controls, num_samples, source)


def _draw_from_maxima(
    logits: Tensor, maxima: Tensor, controls: Controls, num_samples: int, source: UniformSource
) -> Drawn:
    batch, vocab = logits.shape
    width = vocab + vocab % 2  # the general path's even-width weight buffer
    temperature = controls.temperature
    count = candidate_count(controls, vocab)
    assert count is not None

    best = maxima.amax(-1).to(torch.float32)
    finite = (best > -math.inf) & (best < math.inf)
    shift = torch.where(finite, best, 0.0)

    divisor = temperature_divisor(temperature, torch.float32)  # once for every weigh()

    def weigh(x: Tensor) -> Tensor:  # the general path's formula, on a few columns
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return logit_weights_divided_(out, x, shift, divisor)

    # On CPU in eager mode a few more candidates (spares for ties at the k-th weight, then
    # one more) tell whether every entry >= x_low is a candidate (_only_candidates_reach).
    readable = host_readable(logits)
    spare = min(_TIE_SPARES[logits.dtype], vocab - count - 1) if readable else 0
    wide = count + spare  # the candidates that can be kept when they alone reach x_low
    found = candidate_entries(logits, wide + 1 if readable else count, maxima, host=readable)
    wide_values = found.values[:, :wide]
    values, positions = wide_values[:, :count], found.positions[:, :count]
    wide_weights = torch.where(wide_values > -math.inf, weigh(wide_values), 0.0)
    candidates = wide_weights[:, :count]
    if isinstance(controls.top_k, Tensor):  # each row's own k-th largest (sorted candidates)
        kth = controls.top_k.clamp(1, count).sub_(1).to(torch.int64)[:, None]
        cut_k = candidates.gather(1, kth).squeeze(1)
        x_k = values.gather(1, kth).squeeze(1)
    else:
        cut_k, x_k = candidates[:, -1], values[:, -1]
    x_low = _lowest_logit_reaching(weigh, x_k.float(), cut_k, host=readable)
    alone = readable and _only_candidates_reach(found, wide, x_low)
    if alone:  # count(x >= x_low) from the candidates
        reaching = (wide_values >= x_low[:, None]).sum(-1, dtype=torch.float64)
    else:
        # 0/1 where a candidate block's entry is >= x_low: its count, and its kept weights.
        hits = torch.empty(found.content.shape, dtype=torch.float32, device=logits.device)
        torch.ge(found.content, x_low[:, None], out=hits)
        if readable:
            counts = _count_selected(logits, x_low, maxima, found, hits, finite & (cut_k > 0))
        else:
            counts = _count_at_least(logits, x_low)  # (B, blocks) float32
        reaching = counts.sum(-1, dtype=torch.float64)

    # Entries above cut_k are all candidates; the rest of count(x >= x_low) are ties at it.
    strictly_above = torch.where(candidates > cut_k[:, None], candidates, 0.0)
    cut = cut_k
    cut_min = None
    if controls.min_p is not None:  # the largest weight is 1
        f64 = torch.zeros(batch, dtype=torch.float64, device=logits.device)
        cut_min = as_rows(controls.min_p, batch, f64).to(cut.dtype)
    if controls.top_p is not None:
        floor = cut_k
        ties = reaching - (strictly_above > 0).sum(-1)
        if controls.min_p_first:  # top-p's mass: the survivors of min-p and top-k
            assert cut_min is not None
            floor = torch.maximum(cut_k, cut_min)
            # Above cut_k every entry is a candidate, so are the ties at a higher floor.
            at_floor = (candidates == floor[:, None]).sum(-1, dtype=torch.float64)
            ties = torch.where(floor > cut_k, at_floor, ties)
        if controls.top_p_on_whole_row:
            cut_p = joint_top_p_cut(
                logits, maxima, candidates, cut_k, ties, controls.top_p, shift, divisor, readable
            )
        else:
            cut_p = top_p_cut_from_candidates(candidates, floor, controls.top_p, ties)
        cut = torch.maximum(cut, cut_p)
    if cut_min is not None:
        cut = torch.maximum(cut, cut_min)
    scale = cut.clamp_min(CUT_FLOOR[torch.float32])[:, None]

    def keep(w: Tensor) -> Tensor:  # controls.keep_at_least, on a few columns
        return torch.nn.functional.threshold_(w.div_(scale), BELOW_ONE[torch.float32], 0.0)

    def read(columns: Tensor) -> Tensor:
        w = weigh(logits.gather(1, columns.clamp_max(vocab - 1)))
        if width > vocab:  # the general buffer's padding column weighs 0
            w = torch.where(columns < vocab, w, 0.0)
        return keep(w)

    if alone:  # the kept weight of each of the wide candidates, as the general path keeps it
        table = _candidate_block_sums(found, keep(wide_weights.clone()), maxima.shape[1], width)
    else:
        # Besides the k largest, only ties at cut_k can be kept (entries >= x_low), each
        # scaled to exactly 1 when the final cut is cut_k itself (and above the floor), else
        # cut. So the candidate blocks' kept weights are that tie weight where x >= x_low,
        # with the k largest written over it: no exp over the blocks.
        tie_weight = ((cut == cut_k) & (cut_k >= CUT_FLOOR[torch.float32])).to(torch.float32)
        kept_candidates = keep(candidates.clone())
        kept = hits.mul_(tie_weight[:, None]).scatter_(1, positions, kept_candidates)
        kept = kept.view(batch, found.content.shape[1] // BLOCK, BLOCK)
        candidate_sums = tile_sums(kept, found.blocks, width)
        table = (counts * tie_weight[:, None]).scatter_(1, found.blocks, candidate_sums)
    sums = table.to(torch.float64)

    shape = torch.empty((), dtype=torch.float32, device=logits.device).expand(batch, width)
    token_ids, genuine, total = inverse_cdf_draw(shape, num_samples, source, sums=sums, read=read)
    valid = finite & (total > 0) & (total < math.inf)
    tensors = (temperature, controls.top_k, controls.top_p, controls.min_p)
    if any(isinstance(c, Tensor) for c in tensors):
        valid = valid & controls_in_range(controls, batch, logits.device)
    greedy = greedy_ids = None
    if isinstance(temperature, Tensor):
        greedy = temperature == 0
        # Reading it is free where the values are (CPU eager): no greedy row, nothing to do.
        if not host_readable(greedy) or bool(greedy.any()):
            greedy_ids = first_argmax(logits, maxima)
        else:
            greedy = None
    return Drawn(token_ids, genuine, total, valid, read, maxima, greedy, greedy_ids)


def _lowest_logit_reaching(
    weigh: Callable[[Tensor], Tensor], x_k: Tensor, cut_k: Tensor, host: bool = False
) -> Tensor:
    """``(B,)`` smallest float32 ``x`` with ``weigh(x) >= cut_k``; ``weigh(x_k) == cut_k``.

    A 32-way search over ordered keys between ``-inf`` (weight 0, below any positive cut)
    and ``x_k``: 31 probes a round, the interval shrinks 32x, 7 rounds cover all keys.
    Rows with ``cut_k == 0`` or NaN get an arbitrary value (their ties weigh nothing).

    ``host=True`` (CPU eager) first tries ``x_k`` itself, with one host read: where the
    float32 just below ``x_k`` weighs less than ``cut_k`` in every row, ``x_k`` is the answer
    (the weight is monotone). Distinct float32 logits keep distinct weights unless ``T`` is
    large, so the ~120 small ops of the search are skipped in most calls.
    """
    if host:
        below = torch.nextafter(x_k, torch.full_like(x_k, -math.inf))
        if bool((weigh(below[:, None]).squeeze(1) < cut_k).all()):
            return x_k.clone()
    with _small_op_mode():  # ~120 ops on (B, 33) tensors: per-op overhead is the cost
        hi = order_key(x_k.view(torch.int32).to(torch.int64))[:, None]
        lo = torch.full_like(hi, _NEG_INF_KEY)
        steps = torch.arange((1 << _SEARCH_SHIFT) + 1, device=x_k.device)
        cut = cut_k[:, None]
        for _ in range(_SEARCH_ROUNDS):
            table = ((hi - lo) * steps).bitwise_right_shift_(_SEARCH_SHIFT).add_(lo)
            probes = order_key(table[:, 1:-1]).to(torch.int32).view(torch.float32)
            # The weight is monotone, so the probes below the cut are a prefix.
            below = (weigh(probes) < cut).sum(-1, keepdim=True)
            lo, hi = table.gather(1, below), table.gather(1, below.add_(1))
        low = order_key(hi).to(torch.int32).view(torch.float32).squeeze(1)
    return low.clone()  # an ordinary tensor again


def _only_candidates_reach(found: Candidates, wide: int, x_low: Tensor) -> bool:
    """Whether every entry ``>= x_low`` of every row is among its ``wide`` largest: the
    row's ``wide + 1``-th largest entry (``found`` holds ``wide + 1``) lies below ``x_low``.
    One host read (CPU eager). Continuous float32 logits almost always pass, and half-precision
    ones with their spares (:data:`_TIE_SPARES`); many ties at the k-th weight (integer
    logits, weights equal after rounding) and NaN rows do not, and take the counting pass."""
    return bool((found.values[:, wide] < x_low).all())


def _candidate_block_sums(found: Candidates, kept: Tensor, blocks: int, width: int) -> Tensor:
    """``(B, blocks)`` float32 block sums of the kept weights when the candidates are the
    only entries that can be kept (:func:`_only_candidates_reach`); ``kept`` is ``(B, c)``,
    the first c candidates' kept weights. Bitwise the general path's block sums (CPU eager).

    A sum of at most two nonzero weights (among zeros) rounds once whatever the order, so
    most blocks are the candidates' weights added into a zero table. A block holding three
    or more (a few per batch at k=50, V=128k) is summed as the general path sums it: its
    ``BLOCK`` weights laid out in place, zeros elsewhere, one ``sum`` over the tile.
    """
    count = kept.shape[1]
    positions = found.positions[:, :count]
    # Position p of the content is entry p % BLOCK of candidate block p // BLOCK (the real
    # block: unlike found.ids, never clamped, so padding past the vocabulary stays apart).
    block_ids = found.blocks.gather(1, positions // BLOCK)
    return kept_block_sums(kept, block_ids, positions % BLOCK, blocks, width)


def _count_at_least(logits: Tensor, x_low: Tensor) -> Tensor:
    """``(B, blocks)`` float32: per block, the entries ``>= x_low`` of their row.

    The comparison writes 0/1 floats straight into a cache-sized scratch (a bool result and
    its sum would cost ~10x more on CPU); their block sums are exact.
    """
    batch, vocab = logits.shape
    full = vocab // BLOCK
    rows = piece_rows(batch, vocab, logits.device, _PIECE_ELEMENTS)
    scratch = torch.empty(min(rows, batch), vocab, dtype=torch.float32, device=logits.device)
    pieces = []
    for piece, low in zip(logits.split(rows), x_low[:, None].split(rows), strict=True):
        hits = torch.ge(piece, low, out=scratch[: piece.shape[0]])
        part = hits[:, : full * BLOCK].reshape(piece.shape[0], full, BLOCK).sum(-1)
        if vocab % BLOCK:
            part = torch.cat((part, hits[:, full * BLOCK :].sum(-1, keepdim=True)), dim=1)
        pieces.append(part)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _count_selected(
    logits: Tensor, x_low: Tensor, maxima: Tensor, found: Candidates, hits: Tensor, rows: Tensor
) -> Tensor:
    """:func:`_count_at_least` from the blocks that can hold an entry ``>= x_low`` (CPU eager).

    The candidate blocks' counts come from ``hits`` (their 0/1 comparisons, already made);
    any other block counts only if its maximum reaches ``x_low``, and only for ``rows`` (the
    others' ties weigh nothing: ``cut_k`` is 0, or the row is invalid). Those blocks are read
    one by one, a data-dependent selection; if there are many, the pass over every block.
    The counts are exact integers either way, so the numbers are the full pass's.
    """
    batch, blocks = maxima.shape
    vocab = logits.shape[1]
    chosen = found.blocks.shape[1]
    counts = torch.zeros(batch, blocks, dtype=torch.float32, device=logits.device)
    counts.scatter_(1, found.blocks, hits.view(batch, chosen, BLOCK).sum(-1))
    # NaN maxima never reach; -inf padding of the candidates never does either (x_low > -inf).
    reaching = (maxima >= x_low[:, None]) & rows[:, None]
    reaching.scatter_(1, found.blocks, False)
    row_ids, block_ids = reaching.nonzero(as_tuple=True)
    selected = row_ids.shape[0]
    if selected == 0:
        return counts
    if selected > _SELECTIVE_MAX_SHARE * batch * blocks:
        return _count_at_least(logits, x_low)
    columns = block_ids[:, None] * BLOCK + torch.arange(BLOCK, device=logits.device)
    values = logits[row_ids[:, None], columns.clamp_max(vocab - 1)]
    reached = (values >= x_low[row_ids][:, None]) & (columns < vocab)
    counts[row_ids, block_ids] = reached.sum(-1, dtype=torch.float32)
    return counts
