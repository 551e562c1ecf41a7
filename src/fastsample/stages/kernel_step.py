"""The step on the Triton backend: the stages' settings handed to the kernels.

:mod:`.step` keeps the torch ops as the reference and, on the Triton backend
(:func:`fastsample.kernels.backend.use_triton`), sends a step here: stages a-c become one
launch of the stages kernel, and a step with any stage or logprob option on is the stages,
controls and draw launches of :mod:`fastsample.kernels.step_ops` (the same arguments, the same
results: tests/kernels/test_triton_stages.py); with the sampler chain on, the chain kernel
takes the controls kernel's place (:func:`chain_args`; tests/kernels/test_triton_chain.py),
and in :func:`fastsample.process_step` it makes the distribution (:func:`chain_distribution`).
The history stages (DRY, no-repeat n-grams, windowed penalties) run last in the stages kernel
(tests/kernels/test_triton_history.py) when the context, drafts included, fits its tile
(:data:`fastsample.kernels.history.MAX_CONTEXT`); a longer one takes the torch ops. A step
with none of them keeps the controls kernels' path of :mod:`.draw`.
"""

from __future__ import annotations

from torch import Tensor

from ..kernels import backend as kernel_backend
from ..ops.noise import UniformSource
from .output import SampleOutput
from .params import StepParams
from .state import TokenStats


def _unit(value):
    """A ``(B,)`` tensor the kernels read at ``ptr + row``: copied if its stride is not 1."""
    if isinstance(value, Tensor) and value.shape[0] > 1 and value.stride(0) != 1:
        return value.contiguous()
    return value


def _split(value):
    """``(tensor, number)`` of a setting given either way (None: off)."""
    return (_unit(value), None) if isinstance(value, Tensor) else (None, value)


def stage_args(
    params: StepParams,
    state: TokenStats | None,
    words: Tensor | None,
    indices: Tensor | None,
    output_len: int | Tensor | None,
    rows: Tensor | None = None,
    extra: Tensor | None = None,
):
    """The :class:`fastsample.kernels.step_ops.Stages` of a step (arguments checked)."""
    from ..kernels.step_ops import Stages

    args = Stages(
        grammar=words, indices=indices, allowed=params.allowed_mask, bias_ids=params.bias_ids,
        bias_values=params.bias_values, rows=_unit(rows),
        extra=extra if extra is not None and extra.shape[1] else None,
    )  # fmt: skip
    if params.stop_ids is not None:
        length = output_len if output_len is not None else state.output_len  # type: ignore[union-attr]
        least, least_value = _split(params.min_tokens)
        length, length_value = _split(length)
        args = args._replace(
            stop_ids=params.stop_ids, min_tokens=least, min_tokens_value=least_value or 0,
            length=length, length_value=length_value or 0,
        )  # fmt: skip
    s = params.samplers
    last_n = s.penalty_last_n if params.penalties_on else None  # type: ignore[attr-defined]
    if params.penalties_on:
        assert state is not None
        rep, rep_value = _split(params.repetition_penalty)
        freq, freq_value = _split(params.frequency_penalty)
        pres, pres_value = _split(params.presence_penalty)
        args = args._replace(
            rep=rep, rep_value=rep_value, freq=freq, freq_value=freq_value, pres=pres,
            pres_value=pres_value,
        )  # fmt: skip
        if last_n is None or isinstance(last_n, Tensor):  # the output counts' penalties
            args = args._replace(seen=state.seen_mask, counts=state.output_counts)
    if s.history_on:
        assert state is not None and state.history is not None
        window, window_value = _split(last_n)
        args = args._replace(history=state.history, last_n=window, last_n_value=window_value)
        if s.dry_multiplier is not None:  # type: ignore[attr-defined]
            mult, mult_value = _split(s.dry_multiplier)  # type: ignore[attr-defined]
            base, base_value = _split(s.dry_base)  # type: ignore[attr-defined]
            allowed, allowed_value = _split(s.dry_allowed_length)  # type: ignore[attr-defined]
            dry_n, dry_n_value = _split(s.dry_penalty_last_n)  # type: ignore[attr-defined]
            args = args._replace(
                dry_multiplier=mult, dry_multiplier_value=mult_value, dry_base=base,
                dry_base_value=base_value, dry_allowed=allowed, dry_allowed_value=allowed_value,
                dry_window=dry_n, dry_window_value=dry_n_value, breakers=s.breaker_table,
                singles=s.single_breakers,
            )  # fmt: skip
        ngram, ngram_value = _split(s.no_repeat_ngram_size)  # type: ignore[attr-defined]
        args = args._replace(ngram=ngram, ngram_value=ngram_value)
    return args


def applies(
    source: Tensor, params: StepParams, words: Tensor | None, state: TokenStats | None = None,
    extra_width: int = 0,
) -> bool:  # fmt: skip
    """Whether :func:`sample_step` takes this step: the Triton backend, with a stage before
    the controls, the sampler chain or a logprob option of the step on (the history stages:
    with a context of at most :data:`fastsample.kernels.history.MAX_CONTEXT` entries, the
    drafts' ``extra_width`` included)."""
    if not kernel_backend.use_triton(source.device.type):
        return False
    if params.samplers.history_on:
        from ..kernels.history import MAX_CONTEXT

        history = getattr(state, "history", None)
        return history is not None and history.shape[1] + extra_width <= MAX_CONTEXT
    return (
        params.chain_on
        or words is not None
        or params.allowed_mask is not None
        or params.edits_logits
        or params.logprobs_mode == "raw"
        or params.token_ranks
        or params.logprob_token_ids is not None
    )


def staged(
    source: Tensor,
    is_logits: bool,
    params: StepParams,
    state: TokenStats | None,
    words: Tensor | None,
    indices: Tensor | None,
    output_len: int | Tensor | None,
    rows: Tensor | None = None,
    extra: Tensor | None = None,
) -> Tensor | None:
    """Stages a-c in one launch, or None when no stage is on (the scores are the input)."""
    args = stage_args(params, state, words, indices, output_len, rows, extra)
    if not args.on:
        return None
    from ..kernels import step_ops

    return step_ops.staged(source, is_logits, args)


def sample_step(
    source: Tensor,
    is_logits: bool,
    params: StepParams,
    state: TokenStats | None,
    words: Tensor | None,
    indices: Tensor | None,
    output_len: int | Tensor | None,
    rng: UniformSource,
    rows: Tensor | None = None,
) -> SampleOutput:
    """:func:`fastsample.stages.sample_step` after its checks, in at most three launches
    (``rows``: the state's row of each logits row)."""
    from ..kernels import step_ops

    args = stage_args(params, state, words, indices, output_len, rows)
    fields = step_ops.sample_step(
        source, is_logits, args, params.controls, params.num_samples, rng,
        params.top_logprobs, params.logprobs_mode == "raw", params.token_ranks,
        params.logprob_token_ids, _unit(params.rows_ok),
        chain_args(params, state, rows) if params.chain_on else None,
    )  # fmt: skip
    return SampleOutput(*fields)


def chain_args(params: StepParams, state: TokenStats | None, rows: Tensor | None):
    """The :class:`fastsample.kernels.step_ops.Chain` of a step whose chain is on: the stages
    that are on in the order's sequence, and every setting the kernel reads."""
    from ..kernels import chain as kernel_chain
    from ..kernels.step_ops import Chain

    s, c = params.samplers, params.controls
    stages = []
    for entry in s.order:
        names = entry if isinstance(entry, tuple) else (entry,)
        on = [name for name in names if s.stage_on(name, c)]
        if len(on) == 2:  # the joint order's top-k and top-p, both on
            stages.append(kernel_chain.JOINT)
        elif on:
            stages.append(kernel_chain.CODES[on[0]])
    values = {"temperature": c.temperature, "top_k": c.top_k, "top_p": c.top_p,
              "min_p": c.min_p}  # fmt: skip
    settings = [_unit(values[name] if name in values else getattr(s, name))
                for name in kernel_chain.SETTINGS]  # fmt: skip
    mu = None
    if s.on("mirostat"):
        assert state is not None
        mu = state.mirostat_mu
    return Chain(settings, stages, s.dynatemp_on, mu, _unit(rows))


def chain_distribution(
    scores: Tensor, params: StepParams, state: TokenStats | None, rows: Tensor | None,
    mirostat_mu: Tensor | None,
) -> Tensor:  # fmt: skip
    """:func:`fastsample.process_step`'s distribution with the chain on, on the Triton backend:
    the chain kernel on the staged ``scores`` (``mirostat_mu``: each row's ``mu`` in place of
    the state's at ``rows``)."""
    from ..kernels import step_ops

    args = chain_args(params, state, rows)
    if mirostat_mu is not None:
        args = args._replace(mu=mirostat_mu, rows=None)
    s = params.samplers
    q = s.xtc_probability if s.on("xtc") else None  # type: ignore[attr-defined]
    return step_ops.chain_distribution(scores, args, _unit(q))
