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
  :data:`SPARSE_FROM` tokens): only the seen tokens, read off the seen bitmask's nonzero
  words (a few hundred per row), gathered, penalized and scattered back. Unseen tokens are
  unchanged by the formula (``r = 1``, ``c = 0``), so visiting them is never needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import bitmask
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


def _rows(value: Penalty, index: Tensor) -> Penalty:
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
    if rows is None:
        rows = torch.arange(x.shape[0], device=x.device)
    sparse = x.shape[1] >= SPARSE_FROM
    if sparse and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _sparse_(x, stats, rep, freq, pres, rows, extra)
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
    vocab = x.shape[1]
    words = stats.seen_mask.index_select(0, rows)
    row, word = words.nonzero(as_tuple=True)  # the nonzero words: a few hundred per row
    lanes = torch.arange(bitmask.WORD_BITS, device=x.device)
    bits = (words[row, word][:, None] >> lanes.to(torch.int32)) & 1
    columns = word[:, None] * bitmask.WORD_BITS + lanes
    hit = (bits == 1) & (columns < vocab)
    pos_row = row[:, None].expand_as(columns)[hit]
    pos_col = columns[hit]
    if extra is not None and extra.shape[1]:
        inside = (extra >= 0) & (extra < vocab)
        extra_row = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(extra)[inside]
        pos_row = torch.cat((pos_row, extra_row))
        pos_col = torch.cat((pos_col, extra[inside]))
    count = stats.output_counts[rows[pos_row], pos_col].to(x.dtype)
    word = stats.seen_mask[rows[pos_row], pos_col // bitmask.WORD_BITS]
    seen = ((word >> (pos_col % bitmask.WORD_BITS).to(torch.int32)) & 1).bool()
    if extra is not None and extra.shape[1]:
        more = (extra[pos_row] == pos_col[:, None]).sum(-1).to(x.dtype)
        count = count + more
        seen = seen | (more > 0)
    # Every visit of a position computes the same number (a seen draft is visited twice).
    values = penalize(
        x[pos_row, pos_col], seen, count,
        _rows(rep, pos_row), _rows(freq, pos_row), _rows(pres, pos_row),
    )  # fmt: skip
    x[pos_row, pos_col] = values
    return x
