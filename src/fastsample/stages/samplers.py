"""The samplers users ask engines for, as per-request settings: checked here, run in a chain.

:class:`Samplers` holds the settings of the stages beyond temperature, top-k, top-p and
min-p, and the chain's order (:data:`ORDERS`). Each setting is off by default and free when
off; it is a Python number (range-checked here; its off value switches the stage off for the
batch) or a ``(B,)`` tensor (a value out of range makes its row invalid, no host sync).

Truncation stages (the chain, :mod:`fastsample.stages.chain`, ops in
:mod:`fastsample.ops.truncation`):

* ``typical_p`` (off 1): locally typical sampling (Hugging Face, llama.cpp ``typical``);
* ``epsilon_cutoff``, ``eta_cutoff`` (off 0): Hugging Face's warpers;
* ``top_n_sigma`` (off: <= 0): keep logits ``>= max - n sigma`` (llama.cpp, the paper);
* ``xtc_probability`` (off 0), ``xtc_threshold`` (default 0.1): llama.cpp's XTC;
* ``dynatemp_range`` (off 0), ``dynatemp_exponent`` (default 1): llama.cpp's ``temp_ext``,
  the temperature stage scaled by the entropy;
* ``mirostat_tau`` (off: None or 0), ``mirostat_eta`` (default 0.1): mirostat v2, ``mu`` in the
  :class:`~fastsample.stages.state.TokenStats`.

History stages (logit edits before the chain, :mod:`fastsample.stages.history`; they need a
``TokenStats`` built with ``history=``):

* ``penalty_last_n`` (0: the penalties as before; ``n > 0``: all three over the last ``n``
  context tokens; ``-1``: over the whole kept history), llama.cpp's window;
* DRY: ``dry_multiplier`` (off 0), ``dry_base`` (1.75), ``dry_allowed_length`` (2),
  ``dry_penalty_last_n`` (-1: the whole kept history), ``dry_sequence_breakers``;
* ``no_repeat_ngram_size`` (off 0): Hugging Face's ``NoRepeatNGramLogitsProcessor``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..ops import validation as v

TRUNCATION_STAGES = (
    "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "epsilon_cutoff",
    "eta_cutoff", "temperature", "mirostat",
)  # fmt: skip
"""The names a custom ``order`` may list (``temperature`` includes dynamic temperature)."""

ORDERS: dict[str, tuple[str | tuple[str, str], ...]] = {
    # Hugging Face's warpers (temperature, top-k, top-p, min-p, typical, epsilon, eta); the
    # stages it lacks where they change least: top-n-sigma first (it is temperature-free),
    # XTC and mirostat last.
    "transformers": ("temperature", "top_n_sigma", "top_k", "top_p", "min_p", "typical_p",
                     "epsilon_cutoff", "eta_cutoff", "xtc", "mirostat"),
    # vLLM's: min-p before top-k and top-p.
    "vllm": ("temperature", "top_n_sigma", "min_p", "top_k", "top_p", "typical_p",
             "epsilon_cutoff", "eta_cutoff", "xtc", "mirostat"),
    # SGLang's and FlashInfer's: top-k and top-p each on the same distribution, intersected.
    "joint": ("temperature", "top_n_sigma", ("top_k", "top_p"), "min_p", "typical_p",
              "epsilon_cutoff", "eta_cutoff", "xtc", "mirostat"),
    # llama.cpp's default chain (common.h), temperature last; epsilon and eta (which it
    # lacks) after min-p; mirostat, its terminal sampler, last.
    "llama.cpp": ("top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc",
                  "epsilon_cutoff", "eta_cutoff", "temperature", "mirostat"),
}  # fmt: skip
LEGACY_ORDERS = ("transformers", "vllm", "joint")
"""The presets of ``cut_order``: with no new stage on they take the controls' own paths."""

Setting = float | int | Tensor | None

# name -> (kind, rule, the rule's text, the off value or None). A rule takes a Python number
# or a tensor (``&`` of comparisons works on both), so numbers and tensor rows share it.
_SPECS: dict[str, tuple[str, Callable, str, float | None]] = {
    "typical_p": ("float", lambda x: (x > 0) & (x <= 1), "in (0, 1] (1 = off)", 1.0),
    "epsilon_cutoff": ("float", lambda x: (x >= 0) & (x < 1), "in [0, 1) (0 = off)", 0.0),
    "eta_cutoff": ("float", lambda x: (x >= 0) & (x < 1), "in [0, 1) (0 = off)", 0.0),
    "top_n_sigma": ("float", lambda x: True, "finite (<= 0 = off)", None),
    "xtc_probability": ("float", lambda x: (x >= 0) & (x <= 1), "in [0, 1] (0 = off)", 0.0),
    "xtc_threshold": ("float", lambda x: (x >= 0) & (x <= 1), "in [0, 1]", None),
    "dynatemp_range": ("float", lambda x: x >= 0, ">= 0 (0 = off)", 0.0),
    "dynatemp_exponent": ("float", lambda x: x >= 0, ">= 0", None),
    # 0 is off, as a tensor row's off value must be in range (mirostat_update skips it too).
    "mirostat_tau": ("float", lambda x: x >= 0, ">= 0 (0 or None = off)", 0.0),
    "mirostat_eta": ("float", lambda x: x >= 0, ">= 0", None),
    "penalty_last_n": ("int", lambda x: x >= -1, ">= -1 (0 = the whole output, as vLLM)", 0),
    "dry_multiplier": ("float", lambda x: x >= 0, ">= 0 (0 = off)", 0.0),
    "dry_base": ("float", lambda x: x >= 1, ">= 1", None),
    "dry_allowed_length": ("int", lambda x: x >= 0, ">= 0", None),
    "dry_penalty_last_n": ("int", lambda x: x >= -1,
                           ">= -1 (-1 = the whole history, 0 = DRY off)", None),
    "no_repeat_ngram_size": ("int", lambda x: x >= 0, ">= 0 (0 = off)", 0),
}  # fmt: skip
DEFAULTS = {"xtc_threshold": 0.1, "dynatemp_exponent": 1.0, "mirostat_eta": 0.1,
            "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1}  # fmt: skip


def _in_range(name: str, value: Tensor) -> Tensor:
    """``(B,)`` bool: a tensor setting's rows inside its rule and finite (NaN fails)."""
    return _SPECS[name][1](value) & (value.abs() < math.inf)


class Samplers:
    """The checked settings of the new stages and the chain's order (see the module
    docstring). ``ok`` collects the ``(B,)`` range flags of tensor settings."""

    def __init__(
        self, batch: int, vocab: int, device: torch.device, order: object, cut_order: str,
        values: dict[str, Setting], breakers: object,
    ) -> None:  # fmt: skip
        self.batch, self.vocab, self.device = batch, vocab, device
        self.ok: list[Tensor] = []
        for name in _SPECS:
            setattr(self, name, self._check(name, values.get(name)))
        self.dry_sequence_breakers = self._breakers(breakers)
        self.breaker_table, self.single_breakers = breaker_tables(
            self.dry_sequence_breakers, device
        )
        self.order = self._order(order, cut_order)

    # ------------------------------------------------------------------ what is on

    def on(self, stage: str) -> bool:
        """Whether a truncation stage of :data:`TRUNCATION_STAGES` (not temperature, top-k,
        top-p, min-p: the controls say those) is on for the batch."""
        if stage == "xtc":
            return self.xtc_probability is not None  # type: ignore[attr-defined]
        if stage == "mirostat":
            return self.mirostat_tau is not None  # type: ignore[attr-defined]
        return getattr(self, stage, None) is not None

    def stage_on(self, stage: str, controls: v.Controls) -> bool:
        """Whether any stage of :data:`TRUNCATION_STAGES` is on for the batch, the controls
        (temperature, top-k, top-p, min-p) included."""
        if stage == "temperature":
            return controls.temperature is not None or self.dynatemp_on
        if stage in _CONTROLS:
            return getattr(controls, stage) is not None
        return self.on(stage)

    @property
    def truncation_on(self) -> bool:
        return any(self.on(s) for s in TRUNCATION_STAGES if s not in _CONTROLS)

    @property
    def dynatemp_on(self) -> bool:
        return self.dynatemp_range is not None  # type: ignore[attr-defined]

    @property
    def history_on(self) -> bool:
        """A stage that reads the token history (DRY, no-repeat n-grams, windowed penalties)."""
        names = ("penalty_last_n", "dry_multiplier", "no_repeat_ngram_size")
        return any(getattr(self, n) is not None for n in names)

    @property
    def chain_on(self) -> bool:
        """Whether the step takes the chain (:mod:`fastsample.stages.chain`) rather than the
        controls' own paths: a new truncation stage, dynamic temperature, or an order the
        controls do not know."""
        return self.truncation_on or self.dynatemp_on or self.preset not in LEGACY_ORDERS

    # ------------------------------------------------------------------ checks

    def _check(self, name: str, value: Setting) -> Setting:
        kind, rule, text, off = _SPECS[name]
        if value is None:
            value = DEFAULTS.get(name)
            if value is None:
                return None
        if isinstance(value, Tensor):
            value = v._check_tensor(value, name, self.batch, self.device, kind)
            self.ok.append(_in_range(name, value))
            return value
        number = v._check_number(value, name, kind)
        if not rule(number):
            raise ValueError(f"{name} must be {text}, got {number!r}")
        if (off is not None and number == off) or (name == "top_n_sigma" and number <= 0):
            return None
        return float(number) if kind == "float" else int(number)

    def _breakers(self, breakers: object) -> list[list[list[int]]] | None:
        """Per row, the DRY sequence breakers as token-id sequences (``None``: none)."""
        if breakers is None:
            return None
        if isinstance(breakers, str | bytes) or not isinstance(breakers, Sequence):
            raise TypeError("dry_sequence_breakers must be a list (one entry per row) of lists "
                            "of token-id sequences")  # fmt: skip
        if len(breakers) != self.batch:
            raise ValueError(f"dry_sequence_breakers must have one entry per row "
                             f"({self.batch}), got {len(breakers)}")  # fmt: skip
        rows: list[list[list[int]]] = []
        for b, row in enumerate(breakers):
            sequences = []
            for seq in row or ():
                if isinstance(seq, int) and not isinstance(seq, bool):
                    seq = [seq]  # one token
                seq = list(seq)
                for token in seq:
                    if isinstance(token, bool) or not isinstance(token, int):
                        raise TypeError(f"dry_sequence_breakers[{b}] holds {token!r}: token ids "
                                        "must be Python ints")  # fmt: skip
                    if not 0 <= token < self.vocab:
                        raise ValueError(f"dry_sequence_breakers[{b}] holds {token}, outside "
                                         f"[0, {self.vocab})")  # fmt: skip
                if seq:  # an empty breaker breaks nothing (llama.cpp skips empty strings)
                    sequences.append(seq)
            rows.append(sequences)
        return rows

    @property
    def preset(self) -> str:
        return self._preset

    def _order(self, order: object, cut_order: str) -> tuple[str | tuple[str, str], ...]:
        if order is None:
            self._preset = cut_order
            return ORDERS[cut_order]
        if isinstance(order, str):
            if order not in ORDERS:
                raise ValueError(f"order must be one of {', '.join(map(repr, ORDERS))} or a "
                                 f"sequence of stage names, got {order!r}")  # fmt: skip
            if cut_order != "transformers" and order != cut_order:
                raise ValueError(f"cut_order={cut_order!r} and order={order!r} disagree: "
                                 "pass order only")  # fmt: skip
            self._preset = order
            return ORDERS[order]
        if not isinstance(order, Sequence) or not all(isinstance(s, str) for s in order):
            raise TypeError("order must be a preset name or a sequence of stage names")
        names = list(order)
        unknown = [s for s in names if s not in TRUNCATION_STAGES]
        if unknown:
            raise ValueError(f"order names unknown stages {unknown}; the stages are "
                             f"{', '.join(TRUNCATION_STAGES)}")  # fmt: skip
        if len(set(names)) != len(names):
            raise ValueError(f"order lists a stage twice: {names}")
        if "mirostat" in names and names[-1] != "mirostat":
            raise ValueError("mirostat draws the token: it must come last in order")
        self._preset = "custom"
        return tuple(names)

    def check_order_covers(self, controls: v.Controls) -> None:
        """Raise if a stage that is on is missing from a custom order."""
        if self._preset != "custom":
            return
        missing = [s for s in TRUNCATION_STAGES
                   if self.stage_on(s, controls) and s not in self.order]  # fmt: skip
        if missing:
            raise ValueError(f"order leaves out stages that are on: {missing}")

    # ------------------------------------------------------------------ rows

    def repeat_rows(self, rows: Callable[[object], object]) -> Samplers:
        """These settings for a batch whose rows are ``rows`` of this one's (``rows`` maps a
        ``(B, ...)`` tensor to the new batch's)."""
        out = object.__new__(Samplers)
        out.__dict__.update(self.__dict__)
        for name in (*_SPECS, "breaker_table", "single_breakers"):
            setattr(out, name, rows(getattr(self, name)))
        index = rows(torch.arange(self.batch))
        assert isinstance(index, Tensor)
        out.batch = index.shape[0]
        if self.dry_sequence_breakers is not None:
            out.dry_sequence_breakers = [self.dry_sequence_breakers[i] for i in index.tolist()]
        return out


def breaker_tables(
    breakers: list[list[list[int]]] | None, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """DRY's sequence breakers as tensors, built once: ``(B, S, L)`` int64 sequences aligned
    to the right (``-3`` before a shorter one's start) and ``(B, S1)`` the one-token ones
    (``-3`` padding); None without breakers."""
    if breakers is None or not any(breakers):
        return None, None
    count = max(len(row) for row in breakers)
    longest = max(len(seq) for row in breakers for seq in row)
    pad = -3
    table = [[[pad] * (longest - len(seq)) + seq for seq in row]
             + [[pad] * longest] * (count - len(row)) for row in breakers]  # fmt: skip
    singles = [[seq[0] for seq in row if len(seq) == 1] for row in breakers]
    width = max(1, max(len(row) for row in singles))
    singles = [row + [pad] * (width - len(row)) for row in singles]
    return (torch.tensor(table, dtype=torch.int64, device=device),
            torch.tensor(singles, dtype=torch.int64, device=device))  # fmt: skip


_CONTROLS = ("temperature", "top_k", "top_p", "min_p")
