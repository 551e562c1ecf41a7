"""Statistical helpers shared by the exactness tests.

Every test compares observed counts with exact float64 probabilities by Pearson's
chi-square, with cells of small expected count pooled, at a false-alarm rate of
``ALPHA = 1e-6`` per test. Counts in cells of probability exactly 0 must be exactly 0.
The thresholds come from the chi-square quantile for the test's degrees of freedom, so
they scale with the number of cells; the sample sizes are chosen per test so that the
negative controls (a 2% bias) are rejected with overwhelming margin.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

ALPHA = 1e-6


def chi2_isf(alpha: float, df: int) -> float:
    """Upper ``alpha`` quantile of the chi-square law with ``df`` degrees of freedom."""
    try:
        from scipy.stats import chi2

        return float(chi2.isf(alpha, df))
    except ImportError:  # Wilson-Hilferty, accurate to a few % for df >= 3 at this alpha
        z = _normal_isf(alpha)
        k = float(df)
        return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def _normal_isf(alpha: float) -> float:
    lo, hi = 0.0, 40.0
    for _ in range(200):  # bisection on the normal tail, no scipy needed
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2)) > alpha:
            lo = mid
        else:
            hi = mid
    return lo


def poisson_bounds(mean: float, alpha: float = ALPHA) -> tuple[int, int]:
    """Two-sided acceptance interval for a Poisson(mean) count at total level ``alpha``."""
    try:
        from scipy.stats import poisson

        return int(poisson.ppf(alpha / 2, mean)), int(poisson.isf(alpha / 2, mean))
    except ImportError:
        z = _normal_isf(alpha / 2)
        spread = z * math.sqrt(mean) + 2
        return max(0, int(mean - spread)), int(mean + spread + 1)


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0):
    """Pearson's statistic with pooling; returns ``(stat, df, zero_cell_hits)``.

    Cells are sorted by expected count and the smallest are pooled until every pooled
    cell expects at least ``min_expected``. ``zero_cell_hits`` counts draws that landed on
    probability-0 cells (any is a failure, whatever the statistic).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    zero = probs == 0
    zero_hits = int(counts[zero].sum())
    counts, probs = counts[~zero], probs[~zero]
    total = counts.sum()
    expected = probs * total
    order = np.argsort(expected)
    pooled_obs, pooled_exp = [], []
    acc_o = acc_e = 0.0
    for i in order:
        acc_o += counts[i]
        acc_e += expected[i]
        if acc_e >= min_expected:
            pooled_obs.append(acc_o)
            pooled_exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:  # leftover joins the last pooled cell
        if pooled_exp:
            pooled_obs[-1] += acc_o
            pooled_exp[-1] += acc_e
        else:
            pooled_obs, pooled_exp = [acc_o], [acc_e]
    obs = np.array(pooled_obs)
    exp = np.array(pooled_exp)
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, max(len(obs) - 1, 1), zero_hits


def law_rejected(counts, probs, alpha: float = ALPHA) -> bool:
    stat, df, zero_hits = chi_square(counts, probs)
    return zero_hits > 0 or stat > chi2_isf(alpha, df)


def assert_law(counts, probs, alpha: float = ALPHA, what: str = "") -> None:
    """Fail if the counts are inconsistent with ``probs`` at false-alarm rate ``alpha``."""
    stat, df, zero_hits = chi_square(counts, probs)
    limit = chi2_isf(alpha, df)
    assert zero_hits == 0, f"{what}: {zero_hits} draws of probability-0 tokens"
    assert stat <= limit, f"{what}: chi-square {stat:.1f} > {limit:.1f} (df={df}, p<{alpha})"


def equal_mass_bins(probs: np.ndarray, num_bins: int) -> np.ndarray:
    """Map each token to one of ~num_bins bins of roughly equal probability (zeros to -1)."""
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs) / probs.sum()
    bins = np.minimum((cdf - probs / probs.sum() / 2) * num_bins, num_bins - 1).astype(np.int64)
    bins[probs == 0] = -1
    return bins


def binned(counts: np.ndarray, probs: np.ndarray, num_bins: int):
    """Aggregate token counts and probabilities into equal-mass bins plus one zero cell."""
    bins = equal_mass_bins(probs, num_bins)
    n = int(bins.max()) + 1
    c = np.bincount(bins[bins >= 0], weights=counts[bins >= 0], minlength=n)
    p = np.bincount(bins[bins >= 0], weights=probs[bins >= 0], minlength=n)
    zero_hits = counts[bins < 0].sum()
    return np.append(c, zero_hits), np.append(p, 0.0)


def count_draws(
    draw: Callable[[torch.Tensor], torch.Tensor], row: torch.Tensor, total: int, chunk: int
) -> np.ndarray:
    """Token counts from ``total`` single draws of ``row`` (a ``(V,)`` tensor).

    ``draw`` maps a ``(B, V)`` batch to ``(B, n)`` token ids; the batch repeats the row as
    an expanded view, so no copy of it is made.
    """
    counts = torch.zeros(row.shape[0], dtype=torch.int64)
    done = 0
    while done < total:
        b = min(chunk, total - done)
        ids = draw(row.expand(b, -1))
        counts += torch.bincount(ids[:, 0].cpu(), minlength=row.shape[0])
        done += b
    return counts.numpy()


def plackett_luce(probs: np.ndarray, tuples: np.ndarray) -> np.ndarray:
    """Exact probability of each ordered tuple of distinct tokens drawn without replacement."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    out = np.ones(len(tuples))
    for i, tup in enumerate(tuples):
        left = 1.0
        for tok in tup:
            out[i] *= probs[tok] / left if left > 0 else 0.0
            left -= probs[tok]
    return out
