"""Model Runner V2's ``RejectionSampler``, verifying speculative drafts with
:func:`fastsample.verify_chain`.

MRV2's layout (``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py``): request ``b`` has
``n_b + 1`` consecutive logits rows (``cu_num_logits``); row ``j`` verifies draft ``j``, whose
token is the input token of row ``j + 1`` (vLLM's ``gather_draft_sampled``; ``-1`` marks a
placeholder: a draft the grammar rejected, or one proposed before the prefill ended), and row
``n_b`` is the bonus position. Draft logits, when the drafts were drawn (probabilistic
drafts), are kept per slot before temperature: ``(max_num_reqs, K, V)``; the draft drew from
``softmax(draft_logits / T)``, so those are the draft's probabilities (a greedy row's draft
is a point mass). The output is ``(B, K+1)`` tokens and ``num_sampled`` per request.

The mapping: every logits row is processed by the batch's stages (the plan of
:mod:`.mrv2_plan`, per row) with the drafts before it counted as emitted (penalties on vLLM's
own counts through the slot rows, min-tokens), as vLLM's ``apply_sampling_params`` does; the
drafts are verified with ``verify_chain`` keyed ``(seed, position)`` as on the V1 runner.
**Placeholder drafts:** a request's drafts end at its first ``-1``, which keeps the accepted
prefix, as vLLM's kernels reject a ``-1`` draft; that position is drawn from the target there,
or, for a drawn draft the grammar rejected (probabilistic drafts), from the residual
``max(p - q, 0)`` of its certain rejection (:func:`.rejection.residual_at_cuts`).

Left to vLLM's own code, with one warning each: synthetic acceptance rates, block
verification, adaptive verification, watermarking (and everything the sampler leaves to vLLM).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.output import SamplerOutput, SamplingMaskTensors
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

from ..ops import threads
from ..stages import process_step, staged_logits
from ..stages.state import mirostat_update
from ..verify import verify_chain
from .logprobs import from_full, raw_values
from .mrv2_sampler import FastsampleSamplerV2, _process_args, _warn_once, prefill_done
from .rejection import residual_at_cuts
from .state import CALLS, STATE


def unsupported_mode(rejection: RejectionSampler) -> str | None:
    """A verification mode of vLLM's that fastsample does not implement, or None."""
    if rejection.synthetic_conditional_rates is not None:
        return "synthetic acceptance rates"
    if rejection.use_block_verification:
        return "block verification"
    if rejection.enable_adaptive_verification:
        return "adaptive verification"
    if rejection.watermark_key is not None:
        return "watermarking"
    return None


def drafts_of_rows(input_batch, local: Tensor, prefill_len: Tensor) -> Tensor:
    """``(N,)`` int64: the input token of each logits row (for row ``j > 0`` of a request, the
    draft that row ``j - 1`` verifies), ``-1`` for a draft proposed before the request's
    prefill ended. vLLM's ``gather_draft_sampled`` in torch ops (its Triton kernel would run in
    Triton's interpreter on CPU)."""
    index = input_batch.logits_indices.to(torch.int64)
    token = input_batch.input_ids.index_select(0, index).to(torch.int64)
    pos = input_batch.positions.index_select(0, index).to(torch.int64)
    slots = input_batch.expanded_idx_mapping.to(torch.int64)
    prefill = prefill_len.index_select(0, slots).to(torch.int64)
    return torch.where((local > 0) & (pos - local < prefill), -1, token)


def chain_layout(cu: Tensor, local: Tensor, draft_sampled: Tensor, k: int):
    """From MRV2's flat rows: ``(prefixes (N, K), logit_rows (B, K+1), drafts (B, K),
    lengths (B,))``. ``prefixes[r]`` holds the drafts before row ``r`` (then -1); a request's
    drafts end at its first placeholder (``-1``); pad positions repeat the last row."""
    device = cu.device
    total = draft_sampled.shape[0]
    flat = torch.arange(total, device=device)
    slots = torch.arange(k, device=device)
    take = (flat - local)[:, None] + 1 + slots  # the rows holding the drafts before r
    prefixes = torch.where(slots < local[:, None],
                           draft_sampled[take.clamp_max(max(total - 1, 0))], -1)  # fmt: skip
    starts, counts = cu[:-1], cu[1:] - cu[:-1] - 1
    index = (starts[:, None] + 1 + slots).clamp_max(max(total - 1, 0))
    used = slots < counts[:, None]
    drafts = torch.where(used, draft_sampled[index], 0)
    placeholder = used & (drafts < 0)
    first = torch.where(placeholder, slots, k).amin(-1) if k else counts
    lengths = torch.minimum(counts, first)
    positions = torch.arange(k + 1, device=device)
    logit_rows = starts[:, None] + torch.minimum(positions, counts[:, None])
    return prefixes, logit_rows, drafts.clamp_min(0), lengths


def draft_probs(draft_logits: Tensor, slots: Tensor, temperature: Tensor, drafts: Tensor,
                vocab: int) -> Tensor:  # fmt: skip
    """``(B, K, V)``: ``softmax(draft_logits / T)`` of the requests' slots, a point mass at the
    draft for a greedy row (``T == 0``, where the draft was the argmax)."""
    k = drafts.shape[1]
    logits = draft_logits.index_select(0, slots)[:, :k].to(torch.float32)
    t = temperature.index_select(0, slots).to(torch.float32)
    probs = torch.softmax(logits / torch.where(t > 0, t, 1.0)[:, None, None], -1)
    if probs.shape[-1] < vocab:  # a draft vocabulary padded shorter than the target's
        probs = torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))
    probs = probs[..., :vocab]
    point = torch.nn.functional.one_hot(drafts, vocab).to(probs.dtype)
    return torch.where((t > 0)[:, None, None], probs, point)


class FastsampleRejectionSamplerV2(RejectionSampler):
    """MRV2's ``RejectionSampler`` whose ``__call__`` verifies with fastsample."""

    @threads.one_thread_calls  # the plugin's own passes too (fastsample.ops.threads)
    def __call__(self, logits: Tensor, input_batch, draft_logits: Tensor | None = None,
                 invalid_drafts: Tensor | None = None) -> SamplerOutput:  # fmt: skip
        sampler = self.sampler
        if STATE.delegate or not isinstance(sampler, FastsampleSamplerV2):
            CALLS["delegated"] += 1
            return super().__call__(logits, input_batch, draft_logits, invalid_drafts)
        reason = unsupported_mode(self) or sampler.plans.plan(
            input_batch, logits.shape[1], logits.device).unsupported
        if reason is not None:
            return self.hand_over(logits, input_batch, draft_logits, invalid_drafts,
                                  "unsupported " + reason, "fastsample's vLLM plugin leaves "
                                  "verification with %s to vLLM's own rejection sampler",
                                  reason)  # fmt: skip
        try:
            return self._verify_all(logits, input_batch, draft_logits, invalid_drafts)
        except Exception as exc:  # never take vLLM down: its own code verifies this step
            name = type(exc).__name__
            return self.hand_over(logits, input_batch, draft_logits, invalid_drafts,
                                  "error " + name, "fastsample's vLLM plugin failed a step "
                                  "(%s: %s); vLLM's own rejection sampler verified it", name,
                                  exc)  # fmt: skip

    def hand_over(self, logits, input_batch, draft_logits, invalid_drafts, key: str,
                  message: str, *args) -> SamplerOutput:  # fmt: skip
        _warn_once(key, message, *args)
        CALLS["delegated"] += 1
        return super().__call__(logits, input_batch, draft_logits, invalid_drafts)

    def _verify_all(self, logits: Tensor, input_batch, draft_logits: Tensor | None,
                    invalid_drafts: Tensor | None) -> SamplerOutput:  # fmt: skip
        CALLS["verify"] += 1
        sampler: FastsampleSamplerV2 = self.sampler
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        local = input_batch.expanded_local_pos.to(torch.int64)
        draft_sampled = drafts_of_rows(input_batch, local, sampler.req_states.prefill_len.gpu)
        verified = draft_sampled
        if invalid_drafts is not None:  # the grammar rejected these drafts: placeholders
            verified = draft_sampled.masked_fill(invalid_drafts, -1)
        plan, rows, positions = sampler.step_inputs(input_batch, logits)
        k = self.num_speculative_steps
        cu = input_batch.cu_num_logits.to(torch.int64)
        _, logit_rows, drafts, lengths = chain_layout(cu, local, verified, k)
        # The stages see the real draft ids before each row, as vLLM's processors do.
        extra, _, _, _ = chain_layout(cu, local, draft_sampled, k)
        slots = input_batch.idx_mapping.to(torch.int64)
        first = positions.index_select(0, cu[:-1])  # each request's position (emitted so far)
        if plan.needs_state:  # the history: each request's committed context (drafts: extra)
            context = sampler.history_context(plan, input_batch, cu[:-1])
            state = sampler.plans.slot_stats.current(slots, first, context)
            where = dict(state=state, state_rows=rows)
        else:  # min-tokens read each row's length: the request's, plus its drafts (extra)
            needed = plan.params.stop_ids is not None
            where = dict(output_len=first.index_select(0, _request_of(cu, local)) if needed
                         else None)  # fmt: skip
        args = _process_args(where)
        if plan.mirostat:
            start = where["state"].mirostat_mu.index_select(0, rows)
            probs = _with_mirostat(logits, plan.params, extra, args, local, draft_sampled, start,
                                   k)  # fmt: skip
        else:
            probs = process_step(logits, plan.params, extra=extra, **args)
        target = probs[logit_rows]
        q = None
        if draft_logits is not None and k:
            q = draft_probs(draft_logits, slots, sampler.sampling_states.temperature.gpu, drafts,
                            logits.shape[1])  # fmt: skip
            # A drawn draft the grammar rejected is a certain rejection: the residual there.
            target = residual_at_cuts(target, q, lengths, cu[1:] - cu[:-1] - 1)
        seeds = plan.params.seed.index_select(0, cu[:-1])
        out = verify_chain(target, drafts, q, draft_lengths=lengths, seed=seeds, step=first)
        tokens = out.token_ids
        # A row with bad values emits nothing in verify_chain; vLLM expects a token from every
        # request (its sampler's policy: token 0).
        tokens[:, 0] = torch.where(out.valid, tokens[:, 0], 0)
        emitted = out.num_emitted.clamp_min(1).to(torch.int32)
        if plan.penalties:
            sampler.plans.slot_stats.emitted(slots, tokens)
        if plan.mirostat:  # mu moves by each emitted token at its position (none in a prefill)
            done = prefill_done(plan, input_batch)[:, None]
            ids = torch.where(done, tokens, -1)
            at = probs[logit_rows].gather(2, ids.clamp_min(0)[..., None])[..., 0]
            tau, eta = (_of_rows(getattr(plan.params, name), cu[:-1])
                        for name in ("mirostat_tau", "mirostat_eta"))  # fmt: skip
            sampler.plans.slot_stats.moved_mu(slots, ids, at, tau, eta)
        num_sampled, num_rejected = sampler.sampled_and_rejected(plan, input_batch, emitted)
        logprobs = None
        wanted = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
        if wanted >= 0:
            flat_tokens = _flat_sampled(tokens, cu, local)
            logprobs = self._logprobs(logits, probs, plan, flat_tokens, wanted, where,
                                      extra, input_batch)  # fmt: skip
        mask = None
        if sampler.return_sampling_mask:
            kept = int(np.max(sampler.sampling_states.top_k.np[input_batch.idx_mapping_np]))
            mask = SamplingMaskTensors.from_logits(
                torch.where(probs > 0, 0.0, -math.inf), input_batch.cu_num_logits, num_sampled,
                kept, k + 1,
            )  # fmt: skip
        return SamplerOutput(
            sampled_token_ids=tokens, logprobs_tensors=logprobs, num_nans=num_nans,
            num_sampled=num_sampled, num_rejected=num_rejected, sampling_mask_tensors=mask,
        )  # fmt: skip

    def _logprobs(self, logits, probs, plan, flat_tokens, num, where, extra, input_batch):
        """Every logits row's logprobs in the sampler's mode, at the token emitted there (0
        where none was): vLLM's layout, with the requests' row counts."""
        mode = self.sampler.logprobs_mode
        if mode == "processed_logprobs":
            values = probs.to(torch.float32).log()
        elif mode == "processed_logits":  # the drafts before a row count as output
            staged = staged_logits(logits, plan.params, extra=extra, **where)
            t = plan.params.controls.temperature
            if isinstance(t, Tensor):
                staged = staged / torch.where(t > 0, t, 1.0)[:, None]
            elif t:
                staged = staged / float(t)
            values = torch.where(probs > 0, staged.to(torch.float32), -math.inf)
        else:
            values = raw_values(logits, None, mode)
        out = from_full(values, flat_tokens, num, None)
        cu = input_batch.cu_num_logits_np
        expanded = logits.shape[0] != input_batch.num_reqs
        return out._replace(logprob_token_ids=out.logprob_token_ids.to(torch.int64),
                            cu_num_generated_tokens=cu.tolist() if expanded else None)


def _with_mirostat(logits: Tensor, params, extra: Tensor, args: dict, local: Tensor,
                   leading: Tensor, start: Tensor, k: int) -> Tensor:  # fmt: skip
    """The flat rows' distributions with mirostat: row ``r`` past a request's first takes the
    ``mu`` of row ``r - 1`` moved by its input token (the draft row ``r - 1`` verifies) at row
    ``r - 1``'s probability. One pass per draft position, each over every row (the rows of
    position ``j`` are right once position ``j - 1``'s are)."""
    prev = (torch.arange(logits.shape[0], device=logits.device) - 1).clamp_min(0)
    token = torch.where(local > 0, leading, -1)[:, None]
    mu = start
    probs = process_step(logits, params, extra=extra, mirostat_mu=mu, **args)
    for j in range(1, k + 1):
        at = probs.index_select(0, prev).gather(1, token.clamp_min(0))
        moved = mirostat_update(mu.index_select(0, prev), token, at, params.mirostat_tau,
                                params.mirostat_eta, logits.shape[1])  # fmt: skip
        mu = torch.where(local == j, moved, mu)
        probs = process_step(logits, params, extra=extra, mirostat_mu=mu, **args)
    return probs


def _of_rows(value, rows: Tensor):
    """A setting (a number, or a tensor of the flat rows) at ``rows``."""
    return value.index_select(0, rows) if isinstance(value, Tensor) else value


def _request_of(cu: Tensor, local: Tensor) -> Tensor:
    """``(N,)``: the request of each flat logits row."""
    flat = torch.arange(local.shape[0], device=local.device)
    return torch.searchsorted(cu[1:], flat, right=True)


def _flat_sampled(tokens: Tensor, cu: Tensor, local: Tensor) -> Tensor:
    """``(N,)``: the token emitted at each flat logits row (0 where none was)."""
    request = _request_of(cu, local)
    token = tokens[request, local.clamp_max(tokens.shape[1] - 1)]
    return token.clamp_min(0)
