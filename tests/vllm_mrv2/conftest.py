"""The Model Runner V2 tests run in a pytest process of their own.

vLLM 0.32 builds Model Runner V2 (MRV2) wherever its Triton is usable: on every GPU, not on
this CPU build. ``mrv2_shim.install()`` makes it usable here (a fake ``"cpu"`` Triton backend,
Triton's interpreter), which changes what vLLM decides for every engine of the process, the V1
tests' engines included. So this folder runs only when asked, alone::

    FASTSAMPLE_MRV2=1 python -m pytest tests/vllm_mrv2

Without ``FASTSAMPLE_MRV2=1`` each test module is skipped at collection, saying so, without
being imported (the modules import vLLM), and nothing here imports vLLM or applies the shim.
With it: the shim is applied when this file is imported (before any test module imports
vLLM); the folder is skipped, naming the reason, where triton or vLLM do not import; and a run
that collected tests outside this folder stops with a usage error. The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on one torch thread with the plugin named
(``VLLM_PLUGINS=fastsample``), as in ``tests/vllm_plugin``, whose ``vllm_helpers`` this folder
reuses (its folder is put on ``sys.path``); torch's ``set_num_threads``, which an in-process
vLLM replaces for the whole process, is put back after each module.

A module of this folder imported outside this collection (``tests/test_power.py`` imports
every module that judges a law) does not get this file: it calls
``mrv2_helpers.skip_unless_shim_installed()`` before importing vLLM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
RUN = "FASTSAMPLE_MRV2=1 python -m pytest tests/vllm_mrv2"
ENABLED = os.environ.get("FASTSAMPLE_MRV2") == "1"

# vllm_helpers (tiny_llama, engine, close, ...) lives beside the V1 plugin's tests.
_helpers = str(HERE.parent / "vllm_plugin")
if _helpers not in sys.path:
    sys.path.append(_helpers)

SKIP_REASON: str | None = None
if not ENABLED:
    SKIP_REASON = f"Model Runner V2 tests apply a process-wide shim; run them alone: {RUN}"
else:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_PLUGINS"] = "fastsample"
    from fastsample.tools import mrv2_shim

    try:
        mrv2_shim.install()
    except ImportError as exc:
        SKIP_REASON = f"vLLM or triton is not importable here ({type(exc).__name__}: {exc})"
    except RuntimeError as exc:  # vLLM was imported first: other tests ran their imports
        raise pytest.UsageError(f"{exc}; run this folder alone: {RUN}") from exc


def _mine(path) -> bool:
    return HERE in Path(path).resolve().parents


class NotInThisProcess(pytest.File):
    """A test module of this folder, left unimported: its collection is skipped, naming why
    (the modules import vLLM, which must not happen here without the shim)."""

    def collect(self):
        pytest.skip(SKIP_REASON)


def pytest_pycollect_makemodule(module_path, parent):
    if SKIP_REASON is not None and _mine(module_path):
        return NotInThisProcess.from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(config, items):
    if SKIP_REASON is not None:
        return
    others = [item.nodeid for item in items if not _mine(item.path)]
    if others:
        raise pytest.UsageError(
            f"FASTSAMPLE_MRV2=1 applies the Model Runner V2 shim to the whole process; run "
            f"tests/vllm_mrv2 alone ({RUN}), not with {len(others)} other tests such as {others[0]}"
        )


@pytest.fixture(autouse=True, scope="module")
def one_thread_and_torch_restored():
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch's own function, whatever torch.set_num_threads is now
    yield
    torch.set_num_threads = torch._C.set_num_threads
    torch._C.set_num_threads(threads)
