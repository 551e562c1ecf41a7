"""vLLM's ``SamplingMetadata`` for a batch of requests, built as vLLM 0.32's runner builds it.

``python -m fastsample bench --engine vllm`` and the plugin's tests drive vLLM's ``Sampler``
(and fastsample's replacement) outside an engine with it. :func:`sampling_metadata` turns
per-request :class:`Request` settings into real ``SamplingParams`` (so vLLM's own
normalisation applies: greedy below ``T = 1e-5``, 0 < T < 0.01 raised to 0.01, a greedy
request's top-k/top-p/min-p switched off) and fills the metadata the way the persistent input
batch does (``vllm/v1/worker/gpu_input_batch.py``, ``add_request`` and
``_make_sampling_metadata``):

* ``temperature`` 0.0 for greedy rows, None when every row is greedy; ``top_k`` holds ``V``
  unless ``0 < k < V`` and is None when no row cuts, likewise ``top_p``;
* a seeded random request gets its own ``torch.Generator`` seeded once;
* the three penalty tensors always; ``prompt_token_ids`` (padded with ``V``) and the live
  ``output_token_ids`` lists only when a row has a penalty;
* ``allowed_token_ids_mask`` True where masked; ``max_num_logprobs`` the largest request's;
* the built-in logits processors (min-tokens, logit bias, min-p), each told about the added
  rows with one ``BatchUpdate``.

Nothing is imported from vLLM until a function is called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch


@dataclass
class Request:
    """One request's settings, as ``SamplingParams`` takes them, and its tokens so far."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)

    def sampling_params(self):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, seed=self.seed, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            logprobs=self.logprobs, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, max_tokens=max(self.min_tokens, 16),
        )  # fmt: skip


def sampling_metadata(requests: list[Request], vocab: int, logprob_token_ids=None):
    """vLLM's ``SamplingMetadata`` for ``requests`` (one row each) over ``vocab`` tokens.

    The metadata holds live objects, like the runner's: the rows' generators advance as vLLM
    draws, and ``output_token_ids`` are the requests' own ``output`` lists (append to them
    between steps, as the runner does).
    """
    from vllm.sampling_params import SamplingType
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.metadata import SamplingMetadata

    batch = len(requests)
    params = [r.sampling_params() for r in requests]
    greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    temperature = torch.tensor(
        [0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
        dtype=torch.float32,
    )
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         dtype=torch.int32)  # fmt: skip
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    penalized = [
        p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        for p in params
    ]
    generators = {
        row: torch.Generator().manual_seed(p.seed)
        for row, p in enumerate(params)
        if p.sampling_type == SamplingType.RANDOM_SEED
    }
    logprobs = [vocab if p.logprobs == -1 else p.logprobs for p in params if p.logprobs is not None]
    allowed = None
    if any(p.allowed_token_ids for p in params):
        allowed = torch.zeros(batch, vocab, dtype=torch.bool)
        for row, p in enumerate(params):
            if p.allowed_token_ids:
                allowed[row] = True
                allowed[row, p.allowed_token_ids] = False
    prompts = None
    if any(penalized):
        width = max(1, max(len(r.prompt) for r in requests))
        prompts = torch.full((batch, width), vocab, dtype=torch.int64)
        for row, r in enumerate(requests):
            if r.prompt:
                prompts[row, : len(r.prompt)] = torch.tensor(r.prompt)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=batch))
    device = torch.device("cpu")
    processors = [
        MinTokensLogitsProcessor(config, device, False),
        LogitBiasLogitsProcessor(config, device, False),
        MinPLogitsProcessor(config, device, False),
    ]
    added = [
        (row, p, r.prompt, r.output)
        for row, (p, r) in enumerate(zip(params, requests, strict=True))
    ]
    for processor in processors:
        processor.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
    all_greedy, all_random = all(greedy), not any(greedy)
    return SamplingMetadata(
        temperature=None if all_greedy else temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=top_p if any(p.top_p < 1 for p in params) else None,
        top_k=top_k if any(0 < p.top_k < vocab for p in params) else None,
        generators=generators,
        max_num_logprobs=max(logprobs) if logprobs else None,
        no_penalties=not any(penalized),
        prompt_token_ids=prompts,
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params]),
        presence_penalties=torch.tensor([p.presence_penalty for p in params]),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params]),
        output_token_ids=[r.output for r in requests] if any(penalized) else [],
        allowed_token_ids_mask=allowed,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(processors),
        logprob_token_ids=logprob_token_ids,
        spec_token_ids=[[] for _ in requests],
        thinking_budget_state_holder=None,
    )
