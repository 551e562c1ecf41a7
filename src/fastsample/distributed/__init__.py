"""Vocabulary-parallel sampling over ``torch.distributed``, without gathering the logits.

With tensor parallelism each rank holds a slice ``[a, a + V_local)`` of the vocabulary's logits.
:func:`sample` is called on every rank of a process group with that rank's ``(B, V_local)``
shard and returns, on every rank, the same global token ids, probabilities, log-probabilities
and validity that :func:`fastsample.sample` gives on the concatenated ``(B, vocab_size)`` input:
temperature, top-k, top-p, min-p, greedy and several draws without replacement, exactly.

Why it is exact. Everything :func:`fastsample.sample` computes is a per-row reduction over the
vocabulary, and each of them combines across shards:

* the row maximum (for ``exp((x - max) / T)``), the greedy token (first maximal index) and
  validity: one all-gather of a few per-shard summaries per row (each rank then reduces the
  ``world`` rows in the same order, so every rank gets the same answer);
* the top-k and top-p thresholds: exact order statistics of the weights. With a Python
  ``top_k <= 1024`` the global k largest weights are among the union of each shard's k largest,
  so one all-gather of ``(B, k)`` candidates gives the exact k-th largest (ties counted); the
  top-p cut then needs the survivors' mass: the candidates above the cut plus the ties at it,
  counted on every shard (one ``(B,)`` all-reduce; with ``cut_order="vllm"`` the cut is
  ``max(cut_k, cut_min)``, and with ``cut_order="joint"`` the mass is the whole row's, each
  shard's sum in that all-reduce). Otherwise (tensor ``top_k``/``top_p``,
  larger ``k``) the radix selection of :mod:`fastsample.ops.select` runs across shards: its
  per-round histograms of bit-pattern digits are additive, so a SUM all-reduce of each round's
  ``(B, 1024)`` histogram gives every rank the global histogram and the same digit; three rounds
  (float32 weights lie in ``[0, 1]``: 30 pattern bits) give the exact threshold bit pattern,
  ties included. Min-p is relative to the global maximum, which is 1 after the shift: no
  communication;
* the draw: the blocked inverse CDF (:mod:`fastsample.ops.inverse_cdf`) needs the float64 prefix
  over block sums and one uniform per row. A SUM all-reduce of ``(B, S)`` slot sums (the blocks
  of 256 entries; see :mod:`fastsample.distributed.shard` for uneven shards) gives every rank
  the same prefix; the uniforms are identical on every rank (counter-based ``seed=``, or rank
  0's generator draws, shipped in the first all-gather). Every rank finds the same slot; the one
  rank that owns it scans its entries, and a MAX all-reduce of ``(B, 3)`` shares the global id,
  its weight and the slot's remaining mass. Further draws repeat that step with the drawn entry
  removed (as in :func:`fastsample.ops.inverse_cdf.inverse_cdf_draw`).

Bitwise equality with one process. When every shard starts on a multiple of
:data:`fastsample.ops.inverse_cdf.BLOCK` (256) and ``ceil(vocab_size / 256) + world <= 1024``,
the slots are the single-process blocks and every weight, block sum, prefix, uniform and in-block
scan is computed by the same ops on the same values: the tokens, probabilities and
log-probabilities are bitwise those of :func:`fastsample.sample` with the same seeds and
steps. One exception: a radix top-p cut compares float32 bucket masses that the shards
accumulate in another order, so the kept set can differ when ``top_p * mass`` lies within
float32 rounding (~1e-7 relative) of a cumulative mass (so can a candidate top-p cut in the
joint order, whose whole-row mass is summed in another order). (``probs`` with a temperature are
raised to ``1/T`` as ``exp(log(p) / T)``, not with ``pow``, whose CPU kernel rounds an entry
by its position in the vector loop; see :mod:`fastsample.ops.weights`.) With
unaligned shards (or a vocabulary past ~262k entries, where slots of ``256 * m`` entries keep
the collective at <= 1024 values per row) the draw is exact in distribution but its float
rounding differs from the single-process one, so the tokens agree only in law.

What is communicated per call (``B`` rows, ``n = num_samples``, values per row):

=====================================  ==============================  =====================
stage                                  collective                      values per row
=====================================  ==============================  =====================
max, validity, greedy (always)         all-gather float64              2 (+1 greedy id, or +2n
                                                                       with ``n > 1``, when a
                                                                       row can be greedy; +n
                                                                       uniforms when ``seed`` is
                                                                       None)
top-k, Python ``k <= 1024``            all-gather                      k
top-k otherwise                        3 x all-reduce SUM float32      1024
                                       (7 for float64 input)
top-p after candidate top-k, Python p  all-reduce SUM float64         1 (ties, or the mass)
top-p otherwise                        3 x all-reduce SUM (7)          1024
draw: slot masses                      all-reduce SUM                  S <= 1024
draw: each of the n draws              all-reduce MAX float64          3 (2 for the last)
=====================================  ==============================  =====================

``S = ceil(vocab_size / 256) + world`` slots (float32 for float32 weights). A Python
``temperature=0`` (all greedy) needs only the first all-gather. Never ``O(B x V)``;
no host sync beyond the collectives themselves (all shapes and the number of collectives are
fixed by the Python arguments). :func:`record_traffic` records each call's collectives and
bytes.

Where each piece lives (each module imports only those listed before it, :mod:`fastsample.ops`
and, for :class:`~fastsample.SampleOutput`, :mod:`fastsample.sampling`):

* :mod:`.shard`: shard-local work, no communication: the slot layout, the weights, slot sums,
  one shard's radix histograms, the scan inside a drawn slot;
* :mod:`.comm`: :class:`Collective`, :class:`Traffic`, :func:`record_traffic` and the wrapper
  through which every collective is issued (and counted);
* :mod:`.agree`: the argument checks and the ``check=True`` agreement protocol;
* :mod:`.cuts`: the top-k, top-p and min-p thresholds across shards (candidates or radix);
* :mod:`.triton_round`: the same data flow on the Triton backend (``FASTSAMPLE_BACKEND``),
  one kernel launch per collective (:mod:`fastsample.kernels.shard`); what it covers and what
  still takes the torch path is listed there;
* :mod:`.sampling`: :func:`sample`, the data flow of one call.
"""

from __future__ import annotations

from .comm import Collective, Traffic, record_traffic
from .sampling import sample

__all__ = ["Collective", "Traffic", "record_traffic", "sample"]
