"""The graph-captured GPU benchmarks (run by scripts/device_check.sh) say so and exit 0 on a
machine without CUDA, and time a real call when one exists."""

from __future__ import annotations

import pytest
import torch

from fastsample.tools.bench import sampling_cuda, verify_cuda


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
