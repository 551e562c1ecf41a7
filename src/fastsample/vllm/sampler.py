"""vLLM's V1 ``Sampler``, drawing with :func:`fastsample.sample_step`.

One step (:meth:`FastsampleSampler.forward`): find the batch's :class:`~.plan.Plan` (built
when vLLM rebuilt its metadata, else reused), read the rows' positions from the runner's host
arrays, take the grammar bitmask the runner left for these logits, call ``sample_step`` once
(every stage, the draw and the logprobs in one call, keys ``(seed, position)``), update the
penalties' state with the drawn tokens, and return vLLM's ``SamplerOutput``: int32
``(B, 1)`` tokens and the logprobs in vLLM's layout (:mod:`.logprobs`). No Python loop over
the requests, no host sync beyond what the runner does anyway, no logging.

vLLM's own ``forward`` runs instead, unchanged, for its rejection sampler's bonus call
(``predict_bonus_token``), inside :func:`fastsample.vllm.vllm_sampling`, and for a batch the
plan marks unsupported (one warning per reason).
"""

from __future__ import annotations

import torch
from torch import Tensor
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.sampler import Sampler

from ..ops import threads
from ..stages import sample_step, staged_logits
from . import grammar
from .logprobs import as_vllm, from_full, raw_values
from .plan import Plan, build_plan, thinking_budget_active
from .state import CALLS, STATE


def _warn_once(key: str, message: str, *args: object) -> None:
    from . import _warn_once as warn

    warn(key, message, *args)


class FastsampleSampler(Sampler):
    """vLLM's ``Sampler`` whose ``forward`` draws with fastsample."""

    _plan: Plan | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        STATE.runners.add("v1")

    def plan_for(self, metadata, logits: Tensor, batch: int | None = None,
                 verify: bool = False) -> Plan:  # fmt: skip
        """The plan of ``metadata`` (rebuilt when vLLM rebuilt the metadata; ``verify``: for
        the rejection sampler, ``batch`` requests)."""
        rows = logits.shape[0] if batch is None else batch
        plan = self._plan
        if plan is None or not plan.matches(metadata, rows, logits.shape[1], verify):
            plan = build_plan(metadata, logits, self.logprobs_mode, rows, previous=plan,
                              verify=verify)  # fmt: skip
            self._plan = plan
            if plan.unsupported is not None:
                _warn_once(
                    "unsupported " + plan.unsupported, "fastsample's vLLM plugin leaves "
                    "batches with %s to vLLM's own sampler", plan.unsupported,
                )  # fmt: skip
        return plan

    @threads.one_thread_calls  # the plugin's own passes too (fastsample.ops.threads)
    def forward(
        self,
        logits: Tensor,
        sampling_metadata,
        predict_bonus_token: bool = False,
        logprobs_mode_override=None,
    ) -> SamplerOutput:
        if STATE.delegate or predict_bonus_token or logprobs_mode_override is not None:
            return self.vllm_forward(logits, sampling_metadata, predict_bonus_token,
                                     logprobs_mode_override)  # fmt: skip
        plan = self.plan_for(sampling_metadata, logits)
        if plan.unsupported is not None or thinking_budget_active(sampling_metadata):
            return self.vllm_forward(logits, sampling_metadata)
        words = grammar.take(logits)
        try:
            return self._draw(logits, plan, words)
        except Exception as exc:  # never take vLLM down: its own code samples this step
            self.hand_back(exc, logits, words, "sampler drew it")
            return super().forward(logits, sampling_metadata)

    def hand_back(self, exc: Exception, logits: Tensor, words: Tensor | None, what: str) -> None:
        """After ``exc`` inside a step, before vLLM's own code takes it: the next step starts
        from a fresh plan, one warning per kind of error, the call counted, and the grammar
        bitmask applied to ``logits`` (vLLM's code expects it applied)."""
        self._plan = None
        _warn_once(
            "error " + type(exc).__name__, "fastsample's vLLM plugin failed a step (%s: %s); "
            "vLLM's own %s", type(exc).__name__, exc, what,
        )  # fmt: skip
        CALLS["delegated"] += 1
        grammar.mask(logits, words)

    def _draw(self, logits: Tensor, plan: Plan, words: Tensor | None) -> SamplerOutput:
        """One step with fastsample: ``sample_step``, the state's update, vLLM's output."""
        CALLS["sample"] += 1
        positions = plan.positions()
        params = plan.params
        assert params is not None
        out = sample_step(
            logits, params=params, state=plan.stats, step=positions, token_bitmask=words,
            output_len=positions if params.stop_ids is not None else None,
        )  # fmt: skip
        if plan.stops_yield_to_grammar and not bool(out.valid.all()):
            # Rows whose grammar allowed only their (min-tokens-masked) stop tokens: drawn again
            # with min-tokens off there, as vLLM restores the stop tokens. Other rows draw the
            # same tokens (same keys and positions).
            done = torch.where(out.valid, positions, torch.iinfo(torch.int64).max)
            out = sample_step(logits, params=params, state=plan.stats, step=positions,
                              token_bitmask=words, output_len=done)  # fmt: skip
        logprobs = None
        if plan.raw_before_allowed:
            values = raw_values(logits, words, self.logprobs_mode)
            logprobs = from_full(values, out.token_ids[:, 0], plan.num_logprobs, plan.logprob_ids)
        elif plan.num_logprobs is not None or plan.logprob_ids:

            def processed() -> Tensor:  # before the state update: the logits drawn from
                return staged_logits(logits, params, state=plan.stats, token_bitmask=words,
                                     output_len=positions)  # fmt: skip

            logprobs = as_vllm(out, self.logprobs_mode, plan.num_logprobs, plan.logprob_ids,
                               logits, processed, params.controls.temperature)  # fmt: skip
        if plan.stats is not None:  # probs: mirostat's mu moves by the drawn token's
            plan.stats.update(out.token_ids, probs=out.probs, params=params)
        plan.emitted(1)
        tokens = out.token_ids.to(torch.int32)
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=logprobs)

    def vllm_forward(self, logits, sampling_metadata, predict_bonus_token=False,
                     logprobs_mode_override=None) -> SamplerOutput:  # fmt: skip
        """vLLM's own ``forward``, after the grammar bitmask it would have had."""
        CALLS["delegated"] += 1
        grammar.apply(logits)
        return super().forward(logits, sampling_metadata, predict_bonus_token,
                               logprobs_mode_override)  # fmt: skip

