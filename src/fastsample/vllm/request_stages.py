"""The stages a vLLM request asks for in ``SamplingParams(extra_args={"fastsample": {...}})``.

vLLM's documented way to give a request arguments its sampler does not know is
``SamplingParams.extra_args``; the plugin reads the ``"fastsample"`` entry, a dict of
:class:`fastsample.StepParams`' stage settings (:data:`ARGS`), per request::

    SamplingParams(temperature=0.8, extra_args={"fastsample": {
        "dry_multiplier": 0.8, "dry_sequence_breakers": [[198], [25]],   # token-id sequences
        "xtc_probability": 0.5, "xtc_threshold": 0.1, "typical_p": 0.9}})

The stages run in vLLM's order (``order="vllm"``: min-p, then top-k and top-p, then the new
truncation stages, mirostat last); a batch mixes requests with and without them, each row
with its own values. Three places use this module:

* the front end (:func:`check`, wrapped around vLLM's per-request check of logits-processor
  arguments): a bad entry is the request's error, naming the argument, before any work;
* each runner's plan (:func:`batch_settings`): the rows' settings as ``StepParams`` keywords,
  a Python number where every row agrees (the shorter paths), else a ``(B,)`` tensor whose
  rows without the stage hold its off value;
* the state (:func:`history_width`, :func:`fitted_width`): how many context tokens DRY,
  no-repeat n-grams and ``penalty_last_n`` read, capped by the model's context length and
  kept only as wide as the batch's contexts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..stages.samplers import _SPECS, DEFAULTS, Samplers

KEY = "fastsample"
"""The ``extra_args`` entry the plugin reads."""

ARGS = (*_SPECS, "dry_sequence_breakers")
"""The settings a request may give (:class:`fastsample.StepParams`' names and meanings;
``dry_sequence_breakers`` is one list of token-id sequences)."""

_OFF = {name: spec[3] for name, spec in _SPECS.items() if spec[3] is not None}
_OFF["top_n_sigma"] = 0.0  # any value <= 0 is off
# A tensor row without the stage: its off value, or the setting's default (a dial).
ROW_DEFAULTS = {**_OFF, **DEFAULTS}


def requested(extra_args: object) -> dict | None:
    """A request's fastsample settings (``extra_args["fastsample"]``), or None."""
    if not isinstance(extra_args, dict):
        return None
    value = extra_args.get(KEY)
    return value if value else None


def check(extra_args: object, vocab: int | None = None) -> dict | None:
    """The request's settings, checked, without those given as None (their defaults); raises
    ``ValueError`` naming the bad argument (an unknown name, a wrong type, a value out of
    range, a breaker id outside ``[0, vocab)``)."""
    if not isinstance(extra_args, dict) or KEY not in extra_args:
        return None
    args = extra_args[KEY]
    where = f'extra_args["{KEY}"]'
    if args is None:
        return None
    if not isinstance(args, dict):
        raise ValueError(f"{where} must be a dict of fastsample stage settings, got "
                         f"{type(args).__name__}")  # fmt: skip
    unknown = sorted(set(args) - set(ARGS))
    if unknown:
        raise ValueError(f"{where} has unknown settings {unknown}; fastsample's vLLM plugin "
                         f"takes {', '.join(ARGS)} (vLLM's own settings go in "
                         "SamplingParams)")  # fmt: skip
    values = {k: v for k, v in args.items() if k != "dry_sequence_breakers"}
    breakers = args.get("dry_sequence_breakers")
    try:
        Samplers(1, vocab or 2**31 - 1, torch.device("cpu"), None, "vllm", values,
                 None if breakers is None else [breakers])  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return {k: v for k, v in args.items() if v is not None}  # None: the setting's default


def checked_or_none(extra_args: object, vocab: int, warn) -> dict | None:
    """:func:`check` in a worker (the front end checked already; a request built without it,
    e.g. by a test harness, gets one warning per message and runs without the stages)."""
    try:
        return check(extra_args, vocab)
    except ValueError as exc:
        warn("extra_args " + str(exc), "fastsample's vLLM plugin ignores a request's %s", exc)
        return None


def batch_settings(rows: Sequence[dict | None], device: torch.device) -> dict:
    """``StepParams`` keywords for a batch whose row ``b`` asked for ``rows[b]`` (checked)."""
    if not any(rows):
        return {}
    out: dict = {}
    for name in _SPECS:
        if not any(r and name in r for r in rows):
            continue
        values = [(r or {}).get(name, ROW_DEFAULTS.get(name)) for r in rows]
        if all(x == values[0] for x in values):
            out[name] = values[0]
        else:
            integral = _SPECS[name][0] == "int"
            out[name] = torch.tensor(values, dtype=torch.int64 if integral else torch.float32,
                                     device=device)  # fmt: skip
    if any(r and r.get("dry_sequence_breakers") for r in rows):
        out["dry_sequence_breakers"] = [(r or {}).get("dry_sequence_breakers") for r in rows]
    return out


def mirostat_on(rows: Sequence[dict | None]) -> bool:
    return any(r and r.get("mirostat_tau") for r in rows)


def fitted_width(cap: int, longest: int) -> int:
    """The history's width for contexts of at most ``longest`` tokens: the power of two
    (at least 64) that holds them, at most ``cap`` (:func:`history_width`). A history as
    long as the context holds all of it, so every stage sees what a ``cap``-wide one would,
    and a step costs the contexts' length, not the model's (a window of -1 with
    ``max_model_len`` 128k); a power of two keeps the rebuilds as contexts grow to a few."""
    if cap <= 0:
        return 0
    width = 64
    while width < longest:
        width *= 2
    return min(cap, width)


def history_width(rows: Sequence[dict | None], context: int) -> int:
    """The context tokens the batch's history stages read at most (0: none): each row's
    windows (``-1``, and no-repeat n-grams, mean the whole context), at most ``context`` (the
    model's context length)."""
    width = 0
    for r in rows:
        if not r:
            continue
        windows = []
        if r.get("penalty_last_n", 0):
            windows.append(r["penalty_last_n"])
        if r.get("dry_multiplier", 0):
            windows.append(r.get("dry_penalty_last_n", DEFAULTS["dry_penalty_last_n"]))
        if r.get("no_repeat_ngram_size", 0):
            windows.append(-1)
        for n in windows:
            width = max(width, context if n < 0 else min(n, context))
    return width
