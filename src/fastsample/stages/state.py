"""Per-request token statistics for the penalties, kept on the device between steps.

:class:`TokenStats` holds, for each request (row) of a batch:

* ``prompt_mask`` ``(B, ceil(V / 32))`` int32: the tokens of its prompt, one bit each
  (:mod:`fastsample.ops.bitmask`'s layout);
* ``output_counts`` ``(B, V)``: how often it has emitted each token, in the narrowest integer
  type that holds ``max_output_tokens`` exactly (uint8 up to 255, int16 up to 32,767, else
  int32);
* ``seen_mask`` ``(B, ceil(V / 32))`` int32: ``prompt | output_counts > 0``, the tokens the
  repetition penalty applies to, kept current by :meth:`TokenStats.update` (it lets the CPU
  path visit only the seen tokens, and a kernel read one bit instead of a count and a bit);
* ``output_len`` ``(B,)`` int64: tokens emitted so far (min-tokens reads it);
* ``history`` ``(B, H)`` int64, only when built with ``history=H > 0``: the request's last
  ``H`` tokens of context (prompt, then output), oldest first, ``-1`` where the context is
  shorter. DRY, no-repeat n-grams and windowed penalties (``penalty_last_n``) read it;
* ``mirostat_mu`` ``(B,)`` float32: mirostat's per-request target surprise ``mu``, NaN until
  the first update that knows ``mirostat_tau`` (the stage reads NaN as its start, ``2 tau``).

Memory per request at ``V = 128,256``: 16,032 bytes per mask, so 32 KiB for the two masks,
plus 125 KiB of uint8 counts (``max_output_tokens <= 255``), 250 KiB of int16 (the default,
up to 32,767) or 501 KiB of int32. :attr:`TokenStats.bytes_per_request` says it.

Built once per request from its prompt (:meth:`TokenStats.from_prompts`); each step adds the
emitted tokens with :meth:`~TokenStats.update` (fixed shapes, no host sync, no loop over
requests: a scatter and a few small ops, or one kernel), including the drafts that
:func:`fastsample.verify_chain` / :func:`fastsample.verify_tree` accepted (pass their
``token_ids``: ``-1`` marks nothing). Rows follow the batch as requests come and go:
:meth:`~TokenStats.select` (reorder, drop, repeat), :meth:`~TokenStats.cat` (append) and
:meth:`~TokenStats.assign` (a new request into a freed row, in place).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels import backend as kernel_backend  # imports no triton
from ..ops import bitmask
from ..ops.threads import GRAIN


def counts_dtype(max_output_tokens: int) -> torch.dtype:
    """The narrowest integer type holding every count up to ``max_output_tokens`` exactly."""
    if isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, int):
        raise TypeError(f"max_output_tokens must be an int, got {type(max_output_tokens).__name__}")
    if max_output_tokens < 0:
        raise ValueError(f"max_output_tokens must be >= 0, got {max_output_tokens}")
    if max_output_tokens <= 255:
        return torch.uint8
    if max_output_tokens <= 32767:
        return torch.int16
    if max_output_tokens <= 2**31 - 1:
        return torch.int32
    raise ValueError(f"max_output_tokens must be below 2**31, got {max_output_tokens}")


def padded_ids(
    rows: Sequence[Sequence[int] | None] | Tensor, device: torch.device | str | None, name: str
) -> Tensor:
    """``(B, L)`` int64 ids from a list of per-row sequences (None = empty), padded with -1; a
    tensor is checked (2-D, integer) and returned as int64."""
    if isinstance(rows, Tensor):
        if rows.dim() != 2 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a (batch, length) integer tensor padded with -1, got "
                f"{rows.dtype} of shape {tuple(rows.shape)}"
            )
        return rows.to(device=device, dtype=torch.int64) if device is not None else rows.long()
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise TypeError(f"{name} must be a list of token-id lists (one per row) or a tensor")
    lists = [list(row) if row is not None else [] for row in rows]
    for b, row in enumerate(lists):
        for token in row:
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"{name}[{b}] must hold Python ints, got {type(token).__name__}")
    width = max((len(row) for row in lists), default=0)
    out = torch.full((len(lists), width), -1, dtype=torch.int64)
    for b, row in enumerate(lists):
        if row:
            out[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out.to(device) if device is not None else out


def shift_in(history: Tensor, token_ids: Tensor) -> Tensor:
    """``history`` (``(B, H)``, oldest first) with each row's valid entries of ``token_ids``
    (``(B, n)``; valid ones first, ``-1`` after them) appended and as many of its oldest
    dropped: one gather, fixed shapes."""
    width = history.shape[1]
    valid = token_ids >= 0
    joined = torch.cat((history, torch.where(valid, token_ids, -1)), dim=1)
    start = valid.sum(-1, keepdim=True)  # the row's count of new tokens
    return joined.gather(1, start + torch.arange(width, device=history.device))


def mirostat_update(
    mu: Tensor, token_ids: Tensor, probs: Tensor, tau: float | Tensor, eta: float | Tensor,
    vocab: int,
) -> Tensor:
    """Mirostat v2's ``mu`` after the emitted tokens: ``mu -= eta * (-log2 q - tau)`` for each
    valid token, ``q`` its processed probability; ``mu`` starts at ``2 tau`` (NaN = not
    started). Rows with mirostat off (a tensor ``tau <= 0``) keep theirs."""
    batch = mu.shape[0]
    tau_rows = torch.as_tensor(tau, dtype=torch.float32, device=mu.device).expand(batch)
    eta_rows = torch.as_tensor(eta, dtype=torch.float32, device=mu.device).expand(batch)
    start = torch.where(torch.isnan(mu), 2 * tau_rows, mu)
    valid = (token_ids >= 0) & (token_ids < vocab)
    surprise = -torch.log2(probs.to(torch.float32).clamp_min(1e-45))
    moved = torch.where(valid, surprise - tau_rows[:, None], 0.0).sum(-1)
    return torch.where(tau_rows > 0, start - eta_rows * moved, mu)


class TokenStats:
    """Which tokens each request has seen, and how often it emitted each: the penalties'
    state (see the module docstring for the layout and its memory)."""

    def __init__(
        self,
        prompt_mask: Tensor,
        output_counts: Tensor,
        output_len: Tensor,
        seen_mask: Tensor,
        max_output_tokens: int,
        history: Tensor | None = None,
        mirostat_mu: Tensor | None = None,
    ) -> None:
        batch, vocab = output_counts.shape
        words = bitmask.words_for(vocab)
        for name, mask in (("prompt_mask", prompt_mask), ("seen_mask", seen_mask)):
            if mask.dtype != torch.int32 or tuple(mask.shape) != (batch, words):
                raise ValueError(f"{name} must be int32 of shape {(batch, words)}")
        if output_len.dtype != torch.int64 or tuple(output_len.shape) != (batch,):
            raise ValueError(f"output_len must be int64 of shape {(batch,)}")
        self.prompt_mask = prompt_mask
        self.output_counts = output_counts
        self.output_len = output_len
        self.seen_mask = seen_mask
        self.max_output_tokens = max_output_tokens
        if history is not None and (
            history.dtype != torch.int64 or history.dim() != 2 or history.shape[0] != batch
        ):
            raise ValueError(f"history must be int64 of shape ({batch}, H)")
        self.history = history
        if mirostat_mu is None:
            mirostat_mu = torch.full((batch,), math.nan, device=output_counts.device)
        self.mirostat_mu = mirostat_mu
        # The seen tokens as positions, for the CPU's sparse penalties (seen_positions), in
        # chunks of fewer than GRAIN: None until asked for, then kept current by update().
        self._positions: list[tuple[Tensor, Tensor]] | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_prompts(
        cls,
        prompts: Sequence[Sequence[int] | None] | Tensor,
        vocab: int,
        *,
        device: torch.device | str | None = None,
        max_output_tokens: int = 32767,
        outputs: Sequence[Sequence[int] | None] | Tensor | None = None,
        history: int = 0,
    ) -> TokenStats:
        """The statistics of requests that start now, from their prompts.

        Args:
            prompts: one token-id sequence per request (a list of lists), or a ``(B, L)``
                integer tensor padded with ``-1``. Ids outside ``[0, vocab)`` are ignored.
            vocab: the vocabulary size ``V``.
            device: where the state lives (the logits' device); default: the tensor's, or CPU.
            max_output_tokens: the most tokens any request will emit: it sets the counts'
                integer type (uint8 up to 255, int16 up to 32,767, int32 beyond). Counts stop
                at the type's largest value.
            outputs: tokens already emitted (a request resumed elsewhere), same forms.
            history: how many of the latest context tokens to keep (``H``; 0: none). DRY,
                no-repeat n-grams and ``penalty_last_n`` need it: at least their window, the
                prompt's length plus ``max_output_tokens`` for the whole context.

        Example:
            >>> stats = TokenStats.from_prompts([[5, 6, 6], [1]], vocab=10, max_output_tokens=100)
            >>> stats.update(torch.tensor([[7], [-1]]))
            >>> stats.output_counts[0, 7].item(), stats.output_len.tolist()
            (1, [1, 0])
        """
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"vocab must be a positive int, got {vocab!r}")
        dtype = counts_dtype(max_output_tokens)
        if device is None and isinstance(prompts, Tensor):
            device = prompts.device
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ValueError(f"history must be an int >= 0, got {history!r}")
        ids = padded_ids(prompts, device, "prompts")
        batch = ids.shape[0]
        prompt_mask = bitmask.from_ids(ids, vocab)
        window = None
        if history:
            window = torch.full((batch, history), -1, dtype=torch.int64, device=ids.device)
            window = shift_in(window, ids)
        stats = cls(
            prompt_mask,
            torch.zeros(batch, vocab, dtype=dtype, device=ids.device),
            torch.zeros(batch, dtype=torch.int64, device=ids.device),
            prompt_mask.clone(),
            max_output_tokens,
            window,
        )
        if outputs is not None:
            emitted = padded_ids(outputs, ids.device, "outputs")
            if emitted.shape[0] != batch:
                raise ValueError(f"outputs has {emitted.shape[0]} rows, prompts {batch}")
            stats.update(emitted)
        return stats

    @classmethod
    def empty(
        cls, batch: int, vocab: int, *, device=None, max_output_tokens: int = 32767,
        history: int = 0,
    ) -> TokenStats:
        """Statistics of ``batch`` requests with empty prompts and nothing emitted."""
        return cls.from_prompts(
            torch.empty(batch, 0, dtype=torch.int64, device=device), vocab,
            max_output_tokens=max_output_tokens, history=history,
        )  # fmt: skip

    # ------------------------------------------------------------------ properties

    @property
    def batch(self) -> int:
        return self.output_counts.shape[0]

    @property
    def vocab(self) -> int:
        return self.output_counts.shape[1]

    @property
    def device(self) -> torch.device:
        return self.output_counts.device

    @property
    def bytes_per_request(self) -> int:
        """Device memory one request takes: two masks, its counts and its length."""
        words = bitmask.words_for(self.vocab)
        return 2 * 4 * words + self.output_counts.element_size() * self.vocab + 8

    def seen_positions(self) -> list[tuple[Tensor, Tensor]]:
        """The seen tokens (the set bits of ``seen_mask``) as ``(rows, columns)`` int64
        positions, in chunks of fewer than :data:`~fastsample.ops.threads.GRAIN` (the CPU's
        sparse penalties visit them; no op on a chunk opens a parallel region).

        CPU eager: found by one scan of the mask on the first call, then kept current by
        :meth:`update` (the newly seen tokens of a step, a few small ops) until the rows
        change (:meth:`assign`; :meth:`select` and :meth:`cat` make a new state). The masks
        change through these methods only."""
        if self._positions is None:
            rows, columns = bitmask.set_bits(self.seen_mask, self.vocab)
            self._positions = []
            self._append_positions(rows, columns)
        return self._positions

    def _append_positions(self, rows: Tensor, columns: Tensor) -> None:
        """Add positions to the chunks, filling the last one up to the grain first."""
        chunks = self._positions
        assert chunks is not None
        size = GRAIN - 1
        start = 0
        if chunks and chunks[-1][0].shape[0] < size:  # top up the last chunk (a small cat)
            last_rows, last_columns = chunks[-1]
            start = size - last_rows.shape[0]
            chunks[-1] = (torch.cat((last_rows, rows[:start])),
                          torch.cat((last_columns, columns[:start])))  # fmt: skip
        for first in range(start, rows.shape[0], size):
            chunks.append((rows[first : first + size], columns[first : first + size]))

    # ------------------------------------------------------------------ each step

    def update(
        self, token_ids: Tensor, *, probs: Tensor | None = None, params: object = None
    ) -> None:
        """Add the tokens each request just emitted, in place: ``(B, n)`` int64, entries outside
        ``[0, V)`` (``-1`` padding, as ``verify_chain``'s ``token_ids`` after the emitted ones)
        add nothing. Fixed shapes, no host sync.

        With mirostat on in ``params`` (a :class:`~fastsample.StepParams`), ``probs`` (the
        step's ``out.probs``: each emitted token's processed probability) moves each row's
        ``mu`` by ``-eta * (-log2 q - tau)`` per emitted token (llama.cpp's update). After a
        chain's verification, ``probs`` may be the ``(B, K+1, V)`` target distributions (token
        ``i`` was emitted at position ``i``): each emitted token's is read there."""
        if not isinstance(token_ids, Tensor) or token_ids.dim() != 2:
            raise ValueError("token_ids must be a (batch, n) int64 tensor")
        if token_ids.shape[0] != self.batch:
            raise ValueError(f"token_ids has {token_ids.shape[0]} rows, the stats {self.batch}")
        if token_ids.device != self.device:
            raise ValueError(f"token_ids is on {token_ids.device}, the stats on {self.device}")
        if token_ids.shape[1] == 0:
            return
        tau = getattr(params, "mirostat_tau", None)
        if tau is not None and probs is not None and probs.dim() == 3:
            if probs.shape[:2] != token_ids.shape:
                raise ValueError("probs of shape (B, n, V) must match token_ids (B, n)")
            probs = probs.gather(2, token_ids.clamp(0, probs.shape[2] - 1)[..., None])[..., 0]
        if tau is not None:
            if probs is None or tuple(probs.shape) != tuple(token_ids.shape):
                raise ValueError("mirostat is on: pass probs=out.probs (shaped as token_ids)")
            self.mirostat_mu = mirostat_update(
                self.mirostat_mu, token_ids, probs, tau, params.mirostat_eta, self.vocab
            )
        if self.history is not None:
            self.history = shift_in(self.history, token_ids)
        if kernel_backend.use_triton(self.device.type):  # one launch (kernels/stats.py)
            from ..kernels import step_ops

            self._positions = None

            step_ops.update(self.output_counts, self.output_len, self.seen_mask,
                            self.prompt_mask, token_ids)  # fmt: skip
            return
        vocab = self.vocab
        inside = (token_ids >= 0) & (token_ids < vocab)
        ids = torch.where(inside, token_ids, 0)
        # Each touched count becomes its value plus its occurrences among this step's tokens,
        # capped at the type's largest value (max_output_tokens says it is never reached).
        # Every entry naming the same column computes the same number, padding included (it
        # names column 0 and adds the real zeros' occurrences), so the scatter is exact.
        same = (ids[:, :, None] == ids[:, None, :]) & inside[:, None, :]  # (B, n, n)
        occurrences = same.sum(-1)
        counts = self.output_counts
        top = torch.iinfo(counts.dtype).max
        new = (counts.gather(1, ids).to(torch.int64) + occurrences).clamp_(max=top)
        counts.scatter_(1, ids, new.to(counts.dtype))
        self.output_len += inside.sum(-1)
        if self._positions is not None:
            self._add_newly_seen(ids, inside, same)
        self._refresh_seen(ids)

    def _add_newly_seen(self, ids: Tensor, inside: Tensor, same: Tensor) -> None:
        """Append to :meth:`seen_positions` the tokens of ``ids`` not seen before this step
        (each once: ``same[b, i, j]``, entry ``j`` of row ``b`` names the token of entry
        ``i``), before the seen mask takes them."""
        if torch.compiler.is_compiling() or self.device.type != "cpu":
            self._positions = None  # the cache reads on the host: CPU eager only
            return
        new = inside & ~bitmask.bits_at(self.seen_mask, ids)
        steps = ids.shape[1]
        if steps > 1:  # a token named twice in a row this step: its first entry only
            earlier = torch.ones(steps, steps, dtype=torch.bool, device=ids.device).tril_(-1)
            new &= ~(same & earlier).any(-1)
        row, slot = new.nonzero(as_tuple=True)
        if row.shape[0]:
            self._append_positions(row, ids[row, slot])

    def _refresh_seen(self, ids: Tensor) -> None:
        """Recompute the seen words holding ``ids``: prompt bits or a nonzero count."""
        words = ids // bitmask.WORD_BITS
        lanes = torch.arange(bitmask.WORD_BITS, device=ids.device)
        columns = words[..., None] * bitmask.WORD_BITS + lanes  # (B, n, 32)
        inside = columns < self.vocab
        flat = columns.clamp_max(self.vocab - 1).flatten(1)
        emitted = (self.output_counts.gather(1, flat) > 0).view(columns.shape) & inside
        prompt = bitmask.unpack(self.prompt_mask.gather(1, words), 32 * words.shape[1])
        bitmask.refresh_words(self.seen_mask, words, emitted | prompt.view(columns.shape))

    # ------------------------------------------------------------------ batch composition

    def select(self, rows: Tensor | Sequence[int]) -> TokenStats:
        """A new state with rows ``rows`` of this one (reorder, drop, repeat)."""
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        return TokenStats(
            self.prompt_mask.index_select(0, index),
            self.output_counts.index_select(0, index),
            self.output_len.index_select(0, index),
            self.seen_mask.index_select(0, index),
            self.max_output_tokens,
            None if self.history is None else self.history.index_select(0, index),
            self.mirostat_mu.index_select(0, index),
        )

    @staticmethod
    def cat(parts: Sequence[TokenStats]) -> TokenStats:
        """The rows of ``parts`` one after the other (requests joining the batch)."""
        if not parts:
            raise ValueError("cat needs at least one TokenStats")
        vocab = parts[0].vocab
        if any(p.vocab != vocab for p in parts):
            raise ValueError("TokenStats.cat: the vocabularies differ")
        widest = max(parts, key=lambda p: p.output_counts.element_size())
        dtype = widest.output_counts.dtype
        lengths = {None if p.history is None else p.history.shape[1] for p in parts}
        if len(lengths) != 1:
            raise ValueError("TokenStats.cat: the parts keep histories of different lengths")
        return TokenStats(
            torch.cat([p.prompt_mask for p in parts]),
            torch.cat([p.output_counts.to(dtype) for p in parts]),
            torch.cat([p.output_len for p in parts]),
            torch.cat([p.seen_mask for p in parts]),
            max(p.max_output_tokens for p in parts),
            None if None in lengths else torch.cat([p.history for p in parts]),  # type: ignore[misc]
            torch.cat([p.mirostat_mu for p in parts]),
        )

    def assign(self, rows: Tensor | Sequence[int], other: TokenStats) -> None:
        """Overwrite rows ``rows`` with ``other``'s rows, in place (new requests in freed
        rows); ``other`` has one row per entry of ``rows`` and a type of counts that fits."""
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        if other.vocab != self.vocab or other.batch != index.numel():
            raise ValueError("assign: other must have one row per index and the same vocab")
        if other.output_counts.element_size() > self.output_counts.element_size():
            raise ValueError("assign: other's counts need a wider type than this state's")
        mine = None if self.history is None else self.history.shape[1]
        if mine != (None if other.history is None else other.history.shape[1]):
            raise ValueError("assign: other keeps a history of another length")
        if self.history is not None:
            self.history.index_copy_(0, index, other.history)
        self.mirostat_mu.index_copy_(0, index, other.mirostat_mu)
        self.prompt_mask.index_copy_(0, index, other.prompt_mask)
        self.output_counts.index_copy_(0, index, other.output_counts.to(self.output_counts.dtype))
        self.output_len.index_copy_(0, index, other.output_len)
        self.seen_mask.index_copy_(0, index, other.seen_mask)
        self._positions = None

    def __repr__(self) -> str:
        return (
            f"TokenStats(batch={self.batch}, vocab={self.vocab}, counts="
            f"{self.output_counts.dtype}, device={self.device})"
        )
