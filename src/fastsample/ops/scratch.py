"""Batch-sized scratch buffers kept per thread on CPU, for the passes that need one every step.

On CPU a batch-sized temporary (32 MB for ``(64, 128256)`` float32) is a fresh block from the
OS on every call (glibc maps blocks that large directly and unmaps them on free), and its page
faults cost about as much as the copy itself (``docs/cpu-primitive-costs.md``). The engine step
needs one such buffer per call (the logits after the allowed tokens, bias and penalties), so it
takes it from here: one buffer per thread and per use (``slot``), kept while the shape and
dtype stay the same, replaced when they change. A buffer is handed out only for the duration
of a call and never returned to the caller (results are computed from it, never views of it).

Memory: at most one buffer per slot per calling thread (four slots are used: the staged
logits, the raw logprobs' normalizer, the sampler chain's whole-row weights and the general
path's weights, :func:`fastsample.ops.weights.weights_from_logits`), released
with the thread or by :func:`release`. Off CPU (the caching allocator reuses memory there)
and under ``torch.compile`` a fresh tensor is made.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

_local = threading.local()


def buffer(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialized ``shape`` tensor of ``dtype`` on ``device`` for this call: this thread's
    kept buffer for ``slot`` on CPU (eager), a fresh one elsewhere."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=device)
    kept: dict[str, Tensor] | None = getattr(_local, "buffers", None)
    if kept is None:
        kept = _local.buffers = {}
    found = kept.get(slot)
    if found is None or found.shape != shape or found.dtype != dtype or found.device != device:
        with torch.inference_mode(False):  # an ordinary tensor, usable in any mode
            found = kept[slot] = torch.empty(shape, dtype=dtype, device=device)
    return found


def release() -> None:
    """Free this thread's kept buffers (they come back, at their cost, on the next call)."""
    _local.buffers = {}
