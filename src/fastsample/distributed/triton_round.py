"""One call of :func:`fastsample.distributed.sample` on the Triton backend: one launch per rank
before each of the call's collectives, none after the last (:mod:`fastsample.kernels.shard`,
:mod:`fastsample.kernels.shard_cuts`).

**Launch budget.** A *collective step* is the local work that produces one collective's
payload from what the earlier collectives returned: here it is always exactly one launch.
*One round* is the summaries, the slot masses and one draw: three collective steps, three
launches (the issue's "at most 3 per rank beyond its collectives"). A call costs one launch
per collective in all and no other device work (the outputs are views of the draws'
reduced records; buffers are allocated, never filled by torch ops); each cut step and each
further draw adds one collective and so one launch:

================================  ==============================  ========================
call                              collectives (per rank)          launches = collectives
================================  ==============================  ========================
no cut, or min-p only             all-gather, SUM, MAX            3
Python ``top_k <= 1024``          + all-gather of candidates      4
... and a Python ``top_p``        + SUM of the ties at ``cut_k``  5
other top-k (tensor, ``> 1024``)  + 3 SUM (7 for float64)         6 (10)
other top-p                       + 3 SUM (7 for float64)         +3 (+7)
``num_samples = n``               + (n - 1) MAX                   +(n - 1)
================================  ==============================  ========================

The steps, in order, each a launch followed by its collective (the data flow is the torch
path's, :mod:`fastsample.distributed.sampling`, step for step):

1. ``summaries`` -> all-gather ``(world, B, 2)``: global maximum and validity (with a tensor
   temperature also the shard's first maximal index, or its ``n`` largest entries and their
   ids for ``n`` draws, for greedy rows; unseeded, rank ``r``'s ``n`` generator draws);
2. the cut steps of :mod:`fastsample.kernels.shard_cuts` (the first one also computes the
   weights): the candidates (all-gather), the radix rounds of top-k then top-p (SUM of each
   round's histogram), the ties at the candidate ``cut_k`` (SUM; with ``cut_order="vllm"``
   at ``max(cut_k, cut_min)``, with ``"joint"`` each shard's mass instead);
3. ``APPLY`` (the weights too, when no cut needs a collective): the final cut, the kept
   weights and the slot masses -> all-reduce SUM ``(B, slots)``;
4. ``draw_record`` of draw ``k`` -> all-reduce MAX ``(B, 4)`` int64 (5 words with several
   draws: the drawn slot's mass without the drawn entry, for the next draw): the owner's
   finished result (or, on every rank, a greedy row's point mass, an invalid row's fallback,
   or a row out of kept tokens repeating its previous draw), whose columns are the outputs.
   Draw ``k > 0`` first sets the previous draw's slot to its mass left and removes the earlier
   draws' tokens from the scan, as the torch path does.

Covered calls (:func:`covered`): seeded or not, not all greedy, the 256-entry slot grid
(vocabularies up to ~262k entries), ``world * top_k <= 4096`` for a candidate top-k (the
merged candidates are sorted in registers), temperature, top-k, top-p and min-p as Python
numbers or ``(B,)`` tensors, any ``num_samples`` (greedy rows of a tensor temperature take
the ``n`` largest entries: every shard's ``n`` largest sent in the summaries, merged by rank in
the draw kernel, a row with fewer genuine ones repeating its last, as the torch path; where
such a row's random draws run out before its greedy ones, the torch path reports a ``-inf``
probability for the invalid row, this path 0). Unseeded calls draw ``(B, n)`` uniforms from
every rank's generator (one ``torch.rand``, the only device work besides the launches), sent
in the summaries' last columns; every rank uses rank 0's, as the torch path does. The others
take the torch path (also the reference): a Python ``temperature=0`` (nothing to draw: one
all-gather), coarse slot grids (vocabularies past ~262k entries), ``world * top_k > 4096``.

Equality with the torch path: the weights, the top-k cut (candidates or radix counts), the
candidate top-p cut (the same float64 running sum), min-p and the kept weights are the same
numbers; slot masses are float32 block sums and the scans float64 prefix sums, as there, in
another summation order (a block sum may differ in its last bit, so probabilities agree to
~1e-7 relative and a token can differ only when its uniform lies within that of a boundary:
the tests see equal tokens and validity, probabilities within 1e-6). The
radix top-p cut sums bucket masses in another order, so it can differ where ``top_p`` times
the mass lies within float32 rounding of a cumulative mass (the exception the torch path
already makes against one process, :mod:`fastsample.distributed`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.cuts import predecessor
from ..ops.inverse_cdf import BLOCK
from ..ops.seeds import CounterSource
from ..ops.select import CANDIDATE_MAX_K
from ..ops.weights import compute_dtype
from ..sampling import SampleOutput
from .agree import Call
from .comm import Comm
from .shard import histogram_dtype, probs_are_weights

# Most merged candidates per row (world * top_k) that the kernels sort in registers.
MAX_MERGED = 4096


def covered(call: Call) -> bool:
    """Whether the Triton round handles this call (else the torch path does)."""
    c, layout = call.controls, call.layout
    k = c.top_k
    small_k = isinstance(k, int) and k <= CANDIDATE_MAX_K
    return (
        (isinstance(call.uniforms, CounterSource) or not call.seeded)
        and not c.all_greedy
        and layout.per_slot == BLOCK
        and not (small_k and layout.world * k > MAX_MERGED)
    )


def plan(call: Call) -> tuple[int, int, int, int, list[tuple[int, int]]]:
    """``(k_mode, p_mode, m_mode, p_mass, steps)``: how each cut is taken, which mass top-p
    takes (the cut order), and the ``(step, round)`` launches of a :func:`covered` call, each
    followed by one collective (the last, APPLY, by the slot masses' SUM)."""
    from ..kernels import shard_cuts as sc

    c = call.controls
    dtype = compute_dtype(call.source.dtype)
    k, p, m = c.top_k, c.top_p, c.min_p
    k_mode = sc.OFF if k is None else sc.RADIX
    if isinstance(k, int) and k <= CANDIDATE_MAX_K:
        k_mode = sc.CAND
    p_mode = sc.OFF if p is None else sc.RADIX
    if p is not None and k_mode == sc.CAND and isinstance(p, float):
        p_mode = sc.CAND
    if m is None:
        m_mode = sc.OFF
    elif isinstance(m, Tensor):
        m_mode = sc.MIN_TENSOR
    elif call.logits is not None and k is None and p is None:
        m_mode = sc.PLAIN  # as one process: w > pred(min_p), no division
    else:
        m_mode = sc.MIN_NUMBER
    p_mass = sc.P_ON_K
    if c.min_p_first:
        p_mass = sc.P_ON_MIN_AND_K
    elif c.top_p_on_whole_row:
        p_mass = sc.P_ON_ROW
    rounds = range(sc.WIDTHS[dtype][2])
    steps: list[tuple[int, int]] = []
    if k_mode == sc.CAND:
        steps.append((sc.TOP, 0))
    elif k_mode == sc.RADIX:
        steps += [(sc.HIST_K, r) for r in rounds]
    if p_mode == sc.CAND:
        steps.append((sc.TIES, 0))
    elif p_mode == sc.RADIX:
        steps += [(sc.HIST_P, r) for r in rounds]
    steps.append((sc.APPLY, 0))
    return k_mode, p_mode, m_mode, p_mass, steps


def sample_round(comm: Comm, call: Call) -> SampleOutput:
    """:func:`fastsample.distributed.sample` for a :func:`covered` call, by the kernels."""
    from ..kernels import shard
    from ..kernels import shard_cuts as sc

    x, layout, c = call.source, call.layout, call.controls
    batch = x.shape[0]
    is_logits = call.logits is not None
    dtype = compute_dtype(x.dtype)
    k_mode, p_mode, m_mode, p_mass, steps = plan(call)
    controls = (c.temperature, c.top_k, c.top_p, c.min_p)
    tensors = [v if isinstance(v, Tensor) else None for v in controls]
    greedy = tensors[0] is not None  # rows with T == 0 are greedy
    # Unseeded: every rank draws from its generator (as the torch path), rank 0's are used.
    uniforms = None if call.seeded else call.uniforms.row_uniforms(call.num_samples)
    summary = shard.summaries_op(
        x, layout.start, is_logits, greedy, *tensors, uniforms, call.num_samples, layout.vocab
    )
    table = comm.all_gather(summary)

    numbers: list[float | None] = [None if v is None or t is not None else float(v)
                                   for v, t in zip(controls, tensors, strict=True)]  # fmt: skip
    if numbers[0] is not None:  # as divide_by_temperature_: at least the smallest normal
        numbers[0] = max(numbers[0], torch.finfo(dtype).tiny)
    if m_mode == sc.PLAIN:
        numbers[3] = predecessor(float(c.min_p), dtype)  # type: ignore[arg-type]
    # The torch path uses the probabilities themselves (no copy) exactly in this case.
    no_copy = not is_logits and probs_are_weights(c, x.dtype, layout.vocab)
    k_static = c.top_k if k_mode == sc.CAND else 0
    assert isinstance(k_static, int)
    sizes = [
        layout.local, layout.width, layout.head, layout.first, layout.owned, layout.grid,
        layout.rank, layout.slots,
    ]  # fmt: skip
    # Buffers the launches fill (allocations only: no device work).
    hist_dtype = histogram_dtype(dtype, layout.vocab)
    buckets = batch * sc.histogram_buckets(dtype)
    weights = x.new_empty((batch, layout.width), dtype=dtype)
    sums = x.new_empty((batch, layout.slots), dtype=dtype)
    candidates = x.new_empty((batch, k_static), dtype=dtype)
    hists_k = x.new_empty((buckets if k_mode == sc.RADIX else 0,), dtype=hist_dtype)
    hists_p = x.new_empty((buckets if p_mode == sc.RADIX else 0,), dtype=hist_dtype)
    ties = x.new_empty((batch if p_mode == sc.CAND else 0,), dtype=torch.float64)
    merged = candidates
    for i, (kind, r) in enumerate(steps):
        how = [int(is_logits), int(no_copy), int(i == 0), kind, r, k_mode, p_mode, m_mode, p_mass]
        shard.step_op(
            x, table, weights, sums, candidates, merged, hists_k, hists_p, ties,
            tensors[0], numbers[0], tensors[1], numbers[1], tensors[2], numbers[2],
            tensors[3], numbers[3], [*sizes, layout.vocab, k_static], how,
        )  # fmt: skip
        if kind == sc.TOP:
            merged = comm.all_gather(candidates)
        elif kind in (sc.HIST_K, sc.HIST_P):
            width, _, offset = sc.round_layout(dtype, r)
            flat = hists_k if kind == sc.HIST_K else hists_p
            part = flat[offset * batch : (offset + (1 << width)) * batch]
            comm.all_reduce(part.view(batch, 1 << width), "sum")
        elif kind == sc.TIES:
            comm.all_reduce(ties, "sum")
        else:
            sums = comm.all_reduce(sums, "sum")

    source = call.uniforms
    seed = step = stream_rows = None
    stream = 0
    if isinstance(source, CounterSource):
        seed, step, stream = source.seed, source.step, source.stream
        stream_rows = stream if isinstance(stream, torch.Tensor) else None
    n = call.num_samples
    records = x.new_empty((n, batch, shard.record_words(n, greedy)), dtype=torch.int64)
    live = x.new_empty((batch, layout.slots if n > 1 else 0), dtype=torch.float64)
    chosen = x.new_empty((batch if n > 1 else 0,), dtype=torch.int64)
    for k in range(n):  # each draw: one launch, one MAX of its record
        shard.draw_op(
            weights, sums, table, is_logits, sizes, layout.start, layout.vocab,
            layout.draw_width, seed, step, stream_rows,
            0 if stream_rows is not None else int(stream), tensors[0], records, live, chosen, k,
        )  # fmt: skip
        comm.all_reduce(records[k], "max")
    ids, probs, valid, logprobs = shard.unpack(records, dtype == torch.float64)
    return SampleOutput(ids, probs, valid, logprobs)
