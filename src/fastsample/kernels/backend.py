"""The backend switch: torch ops or Triton kernels, chosen per call.

``FASTSAMPLE_BACKEND`` is read at every call (never cached), so a test or a server can flip it
without reimporting anything:

* ``auto`` (default): Triton for CUDA tensors when ``triton`` imports, the torch ops
  otherwise (CPU tensors always take the torch ops: they are faster there than the
  interpreter by orders of magnitude);
* ``torch``: always the torch ops of :mod:`fastsample.ops` (the reference);
* ``triton``: Triton on any device; CPU tensors run through Triton's interpreter, which must
  have been on when the kernels were decorated: on a machine without CUDA the first such call
  turns it on before loading the kernels (see :mod:`fastsample.kernels`).

A bad value raises ``ValueError`` naming the variable; ``triton`` without Triton installed
raises ``ImportError`` saying how to install it. This module imports neither triton nor any
kernel until a call needs them, so ``import fastsample`` stays torch-only.
"""

from __future__ import annotations

import importlib.util
import os

import torch

VARIABLE = "FASTSAMPLE_BACKEND"
CHOICES = ("auto", "torch", "triton")

# Asked for Triton from the start on a machine without CUDA: the interpreter must be on before
# anything imports triton.language (torch.compile does), so decide now rather than at a call.
if os.environ.get(VARIABLE) == "triton" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def requested() -> str:
    """The backend asked for by ``FASTSAMPLE_BACKEND`` (default ``auto``), checked."""
    value = os.environ.get(VARIABLE, "auto")
    if value not in CHOICES:
        raise ValueError(
            f"{VARIABLE} must be one of {', '.join(repr(c) for c in CHOICES)}, got {value!r}"
        )
    return value


_TRITON_INSTALLED: list[bool] = []  # memo (a plain global: torch.compile reads it freely)
_INTERPRETER_READY: list[bool] = []


def triton_installed() -> bool:
    """Whether ``triton`` can be imported (found on the path; not imported here)."""
    if not _TRITON_INSTALLED:
        _TRITON_INSTALLED.append(importlib.util.find_spec("triton") is not None)
    return _TRITON_INSTALLED[0]


def interpreted() -> bool:
    """Whether this process's kernels run in Triton's interpreter (imports the kernels)."""
    from . import philox

    return philox.INTERPRETED


def _enable_interpreter() -> None:
    """Turn Triton's interpreter on if nothing decided yet and there is no CUDA device
    (effective only before the kernel modules are imported)."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _interpreter_ready() -> bool:
    """Turn the interpreter on if needed, load the kernels, and say whether they interpret.

    Decided once per process, eagerly: under ``torch.compile`` the memo is only read (setting
    an environment variable is not traceable), so a compiled first call on CPU tensors needs
    an eager call before it or ``TRITON_INTERPRET=1`` from the start.
    """
    if not _INTERPRETER_READY:
        if not torch.compiler.is_compiling():
            _enable_interpreter()
        _INTERPRETER_READY.append(interpreted())
    return _INTERPRETER_READY[0]


def use_triton(device_type: str) -> bool:
    """Whether a call on tensors of ``device_type`` (``"cuda"``, ``"cpu"``...) takes Triton.

    Under ``torch.compile`` the variable is read while tracing, like any Python flag.
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
    if device_type != "cuda" and not _interpreter_ready():
        raise RuntimeError(
            f"{VARIABLE}=triton on {device_type} tensors needs Triton's interpreter, which "
            "was off when the kernels were loaded; start Python with TRITON_INTERPRET=1 set, "
            "or use CUDA tensors"
        )
    return True


def kernel_ops():
    """The module of Triton entry points (:mod:`fastsample.kernels.ops`), imported on demand."""
    from . import ops

    return ops
