"""scripts/device_check.sh cannot rot between GPU runs: its rehearsal reaches every step.

The rehearsal runs the script as the GPU machine would (``python3`` as it is, fastsample only
on ``PYTHONPATH``, no package index) with no CUDA device: every GPU step runs its command's
no-CUDA entry point (the exact flags through argparse, pytest ``--collect-only`` of the exact
selection) and must say it was skipped, and why; nothing may fail. The step names come from
the script itself (``--list-steps``), so a step added there is checked here too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash"
)


def steps() -> list[tuple[str, str]]:
    done = subprocess.run(["bash", str(SCRIPT), "--list-steps"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return [tuple(line.split()) for line in done.stdout.splitlines()]


def summary_rows(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [re.split(r"(?<!\\)\|", row)[1:-1] for row in rows]
    return [[cell.strip() for cell in row] for row in cells[1:]]  # without the header


def test_rehearsal_reaches_every_step_and_skips_the_gpu_ones(tmp_path):
    # A python3 that is this interpreter, found first on PATH, as the GPU image's would be.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    out, carry = tmp_path / "out", tmp_path / "carry"
    carry.mkdir()  # no FlashInfer bundle carried
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out),
           "CARRY_DIR": str(carry), "PIP_NO_INDEX": "1"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", str(SCRIPT), "--rehearse"], env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    summary = (out / "summary.md").read_text()
    rows = summary_rows(summary)
    listed = steps()
    assert [row[0] for row in rows] == [name for name, _ in listed], summary
    kinds = dict(listed)
    for name, status, seconds, note in rows:
        assert status != "failed", (name, note)
        assert seconds.isdigit(), (name, seconds)
        if kinds[name] == "gpu":
            assert status == "skipped" and note, (name, status, note)
        else:
            assert status == "ran", (name, status, note)
    assert "rehearsal" in summary and "Key figures" in summary
    assert (out / "steps.log").stat().st_size > 0
    # What comes back from the GPU machine: at most 8 files, no deeper than two folders.
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8

