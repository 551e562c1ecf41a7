"""The law of the engine step's draws, stage by stage and all together, at 2%.

Each configuration is one row whose stage changes the law a lot (a penalty on the likely
tokens, a bitmask word with an asymmetric pattern and a partial last word, a bias at a
temperature far from 1, stop ids among the top tokens, ...). ``sample_step`` draws it many
times (a batch of copies, Philox seeds per row, several steps) and the counts pass the law test
of tests/stattests.py against tests/stage_reference.py's float64 law at ``ALPHA = 1e-6``. The
sizes come from ``draws_needed``: each test detects a 2% relative bias on 10% of the mass with
probability 0.99 (registered in ``law_cases()``, checked by tests/test_power.py).

Negative controls, at each test's own size: the same counts are rejected against the law of
each planted mistake that changes the configuration's law (stage_reference.BUGS: frequency
counted over the prompt, the bitmask read MSB-first, the bias added after temperature, the
repetition penalty on unseen tokens, min-tokens ignored), and against the true law shifted by
one index.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
from stage_reference import BUGS, Row, fastsample_args, step_probs
from stattests import LawCase, assert_law, draws_needed, law_rejected, shifted_law

CLAIM = 0.02
CHUNK = 200_000


def _logits(vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=vocab) * 1.5


def _words(vocab: int, seed: int) -> np.ndarray:
    """An asymmetric bitmask (about two thirds allowed) whose MSB-first reading differs."""
    rng = np.random.default_rng(seed)
    bits = rng.random((vocab + 31) // 32 * 32) < 0.65
    values = (bits.reshape(-1, 32).astype(np.int64) << np.arange(32)).sum(-1)
    return np.where(values >= 2**31, values - 2**32, values).astype(np.int32)


# One configuration per stage (a: allowed tokens, b: bias and min-tokens, c: penalties) and
# one with every stage on, the controls in vLLM's order.
CONFIGS: dict[str, tuple[np.ndarray, Row]] = {
    "allowed": (_logits(40, 2), Row(bitmask_words=_words(40, 3),
                                    allowed=[0, 1, 2, 3, 5, 8, 13, 21, 29, 31, 32, 34, 36, 39])),
    "bias and min-tokens": (
        _logits(24, 5),
        Row(temperature=0.5, bias={2: 2.0, 5: -1.5, 9: 1.0, 17: 0.7}, min_tokens=4, outputs=[5]),
    ),
    "penalties": (
        _logits(24, 1),
        Row(prompt=[0, 0, 0, 1, 1, 4, 4, 4, 4], outputs=[3, 3, 7, 7, 7, 12, 0],
            repetition=1.6, frequency=0.5, presence=0.4),
    ),
    "all": (
        _logits(60, 7),
        Row(temperature=0.8, top_k=30, top_p=0.93, min_p=0.02, cut_order="vllm",
            bitmask_words=_words(60, 8), allowed=list(range(3, 57)), bias={10: 1.5, 11: -2.0},
            min_tokens=3, outputs=[20, 20], prompt=[1, 1, 2, 30, 31, 31, 31],
            repetition=1.4, frequency=0.3, presence=0.2),
    ),
}  # fmt: skip
# Stop ids among the most likely tokens (and unbiased), so that suppressing them matters.
for _name in ("bias and min-tokens", "all"):
    _x, _row = CONFIGS[_name]
    _row.stop = [int(i) for i in np.argsort(-_x) if int(i) not in _row.bias][:2]


def law(name: str, bug: str | None = None) -> np.ndarray:
    x, row = CONFIGS[name]
    return step_probs(x, row, bug)


def draws(name: str) -> int:
    return draws_needed(law(name), CLAIM)


def counts_of(name: str) -> np.ndarray:
    """Token counts of ``draws(name)`` draws: one row's parameters repeated over a batch,
    a seeded generator per call."""
    x, row = CONFIGS[name]
    vocab = x.shape[0]
    total = draws(name)
    counts = np.zeros(vocab, dtype=np.int64)
    rows = min(CHUNK, total)
    one, stats, bitmask = fastsample_args([row], vocab, "list")
    params = one.repeat_rows(rows)
    stats = stats.select([0] * rows)
    bitmask = None if bitmask is None else bitmask.expand(rows, -1)
    logits = torch.tensor(x, dtype=torch.float32).expand(rows, -1)
    done, call = 0, 0
    with torch.inference_mode():
        while done < total:
            gen = torch.Generator().manual_seed(1000 * len(name) + call)
            out = fs.sample_step(logits, params=params, state=stats, token_bitmask=bitmask,
                                 generator=gen)  # fmt: skip
            assert out.valid.all()
            take = min(rows, total - done)
            counts += np.bincount(out.token_ids[:take, 0].numpy(), minlength=vocab)
            done += take
            call += 1
    return counts


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_step_law_and_negative_controls(name):
    counts = counts_of(name)
    want = law(name)
    assert_law(counts, want, what=name)
    assert law_rejected(counts, shifted_law(want))
    planted = [bug for bug in BUGS if not np.allclose(law(name, bug), want, atol=1e-9)]
    assert planted, f"{name}: no planted bug changes this law"
    for bug in planted:
        assert law_rejected(counts, law(name, bug)), f"{name}: {bug} not rejected"


def test_each_named_bug_is_planted_somewhere():
    """Every mistake of the issue's list changes at least one configuration's law here."""
    for bug in BUGS:
        assert any(not np.allclose(law(n, bug), law(n), atol=1e-9) for n in CONFIGS), bug


def law_cases():
    for name in sorted(CONFIGS):
        yield LawCase(f"engine step {name} V={CONFIGS[name][0].shape[0]}", law(name),
                      draws(name), CLAIM)  # fmt: skip
