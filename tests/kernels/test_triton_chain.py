"""The sampler chain on the Triton backend (:mod:`fastsample.kernels.chain`) against the torch
chain (:func:`fastsample.stages.chain.run`), which stays the reference.

Run on CPU tensors through Triton's interpreter at small sizes:

* the chained logits keep exactly the torch chain's set of tokens, and the kept values are the
  same up to an ulp of ``exp`` (numpy's in the interpreter, torch's on the other side), for
  each new stage alone (a Python number, and a tensor with a row off), every preset order and
  a custom one with every stage on, float32/bfloat16/float64 input, a row mapped to another
  state row for mirostat's ``mu``;
* ``sample_step`` draws the torch path's tokens with the same seeds (XTC's coin included),
  one or several draws, with the logprobs within 1e-6; the torch path takes its whole-row
  chain here (``top_logprobs`` on: its top-k candidates draw in another column order);
* bad rows (NaN, ``+inf``, all removed, out-of-range tensor settings) are flagged and leave
  the other rows bitwise unchanged;
* a step with every stage before the controls, every chain stage and every logprob option is
  3 launches; the kernel compiles for sm_90 and its op traces under fake tensors and
  ``torch.compile(fullgraph=True)``.

The law of the draws is carried by the torch path's tests (tests/stages/test_chain_law.py):
the kernel draws its tokens, checked here row by row.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

pytest.importorskip("triton")

import fastsample as fs
from compiled_mode import run_compiled
from fastsample.kernels import chain as kernel_chain
from fastsample.kernels.ops import counters
from fastsample.kernels.philox import INTERPRETED
from fastsample.ops.seeds import make_source
from fastsample.stages import chain, kernel_step
from fastsample.tools.bench.launches import device_work

pytestmark = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors need the interpreter (TRITON_INTERPRET=1)"
)

BATCH, VOCAB = 4, 300


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv("FASTSAMPLE_BACKEND", name)

    return use


def _logits(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, VOCAB, generator=gen) * 3
    x[1, :60] = -math.inf  # removed upstream (a grammar): the stages see the survivors
    return x.to(dtype)


def _chained(x, params, state=None, rows=None, step=5):
    """``(torch chain's logits, kernel's (chained, weights, sums, total, valid))``."""
    rng = make_source(None, params.seed, step, params.stream, x.shape[0], x.device)
    mu = None
    if params.samplers.on("mirostat"):
        mu = state.mirostat_mu if rows is None else state.mirostat_mu[rows]
    staged = x if x.dtype in (torch.float32, torch.float64) else x.float()
    want = chain.run(staged.clone(), params.controls, params.samplers, rng, mu)
    args = kernel_step.chain_args(params, state, rows)
    seed, step_t, stream_rows, stream = counters(rng, x.shape[0], x.device)
    got = kernel_chain.chain_weights(
        x, args.settings, args.stages, args.dynatemp, args.mu, args.rows, seed, step_t,
        stream_rows if stream_rows is not None else stream, 0,
    )  # fmt: skip
    return want, got


def _assert_same_chain(want, chained):
    kept = want > -math.inf
    assert torch.equal(kept, chained > -math.inf), (kept.sum(1), (chained > -math.inf).sum(1))
    torch.testing.assert_close(chained[kept], want[kept], rtol=2e-6, atol=0)


def _state(batch=BATCH):
    stats = fs.TokenStats.from_prompts([[1, 2]] * batch, vocab=VOCAB)
    stats.mirostat_mu[1:] = torch.tensor([3.0, 6.5, 1.0])[: batch - 1]  # row 0 not started
    return stats


_ALONE = {
    "typical_p": dict(typical_p=0.6),
    "epsilon_cutoff": dict(epsilon_cutoff=0.02),
    "eta_cutoff": dict(eta_cutoff=0.02),
    "top_n_sigma": dict(top_n_sigma=1.0),
    "xtc": dict(xtc_probability=0.9, xtc_threshold=0.05),
    "dynatemp": dict(dynatemp_range=0.6, dynatemp_exponent=1.5, temperature=0.9),
    "mirostat": dict(mirostat_tau=3.0),
}
_OFF_ROW = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_n_sigma": 0.0,
            "xtc_probability": 0.0, "dynatemp_range": 0.0, "mirostat_tau": 0.0}  # fmt: skip


def _as_tensors(settings: dict) -> dict:
    """Each setting a ``(B,)`` tensor (varied), the first stage setting off in row 2."""
    out = {}
    for name, value in settings.items():
        column = torch.tensor([value * f for f in (1.0, 0.7, 1.0, 1.3)], dtype=torch.float32)
        if name in ("top_p", "typical_p", "min_p", "xtc_probability"):
            column.clamp_(max=1.0)  # in range
        if name in _OFF_ROW:
            column[2] = _OFF_ROW[name]
        if name == "xtc_threshold":
            column = torch.tensor([0.05, 0.1, 0.02, 0.3])
        out[name] = column
    return out


@pytest.mark.parametrize("kind", ["number", "tensor"])
@pytest.mark.parametrize("stage", list(_ALONE))
def test_each_stage_alone_keeps_the_torch_chains_set(stage, kind):
    settings = _ALONE[stage] if kind == "number" else _as_tensors(_ALONE[stage])
    params = fs.StepParams(BATCH, VOCAB, seed=torch.arange(BATCH) + 3, **settings)
    want, got = _chained(_logits(1), params, _state())
    _assert_same_chain(want, got[0])
    assert bool(got[4].all())
    # The stage acted (the check above is not a comparison of two untouched rows).
    if stage != "dynatemp":  # (it keeps every token)
        assert bool(((want > -math.inf).sum(1) < (_logits(1) > -math.inf).sum(1)).any())


_EVERY_STAGE = dict(
    temperature=0.8, top_k=60, top_p=0.95, min_p=0.01, typical_p=0.97, epsilon_cutoff=3e-4,
    eta_cutoff=3e-4, top_n_sigma=2.5, xtc_probability=0.8, xtc_threshold=0.08,
    dynatemp_range=0.3, mirostat_tau=6.0,
)  # fmt: skip


@pytest.mark.parametrize("order", ["transformers", "vllm", "joint", "llama.cpp", "custom"])
def test_every_order_with_every_stage(order):
    named = order
    if order == "custom":
        named = ["xtc", "top_p", "typical_p", "temperature", "top_n_sigma", "min_p",
                 "eta_cutoff", "top_k", "epsilon_cutoff", "mirostat"]  # fmt: skip
    params = fs.StepParams(BATCH, VOCAB, seed=torch.arange(BATCH) + 7, order=named,
                           **_EVERY_STAGE)  # fmt: skip
    want, got = _chained(_logits(2), params, _state())
    _assert_same_chain(want, got[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_input_dtypes(dtype):
    numbers = {k: v for k, v in _EVERY_STAGE.items() if k not in ("top_k", "xtc_threshold")}
    params = fs.StepParams(BATCH, VOCAB, seed=torch.arange(BATCH), **_as_tensors(numbers))
    x = _logits(3, dtype)
    want, got = _chained(x, params, _state())
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _assert_same_chain(want, got[0])


def test_mirostat_reads_mu_at_the_state_row():
    stats = _state()
    rows = torch.tensor([3, 0, 1, 1])
    params = fs.StepParams(BATCH, VOCAB, mirostat_tau=torch.tensor([3.0, 2.0, 5.0, 0.0]),
                           seed=torch.arange(BATCH))  # fmt: skip
    want, got = _chained(_logits(4), params, stats, rows)
    _assert_same_chain(want, got[0])
    assert not torch.equal(want[2] > -math.inf, want[3] > -math.inf)  # same mu, tau 0 is off


def test_bad_rows_are_flagged_and_leave_the_others_alone(backend):
    """NaN, +inf, an all-removed row and out-of-range tensor settings (a control and a chain
    setting): those rows are invalid with an in-range token; the others draw as without them."""
    x = _logits(5)
    x[0, 7] = math.nan
    x[1, 60:] = -math.inf  # nothing left
    x[2, 9] = math.inf
    settings = _as_tensors({k: v for k, v in _EVERY_STAGE.items()
                            if k not in ("top_k", "xtc_threshold", "mirostat_tau")})  # fmt: skip
    wide = fs.TokenStats.from_prompts([[1, 2]] * 6, vocab=VOCAB)
    six = torch.cat([x, _logits(6)[:2]])
    params = dict(settings)
    for name in params:
        params[name] = torch.cat([params[name], params[name][:2]])
    params["top_p"][4] = 1.5  # out of range: the control
    params["typical_p"][5] = -0.5  # out of range: a chain setting
    batch_params = fs.StepParams(6, VOCAB, seed=torch.arange(6) + 1, top_logprobs=2, **params)
    backend("triton")
    out = fs.sample_step(six, params=batch_params, state=wide, step=3)
    assert out.valid.tolist() == [False, False, False, True, False, False]
    assert bool(((out.token_ids >= 0) & (out.token_ids < VOCAB)).all())
    alone = fs.StepParams(1, VOCAB, seed=torch.tensor([4]), top_logprobs=2,
                          **{k: v[3:4] for k, v in params.items()})  # fmt: skip
    single = fs.sample_step(six[3:4], params=alone, state=wide.select(torch.tensor([3])), step=3)
    assert torch.equal(out.token_ids[3], single.token_ids[0])
    assert torch.equal(out.logprobs[3], single.logprobs[0])
    assert torch.equal(out.top_logprobs[3], single.top_logprobs[0])


def _step_settings(batch: int, mirostat: bool) -> dict:
    gen = torch.Generator().manual_seed(11)
    settings = dict(
        temperature=torch.tensor([0.0, 0.7, 1.2, 0.9])[:batch],
        top_k=torch.randint(0, 80, (batch,), generator=gen),
        top_p=torch.rand(batch, generator=gen) * 0.3 + 0.7, min_p=0.02,
        typical_p=torch.tensor([0.9, 1.0, 0.8, 0.95])[:batch], epsilon_cutoff=1e-4,
        eta_cutoff=torch.full((batch,), 1e-4),
        top_n_sigma=torch.tensor([2.0, 0.0, 3.0, 1.5])[:batch],
        xtc_probability=torch.tensor([0.5, 1.0, 0.0, 0.7])[:batch], xtc_threshold=0.05,
        dynatemp_range=torch.tensor([0.2, 0.0, 0.5, 0.3])[:batch],
    )  # fmt: skip
    if mirostat:
        settings["mirostat_tau"] = torch.tensor([4.0, 3.0, 0.0, 5.0])[:batch]
    return settings


@pytest.mark.parametrize("num_samples", [1, 3])
def test_sample_step_draws_the_torch_tokens(backend, num_samples):
    mirostat = num_samples == 1  # mirostat draws one token per step
    params = fs.StepParams(BATCH, VOCAB, seed=torch.arange(BATCH) + 21, top_logprobs=3,
                           num_samples=num_samples, order="llama.cpp",
                           **_step_settings(BATCH, mirostat))  # fmt: skip
    x, stats = _logits(8), _state()
    outs = {}
    for name in ("torch", "triton"):
        backend(name)
        outs[name] = fs.sample_step(x, params=params, state=stats, step=torch.arange(BATCH) + 4)
    theirs, ours = outs["torch"], outs["triton"]
    assert torch.equal(ours.token_ids, theirs.token_ids)
    assert torch.equal(ours.valid, theirs.valid) and bool(ours.valid.all())
    assert torch.equal(ours.top_token_ids, theirs.top_token_ids)
    torch.testing.assert_close(ours.probs, theirs.probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, rtol=0, atol=1e-6)


def test_unseeded_steps_draw_in_range(backend):
    """Without seeds the kernel's coin and draws come from one ``randint`` per call (as the
    controls kernels' path): valid, in the torch chain's kept set."""
    params = fs.StepParams(BATCH, VOCAB, **_step_settings(BATCH, False))
    x = _logits(9)
    backend("triton")
    out = fs.sample_step(x, params=params, generator=torch.Generator().manual_seed(3))
    assert bool(out.valid.all())
    kept = chain.run(x.clone(), params.controls, params.samplers,
                     chain.FixedCoin(BATCH, 1.0, x.device), None) > -math.inf  # fmt: skip
    xtc_free = kept.gather(1, out.token_ids)  # with no XTC removal every drawn token is kept
    assert bool(xtc_free.all())


def test_launch_budget_with_the_chain(backend):
    """Every stage before the controls (tensor settings), every chain stage but the history
    ones, seeds and steps, top-5 logprobs, ranks and requested ids: the stages, chain and draw
    launches, nothing else."""
    gen = torch.Generator().manual_seed(1)
    batch = BATCH
    params = fs.StepParams(
        batch, VOCAB, repetition_penalty=torch.rand(batch, generator=gen) + 0.6,
        presence_penalty=torch.rand(batch, generator=gen) - 0.5,
        logit_bias=(torch.randint(-1, VOCAB, (batch, 4), generator=gen),
                    torch.randn(batch, 4, generator=gen)),
        min_tokens=torch.randint(0, 4, (batch,), generator=gen),
        stop_token_ids=torch.randint(-1, VOCAB, (batch, 2), generator=gen),
        seed=torch.arange(batch) + 100, top_logprobs=5, token_ranks=True,
        logprob_token_ids=torch.randint(-1, VOCAB, (batch, 3), generator=gen),
        **_step_settings(batch, True),
    )  # fmt: skip
    stats = _state()
    words = torch.randint(-(2**31), 2**31 - 1, (batch, (VOCAB + 31) // 32), dtype=torch.int32,
                          generator=gen) | 0x00FF00FF  # fmt: skip
    steps = torch.arange(batch)
    backend("triton")

    def call():
        return fs.sample_step(_logits(10), params=params, state=stats, step=steps,
                              token_bitmask=words)  # fmt: skip

    call()
    logits = _logits(10)
    work = device_work(lambda: fs.sample_step(logits, params=params, state=stats, step=steps,
                                              token_bitmask=words))  # fmt: skip
    assert work.kernels == 3 and work.total <= 3, (work.total, work.names)
    # The same step on the torch path draws the same tokens.
    backend("torch")
    theirs = fs.sample_step(logits, params=params, state=stats, step=steps, token_bitmask=words)
    backend("triton")
    ours = fs.sample_step(logits, params=params, state=stats, step=steps, token_bitmask=words)
    assert torch.equal(ours.token_ids, theirs.token_ids)
    assert torch.equal(ours.ranks, theirs.ranks)


def test_compiled_fullgraph_traces_a_chain_step(backend):
    params = fs.StepParams(BATCH, VOCAB, seed=torch.arange(BATCH), **_step_settings(BATCH, True))
    stats = _state()
    backend("triton")

    def run(logits, steps):
        out = fs.sample_step(logits, params=params, state=stats, step=steps)
        return out.token_ids, out.logprobs, out.valid

    x, steps = _logits(12), torch.arange(BATCH) + 2
    want = run(x, steps)
    got = torch.compile(run, fullgraph=True, backend="eager")(x, steps)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


_COMPILE = textwrap.dedent("""
    import math

    import torch
    from compiled_mode import compile_sm90
    from fastsample.kernels import chain as kc

    I64 = "i64"
    pointers = dict(
        src_ptr="*fp32", x_ptr="*fp32", keys_ptr="*fp32", weights_ptr="*fp32", sums_ptr="*fp64",
        total_ptr="*fp64", valid_ptr="*i1", t_ptr="*fp32", k_ptr="*i64", p_ptr="*fp32",
        m_ptr="*fp32", sigma_ptr="*fp32", typical_ptr="*fp32", eps_ptr="*fp32",
        eta_ptr="*fp32", xp_ptr="*fp32", xt_ptr="*fp32", dr_ptr="*fp32", de_ptr="*fp32",
        tau_ptr="*fp32", mu_ptr="*fp32", rows_ptr="*i64", seed_ptr="*i64", step_ptr="*i64",
        stream_ptr="*i64", top_ids_ptr="*i64", top_logp_ptr="*fp32", src_stride=I64,
        seed_stride=I64, step_stride=I64, stream_stride=I64, stream_value=I64,
        **{name: I64 for name in ("t_bits", "k_bits", "p_bits", "m_bits", "sigma_bits",
           "typical_bits", "eps_bits", "eta_bits", "xp_bits", "xt_bits", "dr_bits", "de_bits",
           "tau_bits")},
    )
    modes = ("T_MODE", "K_MODE", "P_MODE", "M_MODE", "SIGMA_MODE", "TYPICAL_MODE", "EPS_MODE",
             "ETA_MODE", "XP_MODE", "XT_MODE", "DR_MODE", "DE_MODE", "TAU_MODE")
    every = [kc.TEMPERATURE, kc.TOP_N_SIGMA, kc.JOINT, kc.MIN_P, kc.TYPICAL, kc.EPSILON,
             kc.ETA, kc.XTC, kc.MIROSTAT]
    cases = ((2, every, False, kc.DRAWN), (1, [kc.TOP_K, kc.TOP_P] + every[3:], True, kc.REMOVES))
    for mode, order, is_f64, coin in cases:  # a sampling step, then process_step's
        constants = dict({name: mode for name in modes}, ORDER=kc.order_word(order),
                         DYNATEMP=True, HAS_ROWS=True, HAS_STEP=True, STREAM_ROWS=True,
                         NUM_TOP=3, COIN=coin, NORMALIZED=coin != kc.DRAWN, IS_F64=is_f64,
                         TILE=512, BLOCK=256, PRECISE=True)
        types = dict(pointers)
        if is_f64:
            types.update(src_ptr="*fp64", x_ptr="*fp64", weights_ptr="*fp64",
                         top_logp_ptr="*fp64")
        compile_sm90(kc._chain_kernel, constants, lambda name: types.get(name, "i32"))
        print("compiled")

    # The GPU registration (a triton_op around the wrap_triton launch) traces under fakes.
    from torch.fx.experimental.proxy_tensor import make_fx
    from fastsample.kernels import step_ops

    assert not step_ops.INTERPRETED

    def chain(x, tau):
        return step_ops.chain_op(
            x, [None] * 12 + [tau], [0.8] + [math.nan] * 12, [kc.TEMPERATURE, kc.MIROSTAT],
            False, torch.zeros(4), None, torch.arange(4), None, None, 0, 2)

    graph = make_fx(chain, tracing_mode="fake")(torch.randn(4, 300), torch.rand(4) + 1).graph
    targets = [str(node.target) for node in graph.nodes if node.op == "call_function"]
    assert "fastsample.chain.default" in targets, targets
    print("traced")
""")


@pytest.mark.sm90_compile
def test_chain_kernel_compiles_for_a_gpu():
    """The GPU path without a GPU: Triton's compiler (sm_90, down to a cubin) takes the chain
    kernel with every stage, tensor and number settings, float32 and float64; its
    ``triton_op`` registration traces under fake tensors."""
    out = run_compiled(_COMPILE)
    assert out.count("compiled") == 2 and "traced" in out


@pytest.mark.parametrize("xtc", [False, True])
def test_process_step_is_the_torch_paths_distribution(backend, xtc):
    """``process_step`` with the chain on: the chain kernel, normalized (XTC's exact mixture:
    two launches with fixed coins), rows mapped to state rows (mirostat's ``mu`` there, or
    given per row), a bad row all zeros; the torch path's distribution within 1e-6."""
    settings = _step_settings(BATCH, True)
    if not xtc:
        del settings["xtc_probability"], settings["xtc_threshold"]
    settings["top_p"] = settings["top_p"].clone()
    settings["top_p"][3] = 2.0  # out of range: the row is all zeros
    params = fs.StepParams(BATCH, VOCAB, order="joint", **settings)
    stats = _state()
    rows = torch.tensor([2, 3, 0, 1])
    x = _logits(13)
    for mu in (None, torch.tensor([2.0, math.nan, 7.0, 3.0])):
        outs = {}
        for name in ("torch", "triton"):
            backend(name)
            outs[name] = fs.process_step(x, params, state=stats, rows=rows, mirostat_mu=mu)
        torch.testing.assert_close(outs["triton"], outs["torch"], rtol=0, atol=1e-6)
        assert bool((outs["triton"][3] == 0).all())
        assert torch.allclose(outs["triton"][:3].sum(-1), torch.ones(3, dtype=torch.float32))
    backend("triton")
    work = device_work(lambda: fs.process_step(x, params, state=stats, rows=rows))
    assert work.kernels == (2 if xtc else 1), (work.total, work.names)
