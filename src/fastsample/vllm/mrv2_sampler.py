"""Model Runner V2's ``Sampler``, drawing with :func:`fastsample.sample_step`.

MRV2 (``vllm/v1/worker/gpu/sample/sampler.py``) calls ``sampler(logits, input_batch)`` with the
structured-output bitmask already written into the logits, and expects its own
``SamplerOutput``: ``(N, 1)`` tokens, the logprobs in its layout, the NaN counts when asked,
``num_sampled``/``num_rejected`` per request, and the sampling mask when
``return_sampling_mask`` is on. One step here:

1. the batch's plan (:class:`.mrv2_plan.SlotPlans`: rebuilt only when the rows or a slot's
   settings changed) and each row's position ``pos + 1 - prompt_len`` (device ops);
2. one ``sample_step`` with every stage on the rows' slots: allowed ids, logit bias,
   min-tokens, penalties (vLLM's own prompt bitmask and output counts, read in place through
   ``state_rows``), temperature, min-p then top-k and top-p (``cut_order="vllm"``), the
   request's fastsample stages (``extra_args``: :mod:`.request_stages`), greedy (``T == 0``),
   the draw keyed ``(seed, position)``, and the logprobs;
3. vLLM's output, built from fastsample's results (:func:`logprobs_tensors`), and vLLM's own
   helpers for what it counts (``get_num_nans``, ``get_num_sampled_and_rejected``,
   ``SamplingMaskTensors``).

vLLM's own ``__call__`` runs instead inside :func:`fastsample.vllm.vllm_sampling`, for a batch
the plan marks unsupported (one warning per reason), and for a step that raised (one warning
per kind of error).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.output import SamplerOutput, SamplingMaskTensors
from vllm.v1.worker.gpu.sample.sampler import Sampler

from ..ops import threads
from ..stages import SampleOutput, process_step, sample_step, staged_logits
from . import request_stages
from .logprobs import raw_values
from .mrv2_plan import SlotPlan, SlotPlans
from .state import CALLS, STATE


def _warn_once(key: str, message: str, *args: object) -> None:
    from . import _warn_once as warn

    warn(key, message, *args)


class FastsampleSamplerV2(Sampler):
    """MRV2's ``Sampler`` whose ``__call__`` draws with fastsample."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        parallel = getattr(config, "parallel_config", None)
        # Batch-sharded sampling splits a batch across ranks: untested with the plugin.
        self.batch_sharded = bool(getattr(parallel, "enable_batch_sharded_sampling", False))
        self.plans = SlotPlans(self)
        STATE.runners.add("mrv2")

    def add_request(self, req_idx: int, sampling_params) -> None:
        super().add_request(req_idx, sampling_params)
        from . import _warn_once

        stages = request_stages.checked_or_none(getattr(sampling_params, "extra_args", None),
                                                self.req_states.vocab_size, _warn_once)  # fmt: skip
        self.plans.joined(req_idx, stages)

    @threads.one_thread_calls  # the plugin's own passes too (fastsample.ops.threads)
    def __call__(self, logits: Tensor, input_batch) -> SamplerOutput:
        if STATE.delegate:
            CALLS["delegated"] += 1
            return super().__call__(logits, input_batch)
        try:
            plan = self.plans.plan(input_batch, logits.shape[1], logits.device)
            if plan.unsupported is not None:
                return self.hand_over(logits, input_batch, "unsupported " + plan.unsupported,
                                      "fastsample's vLLM plugin leaves batches with %s to "
                                      "vLLM's own sampler", plan.unsupported)  # fmt: skip
            return self._draw(logits, input_batch, plan)
        except Exception as exc:  # never take vLLM down: its own code samples this step
            name = type(exc).__name__
            return self.hand_over(logits, input_batch, "error " + name,
                                  "fastsample's vLLM plugin failed a step (%s: %s); vLLM's "
                                  "own sampler drew it", name, exc)  # fmt: skip

    def hand_over(self, logits, input_batch, key: str, message: str, *args) -> SamplerOutput:
        """vLLM's own ``__call__`` for this step, after one warning per ``key``."""
        _warn_once(key, message, *args)
        CALLS["delegated"] += 1
        return super().__call__(logits, input_batch)

    @staticmethod
    def sampled_and_rejected(plan: SlotPlan, input_batch,
                             emitted: Tensor | None) -> tuple[Tensor, Tensor]:  # fmt: skip
        """vLLM's ``(num_sampled, num_rejected)`` int32 per request from the tokens each
        emitted (None: one each): none for a request still in its chunked prefill (its token is
        discarded), the rest of its logits rows rejected. vLLM's
        ``get_num_sampled_and_rejected`` in torch ops (its Triton kernel would run in Triton's
        interpreter on CPU)."""
        done = prefill_done(plan, input_batch)
        sampled = done.to(torch.int32) if emitted is None else torch.where(done, emitted, 0)
        rejected = torch.where(done, plan.logits_per_request - sampled, 0)
        return sampled.to(torch.int32), rejected.to(torch.int32)

    def step_inputs(self, input_batch, logits: Tensor) -> tuple[SlotPlan, Tensor, Tensor]:
        """The batch's plan, each logits row's slot (int64) and position."""
        plan = self.plans.plan(input_batch, logits.shape[1], logits.device)
        return plan, *rows_and_positions(plan, input_batch)

    def stage_state(self, plan: SlotPlan, rows: Tensor, positions: Tensor,
                    input_batch) -> dict:  # fmt: skip
        """``sample_step``'s state arguments: the slots' state (penalties, history, mirostat's
        ``mu``), else the lengths."""
        if plan.needs_state:
            context = self.history_context(plan, input_batch)
            state = self.plans.slot_stats.current(rows, positions, context)
            return dict(state=state, state_rows=rows)
        return dict(output_len=positions if plan.params.stop_ids is not None else None)

    def history_context(self, plan: SlotPlan, input_batch, first: Tensor | None = None):
        """:meth:`.mrv2_plan.SlotStats.current`'s ``context``: vLLM's token table, the
        context length of each logits row (``first``: of these rows only) and this step's
        width; None when no history stage is on."""
        if not plan.history:
            return None
        ends = input_batch.positions.index_select(0, input_batch.logits_indices) + 1
        if first is not None:
            ends = ends.index_select(0, first)
        return self.req_states.all_token_ids.gpu, ends, history_width(plan, input_batch)

    def _draw(self, logits: Tensor, input_batch, plan: SlotPlan) -> SamplerOutput:
        CALLS["sample"] += 1
        num_nans = get_num_nans(logits) if self.compute_nans else None
        rows, positions = rows_and_positions(plan, input_batch)
        params = plan.params
        where = self.stage_state(plan, rows, positions, input_batch)
        out = sample_step(logits, params=params, step=positions, **where)
        if plan.stops_yield_to_grammar and not bool(out.valid.all()):
            # Rows whose grammar allowed only their (min-tokens-masked) stop tokens: drawn
            # again with min-tokens off there, as vLLM restores the stop tokens.
            done = torch.where(out.valid, positions, torch.iinfo(torch.int64).max)
            where = self.stage_state(plan, rows, done, input_batch)
            if "output_len" in where:
                where["output_len"] = done
            out = sample_step(logits, params=params, step=positions, **where)
        logprobs = None
        if plan.num_logprobs is not None or plan.logprob_ids is not None:
            logprobs = logprobs_tensors(out, plan, self.logprobs_mode, logits,
                                        lambda: staged_logits(logits, params, **where))
        if plan.penalties:
            self.plans.slot_stats.emitted(rows, out.token_ids)
        if plan.mirostat:  # a token vLLM discards (a chunked prefill's) moves nothing
            kept = prefill_done(plan, input_batch).repeat_interleave(
                plan.logits_per_request.to(torch.int64))  # fmt: skip
            self.plans.slot_stats.moved_mu(rows, torch.where(kept[:, None], out.token_ids, -1),
                                           out.probs, params.mirostat_tau,
                                           params.mirostat_eta)  # fmt: skip
        num_sampled, num_rejected = self.sampled_and_rejected(plan, input_batch, None)
        mask = None
        if self.return_sampling_mask:
            kept = int(np.max(self.sampling_states.top_k.np[input_batch.idx_mapping_np]))
            probs = process_step(logits, params, **_process_args(where))
            mask = SamplingMaskTensors.from_logits(
                torch.where(probs > 0, 0.0, -math.inf), input_batch.cu_num_logits, num_sampled,
                kept,
            )  # fmt: skip
        return SamplerOutput(
            sampled_token_ids=out.token_ids.view(-1, 1), logprobs_tensors=logprobs,
            num_nans=num_nans, num_sampled=num_sampled, num_rejected=num_rejected,
            sampling_mask_tensors=mask,
        )  # fmt: skip


def rows_and_positions(plan: SlotPlan, input_batch) -> tuple[Tensor, Tensor]:
    """Each logits row's slot (int64) and position: the tokens its request emitted before the
    one drawn there (``pos + 1 - prompt_len``; 0 during a chunked prefill)."""
    rows = input_batch.expanded_idx_mapping.to(torch.int64)
    pos = input_batch.positions.index_select(0, input_batch.logits_indices)
    return rows, (pos + plan.offset).clamp_min(0)


def prefill_done(plan: SlotPlan, input_batch) -> Tensor:
    """``(B,)`` bool: requests past their (chunked) prefill, whose tokens vLLM keeps."""
    return input_batch.seq_lens >= plan.prefill


def history_width(plan: SlotPlan, input_batch) -> int:
    """The history's width this step: as wide as the batch's contexts (the host's upper
    bound of its sequence lengths), at most the plan's cap (:mod:`.request_stages`)."""
    bound = getattr(input_batch, "seq_lens_cpu_upper_bound", None)
    if bound is None:
        return plan.history
    longest = int(bound[: input_batch.num_reqs].max()) if input_batch.num_reqs else 0
    return request_stages.fitted_width(plan.history, longest)


def _process_args(where: dict) -> dict:
    """``process_step``'s spelling of ``sample_step``'s state arguments."""
    out = dict(where)
    if "state_rows" in out:
        out["rows"] = out.pop("state_rows")
    return out


def logprobs_tensors(out: SampleOutput, plan: SlotPlan, mode: str, logits: Tensor,
                     processed_logits) -> LogprobsTensors:  # fmt: skip
    """MRV2's layout: column 0 the drawn token; then, per row, its requested ids
    (``logprob_token_ids``) if it has any, else the batch's ``n`` most likely tokens, padded
    with id 0 and ``-inf``; ranks counted on the same values. Values by ``mode``: raw or
    processed log-probabilities or logits (processed logits divided by the temperature)."""
    sampled = out.token_ids[:, :1]
    num = max(plan.num_logprobs or 0, 0)
    requested = plan.logprob_ids
    if plan.raw_before_allowed:  # vLLM's raw values come before its allowed-ids mask
        values = raw_values(logits, None, mode)
        chosen = values.gather(1, sampled)
        ranks = (values >= chosen).sum(-1)
        top = values.topk(num, dim=-1) if num else None
        top_ids, top_values = (top.indices, top.values) if top is not None else (None, None)
        req_values = None if requested is None else values.gather(1, requested.clamp_min(0))
    else:
        chosen, ranks = out.logprobs[:, :1], out.ranks[:, 0]
        top_ids, top_values = (out.top_token_ids, out.top_logprobs) if num else (None, None)
        req_values = out.requested_logprobs
    width = max(num, 0 if requested is None else requested.shape[1])
    batch, device = sampled.shape[0], sampled.device
    ids = torch.zeros(batch, width, dtype=torch.int64, device=device)
    scores = torch.full((batch, width), -math.inf, dtype=torch.float32, device=device)
    if top_ids is not None:
        ids[:, :num], scores[:, :num] = top_ids, top_values.to(torch.float32)
    if requested is not None and req_values is not None:
        m = requested.shape[1]
        listed = requested >= 0
        has = listed.any(-1, keepdim=True)
        ids[:, :m] = torch.where(has, requested.clamp_min(0), ids[:, :m])
        scores[:, :m] = torch.where(has, torch.where(listed, req_values.to(torch.float32),
                                                     -math.inf), scores[:, :m])  # fmt: skip
        if width > m:
            ids[:, m:] = torch.where(has, 0, ids[:, m:])
            scores[:, m:] = torch.where(has, -math.inf, scores[:, m:])
    ids = torch.cat((sampled, ids), 1)
    scores = torch.cat((chosen.to(torch.float32), scores), 1)
    if mode.endswith("logits") and not plan.raw_before_allowed:
        if mode == "raw_logits":
            at = logits.gather(1, ids).to(torch.float32)
        else:
            at = processed_logits().gather(1, ids).to(torch.float32)
            t = plan.params.controls.temperature
            if isinstance(t, Tensor):
                at = at / torch.where(t > 0, t, 1.0).to(torch.float32)[:, None]
            elif t:
                at = at / float(t)
        scores = torch.where(scores > -math.inf, at, -math.inf)
    return LogprobsTensors(ids, scores, ranks)
