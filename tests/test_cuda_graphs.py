"""CUDA-graph capture under sync-debug mode "error": each sampler is captured once, then
replayed with new inputs copied into its static buffers; replays must draw fresh tokens
with the right law. Skipped cleanly without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
from reference import reference_probs
from stattests import LawCase, assert_law

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


# Replays per law: batch x replays is stattests.draws_needed(law, target) for each law below
# (2% at V <= 1,000, 5% at V = 1,024; tests/test_power.py checks them). A replay costs tens
# of microseconds on a GPU: about 11,000 replays in all.
REPLAY_BATCH, REPLAYS = 4096, 1135  # 4.65M draws per row of V=50
CONTROLS_BATCH, CONTROLS_REPLAYS = 4096, 737  # 3.02M per control setting, V=40
SHORTCUT_BATCH, SHORTCUT_REPLAYS = 2048, 320  # 655k, V=1024


def replay_rows() -> list[torch.Tensor]:
    """Two rows of 50 float32 probabilities (float64 copies), the second with zeros."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.rand(50, generator=gen, dtype=torch.float64) for _ in range(2)]
    rows[1][::3] = 0
    return [row.float().double() for row in rows]


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_capture_and_replay_draws_fresh_exact_tokens(name):
    batch, vocab = REPLAY_BATCH, 50
    static = torch.zeros(batch, vocab, device="cuda")
    static[:, 0] = 1
    graph, out = capture(SAMPLERS[name], static)
    for row in replay_rows():  # new inputs each time, copied into the static buffer
        static.copy_(row.float().expand(batch, -1))
        counts = np.zeros(vocab)
        previous = None
        for _ in range(REPLAYS):
            graph.replay()
            ids = out[:, 0].clone()
            assert previous is None or not torch.equal(ids, previous), "replay repeated noise"
            previous = ids
            counts += torch.bincount(ids, minlength=vocab).cpu().numpy()
        assert_law(counts, row.numpy(), what=name)


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


CONTROL_SETTINGS = ((0.8, 12, 0.9), (1.3, 30, 0.7))


def controls_row() -> torch.Tensor:
    """40 float32 logits (float64 copy)."""
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(40, generator=gen, dtype=torch.float64) * 2).float().double()


def test_capture_sample_with_per_row_controls():
    """fastsample.sample with tensor controls and seeds: captured once, the step advanced
    inside the graph; replays draw fresh tokens whose law is the processed distribution,
    and new control values copied into the static tensors take effect without recapture."""
    batch, vocab = CONTROLS_BATCH, 40
    row = controls_row()
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
    for t, k, p in CONTROL_SETTINGS:
        temperature.fill_(t)
        top_k.fill_(k)
        top_p.fill_(p)
        counts = np.zeros(vocab)
        previous = None
        for _ in range(CONTROLS_REPLAYS):
            graph.replay()
            ids = out[:, 0].clone()
            assert previous is None or not torch.equal(ids, previous)
            previous = ids
            counts += torch.bincount(ids, minlength=vocab).cpu().numpy()
        want = reference_probs(row.numpy(), t, k, p)
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


def shortcut_row() -> np.ndarray:
    """1024 logits: one at 2, the rest 0 (k=2: every zero ties at the cut, in all blocks)."""
    row = np.zeros(1024)
    row[5] = 2.0
    return row


def test_capture_sample_with_a_small_python_top_k():
    """The small-top_k shortcut (Python controls, float32 logits): captured once with the
    counting pass, the 64-way search and the block reads inside; replays draw fresh tokens
    with the processed law, ties at the cut beyond the k best blocks included."""
    batch, vocab = SHORTCUT_BATCH, 1024
    row = torch.tensor(shortcut_row())
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
    for _ in range(SHORTCUT_REPLAYS):
        graph.replay()
        ids = out[:, 0].clone()
        assert previous is None or not torch.equal(ids, previous)
        previous = ids
        counts += torch.bincount(ids, minlength=vocab).cpu().numpy()
    assert_law(counts, reference_probs(row.numpy(), 0.8, 2), what="shortcut under capture")


def law_cases():
    """The laws judged here, at their sizes (tests/test_power.py checks them)."""
    for i, row in enumerate(replay_rows()):
        for name in SAMPLERS:
            law = row.numpy()
            yield LawCase(f"replay {name} row {i} V=50", law, REPLAY_BATCH * REPLAYS, 0.02)
    for t, k, p in CONTROL_SETTINGS:
        law = reference_probs(controls_row().numpy(), t, k, p)
        draws = CONTROLS_BATCH * CONTROLS_REPLAYS
        yield LawCase(f"sample T={t} k={k} p={p} V=40", law, draws, 0.02)
    law = reference_probs(shortcut_row(), 0.8, 2)
    yield LawCase("small top_k=2 V=1024", law, SHORTCUT_BATCH * SHORTCUT_REPLAYS, 0.05)


def test_engine_step_with_every_stage_captures_and_replays_with_new_state():
    """``sample_step`` with every stage on (grammar bitmask, allowed ids, bias, min-tokens,
    penalties, the controls, raw top-5 logprobs and ranks) and the state update, captured once:
    replays read new logits, bitmask and step from their static buffers and the statistics
    the previous replay updated, and draw what the eager step draws from the same inputs."""
    batch, vocab, device = 8, 3000, "cuda"
    gen = torch.Generator(device=device).manual_seed(5)
    params = fs.StepParams(
        batch, vocab, device=device, temperature=torch.full((batch,), 0.8, device=device),
        top_k=torch.full((batch,), 40, device=device), top_p=0.95, min_p=0.01,
        cut_order="vllm", repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1,
        logit_bias=[{5: 2.0}] * batch, min_tokens=2, stop_token_ids=[[0, 1]] * batch,
        allowed_token_ids=[list(range(2500))] * batch, seed=torch.arange(batch, device=device),
        top_logprobs=5, logprobs_mode="raw", token_ranks=True,
    )  # fmt: skip
    stats = fs.TokenStats.from_prompts([[3, 4, 5]] * batch, vocab, device=device)
    twin = fs.TokenStats.from_prompts([[3, 4, 5]] * batch, vocab, device=device)
    logits = torch.randn(batch, vocab, device=device, generator=gen)
    words = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
    step = torch.zeros(batch, dtype=torch.int64, device=device)

    def run(logits, words, step):
        out = fs.sample_step(logits, params=params, state=stats, step=step, token_bitmask=words)
        stats.update(out.token_ids)
        return out

    graph, out = capture(run, logits, words, step)
    # The warm-up calls updated the statistics: the eager twin starts from the same state.
    for name in ("prompt_mask", "seen_mask", "output_counts", "output_len"):
        getattr(twin, name).copy_(getattr(stats, name))
    for i in range(4):
        logits.copy_(torch.randn(batch, vocab, device=device, generator=gen))
        words[:, i] = 0  # a new grammar state: 32 more tokens masked
        step.fill_(10 + i)
        want = fs.sample_step(logits, params=params, state=twin, step=step, token_bitmask=words)
        graph.replay()
        twin.update(want.token_ids)
        assert torch.equal(out.token_ids, want.token_ids) and torch.equal(out.ranks, want.ranks)
        assert torch.equal(stats.output_counts, twin.output_counts)
