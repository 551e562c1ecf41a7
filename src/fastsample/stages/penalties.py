"""Stage c: repetition, frequency and presence penalties (vLLM's and OpenAI's definitions).

For row ``b`` and token ``i``, with ``c`` its output count and ``seen`` whether it appears in
the prompt or the output (:class:`~fastsample.stages.state.TokenStats`):

1. repetition ``r`` (off: 1), for seen tokens only: ``x > 0`` becomes ``x / r``, any other
   ``x`` becomes ``x * r`` (vLLM's ``apply_penalties``; Hugging Face's
   ``RepetitionPenaltyLogitsProcessor`` with the prompt and output as ``input_ids``);
2. frequency ``f`` (off: 0): ``x - f * c`` (float32 product, then difference: vLLM's ops);
3. presence ``p`` (off: 0): ``x - p`` where ``c > 0``.

Counts are output counts only (the prompt sets ``seen``, never ``c``). In speculative
verification the target position ``j`` counts the drafts before it as output tokens
(``extra``), as if they had been emitted.

Two implementations, one formula (:func:`penalize`), bitwise the same numbers:

* dense (CUDA, ``torch.compile``): the formula over every ``(B, V)`` entry, fixed shapes;
* sparse (CPU eager, where data-dependent shapes are free, and rows of at least
  :data:`SPARSE_FROM` tokens): only the seen tokens, gathered, penalized and scattered back.
  A step's rows take them from the state (:meth:`~fastsample.stages.TokenStats.seen_positions`,
  kept current step by step); verification's rows map and drafts read them off the seen
  bitmask's nonzero words (a few hundred per row). Unseen tokens are unchanged by the
  formula (``r = 1``, ``c = 0``), so visiting them is never needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import bitmask
from ..ops.threads import grain_rows
from .state import TokenStats

Penalty = float | Tensor | None

SPARSE_FROM = 4096
"""Rows at least this long take the sparse path on CPU: below it a dense pass over the row
costs less than finding the seen tokens (a word of 32 tokens is then a good share of it)."""


def penalize(x: Tensor, seen: Tensor, count: Tensor, rep: Penalty, freq: Penalty, pres: Penalty):
    """The penalties on logits ``x`` with ``seen`` (bool) and ``count`` (``x``'s dtype), each
    penalty a Python number, a tensor broadcasting against ``x``, or None (off)."""
    if rep is not None:
        r = torch.where(seen, rep, 1.0).to(x.dtype)
        x = torch.where(x > 0, x / r, x * r)
    if freq is not None:
        x = x - torch.as_tensor(freq, dtype=x.dtype, device=x.device) * count
    if pres is not None:
        x = torch.where(count > 0, x - torch.as_tensor(pres, dtype=x.dtype, device=x.device), x)
    return x


def _rows(value: Penalty, index: Tensor | slice) -> Penalty:
    return value[index] if isinstance(value, Tensor) else value


def apply_(
    x: Tensor,
    stats: TokenStats,
    rep: Penalty,
    freq: Penalty,
    pres: Penalty,
    rows: Tensor | None = None,
    extra: Tensor | None = None,
) -> Tensor:
    """The penalties on ``x`` (``(R, V)`` float logits), in place.

    ``rows`` (``(R,)`` int64) maps each row of ``x`` to its row of ``stats`` (None: the same
    row); ``extra`` (``(R, E)`` int64, -1 = none) are tokens counted as output on top of the
    stats (the drafts before a verification position).
    """
    sparse = x.shape[1] >= SPARSE_FROM
    if sparse and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _sparse_(x, stats, rep, freq, pres, rows, extra)
    if rows is None:
        rows = torch.arange(x.shape[0], device=x.device)
    return _dense_(x, stats, rep, freq, pres, rows, extra)


def _extra_counts(extra: Tensor | None, vocab: int, like: Tensor) -> Tensor | None:
    if extra is None or extra.shape[1] == 0:
        return None
    inside = (extra >= 0) & (extra < vocab)
    counts = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return counts.scatter_add_(1, torch.where(inside, extra, 0), inside.to(like.dtype))


def _dense_(x, stats, rep, freq, pres, rows, extra) -> Tensor:
    vocab = x.shape[1]
    count = stats.output_counts.index_select(0, rows).to(x.dtype)
    more = _extra_counts(extra, vocab, count)
    if more is not None:
        count = count + more
    seen = bitmask.unpack(stats.prompt_mask.index_select(0, rows), vocab) | (count > 0)
    per_row = [p if not isinstance(p, Tensor) else p[:, None] for p in (rep, freq, pres)]
    return x.copy_(penalize(x, seen, count, *per_row))


def _sparse_(x, stats, rep, freq, pres, rows, extra) -> Tensor:
    """The sparse path: rows in pieces whose seen-mask words stay under torch's parallel
    grain (fastsample.ops.threads), so no op opens a parallel region. A step's own rows
    (no rows map, no drafts) visit the state's kept positions instead of scanning the mask."""
    if rows is None and extra is None and x.is_contiguous() and stats.output_counts.is_contiguous():
        return _sparse_kept_(x, stats, rep, freq, pres)
    batch = x.shape[0]
    words = stats.seen_mask.shape[1]
    step = grain_rows(batch, words // 2 if words % 2 == 0 else words)
    for start in range(0, batch, step):
        piece = slice(start, min(start + step, batch))
        _sparse_piece_(
            x[piece], stats, _rows(rep, piece), _rows(freq, piece), _rows(pres, piece),
            None if rows is None else rows[piece], None if extra is None else extra[piece],
            start,
        )  # fmt: skip
    return x


def _sparse_kept_(x, stats, rep, freq, pres) -> Tensor:
    """The sparse path over :meth:`TokenStats.seen_positions` (chunks under the grain): the
    same formula at the same positions as :func:`_sparse_piece_`, so the same numbers."""
    vocab = x.shape[1]
    flat, counts = x.view(-1), stats.output_counts.view(-1)
    for pos_row, pos_col in stats.seen_positions():
        where = pos_row * vocab + pos_col
        seen = torch.ones(where.shape, dtype=torch.bool, device=x.device)
        values = penalize(
            flat.gather(0, where), seen, counts.gather(0, where).to(x.dtype),
            _gather(rep, pos_row), _gather(freq, pos_row), _gather(pres, pos_row),
        )  # fmt: skip
        flat.scatter_(0, where, values)
    return x


def _sparse_piece_(x, stats, rep, freq, pres, rows, extra, first) -> Tensor:
    vocab = x.shape[1]
    if rows is None:  # rows first .. first + R - 1 of the stats
        words = stats.seen_mask[first : first + x.shape[0]]
        state_rows = None
    else:
        words = stats.seen_mask.index_select(0, rows)
        state_rows = rows
    pos_row, pos_col = bitmask.set_bits(words, vocab)
    seen = None  # every bit-mask position is seen
    seen_count = pos_row.shape[0]
    if extra is not None and extra.shape[1]:
        inside = (extra >= 0) & (extra < vocab)
        extra_row = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(extra)[inside]
        pos_row = torch.cat((pos_row, extra_row))
        pos_col = torch.cat((pos_col, extra[inside]))
    # Flat gathers and scatters, not advanced indexing (a parallel region from 3,000 entries).
    state_row = pos_row + first if state_rows is None else state_rows.gather(0, pos_row)
    count = _at(stats.output_counts, state_row, pos_col).to(x.dtype)
    if pos_row.shape[0] > seen_count:  # drafts counted as output (verification)
        word = _at(stats.seen_mask, state_row, pos_col // bitmask.WORD_BITS)
        seen = ((word >> (pos_col % bitmask.WORD_BITS).to(torch.int32)) & 1).bool()
        more = (extra[pos_row] == pos_col[:, None]).sum(-1).to(x.dtype)
        count = count + more
        seen = seen | (more > 0)
    else:
        seen = torch.ones(pos_row.shape, dtype=torch.bool, device=x.device)
    # Every visit of a position computes the same number (a seen draft is visited twice).
    values = penalize(
        _at(x, pos_row, pos_col), seen, count,
        _gather(rep, pos_row), _gather(freq, pos_row), _gather(pres, pos_row),
    )  # fmt: skip
    if x.is_contiguous():
        x.view(-1).scatter_(0, pos_row * x.shape[1] + pos_col, values)
    else:
        x[pos_row, pos_col] = values
    return x


def _at(table: Tensor, row: Tensor, col: Tensor) -> Tensor:
    """``table[row, col]`` by a flat ``gather`` where ``table`` is contiguous."""
    if table.is_contiguous():
        return table.view(-1).gather(0, row * table.shape[1] + col)
    return table[row, col]


def _gather(value: Penalty, index: Tensor) -> Penalty:
    return value.gather(0, index) if isinstance(value, Tensor) else value
