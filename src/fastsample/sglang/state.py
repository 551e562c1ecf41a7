"""The plugin's process-wide record: what it installed, its calls, its one-time warnings."""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass, field

logger = logging.getLogger("fastsample.sglang")

CALLS: collections.Counter[str] = collections.Counter()
"""Calls in this process: ``sampler`` (steps drawn by fastsample), ``handed`` (steps given to
SGLang's own code), ``fast_sample``, ``verify``."""

CALLS_FILE_ENV = "FASTSAMPLE_SGLANG_CALLS"
"""If set, a file every process appends one line per call to (``kind detail``): SGLang's
scheduler is a child process, so tests and benchmarks count its calls there."""


@dataclass
class State:
    installed: bool = False
    hooked: list[str] = field(default_factory=list)
    warned: set[str] = field(default_factory=set)


STATE = State()


def count(kind: str, detail: object = "") -> None:
    CALLS[kind] += 1
    path = os.environ.get(CALLS_FILE_ENV)
    if path:
        with open(path, "a") as out:
            out.write(f"{kind} {detail}\n")


def warn_once(reason: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``reason`` comes up in this process."""
    if reason not in STATE.warned:
        STATE.warned.add(reason)
        logger.warning(message)


def read_calls(path: str | os.PathLike[str]) -> collections.Counter[str]:
    """The calls recorded in ``path`` (see :data:`CALLS_FILE_ENV`), counted by kind."""
    counts: collections.Counter[str] = collections.Counter()
    if os.path.exists(path):
        with open(path) as lines:
            for line in lines:
                if line.strip():
                    counts[line.split()[0]] += 1
    return counts


def keys_are_ours() -> bool:
    """Whether a batch's ``sampling_seed`` was filled by the plugin
    (:func:`.install.seeded_batch_info`; SGLang builds one only under
    ``--enable-deterministic-inference``): SGLang's own code must then see None, as it would
    without the plugin (its seeded CPU path needs a kernel that no CPU wheel ships). Read from
    SGLang's runtime settings, not from the batch: SGLang copies the batch's settings for
    every forward pass (``copy_for_forward``), dropping extra attributes."""
    from sglang.srt.runtime_context import get_exec

    try:
        return not get_exec().deterministic.enable_deterministic_inference
    except ValueError:  # no runtime published (outside an engine): SGLang's default, off
        return True
