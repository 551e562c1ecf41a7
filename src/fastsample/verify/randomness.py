"""Where verification's uniforms come from: a ``torch.Generator`` or per-request counters.

Chain and tree verification draw the same three kinds of uniforms (one per tested draft or
tree node, one for the draw after a rejection, one for the bonus draw), so both take them
from :func:`uniforms`; the stream layout is described in :mod:`fastsample.verify`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..ops import validation as v
from ..ops.noise import GeneratorSource
from ..ops.seeds import CounterSource, Stream, check_counter_args, make_source


class Seeds(NamedTuple):
    """Checked per-request counters: ``(B,)`` int64 ``seed`` and ``step``."""

    seed: Tensor
    step: Tensor


def random_source(
    generator: object, seed: object, step: object, batch: int, device: torch.device
) -> GeneratorSource | Seeds:
    """Check the randomness arguments (before any work): a generator source, or seeds."""
    v.check_generator(generator, device)
    source = make_source(generator, seed, step, None, batch, device)  # type: ignore[arg-type]
    if isinstance(source, GeneratorSource):
        return source
    return Seeds(*check_counter_args(seed, step, 0, batch, device, int_stream=True)[:2])


def _counters(seeds: Seeds, streams: Sequence[Stream]) -> CounterSource:
    """One counter source over ``len(streams)`` virtual copies of the batch, one per stream:
    row ``b`` of each copy depends only on ``seed[b]``, ``step[b]`` and the stream."""
    batch, copies, device = seeds.seed.shape[0], len(streams), seeds.seed.device
    # Filled on the device (no host-to-device copy: capturable in a CUDA graph).
    stream = torch.cat(
        [torch.full((batch,), int(s), dtype=torch.int64, device=device) for s in streams]
    )
    return CounterSource(seeds.seed.repeat(copies), seeds.step.repeat(copies), stream)


# Up to this many acceptance uniforms per call, one Philox evaluation serves all three
# streams (op count dominates); above, the final draw's streams, which need one uniform
# each, get their own evaluation (volume dominates).
_ONE_PHILOX_CALL_MAX = 8192


def uniforms(
    source: GeneratorSource | Seeds, batch: int, num_accept: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(accept (B, num_accept), recovery (B, 1), bonus (B, 1))`` float64 uniforms in [0, 1).

    Acceptance uniform ``i`` is counter ``i`` of the ``ACCEPT`` stream (draft position ``i``,
    or tree node ``i + 1``); the final draw uses counter 0 of ``RECOVERY`` or ``BONUS``. The
    values depend only on ``(seed, step, stream, counter)``, never on how they are batched.
    A ``torch.Generator`` gives all of them in one ``torch.rand`` call.
    """
    if isinstance(source, GeneratorSource):
        u = source.row_uniforms(num_accept + 2)
        return u[:, :num_accept], u[:, num_accept : num_accept + 1], u[:, num_accept + 1 :]
    if num_accept <= 2 or batch * num_accept <= _ONE_PHILOX_CALL_MAX:
        u = _counters(source, (Stream.ACCEPT, Stream.RECOVERY, Stream.BONUS))
        u = u.row_uniforms(max(num_accept, 1))
        return u[:batch, :num_accept], u[batch : 2 * batch, :1], u[2 * batch :, :1]
    accept = _counters(source, (Stream.ACCEPT,)).row_uniforms(num_accept)
    final = _counters(source, (Stream.RECOVERY, Stream.BONUS)).row_uniforms(1)
    return accept, final[:batch], final[batch:]
