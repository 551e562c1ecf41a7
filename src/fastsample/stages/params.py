"""The per-batch parameters of the sampling step: one object, built when the batch changes.

:class:`StepParams` gathers every per-request setting of :func:`fastsample.sample_step`, as
vLLM's ``SamplingMetadata`` does: the controls (temperature, top-k, top-p, min-p, their
order), the seeds, the allowed tokens, logit bias, min-tokens, the three penalties and what
to return as logprobs. An engine builds it when requests join or leave and passes the same
object every step; only the logits, the step counter, the grammar bitmask and the
:class:`~fastsample.stages.state.TokenStats` change between steps.

Every field is off by default, and an off field costs nothing. A setting is a Python number
(one value for the batch, range-checked here, an off value such as ``repetition_penalty=1``
switches the stage off) or a ``(B,)`` tensor on the logits' device (one value per row; a
value out of range makes its row invalid at every step, without a host sync). Per-request
token lists (allowed ids, stop ids, logit bias, requested logprob ids) are Python lists (one
entry per row, checked here: an id out of range raises) or ``-1``-padded ``(B, M)`` tensors
(an out-of-range id makes its row invalid). The checks of tensor values run once, here, as
device ops; ``check_values()`` reads them on the host and raises naming the first bad row
(``check=True`` calls it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..ops import bitmask
from ..ops import validation as v
from ..ops.validation import Controls, check_controls
from .samplers import Samplers
from .state import padded_ids

LOGPROBS_MODES = ("processed", "raw")
"""``"processed"``: log-probabilities of the distribution drawn from (after every stage);
``"raw"``: of the logits as given, after the grammar bitmask and allowed tokens only (vLLM's
``raw_logprobs``)."""

Number = float | int
Setting = Number | Tensor | None
IdLists = Sequence[Sequence[int] | None] | Tensor


def _finite(value: Tensor) -> Tensor:
    return value.abs() < math.inf  # NaN fails too


class StepParams:
    """Per-request parameters of a batch for :func:`fastsample.sample_step` (see the module
    docstring for the forms each setting takes).

    Args:
        batch, vocab: the logits' ``(B, V)``.
        device: the logits' device (default CPU); tensors given here must live there.
        temperature, top_k, top_p, min_p, cut_order: as in :func:`fastsample.sample`
            (``cut_order``: ``"transformers"``, ``"vllm"`` or ``"joint"``).
        num_samples: draws without replacement per row.
        seed, stream: per-request counter-based randomness (Python ints or ``(B,)`` int64);
            the step counter is given per call. None: a ``torch.Generator`` per call.
        allowed_token_ids: the only tokens a row may draw: per row a list (None: no
            restriction) or ``(B, M)`` ids padded with -1 (a row of only -1: no restriction).
            Kept as a packed bitmask, applied like a grammar bitmask.
        logit_bias: added to the logits: per row a ``{token_id: bias}`` dict (or None), or a
            pair of ``(B, M)`` tensors ``(ids padded with -1, float values)``; an id listed
            twice in a row gets the sum.
        min_tokens, stop_token_ids: while a row has emitted fewer than ``min_tokens[b]`` tokens
            its ``stop_token_ids`` get logit ``-inf``. ``min_tokens`` is an int or ``(B,)``
            int64; the stop ids per row as lists or a -1-padded ``(B, S)`` tensor.
        repetition_penalty: ``r > 0`` (off: 1). Tokens seen in the prompt or the output: a
            logit ``x > 0`` becomes ``x / r``, any other ``x * r``.
        frequency_penalty: ``f`` (off: 0); subtracts ``f * count`` (output count).
        presence_penalty: ``p`` (off: 0); subtracts ``p`` where the output count is > 0.
        top_logprobs: ``N >= 0``: also return the N most likely tokens with their logprobs.
        logprobs_mode: ``"processed"`` or ``"raw"`` (see :data:`LOGPROBS_MODES`).
        token_ranks: also return each drawn token's rank (vLLM's: the number of tokens at
            least as likely, itself included).
        logprob_token_ids: per-row token ids whose logprobs to return (lists or a -1-padded
            ``(B, M)`` tensor).
        order: the chain's order of the truncation stages and temperature: a preset
            (``"transformers"``, ``"vllm"``, ``"joint"``, ``"llama.cpp"``) or a sequence of
            stage names (:data:`fastsample.stages.samplers.TRUNCATION_STAGES`); None: the
            ``cut_order`` preset.
        typical_p, epsilon_cutoff, eta_cutoff, top_n_sigma, xtc_probability, xtc_threshold,
        dynatemp_range, dynatemp_exponent, mirostat_tau, mirostat_eta, penalty_last_n,
        dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n,
        dry_sequence_breakers, no_repeat_ngram_size: the stages of
            :mod:`fastsample.stages.samplers` (each off by default; its docstring gives the
            definitions, ranges and off values).

    Example:
        >>> params = StepParams(2, 1000, temperature=0.7, top_p=0.9, repetition_penalty=1.2,
        ...                     logit_bias=[{5: 2.0}, None], seed=torch.tensor([1, 2]))
        >>> params.penalties_on, params.batch
        (True, 2)
    """

    def __init__(
        self,
        batch: int,
        vocab: int,
        *,
        device: torch.device | str | None = None,
        temperature: Setting = None,
        top_k: Setting = None,
        top_p: Setting = None,
        min_p: Setting = None,
        cut_order: str = "transformers",
        num_samples: int = 1,
        seed: int | Tensor | None = None,
        stream: int | Tensor = 0,
        allowed_token_ids: IdLists | None = None,
        logit_bias: Sequence[Mapping[int, float] | None] | tuple[Tensor, Tensor] | None = None,
        min_tokens: int | Tensor | None = None,
        stop_token_ids: IdLists | None = None,
        repetition_penalty: Setting = None,
        frequency_penalty: Setting = None,
        presence_penalty: Setting = None,
        top_logprobs: int = 0,
        logprobs_mode: str = "processed",
        token_ranks: bool = False,
        logprob_token_ids: IdLists | None = None,
        order: str | Sequence[str] | None = None,
        typical_p: Setting = None,
        epsilon_cutoff: Setting = None,
        eta_cutoff: Setting = None,
        top_n_sigma: Setting = None,
        xtc_probability: Setting = None,
        xtc_threshold: Setting = None,
        dynatemp_range: Setting = None,
        dynatemp_exponent: Setting = None,
        mirostat_tau: Setting = None,
        mirostat_eta: Setting = None,
        penalty_last_n: Setting = None,
        dry_multiplier: Setting = None,
        dry_base: Setting = None,
        dry_allowed_length: Setting = None,
        dry_penalty_last_n: Setting = None,
        dry_sequence_breakers: Sequence[Sequence[Sequence[int] | int] | None] | None = None,
        no_repeat_ngram_size: Setting = None,
    ) -> None:
        for name, value in (("batch", batch), ("vocab", vocab)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if batch < 0 or vocab < 1:
            raise ValueError(f"batch must be >= 0 and vocab >= 1, got {batch} and {vocab}")
        self.batch, self.vocab = batch, vocab
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.controls: Controls = check_controls(
            temperature, top_k, top_p, min_p, batch, vocab, self.device, cut_order
        )
        self.num_samples = v.check_num_samples(num_samples, vocab)
        self._ok: list[Tensor] = []
        self.samplers = Samplers(
            batch, vocab, self.device, order, cut_order,
            {"typical_p": typical_p, "epsilon_cutoff": epsilon_cutoff, "eta_cutoff": eta_cutoff,
             "top_n_sigma": top_n_sigma, "xtc_probability": xtc_probability,
             "xtc_threshold": xtc_threshold, "dynatemp_range": dynatemp_range,
             "dynatemp_exponent": dynatemp_exponent, "mirostat_tau": mirostat_tau,
             "mirostat_eta": mirostat_eta, "penalty_last_n": penalty_last_n,
             "dry_multiplier": dry_multiplier, "dry_base": dry_base,
             "dry_allowed_length": dry_allowed_length, "dry_penalty_last_n": dry_penalty_last_n,
             "no_repeat_ngram_size": no_repeat_ngram_size},
            dry_sequence_breakers,
        )  # fmt: skip
        self.samplers.check_order_covers(self.controls)
        self._ok += self.samplers.ok
        if self.samplers.chain_on and self.num_samples > 1 and self.samplers.on("mirostat"):
            raise ValueError("mirostat draws one token a step: num_samples must be 1")
        self.seed, self.stream = seed, stream
        if seed is None and not (isinstance(stream, int) and stream == 0):
            raise ValueError("stream was given without seed; pass seed=... as well")

        self.repetition_penalty = self._penalty(repetition_penalty, "repetition_penalty", 1.0)
        self.frequency_penalty = self._penalty(frequency_penalty, "frequency_penalty", 0.0)
        self.presence_penalty = self._penalty(presence_penalty, "presence_penalty", 0.0)

        self.allowed_mask = None
        if allowed_token_ids is not None:
            ids = self._ids(allowed_token_ids, "allowed_token_ids", empty_ok=False)
            # A row with no id (a Python None, or only -1) has no restriction: all bits set.
            listed = bitmask.from_ids(ids, vocab)
            free = ~((ids >= 0) & (ids < vocab)).any(-1) if ids.shape[1] else None
            if free is None:
                listed = torch.full_like(listed, -1)
            else:
                listed = torch.where(free[:, None], torch.full_like(listed, -1), listed)
            self.allowed_mask = listed

        self.bias_ids = self.bias_values = None
        if logit_bias is not None:
            self.bias_ids, self.bias_values = self._bias(logit_bias)

        self.stop_ids, self.min_tokens = None, None
        if min_tokens is not None or stop_token_ids is not None:
            if min_tokens is None or stop_token_ids is None:
                raise ValueError("min_tokens and stop_token_ids go together: pass both")
            self.min_tokens = self._min_tokens(min_tokens)
            if self.min_tokens is not None:
                self.stop_ids = self._ids(stop_token_ids, "stop_token_ids")

        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int):
            raise TypeError(f"top_logprobs must be a Python int, got {type(top_logprobs).__name__}")
        if not 0 <= top_logprobs <= vocab:
            raise ValueError(
                f"top_logprobs must be between 0 and the vocabulary size {vocab}, got "
                f"{top_logprobs}"
            )
        self.top_logprobs = top_logprobs
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(map(repr, LOGPROBS_MODES))}, got "
                f"{logprobs_mode!r}"
            )
        self.logprobs_mode = logprobs_mode
        self.token_ranks = v.check_flag(token_ranks, "token_ranks")
        self.logprob_token_ids = None
        if logprob_token_ids is not None:
            self.logprob_token_ids = self._ids(logprob_token_ids, "logprob_token_ids")

        ok = None
        for flags in self._ok:
            ok = flags if ok is None else ok & flags
        self.rows_ok: Tensor | None = ok
        """``(B,)`` bool: the rows whose tensor settings here are in range (None: all)."""
        del self._ok

    # ------------------------------------------------------------------ what is on

    @property
    def penalties_on(self) -> bool:
        return any(
            p is not None
            for p in (self.repetition_penalty, self.frequency_penalty, self.presence_penalty)
        )

    @property
    def edits_logits(self) -> bool:
        """Whether a stage before the controls changes the logits (bias, min-tokens, a
        penalty, DRY, no-repeat n-grams) or the chain runs: those need logits, not
        probabilities."""
        return (self.bias_ids is not None or self.stop_ids is not None or self.penalties_on
                or self.samplers.history_on or self.samplers.chain_on)  # fmt: skip

    @property
    def chain_on(self) -> bool:
        """Whether the step runs the sampler chain (:mod:`fastsample.stages.chain`)."""
        return self.samplers.chain_on

    @property
    def mirostat_tau(self) -> float | Tensor | None:
        return self.samplers.mirostat_tau  # type: ignore[attr-defined]

    @property
    def mirostat_eta(self) -> float | Tensor | None:
        return self.samplers.mirostat_eta  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ checks

    def _tensor(self, value: Tensor, name: str, integral: bool) -> Tensor:
        kind = "int" if integral else "float"
        return v._check_tensor(value, name, self.batch, self.device, kind)

    def _penalty(self, value: Setting, name: str, off: float) -> Tensor | float | None:
        if value is None:
            return None
        if isinstance(value, Tensor):
            value = self._tensor(value, name, integral=False)
            if name == "repetition_penalty":
                self._ok.append((value > 0) & (value < math.inf))
            else:
                self._ok.append(_finite(value))
            return value
        number = float(v._check_number(value, name, "float"))
        if name == "repetition_penalty" and not number > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {number!r}")
        return None if number == off else number

    def _ids(self, rows: IdLists, name: str, empty_ok: bool = True) -> Tensor:
        """``(B, M)`` int64 ids, -1 padded; list entries are range-checked (raise), tensor
        entries flag their row."""
        if isinstance(rows, Tensor):
            if rows.device != self.device:
                raise ValueError(f"{name} is on {rows.device} but the data is on {self.device}")
            ids = padded_ids(rows, None, name)
            if ids.shape[0] != self.batch:
                raise ValueError(f"{name} must have {self.batch} rows, got {ids.shape[0]}")
            fine = ((ids >= 0) & (ids < self.vocab)) | (ids == -1)
            self._ok.append(fine.all(-1))
            return ids
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
            raise TypeError(f"{name} must be a list of token-id lists (one per row) or a tensor")
        if len(rows) != self.batch:
            raise ValueError(f"{name} must have one entry per row ({self.batch}), got {len(rows)}")
        for b, row in enumerate(rows):
            if row is None:
                continue
            if not empty_ok and len(row) == 0:
                raise ValueError(f"{name}[{b}] is empty: no token could be drawn (None: any)")
            for token in row:
                is_int = isinstance(token, int) and not isinstance(token, bool)
                if is_int and not 0 <= token < self.vocab:
                    raise ValueError(f"{name}[{b}] holds {token}, outside [0, {self.vocab})")
        return padded_ids(rows, self.device, name)

    def _bias(self, logit_bias) -> tuple[Tensor, Tensor]:
        if isinstance(logit_bias, tuple):
            if len(logit_bias) != 2 or not all(isinstance(t, Tensor) for t in logit_bias):
                raise TypeError("logit_bias as tensors is a pair (ids, values) of (B, M) tensors")
            ids = self._ids(logit_bias[0], "logit_bias ids")
            values = logit_bias[1]
            if values.device != self.device or not values.dtype.is_floating_point:
                raise ValueError(f"logit_bias values must be floating, on {self.device}")
            if tuple(values.shape) != tuple(ids.shape):
                raise ValueError(
                    f"logit_bias values have shape {tuple(values.shape)}, ids {tuple(ids.shape)}"
                )
            values = values.to(torch.float32)
            self._ok.append((_finite(values) | (ids == -1)).all(-1))
            return ids, torch.where(ids == -1, 0.0, values)
        if isinstance(logit_bias, str | bytes) or not isinstance(logit_bias, Sequence):
            raise TypeError("logit_bias must be a list of {token_id: bias} dicts (one per row)")
        if len(logit_bias) != self.batch:
            raise ValueError(
                f"logit_bias must have one entry per row ({self.batch}), got {len(logit_bias)}"
            )
        rows: list[list[int]] = []
        biases: list[list[float]] = []
        for b, entry in enumerate(logit_bias):
            entry = entry or {}
            if not isinstance(entry, Mapping):
                raise TypeError(f"logit_bias[{b}] must be a dict {{token_id: bias}} or None")
            for token, bias in entry.items():
                if isinstance(token, bool) or not isinstance(token, int):
                    raise TypeError(f"logit_bias[{b}] keys must be int token ids, got {token!r}")
                if not 0 <= token < self.vocab:
                    raise ValueError(f"logit_bias[{b}] holds {token}, outside [0, {self.vocab})")
                v._check_number(bias, f"logit_bias[{b}][{token}]", "float")
            rows.append(list(entry.keys()))
            biases.append([float(x) for x in entry.values()])
        ids = padded_ids(rows, self.device, "logit_bias")
        values = torch.zeros(ids.shape, dtype=torch.float32)
        for b, row in enumerate(biases):
            if row:
                values[b, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return ids, values.to(self.device)

    def _min_tokens(self, value: int | Tensor) -> int | Tensor | None:
        if isinstance(value, Tensor):
            value = self._tensor(value, "min_tokens", integral=True).to(torch.int64)
            self._ok.append(value >= 0)
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"min_tokens must be an int or a (B,) int tensor, got {value!r}")
        if value < 0:
            raise ValueError(f"min_tokens must be >= 0 (0 = off), got {value}")
        return value or None

    def check_values(self) -> None:
        """Raise ``ValueError`` naming the first row with an out-of-range tensor setting (reads
        the values on the host: it syncs; ``check=True`` calls it)."""
        v.check_control_values(self.controls)
        if self.rows_ok is not None and not bool(self.rows_ok.all()):
            row = int((~self.rows_ok).to(torch.uint8).argmax())
            raise ValueError(
                f"row {row} has an out-of-range setting: a penalty (repetition must be > 0 and "
                "finite, frequency and presence finite), a token id outside [0, vocab) and not "
                "-1, a non-finite logit bias, or a negative min_tokens"
            )

    # ------------------------------------------------------------------ rows

    def repeat_rows(self, times: int) -> StepParams:
        """These parameters for a batch in which every row is repeated ``times`` times in a
        row (``repeat_interleave``): the target positions of speculative verification."""
        out = object.__new__(StepParams)
        out.__dict__.update(self.__dict__)
        out.batch = self.batch * times

        def rows(value):
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == self.batch:
                return value.repeat_interleave(times, dim=0)
            return value

        c = self.controls
        out.controls = Controls(
            rows(c.temperature), rows(c.top_k), rows(c.top_p), rows(c.min_p), c.cut_order
        )
        for name in (
            "seed", "stream", "repetition_penalty", "frequency_penalty", "presence_penalty",
            "allowed_mask", "bias_ids", "bias_values", "stop_ids", "min_tokens",
            "logprob_token_ids", "rows_ok",
        ):  # fmt: skip
            setattr(out, name, rows(getattr(self, name)))
        out.samplers = self.samplers.repeat_rows(rows)
        return out

    def __repr__(self) -> str:
        on = [
            name
            for name, value in (
                ("allowed", self.allowed_mask), ("bias", self.bias_ids),
                ("min_tokens", self.stop_ids), ("penalties", self.penalties_on or None),
                ("logprob_ids", self.logprob_token_ids),
            )
            if value is not None
        ]  # fmt: skip
        return f"StepParams(batch={self.batch}, vocab={self.vocab}, stages={on}, {self.controls})"
