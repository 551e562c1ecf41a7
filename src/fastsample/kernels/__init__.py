"""The Triton backend: fused sampling kernels, one kernel per file beside its launcher.

Entry points (import the submodule you need; none is imported by ``import fastsample``):

* :mod:`.backend` -- the ``FASTSAMPLE_BACKEND`` switch (``auto``/``torch``/``triton``),
  read at call time, and whether Triton is usable for a tensor. Imports nothing heavy.
* :mod:`.philox` -- Philox 4x32-10 as ``@triton.jit`` device functions with the counter
  layout of :mod:`fastsample.ops.seeds`, and :func:`.philox.counter_uniforms` (a launcher
  for tests and other kernels' references).
* :mod:`.race` -- the exponential race (``fast_sample``, ``method="race"``).
* :mod:`.inverse_cdf` -- the blocked inverse CDF; its draw stage takes precomputed
  (weights, float64 block sums) so a fused controls kernel can reuse it.
* :mod:`.ops` -- the launchers registered as ``torch.library.triton_op`` and the two entry
  points ``sampling.py`` dispatches to.

Triton's interpreter. ``@triton.jit`` decides at *decoration* time whether a kernel is
compiled or interpreted (``TRITON_INTERPRET=1``). This package is imported before any of its
kernel modules, so it is the one place that decides: on a machine where
``torch.cuda.is_available()`` is False and ``TRITON_INTERPRET`` is unset, it sets
``TRITON_INTERPRET=1`` (the kernels can only run on CPU tensors there). On a CUDA machine
nothing is set; run with ``TRITON_INTERPRET=1`` in the environment to interpret the kernels
on CPU tensors there (see :func:`.backend.interpreted`). This works the same under pytest
and from the command line, whatever imported ``triton`` first, because triton reads the
variable when each kernel is decorated.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
