"""fastsample: exact, sync-free token sampling for PyTorch.

Public API (flat and functional, every function shares argument names):

* :func:`fast_sample` -- ``(sample_p, sample_index)``, the drop-in for the speculative-decoding
  helper that replaced ``torch.multinomial``;
* :func:`sample_from_probs` -- draws from weights with a per-row ``valid`` flag;
* :func:`sample`, :func:`process` -- temperature, top-k, top-p, min-p and greedy per row
  (logits or probabilities), and the processed distribution they sample from;
* :class:`SampleOutput` -- what samplers return;
* :func:`verify_chain`, :func:`verify_tree` -- speculative-decoding verification, exact in
  distribution (:class:`VerifyOutput`, :class:`TokenTree`, :class:`TreeVerifyOutput`);
* :class:`Stream`, :func:`advance_step` -- counter-based per-request randomness
  (``seed=``, ``step=``, ``stream=`` on every sampler);
* :mod:`fastsample.distributed` -- ``distributed.sample``, the same sampling on a vocabulary
  sharded across the ranks of a ``torch.distributed`` group, without gathering the logits.

Where things live: ``sampling.py`` orchestrates (argument checks, method choice, bad-row
policy); ``race.py`` and ``inverse_cdf.py`` are the two exact draw algorithms;
``controls.py`` turns logits and per-row controls into kept weights, with the exact
threshold selections of ``select.py``; ``noise.py`` is the single interface through
which randomness enters, ``seeds.py`` and ``philox.py`` its counter-based source;
``verify.py`` (with ``_verify_draw.py``) verifies speculative drafts; ``distributed.py`` (with
``_shard.py``) samples a sharded vocabulary; ``_validation.py`` holds every argument check;
``bench.py`` is ``python -m fastsample bench`` (``bench_controls.py``, ``bench_verify.py`` and
``bench_distributed.py`` its ``--controls``, ``--verify`` and ``--distributed`` parts).
"""

from . import distributed
from .controls import process
from .ops.seeds import Stream, advance_step
from .sampling import SampleOutput, fast_sample, sample, sample_from_probs
from .verify import TokenTree, TreeVerifyOutput, VerifyOutput, verify_chain, verify_tree

__all__ = [
    "SampleOutput",
    "Stream",
    "TokenTree",
    "TreeVerifyOutput",
    "VerifyOutput",
    "advance_step",
    "distributed",
    "fast_sample",
    "process",
    "sample",
    "sample_from_probs",
    "verify_chain",
    "verify_tree",
]
__version__ = "0.1.0"
