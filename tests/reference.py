"""Float64 reference of the sampling controls, written with plain sorting.

This is the specification the tests hold :func:`fastsample.sample` and
:func:`fastsample.process` to: temperature, then top-k (ties at the k-th value kept), then
top-p on the top-k survivors renormalized (the smallest most-likely set reaching top_p,
ties kept), then min-p relative to the largest probability; greedy for temperature 0.
"""

from __future__ import annotations

import numpy as np
import torch


def reference_probs(
    values: np.ndarray,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    is_logits: bool = True,
    top_p_on_all: bool = False,
    cut_order: str = "transformers",
) -> np.ndarray:
    """The processed distribution of one row, float64.

    ``cut_order="vllm"`` applies min-p first, then top-k among its survivors (all of them if
    fewer than k), then top-p on what is left, as vLLM does. ``top_p_on_all=True`` is the
    classic bug kept for negative controls: the top-p mass is taken from the whole
    distribution instead of the top-k survivors. ``cut_order="joint"`` is that on purpose
    (SGLang's and FlashInfer's joint order): top-k and top-p each on the whole tempered row,
    the kept sets intersected, then min-p.
    """
    x = np.asarray(values, dtype=np.float64)
    vocab = x.shape[0]
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0  # np.argmax returns the first maximal index
        return out
    if is_logits:
        weights = np.exp((x - x.max()) / temperature)
    else:
        weights = (x / x.max()) ** (1.0 / temperature)
    keep = np.ones(vocab, dtype=bool)
    if cut_order == "vllm" and min_p > 0:
        keep &= weights >= min_p * weights.max()
    if 0 < top_k < keep.sum():
        kth = np.sort(weights[keep])[::-1][top_k - 1]
        keep &= weights >= kth
    if top_p < 1:
        pool = weights if top_p_on_all or cut_order == "joint" else np.where(keep, weights, 0.0)
        ranked = np.sort(pool)[::-1]
        reached = np.cumsum(ranked) >= top_p * pool.sum()
        tau = ranked[int(np.argmax(reached))]
        keep &= weights >= tau
    if cut_order in ("transformers", "joint") and min_p > 0:
        keep &= weights >= min_p * weights.max()
    out = np.where(keep, weights, 0.0)
    return out / out.sum()


def robust_top_p(weights: np.ndarray, rng: np.random.Generator) -> float:
    """A top_p halfway between two consecutive cumulative masses of distinct values, so the
    kept set does not hinge on rounding (ties stay together)."""
    ranked = np.sort(weights[weights > 0])[::-1]
    # The mass at or above each distinct value: the running sum at its last occurrence.
    last = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    masses = np.cumsum(ranked)[last] / weights.sum()
    # Gaps below float32 resolution of top_p and of the masses are not robust: skip them.
    usable = np.flatnonzero(np.diff(masses) > 1e-4)
    if len(usable) == 0:
        return 1.0
    j = int(rng.choice(usable))
    return float((masses[j] + masses[j + 1]) / 2)


def robust_min_p(weights: np.ndarray, rng: np.random.Generator) -> float:
    """A min_p halfway between two consecutive distinct weight ratios to the maximum."""
    ratios = np.unique(weights[weights > 0] / weights.max())[::-1]
    usable = np.flatnonzero(-np.diff(ratios) > 1e-4 * ratios[:-1])
    if len(usable) == 0:
        return 0.0
    j = int(rng.choice(usable))
    return float((ratios[j] + ratios[j + 1]) / 2)


def top_p_keeping(weights: np.ndarray, values: int) -> float:
    """A top_p keeping the ``values`` most likely distinct values of ``weights`` (all of them
    if there are fewer), halfway between two cumulative masses (robust to rounding)."""
    ranked = np.sort(weights[weights > 0])[::-1]
    last = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    masses = np.append(0.0, np.cumsum(ranked)[last] / weights.sum())
    n = min(values, len(masses) - 1)
    assert masses[n] - masses[n - 1] > 1e-4  # float32 top_p and sums resolve the cut
    return float((masses[n - 1] + masses[n]) / 2)


def min_p_keeping(weights: np.ndarray, values: int) -> float:
    """A min_p keeping the ``values`` largest distinct weights, halfway between two ratios to
    the largest (checked to be well apart)."""
    ratios = np.append(np.unique(weights[weights > 0] / weights.max())[::-1], 0.0)
    n = min(values, len(ratios) - 1)
    assert ratios[n - 1] - ratios[n] > 1e-4 * ratios[n - 1]
    return float((ratios[n - 1] + ratios[n]) / 2)


# ---- exact thresholds (tests/ops/test_select.py, tests/kernels/test_triton_select.py)


def threshold_rows(dtype: torch.dtype, vocab: int, seed: int) -> torch.Tensor:
    """Non-negative test rows for threshold selection: continuous, heavy ties, mostly zeros,
    tiny values, nearly flat."""
    gen = torch.Generator().manual_seed(seed)
    continuous = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 4
    ties = torch.randint(0, 4, (vocab,), generator=gen).double() / 4
    zeros = torch.where(torch.rand(vocab, generator=gen) < 0.7, 0.0, continuous)
    tiny = continuous * 1e-30
    flat = 0.5 + torch.rand(vocab, generator=gen, dtype=torch.float64) * 1e-6
    return torch.stack([continuous, ties, zeros, tiny, flat]).to(dtype)


def reference_threshold(row: np.ndarray, target: float, by: str) -> float:
    ranked = np.sort(row)[::-1]
    amounts = np.cumsum(np.ones_like(ranked) if by == "count" else ranked)
    return float(ranked[int(np.argmax(amounts >= target))])
