"""The inference engines' own pure-PyTorch samplers, written here from their published code.

Neither package is needed (nor imported): each function reproduces the algorithm of the
engine's torch path, with per-row ``(B,)`` tensors as the engines pass them.

* :func:`vllm_sample`: vLLM (v1 ``Sampler``): temperature by an in-place division, min-p on
  the softmax (``apply_min_p``), then ``apply_top_k_top_p`` of ``topk_topp_sampler.py``: with a
  top-p, **sort the vocabulary** ascending, mask below the k-th value (``gather`` at
  ``V - k``), ``softmax().cumsum()`` and mask ``<= 1 - p`` (keeping the last), ``scatter`` back;
  top-k alone takes ``apply_top_k_only`` (one ``topk`` of ``max(k)``); then ``softmax`` in
  float32 and the exponential race ``probs.div_(q.exponential_()).argmax()``. Greedy: argmax.
* :func:`sglang_sample`: SGLang's ``pytorch`` sampling backend: temperature division,
  ``softmax``, then ``top_k_top_p_min_p_sampling_from_probs_torch``: **sort** the
  probabilities descending, ``cumsum``, zero ranks ``>= k`` and entries whose preceding mass
  exceeds ``p``, zero below ``min_p`` times the top probability, ``torch.multinomial`` on what
  is left (it renormalizes) and ``gather`` the id. Every stage runs for every row (top-k off is
  a large k). Greedy: argmax.

Controls missing from a setting are off: vLLM passes None for a stage no request uses, SGLang
runs its defaults (k = V, p = 1, no min-p pass).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _rows(value: float | int, batch: int, device: torch.device, integral: bool = False) -> Tensor:
    dtype = torch.int64 if integral else torch.float32
    return torch.full((batch,), value, dtype=dtype, device=device)


def vllm_sample(logits: Tensor, controls: dict[str, float | int]) -> Tensor:
    """Token ids ``(B,)`` the way vLLM's torch sampler draws them."""
    batch = logits.shape[0]
    temperature = controls.get("temperature", 1.0)
    if temperature == 0:
        return logits.argmax(-1)
    # vLLM divides its own fresh logits in place; the benchmark's input is reused, so copy
    # once (the division would have written a full pass anyway).
    logits = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        logits.div_(_rows(temperature, batch, logits.device)[:, None])
    if controls.get("min_p", 0.0) > 0:
        probs = logits.softmax(-1)
        top = probs.amax(-1, keepdim=True)
        keep = probs >= _rows(controls["min_p"], batch, logits.device)[:, None] * top
        logits[~keep] = -float("inf")
    k = _rows(controls["top_k"], batch, logits.device, True) if controls.get("top_k") else None
    p = _rows(controls["top_p"], batch, logits.device) if controls.get("top_p", 1.0) < 1 else None
    logits = _vllm_top_k_top_p(logits, k, p)
    probs = logits.softmax(-1, dtype=torch.float32)
    q = torch.empty_like(probs).exponential_()
    return probs.div_(q).argmax(-1)


def _vllm_top_k_top_p(logits: Tensor, k: Tensor | None, p: Tensor | None) -> Tensor:
    """vLLM's ``apply_top_k_top_p`` (and ``apply_top_k_only`` for top-k alone)."""
    if p is None:
        if k is None:
            return logits
        no_top_k = k == logits.shape[1]
        k = k.masked_fill(no_top_k, 1)
        largest = int(k.max())
        index = k.sub(1).unsqueeze(1)
        kth = logits.topk(largest, dim=1).values.gather(1, index.long())
        kth.masked_fill_(no_top_k.unsqueeze(1), -float("inf"))
        return logits.masked_fill_(logits < kth, -float("inf"))
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = logits_sort.gather(1, (logits_sort.size(1) - k.to(torch.long)).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, -float("inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def sglang_sample(logits: Tensor, controls: dict[str, float | int]) -> Tensor:
    """Token ids ``(B,)`` the way SGLang's ``pytorch`` sampling backend draws them."""
    batch, vocab = logits.shape
    temperature = controls.get("temperature", 1.0)
    if temperature == 0:
        return logits.argmax(-1)
    device = logits.device
    logits = logits.div(_rows(temperature, batch, device)[:, None])
    probs = torch.softmax(logits, dim=-1)
    top_ks = _rows(int(controls.get("top_k", 0)) or vocab, batch, device, True)
    top_ps = _rows(controls.get("top_p", 1.0), batch, device)
    min_p = controls.get("min_p", 0.0)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    ranks = torch.arange(0, vocab, device=device).view(1, -1)
    probs_sort[ranks >= top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
    if min_p > 0:
        thresholds = probs_sort[:, 0] * _rows(min_p, batch, device)
        probs_sort[probs_sort < thresholds.view(-1, 1)] = 0.0
    sampled = torch.multinomial(probs_sort, num_samples=1)
    return torch.gather(probs_idx.to(torch.int32), dim=1, index=sampled).view(-1)
