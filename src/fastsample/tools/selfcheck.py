"""``python -m fastsample selfcheck``: does fastsample behave on *this* device?

A short battery (seconds on a CPU, less on a GPU) that a user can run wherever fastsample
is installed, with no test dependencies:

* exactness: chi-square of single draws and of ordered pairs (Plackett-Luce) against exact
  float64 probabilities, for every method, unseeded and seeded, at a false-alarm rate of
  1e-6 per check; each check is also run on a 2%-biased law, which it must reject (so a
  pass means the check had the power to fail);
* sampling controls: ``fastsample.sample`` with per-row tensor temperature, top-k, top-p
  and min-p against a reference written here with a full sort (same power check), and the
  small Python ``top_k`` shortcut on a row whose ties at the cut fill every block, and
  ``fastsample.process`` on 40,000-entry rows (the code real vocabularies take) against the
  same reference, with a power check (top-p taken before top-k must be told apart);
* zero weights are never drawn; bad rows (NaN, inf, negative, all-zero) are flagged and
  leave the other rows bitwise unchanged;
* batch invariance with per-request seeds;
* on CUDA: capture in a CUDA graph under ``torch.cuda.set_sync_debug_mode("error")`` and
  replay with the step advanced inside the graph.

Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Callable

import torch
from torch import Tensor

from ..controls import process
from ..ops.seeds import advance_step
from ..sampling import fast_sample, sample, sample_from_probs
from .bench.harness import pick_device

ALPHA = 1e-6
DESCRIPTION = (__doc__ or "").strip()


def chi2_threshold(df: int, alpha: float = ALPHA) -> float:
    """Upper ``alpha`` quantile of chi-square(df), Wilson-Hilferty (no scipy needed)."""
    z = _normal_upper_quantile(alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _normal_upper_quantile(alpha: float) -> float:
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(mid / math.sqrt(2)) > alpha else (lo, mid)
    return lo


def chi_square(counts: Tensor, probs: Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` (cells with p == 0 excluded)."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat, int(keep.sum()) - 1


def law_holds(counts: Tensor, probs: Tensor) -> bool:
    stat, df = chi_square(counts, probs)
    return stat <= chi2_threshold(df) and int(counts[probs.cpu() == 0].sum()) == 0


def _biased(probs: Tensor) -> Tensor:
    """The same law with 2% of the mass moved onto the least likely positive token."""
    p = probs.double() / probs.double().sum()
    out = p * 0.98
    out[int(torch.where(p > 0, p, 2.0).argmin())] += 0.02
    return out


Sampler = Callable[[Tensor, int, int], Tensor]  # (batch, num_samples, call index) -> ids


def _samplers() -> dict[str, Sampler]:
    def method(name: str, seeded: bool) -> Sampler:
        def draw(batch: Tensor, n: int, call: int) -> Tensor:
            if not seeded:
                return sample_from_probs(batch, n, method=name).token_ids
            rows = torch.arange(batch.shape[0], device=batch.device)
            return sample_from_probs(
                batch, n, seed=rows * 7919 + call, step=call, method=name
            ).token_ids

        return draw

    samplers = {
        f"{name}{'+seed' if seeded else ''}": method(name, seeded)
        for name, seeded in itertools.product(("inverse_cdf", "race"), (False, True))
    }
    samplers["fast_sample"] = lambda batch, n, call: fast_sample(batch, n)[1]
    return samplers


ROW = [0.05, 0.4, 0.0, 0.2, 0.15, 0.2, 1e-3, 0.0]


def check_single_draws(draw: Sampler, device: torch.device) -> str | None:
    row = torch.tensor(ROW, device=device)
    batch = row.expand(100_000, -1)
    counts = torch.zeros(len(ROW), dtype=torch.float64, device=device)
    for call in range(4):
        counts += torch.bincount(draw(batch, 1, call)[:, 0], minlength=len(ROW))
    if not law_holds(counts, row):
        return f"single draws: chi-square {chi_square(counts, row)[0]:.1f} too large"
    if law_holds(counts, _biased(row)):
        return "single draws: a 2% bias was not detected (check has no power)"
    return None


def check_pairs(draw: Sampler, device: torch.device) -> str | None:
    row = torch.tensor(ROW, device=device)
    vocab = len(ROW)
    ids = torch.cat([draw(row.expand(100_000, -1), 2, call) for call in range(3)])
    if bool((ids[:, 0] == ids[:, 1]).any()):
        return "pairs: a token was drawn twice"
    counts = torch.bincount(ids[:, 0] * vocab + ids[:, 1], minlength=vocab * vocab)
    exact = _pair_law(row)
    if not law_holds(counts, exact):
        return f"pairs: chi-square {chi_square(counts, exact)[0]:.1f} too large"
    if law_holds(counts, _pair_law(_biased(row))):
        return "pairs: a 2% bias was not detected (check has no power)"
    return None


def _pair_law(weights: Tensor) -> Tensor:
    """Exact probability of each ordered pair drawn without replacement, flattened."""
    p = weights.double().cpu() / weights.double().sum().cpu()
    vocab = p.numel()
    exact = torch.zeros(vocab * vocab, dtype=torch.float64)
    for a, b in itertools.permutations(range(vocab), 2):
        exact[a * vocab + b] = p[a] * p[b] / (1 - p[a]) if p[a] < 1 else 0.0
    return exact


CONTROL_LOGITS = [2.0, 1.0, 1.0, 0.5, -1.0, 3.0, 0.0, float("-inf"), 2.5, -0.5]
CONTROL_SETTINGS = [  # (temperature, top_k, top_p, min_p): each cut lands between values
    (0.8, 5, 1.0, 0.0),
    (1.0, 0, 0.93, 0.0),
    (1.5, 6, 0.7, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.7, 8, 0.9, 0.05),
]


def controlled_law(
    logits: Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    top_p_on_all: bool = False,
):
    """The processed distribution, float64, written independently with a full sort.
    ``top_p_on_all`` is the classic bug kept for power checks: the top-p mass taken over
    every token instead of the top-k survivors."""
    x = logits.double().cpu()
    w = torch.exp((x - x.max()) / temperature)
    keep = torch.ones_like(w, dtype=torch.bool)
    if 0 < top_k < w.numel():
        keep &= w >= torch.sort(w, descending=True).values[top_k - 1]
    if top_p < 1:
        keep &= w >= _top_p_cut(w if top_p_on_all else torch.where(keep, w, 0.0), top_p)
    keep &= w >= min_p * w.max()
    out = torch.where(keep, w, 0.0)
    return out / out.sum()


def _top_p_cut(weights: Tensor, top_p: float) -> Tensor:
    ranked = torch.sort(weights, descending=True).values
    reached = ranked.cumsum(0) >= top_p * ranked.sum()
    return ranked[int(reached.to(torch.uint8).argmax())]


def check_controls(device: torch.device) -> str | None:
    """fastsample.sample with mixed per-row tensor controls against a sorted reference."""
    logits = torch.tensor(CONTROL_LOGITS, device=device)
    draws = 60_000
    for temperature, top_k, top_p, min_p in CONTROL_SETTINGS:

        def tensor(value: float, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.full((draws,), value, dtype=dtype, device=device)

        out = sample(
            logits.expand(draws, -1),
            temperature=tensor(temperature),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor(top_p),
            min_p=tensor(min_p),
            seed=torch.arange(draws, device=device),
        )
        counts = torch.bincount(out.token_ids[:, 0], minlength=len(CONTROL_LOGITS))
        law = controlled_law(logits, temperature, top_k, top_p, min_p)
        setting = f"T={temperature} k={top_k} p={top_p} min_p={min_p}"
        if not law_holds(counts, law):
            return f"controls {setting}: chi-square {chi_square(counts, law)[0]:.1f} too large"
        if law_holds(counts, _biased(law)):
            return f"controls {setting}: a 2% bias was not detected (check has no power)"
    return None


# The small-top_k shortcut reads only the k best blocks of 256 plus a counting pass: a row
# whose k-th largest weight is shared by entries in every block tests that pass. Row: one
# logit of 2.0 in block 0, 1023 zeros; k=2 makes every zero a tie at the cut. With top_p=0.01
# the mass of all 1023 ties decides whether the top token alone reaches the target (it must
# not: 0.01 * (1 + 1023 e^-2) > 1).
SHORTCUT_VOCAB = 1024
SHORTCUT_SETTINGS = [(0.8, 2, 1.0, 0.0), (1.0, 2, 0.01, 0.0)]


def check_small_top_k(device: torch.device) -> str | None:
    """fastsample.sample with a Python top_k (the shortcut) against the sorted reference."""
    logits = torch.zeros(SHORTCUT_VOCAB, device=device)
    logits[5] = 2.0
    draws, chunk = 60_000, 7_500
    for temperature, top_k, top_p, min_p in SHORTCUT_SETTINGS:
        counts = torch.zeros(SHORTCUT_VOCAB, dtype=torch.int64, device=device)
        for start in range(0, draws, chunk):
            out = sample(
                logits.expand(chunk, -1),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                seed=torch.arange(start, start + chunk, device=device),
            )
            counts += torch.bincount(out.token_ids[:, 0], minlength=SHORTCUT_VOCAB)
        law = controlled_law(logits, temperature, top_k, top_p, min_p)
        setting = f"T={temperature} k={top_k} p={top_p}"
        if not law_holds(counts, law):
            return (
                f"top-k shortcut {setting}: chi-square {chi_square(counts, law)[0]:.1f} too large"
            )
        if law_holds(counts, _biased(law)):
            return f"top-k shortcut {setting}: a 2% bias was not detected (check has no power)"
    return None


# Real vocabularies (>= 32,768 entries) take other code than the short rows above: the radix
# selection's 16-bit digits, row pieces. Three 40,000-entry rows (continuous, integer ties,
# half masked) with tensor controls; process() must give the sorted reference's distribution.
LONG_VOCAB = 40_000
LONG_SETTINGS = [(0.7, 50, 0.9), (1.0, 0, 0.6), (1.3, 2000, 0.95)]  # T, top_k, ~top_p


def _long_rows() -> Tensor:
    gen = torch.Generator().manual_seed(20261201)
    continuous = torch.randn(LONG_VOCAB, generator=gen, dtype=torch.float64) * 3
    ties = torch.randint(-3, 4, (LONG_VOCAB,), generator=gen).double()
    masked = torch.randn(LONG_VOCAB, generator=gen, dtype=torch.float64) * 2
    masked[torch.rand(LONG_VOCAB, generator=gen) < 0.5] = -math.inf
    return torch.stack([continuous, ties, masked]).float()


def _robust_top_p(weights: Tensor, wanted: float) -> float:
    """The midpoint of the two cumulative masses (of distinct values) around ``wanted`` whose
    gap is widest nearby, so float32 rounding (~1e-7) cannot move the cut."""
    ranked = torch.sort(weights[weights > 0], descending=True).values
    last = torch.cat((ranked[1:] != ranked[:-1], torch.tensor([True])))
    masses = (ranked.cumsum(0) / ranked.sum())[last]
    gaps = masses[1:] - masses[:-1]
    near = (masses[:-1] - wanted).abs() < 0.05
    j = int(torch.where(near, gaps, -1.0).argmax())
    return float((masses[j] + masses[j + 1]) / 2)


def check_long_rows(device: torch.device) -> str | None:
    """fastsample.process with tensor controls on 40,000-entry rows against the sorted
    reference: same support, probabilities within 1e-6."""
    rows = _long_rows()
    settings = []
    for row, (temperature, top_k, wanted) in zip(rows, LONG_SETTINGS, strict=True):
        survivors = controlled_law(row, temperature, top_k, 1.0, 0.0)
        settings.append((temperature, top_k, _robust_top_p(survivors, wanted)))
    t, k, p = (list(column) for column in zip(*settings, strict=True))
    got = (
        process(
            rows.to(device),
            temperature=torch.tensor(t, device=device),
            top_k=torch.tensor(k, device=device),
            top_p=torch.tensor(p, device=device),
        )
        .double()
        .cpu()
    )
    for r, (temperature, top_k, top_p) in enumerate(settings):
        want = controlled_law(rows[r], temperature, top_k, top_p, 0.0)
        setting = f"long rows, row {r}: T={temperature} k={top_k} p={top_p:.6f}"
        kept, wanted = int((got[r] > 0).sum()), int((want > 0).sum())
        if not torch.equal(got[r] > 0, want > 0):
            return f"{setting}: kept {kept} tokens, the reference {wanted}"
        error = float((got[r] - want).abs().max())
        if error > 1e-6:
            return f"{setting}: probabilities differ by {error:.2e}"
    # Power: the classic bug (top-p mass taken over all tokens, not the top-k survivors).
    temperature, top_k, top_p = settings[0]
    wrong = controlled_law(rows[0], temperature, top_k, top_p, 0.0, top_p_on_all=True)
    if torch.equal(got[0] > 0, wrong > 0):
        return "long rows: top-p over all tokens gives the same support (check has no power)"
    return None


def check_bad_rows(device: torch.device) -> str | None:
    gen = torch.Generator().manual_seed(0)
    clean = torch.softmax(torch.randn(5, 3000, generator=gen), -1).to(device)
    dirty = clean.clone()
    dirty[1, 7] = float("nan")
    dirty[2, 9] = float("inf")
    dirty[3, 11] = -1.0
    dirty[4] = 0
    seeds = torch.arange(5, device=device)
    for method in ("inverse_cdf", "race"):
        a = sample_from_probs(clean, 2, seed=seeds, step=3, method=method)
        b = sample_from_probs(dirty, 2, seed=seeds, step=3, method=method)
        if b.valid.tolist() != [True, False, False, False, False]:
            return f"bad rows ({method}): valid flags {b.valid.tolist()}"
        if not torch.equal(a.token_ids[0], b.token_ids[0]):
            return f"bad rows ({method}): a good row changed"
        if b.token_ids[1:].tolist() != [[0, 1]] * 4:
            return f"bad rows ({method}): ids {b.token_ids[1:].tolist()}"
    return None


def check_batch_invariance(device: torch.device) -> str | None:
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(65, 5000, generator=gen) * 3, -1).to(device)
    seeds = torch.randint(0, 2**62, (65,), generator=gen).to(device)
    for method in ("inverse_cdf", "race"):
        full = sample_from_probs(probs, 2, seed=seeds, step=9, method=method).token_ids
        order = torch.randperm(65, generator=gen).to(device)
        shuffled = sample_from_probs(
            probs[order], 2, seed=seeds[order], step=9, method=method
        ).token_ids
        alone = sample_from_probs(probs[7:8], 2, seed=seeds[7:8], step=9, method=method)
        if not torch.equal(shuffled, full[order]) or not torch.equal(alone.token_ids, full[7:8]):
            return f"batch invariance ({method}): a request's tokens depend on its batch"
    return None


def check_zero_weights(draw: Sampler, device: torch.device) -> str | None:
    row = torch.zeros(600, device=device)
    row[1::3] = 1e-30
    row[2::7] = 1.0
    for call in range(3):
        ids = draw(row.expand(20_000, -1), 2, call)
        if bool((row[ids] == 0).any()):
            return "zero weights: a zero-weight token was drawn"
    return None


def check_cuda_graph(device: torch.device) -> str | None:
    probs = torch.softmax(torch.randn(32, 32000, device=device), -1)
    seeds = torch.arange(32, device=device)
    step = torch.zeros(32, dtype=torch.int64, device=device)
    for method in ("inverse_cdf", "race"):

        def decode_step(method: str = method) -> Tensor:
            out = sample_from_probs(probs, 2, seed=seeds, step=step, method=method)
            advance_step(step)
            return out.token_ids

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = decode_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        step.zero_()
        for k in range(3):
            graph.replay()
            want = sample_from_probs(probs, 2, seed=seeds, step=k, method=method).token_ids
            if not torch.equal(out, want):
                return f"CUDA graph ({method}): replay {k} differs from eager step {k}"
        step.zero_()
    return None


def run_checks(device: torch.device, report: Callable[[str], None]) -> int:
    checks: list[tuple[str, Callable[[], str | None]]] = []
    for name, draw in _samplers().items():
        checks.append((f"single-draw law, {name}", lambda d=draw: check_single_draws(d, device)))
        checks.append((f"pair law, {name}", lambda d=draw: check_pairs(d, device)))
        checks.append((f"zero weights, {name}", lambda d=draw: check_zero_weights(d, device)))
    checks.append(("sampling controls (T, top-k, top-p, min-p)", lambda: check_controls(device)))
    checks.append(("small top-k shortcut, ties", lambda: check_small_top_k(device)))
    checks.append(("controls on 40,000-entry rows", lambda: check_long_rows(device)))
    checks.append(("bad rows", lambda: check_bad_rows(device)))
    checks.append(("batch invariance", lambda: check_batch_invariance(device)))
    if device.type == "cuda":
        checks.append(("CUDA graph, sync-free", lambda: check_cuda_graph(device)))
    failures = 0
    for label, check in checks:
        start = time.perf_counter()
        try:
            problem = check()
        except Exception as error:  # a crash is a failure to report, not to hide
            problem = f"raised {type(error).__name__}: {error}"
        seconds = time.perf_counter() - start
        report(f"{'FAIL' if problem else 'ok  '} {label} ({seconds:.1f} s)")
        if problem:
            failures += 1
            report(f"     {problem}")
    report(f"{len(checks) - failures} passed, {failures} failed")
    return 1 if failures else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)"
    )
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed for the run")


def run(args: argparse.Namespace) -> int:
    # An unavailable cuda is an error up front, as in bench, not every check failing.
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    print(f"fastsample selfcheck on {device} (torch {torch.__version__})", flush=True)
    return run_checks(device, lambda line: print(line, flush=True))
