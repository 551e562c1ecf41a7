"""The graph-captured GPU benchmarks (run by scripts/device_check.sh) say so and exit 0 on a
machine without CUDA, and time a real call when one exists."""

from __future__ import annotations

import json

import pytest
import torch

from fastsample.tools.bench import cuda_summary, sampling_cuda, verify_cuda


@pytest.mark.parametrize("module", [sampling_cuda, verify_cuda], ids=["sampling", "verify"])
def test_gpu_benchmark_skips_cleanly_without_cuda(module, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: device_check.sh runs the benchmark itself")
    assert module.main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out


def test_seed_race_is_the_four_op_race():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    p, index = sampling_cuda.seed_race(probs)
    assert index.squeeze(1).tolist() == [1, 2] and p.squeeze(1).tolist() == [1.0, 2.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_case_times_every_contender_on_cuda():
    rows = sampling_cuda.case(8, 32000, repeats=2)
    assert rows and all("us" in row for row in rows if row["backend"] != "-"), rows


def test_summary_reads_the_benchmark_json(tmp_path):
    rows = [
        {"call": "read pass (probs.sum(-1))", "backend": "-", "B": 64, "V": 32000, "us": 10.0,
         "graph": True},
        {"call": "torch.multinomial(probs, 1)", "backend": "-", "B": 64, "V": 32000, "us": 80.0,
         "graph": True},
        {"call": "seed's race", "backend": "-", "B": 64, "V": 32000, "us": 40.0, "graph": True},
        {"call": "fast_sample(probs)", "backend": "triton", "B": 64, "V": 32000, "us": 16.0,
         "graph": True},
        {"call": "fast_sample(probs)", "backend": "torch", "B": 64, "V": 32000, "us": 99.0,
         "graph": True},
        {"call": "sample(logits, T/top-k/top-p tensors)", "backend": "triton", "B": 64,
         "V": 32000, "error": "RuntimeError: boom"},
    ]  # fmt: skip
    path = tmp_path / "sampling.json"
    path.write_text(json.dumps(rows))
    text = "\n".join(cuda_summary.summary(path, tmp_path / "missing.json"))
    line = next(row for row in text.splitlines() if row.startswith("| 64 | 32000 |"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    heads = [name for name, _, _ in cuda_summary.SAMPLING_COLUMNS + cuda_summary.SAMPLING_RATIOS]
    got = dict(zip(heads, cells[2:], strict=True))
    assert got["fast_sample"] == "16" and got["multinomial"] == "80"  # the Triton row
    assert got["fast_sample vs multinomial"] == "5.00x" and got["fast_sample vs race"] == "2.50x"
    assert got["fast_sample in read passes"] == "1.60x"
    assert got["sample T/k/p"] == "error" and got["FlashInfer top-k/top-p"] == "-"
    assert got["sample vs FlashInfer"] == "-"
    assert "no JSON at" in text
