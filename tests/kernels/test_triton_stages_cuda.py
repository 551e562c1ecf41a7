"""The engine step's kernels compiled, on a CUDA device (``scripts/device_check.sh``).

tests/kernels/test_triton_stages.py holds the kernels to the torch path through the
interpreter; here the compiled kernels (libdevice ``exp``/``log``, ``div.rn``, ``mul.rn``,
barriers between the passes of a program) meet the torch ops on the same CUDA tensors: the
staged buffer bitwise (no duplicate bias ids: the torch path's CUDA ``scatter_add_`` adds
those in any order), the tokens of a seeded step, the state update bitwise, three launches
per step and one per update, and capture in a CUDA graph under sync-debug "error"; the same
for a step with every stage (the history stages and the sampler chain: staged logits, tokens,
``process_step``'s distribution, three launches, capture). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
from fastsample.stages import staged_logits
from fastsample.tools.bench.launches import device_work

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

V = 50_000  # several tiles of 512 per row, a partial last word and block


def _inputs(batch: int, mode: str = "processed"):
    gen = torch.Generator().manual_seed(batch)

    def ids(*shape: int) -> torch.Tensor:
        return torch.randint(-1, V, shape, generator=gen)

    biased = torch.stack([torch.randperm(V, generator=gen)[:6] for _ in range(batch)])
    params = fs.StepParams(
        batch, V, device="cuda", temperature=(torch.rand(batch, generator=gen) + 0.3).cuda(),
        top_k=torch.full((batch,), 200).cuda(), top_p=torch.full((batch,), 0.95).cuda(),
        repetition_penalty=(torch.rand(batch, generator=gen) + 0.6).cuda(),
        frequency_penalty=0.4, presence_penalty=(torch.rand(batch, generator=gen) - 0.5).cuda(),
        logit_bias=(biased.cuda(), torch.randn(batch, 6, generator=gen).cuda()),
        min_tokens=3, stop_token_ids=ids(batch, 2).cuda(),
        allowed_token_ids=ids(batch, V // 2).cuda(), seed=torch.arange(batch).cuda(),
        top_logprobs=5, token_ranks=True, logprob_token_ids=ids(batch, 3).cuda(),
        logprobs_mode=mode,
    )  # fmt: skip
    logits = (torch.randn(batch, V, generator=gen) * 3).cuda()
    stats = fs.TokenStats.from_prompts(ids(batch, 40).cuda(), V)
    words = torch.randint(-(2**31), 2**31 - 1, (batch, (V + 31) // 32), dtype=torch.int32,
                          generator=gen).cuda() | 0x00FF00FF  # fmt: skip
    return logits, params, stats, words


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_compiled_step_matches_the_torch_ops_on_cuda(mode, monkeypatch):
    logits, params, stats, words = _inputs(8, mode)
    stats.update(torch.randint(0, V, (8, 5), device="cuda"))
    steps = torch.arange(8, device="cuda")
    outs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("FASTSAMPLE_BACKEND", name)
        staged = staged_logits(logits, params, state=stats, token_bitmask=words)
        out = fs.sample_step(logits, params=params, state=stats, step=steps, token_bitmask=words)
        outs[name] = staged, out
    (staged_t, theirs), (staged_o, ours) = outs["torch"], outs["triton"]
    assert torch.equal(staged_o, staged_t)
    assert torch.equal(ours.valid, theirs.valid) and bool(ours.valid.all())
    assert int((ours.token_ids != theirs.token_ids).any(-1).sum()) <= 1  # rounding at an edge
    same = (ours.token_ids == theirs.token_ids).all(-1)
    assert torch.equal(ours.top_token_ids, theirs.top_token_ids)
    for field in ("probs", "logprobs", "top_logprobs", "requested_logprobs"):
        a, b = getattr(theirs, field), getattr(ours, field)
        if field in ("probs", "logprobs"):
            a, b = a[same], b[same]
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=field)
    assert torch.equal(ours.ranks[same], theirs.ranks[same])


def test_compiled_update_matches_the_torch_update_on_cuda(monkeypatch):
    states = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("FASTSAMPLE_BACKEND", name)
        _, _, stats, _ = _inputs(6)
        gen = torch.Generator().manual_seed(1)
        for n in (1, 4, 2):
            stats.update(torch.randint(-1, V, (6, n), generator=gen).cuda())
        states[name] = stats
    for field in ("output_counts", "output_len", "seen_mask"):
        assert torch.equal(getattr(states["triton"], field), getattr(states["torch"], field))


def _replays_in_a_cuda_graph(run, stats, steps) -> None:
    """``run`` (a step and the state's update) captured in a CUDA graph under sync-debug
    "error" (no host sync), then replayed with the steps advanced: one more token per row, in
    range."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    length = stats.output_len.clone()
    steps += 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(stats.output_len, length + 1)
    assert bool(((tokens >= 0) & (tokens < V)).all())


def test_launches_and_capture_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "auto")  # CUDA tensors take the kernels
    logits, params, stats, words = _inputs(4, "raw")
    steps = torch.zeros(4, dtype=torch.int64, device="cuda")

    def run():
        out = fs.sample_step(logits, params=params, state=stats, step=steps, token_bitmask=words)
        stats.update(out.token_ids)
        return out.token_ids

    run()
    work = device_work(run)
    assert work.kernels == 4 and work.total <= 4, work.names  # 3 for the step, 1 for the update
    _replays_in_a_cuda_graph(run, stats, steps)


def _every_stage(batch: int):
    """Every stage of the step on CUDA tensors: the history stages on contexts that repeat
    (a 7-token cycle), the sampler chain in llama.cpp's order, penalties and logprobs."""
    gen = torch.Generator().manual_seed(batch + 100)
    cycle = (torch.arange(300) % 7 + 11).repeat(batch, 1)
    cycle[:, ::50] = torch.randint(0, V, (batch, 6), generator=gen)  # a few breaks
    params = fs.StepParams(
        batch, V, device="cuda", order="llama.cpp",
        temperature=(torch.rand(batch, generator=gen) + 0.4).cuda(), top_k=200, top_p=0.95,
        min_p=0.01, typical_p=0.97, epsilon_cutoff=1e-6, eta_cutoff=1e-6, top_n_sigma=3.0,
        xtc_probability=torch.rand(batch, generator=gen).cuda(), xtc_threshold=0.1,
        dynatemp_range=0.3, mirostat_tau=torch.full((batch,), 6.0).cuda(),
        repetition_penalty=1.1, penalty_last_n=64, dry_multiplier=0.8,
        dry_sequence_breakers=[[[13]]] * batch, no_repeat_ngram_size=4,
        seed=torch.arange(batch).cuda(), top_logprobs=3,
    )  # fmt: skip
    logits = (torch.randn(batch, V, generator=gen) * 3).cuda()
    stats = fs.TokenStats.from_prompts(cycle.cuda(), V, history=512)
    return logits, params, stats


def test_every_stage_matches_the_torch_ops_on_cuda(monkeypatch):
    """The history stages (stages kernel) and the chain kernel against the torch ops on the
    same CUDA tensors: the staged logits (removed tokens exactly, values within 1e-6: ``pow``
    may differ by an ulp), the tokens of a seeded step (one row may differ where rounding sits
    at a cut), ``process_step``'s distribution."""
    logits, params, stats = _every_stage(8)
    steps = torch.arange(8, device="cuda")
    outs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("FASTSAMPLE_BACKEND", name)
        staged = staged_logits(logits, params, state=stats)
        out = fs.sample_step(logits, params=params, state=stats, step=steps)
        outs[name] = staged, out, fs.process_step(logits, params, state=stats)
    (staged_t, theirs, dist_t), (staged_o, ours, dist_o) = outs["torch"], outs["triton"]
    removed = staged_t == -float("inf")
    assert torch.equal(removed, staged_o == -float("inf"))
    assert bool((staged_t != logits).any())  # the history stages acted
    torch.testing.assert_close(staged_o[~removed], staged_t[~removed], rtol=1e-6, atol=0)
    assert torch.equal(ours.valid, theirs.valid) and bool(ours.valid.all())
    assert int((ours.token_ids != theirs.token_ids).any(-1).sum()) <= 1
    torch.testing.assert_close(dist_o, dist_t, rtol=0, atol=1e-5)


def test_every_stage_is_three_launches_and_captures_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("FASTSAMPLE_BACKEND", "auto")  # CUDA tensors take the kernels
    logits, params, stats = _every_stage(4)
    steps = torch.zeros(4, dtype=torch.int64, device="cuda")

    def step():
        return fs.sample_step(logits, params=params, state=stats, step=steps)

    def run():
        out = step()
        stats.update(out.token_ids, probs=out.probs, params=params)
        return out.token_ids

    run()
    work = device_work(step)
    assert work.kernels == 3 and work.total <= 3, work.names
    _replays_in_a_cuda_graph(run, stats, steps)
