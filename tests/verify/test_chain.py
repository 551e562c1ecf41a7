"""verify_chain: exactness on the toy model (with negative controls: the same test code,
run on a verifier with one small realistic bug, rejects it), output structure, batch
invariance, bad input, and graph safety."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fastsample as fs
from fastsample.verify import chain as chain_mod
from stattests import ALPHA, LawCase, _normal_isf, assert_law, law_test
from verify_helpers import (
    CHAIN_DRAWS,
    GROUPS,
    INF,
    LAW_KIND,
    NAN,
    P3,
    Q2,
    V_CHAIN,
    X2,
    ToyModel,
    assert_drawn_laws,
    capture,
    chain_round,
    chain_rounds,
    law_draws,
    law_model_laws,
    random_chain_batch,
)

# ---------------------------------------------------------------------------- chain exactness

# Full power: CHAIN_DRAWS (verify_helpers) requests. One full-power test per code path:
# drafts with probabilities (per-request seeds), point-mass drafts, ragged draft lengths
# (the last two with uniforms from a generator: a third of the cost per request; the seeded
# uniforms' layout is checked bitwise in test_verify_randomness). Their negative controls
# run at the same size.
CHAIN_CLAIM = 0.02


def ragged_lengths(rows):
    """Draft lengths 0..4, a function of the request (the same in both rounds' batches)."""
    return (rows * 7919 + 3) % 5


def law_cases():
    """The laws this module judges, with their sizes (tests/test_power.py checks them)."""

    def first():
        return law_model_laws()[0]

    def joint():
        return law_model_laws()[1]

    for test in ("draft probs", "point drafts", "ragged lengths"):
        yield LawCase(f"chain {test}: first token", first, CHAIN_DRAWS, CHAIN_CLAIM)
        yield LawCase(f"chain {test}: first two tokens", joint, CHAIN_DRAWS, CHAIN_CLAIM)
    yield LawCase(
        "captured verify_chain (CUDA): first token",
        first,
        CAPTURE_BATCH * CAPTURE_REPLAYS,
        0.09,
        carried_by="every replay equals the eager call bitwise (asserted there); the law of "
        "the same torch code at full power: test_chain_law_with_draft_probs",
    )


def test_chain_law_with_draft_probs(models):
    model = models(LAW_KIND)
    draws = law_draws(model, CHAIN_DRAWS, chain_rounds(model, seed=1))
    assert_drawn_laws(model, draws, "chain with draft probs")


def point_drafts(model, seed):
    return chain_rounds(model, seed=seed, probs=False, seeded=False)


def ragged(model, seed):
    return chain_rounds(model, seed=seed, lengths=ragged_lengths, seeded=False)


def test_chain_law_of_point_drafts(models):
    """Drafts without probabilities are point masses (exact for any draft)."""
    model = models(LAW_KIND)
    draws = law_draws(model, CHAIN_DRAWS, point_drafts(model, seed=2))
    assert_drawn_laws(model, draws, "chain, point drafts")


def test_chain_law_with_ragged_draft_lengths(models):
    """Each request uses its first 0..4 drafts (draft_lengths)."""
    model = models(LAW_KIND)
    draws = law_draws(model, CHAIN_DRAWS, ragged(model, seed=3))
    assert_drawn_laws(model, draws, "chain, ragged draft lengths")


def test_chain_accepted_counts_respect_ragged_lengths(models):
    model = models(LAW_KIND)
    rows = torch.arange(20_000)
    out = ragged(model, seed=3)(model.starts[rows % GROUPS], rows, 0)
    assert bool((out.num_accepted <= ragged_lengths(rows)).all())
    assert bool((out.num_accepted == ragged_lengths(rows)).any())


# The mean test: MEAN_REQUESTS first rounds, a two-sided z-test at false alarm 1e-6. It
# detects a relative error of MEAN_CLAIM (2%) in the mean accepted count (the acceptance
# rate times K) with probability 0.99: (z_{0.5e-6} + z_{0.01}) * sd / (sqrt(n) * mean) is
# 1.4% on "random" and 1.7% on "mixed" (sd 1.28 and 1.29 for means 1.18 and 1.02);
# mean_accepted_power computes it from the sample and the test checks it. Its control
# (2% fewer acceptances) runs at the same size.
MEAN_REQUESTS = 300_000
MEAN_CLAIM = 0.02


def mean_accepted_power(model, num_accepted, draft_count) -> float:
    """The relative error in the mean accepted count that the z-test detects with
    probability 0.99, at the sample's standard deviation."""
    values = num_accepted.double()
    z = _normal_isf(ALPHA / 2) + _normal_isf(0.01)
    return z * values.std().item() / (math.sqrt(len(values)) * model.expected_accepted(draft_count))


def mean_accepted_rejected(model, num_accepted, draft_count) -> tuple[bool, float]:
    """Two-sided z-test of the mean accepted count against theory, at false alarm ALPHA."""
    expected = model.expected_accepted(draft_count)
    values = num_accepted.double()
    z = (values.mean().item() - expected) / (values.std().item() / math.sqrt(len(values)))
    return abs(z) > _normal_isf(ALPHA / 2), z


@pytest.mark.parametrize("kind", ["random", "mixed"])
def test_chain_mean_accepted_matches_theory(models, kind):
    """The first round's mean accepted count against theory: MEAN_REQUESTS rounds detect a
    2% relative error in the acceptance rate (1.4% on "random", 1.7% on "mixed") with
    probability 0.99 at p < 1e-6; the power is computed from the sample and checked."""
    model = models(kind)
    out = chain_round(model, model.start_keys(MEAN_REQUESTS), 4, seed=11, seeded=False)
    assert mean_accepted_power(model, out.num_accepted, 4) <= MEAN_CLAIM
    rejected, z = mean_accepted_rejected(model, out.num_accepted, 4)
    assert not rejected, f"mean accepted off by {z:.1f} standard errors"


# ------------------------------------------------------------------ chain negative controls


def quantize_acceptance_uniforms(monkeypatch, bits=12):
    """Acceptance uniforms on a 2^-bits grid, so u == 0 happens (about every 4096th draw)."""
    real = chain_mod.uniforms

    def coarse(source, batch, num_accept):
        accept, recovery, bonus = real(source, batch, num_accept)
        return torch.floor(accept * 2**bits) / 2**bits, recovery, bonus

    monkeypatch.setattr(chain_mod, "uniforms", coarse)


def test_chain_control_acceptance_with_less_or_equal(models, monkeypatch):
    """``u * q <= p`` (``u <= p`` for point drafts) accepts a zero-probability draft when
    u == 0 (coarse uniforms make that happen about every 4096th test): the law test of the
    point-draft test, at its size, rejects it on the first token already (two of the four
    start contexts draft tokens the target cannot emit), for the probability-0 tokens drawn;
    the strict rule never accepts them, whatever u (``u * q < 0`` is false)."""
    model = models(LAW_KIND)
    quantize_acceptance_uniforms(monkeypatch)
    monkeypatch.setattr(
        chain_mod, "accept_drafts", lambda u, p, q: (u if q is None else u * q) <= p
    )
    draws = law_draws(model, CHAIN_DRAWS, point_drafts(model, seed=4), joint=False)
    result = law_test(draws.first, law_model_laws()[0])
    assert result.rejected and result.zero_hits > 0


def test_chain_control_mean_accepted_with_two_percent_fewer_acceptances(models, monkeypatch):
    """Acceptance tested against 0.98 p, at the mean test's size: rejected."""
    real = chain_mod.accept_drafts
    monkeypatch.setattr(chain_mod, "accept_drafts", lambda u, p, q: real(u, 0.98 * p, q))
    model = models("random")
    out = chain_round(model, model.start_keys(MEAN_REQUESTS), 4, seed=11, seeded=False)
    assert mean_accepted_rejected(model, out.num_accepted, 4)[0]


# ---------------------------------------------------------------------------- structure of outputs


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_output_structure(with_probs):
    target, tokens, draft = random_chain_batch(300, 5, 50)
    if not with_probs:  # point-mass drafts: pick likely tokens so some are accepted
        tokens = target[:, :5].argmax(-1)
    lengths = torch.arange(300) % 6
    out = fs.verify_chain(
        target, tokens, draft if with_probs else None, draft_lengths=lengths, seed=torch.arange(300)
    )
    assert out.token_ids.shape == (300, 6) and out.token_ids.dtype == torch.int64
    assert bool(out.valid.all())
    assert torch.equal(out.num_emitted, out.num_accepted + 1)
    assert bool((out.num_accepted <= lengths).all())
    slots = torch.arange(6)
    emitted = slots < out.num_emitted[:, None]
    assert bool((out.token_ids[~emitted] == -1).all())
    assert bool(((out.token_ids >= 0) & (out.token_ids < 50))[emitted].all())
    accepted = slots[:5] < out.num_accepted[:, None]
    assert torch.equal(out.token_ids[:, :5][accepted], tokens[accepted])
    assert 0 < out.num_accepted.float().mean() < 5  # some accepted, some rejected


def test_chain_without_drafts_draws_the_bonus():
    target = torch.softmax(torch.randn(4, 1, 9), -1)
    out = fs.verify_chain(target, torch.zeros(4, 0, dtype=torch.int64), seed=1)
    assert out.token_ids.shape == (4, 1) and out.num_emitted.tolist() == [1] * 4
    out = fs.verify_chain(target, torch.zeros(4, 0, dtype=torch.int64), target[:, :0], seed=1)
    assert out.num_accepted.tolist() == [0] * 4


def test_chain_zero_residual_falls_back_to_the_target():
    """p == q and a draft the target cannot emit: the rejection is certain and the residual
    is empty; the token comes from p (valid, in range, never the rejected one)."""
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]]).expand(2000, -1, -1)
    q = p[:, :1]
    draft = torch.zeros(2000, 1, dtype=torch.int64)  # p(0) = q(0) = 0
    out = fs.verify_chain(p.contiguous(), draft, q.contiguous(), seed=torch.arange(2000))
    assert bool(out.valid.all()) and out.num_accepted.max() == 0
    assert set(out.token_ids[:, 0].tolist()) == {1, 2}


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_batch_invariance(with_probs):
    target, tokens, draft = random_chain_batch(257, 4, 40, seed=1)
    q = draft if with_probs else None
    gen = torch.Generator().manual_seed(2)
    seeds = torch.randint(-(2**62), 2**62, (257,), generator=gen)
    steps = torch.randint(0, 2**40, (257,), generator=gen)
    lengths = torch.randint(0, 5, (257,), generator=gen)

    def run(rows):
        return fs.verify_chain(
            target[rows],
            tokens[rows],
            None if q is None else q[rows],
            draft_lengths=lengths[rows],
            seed=seeds[rows],
            step=steps[rows],
        )

    full = run(torch.arange(257))
    order = torch.randperm(257, generator=gen)
    shuffled = run(order)
    for field in full._fields:
        assert torch.equal(getattr(shuffled, field), getattr(full, field)[order])
    for row in (0, 100, 256):
        alone = run(torch.tensor([row]))
        for field in full._fields:
            assert torch.equal(getattr(alone, field), getattr(full, field)[row : row + 1])


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args,kwargs,error,words",
    [
        (([[0.5]], X2), {}, TypeError, "target_probs must be a torch.Tensor"),
        ((P3[0], X2), {}, ValueError, "target_probs must have shape (batch, K+1, vocab)"),
        ((P3.long(), X2), {}, TypeError, "float16, bfloat16, float32 or float64"),
        ((P3[:, :, :0], X2), {}, ValueError, "at least one vocabulary entry"),
        ((P3[:, :0], X2[:, :0]), {}, ValueError, "K+1 >= 1 positions"),
        ((P3, X2.float()), {}, TypeError, "draft_token_ids must be int64"),
        ((P3, X2[:, :1]), {}, ValueError, "draft_token_ids must have shape (2, 2)"),
        ((P3, [[0, 0], [0, 0]]), {}, TypeError, "draft_token_ids must be an int64 tensor"),
        ((P3, X2, Q2[:, :1]), {}, ValueError, "draft_probs must have shape (batch, K, vocab)"),
        ((P3, X2, Q2[0]), {}, ValueError, "draft_probs must have shape"),
        ((P3, X2, Q2.long()), {}, TypeError, "draft_probs must be float16"),
        ((P3, X2), {"draft_lengths": 3}, ValueError, "draft_lengths must be between 0 and 2"),
        ((P3, X2), {"draft_lengths": True}, TypeError, "draft_lengths must be None, an int"),
        ((P3, X2), {"draft_lengths": torch.ones(3).long()}, ValueError, "shape (2,)"),
        ((P3, X2), {"draft_lengths": torch.ones(2)}, TypeError, "draft_lengths must be int64"),
        ((P3, X2), {"seed": 1, "generator": torch.Generator()}, ValueError, "mutually exclusive"),
        ((P3, X2), {"step": 1}, ValueError, "step was given without seed"),
        ((P3, X2), {"seed": torch.arange(3)}, ValueError, "seed must have shape (2,)"),
        ((P3, X2), {"generator": 1}, TypeError, "generator must be a torch.Generator"),
        ((P3, X2), {"check": 1}, TypeError, "check must be True or False"),
    ],
)
def test_chain_argument_errors(args, kwargs, error, words):
    with pytest.raises(error) as info:
        fs.verify_chain(*args, **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "change,words,flagged",
    [
        ({"ids": (1, 0, 5)}, "row 1 draft position 0 has an id outside [0, 5)", 1),
        ({"ids": (0, 1, -1)}, "row 0 draft position 1 has an id outside [0, 5)", 1),
        ({"target": (1, 2, 0, NAN)}, "row 1 target_probs position 2 contains NaN", 1),
        ({"target": (0, 0, 3, -0.1)}, "row 0 target_probs position 0 contains negative", 0),
        ({"draft": (1, 1, 3, INF)}, "row 1 draft_probs position 1 contains +-inf", 0),
        ({"draft": (1, 1, 0, INF)}, "row 1 draft_probs position 1 contains +-inf", 1),
        ({"lengths": torch.tensor([2, 3])}, "row 1 draft_lengths 0 outside [0, 2]", 1),
    ],
)
def test_chain_check_true_names_the_first_bad_row(change, words, flagged):
    """check=True reads every used row. Without it, only the values the verifier reads
    are judged: here p == q, so every draft is accepted and the bad entries off the drafted
    tokens at positions 0 and 1 are never read (flagged == 0)."""
    p, x, q = P3.clone(), X2.clone(), Q2.clone()
    lengths = change.get("lengths")
    if "ids" in change:
        b, k, value = change["ids"]
        x[b, k] = value
    if "target" in change:
        b, k, i, value = change["target"]
        p[b, k, i] = value
    if "draft" in change:
        b, k, i, value = change["draft"]
        q[b, k, i] = value
    with pytest.raises(ValueError) as info:
        fs.verify_chain(p, x, q, draft_lengths=lengths, seed=1, check=True)
    assert words in str(info.value)
    out = fs.verify_chain(p, x, q, draft_lengths=lengths, seed=1)
    assert out.valid.tolist().count(False) == flagged


def test_chain_padding_is_never_judged():
    """Garbage after draft_lengths (ids, draft rows, target rows) is ignored, even by
    check=True; the bonus position's target row is used and judged."""
    p, x, q = P3.clone(), X2.clone(), Q2.clone()
    lengths = torch.tensor([0, 1])
    x[0] = -7
    q[0] = NAN
    p[0, 1:] = NAN
    x[1, 1] = 99
    q[1, 1] = -1
    p[1, 2] = INF
    out = fs.verify_chain(p, x, q, draft_lengths=lengths, seed=1, check=True)
    assert out.valid.tolist() == [True, True]


def bad_rows_batch():
    target, tokens, draft = random_chain_batch(8, 3, 300, seed=9)
    target[1, 0, 7] = NAN  # gathered or recovery row: row 1 bad
    target[1, :, :] = torch.where(torch.arange(300) == 7, NAN, target[1])
    target[2, :, 5] = -0.5
    target[3] = 0
    draft[4, :, 2] = INF
    tokens[5, 1] = 300  # out of range
    target[6, :, 0] = INF
    draft[7] = NAN
    return target, tokens, draft


def test_chain_bad_rows_are_flagged_and_other_rows_unchanged():
    target, tokens, draft = bad_rows_batch()
    clean_target, clean_tokens, clean_draft = random_chain_batch(8, 3, 300, seed=9)
    seeds = torch.arange(8) * 3
    out = fs.verify_chain(target, tokens, draft, seed=seeds)
    clean = fs.verify_chain(clean_target, clean_tokens, clean_draft, seed=seeds)
    assert out.valid.tolist() == [True] + [False] * 7
    for field in out._fields:
        assert torch.equal(getattr(out, field)[0], getattr(clean, field)[0])
    assert bool((out.token_ids[1:] == -1).all()) and out.num_emitted[1:].max() == 0
    # Point-mass drafts: same policy (row 4 and 7 only had bad draft rows: valid now).
    out = fs.verify_chain(target, tokens, None, seed=seeds)
    clean = fs.verify_chain(clean_target, clean_tokens, None, seed=seeds)
    assert out.valid.tolist() == [True, False, False, False, True, False, False, True]
    for row in (0, 4, 7):
        assert torch.equal(out.token_ids[row], clean.token_ids[row])


def test_chain_fuzz_garbage_rows_stay_in_range():
    gen = torch.Generator().manual_seed(12)
    batch, k, vocab = 400, 3, 37
    values = torch.tensor([0.0, 1.0, -1.0, NAN, INF, -INF, 1e-30, 1e30])
    target = values[torch.randint(0, 8, (batch, k + 1, vocab), generator=gen)]
    draft = values[torch.randint(0, 8, (batch, k, vocab), generator=gen)]
    tokens = torch.randint(-3, vocab + 3, (batch, k), generator=gen)
    for q in (draft, None):
        out = fs.verify_chain(target, tokens, q, seed=torch.arange(batch))
        ids = out.token_ids
        assert bool(((ids == -1) | ((ids >= 0) & (ids < vocab))).all())
        assert bool((out.num_emitted <= k + 1).all())


# ---------------------------------------------------------------------------- graph safety


def compile_batch():
    target, tokens, draft = random_chain_batch(6, 3, 700, seed=13)
    target[2, :, 9] = NAN  # a bad row goes through the compiled graph too
    return target, tokens, draft, torch.tensor([3, 3, 3, 1, 0, 2])


@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_fullgraph_seeded_matches_eager(eager_equivalent_random, with_probs):
    target, tokens, draft, lengths = compile_batch()
    q = draft if with_probs else None

    def run(p, x, d, n, s, t):
        return fs.verify_chain(p, x, d, draft_lengths=n, seed=s, step=t)

    # aot_eager: dynamo with fullgraph (no graph break: no sync, no Python branch on values)
    # and AOT tracing with fake tensors (no data-dependent shape), without inductor's code
    # generation (tens of seconds for the Philox rounds), which the next test exercises.
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    seeds, step = torch.arange(6) * 11, torch.zeros(6, dtype=torch.int64)
    for _ in range(2):
        got, want = (
            compiled(target, tokens, q, lengths, seeds, step),
            run(target, tokens, q, lengths, seeds, step),
        )
        for field in want._fields:
            assert torch.equal(getattr(got, field), getattr(want, field))
        fs.advance_step(step)
    assert got.valid.tolist() == [True, True, False, True, True, True]


def test_chain_fullgraph_generator_free_matches_eager(eager_equivalent_random):
    """Inductor end to end: the compiled kernels draw exactly what eager draws (a small
    graph: inductor's code generation is the slow part of compiling)."""
    target, tokens, draft = random_chain_batch(4, 2, 256, seed=13)
    target[1, :, 5] = NAN
    compiled = torch.compile(lambda p, x, d: fs.verify_chain(p, x, d), fullgraph=True)
    torch.manual_seed(5)
    got = compiled(target, tokens, draft)
    torch.manual_seed(5)
    want = fs.verify_chain(target, tokens, draft)
    for field in want._fields:
        assert torch.equal(getattr(got, field), getattr(want, field))
    assert want.valid.tolist() == [True, False, True, True]


def chain_inputs(model, batch, draft_count, seed):
    """One round of drafts from the toy model: (target, draft, tokens), float32."""
    gen = torch.Generator().manual_seed(seed)
    target, draft, tokens = [], [], []
    key = model.start_keys(batch)
    for _ in range(draft_count):
        target.append(model.target[key])
        draft.append(model.draft[key])
        tokens.append(torch.multinomial(draft[-1], 1, generator=gen)[:, 0])
        key = model.child(key, tokens[-1])
    target.append(model.target[key])
    return torch.stack(target, 1).float(), torch.stack(draft, 1).float(), torch.stack(tokens, 1)


CAPTURE_BATCH, CAPTURE_REPLAYS = 65_536, 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_probs", [True, False])
def test_chain_cuda_graph_capture_replays_fresh_exact_draws(with_probs):
    """Captured once under sync-debug "error"; each replay gets new drafts copied into the
    static inputs and a new step (advanced inside the graph): every replay equals eager, and
    the first emitted tokens over all replays follow the target's law."""
    model = ToyModel("mixed", V_CHAIN)
    batch, k, replays = CAPTURE_BATCH, 2, CAPTURE_REPLAYS
    cuda = torch.device("cuda")
    rounds = [[t.to(cuda) for t in chain_inputs(model, batch, k, seed)] for seed in range(replays)]
    p, q, x = (t.clone() for t in rounds[0])
    q_arg = q if with_probs else None
    seeds = torch.arange(batch, device=cuda)
    step = torch.zeros(batch, dtype=torch.int64, device=cuda)

    def decode():
        out = fs.verify_chain(p, x, q_arg, seed=seeds, step=step)
        fs.advance_step(step)
        return out

    graph, out = capture(decode)
    step.zero_()
    counts = np.zeros(GROUPS * V_CHAIN)
    group = torch.arange(batch, device=cuda) % GROUPS
    for replay, (new_p, new_q, new_x) in enumerate(rounds):
        p.copy_(new_p)
        q.copy_(new_q)
        x.copy_(new_x)
        graph.replay()
        eager = fs.verify_chain(
            new_p, new_x, new_q if with_probs else None, seed=seeds, step=replay
        )
        for field in eager._fields:
            assert torch.equal(getattr(out, field), getattr(eager, field))
        ids = out.token_ids[:, 0]
        counts += torch.bincount(group * V_CHAIN + ids, minlength=counts.size).cpu().numpy()
    assert_law(counts, model.exact_laws()[0], what="captured verify_chain")
