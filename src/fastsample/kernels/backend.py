"""The backend switch: torch ops or Triton kernels, chosen per call.

``FASTSAMPLE_BACKEND`` is read at every call (never cached), so a test or a server can flip it
without reimporting anything:

* ``auto`` (default): Triton for CUDA tensors when ``triton`` imports, the torch ops
  otherwise (CPU tensors always take the torch ops: they are faster there than the
  interpreter by orders of magnitude);
* ``torch``: always the torch ops of :mod:`fastsample.ops` (the reference);
* ``triton``: Triton on any device; CPU tensors run through Triton's interpreter, which must
  have been on when the kernels were decorated (see :mod:`fastsample.kernels`).

A bad value raises ``ValueError`` naming the variable; ``triton`` without Triton installed
raises ``ImportError`` saying how to install it. This module imports neither triton nor any
kernel until a call needs them, so ``import fastsample`` stays torch-only.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

VARIABLE = "FASTSAMPLE_BACKEND"
CHOICES = ("auto", "torch", "triton")


def requested() -> str:
    """The backend asked for by ``FASTSAMPLE_BACKEND`` (default ``auto``), checked."""
    value = os.environ.get(VARIABLE, "auto")
    if value not in CHOICES:
        raise ValueError(
            f"{VARIABLE} must be one of {', '.join(repr(c) for c in CHOICES)}, got {value!r}"
        )
    return value


@functools.cache
def triton_installed() -> bool:
    """Whether ``triton`` can be imported (found on the path; not imported here)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether this process's kernels run in Triton's interpreter (imports the kernels)."""
    from . import philox

    return philox.INTERPRETED


@torch.compiler.assume_constant_result
def use_triton(device_type: str) -> bool:
    """Whether a call on tensors of ``device_type`` (``"cuda"``, ``"cpu"``...) takes Triton.

    Constant for a compiled graph (the variable is read while tracing, like a Python flag).
    Raises when ``triton`` is requested but cannot run: not installed, or CPU tensors in a
    process whose kernels were compiled for the GPU instead of interpreted.
    """
    choice = requested()
    if choice == "torch":
        return False
    if choice == "auto":
        return device_type == "cuda" and triton_installed()
    if not triton_installed():
        raise ImportError(
            f"{VARIABLE}=triton but triton is not installed; install it with "
            "pip install 'fastsample[triton]', or unset the variable to use the torch ops"
        )
    if device_type != "cuda" and not interpreted():
        raise RuntimeError(
            f"{VARIABLE}=triton on {device_type} tensors needs Triton's interpreter, which "
            "was off when the kernels were loaded (CUDA is available); start Python with "
            "TRITON_INTERPRET=1 set, or use CUDA tensors"
        )
    return True
