"""vLLM's persistent input batch, with a way back to it from the sampling metadata.

vLLM's ``Sampler`` is given the logits and a ``SamplingMetadata`` only. fastsample needs two
more things per row, which the runner's ``InputBatch`` holds on the host:

* the request's position (tokens emitted so far: ``num_tokens_no_spec - num_prompt_tokens``),
  the ``step`` of its counter-based randomness and min-tokens' output length; vLLM keeps it
  exact (a token the runner discards, such as one sampled for an unfinished chunked prefill,
  is not counted);
* the request's id, so that an unseeded request keeps the random key it got when it joined;
* the request's fastsample stages (``SamplingParams.extra_args["fastsample"]``,
  :mod:`.request_stages`), read when it joins, and its context tokens for the history stages.

:class:`FastsampleInputBatch` is vLLM's ``InputBatch`` whose metadata, when rebuilt (the
batch changed), carries a weak reference to the batch (:data:`ROWS_ATTRIBUTE`).
:class:`Rows` reads it: the positions of all rows are one vectorized numpy subtraction, no
Python loop over requests.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from vllm.v1.worker.gpu_input_batch import InputBatch

from . import request_stages

ROWS_ATTRIBUTE = "fastsample_rows"


class FastsampleInputBatch(InputBatch):
    """vLLM's ``InputBatch``; its sampling metadata points back to it, and it keeps each
    request's fastsample stages by request id."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fastsample_stages: dict[str, dict] = {}

    def add_request(self, request):
        from . import _warn_once

        params = getattr(request, "sampling_params", None)
        stages = None if params is None else request_stages.checked_or_none(
            params.extra_args, self.vocab_size, _warn_once)  # fmt: skip
        if stages:
            self.fastsample_stages[request.req_id] = stages
        else:
            self.fastsample_stages.pop(request.req_id, None)
        return super().add_request(request)

    def remove_request(self, req_id: str):
        self.fastsample_stages.pop(req_id, None)
        return super().remove_request(req_id)

    def _make_sampling_metadata(self):
        metadata = super()._make_sampling_metadata()
        setattr(metadata, ROWS_ATTRIBUTE, weakref.ref(self))
        return metadata


class Rows:
    """The host-side facts of a metadata's rows (or, without an input batch, none)."""

    def __init__(self, metadata: object, batch: int) -> None:
        ref = getattr(metadata, ROWS_ATTRIBUTE, None)
        self._batch_ref = ref
        self.batch = batch
        source = ref() if ref is not None else None
        self.req_ids: list[str] | None = None
        if source is not None and source.num_reqs == batch:
            self.req_ids = list(source.req_ids[:batch])
        else:
            self._batch_ref = None

    @property
    def known(self) -> bool:
        return self._source() is not None

    def _source(self) -> InputBatch | None:
        """The input batch the metadata came from, while it lives."""
        return self._batch_ref() if self._batch_ref is not None else None

    def stages(self) -> list[dict | None]:
        """Each row's fastsample stages (None: none asked, or no input batch)."""
        source = self._source()
        if source is None or self.req_ids is None:
            return [None] * self.batch
        table = getattr(source, "fastsample_stages", {})
        return [table.get(r) for r in self.req_ids]

    @property
    def context_limit(self) -> int | None:
        """The model's context length (the token table's width), or None without a batch."""
        source = self._source()
        return None if source is None else int(source.token_ids_cpu.shape[1])

    def prompt_lengths(self) -> np.ndarray | None:
        """``(B,)`` int64 prompt lengths (None without a batch)."""
        source = self._source()
        return None if source is None else source.num_prompt_tokens[: self.batch].astype(np.int64)

    def prompt_ids(self, which: list[int]) -> torch.Tensor | None:
        """``(len(which), longest prompt)`` int64 prompts of rows ``which``, -1 padded, read
        from the batch's token table (None without a batch)."""
        source = self._source()
        if source is None:
            return None
        rows = np.asarray(which, dtype=np.int64)
        prompt = source.num_prompt_tokens[rows].astype(np.int64)
        return _spans(source.token_ids_cpu, rows, np.zeros_like(prompt), prompt)

    def lengths(self) -> np.ndarray | None:
        """``(B,)`` int64: tokens each request has emitted so far (None without a batch)."""
        source = self._source()
        if source is None:
            return None
        b = self.batch
        return source.num_tokens_no_spec[:b].astype(np.int64) - source.num_prompt_tokens[:b]

    def output_ids(self, lengths: np.ndarray, which: list[int]) -> torch.Tensor | None:
        """``(len(which), max length)`` int64 tokens rows ``which`` emitted, -1 padded, read
        from the batch's token table (``lengths``: every row's)."""
        source = self._source()
        if source is None:
            return None
        rows = np.asarray(which, dtype=np.int64)
        prompt = source.num_prompt_tokens[rows].astype(np.int64)
        return _spans(source.token_ids_cpu, rows, prompt, lengths[rows])


def _spans(table: np.ndarray, rows: np.ndarray, start: np.ndarray,
           length: np.ndarray) -> torch.Tensor:  # fmt: skip
    """``(len(rows), longest)`` int64: ``length[i]`` tokens of the token table's row
    ``rows[i]`` from column ``start[i]``, -1 padded."""
    width = int(length.max(initial=0))
    columns = np.minimum(start[:, None] + np.arange(width), table.shape[1] - 1)
    ids = np.take_along_axis(table[rows], columns, axis=1).astype(np.int64)
    return torch.from_numpy(np.where(np.arange(width) < length[:, None], ids, -1))
