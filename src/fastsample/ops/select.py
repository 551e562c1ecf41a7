"""Exact per-row order statistics without sorting the vocabulary.

Two questions the sampling controls ask of a row of non-negative weights ``w``:

* :func:`descending_threshold`: the largest value ``t`` whose *upper set* ``{i : w_i >= t}``
  holds at least ``target`` entries (``by="count"``: the k-th largest value, for top-k) or at
  least ``target`` mass (``by="mass"``, or ``by="share"`` for a fraction of the row's mass:
  the top-p cut). Ties at ``t`` are all in the set.
* :func:`top_entries`: the ``n`` largest entries in order, ties broken by the lower index
  (greedy with several draws, ``top_logprobs``).

Why no sort: a full sort of a 128k vocabulary costs ~300 read passes on a CPU. Both answers
only need a few numbers per row.

**Radix selection** (:func:`descending_threshold`). Non-negative IEEE floats order like their
bit patterns read as integers, so the threshold is found digit by digit: round 1 histograms
(``scatter_add``) the top 16 bits of every weight's pattern, a suffix sum over the 65,536
buckets (two levels of 64) finds the bucket where the count or mass from the top crosses
``target``; the next rounds histogram the next bits of the weights inside the chosen bucket
only (everything else lands in dump buckets below or above it). Round 1 holds every weight,
so a mass target given as a share of the row needs no separate pass for the row's total.
Two rounds for float32 (16 + 15 bits), four for
float64; rows shorter than 32,768 take three (float64: six) rounds of 10-11 bits, and rows
shorter than 512 are sorted instead (a table per row would outweigh them). A fixed
number of full-shape ops, no host sync, no data-dependent shape, and the
result is an exact bit pattern, so ties are handled for free. Memory: one float table of
``B x (2**16 + 128)`` (less than the weights themselves for the rows that use it) and ~1 MiB
of keys on CPU. A float32 weight's key is its pattern read as int32 (``scatter_add_`` takes
int32 indices since torch 2.8; before, the keys are widened to int64): two cheap ops per
round (shift and mask, or subtract and clamp).

Why it is shaped this way (CPU, measured in ``docs/cpu-primitive-costs.md``): the
``scatter_add`` is the floor (~0.8 ns per entry on 2 cores, wherever the buckets are), so few
wide rounds beat many narrow ones (16 + 15 bits: 2 scatters per entry instead of 3); the
entries outside the chosen bucket go to 64 buckets below or above it picked by column, because
piling them on one bucket serialises the adds (3x slower); and rows are processed in chunks
whose keys fit in ~1 MiB, so the scratch stays in cache and is reused instead of being a fresh
32 MB block whose page faults cost as much as the work.

Masses are accumulated in float32 buckets and combined in float64, so a top-p decision can
differ from an exact one only when ``target`` lies within float32 rounding (~1e-7
relative) of a cumulative mass.

**Candidate blocks** (:func:`top_entries`). The ``n`` largest entries lie in the ``n``
blocks (of :data:`~fastsample.inverse_cdf.BLOCK` entries) with the largest block maxima,
ties by block index: each earlier block holds an entry that precedes any entry of a later
one. So one blocked max pass plus a sort of ``n`` small blocks replaces the sort of the row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import threads
from .inverse_cdf import BLOCK
from .pieces import piece_rows

# Digit widths per round (bits), most significant first; they cover every non-negative
# pattern (31 bits for float32, 63 for float64). Wide digits mean fewer passes but a table of
# 2**16 buckets per row, so they are for long rows only: a short row (a small vocabulary,
# often with a huge batch in tests and self-checks) would spend more on the table than on
# its entries.
_ROUNDS = {torch.float32: (16, 15), torch.float64: (16, 16, 16, 15)}
_SHORT_ROW_ROUNDS = {torch.float32: (11, 10, 10), torch.float64: (11, 11, 11, 10, 10, 10)}
_WIDE_FROM = 1 << 15  # row length from which the wide digits are used
# Rows per chunk of the radix rounds on CPU: as many as keep one chunk's keys near this many
# bytes.
_CHUNK_BYTES = 1 << 20
# Rows shorter than this are sorted instead (:func:`_sorted_threshold`): the radix table of
# 2**11 + 128 buckets per row would be larger than the row itself (B=50,000 rows of V=8 took
# 5.5 s and ~550 MB), while a sort of short rows costs a few times the row and stays linear
# in the input's size. Measured crossover on the 2-core CPU: V ~ 512 (B x V = 4M entries).
_SORT_BELOW = 512
_GROUP = 64  # buckets per group of the two-level suffix search
_TOP_GROUP = 32  # entries per group in the second level of candidate_entries
# _entries_reaching gives way to the two-level topk past this many reaching entries per
# candidate (its table and small topk would cost more than the fixed-shape way).
_REACHING_MAX = 4


def _last_meeting(hist: Tensor, target: Tensor, above: Tensor) -> tuple[Tensor, Tensor]:
    """Last column ``d`` of ``hist`` (``(B, c)`` float64) with ``above + sum(hist[:, d:]) >=
    target`` (0 if none) and ``above`` plus the columns strictly after it."""
    suffix = hist.flip(-1).cumsum(-1).flip(-1)
    # Suffix sums fall as the column rises, so the columns meeting the target form a prefix.
    last = ((above[:, None] + suffix) >= target[:, None]).sum(-1, keepdim=True) - 1
    last = last.clamp_(0, hist.shape[1] - 1)
    return last, above + (suffix.gather(1, last) - hist.gather(1, last)).squeeze(1)


def group_sums(hist: Tensor) -> Tensor:
    """``(B, groups)`` float64 sums of ``hist``'s groups of 64 buckets (summed in ``hist``'s
    dtype: bucket masses are float32 sums already, counts are exact)."""
    batch, width = hist.shape
    return hist.view(batch, width // _GROUP, _GROUP).sum(-1).to(torch.float64)


def descend(
    hist: Tensor, target: Tensor, above: Tensor, sums: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Largest bucket ``d`` with ``above + sum(hist[:, d:]) >= target`` (0 if none), ``(B, 1)``,
    and the new ``above`` (plus the buckets strictly after ``d``); ``hist`` is
    ``(B, groups * 64)``, ``sums`` its :func:`group_sums` if already taken.

    Two levels (groups of 64 buckets, then the 64 buckets of one group) so each round touches
    ``O(buckets / 64 + 64)`` float64 values per row instead of a cumulative sum over all of
    them; float64 arithmetic. Shared with the vocabulary-parallel radix of ``_shard``.
    """
    batch, width = hist.shape
    groups = hist.view(batch, width // _GROUP, _GROUP)
    group, above = _last_meeting(group_sums(hist) if sums is None else sums, target, above)
    bins = groups.gather(1, group[:, :, None].expand(batch, 1, _GROUP)).squeeze(1)
    inner, above = _last_meeting(bins.to(torch.float64), target, above)
    return group * _GROUP + inner, above


def descending_threshold(
    values: Tensor, target: Tensor, by: str, mass: Tensor | None = None
) -> Tensor:
    """Largest ``t`` with ``Q(t) >= target`` per row, where ``Q(t)`` is the count
    (``by="count"``) or the sum (``by="mass"``) of the entries ``>= t``; ``by="share"`` is
    ``by="mass"`` with ``target`` a fraction of the row's total mass (read off the first
    round's histogram: no separate pass over the row). ``mass`` (same shape and dtype as
    ``values``, non-negative): each entry's mass when it is not its value (typical-p orders
    the tokens by closeness to the entropy but counts their probability).

    Args:
        values: ``(B, V)`` contiguous float32 or float64, non-negative (``-0.0`` counts as
            0). Rows with NaN or negative entries give an arbitrary ``t`` (never an error).
        target: ``(B,)`` float64, ``0 < target <= Q(0)`` (for ``"share"``: a fraction in
            ``(0, 1]``). A larger target gives ``t`` at or below the row's smallest bucket;
            ``target <= 0`` gives the largest pattern: callers mask rows whose control is off.

    Returns:
        ``(B,)`` threshold in ``values``' dtype, one of the row's values when
        ``0 < target <= Q(0)``.

    Example:
        >>> w = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
        >>> descending_threshold(w, torch.tensor([2.0], dtype=torch.float64), "count")
        tensor([0.3000])
    """
    if torch.compiler.is_compiling():
        return _bisect_threshold(values, target, by, mass)
    batch, vocab = values.shape
    if vocab < _SORT_BELOW:
        return _sorted_threshold(values, target, by, mass)
    device, dtype = values.device, values.dtype
    digits = (_ROUNDS if vocab >= _WIDE_FROM else _SHORT_ROW_ROUNDS)[dtype]
    key_bytes = 4 if key_dtype(dtype, device) == torch.int32 else 8
    rows = piece_rows(batch, vocab * key_bytes, device, _CHUNK_BYTES)
    keys = key_scratch(values, rows)
    # Entries outside the chosen bucket are clamped into 64 buckets below (dumps) or above it,
    # picked by column, so that no single bucket takes most of the adds.
    dump = (torch.arange(vocab, device=device, dtype=keys.dtype) & (_GROUP - 1))[None, :]
    # One table for the whole batch: per-row-piece tables (smaller, in cache) cost more in the
    # per-piece small ops of the bucket search than they save (measured).
    table = torch.empty(batch, (1 << max(digits)) + 2 * _GROUP, dtype=dtype, device=device)
    prefix = torch.zeros(batch, 1, dtype=keys.dtype, device=device)
    above = torch.zeros(batch, dtype=torch.float64, device=device)
    remaining = sum(digits)
    for round_index, width in enumerate(digits):
        remaining -= width
        # Keys of the patterns sharing the prefix chosen so far land in buckets
        # 64..64 + 2**width - 1; smaller patterns in the 64 buckets below, larger ones in the
        # 64 above. Round 1 shares one prefix (0): every key is a digit.
        hist = table[:, : (1 << width) + 2 * _GROUP].zero_()
        base = (prefix << width) - _GROUP
        ceiling = dump + ((1 << width) + _GROUP)
        for start in range(0, batch, rows):
            stop = min(start + rows, batch)
            chunk = (values[start:stop], keys[: stop - start])
            entries = None if mass is None else mass[start:stop]
            if round_index == 0:
                real = hist[start:stop, _GROUP:-_GROUP]
                add_digits(real, *chunk, by, shift=remaining, mask=(1 << width) - 1,
                           entries=entries)  # fmt: skip
            else:
                bounds = {"base": base[start:stop], "floor": dump, "ceiling": ceiling}
                add_digits(hist[start:stop], *chunk, by, shift=remaining, entries=entries,
                           **bounds)  # fmt: skip
        hist[:, :_GROUP] = 0
        hist[:, -_GROUP:] = 0
        sums = group_sums(hist)
        if round_index == 0 and by == "share":  # round 1 holds every weight: the row's mass
            target = target * sums.sum(-1)
        digit, above = descend(hist, target, above, sums)
        prefix = (prefix << width) | (digit - _GROUP).clamp_(0, (1 << width) - 1).to(keys.dtype)
    pattern = prefix.squeeze(1)
    return (pattern if dtype == torch.float64 else pattern.to(torch.int32)).view(dtype)


def _sorted_threshold(
    values: Tensor, target: Tensor, by: str, mass: Tensor | None = None
) -> Tensor:
    """:func:`descending_threshold` by sorting each row (short rows: memory and time a small
    multiple of the input's). Masses are summed in float64 in descending order, so a top-p
    decision can differ from the radix's only where ``target`` is within rounding of a
    cumulative mass."""
    vocab = values.shape[1]
    ranked, order = torch.sort(values, dim=1, descending=True, stable=True)
    if by == "count":
        # The entries >= the ceil(target)-th largest number at least target (ties included).
        position = target.ceil().sub_(1).clamp_(0, vocab - 1).to(torch.int64)[:, None]
    else:
        masses = ranked if mass is None else mass.gather(1, order)
        running = masses.to(torch.float64).cumsum(-1)
        if by == "share":
            target = target * running[:, -1]
        # The first prefix reaching the target (prefixes of non-negative masses only grow):
        # its last entry's upper set holds that prefix and any ties after it.
        position = (running < target[:, None]).sum(-1, keepdim=True).clamp_max_(vocab - 1)
    return ranked.gather(1, position).squeeze(1)


def _int32_index_dtype() -> torch.dtype:
    """int32 if ``scatter_add_`` takes int32 indices (torch >= 2.8), else int64."""
    cpu = torch.device("cpu")  # whatever default device the importer has set
    try:
        index = torch.zeros(1, dtype=torch.int32, device=cpu)
        torch.zeros(1, device=cpu).scatter_add_(0, index, torch.ones(1, device=cpu))
    except RuntimeError:
        return torch.int64
    return torch.int32


# The keys of float32 weights on CPU: their bit patterns as int32 where scatter_add_ takes
# int32 indices (half the bytes of int64 keys, and no widening op), else widened to int64 as
# they are computed (slower, same buckets).
_FLOAT32_KEYS = _int32_index_dtype()


def key_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The integer dtype of :func:`add_digits`'s keys for weights of ``dtype`` on ``device``.

    int32 keys are a CPU measurement (fewer bytes and ops per round there); other devices get
    int64 keys, the layout every torch version's ``scatter_add_`` takes, until a run on them
    shows that int32 indices work and pay.
    """
    if dtype == torch.float32 and device.type == "cpu":
        return _FLOAT32_KEYS
    return torch.int64


def key_scratch(values: Tensor, rows: int) -> Tensor:
    """An integer scratch of :func:`key_dtype` for :func:`add_digits`: ``(min(rows, B), V)``."""
    batch, vocab = values.shape
    dtype = key_dtype(values.dtype, values.device)
    return torch.empty(min(rows, batch), vocab, dtype=dtype, device=values.device)


def add_digits(
    hist: Tensor,
    values: Tensor,
    keys: Tensor,
    by: str,
    *,
    shift: int,
    mask: int | None = None,
    base: Tensor | None = None,
    floor: Tensor | None = None,
    ceiling: Tensor | None = None,
    entries: Tensor | None = None,
) -> None:
    """Add one chunk of rows to ``hist``: each entry's count (``by="count"``) or mass (any
    other ``by``: its value, or ``entries`` when given) to the bucket of its bit pattern's
    digit (``keys``, from :func:`key_scratch`, is scratch).

    Round 1 (``mask`` given): bucket ``(pattern >> shift) & mask``; every pattern lands on a
    digit, the sign bit masked off (``-0.0`` with ``0.0``; garbage rows see garbage).
    Later rounds: bucket ``(pattern >> shift) - base`` clamped into ``[floor, ceiling]``
    (per-column tensors in the keys' dtype: patterns outside the prefix spread over groups of
    buckets below and above it, since adds piling up on one bucket serialise). A set sign bit
    makes a pattern negative: it lands below (shifted) or, wrapping around in the
    subtraction, above (unshifted), never on a digit of a valid prefix.
    """
    patterns = values.view(torch.int32 if values.dtype == torch.float32 else torch.int64)
    if mask is not None:
        torch.bitwise_right_shift(patterns, shift, out=keys).bitwise_and_(mask)
    else:
        assert base is not None and floor is not None and ceiling is not None
        if shift:
            torch.bitwise_right_shift(patterns, shift, out=keys).sub_(base)
        else:
            torch.sub(patterns, base, out=keys)
        torch.clamp(keys, floor, ceiling, out=keys)
    if by == "count":
        entries = torch.ones((), dtype=hist.dtype, device=keys.device).expand(keys.shape)
    elif entries is not None:
        entries = entries.to(hist.dtype)
    elif values.dtype != hist.dtype:  # float64 buckets for float32 weights (distributed)
        entries = values.to(hist.dtype)
    else:
        entries = values
    hist.scatter_add_(1, keys, entries)


def _bisect_threshold(
    values: Tensor, target: Tensor, by: str, mass: Tensor | None = None
) -> Tensor:
    """:func:`descending_threshold` by bisection on the bit pattern: one masked reduction per
    bit. Used under ``torch.compile``, where each round fuses into one read of ``values``
    and a scatter would not; same answer as the radix up to the order of float additions.
    """
    bits = 63 if values.dtype == torch.float64 else 31
    batch = values.shape[0]
    counted_mass = values if mass is None else mass
    if by == "share":
        target = target * counted_mass.sum(-1, dtype=torch.float64)
    # Invariant: Q(lo) >= target (Q(0) is everything), the answer is in [lo, hi].
    lo = torch.zeros(batch, 1, dtype=torch.int64, device=values.device)
    infinity = 0x7FF0000000000000 if values.dtype == torch.float64 else 0x7F800000
    hi = torch.full_like(lo, infinity)
    unit = torch.ones((), dtype=values.dtype, device=values.device)
    for _ in range(bits):
        mid = lo + ((hi - lo + 1) >> 1)  # no int64 overflow near the top pattern
        if values.dtype == torch.float64:
            threshold = mid.view(torch.float64)
        else:
            threshold = mid.to(torch.int32).view(torch.float32)
        counted = unit if by == "count" else counted_mass
        q = torch.where(values >= threshold, counted, 0).sum(-1, keepdim=True, dtype=torch.float64)
        ok = q >= target[:, None]
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    lo = lo.squeeze(1)
    return (
        lo.view(torch.float64)
        if values.dtype == torch.float64
        else lo.to(torch.int32).view(torch.float32)
    )


def block_maxima(values: Tensor) -> Tensor:
    """``(B, ceil(V / BLOCK))`` maxima of consecutive blocks (NaN propagates)."""
    batch, vocab = values.shape
    full = vocab // BLOCK
    if threads.serial_passes(values.device, batch * full * BLOCK):
        out = torch.empty(batch, full, dtype=values.dtype, device=values.device)
        parts = [threads.blockwise_(values, out, BLOCK, "amax")]
    else:  # one op: a parallel region over a long input (fastsample.ops.threads)
        whole = values[:, : full * BLOCK].reshape(batch, full, BLOCK)
        parts = [threads.watched(values.device, lambda: whole.amax(-1))]
    if vocab % BLOCK:
        parts.append(values[:, full * BLOCK :].amax(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _gather_blocks(values: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Values and global indices of the given blocks, ``(B, len * BLOCK)``; entries past the
    vocabulary read as ``-inf``."""
    vocab = values.shape[1]
    width = min(BLOCK, vocab)
    columns = (blocks[:, :, None] * BLOCK + torch.arange(width, device=values.device)).flatten(1)
    if vocab % width == 0:  # whole blocks only: nothing to clamp or mask (fewer small ops)
        return values.gather(1, columns), columns
    gathered = values.gather(1, columns.clamp_max(vocab - 1))
    gathered = gathered.masked_fill(columns >= vocab, -torch.inf)
    return gathered, columns


def top_entries(values: Tensor, num: int, maxima: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The ``num`` largest entries of each row, largest first, ties by the lower index.

    Args:
        values: ``(B, V)`` floats (``-inf`` allowed; NaN rows give arbitrary in-range ids).
        num: static, ``1 <= num <= V``.
        maxima: :func:`block_maxima` of ``values`` if already computed.

    Returns:
        ``(values (B, num), ids (B, num) int64)``.

    Example:
        >>> top_entries(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), 3)
        (tensor([[3., 3., 2.]]), tensor([[1, 2, 3]]))
    """
    if maxima is None:
        maxima = block_maxima(values)
    count = min(num, maxima.shape[1])
    if values.dtype == torch.float64:  # no room for the index next to a 64-bit key: sort
        # Stable sorts keep the lower block (then the lower index) first among equal values.
        order = torch.sort(maxima, dim=1, descending=True, stable=True).indices[:, :count]
        blocks = torch.sort(order, dim=1).values
        candidates, columns = _gather_blocks(values, blocks)
        ranked = torch.sort(candidates, dim=1, descending=True, stable=True)
        ids = columns.gather(1, ranked.indices[:, :num]).clamp_max_(values.shape[1] - 1)
        return ranked.values[:, :num], ids
    block_ids = torch.arange(maxima.shape[1], device=values.device).expand_as(maxima)
    blocks = block_ids.gather(1, _largest_first(maxima, block_ids, count))
    batch = values.shape[0]
    # CPU: rows in pieces whose int64 keys stay under torch's parallel grain (one piece on
    # other devices); every row's result is the same whatever rows share its piece.
    rows = batch if values.device.type != "cpu" else threads.grain_rows(batch, 2 * count * BLOCK)
    found, ids = [], []
    for start in range(0, max(batch, 1), max(rows, 1)):  # an empty batch: one empty piece
        piece = slice(start, start + rows)
        candidates, columns = _gather_blocks(values[piece], blocks[piece])
        best = _largest_first(candidates, columns, num)
        ids.append(columns.gather(1, best).clamp_max_(values.shape[1] - 1))
        found.append(candidates.gather(1, best))
    if len(found) == 1:
        return found[0], ids[0]
    return torch.cat(found), torch.cat(ids)


def _largest_first(values: Tensor, index: Tensor, num: int) -> Tensor:
    """Positions of the ``num`` largest ``values`` per row, largest first, equal values by
    the lower ``index``: one ``topk`` of int64 keys ``order(value) << 32 - index`` (values of
    at most 32 bits; ``-0.0`` counts as ``0.0``), ~10x faster than two stable sorts on CPU."""
    bits = (values.float() + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 -> 0.0
    keys = (order_key(bits) << 32) - index
    return torch.topk(keys, num, dim=1).indices


def order_key(bits: Tensor) -> Tensor:
    """float32 bit patterns (int64, sign-extended) <-> integers in float order (involution):
    negative patterns order backwards, so their magnitude bits are flipped."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def first_argmax(values: Tensor, maxima: Tensor | None = None) -> Tensor:
    """``(B,)`` index of the first maximal entry per row (in range for a NaN row), one
    blocked pass.

    ``maxima`` (:func:`block_maxima`) may be passed in when already computed.

    Example:
        >>> first_argmax(torch.tensor([[1.0, 5.0, 5.0], [2.0, 0.0, 2.0]]))
        tensor([1, 0])
    """
    if maxima is None:
        maxima = block_maxima(values)
    # argmax returns the first maximal index (documented): the first block holding the row
    # maximum. (max() with indices opens a CPU parallel region from a few thousand entries,
    # fastsample.ops.threads; argmax does not, and is as fast on these small rows.)
    return first_in_block(values, maxima.argmax(-1, keepdim=True))


def first_in_block(values: Tensor, block: Tensor) -> Tensor:
    """``(B,)`` index of the first maximal entry of block ``block[b]`` (``(B, 1)``) per row."""
    batch, vocab = values.shape
    if vocab % BLOCK == 0 and values.is_contiguous():  # rows of the (B * blocks, BLOCK) view
        block = block.squeeze(1)
        blocks = vocab // BLOCK
        rows = torch.arange(0, batch * blocks, blocks, device=values.device).add_(block)
        # index_select, not advanced indexing (a parallel region from 3,000 entries on CPU)
        chosen = values.view(batch * blocks, BLOCK).index_select(0, rows)
        return (block * BLOCK).add_(chosen.argmax(-1))
    candidates, columns = _gather_blocks(values, block)
    inner = candidates.argmax(-1, keepdim=True)
    ids = columns.gather(1, inner).squeeze(1)
    # Past-the-end columns of a short last block read -inf, so only a NaN row can land there.
    return ids if vocab % BLOCK == 0 else ids.clamp_max_(vocab - 1)


# Up to this k, top-k thresholds come from candidate blocks (topk of ~k blocks) instead of
# radix selection over the row (static Python top_k only: tensor k needs every row's k).
CANDIDATE_MAX_K = 1024


class Candidates(NamedTuple):
    """The ``num`` largest entries of each row and the blocks they were taken from."""

    values: Tensor  # (B, num), largest first, ties in any order
    ids: Tensor  # (B, num) int64
    blocks: Tensor  # (B, count) the candidate blocks (the count largest block maxima)
    content: Tensor  # (B, count * BLOCK) those blocks' entries; -inf past the vocabulary
    positions: Tensor  # (B, num) where each of the num largest sits in ``content``


def largest_entries(
    values: Tensor, num: int, maxima: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The ``num`` largest entries of each row, largest first, ties in any order.

    Like :func:`top_entries` with ``torch.topk`` on the candidate blocks (no sort): for
    order statistics, where tie order does not matter.
    """
    found = candidate_entries(values, num, maxima)
    return found.values, found.ids


def candidate_entries(
    values: Tensor, num: int, maxima: Tensor | None = None, *, host: bool = False
) -> Candidates:
    """:func:`largest_entries` with the candidate blocks and their entries.

    Every entry outside the candidate blocks is ``<=`` the ``num``-th largest: its block's
    maximum is at most every candidate block's maximum, so a larger entry there would make
    each of the ``num`` candidate blocks hold one too: ``num + 1`` entries above the
    ``num``-th largest.

    ``host=True`` (CPU eager callers: data-dependent shapes and host reads are free there)
    lets :func:`_entries_reaching` pick the ``num`` largest from the few entries that reach
    the smallest candidate block maximum, instead of the fixed-shape two-level ``topk``.
    """
    if maxima is None:
        maxima = block_maxima(values)
    count = min(num, maxima.shape[1])
    chosen_blocks = torch.topk(maxima, count, dim=1, sorted=False)  # any order will do
    blocks = chosen_blocks.indices
    content = _block_content(values, blocks)
    if host and count == num:
        reaching = _entries_reaching(content, chosen_blocks.values, num)
        if reaching is not None:
            best_values, positions = reaching
            ids = blocks.gather(1, positions // BLOCK) * BLOCK + positions % BLOCK
            ids = ids.clamp_max_(values.shape[1] - 1)
            return Candidates(best_values, ids, blocks, content, positions)
    # The same argument one level down: the num largest lie in the num groups of _TOP_GROUP
    # entries with the largest maxima, so the final topk reads num * 32 entries, not
    # num * 256 (torch.topk's cost grows with the row length; on CPU an amax over 32
    # contiguous entries is ~4x faster than over 16).
    batch = values.shape[0]
    if content.shape[1] % _TOP_GROUP:  # a vocabulary shorter than a block: one short block
        best = torch.topk(content, num, dim=1)
        positions = best.indices
    else:
        groups = content.view(batch, content.shape[1] // _TOP_GROUP, _TOP_GROUP)
        group_maxima = groups.amax(-1)
        chosen = torch.topk(group_maxima, min(num, group_maxima.shape[1]), dim=1, sorted=False)
        picked = groups.gather(1, chosen.indices[:, :, None].expand(-1, -1, _TOP_GROUP))
        best = torch.topk(picked.flatten(1), num, dim=1)
        positions = chosen.indices.gather(1, best.indices // _TOP_GROUP) * _TOP_GROUP
        positions += best.indices % _TOP_GROUP
    # Position p of the content is entry p % BLOCK of candidate block p // BLOCK.
    ids = blocks.gather(1, positions // BLOCK) * BLOCK + positions % BLOCK
    return Candidates(best.values, ids.clamp_max_(values.shape[1] - 1), blocks, content, positions)


def _entries_reaching(
    content: Tensor, block_maxima_chosen: Tensor, num: int
) -> tuple[Tensor, Tensor] | None:
    """The ``num`` largest entries of ``content`` (``(B, num * BLOCK)``, the ``num`` candidate
    blocks), largest first, and their positions in it; None where this way does not pay.

    Each chosen block's maximum is an entry, so ``num`` entries reach the smallest of them
    (the floor) and the ``num`` largest all do. For continuous logits only a few more reach
    it: the groups of :data:`_TOP_GROUP` entries whose maximum reaches the floor are read,
    their reaching entries gathered into a short ``(B, width)`` table (data-dependent shapes,
    host reads) and one small ``topk`` orders them: on CPU ~3x cheaper than the fixed-shape
    way's two ``topk`` calls over 400 and 1,600 entries a row. NaN maxima, or more than
    :data:`_REACHING_MAX` reaching groups or entries per candidate (ties: integer logits,
    masked rows whose floor is ``-inf``), return None.
    """
    floor = block_maxima_chosen.amin(-1, keepdim=True)
    if bool(floor.isnan().any()):
        return None
    batch, length = content.shape
    groups = content.view(batch * (length // _TOP_GROUP), _TOP_GROUP)
    group_rows, group_ids = (groups.amax(-1).view(batch, -1) >= floor).nonzero(as_tuple=True)
    if group_rows.shape[0] > _REACHING_MAX * num * batch:
        return None
    picked = groups.index_select(0, group_rows * (length // _TOP_GROUP) + group_ids)
    which, inner = (picked >= floor[group_rows]).nonzero(as_tuple=True)
    rows = group_rows[which]
    columns = group_ids[which] * _TOP_GROUP + inner
    per_row = torch.bincount(rows, minlength=batch)
    width = int(per_row.max())
    if width > _REACHING_MAX * num:
        return None
    start = per_row.cumsum(0).sub_(per_row)
    slot = torch.arange(rows.shape[0], device=content.device).sub_(start[rows])
    table = torch.full((batch, width), -torch.inf, dtype=content.dtype, device=content.device)
    where = torch.zeros((batch, width), dtype=torch.int64, device=content.device)
    table[rows, slot] = picked[which, inner]
    where[rows, slot] = columns
    best = torch.topk(table, num, dim=1)
    return best.values, where.gather(1, best.indices)


def _block_content(values: Tensor, blocks: Tensor) -> Tensor:
    """``(B, len * BLOCK)``: the entries of the given blocks, ``-inf`` past the vocabulary.

    Indexes whole blocks of a ``(B, full, BLOCK)`` view (a row copy per block, ~2x faster
    than a per-entry gather); a short last block is padded and substituted where chosen.
    """
    batch, vocab = values.shape
    if vocab < BLOCK:
        return _gather_blocks(values, blocks)[0]
    full = vocab // BLOCK
    if vocab % BLOCK == 0 and values.is_contiguous():
        # Rows of a (B * full, BLOCK) view: one index_select, ~2x faster than indexing the
        # (B, full, BLOCK) view with a row and a block index.
        flat = blocks + torch.arange(0, batch * full, full, device=values.device)[:, None]
        picked = values.view(batch * full, BLOCK).index_select(0, flat.flatten())
        return picked.view(batch, blocks.shape[1] * BLOCK)
    rows = torch.arange(batch, device=values.device)[:, None]
    whole = values[:, : full * BLOCK].reshape(batch, full, BLOCK)
    content = whole[rows, blocks.clamp_max(full - 1)]
    if vocab % BLOCK:
        pad = torch.full(
            (batch, full * BLOCK + BLOCK - vocab),
            -torch.inf,
            dtype=values.dtype,
            device=values.device,
        )
        tail = torch.cat((values[:, full * BLOCK :], pad), dim=1)
        content = torch.where((blocks == full)[:, :, None], tail[:, None, :], content)
    return content.flatten(1)
