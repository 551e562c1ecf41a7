"""One CPU thread for chains of small ops: no parallel region a busy machine can stall.

On CPU, torch runs every op over more than 32,768 elements as an OpenMP parallel region on
all its threads, and every region ends at a barrier. On a machine whose cores are shared
(the normal state of an inference server) a region waits for its slowest thread, which may
not be scheduled for milliseconds: measured on the 2-core VM with other processes running,
a ``fill_`` of 50,000 floats took 22 ms with 2 threads and 4 us with one, and a sampling
call made of a few dozen such ops ran 5-10x slower with 2 threads than with one. A chain of
small ops gains little from a second thread even on a quiet machine, so the samplers run
such chains on one thread (:func:`one_thread`) and keep the parallel regions for the few
passes over the whole input that are worth them (:func:`pass_threads`).

Results do not depend on the thread count here: the ops these chains use reduce each row (or
block) on one thread either way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

PARALLEL_PASS_ELEMENTS = 1 << 25
"""A pass over at least this many elements (~10-20 ms on one core) keeps torch's threads. At
B=64, V=128,256 (8.2M logits) the block-maxima pass ran as fast or faster on one thread on
the shared 2-core VM (38 against 48-56 ms median under load, 127-151 against 122-159 ms
beside 2 more busy loops), so only passes long enough to amortize a stalled barrier are
parallel."""

_lock = threading.Lock()
_depth = 0
_saved = 0


def _serial_wanted(device: torch.device) -> bool:
    return device.type == "cpu" and not torch.compiler.is_compiling()


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Run the block's CPU ops on one thread (``torch.set_num_threads(1)``), then restore.

    The thread count is process-wide in torch: concurrent callers share one saved count (the
    first in saves it, the last out restores it), and other threads' torch ops run on one
    thread too while a block is open (for the few milliseconds of a sampling call). Nothing
    happens off CPU, under ``torch.compile``, or when torch already uses one thread.
    """
    global _depth, _saved
    if not _serial_wanted(device) or (_depth == 0 and torch.get_num_threads() == 1):
        yield
        return
    with _lock:
        if _depth == 0:
            _saved = torch.get_num_threads()
            torch.set_num_threads(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.set_num_threads(_saved)


def pass_threads(device: torch.device, elements: int) -> contextlib.AbstractContextManager:
    """The context for one pass over ``elements``: torch's threads for a large pass, one
    thread for a small one (a parallel region costs more than it saves there)."""
    if elements >= PARALLEL_PASS_ELEMENTS:
        return contextlib.nullcontext()
    return one_thread(device)
