"""The law of the new stages (issue 37), one configuration each and all together, at 2%.

Each configuration is one row whose stage changes the law a lot. ``process_step`` must give
tests/chain_reference.py's float64 law (to float32 rounding), and ``sample_step`` draws it
many times (a batch of copies, a seeded generator per call): the counts pass the law test of
tests/stattests.py at ``ALPHA = 1e-6``. Sizes come from ``draws_needed``: each test detects a
2% relative bias on 10% of the mass with probability 0.99 (registered in ``law_cases()``).

Negative controls, at each test's own size: the counts are rejected against the law with the
stage dropped, against each planted mistake of chain_reference.BUGS that changes the
configuration's law (the stage misplaced or misdefined), and against the law shifted by one
index.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
from chain_reference import BUGS, ChainRow, chain_probs, history_logits
from stattests import LawCase, assert_law, draws_needed, law_rejected, shifted_law

CLAIM = 0.02
CHUNK = 200_000


def _logits(vocab: int, seed: int, scale: float = 1.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=vocab) * scale


_HISTORY = [3, 7, 1, 2, 9, 4, 1, 2, 9, 5, 11, 1, 2, 30, 6, 5, 2, 13, 3, 7, 1, 2]

CONFIGS: dict[str, tuple[np.ndarray, ChainRow]] = {
    "typical_p": (_logits(40, 1), ChainRow(temperature=0.9, typical_p=0.55)),
    "epsilon_cutoff": (_logits(40, 2), ChainRow(epsilon_cutoff=0.03)),
    "eta_cutoff": (_logits(40, 3, 2.0), ChainRow(eta_cutoff=0.2)),
    "top_n_sigma": (_logits(40, 4), ChainRow(temperature=1.3, top_n_sigma=1.1)),
    "xtc": (_logits(30, 5, 1.2), ChainRow(xtc_probability=0.6, xtc_threshold=0.06)),
    "dynatemp": (_logits(40, 6, 2.0), ChainRow(temperature=1.0, dynatemp_range=0.8,
                                               dynatemp_exponent=0.5)),
    # The same with a top-k after them: the chain on the top-k candidates, the temperature
    # and top-n-sigma's threshold found on the whole row first.
    "dynatemp top-k": (_logits(40, 13, 2.0), ChainRow(temperature=1.0, dynatemp_range=0.8,
                                                     dynatemp_exponent=0.5, top_k=25)),
    "top_n_sigma top-k": (_logits(40, 14), ChainRow(temperature=1.3, top_n_sigma=1.1,
                                                    top_k=30)),
    "mirostat": (_logits(40, 7, 2.0), ChainRow(mirostat_tau=2.0, mirostat_mu=3.2)),
    "llama.cpp order": (_logits(50, 8, 1.5), ChainRow(order="llama.cpp", temperature=0.5,
                                                      top_k=30, top_p=0.8, min_p=0.04)),
    "dry": (_logits(40, 9), ChainRow(history=_HISTORY, dry_multiplier=0.9, dry_base=1.75,
                                     dry_allowed_length=1, dry_sequence_breakers=[[30]])),
    "penalty_last_n": (_logits(40, 10), ChainRow(history=_HISTORY, penalty_last_n=6,
                                                 repetition=1.8, frequency=0.4, presence=0.3)),
    "no_repeat_ngram": (_logits(40, 11), ChainRow(history=_HISTORY, no_repeat_ngram_size=3)),
    "all": (_logits(60, 12, 1.8), ChainRow(
        order="llama.cpp", temperature=0.9, top_k=45, top_p=0.97, min_p=0.01,
        typical_p=0.95, epsilon_cutoff=0.002, eta_cutoff=0.001, top_n_sigma=2.5,
        xtc_probability=0.5, xtc_threshold=0.1, dynatemp_range=0.3, history=_HISTORY,
        dry_multiplier=0.7, dry_allowed_length=2, dry_sequence_breakers=[[11, 1]],
        penalty_last_n=8, repetition=1.3, frequency=0.2, no_repeat_ngram_size=4)),
}  # fmt: skip


def law(name: str, bug: str | None = None) -> np.ndarray:
    x, row = CONFIGS[name]
    return chain_probs(history_logits(x, row, bug), row, bug)


def draws(name: str) -> int:
    return draws_needed(law(name), CLAIM)


def fastsample_args(row: ChainRow, vocab: int, batch: int):
    """``(StepParams, TokenStats)`` for ``batch`` copies of ``row``."""
    on = {
        "temperature": row.temperature, "top_k": row.top_k or None, "top_p": row.top_p,
        "min_p": row.min_p, "order": row.order, "typical_p": row.typical_p,
        "epsilon_cutoff": row.epsilon_cutoff, "eta_cutoff": row.eta_cutoff,
        "top_n_sigma": row.top_n_sigma, "xtc_probability": row.xtc_probability,
        "xtc_threshold": row.xtc_threshold, "dynatemp_range": row.dynatemp_range,
        "dynatemp_exponent": row.dynatemp_exponent, "mirostat_tau": row.mirostat_tau,
        "penalty_last_n": row.penalty_last_n, "dry_multiplier": row.dry_multiplier,
        "dry_base": row.dry_base, "dry_allowed_length": row.dry_allowed_length,
        "dry_penalty_last_n": row.dry_penalty_last_n,
        "no_repeat_ngram_size": row.no_repeat_ngram_size,
        "repetition_penalty": row.repetition, "frequency_penalty": row.frequency,
        "presence_penalty": row.presence,
    }  # fmt: skip
    if row.penalty_last_n == 0:  # the output-count penalties are another test's
        on.update(repetition_penalty=None, frequency_penalty=None, presence_penalty=None)
    if row.dry_sequence_breakers:
        on["dry_sequence_breakers"] = [row.dry_sequence_breakers] * batch
    params = fs.StepParams(batch, vocab, **on)
    stats = fs.TokenStats.from_prompts([row.history] * batch, vocab,
                                       history=max(len(row.history), 1))  # fmt: skip
    if row.mirostat_mu is not None:
        stats.mirostat_mu.fill_(row.mirostat_mu)
    return params, stats


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_processed_distribution_is_the_chain(name):
    x, row = CONFIGS[name]
    params, stats = fastsample_args(row, x.shape[0], 1)
    got = fs.process_step(torch.tensor(x, dtype=torch.float32)[None], params, state=stats)
    np.testing.assert_allclose(got[0].double().numpy(), law(name), atol=2e-6)


def counts_of(name: str) -> np.ndarray:
    x, row = CONFIGS[name]
    vocab = x.shape[0]
    total = draws(name)
    counts = np.zeros(vocab, dtype=np.int64)
    rows = min(CHUNK, total)
    params, stats = fastsample_args(row, vocab, rows)
    logits = torch.tensor(x, dtype=torch.float32).expand(rows, -1)
    done, call = 0, 0
    with torch.inference_mode():
        while done < total:
            gen = torch.Generator().manual_seed(7000 + 31 * len(name) + call)
            out = fs.sample_step(logits, params=params, state=stats, generator=gen)
            assert out.valid.all()
            take = min(rows, total - done)
            counts += np.bincount(out.token_ids[:take, 0].numpy(), minlength=vocab)
            done += take
            call += 1
    return counts


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chain_law_and_negative_controls(name):
    counts = counts_of(name)
    want = law(name)
    assert_law(counts, want, what=name)
    assert law_rejected(counts, shifted_law(want))
    planted = [bug for bug in BUGS if not np.allclose(law(name, bug), want, atol=1e-9)]
    assert planted, f"{name}: no planted mistake changes this law"
    for bug in planted:
        assert law_rejected(counts, law(name, bug)), f"{name}: {bug} not rejected"


def test_each_stage_has_its_negative_control():
    """Dropping the configuration's own stage changes its law (so the control is real), and
    every planted mistake changes some configuration's law."""
    for name in CONFIGS:
        if name not in ("llama.cpp order", "all"):  # their own stages: the order, everything
            assert not np.allclose(law(name, "stage_dropped"), law(name), atol=1e-9), name
    for bug in BUGS:
        assert any(not np.allclose(law(n, bug), law(n), atol=1e-9) for n in CONFIGS), bug


def law_cases():
    for name in sorted(CONFIGS):
        yield LawCase(f"sampler chain {name} V={CONFIGS[name][0].shape[0]}", law(name),
                      draws(name), CLAIM)  # fmt: skip
