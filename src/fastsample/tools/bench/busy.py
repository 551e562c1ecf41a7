"""Busy-loop processes beside a benchmark (``--busy N``): the load of a shared server.

Each loop is a separate Python process spinning on the clock (no torch import, ~20 ms to
start). They are bounded twice: each stops by itself after ``limit_s`` seconds, and
:func:`busy_loops` terminates (then kills) them when its block ends, even on an error.

Each loop runs in a session of its own, like the other tenants of a server. Linux's
scheduler (with ``sched_autogroup_enabled``, the default on most distributions) shares the
CPU between sessions first: loops left in the benchmark's session would compete with it for
its own session's share instead of loading the machine (measured: a one-thread sampler
then slows down ~3x beside 2 loops, a two-thread one ~2x; in sessions of their own the loops
take their share of the machine, as other processes do).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

_LOOP = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"

SETTLE_S = 0.2
"""Seconds to wait after starting the loops, so that timing starts under the full load."""


@contextlib.contextmanager
def busy_loops(count: int, limit_s: float = 600.0) -> Iterator[list[subprocess.Popen]]:
    """Run ``count`` busy-loop processes for the duration of the block (at most ``limit_s``)."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _LOOP.format(limit=float(limit_s))],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        if procs:
            time.sleep(SETTLE_S)
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
