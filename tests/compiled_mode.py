"""Runs a script in a fresh Python with Triton's interpreter off: the path a GPU takes.

The interpreter accepts code that Triton's compiler rejects (globals that are not constexpr,
mixed types in ``where``, runtime ``if`` on tensors), so the kernel tests also compile the
kernels for an NVIDIA target (sm_90) and trace their ``triton_op`` registrations under fake
tensors, with no GPU. Those scripts run here, in a child process: this one has the
interpreter on; they compile each kernel with :func:`compile_sm90`. Lives in tests/ (on
``sys.path`` through ``pythonpath``, and through ``PYTHONPATH`` in the child).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest


def run_compiled(script: str, fp_fusion: bool = True, timeout: int = 600) -> str:
    """Runs ``script`` (written to a file: ``@triton.jit`` reads its source) without
    ``TRITON_INTERPRET`` and returns its stdout; skips where this triton has no ptxas, fails
    with the script's stderr otherwise."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    # Triton 3.9 warns when this is unset; the kernels that fuse are compiled with fusion on.
    env["TRITON_DEFAULT_FP_FUSION"] = "1" if fp_fusion else "0"
    # The script imports compile_sm90 from here.
    here = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (here, env.get("PYTHONPATH"))))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "compiled_mode_script.py"
        path.write_text(script)
        done = subprocess.run(
            [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=timeout
        )
    error = done.stderr.lower()
    if done.returncode and "ptxas" in error and ("not found" in error or "no such file" in error):
        pytest.skip("this triton install has no ptxas")
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def compile_sm90(kernel, constants: dict, arg_type: Callable[[str], str]):
    """Compiles the ``@triton.jit`` ``kernel`` for an NVIDIA sm_90 target (no GPU needed):
    the arguments in ``constants`` as constexprs, every other one typed ``arg_type(name)``
    (``"*fp32"``, ``"i64"``, ...). Fails unless a cubin comes out; returns the compiled kernel.
    For the child scripts of :func:`run_compiled` (the interpreter must be off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        name: "constexpr" if name in constants else arg_type(name) for name in kernel.arg_names
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32)
    )
    assert compiled.asm["cubin"], kernel.__name__
    return compiled
