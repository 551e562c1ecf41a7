"""Statistical helpers shared by every law test of the suite.

**The law test.** Observed counts are compared with exact float64 probabilities by Pearson's
chi-square at a false-alarm rate of ``ALPHA = 1e-6`` per test (seeded, so a passing test stays
passing). Any draw of a probability-0 token fails at once. When every token of a small law
expects enough draws, the tokens themselves are the cells. Otherwise the counts are judged in
several *views*, each a partition of the tokens into cells, at ``ALPHA / views`` each (so the
false-alarm rate stays below ``ALPHA``):

- the most likely tokens (each expecting at least ``SINGLE_EXPECTED`` draws, at most
  ``MAX_SINGLES``) get a cell of their own in every view, so an off-by-one index that moves a
  heavy token's mass onto its neighbour shows in every view;
- ``index``: the other tokens in contiguous equal-mass ranges (a bias on a block of the row);
- ``mass``: the other tokens in equal-mass tiers by probability, each split by index parity
  (a bias on mid-mass tokens, on even-index tokens);
- ``hash``: the other tokens by a hash of their index (neighbouring indices land in different
  cells: a local, off-by-one or lane error shows);
- ``tokens``: every token on its own, when each expects at least 5 draws.

No view groups only neighbouring indices, save the index ranges themselves.

**Power.** :func:`detectable_bias` returns, for a law, a sample size and the test above, the
smallest relative bias ``delta`` on about 10% of the mass (a set ``S`` of tokens drawn with
probability ``p_i (1 + delta) / (1 + delta p(S))``) that the test detects with probability
0.99. The sets tried are the index windows of 10% of the mass, the even-index tokens of each
window of 20%, and the deciles of the tokens ranked by probability; the worst is reported.
Each view's statistic is non-central chi-square with non-centrality
``n * sum_c (q_c - p_c)^2 / p_c`` under the alternative; a set is detected by the view that
sees it best. Law tests choose their sample size with :func:`draws_needed` and state their
detectable bias.

**The registry.** Every test module that judges a law defines ``law_cases()``, yielding one
:class:`LawCase` per law it judges (name, exact law, draws, claimed detectable bias).
tests/test_power.py finds those modules by their source, checks each claim with
:func:`detectable_bias` and the targets: at most 2% at V <= 1,000, 5% up to 32k, 10% at
V >= 32k. A case below its target names, in ``carried_by``, the full-power test that carries
its law (for instance: the Triton interpreter path draws bitwise the torch path's tokens,
whose law test has full power).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

ALPHA = 1e-6
POWER = 0.99
BIAS_MASS = 0.1  # the power statement: a relative bias on this share of the mass
MIN_EXPECTED = 5.0  # cells expecting fewer draws are pooled (smallest first)
SINGLE_EXPECTED = 40.0  # a token expecting this many draws gets a cell of its own
MAX_SINGLES = 16
CELL_EXPECTED = 40.0  # the other tokens: cells expecting about this many draws ...
VIEW_CELLS = 20  # ... and at most this many per view (ranges and tiers of 10% align)
SMALL_LAW = 2 * MAX_SINGLES  # laws with at most this many tokens: the tokens are the cells


@lru_cache(maxsize=4096)
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


def poisson_power(bounds: tuple[int, int], mean: float) -> float:
    """Probability that a Poisson(mean) count falls outside ``bounds`` (is rejected)."""
    from scipy.stats import poisson

    lo, hi = bounds
    return float(poisson.cdf(lo - 1, mean) + poisson.sf(hi, mean))


# ----------------------------------------------------------------------------- cells and views


def _pool(expected: np.ndarray, min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """Group of each cell: cells sorted by expected count, the smallest pooled until each
    group expects at least ``min_expected``; a short leftover joins the last group."""
    order = np.argsort(expected, kind="stable")
    groups = np.empty(len(expected), dtype=np.int64)
    g, acc = 0, 0.0
    for i in order:
        groups[i] = g
        acc += expected[i]
        if acc >= min_expected:
            g, acc = g + 1, 0.0
    if acc > 0 and g > 0:
        groups[groups == g] = g - 1
    return groups


def _hash(index: np.ndarray) -> np.ndarray:
    """A multiplicative hash of token indices (neighbours land far apart)."""
    h = (index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return h.astype(np.int64)


def law_views(probs: np.ndarray, n: float) -> list[tuple[str, np.ndarray]]:
    """The partitions the law test judges ``n`` draws of ``probs`` in: ``(name, cell)`` with
    ``cell[i]`` the cell of token ``i`` (-1 for the probability-0 tokens)."""
    p = np.asarray(probs, dtype=np.float64).ravel()
    p = p / p.sum()
    support = np.flatnonzero(p > 0)
    views = []
    if len(support) <= SMALL_LAW or n * p[support].min() >= MIN_EXPECTED:
        cell = np.full(len(p), -1, dtype=np.int64)
        cell[support] = np.arange(len(support))
        views.append(("tokens", cell))
        if len(support) <= SMALL_LAW:
            return views
    ranked = support[np.lexsort((support, -p[support]))]  # most likely first, ties by index
    top = ranked[:MAX_SINGLES]
    singles = top[n * p[top] >= SINGLE_EXPECTED]
    is_rest = p > 0
    is_rest[singles] = False
    rest = np.flatnonzero(is_rest)  # index order
    s = len(singles)
    if len(rest) == 0:
        cell = np.full(len(p), -1, dtype=np.int64)
        cell[singles] = np.arange(s)
        return [*views, ("singles", cell)]
    mass = p[rest].sum()
    k = int(min(VIEW_CELLS, max(1, n * mass // CELL_EXPECTED, 1)))
    k = max(1, min(k, len(rest)))

    def with_rest(rest_cell: np.ndarray) -> np.ndarray:
        cell = np.full(len(p), -1, dtype=np.int64)
        cell[singles] = np.arange(s)
        cell[rest] = s + rest_cell
        return cell

    def equal_mass(order: np.ndarray, parts: int) -> np.ndarray:
        cum = np.cumsum(p[order]) - p[order] / 2
        return np.minimum((cum / mass * parts).astype(np.int64), parts - 1)

    if k >= 4:  # contiguous ranges, each split by index parity
        views.append(("index", with_rest(equal_mass(rest, k // 2) * 2 + (rest & 1))))
    else:
        views.append(("index", with_rest(equal_mass(rest, k))))
    by_mass = rest[np.lexsort((rest, -p[rest]))]
    tier = np.empty(len(p), dtype=np.int64)
    tier[by_mass] = equal_mass(by_mass, k)
    views.append(("mass", with_rest(tier[rest])))
    views.append(("hash", with_rest(_hash(rest) % k)))
    return views


def _cells(counts, p, cell):
    keep = cell >= 0
    c = np.bincount(cell[keep], weights=counts[keep])
    q = np.bincount(cell[keep], weights=p[keep], minlength=len(c))
    return c, q


def _pooled(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    return np.bincount(groups, weights=values)


@dataclass
class LawResult:
    """The outcome of :func:`law_test`: ``rejected`` and a line saying why."""

    rejected: bool
    zero_hits: int
    worst: str  # the view with the smallest p-value margin, and its statistic

    def __bool__(self) -> bool:
        return self.rejected


def law_test(counts, probs, alpha: float = ALPHA) -> LawResult:
    """The law test: ``counts`` (per token) against ``probs`` (exact, float64)."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    p = np.asarray(probs, dtype=np.float64).ravel()
    p = p / p.sum()
    zero_hits = int(counts[p == 0].sum())
    n = counts.sum()
    views = law_views(p, n)
    rejected, worst, margin = zero_hits > 0, "", -np.inf
    for name, cell in views:
        c, q = _cells(counts, p, cell)
        groups = _pool(n * q)
        obs, exp = _pooled(c, groups), _pooled(n * q, groups)
        stat = float(((obs - exp) ** 2 / exp).sum())
        df = max(len(obs) - 1, 1)
        limit = chi2_isf(alpha / len(views), df)
        if stat - limit > margin:
            margin = stat - limit
            worst = f"view {name}: chi-square {stat:.1f} vs limit {limit:.1f} (df={df})"
        rejected |= stat > limit
    return LawResult(bool(rejected), zero_hits, worst)


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = MIN_EXPECTED):
    """Pearson's statistic over the tokens with pooling; returns ``(stat, df, zero_hits)``."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    zero = probs == 0
    zero_hits = int(counts[zero].sum())
    counts, probs = counts[~zero], probs[~zero]
    expected = probs * counts.sum()
    groups = _pool(expected, min_expected)
    obs, exp = _pooled(counts, groups), _pooled(expected, groups)
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, max(len(obs) - 1, 1), zero_hits


def law_rejected(counts, probs, alpha: float = ALPHA) -> bool:
    return law_test(counts, probs, alpha).rejected


def assert_law(counts, probs, alpha: float = ALPHA, what: str = "") -> None:
    """Fail if the counts are inconsistent with ``probs`` at false-alarm rate ``alpha``."""
    result = law_test(counts, probs, alpha)
    assert result.zero_hits == 0, f"{what}: {result.zero_hits} draws of probability-0 tokens"
    assert not result.rejected, f"{what}: {result.worst}, p < {alpha}"


# ----------------------------------------------------------------------------- power


def bias_sets(probs: np.ndarray, mass: float = BIAS_MASS) -> list[tuple[str, np.ndarray]]:
    """The token sets (index arrays) of about ``mass`` of the probability that the power
    statement covers: index windows, the even-index tokens of windows of twice the mass, and
    deciles of the tokens ranked by probability."""
    p = np.asarray(probs, dtype=np.float64).ravel()
    p = p / p.sum()
    idx = np.flatnonzero(p > 0)
    parts = max(1, round(1 / mass))

    def slices(order: np.ndarray, count: int) -> list[np.ndarray]:
        cum = np.cumsum(p[order]) - p[order] / 2
        which = np.minimum((cum * count).astype(np.int64), count - 1)
        cuts = np.searchsorted(which, np.arange(count + 1))
        return [order[cuts[j] : cuts[j + 1]] for j in range(count)]

    sets = [(f"index window {j}", t) for j, t in enumerate(slices(idx, parts))]
    for j, tokens in enumerate(slices(idx, max(1, parts // 2))):
        sets.append((f"even tokens of window {j}", tokens[tokens % 2 == 0]))
    ranked = idx[np.lexsort((idx, -p[idx]))]
    sets += [(f"probability decile {j}", t) for j, t in enumerate(slices(ranked, parts))]
    out, seen = [], set()
    for name, tokens in sets:
        key = np.sort(tokens).tobytes()
        if key not in seen and mass / 2 <= p[tokens].sum() < 1 - 1e-12:
            seen.add(key)
            out.append((name, tokens))
    return out


@dataclass(frozen=True)
class LawCase:
    """One law a test judges, as registered by its module's ``law_cases()``.

    ``law`` is the exact law (float64, or a function computing it: registries are built at
    collection time); ``draws`` the sample size the test uses; ``claim`` the detectable bias
    it states (:func:`detectable_bias` at ``draws`` must not exceed it). ``carried_by`` is
    empty for a test that meets the target itself, else the test that carries the law at full
    power and why this one may be weaker.
    """

    name: str
    law: np.ndarray | Callable[[], np.ndarray]
    draws: int
    claim: float
    carried_by: str = ""

    def probs(self) -> np.ndarray:
        law = self.law() if callable(self.law) else self.law
        return np.asarray(law, dtype=np.float64).ravel()


def target_bias(vocab: int) -> float:
    """The detectable bias a law test of a ``vocab``-token law must reach (issue 18)."""
    return 0.02 if vocab <= 1000 else 0.10 if vocab >= 32_000 else 0.05


@lru_cache(maxsize=4096)
def _needed_noncentrality(df: int, alpha: float, power: float) -> float:
    from scipy.optimize import brentq
    from scipy.stats import ncx2

    limit = chi2_isf(alpha, df)
    return float(brentq(lambda lam: ncx2.sf(limit, df, lam) - power, 1e-9, 1e7, xtol=1e-6))


def detectable_bias(
    probs, n: float, mass: float = BIAS_MASS, power: float = POWER, alpha: float = ALPHA
) -> tuple[float, str]:
    """``(delta, set)``: the smallest relative bias on about ``mass`` of the probability that
    :func:`law_test` detects with probability ``power`` from ``n`` draws of ``probs``, for the
    worst of :func:`bias_sets` (named)."""
    p = np.asarray(probs, dtype=np.float64).ravel()
    p = p / p.sum()
    views = []
    all_views = law_views(p, n)
    for _, cell in all_views:
        keep = cell >= 0
        q = np.bincount(cell[keep], weights=p[keep])
        groups = _pool(n * q)
        pooled = _pooled(q, groups)
        df = max(len(pooled) - 1, 1)
        lam = _needed_noncentrality(df, alpha / len(all_views), power)
        views.append((groups[cell.clip(0)], len(pooled), pooled, lam))
    worst, worst_name = 0.0, ""
    for name, tokens in bias_sets(p, mass):
        m = p[tokens].sum()
        best = math.inf
        for group_of, size, pooled, lam in views:
            s = np.bincount(group_of[tokens], weights=p[tokens], minlength=size)
            a = float(((s - m * pooled) ** 2 / pooled).sum())
            if a <= 0:
                continue
            r = math.sqrt(lam / (n * a))
            if r * m < 1:
                best = min(best, r / (1 - r * m))
        if best > worst:
            worst, worst_name = best, name
    return worst, worst_name


def equality_bias(checks: list[tuple[int, int]], mass: float = BIAS_MASS) -> float:
    """The relative bias on ``mass`` of the probability that bitwise equality checks against an
    exact sampler detect with probability ``POWER``: ``checks`` are ``(rows, allowed)``, each
    failing when more than ``allowed`` of its ``rows`` (random rows, random counters) draw
    another token than the exact sampler with the same uniforms. A bias ``delta`` on a set of
    mass ``m`` moves ``m (1 - m) delta / (1 + m delta)`` of the probability (total variation),
    so the sampler draws another token at least that often: the checks pass together with
    probability ``prod_c P(Binom(rows, r) <= allowed)`` at a mismatch rate ``r``."""
    from scipy.optimize import brentq
    from scipy.stats import binom

    def missed(rate: float) -> float:
        return math.prod(binom.cdf(a, n, rate) for n, a in checks) - (1 - POWER)

    rate = brentq(missed, 1e-12, 0.5)
    return rate / (mass * (1 - mass) - mass * rate)


def draws_needed(probs, target: float, mass: float = BIAS_MASS, multiple: int = 1000) -> int:
    """The smallest sample size (a multiple of ``multiple``) whose detectable bias is at most
    ``target``."""
    n = 1000.0
    for _ in range(30):
        delta, _ = detectable_bias(probs, n, mass)
        if delta <= target:
            break
        n *= min(4.0, (delta / target) ** 2 * 1.05) if math.isfinite(delta) else 4.0
    lo, hi = max(1, int(n / 1.3 / multiple)), math.ceil(n / multiple)
    while lo < hi:  # bisect down to the smallest multiple that still reaches the target
        mid = (lo + hi) // 2
        if detectable_bias(probs, mid * multiple, mass)[0] <= target:
            hi = mid
        else:
            lo = mid + 1
    return hi * multiple


# ----------------------------------------------------------------------------- wrong laws


def shifted_law(probs: np.ndarray, shift: int = 1) -> np.ndarray:
    """The law of a sampler returning index ``i + shift`` (mod V) for a draw of ``i``."""
    return np.roll(np.asarray(probs, dtype=np.float64), shift)


def parity_biased(probs: np.ndarray, factor: float = 1.5) -> np.ndarray:
    """Even-index tokens ``factor`` times as likely as they should be."""
    q = np.asarray(probs, dtype=np.float64).copy()
    q[::2] *= factor
    return q / q.sum()


def half_biased(probs: np.ndarray, factor: float = 1.1) -> np.ndarray:
    """The first half of the vocabulary ``factor`` times as likely as it should be."""
    q = np.asarray(probs, dtype=np.float64).copy()
    q[: len(q) // 2] *= factor
    return q / q.sum()


def mid_mass_biased(probs: np.ndarray, delta: float, mass: float = BIAS_MASS) -> np.ndarray:
    """The tokens of middling probability (the probability decile around the median of the
    mass) ``1 + delta`` times as likely as they should be."""
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum()
    ranked = np.lexsort((np.arange(len(p)), -p))
    cum = np.cumsum(p[ranked]) - p[ranked] / 2
    middle = ranked[(cum >= 0.5 - mass / 2) & (cum < 0.5 + mass / 2)]
    if len(middle) == 0:  # one token holds the median: bias it
        middle = ranked[np.searchsorted(np.cumsum(p[ranked]), 0.5)]
    q = p.copy()
    q[middle] *= 1 + delta
    return q / q.sum()


# ----------------------------------------------------------------------------- drawing


def binned(counts: np.ndarray, probs: np.ndarray, num_bins: int):
    """Equal-mass bins of neighbouring tokens plus one zero cell (kept for the GPU-only tests;
    :func:`law_test` bins by itself)."""
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs) / probs.sum()
    bins = np.minimum((cdf - probs / probs.sum() / 2) * num_bins, num_bins - 1).astype(np.int64)
    bins[probs == 0] = -1
    n = int(bins.max()) + 1
    c = np.bincount(bins[bins >= 0], weights=counts[bins >= 0], minlength=n)
    p = np.bincount(bins[bins >= 0], weights=probs[bins >= 0], minlength=n)
    return np.append(c, counts[bins < 0].sum()), np.append(p, 0.0)


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
