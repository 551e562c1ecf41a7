"""The verification kernels compile for a GPU (sm_90 PTX), checked without one (the shard
kernels: tests/kernels/test_triton_shard_compiles.py).

The interpreter accepts code that Triton's compiler rejects (globals that are not constexpr,
mixed types in ``where``, runtime ``if`` on tensors), so the kernels are also compiled, in a
fresh process (the interpreter is on in this one), for an NVIDIA target: the path a GPU takes.
"""

from __future__ import annotations

import textwrap

import pytest

from compiled_mode import run_compiled

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    from compiled_mode import compile_sm90
    from fastsample.kernels import verify_chain as kc, verify_tree as kt

    POINTERS = {"p_ptr": "*fp32", "q_ptr": "*fp32", "ua_ptr": "*fp64", "ur_ptr": "*fp64",
                "ub_ptr": "*fp64", "scratch_ptr": "*fp64", "valid_ptr": "*i1"}
    INTS = {"temperature_bits": "i64", "min_p_bits": "i64"}

    def kind(name):
        if name.endswith("_ptr"):
            return POINTERS.get(name, "*i64")
        if name in INTS:
            return INTS[name]
        return "i64" if name.endswith(("sb", "sk", "sv", "sn")) else "i32"

    chain = dict(HAS_Q=True, HAS_LEN=True, SEEDED=True, RESIDUAL=True, WORK_F64=False,
                 ROWS=1, TILE=256, P_PAD=8, SUMS_TILE=512)
    point = dict(chain, HAS_Q=False, SEEDED=False, RESIDUAL=False)
    for constants in (chain, point):
        compile_sm90(kc._chain_kernel, constants, kind)
    for mode_b in (False, True):
        constants = dict(MODE_B=mode_b, HAS_SIZE=True, SEEDED=True, WORK_F64=False, ROWS=1,
                         TILE=256, N_PAD=32, W_PAD=4, SUMS_TILE=512)
        compile_sm90(kt._tree_kernel, constants, kind)
    print("compiled")
    """
)


@pytest.mark.sm90_compile
def test_verify_kernels_compile_for_an_nvidia_gpu():
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("triton built without its NVIDIA backend")
    assert "compiled" in run_compiled(SCRIPT)
