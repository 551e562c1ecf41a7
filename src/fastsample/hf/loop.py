"""The plain decoding loop: one model forward and one fastsample draw per new token.

It follows transformers' sampling loop step for step (processors on the float32 logits of
the last position, a token per row, finished rows padded, stopping criteria after each
token), with two differences:

* the draw is :func:`fastsample.sample` with the config's temperature/top-k/top-p/min-p
  instead of the warpers and ``torch.multinomial``, the same law without a sort;
* randomness is per request: row ``b`` draws with ``seed[b]``, ``step`` = the position of
  the token it draws (its count of real tokens before it) and ``stream`` =
  ``Stream.SAMPLE + i`` for the i-th returned sequence of its prompt. So a request's token
  depends on its own logits, seed and position only, never on its batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..controls import process
from ..ops.seeds import Stream
from ..sampling import sample
from .cache import CachedModel, prompt_positions
from .config import Prepared
from .output import FastsampleGenerateOutput, finish


def choose_tokens(scores: Tensor, job: Prepared, positions: Tensor, stream: Tensor) -> Tensor:
    """``(B,)`` next tokens from processed ``scores (B, V)``: greedy or a seeded draw."""
    if job.controls.greedy:
        # fastsample's greedy is the first maximal index too; argmax skips the other work.
        return scores.argmax(-1)
    drawn = sample(
        scores, **job.controls.sample_kwargs(), seed=job.seeds, step=positions, stream=stream
    )
    return drawn.token_ids[:, 0]


@torch.no_grad()
def plain_generate(model: object, job: Prepared) -> Tensor | FastsampleGenerateOutput:
    """Decode ``job`` with ``model`` alone; returns what transformers' generate returns."""
    input_ids, mask = job.input_ids, job.attention_mask
    batch, _ = input_ids.shape
    device = input_ids.device
    stream = Stream.SAMPLE + job.copy_index
    runner = CachedModel(model, batch, device)
    logits = runner(input_ids, mask.bool(), prompt_positions(mask), last_only=True)[:, -1]
    next_position = mask.long().sum(-1)  # real tokens so far = position of the next token
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    pads_finished = any(hasattr(c, "eos_token_id") for c in job.stopping)
    want_scores = job.config.return_dict_in_generate and job.config.output_scores
    want_logits = job.config.return_dict_in_generate and job.config.output_logits
    kept_scores: list[Tensor] = []
    kept_logits: list[Tensor] = []
    ones = torch.ones(batch, 1, dtype=torch.bool, device=device)

    for _ in range(job.max_new_tokens):
        logits = logits.to(torch.float32)
        scores = job.processors(input_ids, logits.clone())
        token = choose_tokens(scores, job, next_position, stream)
        if want_scores:  # what was sampled from, as log-probabilities (transformers' scores)
            kept_scores.append(process(scores, **job.controls.sample_kwargs()).log())
        if want_logits:
            kept_logits.append(logits)
        if pads_finished:
            token = torch.where(unfinished, token, job.pad_token)
        input_ids = torch.cat((input_ids, token[:, None]), dim=-1)
        if job.streamer is not None:
            job.streamer.put(token.cpu())
        unfinished = unfinished & ~job.stopping(input_ids, scores).to(device)
        if not bool(unfinished.any()):  # one host read per token, as in transformers
            break
        logits = runner(token[:, None], ones, next_position[:, None], last_only=True)[:, -1]
        next_position = next_position + 1

    if job.streamer is not None:
        job.streamer.end()
    return finish(
        job.config,
        input_ids,
        scores=tuple(kept_scores) if want_scores else None,
        logits=tuple(kept_logits) if want_logits else None,
    )
