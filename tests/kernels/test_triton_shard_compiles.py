"""The distributed-round kernels compile for a GPU (sm_90: Triton's front end, LLVM and
ptxas), no GPU needed (as tests/kernels/test_triton_compiles.py does for the samplers).

The interpreter runs a kernel's Python; compiled Triton is stricter (constexpr globals,
loop-carried types, dot shapes and dtypes), so the summaries, every kind of step (weights,
candidates and their sort, float64 radix rounds on ``tl.dot``, the final cut) and the draws
(several draws, greedy rows, unseeded) are compiled, one program per row.
"""

from __future__ import annotations

import textwrap

import pytest

from compiled_mode import run_compiled

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    from compiled_mode import compile_sm90
    from fastsample.kernels import shard
    from fastsample.kernels import shard_cuts as sc


    def pointers(f64):
        w = "*fp64" if f64 else "*fp32"
        return {
            "x_ptr": "*bf16", "table_ptr": "*fp64", "w_ptr": w, "sums_ptr": w, "cand_ptr": w,
            "merged_ptr": w, "hists_k_ptr": w, "hists_p_ptr": w, "ties_ptr": "*fp64",
            "t_ptr": "*fp32", "k_ptr": "*i64", "p_ptr": "*fp32", "m_ptr": "*fp32",
            "out_ptr": "*fp64", "u_ptr": "*fp64", "records_ptr": "*i64", "live_ptr": "*fp64",
            "chosen_ptr": "*i64", "seed_ptr": "*i64", "step_ptr": "*i64", "stream_ptr": "*i64",
        }


    I64 = {"t_bits", "k_bits", "p_bits", "m_bits", "tiny_bits", "floor_bits", "below_bits",
           "x_sb", "x_sv", "t_sb", "k_sb", "p_sb", "m_sb", "seed_sb", "step_sb", "stream_sb",
           "stream_value", "start_id"}
    STEP = dict(IS_LOGITS=True, NO_COPY=False, COLS=3, W0=10, WN=10, ROUNDS=3, T_SRC=2,
                K_SRC=1, P_SRC=1, M_SRC=1, KPAD=64, ROWS=1, TILE=256, SLOTS_PAD=8,
                PRECISE=True, HAS_KP=True, HAS_CUT=True, HIST_F64=False, ROUND=0, SHIFT=20,
                WIDTH=10, OFFSET=0, F64=False, WEIGHTS=False, P_MASS=sc.P_ON_K,
                P_SURVIVORS=True)
    CANDIDATES = dict(K_MODE=sc.CAND, P_MODE=sc.CAND, M_MODE=sc.MIN_NUMBER)
    RADIX = dict(K_MODE=sc.RADIX, P_MODE=sc.RADIX, M_MODE=sc.MIN_TENSOR, K_SRC=2, P_SRC=2,
                 M_SRC=2)
    DRAW = dict(IS_LOGITS=True, HAS_STEP=True, STREAM_ROWS=True, ROWS=1, TILE=256, SLOTS_PAD=8)
    CASES = [
        # Greedy rows drawing 3 (the shard's 3 largest), unseeded (3 generator draws).
        (shard._summary_kernel, dict(IS_LOGITS=True, GREEDY=True, T_SRC=2, K_SRC=2, P_SRC=2,
                                     M_SRC=2, UNIFORMS=3, COLS=11, TOP_N=3, ROWS=1,
                                     TILE=1024), False),
        # The weights, then the local k largest (radix rounds in the kernel, compaction).
        (sc._step_kernel, {**STEP, **CANDIDATES, "WEIGHTS": True, "STEP": sc.TOP}, False),
        # The merged candidates sorted, the candidate top-p cut, keep_at_least, slot sums.
        (sc._step_kernel, {**STEP, **CANDIDATES, "STEP": sc.APPLY}, False),
        # cut_order="joint": the shard's mass (TIES), the candidate cut on the row's mass.
        (sc._step_kernel, {**STEP, **CANDIDATES, "STEP": sc.TIES, "P_MASS": sc.P_ON_ROW,
                           "P_SURVIVORS": False}, False),
        (sc._step_kernel, {**STEP, **CANDIDATES, "STEP": sc.APPLY, "P_MASS": sc.P_ON_ROW,
                           "P_SURVIVORS": False}, False),
        # cut_order="vllm": a top-p radix round on the survivors of min-p and top-k.
        (sc._step_kernel, {**STEP, **RADIX, "STEP": sc.HIST_P, "P_MASS": sc.P_ON_MIN_AND_K},
         False),
        # A float64 radix round (float64 tl.dot) after the weights.
        (sc._step_kernel, {**STEP, **RADIX, "F64": True, "WEIGHTS": True, "STEP": sc.HIST_K,
                           "ROUND": 1, "SHIFT": 45, "WIDTH": 9, "OFFSET": 256, "W0": 8,
                           "WN": 9, "ROUNDS": 7, "HIST_F64": True}, True),
        # Every radix round read back, both radix cuts and a tensor min-p.
        (sc._step_kernel, {**STEP, **RADIX, "STEP": sc.APPLY}, False),
        # A later draw of several; greedy rows drawing several, unseeded, float64; one
        # greedy draw.
        (shard._draw_kernel, dict(DRAW, GREEDY=False, F64=False, K=1, MORE=True, WORDS=5,
                                  COLS=2, UNSEEDED=False, N=3, TOKEN_WORD=0, MERGED=8), False),
        (shard._draw_kernel, dict(DRAW, GREEDY=True, F64=True, K=1, MORE=True, WORDS=6,
                                  COLS=11, UNSEEDED=True, N=3, TOKEN_WORD=5, MERGED=8), True),
        (shard._draw_kernel, dict(DRAW, GREEDY=True, F64=False, K=0, MORE=False, WORDS=4,
                                  COLS=3, UNSEEDED=False, N=1, TOKEN_WORD=0, MERGED=2), False),
    ]
    for kernel, constants, f64 in CASES:
        ptrs = pointers(f64)
        compile_sm90(
            kernel, constants, lambda name: ptrs.get(name, "i64" if name in I64 else "i32")
        )
        print("compiled", kernel.__name__, flush=True)
    """
)


@pytest.mark.sm90_compile
def test_shard_kernels_compile_for_sm90():
    assert run_compiled(SCRIPT).count("compiled") == 11
