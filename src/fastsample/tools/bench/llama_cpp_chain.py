"""llama.cpp's own sampler chain as a benchmark contender (``llama-cpp-python``, no model).

llama.cpp samples one sequence at a time: for each row it fills a candidate array (``id``,
``logit``, ``p`` for every token of the vocabulary) from the logits and applies its chain
(``llama_sampler_apply``), whose samplers sort or partially sort the candidates. This module
builds such a chain through the package's low-level ``llama_sampler_*`` API and times what a
llama.cpp user pays per token: the array's fill and the chain, row after row. No model is
loaded; the package is an optional install (``pip install llama-cpp-python``: it builds
llama.cpp from source, ~5 minutes on 2 cores for the library alone, optimized; ``.ci/run``
builds it at ``-O0`` for the agreement tests, which is no build to time).

:func:`controls_chain` gives the chain of a ``bench --controls`` setting, in llama.cpp's
default order (penalties, top-k, top-p, min-p, then temperature last, and ``dist``), the
order its users run; :func:`chain_call` times any chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

PENALTY_LAST_N = 64
"""llama.cpp's default window of its repetition penalties (``--repeat-last-n``)."""


def load() -> Any:
    """The ``llama_cpp`` module, or None where it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def controls_chain(controls: dict, penalties: dict | None = None) -> Callable[[Any, int], list]:
    """The samplers of a ``bench --controls`` setting (``temperature``, ``top_k``, ``top_p``,
    ``min_p``; ``penalties``: repetition, frequency and presence over the last
    :data:`PENALTY_LAST_N` tokens), as a function of the ``llama_cpp`` module and the
    vocabulary size."""

    def samplers(lc: Any, vocab: int) -> list:
        chain = []
        if penalties:
            chain.append(lc.llama_sampler_init_penalties(
                vocab, PENALTY_LAST_N, penalties["repetition_penalty"],
                penalties["frequency_penalty"], penalties["presence_penalty"],
            ))  # fmt: skip
        if controls.get("top_k", 0) > 0:
            chain.append(lc.llama_sampler_init_top_k(int(controls["top_k"])))
        if controls.get("top_p", 1.0) < 1.0:
            chain.append(lc.llama_sampler_init_top_p(float(controls["top_p"]), 1))
        if controls.get("min_p", 0.0) > 0.0:
            chain.append(lc.llama_sampler_init_min_p(float(controls["min_p"]), 1))
        temperature = float(controls.get("temperature", 1.0))
        if temperature == 0.0:
            return [*chain, lc.llama_sampler_init_greedy()]
        return [*chain, lc.llama_sampler_init_temp(temperature), lc.llama_sampler_init_dist(1)]

    return samplers


def chain_call(
    logits: Callable[[], Tensor],
    vocab: int,
    samplers: Callable[[Any, int], list],
    history: Sequence[int] = (),
) -> Callable[[], list[int]] | None:
    """A call drawing one token per row of ``logits()`` (a ``(B, vocab)`` float32 CPU tensor,
    the next one at each call) with llama.cpp's chain of ``samplers(llama_cpp, vocab)``, the
    ``history`` tokens accepted first (what the penalties and DRY see); it returns the drawn
    ids. None where ``llama_cpp`` is not installed."""
    lc = load()
    if lc is None:
        return None
    import ctypes

    import numpy as np

    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for sampler in samplers(lc, vocab):
        lc.llama_sampler_chain_add(chain, sampler)  # the chain owns (and frees) them
    for token in history:
        lc.llama_sampler_accept(chain, int(token))
    record = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    cells = np.zeros(vocab, dtype=record)
    ids = np.arange(vocab, dtype=np.int32)
    pointer = ctypes.cast(cells.ctypes.data, ctypes.POINTER(lc.llama_token_data))

    def call() -> list[int]:
        drawn = []
        for row in logits().numpy():
            cells["id"] = ids  # the array's fill: llama.cpp pays it every token
            cells["logit"] = row
            array = lc.llama_token_data_array(data=pointer, size=vocab, selected=-1, sorted=False)
            lc.llama_sampler_apply(chain, ctypes.byref(array))
            drawn.append(int(cells["id"][array.selected]))  # the samplers reorder the array
        return drawn

    return call
