"""CUDA-graph capture under sync-debug mode "error": each sampler is captured once, then
replayed with new inputs copied into its static buffers; replays must draw fresh tokens
with the right law. Skipped cleanly without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
from stattests import assert_law

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def capture(fn, *static_inputs):
    """Warm up on a side stream, then capture ``fn`` with host syncs turned into errors."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # Only the sampler runs under "error" (the capture context syncs on entry by design).
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fn(*static_inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return graph, out


SAMPLERS = {
    "inverse_cdf": lambda p: fs.sample_from_probs(p, 1, method="inverse_cdf").token_ids,
    "race": lambda p: fs.sample_from_probs(p, 1, method="race").token_ids,
    "auto": lambda p: fs.sample_from_probs(p, 1).token_ids,
    "fast_sample": lambda p: fs.fast_sample(p, 1)[1],
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_capture_and_replay_draws_fresh_exact_tokens(name):
    batch, vocab = 4096, 50
    static = torch.zeros(batch, vocab, device="cuda")
    static[:, 0] = 1
    graph, out = capture(SAMPLERS[name], static)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.rand(vocab, generator=gen, dtype=torch.float64) for _ in range(2)]
    rows[1][::3] = 0
    for row in rows:  # new inputs each time, copied into the static buffer
        static.copy_(row.float().expand(batch, -1))
        counts = np.zeros(vocab)
        previous = None
        for _ in range(40):
            graph.replay()
            ids = out[:, 0].clone()
            assert previous is None or not torch.equal(ids, previous), "replay repeated noise"
            previous = ids
            counts += torch.bincount(ids, minlength=vocab).cpu().numpy()
        assert_law(counts, row.float().double().numpy(), what=name)


def test_capture_with_bad_rows_and_several_draws():
    static = torch.softmax(torch.randn(8, 128256, device="cuda"), -1)
    static[2, 5] = float("nan")

    def fn(p):
        return fs.sample_from_probs(p, 4)

    graph, out = capture(fn, static)
    graph.replay()
    torch.cuda.synchronize()
    assert out.valid.tolist() == [True, True, False, True, True, True, True, True]
    assert out.token_ids[2].tolist() == [0, 1, 2, 3]


def test_capture_sample_with_per_row_controls():
    """fastsample.sample with tensor controls and seeds: captured once, the step advanced
    inside the graph; replays draw fresh tokens whose law is the processed distribution,
    and new control values copied into the static tensors take effect without recapture."""
    from reference import reference_probs

    batch, vocab = 4096, 40
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=gen, dtype=torch.float64) * 2
    logits = row.float().cuda().expand(batch, -1).contiguous()
    temperature = torch.full((batch,), 0.8, device="cuda")
    top_k = torch.full((batch,), 12, dtype=torch.int64, device="cuda")
    top_p = torch.full((batch,), 0.9, device="cuda")
    min_p = torch.zeros(batch, device="cuda")
    seed = torch.arange(batch, device="cuda")
    step = torch.zeros(batch, dtype=torch.int64, device="cuda")

    def fn(x):
        out = fs.sample(
            x, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step
        )
        fs.advance_step(step)
        return out.token_ids

    graph, out = capture(fn, logits)
    for t, k, p in ((0.8, 12, 0.9), (1.3, 30, 0.7)):
        temperature.fill_(t)
        top_k.fill_(k)
        top_p.fill_(p)
        counts = np.zeros(vocab)
        previous = None
        for _ in range(20):
            graph.replay()
            ids = out[:, 0].clone()
            assert previous is None or not torch.equal(ids, previous)
            previous = ids
            counts += torch.bincount(ids, minlength=vocab).cpu().numpy()
        want = reference_probs(row.float().double().numpy(), t, k, p)
        assert_law(counts, want, what=f"T={t} k={k} p={p}")


def test_capture_tensor_controls_on_long_rows_matches_eager():
    """Rows of >= 32,768 entries take the radix's 16-bit digits (a different code path from
    the short rows above): captured with tensor top-k and top-p, a replay draws the tokens
    that the same seeds and step draw eagerly."""
    batch, vocab = 8, 40_000
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).cuda()
    controls = dict(
        temperature=torch.full((batch,), 0.9, device="cuda"),
        top_k=torch.tensor([0, 50, 1000, 39_999, 5, 0, 300, 20_000], device="cuda"),
        top_p=torch.tensor([0.9, 1.0, 0.5, 0.95, 0.9, 0.3, 0.99, 0.8], device="cuda"),
    )
    seed = torch.arange(batch, device="cuda")
    step = torch.full((batch,), 7, dtype=torch.int64, device="cuda")
    graph, out = capture(lambda x: fs.sample(x, seed=seed, step=step, **controls).token_ids, logits)
    graph.replay()
    eager = fs.sample(logits, seed=seed, step=step, **controls).token_ids
    assert torch.equal(out, eager)


def test_capture_sample_with_a_small_python_top_k():
    """The small-top_k shortcut (Python controls, float32 logits): captured once with the
    counting pass, the 64-way search and the block reads inside; replays draw fresh tokens
    with the processed law, ties at the cut beyond the k best blocks included."""
    from reference import reference_probs

    batch, vocab = 2048, 1024
    row = torch.zeros(vocab, dtype=torch.float64)
    row[5] = 2.0  # k=2: every zero ties at the cut, in all four blocks
    logits = row.float().cuda().expand(batch, -1).contiguous()
    seed = torch.arange(batch, device="cuda")
    step = torch.zeros(batch, dtype=torch.int64, device="cuda")

    def fn(x):
        out = fs.sample(x, temperature=0.8, top_k=2, seed=seed, step=step)
        fs.advance_step(step)
        return out.token_ids

    graph, out = capture(fn, logits)
    counts = np.zeros(vocab)
    previous = None
    for _ in range(30):
        graph.replay()
        ids = out[:, 0].clone()
        assert previous is None or not torch.equal(ids, previous)
        previous = ids
        counts += torch.bincount(ids, minlength=vocab).cpu().numpy()
    assert_law(counts, reference_probs(row.numpy(), 0.8, 2), what="shortcut under capture")
