"""Where the plugin hooks into vLLM 0.32's two model runners, and how it is taken out again.

Both runners look up their sampler classes by name in their own module's globals when they
build them, so the installer points those names at fastsample's subclasses, in the modules
only: vLLM's classes are unchanged, ``isinstance`` checks still hold, and a runner built
before the installation keeps vLLM's objects. vLLM loads general plugins in every process
before the worker builds its runner (in-process and with worker processes alike), so whichever
runner the engine picks draws with fastsample:

* the V1 runner (``vllm.v1.worker.gpu_model_runner``, which ``CPUModelRunner`` inherits):
  ``Sampler``, ``RejectionSampler``, ``InputBatch`` and ``apply_grammar_bitmask``
  (:mod:`.sampler`, :mod:`.rejection`, :mod:`.batch`, :mod:`.grammar`);
* Model Runner V2 (``vllm.v1.worker.gpu.model_runner``, which MRV2's CPU runner inherits):
  ``Sampler`` and ``RejectionSampler`` (:mod:`.mrv2_sampler`, :mod:`.mrv2_rejection`), and
  ``GPUWatermarkSampler``, whose subclass only says, once, that watermarked engines sample
  with vLLM's own code.

One method of vLLM's front end is wrapped too: ``InputProcessor``'s builder of the per-request
check of logits-processor arguments, so that a request's bad
``extra_args["fastsample"]`` is its own ``VLLMValidationError`` (HTTP 400), naming the setting,
before any work (:func:`.request_stages.check`).

:func:`expected_runner` says which runner vLLM will build by default in this process (MRV2
wherever vLLM counts Triton as usable: every GPU); the installer logs it once, and warns when
it could not hook that runner. :data:`~.state.STATE` records what was hooked and what was built.
"""

from __future__ import annotations

import logging
import os

from .state import STATE

logger = logging.getLogger("fastsample.vllm")

V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
MRV2_RUNNER = "vllm.v1.worker.gpu.model_runner"


def expected_runner() -> str:
    """``"mrv2"`` or ``"v1"``: what vLLM builds by default here (``VLLM_USE_V2_MODEL_RUNNER``
    if set, else MRV2 wherever vLLM's Triton is usable), before any engine configuration
    (features MRV2 does not support send an engine back to V1; watermarking forces MRV2)."""
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if value is not None and value.strip() != "":
        return "v1" if value.strip().lower() in ("0", "false") else "mrv2"
    from vllm.triton_utils import HAS_TRITON

    return "mrv2" if HAS_TRITON else "v1"


def _replace(module, names: dict) -> None:
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise AttributeError(f"{module.__name__} has no {', '.join(missing)}")
    for name, value in names.items():
        STATE.replaced.append((module, name, getattr(module, name)))
        setattr(module, name, value)


def _install_v1() -> None:
    import vllm.v1.worker.gpu_model_runner as runner

    from .batch import FastsampleInputBatch
    from .grammar import intercept_grammar_bitmask
    from .rejection import FastsampleRejectionSampler
    from .sampler import FastsampleSampler

    _replace(runner, {
        "Sampler": FastsampleSampler,
        "RejectionSampler": FastsampleRejectionSampler,
        "InputBatch": FastsampleInputBatch,
        "apply_grammar_bitmask": intercept_grammar_bitmask,
    })  # fmt: skip


def _install_mrv2() -> None:
    import vllm.v1.worker.gpu.model_runner as runner

    from .mrv2_rejection import FastsampleRejectionSamplerV2
    from .mrv2_sampler import FastsampleSamplerV2

    watermark = runner.GPUWatermarkSampler

    class WatermarkSampler(watermark):  # vLLM's, after one warning
        def __init__(self, *args, **kwargs) -> None:
            from . import _warn_once

            _warn_once("watermark", "fastsample's vLLM plugin does not watermark: engines with "
                       "a watermark_config sample with vLLM's own code")  # fmt: skip
            super().__init__(*args, **kwargs)

    WatermarkSampler.__name__ = WatermarkSampler.__qualname__ = watermark.__name__
    _replace(runner, {
        "Sampler": FastsampleSamplerV2,
        "RejectionSampler": FastsampleRejectionSamplerV2,
        "GPUWatermarkSampler": WatermarkSampler,
    })  # fmt: skip


def _install_front_end() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from . import request_stages

    build = InputProcessor._build_logits_processors_params_validator

    def checked_validator(self):
        validate = build(self)
        vocab = self.model_config.get_vocab_size()

        def validator(params) -> None:
            try:
                request_stages.check(getattr(params, "extra_args", None), vocab)
            except ValueError as exc:
                raise VLLMValidationError(str(exc), parameter="extra_args") from None
            validate(params)

        return validator

    _replace(InputProcessor, {"_build_logits_processors_params_validator": checked_validator})


def install() -> None:
    """Hook both runners (idempotent). A runner that cannot be hooked (an import or a name
    missing) is logged: a warning when it is the one vLLM will build."""
    from . import _warn_once

    if STATE.installed:
        return
    expected = expected_runner()
    for name, hook in (("v1", _install_v1), ("mrv2", _install_mrv2)):
        try:
            hook()
            STATE.hooked.add(name)
        except Exception as exc:  # this vLLM lacks the runner, or renamed a class
            if name == expected:
                _warn_once("runner " + name, "fastsample's vLLM plugin could not hook the "
                           "%s runner that vLLM will build (%s: %s): vLLM samples with its "
                           "own code", _label(name), type(exc).__name__, exc)  # fmt: skip
            else:
                logger.info("fastsample's vLLM plugin did not hook the %s runner (%s: %s)",
                            _label(name), type(exc).__name__, exc)  # fmt: skip
    try:
        _install_front_end()
    except Exception as exc:  # the workers still check each request (one warning per error)
        logger.info("fastsample's vLLM plugin did not hook vLLM's request checks (%s: %s)",
                    type(exc).__name__, exc)  # fmt: skip
    STATE.installed = bool(STATE.hooked)
    if STATE.installed:
        logger.info(
            "fastsample's vLLM plugin is installed on the %s; vLLM builds the %s here by "
            "default", " and ".join(_label(n) for n in sorted(STATE.hooked)), _label(expected),
        )  # fmt: skip


def _label(name: str) -> str:
    return {"v1": "V1 model runner", "mrv2": "Model Runner V2"}[name]


def uninstall() -> None:
    """Put vLLM's names back (runners already built keep what they were built with)."""
    while STATE.replaced:
        module, name, value = STATE.replaced.pop()
        setattr(module, name, value)
    STATE.installed = False
    STATE.hooked.clear()
