"""vLLM's ``RejectionSampler``, verifying speculative drafts with :func:`fastsample.verify_chain`.

vLLM's layout (``SpecDecodeMetadata``, ``vllm/v1/spec_decode/metadata.py``): request ``b``
proposed ``n_b = num_draft_tokens[b]`` drafts (ragged, 0 included: every step of a runner with
a speculative config comes here, prefill too), flattened in ``draft_token_ids``; the logits
hold, per request, its ``n_b`` target rows (``target_logits_indices``) and one bonus row
(``bonus_logits_indices``); ``draft_probs`` (``(sum n_b, V)``) come only from a draft model
with ``draft_sample_method="probabilistic"``: the distributions the drafts were drawn from.

The mapping: ``K = max_spec_len``; the target logits become ``(B, K+1, V)`` with position
``n_b`` the bonus row (later positions are padding, never read), the drafts ``(B, K)``,
``draft_lengths = n_b`` (cut at a placeholder draft, below). Position ``j`` of request ``b``
is processed by the batch's :class:`~fastsample.StepParams` and
:class:`~fastsample.TokenStats` with the drafts before it counted as emitted (penalties,
min-tokens), as vLLM's rejection sampler counts them, and masked by its grammar bitmask row;
the drafts are verified against those distributions with ``draft_probs`` when vLLM has them
(an all-greedy batch's ``draft_probs`` are logits in vLLM 0.32, and greedy drafts are point
masses anyway) and as point masses otherwise (n-gram, greedy drafts): exact for any proposer.
Keys ``(seed, position)`` as in sampling, on verification's own streams. The result is vLLM's:
int32 ``(B, K+1)``, the emitted tokens left-aligned (accepted drafts, then the recovered or
bonus token), ``-1`` after them, and the logprobs of every slot in vLLM's layout (the runner
drops the ``-1`` slots).

Placeholder drafts: with structured outputs vLLM cuts a request's drafts at the first one its
grammar rejects and pads the rest with ``-1`` (``PLACEHOLDER_TOKEN_ID``, the count unchanged);
its rejection sampler keeps the drafts accepted before a ``-1``, rejects the ``-1`` outright and
emits a token at its position (greedy: the target's argmax). Exactly, position ``L`` of the
first ``-1`` holds a discarded draft ``x ~ q_L`` with ``p_L(x) = 0`` (the grammar's row at that
position masks it), a certain rejection, so the token there follows the residual
``norm(max(p_L - q_L, 0))``; for a point-mass draft (no ``draft_probs``) that is ``p_L`` itself,
``x`` having no mass. So ``draft_lengths`` is cut at ``L``, position ``L`` (the target's logits
and grammar rows there) is the bonus position, and where ``draft_probs`` exist its
distribution is replaced by that residual (``p_L`` if the residual has no mass, as in
:func:`~fastsample.verify_chain`).

Synthetic acceptance (``rejection_sample_method="synthetic"``, for benchmarking: drafts are
accepted at given rates, not verified) is vLLM's own code: such a sampler hands every step to
its base class, with one warning.

vLLM refuses ``min_p`` and ``logit_bias`` with speculative decoding (``SamplingParams``
validation, and no such processors are built); that stays so.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.rejection_sampler import RejectionSampler

from ..ops import threads
from ..stages import TokenStats, staged_logits
from ..verify import verify_chain
from ..verify.targets import chain_prefixes, processed_positions
from . import _warn_once, grammar
from .logprobs import from_full, raw_values
from .plan import Plan, thinking_budget_active
from .sampler import FastsampleSampler
from .state import CALLS, STATE


def layout(metadata, counts: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(logit_rows (B, K+1), draft_rows (B, K))``: the logits row of each position (padding
    positions repeat the bonus row) and the flat draft index of each draft slot (clamped)."""
    k = metadata.max_spec_len
    batch = counts.shape[0]
    target_index = metadata.target_logits_indices.to(device=device, dtype=torch.int64)
    bonus_index = metadata.bonus_logits_indices.to(device=device, dtype=torch.int64)
    ends = metadata.cu_num_draft_tokens.to(device=device, dtype=torch.int64)
    starts = ends - counts
    slots = torch.arange(k + 1, device=device)
    flat = (starts[:, None] + slots).clamp(0, max(target_index.numel() - 1, 0))
    if target_index.numel():
        logit_rows = torch.where(slots < counts[:, None], target_index[flat], bonus_index[:, None])
    else:
        logit_rows = bonus_index[:, None].expand(batch, k + 1)
    return logit_rows, flat[:, :k]


def residual_at_cuts(probs: Tensor, q: Tensor, lengths: Tensor, counts: Tensor) -> Tensor:
    """``probs`` (``(B, K+1, V)``) with position ``L_b = lengths[b]`` of every request whose
    drafts a placeholder cut (``L_b < counts[b]``) replaced by ``max(p - q, 0)`` there (``p``
    where that has no mass): the law after a certain rejection of a draft drawn from ``q``
    (module docstring). A copy: the processed logprobs still read ``probs``."""
    batch, slots, _ = probs.shape
    rows = torch.arange(batch, device=probs.device)
    p = probs[rows, lengths]
    residual = (p - q[rows, lengths.clamp_max(slots - 2)]).clamp_min(0).to(probs.dtype)
    take = (lengths < counts) & (residual.sum(-1) > 0)
    out = probs.clone()
    out[rows, lengths] = torch.where(take[:, None], residual, p)
    return out


class FastsampleRejectionSampler(RejectionSampler):
    """vLLM's ``RejectionSampler`` whose ``forward`` verifies with fastsample."""

    @threads.one_thread_calls  # the plugin's own passes too (fastsample.ops.threads)
    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        sampler = self.sampler
        if STATE.delegate or not isinstance(sampler, FastsampleSampler):
            return self.vllm_forward(metadata, draft_probs, logits, sampling_metadata)
        if self.synthetic_mode:  # acceptance at set rates, no verification: vLLM's own code
            _warn_once(
                "synthetic", "fastsample's vLLM plugin leaves synthetic acceptance "
                "(rejection_sample_method='synthetic') to vLLM's own rejection sampler",
            )  # fmt: skip
            return self.vllm_forward(metadata, draft_probs, logits, sampling_metadata)
        batch = len(metadata.num_draft_tokens)
        plan = sampler.plan_for(sampling_metadata, logits, batch, verify=True)
        if plan.unsupported is not None or thinking_budget_active(sampling_metadata):
            return self.vllm_forward(metadata, draft_probs, logits, sampling_metadata)
        words = grammar.take(logits)
        try:
            return self._verify(metadata, draft_probs, logits, sampling_metadata, plan, words)
        except Exception as exc:  # never take vLLM down: its own code verifies this step
            sampler.hand_back(exc, logits, words, "rejection sampler verified it")
            return super().forward(metadata, draft_probs, logits, sampling_metadata)

    def _verify(self, metadata, draft_probs, logits, sampling_metadata, plan: Plan,
                words: Tensor | None) -> SamplerOutput:  # fmt: skip
        """One verification with fastsample: ``verify_chain``, the state's update, vLLM's
        output."""
        CALLS["verify"] += 1
        device = logits.device
        positions = plan.positions()
        counts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64).to(device)
        logit_rows, draft_rows = layout(metadata, counts, device)
        k = metadata.max_spec_len
        used = torch.arange(k, device=device) < counts[:, None]
        flat_drafts = metadata.draft_token_ids.to(device=device, dtype=torch.int64)
        drafts = flat_drafts[draft_rows] if flat_drafts.numel() else draft_rows.clone()
        # A request's drafts end at its first placeholder (-1); its position keeps the target
        # row and becomes the bonus position (module docstring). Sync-free: a prefix mask.
        used = (used & (drafts >= 0)).long().cumprod(dim=1).bool()
        lengths = used.sum(-1)
        drafts = torch.where(used, drafts, 0)
        target = logits[logit_rows]  # (B, K+1, V)
        bitmask = None if words is None else words[logit_rows]
        prefixes = chain_prefixes(torch.where(used, drafts, -1))
        params = plan.params
        assert params is not None
        probs = processed_positions(target, prefixes, params, plan.stats, bitmask)
        q = None
        if draft_probs is not None and k and not sampling_metadata.all_greedy:
            q = draft_probs[draft_rows]
        chain = probs if q is None else residual_at_cuts(probs, q, lengths, counts)
        out = verify_chain(chain, drafts, q, draft_lengths=lengths, seed=plan.keys,
                           step=positions)  # fmt: skip
        tokens = out.token_ids
        # A row with bad values emits nothing in verify_chain; vLLM expects a token from
        # every row (its sampler's policy: token 0).
        tokens[:, 0] = torch.where(out.valid, tokens[:, 0], 0)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(plan, sampling_metadata.max_num_logprobs, tokens, target,
                                      probs, prefixes, bitmask, positions)  # fmt: skip
        if plan.stats is not None:  # probs: mirostat's mu moves by each token at its position
            plan.stats.update(tokens, probs=probs, params=params)
        plan.emitted((tokens >= 0).sum(-1).cpu().numpy())
        return SamplerOutput(sampled_token_ids=tokens.to(torch.int32), logprobs_tensors=logprobs)

    def vllm_forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        """vLLM's own ``forward``, after the grammar bitmask it would have had."""
        CALLS["delegated"] += 1
        grammar.apply(logits)
        return super().forward(metadata, draft_probs, logits, sampling_metadata)

    def _logprobs(
        self, plan: Plan, num: int, tokens: Tensor, target: Tensor, probs: Tensor,
        prefixes: Tensor, bitmask: Tensor | None, positions: Tensor,
    ) -> LogprobsTensors:  # fmt: skip
        """Every slot's logprobs (``(B * (K+1), num + 1)``), in the sampler's mode, from the
        distribution at that slot's position: vLLM's layout."""
        mode = self.sampler.logprobs_mode
        batch, slots, vocab = target.shape
        if mode.startswith("processed"):
            values = probs.reshape(batch * slots, vocab).to(torch.float32).log()
            if mode == "processed_logits":
                values = self._processed_logits(plan, target, prefixes, bitmask, positions, values)
        else:
            words = None if bitmask is None else bitmask.reshape(batch * slots, -1)
            values = raw_values(target.reshape(batch * slots, vocab), words, mode)
        return from_full(values, tokens.reshape(-1).clamp_min(0), num, None)

    @staticmethod
    def _processed_logits(plan, target, prefixes, bitmask, positions, logprobs) -> Tensor:
        """The staged logits at every position divided by the temperature (``-inf`` where
        the position's processed probability is 0)."""
        params = plan.params
        batch, slots, vocab = target.shape
        rows = torch.arange(batch, device=target.device).repeat_interleave(slots)
        extra = prefixes.reshape(batch * slots, -1)
        state: TokenStats | None = None
        if plan.stats is not None:
            state = plan.stats.select(rows)
            state.update(extra)
        length = positions[rows] + (extra >= 0).sum(-1)
        staged = staged_logits(
            target.reshape(batch * slots, vocab), params.repeat_rows(slots), state=state,
            token_bitmask=None if bitmask is None else bitmask.reshape(batch * slots, -1),
            output_len=length,
        )  # fmt: skip
        t = params.controls.temperature
        if isinstance(t, Tensor):
            staged = staged / torch.where(t > 0, t, 1.0).repeat_interleave(slots)[:, None]
        elif t:
            staged = staged / float(t)
        return torch.where(logprobs > -math.inf, staged, -math.inf)
