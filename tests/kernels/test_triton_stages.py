"""The engine step on the Triton backend (the stages, controls and draw kernels) against the
torch path, which stays the reference.

Run on CPU tensors through Triton's interpreter (``tests/kernels/conftest.py``) at small sizes:

* the staged buffer (stages a-c) equals the torch path's ``staged_logits`` **bitwise**, for
  every stage alone and all together, settings as Python lists/numbers and as tensors,
  float32/bfloat16/float64 logits, rows long enough for the torch path's sparse penalties,
  ``bitmask_indices``, duplicate bias ids (added in list order) across entry tiles, and the
  verification rows map with extra tokens (every operation is the same float operation: no
  ``exp`` or ``log`` is involved);
* ``sample_step`` draws the torch path's tokens with the same seeds (processed and raw
  logprobs, one or several draws, greedy rows, probabilities, an all-greedy step); ``probs``
  and the logprob fields agree within 1e-6 (``exp``/``log`` in the interpreter are numpy's,
  the torch path's are torch's: an ulp apart; the raw normalizer's float64 sum runs in
  another order), ranks and top ids exactly;
* bad rows (NaN, +inf, nothing allowed, out-of-range tensor settings) get the policy and leave
  the other rows bitwise unchanged; ``TokenStats.update`` equals the torch update bitwise;
* launch budgets: a full step with every stage and top-5 logprobs (plus ranks and requested
  ids) is 3 launches and no other device op, processed or raw; the update is 1;
* the kernels compile for sm_90 and their ops trace under fake tensors and
  ``torch.compile(fullgraph=True)``.

The law of the draws is carried by the torch path's tests (tests/stages/test_step_law.py):
the kernels draw its tokens, checked here row by row.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import fastsample as fs
from compiled_mode import run_compiled
from fastsample.kernels.philox import INTERPRETED
from fastsample.stages import staged_logits, step
from fastsample.tools.bench.launches import device_work
from stage_reference import Row, fastsample_args

pytestmark = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors need the interpreter (TRITON_INTERPRET=1)"
)


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv("FASTSAMPLE_BACKEND", name)

    return use


def both(backend, fn, *args, **kwargs):
    """``fn`` on the torch path, then on the Triton path."""
    backend("torch")
    theirs = fn(*args, **kwargs)
    backend("triton")
    return theirs, fn(*args, **kwargs)


STAGES = ("allowed", "bitmask", "bias", "min_tokens", "repetition", "frequency", "presence")


def rows_for(vocab: int, batch: int, seed: int, stages) -> tuple[np.ndarray, list[Row]]:
    """Random logits and per-row settings with ``stages`` on (some rows off)."""
    rng = np.random.default_rng(seed)
    xs = (rng.normal(size=(batch, vocab)) * 2).astype(np.float32)
    rows = []
    for b in range(batch):
        row = Row(temperature=float(rng.choice([0.6, 1.0, 1.4])))
        if "allowed" in stages and b % 3 != 2:
            size = int(rng.integers(3, vocab))
            row.allowed = rng.choice(vocab, size=size, replace=False).tolist()
        if "bitmask" in stages and b != 1:
            words = rng.integers(-(2**31), 2**31, size=(vocab + 31) // 32)
            row.bitmask_words = (words | 0x00FF00FF).astype(np.int32)
        if "bias" in stages and b != 0:
            ids = rng.choice(vocab, size=int(rng.integers(1, 6)), replace=False)
            row.bias = {int(i): float(rng.normal() * 2) for i in ids}
        if "min_tokens" in stages:
            row.min_tokens = int(rng.integers(0, 5))
            row.stop = rng.choice(vocab, size=int(rng.integers(1, 4)), replace=False).tolist()
        row.outputs = rng.integers(0, vocab, size=int(rng.integers(0, 8))).tolist()
        row.prompt = rng.integers(0, vocab, size=int(rng.integers(1, 10))).tolist()
        if row.bias:  # a biased token that is also seen: the penalty applies to the biased value
            row.bias[(row.outputs or row.prompt)[0]] = 1.75
        if "repetition" in stages:
            row.repetition = float(rng.choice([1.0, 0.7, 1.3, 2.0]))
        if "frequency" in stages:
            row.frequency = float(rng.choice([0.0, 0.4, -0.3]))
        if "presence" in stages:
            row.presence = float(rng.choice([0.0, 0.6, -0.5]))
        rows.append(row)
    xs[0, :5] = [-0.0, 0.0, 3.0, -2.0, 0.5]  # -0.0 at column 0, where bias padding adds +0.0
    return xs, rows


def _case(vocab, batch, seed, stages, form, backend, **extra):
    backend("torch")  # the statistics are built (updated) by the torch path
    xs, rows = rows_for(vocab, batch, seed, stages)
    params, stats, bitmask = fastsample_args(rows, vocab, form, **extra)
    return torch.from_numpy(xs), params, stats, bitmask


@pytest.mark.parametrize("form", ["list", "tensor"])
@pytest.mark.parametrize(
    "stages", [(s,) for s in STAGES] + [STAGES], ids=[*STAGES, "all"]
)  # fmt: skip
def test_staged_buffer_equals_the_torch_path_bitwise(stages, form, backend):
    x, params, stats, bitmask = _case(70, 5, len("".join(stages)) + len(form), stages, form,
                                      backend)  # fmt: skip
    theirs, ours = both(backend, staged_logits, x, params, state=stats, token_bitmask=bitmask)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs) and torch.equal(ours.signbit(), theirs.signbit())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_staged_buffer_other_dtypes_and_long_rows(dtype, backend):
    """Half and double logits; V = 4100 takes the torch path's sparse penalties (two tiles
    of the interpreter's 4096)."""
    vocab = 4100 if dtype == torch.bfloat16 else 300
    x, params, stats, bitmask = _case(vocab, 3, 5, STAGES, "tensor", backend)
    x = x.to(dtype)
    theirs, ours = both(backend, staged_logits, x, params, state=stats, token_bitmask=bitmask)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    assert ours.dtype == theirs.dtype == wide
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_settings_as_python_numbers(dtype, backend):
    """Penalties, min-tokens and the output length as Python numbers (a Python repetition
    penalty is a float32 on the torch path, also for float64 logits)."""
    batch, vocab = 4, 100
    backend("torch")
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
    stats = fs.TokenStats.from_prompts(torch.randint(-1, vocab, (batch, 12), generator=gen), vocab,
                                       outputs=torch.randint(-1, vocab, (batch, 6), generator=gen))
    params = fs.StepParams(batch, vocab, repetition_penalty=1.1, frequency_penalty=0.3,
                           presence_penalty=-0.7, min_tokens=4,
                           stop_token_ids=[[1], [2, 3], [], [4]],
                           logit_bias=[{5: 0.1}, None, {6: -1.5, 7: 2.0}, None])  # fmt: skip
    for output_len in (None, 2, 9):
        theirs, ours = both(backend, staged_logits, x, params, state=stats, output_len=output_len)
        assert torch.equal(ours, theirs) and torch.equal(ours.signbit(), theirs.signbit())


def test_bitmask_indices_and_duplicate_bias_ids(backend):
    """Rows listed in ``bitmask_indices`` take their bitmask row (an index past the bitmask's
    rows masks nothing); an id listed several times adds in list order (``(1 + 1e8) - 1e8``
    is not ``1 + (1e8 - 1e8)`` in float32), also across tiles of 64 entries; ids outside
    the vocabulary flag their row and add nothing."""
    batch, vocab = 4, 100
    x = torch.randn(batch, vocab)
    x[:, 7] = 1.0
    ids = torch.full((batch, 70), -1)
    values = torch.zeros(batch, 70)
    ids[0, :3], values[0, :3] = 7, torch.tensor([1e8, -1e8, 0.25])
    ids[1, 60:70], values[1, 60:70] = 7, torch.linspace(-3e7, 5e7, 10)  # across the tile edge
    ids[1, 0], values[1, 0] = 7, 1e8
    ids[2, 5], values[2, 5] = vocab + 3, 1.0  # out of range: row 2 flagged
    params = fs.StepParams(batch, vocab, logit_bias=(ids, values), seed=0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    for indices in ([0, 2], torch.tensor([2, 1])):
        kwargs = dict(token_bitmask=bitmask, bitmask_indices=indices)
        theirs, ours = both(backend, staged_logits, x, params, **kwargs)
        assert torch.equal(ours, theirs)
    assert ours[0, 7] == 0.25  # ((1 + 1e8) - 1e8) + 0.25 in float32; in any other order 1.25
    out_t, out_o = both(backend, fs.sample_step, x, params=params, step=0)
    assert out_o.valid.tolist() == out_t.valid.tolist() == [True, True, False, True]


def test_rows_map_and_extra_tokens(backend):
    """Verification's targets: row ``r`` reads stats row ``rows[r]`` and counts its extra
    tokens (drafts before it) as output, for the penalties and for min-tokens."""
    batch, positions, vocab = 3, 3, 80
    backend("torch")
    _, settings = rows_for(vocab, batch, 11, STAGES)
    for row in settings:  # min-tokens reached by the drafts: position 0 blocks, later ones not
        row.min_tokens = len(row.outputs) + 1
        row.stop = list(range(3, 60, 7))
    params, stats, bitmask = fastsample_args(settings, vocab, "tensor")
    rows = torch.arange(batch).repeat_interleave(positions)
    gen = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, vocab, (batch, positions - 1), generator=gen)
    drafts[1, 0] = drafts[1, 1]  # a token drafted twice
    upto = torch.arange(positions)[:, None] > torch.arange(positions - 1)
    extra = torch.where(upto, drafts[:, None, :], -1).reshape(batch * positions, -1)
    logits = torch.randn(batch * positions, vocab, generator=gen)
    flat = bitmask.repeat_interleave(positions, 0)
    wide = params.repeat_rows(positions)
    args = (logits, True, wide, stats, flat, None, None, False, rows, extra)
    theirs, ours = both(backend, step._prepare, *args)
    assert torch.equal(ours.scores, theirs.scores)
    theirs, ours = both(backend, fs.process_step, logits, wide, state=stats,
                        token_bitmask=flat, rows=rows, extra=extra)  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-9)


def test_verify_chain_with_stages_and_the_update(backend):
    """``verify_chain(target_logits=..., params=..., state=...)`` on the Triton backend (stages
    kernel with the rows map and drafts as extra tokens, controls kernel, verify kernel) emits
    the torch path's tokens, and the statistics updated with them are the torch path's."""
    batch, k, vocab = 3, 2, 60
    _, params, stats, _ = _case(vocab, batch, 13, STAGES, "tensor", backend)
    gen = torch.Generator().manual_seed(13)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    outs = {}
    for name in ("torch", "triton"):
        backend(name)
        mine = stats.select(torch.arange(batch))
        out = fs.verify_chain(target_logits=target, draft_token_ids=drafts, params=params,
                              state=mine, seed=torch.arange(batch) + 5)  # fmt: skip
        mine.update(out.token_ids)
        outs[name] = out, mine
    (theirs, theirs_stats), (ours, our_stats) = outs["torch"], outs["triton"]
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(our_stats.output_counts, theirs_stats.output_counts)
    assert torch.equal(our_stats.seen_mask, theirs_stats.seen_mask)


def _step_params(form: str, **extra):
    return dict(form=form, top_logprobs=5, token_ranks=True, **extra)


def _assert_same_step(theirs, ours, what: str) -> None:
    for field in ("token_ids", "valid", "top_token_ids", "ranks"):
        a, b = getattr(theirs, field), getattr(ours, field)
        assert (a is None and b is None) or torch.equal(a, b), f"{what}: {field}"
    for field in ("probs", "logprobs", "top_logprobs", "requested_logprobs"):
        a, b = getattr(theirs, field), getattr(ours, field)
        assert (a is None) == (b is None), f"{what}: {field}"
        if a is not None:
            assert a.dtype == b.dtype, f"{what}: {field}"
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"{what}: {field}")


STEP_CASES = {
    "processed-list": dict(mode="processed", form="list", num_samples=1),
    "raw-tensor": dict(mode="raw", form="tensor", num_samples=1),
    "processed-two-draws-greedy-rows": dict(mode="processed", form="tensor", num_samples=2),
    "raw-two-draws": dict(mode="raw", form="list", num_samples=2),
    "processed-joint-order": dict(mode="processed", form="tensor", num_samples=1, order="joint"),
}


def _with_controls(rows: list[Row], seed: int, greedy_row: int | None = 1) -> list[Row]:
    """Temperature, top-k, top-p and min-p per row (row ``greedy_row`` greedy)."""
    rng = np.random.default_rng(seed)
    for b, row in enumerate(rows):
        row.temperature = 0.0 if b == greedy_row else float(rng.uniform(0.4, 1.4))
        row.top_k = int(rng.choice([0, int(rng.integers(1, 40))]))
        row.top_p = float(rng.choice([1.0, rng.uniform(0.5, 1.0)]))
        row.min_p = 0.02
    return rows


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_sample_step_draws_the_torch_paths_tokens(case, backend):
    spec = STEP_CASES[case]
    batch, vocab = 6, 120
    x, _, stats, bitmask = _case(vocab, batch, len(case), STAGES, spec["form"], backend)
    rows = _with_controls(rows_for(vocab, batch, len(case), STAGES)[1], len(case))
    for row in rows:
        row.cut_order = spec.get("order", "transformers")
        if row.cut_order == "joint":  # top-k and top-p both on: the order matters
            row.top_k, row.top_p = 20, 0.8
    gen = torch.Generator().manual_seed(len(case))
    requested = torch.randint(-1, vocab, (batch, 4), generator=gen)
    params, _, _ = fastsample_args(
        rows, vocab, spec["form"], logprobs_mode=spec["mode"], num_samples=spec["num_samples"],
        seed=torch.arange(batch) * 7 + 1, top_logprobs=5, token_ranks=True,
        logprob_token_ids=requested if spec["form"] == "tensor" else requested.tolist(),
    )  # fmt: skip
    assert isinstance(params.controls.temperature, torch.Tensor)
    steps = torch.arange(batch) + 3
    theirs, ours = both(backend, fs.sample_step, x, params=params, state=stats, step=steps,
                        token_bitmask=bitmask)  # fmt: skip
    assert bool(theirs.valid[1])  # the greedy row
    _assert_same_step(theirs, ours, case)


def test_greedy_steps_and_probabilities(backend):
    """An all-greedy step without controls to weigh (the draw launch judges the rows), one with
    top-N (the controls kernel's point masses), and probabilities with allowed ids in the raw
    mode."""
    batch, vocab = 4, 90
    x, _, stats, bitmask = _case(vocab, batch, 2, STAGES, "list", backend)
    rows = rows_for(vocab, batch, 2, STAGES)[1]
    for row in rows:
        row.temperature = 0.0
    for num_samples, top in ((1, 0), (3, 0), (2, 4)):
        params, _, _ = fastsample_args(rows, vocab, "list", num_samples=num_samples,
                                       top_logprobs=top, token_ranks=True,
                                       logprob_token_ids=[[1, 2], [3], [], [4, 5]])  # fmt: skip
        assert params.controls.all_greedy
        theirs, ours = both(backend, fs.sample_step, x, params=params, state=stats,
                            token_bitmask=bitmask)  # fmt: skip
        _assert_same_step(theirs, ours, f"greedy n={num_samples} top={top}")
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.5, 2.0], [0.1, 0.2, 0.2, 0.4, 0.5]])
    for t in (torch.tensor([0.0, 1.0]), 0.0):  # the draw and the greedy launch's modes
        params = fs.StepParams(2, 5, temperature=t, num_samples=3, token_ranks=True, seed=0)
        theirs, ours = both(backend, fs.sample_step, ties, params=params, step=0)
        assert ours.ranks[0].tolist() == [1, 2, 3] == theirs.ranks[0].tolist()  # ties in order
        _assert_same_step(theirs, ours, f"ties T={t}")
    probs = torch.softmax(x, -1)
    params = fs.StepParams(batch, vocab, allowed_token_ids=[[1, 2, 3], None, list(range(40)), [7]],
                           temperature=0.8, top_p=0.9, seed=4, top_logprobs=3,
                           logprobs_mode="raw", token_ranks=True,
                           logprob_token_ids=[[1, 50], [3], [4], [7]])  # fmt: skip
    theirs, ours = both(backend, fs.sample_step, probs=probs, params=params, step=0)
    _assert_same_step(theirs, ours, "probs raw")
    params.logprobs_mode = "processed"
    theirs, ours = both(backend, fs.sample_step, probs=probs, params=params, step=0)
    _assert_same_step(theirs, ours, "probs processed")


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_bad_rows_get_the_policy_and_leave_good_rows_unchanged(mode, backend):
    batch, vocab = 6, 100
    x, _, stats, bitmask = _case(vocab, batch, 21, STAGES, "tensor", backend)
    rows = _with_controls(rows_for(vocab, batch, 21, STAGES)[1], 21, greedy_row=None)
    extra = dict(seed=torch.arange(batch), logprobs_mode=mode, top_logprobs=2, token_ranks=True,
                 logprob_token_ids=torch.tensor([[1, 2]] * batch))  # fmt: skip
    params, _, _ = fastsample_args(rows, vocab, "tensor", **extra)
    rows[4].min_tokens = -1  # out of range: flagged by the parameters (values left as they are)
    bad_params, _, _ = fastsample_args(rows, vocab, "tensor", **extra)
    bad_x = x.clone()
    bad_x[1, ::2] = math.nan  # (whole rows: an entry may be masked)
    bad_x[2, 1::2] = math.inf
    bad_mask = bitmask.clone()
    bad_mask[3] = 0  # nothing allowed
    bad = torch.tensor([False, True, True, True, True, False])
    kwargs = dict(params=bad_params, state=stats, token_bitmask=bad_mask, step=0)
    theirs, ours = both(backend, fs.sample_step, bad_x, **kwargs)
    clean = fs.sample_step(x, params=params, state=stats, token_bitmask=bitmask, step=0)
    assert ours.valid.tolist() == theirs.valid.tolist() == (~bad).tolist()
    assert (ours.ranks[bad] == 0).all() and (ours.probs[bad] == 0).all()
    assert torch.equal(ours.token_ids[bad], torch.zeros(int(bad.sum()), 1, dtype=torch.int64))
    for field in ("logprobs", "top_logprobs", "requested_logprobs"):
        assert (getattr(ours, field)[bad] == -math.inf).all(), field
    for field in ours._fields:
        assert torch.equal(getattr(ours, field)[~bad], getattr(clean, field)[~bad]), field


@pytest.mark.parametrize("dtype_tokens", [255, 32767, 100_000])
def test_update_kernel_equals_the_torch_update_bitwise(dtype_tokens, backend):
    batch, vocab = 4, 70  # three seen words, the last one partial
    gen = torch.Generator().manual_seed(dtype_tokens % 97)
    prompts = torch.randint(-1, vocab, (batch, 9), generator=gen)
    states = {}
    for name in ("torch", "triton"):
        backend("torch")
        stats = fs.TokenStats.from_prompts(prompts, vocab, max_output_tokens=dtype_tokens)
        stats.output_counts[0, 5] = torch.iinfo(stats.output_counts.dtype).max - 1  # the cap
        backend(name)
        for n in (3, 1, 5):
            draw = torch.Generator().manual_seed(n)
            ids = torch.randint(-2, vocab + 3, (batch, n), generator=draw)
            ids[0, 0] = 5
            if n > 1:
                ids[0, 1] = ids[1, 0] = 5
            ids[2, -1] = 69  # the last, partial word
            stats.update(ids)
        states[name] = stats
    theirs, ours = states["torch"], states["triton"]
    for field in ("output_counts", "output_len", "seen_mask", "prompt_mask"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    assert ours.output_counts[0, 5] == torch.iinfo(ours.output_counts.dtype).max


def _full_step(mode: str, batch: int = 5, vocab: int = 300):
    """A step with every stage on, as tensors, and every logprob option."""
    gen = torch.Generator().manual_seed(1)
    params = fs.StepParams(
        batch, vocab, temperature=torch.rand(batch, generator=gen) + 0.3,
        top_k=torch.randint(0, 60, (batch,), generator=gen),
        top_p=torch.rand(batch, generator=gen) * 0.5 + 0.5, min_p=torch.full((batch,), 0.02),
        repetition_penalty=torch.rand(batch, generator=gen) + 0.6,
        frequency_penalty=torch.rand(batch, generator=gen) - 0.5,
        presence_penalty=torch.rand(batch, generator=gen) - 0.5,
        logit_bias=(torch.randint(-1, vocab, (batch, 4), generator=gen),
                    torch.randn(batch, 4, generator=gen)),
        min_tokens=torch.randint(0, 4, (batch,), generator=gen),
        stop_token_ids=torch.randint(-1, vocab, (batch, 2), generator=gen),
        allowed_token_ids=torch.randint(-1, vocab, (batch, 200), generator=gen),
        seed=torch.arange(batch) + 100, top_logprobs=5, token_ranks=True,
        logprob_token_ids=torch.randint(-1, vocab, (batch, 3), generator=gen),
        logprobs_mode=mode,
    )  # fmt: skip
    logits = torch.randn(batch, vocab, generator=gen) * 2
    stats = fs.TokenStats.from_prompts(torch.randint(-1, vocab, (batch, 30), generator=gen), vocab)
    words = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32,
                          generator=gen) | 0x00FF00FF  # fmt: skip
    steps = torch.arange(batch)
    emitted = torch.randint(-1, vocab, (batch, 2), generator=gen)
    return logits, params, stats, words, steps, emitted


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_launch_budget(mode, backend):
    """A full step (every stage, tensor settings, seeds and steps, top-5 logprobs, ranks and
    requested ids) is the stages, controls and draw launches and nothing else; the update of
    the statistics is one launch."""
    backend("torch")
    logits, params, stats, words, steps, emitted = _full_step(mode)
    backend("triton")

    def call():
        return fs.sample_step(logits, params=params, state=stats, step=steps, token_bitmask=words)

    call()
    work = device_work(call)
    assert work.kernels == 3 and work.total <= 3, (work.total, work.names)
    stats.update(emitted)
    work = device_work(lambda: stats.update(emitted))
    assert work.kernels == 1 and work.total <= 1, (work.total, work.names)


def test_compiled_fullgraph_traces_the_step_and_the_update(backend):
    backend("torch")
    logits, params, stats, words, steps, emitted = _full_step("raw", batch=3, vocab=64)
    backend("triton")

    def run(logits, steps, words, emitted):
        out = fs.sample_step(logits, params=params, state=stats, step=steps, token_bitmask=words)
        stats.update(out.token_ids)
        return out.token_ids, out.logprobs, out.ranks, out.requested_logprobs

    before = stats.select(torch.arange(3))
    want = run(logits, steps, words, emitted)
    after_eager = stats.select(torch.arange(3))
    stats.output_counts.copy_(before.output_counts)
    stats.output_len.copy_(before.output_len)
    stats.seen_mask.copy_(before.seen_mask)
    got = torch.compile(run, fullgraph=True, backend="eager")(logits, steps, words, emitted)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(stats.output_counts, after_eager.output_counts)
    assert torch.equal(stats.seen_mask, after_eager.seen_mask)


_COMPILE = textwrap.dedent("""
    from compiled_mode import compile_sm90
    from fastsample.kernels import stages as ks, stats as kst, step_draw as kd

    def build(fn, signature, constexprs):
        compile_sm90(fn, constexprs, lambda name: signature.get(name, "i32"))
        print("compiled", fn.__name__)

    I64 = "i64"
    stage_pointers = dict(
        grammar_ptr="*i32", index_ptr="*i64", allowed_ptr="*i32", bias_ids_ptr="*i64",
        bias_values_ptr="*fp32", stop_ptr="*i64", min_ptr="*i64", len_ptr="*i64",
        rows_ptr="*i64", seen_ptr="*i32", extra_ptr="*i64", freq_ptr="*fp32", pres_ptr="*fp32",
        rep_bits=I64, freq_bits=I64, pres_bits=I64, min_value=I64, len_value=I64,
        log_total_ptr="*fp64", top_ids_ptr="*i64", top_logp_ptr="*fp64", words_out_ptr="*i32",
        hist_ptr="*i64", hist_stride=I64, scratch_ptr="*i64", last_n_ptr="*i64",
        last_n_bits=I64, mult_ptr="*fp32", mult_bits=I64, base_ptr="*fp32", base_bits=I64,
        allowed_ptr_h="*i64", allowed_bits=I64, window_ptr="*i64", window_bits=I64,
        ngram_ptr="*i64", ngram_bits=I64, table_ptr="*i64", singles_ptr="*i64",
    )
    every = dict(GRAMMAR=2, ALLOWED=True, WRITE=True, BIAS=True, STOPS=True, MIN_MODE=2,
                 LEN_MODE=2, ROWS_MAP=True, MASKED=True, FUSED=False, SECOND=True, REP=2, FREQ=1,
                 PRES=2, E_PAD=4, RAW=True, NUM_TOP=5, WORDS_OUT=True, TILE=512, PRECISE=True,
                 HISTORY=True, LAST_N_MODE=2, DRY_MODE=2, BASE_MODE=1, ALLOWED_MODE=2,
                 WINDOW_MODE=1, NGRAM_MODE=2, W_PAD=64)
    build(ks._stages_kernel, dict(stage_pointers, src_ptr="*bf16", out_ptr="*fp32",
          counts_ptr="*i16", rep_ptr="*fp32"), dict(every, IS_LOGITS=True, IS_F64=False))
    fused = dict(every, GRAMMAR=1, ALLOWED=False, BIAS=False, STOPS=False, ROWS_MAP=False,
                 FUSED=True, SECOND=False, REP=1, FREQ=2, PRES=1, E_PAD=0, RAW=False, NUM_TOP=0,
                 WORDS_OUT=False, LAST_N_MODE=1, DRY_MODE=1, BASE_MODE=2, ALLOWED_MODE=1,
                 WINDOW_MODE=2, NGRAM_MODE=1, W_PAD=4096)
    build(ks._stages_kernel, dict(stage_pointers, src_ptr="*fp64", out_ptr="*fp64",
          counts_ptr="*u8", rep_ptr="*fp64"), dict(fused, IS_LOGITS=True, IS_F64=True))
    probs = dict(fused, GRAMMAR=0, FUSED=False, REP=0, FREQ=0, PRES=0, RAW=True, NUM_TOP=3,
                 HISTORY=False, LAST_N_MODE=0, DRY_MODE=0, BASE_MODE=0, ALLOWED_MODE=0,
                 WINDOW_MODE=0, NGRAM_MODE=0, W_PAD=16)
    build(ks._stages_kernel, dict(stage_pointers, src_ptr="*fp16", out_ptr="*fp32",
          counts_ptr="*u8", rep_ptr="*fp32"), dict(probs, IS_LOGITS=False, IS_F64=False))
    unwritten = dict(probs, GRAMMAR=1, WRITE=False, NUM_TOP=5)  # raw top-N read from the input
    build(ks._stages_kernel, dict(stage_pointers, src_ptr="*bf16", out_ptr="*fp32",
          counts_ptr="*u8", rep_ptr="*fp32"), dict(unwritten, IS_LOGITS=True, IS_F64=False))
    draw_pointers = dict(
        src_ptr="*fp32", weights_ptr="*fp32", sums_ptr="*fp64", total_ptr="*fp64",
        clean_ptr="*i1", t_ptr="*fp32", seed_ptr="*i64", step_ptr="*i64", stream_ptr="*i64",
        ok_ptr="*i1", scores_ptr="*bf16", words_ptr="*i32", log_total_ptr="*fp64",
        top_in_ptr="*fp64", top_out_ptr="*fp32", req_ptr="*i64", req_out_ptr="*fp32",
        ids_ptr="*i64", p_ptr="*fp32", logp_ptr="*fp32", valid_ptr="*i1", ranks_ptr="*i64",
        src_stride=I64, w_stride=I64, sums_stride=I64, seed_stride=I64, step_stride=I64,
        stream_stride=I64, scores_stride=I64, words_stride=I64, req_stride=I64,
    )
    for mode in (0, 1, 2, 3):
        build(kd._step_draw_kernel, draw_pointers, dict(
            MODE=mode, IS_LOGITS=True, IS_F64=False, NUM_SAMPLES=2, N_PAD=2, ROWS=1, TILE=256,
            SUMS_TILE=512, ONE_SUMS_TILE=True, HAS_STEP=True, STREAM_ROWS=True,
            T_ROWS=mode != 3, ROWS_OK=True, RAW=mode != 1, WORDS=True, SCORES_F64=False,
            NUM_TOP=5, TOP_PAD=8, RANKS=True, REQ_PAD=4,
        ))
    build(kst._update_kernel, dict(ids_ptr="*i64", counts_ptr="*i16", length_ptr="*i64",
          seen_ptr="*i32", prompt_ptr="*i32", ids_stride=I64, counts_stride=I64),
          dict(TOP=32767, N_PAD=4))

    # The GPU registrations (triton_op around wrap_triton launches) trace under fake tensors.
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from fastsample.kernels import step_ops

    assert not step_ops.INTERPRETED
    logits, rep = torch.randn(4, 300), torch.rand(4) + 0.5

    def stages(x, r):
        return step_ops.stages_op(
            x, True, None, None, None, None, None, None, None, 0, None, 0, None,
            torch.zeros(4, 10, dtype=torch.int32), torch.zeros(4, 300, dtype=torch.int16),
            None, r, None, None, 0.5, None, None, True, True, 3, False)

    def draw(x, r):
        w, total, ok = torch.softmax(x, -1), torch.ones(4, dtype=torch.float64), r > 0
        sums = torch.ones(4, 2, dtype=torch.float64)
        return step_ops.step_draw_op(
            x, True, 0, 1, w, sums, total, ok, None, torch.arange(4), None, None, 0, ok, x,
            None, total, None, True, torch.zeros(4, 2, dtype=torch.int64))

    def update(x, r):
        counts = torch.zeros(4, 300, dtype=torch.int16)
        length = torch.zeros(4, dtype=torch.int64)
        seen = torch.zeros(4, 10, dtype=torch.int32)
        step_ops.update_op(counts, length, seen, seen.clone(), torch.ones(4, 2, dtype=torch.int64))
        return counts

    for name, call in {"stages": stages, "step_draw": draw, "stats_update": update}.items():
        graph = make_fx(call, tracing_mode="fake")(logits, rep).graph
        targets = [str(node.target) for node in graph.nodes if node.op == "call_function"]
        assert f"fastsample.{name}.default" in targets, targets
    print("traced")
""")


@pytest.mark.sm90_compile
def test_kernels_compile_for_a_gpu():
    """The GPU path without a GPU: Triton's compiler (sm_90, down to a cubin) takes the stages
    (the history stages too: a 64- and a 4096-entry context), step draw and update kernels
    (fusion on: the penalties' products are ``mul.rn``, which is never contracted), and their
    ``triton_op`` registrations trace under fake tensors."""
    out = run_compiled(_COMPILE)
    assert out.count("compiled") == 9 and "traced" in out


def test_sample_step_reads_the_state_through_state_rows(backend):
    """``state_rows`` (an engine's fixed per-request slots, vLLM's Model Runner V2): each
    logits row reads its slot of a larger state, for the penalties and min-tokens, on both
    backends; the draw equals the same step on the state's selected rows (``select``)."""
    batch, vocab = 4, 120
    backend("torch")
    _, settings = rows_for(vocab, 6, 5, STAGES)  # a state of 6 slots
    for row in settings:
        row.min_tokens = len(row.outputs) + 1
        row.stop = list(range(3, 60, 7))
    _, slots_state, _ = fastsample_args(settings, vocab, "tensor")
    slots = torch.tensor([4, 1, 5, 2])
    picked = [settings[int(s)] for s in slots]
    params, _, _ = fastsample_args(_with_controls(picked, 9), vocab, "tensor",
                                   seed=torch.arange(batch) + 11)  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, vocab, generator=gen) * 2
    steps = torch.arange(batch) + 2
    expected = fs.sample_step(x, params=params, state=slots_state.select(slots), step=steps)
    theirs, ours = both(backend, fs.sample_step, x, params=params, state=slots_state,
                        step=steps, state_rows=slots)  # fmt: skip
    assert torch.equal(theirs.token_ids, expected.token_ids)
    assert torch.equal(ours.token_ids, expected.token_ids)
    assert torch.equal(ours.valid, theirs.valid)
