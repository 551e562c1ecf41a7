"""Shared set-up for the transformers integration tests: nothing here is collected without
transformers (the optional extra ``fastsample[hf]``), and the tiny models run on one thread
(on a busy 2-core machine, two threads wait on each other for milliseconds per tiny op; one
thread is ~100x faster here)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("transformers") is None:
    collect_ignore_glob = ["test_hf_*.py", "hf_models.py"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
