"""The Triton samplers as torch operators, and the two entry points ``sampling.py`` calls.

Entry points (arguments already checked by ``sampling.py``, the same checks as the torch path):

* :func:`fast_sample` ``(probs, num_samples, source) -> (sample_p, sample_index)``;
* :func:`sample_from_probs` ``(probs, num_samples, method, source) -> (token_ids, probs,
  logprobs, valid)``, ``method`` ``"race"`` or ``"inverse_cdf"``.

``source`` is the :class:`~fastsample.ops.noise.UniformSource` the torch path would use. A
:class:`~fastsample.ops.seeds.CounterSource` passes its seed/step/stream to the kernel, so the
kernel's uniforms are the torch path's, bit for bit. A
:class:`~fastsample.ops.noise.GeneratorSource` (unseeded call) becomes one device op: a 63-bit
Philox key per row drawn from the torch generator (``randint``), with step 0 and stream 0, so
nothing is read back to the host.

Operators. Each launcher is a ``torch.library`` operator (``fastsample::race``,
``fastsample::fast_sample``, ``fastsample::inverse_cdf``, ``fastsample::draw_from_sums``) so
that ``torch.compile(fullgraph=True)`` traces through it: compiled kernels are registered with
``triton_op`` (inductor sees the Triton kernel and can place it in its graph), interpreted
ones with ``custom_op`` and a fake implementation (the interpreter reads raw data pointers,
which tracing cannot give it).

Launches per call: one kernel, plus ``randint`` for unseeded calls; integer ``seed``/``step``
arguments become ``(B,)`` tensors in the shared argument checks (one ``full`` each).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.noise import GeneratorSource, UniformSource
from ..ops.seeds import CounterSource
from . import inverse_cdf as _inverse_cdf
from . import race as _race
from .philox import INTERPRETED

_LIBRARY = "fastsample"


def _register(name: str, launcher, fake):
    """A torch operator for ``launcher``: ``triton_op`` when compiled, else ``custom_op``."""
    qualified = f"{_LIBRARY}::{name}"
    if INTERPRETED:
        op = torch.library.custom_op(qualified, launcher, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(qualified, launcher, mutates_args=())


def _sample_outputs(weights: Tensor, num_samples: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch = weights.shape[0]
    out_dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
    p_out = weights.new_empty((batch, num_samples), dtype=out_dtype)
    return (
        weights.new_empty((batch, num_samples), dtype=torch.int64),
        p_out,
        torch.empty_like(p_out),
        weights.new_empty((batch,), dtype=torch.bool),
    )


def _stream(stream_rows: Tensor | None, stream: int) -> Tensor | int:
    return stream if stream_rows is None else stream_rows


def _race_launcher(
    probs: Tensor,
    num_samples: int,
    seed: Tensor,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _race.race(probs, num_samples, seed, step, _stream(stream_rows, stream), False)  # type: ignore[return-value]


def _race_fake(probs, num_samples, seed, step, stream_rows, stream):
    return _sample_outputs(probs, num_samples)


def _fast_launcher(
    probs: Tensor,
    num_samples: int,
    seed: Tensor,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream: int,
) -> tuple[Tensor, Tensor]:
    return _race.race(probs, num_samples, seed, step, _stream(stream_rows, stream), True)  # type: ignore[return-value]


def _fast_fake(probs, num_samples, seed, step, stream_rows, stream):
    shape = (probs.shape[0], num_samples)
    return probs.new_empty(shape), probs.new_empty(shape, dtype=torch.int64)


def _inverse_cdf_launcher(
    probs: Tensor,
    num_samples: int,
    seed: Tensor,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _inverse_cdf.inverse_cdf(probs, num_samples, seed, step, _stream(stream_rows, stream))


def _draw_from_sums_launcher(
    weights: Tensor,
    sums: Tensor,
    total: Tensor,
    clean: Tensor,
    num_samples: int,
    seed: Tensor,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _inverse_cdf.draw_from_sums(
        weights, sums, total, clean, num_samples, seed, step, _stream(stream_rows, stream)
    )


def _draw_from_sums_fake(weights, sums, total, clean, num_samples, seed, step, stream_rows, stream):
    return _sample_outputs(weights, num_samples)


race_op = _register("race", _race_launcher, _race_fake)
fast_sample_op = _register("fast_sample", _fast_launcher, _fast_fake)
inverse_cdf_op = _register("inverse_cdf", _inverse_cdf_launcher, _race_fake)
draw_from_sums_op = _register("draw_from_sums", _draw_from_sums_launcher, _draw_from_sums_fake)


def counters(
    source: UniformSource, batch: int, device: torch.device
) -> tuple[Tensor, Tensor | None, Tensor | None, int]:
    """``(seed, step, stream_rows, stream)`` kernel counters for the torch path's ``source``.

    Unseeded (a generator): one ``randint`` per call draws each row's 63-bit key on the device.
    """
    if isinstance(source, CounterSource):
        seed, step = source.given()
        # A Python seed or step is one 1-entry tensor broadcast with stride 0 (a Python step
        # of 0 is none at all): the kernels read (B,) counters with any stride.
        if not isinstance(seed, Tensor):
            seed = torch.full((1,), seed, dtype=torch.int64, device=device).expand(batch)
        if not isinstance(step, Tensor):
            step = (
                None
                if step == 0
                else torch.full((1,), step, dtype=torch.int64, device=device).expand(batch)
            )
        stream = source.stream
        if isinstance(stream, Tensor):
            return seed, step, stream, 0
        return seed, step, None, int(stream)
    if not isinstance(source, GeneratorSource):
        raise TypeError(f"no kernel counters for a {type(source).__name__}")
    keys = torch.randint(
        0, 2**63 - 1, (batch,), dtype=torch.int64, device=device, generator=source.generator
    )
    return keys, None, None, 0


def fast_sample(probs: Tensor, num_samples: int, source: UniformSource) -> tuple[Tensor, Tensor]:
    """``(sample_p, sample_index)`` of :func:`fastsample.fast_sample`, by the Triton race."""
    seed, step, stream_rows, stream = counters(source, probs.shape[0], probs.device)
    return fast_sample_op(probs, num_samples, seed, step, stream_rows, stream)


def sample_from_probs(
    probs: Tensor, num_samples: int, method: str, source: UniformSource
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(token_ids, probs, logprobs, valid)`` of :func:`fastsample.sample_from_probs`."""
    seed, step, stream_rows, stream = counters(source, probs.shape[0], probs.device)
    op = race_op if method == "race" else inverse_cdf_op
    return op(probs, num_samples, seed, step, stream_rows, stream)
