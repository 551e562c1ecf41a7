"""The options of ``python -m fastsample bench`` and the dispatch to its modes.

A mode is a module of this package with ``run(args) -> int``, chosen by one option. The
default mode (:mod:`.probs`, samplers on probabilities) runs when no mode option is given.

Adding a mode (say ``--busy N``):

1. write ``tools/bench/busy.py`` with a docstring (what it measures) and ``run(args)``,
   importing only :mod:`.harness`, :mod:`.report` and fastsample's public or ops modules
   (never this module or the package: the modes sit below the CLI);
2. add its option in :func:`add_arguments` (its ``dest`` is the mode's name);
3. add ``Mode("busy", "busy")`` to :data:`MODES`.

Modes are imported only when chosen, so a broken or slow-to-import mode (``--distributed``
pulls in ``torch.distributed``) costs the others nothing.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

from .harness import DTYPES
from .probs import FULL_BATCHES, FULL_DTYPES, FULL_VOCABS, QUICK_CASES


@dataclass(frozen=True)
class Mode:
    """``dest``: the option's attribute on ``args`` (set and not False: the mode runs);
    ``module``: the module of this package whose ``run(args)`` it calls."""

    dest: str
    module: str
    value: str | None = None
    """If set, the mode runs only when the option has this value (``--engine sglang``)."""

    def chosen(self, args: argparse.Namespace) -> bool:
        value = getattr(args, self.dest, None)
        if self.value is not None:
            return value == self.value
        return value is not None and value is not False  # --distributed 0 is chosen (an error)


MODES: tuple[Mode, ...] = (
    Mode("verify", "verify"),
    Mode("distributed", "distributed"),
    Mode("controls", "controls"),
    Mode("generate", "generate"),
    Mode("launches", "launches"),
    Mode("samplers", "samplers"),
    Mode("engine", "sglang_engine", value="sglang"),
    Mode("engine", "engine"),
)
"""Checked in order; the first chosen one runs."""

DEFAULT_MODE = "probs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where to run (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"two cases {QUICK_CASES} and fewer repeats (under a minute on a "
        "2-core CPU); with --batch/--vocab/--dtype, only fewer repeats",
    )
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        metavar="B",
        help=f"batch sizes (default {' '.join(map(str, FULL_BATCHES))})",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        nargs="+",
        metavar="V",
        help=f"vocabulary sizes (default {' '.join(map(str, FULL_VOCABS))})",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=sorted(DTYPES),
        help=f"dtypes (default {' '.join(FULL_DTYPES)})",
    )
    parser.add_argument(
        "--contender",
        nargs="+",
        metavar="GLOB",
        help="only these contenders (fnmatch globs, e.g. 'fs.*'); the read "
        "pass and torch.multinomial always run, the ratios need them",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="at most this many timed calls per contender (default 50)",
    )
    parser.add_argument(
        "--min-repeats",
        type=int,
        default=None,
        help="at least this many timed calls per contender (default 5)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop timing a contender after this long (default 0.3)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input logits")
    parser.add_argument(
        "--controls",
        action="store_true",
        help="benchmark fastsample.sample's controls (temperature, top-k, top-p, min-p, "
        "greedy) on float32 logits against an HF-style pipeline and vLLM's and SGLang's torch "
        "samplers, at every --batch and the first --vocab (default 64 x 128256)",
    )
    parser.add_argument(
        "--busy",
        type=int,
        metavar="N",
        default=0,
        help="with --controls: time every setting again beside N busy-loop processes "
        "(bounded, stopped at the end) and report each row's slowdown under that load",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="with --controls: also time fastsample right after a model-sized matmul and "
        "after a sort pipeline (an engine's sampler runs right after the model's forward); "
        "with --engine vllm: vLLM's sampler and the plugin's right after the matmul",
    )
    parser.add_argument(
        "--fresh",
        type=int,
        metavar="N",
        default=1,
        help="with --controls: every call takes the next of N logits tensors (fresh logits "
        "every call, as in an engine; default 1: one tensor reused)",
    )
    parser.add_argument(
        "--setting",
        nargs="+",
        metavar="GLOB",
        help="with --controls or --engine: only these settings (fnmatch globs, e.g. 'k=50' 'T=*')",
    )
    parser.add_argument(
        "--distributed",
        type=int,
        metavar="W",
        help="benchmark fastsample.distributed.sample on W gloo processes (loopback) against "
        "gather-then-sample, at the first --batch and --vocab (default 64 x 128256)",
    )
    parser.add_argument("--json", metavar="PATH", help="save results and machine info as JSON")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="save a PNG bar chart of the speed-ups (needs fastsample[plot])",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="benchmark speculative-decoding verification instead (fastsample.tools.bench.verify)",
    )
    parser.add_argument(
        "--generate",
        action="store_true",
        help="benchmark text generation with transformers: fastsample.hf's loop and speculative "
        "decoding against generate and assisted generation (fastsample.tools.bench.generate; "
        "needs fastsample[hf])",
    )
    parser.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default=None,
        help="benchmark an inference engine's sampling with and without fastsample's plugin: "
        "vLLM's sampler step at every --batch (default 1 8 64) and the first --vocab (default "
        "128256), and LLM.generate on a tiny model (fastsample.tools.bench.engine; needs vLLM); "
        "sglang: SGLang's Sampler.forward against the plugin's, standalone, at every --batch, "
        "the first --vocab and every --threads (fastsample.tools.bench.sglang_engine; needs "
        "SGLang 0.5.23)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        metavar="N",
        help="with --engine sglang: torch thread counts, each set in this process for its "
        "rows and restored after (default 1 2)",
    )
    parser.add_argument(
        "--tail",
        action="store_true",
        help="with --engine vllm: count vLLM's CPU draw of far-tail tokens exactly over all "
        "2**31 seeds (needs numba; about a minute)",
    )
    parser.add_argument(
        "--no-generate",
        action="store_true",
        help="with --engine vllm: skip the LLM.generate part",
    )
    parser.add_argument(
        "--no-runners",
        action="store_true",
        help="with --engine vllm: skip the plugin's step inside Model Runner V2 against the V1 "
        "runner (a child process with the MRV2 CPU shim; minutes: MRV2's own bookkeeping runs "
        "in Triton's interpreter)",
    )
    parser.add_argument(
        "--samplers",
        action="store_true",
        help="each new stage of the sampler chain (typical, epsilon, eta, top-n-sigma, XTC, "
        "dynamic temperature, mirostat, windowed penalties, DRY, no-repeat n-grams) on top of "
        "sample_step, beside transformers' warpers and llama-cpp-python's chain where they "
        "install (fastsample.tools.bench.samplers; --batch default 1 64, V=128256)",
    )
    parser.add_argument(
        "--launches",
        action="store_true",
        help="count the device work per call (aten ops + Triton kernel launches) of each public "
        "call and backend, beside the seed's race and torch.multinomial "
        "(fastsample.tools.bench.launches; first --batch and --vocab, default 4 x 1000)",
    )


def chosen_module(args: argparse.Namespace) -> str:
    """The name of the mode module ``args`` ask for."""
    return next((m.module for m in MODES if m.chosen(args)), DEFAULT_MODE)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m fastsample bench``: run the chosen mode."""
    module = importlib.import_module(f".{chosen_module(args)}", __package__)
    return module.run(args)
