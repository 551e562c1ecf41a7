"""Speculative decoding with a draft model, for any batch size, exact in distribution.

Each round, for every row at once:

1. the draft model proposes ``K`` tokens, each drawn with fastsample from the draft's
   processed distribution ``q`` (same processors and controls as the target; seed stream
   ``Stream.DRAFT``, step = the drafted token's position);
2. the target scores the row's last token and the ``K`` drafts in one forward pass, giving
   ``K + 1`` processed distributions ``p``;
3. :func:`fastsample.verify_chain` accepts a prefix of the drafts and emits one more token
   (recovery or bonus), so each row emits ``a + 1`` tokens, ``0 <= a <= K``, distributed
   exactly as sampling from the target alone (step = position of the first draft).

Rows accept different numbers of tokens. The caches stay rectangular: every drafted token
was written into both caches, and the rejected ones are masked out afterwards
(:class:`~fastsample.hf.cache.CachedModel`). Position ids count real tokens only, so what
follows a hole is computed exactly as if the hole were not there. Bookkeeping per row:

* the target has cached everything but the row's last emitted token, which opens the next
  round's target input ``[last, x_0 .. x_{K-1}]``;
* the draft has cached everything but the last token too, and when all ``K`` drafts were
  accepted also the last draft ``x_{K-1}`` (it drafted it but never fed it back); its next
  input is ``[x_{K-1} or a hole, last]``, two columns for every row.

Stopping: a row stops after ``max_new_tokens`` tokens or at an EOS token (anything the round
emitted after it is dropped); other stopping criteria are checked per row after each round.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..controls import process
from ..ops.seeds import Stream
from ..sampling import sample_from_probs
from ..verify import verify_chain
from .cache import CachedModel, prompt_positions
from .config import Prepared, mixed_copy_seeds
from .output import FastsampleGenerateOutput, finish

DEFAULT_DRAFT_TOKENS = 4


class RowTokens:
    """Each row's tokens so far, rows of different lengths, in one padded buffer."""

    def __init__(self, prompt: Tensor, pad: int, room: int) -> None:
        batch, length = prompt.shape
        self.prompt_length = length
        self.pad = pad
        self.buffer = torch.full(
            (batch, length + room), pad, dtype=prompt.dtype, device=prompt.device
        )
        self.buffer[:, :length] = prompt
        self.generated = torch.zeros(batch, dtype=torch.long, device=prompt.device)

    def append(self, tokens: Tensor, counts: Tensor) -> None:
        """Append the first ``counts[b]`` of ``tokens[b]`` to row ``b``."""
        width = tokens.shape[1]
        columns = self.prompt_length + self.generated[:, None] + torch.arange(
            width, device=tokens.device
        )
        keep = torch.arange(width, device=tokens.device) < counts[:, None]
        columns = columns.clamp_max(self.buffer.shape[1] - 1)
        current = self.buffer.gather(1, columns)
        self.buffer.scatter_(1, columns, torch.where(keep, tokens, current))
        self.generated = self.generated + counts

    def row(self, b: int) -> Tensor:
        """Row ``b``'s sequence so far (its prompt with the batch's left padding, then its
        tokens): what the plain loop would hand the logits processors for this request."""
        return self.buffer[b, : self.prompt_length + int(self.generated[b])]

    def sequences(self) -> Tensor:
        """The output layout: prompts, then each row's tokens, padded on the right."""
        return self.buffer[:, : self.prompt_length + int(self.generated.max())]


def processed(
    logits: Tensor, job: Prepared, rows: RowTokens | None, drafts: list[Tensor]
) -> Tensor:
    """The distribution sampled from after each row's tokens + ``drafts``: processors, then
    fastsample's controls, as in the plain loop. ``(B, V)`` float32 probabilities.

    Processors expect every row at the same length, and some keep per-row state shaped by
    the batch (repetition penalty's prompt lengths), so they run on the whole batch once per
    distinct row length ``n``, on ``tokens[:, :n] + drafts``; each row keeps the result of
    the call made at its own length, where it sees exactly the sequence the plain loop would
    show it (``rows=None``: no processors)."""
    scores = logits.to(torch.float32)
    if rows is not None:
        lengths = rows.prompt_length + rows.generated
        result = scores
        for length in sorted(set(lengths.tolist())):
            context = torch.cat((rows.buffer[:, :length], *[d[:, None] for d in drafts]), 1)
            mine = job.processors(context, scores.clone())
            result = torch.where((lengths == length)[:, None], mine, result)
        scores = result
    return process(scores, **job.controls.sample_kwargs())


def _has_max_length_or_eos(criterion: Any) -> bool:
    return hasattr(criterion, "max_length") or hasattr(criterion, "eos_token_id")


@torch.no_grad()
def speculative_generate(
    model: Any, draft_model: Any, job: Prepared, num_draft_tokens: int | None = None
) -> Tensor | FastsampleGenerateOutput:
    """Decode ``job`` with ``model`` verifying ``draft_model``'s proposals (see module doc)."""
    k = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else int(num_draft_tokens)
    if k < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {k}")
    input_ids, mask = job.input_ids, job.attention_mask
    batch, length = input_ids.shape
    device = input_ids.device
    seeds = mixed_copy_seeds(job.seeds, job.copy_index)
    eos = job.eos_tokens
    budget = job.max_new_tokens
    other_criteria = [c for c in job.stopping if not _has_max_length_or_eos(c)]
    rows = RowTokens(input_ids, job.pad_token, budget + k + 1)
    target = CachedModel(model, batch, device)
    draft = CachedModel(draft_model, batch, device)
    if not (target.takes_positions and draft.takes_positions):
        raise NotImplementedError(
            "speculative decoding masks rejected drafts in the cache and needs models that "
            "take position_ids (their positions must skip the masked entries)"
        )

    positions = prompt_positions(mask)
    if length > 1:  # both models cache the prompt but its last token
        target(input_ids[:, :-1], mask[:, :-1].bool(), positions[:, :-1], last_only=True)
        draft(input_ids[:, :-1], mask[:, :-1].bool(), positions[:, :-1], last_only=True)
    last = input_ids[:, -1]
    count = mask.long().sum(-1)  # real tokens so far, `last` included
    held_draft: Tensor | None = None  # x_{K-1} when the draft has not cached it, else a hole
    held_valid = torch.zeros(batch, dtype=torch.bool, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    num_drafted = torch.zeros(batch, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    columns = torch.arange(k + 1, device=device)
    if budget == 0:
        done[:] = True

    while not bool(done.all()):
        history = rows if len(job.processors) > 0 else None
        # 1. Draft K tokens.
        if held_draft is None:  # first round: the draft only lacks `last`
            feed, feed_pos = last[:, None], (count - 1)[:, None]
            valid = torch.ones_like(feed, dtype=torch.bool)
        else:
            feed = torch.stack((held_draft, last), dim=1)
            valid = torch.stack((held_valid, torch.ones_like(held_valid)), dim=1)
            feed_pos = torch.stack(((count - 2).clamp_min(0), count - 1), dim=1)
        draft_logits = draft(feed, valid, feed_pos, last_only=True)[:, -1]
        drafts: list[Tensor] = []
        draft_probs: list[Tensor] = []
        for i in range(k):
            q = processed(draft_logits, job, history, drafts)
            token = sample_from_probs(q, seed=seeds, step=count + i, stream=Stream.DRAFT)
            drafts.append(token.token_ids[:, 0])
            draft_probs.append(q)
            if i < k - 1:
                draft_logits = draft(
                    drafts[-1][:, None], valid[:, -1:], (count + i)[:, None], last_only=True
                )[:, -1]
        drafted = torch.stack(drafts, dim=1)

        # 2. One target pass over [last, x_0 .. x_{K-1}].
        target_feed = torch.cat((last[:, None], drafted), dim=1)
        target_valid = torch.ones_like(target_feed, dtype=torch.bool)
        target_logits = target(target_feed, target_valid, (count - 1)[:, None] + columns)
        vocab = target_logits.shape[-1]
        if history is None:  # no processors: one call for all K+1 positions
            flat = target_logits.reshape(batch * (k + 1), vocab).to(torch.float32)
            target_probs = process(flat, **job.controls.sample_kwargs()).view(batch, k + 1, vocab)
        else:  # processors read the context, which differs per position
            target_probs = torch.stack(
                [processed(target_logits[:, i], job, history, drafts[:i]) for i in range(k + 1)],
                dim=1,
            )
        q_all = torch.stack(draft_probs, dim=1)
        if q_all.shape[-1] != vocab:
            raise ValueError(
                f"the draft model has {q_all.shape[-1]} logits per token, the target {vocab}: "
                "they must share the vocabulary"
            )

        # 3. Verify; keep the accepted drafts in both caches, mask the rest.
        verdict = verify_chain(target_probs, drafted, q_all, seed=seeds, step=count)
        accepted = verdict.num_accepted
        target.mask_columns(k, columns[:k] < accepted[:, None])
        draft.mask_columns(k - 1, columns[: k - 1] < accepted[:, None])
        held_draft, held_valid = drafted[:, -1], accepted == k
        emitted = verdict.token_ids
        last = emitted.gather(1, accepted[:, None])[:, 0]

        # 4. Record what each unfinished row emitted, up to its budget and first EOS.
        take = torch.minimum(accepted + 1, budget - rows.generated)
        if eos is not None:
            is_eos = torch.isin(emitted, eos) & (columns < take[:, None])
            hit = is_eos.any(-1)
            take = torch.where(hit, is_eos.long().argmax(-1) + 1, take)
            finished_by_eos = hit
        else:
            finished_by_eos = torch.zeros_like(done)
        take = torch.where(done, 0, take)
        live = ~done
        num_drafted = num_drafted + torch.where(live, k, 0)
        num_accepted = num_accepted + torch.where(live, accepted, 0)
        rows.append(emitted.clamp_min(0), take)
        if job.streamer is not None and batch == 1 and int(take[0]) > 0:
            job.streamer.put(emitted[0, : int(take[0])].cpu())
        done = done | finished_by_eos | (rows.generated >= budget)
        for criterion in other_criteria:  # per row: each row's sequence has its own length
            for b in torch.nonzero(~done).flatten().tolist():
                if bool(torch.as_tensor(criterion(rows.row(b)[None], None)).any()):
                    done[b] = True
        count = count + accepted + 1

    if job.streamer is not None:
        job.streamer.end()
    return finish(
        job.config, rows.sequences(), num_drafted=num_drafted, num_accepted=num_accepted
    )
