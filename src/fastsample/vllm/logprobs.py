"""Logprobs in vLLM's layout and in each of its four ``logprobs_mode`` values.

vLLM returns ``LogprobsTensors(logprob_token_ids int32 (N, n+1), logprobs float32 (N, n+1),
selected_token_ranks int64 (N,))``: column 0 is the sampled token, then the ``n`` most likely
tokens (``n = max_num_logprobs``, the batch's largest request; the output processor trims
each request's). With ``logprob_token_ids`` (generative scoring) the columns after the first
are the requested ids instead (padded with id 0 and ``-inf``). The rank is vLLM's: the
number of tokens whose value is at least the sampled token's, itself included.

The modes, and what fastsample computes for each (:class:`fastsample.StepParams`'
``logprobs_mode``):

* ``raw_logprobs``: log-softmax of the logits as they reach the sampler (after the grammar
  bitmask): fastsample's ``"raw"`` mode;
* ``raw_logits``: those logits themselves: the input logits at the ids, ``-inf`` where the
  raw log-probability is ``-inf`` (the grammar masked the token);
* ``processed_logprobs``: log-probabilities of the distribution drawn from (after every
  stage, temperature and cuts): fastsample's ``"processed"`` mode;
* ``processed_logits``: the logits after the stages, divided by the temperature, ``-inf``
  where cut: read from :func:`fastsample.staged_logits` at the ids.

vLLM's raw values are taken before its allowed-token mask (``allowed_token_ids``), fastsample's
raw mode after it: for a batch with allowed ids the plugin computes vLLM's raw values itself
from the logits (:func:`from_full`, one log-softmax pass), as vLLM does.

Greedy rows in the processed modes: fastsample reports the distribution it drew from, the
point mass at the greedy token (log-probability 0, the others ``-inf``); vLLM reports the
untempered distribution of the penalized logits (README, "Serve with vLLM").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from vllm.v1.outputs import LogprobsTensors

from ..ops import bitmask as bits
from ..stages import SampleOutput


def _requested(ids: dict[int, list[int]], batch: int, device: torch.device) -> Tensor:
    """``(B, M)`` int64 requested ids, -1 padded."""
    width = max((len(v) for v in ids.values()), default=0)
    out = torch.full((batch, width), -1, dtype=torch.int64)
    for row, values in ids.items():
        if 0 <= row < batch and values:
            out[row, : len(values)] = torch.tensor(values, dtype=torch.int64)
    return out.to(device)


def as_vllm(
    out: SampleOutput,
    mode: str,
    num_logprobs: int | None,
    logprob_ids: dict[int, list[int]] | None,
    logits: Tensor,
    processed_logits: Callable[[], Tensor] | None = None,
    temperature: Tensor | float | None = None,
) -> LogprobsTensors | None:
    """vLLM's ``LogprobsTensors`` from a :func:`fastsample.sample_step` output.

    ``logits``: the sampler's input (raw logits); ``processed_logits()``: the staged logits
    (only called in ``processed_logits`` mode) and ``temperature`` the rows' temperatures
    (0 = greedy).
    """
    if num_logprobs is None and not logprob_ids:
        return None
    batch = out.token_ids.shape[0]
    sampled = out.token_ids[:, :1]
    assert out.logprobs is not None and out.ranks is not None
    values = [out.logprobs[:, :1]]
    columns = [sampled]
    if logprob_ids:
        assert out.requested_logprobs is not None
        requested = _requested(logprob_ids, batch, sampled.device)
        columns.append(requested.clamp_min(0))
        values.append(out.requested_logprobs)
    elif num_logprobs:
        assert out.top_token_ids is not None and out.top_logprobs is not None
        columns.append(out.top_token_ids)
        values.append(out.top_logprobs)
    ids = torch.cat(columns, 1)
    logprobs = torch.cat(values, 1).to(torch.float32)
    if mode.endswith("logits"):
        logprobs = _logits_at(ids, logprobs, mode, logits, processed_logits, temperature)
    if logprob_ids:  # padding columns: vLLM's -inf
        padded = torch.cat((torch.zeros_like(sampled, dtype=torch.bool), requested < 0), 1)
        logprobs = logprobs.masked_fill(padded, -math.inf)
    return LogprobsTensors(ids.to(torch.int32), logprobs, out.ranks[:, 0])


def from_full(values: Tensor, sampled: Tensor, num_logprobs: int | None,
              logprob_ids: dict[int, list[int]] | None) -> LogprobsTensors:  # fmt: skip
    """vLLM's layout from a full ``(N, V)`` tensor of values (log-probabilities or logits) and
    the ``(N,)`` sampled ids (in range)."""
    ids = sampled.long()[:, None]
    chosen = values.gather(1, ids)
    ranks = (values >= chosen).sum(-1)
    columns, out = [ids], [chosen]
    if logprob_ids:
        requested = _requested(logprob_ids, values.shape[0], values.device)
        safe = requested.clamp_min(0)
        columns.append(safe)
        out.append(values.gather(1, safe).masked_fill(requested < 0, -math.inf))
    elif num_logprobs:
        top_values, top_ids = values.topk(num_logprobs, dim=-1)
        columns.append(top_ids)
        out.append(top_values)
    return LogprobsTensors(torch.cat(columns, 1).to(torch.int32),
                           torch.cat(out, 1).to(torch.float32), ranks)  # fmt: skip


def raw_values(logits: Tensor, words: Tensor | None, mode: str) -> Tensor:
    """vLLM's raw tensor: the logits after the grammar bitmask (float32), log-softmaxed in
    ``raw_logprobs`` mode."""
    values = logits.to(torch.float32)
    if words is not None:
        allowed = bits.unpack(words, logits.shape[-1])
        values = values.masked_fill(~allowed, -math.inf)
    elif values is logits:
        values = values.clone()
    return values.log_softmax(-1) if mode == "raw_logprobs" else values


def _logits_at(ids, logprobs, mode, logits, processed_logits, temperature) -> Tensor:
    """The logits modes: values at ``ids`` of the raw or processed logits, ``-inf`` where
    the log-probability is ``-inf``."""
    if mode == "raw_logits":
        values = logits.gather(1, ids).to(torch.float32)
    else:
        assert processed_logits is not None
        values = processed_logits().gather(1, ids).to(torch.float32)
        if isinstance(temperature, Tensor):
            t = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)
            values = values / t[:, None]
        elif temperature:
            values = values / float(temperature)
    return torch.where(logprobs > -math.inf, values, -math.inf)
