"""One round of :func:`fastsample.distributed.sample` on the Triton backend: three launches per
rank plus the round's three collectives (:mod:`fastsample.kernels.shard`).

Covered calls (:func:`covered`; the others take the torch path, which is also the reference):
seeded (``seed=``), one draw, ``temperature`` a positive Python number or None, no top-k or
top-p, ``min_p`` a Python number on logits or None, and the 256-entry slot grid (vocabularies
up to ~262k entries). The data flow is the torch path's (:mod:`fastsample.distributed.sampling`),
step for step:

1. ``summaries`` (launch) -> all-gather ``(world, B, 2)``: global maximum and validity;
2. ``weights_and_sums`` (launch) -> all-reduce SUM ``(B, slots)``: the slot masses;
3. ``draw_record`` (launch) -> all-reduce MAX ``(B, 4)`` int64: the owner's finished result,
   whose columns are the outputs (views: no fourth launch).
"""

from __future__ import annotations

import torch

from ..ops.cuts import predecessor
from ..ops.inverse_cdf import BLOCK
from ..ops.seeds import CounterSource
from ..ops.weights import compute_dtype
from ..sampling import SampleOutput
from .agree import Call
from .comm import Comm


def covered(call: Call) -> bool:
    """Whether the Triton round handles this call (else the torch path does)."""
    c = call.controls
    temperature_ok = c.temperature is None or (
        isinstance(c.temperature, float) and c.temperature > 0
    )
    min_p_ok = c.min_p is None or (isinstance(c.min_p, float) and call.logits is not None)
    return (
        call.seeded
        and isinstance(call.uniforms, CounterSource)
        and call.num_samples == 1
        and c.top_k is None
        and c.top_p is None
        and temperature_ok
        and min_p_ok
        and call.layout.per_slot == BLOCK
    )


def sample_round(comm: Comm, call: Call) -> SampleOutput:
    """:func:`fastsample.distributed.sample` for a :func:`covered` call, by the kernels."""
    from ..kernels import shard

    x, layout, c = call.source, call.layout, call.controls
    is_logits = call.logits is not None
    dtype = compute_dtype(x.dtype)
    table = comm.all_gather(shard.summaries_op(x, is_logits))
    temperature = c.temperature
    if temperature is not None:  # as divide_by_temperature_: at least the smallest normal
        temperature = max(float(temperature), torch.finfo(dtype).tiny)
    min_p_below = predecessor(float(c.min_p), dtype) if c.min_p is not None else None
    # The torch path uses the probabilities themselves (no copy) exactly in this case.
    no_copy = (
        not is_logits and temperature is None and not c.filters and x.dtype == dtype
    ) and layout.vocab % 2 == 0
    sizes = [
        layout.local, layout.width, layout.head, layout.first, layout.owned, layout.grid,
        layout.rank, layout.slots,
    ]  # fmt: skip
    weights, sums = shard.weights_op(x, table, is_logits, sizes, temperature, min_p_below, no_copy)
    sums = comm.all_reduce(sums, "sum")
    source = call.uniforms
    assert isinstance(source, CounterSource)
    stream = source.stream
    stream_rows = stream if isinstance(stream, torch.Tensor) else None
    record = shard.draw_op(
        weights, sums, table, is_logits, sizes, layout.start, layout.vocab, layout.draw_width,
        source.seed, source.step, stream_rows, 0 if stream_rows is not None else int(stream),
    )  # fmt: skip
    record = comm.all_reduce(record, "max")
    ids, probs, valid, logprobs = shard.unpack(record, dtype == torch.float64)
    return SampleOutput(ids, probs, valid, logprobs)
