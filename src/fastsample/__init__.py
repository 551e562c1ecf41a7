"""fastsample: exact, sync-free token sampling for PyTorch.

Public API (flat and functional, every function shares argument names):

* :func:`fast_sample` -- ``(sample_p, sample_index)``, the drop-in for the speculative-decoding
  helper that replaced ``torch.multinomial``;
* :func:`sample_from_probs` -- draws from weights with a per-row ``valid`` flag;
* :class:`SampleOutput` -- what samplers return.

Where things live: ``sampling.py`` orchestrates (argument checks, method choice, bad-row
policy); ``race.py`` and ``inverse_cdf.py`` are the two exact draw algorithms;
``noise.py`` is the single interface through which randomness enters; ``_validation.py``
holds every argument check; ``bench.py`` is ``python -m fastsample bench``.
"""

from .sampling import SampleOutput, fast_sample, sample_from_probs

__all__ = ["SampleOutput", "fast_sample", "sample_from_probs"]
__version__ = "0.1.0"
