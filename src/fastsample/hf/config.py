"""Reading a transformers ``GenerationConfig`` into fastsample's controls and seeds.

transformers turns ``do_sample``, ``temperature``, ``top_k``, ``top_p`` and ``min_p`` into
logits warpers that it appends to the processor list after the user's processors. fastsample
draws from the same processed distribution with :func:`fastsample.sample`, so this module
removes exactly the warpers transformers built from the config (the user's own processors
stay, and run first) and hands their settings to fastsample as :class:`Controls`.

Seeds: one per prompt (``seed=`` a list or tensor), an int for every prompt, or None for
seeds drawn from torch's global generator (so ``torch.manual_seed`` reproduces a run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

STAGE_KWARGS = (
    "order", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
    "dynatemp_exponent", "mirostat_tau", "mirostat_eta", "penalty_last_n", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
)  # fmt: skip
"""fastsample's stages that transformers' generation config lacks: ``generate`` takes them as
keywords (:class:`fastsample.StepParams`' names and meanings; ``dry_sequence_breakers`` is
one list of token-id sequences for every prompt)."""

# Largest seed drawn when the caller gives none (fastsample seeds are 64-bit).
_SEED_LIMIT = 1 << 62
# Odd 64-bit constant (the golden ratio's bits) that spreads copy indices over the seed space.
_COPY_MIX = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Controls:
    """The sampling controls of one generate call, as :func:`fastsample.sample` takes them.

    ``greedy`` is ``do_sample=False`` (or ``temperature == 0``): the first most likely token.
    The others are None when off, as transformers leaves the matching warper out.
    """

    greedy: bool
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None

    @property
    def needs_step(self) -> bool:
        """Whether a stage beyond temperature, top-k, top-p and min-p is on: the draw is then
        :func:`fastsample.sample_step` with :class:`fastsample.StepParams`."""
        return any(v is not None for v in (self.typical_p, self.epsilon_cutoff, self.eta_cutoff))

    def step_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`fastsample.StepParams` (transformers' order)."""
        if self.greedy:
            return {"temperature": 0.0}
        return {**self.sample_kwargs(), "typical_p": self.typical_p,
                "epsilon_cutoff": self.epsilon_cutoff, "eta_cutoff": self.eta_cutoff}  # fmt: skip

    def sample_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`fastsample.sample` / :func:`fastsample.process`."""
        if self.greedy:
            return {"temperature": 0.0}
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }


def _off_unless(value: Any, off: Any) -> Any:
    return None if value is None or value == off else value


def controls_from_config(config: Any) -> Controls:
    """The :class:`Controls` that ``config`` asks for; raises for what fastsample lacks."""
    if (getattr(config, "num_beams", 1) or 1) > 1:
        raise NotImplementedError(
            "fastsample.hf samples or decodes greedily; num_beams > 1 is beam search"
        )
    if not config.do_sample:
        return Controls(greedy=True)
    if getattr(config, "top_h", None) is not None:
        raise NotImplementedError(
            "fastsample.hf has no top_h (use model.generate without custom_generate)"
        )
    temperature = _off_unless(config.temperature, 1.0)
    if temperature == 0:
        return Controls(greedy=True)
    top_p = config.top_p if config.top_p is not None and config.top_p < 1.0 else None
    typical = getattr(config, "typical_p", None)
    epsilon = getattr(config, "epsilon_cutoff", None)
    eta = getattr(config, "eta_cutoff", None)
    return Controls(
        greedy=False,
        temperature=temperature,
        top_k=_off_unless(config.top_k, 0),
        top_p=top_p,
        min_p=config.min_p,
        typical_p=typical if typical is not None and typical < 1.0 else None,
        epsilon_cutoff=epsilon if epsilon is not None and 0.0 < epsilon < 1.0 else None,
        eta_cutoff=eta if eta is not None and 0.0 < eta < 1.0 else None,
    )


def _built_warpers(config: Any) -> list[type]:
    """The warper classes transformers appends for ``config`` (``_get_logits_processor``)."""
    if not config.do_sample:
        return []
    built: list[type] = []
    if config.temperature is not None and config.temperature != 1.0:
        built.append(TemperatureLogitsWarper)
    if config.top_k is not None and config.top_k != 0:
        built.append(TopKLogitsWarper)
    if config.top_p is not None and config.top_p < 1.0:
        built.append(TopPLogitsWarper)
    if config.min_p is not None:
        built.append(MinPLogitsWarper)
    typical = getattr(config, "typical_p", None)
    if typical is not None and typical < 1.0:
        built.append(TypicalLogitsWarper)
    for name, kind in (("epsilon_cutoff", EpsilonLogitsWarper), ("eta_cutoff", EtaLogitsWarper)):
        value = getattr(config, name, None)
        if value is not None and 0.0 < value < 1.0:
            built.append(kind)
    return built


def without_config_warpers(processors: Sequence[Any] | None, config: Any) -> LogitsProcessorList:
    """``processors`` minus the warpers transformers built from ``config``.

    transformers appends its warpers after the user's processors, so for each warper class
    it built, the last instance in the list is its own; a user's earlier instance stays.
    """
    kept = list(processors or [])
    for kind in _built_warpers(config):
        for index in range(len(kept) - 1, -1, -1):
            if type(kept[index]) is kind:
                del kept[index]
                break
    return LogitsProcessorList(kept)


def prompt_seeds(seed: object, num_prompts: int, device: torch.device) -> Tensor:
    """``(num_prompts,)`` int64 seeds from ``seed`` (None, an int, a list or a tensor)."""
    if seed is None:
        return torch.randint(0, _SEED_LIMIT, (num_prompts,), dtype=torch.int64).to(device)
    if isinstance(seed, bool):
        raise TypeError("seed must be an int, a list of ints or an int64 tensor, got bool")
    if isinstance(seed, int):
        return torch.full((num_prompts,), seed, dtype=torch.int64, device=device)
    if isinstance(seed, Tensor):
        if seed.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"seed must be an integer tensor, got {seed.dtype}")
        seeds = seed.to(device=device, dtype=torch.int64).reshape(-1)
    elif isinstance(seed, Sequence) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in seed
    ):
        seeds = torch.tensor(list(seed), dtype=torch.int64, device=device)
    else:
        raise TypeError(f"seed must be an int, a list of ints or an int64 tensor, got {seed!r}")
    if seeds.numel() != num_prompts:
        raise ValueError(f"seed has {seeds.numel()} entries for {num_prompts} prompts (one each)")
    return seeds


def copy_seeds(seeds: Tensor, copies: int) -> tuple[Tensor, Tensor]:
    """Per-row seeds and copy indices for ``num_return_sequences = copies``.

    transformers repeats each prompt ``copies`` times in a row. Returns the prompt's seed
    per row and the copy index ``i`` (for ``Stream.SAMPLE + i``), plus nothing else: copy 0
    keeps the request's own seed, so ``copies=1`` draws what a single request draws.
    """
    rows = seeds.repeat_interleave(copies)
    index = torch.arange(copies, device=seeds.device).repeat(seeds.numel())
    return rows, index


def mixed_copy_seeds(seeds: Tensor, index: Tensor) -> Tensor:
    """Seeds that differ between the copies of one prompt (copy 0 keeps its seed).

    Speculative verification has no stream argument, so copies get distinct seeds instead of
    distinct streams: ``seed + i * odd constant`` (mod 2**64) is one-to-one in ``i``.
    """
    mix = torch.tensor(_COPY_MIX - (1 << 64), dtype=torch.int64, device=seeds.device)
    return seeds + index * mix


@dataclass
class Prepared:
    """Everything a decoding loop needs, after transformers' generate has prepared it.

    ``input_ids`` and ``attention_mask`` are ``(B, L)`` (rows already repeated for
    ``num_return_sequences``); ``processors`` are the user's and the config's processors
    without the warpers fastsample replaces; ``seeds`` and ``copy_index`` are per row;
    ``stages`` the :data:`STAGE_KWARGS` given to ``generate``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    processors: LogitsProcessorList
    stopping: Any
    config: Any
    controls: Controls
    seeds: Tensor
    copy_index: Tensor
    streamer: Any = None
    stages: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_step(self) -> bool:
        """Whether the draw is :func:`fastsample.sample_step` (a stage of the chain is on)."""
        return bool(self.stages) or self.controls.needs_step

    @property
    def max_new_tokens(self) -> int:
        """New tokens at most per row (transformers stores the total as ``max_length``)."""
        return max(int(self.config.max_length) - self.input_ids.shape[1], 0)

    @property
    def pad_token(self) -> int:
        pad = self.config._pad_token_tensor
        return int(pad) if pad is not None else 0

    @property
    def eos_tokens(self) -> Tensor | None:
        eos = self.config._eos_token_tensor
        return None if eos is None else eos.reshape(-1).to(self.input_ids.device)
