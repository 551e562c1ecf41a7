"""The sampling step: the stages in order, from one batch of logits to the drawn tokens.

:func:`sample_step` is the engine's call (per-batch :class:`StepParams`, per-step logits,
step counter, grammar bitmask and :class:`TokenStats`); :func:`process_step` returns the
processed distribution instead of drawing (speculative verification's target rows);
:func:`fastsample.sample` is :func:`sample_step` with its keyword arguments as parameters.

The list, each stage a module of this package with its exact definition:

a. :mod:`.allowed` -- grammar bitmask and allowed ids (``-inf`` where not allowed);
b. :mod:`.bias` -- logit bias, then min-tokens;
c. :mod:`.penalties` -- repetition, frequency, presence; :mod:`.history` -- DRY, no-repeat
   n-grams, windowed penalties (when on);
d-e. :mod:`.draw` -- temperature, top-k, top-p, min-p, greedy, and the draw; or, when a
   stage of :mod:`.samplers` is on or the order asks for it, :mod:`.chain` -- the truncation
   stages and temperature in ``params.samplers.order``, then the draw with no control;
f. :mod:`.logprobs` -- processed or raw log-probabilities, top-N, ranks, requested ids.

Stages a-c write one float buffer (float32; float64 for float64 logits) that the draw stage
reads; when none is on, the draw reads the logits themselves and the step is bitwise
:func:`fastsample.sample` of before. The raw logprobs are taken after stage a.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..controls import process_checked
from ..ops import scratch, threads
from ..ops import validation as v
from ..ops.seeds import check_stream_values, make_source, stream_ok
from ..ops.weights import compute_dtype, controls_in_range
from . import allowed, bias, chain, history, kernel_step, logprobs, penalties
from .draw import draw
from .output import SampleOutput, flag_rows
from .params import StepParams
from .state import TokenStats


class _Prepared(NamedTuple):
    scores: Tensor  # what the controls read: the logits after stages a-c (or the input)
    raw: Tensor | None  # the logits after stage a, for raw logprobs
    is_logits: bool
    rows_ok: Tensor | None  # (B,) rows whose tensor settings are in range


def _check_inputs(
    logits, probs, params, state, token_bitmask, bitmask_indices, output_len, rows=None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Every argument check of a step, before any work; ``rows`` maps the logits' rows to the
    state's (:func:`process_step`), so their counts may differ."""
    source = v.check_source(logits, probs)
    batch, vocab = source.shape
    if not isinstance(params, StepParams):
        raise TypeError(f"params must be a fastsample.StepParams, got {type(params).__name__}")
    if (params.batch, params.vocab) != (batch, vocab):
        raise ValueError(
            f"params were built for ({params.batch}, {params.vocab}), the logits are "
            f"{tuple(source.shape)}; build StepParams when the batch changes"
        )
    if params.device.type != source.device.type or (
        params.device.index is not None and params.device != source.device
    ):
        raise ValueError(f"params live on {params.device}, the logits on {source.device}")
    if probs is not None and params.edits_logits:
        raise ValueError(
            "logit bias, min-tokens and penalties need logits=, not probs= (so do the "
            "sampler chain's stages)"
        )
    samplers = params.samplers
    needs_state = (params.penalties_on or samplers.history_on or samplers.on("mirostat")
                   or (params.stop_ids is not None and output_len is None))  # fmt: skip
    if state is None and needs_state:
        raise ValueError(
            "penalties and min-tokens need state= (a TokenStats; min-tokens can take "
            "output_len= instead), as do DRY, no-repeat n-grams, penalty_last_n and mirostat"
        )
    if samplers.history_on and state is not None and state.history is None:
        raise ValueError(
            "DRY, no-repeat n-grams and penalty_last_n read the token history: build the "
            "TokenStats with history=H (TokenStats.from_prompts(..., history=H))"
        )
    if state is not None:
        if not isinstance(state, TokenStats):
            raise TypeError(f"state must be a fastsample.TokenStats, got {type(state).__name__}")
        state_rows = batch if rows is None else state.batch
        if (state.batch, state.vocab) != (state_rows, vocab) or state.device != source.device:
            raise ValueError(
                f"state holds ({state.batch}, {state.vocab}) on {state.device}, the logits "
                f"are {tuple(source.shape)} on {source.device}"
            )
    if output_len is not None and not isinstance(output_len, int | Tensor):
        raise TypeError("output_len must be an int or a (B,) int64 tensor")
    words, indices = allowed.check_bitmask(
        token_bitmask, bitmask_indices, batch, vocab, source.device
    )
    return source, words, indices


def _prepare(
    source: Tensor,
    is_logits: bool,
    params: StepParams,
    state: TokenStats | None,
    words: Tensor | None,
    indices: Tensor | None,
    output_len: Tensor | int | None,
    raw_wanted: bool,
    rows: Tensor | None = None,
    extra: Tensor | None = None,
    scratch_ok: bool = False,
    kernel_declined: bool = False,
) -> _Prepared:
    """Stages a-c: the logits the controls read (a buffer of ours when a stage is on: with
    ``scratch_ok``, the calling thread's kept one, :mod:`fastsample.ops.scratch`).
    ``kernel_declined``: the caller found that :func:`kernel_step.applies` does not hold."""
    batch = source.shape[0]
    dtype = compute_dtype(source.dtype)
    scores = v.detached(source)
    if not (raw_wanted or kernel_declined) and kernel_step.applies(
        source, params, words, state, _width(extra)
    ):
        staged = kernel_step.staged(scores, is_logits, params, state, words, indices, output_len,
                                    rows, extra)  # fmt: skip
        return _Prepared(scores if staged is None else staged, None, is_logits, params.rows_ok)

    def new_buffer(slot: str) -> Tensor:
        if scratch_ok:
            return scratch.buffer(slot, tuple(source.shape), dtype, source.device)
        return torch.empty(source.shape, dtype=dtype, device=source.device)

    mask = allowed.allowed_words(words, indices, params.allowed_mask, batch)
    owned = False  # whether scores is a buffer of ours (not the caller's logits, or a view)
    if mask is not None:
        scores, owned = allowed.apply(scores, mask, new_buffer("allowed"), is_logits), True
    raw = scores if raw_wanted else None
    if params.edits_logits:
        # Stages b-c edit in place: a buffer of our own, apart from the raw scores if kept.
        if not owned or raw_wanted:
            scores, owned = threads.copy_(new_buffer("staged"), scores), True
        if params.bias_ids is not None:
            assert params.bias_values is not None
            bias.apply_bias_(scores, params.bias_ids, params.bias_values)
        if params.stop_ids is not None:
            assert params.min_tokens is not None
            length = output_len if output_len is not None else state.output_len  # type: ignore[union-attr]
            if rows is not None and isinstance(length, Tensor):
                length = length[rows]
            if extra is not None:  # drafts before a verification position count as output
                length = length + (extra >= 0).sum(-1)
            bias.apply_min_tokens_(scores, params.stop_ids, params.min_tokens, length)
        if params.penalties_on:
            assert state is not None
            rep, freq, pres = history.output_penalties(params)
            penalties.apply_(scores, state, rep, freq, pres, rows, extra)
        if params.samplers.history_on:
            assert state is not None
            history.apply_(scores, state, params, rows, extra)
    return _Prepared(scores, raw, is_logits, params.rows_ok)


@threads.one_thread_calls
def sample_step(
    logits: Tensor | None = None,
    probs: Tensor | None = None,
    params: StepParams | None = None,
    *,
    state: TokenStats | None = None,
    step: int | Tensor | None = None,
    generator: torch.Generator | None = None,
    token_bitmask: Tensor | None = None,
    bitmask_indices: Tensor | list[int] | None = None,
    output_len: int | Tensor | None = None,
    state_rows: Tensor | None = None,
    check: bool = False,
) -> SampleOutput:
    """One sampling step of an inference engine: every stage, then the draw.

    Math: the logits ``x`` go through the stages in order (:mod:`fastsample.stages.step`'s
    list, each stage's exact definition in its module): allowed tokens (``-inf`` outside the
    grammar bitmask and the allowed ids), logit bias, min-tokens, penalties, then temperature,
    top-k, top-p and min-p in ``params.cut_order``; ``num_samples`` ordered draws without
    replacement from the result. ``probs=`` takes probabilities instead (allowed tokens and
    the controls only).

    Args:
        logits, probs: exactly one, ``(B, V)`` float16/bfloat16/float32/float64. Not modified.
        params: the batch's :class:`StepParams` (built for this ``(B, V)`` and device).
        state: the batch's :class:`TokenStats` (needed by penalties, and by min-tokens unless
            ``output_len`` is given). This call does not update it: after the step, call
            ``state.update(out.token_ids)`` (or with verification's ``token_ids``).
        step: the per-request counter (Python int or ``(B,)`` int64) for seeded params.
        generator: a ``torch.Generator`` when ``params.seed`` is None.
        token_bitmask, bitmask_indices: this step's grammar bitmask, xgrammar's layout
            (:mod:`fastsample.stages.allowed`).
        output_len: ``(B,)`` tokens emitted so far, for min-tokens without a ``state``.
        state_rows: ``(B,)`` int64: the row of ``state`` that each logits row reads (an engine
            that keeps its requests' statistics in fixed slots, such as vLLM's Model Runner
            V2); min-tokens then read ``state.output_len`` at those rows. None: row ``b``.
        check: raise ``ValueError`` naming the first bad row or setting (syncs).

    Returns:
        :class:`SampleOutput`: ``token_ids``, ``probs`` (processed), ``valid``, ``logprobs``
        and, as ``params`` ask, ``top_token_ids``/``top_logprobs``, ``ranks`` and
        ``requested_logprobs`` (in ``params.logprobs_mode``). A row with bad values (NaN or
        ``+inf`` logits, nothing allowed, an out-of-range tensor setting) gets
        ``valid=False`` and the documented in-range result; other rows are unaffected.

    No host sync, fixed shapes (``torch.compile(fullgraph=True)``, CUDA graphs) except on CPU
    in eager mode, where the penalties and the small-top-k path read values on the host for
    free.

    Example:
        >>> params = StepParams(2, 50, temperature=0.8, top_k=10, presence_penalty=0.5,
        ...                     seed=torch.tensor([1, 2]), top_logprobs=3)
        >>> stats = TokenStats.from_prompts([[1, 2, 3], [4]], vocab=50)
        >>> out = sample_step(torch.randn(2, 50), params=params, state=stats, step=0)
        >>> stats.update(out.token_ids)
        >>> out.top_token_ids.shape, stats.output_len.tolist()
        (torch.Size([2, 3]), [1, 1])
    """
    source, words, indices = _check_inputs(
        logits, probs, params, state, token_bitmask, bitmask_indices, output_len, state_rows
    )
    assert params is not None
    v.check_generator(generator, source.device)
    rng = make_source(generator, params.seed, step, params.stream, params.batch, source.device)  # type: ignore[arg-type]
    if v.check_flag(check, "check"):
        v.check_source_values(logits, probs)
        params.check_values()
        check_stream_values(rng)
    if kernel_step.applies(source, params, words, state):  # the Triton backend: 3 launches
        return kernel_step.sample_step(v.detached(source), logits is not None, params, state,
                                       words, indices, output_len, rng, state_rows)  # fmt: skip
    raw_mode = params.logprobs_mode == "raw"
    ready = _prepare(source, logits is not None, params, state, words, indices, output_len,
                     raw_mode, state_rows, scratch_ok=True, kernel_declined=True)  # fmt: skip
    scores, controls = ready.scores, params.controls
    if params.chain_on:
        mu = _mirostat_mu(params, state, state_rows)
        few = None
        if not (params.top_logprobs or raw_mode or params.token_ranks
                or params.logprob_token_ids is not None):  # fmt: skip
            few = chain.candidates(scores, controls, params.samplers, rng, mu)
        if few is not None:  # the chain ran on the top-k candidates: draw there, map back
            drawn = draw(few[0], True, chain.off_controls(controls), params.num_samples, rng, 0)
            out = drawn.out._replace(token_ids=few[1].gather(1, drawn.out.token_ids))
            return flag_rows(out, _rows_ok(ready, params, drawn, rng))
        scores = chain.run(scores, controls, params.samplers, rng, mu)
        controls = chain.off_controls(controls)
    drawn = draw(
        scores, ready.is_logits, controls, params.num_samples, rng,
        0 if raw_mode else params.top_logprobs, want_greedy=params.token_ranks,
    )  # fmt: skip
    raw = None
    if ready.raw is not None:  # the draw's block maxima when it read the same scores
        maxima = drawn.maxima if ready.raw is ready.scores else None
        raw = logprobs.raw_normalizer(ready.raw, ready.is_logits, maxima)
    out = logprobs.attach(
        drawn, scores, raw, params.top_logprobs, params.token_ranks,
        params.logprob_token_ids,
    )  # fmt: skip
    return flag_rows(out, _rows_ok(ready, params, drawn, rng))


def _rows_ok(ready: _Prepared, params: StepParams, drawn, rng) -> Tensor | None:
    """The rows whose stream, step settings and (through the chain, which hands the draw no
    controls) controls are in range; None: all."""
    ok = None if drawn.streams_flagged else stream_ok(rng)
    if ready.rows_ok is not None:
        ok = ready.rows_ok if ok is None else ok & ready.rows_ok
    fine = _chain_controls_ok(params)
    if fine is not None:
        ok = fine if ok is None else ok & fine
    return ok


def _chain_controls_ok(params: StepParams) -> Tensor | None:
    """``(B,)`` rows whose tensor controls are in range when the chain runs (it hands the
    draw no controls, so the draw cannot flag them); None: nothing to flag."""
    c = params.controls
    if not params.chain_on or not any(
        isinstance(v, Tensor) for v in (c.temperature, c.top_k, c.top_p, c.min_p)
    ):
        return None
    return controls_in_range(c, params.batch, params.device)


def _mirostat_mu(
    params: StepParams, state: TokenStats | None, rows: Tensor | None
) -> Tensor | None:
    if not params.samplers.on("mirostat"):
        return None
    assert state is not None
    return state.mirostat_mu if rows is None else state.mirostat_mu[rows]


def _width(extra: Tensor | None) -> int:
    return extra.shape[1] if extra is not None else 0


def _chain_distribution(
    scores: Tensor, params: StepParams, state: TokenStats | None, rows: Tensor | None,
    mirostat_mu: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The chain's processed distribution. XTC's coin is not drawn: the result is its exact
    mixture, ``q`` times the chain with XTC's removal plus ``1 - q`` times without."""
    samplers = params.samplers
    mu = mirostat_mu if mirostat_mu is not None else _mirostat_mu(params, state, rows)
    off = chain.off_controls(params.controls)

    def distribution(coin: float) -> Tensor:
        fixed = chain.FixedCoin(scores.shape[0], coin, scores.device)
        return process_checked(chain.run(scores, params.controls, samplers, fixed, mu), None, off)

    if not samplers.on("xtc"):
        return distribution(1.0)
    q = samplers.xtc_probability  # type: ignore[attr-defined]
    q = q[:, None].to(scores.dtype) if isinstance(q, Tensor) else q
    # coin 0 < q always removes; coin 1 never does (q <= 1 and the rule is coin < q).
    return q * distribution(0.0) + (1 - q) * distribution(1.0)


def staged_logits(
    logits: Tensor,
    params: StepParams,
    *,
    state: TokenStats | None = None,
    token_bitmask: Tensor | None = None,
    bitmask_indices: Tensor | list[int] | None = None,
    output_len: int | Tensor | None = None,
    state_rows: Tensor | None = None,
    extra: Tensor | None = None,
) -> Tensor:
    """The logits after stages a-c (allowed tokens, bias, min-tokens, penalties): what the
    controls read. ``(B, V)`` float32 (float64 for float64 logits), a new tensor.
    ``state_rows`` as in :func:`sample_step`, ``extra`` as in :func:`process_step`."""
    source, words, indices = _check_inputs(
        logits, None, params, state, token_bitmask, bitmask_indices, output_len, state_rows
    )
    ready = _prepare(source, True, params, state, words, indices, output_len, False,
                     state_rows, extra)  # fmt: skip
    scores = ready.scores.to(compute_dtype(source.dtype))
    return scores.clone() if scores is source else scores


@threads.one_thread_calls
def process_step(
    logits: Tensor,
    params: StepParams,
    *,
    state: TokenStats | None = None,
    token_bitmask: Tensor | None = None,
    bitmask_indices: Tensor | list[int] | None = None,
    output_len: int | Tensor | None = None,
    rows: Tensor | None = None,
    extra: Tensor | None = None,
    mirostat_mu: Tensor | None = None,
) -> Tensor:
    """The processed distribution of every row after all stages: ``(B, V)`` float32 (float64
    for float64 logits), rows summing to 1, invalid rows all zeros (as
    :func:`fastsample.process`).

    ``rows`` (``(B,)`` int64) maps each row to its row of ``state`` (and of ``output_len``)
    and ``extra`` (``(B, E)`` int64, -1 = none, oldest first) adds tokens counted as already
    emitted: the drafts before each target position in speculative verification.
    ``mirostat_mu`` (``(B,)`` float32): mirostat's ``mu`` of each row in place of the
    state's; with mirostat on and drafts in ``extra`` it is required, since ``mu`` moves with
    each draft (:func:`fastsample.verify.targets.processed_positions` computes it).
    """
    source, words, indices = _check_inputs(
        logits, None, params, state, token_bitmask, bitmask_indices, output_len, rows
    )
    if mirostat_mu is not None and (
        not isinstance(mirostat_mu, Tensor) or tuple(mirostat_mu.shape) != (source.shape[0],)
        or mirostat_mu.device != source.device
    ):  # fmt: skip
        raise ValueError(f"mirostat_mu must be a ({source.shape[0]},) tensor on {source.device}")
    if (mirostat_mu is None and params.samplers.on("mirostat") and extra is not None
            and bool(extra.shape[1])):  # fmt: skip
        raise ValueError(
            "mirostat with drafts (extra=): its mu moves with each draft token, so pass "
            "each row's mirostat_mu (fastsample.verify.targets.processed_positions does)"
        )
    ready = _prepare(
        source, True, params, state, words, indices, output_len, False, rows, extra, True
    )
    if params.chain_on and kernel_step.applies(source, params, words, state, _width(extra)):
        # The Triton backend: the chain kernel (tensor controls flagged inside).
        out = kernel_step.chain_distribution(ready.scores, params, state, rows, mirostat_mu)
    elif params.chain_on:
        out = _chain_distribution(ready.scores, params, state, rows, mirostat_mu)
        fine = _chain_controls_ok(params)
        if fine is not None:
            out = torch.where(fine[:, None], out, 0.0)
    else:
        out = process_checked(ready.scores, None, params.controls)
    if ready.rows_ok is not None:
        out = torch.where(ready.rows_ok[:, None], out, 0.0)
    return out
