"""The orchestration of :func:`fastsample.distributed.sample`: one call, collective by collective.

Checks (:mod:`.agree`), then the first all-gather of per-shard summaries, the weights and global
cuts (:mod:`.shard`, :mod:`.cuts`), the slot masses and the draws; see
:mod:`fastsample.distributed` for the protocol.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels import backend
from ..ops import validation as v
from ..ops.cuts import keep_at_least, predecessor
from ..ops.race import repeat_last_genuine
from ..ops.select import block_maxima, first_argmax, top_entries
from ..ops.weights import controls_in_range
from ..sampling import SampleOutput
from . import triton_round
from .agree import Call, agree, check_call, local_value_error
from .comm import Comm
from .cuts import global_cut
from .shard import Layout, draw_in_slot, shard_weights, slot_sums

__all__ = ["sample"]


def sample(
    logits: Tensor | None = None,
    probs: Tensor | None = None,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    temperature: float | Tensor | None = None,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    cut_order: str = "transformers",
    num_samples: int = 1,
    seed: int | Tensor | None = None,
    step: int | Tensor | None = None,
    stream: int | Tensor = 0,
    check: bool = False,
) -> SampleOutput:
    """:func:`fastsample.sample` over a vocabulary sharded across the ranks of ``group``.

    Call it on every rank of ``group`` (collectively, same arguments except the shard) with
    that rank's shard: columns ``[vocab_start, vocab_start + V_local)`` of the
    ``(B, vocab_size)`` logits (or probabilities). Shards may be uneven and in any rank order;
    together they must cover the vocabulary exactly once.

    Math: as :func:`fastsample.sample` on the concatenated vocabulary. Weights
    ``w = exp((x - max x) / T)`` with the *global* row maximum (``(p / max p)^(1/T)`` for
    ``probs``), kept where ``w >= max(cut_k, cut_p, cut_min)`` (top-k with ties kept, top-p on
    the mass ``cut_order`` names, min-p relative to the global maximum), then
    ``num_samples`` ordered draws without replacement; ``T == 0`` is greedy (the first global
    index among the maximal entries). How each step combines across shards, what it sends and
    when the result is bitwise the single-process one: see :mod:`fastsample.distributed`.

    Args:
        logits, probs: exactly one, this rank's ``(B, V_local)`` shard, float16/bfloat16/
            float32/float64, on the device the group's backend uses (CPU for gloo, the rank's
            GPU for NCCL). Detached after the checks if it requires grad (not differentiable).
        vocab_start: global id of the shard's first column (Python int).
        vocab_size: the full vocabulary size ``V`` (Python int, same on every rank).
        group: the process group (default: the world group).
        temperature, top_k, top_p, min_p: as in :func:`fastsample.sample` (Python numbers or
            ``(B,)`` tensors); must be the same on every rank.
        cut_order: as in :func:`fastsample.sample`: top-p's mass is that of the top-k
            survivors (``"transformers"``), of min-p's and top-k's (``"vllm"``) or of the
            whole row (``"joint"``), over every shard.
        num_samples: ``n``, ``1 <= n <= V``.
        seed, step, stream: counter-based per-request randomness, as in
            :func:`fastsample.sample`: identical on every rank by construction, and the same
            tokens as one process with the same seeds. With ``seed=None`` the uniforms come
            from group rank 0's default generator (sent along in the first collective), so the
            ranks agree whatever their generator states.
        check: if True, first compare every rank's arguments (batch size, vocab_size,
            controls, seeds; shards that overlap, leave gaps or miss the end) and values (NaN,
            +inf, negative probabilities, rows with nothing to draw on any rank) and raise the
            same ``ValueError`` on every rank. Costs two extra collectives and host syncs. Without
            it, ranks that disagree on shapes or Python arguments issue mismatched collectives
            (the backend may raise or hang).

    Returns:
        :class:`fastsample.SampleOutput` ``(token_ids, probs, valid, logprobs)``, identical on
        every rank: global ids ``(B, n)`` int64 in ``[0, V)``, their processed probabilities
        and log-probabilities, and ``(B,)`` validity. A row that is bad on any shard (NaN,
        +inf, negative probabilities, nothing kept anywhere, out-of-range tensor controls) is
        invalid on every rank, with ids ``0..n-1``. ``top_logprobs`` is not offered here.

    Example (on each of 2 ranks; a runnable version is in the README):
        >>> rank = torch.distributed.get_rank()  # doctest: +SKIP
        >>> shard = full_logits[:, rank * 16000 : (rank + 1) * 16000]  # doctest: +SKIP
        >>> out = sample(shard, vocab_start=rank * 16000, vocab_size=32000,  # doctest: +SKIP
        ...              temperature=0.7, top_p=0.9, seed=seeds)
        >>> out.token_ids  # the same global ids on both ranks  # doctest: +SKIP
    """
    comm = Comm(group)
    check = v.check_flag(check, "check")
    args = (logits, probs, vocab_start, vocab_size, (temperature, top_k, top_p, min_p))
    if check:
        call: Call | None = None
        error: str | None = None
        try:
            call = check_call(comm, *args, num_samples, seed, step, stream, cut_order)
            error = local_value_error(call)
        except (TypeError, ValueError) as e:
            error = str(e)
        agree(comm, call, error, (seed, step, stream), logits if logits is not None else probs)
        assert call is not None
    else:
        call = check_call(comm, *args, num_samples, seed, step, stream, cut_order)
    # Sampling is not differentiable: values only, once, after the checks.
    x = v.detached(call.source)
    is_logits = call.logits is not None
    call = replace(call, source=x, logits=x if is_logits else None, probs=None if is_logits else x)
    return _sample(comm, call)


def _sample(comm: Comm, call: Call) -> SampleOutput:
    x, layout, controls, n = call.source, call.layout, call.controls, call.num_samples
    if triton_round.covered(call) and backend.use_triton(x.device.type):  # FASTSAMPLE_BACKEND
        return triton_round.sample_round(comm, call)  # three launches plus the collectives
    batch, device = x.shape[0], x.device
    is_logits = call.logits is not None
    out_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    greedy_possible = isinstance(controls.temperature, Tensor) or controls.all_greedy

    # 1. One all-gather of per-shard summaries: maximum, badness, greedy candidates, uniforms.
    maxima = block_maxima(x)
    best = maxima.amax(-1).to(torch.float64)
    # Logits: a NaN anywhere makes the maximum NaN. Probabilities: NaN fails `>= 0` as well.
    bad = best.isnan() if is_logits else ~(x.amin(-1) >= 0)
    columns = [torch.where(bad, -math.inf, best)[:, None], bad.to(torch.float64)[:, None]]
    if greedy_possible and n == 1:
        columns.append((first_argmax(x, maxima) + layout.start).to(torch.float64)[:, None])
    elif greedy_possible:
        mine = min(n, layout.local)
        top_values, top_ids = top_entries(x, mine, maxima)
        pad = (0, n - mine)
        columns.append(torch.nn.functional.pad(top_values.double(), pad, value=-math.inf))
        ids = (top_ids + layout.start).double()
        columns.append(torch.nn.functional.pad(ids, pad, value=float(layout.vocab)))
    draws_random = not controls.all_greedy
    if draws_random and not call.seeded:
        columns.append(call.uniforms.row_uniforms(n))
    table = comm.all_gather(torch.cat(columns, dim=1))  # (world, B, c)
    top = table[:, :, 0].amax(0)
    clean = ~(table[:, :, 1].amax(0) > 0)
    if is_logits:
        finite = clean & (top > -math.inf) & (top < math.inf)
    else:
        finite = clean & (top > 0) & (top < math.inf)

    greedy_ids = greedy_genuine = None
    if greedy_possible and n == 1:
        candidate = torch.where(table[:, :, 0] == top, table[:, :, 2], float(layout.vocab))
        greedy_ids = candidate.amin(0).long().clamp_(0, layout.vocab - 1)[:, None]
        greedy_genuine = torch.ones_like(greedy_ids, dtype=torch.bool)
    elif greedy_possible:
        width = table.shape[0] * n  # every rank's n largest (explicit: batch may be 0)
        values = table[:, :, 2 : 2 + n].permute(1, 0, 2).reshape(batch, width)
        ids = table[:, :, 2 + n : 2 + 2 * n].permute(1, 0, 2).reshape(batch, width)
        # n largest, ties by the lower global id: order by id, then stably by value.
        by_id = ids.argsort(dim=1)
        values, ids = values.gather(1, by_id), ids.gather(1, by_id)
        order = values.sort(dim=1, descending=True, stable=True).indices[:, :n]
        values, ids = values.gather(1, order), ids.gather(1, order)
        greedy_genuine = values > (-math.inf if is_logits else 0.0)
        ids = ids.long().clamp_(0, layout.vocab - 1)
        greedy_ids = repeat_last_genuine(ids, greedy_genuine)

    fallback = torch.arange(n, device=device).expand(batch, n)
    if controls.all_greedy:  # as fastsample.stages.draw._all_greedy: nothing random, no weights
        assert greedy_ids is not None and greedy_genuine is not None
        keep = finite[:, None] & greedy_genuine
        return SampleOutput(
            torch.where(finite[:, None], greedy_ids, fallback),
            keep.to(out_dtype),
            finite & greedy_genuine.all(-1),
            torch.where(keep, 0.0, -math.inf).to(out_dtype),
        )

    # 2. Weights with the global maximum, the global cuts, then the slot masses.
    buffer = shard_weights(call.logits, call.probs, controls, top, finite, layout)
    weights = buffer[:, : layout.width]
    valid = finite & controls_in_range(controls, batch, device)
    only_min_p = controls.top_k is None and controls.top_p is None
    if only_min_p and isinstance(controls.min_p, float) and is_logits:
        # As one process: every row's largest weight is exactly 1, so the cut is one number
        # for the batch, kept as w > its predecessor, in place, no division.
        below = predecessor(controls.min_p, weights.dtype)
        torch.nn.functional.threshold_(buffer, below, 0.0)
    else:
        cut = global_cut(comm, buffer, call, maxima)
        if cut is not None:
            weights, _ = keep_at_least(weights, cut, out=weights)
    sums = comm.all_reduce(slot_sums(weights, layout), "sum").to(torch.float64)
    total = _grid_total(sums, layout)
    valid = valid & (total > 0) & (total < math.inf)

    # 3. The draws: every rank picks the same slot; its owner scans it; MAX shares the result.
    # Counter-based uniforms are the same on every rank; generator ones are rank 0's.
    uniforms = call.uniforms.row_uniforms(n) if call.seeded else table[0, :, -n:]
    floor = torch.zeros((), dtype=torch.float64, device=device)
    token_ids: list[Tensor] = []
    genuine: list[Tensor] = []
    drawn: list[Tensor] = []
    for k in range(n):
        prefix = sums.cumsum(-1)
        remaining = prefix[:, -1:]
        target = torch.minimum(uniforms[:, k : k + 1] * remaining, remaining.nextafter(floor))
        slot = torch.searchsorted(prefix, target, right=True).clamp_max_(layout.slots - 1)
        slot_sum = sums.gather(1, slot)
        fraction = ((target - (prefix.gather(1, slot) - slot_sum)) / slot_sum).clamp_(0, 1)
        more = k + 1 < n
        token, weight, left, owned = draw_in_slot(weights, layout, slot, fraction, token_ids, more)
        # Ranks that do not own the slot send values below any real one (scalars in torch.where:
        # no host-to-device copy on the hot path); NaN (bad rows) must not win the MAX.
        parts = [torch.where(owned, token.to(torch.float64), -1.0)]
        for value in (weight, left) if left is not None else (weight,):
            parts.append(torch.where(owned, value.nan_to_num(nan=-math.inf), -math.inf))
        result = comm.all_reduce(torch.cat(parts, dim=1), "max")
        token = result[:, :1].clamp(0, layout.vocab - 1).long()
        is_genuine = remaining > 0
        if token_ids:  # a row that ran out of kept tokens repeats its previous draw
            token = torch.where(is_genuine, token, token_ids[-1])
        token_ids.append(token)
        genuine.append(is_genuine)
        drawn.append(result[:, 1:2])
        if more:
            sums = sums.scatter(1, slot, result[:, 2:3])
    ids = token_ids[0] if n == 1 else torch.cat(token_ids, dim=1)
    ok = genuine[0] if n == 1 else torch.cat(genuine, dim=1)
    weight = drawn[0] if n == 1 else torch.cat(drawn, dim=1)
    greedy = None
    if isinstance(controls.temperature, Tensor):
        assert greedy_ids is not None and greedy_genuine is not None
        greedy = controls.temperature == 0
        ids = torch.where(greedy[:, None], greedy_ids, ids)
        ok = torch.where(greedy[:, None], greedy_genuine, ok)

    # 4. As fastsample.stages.output.finish, on the shared drawn weights and total.
    keep = valid[:, None] & ok
    token_probs = torch.where(keep, weight / total[:, None], 0.0)
    logprobs = torch.where(keep, weight.log() - total.log()[:, None], -math.inf)
    ids = torch.where(valid[:, None], ids, fallback)
    all_ok = ok[:, 0] if n == 1 else ok.all(-1)
    out = SampleOutput(ids, token_probs.to(out_dtype), valid & all_ok, logprobs.to(out_dtype))
    if greedy is not None:  # a point mass: probability 1 for every genuine greedy draw
        point = out.valid[:, None] & ok & greedy[:, None]
        out = out._replace(
            probs=torch.where(point, 1.0, out.probs).to(out_dtype),
            logprobs=torch.where(point, 0.0, out.logprobs).to(out_dtype),  # type: ignore[arg-type]
        )
    return out


def _grid_total(sums: Tensor, layout: Layout) -> Tensor:
    """Row totals of global slot sums, as the single-process ``sums.sum(-1)`` over blocks
    (the head slots, zero for aligned shards, are added after)."""
    sums = sums.to(torch.float64)
    return sums[:, : layout.grid].sum(-1) + sums[:, layout.grid :].sum(-1)
