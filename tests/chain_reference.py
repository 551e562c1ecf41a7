"""Float64 reference of the sampler chain and the history stages, written with plain sorting.

One row at a time, numpy: each stage of fastsample.stages.samplers from its definition
(Hugging Face's warpers for typical, epsilon, eta and no-repeat n-grams; llama.cpp's samplers
for top-n-sigma, XTC, dynamic temperature, mirostat v2, windowed penalties and DRY), run in
the chain's order on the renormalized survivors. XTC's law is its mixture: ``q`` times the
chain with its removal plus ``1 - q`` without. The ``bug`` argument plants the mistakes the
negative controls must catch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ORDERS = {
    "transformers": ("temperature", "top_n_sigma", "top_k", "top_p", "min_p", "typical_p",
                     "epsilon_cutoff", "eta_cutoff", "xtc", "mirostat"),
    "vllm": ("temperature", "top_n_sigma", "min_p", "top_k", "top_p", "typical_p",
             "epsilon_cutoff", "eta_cutoff", "xtc", "mirostat"),
    "llama.cpp": ("top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc",
                  "epsilon_cutoff", "eta_cutoff", "temperature", "mirostat"),
}  # fmt: skip

BUGS = (
    "stage_dropped",  # the configuration's own stage is skipped
    "temperature_first",  # temperature moved to the front of the chain
    "typical_by_probability",  # typical-p orders the tokens by probability (top-p)
    "variance_for_sigma",  # top-n-sigma with the variance in place of the deviation
    "xtc_keeps_most_likely",  # XTC keeps the most likely of the top choices
    "entropy_unnormalized",  # dynamic temperature without dividing H by log n
    "mu_natural_log",  # mirostat's surprise in nats
    "dry_no_breakers",  # DRY ignores its sequence breakers
    "window_ignored",  # penalties over the whole history instead of the last n
    "ngram_one_short",  # no-repeat n-grams compare n - 2 tokens
)


@dataclass
class ChainRow:
    """One request's chain settings (everything off by default)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    order: str | tuple[str, ...] = "transformers"
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat_tau: float | None = None
    mirostat_mu: float | None = None  # None: 2 tau
    history: list[int] = field(default_factory=list)  # context tokens, oldest first
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    penalty_last_n: int = 0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[list[int]] = field(default_factory=list)
    no_repeat_ngram_size: int = 0


def _probs(x: np.ndarray) -> np.ndarray:
    alive = x > -np.inf
    w = np.where(alive, np.exp(x - x[alive].max()), 0.0)
    return w / w.sum()


def _entropy(p: np.ndarray) -> float:
    q = p[p > 0]
    return float(-(q * np.log(q)).sum())


def _cut(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    return np.where(keep, x, -np.inf)


def _upper_set(keys: np.ndarray, p: np.ndarray, target: float) -> np.ndarray:
    """Keep the entries with the largest keys until their mass reaches target (ties kept)."""
    order = np.argsort(-keys, kind="stable")
    mass = np.cumsum(p[order])
    at = min(int(np.searchsorted(mass, target * (1 - 1e-12), side="left")), len(keys) - 1)
    return keys >= keys[order[at]]


def stage(x: np.ndarray, name: str, r: ChainRow, coin: float, bug: str | None) -> np.ndarray:
    alive = x > -np.inf
    p = _probs(x)
    if name == "temperature":
        if r.dynatemp_range > 0 and bug != "dynatemp_off":
            n = alive.sum()
            if n <= 1:
                return x
            lo, hi = max(0.0, r.temperature - r.dynatemp_range), r.temperature + r.dynatemp_range
            h = _entropy(p) if bug == "entropy_unnormalized" else _entropy(p) / np.log(n)
            t = lo + (hi - lo) * h**r.dynatemp_exponent
        else:
            t = r.temperature
        if t == 0:
            keep = np.zeros_like(alive)
            keep[int(np.argmax(x))] = True
            return _cut(x, keep)
        return x / t
    if name == "top_k" and 0 < r.top_k < alive.sum():
        return _cut(x, x >= np.sort(x[alive])[::-1][r.top_k - 1])
    if name == "top_p" and r.top_p < 1:
        return _cut(x, _upper_set(p, p, r.top_p) & alive)
    if name == "min_p" and r.min_p > 0:
        return _cut(x, p >= r.min_p * p.max())
    if name == "top_n_sigma" and r.top_n_sigma > 0:
        sigma = np.std(x[alive])
        sigma = sigma**2 if bug == "variance_for_sigma" else sigma
        return _cut(x, x >= x[alive].max() - r.top_n_sigma * sigma)
    if name == "typical_p" and r.typical_p < 1:
        if bug == "typical_by_probability":
            return _cut(x, _upper_set(p, p, r.typical_p) & alive)
        d = np.where(alive & (p > 0), np.abs(-np.log(np.where(p > 0, p, 1)) - _entropy(p)), np.inf)
        return _cut(x, _upper_set(-d, p, r.typical_p) & alive & (p > 0))
    if name == "epsilon_cutoff" and r.epsilon_cutoff > 0:
        return _cut(x, (p >= r.epsilon_cutoff) | (x == x[alive].max()))
    if name == "eta_cutoff" and r.eta_cutoff > 0:
        eta = min(r.eta_cutoff, np.sqrt(r.eta_cutoff) * np.exp(-_entropy(p)))
        return _cut(x, (p >= eta) | (x == x[alive].max()))
    if name == "xtc" and r.xtc_probability > 0 and coin < r.xtc_probability:
        top = p >= r.xtc_threshold
        if top.sum() >= 2 and r.xtc_threshold <= 0.5:
            chosen = p[top].max() if bug == "xtc_keeps_most_likely" else p[top].min()
            return _cut(x, ~(top & (p != chosen)))
        return x
    if name == "mirostat" and r.mirostat_tau is not None:
        mu = 2 * r.mirostat_tau if r.mirostat_mu is None else r.mirostat_mu
        surprise = -np.log(np.where(p > 0, p, 1e-300))
        if bug != "mu_natural_log":
            surprise = surprise / np.log(2)
        return _cut(x, (surprise <= mu) | (p == p.max()))
    return x


def chain_probs(x: np.ndarray, r: ChainRow, bug: str | None = None) -> np.ndarray:
    """The chain's law on one row of (already staged) logits, float64."""
    order = ORDERS[r.order] if isinstance(r.order, str) else r.order
    own = _own_stage(r)
    if bug == "stage_dropped" and own == "temperature":  # dynamic temperature: the plain one
        own, bug = "", "dynatemp_off"
    if bug == "temperature_first":
        order = ("temperature", *(s for s in order if s != "temperature"))

    def run(coin: float) -> np.ndarray:
        y = np.asarray(x, dtype=np.float64)
        for name in order:
            if bug == "stage_dropped" and name == own:
                continue
            y = stage(y, name, r, coin, bug)
        return _probs(y)

    if r.xtc_probability > 0:
        q = r.xtc_probability
        return q * run(0.0) + (1 - q) * run(1.0)
    return run(1.0)


def _own_stage(r: ChainRow) -> str:
    for name, on in (("typical_p", r.typical_p < 1), ("epsilon_cutoff", r.epsilon_cutoff > 0),
                     ("eta_cutoff", r.eta_cutoff > 0), ("top_n_sigma", r.top_n_sigma > 0),
                     ("xtc", r.xtc_probability > 0), ("mirostat", r.mirostat_tau is not None),
                     ("temperature", r.dynatemp_range > 0)):  # fmt: skip
        if on:
            return name
    return ""


# ---------------------------------------------------------------------------- history stages


def _suffix_match(h: list[int], c: int, limit: int) -> int:
    """How many tokens before position c repeat the context's last tokens (at most limit)."""
    m = 0
    while m < limit and c - 1 - m >= 0 and h[c - 1 - m] == h[len(h) - 1 - m]:
        m += 1
    return m


def history_logits(x: np.ndarray, r: ChainRow, bug: str | None = None) -> np.ndarray:
    """Windowed penalties, DRY and no-repeat n-grams on one row, float64."""
    x = np.asarray(x, dtype=np.float64).copy()
    hist = list(r.history)
    if bug == "stage_dropped":  # the history stages' own negative control
        return x
    if r.penalty_last_n != 0:
        whole = r.penalty_last_n < 0 or bug == "window_ignored"
        window = hist if whole else hist[-r.penalty_last_n :]
        counts = np.bincount(np.asarray(window, dtype=np.int64), minlength=x.shape[0])
        seen = counts > 0
        x = np.where(seen & (x > 0), x / r.repetition, np.where(seen, x * r.repetition, x))
        x = x - r.frequency * counts - r.presence * seen
    if r.dry_multiplier > 0 and r.dry_penalty_last_n != 0:
        h = hist if r.dry_penalty_last_n < 0 else hist[-r.dry_penalty_last_n :]
        n = len(h)
        limit = n
        breakers = [] if bug == "dry_no_breakers" else r.dry_sequence_breakers
        for i in range(n):  # the most recent complete breaker, by the position of its last token
            end = n - 1 - i
            fits = [b for b in breakers if len(b) <= end + 1]
            if any(h[end - len(b) + 1 : end + 1] == list(b) for b in fits):
                limit = i
                break
        if n > r.dry_allowed_length and limit >= r.dry_allowed_length:
            longest: dict[int, int] = {}
            for c in range(1, n):
                m = _suffix_match(h, c, limit)
                if m >= r.dry_allowed_length:
                    longest[h[c]] = max(longest.get(h[c], -1), m)
            singles = {b[0] for b in breakers if len(b) == 1}
            for token, m in longest.items():
                if token in singles:
                    continue
                e = m - r.dry_allowed_length
                if r.dry_base > 1.000001:
                    cap = np.float32(88.7228391) / np.log(np.float32(r.dry_base))
                    e = min(e, int(cap))  # llama.cpp's cap, in float as it computes it
                x[token] -= r.dry_multiplier * r.dry_base**e
    if r.no_repeat_ngram_size > 0:
        n = r.no_repeat_ngram_size
        need = n - 2 if bug == "ngram_one_short" else n - 1
        for c in range(len(hist)):
            if c >= need and _suffix_match(hist, c, len(hist)) >= need:
                x[hist[c]] = -np.inf
    return x
