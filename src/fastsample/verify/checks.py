"""Argument and value checks shared by chain and tree verification.

Argument checks (types, shapes, devices) raise before any work or random draw. The value
checks (:func:`raise_bad_values`, :func:`value_flags`) serve ``check=True`` only: they read
the inputs on the host, which syncs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..ops import validation as v

INT_DTYPES = (torch.int64, torch.int32)


def check_probs(probs: object, name: str, rank_hint: str) -> Tensor:
    if not isinstance(probs, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {rank_hint}, got {type(probs)}")
    if probs.dim() != 3:
        raise ValueError(
            f"{name} must have shape {rank_hint}, got {probs.dim()} dimensions {tuple(probs.shape)}"
        )
    if probs.dtype not in v.FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {probs.dtype}; "
            f"convert with {name}.float()"
        )
    if probs.shape[2] < 1:
        raise ValueError(f"{name} must have at least one vocabulary entry, got {probs.shape}")
    return probs


def check_draft_probs(
    draft_probs: object, target: Tensor, positions: int, rank_hint: str
) -> Tensor | None:
    """None, or ``draft_probs`` checked as :func:`check_probs` does and against the target:
    shape ``(B, positions, V)`` for a ``(B, ., V)`` ``target``, on the target's device."""
    if draft_probs is None:
        return None
    q = check_probs(draft_probs, "draft_probs", rank_hint)
    want = (target.shape[0], positions, target.shape[2])
    if tuple(q.shape) != want:
        raise ValueError(
            f"draft_probs must have shape {rank_hint} = {want} to match target_probs "
            f"{tuple(target.shape)}, got {tuple(q.shape)}"
        )
    check_same_device(q, "draft_probs", target.device)
    return q


def check_ids(ids: object, name: str, shape: tuple[int, int], device: torch.device) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be an int64 tensor of shape {shape}, got {type(ids)}")
    if ids.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must be int64 (or int32), got {ids.dtype}; use {name}.long()")
    if tuple(ids.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but target_probs is on {device}")
    return ids.long()


def check_same_device(t: Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(
            f"{name} is on {t.device} but target_probs is on {device}; all inputs must be "
            "on one device"
        )


def check_counts(
    counts: object, name: str, batch: int, low: int, high: int, device: torch.device
) -> Tensor | None:
    """None, a Python int in ``[low, high]`` (checked now) or a ``(B,)`` int64 tensor
    (values checked only with ``check=True``)."""
    if counts is None:
        return None
    if isinstance(counts, bool):
        raise TypeError(f"{name} must be None, an int or an int64 tensor, got bool")
    if isinstance(counts, int):
        if not low <= counts <= high:
            raise ValueError(f"{name} must be between {low} and {high}, got {counts}")
        return torch.full((batch,), counts, dtype=torch.int64, device=device)
    if not isinstance(counts, Tensor):
        raise TypeError(f"{name} must be None, an int or an int64 tensor, got {type(counts)}")
    if counts.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must be int64, got {counts.dtype}; use {name}.long()")
    if tuple(counts.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(counts.shape)}")
    check_same_device(counts, name, device)
    return counts.long()


def raise_bad_values(bad: Tensor, where: str, reasons: Sequence[str]) -> None:
    """``bad``: ``(B, P, len(reasons))`` bool flags; raise naming the first bad (row, place)."""
    flags = bad.cpu()
    rows = flags.flatten(1).any(1)
    if not bool(rows.any()):
        return
    b = int(rows.to(torch.uint8).argmax())
    place = int(flags[b].any(-1).to(torch.uint8).argmax())
    why = [text for text, f in zip(reasons, flags[b, place].tolist(), strict=True) if f]
    raise ValueError(
        f"row {b} {where} {place} {' and '.join(why)} ({int(rows.sum())} bad row(s) in all). "
        "Without check=True such rows are reported as valid=False instead of raising."
    )


VALUE_REASONS = ("contains NaN", "contains +-inf", "contains negative weights", "has no mass")


def value_flags(probs: Tensor) -> Tensor:
    """``(B, P, 4)`` flags of :data:`VALUE_REASONS` for ``(B, P, V)`` distributions."""
    total = probs.sum(-1, dtype=torch.float64)
    return torch.stack(
        (
            probs.isnan().any(-1),
            probs.isinf().any(-1),
            (probs < 0).any(-1),
            ~(total > 0),
        ),
        dim=-1,
    )
