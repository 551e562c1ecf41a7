"""``python -m fastsample bench --generate``: text generation with transformers, end to end.

Models (random weights, built from a config, nothing downloaded): a Llama-style target of a
few layers and a 1-layer draft that is a truncated copy of it (its embeddings, first layer,
final norm and head), so the draft agrees with the target often enough for speculative
decoding to pay. Two scalings make the random models behave more like trained ones: the
output head's (``head_scale``) makes next-token laws peaked (about 3 nats of entropy at
temperature 0.8 instead of nearly uniform: top-k sets of near-uniform laws barely overlap,
so nothing would be accepted), and the token embeddings' (``embed_scale``) makes each layer
a perturbation of the residual stream (at the default scale the random layers dominate it,
and a 1-layer copy agrees with the target no better than chance). Both are tuned per model
size so that the draft's acceptance is ~0.7, like a good draft model's. No EOS: every row
generates exactly ``new_tokens`` tokens.

Contenders, all with the same sampling config (``do_sample=True``, temperature 0.8,
top-k 50, top-p 0.95):

* ``hf.sample``: transformers' own ``model.generate`` (warpers and ``torch.multinomial``);
* ``fs.sample``: :func:`fastsample.hf.generate`, the plain loop (per-request seeds);
* ``hf.assisted``: transformers' assisted generation with the draft (batch size 1 only,
  ``num_assistant_tokens`` fixed at the same ``K``, no confidence cut-off);
* ``fs.speculative``: :func:`fastsample.hf.generate` with ``assistant_model=``, ``K``
  drafts per round, verified by :func:`fastsample.verify_chain`, at every batch size.

Columns: median seconds per ``generate`` call, generated tokens per second (all rows),
tokens per target forward pass per row (counted with a forward hook; the prefill counts as
one), and the draft acceptance rate: fastsample reports accepted/drafted exactly;
transformers does not report it, so its rate is estimated from the passes as
``(tokens per pass - 1) / K``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .harness import Timing, pick_device, time_interleaved
from .report import machine_info, save_json

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95)


@dataclass(frozen=True)
class Setup:
    """The models and the generation job."""

    vocab: int = 8192
    hidden: int = 512
    layers: int = 8
    draft_layers: int = 1
    prompt: int = 32
    new_tokens: int = 64
    draft_tokens: int = 4
    embed_scale: float = 100.0
    head_scale: float = 8.0
    batches: tuple[int, ...] = (1, 8)


QUICK = Setup(hidden=128, layers=4, new_tokens=32, embed_scale=10.0, head_scale=16.0)


@dataclass
class GenerateResult:
    """One row of the table."""

    contender: str
    batch: int
    median_s: float
    tokens_per_s: float
    tokens_per_pass: float
    acceptance: float | None
    acceptance_estimated: bool
    repeats: int


def build_models(setup: Setup, device: torch.device) -> tuple[Any, Any]:
    """The random target and its truncated copy as the draft, in eval mode on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=setup.vocab,
        hidden_size=setup.hidden,
        intermediate_size=setup.hidden * 8 // 3,
        num_hidden_layers=setup.layers,
        num_attention_heads=max(setup.hidden // 64, 1),
        num_key_value_heads=max(setup.hidden // 128, 1),
        max_position_embeddings=4 * (setup.prompt + setup.new_tokens),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(setup.embed_scale)
        target.lm_head.weight.mul_(setup.head_scale)
    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": setup.draft_layers})
    draft = LlamaForCausalLM(draft_config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # the target's first layers
    for model in (target, draft):
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
    return target.to(device), draft.to(device)


class PassCounter:
    """Counts a model's forward calls (a forward pre-hook)."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1


def contenders(setup: Setup, target: Any, draft: Any, device: torch.device) -> dict[str, Any]:
    """``name -> (batch, call)``; each call returns the acceptance it knows, or None."""
    from ...hf import generate as hf_generate

    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, setup.vocab, (max(setup.batches), setup.prompt),
                            generator=generator).to(device)
    common = dict(max_new_tokens=setup.new_tokens, **SAMPLING)
    table: dict[str, Any] = {}
    for batch in setup.batches:
        ids = prompts[:batch]
        seeds = list(range(batch))
        table[f"hf.sample B={batch}"] = (
            batch, _call(lambda ids=ids: target.generate(ids, **common))
        )
        table[f"fs.sample B={batch}"] = (
            batch, _call(lambda ids=ids, s=seeds: hf_generate(target, ids, seed=s, **common))
        )
        if batch == 1:
            table["hf.assisted B=1"] = (batch, _call(lambda ids=ids: target.generate(
                ids, assistant_model=draft, num_assistant_tokens=setup.draft_tokens,
                num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
                **common)))
        table[f"fs.speculative B={batch}"] = (batch, _speculative_call(
            lambda ids=ids, s=seeds: hf_generate(
                target, ids, seed=s, assistant_model=draft, num_draft_tokens=setup.draft_tokens,
                return_dict_in_generate=True, **common)))
    return table


def _call(fn: Callable[[], Any]) -> Callable[[], float | None]:
    def run() -> float | None:
        fn()
        return None

    return run


def _speculative_call(fn: Callable[[], Any]) -> Callable[[], float | None]:
    def run() -> float | None:
        out = fn()
        return float(out.num_accepted.sum()) / max(float(out.num_drafted.sum()), 1.0)

    return run


def measure(setup: Setup, device: torch.device, timing: Timing) -> list[GenerateResult]:
    """Time every contender (round-robin) and count its target passes once."""
    target, draft = build_models(setup, device)
    counter = PassCounter(target)
    table = contenders(setup, target, draft, device)
    results = []
    passes: dict[str, tuple[int, float | None]] = {}
    for name, (_, call) in table.items():  # one counted run each (also a warm-up)
        before = counter.count
        acceptance = call()
        passes[name] = (counter.count - before, acceptance)
    with torch.no_grad():
        seconds = time_interleaved({n: c for n, (_, c) in table.items()}, device, timing)
    for name, (batch, _) in table.items():
        median = statistics.median(seconds[name])
        count, acceptance = passes[name]
        per_pass = setup.new_tokens / max(count, 1)
        estimated = acceptance is None and name.startswith("hf.assisted")
        if estimated:
            acceptance = (per_pass - 1) / setup.draft_tokens
        results.append(GenerateResult(
            name, batch, median, batch * setup.new_tokens / median, per_pass, acceptance,
            estimated, len(seconds[name])))
    return results


def print_table(results: list[GenerateResult], setup: Setup) -> None:
    header = (f"{'contender':<22} {'median s':>9} {'tokens/s':>10} {'vs hf.sample':>13} "
              f"{'tokens/pass':>12} {'acceptance':>11}")
    print(header)
    print("-" * len(header))
    baseline = {r.batch: r.tokens_per_s for r in results if r.contender.startswith("hf.sample")}
    for r in results:
        ratio = r.tokens_per_s / baseline[r.batch] if r.batch in baseline else None
        accept = "-" if r.acceptance is None else f"{'~' if r.acceptance_estimated else ''}" \
            f"{r.acceptance:.2f}"
        print(f"{r.contender:<22} {r.median_s:>9.3f} {r.tokens_per_s:>10.1f} "
              f"{'-' if ratio is None else f'{ratio:.2f}x':>13} {r.tokens_per_pass:>12.2f} "
              f"{accept:>11}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m fastsample bench --generate``."""
    try:
        import transformers
    except ImportError:
        print("bench --generate needs transformers: pip install 'fastsample[hf]'")
        return 2
    device = pick_device(args.device)
    setup = QUICK if args.quick else Setup()
    repeats = args.repeats or (3 if args.quick else 5)
    timing = Timing(warmup=0, min_repeats=min(3, repeats), max_repeats=repeats,
                    budget_s=0.0 if args.budget is None else args.budget)
    info = machine_info(device)
    print(f"fastsample bench --generate: torch {info['torch']}, transformers "
          f"{transformers.__version__}, {info['device_name']} ({device}), "
          f"{info['torch_threads']} threads")
    print(f"target: Llama {setup.layers} layers, hidden {setup.hidden}, vocab {setup.vocab}; "
          f"draft: its first {setup.draft_layers} layer(s); prompt {setup.prompt}, "
          f"{setup.new_tokens} new tokens, K={setup.draft_tokens}; sampling {SAMPLING}; "
          f"median of {timing.min_repeats}-{timing.max_repeats} calls\n")
    results = measure(setup, device, timing)
    print_table(results, setup)
    if args.json:
        save_json(args.json, results, info, {"mode": "generate", **setup.__dict__})
    return 0
