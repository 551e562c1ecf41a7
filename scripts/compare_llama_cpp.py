"""fastsample's llama.cpp-style stages against llama.cpp's own samplers, one stage at a time.

For many random rows (vocabularies of 20 to 2000 tokens, logit scales 0.3 to 8, plain,
peaked and quantized rows with ties, fixed seeds), after a few hand-picked ones (the inputs
of llama.cpp's ``tests/test-sampling.cpp``, DRY's exponent cap), each llama.cpp sampler is
applied alone, through llama-cpp-python's ctypes API (``llama_cpp``, no model needed), to a
candidate array built from the same logits as fastsample's stage alone:

========================  ==================================================================
llama.cpp sampler         fastsample, and what is compared
========================  ==================================================================
``typical(p, 0)``         ``typical_p=p``: the kept sets (``process_step > 0``), then the
                          probabilities over them
``top_n_sigma(n)``        ``top_n_sigma=n``: the finite logits after ``apply`` vs the kept set
``xtc(1.0, t, 0, seed)``  ``xtc_probability=1.0, xtc_threshold=t`` (``process_step`` returns
                          the removed distribution at probability 1): the kept sets
``temp_ext(t, d, e)``     ``temperature=t, dynatemp_range=d, dynatemp_exponent=e``: the
                          softmax of llama.cpp's output logits vs the processed distribution
``mirostat_v2(s, τ, η)``  ``mirostat_tau=τ, mirostat_eta=η``: several steps on one row;
                          before each, fastsample's ``mu`` is set to llama.cpp's; the kept
                          sets, then the new ``mu`` from ``TokenStats.update`` with llama.cpp's
                          selected token and fastsample's probability of it
``penalties(V, n, ...)``  ``penalty_last_n=n`` and the three penalties, the same history
                          (``accept`` there, the ``TokenStats`` history here): the logits
``dry(None, ...)``        ``dry_*`` on the same history, no sequence breakers: the logits
========================  ==================================================================

A row whose sets differ only where a threshold falls within float rounding of a token, or
at tied tokens, is counted as "boundary", not as a failure, and reported; the known
deliberate differences (:data:`KNOWN_DIFFERENCES`) are printed with the table. Any other
disagreement is a failure: the script prints each one (inputs, both results, the rule that
differs) and exits with status 1.

``pip install llama-cpp-python`` builds llama.cpp from the sdist (a C/C++ compiler and CMake
needed): ~9 minutes on 2 cores by default, ~5 with only the library (``CMAKE_ARGS=
"-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
-DLLAMA_BUILD_SERVER=OFF"``), ~3 at ``-O0`` as ``.ci/run`` builds it for the tests (values,
not timings: keep the optimized build for ``bench --samplers``). A CPU build is enough; no
model is loaded. Setup::

    python -m venv /tmp/llama-venv
    /tmp/llama-venv/bin/pip install llama-cpp-python==0.3.36 numpy torch

Run (fastsample from this checkout)::

    PYTHONPATH=src /tmp/llama-venv/bin/python scripts/compare_llama_cpp.py [--rows 2000]
        [--seed 0] [--stage typical --stage dry ...] [--show-boundary]

llama-cpp-python 0.3.36 is what the calls here were written against: the ctypes signatures
of ``llama_sampler_init_penalties`` (with ``n_vocab``), ``llama_sampler_init_dry`` (without
``n_ctx_train``) and the layout of mirostat v2's state (``mu`` read from its context) changed
between versions. ``tests/stages/test_llama_cpp_peers.py`` runs a few rows of each comparison
with pytest (skipped where ``llama_cpp`` does not import).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import llama_cpp as L
import numpy as np
import torch

import fastsample as fs
from fastsample.stages.step import staged_logits

STAGES = ("typical", "top_n_sigma", "xtc", "temp_ext", "mirostat_v2", "penalties", "dry")

# Tolerances. Probabilities are float32 on both sides; the thresholds are computed in float
# there (llama.cpp) and in float64 here, so a token this close to a threshold may go either way.
PROB_TOL = 1e-5  # |fastsample - renormalized reference| over the kept set
TEMP_TOL = 1e-4  # relative difference of the temperature used, when the probabilities differ:
# llama.cpp's entropy is a float sum, its temperature is off by up to ~1e-5 (relative)
MU_TOL = 1e-4  # mirostat's mu after a step
LOGIT_TOL = 1e-5  # |fastsample - llama.cpp| / max(1, |llama.cpp|) for penalties and DRY
CUM_TOL = 1e-5  # typical: cumulative mass this close to p is a boundary
SCORE_TOL = 1e-4  # typical: |-log p - H| this close to the cut's is a tie
SIGMA_TOL = 1e-5  # top-n-sigma: |x - (max - n sigma)| <= this * (|max| + n sigma + |mean| + 1)
XTC_TOL = 1e-5  # XTC: |p - t| <= this * max(t, 1e-6)
SURPRISE_TOL = 1e-5  # mirostat: |-log2 p - mu| in bits

KNOWN_DIFFERENCES = (
    "typical: llama.cpp keeps tokens until the cumulative mass is > p (strict), fastsample "
    "until it is >= p; they differ only when the mass hits p exactly (boundary)",
    "XTC: llama.cpp fires when its uniform is <= probability, fastsample when < probability "
    "(irrelevant at probability 1, the only value compared here)",
    "ties: llama.cpp's sorts are unstable, so of several tokens tied at a cut (typical's "
    "score, XTC's least probable token above the threshold, mirostat v2's one forced token "
    "when no token's surprise is <= mu) it keeps an unspecified subset; fastsample keeps every "
    "tied token (boundary)",
    "float32 vs float64: llama.cpp sums in float (softmax, entropy, top-n-sigma's mean and "
    "std, typical's running mass), fastsample in float64; a token within that rounding of a "
    "threshold may fall either way (boundary), and temp_ext's temperature differs by up to "
    "~1e-5 relative (fastsample's is the float64 one; within tolerance)",
    "typical: llama.cpp's entropy is NaN when a probability underflows to 0 in float32 (its "
    "result is then arbitrary); such rows are boundary rows, not failures",
)


# ---------------------------------------------------------------------------- results


@dataclass
class Outcome:
    """One compared row: ``status`` is "agree", "boundary" or "fail"; ``diff`` the largest
    difference of the compared numbers (NaN where the sets differ); ``inputs`` what the row
    was; ``detail`` both results and the rule that differs (boundary and fail rows)."""

    status: str
    diff: float
    inputs: str
    detail: str = ""


@dataclass
class Tally:
    rows: int = 0
    agree: int = 0
    boundary: int = 0
    fail: int = 0
    max_diff: float = 0.0
    quantity: str = ""
    seconds: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.rows += 1
        setattr(self, outcome.status, getattr(self, outcome.status) + 1)
        if outcome.status == "agree" and math.isfinite(outcome.diff):
            self.max_diff = max(self.max_diff, outcome.diff)
        self.outcomes.append(outcome)


# ---------------------------------------------------------------------------- llama.cpp


@dataclass
class LlamaResult:
    """The candidates after ``llama_sampler_apply``: ``data[0:size]`` read through the
    array's (possibly moved) data pointer."""

    ids: np.ndarray  # int64
    logits: np.ndarray  # float32
    probs: np.ndarray  # float32 (only meaningful where the sampler ran a softmax)
    selected: int


_backend_ready = False


def _backend() -> None:
    global _backend_ready
    if not _backend_ready:
        L.llama_backend_init()
        _backend_ready = True


@contextlib.contextmanager
def llama_sampler(init: Callable[..., int | None], *args) -> Iterator[int]:
    """A sampler from ``llama_sampler_init_*(*args)``, freed on exit."""
    _backend()
    sampler = init(*args)
    if not sampler:
        raise RuntimeError(f"{init.__name__}{args} returned NULL")
    try:
        yield sampler
    finally:
        L.llama_sampler_free(sampler)


def llama_apply(sampler: int, logits: np.ndarray, history: Sequence[int] = ()) -> LlamaResult:
    """``accept`` each token of ``history``, then ``apply`` to fresh candidates ``(i,
    logits[i], 0)``."""
    for token in history:
        L.llama_sampler_accept(sampler, int(token))
    n = len(logits)
    buf = (L.llama_token_data * n)()
    view = np.ctypeslib.as_array(buf)
    view["id"] = np.arange(n, dtype=np.int32)
    view["logit"] = logits
    view["p"] = 0.0
    arr = L.llama_token_data_array(
        data=ctypes.cast(buf, L.llama_token_data_p), size=n, selected=-1, sorted=False
    )
    L.llama_sampler_apply(sampler, ctypes.byref(arr))
    # XTC moves the data pointer past the removed tokens: read data[0:size] where it points.
    start = ctypes.addressof(arr.data.contents) - ctypes.addressof(buf)
    start //= ctypes.sizeof(L.llama_token_data)
    out = view[start : start + arr.size].copy()
    return LlamaResult(out["id"].astype(np.int64), out["logit"], out["p"], int(arr.selected))


class _Sampler(ctypes.Structure):
    _fields_ = [("iface", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _MirostatV2(ctypes.Structure):
    """The head of ``llama_sampler_mirostat_v2`` (vendor/llama.cpp/src/llama-sampler.cpp of
    llama-cpp-python 0.3.36): ``mu`` at byte offset 16."""

    _fields_ = [
        ("seed", ctypes.c_uint32),
        ("seed_cur", ctypes.c_uint32),
        ("tau", ctypes.c_float),
        ("eta", ctypes.c_float),
        ("mu", ctypes.c_float),
    ]


def mirostat_state(sampler: int) -> _MirostatV2:
    ctx = ctypes.cast(sampler, ctypes.POINTER(_Sampler)).contents.ctx
    return ctypes.cast(ctx, ctypes.POINTER(_MirostatV2)).contents


# ---------------------------------------------------------------------------- fastsample


def fs_probs(logits: np.ndarray, state: fs.TokenStats | None = None, **settings) -> np.ndarray:
    """fastsample's processed distribution (float64 copy of the float32 result) of one row
    with ``settings`` as :class:`fastsample.StepParams` keywords."""
    x = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))[None]
    params = fs.StepParams(1, x.shape[1], **settings)
    return fs.process_step(x, params, state=state)[0].double().numpy()


def fs_history_logits(logits: np.ndarray, history: Sequence[int], **settings) -> np.ndarray:
    """fastsample's logits after the history stages (``staged_logits``), ``history`` the
    context tokens oldest first."""
    x = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))[None]
    vocab = x.shape[1]
    stats = fs.TokenStats.from_prompts([list(history)], vocab, history=max(1, len(history)))
    params = fs.StepParams(1, vocab, **settings)
    return staged_logits(x, params, state=stats)[0].numpy()


# ---------------------------------------------------------------------------- helpers


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _kept_distribution(logits: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The float64 distribution renormalized over ``kept`` (bool)."""
    out = np.zeros(len(logits))
    out[kept] = softmax64(logits[kept])
    return out


def _ids(ids: np.ndarray, limit: int = 8) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}] ({len(ids)})"


def _token_lines(ids: np.ndarray, describe: Callable[[int], str], limit: int = 6) -> str:
    lines = [f"      token {int(i)}: {describe(int(i))}" for i in ids[:limit]]
    if len(ids) > limit:
        lines.append(f"      ... {len(ids) - limit} more")
    return "\n".join(lines)


def _compare_sets(
    logits: np.ndarray,
    llama_kept: np.ndarray,
    q: np.ndarray,
    inputs: str,
    boundary: Callable[[np.ndarray, np.ndarray], str | None],
    describe: Callable[[int], str],
    context: str,
) -> Outcome:
    """Kept sets (bool ``llama_kept`` vs ``q > 0``), then, where they agree, fastsample's
    probabilities against the float64 distribution renormalized over the set."""
    fs_kept = q > 0
    if np.array_equal(llama_kept, fs_kept):
        diff = float(np.abs(q - _kept_distribution(logits, llama_kept)).max())
        if diff <= PROB_TOL:
            return Outcome("agree", diff, inputs)
        return Outcome(
            "fail",
            diff,
            inputs,
            f"    same kept set ({int(fs_kept.sum())} tokens), probabilities differ "
            f"by {diff:.3g} from the renormalized softmax\n    {context}",
        )
    only_llama = np.flatnonzero(llama_kept & ~fs_kept)
    only_fs = np.flatnonzero(fs_kept & ~llama_kept)
    reason = boundary(only_llama, only_fs)
    detail = (
        f"    llama.cpp keeps {int(llama_kept.sum())}, fastsample {int(fs_kept.sum())}; "
        f"only llama.cpp: {_ids(only_llama)}, only fastsample: {_ids(only_fs)}\n"
        f"    {context}\n" + _token_lines(np.concatenate([only_llama, only_fs]), describe)
    )
    if reason:
        return Outcome("boundary", math.nan, inputs, f"    boundary: {reason}\n{detail}")
    return Outcome("fail", math.nan, inputs, detail)


# ---------------------------------------------------------------------------- typical


def compare_typical(logits: np.ndarray, p: float, inputs: str = "") -> Outcome:
    """llama.cpp ``typical(p, min_keep=0)`` vs fastsample ``typical_p=p``."""
    inputs = f"{inputs} p={p}"
    with llama_sampler(L.llama_sampler_init_typical, p, 0) as sampler:
        got = llama_apply(sampler, logits)
    llama_kept = np.zeros(len(logits), dtype=bool)
    llama_kept[got.ids] = True
    q = fs_probs(logits, typical_p=p)

    # float64 reference of the rule: order by |-log p_i - H|, keep until the mass reaches p.
    probs = softmax64(logits)
    h = float(-(probs * np.log(probs)).sum())
    score = np.abs(-np.log(probs) - h)
    order = np.argsort(score, kind="stable")
    cum = np.cumsum(probs[order])
    cut = min(int(np.searchsorted(cum, p)), len(cum) - 1)  # first rank with cum >= p
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    cut_score = float(score[order[cut]])
    underflow = bool((np.exp((logits - logits.max()).astype(np.float32)) == 0).any())

    def boundary(only_llama: np.ndarray, only_fs: np.ndarray) -> str | None:
        if underflow:
            return "underflow: a float32 probability is 0, so llama.cpp's entropy is NaN"
        diff = np.concatenate([only_llama, only_fs])
        before = float(cum[cut - 1]) if cut > 0 else 0.0
        near_mass = min(abs(float(cum[cut]) - p), abs(before - p)) <= CUM_TOL
        # Ranks the cut can move to when the mass is within rounding of p.
        if near_mass and all(cut - 1 <= rank[i] <= cut + 1 for i in diff):
            return (
                f"mass at p: the cumulative mass at the cut is within {CUM_TOL:g} of p "
                f"(cum before/at the cut {before:.9f}/{float(cum[cut]):.9f})"
            )
        if all(abs(score[i] - cut_score) <= SCORE_TOL for i in diff):
            tied = int((np.abs(score - cut_score) <= SCORE_TOL).sum())
            # Exact: the same logit (or mirrored about H exactly); near: an error dH of
            # llama.cpp's float entropy moves the scores of tokens on either side of H by
            # -dH and +dH, so their order can swap.
            exact = all(score[i] == cut_score for i in diff)
            return (
                f"{'tie' if exact else 'near tie'}: {tied} tokens have |-log p - H| within "
                f"{SCORE_TOL:g} of the cut's {cut_score:.6f}"
                + ("" if exact else f" (the differing tokens' ones: {score[diff].round(6)})")
            )
        return None

    def describe(i: int) -> str:
        return (
            f"logit {float(logits[i]):.6f} p {probs[i]:.6g} |-log p - H| {score[i]:.6f} "
            f"rank {int(rank[i])} cum to it {float(cum[rank[i]]):.9f}"
        )

    context = (
        f"H {h:.6f}; reference cut (cum >= p) at rank {cut}, score {cut_score:.6f}, "
        f"cum {float(cum[cut]):.9f}"
    )
    return _compare_sets(logits, llama_kept, q, inputs, boundary, describe, context)


# ---------------------------------------------------------------------------- top-n-sigma


def compare_top_n_sigma(logits: np.ndarray, n: float, inputs: str = "") -> Outcome:
    """llama.cpp ``top_n_sigma(n)`` (masks with -inf) vs fastsample ``top_n_sigma=n``."""
    inputs = f"{inputs} n={n}"
    with llama_sampler(L.llama_sampler_init_top_n_sigma, n) as sampler:
        got = llama_apply(sampler, logits)
    llama_kept = np.zeros(len(logits), dtype=bool)
    llama_kept[got.ids[np.isfinite(got.logits)]] = True
    q = fs_probs(logits, top_n_sigma=n)

    x = logits.astype(np.float64)
    mean, sigma = float(x.mean()), float(x.std())  # population std, as llama.cpp
    threshold = float(x.max()) - n * sigma
    tol = SIGMA_TOL * (abs(float(x.max())) + n * sigma + abs(mean) + 1)

    def boundary(only_llama: np.ndarray, only_fs: np.ndarray) -> str | None:
        diff = np.concatenate([only_llama, only_fs])
        if all(abs(x[i] - threshold) <= tol for i in diff):
            return f"rounding: logits within {tol:.3g} of max - n sigma = {threshold:.7f}"
        return None

    def describe(i: int) -> str:
        return f"logit {x[i]:.7f} - threshold = {x[i] - threshold:.3g}"

    context = f"mean {mean:.6f} sigma {sigma:.6f} threshold (float64) {threshold:.7f}"
    return _compare_sets(logits, llama_kept, q, inputs, boundary, describe, context)


# ---------------------------------------------------------------------------- XTC


def compare_xtc(logits: np.ndarray, t: float, seed: int = 1234, inputs: str = "") -> Outcome:
    """llama.cpp ``xtc(1.0, t, min_keep=0, seed)`` vs fastsample ``xtc_probability=1.0,
    xtc_threshold=t`` (the distribution with XTC's removal)."""
    inputs = f"{inputs} t={t}"
    with llama_sampler(L.llama_sampler_init_xtc, 1.0, t, 0, seed) as sampler:
        got = llama_apply(sampler, logits)
    llama_kept = np.zeros(len(logits), dtype=bool)
    llama_kept[got.ids] = True
    q = fs_probs(logits, xtc_probability=1.0, xtc_threshold=t)

    probs = softmax64(logits)
    top = probs >= t
    least = logits[top].min() if top.any() else math.inf
    tied_least = int((logits == least).sum())
    near = np.abs(probs - t) <= XTC_TOL * max(t, 1e-6)

    def boundary(only_llama: np.ndarray, only_fs: np.ndarray) -> str | None:
        if t > 0 and near.any():
            return (
                f"rounding: token(s) {_ids(np.flatnonzero(near))} have p within {XTC_TOL:g} "
                f"(relative) of t"
            )
        if tied_least > 1 and all(
            logits[i] == least for i in np.concatenate([only_llama, only_fs])
        ):
            return (
                f"tie: {tied_least} tokens share the least probability above t "
                f"(llama.cpp keeps one, fastsample all)"
            )
        return None

    def describe(i: int) -> str:
        return f"logit {float(logits[i]):.6f} p {probs[i]:.8g} (t {t})"

    context = (
        f"{int(top.sum())} tokens have p >= t (float64); the least of them has logit "
        f"{least:.6f}, {tied_least} tied"
    )
    return _compare_sets(logits, llama_kept, q, inputs, boundary, describe, context)


# ---------------------------------------------------------------------------- temp_ext


def _dynamic_temperature(logits: np.ndarray, t: float, delta: float, exponent: float) -> float:
    """llama.cpp's ``temp_ext`` temperature in float64."""
    if delta <= 0:
        return t
    probs = softmax64(logits)
    live = probs > 0
    h = float(-(probs[live] * np.log(probs[live])).sum())
    lo, hi = max(0.0, t - delta), t + delta
    return lo + (hi - lo) * (h / math.log(len(logits))) ** exponent


def _implied_temperature(x: np.ndarray, logq: np.ndarray) -> float:
    """``T`` from ``log q_a - log q_b = (x_a - x_b) / T`` on the most and least likely
    tokens with a usable probability (NaN when all are equal)."""
    usable = np.isfinite(logq) & (logq > -80)
    a = int(np.argmax(np.where(usable, logq, -np.inf)))
    b = int(np.argmin(np.where(usable, logq, np.inf)))
    if logq[a] - logq[b] <= 0:
        return math.nan
    return float((x[a] - x[b]) / (logq[a] - logq[b]))


def compare_temp_ext(
    logits: np.ndarray, t: float, delta: float, exponent: float, inputs: str = ""
) -> Outcome:
    """llama.cpp ``temp_ext(t, delta, exponent)`` (softmax of its output logits) vs fastsample
    ``temperature=t, dynatemp_range=delta, dynatemp_exponent=exponent``."""
    inputs = f"{inputs} t={t} delta={delta} exponent={exponent}"
    with llama_sampler(L.llama_sampler_init_temp_ext, t, delta, exponent) as sampler:
        got = llama_apply(sampler, logits)
    out = np.full(len(logits), -np.inf, dtype=np.float32)
    out[got.ids] = got.logits
    ref = softmax64(out)
    q = fs_probs(logits, temperature=t, dynatemp_range=delta, dynatemp_exponent=exponent)
    diff = float(np.abs(q - ref).max())
    x = logits.astype(np.float64)
    with np.errstate(divide="ignore"):
        t_llama = _implied_temperature(x, np.log(ref))
        t_fs = _implied_temperature(x, np.log(q))
    t_ref = _dynamic_temperature(logits, t, delta, exponent)
    rel = abs(t_fs - t_llama) / t_llama if t_llama > 0 else math.nan
    context = (
        f"    temperature: llama.cpp {t_llama:.8g}, fastsample {t_fs:.8g}, float64 "
        f"reference {t_ref:.8g} (relative llama/fastsample {rel:.3g}); "
        f"max |p diff| {diff:.3g}"
    )
    # No truncation here (but T == 0, greedy): the probabilities say it all; tiny ones
    # underflow to 0 in fastsample's float32.
    if diff <= PROB_TOL or rel <= TEMP_TOL:
        return Outcome("agree", diff, inputs, context)
    return Outcome("fail", diff, inputs, context)


# ---------------------------------------------------------------------------- mirostat v2


def compare_mirostat(
    logits: np.ndarray, tau: float, eta: float, seed: int, steps: int, inputs: str = ""
) -> list[Outcome]:
    """``steps`` llama.cpp ``mirostat_v2(seed, tau, eta)`` steps on one row; before each,
    fastsample's ``mu`` is llama.cpp's. Each step: the kept sets (llama.cpp's ``size``
    entries vs ``process_step > 0``), the probabilities over them (vs llama.cpp's renormalized
    ``p``) and the ``mu`` after ``TokenStats.update`` with llama.cpp's token."""
    vocab = len(logits)
    x = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))[None]
    params = fs.StepParams(1, vocab, mirostat_tau=tau, mirostat_eta=eta)
    stats = fs.TokenStats.from_prompts([[]], vocab)
    probs = softmax64(logits)
    surprise = -np.log2(probs)
    top = logits.max()
    outcomes = []
    with llama_sampler(L.llama_sampler_init_mirostat_v2, seed, tau, eta) as sampler:
        state = mirostat_state(sampler)
        if abs(state.mu - 2 * tau) > 1e-5 or abs(state.tau - tau) > 1e-6:
            raise RuntimeError(
                "mirostat v2's state layout is not the one of llama-cpp-python "
                "0.3.36 (mu at byte 16)"
            )
        for step in range(steps):
            mu = float(state.mu)
            got = llama_apply(sampler, logits)
            token, mu_after = int(got.ids[got.selected]), float(state.mu)
            stats.mirostat_mu = torch.tensor([mu], dtype=torch.float32)
            q = fs.process_step(x, params, state=stats)[0].double().numpy()
            where = f"{inputs} tau={tau} eta={eta} step={step} mu={mu:.7f}"
            llama_kept = np.zeros(vocab, dtype=bool)
            llama_kept[got.ids] = True
            fs_kept = q > 0
            p_selected = float(got.probs[got.selected])
            context = (
                f"    llama.cpp selected token {token} (p {p_selected:.7g}), "
                f"mu {mu:.7f} -> {mu_after:.7f}"
            )
            if not np.array_equal(llama_kept, fs_kept):
                only_llama = np.flatnonzero(llama_kept & ~fs_kept)
                only_fs = np.flatnonzero(fs_kept & ~llama_kept)
                diff_ids = np.concatenate([only_llama, only_fs])
                detail = (
                    f"    llama.cpp keeps {int(llama_kept.sum())}, fastsample "
                    f"{int(fs_kept.sum())}; only llama.cpp: {_ids(only_llama)}, only "
                    f"fastsample: {_ids(only_fs)}\n{context}\n"
                    + _token_lines(
                        diff_ids,
                        lambda i, mu=mu: (
                            f"logit {float(logits[i]):.6f} p {probs[i]:.8g} -log2 p "
                            f"{surprise[i]:.7f} (mu {mu:.7f})"
                        ),
                    )
                )
                reason = None
                if all(abs(surprise[i] - mu) <= SURPRISE_TOL for i in diff_ids):
                    reason = f"rounding: -log2 p within {SURPRISE_TOL:g} of mu"
                elif got.ids.size == 1 and all(logits[i] == top for i in diff_ids):
                    reason = (
                        f"tie: no token has -log2 p <= mu, llama.cpp keeps one of the "
                        f"{int((logits == top).sum())} tied most likely tokens, fastsample "
                        f"all"
                    )
                if reason:
                    detail = f"    boundary: {reason}\n{detail}"
                status = "boundary" if reason else "fail"
                outcomes.append(Outcome(status, math.nan, where, detail))
                continue
            # fastsample's probabilities against the float64 renormalized softmax (llama.cpp's
            # p is a float sum over up to 2000 tokens: off by up to ~2e-5 relative).
            diff_p = float(np.abs(q - _kept_distribution(logits, fs_kept)).max())
            diff_llama_p = float(np.abs(q[got.ids] - got.probs).max())
            stats.update(torch.tensor([[token]]), probs=torch.tensor([[q[token]]]), params=params)
            mu_fs = float(stats.mirostat_mu[0])
            diff_mu = abs(mu_fs - mu_after)
            detail = (
                f"{context}\n    fastsample: mu -> {mu_fs:.7f} (|diff| {diff_mu:.3g}); over the "
                f"{int(fs_kept.sum())} kept tokens max |p - float64 softmax| {diff_p:.3g}, "
                f"max |p - llama.cpp's p| {diff_llama_p:.3g}"
            )
            ok = diff_mu <= MU_TOL and diff_p <= PROB_TOL
            outcomes.append(Outcome("agree" if ok else "fail", diff_mu, where, detail))
    return outcomes


# ---------------------------------------------------------------------------- history stages


def _compare_logits(
    ours: np.ndarray, theirs: np.ndarray, x: np.ndarray, inputs: str, context: str
) -> Outcome:
    both_inf = np.isinf(ours) & np.isinf(theirs) & (np.sign(ours) == np.sign(theirs))
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = np.abs(ours.astype(np.float64) - theirs) / np.maximum(1.0, np.abs(theirs))
    scaled = np.where(both_inf, 0.0, scaled)
    diff = float(np.nan_to_num(scaled, nan=np.inf).max())
    if diff <= LOGIT_TOL:
        return Outcome("agree", diff, inputs)
    bad = np.flatnonzero(~(np.nan_to_num(scaled, nan=np.inf) <= LOGIT_TOL))
    detail = (
        f"    {len(bad)} logits differ (max |diff|/max(1,|llama|) {diff:.3g}); {context}\n"
        + _token_lines(
            bad,
            lambda i: (
                f"input {float(x[i]):.7g}: llama.cpp {float(theirs[i]):.9g}, fastsample "
                f"{float(ours[i]):.9g} (llama.cpp change {float(theirs[i]) - float(x[i]):.9g}, "
                f"fastsample {float(ours[i]) - float(x[i]):.9g})"
            ),
        )
    )
    return Outcome("fail", diff, inputs, detail)


def _in_id_order(got: LlamaResult, vocab: int) -> np.ndarray:
    out = np.full(vocab, np.nan, dtype=np.float32)
    out[got.ids] = got.logits
    return out


def compare_penalties(
    logits: np.ndarray,
    history: Sequence[int],
    last_n: int,
    repeat: float,
    freq: float,
    present: float,
    inputs: str = "",
) -> Outcome:
    """llama.cpp ``penalties(V, last_n, repeat, freq, present)`` after ``accept`` of
    ``history`` vs fastsample ``penalty_last_n=last_n`` with the history as its context."""
    vocab = len(logits)
    inputs = (
        f"{inputs} history={len(history)} last_n={last_n} repeat={repeat} freq={freq} "
        f"present={present}"
    )
    with llama_sampler(
        L.llama_sampler_init_penalties, vocab, last_n, repeat, freq, present
    ) as sampler:
        theirs = _in_id_order(llama_apply(sampler, logits, history), vocab)
    ours = fs_history_logits(
        logits,
        history,
        penalty_last_n=last_n,
        repetition_penalty=repeat,
        frequency_penalty=freq,
        presence_penalty=present,
    )
    window = list(history)[-last_n:] if last_n > 0 else []
    context = f"window (last {last_n}): {window[-24:]}"
    return _compare_logits(ours, theirs, logits, inputs, context)


def dry_exponent_caps(base: float) -> tuple[int, int]:
    """DRY's cap on its exponent: as llama.cpp computes it (``FLOAT_MAX_LOG / std::log(base)``,
    all float, truncated) and in float64 (``floor(88.7228391 / ln base)``); 0 = no cap."""
    if not np.float32(base) > np.float32(1.000001):
        return 0, 0
    in_float = int(np.float32(88.7228391) / np.log(np.float32(base)))
    return in_float, math.floor(88.7228391 / math.log(float(np.float32(base))))


def compare_dry(
    logits: np.ndarray,
    history: Sequence[int],
    multiplier: float,
    base: float,
    allowed: int,
    last_n: int,
    inputs: str = "",
) -> Outcome:
    """llama.cpp ``dry(None, multiplier, base, allowed, last_n, None, 0)`` after ``accept`` of
    ``history`` vs fastsample's ``dry_*`` settings on the same history (no breakers)."""
    vocab = len(logits)
    inputs = (
        f"{inputs} history={len(history)} multiplier={multiplier} base={base} "
        f"allowed={allowed} last_n={last_n}"
    )
    with llama_sampler(
        L.llama_sampler_init_dry, None, multiplier, base, allowed, last_n, None, 0
    ) as sampler:
        theirs = _in_id_order(llama_apply(sampler, logits, history), vocab)
    ours = fs_history_logits(
        logits,
        history,
        dry_multiplier=multiplier,
        dry_base=base,
        dry_allowed_length=allowed,
        dry_penalty_last_n=last_n,
    )
    window = list(history)[-last_n:]
    cap_float, cap_double = dry_exponent_caps(base)
    context = (
        f"exponent cap (base > 1.000001): llama.cpp's int(88.7228391f / logf(base)) in float "
        f"= {cap_float}, floor(88.7228391 / ln base) in float64 = {cap_double}; "
        f"window (last {last_n}, oldest first, last 40 shown): {window[-40:]}"
    )
    return _compare_logits(ours, theirs, logits, inputs, context)


# ---------------------------------------------------------------------------- random rows

SCALES = (0.3, 1.0, 2.0, 4.0, 8.0)
KINDS = ("normal", "normal", "normal", "peaked", "quantized")


def random_logits(rng: np.random.Generator, small: bool = False) -> tuple[np.ndarray, str]:
    """One row: ``V`` log-uniform in [20, 2000] (or [20, 200] when ``small``), a scale of
    :data:`SCALES`, and a kind: normal, peaked (a few tokens raised by 3 scales) or quantized
    (rounded to halves: many ties)."""
    top = 200 if small else 2000
    vocab = round(math.exp(rng.uniform(math.log(20), math.log(top))))
    scale = float(rng.choice(SCALES))
    kind = str(rng.choice(KINDS))
    x = rng.standard_normal(vocab) * scale
    if kind == "peaked":
        x[rng.integers(0, vocab, size=int(rng.integers(1, 4)))] += 3 * scale
    elif kind == "quantized":
        x = np.round(x * 2) / 2
    return x.astype(np.float32), f"V={vocab} scale={scale} {kind}"


def random_history(rng: np.random.Generator, vocab: int, longest: int = 160) -> list[int]:
    """Context tokens with repeats: a few tokens of a small alphabet, or a repeated pattern
    with occasional changes, after a random prefix."""
    length = int(rng.integers(0, longest + 1))
    alphabet = rng.choice(vocab, size=min(vocab, int(rng.choice([2, 3, 5, 12, 40]))), replace=False)
    if rng.random() < 0.5:
        return [int(t) for t in rng.choice(alphabet, size=length)]
    pattern = rng.choice(alphabet, size=int(rng.integers(2, 10)))
    prefix = rng.choice(alphabet, size=int(rng.integers(0, 8)))
    reps = -(-max(length - len(prefix), 0) // len(pattern))
    body = np.tile(pattern, max(reps, 1))[: max(length - len(prefix), 0)]
    changes = rng.random(len(body)) < 0.08
    body = np.where(changes, rng.choice(alphabet, size=len(body)), body)
    return [int(t) for t in np.concatenate([prefix, body])]


def rows_for(stage: str, count: int, seed: int = 0, small: bool = False) -> Iterator[Outcome]:
    """``count`` random rows of ``stage`` (seeded by ``(seed, stage, row)``): their outcomes
    (mirostat: one per step of each row)."""
    stage_index = STAGES.index(stage)
    for row in range(count):
        rng = np.random.default_rng([seed, stage_index, row])
        x, desc = random_logits(rng, small)
        tag = f"[{stage} row {row}] {desc}"
        if stage == "typical":
            yield compare_typical(x, float(rng.choice([0.2, 0.5, 0.8, 0.9, 0.95, 0.99])), tag)
        elif stage == "top_n_sigma":
            yield compare_top_n_sigma(x, float(rng.choice([0.5, 1.0, 1.5, 2.0, 3.0])), tag)
        elif stage == "xtc":
            t = float(rng.choice([0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5]))
            yield compare_xtc(x, t, int(rng.integers(0, 2**31)), tag)
        elif stage == "temp_ext":
            yield compare_temp_ext(
                x,
                float(rng.choice([0.3, 0.7, 1.0, 1.5])),
                float(rng.choice([0.0, 0.2, 0.5, 1.0, 2.0])),
                float(rng.choice([0.5, 1.0, 2.0])),
                tag,
            )
        elif stage == "mirostat_v2":
            yield from compare_mirostat(
                x,
                float(rng.choice([1.0, 3.0, 5.0, 8.0])),
                float(rng.choice([0.05, 0.1, 0.5, 1.0])),
                int(rng.integers(0, 2**31)),
                8,
                tag,
            )
        elif stage == "penalties":
            history = random_history(rng, len(x))
            yield compare_penalties(
                x,
                history,
                int(rng.choice([1, 3, 8, 32, 64, 128])),
                float(rng.choice([1.0, 1.1, 1.5, 0.8])),
                float(rng.choice([0.0, 0.1, 0.5, -0.2])),
                float(rng.choice([0.0, 0.25, 1.0, -0.5])),
                tag,
            )
        elif stage == "dry":
            history = random_history(rng, len(x), longest=300)
            yield compare_dry(
                x,
                history,
                float(rng.choice([0.25, 0.8, 1.0, 2.0])),
                float(rng.choice([1.0, 1.1, 1.75, 2.0, 3.0])),
                int(rng.choice([0, 1, 2, 3, 5])),
                int(rng.choice([1, 2, 5, 16, 64, 256])),
                tag,
            )
        else:
            raise ValueError(f"unknown stage {stage!r}")


def _log(probs: Sequence[float]) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def _repeat(pattern: Sequence[int], length: int) -> list[int]:
    return [int(pattern[i % len(pattern)]) for i in range(length)]


def fixed_rows(stage: str) -> Iterator[Outcome]:
    """Hand-picked rows: the cases of llama.cpp's ``tests/test-sampling.cpp`` (as inputs; both
    sides are compared, not the test's numbers), DRY's exponent cap with long repeats
    (``floor(88.7228391 / ln base)``: 127 vs 128 for base 2, 63 vs 64 for base 4, 31 vs 32 for
    base 16 in float64 vs float), and the penalty window's edges."""
    quarter, ramp = _log([0.25] * 4), _log([0.1, 0.2, 0.3, 0.4])
    rng = np.random.default_rng(12345)
    noise = (rng.standard_normal(50) * 2).astype(np.float32)
    tag = f"[{stage} fixed]"
    if stage == "typical":
        yield compare_typical(_log([0.97, 0.01, 0.01, 0.01]), 0.5, f"{tag} V=4 test-sampling")
        yield compare_typical(_log([0.4, 0.2, 0.2, 0.2]), 0.5, f"{tag} V=4 test-sampling")
        yield compare_typical(quarter, 0.5, f"{tag} V=4 uniform (mass hits p, all tied)")
    elif stage == "top_n_sigma":
        for n in (1.0, 3.0):
            yield compare_top_n_sigma(ramp, n, f"{tag} V=4 test-sampling")
    elif stage == "xtc":
        for t in (0.09, 0.19, 0.29, 0.39):
            yield compare_xtc(ramp, t, 42, f"{tag} V=4 test-sampling")
    elif stage == "temp_ext":
        for t, delta in ((1.0, 0.0), (0.0, 0.0), (0.0, 0.5), (0.5, 0.5)):
            yield compare_temp_ext(ramp, t, delta, 1.0, f"{tag} V=4 test-sampling")
    elif stage == "mirostat_v2":
        yield from compare_mirostat(noise, 3.0, 0.5, 7, 8, f"{tag} V=50 scale=2")
    elif stage == "penalties":
        for history, last_n in (
            ([], 8),
            ([7] * 100, 64),
            ([1, 2, 3], 64),
            (_repeat([4, 5, 6], 40), 7),
        ):
            yield compare_penalties(noise, history, last_n, 1.3, 0.4, 0.6, f"{tag} V=50 scale=2")
    elif stage == "dry":
        for history, mult, allowed, last_n in (
            ([0, 1], 1.0, 2, 4),
            ([0, 1, 2, 0, 1], 1.0, 2, 5),
            ([0, 1, 2, 0, 1], 2.0, 2, 5),
            ([0, 1, 2, 3, 4, 0, 1], 1.0, 4, 7),
        ):
            yield compare_dry(
                np.zeros(5, dtype=np.float32),
                history,
                mult,
                1.1,
                allowed,
                last_n,
                f"{tag} V=5 test-sampling",
            )
        for base in (1.75, 2.0, 3.0, 4.0, 16.0):
            for mult in (0.25, 1.0):
                yield compare_dry(
                    noise,
                    _repeat([5, 6], 200),
                    mult,
                    base,
                    2,
                    256,
                    f"{tag} V=50 scale=2 exponent cap",
                )
    else:
        raise ValueError(f"unknown stage {stage!r}")


QUANTITY = {
    "typical": "p over the kept set",
    "top_n_sigma": "p over the kept set",
    "xtc": "p over the kept set",
    "temp_ext": "p",
    "mirostat_v2": "mu after the step",
    "penalties": "logit (/max(1,|x|))",
    "dry": "logit (/max(1,|x|))",
}


def run(stages: Sequence[str], count: int, seed: int) -> dict[str, Tally]:
    """The fixed rows and ``count`` random rows of each stage (mirostat: ``count // 8``
    rows of 8 steps)."""
    tallies = {}
    for stage in stages:
        tally = Tally(quantity=QUANTITY[stage])
        start = time.perf_counter()
        for outcome in fixed_rows(stage):
            tally.add(outcome)
        for outcome in rows_for(
            stage, max(1, count // 8) if stage == "mirostat_v2" else count, seed
        ):
            tally.add(outcome)
        tally.seconds = time.perf_counter() - start
        tallies[stage] = tally
    return tallies


def _reason(outcome: Outcome) -> str:
    """A boundary row's reason: the first line of its detail, without "boundary: "."""
    return outcome.detail.splitlines()[0].strip().removeprefix("boundary: ")


def report(tallies: dict[str, Tally], show_boundary: bool) -> bool:
    """Print the table, the known differences, the boundary rows (by stage and reason; all
    details with ``show_boundary``) and every disagreement; True when none failed."""
    header = (
        f"{'stage':<12} {'rows':>5} {'agree':>6} {'boundary':>9} {'fail':>5} "
        f"{'max |diff| (agreeing rows)':>27}  {'of':<22} {'seconds':>7}"
    )
    print(header)
    print("-" * len(header))
    for stage, t in tallies.items():
        print(
            f"{stage:<12} {t.rows:>5} {t.agree:>6} {t.boundary:>9} {t.fail:>5} "
            f"{t.max_diff:>27.3g}  {t.quantity:<22} {t.seconds:>7.1f}"
        )
    print("\nKnown deliberate differences (boundary rows, not failures):")
    for line in KNOWN_DIFFERENCES:
        print(f"  * {line}")
    boundary = [o for t in tallies.values() for o in t.outcomes if o.status == "boundary"]
    if boundary:
        print(f"\n{len(boundary)} boundary rows, by stage and reason:")
        groups: dict[tuple[str, str], list[Outcome]] = {}
        for o in boundary:
            stage = o.inputs.split()[0].lstrip("[")
            groups.setdefault((stage, _reason(o).split(":")[0]), []).append(o)
        for (stage, why), rows in groups.items():
            quantized = sum("quantized" in o.inputs for o in rows)
            print(f"  {stage} / {why}: {len(rows)} rows ({quantized} of them quantized rows), e.g.")
            for o in rows[: len(rows) if show_boundary else 2]:
                print(f"    {o.inputs.strip()}: {_reason(o)}")
                if show_boundary:
                    print("\n".join("  " + line for line in o.detail.splitlines()[1:]))
    failed = [o for t in tallies.values() for o in t.outcomes if o.status == "fail"]
    if failed:
        print(f"\n{len(failed)} disagreements:")
        for o in failed:
            print(f"  {o.inputs.strip()}\n{o.detail}")
    return not failed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows",
        type=int,
        default=2000,
        help="random rows per stage (mirostat: rows/8 rows of 8 steps)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stage",
        action="append",
        choices=STAGES,
        help="compare only these stages (repeatable; default: all)",
    )
    parser.add_argument(
        "--show-boundary", action="store_true", help="print the details of the boundary rows too"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    print(
        f"llama-cpp-python {L.__version__}, fastsample {fs.__version__}, "
        f"torch {torch.__version__}, numpy {np.__version__}\n"
    )
    tallies = run(args.stage or STAGES, args.rows, args.seed)
    ok = report(tallies, args.show_boundary)
    print(
        f"\n{'all stages agree' if ok else 'DISAGREEMENTS FOUND'} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
