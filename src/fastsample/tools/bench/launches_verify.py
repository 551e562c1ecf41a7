"""The verification calls and one round of ``distributed.sample`` for ``bench --launches``.

:func:`verify_calls` gives :mod:`.launches` the calls whose device work it counts beside the
samplers: ``verify_chain`` (seeded, with and without draft probabilities, ragged lengths) and
``verify_tree`` (modes a and b on a 17-node EAGLE-style tree, shared host parents), plus one
round of ``distributed.sample`` on a one-rank gloo group when ``torch.distributed`` is
available (its collectives are ``c10d`` ops, not aten ops, so they are not counted: the
budget is per rank *beyond* the collectives). The Triton backend covers seeded single draws
with every control (:mod:`fastsample.distributed.triton_round`): one launch per collective,
3 for the draw round, one more per cut step (candidates, ties, each radix round) and per
further draw; a tensor temperature with several draws still takes the torch path.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator

import torch

from ... import verify as fs

# An EAGLE-style tree of 17 nodes: 4 first tokens, then chains and small fans (depth 4).
TREE_17 = [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 5, 5, 8, 11, 11, 13]


def verify_calls(
    batch: int, vocab: int, device: torch.device, k: int = 4
) -> list[tuple[str, Callable[[], object]]]:
    """``(label, call)`` for the verification calls, on fresh random input."""
    gen = torch.Generator(device=device).manual_seed(2)
    n = len(TREE_17)

    def probs(*shape: int) -> torch.Tensor:
        return torch.softmax(torch.randn(*shape, vocab, device=device, generator=gen) * 3, -1)

    target, draft = probs(batch, k + 1), probs(batch, k)
    drafts = torch.multinomial(draft.view(-1, vocab), 1, generator=gen).view(batch, k)
    seeds = torch.arange(batch, device=device)
    steps = torch.zeros(batch, dtype=torch.int64, device=device)
    lengths = torch.arange(batch, device=device) % (k + 1)
    tree_target, tree_draft = probs(batch, n), probs(batch, n)
    tokens = torch.stack(
        [torch.randperm(vocab, generator=gen, device=device)[:n] for _ in range(batch)]
    )
    tree = fs.TokenTree(tokens, TREE_17)
    return [
        ("verify_chain(target, drafts, draft_probs, seed=, step= tensors)",
         lambda: fs.verify_chain(target, drafts, draft, seed=seeds, step=steps)),
        ("verify_chain(target, drafts, seed=, step= tensors) (no draft probs)",
         lambda: fs.verify_chain(target, drafts, seed=seeds, step=steps)),
        ("verify_chain(..., draft_probs, draft_lengths=tensor, seed=, step=)",
         lambda: fs.verify_chain(
             target, drafts, draft, draft_lengths=lengths, seed=seeds, step=steps)),
        ("verify_tree(target, 17-node tree, seed=, step=) mode a",
         lambda: fs.verify_tree(tree_target, tree, seed=seeds, step=steps)),
        ("verify_tree(target, 17-node tree, draft_probs, seed=, step=) mode b",
         lambda: fs.verify_tree(tree_target, tree, tree_draft, seed=seeds, step=steps)),
    ]  # fmt: skip


@contextlib.contextmanager
def one_rank_group() -> Iterator[bool]:
    """A one-rank gloo default group for the duration (yields False when unavailable)."""
    import torch.distributed as dist

    if not dist.is_available():
        yield False
        return
    if dist.is_initialized():
        yield True
        return
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield True
        finally:
            dist.destroy_process_group()


def distributed_calls(
    batch: int, vocab: int, device: torch.device
) -> list[tuple[str, Callable[[], object]]]:
    """One round of ``distributed.sample`` on the whole vocabulary (call inside
    :func:`one_rank_group`); empty off CPU (gloo carries CPU tensors)."""
    if device.type != "cpu":
        return []
    from ...distributed import sample

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, vocab, generator=gen)
    seeds, steps = torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
    rows = torch.arange(batch)
    temperature = torch.where(rows % 4 == 0, 0.0, 0.8)  # some greedy rows
    top_k, top_p = 20 + rows % 30, torch.full((batch,), 0.9)
    return [
        ("distributed.sample(shard, T=0.8, min_p=0.05, seed=, step= tensors) (1 rank)",
         lambda: sample(logits, vocab_start=0, vocab_size=vocab, temperature=0.8, min_p=0.05,
                        seed=seeds, step=steps)),
        ("distributed.sample(shard, T=0.8, top_k=50, top_p=0.9, seed=, step=) (1 rank)",
         lambda: sample(logits, vocab_start=0, vocab_size=vocab, temperature=0.8, top_k=50,
                        top_p=0.9, seed=seeds, step=steps)),
        ("distributed.sample(shard, T=0.8, top_p=0.9 (radix), seed=, step=) (1 rank)",
         lambda: sample(logits, vocab_start=0, vocab_size=vocab, temperature=0.8, top_p=0.9,
                        seed=seeds, step=steps)),
        ("distributed.sample(shard, T, top_k, top_p tensors, min_p=0.05, seed=, step=) (1 rank)",
         lambda: sample(logits, vocab_start=0, vocab_size=vocab, temperature=temperature,
                        top_k=top_k, top_p=top_p, min_p=0.05, seed=seeds, step=steps)),
    ]  # fmt: skip
