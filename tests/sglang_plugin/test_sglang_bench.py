"""``python -m fastsample bench --engine sglang`` runs to the end at a tiny size (not timed).

The benchmark runs in a child process: it publishes SGLang's process-wide runtime context and
builds a one-process gloo group, which this test process should not keep. The child gets the
import stubs SGLang needs on this CPU (``stubs/``, see its README) and
``SGLANG_USE_CPU_ENGINE=1``. Where SGLang is not installed, the benchmark must refuse with a
message naming what to install (checked in this process: the import fails at once).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastsample.tools.bench import cli

HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
SETTINGS = ("T/k/p joint", "T/k/p rows differ", "top-p only", "penalties", "logprobs")


def test_engine_sglang_is_its_own_mode():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.chosen_module(parser.parse_args(["--engine", "sglang"])) == "sglang_engine"
    assert cli.chosen_module(parser.parse_args(["--engine", "vllm"])) == "engine"


@pytest.mark.skipif(HAS_SGLANG, reason="SGLang is installed: the refusal cannot be shown")
def test_without_sglang_the_benchmark_says_what_to_install(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--engine", "sglang", "--quick"])) == 2
    out = capsys.readouterr().out
    assert "sglang==0.5.23" in out and "import sglang failed" in out


@pytest.mark.skipif(not HAS_SGLANG, reason="SGLang is not installed (pip install sglang==0.5.23)")
def test_bench_engine_sglang_tiny_run():
    from fastsample.tools.bench.sglang_engine import SETTINGS as BENCH_SETTINGS

    assert BENCH_SETTINGS == SETTINGS
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS), env.get("PYTHONPATH")) if p)
    argv = ["--engine", "sglang", "--quick", "--vocab", "512", "--batch", "1", "4",
            "--threads", "1", "--repeats", "2", "--min-repeats", "1", "--warmup", "1"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "fastsample", "bench", *argv], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-4000:]
    assert "Traceback" not in out + done.stderr
    for setting in SETTINGS:
        rows = [line for line in out.splitlines() if line.startswith(setting)]
        assert len(rows) == 2, (setting, out)  # B = 1 and 4, one thread count
        assert all(re.search(r" \d+\.\dx ", line) for line in rows), rows  # a ratio each
        checks = [line for line in out.splitlines() if line.strip().startswith(setting + " ")]
        assert any(line.rstrip().endswith("ok") and "B=4" in line for line in checks), out
    assert "handed to SGLang" not in out
    assert ">= 2.5x" in out  # the B=1 target is marked
