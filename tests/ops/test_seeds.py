"""Counter-based per-request seeds: the generator, its statistics, batch invariance, exactness.

The generator itself (Philox-4x32-10) has known-answer tests in test_philox.py; here we test
what fastsample builds on it: the mapping of (seed, step, stream, position) to uniforms, their
quality and independence, and the samplers' guarantees.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch._dynamo
from test_philox import ref_philox4x32

import fastsample as fs
from fastsample.ops.seeds import CounterSource, Purpose, Stream, advance_step
from stattests import LawCase, assert_law, law_rejected, parity_biased
from test_exactness import (
    CASES,
    JOINT_CLAIM,
    JOINT_DRAWS,
    JOINT_ROW,
    case_row,
    joint_counts,
    joint_law,
    mid_mass_thinned,
    serial,
    shifted_tuples,
    single_draw_counts,
)

METHODS = ["inverse_cdf", "race"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MASK64 = (1 << 64) - 1


def reference_uniform(seed: int, step: int, stream: int, purpose: int, position: int) -> float:
    """The documented mapping, from the spec, in plain Python ints."""
    seed, step = seed & MASK64, step & MASK64
    ctr = (position // 2, (purpose << 24) | stream, step & 0xFFFFFFFF, step >> 32)
    x0, x1, x2, x3 = ref_philox4x32(ctr, (seed & 0xFFFFFFFF, seed >> 32))
    high, low = (x0, x3) if position % 2 == 0 else (x2, x1)
    return ((high << 21) | (low >> 11)) * 2.0**-53


def source(seed, step, stream=0):
    as_t = lambda v: torch.as_tensor(v, dtype=torch.int64)  # noqa: E731
    seed = as_t(seed)
    step, stream = (torch.broadcast_to(as_t(v), seed.shape) for v in (step, stream))
    return CounterSource(seed, step, stream)


def test_uniforms_match_the_documented_mapping():
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345]
    steps = [0, 1, 2**32 - 1, 2**32, 2**62 + 5, 7]
    streams = [0, 1, Stream.DRAFT, Stream.RECOVERY + 3, 2**24 - 1, 42]
    src = source(seeds, steps, streams)
    for purpose, start, length in [(Purpose.DRAW, 0, 3), (Purpose.ENTRY, 5, 20)]:
        got = src.uniforms(purpose, start, length)  # 20 entries: the per-word layout
        for b in range(len(seeds)):
            want = [
                reference_uniform(seeds[b], steps[b], streams[b], purpose, start + i)
                for i in range(length)
            ]
            assert got[b].tolist() == want


def test_host_uniforms_are_the_tensor_layouts_bits(monkeypatch):
    """Rows on CPU take Philox on Python ints, every block a 64-bit lane of one computation
    (fastsample.ops.seeds.HOST_MAX_BLOCKS): the same float64 uniforms, bit for bit, as the
    packed tensor layout and the per-word one, for negative and 64-bit seeds and steps, tensor
    and int streams, any start and length, one to 64 rows (lanes from 1 to 192), as tensors
    and as Python floats."""
    from fastsample.ops import seeds

    gen = torch.Generator().manual_seed(5)
    for batch in (1, 2, 5, 64):
        seed = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
        step = torch.randint(-(2**40), 2**40, (batch,), generator=gen)
        tensor_stream = torch.randint(0, 2**24, (batch,), generator=gen)
        draw, entry = Purpose.DRAW, Purpose.ENTRY
        spans = ((draw, 0, 1), (draw, 1, 2), (entry, 3, 5), (draw, 0, 3))
        for stream in (tensor_stream, 7, int(Stream.BONUS)):
            for purpose, start, length in spans:
                monkeypatch.setattr(seeds, "HOST_MAX_BLOCKS", 10**6)
                host = CounterSource(seed, step, stream).uniforms(purpose, start, length)
                monkeypatch.setattr(seeds, "HOST_MAX_BLOCKS", 0)
                packed = CounterSource(seed, step, stream).uniforms(purpose, start, length)
                monkeypatch.setattr(CounterSource, "FEW_BLOCKS", 0)
                per_word = CounterSource(seed, step, stream).uniforms(purpose, start, length)
                monkeypatch.undo()
                assert torch.equal(host, packed) and torch.equal(host, per_word)
            for num in (1, 2, 3):  # the Python floats of the host paths (host_rows)
                monkeypatch.setattr(seeds, "HOST_MAX_BLOCKS", 10**6)
                floats = CounterSource(seed, step, stream).host_row_uniforms(num)
                monkeypatch.setattr(seeds, "HOST_MAX_BLOCKS", 0)
                assert floats == CounterSource(seed, step, stream).row_uniforms(num).tolist()
                monkeypatch.undo()
    # Python-int seed and step (built into rows only when read by the tensor layouts).
    monkeypatch.setattr(seeds, "HOST_MAX_BLOCKS", 10**6)
    host = CounterSource(-3, 2**40 + 1, 0, rows=(3, torch.device("cpu"))).row_uniforms(2)
    monkeypatch.setattr(seeds, "HOST_MAX_BLOCKS", 0)
    packed = CounterSource(-3, 2**40 + 1, 0, rows=(3, torch.device("cpu"))).row_uniforms(2)
    assert torch.equal(host, packed)


def test_first_draws_looked_up_ahead_are_the_tensor_layouts_bits(monkeypatch):
    """One draw a row, step after step (host_rows): the uniforms computed LOOKAHEAD steps
    ahead and looked up are bit for bit the tensor layout's, for one and two rows, seeds and
    streams that differ, past the lookahead, when the table is cleared, and for steps at the
    end of int64 (no lookahead past it). A table that keyed the uniforms without the step
    would repeat one uniform: the first check below would fail."""
    from fastsample.ops import seeds

    def tensor_layout(seed, step, stream):
        monkeypatch.setattr(seeds, "HOST_MAX_BLOCKS", 0)
        want = CounterSource(seed, step, stream).row_uniforms(1).tolist()
        monkeypatch.undo()
        return want

    seeds._FIRST_DRAWS.clear()
    cases = (
        (torch.tensor([11]), 0, 40),
        (torch.tensor([-5, 2**62]), Stream.TARGET, 2**40 - 3),
        (torch.tensor([7]), torch.tensor([3]), 2**63 - 20),
    )
    for seed, stream, first in cases:
        got = []
        for step in range(first, min(first + 2 * seeds.LOOKAHEAD + 3, 2**63)):
            steps = torch.full(seed.shape, step)
            floats = CounterSource(seed, steps, stream).host_row_uniforms(1)
            assert floats == tensor_layout(seed, steps, stream), (step, seed)
            got.append(floats)
        assert len({f[0][0] for f in got}) == len(got)  # a fresh uniform at every step
    assert len(seeds._FIRST_DRAWS) > 0
    monkeypatch.setattr(seeds, "_FIRST_DRAWS_MAX", 20)  # cleared when the next fill is over it
    seed, steps = torch.tensor([3, 4]), torch.tensor([100, 900])
    assert CounterSource(seed, steps, 0).host_row_uniforms(1) == tensor_layout(seed, steps, 0)
    assert len(seeds._FIRST_DRAWS) == 2 * seeds.LOOKAHEAD
    monkeypatch.undo()


def test_entry_uniforms_are_keyed_by_global_index():
    """A vocabulary shard reproduces its slice of the full row's noise, at any offset."""
    src = source([3, 4], [10, 11])
    full = src.entry_uniforms(0, 1000)
    for start, length in [(0, 1), (1, 1), (255, 300), (256, 5), (999, 1), (7, 6)]:
        assert torch.equal(src.entry_uniforms(start, length), full[:, start : start + length])


# --- statistical quality ------------------------------------------------------------------


# Sizes of the uniformity and independence tests: each judges 2**22 values (or pairs) on 256
# cells, above stattests.draws_needed(uniform law on 256 cells, 0.02) = 4,123,000.
CELLS = 256
UNIFORM_CLAIM = 0.02
SAMPLES = 2**22
ROW_WIDTH, ENTRY_WIDTH = 4, 16  # uniforms per request: SAMPLES // width requests


def requests(width: int) -> torch.Tensor:
    """Seeds of the SAMPLES // width requests that give SAMPLES uniforms of ``width`` each."""
    return torch.arange(SAMPLES // width) * 1000


def bit_field_counts(u: torch.Tensor, shift: int, bits: int = 8) -> np.ndarray:
    ints = (u * 2.0**53).to(torch.int64)
    field = (ints >> shift) & ((1 << bits) - 1)
    return torch.bincount(field.flatten(), minlength=1 << bits).numpy()


@functools.cache
def bit_field_uniforms() -> dict[str, torch.Tensor]:
    """SAMPLES row and SAMPLES entry uniforms, made once for every shift."""
    rows, entries = requests(ROW_WIDTH), requests(ENTRY_WIDTH)
    with serial():  # chains of 4M-element ops: one thread (see test_exactness.serial)
        return {
            "row": source(rows, rows * 3 + 1).row_uniforms(ROW_WIDTH),
            "entry": source(entries, entries * 3 + 1).entry_uniforms(1000, ENTRY_WIDTH),
        }


@pytest.mark.parametrize("shift", [0, 11, 21, 32, 45])
def test_bit_fields_are_uniform(shift):
    for name, u in bit_field_uniforms().items():
        counts = bit_field_counts(u, shift)
        assert counts.sum() == SAMPLES
        assert_law(counts, np.ones(CELLS), what=f"{name} bits {shift}..{shift + 7}")


def pair_counts(a: torch.Tensor, b: torch.Tensor, cells: int = 16) -> np.ndarray:
    ia = (a.flatten() * cells).long()
    ib = (b.flatten() * cells).long()
    return torch.bincount(ia * cells + ib, minlength=cells * cells).numpy()


NEIGHBOURS = {
    "steps": lambda seeds: (source(seeds, 5), source(seeds, 6)),
    "seeds": lambda seeds: (source(seeds, 5), source(seeds + 1, 5)),
    "streams": lambda seeds: (source(seeds, 5, Stream.DRAFT), source(seeds, 5, Stream.TARGET)),
    "samples": lambda seeds: (source(seeds, 5, Stream.SAMPLE), source(seeds, 5, 1)),
}


def assert_uniform_pairs(counts: np.ndarray, what: str) -> None:
    """The pair law test, with its negative control at its size from the same pairs: thinned
    to the law with the mid-mass cells 1.5x the claim more likely, they fail."""
    assert counts.sum() == SAMPLES
    uniform = np.ones(CELLS)
    assert_law(counts, uniform, what=what)
    assert law_rejected(mid_mass_thinned(counts, uniform, 1.5 * UNIFORM_CLAIM, 0), uniform)


@pytest.mark.parametrize("what", list(NEIGHBOURS))
def test_neighbours_are_independent(what):
    """Joint law of (u, u') for neighbouring steps, seeds, streams: uniform on a 16x16 grid."""
    with serial():  # chains of 4M-element ops: one thread (see test_exactness.serial)
        first, second = NEIGHBOURS[what](requests(ROW_WIDTH))
        row_pairs = pair_counts(first.row_uniforms(ROW_WIDTH), second.row_uniforms(ROW_WIDTH))
        first, second = NEIGHBOURS[what](requests(ENTRY_WIDTH))
        entry_pairs = pair_counts(
            first.entry_uniforms(0, ENTRY_WIDTH), second.entry_uniforms(0, ENTRY_WIDTH)
        )
    assert_uniform_pairs(row_pairs, f"{what}, row uniforms")
    assert_uniform_pairs(entry_pairs, f"{what}, entry uniforms")


def test_independence_test_rejects_correlated_streams():
    """Negative control at the size of the independence test: a stream that shares 0.25% of
    its draws with its neighbour is caught. The shared pairs land on the diagonal (1/16 of
    the cells) and raise it by 15 x 0.25% = 3.75%: about 1.5x the 2% claim on 10% of the
    mass, in the test's power (non-centrality n * 15 * f**2 vs n * 0.02**2 * 0.1 / 0.9)."""
    seeds = requests(ROW_WIDTH)
    with serial():
        a = source(seeds, 5).row_uniforms(ROW_WIDTH)
        b = source(seeds, 6).row_uniforms(ROW_WIDTH)
    leak = torch.rand(b.shape, generator=torch.Generator().manual_seed(0)) < 0.0025
    b = torch.where(leak, a, b)
    assert law_rejected(pair_counts(a, b), np.ones(CELLS))


def test_purposes_do_not_share_noise():
    """Row and entry uniforms of the same request are independent: not one of 2**22 pairs
    is equal (53-bit values), and their joint law is uniform on a 16x16 grid."""
    src = source(requests(ROW_WIDTH), 5)
    with serial():
        rows, entries = src.row_uniforms(ROW_WIDTH), src.entry_uniforms(0, ROW_WIDTH)
    assert int((rows == entries).sum()) == 0
    assert_uniform_pairs(pair_counts(rows, entries), "row vs entry uniforms")


def test_entry_uniforms_match_the_mapping_at_every_scale_of_position():
    """The race's noise at positions up to 2**18 (vocabularies of 262k): bitwise the
    documented mapping, so the race's law at large V is its law at small V."""
    src = source([11, -7], [3, 2**33])
    for start in (255, 4095, 32_767, 65_535, 131_071, 200_001, 2**18 - 6):
        got = src.entry_uniforms(start, 6)
        for b, (seed, step) in enumerate([(11, 3), (-7, 2**33)]):
            want = [reference_uniform(seed, step, 0, Purpose.ENTRY, start + i) for i in range(6)]
            assert got[b].tolist() == want


# --- batch invariance ---------------------------------------------------------------------


def random_requests(count: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(count, vocab, generator=gen) * 3, -1)
    probs[::5, ::3] = 0  # some rows with exact zeros
    seeds = torch.randint(-(2**62), 2**62, (count,), generator=gen)
    steps = torch.randint(0, 2**40, (count,), generator=gen)
    return probs, seeds, steps


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_samples", [1, 3])
def test_same_request_same_tokens_whatever_the_batch(method, num_samples):
    probs, seeds, steps = random_requests(257, 1500)

    def draw(rows):
        return fs.sample_from_probs(
            probs[rows], num_samples, seed=seeds[rows], step=steps[rows], method=method
        ).token_ids

    full = draw(torch.arange(257))
    order = torch.randperm(257, generator=torch.Generator().manual_seed(1))
    assert torch.equal(draw(order), full[order])
    for row in [0, 5, 128, 256]:
        assert torch.equal(draw(torch.tensor([row])), full[row : row + 1])
    # fast_sample too
    _, alone = fs.fast_sample(probs[3:4], num_samples, seed=seeds[3:4], step=steps[3:4])
    _, batch = fs.fast_sample(probs, num_samples, seed=seeds, step=steps)
    assert torch.equal(alone, batch[3:4])


@pytest.mark.parametrize("method", METHODS)
def test_batch_invariance_under_compile(method):
    probs, seeds, steps = random_requests(257, 600, seed=2)
    torch._dynamo.reset()

    def draw(p, s, t):
        return fs.sample_from_probs(p, 2, seed=s, step=t, method=method).token_ids

    compiled = torch.compile(draw, fullgraph=True)
    eager = draw(probs, seeds, steps)
    assert torch.equal(compiled(probs, seeds, steps), eager)
    order = torch.randperm(257, generator=torch.Generator().manual_seed(3))
    assert torch.equal(compiled(probs[order], seeds[order], steps[order]), eager[order])


def test_steps_and_streams_change_the_draws():
    probs = torch.ones(64, 1000)
    seeds = torch.arange(64)
    base = fs.sample_from_probs(probs, seed=seeds, step=0).token_ids
    assert torch.equal(fs.sample_from_probs(probs, seed=seeds, step=0).token_ids, base)
    for kwargs in ({"step": 1}, {"step": 0, "stream": Stream.DRAFT}, {"step": 0, "stream": 1}):
        other = fs.sample_from_probs(probs, seed=seeds, **kwargs).token_ids
        assert (other != base).float().mean() > 0.9


@pytest.mark.parametrize("method", METHODS)
def test_int_and_tensor_streams_give_the_same_draws(method):
    """A Python-int stream takes a shortcut (no tensor op); it must mean what the tensor does."""
    probs, seeds, steps = random_requests(9, 700, seed=4)
    for stream in (0, 5, Stream.RECOVERY + 2, 2**24 - 1):
        as_int = fs.sample_from_probs(
            probs, 3, seed=seeds, step=steps, stream=stream, method=method
        )
        as_tensor = fs.sample_from_probs(
            probs, 3, seed=seeds, step=steps, stream=torch.full((9,), int(stream)), method=method
        )
        assert torch.equal(as_int.token_ids, as_tensor.token_ids)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_results_are_ordinary_tensors_in_any_mode(method):
    """The Philox chain runs in inference mode (cheaper tiny ops); nothing of it may leak out.
    Uniforms are consumed in place (the race's noise), outputs accept in-place updates, and
    constants first made inside an outer inference mode work in eager and compiled calls."""
    import fastsample.ops.philox as philox
    import fastsample.ops.seeds as seeds_module

    probs, seeds, steps = random_requests(5, 12, seed=5)  # 12 entries: the few-block layout
    philox._PAIR_CONSTANTS.clear()
    seeds_module._LANE_CONSTANTS.clear()
    with torch.inference_mode():
        inside = fs.sample_from_probs(probs, 2, seed=seeds, step=steps, method=method)
    out = fs.sample_from_probs(probs, 2, seed=seeds, step=steps, method=method)
    assert not out.token_ids.is_inference() and not out.probs.is_inference()
    out.token_ids.add_(0)
    out.probs.mul_(1)
    assert torch.equal(out.token_ids, inside.token_ids)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda p, s, t: fs.sample_from_probs(p, 2, seed=s, step=t, method=method).token_ids,
        fullgraph=True,
    )
    assert torch.equal(compiled(probs, seeds, steps), out.token_ids)


def test_advance_step_in_place_and_under_compile():
    step = torch.tensor([0, 5, 2**40])
    assert advance_step(step) is step
    assert step.tolist() == [1, 6, 2**40 + 1]
    probs = torch.ones(3, 500)
    seeds = torch.tensor([1, 2, 3])
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def decode_step(p, s, t):
        out = fs.sample_from_probs(p, seed=s, step=t)
        advance_step(t)
        return out.token_ids

    step = torch.zeros(3, dtype=torch.int64)
    first = decode_step(probs, seeds, step)
    second = decode_step(probs, seeds, step)
    assert step.tolist() == [2, 2, 2]
    assert not torch.equal(first, second)
    assert torch.equal(first, fs.sample_from_probs(probs, seed=seeds, step=0).token_ids)
    assert torch.equal(second, fs.sample_from_probs(probs, seed=seeds, step=1).token_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", METHODS)
def test_cuda_graph_advances_step_inside_the_graph(method):
    probs = torch.softmax(torch.randn(64, 32000, device="cuda"), -1)
    seeds = torch.arange(64, device="cuda")
    step = torch.zeros(64, dtype=torch.int64, device="cuda")

    def decode_step():
        out = fs.sample_from_probs(probs, 2, seed=seeds, step=step, method=method)
        advance_step(step)
        return out.token_ids

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_step()
    torch.cuda.current_stream().wait_stream(stream)
    step.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")  # only the step itself, not capture's own sync
        try:
            out = decode_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    step.zero_()
    seen = []
    for _ in range(3):
        graph.replay()
        seen.append(out.clone())
    assert step.tolist() == [3] * 64
    for k, ids in enumerate(seen):  # replay k drew exactly what eager draws at step k
        eager = fs.sample_from_probs(probs, 2, seed=seeds, step=k, method=method).token_ids
        assert torch.equal(ids, eager)
    assert not torch.equal(seen[0], seen[1])


# --- exactness with seeds -----------------------------------------------------------------


# (method, case of test_exactness, draws): sizes from stattests.draws_needed (claims in
# tests/test_power.py). Rows are drawn as float32 (half rows are widened a few rows at a time
# on CPU: slow for these many-row batches; the widening is tested bitwise in this file). The
# race draws one Philox uniform per entry (~0.2 us each on CPU): the CPU runs it at V=2;
# CUDA at V=32k too.
SEEDED_CASES = [
    ("inverse_cdf", CASES[0], 640_000),
    ("race", CASES[0], 640_000),
    ("inverse_cdf", CASES[5], 104_000),
    ("race", CASES[5], 104_000),
]
SEEDED = [
    pytest.param(*case, marks=CUDA) if case[0] == "race" and case[1][1] > 2 else case
    for case in SEEDED_CASES
]


def seeded_claim(vocab: int) -> float:
    return 0.02 if vocab <= 1000 else 0.10


def seeded_sampler(method: str):
    """Each call's rows get distinct (seed, step) pairs, different across calls."""
    calls = iter(range(10**9))

    def draw(batch):
        k = next(calls)
        seeds = torch.arange(batch.shape[0], device=batch.device) * 7919 + k
        steps = torch.full((batch.shape[0],), k * 13, device=batch.device)
        return fs.sample_from_probs(batch, seed=seeds, step=steps, method=method).token_ids

    return draw


@pytest.mark.parametrize(
    "method,case,draws", SEEDED, ids=lambda c: f"{c[0]}-{c[1]}" if isinstance(c, tuple) else c
)
def test_seeded_single_draw_law(method, case, draws):
    """Each draw uses a different (seed, step): the law holds across seeds and steps."""
    kind, vocab, dtype, _ = case
    row = case_row(kind, vocab, dtype).float()  # exact: the cases are float32 or bfloat16
    counts = single_draw_counts(seeded_sampler(method), row, draws)
    exact = row.double().numpy()
    assert_law(counts, exact, what=f"seeded {method} {kind} V={vocab}")
    # Negative controls at this size, from the same draws: thinned to the law with the
    # mid-mass tokens 1.5x the claim more likely, and reported one index off, they fail.
    assert law_rejected(mid_mass_thinned(counts, exact, 1.5 * seeded_claim(vocab), 1), exact)
    assert law_rejected(np.roll(counts, 1), exact)


def test_seeded_law_rejects_parity_and_shifted_samplers():
    """Negative controls at the size of the V=32k seeded test: even-index tokens 1.5x as
    likely (the real seeded sampler on the wrong weights) and a draw reported one index
    off (on the zeros row of test_exactness at the same size) are both caught."""
    kind, vocab, dtype, _ = CASES[5]
    row = case_row(kind, vocab, dtype).float()
    exact = row.double().numpy()
    wrong = torch.tensor(parity_biased(exact), dtype=torch.float32)
    counts = single_draw_counts(seeded_sampler("inverse_cdf"), wrong, 104_000)
    assert law_rejected(counts, exact)
    kind, vocab, dtype, _ = CASES[1]
    row = case_row(kind, vocab, dtype)
    real = seeded_sampler("inverse_cdf")
    counts = single_draw_counts(lambda b: (real(b) + 1) % b.shape[1], row, 104_000)
    assert law_rejected(counts, row.double().numpy())


@pytest.mark.parametrize("method", METHODS)
def test_seeded_joint_law_and_negative_control(method):
    """Pairs drawn with a different (seed, step) per row follow the joint law (test_exactness's
    procedure and size); negative controls from the same pairs: thinned to the law with its
    mid-mass pairs 1.5x the claim more likely, and reported one index off, they fail."""
    row = torch.tensor(JOINT_ROW, dtype=torch.float32)
    calls = iter(range(10**9))

    def draw(batch, n):
        first = next(calls) * batch.shape[0]  # the same rows per call: distinct seeds
        seeds = torch.arange(first, first + batch.shape[0])
        return fs.sample_from_probs(batch, n, seed=seeds, step=seeds % 97, method=method).token_ids

    counts, tuples = joint_counts(draw, row, 2, JOINT_DRAWS[2])
    law, _ = joint_law(2)
    assert_law(counts, law, what=f"seeded joint {method}")
    assert law_rejected(mid_mass_thinned(counts, law, 1.5 * JOINT_CLAIM, 2), law)
    assert law_rejected(shifted_tuples(counts, tuples), law)


# --- argument errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"seed": 1, "generator": torch.Generator()}, ValueError, "mutually exclusive"),
        ({"step": 3}, ValueError, "step was given without seed"),
        ({"stream": 2}, ValueError, "stream was given without seed"),
        ({"seed": 1.5}, TypeError, "seed must be an int or an int64 tensor"),
        ({"seed": True}, TypeError, "seed must be an int or an int64 tensor, got bool"),
        ({"seed": torch.arange(3).int()}, TypeError, "seed must be int64"),
        ({"seed": torch.arange(3)}, ValueError, "seed must have shape (2,)"),
        ({"seed": 1, "step": torch.zeros(2, 2, dtype=torch.int64)}, ValueError, "step must have"),
        ({"seed": 1, "stream": 2**24}, ValueError, "stream must be in [0, 2**24)"),
        ({"seed": 2**64}, ValueError, "seed must fit in int64"),
    ],
)
@pytest.mark.parametrize("api", ["sample_from_probs", "fast_sample"])
def test_seed_argument_errors(api, kwargs, error, words):
    with pytest.raises(error) as info:
        getattr(fs, api)(torch.ones(2, 5), **kwargs)
    assert words in str(info.value)


def test_python_int_and_zero_dim_seeds_broadcast():
    probs = torch.ones(4, 50)
    a = fs.sample_from_probs(probs, seed=7, step=3).token_ids
    b = fs.sample_from_probs(probs, seed=torch.tensor(7), step=torch.full((4,), 3)).token_ids
    assert torch.equal(a, b)
    assert len(set(a.flatten().tolist())) == 1  # four identical requests, identical draws


def test_batch_invariance_at_full_vocabulary_size():
    """Row reductions over a 128k vocabulary do not change with the batch around them."""
    probs, seeds, steps = random_requests(48, 128_256, seed=4)
    full = fs.sample_from_probs(probs, 2, seed=seeds, step=steps, method="inverse_cdf")
    for row in [0, 17, 47]:
        alone = fs.sample_from_probs(
            probs[row : row + 1], 2, seed=seeds[row : row + 1], step=steps[row : row + 1]
        )
        assert torch.equal(alone.token_ids, full.token_ids[row : row + 1])
        assert torch.equal(alone.probs, full.probs[row : row + 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pieces_match_float32_and_batch(dtype):
    """Half rows are widened a few rows at a time: same draws as the float32 copy, and the
    same for a row whatever piece of the batch it lands in."""
    probs, seeds, steps = random_requests(11, 100_000, seed=5)  # 5 rows per piece
    half = probs.to(dtype)
    a = fs.sample_from_probs(half, 2, seed=seeds, step=steps, method="inverse_cdf")
    b = fs.sample_from_probs(half.float(), 2, seed=seeds, step=steps, method="inverse_cdf")
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.valid, b.valid)
    for row in [0, 4, 5, 10]:
        alone = fs.sample_from_probs(
            half[row : row + 1], 2, seed=seeds[row : row + 1], step=steps[row : row + 1]
        )
        assert torch.equal(alone.token_ids, a.token_ids[row : row + 1])


# --- the registry (tests/test_power.py checks each claim) ---------------------------------


def law_cases():
    uniform = np.ones(CELLS)
    for name in ("row", "entry"):
        yield LawCase(f"bit fields of {name} uniforms", uniform, SAMPLES, UNIFORM_CLAIM)
    for what in NEIGHBOURS:
        for name in ("row", "entry"):
            yield LawCase(f"neighbouring {what}, {name} uniforms", uniform, SAMPLES, UNIFORM_CLAIM)
    yield LawCase("row vs entry uniforms", uniform, SAMPLES, UNIFORM_CLAIM)
    for method, (kind, vocab, dtype, _), draws in SEEDED_CASES:
        law = case_row(kind, vocab, dtype).float().double().numpy()
        yield LawCase(f"seeded {method} {kind} V={vocab}", law, draws, seeded_claim(vocab))
    yield LawCase("seeded joint n=2", joint_law(2)[0], JOINT_DRAWS[2], JOINT_CLAIM)
