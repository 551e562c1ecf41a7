"""The engine step on the Triton backend: its kernels as torch operators, and the entry points
:mod:`fastsample.stages` dispatches to.

Entry points (arguments already checked by the step, the same checks as the torch path):

* :func:`staged` ``(source, is_logits, stages) -> (B, V)``: stages a-c
  (:mod:`.stages`, one launch): what ``staged_logits`` and ``process_step`` read;
* :func:`sample_step` -> ``SampleOutput`` fields: a whole step in at most three launches:
  the stages kernel (when a stage or the raw logprobs are on), the controls kernel
  (:mod:`.controls`, unless every row is greedy with nothing to weigh) or, when the sampler
  chain is on (:class:`Chain`), the chain kernel (:mod:`.chain`) in its place, and the draw
  kernel (:mod:`.step_draw`: the draw, the logprobs of either mode, ranks and requested ids);
* :func:`update` ``(counts, length, seen, prompt, ids)``: ``TokenStats.update`` in one
  launch (:mod:`.stats`).

Launches per step: 3 with every stage and any logprobs; 2 without a stage (raw logprobs
count as one: their normalizer is taken in the stages kernel); unseeded steps add one
``randint`` (the per-row Philox key) and Python ``seed``/``step`` numbers one ``full`` each,
as :func:`.controls_ops.sample`. Nothing else runs on the device: per-row settings given as
Python numbers travel by value, absent tensors as a dummy pointer.

Operators: ``fastsample::stages``, ``fastsample::chain``, ``fastsample::step_draw`` and
``fastsample::stats_update`` (which mutates the statistics in place) are ``torch.library``
operators (``triton_op`` when compiled, ``custom_op`` with a fake implementation when
interpreted), so ``torch.compile(fullgraph=True)`` traces a step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..ops.noise import UniformSource
from ..ops.validation import Controls
from . import chain as _chain
from . import stages as _stages
from . import stats as _stats
from . import step_draw as _draw
from .controls_ops import (
    _joined,
    _register,
    _tensor_stream,
    _unit_stride_controls,
    processed,
)
from .history import History
from .ops import counters
from .philox import INTERPRETED


class Stages(NamedTuple):
    """Stages a-c of one step as the kernel takes them (None: off; see
    :func:`.stages.stages` for each field). ``*_value`` are Python numbers used where the
    tensor of the same name is None."""

    grammar: Tensor | None = None
    indices: Tensor | None = None
    allowed: Tensor | None = None
    bias_ids: Tensor | None = None
    bias_values: Tensor | None = None
    stop_ids: Tensor | None = None
    min_tokens: Tensor | None = None
    min_tokens_value: int = 0
    length: Tensor | None = None
    length_value: int = 0
    rows: Tensor | None = None
    seen: Tensor | None = None
    counts: Tensor | None = None
    extra: Tensor | None = None
    rep: Tensor | None = None
    rep_value: float | None = None
    freq: Tensor | None = None
    freq_value: float | None = None
    pres: Tensor | None = None
    pres_value: float | None = None
    # The history stages (.history.History's fields; history None: off).
    history: Tensor | None = None
    last_n: Tensor | None = None
    last_n_value: float | None = None
    dry_multiplier: Tensor | None = None
    dry_multiplier_value: float | None = None
    dry_base: Tensor | None = None
    dry_base_value: float | None = None
    dry_allowed: Tensor | None = None
    dry_allowed_value: float | None = None
    dry_window: Tensor | None = None
    dry_window_value: float | None = None
    ngram: Tensor | None = None
    ngram_value: float | None = None
    breakers: Tensor | None = None
    singles: Tensor | None = None

    @property
    def masked(self) -> bool:
        return self.grammar is not None or self.allowed is not None

    @property
    def on(self) -> bool:
        """Whether a stage changes the scores (then the kernel writes a buffer)."""
        return (
            self.masked
            or self.bias_ids is not None
            or self.stop_ids is not None
            or self.seen is not None
            or self.history is not None
        )


class Chain(NamedTuple):
    """The sampler chain of a step as the chain kernel takes it (:func:`.chain.chain_weights`):
    it then runs in the controls kernel's place."""

    settings: list  # one per name of chain.SETTINGS: a (B,) tensor, a number or None
    stages: list[int]  # the codes of the stages that are on, in order
    dynatemp: bool
    mu: Tensor | None  # mirostat's mu, one per state row
    rows: Tensor | None  # each row's state row


def _stages_launcher(
    source: Tensor,
    is_logits: bool,
    grammar: Tensor | None,
    indices: Tensor | None,
    allowed: Tensor | None,
    bias_ids: Tensor | None,
    bias_values: Tensor | None,
    stop_ids: Tensor | None,
    min_tokens: Tensor | None,
    min_tokens_value: int,
    length: Tensor | None,
    length_value: int,
    rows: Tensor | None,
    seen: Tensor | None,
    counts: Tensor | None,
    extra: Tensor | None,
    rep: Tensor | None,
    rep_value: float | None,
    freq: Tensor | None,
    freq_value: float | None,
    pres: Tensor | None,
    pres_value: float | None,
    write: bool,
    raw: bool,
    num_top: int,
    words_out: bool,
    history: Tensor | None = None,
    last_n: Tensor | None = None,
    last_n_value: float | None = None,
    dry_multiplier: Tensor | None = None,
    dry_multiplier_value: float | None = None,
    dry_base: Tensor | None = None,
    dry_base_value: float | None = None,
    dry_allowed: Tensor | None = None,
    dry_allowed_value: float | None = None,
    dry_window: Tensor | None = None,
    dry_window_value: float | None = None,
    ngram: Tensor | None = None,
    ngram_value: float | None = None,
    breakers: Tensor | None = None,
    singles: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    past = None
    if history is not None:
        past = History(
            history, last_n, last_n_value, dry_multiplier, dry_multiplier_value, dry_base,
            dry_base_value, dry_allowed, dry_allowed_value, dry_window, dry_window_value, ngram,
            ngram_value, breakers, singles,
        )  # fmt: skip
    return _stages.stages(
        source, is_logits, grammar, indices, allowed, bias_ids, bias_values, stop_ids,
        min_tokens, min_tokens_value, length, length_value, rows, seen, counts, extra,
        rep, rep_value, freq, freq_value, pres, pres_value, write, raw, num_top, words_out,
        past,
    )  # fmt: skip


_BEFORE_HISTORY = 20  # Stages' fields up to pres_value: then write, raw, num_top, words_out


def _stages_fake(source, is_logits, *rest):
    write, raw, num_top, words_out = rest[_BEFORE_HISTORY : _BEFORE_HISTORY + 4]
    return _stages.outputs(source, write, raw, num_top, words_out)


def _draw_launcher(
    source: Tensor,
    is_logits: bool,
    mode: int,
    num_samples: int,
    weights: Tensor | None,
    sums: Tensor | None,
    total: Tensor | None,
    clean: Tensor | None,
    temperature: Tensor | None,
    seed: Tensor | None,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream_value: int,
    rows_ok: Tensor | None,
    scores: Tensor,
    words: Tensor | None,
    log_total: Tensor | None,
    top: Tensor | None,
    ranks: bool,
    requested: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    got, stream = _joined(weights, sums, total, clean, stream_rows, stream_value)
    return _draw.step_draw(  # type: ignore[return-value]
        source, is_logits, mode, num_samples, got, temperature, seed, step, stream, rows_ok,
        scores, words, log_total, top, ranks, requested,
    )  # fmt: skip


def _draw_fake(source, is_logits, mode, num_samples, *rest):
    top, ranks, requested = rest[-3:]
    num_top = top.shape[1] if top is not None else 0
    num_requested = requested.shape[1] if requested is not None else 0
    return _draw.outputs(source, num_samples, num_top, ranks, num_requested)


def _chain_launcher(
    scores: Tensor,
    tensors: list[Tensor | None],
    numbers: list[float],
    stages: list[int],
    dynatemp: bool,
    mu: Tensor | None,
    rows: Tensor | None,
    seed: Tensor,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream_value: int,
    num_top: int,
    coin: int = 0,
    normalized: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # A custom op takes no unions: each setting is its tensor, else its number (NaN: off).
    settings = [t if t is not None else (None if math.isnan(x) else x)
                for t, x in zip(tensors, numbers, strict=True)]  # fmt: skip
    return _chain.chain_weights(  # type: ignore[return-value]
        scores, settings, stages, dynatemp, mu, rows, seed, step,
        stream_rows if stream_rows is not None else stream_value, num_top, coin, normalized,
    )  # fmt: skip


def _chain_fake(scores, tensors, numbers, stages, dynatemp, mu, rows, seed, step, stream_rows,
                stream_value, num_top, coin=0, normalized=False):  # fmt: skip
    return _chain.outputs(scores, num_top)


def _update_launcher(
    counts: Tensor, length: Tensor, seen: Tensor, prompt: Tensor, ids: Tensor
) -> None:
    _stats.update(counts, length, seen, prompt, ids)


def _update_fake(counts, length, seen, prompt, ids):
    return None


stages_op = _register("stages", _stages_launcher, _stages_fake)
step_draw_op = _register("step_draw", _draw_launcher, _draw_fake)
chain_op = _register("chain", _chain_launcher, _chain_fake)

_UPDATE = "fastsample::stats_update"
_MUTATED = ("counts", "length", "seen")
if INTERPRETED:
    update_op = torch.library.custom_op(_UPDATE, _update_launcher, mutates_args=_MUTATED)
    update_op.register_fake(_update_fake)
else:
    update_op = torch.library.triton_op(_UPDATE, _update_launcher, mutates_args=_MUTATED)


def _run_chain(
    scores: Tensor, chain: Chain, counted: tuple, num_top: int, coin: int = _chain.DRAWN,
    normalized: bool = False,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The chain op on ``chain``: its settings split into tensors and numbers (NaN: off), as a
    custom op takes them; ``counted``: ``(seed, step, stream_rows, stream_value)``."""
    tensors = [c if isinstance(c, Tensor) else None for c in chain.settings]
    numbers = [math.nan if c is None or isinstance(c, Tensor) else float(c)
               for c in chain.settings]  # fmt: skip
    return chain_op(scores, tensors, numbers, chain.stages, chain.dynatemp, chain.mu,
                    chain.rows, *counted, num_top, coin, normalized)  # fmt: skip


def chain_distribution(scores: Tensor, chain: Chain, xtc_probability) -> Tensor:
    """:func:`fastsample.process_step`'s distribution with the sampler chain on: one launch
    of the chain kernel, normalized (invalid rows all zeros); with XTC on, its exact mixture
    ``q P(removed) + (1 - q) P(kept)`` (two launches, fixed coins, and three ops)."""

    def run(coin: int) -> Tensor:
        # The counters are never read with a fixed coin: any tensor stands in for them.
        return _run_chain(scores, chain, (scores, None, None, 0), 0, coin, True)[1]

    if xtc_probability is None:
        return run(_chain.KEEPS)
    q = xtc_probability
    q = q[:, None].to(scores.dtype if scores.dtype == torch.float64 else torch.float32) \
        if isinstance(q, Tensor) else q  # fmt: skip
    return q * run(_chain.REMOVES) + (1 - q) * run(_chain.KEEPS)


def update(counts: Tensor, length: Tensor, seen: Tensor, prompt: Tensor, ids: Tensor) -> None:
    """:meth:`fastsample.stages.TokenStats.update` in one launch (in place; ids with another
    column stride are copied first, one op)."""
    if ids.shape[1] > 1 and ids.stride(1) != 1:
        ids = ids.contiguous()
    update_op(counts, length, seen, prompt, ids)


def _run_stages(
    source: Tensor, is_logits: bool, stages: Stages, raw: bool, num_top: int, words_out: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return stages_op(
        source, is_logits, *stages[:_BEFORE_HISTORY], stages.on, raw, num_top, words_out,
        *stages[_BEFORE_HISTORY:],
    )  # fmt: skip


def staged(source: Tensor, is_logits: bool, stages: Stages) -> Tensor:
    """The scores after stages a-c, ``(B, V)`` float32 (float64 for float64 input), in one
    launch (``stages.on`` must hold)."""
    return _run_stages(source, is_logits, stages, False, 0, False)[0]


def sample_step(
    source: Tensor,
    is_logits: bool,
    stages: Stages,
    controls: Controls,
    num_samples: int,
    rng: UniformSource,
    num_top: int,
    raw: bool,
    ranks: bool,
    requested: Tensor | None,
    rows_ok: Tensor | None,
    chain: Chain | None = None,
) -> tuple[Tensor | None, ...]:
    """A whole step: ``(token_ids, probs, valid, logprobs, top_token_ids, top_logprobs, ranks,
    requested_logprobs)``, the fields of a ``SampleOutput`` (None where not asked), with
    :func:`fastsample.stages.sample_step`'s results (see the module docstring)."""
    batch = source.shape[0]
    controls = _unit_stride_controls(controls)
    stream = _tensor_stream(rng)
    log_total = raw_top_ids = raw_top = words = None
    scores = source
    if stages.on or raw:
        words_out = raw and stages.masked and (ranks or requested is not None)
        buffer, log_total, raw_top_ids, raw_top, words = _run_stages(
            source, is_logits, stages, raw, num_top, words_out
        )
        if stages.on:
            scores = buffer
        if not raw:
            log_total = None
        if not words_out:
            words = None
    t = controls.temperature
    tensor_controls = any(
        isinstance(c, Tensor) for c in (t, controls.top_k, controls.top_p, controls.min_p)
    )
    processed_top = 0 if raw else num_top
    got = top_ids = top = None
    counted = None
    if chain is not None:  # the chain kernel in the controls kernel's place
        counted = counters(rng, batch, source.device)
        scores, weights, sums, total, clean, top_ids, top = _run_chain(
            scores, chain, counted, processed_top
        )
        got, mode, t = (weights, sums, total, clean), _draw.DRAW, None
    elif controls.all_greedy and processed_top == 0 and not tensor_controls:
        mode = _draw.SCAN  # nothing to weigh: the draw launch judges the rows itself
    else:
        logits, probs = (scores, None) if is_logits else (None, scores)
        weights, sums, total, clean, top_ids, top = processed(
            logits, probs, controls, stream, processed_top
        )
        got = (weights, sums, total, clean)
        if controls.all_greedy:
            mode = _draw.ALL
        elif num_samples > 1 and isinstance(t, Tensor):
            mode = _draw.SOME
        else:
            mode = _draw.DRAW
    if counted is not None:
        seed, step, stream_rows, stream_value = counted
    elif mode in (_draw.DRAW, _draw.SOME):
        seed, step, stream_rows, stream_value = counters(rng, batch, source.device)
    else:
        seed, step, stream_rows, stream_value = None, None, stream, 0
    if raw:
        top_ids, top = (raw_top_ids, raw_top) if num_top else (None, None)
    ids, p_out, logp_out, valid, top_out, ranks_out, requested_out = step_draw_op(
        scores, is_logits, mode, num_samples, *(got or (None,) * 4),
        t if isinstance(t, Tensor) else None, seed, step, stream_rows, stream_value, rows_ok,
        source if raw else scores, words, log_total, top, ranks, requested,
    )  # fmt: skip
    return (
        ids, p_out, valid, logp_out, top_ids if num_top else None, top_out if num_top else None,
        ranks_out if ranks else None, requested_out if requested is not None else None,
    )  # fmt: skip
