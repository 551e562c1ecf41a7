"""The whole sampling step of an inference engine, as a short list of stages.

An engine's step goes from the model's logits to the next tokens through these stages, in
this order (vLLM's), each off by default and free when off, each per row, each defined
exactly in its own module (its torch ops here, its kernel side in :mod:`fastsample.kernels`):

a. allowed tokens (:mod:`.allowed`): a grammar bitmask in xgrammar's format and per-request
   allowed ids; every other token gets logit ``-inf``.
b. logit bias, then min-tokens (:mod:`.bias`).
c. repetition, frequency and presence penalties (:mod:`.penalties`), from the per-request
   token statistics of :class:`TokenStats` (:mod:`.state`).
d. temperature, top-k, top-p, min-p and greedy, in the vLLM or the transformers order
   (:mod:`fastsample.controls`, applied by :mod:`.draw`).
e. the draw, seeded or not, one token or several without replacement (:mod:`.draw`).
f. logprobs (:mod:`.logprobs`): of the drawn tokens, the top-N, the drawn tokens' ranks and
   requested ids, in the ``"processed"`` or ``"raw"`` mode.

The per-batch settings live in one :class:`StepParams` (:mod:`.params`), built when the
batch changes and reused every step; :func:`sample_step` runs the list (:mod:`.step`), and
:func:`process_step` stops before the draw. What every step returns is a
:class:`SampleOutput` (:mod:`.output`).

A new stage goes here as a module with its definition in the docstring, its settings in
:class:`StepParams`, its place in :func:`.step._prepare` (or after the draw), a float64
reference in ``tests/stage_reference.py`` and its kernel side in ``kernels/``.
"""

from .output import SampleOutput
from .params import LOGPROBS_MODES, StepParams
from .state import TokenStats
from .step import process_step, sample_step, staged_logits

__all__ = [
    "LOGPROBS_MODES",
    "SampleOutput",
    "StepParams",
    "TokenStats",
    "process_step",
    "sample_step",
    "staged_logits",
]
