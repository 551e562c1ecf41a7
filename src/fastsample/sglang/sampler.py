"""SGLang's ``Sampler`` drawing with :func:`fastsample.sample_step`, and ``fast_sample``.

:class:`FastsampleSampler` subclasses SGLang's own class (built by SGLang's
``create_sampler()`` once the plugin replaced the name) and overrides ``forward`` only:

1. SGLang's preprocessing already ran: penalties, the grammar mask and logit bias are in the
   logits (``ModelRunner._preprocess_logits``); custom logit processors and NaN
   sanitizing run here as in SGLang (``_preprocess_logits``).
2. Per-row settings from ``SamplingBatchInfo``: temperature, top-k (``TOP_K_ALL`` is off),
   top-p, min-p (only where some row asks for it, as SGLang's ``need_min_p_sampling``), a
   row with ``top_k <= 1`` greedy (the first maximal logit, SGLang's ``argmax``), and the
   joint cut (``cut_order="joint"``). Settings shared by the whole batch are passed as Python
   numbers (a stage that is off is skipped); they are read from the host-side request list
   when SGLang keeps one, else from the tensors (CPU tensors are read for free).
3. The draw, keyed on (``sampling_seed``, position): ``positions`` is the position of each
   row's last input token, as SGLang passes it.
4. Logprobs, SGLang's definitions: ``log_softmax(logits / T)`` (raw logits when the whole
   batch is greedy or under ``SGLANG_RETURN_ORIGINAL_LOGPROB``), then SGLang's own
   ``OutputLogprobProcessor`` packs top-n and per-token values.

Anything else goes to ``super().forward`` (SGLang's code) with one warning per reason.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch
from torch import Tensor

from ..ops import threads
from ..sampling import fast_sample as fs_fast_sample
from ..stages import StepParams, sample_step
from .state import count, warn_once

__all__ = ["ParamsCache", "fastsample_fast_sample", "sampler_class", "step_params"]

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k (sampling_params.TOP_K_ALL)
DRAFT_STREAM = 1
"""fastsample's first stream for EAGLE's draft proposals (``fast_sample``; draft step ``s``
uses stream ``1 + s``): the target's draws use stream 0, so a request's draft and target
noise are independent at the same position."""

_CLASS: type | None = None


def sampler_class() -> type:
    """:class:`FastsampleSampler`, built once on SGLang's ``Sampler`` (imported here, not at
    module import, so that this module imports without SGLang)."""
    global _CLASS
    if _CLASS is None:
        from sglang.srt.layers.sampler import Sampler

        _CLASS = type("FastsampleSampler", (_FastsampleForward, Sampler), {})
        _CLASS.__doc__ = _FastsampleForward.__doc__
        _CLASS.__module__ = __name__
    return _CLASS


def unsupported(sampler: Any, info: Any, logprob_logits: Tensor | None) -> str | None:
    """Why this step must run in SGLang's code, or None."""
    if info.has_custom_logit_processor:
        return "custom logit processors"
    if info.sampling_mask_batch_indices is not None:
        return "return_sampling_mask"
    if logprob_logits is not None:
        return "watermarking"
    if sampler.rl_on_policy_target is not None:
        return "RL on-policy sampling"
    if sampler.use_ascend_backend:
        return "the Ascend sampling backend"
    return None


def _uniform(values: Tensor) -> float | None:
    """The single value of a CPU tensor, or None if the rows differ (or it lives elsewhere:
    reading would sync)."""
    if values.device.type != "cpu" or values.numel() == 0:
        return None
    first = values.reshape(-1)[0]
    return float(first) if bool((values == first).all()) else None


_KEYED = (
    "temperatures", "top_ks", "top_ps", "min_ps", "sampling_seed", "is_all_greedy",
    "is_any_greedy", "need_top_k_sampling", "need_top_p_sampling", "need_min_p_sampling",
)  # fmt: skip


class ParamsCache:
    """The last batch's :func:`step_params`, reused while its settings are the same objects.

    SGLang copies a batch's ``SamplingBatchInfo`` for every forward pass
    (``copy_for_forward``: the same tensors in a new object) and replaces the tensors when
    the batch is filtered or merged; the key holds them, so their ids cannot be reused while
    cached."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.params: StepParams | None = None

    def get(self, info: Any, batch: int, vocab: int, device: torch.device) -> StepParams:
        key = (batch, vocab, device, *(getattr(info, name) for name in _KEYED))
        if self.key is not None and all(
            a is b or (not isinstance(a, Tensor) and a == b)
            for a, b in zip(self.key, key, strict=True)
        ):
            assert self.params is not None
            return self.params
        params = step_params(info, batch, vocab, device)
        if info.sampling_seed is not None and info.sampling_seed.shape[0] == batch:
            self.key, self.params = key, params  # random per-step keys are never kept
        return params


def step_params(info: Any, batch: int, vocab: int, device: torch.device) -> StepParams:
    """fastsample's settings for an SGLang batch (see the module docstring, step 2)."""
    temperature = info.temperatures.reshape(-1).float()
    top_k = info.top_ks.reshape(-1).to(torch.int64)
    greedy = top_k <= 1
    settings: dict[str, Any] = {}
    if info.is_all_greedy:
        settings["temperature"] = 0.0
    else:
        t = _uniform(temperature) if not info.is_any_greedy else None
        settings["temperature"] = t if t is not None else torch.where(greedy, 0.0, temperature)
        if info.need_top_k_sampling:
            k = _uniform(top_k)
            off = torch.where((top_k >= vocab) | greedy, 0, top_k)
            settings["top_k"] = (0 if k >= vocab else int(k)) if k is not None else off
        if info.need_top_p_sampling:
            p = _uniform(info.top_ps)
            settings["top_p"] = p if p is not None else info.top_ps.reshape(-1).float()
        if info.need_min_p_sampling:
            m = _uniform(info.min_ps)
            settings["min_p"] = m if m is not None else info.min_ps.reshape(-1).float()
    seeds = info.sampling_seed
    if seeds is None or seeds.shape[0] != batch:
        # A batch without keys (built outside from_schedule_batch, or merged with one): a
        # random key per row, this step only.
        seeds = torch.tensor([secrets.randbits(63) for _ in range(batch)], dtype=torch.int64)
    return StepParams(batch, vocab, device=device, **settings, cut_order="joint",
                      seed=seeds.to(device=device, dtype=torch.int64))  # fmt: skip


class _FastsampleForward:
    """SGLang's ``Sampler`` whose ``forward`` draws with fastsample (module docstring); the
    class SGLang builds is ``FastsampleSampler`` (:func:`sampler_class`)."""

    def forward(
        self,
        logits_output: Any,
        sampling_info: Any,
        return_logprob: bool,
        top_logprobs_nums: list[int],
        token_ids_logprobs: list[list[int]],
        positions: Tensor,
        *,
        logprob_logits: Tensor | None = None,
    ) -> Tensor:
        reason = unsupported(self, sampling_info, logprob_logits)
        if reason is None:
            try:
                return self._fastsample_forward(
                    logits_output.next_token_logits, logits_output, sampling_info,
                    return_logprob, top_logprobs_nums, token_ids_logprobs, positions,
                )  # fmt: skip
            except Exception as error:  # this step in SGLang's code, the next one here again
                reason = "error"
                warn_once("error", f"fastsample's sampler failed ({error!r}); that step (and "
                          "any later failing one) is sampled by SGLang's own code")  # fmt: skip
        else:
            warn_once(reason, f"a batch uses {reason}, which fastsample's sampler does not "
                      "do: SGLang's own sampler samples it")  # fmt: skip
        count("handed", reason.replace(" ", "_"))
        return self._sglang_forward(
            logits_output, sampling_info, return_logprob, top_logprobs_nums,
            token_ids_logprobs, positions, logprob_logits,
        )  # fmt: skip

    def _sglang_forward(self, logits_output, info, return_logprob, top_nums, token_ids,
                        positions, logprob_logits) -> Tensor:  # fmt: skip
        """SGLang's own ``forward``, with the seeds it would have had (none outside
        deterministic mode: its seeded CPU path needs a kernel no CPU wheel ships)."""
        seeds = info.sampling_seed
        own = seeds is not None and not self.enable_deterministic  # keys_are_ours()
        if own:
            info.sampling_seed = None
        try:
            extra = {} if logprob_logits is None else {"logprob_logits": logprob_logits}
            return super().forward(  # type: ignore[misc]
                logits_output, info, return_logprob, top_nums, token_ids, positions, **extra
            )
        finally:
            if own:
                info.sampling_seed = seeds

    @threads.one_thread_calls  # its own passes too: the logits are an argument for that
    def _fastsample_forward(self, next_token_logits, logits_output, info, return_logprob,
                            top_nums, token_ids, positions) -> Tensor:  # fmt: skip
        logits = self._preprocess_logits(next_token_logits, info)
        batch, vocab = logits.shape
        cache = self.__dict__.setdefault("_fastsample_params", ParamsCache())
        params = cache.get(info, batch, vocab, logits.device)
        step = positions.reshape(-1).to(device=logits.device, dtype=torch.int64)
        out = sample_step(logits, params=params, step=step)
        next_ids = out.token_ids[:, 0].to(torch.int32)
        if return_logprob:
            from sglang.srt.layers import sampler as sglang_sampler

            if info.is_all_greedy or sglang_sampler.SGLANG_RETURN_ORIGINAL_LOGPROB:
                logprobs = torch.log_softmax(logits, dim=-1)
            else:
                logprobs = torch.log_softmax(logits / info.temperatures, dim=-1)
            result = self.output_logprob_processor.compute_logprobs(
                logprobs, top_nums, token_ids, next_ids
            )
            result.write_output_to(logits_output)
        self._sync_token_ids_across_tp(next_ids, info)
        count("sampler", batch)
        return next_ids


def fastsample_fast_sample(
    probs: Tensor,
    num_samples: int = 1,
    *,
    sampling_seed: Tensor | None = None,
    positions: Tensor | None = None,
    draft_step: int = 0,
) -> tuple[Tensor, Tensor]:
    """SGLang's ``spec_utils.fast_sample`` contract on :func:`fastsample.fast_sample`.

    ``(sample_p, sample_index)``: ``num_samples`` ordered draws without replacement from each
    row of ``probs`` (the exponential race), ``sample_p = probs.gather(1, sample_index)``.
    With ``sampling_seed`` (and ``positions``, one per row) the noise is keyed on (seed,
    position, ``draft_step``) in the draft stream, so proposals are reproducible in any batch;
    without, a fresh generator-free key per call (torch's global generator is left alone).
    Works on CPU tensors, where SGLang's own seeded call needs a Triton GPU driver.
    """
    if sampling_seed is not None:
        if positions is None:
            raise ValueError("positions are required with sampling_seed")
        if sampling_seed.shape != positions.shape or sampling_seed.numel() != probs.shape[0]:
            raise ValueError(
                f"sampling_seed {tuple(sampling_seed.shape)} and positions "
                f"{tuple(positions.shape)} must both have one value per row of probs "
                f"{tuple(probs.shape)}"
            )
        if draft_step < 0:
            raise ValueError(f"draft_step must be >= 0, got {draft_step}")
        seed = sampling_seed.reshape(-1).to(device=probs.device, dtype=torch.int64)
        step = positions.reshape(-1).to(device=probs.device, dtype=torch.int64)
        got = fs_fast_sample(probs, num_samples, seed=seed, step=step,
                             stream=DRAFT_STREAM + draft_step)  # fmt: skip
    else:
        seed = torch.tensor([secrets.randbits(63) for _ in range(probs.shape[0])],
                            dtype=torch.int64, device=probs.device)  # fmt: skip
        got = fs_fast_sample(probs, num_samples, seed=seed, step=0, stream=DRAFT_STREAM)
    count("fast_sample", probs.shape[0])
    return got
