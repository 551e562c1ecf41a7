"""A bug of Triton's interpreter, not ours: Triton < 3.7 with NumPy >= 2.4.

NumPy 2.4 turned the conversion of a one-element 1-d array to a Python scalar into a
``TypeError``; the interpreter of Triton 3.6 and older converts a scalar kernel argument that
way when it bounds a ``range`` (``int(handle.data)`` in ``tensor.__index__``), so every kernel
that loops up to a runtime length fails. Reported upstream as triton-lang/triton#9171, fixed
in Triton 3.7 (squeeze before ``int``). Compiled kernels are not affected: with Triton 3.6 the
sm_90 compile tests pass, and the interpreter tests pass with NumPy < 2.4.

The kernel below is the smallest form of the loop our kernels use (``kernels/philox.py``): on
the broken pair it must fail with NumPy's message, anywhere else it must run correctly, which
is the control that the failure comes from the pair and not from the kernel.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

triton = pytest.importorskip("triton")
np = pytest.importorskip("numpy")
import triton.language as tl  # noqa: E402


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = re.findall(r"\d+", version)[:2]
    return int(major), int(minor)


BROKEN_PAIR = _major_minor(triton.__version__) < (3, 7) and _major_minor(np.__version__) >= (2, 4)


@triton.jit
def _ramp_kernel(out_ptr, length, WIDTH: tl.constexpr):
    for first in range(0, length, WIDTH):  # the bound is a runtime scalar argument
        cols = first + tl.arange(0, WIDTH)
        tl.store(out_ptr + cols, cols.to(tl.float32), mask=cols < length)


@pytest.mark.triton_floor
def test_interpreter_loop_bound_from_a_scalar_argument():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA device is present: the kernels are compiled, not interpreted")
    out = torch.zeros(10)
    if BROKEN_PAIR:
        message = "only 0-dimensional arrays can be converted to Python scalars"
        with pytest.raises(Exception, match=message):
            _ramp_kernel[(1,)](out, 10, WIDTH=4)
    else:
        _ramp_kernel[(1,)](out, 10, WIDTH=4)
        assert out.tolist() == [float(i) for i in range(10)]
