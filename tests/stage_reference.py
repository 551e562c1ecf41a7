"""Float64 reference of the engine step's stages, written from their definitions.

One row at a time, plain numpy: the allowed tokens, logit bias, min-tokens, penalties (vLLM's
and OpenAI's definitions), then the controls of tests/reference.py (temperature, top-k, top-p,
min-p in either order). This is the specification tests/stages/ hold
:func:`fastsample.sample_step` and :func:`fastsample.process_step` to. The ``bug`` argument
plants the mistakes the negative controls must catch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from reference import reference_probs

BUGS = (
    "frequency_over_prompt",  # counts the prompt's tokens as output for the frequency penalty
    "bitmask_msb_first",  # reads token j as bit 31 - j % 32 of its word
    "bias_after_temperature",  # adds the logit bias to x / T instead of x
    "repetition_unseen",  # applies the repetition penalty to every token
    "min_tokens_ignored",  # never suppresses the stop ids
)


@dataclass
class Row:
    """One request's settings for the reference (everything off by default)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    cut_order: str = "transformers"
    allowed: Iterable[int] | None = None  # allowed ids (None: all)
    bitmask_words: np.ndarray | None = None  # this row's grammar bitmask words (int32)
    bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop: Iterable[int] = ()
    prompt: Iterable[int] = ()
    outputs: Iterable[int] = ()  # tokens emitted so far, in order (counts and output_len)
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0


def bitmask_allows(words: np.ndarray, vocab: int, msb_first: bool = False) -> np.ndarray:
    """``(V,)`` bool from int32 words in xgrammar's layout (token j = bit j % 32, LSB first)."""
    j = np.arange(vocab)
    shift = (31 - j % 32) if msb_first else j % 32
    return ((words.astype(np.int64)[j // 32] >> shift) & 1).astype(bool)


def stage_logits(x: np.ndarray, row: Row, bug: str | None = None) -> np.ndarray:
    """Stages a-c on one row of logits, float64."""
    x = np.asarray(x, dtype=np.float64).copy()
    vocab = x.shape[0]
    if row.bitmask_words is not None:
        x[~bitmask_allows(row.bitmask_words, vocab, bug == "bitmask_msb_first")] = -np.inf
    if row.allowed is not None:
        keep = np.zeros(vocab, dtype=bool)
        keep[list(row.allowed)] = True
        x[~keep] = -np.inf
    if bug != "bias_after_temperature":
        for token, value in row.bias.items():
            x[token] += value
    outputs = list(row.outputs)
    if len(outputs) < row.min_tokens and bug != "min_tokens_ignored":
        x[list(row.stop)] = -np.inf
    counts = np.bincount(np.asarray(outputs, dtype=np.int64), minlength=vocab).astype(np.float64)
    prompt = np.zeros(vocab, dtype=bool)
    prompt[list(row.prompt)] = True
    seen = prompt | (counts > 0)
    if bug == "repetition_unseen":
        seen[:] = True
    x = np.where(seen & (x > 0), x / row.repetition, np.where(seen, x * row.repetition, x))
    frequency_counts = counts + (np.bincount(list(row.prompt), minlength=vocab)
                                 if bug == "frequency_over_prompt" else 0)  # fmt: skip
    x = x - row.frequency * frequency_counts
    x = x - row.presence * (counts > 0)
    if bug == "bias_after_temperature":
        # The bug: bias added after dividing by T; expressed on x so that the controls below
        # (which divide by T) see (x / T + b) * T = x + b * T.
        for token, value in row.bias.items():
            x[token] += value * row.temperature
    return x


def step_probs(x: np.ndarray, row: Row, bug: str | None = None) -> np.ndarray:
    """The processed distribution of one row after every stage, float64."""
    staged = stage_logits(x, row, bug)
    return reference_probs(
        staged, row.temperature, row.top_k, row.top_p, row.min_p, cut_order=row.cut_order
    )


def raw_logprobs(x: np.ndarray, row: Row) -> np.ndarray:
    """The raw log-probabilities: the logits after the allowed-token masks only."""
    masked = stage_logits(x, Row(allowed=row.allowed, bitmask_words=row.bitmask_words))
    top = masked.max()
    return masked - (top + np.log(np.exp(masked - top).sum()))


def rank_of(scores: np.ndarray, token: int) -> int:
    """vLLM's rank: tokens at least as likely as ``token``, itself included."""
    return int((scores >= scores[token]).sum())


# ---------------------------------------------------------------------------- the same rows
# as fastsample's objects


def _padded(lists: list[list[int]], torch_mod) -> object:
    width = max((len(r) for r in lists), default=0)
    out = torch_mod.full((len(lists), width), -1, dtype=torch_mod.int64)
    for b, r in enumerate(lists):
        if r:
            out[b, : len(r)] = torch_mod.tensor(r)
    return out


def fastsample_args(rows: list[Row], vocab: int, form: str = "list", **extra):
    """``(StepParams, TokenStats, token_bitmask)`` for ``rows``: settings as Python lists and
    numbers (``form="list"``, one value shared when all rows agree) or as tensors."""
    import torch

    import fastsample as fs

    batch = len(rows)

    def per_row(name, off, dtype=torch.float32):
        values = [getattr(r, name) for r in rows]
        if form == "list" and len(set(values)) == 1:
            return values[0] if values[0] != off else None
        return torch.tensor(values, dtype=dtype)

    if form == "list":
        allowed = [sorted(r.allowed) if r.allowed is not None else None for r in rows]
        bias = [dict(r.bias) or None for r in rows]
        stops = [list(r.stop) for r in rows]
    else:
        allowed = _padded([sorted(r.allowed) if r.allowed is not None else [] for r in rows], torch)
        width = max((len(r.bias) for r in rows), default=0)
        ids = torch.full((batch, width), -1, dtype=torch.int64)
        values = torch.zeros(batch, width)
        for b, r in enumerate(rows):
            for m, (token, value) in enumerate(r.bias.items()):
                ids[b, m], values[b, m] = token, value
        bias = (ids, values)
        stops = _padded([list(r.stop) for r in rows], torch)
    any_allowed = any(r.allowed is not None for r in rows)
    any_bias = any(r.bias for r in rows)
    any_stop = any(r.min_tokens for r in rows)
    min_tokens = per_row("min_tokens", 0, torch.int64) if any_stop else None
    if form == "list" and any_stop and min_tokens is None:
        min_tokens = 0
    params = fs.StepParams(
        batch, vocab,
        temperature=per_row("temperature", 1.0), top_k=per_row("top_k", 0, torch.int64),
        top_p=per_row("top_p", 1.0), min_p=per_row("min_p", 0.0),
        cut_order=rows[0].cut_order,
        allowed_token_ids=allowed if any_allowed else None,
        logit_bias=bias if any_bias else None,
        min_tokens=min_tokens, stop_token_ids=stops if any_stop else None,
        repetition_penalty=per_row("repetition", 1.0),
        frequency_penalty=per_row("frequency", 0.0),
        presence_penalty=per_row("presence", 0.0),
        **extra,
    )  # fmt: skip
    stats = fs.TokenStats.from_prompts(
        [list(r.prompt) for r in rows], vocab, outputs=[list(r.outputs) for r in rows]
    )
    bitmask = None
    if any(r.bitmask_words is not None for r in rows):
        words = (vocab + 31) // 32
        bitmask = torch.full((batch, words), -1, dtype=torch.int32)
        for b, r in enumerate(rows):
            if r.bitmask_words is not None:
                bitmask[b] = torch.from_numpy(r.bitmask_words.astype(np.int32))
    return params, stats, bitmask
