"""Several draws with greedy rows on the Triton backend (``fastsample::greedy_several``).

``sample(..., num_samples=n > 1)`` where some rows may be greedy (a ``(B,)`` temperature
holding zeros, or ``temperature=0``): greedy rows take the ``n`` largest inputs in order (ties
by the lower index), probability 1 per genuine draw, and the other rows draw as
``draw_from_sums`` does. Run on CPU tensors through Triton's interpreter
(``tests/kernels/conftest.py``) against the torch path: greedy rows and all-greedy calls
bitwise; sampled rows' tokens and validity bitwise, their probabilities up to an ulp of
``exp`` (numpy's in the interpreter, torch's on the torch path). Also bad rows, the launch
budget, one program per row (the GPU layout), ``torch.compile(fullgraph=True)`` and the
kernel compiling for a GPU. No law test here: greedy draws are deterministic, and sampled
rows' tokens are the torch path's (tests/kernels/test_triton_controls.py judges their law).
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

pytest.importorskip("triton")

import fastsample as fs
from compiled_mode import run_compiled
from fastsample.kernels import launch
from fastsample.kernels.philox import INTERPRETED
from fastsample.tools.bench.launches import device_work

if not INTERPRETED:  # a CUDA machine without TRITON_INTERPRET: these tests use CPU tensors
    pytest.skip("CPU tensors need the interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

FIELDS = ("token_ids", "valid", "probs", "logprobs", "top_token_ids", "top_logprobs")


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv("FASTSAMPLE_BACKEND", name)

    return use


def both(backend, **kwargs):
    """``fs.sample(**kwargs)`` on the torch path, then on the Triton path (a generator is
    reseeded to the same state for each)."""
    generator = kwargs.get("generator")
    state = None if generator is None else generator.get_state()
    backend("torch")
    theirs = fs.sample(**kwargs)
    if generator is not None:
        generator.set_state(state)
    backend("triton")
    return theirs, fs.sample(**kwargs)


def assert_same(theirs, ours, exact_rows: torch.Tensor) -> None:
    """Every field bitwise on ``exact_rows`` (greedy and bad rows); elsewhere tokens, validity
    and top ids bitwise, probabilities up to an ulp of ``exp`` in the weights."""
    for field in FIELDS:
        want, got = getattr(theirs, field), getattr(ours, field)
        if want is None:
            assert got is None, field
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, field
        assert torch.equal(got[exact_rows], want[exact_rows]), (field, got, want)
        if field in ("token_ids", "valid", "top_token_ids"):
            assert torch.equal(got, want), (field, got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=field)


def take_rows(out, start: int):
    """``out`` (a ``SampleOutput``) from row ``start`` on."""
    return type(out)(*(None if field is None else field[start:] for field in out))


def mixed_rows(vocab: int, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """8 rows of logits and per-row controls, greedy on rows 0, 1, 3, 5, 7."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, vocab, generator=gen) * 2
    x[1] = torch.randint(0, 4, (vocab,), generator=gen).float()  # heavy ties, greedy
    x[2, ::3] = -math.inf  # a grammar mask on a sampled row
    x[3, 1:] = -math.inf  # one finite entry: later greedy slots are padding, row invalid
    x[7, ::2] = -0.0  # -0.0 ties 0.0 (ordered by index)
    x[7, 1::2] = 0.0
    temperature = torch.rand(8, generator=gen) + 0.5
    temperature[[0, 1, 3, 5, 7]] = 0.0
    top_k = torch.randint(0, vocab, (8,), generator=gen)
    top_k[5] = 1  # greedy rows take the n largest whatever the cuts
    top_p = torch.rand(8, generator=gen) * 0.5 + 0.5
    min_p = torch.rand(8, generator=gen) * 0.05
    controls = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return x, controls


GREEDY = torch.tensor([True, True, False, True, False, True, False, True])


@pytest.mark.parametrize(
    "kind, num_samples",
    [("logits", 2), ("logits", 5), ("probs", 2), ("logits-float64", 5), ("logits-bfloat16", 2)],
)
def test_mixed_greedy_rows_match_torch_path(kind, num_samples, backend):
    vocab = 300  # two draw blocks and two top-entry tiles, the last one short
    x, controls = mixed_rows(vocab, seed=num_samples)
    data = {
        "logits": dict(logits=x),
        "probs": dict(probs=torch.softmax(x, -1)),
        "logits-float64": dict(logits=x.double()),
        "logits-bfloat16": dict(logits=x.bfloat16()),
    }[kind]
    seed = torch.arange(8) * 7919 + 3
    theirs, ours = both(
        backend, **data, **controls, num_samples=num_samples, seed=seed, top_logprobs=3
    )
    assert_same(theirs, ours, GREEDY)
    # The contract on the greedy rows, not only agreement: the n largest in order.
    source = next(iter(data.values()))
    order = source.double().sort(dim=-1, descending=True, stable=True).indices
    for row in (0, 1, 5, 7):
        assert ours.token_ids[row].tolist() == order[row, :num_samples].tolist()
        assert bool((ours.probs[row] == 1).all()) and bool((ours.logprobs[row] == 0).all())
    # Row 3 has one finite logit (one positive probability): later slots repeat it, invalid.
    assert ours.token_ids[3].tolist() == [0] * num_samples and not ours.valid[3]
    assert ours.probs[3].tolist() == [1.0] + [0.0] * (num_samples - 1)
    assert bool(ours.valid[[0, 1, 5, 7]].all())


def test_full_permutation(backend):
    vocab = 12  # n = V: greedy rows are the whole row in order
    x, controls = mixed_rows(vocab, seed=3)
    seed = torch.arange(8) + 50
    theirs, ours = both(backend, logits=x, **controls, num_samples=vocab, seed=seed)
    assert_same(theirs, ours, GREEDY)
    theirs, ours = both(backend, logits=x, temperature=0.0, num_samples=vocab, top_logprobs=2)
    assert_same(theirs, ours, torch.ones(8, dtype=torch.bool))
    order = x.sort(dim=-1, descending=True, stable=True).indices
    assert torch.equal(ours.token_ids[[0, 1, 5, 7]], order[[0, 1, 5, 7]])


def test_all_greedy_python_zero_matches_torch_path(backend):
    x, controls = mixed_rows(40, seed=9)
    probs = torch.softmax(x, -1)
    probs[4, ::2] = 0.0  # zero probabilities are never genuine
    every = torch.ones(8, dtype=torch.bool)
    calls = [
        dict(logits=x, temperature=0.0, num_samples=3),  # one launch, rows judged there
        dict(probs=probs, temperature=0.0, num_samples=40),
        dict(logits=x.double(), temperature=0.0, num_samples=2, seed=4),
        # With top_logprobs: the controls kernel first (its tensor controls judge rows).
        dict(logits=x, temperature=0.0, top_k=controls["top_k"], num_samples=3, top_logprobs=4),
        dict(probs=probs, temperature=0.0, min_p=0.2, num_samples=25, top_logprobs=1),
    ]
    for kwargs in calls:
        theirs, ours = both(backend, **kwargs)
        assert_same(theirs, ours, every)


def test_generator_calls(backend):
    """Unseeded: greedy rows bitwise the torch path's; sampled rows draw distinct tokens with
    their processed probabilities (the generator's bits differ between the backends)."""
    x, controls = mixed_rows(64, seed=21)
    generator = torch.Generator().manual_seed(8)
    theirs, ours = both(backend, logits=x, **controls, num_samples=3, generator=generator)
    for field in ("token_ids", "valid", "probs", "logprobs"):
        assert torch.equal(getattr(ours, field)[GREEDY], getattr(theirs, field)[GREEDY]), field
    dist = fs.process(x, **controls)
    for row in torch.nonzero(~GREEDY).flatten().tolist():
        ids = ours.token_ids[row]
        genuine = ours.probs[row] > 0
        assert len(set(ids[genuine].tolist())) == int(genuine.sum())
        want = dist[row, ids[genuine]]
        torch.testing.assert_close(ours.probs[row][genuine], want, rtol=1e-5, atol=0)
        assert bool(ours.valid[row]) == bool(genuine.all())
    theirs, ours = both(backend, logits=x, temperature=0.0, num_samples=3, generator=generator)
    assert_same(theirs, ours, torch.ones(8, dtype=torch.bool))


def test_bad_rows_are_flagged_and_leave_other_rows_bitwise_unchanged(backend):
    clean, controls = mixed_rows(90, seed=31)
    x = clean.clone()
    x[0, 4] = math.nan  # greedy rows: NaN, +inf
    x[1, 2] = math.inf
    bad_controls = {name: value.clone() for name, value in controls.items()}
    bad_controls["top_k"][5] = -1  # a greedy row's bad control flags it too
    bad_controls["temperature"][4] = -1.0
    bad_controls["temperature"][6] = math.nan  # not 0: not greedy, and bad
    stream = torch.zeros(8, dtype=torch.int64)
    stream[7] = 2**24  # out of range, on a greedy row
    bad = torch.tensor([True, True, False, False, True, True, True, True])
    common = dict(seed=torch.arange(8) + 1, num_samples=3, top_logprobs=2)
    theirs, ours = both(backend, logits=x, stream=stream, **common, **bad_controls)
    # A NaN row's top ids are arbitrary on either path (fastsample.ops.select.top_entries).
    assert_same(take_rows(theirs, 1), take_rows(ours, 1), (GREEDY | bad)[1:])
    assert torch.equal(ours.top_logprobs[0], theirs.top_logprobs[0])
    assert not bool(ours.valid[bad].any())
    assert torch.equal(ours.token_ids[bad], torch.arange(3).expand(int(bad.sum()), 3))
    assert bool((ours.probs[bad] == 0).all()) and bool((ours.logprobs[bad] == -math.inf).all())
    reference = fs.sample(clean, stream=torch.zeros_like(stream), **common, **controls)
    for field in FIELDS:
        assert torch.equal(getattr(ours, field)[~bad], getattr(reference, field)[~bad]), field
    # Probabilities: a negative entry and a zero row are bad; a greedy row needs no sum.
    probs = torch.softmax(clean, -1)
    probs[0, 3] = -0.1
    probs[1] = 0.0
    probs[5] = 2.0**124  # total 90 * 2**124 >= 2**128: flagged on sampled rows only
    probs[6] = 2.0**124
    t = controls["temperature"]
    theirs, ours = both(backend, probs=probs, temperature=t, num_samples=2, seed=5)
    assert_same(theirs, ours, GREEDY | torch.tensor([1, 1, 0, 0, 0, 0, 1, 0], dtype=torch.bool))
    assert ours.valid[[0, 1, 5, 6]].tolist() == [False, False, True, False]


def test_one_row_per_program_agrees(monkeypatch, backend):
    """The GPU layout (one row per program; here also programs without a greedy row) gives
    the interpreter's row tiles' answer, bitwise."""
    backend("triton")
    x, controls = mixed_rows(40, seed=41)
    kwargs = dict(logits=x, **controls, num_samples=3, seed=torch.arange(8))
    tiled = fs.sample(**kwargs)
    greedy = fs.sample(logits=x, temperature=0.0, num_samples=3)
    monkeypatch.setattr(launch, "rows_per_program", lambda *args, **kwargs: 1)
    per_row = fs.sample(**kwargs), fs.sample(logits=x, temperature=0.0, num_samples=3)
    for want, got in zip((tiled, greedy), per_row, strict=True):
        for field in FIELDS[:4]:
            assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_launch_budget(backend):
    """Issue 16's budget, for several draws too: tensor controls + seeds <= 4, numbers <= 4,
    greedy <= 2; and the kernels serve these calls (no fallback to the torch ops)."""
    backend("triton")
    x, controls = mixed_rows(1000, seed=51)
    seed, step = torch.arange(8), torch.ones(8, dtype=torch.int64)
    budgets = {
        "tensor controls + seeds, n=2": (
            lambda: fs.sample(x, seed=seed, step=step, stream=step, num_samples=2, **controls),
            4,
        ),
        "tensor controls, Python seed and step, n=2": (
            lambda: fs.sample(x, seed=3, step=2, num_samples=2, **controls),
            4,
        ),
        "tensor controls, unseeded, n=3": (lambda: fs.sample(x, num_samples=3, **controls), 4),
        "numbers, seeded, n=2": (
            lambda: fs.sample(x, temperature=0.7, top_k=50, top_p=0.9, num_samples=2, seed=1),
            4,
        ),
        "greedy, n=2": (lambda: fs.sample(x, temperature=0.0, num_samples=2), 2),
        "greedy, n=4, top_logprobs": (
            lambda: fs.sample(x, temperature=0, num_samples=4, top_logprobs=2),
            2,
        ),
    }
    for name, (call, budget) in budgets.items():
        work = device_work(call)  # aten ops (no views, no allocations) + kernel launches
        assert work.kernels >= 1 and work.total <= budget, f"{name}: {work}"


def test_compiled_fullgraph_traces_the_kernels(backend):
    backend("triton")
    x, controls = mixed_rows(64, seed=61)
    seed = torch.arange(8)

    def step(logits, seed, temperature, top_k, top_p, min_p):
        out = fs.sample(logits, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=min_p, num_samples=2)  # fmt: skip
        greedy = fs.sample(logits, temperature=0.0, num_samples=2)
        return out.token_ids, out.probs, out.valid, greedy.token_ids

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got = compiled(x, seed, *controls.values())
    want = step(x, seed, *controls.values())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


_COMPILE = textwrap.dedent("""
    from compiled_mode import compile_sm90
    from fastsample.kernels import greedy

    POINTERS = dict(
        src_ptr="*bf16", weights_ptr="*fp32", sums_ptr="*fp64", total_ptr="*fp64",
        clean_ptr="*i1", t_ptr="*fp32", seed_ptr="*i64", step_ptr="*i64", stream_ptr="*i64",
        ids_ptr="*i64", p_ptr="*fp32", logp_ptr="*fp32", valid_ptr="*i1",
    )
    SIZES = dict(IS_LOGITS=True, IS_F64=False, NUM_SAMPLES=3, N_PAD=4, ROWS=1, TILE=256,
                 SUMS_TILE=512, ONE_SUMS_TILE=True, HAS_STEP=True, STREAM_ROWS=True)
    kernel = greedy._draws_kernel
    for mode in (greedy.SOME, greedy.SCAN):
        constants = dict(SIZES, MODE=mode)
        compile_sm90(
            kernel, constants, lambda name: POINTERS.get(name, "i64" if "stride" in name else "i32")
        )
        print("compiled", mode)

    # The GPU registration (triton_op around a wrap_triton launch) traces under fake tensors.
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from fastsample.kernels import controls_ops

    assert not controls_ops.INTERPRETED
    x, t, seed = torch.randn(4, 300), torch.tensor([0.0, 1.0, 0.0, 0.5]), torch.arange(4)

    def mixed(x, t, seed):
        controls = controls_ops.controls_op(
            x, True, t, 1.0, None, 0, None, 0.9, None, 0.0, None, 0, False, "transformers"
        )
        return controls_ops.several_op(x, True, 2, *controls[:4], t, seed, None, None, 0)

    def every_row(x, t, seed):
        return controls_ops.several_op(x, True, 3, None, None, None, None, None, None, None,
                                       None, 0)  # fmt: skip

    for call in (mixed, every_row):
        graph = make_fx(call, tracing_mode="fake")(x, t, seed).graph
        targets = [str(node.target) for node in graph.nodes if node.op == "call_function"]
        assert "fastsample.greedy_several.default" in targets, targets
    print("traced")
""")


@pytest.mark.sm90_compile
def test_kernel_compiles_for_a_gpu():
    """Compiled Triton is stricter than the interpreter: the kernel builds for sm_90 (no GPU
    needed), with sampled and greedy rows and with every row greedy; and its ``triton_op``
    registration traces under fake tensors (as ``torch.compile`` on a GPU)."""
    out = run_compiled(_COMPILE, fp_fusion=False)
    assert out.count("compiled") == 2 and "traced" in out, out


def test_torch_path_greedy_probabilities_agree_across_control_forms(backend):
    """On the torch path too, a genuine greedy draw has probability 1 whether T = 0 is a Python
    number or a tensor value, also on a row with fewer genuine draws than n (invalid): the
    behaviour the kernels reproduce (the tensor form once reported T = 1 probabilities)."""
    backend("torch")
    x = torch.tensor([[0.0, -1.0, -math.inf, -math.inf], [0.0, -1.0, -2.0, -3.0]])
    zero = torch.zeros(2)
    for extra in ({}, {"top_logprobs": 2}, {"top_k": torch.tensor([1, 2])}):
        tensor_form = fs.sample(x, temperature=zero, num_samples=3, seed=1, **extra)
        number_form = fs.sample(x, temperature=0.0, num_samples=3, **extra)
        for out in (tensor_form, number_form):
            assert out.token_ids.tolist() == [[0, 1, 1], [0, 1, 2]]
            assert out.probs.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
            assert out.logprobs[0].tolist() == [0.0, 0.0, -math.inf]
            assert out.valid.tolist() == [False, True]


def test_zero_dim_and_strided_control_tensors(backend):
    """0-dim tensors (expanded to ``(B,)`` with stride 0) and strided views are read per row:
    the kernels read ``ptr + row``, so such controls and streams are copied to unit stride."""
    x, _ = mixed_rows(50, seed=71)
    every_other = torch.tensor([0.0, 1.0] * 8)[::2]  # stride 2: all zeros, every row greedy
    calls = [
        dict(temperature=torch.tensor(0.0), top_p=torch.full((16,), 0.9)[::2], seed=1),
        dict(temperature=every_other, top_k=torch.tensor(3), seed=1, num_samples=2),
        dict(
            temperature=torch.tensor(0.7),
            top_k=torch.tensor(3),
            seed=torch.tensor(3),
            stream=torch.tensor(5),
            num_samples=2,
        ),
        dict(temperature=torch.tensor(0.0), seed=1, stream=torch.tensor(2**24), num_samples=2),
    ]
    for kwargs in calls:
        theirs, ours = both(backend, logits=x, **kwargs)
        greedy = (kwargs["temperature"] == 0).expand(8)  # sampled rows: up to an ulp of exp
        assert_same(theirs, ours, greedy)
    assert not bool(ours.valid.any())  # the out-of-range stream reached every row
