"""A stand-in for ``sgl_kernel`` (SGLang's compiled ops) for SGLang 0.5.23 on a CPU machine,
tests only: the names SGLang's modules import when ``SGLANG_USE_CPU_ENGINE=1``. One op runs
on every step and has a body; the others belong to speculative decoding and cache moves the
tests do not use, and raise when called."""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):  # fmt: skip
    """Row ``i`` of the batch: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` takes
    the next ``end[i] - start[i]`` entries of ``out_cache_loc`` (the rows' slices in order)."""
    lengths = (end_offset - start_offset).long()
    total = int(lengths.sum())
    if total == 0:
        return
    row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # where each row's slice of out_cache_loc starts
    column = start_offset.long()[row] + torch.arange(total) - first[row]
    assert int(column.max()) < pool_len, "a slice runs past the request's row"
    req_to_token[req_pool_indices.long()[row], column] = out_cache_loc[:total].to(
        req_to_token.dtype
    )


def _not_here(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: the tests' CPU stub has no body for it")

    op.__name__ = name
    return op


# Imported at module level under SGLang's `_is_cpu` (kv-cache moves, EAGLE and tree drafts).
copy_all_layer_kv_cache_cpu = _not_here("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _not_here("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_here("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_here("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_here("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _not_here("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_here("verify_tree_greedy_cpu")
rotate_input_ids_cpu = _not_here("rotate_input_ids_cpu")
