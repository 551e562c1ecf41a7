"""The kernels compile for a GPU (sm_90: Triton's front end, LLVM and ptxas), no GPU needed.

The interpreter runs a kernel's Python; compiled Triton is stricter (constexpr globals, types,
layouts), so a kernel that passes every interpreter test can still fail to compile. This test
compiles each kernel once (one program per row, as on a GPU) in a fresh process without
``TRITON_INTERPRET``, so CI catches that without a GPU.
"""

from __future__ import annotations

import textwrap

import pytest

from compiled_mode import run_compiled

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    from compiled_mode import compile_sm90
    from fastsample.kernels import inverse_cdf, philox, race

    POINTERS = {
        "probs_ptr": "*bf16", "weights_ptr": "*fp32", "seed_ptr": "*i64", "step_ptr": "*i64",
        "stream_ptr": "*i64", "ids_ptr": "*i64", "p_ptr": "*fp32", "logp_ptr": "*fp32",
        "valid_ptr": "*i1", "sums_ptr": "*fp64", "total_ptr": "*fp64", "clean_ptr": "*i1",
        "out_ptr": "*fp64",
    }
    STRIDES = ("row_stride", "col_stride", "seed_stride", "step_stride", "stream_stride",
               "sums_stride", "start")
    DRAWS = dict(ROWS=1, HAS_STEP=True, STREAM_ROWS=True, NUM_SAMPLES=2, N_PAD=2, TILE=256)
    CASES = [
        (race._race_kernel, dict(DRAWS, FAST=False, LOG1P=True, SUM_F64=False)),
        (inverse_cdf._inverse_cdf_kernel,
         dict(DRAWS, SUMS_TILE=1024, ONE_SUMS_TILE=False, SUM_F64=False, STEP_BLOCKS=4)),
        (inverse_cdf._draw_kernel, dict(DRAWS, SUMS_TILE=512, ONE_SUMS_TILE=True)),
        (philox._counter_uniforms_kernel,
         dict(PURPOSE=1, NOISE=True, LOG1P=True, ROWS=1, WIDTH=256)),
    ]
    for kernel, constants in CASES:
        compile_sm90(
            kernel, constants, lambda name: POINTERS.get(name, "i64" if name in STRIDES else "i32")
        )
        print("compiled", kernel.__name__)
    """
)


@pytest.mark.sm90_compile
def test_kernels_compile_for_sm90():
    assert run_compiled(SCRIPT).count("compiled") == 4


TRACE = textwrap.dedent(
    """
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from fastsample.kernels import ops

    assert not ops.INTERPRETED  # the GPU registration: triton_op around wrap_triton launches
    probs, seed = torch.softmax(torch.randn(4, 300), -1), torch.arange(4)
    calls = {
        "race": lambda p, s: ops.race_op(p, 2, s, None, None, 0),
        "fast_sample": lambda p, s: ops.fast_sample_op(p, 1, s, s, s, 0),
        "inverse_cdf": lambda p, s: ops.inverse_cdf_op(p, 2, s, s, None, 3),
    }
    for name, call in calls.items():
        graph = make_fx(call, tracing_mode="fake")(probs, seed).graph
        targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
        assert f"fastsample.{name}.default" in targets, targets
        print("traced", name)
    """
)


def test_triton_ops_trace_with_fake_tensors():
    """The compiled-mode operators (``triton_op``) trace under fake tensors, as
    ``torch.compile`` does, with no GPU and without running a kernel."""
    assert run_compiled(TRACE, timeout=300).count("traced") == 3
