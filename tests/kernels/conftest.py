"""Kernel tests run on CPU tensors through Triton's interpreter when there is no CUDA device.

The interpreter must be on before any kernel module is imported (``@triton.jit`` decides at
decoration time), so it is set here, before the test modules import ``fastsample.kernels``.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
