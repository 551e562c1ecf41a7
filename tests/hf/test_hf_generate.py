"""fastsample.hf.generate, the plain loop: exact against transformers' own warpers, greedy
identical to model.generate, per-request seeds independent of the batch, and generate's
controls (processors, stopping, EOS, streamer, num_return_sequences, return types)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from hf_models import first_two_law, left_pad, next_token_law, stub_model, tiny_llama, warpers
from transformers.generation import GenerationMixin
from transformers.generation.logits_process import LogitsProcessor
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

import fastsample as fs
import fastsample.hf as fh
from fastsample.ops.seeds import Stream
from stattests import LawCase, assert_law, equality_bias, law_rejected

PROMPT = [5, 17, 3, 42, 9]
DRAWS = 20_000
CONTROLS = [
    dict(temperature=0.8, top_k=10, top_p=0.95),
    dict(temperature=1.3, min_p=0.02),
]


@pytest.fixture(scope="module")
def law_model():
    return tiny_llama(seed=0, head_scale=15.0)


def biased(law: np.ndarray) -> np.ndarray:
    """The negative control's law: 2% of the mass moved to the least likely kept outcome."""
    out = law * 0.98
    kept = np.flatnonzero(law > 0)
    out[kept[np.argmin(law[kept])]] += 0.02
    return out


# typical-p, epsilon and eta (issue 37): transformers' warpers, fastsample's sample_step.
CHAIN_CONTROLS = [
    dict(temperature=0.9, top_k=20, typical_p=0.7),
    dict(temperature=1.2, top_k=64, epsilon_cutoff=0.01, eta_cutoff=0.02),  # top-k off (V=64)
]


@pytest.mark.parametrize("controls", CONTROLS + CHAIN_CONTROLS,
                         ids=["T-topk-topp", "T-minp", "T-topk-typical", "T-epsilon-eta"])
def test_first_two_tokens_follow_transformers_warpers(law_model, controls):
    """DRAWS requests of one prompt, one seed each: the first token's law and the joint law
    of the first two match the model's logits through transformers' warpers (p < 1e-6 false
    alarm); the same test rejects a 2%-biased law at the same number of draws."""
    vocab = law_model.config.vocab_size
    prompt = torch.tensor([PROMPT]).expand(DRAWS, -1)
    out = fh.generate(law_model, prompt, do_sample=True, max_new_tokens=2,
                      seed=torch.arange(DRAWS), **controls)
    first, second = out[:, len(PROMPT)], out[:, len(PROMPT) + 1]
    joint = first_two_law(law_model, PROMPT, controls).numpy()
    first_law = next_token_law(law_model, PROMPT, controls).numpy()
    first_counts = np.bincount(first.numpy(), minlength=vocab)
    joint_counts = np.bincount((first * vocab + second).numpy(), minlength=vocab * vocab)
    assert_law(first_counts, first_law, what="first token")
    assert_law(joint_counts, joint, what="first two tokens")
    assert (first_law > 0).sum() >= 4, "controls left too few tokens for a meaningful test"

    rng = np.random.default_rng(0)
    assert law_rejected(rng.multinomial(DRAWS, biased(first_law)), first_law)
    assert law_rejected(rng.multinomial(DRAWS, biased(joint)), joint)


# Requests (8 prompts, left-padded, each repeated) x new tokens of the equality test below:
# 3,072 draws per setting, none allowed to differ, detect a law 2% off on 10% of the mass
# (the law test above detects ~25-35% at its size; law_cases).
SAME_REPEATS, SAME_TOKENS = 128, 3


@pytest.mark.parametrize("controls", CONTROLS, ids=["T-topk-topp", "T-minp"])
def test_tokens_equal_fastsample_sample_with_the_same_seeds(law_model, controls):
    """Every token the loop draws is ``fastsample.sample``'s, bitwise, called directly on the
    logits the loop saw with the request's seed, its position as ``step`` and
    ``Stream.SAMPLE``; and what it samples from (``fastsample.process``) is transformers'
    warpers' law on those logits. So the loop's law is fastsample.sample's, which
    tests/test_controls.py judges at full power."""
    ids, mask = left_pad(PROMPTS)
    ids, mask = ids.repeat(SAME_REPEATS, 1), mask.repeat(SAME_REPEATS, 1)
    seeds = torch.randint(0, 2**62, (ids.shape[0],), generator=torch.Generator().manual_seed(8))
    out = fh.generate(law_model, ids, attention_mask=mask, do_sample=True,
                      max_new_tokens=SAME_TOKENS, seed=seeds, return_dict_in_generate=True,
                      output_logits=True, **controls)
    controls = {"top_k": 50, **controls}  # transformers' default top_k applies if none is given
    for t, logits in enumerate(out.logits):
        position = mask.sum(-1) + t  # the request's real tokens before this one
        want = fs.sample(logits, **controls, seed=seeds, step=position, stream=Stream.SAMPLE)
        assert torch.equal(out.sequences[:, ids.shape[1] + t], want.token_ids[:, 0]), t
        theirs = torch.softmax(warpers(**controls)(out.sequences, logits).double(), -1)
        ours = fs.process(logits, **controls).double()
        assert torch.equal(ours > 0, theirs > 0), t
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_greedy_equals_model_generate_token_for_token():
    model = tiny_llama(seed=1)
    ids, mask = left_pad([[4, 8, 15, 16, 23, 42], [7, 7], [9, 3, 11]])
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    got = fh.generate(model, ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    assert torch.equal(got, expected)


def test_greedy_with_eos_and_stopping_criteria_equals_model_generate():
    model = tiny_llama(seed=1)
    ids, mask = left_pad([[4, 8, 15, 16, 23, 42], [7, 7], [9, 3, 11]])
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    eos = int(free[0, ids.shape[1] + 2])  # row 0 ends early, the others when they meet it

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == int(free[1, -3])

    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=10, eos_token_id=eos,
                  stopping_criteria=[StopAfter()])
    assert torch.equal(fh.generate(model, ids, **kwargs), model.generate(ids, **kwargs))


PROMPTS = [[3], [5, 9, 2, 7, 1, 8, 8], [4, 4], [6, 1, 3, 9, 12], [10, 20, 30],
           [11, 12, 13, 14, 15, 16, 17, 18, 19], [2, 2, 2, 2], [30, 31, 32, 33, 34, 35]]
SEEDS = [101, 7, 33, 2**40 + 5, 0, 9, 123456789, 42]


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "speculative"])
def test_each_request_draws_the_same_tokens_alone_and_in_a_batch(draft):
    """With a stub model whose logits depend on a row's own token and position only, every
    request's tokens with its seed are identical alone and in a batch of 8 prompts of other
    lengths (left-padded), plain and speculative."""
    model = stub_model(seed=3)
    extra = dict(assistant_model=stub_model(seed=4)) if draft else {}
    ids, mask = left_pad(PROMPTS)
    batch = fh.generate(model, ids, attention_mask=mask, do_sample=True, top_k=20,
                        max_new_tokens=9, seed=SEEDS, **extra)
    for row, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS, strict=True)):
        alone = fh.generate(model, torch.tensor([prompt]), do_sample=True, top_k=20,
                            max_new_tokens=9, seed=[seed], **extra)
        assert torch.equal(batch[row, ids.shape[1]:], alone[0, len(prompt):]), row


class BanToken(LogitsProcessor):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


def test_user_processors_run_before_fastsample_controls(law_model):
    """Banning the most likely token with a user processor, then top_k=1, leaves the second
    most likely token: processors first, then fastsample's top-k."""
    law = next_token_law(law_model, PROMPT, {})
    best, second = law.topk(2).indices.tolist()
    out = fh.generate(law_model, torch.tensor([PROMPT]), do_sample=True, top_k=1,
                      max_new_tokens=1, seed=[1], logits_processor=[BanToken(best)])
    assert int(out[0, -1]) == second


def test_plugs_into_model_generate_as_custom_generate(law_model):
    """Through model.generate(custom_generate=...): with seed= passed along where
    transformers forwards a custom loop's own keywords (5.x), bound with functools.partial
    everywhere (4.56 rejects keywords it does not know)."""
    ids, mask = left_pad([PROMPT, [8, 9]])
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=0.9, max_new_tokens=6)
    direct = fh.generate(law_model, ids, seed=[5, 6], **kwargs)
    bound = functools.partial(fh.generate, seed=[5, 6])
    assert torch.equal(law_model.generate(ids, custom_generate=bound, **kwargs), direct)
    if hasattr(GenerationMixin, "_extract_generation_mode_kwargs"):
        plugged = law_model.generate(ids, custom_generate=fh.generate, seed=[5, 6], **kwargs)
        assert torch.equal(plugged, direct)


def test_num_return_sequences_copies_and_return_dict(law_model):
    out = fh.generate(law_model, torch.tensor([PROMPT, [8, 9, 10, 11, 12]]), do_sample=True,
                      max_new_tokens=8, num_return_sequences=3, seed=[5, 6],
                      return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert out.sequences.shape == (6, len(PROMPT) + 8)
    assert len(out.scores) == 8 and out.scores[0].shape == (6, law_model.config.vocab_size)
    assert len(out.logits) == 8
    # Copy 0 of a prompt is the request itself; the copies are independent draws.
    single = fh.generate(law_model, torch.tensor([PROMPT]), do_sample=True, max_new_tokens=8,
                         seed=[5])
    assert torch.equal(out.sequences[0], single[0])
    assert len({tuple(r) for r in out.sequences[:3].tolist()}) == 3
    # Scores are the log-probabilities sampled from: each drawn token is possible.
    drawn = out.sequences[:, len(PROMPT)]
    assert torch.isfinite(out.scores[0].gather(1, drawn[:, None])).all()


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "speculative"])
def test_streamer_sees_the_prompt_then_every_token(law_model, draft):
    streamer = Collect()
    extra = dict(assistant_model=tiny_llama(seed=0, layers=1, head_scale=15.0)) if draft else {}
    out = fh.generate(law_model, torch.tensor([PROMPT]), do_sample=True, max_new_tokens=7,
                      seed=[3], streamer=streamer, **extra)
    assert streamer.chunks[0] == PROMPT and streamer.ended
    assert [t for chunk in streamer.chunks[1:] for t in chunk] == out[0, len(PROMPT):].tolist()


def test_seed_none_follows_torch_manual_seed(law_model):
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(fh.generate(law_model, torch.tensor([PROMPT]), do_sample=True,
                                max_new_tokens=6))
    assert torch.equal(*runs)


def test_dry_and_xtc_run_through_the_loop_and_dry_acts():
    """One request with DRY and XTC on, against the same request with XTC alone: its prompt
    repeats "5 6 7 8 9", so after "... 5 6 7" token 8 would extend a 10-token repeat. DRY takes
    ``multiplier * base ** (10 - allowed)`` off its logit, and nothing off the others (their
    odds against each other are unchanged); the drawn tokens never continue the cycle."""
    model = tiny_llama(seed=0, head_scale=15.0)
    prompt = torch.tensor([[5, 6, 7, 8, 9] * 2 + [5, 6, 7]])
    xtc = dict(xtc_probability=1.0, xtc_threshold=0.02)
    dry = dict(dry_multiplier=0.5, dry_base=1.5, dry_allowed_length=2)
    runs = [fh.generate(model, prompt, do_sample=True, max_new_tokens=6, seed=11,
                        return_dict_in_generate=True, output_scores=True, **xtc, **extra)
            for extra in ({}, dry)]  # fmt: skip
    plain, with_dry = (run.scores[0][0].double() for run in runs)
    kept = torch.isfinite(plain) & torch.isfinite(with_dry)
    others = kept.clone()
    others[8] = False
    shift = (with_dry - plain)[others]
    torch.testing.assert_close(shift, shift[:1].expand_as(shift), atol=1e-5, rtol=0)
    penalty = 0.5 * 1.5 ** (10 - 2)
    if kept[8]:
        assert (with_dry - plain)[8].item() == pytest.approx(shift[0].item() - penalty, abs=1e-3)
    else:
        assert torch.isfinite(plain[8]) and not torch.isfinite(with_dry[8])
    assert runs[0].sequences.shape == runs[1].sequences.shape == (1, 19)


def test_rejects_what_it_does_not_implement(law_model):
    with pytest.raises(NotImplementedError, match="top_h"):
        fh.generate(law_model, torch.tensor([PROMPT]), do_sample=True, top_h=0.5,
                    max_new_tokens=2)
    with pytest.raises(ValueError, match="one each"):
        fh.generate(law_model, torch.tensor([PROMPT]), do_sample=True, max_new_tokens=2,
                    seed=[1, 2])


def test_real_model_texts_differ_in_a_batch_only_where_its_logits_did():
    """On a real (tiny) Llama the forward pass may round differently in another batch shape;
    fastsample adds nothing: wherever a request's tokens alone and in the batch part, the
    logits it sampled from already differed at that step (bitwise), and before it they match
    token for token."""
    model = tiny_llama(seed=2, head_scale=15.0)
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(do_sample=True, max_new_tokens=16, return_dict_in_generate=True,
                  output_logits=True)
    batch = fh.generate(model, ids, attention_mask=mask, seed=SEEDS, **kwargs)
    agree = 0
    for row, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS, strict=True)):
        alone = fh.generate(model, torch.tensor([prompt]), seed=[seed], **kwargs)
        mine, theirs = batch.sequences[row, ids.shape[1]:], alone.sequences[0, len(prompt):]
        differ = torch.nonzero(mine != theirs).flatten()
        if differ.numel() == 0:
            agree += 1
            continue
        step = int(differ[0])
        assert not torch.equal(batch.logits[step][row], alone.logits[step][0]), (row, step)
    print(f"{agree} of {len(PROMPTS)} requests drew identical texts alone and in the batch")


# ----------------------------------------------------------------------------- the registry


def law_cases():
    """The laws judged here, their sizes and claims: ``stattests.detectable_bias`` rounded up
    (tests/test_power.py checks them)."""
    import functools

    @functools.cache
    def laws(which: int) -> tuple[np.ndarray, np.ndarray]:
        with torch.random.fork_rng(devices=[]):  # tiny_llama seeds torch's global generator
            model = tiny_llama(seed=0, head_scale=15.0)
        controls = CONTROLS[which]
        return next_token_law(model, PROMPT, controls).numpy(), first_two_law(
            model, PROMPT, controls
        ).numpy()

    draws = len(PROMPTS) * SAME_REPEATS * SAME_TOKENS
    carriers = (
        "tokens bitwise fastsample.sample's with the same seeds and processed distributions "
        "transformers' warpers' (tests/hf/test_hf_generate.py::test_tokens_equal_fastsample_"
        f"sample_with_the_same_seeds, {draws} draws per setting, detect "
        f"{equality_bias([(draws, 0)]):.1%} on 10% of the mass); fastsample.sample's law test: "
        "tests/test_controls.py::test_sample_frequencies_match_reference; a generate loop per "
        "draw costs too much for more here"
    )
    claims = {(0, 0): 0.25, (0, 1): 0.34, (1, 0): 0.33, (1, 1): 0.36}
    for which, name in enumerate(("T-topk-topp", "T-minp")):
        for part, label in ((0, "first token"), (1, "first two tokens")):

            def law(which=which, part=part) -> np.ndarray:
                return laws(which)[part]

            claim = claims[which, part]
            yield LawCase(f"generate {name}: {label}", law, DRAWS, claim, carriers)
