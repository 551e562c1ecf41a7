"""In-kernel radix thresholds (fastsample.kernels.select) against the torch radix and sorting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from fastsample.kernels import select as ks
from fastsample.kernels.philox import INTERPRETED
from fastsample.ops.select import descending_threshold
from reference import reference_threshold, threshold_rows

if not INTERPRETED:  # a CUDA machine without TRITON_INTERPRET: these tests use CPU tensors
    pytest.skip("CPU tensors need the interpreter (TRITON_INTERPRET=1)", allow_module_level=True)


def near_boundary(row: np.ndarray, target: float) -> bool:
    ranked = np.sort(row)[::-1]
    return bool(np.min(np.abs(np.cumsum(ranked) - target)) < 1e-6 * ranked.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("by", ["count", "mass", "share"])
def test_threshold_matches_torch_radix_and_sorting(dtype, by):
    # 700: not a multiple of any tile; the row is read in one tile here and in 512s on a GPU.
    values = threshold_rows(dtype, 700, seed=1)
    gen = np.random.default_rng(2)
    for _ in range(2):
        if by == "count":
            target = torch.tensor(gen.integers(1, 701, size=5), dtype=torch.float64)
            target[0] = 1.0  # the largest
            target[1] = 700.0  # the smallest (all entries)
        else:
            fraction = torch.tensor(gen.random(5), dtype=torch.float64)
            target = fraction * values.double().sum(-1)
        asked = fraction if by == "share" else target
        got = ks.descending_threshold(values, asked, by)
        torch_radix = descending_threshold(values, asked, by)
        assert got.dtype == dtype and got.shape == (5,)
        amount = "count" if by == "count" else "mass"
        for r in range(values.shape[0]):
            row = values[r].double().numpy()
            want = reference_threshold(row, float(target[r]), amount)
            # Masses are float64 sums here, float32 buckets in the torch radix: either
            # neighbour is right only where the target is within rounding of a mass.
            near = amount == "mass" and near_boundary(row, float(target[r]))
            assert float(got[r]) == want or near
            assert got[r] == torch_radix[r] or near


def test_tiles_of_a_long_row_give_the_same_thresholds(monkeypatch):
    """A row read in several tiles (the GPU layout) gives the one-tile answer, bitwise."""
    values = threshold_rows(torch.float32, 1500, seed=3)
    target = torch.tensor([3.0, 40.0, 1500.0, 777.0, 1.0], dtype=torch.float64)
    whole = ks.descending_threshold(values, target, "count")
    shares = torch.tensor([0.3, 0.9, 0.5, 0.99, 0.01], dtype=torch.float64)
    whole_p = ks.descending_threshold(values, shares, "share")
    monkeypatch.setattr(ks, "tile_for", lambda vocab, interpreted: 256)
    assert torch.equal(ks.descending_threshold(values, target, "count"), whole)
    tiled_p = ks.descending_threshold(values, shares, "share")
    # float64 sums in another order: equal unless a target sits on a cumulative mass.
    assert (tiled_p == whole_p).sum() >= 4


def test_ties_short_rows_and_garbage():
    values = torch.tensor(
        [
            [0.5, 0.25, 0.5, 0.5, 0.125, 0.0],
            [math.nan, 1.0, -2.0, math.inf, 0, 1],
            [1.0, -3.0, -math.nan, -math.inf, -0.0, 2.0],  # negative patterns
        ]
    )
    for dtype in (torch.float32, torch.float64):
        # Row 0: the 2nd largest is 0.5 (all three 0.5s are >= it); the three reach mass 1.2.
        for by, amount in (("count", 2.0), ("mass", 1.2)):
            target = torch.full((3,), amount, dtype=torch.float64)
            got = ks.descending_threshold(values.to(dtype), target, by)
            assert got.shape == (3,)  # garbage rows give some value, never an error
            assert got[0] == 0.5
    one = torch.tensor([[0.25]])
    assert ks.descending_threshold(one, torch.ones(1, dtype=torch.float64), "count") == 0.25
    assert ks.descending_threshold(one, torch.ones(1, dtype=torch.float64), "share") == 0.25


def test_argument_checks():
    with pytest.raises(ValueError, match="by must be"):
        ks.descending_threshold(torch.ones(1, 3), torch.ones(1, dtype=torch.float64), "sum")
    with pytest.raises(TypeError, match="float32 or float64"):
        ks.descending_threshold(torch.ones(1, 3).half(), torch.ones(1), "count")
