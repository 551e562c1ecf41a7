"""Shard-local pieces of vocabulary-parallel sampling (:mod:`fastsample.distributed`).

Nothing here communicates: every function works on one rank's slice ``[a, a + V_local)`` of a
``vocab_size`` vocabulary and returns the small per-row summaries that the ranks combine.

**Slots.** The inverse CDF needs one mass per piece of the vocabulary, in a layout that every
rank agrees on without knowing the other ranks' ranges. The vocabulary is cut into a global
grid of ``grid`` slots of ``per_slot = BLOCK * m`` entries (``m = 1`` unless the grid would
exceed :data:`MAX_SLOTS`), plus one *head* slot per rank:

* grid slot ``J`` holds the entries of ``[J * per_slot, (J + 1) * per_slot)`` that belong to
  the rank whose range contains ``J * per_slot`` (exactly one rank in a partition);
* head slot ``grid + r`` holds rank ``r``'s entries before its first grid boundary (empty when
  ``a`` is a multiple of ``per_slot``).

So every slot is owned by exactly one rank, a rank's slot sums are zero outside its own slots,
and a SUM all-reduce of ``(B, grid + world)`` values gives every rank every slot's mass with
nothing but ``x + 0`` additions (bitwise the owner's value). When every shard starts on a
multiple of ``BLOCK`` and ``m = 1``, the grid slots *are* the single-process blocks of
:mod:`fastsample.ops.inverse_cdf` and the head slots are empty: the draw is then bitwise the
single-process draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops.inverse_cdf import BLOCK, block_sums
from ..ops.select import add_digits
from ..ops.validation import Controls
from ..ops.weights import compute_dtype, logit_weights_, prob_weights_

MAX_SLOTS = 1024
"""Most values per row that one collective carries (slot sums, histogram buckets)."""


@dataclass(frozen=True)
class Layout:
    """Where rank ``rank``'s shard sits in the global slot layout (all Python ints).

    Attributes:
        start: global id of the shard's first entry (``vocab_start``).
        local: entries in the shard (``V_local``).
        width: columns of the shard's weight buffer: ``local``, plus one zero column on the
            shard that ends the vocabulary when ``vocab_size`` is odd (the single-process
            weight buffer has an even width; mirroring it keeps block sums bitwise equal).
        vocab: ``vocab_size``.
        rank, world: position in and size of the process group.
        per_slot: entries per grid slot, ``BLOCK * m``.
        grid: number of grid slots, ``ceil(vocab / per_slot)``.
        head: entries of the head slot (before the first grid boundary at or after ``start``).
        first: the first grid slot this rank owns (meaningful when ``owned > 0``).
        owned: how many grid slots this rank owns.
    """

    start: int
    local: int
    width: int
    vocab: int
    rank: int
    world: int
    per_slot: int
    grid: int
    head: int
    first: int
    owned: int

    @property
    def slots(self) -> int:
        """Slot count of the global layout: the grid plus one head slot per rank."""
        return self.grid + self.world

    @property
    def draw_width(self) -> int:
        """Entries scanned per draw inside a slot: the single-process block width for ``m=1``
        (``min(BLOCK, even vocabulary width)``), else ``per_slot``."""
        return min(self.per_slot, self.vocab + self.vocab % 2)


def make_layout(start: int, local: int, vocab: int, rank: int, world: int) -> Layout:
    """The slot layout of one shard; identical ``per_slot``/``grid`` on every rank."""
    blocks = math.ceil(vocab / BLOCK)
    if world > MAX_SLOTS // 2:  # at least half the slots for the grid
        raise ValueError(f"at most {MAX_SLOTS // 2} ranks are supported, got {world}")
    # Coarsen the grid only when the block grid plus the head slots would not fit.
    m = 1 if blocks + world <= MAX_SLOTS else math.ceil(blocks / (MAX_SLOTS - world))
    per_slot = BLOCK * m
    grid = math.ceil(vocab / per_slot)
    pad = 1 if start + local == vocab and vocab % 2 else 0
    width = local + pad
    head = min((-start) % per_slot, width)
    first = (start + head) // per_slot
    owned = math.ceil((width - head) / per_slot)
    return Layout(start, local, width, vocab, rank, world, per_slot, grid, head, first, owned)


# ---------------------------------------------------------------------------- weights


def probs_are_weights(controls: Controls, dtype: torch.dtype, vocab: int) -> bool:
    """Whether probabilities of ``dtype`` serve as their own weights (no copy): nothing cut, no
    temperature, already the compute dtype. The single-process sampler skips the copy under
    exactly these conditions (its vocabulary is even then, so no shard carries a padding
    column)."""
    return (
        controls.temperature is None
        and not controls.filters
        and dtype == compute_dtype(dtype)
        and vocab % 2 == 0
    )


def shard_weights(
    logits: Tensor | None,
    probs: Tensor | None,
    controls: Controls,
    best: Tensor,
    finite: Tensor,
    layout: Layout,
) -> Tensor:
    """The shard's weights before any cut, from the *global* row maximum ``best`` (``(B,)``
    float64) and the global finiteness flag ``finite``: a contiguous ``(B, layout.width)``
    buffer (a zero column past ``V_local`` on the shard that ends an odd vocabulary).

    The single-process formulas (:func:`fastsample.ops.weights.logit_weights_` and
    :func:`~fastsample.ops.weights.prob_weights_`), so that each weight is bitwise the
    single-process weight of the same global entry:
    logits: ``exp((x - max) / T)``; probabilities: ``(p / max p)^(1/T)``, or ``p`` itself when
    nothing is cut and no temperature applies (the single-process no-copy case).
    """
    source = logits if logits is not None else probs
    assert source is not None
    batch, local = source.shape
    dtype = compute_dtype(source.dtype)
    temperature = controls.temperature
    top = best.to(dtype)
    width = layout.width
    if logits is not None:
        weights = torch.empty(batch, width, dtype=dtype, device=source.device)
        if width > local:
            weights[:, local:] = 0.0
        logit_weights_(weights[:, :local], logits, torch.where(finite, top, 0.0), temperature)
        return weights
    assert probs is not None
    if probs_are_weights(controls, probs.dtype, layout.vocab):
        return probs.contiguous()
    weights = torch.zeros(batch, width, dtype=dtype, device=probs.device)
    prob_weights_(weights[:, :local], probs, torch.where(finite, top, 1.0), temperature)
    return weights


# ---------------------------------------------------------------------------- slot sums


def slot_sums(weights: Tensor, layout: Layout) -> Tensor:
    """``(B, layout.slots)`` masses of this rank's slots, zero elsewhere.

    float32 for float32 weights (each value is one float32 block sum when ``m = 1``, so the
    collective can carry it in float32 without rounding), float64 for float64 weights.
    """
    batch = weights.shape[0]
    acc = torch.float64 if weights.dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, layout.slots, dtype=acc, device=weights.device)
    if layout.head:
        out[:, layout.grid + layout.rank] = weights[:, : layout.head].sum(-1, dtype=acc)
    if layout.owned:
        sums = block_sums(weights[:, layout.head :]).to(acc)  # float32 values, exact
        m = layout.per_slot // BLOCK
        if m > 1:  # coarse grid: group blocks into slots (the last group may be short)
            padded = torch.nn.functional.pad(sums, (0, layout.owned * m - sums.shape[1]))
            sums = padded.view(batch, layout.owned, m).sum(-1)
        out[:, layout.first : layout.first + layout.owned] = sums
    return out


def slot_span(slot: Tensor, layout: Layout) -> tuple[Tensor, Tensor]:
    """Local start column and entry count of each row's ``slot`` (``(B, 1)`` int64 each) in
    this shard; the count is 0 where another rank owns the slot."""
    is_head = slot == layout.grid + layout.rank
    in_grid = (slot >= layout.first) & (slot < layout.first + layout.owned)
    grid_start = layout.head + (slot - layout.first) * layout.per_slot
    start = torch.where(is_head, 0, grid_start)
    count = torch.where(in_grid, (layout.width - grid_start).clamp(max=layout.per_slot), 0)
    count = torch.where(is_head, layout.head, count)
    return start.clamp(0, layout.width - 1), count


def draw_in_slot(
    weights: Tensor,
    layout: Layout,
    slot: Tensor,
    fraction: Tensor,
    drawn: list[Tensor],
    need_left: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Second stage of the inverse CDF inside each row's chosen ``slot``, on the owning rank.

    Mirrors the in-block scan of :func:`fastsample.ops.inverse_cdf.inverse_cdf_draw`: gather the
    slot's weights in float64 (earlier draws ``drawn`` removed), take their prefix ``c`` and
    pick the first ``c_i > fraction * c_last`` (strict, kept below ``c_last``).

    Returns ``(token (B, 1) int64 global id, weight (B, 1) float64, left (B, 1) float64 or
    None, owned (B, 1) bool)``: ``left`` is the slot's mass without the drawn entry (for the
    next draw); rows whose slot another rank owns have ``owned`` False.
    """
    width = layout.draw_width
    offsets = torch.arange(width, device=weights.device)
    start, count = slot_span(slot, layout)
    columns = start + offsets
    values = weights.gather(1, columns.clamp_max(layout.width - 1)).to(torch.float64)
    values = values * (offsets < count)
    ids = layout.start + columns
    if drawn:
        taken = torch.cat(drawn, dim=1)
        values = values * (ids[:, :, None] != taken[:, None, :]).all(-1)
    within = values.cumsum(-1)
    total = within[:, -1:]
    floor = torch.zeros((), dtype=torch.float64, device=weights.device)
    inner_target = torch.minimum(fraction * total, total.nextafter(floor))
    inner = torch.searchsorted(within, inner_target, right=True).clamp_max_(width - 1)
    token = ids.gather(1, inner)
    weight = values.gather(1, inner)
    left = values.scatter(1, inner, 0.0).sum(-1, keepdim=True) if need_left else None
    return token, weight, left, count > 0


# ---------------------------------------------------------------------------- radix rounds

# Digit widths per round for weights in [0, 1]: their bit patterns are below 2**30 (float32)
# or 2**62 (float64), and each round's histogram stays within MAX_SLOTS buckets.
RADIX_ROUNDS = {torch.float32: (10, 10, 10), torch.float64: (8, 9, 9, 9, 9, 9, 9)}
# Bytes of keys per piece of rows on CPU (1 MiB, as in select's radix): a reused scratch in
# cache.
RADIX_PIECE_BYTES = 1 << 20


def histogram_dtype(dtype: torch.dtype, vocab: int) -> torch.dtype:
    """The dtype of the radix histograms of ``dtype`` weights over a ``vocab``-entry row:
    float32 counts (and float32 masses) are exact below 2**24 entries, float64 beyond."""
    wide = dtype == torch.float64 or vocab >= 1 << 24
    return torch.float64 if wide else torch.float32


def radix_histogram(
    values: Tensor,
    keys: Tensor,
    prefix: Tensor,
    shift: int,
    width: int,
    dtype: torch.dtype,
    by: str,
) -> Tensor:
    """``(B, 2**width)`` histogram of the counts (``by="count"``) or masses (else) of
    ``values`` over the next ``width``-bit digit (``shift`` bits up) of the bit patterns that
    share ``prefix`` (``(B, 1)``); other patterns are dropped (those above it were counted in
    earlier rounds).

    ``values``: ``(B, V)`` contiguous float32 or float64; ``keys``: a
    :func:`fastsample.ops.select.key_scratch` of ``rows`` rows, reused across rounds: the rows go
    through it ``rows`` at a time (:func:`fastsample.ops.select.add_digits`, the single-process
    radix's histogram step).
    """
    batch, vocab = values.shape
    buckets = 1 << width
    # Digit d lands in column d + 64; patterns below the prefix in one of columns 0..63, above
    # it (or garbage) in one of the 64 columns after the digits, by column of the entry (one
    # shared dump column serialises most adds, 3x slower): the dumps, left out of the result.
    base = ((prefix << width) - _DUMPS).to(keys.dtype)
    dump = (torch.arange(vocab, device=values.device, dtype=keys.dtype) & (_DUMPS - 1))[None, :]
    ceiling = dump + (buckets + _DUMPS)
    hist = torch.zeros(batch, buckets + 2 * _DUMPS, dtype=dtype, device=values.device)
    rows = max(keys.shape[0], 1)
    for start in range(0, batch, rows):
        stop = min(start + rows, batch)
        bounds = {"base": base[start:stop], "floor": dump, "ceiling": ceiling}
        chunk = (values[start:stop], keys[: stop - start])
        add_digits(hist[start:stop], *chunk, by, shift=shift, **bounds)
    return hist[:, _DUMPS:-_DUMPS].contiguous()


_DUMPS = 64  # dump columns on each side of the digits in radix_histogram
