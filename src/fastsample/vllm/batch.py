"""vLLM's persistent input batch, with a way back to it from the sampling metadata.

vLLM's ``Sampler`` is given the logits and a ``SamplingMetadata`` only. fastsample needs two
more things per row, which the runner's ``InputBatch`` holds on the host:

* the request's position (tokens emitted so far: ``num_tokens_no_spec - num_prompt_tokens``),
  the ``step`` of its counter-based randomness and min-tokens' output length; vLLM keeps it
  exact (a token the runner discards, such as one sampled for an unfinished chunked prefill,
  is not counted);
* the request's id, so that an unseeded request keeps the random key it got when it joined.

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

ROWS_ATTRIBUTE = "fastsample_rows"


class FastsampleInputBatch(InputBatch):
    """vLLM's ``InputBatch``; its sampling metadata points back to it."""

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
        return self._batch_ref is not None and self._batch_ref() is not None

    def lengths(self) -> np.ndarray | None:
        """``(B,)`` int64: tokens each request has emitted so far (None without a batch)."""
        source = self._batch_ref() if self._batch_ref is not None else None
        if source is None:
            return None
        b = self.batch
        return source.num_tokens_no_spec[:b].astype(np.int64) - source.num_prompt_tokens[:b]

    def output_ids(self, lengths: np.ndarray, which: list[int]) -> torch.Tensor | None:
        """``(len(which), max length)`` int64 tokens rows ``which`` emitted, -1 padded, read
        from the batch's token table (``lengths``: every row's)."""
        source = self._batch_ref() if self._batch_ref is not None else None
        if source is None:
            return None
        rows = np.asarray(which, dtype=np.int64)
        lengths = lengths[rows]
        width = int(lengths.max(initial=0))
        prompt = source.num_prompt_tokens[rows].astype(np.int64)
        table = source.token_ids_cpu
        columns = np.minimum(prompt[:, None] + np.arange(width), table.shape[1] - 1)
        ids = np.take_along_axis(table[rows], columns, axis=1).astype(np.int64)
        return torch.from_numpy(np.where(np.arange(width) < lengths[:, None], ids, -1))
