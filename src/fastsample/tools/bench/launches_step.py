"""The engine step's calls for ``bench --launches``: a full step and the state update.

:func:`step_calls` gives :mod:`.launches` a ``sample_step`` with every stage on (a grammar
bitmask, allowed ids, logit bias, min-tokens, the three penalties as ``(B,)`` tensors, the
four controls), seeded with tensors, with top-5 logprobs, ranks and requested ids, in the
processed and the raw mode; the same with every truncation stage of the sampler chain on
(llama.cpp's order), then with the history stages (DRY, no-repeat n-grams, windowed
penalties) too; and the ``TokenStats.update`` after it. Issue budget on the Triton backend: 3
for the step (stages, controls or chain, and draw kernels), 1 for the update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...stages import StepParams, TokenStats, sample_step


def step_calls(
    batch: int, vocab: int, device: torch.device
) -> list[tuple[str, Callable[[], object]]]:
    """``(label, call)`` for the step and the update, on fresh random input."""
    gen = torch.Generator(device=device).manual_seed(3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, device=device, generator=gen)

    def ids(*shape: int) -> torch.Tensor:
        return torch.randint(-1, vocab, shape, device=device, generator=gen)

    logits = torch.randn(batch, vocab, device=device, generator=gen) * 2
    words = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32,
                          device=device, generator=gen) | 0x00FF00FF  # fmt: skip
    stats = TokenStats.from_prompts(ids(batch, 30), vocab, max_output_tokens=1000)
    emitted = ids(batch, 1)
    seeds = torch.arange(batch, device=device)
    settings = dict(
        device=device, temperature=rand(batch) + 0.3,
        top_k=torch.full((batch,), 50, device=device), top_p=rand(batch) * 0.5 + 0.5,
        min_p=torch.full((batch,), 0.02, device=device), repetition_penalty=rand(batch) + 0.6,
        frequency_penalty=rand(batch) - 0.5, presence_penalty=rand(batch) - 0.5,
        logit_bias=(ids(batch, 4), torch.randn(batch, 4, device=device, generator=gen)),
        min_tokens=torch.full((batch,), 2, device=device), stop_token_ids=ids(batch, 2),
        allowed_token_ids=ids(batch, vocab // 2), seed=seeds, top_logprobs=5,
        token_ranks=True, logprob_token_ids=ids(batch, 3),
    )  # fmt: skip
    calls = []
    for mode in ("processed", "raw"):
        params = StepParams(batch, vocab, logprobs_mode=mode, **settings)  # type: ignore[arg-type]

        def call(params: StepParams = params) -> object:
            return sample_step(logits, params=params, state=stats, step=seeds,
                               token_bitmask=words)  # fmt: skip

        label = (f"sample_step(every stage, tensors, top-5 {mode} logprobs, ranks, requested "
                 "ids, seed=, step= tensors)")  # fmt: skip
        calls.append((label, call))
    # The sampler chain: every truncation stage on, llama.cpp's order (the chain kernel takes
    # the controls kernel's place), then the history stages too (in the stages kernel).
    chain = dict(settings, typical_p=torch.full((batch,), 0.95, device=device),
                 epsilon_cutoff=1e-4, eta_cutoff=1e-4, top_n_sigma=rand(batch) + 2.0,
                 xtc_probability=rand(batch), xtc_threshold=0.1, dynatemp_range=0.3,
                 mirostat_tau=torch.full((batch,), 5.0, device=device),
                 order="llama.cpp")  # fmt: skip
    chain_stats = TokenStats.from_prompts(ids(batch, 30), vocab, max_output_tokens=1000,
                                          history=64)  # fmt: skip
    params = StepParams(batch, vocab, **chain)  # type: ignore[arg-type]
    calls.append((
        "sample_step(every stage, every chain stage: typical, epsilon, eta, top-n-sigma, XTC, "
        "dynamic temperature, mirostat; llama.cpp order, top-5 logprobs, ranks, requested ids)",
        lambda: sample_step(logits, params=params, state=chain_stats, step=seeds,
                            token_bitmask=words),
    ))  # fmt: skip
    history = StepParams(batch, vocab, dry_multiplier=0.8, no_repeat_ngram_size=3,
                         penalty_last_n=32, **chain)  # type: ignore[arg-type]
    calls.append((
        "the same with DRY, no-repeat 3-grams and penalty_last_n=32 (history of 64)",
        lambda: sample_step(logits, params=history, state=chain_stats, step=seeds,
                            token_bitmask=words),
    ))  # fmt: skip
    calls.append(("TokenStats.update(token_ids (B, 1))", lambda: stats.update(emitted)))
    return calls
