"""Exactness of fastsample.distributed.sample across shards (the cuts of
:mod:`fastsample.distributed.cuts` and the draws), at full power: each law of
``distributed_helpers.LAWS`` (on world 2's uneven shards: logits with Python top-k and min-p,
probabilities with top-k and top-p, two draws without replacement; on world 4's coarse slots:
min-p) is judged by the chi-square law test against the float64 reference (p < 1e-6) from
``stattests.draws_needed`` draws, so it detects a 2% bias on 10% of the mass (5% for the
1600-token coarse row) with probability 0.99; negative controls at each test's size show it.
Tensor controls (the radix rounds) draw the same tokens as Python controls, seed for seed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed_helpers import (
    CONFIGS,
    JOINT_TOKENS,
    LAWS,
    UNEVEN_VOCAB,
    exact_configs,
    joint_tuples,
    results,
)
from reference import reference_probs
from stattests import LawCase, assert_law, law_rejected, mid_mass_biased, parity_biased


def law_counts(group, name: str) -> np.ndarray:
    """The counts of law ``name`` (the same on every rank: every rank returns every id)."""
    got = [r["laws"][name] for r in results(group, "exact")]
    for per_rank in got[1:]:
        assert np.array_equal(per_rank, got[0])
    spec = LAWS[name]
    counts = got[0]
    assert counts.sum() == spec.draws
    if spec.num_samples == 1:
        return counts
    # Pairs: every draw is two distinct tokens of JOINT_TOKENS (probability 0 elsewhere).
    pairs = counts.reshape(spec.vocab, spec.vocab)
    tuples = np.array(JOINT_TOKENS)[joint_tuples()]
    judged = pairs[tuples[:, 0], tuples[:, 1]]
    assert judged.sum() == spec.draws, "a pair outside the support, or a token drawn twice"
    return judged


def names_in(world: int) -> list[str]:
    return [name for name, spec in LAWS.items() if spec.world == world]


def test_every_law_is_exact_at_full_power(group):
    """Chi-square against the float64 reference at each law's full-power size."""
    world, _ = group
    for name in names_in(world):
        assert_law(law_counts(group, name), LAWS[name].law(), what=f"world {world} {name}")
    if any(LAWS[name].coarse for name in names_in(world)):
        assert results(group, "exact")[0]["coarse per_slot"] == 512  # the coarse layout ran


def test_negative_controls_are_rejected_at_each_tests_size(group):
    """At each law's size the same test rejects the mid-mass tokens 1.5x the claimed bias
    more likely and even-index tokens (cells) x1.5 (exact multinomial draws of those laws,
    seeded), the real draws reported one id off and, for the top-k law of world 2, the
    shard-local top-k (each shard keeps its own k largest: the classic sharding bug)."""
    world, _ = group
    rng = np.random.default_rng(world)
    for name in names_in(world):
        spec, right = LAWS[name], LAWS[name].law()
        counts = law_counts(group, name)
        wrong = {
            "mid-mass": mid_mass_biased(right, 1.5 * spec.claim),
            "even x1.5": parity_biased(right),
        }
        if name == "logits top-k min-p":
            wrong["shard-local top-k"] = shard_local_law(spec.row, spec.controls, spec.spans())
            assert (wrong["shard-local top-k"] > 0).sum() > (right > 0).sum()
        for what, law in wrong.items():
            assert law_rejected(rng.multinomial(spec.draws, law), right), f"{name}: {what}"
        assert law_rejected(np.roll(counts, 1), right), f"{name}: off by one"


def shard_local_law(x: np.ndarray, controls, spans) -> np.ndarray:
    """The law a sampler with the classic sharding bug draws from: each shard keeps its own
    top-k and the kept tokens go through the other controls together."""
    t, k, p, m = controls
    weights = np.exp((x - x.max()) / t)
    keep = np.zeros(len(x), dtype=bool)
    for start, end in spans:
        piece = weights[start:end]
        keep[start:end] = piece >= np.sort(piece)[::-1][min(k, len(piece)) - 1]
    return reference_probs(np.where(keep, x, -np.inf), t, 0, p, m)


def test_tensor_controls_draw_the_python_controls_tokens(group):
    """Tensor controls take the radix cuts (a SUM all-reduce of each round's histogram), Python
    ones the candidate all-gather: the cuts are the same numbers, so the tokens are the same,
    seed for seed, on every full-power law's row and on a peaked, a flat, a tied and a masked
    row; none has probability 0. The tensor-control law is thus the full-power tested one."""
    world, _ = group
    rows = {name: LAWS[name] for name in names_in(world) if LAWS[name].num_samples == 1}
    xs, controls = exact_configs(UNEVEN_VOCAB, seed=world, rows=CONFIGS)
    configs = {f"config {r}": (xs[r], controls[r]) for r in range(CONFIGS)}
    got = results(group, "exact")
    for name in [*rows, *configs]:
        tokens = got[0]["equal"][name]
        for rank in range(1, world):
            assert torch.equal(got[rank]["equal"][name]["tensor"], tokens["tensor"]), name
        assert torch.equal(tokens["tensor"], tokens["python"]), f"world {world} {name}"
        if name in rows:
            law = rows[name].law()
        else:
            x, c = configs[name]
            law = reference_probs(x, *c)
        assert (law[tokens["python"].numpy()] > 0).all(), f"{name}: a probability-0 token"


@pytest.mark.parametrize("name", list(LAWS))
def test_each_law_draws_from_every_shard(name):
    """Each law's tokens lie on every shard of its layout (the single-token ones included)."""
    spec = LAWS[name]
    drawn = JOINT_TOKENS if spec.num_samples == 2 else np.flatnonzero(spec.law() > 0)
    for start, end in spec.spans():
        assert any(start <= t < end for t in drawn), f"{name}: no token of shard {start}:{end}"


def law_cases():
    """test_every_law_is_exact_at_full_power's laws (tests/test_power.py checks them)."""
    for name, spec in LAWS.items():
        yield LawCase(f"world {spec.world} {name}", spec.law, spec.draws, spec.claim)
