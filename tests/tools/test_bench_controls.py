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
