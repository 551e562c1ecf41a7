"""The plain decoding loop: one model forward and one fastsample draw per new token.

It follows transformers' sampling loop step for step (processors on the float32 logits of
the last position, a token per row, finished rows padded, stopping criteria after each
token), with two differences:

* the draw is :func:`fastsample.sample` with the config's temperature/top-k/top-p/min-p
  instead of the warpers and ``torch.multinomial``, the same law without a sort; with a
  stage beyond those on (typical-p, epsilon, eta, or fastsample's DRY, XTC, top-n-sigma,
  dynamic temperature, mirostat, windowed penalties) it is :func:`fastsample.sample_step`
  with one :class:`fastsample.StepParams` for the whole call and a
  :class:`fastsample.TokenStats` holding each row's context (:class:`StepDraw`);
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
from ..stages import StepParams, TokenStats, process_step, sample_step
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


class StepDraw:
    """The draw through :func:`fastsample.sample_step` for a whole generate call: the
    parameters built once, the state (each row's context: its real prompt tokens, then what
    it drew; mirostat's ``mu``) updated after every token; finished rows add nothing."""

    def __init__(self, job: Prepared, vocab: int, stream: Tensor) -> None:
        batch = job.input_ids.shape[0]
        self.params = StepParams(
            batch, vocab, device=job.input_ids.device, seed=job.seeds, stream=stream,
            **{k: v for k, v in job.controls.step_kwargs().items() if v is not None},
            **_per_batch(job.stages, batch),
        )  # fmt: skip
        prompts = [ids[real].tolist() for ids, real in zip(job.input_ids, job.attention_mask.bool(),
                                                            strict=True)]  # fmt: skip
        width = job.input_ids.shape[1] + job.max_new_tokens
        self.state = TokenStats.from_prompts(prompts, vocab, device=job.input_ids.device,
                                             history=width)  # fmt: skip

    def __call__(self, scores: Tensor, positions: Tensor, unfinished: Tensor) -> Tensor:
        out = sample_step(scores, params=self.params, state=self.state, step=positions)
        token = out.token_ids[:, 0]
        emitted = torch.where(unfinished, token, -1)[:, None]
        self.state.update(emitted, probs=out.probs, params=self.params)
        return token

    def processed(self, scores: Tensor) -> Tensor:
        """The distribution the next draw samples from (before this step's update)."""
        return process_step(scores, self.params, state=self.state)


def _per_batch(stages: dict, batch: int) -> dict:
    """``generate``'s stage keywords as :class:`StepParams` takes them: one list of DRY
    sequence breakers for every row."""
    out = dict(stages)
    if "dry_sequence_breakers" in out:
        out["dry_sequence_breakers"] = [out["dry_sequence_breakers"]] * batch
    return out


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
    step_draw = StepDraw(job, logits.shape[-1], stream) if job.needs_step else None

    for _ in range(job.max_new_tokens):
        logits = logits.to(torch.float32)
        scores = job.processors(input_ids, logits.clone())
        if want_scores:  # what was sampled from, as log-probabilities (transformers' scores)
            if step_draw is not None:
                kept_scores.append(step_draw.processed(scores).log())
            else:
                kept_scores.append(process(scores, **job.controls.sample_kwargs()).log())
        if step_draw is not None:
            token = step_draw(scores, next_position, unfinished)
        else:
            token = choose_tokens(scores, job, next_position, stream)
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
