"""Stage c, continued: the logit edits that read a request's recent tokens.

They read :attr:`TokenStats.history <fastsample.stages.state.TokenStats>` (``(B, H)``, the
last ``H`` context tokens, oldest first, ``-1`` before the context starts) and, in
speculative verification, the drafts before each position (``extra``), appended to it.

* **Windowed penalties** (``penalty_last_n``, llama.cpp's ``penalties``): with ``n > 0`` the
  repetition, frequency and presence penalties count the last ``n`` context tokens (prompt
  included), ``c`` a token's count there: repetition on ``c > 0``, ``x - f c``, ``x - p`` on
  ``c > 0`` (the formula of :mod:`.penalties`); ``-1``: the whole kept history; ``0``: the
  output counts of :mod:`.penalties`, as before.
* **DRY** (llama.cpp's ``dry``, after p-e-w's original): for each earlier position ``c`` of
  the window, ``m(c)`` is how many tokens before it repeat the context's last tokens (at most
  the tokens since the last sequence breaker, see :func:`_breaker_limit`); the token at
  ``c`` would extend that repeat, so with ``M_t = max m(c)`` over its positions, ``x_t -=
  multiplier * base ** (M_t - allowed_length)`` where ``M_t >= allowed_length``.
* **No-repeat n-grams** (Hugging Face's ``NoRepeatNGramLogitsProcessor``): a token whose
  ``n - 1`` predecessors at some earlier position equal the context's last ``n - 1`` tokens
  would repeat an n-gram: its logit becomes ``-inf``.

Match lengths (:func:`match_lengths`) come from one compare per length, all positions at once;
on CPU in eager mode the loop stops when no repeat is still growing (a host read, free
there), elsewhere it runs the window's length. DRY and the n-gram ban lower each token by a
``scatter_reduce`` (``amin``) of its entries' values (:func:`_lower_`: a token's penalty is
its longest match's, the largest; on CPU in eager mode only the changed entries'); the
windowed penalties' counts come from an all-pairs compare of the window's entries, or a sort
of them past 128 (:func:`_counts`), never a ``(B, V)`` table; their edit is one scatter
(entries naming one token compute one value, so it is exact). A Python window narrower than
the history keeps only its columns.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import penalties
from .params import StepParams
from .state import TokenStats


def output_penalties(params: StepParams):
    """The (repetition, frequency, presence) of :mod:`.penalties` (output counts): off in the
    rows whose ``penalty_last_n`` is not 0 (those take the window here)."""
    rep, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    last_n = params.samplers.penalty_last_n  # type: ignore[attr-defined]
    if last_n is None:
        return rep, freq, pres
    if not isinstance(last_n, Tensor):
        return None, None, None
    plain = last_n == 0

    def masked(value, off):
        if value is None:
            return None
        return torch.where(plain, torch.as_tensor(value, dtype=torch.float32), off)

    return masked(rep, 1.0), masked(freq, 0.0), masked(pres, 0.0)


def _context(state: TokenStats, rows: Tensor | None, extra: Tensor | None) -> Tensor:
    """``(R, H')`` the history of each row (mapped by ``rows``), with the drafts appended."""
    hist = state.history
    assert hist is not None
    if rows is not None:
        hist = hist.index_select(0, rows)
    if extra is not None and extra.shape[1]:
        from .state import shift_in

        wide = torch.full((hist.shape[0], hist.shape[1] + extra.shape[1]), -1,
                          dtype=torch.int64, device=hist.device)  # fmt: skip
        wide[:, extra.shape[1] :] = hist
        hist = shift_in(wide, extra)
    if _eager_cpu(hist) and hist.shape[1] > 1:
        # The columns before the first one any row holds a token in are padding for every
        # row: dropped (a host read, free on CPU), so the stages' work is the contexts'.
        first = int((hist >= 0).any(0).to(torch.uint8).argmax())
        hist = hist[:, first:]
    return hist


def _window(hist: Tensor, last_n: int | Tensor) -> Tensor:
    """``hist`` with the entries before the last ``last_n`` set to -1 (``-1``: all); a Python
    ``last_n`` narrower than ``hist`` keeps only its columns (what follows sorts and matches
    ``last_n`` entries a row, not the whole history)."""
    width = hist.shape[1]
    if not isinstance(last_n, Tensor):
        # -1 or a window past the history: the history itself (read, never written).
        return hist if last_n < 0 or last_n >= width else hist[:, width - last_n :]
    n = torch.as_tensor(last_n, device=hist.device)
    n = torch.where(n < 0, width, n).reshape(-1, 1)
    inside = torch.arange(width, device=hist.device)[None, :] >= width - n
    return torch.where(inside, hist, -1)


def _eager_cpu(t: Tensor) -> bool:
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def match_lengths(hist: Tensor, limit: Tensor | None = None) -> Tensor:
    """``(B, H)`` int64: for each position ``c``, the largest ``m`` with ``hist[c-1-s] ==
    hist[H-1-s] >= 0`` for every ``s < m`` (at most ``limit[b]`` when given)."""
    batch, width = hist.shape
    length = torch.zeros(batch, width, dtype=torch.int64, device=hist.device)
    alive = torch.ones(batch, width, dtype=torch.bool, device=hist.device)
    for s in range(width - 1):
        last = hist[:, width - 1 - s : width - s]  # (B, 1): the context's (s+1)-th last token
        earlier = torch.full((batch, width), -2, dtype=hist.dtype, device=hist.device)
        earlier[:, s + 1 :] = hist[:, : width - 1 - s]  # earlier[c] = hist[c - 1 - s]
        alive &= (earlier == last) & (last >= 0)
        if limit is not None:
            alive &= (s < limit)[:, None]
        length += alive
        if _eager_cpu(hist) and not bool(alive.any()):
            break
    return length


_PAIRWISE_WIDTH = 128  # windows up to this wide count by an all-pairs compare, not a sort


def _counts(ids: Tensor) -> Tensor:
    """For each entry of ``ids`` (``(B, N)``, -1 = none), how many entries name its token (0
    for padding): an all-pairs compare for narrow windows (``B N^2`` compares in ~3 ops, the
    sort's ~40 cost more below ~128), else :func:`_per_token`'s sort."""
    if ids.shape[1] > _PAIRWISE_WIDTH:
        return _per_token(ids, torch.zeros_like(ids))[1]
    same = (ids[:, :, None] == ids[:, None, :]).sum(-1, dtype=torch.int32)  # ~2x int64's
    return torch.where(ids >= 0, same, 0).to(ids.dtype)


def _per_token(ids: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """For each entry of ``ids`` (``(B, N)``, -1 = none), the largest ``values`` (in ``[-1,
    N]``) among the entries naming its token, and the count of those entries: one sort of the
    keys ``id * (N + 2) + value + 1``; in sorted order each token's entries are a run whose
    last key holds its largest value, the run's ends found by a running maximum and minimum
    of the positions where the token changes, then scattered back (searchsorted, twice, cost
    ~4x more on CPU)."""
    span = values.shape[1] + 2
    valid = ids >= 0
    keys = torch.where(valid, ids * span + values.clamp(-1, span - 2) + 1, -1)
    ordered, order = torch.sort(keys, dim=1)
    token = ordered.div(span, rounding_mode="floor")  # -1 for the padding's -1 keys
    size = keys.shape[1]
    position = torch.arange(size, device=ids.device).expand_as(keys)
    change = token[:, 1:] != token[:, :-1]
    edge = torch.ones((keys.shape[0], 1), dtype=torch.bool, device=ids.device)
    starts = torch.cat((edge, change), dim=1)
    ends = torch.cat((change, edge), dim=1)
    first = torch.where(starts, position, 0).cummax(1).values
    last = torch.where(ends, position, size).flip(1).cummin(1).values.flip(1)
    largest = ordered.gather(1, last) - token * span - 1
    largest = torch.empty_like(keys).scatter_(1, order, largest)
    count = torch.empty_like(keys).scatter_(1, order, last - first + 1)
    return torch.where(valid, largest, -1), torch.where(valid, count, 0)


def _edit_(x: Tensor, ids: Tensor, new_values: Tensor, changed: Tensor) -> None:
    """``x[b, ids] = new_values`` where ``changed``, in one scatter: ``changed`` and
    ``new_values`` must agree across the entries naming one token; an unchanged entry writes
    its token's current value back, and padding (-1) entries repeat the row's last entry,
    the most recent token (valid whenever the row holds one), so no two writes disagree."""
    valid = ids >= 0
    target = torch.where(valid, ids, ids[:, -1:].clamp_min(0))
    written = torch.where(changed, new_values.to(x.dtype), x.gather(1, ids.clamp_min(0)))
    written = torch.where(valid, written, written[:, -1:])
    x.scatter_(1, target, written)


def _lower_(x: Tensor, ids: Tensor, changed: Tensor, lowered) -> None:
    """``x[b, t] = min(x[b, t], v)`` over the entries ``(b, j)`` naming ``t = ids[b, j]`` where
    ``changed``, ``v`` each entry's ``lowered(pick, current)`` (``current`` its token's value
    now; ``pick`` selects the entries' values of a ``(B, N)`` or ``(B, 1)`` tensor), in one
    ``scatter_reduce`` (``amin``: exact). DRY and the n-gram ban lower a token by the largest
    of its entries' penalties (each monotone in its entry's match length), so no per-token
    maximum is needed first. On CPU in eager mode only the changed entries are computed and
    scattered (found by ``nonzero``, a host read there, free: they are few); elsewhere every
    entry is, unchanged and padding (-1) ones writing the current value back."""
    if _eager_cpu(x) and x.is_contiguous():
        # Padding (-1) entries never write: a flat index would land in the row before.
        rows, cols = (changed & (ids >= 0)).nonzero(as_tuple=True)
        if rows.numel() == 0:
            return
        flat = rows * x.shape[1] + ids[rows, cols]

        def pick(t: Tensor) -> Tensor:  # (B, N), (B, 1) or a setting's (1, 1)
            if t.shape[1] > 1:
                return t[rows, cols]
            return t[:, 0] if t.shape[0] == 1 else t[rows, 0]

        flat_x = x.view(-1)
        new_values = lowered(pick, flat_x[flat]).to(x.dtype)
        flat_x.scatter_reduce_(0, flat, new_values, reduce="amin", include_self=True)
        return
    valid = ids >= 0
    target = ids.clamp_min(0)
    current = x.gather(1, target)
    new_values = lowered(lambda t: t, current).to(x.dtype)
    written = torch.where(changed & valid, new_values, current)
    x.scatter_reduce_(1, target, written, reduce="amin", include_self=True)


def _breaker_limit(hist: Tensor, table: Tensor | None) -> Tensor | None:
    """``(B,)``: how many of the context's last tokens follow its last complete sequence
    breaker (``table``: :func:`~fastsample.stages.samplers.breaker_tables`' sequences; an
    occurrence ends at its last token), so a repeat never reaches back across one; None
    without breakers. llama.cpp's ``rep_limit``."""
    if table is None:
        return None
    batch, width = hist.shape
    count, longest = table.shape[1], table.shape[2]
    occurs = torch.zeros(batch, width, dtype=torch.bool, device=hist.device)
    for i in range(count):
        here = table[:, i, -1:] >= 0  # a padding sequence occurs nowhere
        for t in range(longest):
            want = table[:, i, t : t + 1]  # -3: before a shorter breaker's start: any token
            shift = longest - 1 - t
            seen = torch.full((batch, width), -2, dtype=hist.dtype, device=hist.device)
            seen[:, shift:] = hist[:, : width - shift]
            here = here & ((want == -3) | (seen == want))
        occurs |= here
    position = torch.arange(width, device=hist.device)
    last = torch.where(occurs, position, -1).amax(-1)
    return (width - 1 - last).clamp_max(width)


def _rows_value(value, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=torch.float32, device=like.device).reshape(-1, 1)


def apply_(
    x: Tensor, state: TokenStats, params: StepParams, rows: Tensor | None, extra: Tensor | None
) -> Tensor:
    """Windowed penalties, DRY and no-repeat n-grams on ``x`` (``(R, V)`` logits), in place."""
    s = params.samplers
    hist = _context(state, rows, extra)
    last_n = s.penalty_last_n  # type: ignore[attr-defined]
    if last_n is not None and params.penalties_on:
        window = _window(hist, last_n)
        counts = _counts(window)
        on = window >= 0
        if isinstance(last_n, Tensor):
            on &= (last_n != 0)[:, None]

        def per_row(value):
            return value[:, None] if isinstance(value, Tensor) else value

        ids = window.clamp_min(0)
        values = penalties.penalize(
            x.gather(1, ids), on, counts.to(x.dtype) * on, per_row(params.repetition_penalty),
            per_row(params.frequency_penalty), per_row(params.presence_penalty),
        )  # fmt: skip
        _edit_(x, ids, values, on)
    whole: list[Tensor] = []  # the history's own match lengths, once

    def lengths(window: Tensor, limit: Tensor | None = None) -> Tensor:
        """match_lengths; the history's without a breaker limit once (DRY over the whole
        history, whose window is the history itself, and the n-gram ban share it)."""
        if window is not hist or limit is not None:
            return match_lengths(window, limit)
        if not whole:
            whole.append(match_lengths(hist))
        return whole[0]

    multiplier = s.dry_multiplier  # type: ignore[attr-defined]
    if multiplier is not None:
        _dry_(x, hist, s, multiplier, lengths)
    n = s.no_repeat_ngram_size  # type: ignore[attr-defined]
    if n is not None:
        # An entry bans its token when the n - 1 tokens before it repeat the context's last.
        need = torch.as_tensor(n, device=x.device).reshape(-1, 1) - 1
        banned = (hist >= 0) & (lengths(hist) >= need) & (need >= 0)
        _lower_(x, hist, banned, lambda pick, current: torch.full_like(current, -math.inf))
    return x


def _dry_(x: Tensor, hist: Tensor, s, multiplier, lengths=match_lengths) -> None:
    """DRY on ``x`` in place (llama.cpp's rules: see the module docstring and
    :func:`_breaker_limit`)."""
    last_n = s.dry_penalty_last_n
    window = _window(hist, last_n)
    present = window >= 0
    size = present.sum(-1, keepdim=True)  # N: the window's tokens
    limit = _breaker_limit(window, s.breaker_table)
    matched = lengths(window, limit)
    # Each entry's own match length: its token's penalty is the largest of its entries'
    # (_lower_), that of its longest match.
    longest = matched
    some_allowed_zero = not isinstance(s.dry_allowed_length, int) or s.dry_allowed_length < 1
    if some_allowed_zero:
        # The window's first token extends nothing (it follows no position of the window):
        # its length 0 must not reach an allowed length 0. (A length >= 1 needs a token
        # before it in the window, which the first lacks.)
        first = torch.arange(window.shape[1], device=x.device)[None, :] == window.shape[1] - size
        longest = torch.where(first, -1, matched)
    allowed = _rows_value(s.dry_allowed_length, x)
    base = _rows_value(s.dry_base, x)
    mult = _rows_value(multiplier, x)
    reach = size if limit is None else limit[:, None]  # rep_limit
    # No penalty when the window holds at most allowed tokens or fewer than allowed follow the
    # last breaker.
    on = (size > allowed) & (reach >= allowed) & (mult != 0)
    on &= torch.as_tensor(last_n, device=x.device).reshape(-1, 1) != 0
    hit = present & on & (longest >= allowed)  # compared in float32, as allowed is
    if s.single_breakers is not None:  # single-token breakers are never penalized
        hit &= ~(window[:, :, None] == s.single_breakers[:, None, :]).any(-1)

    def lowered(pick, current: Tensor) -> Tensor:
        cap = _max_exponent(base)
        exponent = (pick(longest).to(torch.float64) - pick(allowed)).clamp_max(pick(cap))
        penalty = pick(mult).to(torch.float64) * torch.pow(pick(base).to(torch.float64), exponent)
        return current - penalty.to(current.dtype)

    _lower_(x, window, hit, lowered)


def _max_exponent(base: Tensor) -> Tensor:
    """llama.cpp's cap on DRY's exponent, ``int(88.7228391f / logf(base))`` in float32 as it
    computes it (``base > 1.000001``; none otherwise), so ``base ** exponent`` stays near the
    top of float32 (at base 2 the cap is 128: the penalty overflows to ``inf``, as there)."""
    base32 = base.to(torch.float32).clamp_min(1.000001)
    cap = torch.tensor(88.7228391, dtype=torch.float32) / torch.log(base32)
    return torch.where(base > 1.000001, torch.trunc(cap).to(torch.float64), math.inf)
