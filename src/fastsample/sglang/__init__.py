"""An SGLang plugin: SGLang samples, proposes EAGLE drafts and verifies them with fastsample.

Install ``fastsample`` beside SGLang and set ``SGLANG_PLUGINS=fastsample``. SGLang then calls
:func:`register` in every process it starts (main, scheduler, detokenizer), and the scheduler's
model runner draws its tokens with :func:`fastsample.sample_step`::

    SGLANG_PLUGINS=fastsample python -m sglang.launch_server --model-path ...

What is replaced (:mod:`.install`, through SGLang's ``HookRegistry``):

- ``sglang.srt.layers.sampler.Sampler``: :class:`~.sampler.FastsampleSampler`, SGLang's class
  with its ``forward`` drawing in fastsample (:mod:`.sampler`);
- ``sglang.srt.speculative.spec_utils.fast_sample``: :func:`fastsample.fast_sample` with
  SGLang's signature (:mod:`.sampler`);
- ``sglang.srt.speculative.eagle_utils.eagle_sample``: EAGLE's tree verification with
  :func:`fastsample.verify_tree` (:mod:`.eagle`);
- ``SamplingBatchInfo.from_schedule_batch``: also fills ``sampling_seed`` outside
  deterministic mode, so every request has a key (its own ``sampling_seed``, else a random
  one) that follows it through SGLang's batch merges and filters.

SGLang's semantics are kept (README, "Serve with SGLang", lists where results differ and
why): top-k and top-p are one joint cut (``cut_order="joint"``: each on the whole tempered
distribution, the kept sets intersected; min-p after), a row with ``top_k <= 1`` is greedy
(the first maximal logit), penalties, the grammar mask and logit bias are applied by SGLang's
own preprocessing before the sampler (its dense per-batch state, merged and filtered with the
batch), and logprobs are SGLang's: ``log_softmax(logits / T)``, or of the raw logits under
``SGLANG_RETURN_ORIGINAL_LOGPROB``, packed by SGLang's own processor. Randomness is keyed on
(seed, position): a seeded request draws the same tokens in any batch, deterministic mode
or not.

Never silent: the plugin acts only when ``SGLANG_PLUGINS`` names it and only on
:data:`SUPPORTED_VERSIONS` (else one warning, SGLang's own code); a batch using something the
plugin does not do (custom logit processors, a returned sampling mask, watermarking, RL
on-policy or Ascend sampling) goes to SGLang's code with one warning per reason; an exception
inside a step hands that step to SGLang with one warning. Set ``FASTSAMPLE_SGLANG_CALLS`` to a
file to have every process append one line per call (:func:`read_calls`).
"""

from __future__ import annotations

from .state import CALLS, STATE, read_calls

__all__ = ["CALLS", "PLUGIN_NAME", "STATE", "SUPPORTED_VERSIONS", "read_calls", "register"]

PLUGIN_NAME = "fastsample"
"""The name ``SGLANG_PLUGINS`` must list (comma-separated) for the plugin to act."""

SUPPORTED_VERSIONS = ("0.5.23",)
"""Versions of SGLang the plugin is written and tested for (prefixes of ``sglang.__version__``)."""


def register() -> None:
    """SGLang's general-plugin entry point (``sglang.srt.plugins``: ``fastsample``).

    Registers the hooks in this process when ``SGLANG_PLUGINS`` names the plugin and SGLang's
    version is supported; idempotent; never raises (a failure logs one warning and leaves
    SGLang alone).
    """
    from .install import install

    install()
