"""Argument checks of :func:`fastsample.distributed.sample`, and the ``check=True`` protocol.

:func:`check_call` checks one rank's own arguments (no communication). With ``check=True``,
:func:`agree` then compares every rank's arguments and values with two collectives and raises
the same ``ValueError`` on every rank, so that no rank raises while the others wait in a
collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops import validation as v
from ..ops.noise import UniformSource
from ..ops.seeds import make_source
from ..ops.validation import Controls, check_controls, check_source
from .comm import Comm
from .shard import Layout, make_layout

__all__ = ["Call", "agree", "check_call", "local_value_error"]


@dataclass
class Call:
    """The checked arguments of one call."""

    logits: Tensor | None
    probs: Tensor | None
    source: Tensor
    layout: Layout
    controls: Controls
    num_samples: int
    seeded: bool
    uniforms: UniformSource


def _check_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    return value


def check_call(
    comm: Comm,
    logits: object,
    probs: object,
    vocab_start: object,
    vocab_size: object,
    controls: tuple[object, object, object, object],
    num_samples: object,
    seed: object,
    step: object,
    stream: object,
    cut_order: object = "transformers",
) -> Call:
    """Every argument check, on this rank's arguments only; raises before any work."""
    source = check_source(logits, probs)
    batch, local = source.shape
    vocab = _check_int(vocab_size, "vocab_size")
    start = _check_int(vocab_start, "vocab_start")
    if vocab < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab}")
    if not 0 <= start <= vocab - local:
        raise ValueError(
            f"this rank's shard [vocab_start, vocab_start + V_local) = [{start}, {start + local}) "
            f"must lie inside the vocabulary [0, {vocab})"
        )
    checked = check_controls(*controls, batch, vocab, source.device, cut_order)
    n = v.check_num_samples(num_samples, vocab)
    uniforms = make_source(None, seed, step, stream, batch, source.device)
    layout = make_layout(start, local, vocab, comm.rank, comm.world)
    return Call(
        logits,  # type: ignore[arg-type]
        probs,  # type: ignore[arg-type]
        source,
        layout,
        checked,
        n,
        seed is not None,
        uniforms,
    )


# ---------------------------------------------------------------------------- check=True

_MESSAGE_BYTES = 512
_FIELDS = (
    "status",
    "the batch size B",
    "vocab_start",
    "V_local",
    "vocab_size",
    "num_samples",
    "whether logits or probs are passed",
    "the input dtype",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "cut_order",
    "seed/step/stream",
)
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _fingerprint(values: list[object]) -> int:
    """A 62-bit digest of Python numbers and tensors, to compare what the ranks passed
    (integers exactly, floats by their float64 bit patterns; the kind of each value counts)."""
    digest = 0
    for i, value in enumerate(values):
        if value is None:
            kind, part = 1, 0
        elif isinstance(value, Tensor):
            if value.dtype.is_floating_point:
                bits = value.detach().to(torch.float64).reshape(-1).view(torch.int64).cpu()
            else:
                bits = value.detach().to(torch.int64).reshape(-1).cpu()
            weights = torch.arange(bits.numel(), dtype=torch.int64) * 2 + 2 * i + 1
            kind, part = 2, int((bits * weights).sum()) ^ bits.numel()
        elif isinstance(value, int):
            kind, part = 3, value
        else:
            as_tensor = torch.tensor(float(value), dtype=torch.float64)  # type: ignore[arg-type]
            kind, part = 4, int(as_tensor.view(torch.int64))
        digest = (digest * 1000003 + kind * 7919 + part) & ((1 << 62) - 1)
    return digest


def _meta_row(call: Call | None, error: str | None, randomness: tuple[object, ...]) -> list[int]:
    """This rank's fixed-size summary for the agreement check (one int64 per field)."""
    if call is None:
        return [1] + [-1] * (len(_FIELDS) - 1)
    c = call.controls
    return [
        1 if error else 0,
        call.source.shape[0],
        call.layout.start,
        call.layout.local,
        call.layout.vocab,
        call.num_samples,
        0 if call.logits is not None else 1,
        _DTYPE_CODES[call.source.dtype],
        *(_fingerprint([ctl]) for ctl in (c.temperature, c.top_k, c.top_p, c.min_p)),
        v.CUT_ORDERS.index(c.cut_order),
        _fingerprint(list(randomness)),
    ]


def local_value_error(call: Call) -> str | None:
    """The first bad row of this shard or bad control value, as text (syncs)."""
    x = call.source
    if call.logits is not None:
        reasons = [(x.isnan().any(-1), "contains NaN"), ((x == math.inf).any(-1), "contains +inf")]
    else:
        reasons = [
            (x.isnan().any(-1), "contains NaN"),
            (x.isinf().any(-1), "contains +-inf"),
            ((x < 0).any(-1), "contains negative weights"),
        ]
    name = "logits" if call.logits is not None else "probs"
    for flags, why in reasons:
        if bool(flags.any()):
            row = int(flags.to(torch.uint8).argmax())
            return f"{name} row {row} {why}"
    try:
        v.check_control_values(call.controls)
    except ValueError as e:
        return str(e)
    return None


def agree(
    comm: Comm,
    call: Call | None,
    error: str | None,
    randomness: tuple[object, ...],
    like: object,
) -> None:
    """``check=True``: compare every rank's arguments with two collectives and raise the same
    ``ValueError`` on every rank if any rank's arguments or values are bad (no hang: every
    rank takes part in the same collectives before anyone raises)."""
    device = comm.device(like)
    meta = torch.tensor(_meta_row(call, error, randomness), dtype=torch.int64)
    text = (error or "").encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    message = torch.frombuffer(bytearray(text), dtype=torch.uint8).view(torch.int64)
    table = comm.all_gather(torch.cat([meta, message])[None].to(device))[:, 0].cpu()
    prefix = "fastsample.distributed.sample(check=True): "
    for rank in range(comm.world):
        if table[rank, 0] != 0:
            raw = table[rank, len(_FIELDS) :].contiguous().view(torch.uint8).numpy().tobytes()
            why = raw.rstrip(b"\0").decode(errors="replace") or "bad arguments"
            raise ValueError(f"{prefix}rank {rank}: {why}")
    for column, what in enumerate(_FIELDS):
        values = table[:, column].tolist()
        if what in ("status", "vocab_start", "V_local") or len(set(values)) == 1:
            continue
        shown = f" (by rank: {values})" if column in (1, 4, 5) else ""
        raise ValueError(f"{prefix}ranks disagree on {what}{shown}; pass the same on every rank")
    vocab = int(table[0, 4])
    spans = sorted((int(table[r, 2]), int(table[r, 3]), r) for r in range(comm.world))
    end = 0
    for start, local, rank in spans:
        if start > end:
            raise ValueError(
                f"{prefix}the shards leave a gap: no rank holds ids [{end}, {start}) "
                f"(shards by rank: {_spans_text(spans)})"
            )
        if start < end:
            raise ValueError(
                f"{prefix}the shards overlap: rank {rank} starts at {start}, before id {end} "
                f"where the previous shard ends (shards by rank: {_spans_text(spans)})"
            )
        end = start + local
    if end != vocab:
        raise ValueError(
            f"{prefix}the shards cover [0, {end}) but vocab_size is {vocab} "
            f"(shards by rank: {_spans_text(spans)})"
        )
    # Rows that no shard can draw from (all -inf logits, all-zero probabilities): a per-row flag.
    assert call is not None
    x = call.source
    drawable = (x > -math.inf).any(-1) if call.logits is not None else (x > 0).any(-1)
    drawable = comm.all_reduce(drawable.to(torch.float32), "max")
    if bool((drawable == 0).any()):
        row = int((drawable == 0).to(torch.uint8).argmax())
        if call.logits is not None:
            why = "logits row {} is -inf on every rank (every token masked)"
        else:
            why = "probs row {} is zero on every rank (no token can be drawn)"
        raise ValueError(prefix + why.format(row))


def _spans_text(spans: list[tuple[int, int, int]]) -> str:
    return ", ".join(f"rank {r}: [{s}, {s + n})" for s, n, r in sorted(spans, key=lambda t: t[2]))
