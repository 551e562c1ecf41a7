"""``python -m fastsample bench``: fastsample against ``torch.multinomial``, side by side.

What is measured, per case (batch ``B`` x vocabulary ``V`` x dtype, input the softmax of
seeded random logits of scale 3, so rows look like a model's next-token distribution):

* ``read_pass``: ``probs.sum(-1)``, one read of the input. Any sampler has to look at
  every probability at least once, so this is the physical floor; every row is also shown as
  a multiple of it ("passes"). A sampler at 2-3 passes is close to what the memory allows.
* ``torch.multinomial``: ``torch.multinomial(probs, 1)``, what the speed-ups are against.
* ``eager_race``: the inference-engine helper fastsample replaces
  (``argmax(probs / Exp(1) noise)`` in eager PyTorch).
* ``fs.inverse_cdf``, ``fs.race``, ``fs.auto``: :func:`fastsample.sample_from_probs` with
  each ``method``; ``fs.fast_sample``: :func:`fastsample.fast_sample`.

Everything runs in one process, one case after the other, all contenders of a case on the
same input: absolute times depend on the machine, its load and its clocks, but ratios taken
within one run on one input are what carry over from machine to machine. That is why the
table reports the speed-up over ``torch.multinomial`` and the multiple of one read pass
next to each median.

Timing: a few warm-up calls (allocator, lazy init, kernel caches), then the contenders of a
case are timed round-robin, one call each per round, until each has spent its budget (at
least ``min_repeats``, at most ``max_repeats`` calls); the median is reported. Interleaving
exposes all contenders to the same drifts of a shared machine; slow contenders simply
drop out of the rounds earlier. On CUDA each timed call is
bracketed by ``torch.cuda.synchronize`` and CUDA events, so the time is the call's
completion on the device, launch overhead included; on CPU it is ``time.perf_counter``.

Extra memory (the ``mem`` column, for fastsample rows): the peak of bytes allocated during
one call above what was live before it, minus what is still live when it returns (the
returned tensors, tiny next to the input), as a fraction of the input's bytes. On CUDA it
comes from ``torch.cuda.reset_peak_memory_stats``/``max_memory_allocated``. On CPU, where
torch keeps no peak counter, one call runs under
``torch.profiler.profile(profile_memory=True)``; the profiler's raw ``[memory]`` events
(``prof.profiler.kineto_results.events()``: signed allocation/free sizes with timestamps,
including allocations made and freed inside one op) are summed in time order and the
running maximum is the peak. Where that is unavailable the column says ``n/a``.

Adding rows: contenders live in a registry of named groups (:data:`.probs.GROUPS`), each a
list of :class:`.harness.Contender` (a name and a ``build(case) -> callable`` factory). Call
:func:`.probs.register_group` to add a group; its rows appear after the existing ones, in
every case, in the table, the JSON and the plot. Adding a mode (an option like
``--controls``): see :mod:`.cli`.
"""

# The package is the command: ``fastsample/__main__.py`` reads ``add_arguments``, ``run`` and
# ``DESCRIPTION`` here. Layout (lower modules never import higher ones):
#   cli.py                           options, and the table of modes it dispatches to
#   probs.py, controls.py, verify.py, distributed.py     the modes (probs: the default)
#   report.py                        tables, machine info, JSON and plots
#   harness.py                       inputs, interleaved timing, memory measuring

from __future__ import annotations

from .cli import add_arguments, run

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = (__doc__ or "").split("\n\nAdding rows:", 1)[0]
"""The module docstring without the developer part: the ``bench --help`` description."""
