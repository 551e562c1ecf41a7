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
* :mod:`.controls`, :mod:`.greedy` -- ``sample``'s controls kernel (weights, exact cuts, block
  sums, ``top_logprobs``) and the greedy kernels; :mod:`.controls_ops` -- their operators.
* :mod:`.stages` -- the engine step's stages a-c (allowed tokens, logit bias, min-tokens,
  penalties) and the raw logprobs' normalizer and top-N, one launch; :mod:`.step_draw` -- the
  step's draw launch (draws, logprobs of either mode, ranks, requested ids); :mod:`.stats` --
  ``TokenStats.update`` in one launch; :mod:`.step_ops` -- their operators and the entry
  points :mod:`fastsample.stages` dispatches to.
* :mod:`.rowwise` -- device functions every sampling kernel shares: per-row counters, the
  bad-row finish, ``nextafter(x, 0)``.
* :mod:`.launch` -- rows per program, block widths, the launch counter, and
  :func:`.launch.launcher` (how every launcher should launch its kernel).
* :mod:`.ops` -- the launchers registered as ``torch.library`` operators (``triton_op`` when
  compiled, ``custom_op`` when interpreted) and the entry points ``sampling.py`` dispatches to.

Triton's interpreter. ``@triton.jit`` decides at *decoration* time (when a kernel module is
imported) whether a kernel is compiled or interpreted (``TRITON_INTERPRET=1``). Importing this
package changes nothing; :func:`.backend.use_triton` decides, at the first call that asks for
Triton on a non-CUDA tensor: if ``torch.cuda.is_available()`` is False and
``TRITON_INTERPRET`` is unset, it sets ``TRITON_INTERPRET=1`` before any kernel module is
imported (and :mod:`.backend` does so at import when ``FASTSAMPLE_BACKEND=triton`` is already
set, before anything imports ``triton.language``). So ``FASTSAMPLE_BACKEND=triton python -m
...`` runs the kernels interpreted on a CPU-only machine, and a process that never asks for
Triton on CPU never has the variable set (other Triton users, e.g. inductor on another
accelerator, are left alone). On a CUDA machine
the kernels are compiled unless ``TRITON_INTERPRET=1`` was set before they were imported;
code that imports a kernel module directly (tests) sets the variable first
(``tests/kernels/conftest.py`` does). If ``triton.language`` was imported before the variable
was set (``torch._dynamo`` imports it), its ``@jit`` helpers are compiled-mode functions;
:func:`.launch.launcher` interprets them for the duration of each launch.
"""
