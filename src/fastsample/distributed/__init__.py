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
  counted on every shard (one ``(B,)`` all-reduce). Otherwise
  (tensor ``top_k``/``top_p``, larger ``k``) the radix selection of :mod:`fastsample.select` runs
  across shards: its per-round histograms of bit-pattern digits are additive, so a SUM
  all-reduce of each round's ``(B, 1024)`` histogram gives every rank the global histogram and
  the same digit; three rounds (float32 weights lie in ``[0, 1]``: 30 pattern bits) give the
  exact threshold bit pattern, ties included. Min-p is relative to the global maximum, which
  is 1 after the shift: no communication;
* the draw: the blocked inverse CDF (:mod:`fastsample.inverse_cdf`) needs the float64 prefix over
  block sums and one uniform per row. A SUM all-reduce of ``(B, S)`` slot sums (the blocks of
  256 entries; see :mod:`fastsample._shard` for uneven shards) gives every rank the same prefix;
  the uniforms are identical on every rank (counter-based ``seed=``, or rank 0's generator
  draws, shipped in the first all-gather). Every rank finds the same slot; the one rank that
  owns it scans its entries, and a MAX all-reduce of ``(B, 3)`` shares the global id, its
  weight and the slot's remaining mass. Further draws repeat that step with the drawn entry
  removed (as in :func:`fastsample.inverse_cdf.inverse_cdf_draw`).

Bitwise equality with one process. When every shard starts on a multiple of
:data:`fastsample.inverse_cdf.BLOCK` (256) and ``ceil(vocab_size / 256) + world <= 1024``, the
slots are the single-process blocks and every weight, block sum, prefix, uniform and in-block
scan is computed by the same ops on the same values: the tokens, probabilities and
log-probabilities are bitwise those of :func:`fastsample.sample` with the same seeds and
steps. One exception: a radix top-p cut compares float32 bucket masses that the shards
accumulate in another order, so the kept set can differ when ``top_p * mass`` lies within
float32 rounding (~1e-7 relative) of a cumulative mass. (``probs`` with a temperature are
raised to ``1/T`` as ``exp(log(p) / T)``, not with ``pow``, whose CPU kernel rounds an entry
by its position in the vector loop; see :mod:`fastsample.controls`.) With
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
top-p after candidate top-k, Python p  all-reduce SUM float64         1 (ties at cut_k)
top-p otherwise                        3 x all-reduce SUM (7)          1024
draw: slot masses                      all-reduce SUM                  S <= 1024
draw: each of the n draws              all-reduce MAX float64          3 (2 for the last)
=====================================  ==============================  =====================

``S = ceil(vocab_size / 256) + world`` slots (float32 for float32 weights). A Python
``temperature=0`` (all greedy) needs only the first all-gather. Never ``O(B x V)``;
no host sync beyond the collectives themselves (all shapes and the number of collectives are
fixed by the Python arguments). :func:`record_traffic` records each call's collectives and
bytes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import validation as v
from ..ops.cuts import (
    as_rows,
    count_equal,
    keep_at_least,
    predecessor,
    top_p_cut_from_candidates,
)
from ..ops.noise import UniformSource
from ..ops.pieces import piece_rows
from ..ops.race import repeat_last_genuine
from ..ops.seeds import make_source
from ..ops.select import (
    CANDIDATE_MAX_K,
    block_maxima,
    descend,
    first_argmax,
    key_scratch,
    largest_entries,
    top_entries,
)
from ..ops.validation import Controls, check_controls, check_source
from ..ops.weights import controls_in_range
from ..sampling import SampleOutput
from .shard import (
    RADIX_PIECE_BYTES,
    RADIX_ROUNDS,
    Layout,
    draw_in_slot,
    make_layout,
    radix_histogram,
    shard_weights,
    slot_sums,
)

__all__ = ["Collective", "Traffic", "record_traffic", "sample"]


# ---------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Collective:
    """One collective of a call, as seen from one rank.

    Attributes:
        kind: ``"all_gather"``, ``"all_reduce(sum)"`` or ``"all_reduce(max)"``.
        shape: the shape of the tensor this rank contributes.
        dtype: its dtype.
        payload_bytes: ``numel * element_size`` of that tensor.
        wire_bytes: what a ring implementation sends from this rank: ``2 (W-1)/W`` x the
            payload for an all-reduce, ``(W-1)`` x for an all-gather.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload_bytes: int
    wire_bytes: int

    @property
    def values_per_row(self) -> int:
        """Values per batch row (the tensor's trailing size)."""
        return int(math.prod(self.shape[1:])) if len(self.shape) > 1 else 1


@dataclass
class Traffic:
    """The collectives recorded by :func:`record_traffic` (in call order)."""

    collectives: list[Collective] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.collectives)

    @property
    def payload_bytes(self) -> int:
        """Bytes this rank handed to collectives."""
        return sum(c.payload_bytes for c in self.collectives)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends with ring algorithms (see :class:`Collective`)."""
        return sum(c.wire_bytes for c in self.collectives)


_RECORDERS: list[Traffic] = []


@contextlib.contextmanager
def record_traffic() -> Iterator[Traffic]:
    """Record the collectives that :func:`sample` issues on this rank inside the block.

    Example:
        >>> with record_traffic() as traffic:  # doctest: +SKIP
        ...     out = sample(shard, vocab_start=start, vocab_size=vocab, seed=seeds)
        >>> traffic.count, traffic.payload_bytes  # doctest: +SKIP
        (3, 130560)
    """
    traffic = Traffic()
    _RECORDERS.append(traffic)
    try:
        yield traffic
    finally:
        _RECORDERS.remove(traffic)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _Comm:
    """The process group, and the only place collectives are issued (so they are counted)."""

    def __init__(self, group: dist.ProcessGroup | None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "fastsample.distributed.sample needs an initialized process group: call "
                "torch.distributed.init_process_group(...) on every rank first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given group")

    def _record(self, kind: str, tensor: Tensor, factor: float) -> None:
        size = tensor.numel() * tensor.element_size()
        entry = Collective(kind, tuple(tensor.shape), tensor.dtype, size, round(size * factor))
        for traffic in _RECORDERS:
            traffic.collectives.append(entry)

    def all_reduce(self, tensor: Tensor, op: str) -> Tensor:
        """In-place all-reduce of a contiguous tensor; returns it."""
        tensor = tensor.contiguous()
        self._record(f"all_reduce({op})", tensor, 2 * (self.world - 1) / self.world)
        dist.all_reduce(tensor, op=_OPS[op], group=self.group)
        return tensor

    def all_gather(self, tensor: Tensor) -> Tensor:
        """``(world, *tensor.shape)``: every rank's tensor, in group-rank order."""
        tensor = tensor.contiguous()
        self._record("all_gather", tensor, self.world - 1)
        out = tensor.new_empty((self.world * tensor.shape[0], *tensor.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, tensor, group=self.group)
        return out.view(self.world, *tensor.shape)

    def device(self, like: object) -> torch.device:
        """Where this group's tensors live: the data's device, else the backend's."""
        if isinstance(like, Tensor):
            return like.device
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


# ---------------------------------------------------------------------------- arguments


@dataclass
class _Call:
    """The checked arguments of one call."""

    logits: Tensor | None
    probs: Tensor | None
    source: Tensor
    layout: Layout
    controls: Controls
    num_samples: int
    seeded: bool
    uniforms: UniformSource


def _check_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    return value


def _check_call(
    comm: _Comm,
    logits: object,
    probs: object,
    vocab_start: object,
    vocab_size: object,
    controls: tuple[object, object, object, object],
    num_samples: object,
    seed: object,
    step: object,
    stream: object,
) -> _Call:
    """Every argument check, on this rank's arguments only; raises before any work."""
    source = check_source(logits, probs)
    batch, local = source.shape
    vocab = _check_int(vocab_size, "vocab_size")
    start = _check_int(vocab_start, "vocab_start")
    if vocab < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab}")
    if not 0 <= start <= vocab - local:
        raise ValueError(
            f"this rank's shard [vocab_start, vocab_start + V_local) = [{start}, {start + local}) "
            f"must lie inside the vocabulary [0, {vocab})"
        )
    checked = check_controls(*controls, batch, vocab, source.device)
    n = v.check_num_samples(num_samples, vocab)
    uniforms = make_source(None, seed, step, stream, batch, source.device)
    layout = make_layout(start, local, vocab, comm.rank, comm.world)
    return _Call(
        logits,  # type: ignore[arg-type]
        probs,  # type: ignore[arg-type]
        source,
        layout,
        checked,
        n,
        seed is not None,
        uniforms,
    )


# ---------------------------------------------------------------------------- check=True

_MESSAGE_BYTES = 512
_FIELDS = (
    "status",
    "the batch size B",
    "vocab_start",
    "V_local",
    "vocab_size",
    "num_samples",
    "whether logits or probs are passed",
    "the input dtype",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed/step/stream",
)
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _fingerprint(values: list[object]) -> int:
    """A 62-bit digest of Python numbers and tensors, to compare what the ranks passed
    (integers exactly, floats by their float64 bit patterns; the kind of each value counts)."""
    digest = 0
    for i, value in enumerate(values):
        if value is None:
            kind, part = 1, 0
        elif isinstance(value, Tensor):
            if value.dtype.is_floating_point:
                bits = value.detach().to(torch.float64).reshape(-1).view(torch.int64).cpu()
            else:
                bits = value.detach().to(torch.int64).reshape(-1).cpu()
            weights = torch.arange(bits.numel(), dtype=torch.int64) * 2 + 2 * i + 1
            kind, part = 2, int((bits * weights).sum()) ^ bits.numel()
        elif isinstance(value, int):
            kind, part = 3, value
        else:
            as_tensor = torch.tensor(float(value), dtype=torch.float64)  # type: ignore[arg-type]
            kind, part = 4, int(as_tensor.view(torch.int64))
        digest = (digest * 1000003 + kind * 7919 + part) & ((1 << 62) - 1)
    return digest


def _meta_row(call: _Call | None, error: str | None, randomness: tuple[object, ...]) -> list[int]:
    """This rank's fixed-size summary for the agreement check (one int64 per field)."""
    if call is None:
        return [1] + [-1] * (len(_FIELDS) - 1)
    c = call.controls
    return [
        1 if error else 0,
        call.source.shape[0],
        call.layout.start,
        call.layout.local,
        call.layout.vocab,
        call.num_samples,
        0 if call.logits is not None else 1,
        _DTYPE_CODES[call.source.dtype],
        *(_fingerprint([ctl]) for ctl in (c.temperature, c.top_k, c.top_p, c.min_p)),
        _fingerprint(list(randomness)),
    ]


def _local_value_error(call: _Call) -> str | None:
    """The first bad row of this shard or bad control value, as text (syncs)."""
    x = call.source
    if call.logits is not None:
        reasons = [(x.isnan().any(-1), "contains NaN"), ((x == math.inf).any(-1), "contains +inf")]
    else:
        reasons = [
            (x.isnan().any(-1), "contains NaN"),
            (x.isinf().any(-1), "contains +-inf"),
            ((x < 0).any(-1), "contains negative weights"),
        ]
    name = "logits" if call.logits is not None else "probs"
    for flags, why in reasons:
        if bool(flags.any()):
            row = int(flags.to(torch.uint8).argmax())
            return f"{name} row {row} {why}"
    try:
        v.check_control_values(call.controls)
    except ValueError as e:
        return str(e)
    return None


def _agree(
    comm: _Comm,
    call: _Call | None,
    error: str | None,
    randomness: tuple[object, ...],
    like: object,
) -> None:
    """``check=True``: compare every rank's arguments with two collectives and raise the same
    ``ValueError`` on every rank if any rank's arguments or values are bad (no hang: every
    rank takes part in the same collectives before anyone raises)."""
    device = comm.device(like)
    meta = torch.tensor(_meta_row(call, error, randomness), dtype=torch.int64)
    text = (error or "").encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    message = torch.frombuffer(bytearray(text), dtype=torch.uint8).view(torch.int64)
    table = comm.all_gather(torch.cat([meta, message])[None].to(device))[:, 0].cpu()
    prefix = "fastsample.distributed.sample(check=True): "
    for rank in range(comm.world):
        if table[rank, 0] != 0:
            raw = table[rank, len(_FIELDS) :].contiguous().view(torch.uint8).numpy().tobytes()
            why = raw.rstrip(b"\0").decode(errors="replace") or "bad arguments"
            raise ValueError(f"{prefix}rank {rank}: {why}")
    for column, what in enumerate(_FIELDS):
        values = table[:, column].tolist()
        if what in ("status", "vocab_start", "V_local") or len(set(values)) == 1:
            continue
        shown = f" (by rank: {values})" if column in (1, 4, 5) else ""
        raise ValueError(f"{prefix}ranks disagree on {what}{shown}; pass the same on every rank")
    vocab = int(table[0, 4])
    spans = sorted((int(table[r, 2]), int(table[r, 3]), r) for r in range(comm.world))
    end = 0
    for start, local, rank in spans:
        if start > end:
            raise ValueError(
                f"{prefix}the shards leave a gap: no rank holds ids [{end}, {start}) "
                f"(shards by rank: {_spans_text(spans)})"
            )
        if start < end:
            raise ValueError(
                f"{prefix}the shards overlap: rank {rank} starts at {start}, before id {end} "
                f"where the previous shard ends (shards by rank: {_spans_text(spans)})"
            )
        end = start + local
    if end != vocab:
        raise ValueError(
            f"{prefix}the shards cover [0, {end}) but vocab_size is {vocab} "
            f"(shards by rank: {_spans_text(spans)})"
        )
    # Rows that no shard can draw from (all -inf logits, all-zero probabilities): a per-row flag.
    assert call is not None
    x = call.source
    drawable = (x > -math.inf).any(-1) if call.logits is not None else (x > 0).any(-1)
    drawable = comm.all_reduce(drawable.to(torch.float32), "max")
    if bool((drawable == 0).any()):
        row = int((drawable == 0).to(torch.uint8).argmax())
        if call.logits is not None:
            why = "logits row {} is -inf on every rank (every token masked)"
        else:
            why = "probs row {} is zero on every rank (no token can be drawn)"
        raise ValueError(prefix + why.format(row))


def _spans_text(spans: list[tuple[int, int, int]]) -> str:
    return ", ".join(f"rank {r}: [{s}, {s + n})" for s, n, r in sorted(spans, key=lambda t: t[2]))


# ---------------------------------------------------------------------------- cuts


def _radix_threshold(
    comm: _Comm, values: Tensor, target: Tensor, by: str, layout: Layout
) -> Tensor:
    """Across shards: the largest ``t`` whose upper set ``{w >= t}`` holds ``target`` entries
    (``by="count"``) or ``target`` times the total mass (``by="share"``: the total is read off
    the first round's histogram, which holds every weight in ``[0, 1]``).

    ``values``: ``(B, width)`` contiguous weights in ``[0, 1]`` (a padding zero column only
    adds an entry of weight 0, which no threshold of a valid row depends on). One SUM all-reduce
    of a ``(B, 2**width)`` histogram per round; the rounds of
    :data:`~fastsample._shard.RADIX_ROUNDS` cover the bit patterns of weights in ``[0, 1]``.
    """
    dtype = values.dtype
    wide = dtype == torch.float64 or layout.vocab >= 1 << 24  # float32 counts exact below 2**24
    hist_dtype = torch.float64 if wide else torch.float32
    batch, vocab = values.shape
    # One key scratch for every round, a few rows at a time on CPU (as select's radix).
    row_bytes = vocab * values.element_size()
    keys = key_scratch(values, piece_rows(batch, row_bytes, values.device, RADIX_PIECE_BYTES))
    rounds = RADIX_ROUNDS[dtype]
    remaining = sum(rounds)
    prefix = torch.zeros(batch, 1, dtype=torch.int64, device=values.device)
    above = torch.zeros(batch, dtype=torch.float64, device=values.device)
    for i, width in enumerate(rounds):
        remaining -= width
        hist = radix_histogram(values, keys, prefix, remaining, width, hist_dtype, by)
        hist = comm.all_reduce(hist, "sum")
        if i == 0 and by == "share":
            target = target * hist.sum(-1, dtype=torch.float64)
        digit, above = descend(hist, target, above)
        prefix = (prefix << width) | digit
    prefix = prefix.squeeze(1)
    if dtype == torch.float64:
        return prefix.view(torch.float64)
    return prefix.to(torch.int32).view(torch.float32)


def _grid_total(sums: Tensor, layout: Layout) -> Tensor:
    """Row totals of global slot sums, as the single-process ``sums.sum(-1)`` over blocks
    (the head slots, zero for aligned shards, are added after)."""
    sums = sums.to(torch.float64)
    return sums[:, : layout.grid].sum(-1) + sums[:, layout.grid :].sum(-1)


def _cuts(comm: _Comm, buffer: Tensor, call: _Call, maxima: Tensor) -> Tensor | None:
    """The global per-row threshold ``max(cut_k, cut_p, cut_min)`` (as in
    ``fastsample.controls._cuts``), or None when no control cuts. ``buffer`` is the weight
    buffer of :func:`~fastsample._shard.shard_weights`."""
    controls, layout = call.controls, call.layout
    weights = buffer[:, : layout.width]
    batch = weights.shape[0]
    f64 = torch.zeros(batch, dtype=torch.float64, device=weights.device)
    cut: Tensor | None = None
    candidates: Tensor | None = None
    k = controls.top_k
    if isinstance(k, int) and k <= CANDIDATE_MAX_K:
        # The global k largest weights are among the union of every shard's k largest.
        mine = min(k, layout.local)
        values, ids = largest_entries(call.source, mine, maxima)
        local = torch.where(values > -math.inf, weights.gather(1, ids), 0.0)
        if mine < k:  # a small shard: pad with weight 0 (never above a real k-th weight)
            local = torch.nn.functional.pad(local, (0, k - mine))
        table = comm.all_gather(local)  # (world, B, k)
        merged = table.permute(1, 0, 2).reshape(batch, comm.world * k)
        candidates = merged.topk(k, dim=1).values
        cut = candidates[:, -1]
    elif k is not None:
        k_rows = as_rows(k, batch, f64)
        cut = _radix_threshold(comm, buffer, k_rows, "count", layout)
        cut = torch.where((k_rows > 0) & (k_rows < layout.vocab), cut, 0.0)
    if controls.top_p is not None:
        if candidates is not None and isinstance(controls.top_p, float):
            assert cut is not None
            # The survivors' mass as one process sums it: every survivor above cut_k is a
            # (merged) candidate, the rest are ties at cut_k, counted on every shard.
            ties = comm.all_reduce(count_equal(buffer, cut), "sum")
            strictly_above = torch.where(candidates > cut[:, None], candidates, 0.0)
            mass = strictly_above.sum(-1, dtype=torch.float64) + ties * cut.to(torch.float64)
            cut_p = top_p_cut_from_candidates(candidates, cut, controls.top_p, mass)
        else:
            # Radix on the top-k survivors: above cut_k their upper sets are the weights' own.
            survivors = buffer if cut is None else torch.where(buffer >= cut[:, None], buffer, 0)
            p = as_rows(controls.top_p, batch, f64)
            cut_p = _radix_threshold(comm, survivors, p, "share", layout)
            cut_p = torch.where(p < 1, cut_p, 0.0)
        cut = cut_p if cut is None else torch.maximum(cut, cut_p)
    if controls.min_p is not None:
        # Relative to the global maximum, which is 1 after the shift by the global maximum.
        cut_min = as_rows(controls.min_p, batch, f64).to(weights.dtype)
        cut = cut_min if cut is None else torch.maximum(cut, cut_min)
    return cut


# ---------------------------------------------------------------------------- sample


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
    the top-k survivors renormalized, min-p relative to the global maximum), then
    ``num_samples`` ordered draws without replacement; ``T == 0`` is greedy (the first global
    index among the maximal entries). How each step combines across shards, what it sends and
    when the result is bitwise the single-process one: see :mod:`fastsample.distributed`.

    Args:
        logits, probs: exactly one, this rank's ``(B, V_local)`` shard, float16/bfloat16/
            float32/float64, on the device the group's backend uses (CPU for gloo, the rank's
            GPU for NCCL).
        vocab_start: global id of the shard's first column (Python int).
        vocab_size: the full vocabulary size ``V`` (Python int, same on every rank).
        group: the process group (default: the world group).
        temperature, top_k, top_p, min_p: as in :func:`fastsample.sample` (Python numbers or
            ``(B,)`` tensors); must be the same on every rank.
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
    comm = _Comm(group)
    check = v.check_flag(check, "check")
    args = (logits, probs, vocab_start, vocab_size, (temperature, top_k, top_p, min_p))
    if check:
        call: _Call | None = None
        error: str | None = None
        try:
            call = _check_call(comm, *args, num_samples, seed, step, stream)
            error = _local_value_error(call)
        except (TypeError, ValueError) as e:
            error = str(e)
        _agree(comm, call, error, (seed, step, stream), logits if logits is not None else probs)
        assert call is not None
    else:
        call = _check_call(comm, *args, num_samples, seed, step, stream)
    return _sample(comm, call)


def _sample(comm: _Comm, call: _Call) -> SampleOutput:
    x, layout, controls, n = call.source, call.layout, call.controls, call.num_samples
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
    if controls.all_greedy:  # as fastsample.sampling._all_greedy: nothing random, no weights
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
        cut = _cuts(comm, buffer, call, maxima)
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

    # 4. As fastsample.sampling._finish, on the shared drawn weights and total.
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
