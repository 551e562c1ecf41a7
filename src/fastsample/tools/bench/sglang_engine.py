"""``python -m fastsample bench --engine sglang``: SGLang's sampler against the plugin's.

What is measured (SGLang 0.5.23; no engine, no model, nothing downloaded): SGLang's own
``Sampler.forward`` and the plugin's ``FastsampleSampler.forward`` (:mod:`fastsample.sglang`,
SGLang's class with ``forward`` drawing in :func:`fastsample.sample_step`, joint cut order),
each called standalone on the same batches, as ``ModelRunner.sample`` calls its sampler.

* **SGLang's runtime, the smallest honest set-up.** The configuration is published the way
  SGLang's scheduler process publishes it (``runtime_context.publish(ServerArgs(device="cpu",
  sampling_backend="pytorch"), role="scheduler", ranks=SpawnRanks(world_rank=0))``; the model
  path is a folder holding only a tiny Llama's ``config.json``, which the argument resolution
  reads) and its process groups are built by SGLang's own
  ``init_parallel_runtime`` (one gloo process on a loopback port): ``Sampler.__init__`` reads
  the TP group, the deterministic and RL flags and the sampling backend from there. The
  pytorch backend is what SGLang uses on a CPU (it rewrites every ``--sampling-backend`` to
  it); outside deterministic mode SGLang draws with ``torch.multinomial``. Where every row
  has a top-k, that path sorts only ``torch.topk(max_top_k)`` of each row; top-p alone sorts
  the whole row.
* **The batch, as SGLang builds it.** Each row is a real ``Req`` holding a real
  ``SamplingParams`` (its own normalisation applies: temperature 0 becomes ``top_k = 1``,
  ``top_k = -1`` the whole vocabulary), and ``SamplingBatchInfo.from_schedule_batch`` builds
  the batch's tensors, flags and penalizer orchestrator from them (the batch handed to it is
  a stand-in holding ``reqs`` and ``device``, all that method and the penalizers read). The
  plugin's batch is the same, passed through the plugin's own ``from_schedule_batch`` hook
  (:func:`fastsample.sglang.install.seeded_batch_info`: every request gets a key, as in a
  served engine).
* **The timed call.** ``sampler(LogitsProcessorOutput(logits), info, return_logprob,
  top_logprobs_nums, token_ids_logprobs, positions)``; with penalties, SGLang's preprocessing
  before it (``ModelRunner._preprocess_logits``: ``info.update_regex_vocab_mask()`` and
  ``info.apply_logits_bias(logits)``, the orchestrator's frequency, presence and repetition
  penalties over 128 output tokens fed through ``cumulate_output_tokens`` as the scheduler
  feeds them; SGLang turns the overlap schedule off on the CPU, so the orchestrator applies
  them right there) is timed for both. Logits are ``N(0, 3^2)`` float32, fresh every round; both
  samplers edit them in place, so each call gets its own copy, made outside the timed
  region. Contenders alternate A B B A (SGLang, plugin, plugin, SGLang, ...); medians.
* **Settings.** "T/k/p joint" (T=0.7, k=50, p=0.9 on every row), "T/k/p rows differ" (per
  row T 0.6-0.9, k 40-60, p 0.85-0.95), "top-p only" (T=0.8, p=0.9), "penalties" (T/k/p with
  repetition 1.1, frequency 0.2, presence 0.1), "logprobs" (T/k/p, 5 top logprobs); at every
  ``--batch`` (default 1 8 64), ``--vocab`` (first; default 128256) and torch thread count
  (``--threads``, default 1 2; set in this process for the measurement, restored after).
  Ratios are SGLang's time over the plugin's, from the same run.
* **Agreement guard (not a timing).** With seeded requests, the plugin's tokens must lie in
  SGLang's joint kept set for every row, the set computed by SGLang's own definition
  (``top_k_top_p_min_p_sampling_from_probs_torch``: sort the tempered probabilities, zero
  ranks ``>= k`` and tokens whose mass before them exceeds ``p``), on the logits as
  preprocessed (penalties included), and drawing again with the same seeds and positions
  gives the same tokens. SGLang's own draws are checked against the set too.

The targets (the issue's): SGLang / plugin ``>= 6x`` at B=64 for "T/k/p joint", ``>= 30x`` at
B=64 for "top-p only", ``>= 2.5x`` at B=1 (every setting), at each thread count.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import socket
import statistics
import tempfile
import time
import warnings
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .harness import LOGIT_SCALE
from .report import machine_info, save_json

TKP = dict(temperature=0.7, top_k=50, top_p=0.9)
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
OUTPUT_TOKENS = 128  # output tokens the penalizers have counted
PROMPT_TOKENS = 512
TOP_LOGPROBS = 5
SETTINGS = ("T/k/p joint", "T/k/p rows differ", "top-p only", "penalties", "logprobs")
TARGETS = {("T/k/p joint", 64): 6.0, ("top-p only", 64): 30.0}
B1_TARGET = 2.5  # every setting at B=1
INSTALL_HINT = (
    "bench --engine sglang needs SGLang 0.5.23: pip install sglang==0.5.23 (on a CPU-only "
    "machine, the README's Tests section: torch 2.13.0, then sglang==0.5.23 --no-deps with "
    ".ci/sglang-0.5.23-cpu-requirements.txt, and run with "
    "PYTHONPATH=tests/sglang_plugin/stubs SGLANG_USE_CPU_ENGINE=1)"
)


def target(setting: str, batch: int) -> float | None:
    """The issue's target for SGLang's time over the plugin's, or None."""
    if batch == 1:
        return B1_TARGET
    return TARGETS.get((setting, batch))


# ---------------------------------------------------------------------------- SGLang's runtime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sglang_runtime(vocab: int) -> Iterator[Any]:
    """SGLang's process context for a sampler outside an engine; torn down after.

    Publishes ``ServerArgs`` as the scheduler process does and builds the (one-process,
    gloo) groups with SGLang's ``init_parallel_runtime``. Yields the ``ServerArgs``.
    """
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.bootstrap import init_parallel_runtime, reset_parallel_initialised
    from sglang.srt.server_args import ServerArgs

    threads = torch.get_num_threads()
    folder = tempfile.TemporaryDirectory(prefix="fastsample-bench-sglang-")
    try:
        # SGLang's argument resolution reads the model's config.json (nothing else: no
        # weights, no tokenizer); a tiny Llama's.
        from transformers import LlamaConfig

        LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, architectures=["LlamaForCausalLM"],
                    ).save_pretrained(folder.name)  # fmt: skip
        server_args = ServerArgs(model_path=folder.name, device="cpu", skip_tokenizer_init=True,
                                 sampling_backend="pytorch", random_seed=0)  # fmt: skip
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0, gpu_id=0))
        init_parallel_runtime(server_args=server_args, device="cpu", dist_port=_free_port())
        torch.set_num_threads(threads)  # in case SGLang's CPU set-up bound threads
        yield server_args
    finally:
        with contextlib.suppress(Exception):
            parallel_state.destroy_model_parallel()
        with contextlib.suppress(Exception):
            parallel_state.destroy_distributed_environment()
        reset_parallel_initialised()
        rc.reset_context()
        torch.set_num_threads(threads)
        folder.cleanup()


# ---------------------------------------------------------------------------- the batch


class _Batch:
    """What ``SamplingBatchInfo.from_schedule_batch`` and the penalizers read of a
    ``ScheduleBatch``: its requests and device (weak-referenced by the orchestrator, so kept
    alive by :class:`Batch`)."""

    def __init__(self, reqs: list[Any]) -> None:
        self.reqs = reqs
        self.device = "cpu"


def request_settings(setting: str, batch: int, seeded: bool = False) -> list[dict[str, Any]]:
    """Each row's ``SamplingParams`` arguments for a setting."""
    rows = []
    for b in range(batch):
        if setting == "top-p only":
            row: dict[str, Any] = dict(temperature=0.8, top_p=0.9)
        elif setting == "T/k/p rows differ":
            row = dict(temperature=0.6 + 0.1 * (b % 4), top_k=40 + 10 * (b % 3),
                       top_p=0.85 + 0.05 * (b % 3))  # fmt: skip
        else:
            row = dict(TKP)
        if setting == "penalties":
            row.update(PENALTIES)
        if seeded:
            row["sampling_seed"] = 1000 + b
        rows.append(row)
    return rows


@dataclass
class Batch:
    """One batch for both samplers: SGLang's ``SamplingBatchInfo``, the plugin's (through its
    hook) and the sampler call's other arguments."""

    batch: int
    vocab: int
    sglang_info: Any
    plugin_info: Any
    return_logprob: bool
    top_logprobs_nums: list[int]
    token_ids_logprobs: list[Any]
    positions: torch.Tensor
    penalties: bool
    holders: tuple[Any, ...]  # the stand-in batches the orchestrators weak-reference


def make_batch(setting: str, batch: int, vocab: int, seeded: bool = False, seed: int = 0) -> Batch:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    from ...sglang.install import seeded_batch_info

    logprob = setting == "logprobs"
    gen = torch.Generator().manual_seed(seed)

    def reqs() -> list[Any]:
        out = []
        for b, row in enumerate(request_settings(setting, batch, seeded)):
            params = SamplingParams(max_new_tokens=4096, **row)
            params.verify(vocab)
            prompt = array("q", torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen).tolist())
            out.append(Req(rid=f"bench-{b}", origin_input_text="", origin_input_ids=prompt,
                           sampling_params=params, return_logprob=logprob,
                           top_logprobs_num=TOP_LOGPROBS if logprob else 0,
                           vocab_size=vocab))  # fmt: skip
        return out

    ours, theirs = _Batch(reqs()), _Batch(reqs())
    sglang_info = SamplingBatchInfo.from_schedule_batch(theirs, vocab)
    plugin_info = seeded_batch_info(SamplingBatchInfo.from_schedule_batch, ours, vocab)
    penalties = setting == "penalties"
    if penalties:  # the scheduler feeds each step's tokens; the same ones to both
        assert sglang_info.penalizer_orchestrator.is_required
        for _ in range(OUTPUT_TOKENS):
            out = torch.randint(0, vocab, (batch,), generator=gen)
            sglang_info.penalizer_orchestrator.cumulate_output_tokens(out)
            plugin_info.penalizer_orchestrator.cumulate_output_tokens(out)
    return Batch(batch, vocab, sglang_info, plugin_info, logprob,
                 [TOP_LOGPROBS if logprob else 0] * batch, [None] * batch,
                 torch.full((batch,), PROMPT_TOKENS + OUTPUT_TOKENS, dtype=torch.int64),
                 penalties, (ours, theirs))  # fmt: skip


def step(sampler: Any, info: Any, b: Batch, penalties: bool) -> Callable[[Any, torch.Tensor], Any]:
    """One call as ``ModelRunner.sample`` makes it: preprocessing (with penalties) and the
    sampler, on a ``LogitsProcessorOutput`` and positions made by the caller."""

    def call(output: Any, positions: torch.Tensor) -> Any:
        if penalties:
            info.update_regex_vocab_mask()
            info.apply_logits_bias(output.next_token_logits)
        return sampler(output, info, b.return_logprob, b.top_logprobs_nums,
                       b.token_ids_logprobs, positions)  # fmt: skip

    return call


# ---------------------------------------------------------------------------- timing


@dataclass
class Timing:
    warmup: int
    min_repeats: int
    max_repeats: int
    budget_s: float


def time_abba(calls: dict[str, Callable[[Any, torch.Tensor], Any]], b: Batch, timing: Timing,
              seed: int) -> dict[str, list[float]]:  # fmt: skip
    """Two contenders in A B B A order; every round fresh logits, every call its own copy
    (and its own ``LogitsProcessorOutput``), made untimed; positions advance a step a round."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    (a_name, a), (b_name, bb) = calls.items()
    gen = torch.Generator().manual_seed(seed)
    times: dict[str, list[float]] = {a_name: [], b_name: []}
    rounds = 0
    while True:
        n = len(times[a_name])
        spent = max(sum(t) for t in times.values())
        if n >= timing.max_repeats or (n >= timing.min_repeats and spent >= timing.budget_s):
            break
        base = torch.randn(b.batch, b.vocab, generator=gen) * LOGIT_SCALE
        positions = b.positions + rounds
        order = [(a_name, a), (b_name, bb)] if rounds % 2 == 0 else [(b_name, bb), (a_name, a)]
        for name, fn in order:
            output = LogitsProcessorOutput(next_token_logits=base.clone())
            start = time.perf_counter()
            fn(output, positions)
            seconds = time.perf_counter() - start
            if rounds >= timing.warmup:
                times[name].append(seconds)
        rounds += 1
    return times


@dataclass
class Row:
    setting: str
    batch: int
    vocab: int
    threads: int
    sglang_ms: float
    plugin_ms: float
    ratio: float
    repeats: int
    target: float | None
    handed: int  # plugin calls handed to SGLang's code (must be 0)
    sglang_times_ms: list[float] = field(default_factory=list)
    plugin_times_ms: list[float] = field(default_factory=list)


def measure(setting: str, batch: int, vocab: int, threads: int, timing: Timing,
            samplers: tuple[Any, Any]) -> Row:  # fmt: skip
    from ...sglang.state import CALLS

    theirs, ours = samplers
    b = make_batch(setting, batch, vocab)
    handed = CALLS["handed"]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            times = time_abba({
                "sglang": step(theirs, b.sglang_info, b, b.penalties),
                "plugin": step(ours, b.plugin_info, b, b.penalties),
            }, b, timing, seed=batch)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    ms = {k: [t * 1e3 for t in v] for k, v in times.items()}
    s, p = statistics.median(ms["sglang"]), statistics.median(ms["plugin"])
    return Row(setting, batch, vocab, threads, s, p, s / p, len(ms["plugin"]),
               target(setting, batch), CALLS["handed"] - handed, ms["sglang"],
               ms["plugin"])  # fmt: skip


# ---------------------------------------------------------------------------- agreement


def kept_set(logits: torch.Tensor, info: Any) -> torch.Tensor:
    """SGLang's joint kept set, a ``(B, V)`` bool mask, by its own definition
    (``top_k_top_p_min_p_sampling_from_probs_torch`` after ``softmax(logits / T)``)."""
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    ranks = torch.arange(probs.shape[-1]).view(1, -1)
    probs_sort[ranks >= info.top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > info.top_ps.view(-1, 1)] = 0.0
    kept = torch.zeros_like(probs, dtype=torch.bool)
    return kept.scatter_(1, probs_idx, probs_sort > 0)


@dataclass
class Agreement:
    setting: str
    batch: int
    vocab: int
    rows: int
    plugin_inside: int
    sglang_inside: int
    repeated: int  # plugin rows drawing the same token again with the same seeds
    kept_median: float

    @property
    def ok(self) -> bool:
        return self.rows == self.plugin_inside == self.sglang_inside == self.repeated


def agreement(setting: str, batch: int, vocab: int, steps: int,
              samplers: tuple[Any, Any]) -> Agreement:  # fmt: skip
    """Seeded requests; over ``steps`` positions: every row's plugin token (drawn twice, the
    same both times) and SGLang's inside SGLang's joint kept set of the preprocessed logits."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    theirs, ours = samplers
    b = make_batch(setting, batch, vocab, seeded=True, seed=1)
    gen = torch.Generator().manual_seed(2)
    rows = plugin_in = sglang_in = repeated = 0
    sizes: list[float] = []
    with torch.inference_mode():
        for s in range(steps):  # a decode step: a position further
            logits = torch.randn(batch, vocab, generator=gen) * LOGIT_SCALE
            if b.penalties:  # the same penalties both infos hold
                b.plugin_info.apply_logits_bias(logits)
            kept = kept_set(logits, b.plugin_info)
            positions = b.positions + s
            args = (b.return_logprob, b.top_logprobs_nums, b.token_ids_logprobs, positions)
            mine, again = (ours(LogitsProcessorOutput(next_token_logits=logits.clone()),
                                b.plugin_info, *args).long() for _ in range(2))  # fmt: skip
            their = theirs(LogitsProcessorOutput(next_token_logits=logits.clone()),
                           b.sglang_info, *args).long()  # fmt: skip
            rows += batch
            plugin_in += int(kept.gather(1, mine.view(-1, 1)).sum())
            sglang_in += int(kept.gather(1, their.view(-1, 1)).sum())
            repeated += int((mine == again).sum())
            sizes += kept.sum(dim=1).float().tolist()
    return Agreement(
        setting, batch, vocab, rows, plugin_in, sglang_in, repeated, statistics.median(sizes)
    )


# ---------------------------------------------------------------------------- output


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def print_header() -> None:
    header = (f"{'setting':<18} {'B':>3} {'threads':>7} {'SGLang ms':>10} {'plugin ms':>10} "
              f"{'SGLang/plugin':>14}  target")  # fmt: skip
    print(header)
    print("-" * len(header), flush=True)


def print_row(r: Row) -> None:
    mark = ""
    if r.target is not None:
        mark = f">= {r.target:g}x: {'met' if r.ratio >= r.target else 'MISSED'}"
    if r.handed:
        mark += f"  (!) {r.handed} plugin calls handed to SGLang's code"
    print(f"{r.setting:<18} {r.batch:>3} {r.threads:>7} {_ms(r.sglang_ms):>10} "
          f"{_ms(r.plugin_ms):>10} {f'{r.ratio:.1f}x':>14}  {mark}", flush=True)  # fmt: skip


def print_agreement(results: list[Agreement]) -> None:
    print("\nagreement (not timed): seeded requests, each row's token against SGLang's joint "
          "kept set\n(sort, top-k and top-p each on the whole tempered row, as in "
          "top_k_top_p_min_p_sampling_from_probs_torch)")  # fmt: skip
    for a in results:
        ok = "ok" if a.ok else "FAILED"
        print(f"  {a.setting:<18} B={a.batch:<3} draws {a.rows:>4}: plugin inside "
              f"{a.plugin_inside}/{a.rows} (same again {a.repeated}/{a.rows}), SGLang inside "
              f"{a.sglang_inside}/{a.rows} (kept set median {a.kept_median:g} tokens)  {ok}",
              flush=True)  # fmt: skip


# ---------------------------------------------------------------------------- entry point


def _caution(threads: int) -> None:
    """Say so when other processes hold the CPUs: a row on several threads then waits, at
    every parallel op, for a thread the OS has descheduled (a call of many small ops waits
    many times), and its median says more about the load than about the code."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if threads > 1 and load > cpus - 0.5:
        print(f"(!) load {load:.1f} on {cpus} CPUs: rows on more than one thread wait on "
              "descheduled OpenMP threads; compare those from a quiet machine")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        with warnings.catch_warnings():  # SGLang's import warns about CUDA-only features
            warnings.simplefilter("ignore")
            import sglang
            from sglang.srt.layers.sampler import Sampler
    except Exception as error:  # ImportError, or a CUDA wheel's op registration failing
        print(f"{INSTALL_HINT}\n(import sglang failed: {error!r})")
        return 2
    from ...sglang import SUPPORTED_VERSIONS
    from ...sglang.sampler import sampler_class

    version = getattr(sglang, "__version__", "?")
    batches = args.batch or [1, 8, 64]
    vocab = (args.vocab or [128_256])[0]
    threads = getattr(args, "threads", None) or [1, 2]
    settings = [s for s in SETTINGS if not args.setting
                or any(fnmatch.fnmatch(s, g) for g in args.setting)]  # fmt: skip
    quick = args.quick
    timing = Timing(
        warmup=args.warmup if args.warmup is not None else 1,
        min_repeats=args.min_repeats or (3 if quick else 5),
        max_repeats=args.repeats or (6 if quick else 50),
        budget_s=args.budget if args.budget is not None else (0.3 if quick else 1.5),
    )
    info = machine_info(torch.device("cpu"))
    print(
        f"fastsample bench --engine sglang: SGLang {version}, torch {info['torch']}, "
        f"{info['device_name']}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )
    _caution(max(threads))
    if not version.startswith(SUPPORTED_VERSIONS):
        print(f"(!) the plugin supports SGLang {', '.join(SUPPORTED_VERSIONS)}, this is {version}")
    print(
        f"Sampler.forward (pytorch backend) vs the plugin's FastsampleSampler.forward, "
        f"standalone; V={vocab}, float32 N(0, {LOGIT_SCALE:g}^2) logits fresh every round, "
        f"copied (untimed) for every call; A B B A order, median of "
        f"{timing.min_repeats}-{timing.max_repeats} after {timing.warmup} warm-up round(s); "
        f"torch threads {' and '.join(map(str, threads))} (set per row)\n"
    )
    rows: list[Row] = []
    checks: list[Agreement] = []
    with sglang_runtime(vocab):
        samplers = (Sampler(), sampler_class()())
        print_header()
        for setting in settings:
            for batch in batches:
                for n in threads:
                    rows.append(measure(setting, batch, vocab, n, timing, samplers))
                    print_row(rows[-1])
        check_batch = min(max(batches), 8)
        for setting in settings:
            checks.append(agreement(setting, check_batch, vocab, 2 if quick else 8, samplers))
        print_agreement(checks)
    failed = [a for a in checks if not a.ok]
    handed = sum(r.handed for r in rows)
    print(
        f"\ntargets: {sum(1 for r in rows if r.target and r.ratio >= r.target)} met, "
        f"{sum(1 for r in rows if r.target and r.ratio < r.target)} missed; load after: "
        f"{os.getloadavg()[0]:.2f}"
    )
    _caution(max(threads))
    if args.json:
        save_json(args.json, [*rows, *checks], info,
                  {"mode": "engine", "engine": "sglang", "sglang": version, "vocab": vocab,
                   "threads": threads, "timing": vars(timing)})  # fmt: skip
    if failed or handed:
        print(
            f"error: {len(failed)} agreement check(s) failed, {handed} plugin calls handed "
            "to SGLang's code"
        )
        return 1
    return 0
