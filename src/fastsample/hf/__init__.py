"""Generate text with Hugging Face transformers, sampling with fastsample.

``fastsample.hf.generate(model, input_ids, *, seed=None, assistant_model=None, **kwargs)``
takes ``model.generate``'s arguments and returns what it returns (a tensor of sequences, or
an output object with ``return_dict_in_generate=True``). What changes:

* tokens are drawn with :func:`fastsample.sample` (exact temperature/top-k/top-p/min-p,
  no sort, no ``torch.multinomial``) after the user's and the config's logits processors;
* ``seed=`` gives per-request randomness: a list or tensor with one seed per prompt (or one
  int for all). A request's tokens depend on its own logits, seed and position only, never
  on the batch it shares (with ``seed=None`` seeds come from torch's global generator);
* ``assistant_model=`` (a draft model sharing the vocabulary) turns on speculative decoding
  for any batch size, verified by :func:`fastsample.verify_chain`: the output has exactly
  the law of sampling from ``model`` alone. ``num_draft_tokens`` (default 4) per round.

transformers does the preparation (generation config, special tokens, attention mask,
processors, stopping criteria, ``num_return_sequences``) and calls fastsample's loop through
``model.generate(..., custom_generate=callable)`` (transformers >= 4.56). The same function
plugs in there directly::

    model.generate(input_ids, custom_generate=fastsample.hf.generate, seed=[1, 2], ...)

When transformers calls it that way it keeps ``assistant_model`` to itself (it never reaches
a custom loop): pass the draft as ``draft_model=`` instead. transformers 5.x forwards the
loop's own keywords (``seed``, ``draft_model``, ``num_draft_tokens``) but keeps the
``streamer`` (call ``fastsample.hf.generate`` directly to stream); 4.x rejects keywords it
does not know, so bind them: ``custom_generate=functools.partial(fastsample.hf.generate,
seed=[1, 2])``.

Logits processors run before fastsample's controls, on the sequence each row has so far;
speculative decoding calls them once per draft position and row length, so they must not
keep state from call to call (transformers' built-in ones do not).

Not supported (raises): beam search, ``typical_p``/``epsilon_cutoff``/``eta_cutoff``,
continuing from a filled cache, encoder-decoder models, extra model inputs; speculative
decoding also needs models that take ``position_ids``. Speculative decoding returns no
``scores``/``logits`` (its output has ``num_drafted`` and ``num_accepted`` per row instead),
and streams tokens at batch size 1 only (as transformers' streamers require).

Modules: :mod:`.config` (GenerationConfig to controls, seeds), :mod:`.cache` (a model with
its own KV cache and per-row key mask), :mod:`.loop` (plain decoding),
:mod:`.speculative` (draft and verify), :mod:`.output` (return types).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .config import (
    STAGE_KWARGS,
    Prepared,
    controls_from_config,
    copy_seeds,
    prompt_seeds,
    without_config_warpers,
)
from .loop import plain_generate
from .output import FastsampleGenerateOutput
from .speculative import DEFAULT_DRAFT_TOKENS, speculative_generate

__all__ = ["DEFAULT_DRAFT_TOKENS", "FastsampleGenerateOutput", "generate"]

# Model inputs transformers prepares for its own loop; fastsample's loop builds its own.
_PREPARED_INPUTS = (
    "position_ids",
    "cache",
    "past_key_values",
    "use_cache",
    "logits_to_keep",
    "cache_position",
)


@dataclass
class _Options:
    """fastsample's arguments, carried through ``model.generate`` as one custom keyword."""

    seed: object = None
    draft_model: Any = None
    num_draft_tokens: int | None = None
    streamer: Any = None
    stages: dict[str, Any] = dataclasses.field(default_factory=dict)


def generate(
    model: Any,
    input_ids: Tensor | None = None,
    *,
    seed: int | list[int] | Tensor | None = None,
    assistant_model: Any = None,
    draft_model: Any = None,
    num_draft_tokens: int | None = None,
    **generate_kwargs: Any,
) -> Tensor | FastsampleGenerateOutput:
    """``model.generate`` with fastsample's sampling, per-request seeds and batched
    speculative decoding (see the module docstring).

    Args:
        model: a transformers causal LM (decoder-only).
        input_ids: ``(B, L)`` prompts, left-padded with an ``attention_mask`` for batches of
            different lengths.
        seed: one seed per prompt (list or int64 tensor), one int for every prompt, or None.
            The i-th of ``num_return_sequences`` copies of a prompt uses stream
            ``Stream.SAMPLE + i`` (speculative decoding: a seed derived from ``(seed, i)``).
        assistant_model, draft_model: a draft model sharing ``model``'s vocabulary (either
            name); turns on speculative decoding.
        num_draft_tokens: draft tokens per round (default 4).
        **generate_kwargs: anything ``model.generate`` takes: ``attention_mask``,
            ``generation_config``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``min_p``, ``max_new_tokens``, ``eos_token_id``, ``pad_token_id``,
            ``num_return_sequences``, ``logits_processor``, ``stopping_criteria``,
            ``streamer``, ``return_dict_in_generate``, ``output_scores``, ``typical_p``,
            ``epsilon_cutoff``, ``eta_cutoff``, ``no_repeat_ngram_size`` (transformers' own
            processor), ...; and fastsample's stages that transformers lacks
            (:data:`fastsample.hf.config.STAGE_KWARGS`: DRY, XTC, top-n-sigma, dynamic
            temperature, mirostat, ``penalty_last_n``, ``order``), with
            :class:`fastsample.StepParams`' names; the context they read is the prompt and
            the tokens drawn so far.

    Returns:
        The ``(B * num_return_sequences, L + new)`` sequences, or with
        ``return_dict_in_generate=True`` a :class:`FastsampleGenerateOutput`.
    """
    draft = assistant_model if assistant_model is not None else draft_model
    # fastsample's own stages never reach transformers (it would reject them as model inputs).
    stages = {k: generate_kwargs.pop(k) for k in STAGE_KWARGS if generate_kwargs.get(k) is not None}
    if _prepared_by_transformers(generate_kwargs):  # called as custom_generate
        options = _Options(seed, draft, num_draft_tokens, stages=stages)
        return _decode(model, input_ids, options, **generate_kwargs)
    options = _Options(seed, draft, num_draft_tokens, generate_kwargs.pop("streamer", None),
                       stages)  # fmt: skip
    # The options ride in a closure: transformers forwards no unknown keyword before 5.x.
    return model.generate(
        input_ids,
        custom_generate=functools.partial(_run_prepared, options=options),
        **generate_kwargs,
    )


def _prepared_by_transformers(kwargs: dict[str, Any]) -> bool:
    """Whether generate's preparation already ran: it passes these four, users do not."""
    return all(
        key in kwargs
        for key in ("logits_processor", "stopping_criteria", "generation_config", "use_cache")
    )


def _run_prepared(
    model: Any,
    input_ids: Tensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    *,
    options: _Options,
    **model_kwargs: Any,
) -> Tensor | FastsampleGenerateOutput:
    """The callable ``generate`` hands to ``model.generate(custom_generate=...)``."""
    return _decode(
        model,
        input_ids,
        options,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        generation_config=generation_config,
        **model_kwargs,
    )


def _decode(
    model: Any,
    input_ids: Tensor,
    options: _Options,
    *,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    streamer: Any = None,
    synced_gpus: Any = None,
    **model_kwargs: Any,
) -> Tensor | FastsampleGenerateOutput:
    """Run fastsample's loop on what transformers prepared.

    transformers 4.x hands a custom loop the ``streamer`` (after putting the prompt in it)
    and ``synced_gpus``; 5.x keeps both."""
    del synced_gpus  # one process: nothing to keep in step
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotImplementedError("fastsample.hf decodes decoder-only models")
    mask = model_kwargs.pop("attention_mask", None)
    if mask is None:
        mask = torch.ones_like(input_ids)
    for key in _PREPARED_INPUTS:
        value = model_kwargs.pop(key, None)
        if hasattr(value, "get_seq_length") and value.get_seq_length() > 0:
            raise NotImplementedError("fastsample.hf starts from an empty cache")
    extra = sorted(key for key, value in model_kwargs.items() if value is not None)
    if extra:
        raise NotImplementedError(f"fastsample.hf does not pass model inputs {extra}")
    if options.streamer is not None:  # ours: transformers never saw it, put the prompt
        options.streamer.put(input_ids.cpu())
    elif streamer is not None:  # transformers' (4.x): it has put the prompt already
        options = dataclasses.replace(options, streamer=streamer)
    copies = int(generation_config.num_return_sequences or 1)
    device = input_ids.device
    seeds = prompt_seeds(options.seed, input_ids.shape[0] // copies, device)
    row_seeds, copy_index = copy_seeds(seeds, copies)
    job = Prepared(
        input_ids=input_ids,
        attention_mask=mask.to(device),
        processors=without_config_warpers(logits_processor, generation_config),
        stopping=stopping_criteria,
        config=generation_config,
        controls=controls_from_config(generation_config),
        seeds=row_seeds,
        copy_index=copy_index,
        streamer=options.streamer,
        stages=options.stages,
    )
    if options.draft_model is None:
        return plain_generate(model, job)
    if job.needs_step:
        raise NotImplementedError(
            "fastsample.hf's speculative loop draws with temperature, top_k, top_p and min_p; "
            "typical_p, epsilon/eta cutoffs and fastsample's own stages run without a draft "
            "model for now"
        )
    return speculative_generate(model, options.draft_model, job, options.num_draft_tokens)
