"""Shared set-up of the SGLang plugin's tests (SGLang 0.5.23's CPU engine).

Every module here skips, naming the reason, where SGLang does not import: the main venv has
none (SGLang pins its own torch and a CUDA stack); .ci/run builds a venv of its own,
``.venv-sglang``, with the recipe of the README's "Tests" and runs this folder there.

Where SGLang is installed, before any test imports it:

* ``stubs/`` (``torchvision``, ``sgl_kernel``: no wheel for this machine loads) goes first
  on ``sys.path`` and on ``PYTHONPATH``, which SGLang's child processes and the server
  inherit;
* ``SGLANG_USE_CPU_ENGINE=1`` (else ``device="cpu"`` is not SGLang's CPU platform and its
  RoPE imports vLLM) and ``SGLANG_CACHE_DIR`` in a temporary folder.

Engines take 25-60 s to start on 2 cores, and an idle engine's scheduler polls (about a
third of a core): the engine with the plugin is one for the session (:class:`PluginEngine`),
SGLang's own engine computes every reference output in one fixture and stops
(test_sglang_engine.py), and the server module stops the shared engine before it starts its
server.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sglang_helpers import HAVE_SGLANG, CallLog, checkpoint, engine, logging_config, plugin_env

STUBS = Path(__file__).parent / "stubs"

if HAVE_SGLANG:  # only there: elsewhere transformers would find the torchvision stub and use it
    sys.path.insert(0, str(STUBS))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(STUBS), os.environ.get("PYTHONPATH")) if p
    )
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ.setdefault("SGLANG_CACHE_DIR", tempfile.mkdtemp(prefix="fastsample-sglang-cache-"))

MAX_RUNNING = 128  # the shared engine's batch limit: the law test's requests, 128 a step


class PluginEngine:
    """The session's engine with the plugin (``SGLANG_PLUGINS=fastsample``), started at first
    use: ``calls`` reads its processes' calls, ``log`` the plugin's records."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.calls = CallLog(folder / "calls-plugin.txt")
        self.logging_json, self.log = logging_config(folder)
        self.startups: list[float] = []
        self._engine = None

    @property
    def engine(self):
        if self._engine is None:
            start = time.perf_counter()
            env = plugin_env(True, self.calls.path, self.logging_json)
            self._engine = engine(checkpoint(), env, max_running_requests=MAX_RUNNING)
            self.startups.append(time.perf_counter() - start)
            print(f"\nSGLang engine with the plugin started in {self.startups[-1]:.1f} s")
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


@pytest.fixture(scope="session")
def plugin(tmp_path_factory):
    holder = PluginEngine(tmp_path_factory.mktemp("sglang-plugin"))
    yield holder
    holder.close()
