"""CPU threads: a call changes no thread setting, and its chains of small ops open no parallel
region.

On CPU, torch runs an op over at least :data:`GRAIN` (32,768, ATen's ``GRAIN_SIZE``) elements
as an OpenMP parallel region on all its threads, and every region ends at a barrier; an op
over fewer elements runs on the calling thread alone. On a machine whose cores are shared (the
normal state of an inference server) a region waits for its slowest thread, which may not be
scheduled for milliseconds: measured on the 2-core VM with other processes running, a ``fill_``
of 50,000 floats took 22 ms with 2 threads and 4 us with one, and a sampling call made of a
few dozen such ops ran 5-10x slower with 2 threads than with one.

The thread count is the caller's: the library never calls ``torch.set_num_threads`` (it is
process-wide, other threads would see it change during a call, and vLLM's CPU worker replaces
it with a warning). Instead:

* the chains of small ops are shaped to stay under the grain (per-row tables of a few hundred
  entries, candidate lists), so they never open a region, whatever the thread count;
* the few passes over the whole input (the block maxima of the logits, the copy into the
  stages' buffer, the raw log normalizer) keep torch's threads: one region per pass, which
  beside two busy loops cost about what the same pass costs on one thread, and on a quiet
  2-core machine ran ~1.8x faster (``docs/cpu-primitive-costs.md``);
* ``FASTSAMPLE_CPU_SERIAL=1`` (read at every call) runs those passes too in pieces under the
  grain: a call then opens no parallel region at all (each pass ~1.3x its one-thread time),
  for machines so loaded that a single region costs more than the pass.

Results never depend on any of this: every reduction here sums or compares within a row (or a
block) in the same order whatever the pieces and the thread count.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

GRAIN = 32768
"""ATen's ``at::internal::GRAIN_SIZE``: CPU ops over fewer elements run on the calling thread
(TensorIterator loops and reductions, ``topk``, ``cumsum``, ``index_select``, ...)."""

SERIAL_ENV = "FASTSAMPLE_CPU_SERIAL"


def serial_passes(device: torch.device) -> bool:
    """Whether this call runs its passes over the input in pieces under the grain (CPU eager,
    ``FASTSAMPLE_CPU_SERIAL`` set to a value other than ``0`` or empty; read at every call)."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return os.environ.get(SERIAL_ENV, "0") not in ("", "0")


def grain_rows(batch: int, row_elements: int) -> int:
    """Rows per piece so that a piece of ``row_elements`` per row stays under the grain (at
    least one)."""
    return max(1, min(batch, (GRAIN - 1) // max(row_elements, 1)))


def blockwise_(values: Tensor, out: Tensor, block: int, reduce: str) -> Tensor:
    """``out[b, j] = reduce(values[b, j * block : (j + 1) * block])`` (``reduce``: ``"amax"`` or
    ``"sum"``) for the ``(B, blocks)`` contiguous ``out``, in pieces of fewer than
    :data:`GRAIN` elements (the serial mode): each piece is the same reduction over the same
    blocks, so ``out`` is bitwise what the whole op gives."""
    batch, blocks = out.shape
    op = torch.amax if reduce == "amax" else torch.sum
    step = max(1, (GRAIN - 1) // block)
    if values.is_contiguous() and values.shape[1] == blocks * block:
        pieces = [(values.view(batch * blocks, block), out.view(batch * blocks))]
    else:  # row by row (a short last block, or strided rows)
        rows = values[:, : blocks * block]
        pieces = [(rows[b].reshape(blocks, block), out[b]) for b in range(batch)]
    for source, result in pieces:
        for start in range(0, source.shape[0], step):
            op(source[start : start + step], -1, out=result[start : start + step])
    return out
