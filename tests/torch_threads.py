"""Test helper: torch on one CPU thread for a block (tests own their process; the library
never changes the thread count, see fastsample.ops.threads)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread(device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block on one torch thread (CPU only), then restore the count. The statistical
    tests make millions of small ops, on which a second thread costs more than it saves on a
    shared machine (every parallel region waits for a descheduled thread)."""
    if torch.device(device).type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
