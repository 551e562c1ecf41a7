"""The new stages' contract (issue 37): hand-checked rows, bad settings, the chain's order,
state, seeds, verification's drafts and graph safety.

* llama.cpp's own test vectors for its samplers (``tests/test-sampling.cpp``: typical, XTC,
  top-n-sigma, temp_ext, DRY), as facts about the definitions fastsample follows;
* a Python setting out of range raises naming it; a tensor one flags its row only;
* orders: presets, custom lists, and what a custom list must hold;
* off values leave the step bitwise as before; a seeded request draws the same tokens in any
  batch with every new stage on, XTC and mirostat included;
* mirostat's ``mu`` moves as llama.cpp's; the history follows the emitted tokens;
* ``process_step`` with drafts (``extra``) equals the step after those drafts were emitted;
* ``torch.compile(fullgraph=True)`` takes the truncation stages.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fastsample as fs

V = 300


def _processed(probs: list[float], state=None, **settings) -> list[float]:
    """process_step on logits log(probs), one row."""
    logits = torch.tensor(probs, dtype=torch.float32).log()[None]
    params = fs.StepParams(1, len(probs), **settings)
    return fs.process_step(logits, params, state=state)[0].tolist()


# ---------------------------------------------------------------------------- llama.cpp's rows


def test_llama_cpp_typical_rows():
    assert _processed([0.97, 0.01, 0.01, 0.01], typical_p=0.5) == pytest.approx([1, 0, 0, 0])
    third = pytest.approx([0, 1 / 3, 1 / 3, 1 / 3], abs=1e-6)
    assert _processed([0.4, 0.2, 0.2, 0.2], typical_p=0.5) == third


@pytest.mark.parametrize(
    ("threshold", "kept"),
    [(0.09, [3]), (0.19, [2, 3]), (0.29, [1, 2, 3]), (0.39, [0, 1, 2, 3])],
)
def test_llama_cpp_xtc_rows(threshold, kept):
    got = _processed([0.4, 0.3, 0.2, 0.1], xtc_probability=1.0, xtc_threshold=threshold)
    assert [i for i, p in enumerate(got) if p > 0] == kept


def test_llama_cpp_top_n_sigma_and_temp_ext_rows():
    got = _processed([0.1, 0.2, 0.3, 0.4], top_n_sigma=1.0)
    assert got == pytest.approx([0, 0, 0.428571, 0.571429], abs=1e-6)
    assert _processed([0.1, 0.2, 0.3, 0.4], top_n_sigma=3.0) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    greedy = _processed([0.1, 0.2, 0.3, 0.4], temperature=0.0, order="llama.cpp")
    assert greedy == pytest.approx([0, 0, 0, 1])


def _dry(history, **settings) -> list[float]:
    state = fs.TokenStats.from_prompts([history], 5, history=len(history))
    return _processed([0.25] * 4 + [1e-30], state=state, **settings)[:4]


def test_llama_cpp_dry_rows():
    base = dict(dry_multiplier=1.0, dry_base=1.1, dry_allowed_length=2)
    assert _dry([0, 1], dry_penalty_last_n=4, **base) == pytest.approx([0.25] * 4, abs=1e-6)
    got = _dry([0, 1, 2, 0, 1], dry_penalty_last_n=5, **base)
    assert got == pytest.approx([0.296923, 0.296923, 0.109232, 0.296923], abs=1e-6)
    broken = _dry([0, 1, 3, 4, 0, 1], dry_penalty_last_n=6,
                  dry_sequence_breakers=[[[3]]], **base)  # fmt: skip
    assert broken == pytest.approx([0.25] * 4, abs=1e-6)
    longer = dict(base, dry_allowed_length=4)
    assert _dry([0, 1, 2, 3, 4, 0, 1], dry_penalty_last_n=7, **longer) == pytest.approx(
        [0.25] * 4, abs=1e-6
    )


def test_dry_multi_token_breaker_stops_the_match():
    """The context ends in "1 3 4 2", which followed by 0 before: a repeat of 4 tokens. The
    two-token breaker (3, 4) inside it leaves one token after it, fewer than allowed: nothing
    is penalized; a breaker that does not occur (3, 2) leaves 0 penalized."""
    settings = dict(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    history = [1, 3, 4, 2, 0, 1, 3, 4, 2]
    broken = _dry(history, dry_sequence_breakers=[[[3, 4]]], **settings)
    assert broken == pytest.approx([0.25] * 4, abs=1e-6)
    open_ = _dry(history, dry_sequence_breakers=[[[3, 2]]], **settings)
    assert open_[0] < 0.05  # 2 ** (4 - 2) = 4 off its logit


# ---------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("name", "value"),
    [("typical_p", 0.0), ("typical_p", 1.5), ("epsilon_cutoff", 1.0), ("eta_cutoff", -0.1),
     ("top_n_sigma", math.inf), ("xtc_probability", 1.2), ("xtc_threshold", -0.1),
     ("dynatemp_range", -1.0), ("mirostat_tau", -1.0), ("mirostat_eta", -1.0),
     ("penalty_last_n", -2), ("dry_multiplier", -1.0), ("dry_base", 0.5),
     ("dry_allowed_length", -1), ("dry_penalty_last_n", -3), ("no_repeat_ngram_size", -1)],
)  # fmt: skip
def test_a_python_setting_out_of_range_raises_naming_it(name, value):
    with pytest.raises(ValueError, match=name):
        fs.StepParams(2, V, **{name: value})


def test_bad_orders_and_breakers_raise():
    with pytest.raises(ValueError, match="unknown stages"):
        fs.StepParams(2, V, order=["top_k", "tfs"])
    with pytest.raises(ValueError, match="twice"):
        fs.StepParams(2, V, order=["top_k", "top_k"])
    with pytest.raises(ValueError, match="mirostat"):
        fs.StepParams(2, V, order=["mirostat", "temperature"], mirostat_tau=3.0)
    with pytest.raises(ValueError, match="leaves out"):
        fs.StepParams(2, V, order=["top_k"], top_k=5, typical_p=0.5)
    with pytest.raises(ValueError, match="one of"):
        fs.StepParams(2, V, order="kobold")
    with pytest.raises(ValueError, match="disagree"):
        fs.StepParams(2, V, order="llama.cpp", cut_order="vllm")
    with pytest.raises(ValueError, match="outside"):
        fs.StepParams(2, V, dry_multiplier=1.0, dry_sequence_breakers=[[[V]], None])
    with pytest.raises(ValueError, match="one entry per row"):
        fs.StepParams(2, V, dry_multiplier=1.0, dry_sequence_breakers=[[[1]]])
    with pytest.raises(ValueError, match="history="):
        fs.sample_step(torch.randn(2, V), params=fs.StepParams(2, V, dry_multiplier=1.0),
                       state=fs.TokenStats.empty(2, V))  # fmt: skip
    with pytest.raises(ValueError, match="need state="):
        fs.sample_step(torch.randn(2, V), params=fs.StepParams(2, V, mirostat_tau=3.0))


def test_a_tensor_setting_out_of_range_flags_its_row_only():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=gen)
    good = fs.StepParams(4, V, typical_p=torch.tensor([0.5, 0.5, 0.9, 0.9]), seed=5)
    bad = fs.StepParams(4, V, typical_p=torch.tensor([0.5, 1.5, 0.9, math.nan]), seed=5)
    want = fs.sample_step(logits, params=good, step=1)
    got = fs.sample_step(logits, params=bad, step=1)
    assert got.valid.tolist() == [True, False, True, False]
    assert torch.equal(got.token_ids[[0, 2]], want.token_ids[[0, 2]])
    assert ((got.token_ids >= 0) & (got.token_ids < V)).all()
    with pytest.raises(ValueError, match="row 1"):
        fs.sample_step(logits, params=bad, step=1, check=True)


# ---------------------------------------------------------------------------- orders and off


def test_off_values_leave_the_step_as_before():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    plain = fs.StepParams(3, V, temperature=0.7, top_p=0.9, seed=1)
    off = fs.StepParams(3, V, temperature=0.7, top_p=0.9, seed=1, typical_p=1.0,
                        epsilon_cutoff=0.0, eta_cutoff=0.0, top_n_sigma=-1.0,
                        xtc_probability=0.0, dynatemp_range=0.0, no_repeat_ngram_size=0,
                        dry_multiplier=0.0, penalty_last_n=0)  # fmt: skip
    assert not off.chain_on and not off.samplers.history_on
    a = fs.sample_step(logits, params=plain, step=3)
    b = fs.sample_step(logits, params=off, step=3)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.probs, b.probs)


def test_legacy_presets_through_the_chain_match_the_controls():
    """The chain's top-k, top-p and min-p stages in each legacy order give the controls' own
    distribution (a custom list naming the same order forces the chain)."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2)) * 2
    controls = dict(temperature=0.8, top_k=40, top_p=0.85, min_p=0.03)
    lists = {"transformers": ["temperature", "top_k", "top_p", "min_p"],
             "vllm": ["temperature", "min_p", "top_k", "top_p"]}  # fmt: skip
    for preset, names in lists.items():
        want = fs.process_step(logits, fs.StepParams(4, V, cut_order=preset, **controls))
        got = fs.process_step(logits, fs.StepParams(4, V, order=names, **controls))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------- seeds and state


def _everything(batch: int, rows) -> dict:
    per_row = torch.tensor([0.9, 0.8, 0.95, 0.85, 0.9, 0.8])[rows]
    return dict(
        temperature=0.9, top_k=60, typical_p=per_row, epsilon_cutoff=1e-4, eta_cutoff=1e-4,
        top_n_sigma=3.0, xtc_probability=0.5, xtc_threshold=0.05, dynatemp_range=0.3,
        mirostat_tau=torch.tensor([4.0, 5.0, 6.0, 4.5, 5.5, 3.5])[rows], penalty_last_n=16,
        repetition_penalty=1.2, dry_multiplier=0.8, no_repeat_ngram_size=3, order="llama.cpp",
        seed=torch.tensor([11, 12, 13, 14, 15, 16])[rows],
        dry_sequence_breakers=[[[1]]] * batch,
    )  # fmt: skip


def test_a_seeded_request_draws_the_same_tokens_in_any_batch_with_every_stage():
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(0, 20, (6, 40), generator=gen)
    whole = fs.TokenStats.from_prompts(prompts, V, history=64)
    rows = torch.tensor([4, 1])
    part = whole.select(rows)
    params = fs.StepParams(6, V, **_everything(6, torch.arange(6)))
    sub = fs.StepParams(2, V, **_everything(2, rows))
    for step in range(6):
        logits = torch.randn(6, V, generator=gen) * 2
        a = fs.sample_step(logits, params=params, state=whole, step=step)
        b = fs.sample_step(logits[rows], params=sub, state=part, step=step)
        assert torch.equal(a.token_ids[rows], b.token_ids), step
        whole.update(a.token_ids, probs=a.probs, params=params)
        part.update(b.token_ids, probs=b.probs, params=sub)
        torch.testing.assert_close(whole.mirostat_mu[rows], part.mirostat_mu)
    assert torch.equal(whole.history[rows], part.history)


def test_mirostat_mu_moves_as_llama_cpp_and_history_follows():
    stats = fs.TokenStats.from_prompts([[1, 2], [3]], 10, history=4)
    params = fs.StepParams(2, 10, mirostat_tau=torch.tensor([5.0, 0.0]), mirostat_eta=0.1)
    stats.update(torch.tensor([[7], [8]]), probs=torch.tensor([[0.25], [0.5]]), params=params)
    # mu = 2 tau - eta (-log2 q - tau) = 10 - 0.1 (2 - 5); the second row is off (tau 0).
    assert stats.mirostat_mu[0].item() == pytest.approx(10.3)
    assert math.isnan(stats.mirostat_mu[1].item())
    assert stats.history.tolist() == [[-1, 1, 2, 7], [-1, -1, 3, 8]]
    with pytest.raises(ValueError, match="probs="):
        stats.update(torch.tensor([[1], [1]]), params=params)


def test_process_step_with_drafts_is_the_step_after_them():
    """Verification's positions: drafts in ``extra`` act as emitted tokens for DRY, no-repeat
    n-grams and windowed penalties."""
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, 12, (3, 20), generator=gen)
    drafts = torch.randint(0, 12, (3, 4), generator=gen)
    drafts[2, 2:] = -1
    logits = torch.randn(3, V, generator=gen)
    params = fs.StepParams(3, V, dry_multiplier=0.7, dry_allowed_length=1,
                           no_repeat_ngram_size=2, penalty_last_n=8, presence_penalty=0.5,
                           typical_p=0.9)  # fmt: skip
    before = fs.TokenStats.from_prompts(prompts, V, history=32)
    after = fs.TokenStats.from_prompts(prompts, V, history=32)
    after.update(drafts)
    with_drafts = fs.process_step(logits, params, state=before, rows=torch.arange(3),
                                  extra=drafts)  # fmt: skip
    torch.testing.assert_close(with_drafts, fs.process_step(logits, params, state=after))


def test_verify_chain_runs_the_new_stages():
    gen = torch.Generator().manual_seed(6)
    batch, k = 3, 3
    target = torch.randn(batch, k + 1, V, generator=gen) * 2
    draft_probs = torch.softmax(torch.randn(batch, k, V, generator=gen), -1)
    drafts = torch.multinomial(draft_probs.flatten(0, 1), 1, generator=gen).view(batch, k)
    params = fs.StepParams(batch, V, temperature=0.8, typical_p=0.9, top_n_sigma=2.0)
    out = fs.verify_chain(draft_token_ids=drafts, draft_probs=draft_probs, target_logits=target,
                          params=params, seed=torch.tensor([1, 2, 3]), step=0)  # fmt: skip
    assert out.token_ids.shape == (batch, k + 1)
    assert ((out.token_ids >= -1) & (out.token_ids < V)).all()


def test_truncation_stages_compile_fullgraph():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(8)) * 2
    params = fs.StepParams(4, V, temperature=torch.tensor([0.7, 1.0, 0.0, 1.2]),
                           typical_p=0.9, eta_cutoff=1e-3, top_n_sigma=2.5,
                           xtc_probability=0.5, xtc_threshold=0.05, dynatemp_range=0.2,
                           order="llama.cpp", seed=torch.arange(4))  # fmt: skip
    eager = fs.sample_step(logits, params=params, step=2)
    compiled = torch.compile(lambda x, s: fs.sample_step(x, params=params, step=s),
                             fullgraph=True)  # fmt: skip
    got = compiled(logits, torch.full((4,), 2))
    assert torch.equal(got.token_ids, eager.token_ids) and torch.equal(got.valid, eager.valid)
    np.testing.assert_allclose(got.probs.numpy(), eager.probs.numpy(), rtol=1e-5)


def test_the_candidate_chain_and_its_tie_fallback():
    """A Python top_k before the mass stages runs the chain on the candidates; ties at the
    k-th past the candidates send the call to the whole row. Either way every drawn token is
    in the processed support and the drawn probability is the processed one."""
    gen = torch.Generator().manual_seed(9)
    smooth = torch.randn(4, V, generator=gen) * 2
    tied = torch.zeros(4, V)  # every entry ties: the k-th's ties fill the row
    tied[:, :5] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0])
    params = fs.StepParams(4, V, temperature=0.9, top_k=20, typical_p=0.8, xtc_probability=0.5,
                           order="llama.cpp", seed=torch.arange(4))  # fmt: skip
    from fastsample.ops.noise import GeneratorSource
    from fastsample.stages import chain

    source = GeneratorSource(None, 4, smooth.device)
    assert chain.candidates(smooth, params.controls, params.samplers, source, None) is not None
    assert chain.candidates(tied, params.controls, params.samplers, source, None) is None
    for logits in (smooth, tied):
        want = fs.process_step(logits, params)
        for step in range(20):
            out = fs.sample_step(logits, params=params, step=step)
            drawn = want.gather(1, out.token_ids)
            assert (drawn > 0).all() and out.valid.all()
            # XTC's coin makes the processed law a mixture: the drawn probability is one of
            # its two components', never above 1.
            assert ((out.probs > 0) & (out.probs <= 1)).all()


def test_the_candidate_chain_finds_the_whole_rows_numbers():
    """On the candidates, dynamic temperature and top-n-sigma take the whole row's entropy,
    count and deviation: the same kept logits as the whole-row chain, rows with removed
    (``-inf``) entries included (their entropy then takes the masked path)."""
    from fastsample.ops.noise import GeneratorSource
    from fastsample.stages import chain

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, V, generator=gen) * 2
    x[1, ::3] = -math.inf  # a grammar's removals
    x[3, 40:] = -math.inf
    for stage in ({"dynatemp_range": 0.7, "dynatemp_exponent": 1.3}, {"top_n_sigma": 1.2}):
        params = fs.StepParams(4, V, temperature=0.8, top_k=15, **stage)
        source = GeneratorSource(None, 4, x.device)
        few = chain.candidates(x, params.controls, params.samplers, source, None)
        assert few is not None
        whole = chain.run(x, params.controls, params.samplers, source, None)
        values, ids = few
        torch.testing.assert_close(values, whole.gather(1, ids), rtol=1e-6, atol=0)
        kept = (whole > -math.inf).sum(-1)
        assert torch.equal((values > -math.inf).sum(-1), kept)


def test_dry_breakers_longer_than_the_history_or_empty_break_nothing():
    """As llama.cpp: a breaker longer than the window cannot occur (it limits nothing), and an
    empty one is skipped; both leave DRY's penalty as without breakers."""
    settings = dict(dry_multiplier=1.0, dry_base=1.1, dry_allowed_length=2,
                    dry_penalty_last_n=5)  # fmt: skip
    plain = _dry([0, 1, 2, 0, 1], **settings)
    longer = _dry([0, 1, 2, 0, 1], dry_sequence_breakers=[[[0, 1, 2, 0, 1, 2]]], **settings)
    empty = _dry([0, 1, 2, 0, 1], dry_sequence_breakers=[[[]]], **settings)
    assert longer == pytest.approx(plain) and empty == pytest.approx(plain)
    assert plain[2] < 0.2  # the penalty is there to be kept


@pytest.mark.parametrize(
    "order",
    [["top_k", "top_n_sigma", "temperature"], ["temperature", "top_n_sigma", "top_k"],
     ["top_p", "top_k", "temperature"], ["min_p", "top_n_sigma", "top_k", "temperature"]],
)  # fmt: skip
def test_the_candidate_chain_draws_from_the_whole_row_chain_law(order):
    """Whichever stages stand before or after top-k, the candidate path (or its refusal)
    draws each token with the whole-row chain's processed probability: top-n-sigma after
    top-k takes the top-k survivors' deviation, a top-p before top-k declines the path."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(10)) * 2
    settings = dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, top_n_sigma=0.8)
    settings = {name: value for name, value in settings.items() if name in order}
    params = fs.StepParams(6, V, order=order, seed=torch.arange(6), **settings)
    want = fs.process_step(logits, params)
    for step in range(5):
        out = fs.sample_step(logits, params=params, step=step)
        torch.testing.assert_close(out.probs, want.gather(1, out.token_ids), rtol=1e-5, atol=0)
