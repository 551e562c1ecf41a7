"""Whether a tensor's values can be read on the host for free: a CPU tensor in eager mode.

The CPU eager forms of some ops (the small-top-k path's host steps, top-p's cut from the
entries above a bound, the logprobs' rank count, the draw's all-greedy check) take
data-dependent shapes and read values on the host, where that costs nothing. Elsewhere it
would not: off CPU a read syncs the device, and under ``torch.compile`` or tracing it would
break or freeze the graph. They ask :func:`host_readable` first and otherwise take their
tensor-only route. (One module below :mod:`.cuts` and :mod:`.small_top_k`, so that both
layers ask the same function without an import cycle.)"""

from __future__ import annotations

import torch
from torch import Tensor


def host_readable(value: Tensor) -> bool:
    """Whether reading ``value`` on the host is free: a CPU tensor in eager mode (no device
    sync; under ``torch.compile`` or tracing a read would break or freeze the graph)."""
    return (
        value.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )
