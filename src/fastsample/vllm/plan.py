"""vLLM's ``SamplingMetadata`` as fastsample's per-batch parameters and per-request state.

vLLM rebuilds its ``SamplingMetadata`` only when the batch's composition changes (requests
join, leave or move) and passes the same object every step in between. A :class:`Plan` is
built the first time the sampler sees a new metadata object and reused while it stays the
same (:meth:`Plan.matches`): the :class:`~fastsample.StepParams` of the batch, the
:class:`~fastsample.TokenStats` when a row has penalties, and each row's key. Each step
costs the plan only the rows' positions (one vectorized read of the runner's host arrays)
and, with penalties, the state's update with the emitted tokens.

The mapping, field by field (vLLM 0.32, ``vllm/v1/sample/metadata.py`` and the built-in
logits processors of ``vllm/v1/sample/logits_processor/builtin.py``):

* A control whose rows all hold one legal value (a batch of one always does; serving batches
  often share their settings) is passed as that Python number, the shorter paths: a number
  and a tensor of it draw bitwise the same tokens.
* ``temperature``: 0.0 marks a greedy row (vLLM's rule ``T < 1e-5``; the input batch stores
  0.0, and ``SamplingParams`` raises 0 < T < 0.01 to 0.01); None: every row greedy.
* ``top_k`` (``V`` = off), ``top_p``, and min-p from the ``MinPLogitsProcessor``, in vLLM's
  order: ``cut_order="vllm"`` (min-p first, then top-k, then top-p on what is left).
* ``allowed_token_ids_mask`` (True = masked) becomes allowed ids; ``LogitBiasLogitsProcessor``'s
  biases the logit bias; ``MinTokensLogitsProcessor``'s rows (those still below their
  minimum, with all their stop ids) min-tokens; the three penalty tensors the penalties (a
  row with no penalty holds the off values).
* ``prompt_token_ids`` (padded with ``V``) and the emitted tokens build the TokenStats.
* ``generators``: a seeded row's ``torch.Generator`` was seeded with the request's seed,
  which ``initial_seed()`` returns; that seed is the row's key. An unseeded row's key is
  drawn from torch's global generator when its request first joins, and kept by request id.
* ``max_num_logprobs``, ``logprob_token_ids`` and the runner's ``logprobs_mode`` say what
  logprobs to return (:mod:`.logprobs`).
* ``SamplingParams.extra_args["fastsample"]`` (kept by the input batch per request): the new
  stages (:mod:`.request_stages`); DRY, no-repeat n-grams and ``penalty_last_n`` read a
  history of the latest context tokens kept in the TokenStats, mirostat its ``mu``.

A batch with something fastsample does not do gets ``unsupported`` (a reason) and is
sampled by vLLM's own code: bad words (vLLM's host loop over prefixes), custom logits
processors, a thinking-token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..ops.validation import check_controls
from ..stages import StepParams, TokenStats
from . import request_stages
from .batch import Rows
from .state import CALLS
from .stats import carried, stats_from_ids

_BUILTIN = ("MinPLogitsProcessor", "LogitBiasLogitsProcessor", "MinTokensLogitsProcessor")

def unsupported_reason(metadata) -> str | None:
    """Why vLLM's own code must sample this batch, or None."""
    if metadata.bad_words_token_ids:
        return "bad_words (vLLM's prefix matching runs on the host)"
    custom = [
        type(p).__name__ for p in metadata.logitsprocs.all if type(p).__name__ not in _BUILTIN
    ]
    if custom:
        return f"custom logits processors ({', '.join(sorted(set(custom)))})"
    if thinking_budget_active(metadata):
        return "a thinking-token budget"
    return None


def thinking_budget_active(metadata) -> bool:
    holder = getattr(metadata, "thinking_budget_state_holder", None)
    return holder is not None and holder.has_tracked_requests()


def _processor(metadata, name: str):
    return next((p for p in metadata.logitsprocs.all if type(p).__name__ == name), None)


def _as_int64(seed: int) -> int:
    """A generator's seed (an unsigned 64-bit int) as the int64 of the same bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def row_keys(metadata, rows: Rows, batch: int, device: torch.device,
             previous: dict[str, int]) -> tuple[Tensor, dict[str, int]]:  # fmt: skip
    """``(B,)`` int64 keys (a seeded row's seed, an unseeded request's random key) and the
    unseeded requests' keys by request id. A request keeps the key it got when it joined
    (``previous``); a new one is drawn from torch's global generator (as vLLM's own sampler
    draws an unseeded row's noise seed from it, every step)."""
    values = torch.randint(-(2**63), 2**63 - 1, (batch,), dtype=torch.int64).tolist()
    keys: dict[str, int] = {}
    if rows.req_ids is not None:
        values = [previous.get(r, v) for r, v in zip(rows.req_ids, values, strict=True)]
        keys = dict(zip(rows.req_ids, values, strict=True))
    for row, generator in metadata.generators.items():
        if 0 <= row < batch:
            values[row] = _as_int64(generator.initial_seed())
    return torch.tensor(values, dtype=torch.int64, device=device), keys


def _min_p(metadata, batch: int, device: torch.device) -> Tensor | None:
    proc = _processor(metadata, "MinPLogitsProcessor")
    if proc is None or not proc.min_p_count:
        return None
    return proc.min_p_cpu_tensor[:batch].to(device, copy=True)


def _logit_bias(metadata, batch: int):
    proc = _processor(metadata, "LogitBiasLogitsProcessor")
    if proc is None or not proc.biases:
        return None
    return [dict(proc.biases[b]) if b in proc.biases else None for b in range(batch)]


def _min_tokens(
    metadata, batch: int, device: torch.device
) -> tuple[Tensor, list[list[int] | None], bool] | None:
    """Per row the minimum, the stop ids, and whether a row also has a grammar."""
    proc = _processor(metadata, "MinTokensLogitsProcessor")
    if proc is None or not proc.min_toks:
        return None
    minimum = torch.zeros(batch, dtype=torch.int64, device=device)
    stops: list[list[int] | None] = [None] * batch
    structured = False
    for row, (count, _, stop_ids, grammar) in proc.min_toks.items():
        if 0 <= row < batch:
            minimum[row] = count
            stops[row] = sorted(stop_ids)
            structured = structured or bool(grammar)
    return minimum, stops, structured


def _allowed(metadata, batch: int) -> list[list[int] | None] | None:
    mask = metadata.allowed_token_ids_mask
    if mask is None:
        return None
    mask = mask[:batch]
    restricted = mask.any(-1).tolist()
    return [
        torch.nonzero(~mask[b]).flatten().tolist() if restricted[b] else None
        for b in range(batch)
    ]


def _as_numbers(controls: dict[str, Tensor | float | None], vocab: int) -> dict:
    """The controls whose rows all hold one legal value, as that Python number (a CPU tensor:
    the host read is free, once per plan). A number and a tensor of it give every row bitwise
    the same draws and logprobs (``tests/ops/test_tensor_controls_cpu.py``), and the number
    takes the shorter paths: nothing to read or range-check per step. Serving batches often
    share their settings, and a batch of one always does."""
    out = dict(controls)
    for name, value in controls.items():
        if not isinstance(value, Tensor) or value.device.type != "cpu" or value.numel() == 0:
            continue
        number = value[0].item()
        if not bool((value == number).all()):  # also keeps a NaN a tensor (NaN != NaN)
            continue
        single = dict.fromkeys(controls)
        single[name] = number
        try:  # an out-of-range value stays a tensor: its rows are flagged, not raised
            check_controls(**single, batch=value.numel(), vocab=vocab, device=value.device)
        except ValueError:
            continue
        out[name] = number
    return out


def _penalties(metadata) -> dict[str, Tensor]:
    if metadata.no_penalties:
        return {}
    return dict(
        repetition_penalty=metadata.repetition_penalties,
        frequency_penalty=metadata.frequency_penalties,
        presence_penalty=metadata.presence_penalties,
    )


@dataclass
class Plan:
    """What the sampler needs of one ``SamplingMetadata``, built once."""

    metadata: object
    batch: int
    vocab: int
    device: torch.device
    unsupported: str | None = None
    params: StepParams | None = None
    stats: TokenStats | None = None
    keys: Tensor | None = None
    rows: Rows | None = None
    counted: np.ndarray | None = None  # output lengths the plan has seen (the stats' too)
    num_logprobs: int | None = None
    logprob_ids: dict[int, list[int]] | None = None
    # vLLM's raw values come before its allowed-token mask, fastsample's after: with allowed
    # ids in a raw mode the plugin computes them itself (logprobs.raw_values).
    raw_before_allowed: bool = False
    request_keys: dict[str, int] | None = None  # unseeded requests' keys, by request id
    # A row with min-tokens and a grammar: vLLM lets its stop tokens through when the grammar
    # allows nothing else (MinTokensLogitsProcessor); the sampler redraws such rows.
    stops_yield_to_grammar: bool = False
    for_verify: bool = False
    history_cap: int = 0  # context tokens the history stages read at most

    @property
    def history(self) -> int:
        """Context tokens the state keeps now (:func:`.request_stages.fitted_width`)."""
        kept = None if self.stats is None else self.stats.history
        return 0 if kept is None else kept.shape[1]

    def matches(self, metadata, batch: int, vocab: int, verify: bool = False) -> bool:
        return (self.metadata is metadata and (self.batch, self.vocab) == (batch, vocab)
                and self.for_verify >= verify)  # fmt: skip

    def positions(self) -> Tensor:
        """``(B,)`` int64: each row's position, the tokens it has emitted so far.

        The runner's host arrays say it when the metadata came from its input batch; if they
        disagree with what the plan counted (the runner discarded a token the stats were
        updated with, e.g. one sampled for an unfinished chunked prefill), the stats are
        rebuilt first. Without an input batch (a dummy run, a benchmark) the plan counts."""
        assert self.rows is not None and self.counted is not None
        lengths = self.rows.lengths()
        if lengths is None:
            lengths = self.counted
        elif not np.array_equal(lengths, self.counted):
            if self.stats is not None:  # rebuild the rows that disagree
                source = np.where(lengths == self.counted, np.arange(self.batch), -1).tolist()
                self.stats = carried(self.stats, source, lambda which: build_stats(
                    self.metadata, self.rows, self.vocab, lengths, which,
                    self.history))  # fmt: skip
                CALLS["stats_rebuilds"] += 1
            self.counted = lengths.copy()
        self._fit_history(lengths)
        return torch.from_numpy(lengths).to(self.device)

    def _fit_history(self, lengths: np.ndarray) -> None:
        """Widen the history when a context outgrew it: every row rebuilt from the runner's
        token table (as wide as the contexts now, :func:`.request_stages.fitted_width`),
        mirostat's ``mu`` kept."""
        if not self.history_cap or self.stats is None or self.rows is None:
            return
        width = history_for(self.rows, self.history_cap, lengths)
        if width <= self.history:
            return
        mu = self.stats.mirostat_mu
        self.stats = build_stats(self.metadata, self.rows, self.vocab, lengths,
                                 list(range(self.batch)), width)  # fmt: skip
        self.stats.mirostat_mu = mu
        CALLS["stats_rebuilds"] += 1

    def emitted(self, counts: np.ndarray | int) -> None:
        """Rows emitted ``counts`` tokens this step (the stats were updated with them)."""
        assert self.counted is not None
        self.counted = self.counted + counts


def history_for(rows: Rows, cap: int, lengths: np.ndarray) -> int:
    """The history's width for rows that emitted ``lengths`` tokens: as wide as their
    contexts (prompt included), at most ``cap`` (``cap`` itself without an input batch)."""
    prompts = rows.prompt_lengths()
    if prompts is None:
        return cap
    return request_stages.fitted_width(cap, int((prompts + lengths).max(initial=0)))


def build_stats(metadata, rows: Rows, vocab: int, lengths: np.ndarray, which: list[int],
                history: int = 0) -> TokenStats:  # fmt: skip
    """The state of rows ``which`` now, from their prompts and emitted tokens (the runner's
    token table, else the metadata's lists), keeping ``history`` context tokens."""
    prompts = metadata.prompt_token_ids  # vLLM builds it only for the penalties
    index = torch.tensor(which, dtype=torch.int64)
    if prompts is not None:
        prompts = prompts.index_select(0, index.to(prompts.device))
    else:
        prompts = rows.prompt_ids(which)
        if prompts is None:
            prompts = torch.full((len(which), 0), -1, dtype=torch.int64)
    outputs = rows.output_ids(lengths, which)
    if outputs is None:  # no input batch (a dummy run, a benchmark): the metadata's lists
        lists = metadata.output_token_ids or []
        chosen = [list(lists[b]) if b < len(lists) else [] for b in which]
        outputs = torch.full((len(which), max(map(len, chosen), default=0)), -1)
        for row, tokens in enumerate(chosen):
            if tokens:
                outputs[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return stats_from_ids(prompts, outputs.to(prompts.device), vocab, history)


def plan_stats(metadata, rows: Rows, vocab: int, lengths: np.ndarray, previous: Plan | None,
               history: int = 0) -> TokenStats:  # fmt: skip
    """The batch's state: requests that were in ``previous`` with the lengths it counted keep
    their rows; the others are built (all of them without request ids). When the history's
    width changes, every row is built and the carried rows keep their mirostat ``mu``."""
    batch = len(lengths)
    source = [-1] * batch
    if (previous is not None and previous.stats is not None and previous.counted is not None
            and previous.rows is not None and previous.rows.req_ids and rows.req_ids):  # fmt: skip
        where = {req_id: row for row, req_id in enumerate(previous.rows.req_ids)}
        for b, req_id in enumerate(rows.req_ids):
            row = where.get(req_id, -1)
            if row >= 0 and previous.counted[row] == lengths[b]:
                source[b] = row
    def build(which: list[int]) -> TokenStats:
        return build_stats(metadata, rows, vocab, lengths, which, history)

    if previous is None or previous.stats is None or previous.history == history:
        return carried(previous.stats if previous is not None else None, source, build)
    stats = build(list(range(batch)))
    kept = [b for b in range(batch) if source[b] >= 0]
    if kept:
        index = torch.tensor(kept, dtype=torch.int64, device=stats.device)
        mu = previous.stats.mirostat_mu.index_select(0, index.new_tensor([source[b] for b in kept]))
        stats.mirostat_mu.index_copy_(0, index, mu)
    return stats


def build_plan(metadata, logits: Tensor, logprobs_mode: str, batch: int | None = None,
               previous: Plan | None = None, verify: bool = False) -> Plan:  # fmt: skip
    """The plan of a metadata object for ``logits`` (``batch`` requests: its rows unless
    given); the penalties' state of requests already in ``previous`` is carried over.
    ``verify``: for speculative verification, where min-tokens read the output lengths from
    the state too (each position adds its drafts), so min-tokens need one."""
    CALLS["plans"] += 1
    batch = logits.shape[0] if batch is None else batch
    vocab, device = logits.shape[1], logits.device
    rows = Rows(metadata, batch)
    reason = unsupported_reason(metadata)
    stage_rows = rows.stages()
    if reason is not None and any(stage_rows):
        reason += " (their requests' fastsample stages do not run there)"
    if reason is not None:
        return Plan(metadata, batch, vocab, device, unsupported=reason, rows=rows)
    greedy = metadata.all_greedy or metadata.temperature is None
    temperature = 0.0 if greedy else metadata.temperature[:batch]
    min_tokens = _min_tokens(metadata, batch, device)
    known = previous.request_keys if previous is not None and previous.request_keys else {}
    keys, request_keys = row_keys(metadata, rows, batch, device, known)
    num_logprobs = metadata.max_num_logprobs
    ids = metadata.logprob_token_ids or None
    wanted = num_logprobs is not None or ids is not None
    allowed = _allowed(metadata, batch)
    own_raw = wanted and allowed is not None and logprobs_mode.startswith("raw")
    if own_raw:  # fastsample computes none of them
        wanted, num_logprobs_fs, ids_fs = False, 0, None
    else:
        num_logprobs_fs = num_logprobs if num_logprobs and num_logprobs > 0 else 0
        ids_fs = ids
    controls = _as_numbers(dict(
        temperature=temperature,
        top_k=None if metadata.top_k is None else metadata.top_k[:batch],
        top_p=None if metadata.top_p is None else metadata.top_p[:batch],
        min_p=_min_p(metadata, batch, device),
    ), vocab)  # fmt: skip
    params = StepParams(
        batch, vocab,
        device=device,
        **controls,
        cut_order="vllm",
        seed=keys,
        allowed_token_ids=allowed,
        logit_bias=_logit_bias(metadata, batch),
        min_tokens=None if min_tokens is None else min_tokens[0],
        stop_token_ids=None if min_tokens is None else min_tokens[1],
        **_penalties(metadata),
        top_logprobs=num_logprobs_fs,
        # Raw mode costs a pass over the logits (their normalizer): only when asked for.
        logprobs_mode="raw" if wanted and logprobs_mode.startswith("raw") else "processed",
        token_ranks=wanted,
        logprob_token_ids=None if ids_fs is None else [ids_fs.get(b) for b in range(batch)],
        **request_stages.batch_settings(stage_rows, device),
    )  # fmt: skip
    lengths = rows.lengths()
    if lengths is None:  # no input batch: the metadata's output lists, if it has them
        lists = metadata.output_token_ids or []
        lengths = np.array([len(x) for x in lists[:batch]] + [0] * (batch - len(lists[:batch])),
                           dtype=np.int64)  # fmt: skip
    cap = request_stages.history_width(stage_rows, rows.context_limit or 0)
    history = history_for(rows, cap, lengths)
    stats = None
    if (params.penalties_on or history or request_stages.mirostat_on(stage_rows)
            or (verify and params.stop_ids is not None)):  # fmt: skip
        stats = plan_stats(metadata, rows, vocab, lengths, previous, history)
    return Plan(metadata, batch, vocab, device, None, params, stats, params.seed, rows,
                lengths.copy(), num_logprobs, ids, own_raw, request_keys,
                min_tokens is not None and min_tokens[2], verify, cap)  # fmt: skip
