"""fastsample: exact, sync-free token sampling for PyTorch.

Public API (flat and functional, every function shares argument names):

* :func:`fast_sample` -- ``(sample_p, sample_index)``, the drop-in for the speculative-decoding
  helper that replaced ``torch.multinomial``;
* :func:`sample_from_probs` -- draws from weights with a per-row ``valid`` flag;
* :func:`sample`, :func:`process` -- temperature, top-k, top-p, min-p and greedy per row
  (logits or probabilities), and the processed distribution they sample from;
* :func:`sample_step`, :func:`process_step` -- an inference engine's whole sampling step:
  allowed tokens and grammar bitmasks, logit bias, min-tokens, penalties, the controls, the
  draw and logprobs, per request (:class:`StepParams`, built when the batch changes, and
  :class:`TokenStats`, the penalties' per-request state);
* :class:`SampleOutput` -- what samplers return;
* :func:`verify_chain`, :func:`verify_tree` -- speculative-decoding verification, exact in
  distribution (:class:`VerifyOutput`, :class:`TokenTree`, :class:`TreeVerifyOutput`);
* :class:`Stream`, :func:`advance_step` -- counter-based per-request randomness
  (``seed=``, ``step=``, ``stream=`` on every sampler);
* :mod:`fastsample.distributed` -- ``distributed.sample``, the same sampling on a vocabulary
  sharded across the ranks of a ``torch.distributed`` group, without gathering the logits.

Where things live (one folder per layer, imports only point down; docs/architecture.md):
``sampling.py`` orchestrates the public samplers (argument checks, method and backend choice,
bad-row policy) and ``controls.py`` turns logits and per-row controls into kept weights;
``ops/`` holds the pure torch ops they are built from (the two draw algorithms, thresholds,
weights, counter-based randomness, argument checks), the CPU path and the reference of every
backend; ``kernels/`` is the Triton backend (``FASTSAMPLE_BACKEND``); ``verify/`` verifies
speculative drafts, chain and tree; ``distributed/`` samples a sharded vocabulary;
``hf/`` generates with Hugging Face transformers; ``tools/`` is the command line's
``bench`` and ``selfcheck``.
"""

from . import distributed
from .controls import process
from .ops.seeds import Stream, advance_step
from .sampling import SampleOutput, fast_sample, sample, sample_from_probs
from .stages import StepParams, TokenStats, process_step, sample_step
from .verify import TokenTree, TreeVerifyOutput, VerifyOutput, verify_chain, verify_tree

__all__ = [
    "SampleOutput",
    "StepParams",
    "Stream",
    "TokenStats",
    "TokenTree",
    "TreeVerifyOutput",
    "VerifyOutput",
    "advance_step",
    "distributed",
    "fast_sample",
    "process",
    "process_step",
    "sample",
    "sample_from_probs",
    "sample_step",
    "verify_chain",
    "verify_tree",
]
__version__ = "0.1.0"
