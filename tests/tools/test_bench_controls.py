"""``python -m fastsample bench --controls``: every setting runs, ratios are computed, and
the HF-style reference pipeline samples what HF's warpers define."""

from __future__ import annotations

import json

import numpy as np
import torch

from fastsample.__main__ import main
from fastsample.tools.bench import controls as bench_controls
from reference import reference_probs
from stattests import assert_law


def test_controls_bench_runs_every_setting(tmp_path, capsys):
    path = tmp_path / "controls.json"
    argv = [
        "bench",
        "--controls",
        "--batch",
        "3",
        "--vocab",
        "700",
        "--repeats",
        "2",
        "--min-repeats",
        "1",
        "--warmup",
        "0",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    doc = json.loads(path.read_text())
    settings = {r["setting"] for r in doc["results"]}
    assert settings == set(bench_controls.SETTINGS)
    for r in doc["results"]:
        assert r["median_ms"] > 0
        if r["contender"].startswith("fs"):
            assert r["speedup_vs_hf"] > 0 and r["read_passes"] > 0
    assert "vs hf" in capsys.readouterr().out


def test_hf_pipeline_samples_the_documented_law():
    """The baseline is a faithful HF pipeline: its top-k + top-p law is the reference's
    (HF keeps the smallest set whose mass exceeds top_p: the same set for untied rows)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=gen, dtype=torch.float64) * 2
    controls = {"temperature": 0.7, "top_k": 8, "top_p": 0.6}
    torch.manual_seed(1)
    ids = torch.cat(
        [bench_controls.hf_pipeline(logits.expand(4000, -1), controls) for _ in range(5)]
    )
    counts = np.bincount(ids[:, 0].numpy(), minlength=12)
    want = reference_probs(logits[0].numpy(), 0.7, 8, 0.6)
    assert_law(counts, want, what="hf pipeline")


def test_peer_samplers_sample_their_published_law():
    """vLLM's sampler keeps the reference's set (top-k, then top-p on the survivors); SGLang's
    takes top-p on the full distribution, which is the reference's law without a top-k."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=gen) * 2
    cases = (
        (bench_controls.vllm_sample, {"temperature": 0.7, "top_k": 8, "top_p": 0.6}, (8, 0.6)),
        (bench_controls.vllm_sample, {"top_k": 5}, (5, 1.0)),
        (bench_controls.vllm_sample, {"min_p": 0.1}, None),
        (bench_controls.sglang_sample, {"temperature": 1.3, "top_p": 0.7}, (0, 0.7)),
        (bench_controls.sglang_sample, {"top_k": 4, "min_p": 0.2}, None),
    )
    torch.manual_seed(1)
    for sampler, controls, cuts in cases:
        ids = torch.cat([sampler(logits.expand(4000, -1), controls) for _ in range(5)])
        counts = np.bincount(ids.long().numpy(), minlength=12)
        t = controls.get("temperature", 1.0)
        if cuts is None:  # min-p (after top-k): keep p >= min_p * max p of the survivors
            want = reference_probs(logits[0].double().numpy(), t, controls.get("top_k", 0))
            want = np.where(want >= controls["min_p"] * want.max(), want, 0.0)
            want /= want.sum()
        else:
            want = reference_probs(logits[0].double().numpy(), t, *cuts)
        assert_law(counts, want, what=f"{sampler.__name__} {controls}")


def test_busy_loops_run_beside_the_block_and_stop_after_it():
    from fastsample.tools.bench.busy import busy_loops

    with busy_loops(2, limit_s=30) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    with busy_loops(1, limit_s=0.01) as procs:  # bounded by itself as well
        procs[0].wait(timeout=10)
