"""Shared set-up for the transformers integration tests: skip without transformers, and run
the tiny models on one thread (on a busy 2-core machine, two threads wait on each other for
milliseconds per tiny op; one thread is ~100x faster here)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
