"""Model Runner V2's per-request slots as fastsample's step parameters and penalties' state.

vLLM 0.32's Model Runner V2 (MRV2, ``vllm/v1/worker/gpu/``) keeps every request's settings in a
fixed slot (``idx_mapping`` maps a batch row to its slot), written once when the request
joins: ``SamplingStates`` (temperature, top-k, top-p, min-p and a seed for every request, a
random one when the user gave none), ``LogitBiasState`` (allowed ids, logit bias, min-tokens
and stop ids, as padded device tables with host counts), ``PenaltiesState`` (the three
penalties, the prompt bitmask and the output counts, which vLLM itself updates after every
step) and ``LogprobTokenIdsState``. The plugin reads them; it copies nothing per request:

* :class:`SlotPlans` builds a :class:`~fastsample.StepParams` for a batch from those slots
  only when the batch's rows or a slot's settings changed (:meth:`SlotPlans.plan`), and
  reuses it otherwise. A control every row shares becomes a Python number (the shorter paths,
  as on the V1 runner: :func:`.plan._as_numbers`); the token tables are gathered on the device
  (``-1``-padded, no host sync).
* :class:`SlotStats` is a :class:`~fastsample.TokenStats` over all slots whose prompt bitmask
  and output counts *are* vLLM's tensors (same bit layout); fastsample adds the one thing
  vLLM does not keep, the seen bitmask (``prompt | counts > 0``) that lets the CPU visit only
  the seen tokens. It is rebuilt for a slot when a request joins it and refreshed, for the
  words of the tokens a step emitted, at the start of the next step (vLLM's counts are
  updated after the sampler returns; a token vLLM discarded keeps its bit clear).

A request's fastsample stages (``SamplingParams.extra_args["fastsample"]``,
:mod:`.request_stages`) are read when it joins its slot and kept by slot. DRY, no-repeat
n-grams and ``penalty_last_n`` read the latest context tokens: :class:`SlotStats` keeps a
``(slots, H)`` history, refreshed for the batch's slots every step from vLLM's own
``all_token_ids`` (committed tokens, one gather on the device); mirostat's ``mu`` is kept per
slot and reset when a request joins.

The seed contract is the V1 plugin's: keys ``(seed, position)``, ``position`` = tokens the
request has emitted before the drawn one (``pos + 1 - prompt_len`` of the logits row), so a
seeded request draws the same tokens on both runners.

A batch with something fastsample does not do here is left to vLLM's own code with one
warning per reason (:meth:`SlotPlans.unsupported`, read when a plan is built): bad words,
custom logits processors, a thinking-token budget, trace replay, batch-sharded sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..ops import bitmask
from ..stages import StepParams, TokenStats
from ..stages.state import mirostat_update
from . import request_stages
from .plan import _as_numbers
from .state import CALLS

MAX_COUNT = 2**31 - 1
"""vLLM's output counts are int32."""


class SlotStats:
    """The penalties' state over MRV2's slots (see the module docstring)."""

    def __init__(self, penalties_state) -> None:
        prompt = penalties_state.prompt_bin_mask
        counts = penalties_state.output_bin_counts
        slots = counts.shape[0]
        self.stats = TokenStats(
            prompt, counts, torch.zeros(slots, dtype=torch.int64, device=counts.device),
            prompt.clone(), MAX_COUNT,
        )  # fmt: skip
        self.joined: set[int] = set()
        self._emitted: tuple[Tensor, Tensor] | None = None

    def current(self, rows: Tensor, positions: Tensor,
                context: tuple[Tensor, Tensor, int] | None = None) -> TokenStats:  # fmt: skip
        """The state for a step whose logits rows read slots ``rows`` (int64) at output
        lengths ``positions``: new requests' seen words rebuilt, last step's refreshed.
        ``context``: vLLM's ``all_token_ids``, each row's context length and the history
        width: the rows' history is read from the table (``rows`` distinct)."""
        stats = self.stats
        if context is not None:
            table, ends, width = context
            if stats.history is None or stats.history.shape[1] != width:
                stats.history = torch.full((stats.batch, width), -1, dtype=torch.int64,
                                           device=stats.device)  # fmt: skip
            stats.history.index_copy_(0, rows, latest_tokens(table, rows, ends, width))
        if self._emitted is not None:
            slots, ids = self._emitted
            self._emitted = None
            refresh_seen(stats, slots, ids)
        if self.joined:
            index = torch.tensor(sorted(self.joined), dtype=torch.int64, device=stats.device)
            self.joined.clear()
            seen = stats.prompt_mask.index_select(0, index) | bitmask.pack(
                stats.output_counts.index_select(0, index) > 0
            )
            stats.seen_mask.index_copy_(0, index, seen)
            stats.mirostat_mu.index_fill_(0, index, float("nan"))  # a new request starts
        stats.output_len.index_copy_(0, rows, positions)
        return stats

    def moved_mu(self, rows: Tensor, token_ids: Tensor, probs: Tensor, tau, eta) -> None:
        """Mirostat's ``mu`` of slots ``rows`` (distinct) after they emitted ``token_ids``
        (``(N, n)``, ``-1``: none) with processed probabilities ``probs`` (``(N, n)``);
        ``tau``, ``eta``: the rows' settings."""
        mu = self.stats.mirostat_mu
        moved = mirostat_update(mu.index_select(0, rows), token_ids, probs, tau, eta,
                                self.stats.vocab)  # fmt: skip
        mu.index_copy_(0, rows, moved)

    def emitted(self, rows: Tensor, token_ids: Tensor) -> None:
        """The tokens a step drew for slots ``rows`` (``(N, n)``, ``-1`` = none)."""
        self._emitted = (rows, token_ids)


def latest_tokens(table: Tensor, slots: Tensor, ends: Tensor, width: int) -> Tensor:
    """``(N, width)`` int64: each slot's last ``width`` tokens before ``ends`` (its context
    length) in vLLM's ``(slots, max_model_len)`` token table, oldest first, ``-1`` before the
    context's start."""
    columns = ends.to(torch.int64)[:, None] - width + torch.arange(width, device=ends.device)
    inside = columns >= 0
    flat = slots[:, None] * table.stride(0) + columns.clamp(0, table.shape[1] - 1)
    ids = table.reshape(-1).gather(0, flat.flatten()).view(flat.shape).to(torch.int64)
    return torch.where(inside, ids, -1)


def refresh_seen(stats: TokenStats, slots: Tensor, ids: Tensor) -> None:
    """Recompute the seen words of slots ``slots`` (``(N,)``) holding ``ids`` (``(N, n)``): the
    prompt's bits or a nonzero count, read in place (flat gathers: no copy of a slot)."""
    vocab = stats.vocab
    ids = torch.where((ids >= 0) & (ids < vocab), ids, 0)
    words = ids // bitmask.WORD_BITS
    lanes = torch.arange(bitmask.WORD_BITS, device=ids.device)
    columns = words[..., None] * bitmask.WORD_BITS + lanes  # (N, n, 32)
    inside = columns < vocab
    flat = (slots[:, None, None] * vocab + columns.clamp_max(vocab - 1)).flatten()
    emitted = (stats.output_counts.view(-1).gather(0, flat) > 0).view(columns.shape) & inside
    width = stats.prompt_mask.shape[1]
    word_index = slots[:, None] * width + words
    prompt = stats.prompt_mask.view(-1).gather(0, word_index.flatten()).view(words.shape)
    prompt_bits = ((prompt[..., None] >> lanes.to(torch.int32)) & 1).bool()
    seen = stats.seen_mask.view(1, -1)
    bitmask.refresh_words(seen, word_index.view(1, -1), (emitted | prompt_bits).view(1, -1, 32))


@dataclass
class SlotPlan:
    """What a batch of MRV2 logits rows needs from the slots, built once per composition."""

    key: tuple
    unsupported: str | None  # why vLLM's own code must sample this batch (then nothing else)
    params: StepParams | None = None
    rows_np: np.ndarray | None = None  # (N,) the slot of each logits row
    # Per step: position = pos + offset (1 - prompt length of the row's request); a request
    # whose sequence is shorter than its prefill is in a chunked prefill.
    offset: Tensor | None = None  # (N,) int64
    prefill: Tensor | None = None  # (B,) the requests' prefill lengths
    logits_per_request: Tensor | None = None  # (B,) int32
    penalties: bool = False
    num_logprobs: int | None = None  # the batch's largest request (None: no logprobs)
    logprob_ids: Tensor | None = None  # (N, M) requested ids, -1 padded (rows without: -1)
    raw_before_allowed: bool = False  # vLLM's raw values come before its allowed-ids mask
    stops_yield_to_grammar: bool = False
    history: int = 0  # context tokens the history stages read (0: none)
    mirostat: bool = False

    @property
    def needs_state(self) -> bool:
        """Whether the step reads the slots' state (penalties, history, mirostat's ``mu``)."""
        return self.penalties or self.history > 0 or self.mirostat


class SlotPlans:
    """Plans for the batches of one MRV2 sampler (its slot states), rebuilt on change."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.version = 0  # bumped whenever a slot gets a request
        self._plan: SlotPlan | None = None
        self.slot_stats = SlotStats(sampler.penalties_state)
        self.stages: dict[int, dict] = {}  # each slot's fastsample stages (request_stages)

    def joined(self, slot: int, stages: dict | None = None) -> None:
        self.version += 1
        self.slot_stats.joined.add(slot)
        if stages:
            self.stages[slot] = stages
        else:
            self.stages.pop(slot, None)

    def unsupported(self, idx_mapping_np: np.ndarray) -> str | None:
        """Why vLLM's own code must sample rows of these slots, or None (read when a plan
        is built)."""
        s = self.sampler
        processors = s.logits_processors
        bad_words = next((p for p in processors if type(p).__name__ == "BadWordsState"), None)
        if bad_words is not None and np.any(bad_words.num_bad_words.np[idx_mapping_np] > 0):
            return "bad_words"
        builtin = ("LogitBiasState", "PenaltiesState", "BadWordsState")
        custom = sorted({type(p).__name__ for p in processors if type(p).__name__ not in builtin})
        if custom:
            return f"custom logits processors ({', '.join(custom)})"
        budget = s.thinking_budget_state
        if budget.enabled and np.any(budget.use_thinking_budget[idx_mapping_np]):
            return "a thinking-token budget"
        if s.trace_replay_state is not None:
            return "trace replay"
        if s.batch_sharded:
            return "batch-sharded sampling"
        return None

    def plan(self, input_batch, vocab: int, device: torch.device) -> SlotPlan:
        """The plan of this batch, reused while its rows and their slots' settings stay."""
        idx_mapping_np, cu_num_logits_np = input_batch.idx_mapping_np, input_batch.cu_num_logits_np
        key = (idx_mapping_np.tobytes(), cu_num_logits_np.tobytes(), self.version, vocab)
        if self._plan is None or self._plan.key != key:
            reason = self.unsupported(idx_mapping_np)
            if reason is not None and any(self.stages.get(int(s)) for s in idx_mapping_np):
                reason += " (their requests' fastsample stages do not run there)"
            if reason is not None:
                self._plan = SlotPlan(key, reason)
            else:
                self._plan = build(self.sampler, key, input_batch, vocab, device, self.stages)
        return self._plan


def _host(values: np.ndarray, rows: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(values[rows]))


def _padded(table: Tensor, counts: np.ndarray, rows: Tensor) -> Tensor | None:
    """``(N, M)`` int64 ids of a device table's slot rows, ``-1`` past each row's count."""
    width = int(counts.max(initial=0))
    if width == 0:
        return None
    ids = table.index_select(0, rows)[:, :width].to(torch.int64)
    count = torch.from_numpy(counts.astype(np.int64)).to(ids.device)
    return torch.where(torch.arange(width, device=ids.device) < count[:, None], ids, -1)


def build(sampler, key: tuple, input_batch, vocab: int, device: torch.device,
          stages: dict[int, dict]) -> SlotPlan:  # fmt: skip
    """A plan from the slots' settings (host arrays for the numbers, device tables for ids)
    and their fastsample stages (by slot)."""
    CALLS["plans"] += 1
    counts = np.diff(input_batch.cu_num_logits_np.astype(np.int64))
    slots_np = input_batch.idx_mapping_np.astype(np.int64)
    rows_np = np.repeat(slots_np, counts)
    rows = input_batch.expanded_idx_mapping.to(torch.int64)
    n = len(rows_np)
    req_states = sampler.req_states
    offset = torch.from_numpy(1 - req_states.prompt_len.np[rows_np].astype(np.int64)).to(device)
    prefill = torch.from_numpy(req_states.prefill_len.np[slots_np].astype(np.int32)).to(device)
    per_request = torch.from_numpy(counts.astype(np.int32)).to(device)
    stage_rows = [stages.get(int(slot)) for slot in rows_np]
    states = sampler.sampling_states
    controls = {
        "temperature": _host(states.temperature.np, rows_np),
        "top_k": _host(states.top_k.np, rows_np).to(torch.int64),
        "top_p": _host(states.top_p.np, rows_np),
        "min_p": _host(states.min_p.np, rows_np),
    }
    # A control no row uses is off (vLLM stores top-k off as V, top-p as 1, min-p as 0).
    for name, off in (("top_k", controls["top_k"] >= vocab), ("top_p", controls["top_p"] >= 1),
                      ("min_p", controls["min_p"] <= 0)):  # fmt: skip
        if bool(off.all()):
            controls[name] = None
    settings = _as_numbers(controls, vocab)
    penalties_state = sampler.penalties_state
    penalties = bool(np.any(penalties_state.use_penalty[rows_np]))
    if penalties:  # vLLM validated them when the requests joined: one value, one number
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            values = getattr(penalties_state, name).np[rows_np]
            settings[name] = float(values[0]) if np.all(values == values[0]) else _host(
                getattr(penalties_state, name).np, rows_np)  # fmt: skip
    settings = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in settings.items()}
    lb = next(p for p in sampler.logits_processors if type(p).__name__ == "LogitBiasState")
    allowed = _padded(lb.allowed_token_ids.gpu, lb.num_allowed_token_ids.np[rows_np], rows)
    bias = None
    bias_ids = _padded(lb.logit_bias_token_ids.gpu, lb.num_logit_bias.np[rows_np], rows)
    if bias_ids is not None:
        values = lb.logit_bias.gpu.index_select(0, rows)[:, : bias_ids.shape[1]]
        bias = (bias_ids, torch.where(bias_ids >= 0, values, 0.0))
    stops = lb.num_stop_token_ids.np[rows_np]
    stop_ids = _padded(lb.stop_token_ids.gpu, stops, rows)
    min_tokens = None
    yield_to_grammar = False
    if stop_ids is not None:
        prompt = req_states.prompt_len.np[rows_np].astype(np.int64)
        least = np.where(stops > 0, lb.min_lens.np[rows_np] - prompt, 0)
        min_tokens = torch.from_numpy(least.astype(np.int64)).to(device)
        yield_to_grammar = bool(np.any(lb.restore_when_all_masked.np[rows_np][stops > 0]))
    logprobs_wanted = states.num_logprobs[rows_np]
    num_logprobs = None if np.all(logprobs_wanted < 0) else int(logprobs_wanted.max())
    ids_state = sampler.logprob_token_ids_state
    logprob_ids = _padded(ids_state.token_ids.gpu, ids_state.num_token_ids.np[rows_np], rows)
    wanted = num_logprobs is not None or logprob_ids is not None
    mode = sampler.logprobs_mode
    raw_before_allowed = wanted and allowed is not None and mode.startswith("raw")
    fastsample_logprobs = wanted and not raw_before_allowed
    params = StepParams(
        n, vocab, device=device, **settings, cut_order="vllm",
        seed=torch.from_numpy(states.seeds.np[rows_np].astype(np.int64)).to(device),
        allowed_token_ids=allowed, logit_bias=bias, min_tokens=min_tokens,
        stop_token_ids=stop_ids if min_tokens is not None else None,
        top_logprobs=max(num_logprobs or 0, 0) if fastsample_logprobs else 0,
        # The raw mode costs a normalizer pass: only when fastsample computes logprobs.
        logprobs_mode="raw" if fastsample_logprobs and mode.startswith("raw") else "processed",
        token_ranks=fastsample_logprobs,
        logprob_token_ids=logprob_ids if fastsample_logprobs else None,
        **request_stages.batch_settings(stage_rows, device),
    )  # fmt: skip
    history = request_stages.history_width(stage_rows, req_states.max_model_len)
    return SlotPlan(key, None, params, rows_np, offset, prefill, per_request, penalties,
                    num_logprobs, logprob_ids, raw_before_allowed, yield_to_grammar, history,
                    request_stages.mirostat_on(stage_rows))  # fmt: skip
