"""Speculative decoding in fastsample.hf: exact (the joint law of the first two tokens is the
target's, at batch size 1 and in batches where rows accept different numbers of drafts),
greedy identical to model.generate, and the acceptance counts it reports.

Batch invariance of the speculative loop (a request's tokens alone and in a batch of 8) is
tested in test_hf_generate.py beside the plain loop's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from hf_models import first_two_law, left_pad, stub_model, tiny_llama, truncated_draft

import fastsample as fs
import fastsample.hf as fh
from fastsample.ops.seeds import Stream
from stattests import LawCase, assert_law, law_rejected

CONTROLS = dict(temperature=0.8, top_k=10, top_p=0.95)
PROMPTS = [[5, 17, 3, 42, 9], [8, 9], [30, 2, 2, 14], [61], [7, 6, 5, 4, 3, 2, 1],
           [12, 40, 12], [50, 51, 52, 53, 54, 55], [19, 33]]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=0, head_scale=15.0)
    return target, truncated_draft(target)


def two_token_counts(out: torch.Tensor, start: int, vocab: int) -> np.ndarray:
    pairs = out[:, start] * vocab + out[:, start + 1]
    return np.bincount(pairs.numpy(), minlength=vocab * vocab)


def biased(law: np.ndarray) -> np.ndarray:
    """2% of the mass moved to the least likely possible outcome."""
    out = law * 0.98
    kept = np.flatnonzero(law > 0)
    out[kept[np.argmin(law[kept])]] += 0.02
    return out


def test_batched_speculative_law_equals_the_targets(models):
    """8 prompts of different lengths (left-padded), each repeated 2,500 times with its own
    seeds, 3 drafts per round: rows accept different numbers of drafts and continue from
    caches with masked holes, and each prompt's first two tokens follow the target's joint
    law. At the same size the test rejects the draft's own law and a 2% bias."""
    target, draft = models
    vocab = target.config.vocab_size
    repeats = 2_500
    ids, mask = left_pad(PROMPTS)
    out = fh.generate(target, ids.repeat(repeats, 1), attention_mask=mask.repeat(repeats, 1),
                      assistant_model=draft, num_draft_tokens=3, do_sample=True,
                      max_new_tokens=2, seed=torch.arange(len(PROMPTS) * repeats),
                      return_dict_in_generate=True, **CONTROLS)
    acceptance = float(out.num_accepted.sum() / out.num_drafted.sum())
    assert 0.05 < acceptance < 0.95, acceptance  # both outcomes happen often
    rng = np.random.default_rng(1)
    for row, prompt in enumerate(PROMPTS):
        law = first_two_law(target, prompt, CONTROLS).numpy()
        counts = two_token_counts(out.sequences[row :: len(PROMPTS)], ids.shape[1], vocab)
        assert_law(counts, law, what=f"prompt {row}")
        if row == 0:
            draft_law = first_two_law(draft, prompt, CONTROLS).numpy()
            assert law_rejected(rng.multinomial(repeats, draft_law / draft_law.sum()), law)
            assert law_rejected(rng.multinomial(repeats, biased(law)), law)


def test_single_request_speculative_law_equals_the_targets(models):
    """Batch size 1: 400 separate calls with seeds 0..399. At this size the test still
    rejects the draft's law (what accepting every draft would give)."""
    target, draft = models
    vocab = target.config.vocab_size
    calls = 400
    prompt = PROMPTS[0]
    rows = [
        fh.generate(target, torch.tensor([prompt]), assistant_model=draft, num_draft_tokens=2,
                    do_sample=True, max_new_tokens=2, seed=[s], **CONTROLS)[0]
        for s in range(calls)
    ]
    counts = two_token_counts(torch.stack(rows), len(prompt), vocab)
    law = first_two_law(target, prompt, CONTROLS).numpy()
    assert_law(counts, law, what="batch size 1")
    draft_law = first_two_law(draft, prompt, CONTROLS).numpy()
    assert law_rejected(np.random.default_rng(2).multinomial(calls, draft_law), law)


# Requests of the equality test below: none allowed to differ, they detect a law 2.5% off on
# 10% of the mass (stattests.equality_bias); the law tests above detect ~85-400% here.
SAME_REQUESTS, SAME_DRAFTS, SAME_PROMPT = 2048, 3, 5


def test_first_round_equals_fastsample_with_the_same_seeds():
    """The loop's first round, bitwise, is fastsample called directly with the request's seed:
    ``sample_from_probs`` drafts (``Stream.DRAFT``, step = the drafted token's position) from
    the draft's processed distribution, then ``verify_chain`` (step = the first draft's
    position) on the target's; every token it emits is in the output. Stub models (logits =
    a table row per token plus one per position) make the logits the loop saw computable
    here. So the loop's law is verify_chain's, which tests/verify/test_chain.py judges at full
    power."""
    target, draft = stub_model(seed=5), stub_model(seed=6)
    gen = torch.Generator().manual_seed(9)
    vocab = target.config.vocab_size
    prompts = torch.randint(1, vocab, (SAME_REQUESTS, SAME_PROMPT), generator=gen)
    seeds = torch.randint(0, 2**62, (SAME_REQUESTS,), generator=gen)
    k, count = SAME_DRAFTS, SAME_PROMPT  # count: the real tokens so far
    out = fh.generate(target, prompts, assistant_model=draft, num_draft_tokens=k,
                      do_sample=True, max_new_tokens=k + 1, seed=seeds, **CONTROLS)

    def logits(model, tokens, position):
        return model.token_table[tokens] + model.position_table[position]

    last, drafts, draft_probs = prompts[:, -1], [], []
    for i in range(k):  # the draft's token after `last`, x_0, ... at positions count - 1 + i
        q = fs.process(logits(draft, last if i == 0 else drafts[-1], count - 1 + i), **CONTROLS)
        drafts.append(fs.sample_from_probs(q, seed=seeds, step=count + i,
                                           stream=Stream.DRAFT).token_ids[:, 0])
        draft_probs.append(q)
    fed = torch.stack([last, *drafts], 1)
    target_logits = logits(target, fed, count - 1 + torch.arange(k + 1)).view(-1, vocab)
    target_probs = fs.process(target_logits, **CONTROLS).view(SAME_REQUESTS, k + 1, vocab)
    verdict = fs.verify_chain(target_probs, torch.stack(drafts, 1), torch.stack(draft_probs, 1),
                              seed=seeds, step=count)
    emitted = torch.arange(k + 1) <= verdict.num_accepted[:, None]
    got = out[:, SAME_PROMPT:]
    assert torch.equal(torch.where(emitted, got, -1), torch.where(emitted, verdict.token_ids, -1))
    assert 0 < int(verdict.num_accepted.sum()) < k * SAME_REQUESTS  # both outcomes happen


def test_speculative_greedy_equals_model_generate(models):
    """do_sample=False: the target's greedy tokens exactly, whatever the draft proposed,
    in a left-padded batch, with an EOS token that stops one row early."""
    target, draft = models
    ids, mask = left_pad([[4, 8, 15, 16, 23, 42], [7, 7], [9, 3, 11]])
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    got = fh.generate(target, ids, attention_mask=mask, assistant_model=draft,
                      do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected)
    assert 0 < int(got.num_accepted.sum()) < int(got.num_drafted.sum())  # holes were made

    eos = int(expected[1, ids.shape[1] + 3])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=eos)
    expected = target.generate(ids, **kwargs)
    got = fh.generate(target, ids, assistant_model=draft, num_draft_tokens=5, **kwargs)
    assert torch.equal(got, expected)


def test_a_draft_equal_to_the_target_is_always_accepted(models):
    target, _ = models
    ids, mask = left_pad(PROMPTS)
    out = fh.generate(target, ids, attention_mask=mask, assistant_model=target,
                      do_sample=True, max_new_tokens=11, seed=list(range(8)),
                      num_draft_tokens=4, return_dict_in_generate=True, **CONTROLS)
    assert out.sequences.shape == (8, ids.shape[1] + 11)
    assert torch.equal(out.num_drafted, torch.full((8,), 12))  # 3 rounds of 4 drafts
    assert int(out.num_accepted.sum()) >= 8 * 12 - 2  # float rounding may reject one or two


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "speculative"])
def test_processors_see_each_rows_own_context(models, draft):
    """Greedy decoding with processors that read the sequence (repetition penalty, no-repeat
    n-grams, min_new_tokens against an EOS the model favours) equals model.generate token for
    token, in a left-padded batch where speculative rows run ahead of each other."""
    target, draft_model = models
    ids, mask = left_pad([[4, 8, 15, 16, 23, 42], [7, 7], [9, 3, 11]])
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=14,
                  repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=6,
                  eos_token_id=int(free[0, -1]))
    expected = target.generate(ids, **kwargs)
    extra = dict(assistant_model=draft_model, num_draft_tokens=3) if draft else {}
    assert torch.equal(fh.generate(target, ids, **extra, **kwargs), expected)


def test_another_architecture_gpt2():
    """Nothing here is Llama-specific: a GPT-2 (learned absolute positions) decodes greedily
    like model.generate, plain and with a truncated copy as the draft."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                        pad_token_id=0, bos_token_id=None, eos_token_id=None)
    target = GPT2LMHeadModel(config).eval()
    draft = GPT2LMHeadModel(GPT2Config(**{**config.to_dict(), "n_layer": 1})).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    ids, mask = left_pad([[5, 6], [7, 8, 9, 10], [3, 1, 4]])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=10)
    expected = target.generate(ids, **kwargs)
    assert torch.equal(fh.generate(target, ids, **kwargs), expected)
    assert torch.equal(fh.generate(target, ids, assistant_model=draft, **kwargs), expected)


# ----------------------------------------------------------------------------- the registry


def law_cases():
    """The laws judged here, their sizes and claims: ``stattests.detectable_bias`` rounded up
    (tests/test_power.py checks them)."""
    import functools

    from stattests import equality_bias

    @functools.cache
    def law(row: int) -> np.ndarray:
        with torch.random.fork_rng(devices=[]):  # tiny_llama seeds torch's global generator
            target = tiny_llama(seed=0, head_scale=15.0)
        return first_two_law(target, PROMPTS[row], CONTROLS).numpy()

    carriers = (
        "tokens bitwise sample_from_probs' drafts and verify_chain's with the same seeds "
        "(tests/hf/test_hf_speculative.py::test_first_round_equals_fastsample_with_the_same_"
        f"seeds, {SAME_REQUESTS} requests, detect {equality_bias([(SAME_REQUESTS, 0)]):.1%} "
        "on 10% of the mass) on processed distributions transformers' warpers' "
        "(tests/hf/test_hf_generate.py::test_tokens_equal_fastsample_sample_with_the_same_seeds); "
        "verify_chain's law test: "
        "tests/verify/test_chain.py::test_chain_law_with_draft_probs; a "
        "speculative loop per draw costs too much for more here"
    )
    claims = [0.96, 0.84, 1.05, 0.95, 0.87, 0.94, 0.90, 0.89]  # 2,500 draws per prompt
    for row, claim in enumerate(claims):
        yield LawCase(
            f"batched speculative prompt {row}: first two tokens", functools.partial(law, row),
            2_500, claim, carriers,
        )  # fmt: skip
    yield LawCase("single request: first two tokens", functools.partial(law, 0), 400, 4.0, carriers)
