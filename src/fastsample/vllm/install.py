"""Where the plugin hooks into vLLM 0.32's V1 model runner, and how it is taken out again.

``GPUModelRunner.__init__`` (which ``CPUModelRunner`` inherits) looks up ``Sampler``,
``RejectionSampler`` and ``InputBatch`` in its module's globals when it builds them, and
``sample_tokens`` calls the module's ``apply_grammar_bitmask`` before sampling. The installer
points those four names at fastsample's subclasses and interceptor, in the module only:
vLLM's classes are unchanged, ``isinstance`` checks still hold, and a runner built before
the installation keeps vLLM's objects. vLLM loads general plugins in every process before
the worker builds its runner (in-process and with worker processes alike).

Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``, or a Triton with a CPU backend) builds
other classes (``vllm/v1/worker/gpu/sample``), which this does not reach: a warning says so.
"""

from __future__ import annotations

import logging
import os

from .state import STATE

logger = logging.getLogger("fastsample.vllm")


def install() -> None:
    """Replace the runner module's four names (idempotent)."""
    if STATE.installed:
        return
    import vllm.v1.worker.gpu_model_runner as runner

    from .batch import FastsampleInputBatch
    from .grammar import intercept_grammar_bitmask
    from .rejection import FastsampleRejectionSampler
    from .sampler import FastsampleSampler

    names = {
        "Sampler": FastsampleSampler,
        "RejectionSampler": FastsampleRejectionSampler,
        "InputBatch": FastsampleInputBatch,
        "apply_grammar_bitmask": intercept_grammar_bitmask,
    }
    missing = [name for name in names if not hasattr(runner, name)]
    if missing:
        raise AttributeError(f"vllm.v1.worker.gpu_model_runner has no {', '.join(missing)}")
    for name, value in names.items():
        STATE.replaced.append((runner, name, getattr(runner, name)))
        setattr(runner, name, value)
    STATE.installed = True
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("", "0"):
        logger.warning(
            "fastsample's vLLM plugin hooks the V1 model runner; Model Runner V2 "
            "(VLLM_USE_V2_MODEL_RUNNER) samples with vLLM's own code"
        )
    logger.info("fastsample's vLLM plugin is installed: new model runners sample with it")


def uninstall() -> None:
    """Put vLLM's names back (runners already built keep what they were built with)."""
    while STATE.replaced:
        module, name, value = STATE.replaced.pop()
        setattr(module, name, value)
    STATE.installed = False
