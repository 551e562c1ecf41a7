"""The chain stages' whole-row numbers (:mod:`fastsample.ops.truncation`) against float64:
dynamic temperature's entropy, summed a cache-sized piece of columns at a time on CPU, and
top-n-sigma's deviation, on rows with and without removed (``-inf``) entries. The stages'
laws are in tests/stages/test_chain_law.py."""

from __future__ import annotations

import math

import numpy as np
import torch

from fastsample.ops import truncation


def _entropy64(row: np.ndarray) -> tuple[float, int]:
    alive = row[row > -np.inf].astype(np.float64)
    p = np.exp(alive - alive.max())
    p /= p.sum()
    return float(-(p * np.log(p)).sum()), alive.size


def test_dynamic_temperature_in_pieces_is_the_float64_value():
    """B=64 and V=20,000: three pieces of 8,192 columns (and a short last one); a batch with a
    row of removed entries takes the masked entropy (the pieces' product is NaN there). Every
    row's temperature is the float64 formula's within 1e-6 relative, either way."""
    gen = torch.Generator().manual_seed(2)
    clean = torch.randn(64, 20_000, generator=gen) * 3
    masked = clean.clone()
    masked[5, ::4] = -math.inf
    t, spread, exponent = 0.9, 0.5, 1.3
    for x in (clean, masked):
        for finite in (None, False):
            got = truncation.dynamic_temperature_value(x, t, spread, exponent, finite=finite)
            for b in (0, 5, 63):
                h, count = _entropy64(x[b].numpy())
                lo, hi = max(t - spread, 0.0), t + spread
                want = lo + (hi - lo) * (h / math.log(count)) ** exponent
                assert math.isclose(got[b].item(), want, rel_tol=1e-6), (finite, b)


def test_top_n_sigma_threshold_is_the_float64_value():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5000, generator=gen) * 2
    for removed in (False, True):
        if removed:
            x[2, :1000] = -math.inf
        got = truncation.top_n_sigma_threshold(x, 1.5).squeeze(1)
        for b in range(4):
            row = x[b].numpy()
            alive = row[row > -np.inf].astype(np.float64)
            want = alive.max() - 1.5 * alive.std()
            assert math.isclose(got[b].item(), want, rel_tol=1e-5), (removed, b)
