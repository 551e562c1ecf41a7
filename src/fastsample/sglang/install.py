"""Registering the plugin's hooks with SGLang's ``HookRegistry`` (see the package docstring).

SGLang calls :func:`fastsample.sglang.register` in each of its processes from
``load_plugins()``, then applies every registered hook: class and function replacements on
dotted paths, with stale ``from X import Y`` copies rebound. Nothing here runs at import.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from .state import STATE, logger, warn_once

__all__ = ["enabled_by_env", "install", "seeded_batch_info", "warn_once"]

SAMPLER = "sglang.srt.layers.sampler.Sampler"
FAST_SAMPLE = "sglang.srt.speculative.spec_utils.fast_sample"
BATCH_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch"


def enabled_by_env(environ: dict[str, str] | None = None) -> bool:
    """Whether ``SGLANG_PLUGINS`` names this plugin (unset: SGLang loads every installed
    plugin, and this one stays out of the way)."""
    from . import PLUGIN_NAME

    value = (os.environ if environ is None else environ).get("SGLANG_PLUGINS")
    return value is not None and PLUGIN_NAME in [p.strip() for p in value.split(",")]


def install() -> None:
    """Register the hooks once per process; one warning and nothing changed on failure."""
    if STATE.installed or not enabled_by_env():
        return
    STATE.installed = True  # one attempt per process, whatever happens below
    try:
        import sglang

        from . import SUPPORTED_VERSIONS

        version = getattr(sglang, "__version__", "?")
        if not version.startswith(SUPPORTED_VERSIONS):
            warn_once(
                "version",
                f"fastsample's SGLang plugin supports SGLang {', '.join(SUPPORTED_VERSIONS)}; "
                f"this is {version}: SGLang samples with its own code",
            )
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from .sampler import fastsample_fast_sample, sampler_class

        HookRegistry.register(SAMPLER, sampler_class(), HookType.REPLACE)
        HookRegistry.register(FAST_SAMPLE, fastsample_fast_sample, HookType.REPLACE)
        HookRegistry.register(BATCH_INFO, seeded_batch_info, HookType.AROUND)
        STATE.hooked = [SAMPLER, FAST_SAMPLE, BATCH_INFO]
        try:
            from . import eagle

            STATE.hooked += eagle.install(HookRegistry, HookType)
        except Exception as error:  # the sampler is hooked either way
            warn_once("eagle", f"fastsample could not hook EAGLE's verification ({error!r}); "
                      "SGLang verifies drafts with its own code")  # fmt: skip
        logger.info(
            "fastsample samples for SGLang %s in this process (hooked: %s); penalties, "
            "grammar masks and logit bias stay in SGLang's preprocessing",
            version, ", ".join(STATE.hooked),
        )  # fmt: skip
    except Exception as error:  # never break SGLang's start-up
        warn_once("install", f"fastsample's SGLang plugin could not install ({error!r}); "
                  "SGLang samples with its own code")  # fmt: skip


def seeded_batch_info(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``SamplingBatchInfo.from_schedule_batch``, with ``sampling_seed`` filled in.

    SGLang builds the per-request seed tensor only under ``--enable-deterministic-inference``
    (and then gives unseeded requests 42). Here every batch gets one: a request's own
    ``sampling_seed``, else a fresh random 63-bit key (from the OS, not torch's generator).
    SGLang merges, filters and copies the tensor with the batch, so each request keeps its
    key. Outside deterministic mode SGLang would have had none: its own code, when a step is
    handed to it, sees None again (:func:`.state.keys_are_ours`).
    """
    info = original(*args, **kwargs)
    try:
        if info.sampling_seed is None:
            import torch

            # The registry may pass the class first (a classmethod): the batch has ``reqs``.
            batch = kwargs.get("batch") or next(a for a in args if hasattr(a, "reqs"))
            seeds = [
                r.sampling_params.sampling_seed
                if r.sampling_params.sampling_seed is not None
                else secrets.randbits(63)
                for r in batch.reqs
            ]
            info.sampling_seed = torch.tensor(seeds, dtype=torch.int64).to(
                info.temperatures.device, non_blocking=True
            )
    except Exception as error:
        warn_once("seeds", f"fastsample could not key SGLang's requests ({error!r}); "
                  "seeded requests are not reproducible")  # fmt: skip
    return info

