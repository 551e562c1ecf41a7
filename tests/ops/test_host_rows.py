"""One or two rows in Python floats (fastsample.ops.host_rows) against the general path.

The path must be invisible: every output equals the general path's bit for bit (which
test_controls holds to the float64 reference), on rows chosen to reach its special cases:
blocks holding three or more kept weights (summed by torch), a short last block, strided
rows, bfloat16 logits with ties among the top-N, per-row and Python controls in both cut
orders, temperatures where float32's division rounds. Negative control: the same comparison
catches the path with its float32 roundings left out (the weights then differ in their last
bits, and so do the cuts, the kept sets or the probabilities).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fastsample as fs
from fastsample.ops import host_floats, host_rows, host_top_k, small_top_k


def _rows(batch: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 3.0])[:batch, None]  # a flat row (crowded blocks) and a peaked one
    return (torch.randn(batch, vocab, generator=gen) * scale).to(dtype)


CASES = {  # name: (vocab, dtype, strided)
    "float32": (25_600, torch.float32, False),  # 100 blocks: 50 candidates crowd some
    "short last block": (25_000, torch.float32, False),
    "strided": (25_600, torch.float32, True),
    "bfloat16": (25_600, torch.bfloat16, False),  # ties among the candidates and the top-N
    "short row": (1000, torch.float32, False),  # 4 blocks: the row is its own candidates
}


def _compare(monkeypatch, batch: int) -> tuple[int, int, list]:
    """``(served, crowded, mismatches)`` over the cases and control mixes."""
    served = crowded = 0
    draw, tile_sums = host_rows.draw, host_floats._tile_sums

    def spy(*args):
        nonlocal served
        got = draw(*args)
        served += got is not None
        return got

    def spy_tiles(blocks, width):
        nonlocal crowded
        crowded += len(blocks)
        return tile_sums(blocks, width)

    monkeypatch.setattr(host_rows, "draw", spy)
    monkeypatch.setattr(host_floats, "_tile_sums", spy_tiles)
    t_rows = torch.tensor([0.7, 1.3])[:batch]
    mixes = [
        dict(temperature=t_rows, top_k=torch.tensor([50, 20])[:batch], top_p=0.9),
        dict(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02, cut_order="vllm"),
        dict(temperature=1 / 3, top_k=40, min_p=torch.tensor([0.01, 0.1])[:batch]),
        dict(top_k=60, top_p=torch.tensor([0.8, 1.0])[:batch], cut_order="vllm"),
        dict(temperature=2.0, top_k=50),
    ]
    wrong = []
    for (name, (vocab, dtype, strided)), controls, top, seed in itertools.product(
        CASES.items(), mixes, (0, 5), range(4)
    ):
        x = _rows(batch, vocab + 64 * strided, dtype, seed)
        if strided:
            x = x[:, 64:]
        kwargs = dict(controls, top_logprobs=top, seed=torch.arange(batch) + seed, step=7)
        fast = fs.sample(x, **kwargs)
        with monkeypatch.context() as patch:
            patch.setattr(small_top_k, "applies", lambda *args: False)
            general = fs.sample(x, **kwargs)
        for field in fast._fields:
            a, b = getattr(fast, field), getattr(general, field)
            if not ((a is None and b is None) or torch.equal(a, b)):
                wrong.append((name, field, kwargs))
    return served, crowded, wrong


@pytest.mark.parametrize("batch", [1, 2])
def test_one_or_two_rows_draw_bitwise_what_the_general_path_draws(monkeypatch, batch):
    served, crowded, wrong = _compare(monkeypatch, batch)
    assert wrong == []
    # Declined: flat rows (scale 0.5) at T = 2 or 0.7 where the float32 just below the k-th
    # logit weighs as much as it (more entries may reach the cut: the general path counts).
    calls = len(CASES) * 5 * 2 * 4
    assert served >= 0.8 * calls, served
    assert crowded > 0  # blocks of three or more kept weights were summed by torch


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_short_rows_are_their_own_candidates(monkeypatch, batch):
    """Vocabularies of fewer blocks than candidates (V = 512 with k = 50: 2 blocks) take one
    topk over the row, here (B <= 2) and in host_top_k (B = 8): the general path's bits."""
    served = []
    for module in (host_rows, host_top_k):
        draw = module.draw
        monkeypatch.setattr(module, "draw", lambda *a, _draw=draw: served.append(_draw(*a)) or
                            served[-1])  # fmt: skip
    gen = torch.Generator().manual_seed(batch)
    float32_served = 0
    for vocab, dtype in ((512, torch.float32), (700, torch.float32), (700, torch.bfloat16)):
        x = (torch.randn(batch, vocab, generator=gen) * 2).to(dtype)
        for controls in (dict(temperature=0.8, top_k=50, top_p=0.9),
                         dict(top_k=torch.full((batch,), 40), min_p=0.05, cut_order="vllm")):
            kwargs = dict(controls, top_logprobs=3, seed=torch.arange(batch) + 5, step=2)
            served.clear()
            fast = fs.sample(x, **kwargs)
            float32_served += dtype == torch.float32 and any(got is not None for got in served)
            with monkeypatch.context() as patch:
                patch.setattr(small_top_k, "applies", lambda *args: None)
                general = fs.sample(x, **kwargs)
            for a, b in zip(fast, general, strict=True):
                assert (a is None and b is None) or torch.equal(a, b)
    # Most served: a row declines where the float32 below its k-th logit weighs as much as
    # it (here 1 of 4 at B=2), and bfloat16 ties at the k-th logit may need the general path.
    assert float32_served >= 3


def test_negative_control_without_the_float32_roundings_is_caught(monkeypatch):
    monkeypatch.setattr(host_rows, "rounded", list)  # float64 arithmetic left unrounded
    _, _, wrong = _compare(monkeypatch, 1)
    assert len(wrong) > 0


def test_declines_what_it_does_not_serve(monkeypatch):
    """NaN rows, greedy rows of a tensor temperature and two draws go to the tensor steps
    (same results as the general path there too)."""
    calls = []
    draw = host_rows.draw
    monkeypatch.setattr(host_rows, "draw", lambda *a: calls.append(draw(*a)) or calls[-1])
    x = torch.randn(2, 4096)
    nan = x.clone()
    nan[0, 1234] = torch.nan
    seeded = dict(top_k=20, top_logprobs=2, seed=torch.tensor([3, 4]), step=5)
    for logits, temperature in ((nan, 0.8), (x, torch.tensor([0.0, 0.8]))):
        fast = fs.sample(logits, temperature=temperature, **seeded)
        with monkeypatch.context() as patch:
            patch.setattr(small_top_k, "applies", lambda *args: False)
            general = fs.sample(logits, temperature=temperature, **seeded)
        for a, b in zip(fast, general, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    assert calls == [None, None]
    fs.sample(x, top_k=20, num_samples=2)
    assert len(calls) == 2  # two draws never ask it


# Top-p exactly on a cumulative mass, after top-k, on the host path: probabilities .5, .25,
# .25, .0625 at ids 40, 41, 290, 299 of V = 512, the other logits -inf (or finite but far
# below: weight 0 in float32). Weights p / max = 1, .5, .5, .125, all exact from float32
# logs. top_k = 3 keeps weights >= .5 (no tie at the k-th weight outside the candidates: the
# path serves it, where the earlier boundary rows .5, .25, .125, .125 tied there and were
# declined); top-p = .5 of the kept mass 2 is reached (>=) by token 40 alone, so every draw
# is 40, even at u just below 1.
BOUNDARY_IDS = [40, 41, 290, 299]
BOUNDARY_P = [0.5, 0.25, 0.25, 0.0625]


def _boundary_logits(batch: int, masked: float) -> torch.Tensor:
    x = torch.full((batch, 512), masked)
    x[:, BOUNDARY_IDS] = torch.tensor(BOUNDARY_P).log()
    return x


def _check_top_p_boundary_draws(monkeypatch, masked: float = -torch.inf) -> None:
    """Seeded draws (B = 1, 2) and controlled uniforms (0, 1/2, just below 1) all draw 40
    with probability 1, every call served by host_rows."""
    from fastsample.stages import step as stages_step
    from uniforms import BELOW_ONE, ControlledUniforms

    served: list = []
    draw = host_rows.draw
    with monkeypatch.context() as patch:
        patch.setattr(host_rows, "draw", lambda *a: served.append(draw(*a)) or served[-1])
        calls = 0
        for batch, seeds in ((1, 12), (2, 12)):
            x = _boundary_logits(batch, masked)
            for s in range(seeds):
                seed = torch.arange(batch) * 1009 + s * 7919 + 3
                out = fs.sample(x, top_k=3, top_p=0.5, seed=seed, step=s)
                calls += 1
                assert out.token_ids[:, 0].tolist() == [40] * batch, (batch, s)
                assert out.probs[:, 0].tolist() == [1.0] * batch
        for u in (0.0, 0.5, BELOW_ONE):
            source = ControlledUniforms([[u]])
            with monkeypatch.context() as inner:
                inner.setattr(stages_step, "make_source", lambda *args, s=source: s)
                got = fs.sample(_boundary_logits(1, masked), top_k=3, top_p=0.5).token_ids
            calls += 1
            assert got.tolist() == [[40]], u
        assert len(served) == calls and all(s is not None for s in served), served


@pytest.mark.parametrize("masked", [-torch.inf, -1000.0])
def test_top_p_on_a_cumulative_mass_after_top_k_keeps_one_token(monkeypatch, masked):
    _check_top_p_boundary_draws(monkeypatch, masked)
    # The general path, the reference, keeps the same single token.
    with monkeypatch.context() as patch:
        patch.setattr(small_top_k, "applies", lambda *args: False)
        kept = fs.process(_boundary_logits(1, masked), top_k=3, top_p=0.5)
    assert kept[0, BOUNDARY_IDS].tolist() == [1.0, 0.0, 0.0, 0.0] and kept.sum() == 1.0


def test_negative_control_top_p_that_must_exceed_the_target_is_caught(monkeypatch):
    """The host top-p cut with ``bisect_right`` (the first running mass *above* ``top_p`` of
    the kept mass, where the rule is the first reaching it): no mass exceeds it here, so the
    cut falls back to the k-th weight and 41 and 290 are kept too."""
    from fastsample.ops import host_floats

    monkeypatch.setattr(host_floats, "bisect_left", host_floats.bisect_right)
    with pytest.raises(AssertionError):
        _check_top_p_boundary_draws(monkeypatch)
