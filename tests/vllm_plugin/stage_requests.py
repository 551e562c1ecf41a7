"""Requests with fastsample's stages (``SamplingParams.extra_args["fastsample"]``) through a
vLLM engine: the checks both runners' tests run (``test_vllm_stages.py`` on the V1 runner,
``tests/vllm_mrv2/test_mrv2_stages.py`` on Model Runner V2).

* :func:`check_dry_and_xtc_act` -- one seeded request with DRY and XTC on a prompt that invites
  a repeat: its tokens are fastsample's own step replayed on the model's logits (so every
  stage ran, in the engine's loop, with the request's history and key); the same request
  without DRY repeats (the prompt invites it) and with DRY no token extends a repeat (DRY
  acting); the replay without XTC draws other tokens (XTC acting).
* :func:`check_every_stage_is_batch_invariant` -- a seeded request with every stage on,
  mirostat and XTC included, draws the same tokens alone and among neighbours that join and
  leave with other stages and windows, its context outgrowing the history's first width,
  and those tokens are the replay's.
* :func:`check_the_history_widens_with_the_context` -- no-repeat n-grams still see a prompt's
  first tokens once the context outgrew the history's first width.
* :func:`check_bad_settings_are_the_requests_error` -- a bad entry is vLLM's validation error
  for that request, naming the setting, and the engine serves on.
* with speculative decoding (``test_vllm_speculative.py``, ``test_mrv2_verification.py``):
  :func:`check_dry_with_drafts` -- a greedy request with DRY is verified by fastsample and
  equals the replay; :func:`check_mirostat_with_drafts` -- a request with mirostat is
  verified by fastsample and its tokens stay in mirostat's support.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm_helpers import VOCAB, generated, next_token_logits, tokens_prompt

import fastsample as fs
from fastsample.vllm import CALLS
from fastsample.vllm.request_stages import batch_settings, history_width
from fastsample.vllm.state import reset_calls

REPEAT_PROMPT = [7] * 12  # the test model's near-greedy continuation loops: 323 431 323 ...
DRY = {"dry_multiplier": 100.0, "dry_base": 1.75, "dry_allowed_length": 2}
XTC = {"xtc_probability": 1.0, "xtc_threshold": 0.1}
EVERY_STAGE = {
    "typical_p": 0.97, "epsilon_cutoff": 1e-4, "eta_cutoff": 1e-4, "top_n_sigma": 3.0,
    "xtc_probability": 0.5, "xtc_threshold": 0.1, "dynatemp_range": 0.3,
    "dynatemp_exponent": 1.5, "mirostat_tau": 4.0, "mirostat_eta": 0.2, "penalty_last_n": 16,
    "dry_multiplier": 0.8, "dry_allowed_length": 2, "dry_penalty_last_n": 32,
    "dry_sequence_breakers": [[2], [5, 6]], "no_repeat_ngram_size": 4,
}  # fmt: skip
CONTEXT = 256  # the test engines' max_model_len


def run(llm, prompts, params):
    return generated(llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False))


def replay(path: str, prompt: list[int], tokens: list[int], seed: int, temperature: float,
           stages: dict, logit_bias: dict[int, float] | None = None) -> list[int]:  # fmt: skip
    """The tokens fastsample's ``sample_step`` draws on the model's own logits (through
    transformers) after ``prompt`` and each prefix of ``tokens``, keyed ``(seed, position)``
    with the stages in vLLM's order: what the plugin must have drawn."""
    params = fs.StepParams(1, VOCAB, temperature=temperature, seed=seed, cut_order="vllm",
                           logit_bias=None if logit_bias is None else [logit_bias],
                           **batch_settings([stages], torch.device("cpu")))  # fmt: skip
    state = fs.TokenStats.from_prompts([prompt], VOCAB, history=history_width([stages], CONTEXT))
    logits = next_token_logits(path, [prompt + tokens[:i] for i in range(len(tokens))])
    drawn = []
    for i in range(len(tokens)):
        out = fs.sample_step(logits[i : i + 1].to(torch.float32), params=params, state=state,
                             step=torch.tensor([i]))  # fmt: skip
        state.update(out.token_ids, probs=out.probs, params=params)
        drawn.append(out.token_ids[0, 0].item())
        if drawn[-1] != tokens[i]:  # the rest would replay another context
            break
    return drawn


def dry_extensions(sequence: list[int], start: int, allowed: int) -> list[int]:
    """Positions ``i >= start`` whose token extends a repeat DRY penalizes: some ``j < i``
    holds the same token after the same ``allowed`` tokens (llama.cpp's rule, no breakers)."""
    found = []
    for i in range(max(start, allowed), len(sequence)):
        before = sequence[i - allowed : i]
        if any(sequence[j] == sequence[i] and sequence[j - allowed : j] == before
               for j in range(allowed, i)):  # fmt: skip
            found.append(i)
    return found


def check_dry_and_xtc_act(llm, path: str) -> None:
    reset_calls()
    seed, t = 1234, 0.1  # near greedy: the loop shows (greedy rows take no XTC, as llama.cpp)
    base = dict(temperature=t, seed=seed, max_tokens=24, ignore_eos=True)
    both = run(llm, [REPEAT_PROMPT], SamplingParams(**base, extra_args={"fastsample": DRY | XTC}))
    xtc_only = run(llm, [REPEAT_PROMPT], SamplingParams(**base, extra_args={"fastsample": XTC}))
    assert CALLS["sample"] == 48 and CALLS["delegated"] == 0
    n = len(REPEAT_PROMPT)
    # The prompt invites a repeat: without DRY the request extends repeats; with DRY (its
    # multiplier makes any penalized token lose) no token does.
    assert len(dry_extensions(REPEAT_PROMPT + xtc_only[0], n, 2)) >= 2
    assert dry_extensions(REPEAT_PROMPT + both[0], n, 2) == []
    # Every token is fastsample's own step's: the stages ran in the loop, with the request's
    # history, XTC's coin from its key, at each position.
    assert replay(path, REPEAT_PROMPT, both[0], seed, t, DRY | XTC) == both[0]
    assert replay(path, REPEAT_PROMPT, xtc_only[0], seed, t, XTC) == xtc_only[0]
    # XTC acted: without it the same key draws something else.
    assert replay(path, REPEAT_PROMPT, both[0], seed, t, DRY) != both[0]


def check_every_stage_is_batch_invariant(llm, path: str) -> None:
    seed, t = 99, 0.9
    # 56 + 20 tokens: the history (as wide as the contexts, from 64) widens mid-request.
    prompt = [5, 17, 3, 42, 9, 5, 17, 3] * 7
    params = SamplingParams(temperature=t, seed=seed, max_tokens=20, ignore_eos=True,
                            extra_args={"fastsample": EVERY_STAGE})  # fmt: skip
    alone = run(llm, [prompt], params)[0]
    # Neighbours with other stages and windows (the history's width changes as they come and
    # go), none, unseeded, greedy; finishing at different steps.
    neighbours = [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=9, ignore_eos=True,
                       extra_args={"fastsample": {"dry_multiplier": 1.0,
                                                  "dry_penalty_last_n": -1}}),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                       extra_args={"fastsample": {"no_repeat_ngram_size": 2}}),
        SamplingParams(temperature=1.2, max_tokens=6, ignore_eos=True,
                       extra_args={"fastsample": {"mirostat_tau": 2.0, "typical_p": 0.5}}),
    ]  # fmt: skip
    prompts = [[100, 200, 300], prompt, [7] * 12, [11, 12], [250, 3, 250, 3]]
    together = llm.generate([tokens_prompt(p) for p in prompts],
                            [neighbours[0], params, *neighbours[1:]], use_tqdm=False)  # fmt: skip
    assert generated(together)[1] == alone
    assert replay(path, prompt, alone, seed, t, EVERY_STAGE) == alone


def check_the_history_widens_with_the_context(llm, path: str) -> None:
    """The history starts as wide as the contexts (64 here) and widens as they grow: a
    bigram of the prompt's first tokens is still banned (no-repeat n-grams) once it lies more
    than 64 tokens back. A history stuck at 64 tokens lets 41 follow 40 at the 11th token."""
    prompt = [40, 41, 42, 43, *range(100, 156)]  # 60 tokens
    bias = dict.fromkeys((40, 41, 42, 43), 30.0)  # the model picks among these first
    stages = {"no_repeat_ngram_size": 2}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias=bias,
                            extra_args={"fastsample": stages})  # fmt: skip
    tokens = run(llm, [prompt], params)[0]
    assert replay(path, prompt, tokens, 0, 0.0, stages, bias) == tokens


BAD = [
    ({"dry_multipler": 1.0}, "dry_multipler"),
    ({"typical_p": 1.5}, "typical_p"),
    ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram_size"),
    ({"dry_multiplier": 1.0, "dry_sequence_breakers": [[VOCAB]]}, "dry_sequence_breakers"),
    ("dry", "dict"),
]


def check_bad_settings_are_the_requests_error(llm, path: str) -> None:
    from vllm.exceptions import VLLMValidationError

    for settings, named in BAD:
        params = SamplingParams(max_tokens=2, extra_args={"fastsample": settings})
        with pytest.raises(VLLMValidationError, match=named):
            run(llm, [[1, 2, 3]], params)
    assert len(run(llm, [[1, 2, 3]], SamplingParams(max_tokens=2))[0]) == 2


def check_dry_with_drafts(llm, path: str) -> None:
    """With speculative decoding (the engine's), a greedy request with DRY is verified by
    fastsample, and its tokens are the replay's: verification saw the drafts before each
    position as context, as the step after them would."""
    before = dict(CALLS)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                            extra_args={"fastsample": DRY})  # fmt: skip
    tokens = run(llm, [REPEAT_PROMPT], params)[0]
    assert CALLS["verify"] > before["verify"] and CALLS["delegated"] == before["delegated"]
    assert dry_extensions(REPEAT_PROMPT + tokens, len(REPEAT_PROMPT), 2) == []
    assert replay(path, REPEAT_PROMPT, tokens, 0, 0.0, DRY) == tokens


def along(path: str, prompt: list[int], tokens: list[int], temperature: float,
          stages: dict) -> list[float]:  # fmt: skip
    """Each token's probability under fastsample's processed distribution on the model's
    logits after ``prompt`` and the tokens before it, the state stepped by each (mirostat's
    ``mu`` by the token's probability): 0 for a token the stages exclude."""
    params = fs.StepParams(1, VOCAB, temperature=temperature, cut_order="vllm",
                           **batch_settings([stages], torch.device("cpu")))  # fmt: skip
    state = fs.TokenStats.from_prompts([prompt], VOCAB, history=history_width([stages], CONTEXT))
    logits = next_token_logits(path, [prompt + tokens[:i] for i in range(len(tokens))])
    probs = []
    for i, token in enumerate(tokens):
        p = fs.process_step(logits[i : i + 1].to(torch.float32), params, state=state)
        probs.append(p[0, token].item())
        state.update(torch.tensor([[token]]), probs=p[:, token : token + 1], params=params)
    return probs


MIROSTAT = {"mirostat_tau": 0.5, "mirostat_eta": 0.1}  # mu starts at 1: keeps p >= 1/2


def check_mirostat_with_drafts(llm, path: str) -> None:
    """With speculative decoding, a request with mirostat is verified by fastsample (its mu
    moved by each draft before a position, then by the emitted tokens): every token lies in
    the support of the steps along its tokens; without mirostat the same request draws
    tokens outside it (the stage acting)."""
    before = dict(CALLS)
    base = dict(temperature=1.0, seed=31, max_tokens=16, ignore_eos=True)
    prompt = [5, 17, 3, 42, 9]
    tokens = run(llm, [prompt], SamplingParams(**base, extra_args={"fastsample": MIROSTAT}))[0]
    assert CALLS["verify"] > before["verify"] and CALLS["delegated"] == before["delegated"]
    assert min(along(path, prompt, tokens, 1.0, MIROSTAT)) > 0
    plain = run(llm, [prompt], SamplingParams(**base))[0]
    assert min(along(path, prompt, plain, 1.0, MIROSTAT)) == 0


MODEL = "stages"
"""The checkpoint (``vllm_helpers.checkpoint``) the engines of these checks serve."""

ENGINE_CHECKS = {
    "dry and xtc act": check_dry_and_xtc_act,
    "every stage is batch-invariant": check_every_stage_is_batch_invariant,
    "the history widens with the context": check_the_history_widens_with_the_context,
    "bad settings are the request's error": check_bad_settings_are_the_requests_error,
}
"""The checks each runner's module runs on its own engine (``check(llm, path)``)."""
