"""``sample`` and ``process`` on the Triton backend: the controls kernels as torch operators.

Entry points (arguments already checked by :func:`fastsample.sample` /
:func:`fastsample.process`, the same checks as the torch path):

* :func:`sample` ``(logits, probs, controls, num_samples, source, num_top) -> SampleOutput``
  fields, for every call (no fallback to the torch ops);
* :func:`process` ``(logits, probs, controls) -> (B, V)`` the processed distribution.

How a call runs. The controls kernel (:mod:`.controls`, one launch) makes every row's kept
weights, block sums, total and validity; greedy rows come out as the point mass at their
first maximal index. ``sample`` then draws with the inverse-CDF draw stage over those block
sums (:func:`fastsample.kernels.inverse_cdf.draw_from_sums`, one launch), whose uniforms are
the torch path's bit for bit for seeded calls (same counters); ``process`` divides by the
total inside the same kernel (one launch). An all-greedy single draw (a Python
``temperature=0``) is one launch of :mod:`.greedy`.

Several draws where rows may be greedy (a ``(B,)`` temperature, or a Python 0, with
``num_samples > 1``): greedy rows take the ``n`` largest inputs in order (ties by the lower
index), probability 1 per genuine draw, as the torch path. The draw launch is then
:func:`fastsample.kernels.greedy.several` instead (``fastsample::greedy_several``): the same
draw stage for the other rows, plus one pass over the input per draw for the greedy ones.
An all-greedy call without ``top_logprobs`` skips the controls kernel (one launch).

Launches per ``sample`` call: 2 (controls, draw), plus one ``randint`` (a per-row Philox key
drawn from the generator) when unseeded; an all-greedy call is 1 (2 with ``top_logprobs``).
Python ``seed``/``step`` ints become ``(B,)`` tensors in the shared argument checks (one
``full`` each), as on the torch path. ``top_logprobs=N`` is N more passes inside the
controls kernel (no extra launch).

Operators. ``fastsample::controls``, ``fastsample::greedy`` and ``fastsample::greedy_several``
are ``torch.library`` operators, so ``torch.compile(fullgraph=True)`` traces through them:
``triton_op`` when the kernels are compiled, ``custom_op`` with a fake implementation when
interpreted. Controls given as Python numbers travel as float/int arguments (their off values:
temperature 1, top_k 0, top_p 1, min_p 0), so no tensor is made for them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.noise import UniformSource
from ..ops.seeds import CounterSource
from ..ops.validation import Controls
from . import controls as _controls
from . import greedy as _greedy
from .ops import counters, draw_from_sums_op
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


def _number(value: object, off: float) -> float:
    return off if value is None or isinstance(value, Tensor) else float(value)  # type: ignore[arg-type]


def _controls_launcher(
    source: Tensor,
    is_logits: bool,
    temperature: Tensor | None,
    temperature_value: float,
    top_k: Tensor | None,
    top_k_value: int,
    top_p: Tensor | None,
    top_p_value: float,
    min_p: Tensor | None,
    min_p_value: float,
    stream: Tensor | None,
    num_top: int,
    normalized: bool,
    cut_order: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    controls = Controls(
        temperature if temperature is not None else _off(temperature_value, 1.0),
        top_k if top_k is not None else (top_k_value or None),
        top_p if top_p is not None else _off(top_p_value, 1.0),
        min_p if min_p is not None else _off(min_p_value, 0.0),
        cut_order,
    )
    logits, probs = (source, None) if is_logits else (None, source)
    got, top_ids, top_logp = _controls.processed_weights(
        logits, probs, controls, stream, num_top, normalized
    )
    return got.weights, got.sums, got.total, got.valid, top_ids, top_logp


def _off(value: float, off: float) -> float | None:
    return None if value == off else value


def _controls_fake(source, is_logits, *controls_and_stream):
    num_top = controls_and_stream[-3]
    return _controls.outputs(source) + _controls.top_outputs(source, num_top)


def _greedy_launcher(
    source: Tensor, is_logits: bool, stream: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _greedy.greedy(source, is_logits, stream)


def _greedy_fake(source, is_logits, stream):
    return _greedy.outputs(source)


def _several_launcher(
    source: Tensor,
    is_logits: bool,
    num_samples: int,
    weights: Tensor | None,
    sums: Tensor | None,
    total: Tensor | None,
    clean: Tensor | None,
    temperature: Tensor | None,
    seed: Tensor | None,
    step: Tensor | None,
    stream_rows: Tensor | None,
    stream_value: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    processed, stream = _joined(weights, sums, total, clean, stream_rows, stream_value)
    return _greedy.several(source, is_logits, num_samples, processed, temperature, seed, step,
                           stream)  # fmt: skip


def _joined(
    weights: Tensor | None,
    sums: Tensor | None,
    total: Tensor | None,
    clean: Tensor | None,
    stream_rows: Tensor | None,
    stream_value: int,
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor] | None, Tensor | int]:
    """A custom op's flat arguments joined back (custom ops take no tuples and no unions):
    the controls kernel's ``(weights, sums, total, clean)`` or None, and the stream."""
    processed = None
    if weights is not None and sums is not None and total is not None and clean is not None:
        processed = (weights, sums, total, clean)
    return processed, stream_value if stream_rows is None else stream_rows


def _several_fake(source, is_logits, num_samples, *rest):
    return _greedy.outputs(source, num_samples)


controls_op = _register("controls", _controls_launcher, _controls_fake)
greedy_op = _register("greedy", _greedy_launcher, _greedy_fake)
several_op = _register("greedy_several", _several_launcher, _several_fake)


def _unit_stride(value):
    """A ``(B,)`` tensor readable at ``ptr + row`` (the kernels' layout): a 0-dim value
    expanded to ``(B,)`` (stride 0) or a strided view is copied, one op; anything else as is."""
    if isinstance(value, Tensor) and value.stride(0) != 1:
        return value.contiguous()
    return value


def _unit_stride_controls(controls: Controls) -> Controls:
    t, k, p, m = controls.temperature, controls.top_k, controls.top_p, controls.min_p
    return Controls(
        _unit_stride(t), _unit_stride(k), _unit_stride(p), _unit_stride(m), controls.cut_order
    )


def _tensor_stream(source: UniformSource) -> Tensor | None:
    """The ``(B,)`` stream of a seeded call, when given as a tensor (checked in the kernel),
    with unit stride (the controls and greedy kernels read ``ptr + row``)."""
    if isinstance(source, CounterSource) and isinstance(source.stream, Tensor):
        return _unit_stride(source.stream)
    return None


def processed(
    logits: Tensor | None,
    probs: Tensor | None,
    controls: Controls,
    stream: Tensor | None,
    num_top: int = 0,
    normalized: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(weights, sums, total, valid, top_ids, top_logprobs)`` of
    :func:`.controls.processed_weights`, as an op (``(B,)`` controls and ``stream`` with unit
    stride: :func:`sample` and :func:`process` see to it)."""
    source = logits if logits is not None else probs
    assert source is not None
    t, k, p, m = controls.temperature, controls.top_k, controls.top_p, controls.min_p
    return controls_op(
        source,
        logits is not None,
        t if isinstance(t, Tensor) else None,
        _number(t, 1.0),
        k if isinstance(k, Tensor) else None,
        int(_number(k, 0)),
        p if isinstance(p, Tensor) else None,
        _number(p, 1.0),
        m if isinstance(m, Tensor) else None,
        _number(m, 0.0),
        stream,
        num_top,
        normalized,
        controls.cut_order,
    )


def sample(
    logits: Tensor | None,
    probs: Tensor | None,
    controls: Controls,
    num_samples: int,
    source: UniformSource,
    num_top: int,
) -> tuple[Tensor, ...]:
    """:func:`fastsample.sample` on the Triton backend: ``(token_ids, probs, valid, logprobs,
    top_token_ids, top_logprobs, weights, total)``: the first six are fields of a
    ``SampleOutput`` (the tops None without ``num_top``; the caller builds the output type, so
    this layer needs nothing from the one above), then the controls kernel's kept weights
    (greedy rows as their point masses) and their total, for the logprobs of other tokens
    (None when every row is greedy and the controls kernel did not run)."""
    data = logits if logits is not None else probs
    assert data is not None
    controls = _unit_stride_controls(controls)
    stream = _tensor_stream(source)
    is_logits = logits is not None
    several = num_samples > 1 and (controls.all_greedy or isinstance(controls.temperature, Tensor))
    if controls.all_greedy and num_top == 0:
        if several:  # the n largest: one launch, no weights
            ids, p_out, logp_out, valid = several_op(
                data, is_logits, num_samples, None, None, None, None, None, None, None, stream, 0
            )
        else:
            ids, p_out, logp_out, valid = greedy_op(data, is_logits, stream)
        return ids, p_out, valid, logp_out, None, None, None, None
    weights, sums, total, clean, top_ids, top_logp = processed(
        logits, probs, controls, stream, num_top
    )
    batch = data.shape[0]
    if several and controls.all_greedy:  # nothing random: the n largest after the controls
        ids, p_out, logp_out, valid = several_op(
            data, is_logits, num_samples, weights, sums, total, clean, None, None, None, stream, 0
        )
    elif several:  # rows where T is 0 take the n largest, the others draw
        seed, step, stream_rows, stream_value = counters(source, batch, data.device)
        ids, p_out, logp_out, valid = several_op(
            data, is_logits, num_samples, weights, sums, total, clean, controls.temperature,
            seed, step, stream_rows, stream_value,
        )  # fmt: skip
    else:
        if controls.all_greedy:
            # Point masses draw the same token whatever the uniform: no generator state used.
            seed = torch.zeros(batch, dtype=torch.int64, device=data.device)
            step, stream_rows, stream_value = None, None, 0
        else:
            seed, step, stream_rows, stream_value = counters(source, batch, data.device)
        ids, p_out, logp_out, valid = draw_from_sums_op(
            weights, sums, total, clean, num_samples, seed, step, stream_rows, stream_value
        )
    if num_top:
        return ids, p_out, valid, logp_out, top_ids, top_logp, weights, total
    return ids, p_out, valid, logp_out, None, None, weights, total


def process(logits: Tensor | None, probs: Tensor | None, controls: Controls) -> Tensor:
    """:func:`fastsample.process` on the Triton backend: kept weights over their total, in the
    controls kernel (one launch)."""
    return processed(logits, probs, _unit_stride_controls(controls), None, normalized=True)[0]
