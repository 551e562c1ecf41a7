"""EAGLE's tree verification in SGLang with :func:`fastsample.verify_tree`.

What is replaced: ``sglang.srt.speculative.eagle_utils.eagle_sample`` (an ``AROUND`` hook, so
SGLang's own function stays at hand; EAGLE's workers and NGRAM's call it), with SGLang's
signature, outputs and side effects: the same preprocessing of the target logits in place
(NaN sanitizing, the accumulated penalties, logit bias, the grammar mask), and the same
return value ``(predict, accept_lens, accept_index)``: ``predict`` ``(bs * N,)`` int32 holds,
at the flat index (``retrieve_index``) of the root and of every accepted node, the token
emitted after it (0 elsewhere); ``accept_index`` ``(bs, max_tree_depth)`` int32 the flat
indices of the root and the accepted nodes, -1 after them; ``accept_lens`` ``(bs,)`` int32
the accepted drafts plus one.

The math. EAGLE's drafts are deterministic: each node's children are the draft's top-k (or,
with the plugin's ``fast_sample``, draws keyed on the draft stream), with no probability
the verifier may divide by. The exact rule for such trees is sequential inversion
(fastsample's tree mode a, ``draft_probs=None``): from the root, test the current node's
children in order; child ``t`` is accepted with probability ``p(t) / (1 - R)``, ``R`` the
target mass of the siblings already rejected; an accepted child becomes the current node;
when every child is rejected (or there is none) the last token is drawn from ``p`` without
the rejected siblings. This samples every emitted token from the target alone, whatever
chose the drafts. ``p`` at each node is the request's processed target: temperature, then
top-k and top-p each on the whole tempered distribution with the kept sets intersected
(``cut_order="joint"``, SGLang's sampler's order), then min-p; a request with
``top_k <= 1`` is greedy (one-hot at the first maximal logit, SGLang's ``argmax``), which
makes the walk SGLang's greedy verification exactly. A chain (``topk == 1``) goes to
:func:`fastsample.verify_chain` with point-mass drafts, the same rule. Randomness is keyed
on (``sampling_seed``, ``seq_lens``) per request, in fastsample's ``ACCEPT``, ``RECOVERY`` and
``BONUS`` streams (independent of the draft stream).

SGLang's tree (``retrieve_next_token``: first child, ``retrieve_next_sibling``: next sibling,
-1 for none; node 0 the root) becomes a :class:`fastsample.TokenTree` in SGLang's own node
numbering, with fixed-shape ops (no host sync): parents from the links, depth and
reachability by pointer doubling. SGLang's builders (EAGLE's ``build_tree_kernel_efficient``,
NGRAM's ``reconstruct_indices_from_tree_mask``) list parents before children and chain
siblings in node order, which is the order fastsample tests them in. A node SGLang's walk
never reaches (no link to it, or deeper than ``max_tree_depth - 1``) is left out: a trailing
one by ``num_nodes``, an inner one as a copy of the root's first child placed after it
(a repeated token has no mass left once rejected, so it is never accepted). A row whose
links break these rules is verified with no draft (its first token drawn from the target
at the root: still exact, only slower).

Where it differs from SGLang:

* SGLang's CPU (and XPU) build verifies every request greedily, whatever its temperature;
  here sampled requests are verified by sampling there too.
* SGLang's CUDA kernel (``tree_speculative_sampling_target_only``) renormalizes top-p
  *after* top-k (a sequential cut) while its sampler cuts jointly; here verification uses
  the sampler's joint cut, so a request's tokens follow one law with or without drafts. Its
  min-p is ignored by that kernel; here it is applied.
* SGLang's coins are float32; fastsample compares in float64 with 53-bit uniforms.
* A row whose processed target has no mass (every token masked, NaN logits) is verified
  greedily on its logits, as SGLang's greedy path would.

Handed to SGLang's own function (one warning per reason, ``fastsample.sglang`` logger):
watermarking, rejection sampling with draft probabilities
(``speculative_use_rejection_sampling``, block verification included), acceptance
thresholds below 1 (``speculative_accept_threshold_single``/``_acc``: not exact by design),
``SGLANG_SIMULATE_ACC_LEN``, and the sparse UNO target path. Batches where every request is
greedy and idle batches go to SGLang's function without a warning (its greedy verification
is what the plugin would compute). An exception inside the replacement hands that call to
SGLang's function with one warning; if the logits were already preprocessed in place, SGLang's
function is called with the penalties, bias and grammar mask switched off so that nothing
is applied twice.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..stages import process_step
from ..verify import TokenTree, verify_chain, verify_tree
from .state import count, keys_are_ours, warn_once

__all__ = ["EAGLE_SAMPLE", "fastsample_eagle_sample", "install", "sglang_tree", "unsupported"]

EAGLE_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"


def install(registry: Any, hook_type: Any) -> list[str]:
    """Register :func:`fastsample_eagle_sample` with SGLang's ``HookRegistry`` (an ``AROUND``
    hook on :data:`EAGLE_SAMPLE`); returns the hooked targets."""
    import sglang.srt.speculative.eagle_utils  # noqa: F401  (fails here, not at apply time)

    registry.register(EAGLE_SAMPLE, fastsample_eagle_sample, hook_type.AROUND)
    return [EAGLE_SAMPLE]


# ----------------------------------------------------------------------------- the hook


def fastsample_eagle_sample(
    original: Any,
    verify_input: Any,
    batch: Any,
    logits_output: Any,
    grammar_mask: Any = None,
    uno_target_max_top_k: int | None = None,
    *,
    watermark_state: Any = None,
    watermark_full_mask: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """SGLang's ``eagle_sample`` (``original``) verified with fastsample (module docstring)."""
    call = (verify_input, batch, logits_output, grammar_mask, uno_target_max_top_k,
            watermark_state, watermark_full_mask)  # fmt: skip
    info = batch.sampling_info
    if batch.forward_mode.is_idle() or info.is_all_greedy:
        return _sglang(original, call, edited=False)
    reason = unsupported(info, uno_target_max_top_k, watermark_state)
    if reason is not None:
        warn_once(f"eagle: {reason}", f"an EAGLE verification uses {reason}, which fastsample "
                  "does not do: SGLang's own eagle_sample verifies it")  # fmt: skip
        count("handed", "eagle_" + reason.split(" (")[0].replace(" ", "_"))
        return _sglang(original, call, edited=False)
    edits = _Edits()
    try:
        return _verify(verify_input, batch, logits_output, grammar_mask, edits)
    except Exception as error:  # this call in SGLang's code, the next one here again
        warn_once("eagle: error", f"fastsample's EAGLE verification failed ({error!r}); that "
                  "call (and any later failing one) is verified by SGLang's own code")  # fmt: skip
        count("handed", "eagle_error")
        return _sglang(original, call, edited=edits.done)


def unsupported(info: Any, uno_target_max_top_k: int | None, watermark_state: Any) -> str | None:
    """Why this verification must run in SGLang's code, or None."""
    from sglang.srt.speculative import eagle_utils, spec_utils

    if watermark_state is not None and info.has_watermark_candidates:
        return "watermarking"
    spec = eagle_utils.get_spec()
    if spec.speculative_use_rejection_sampling:
        return "rejection sampling (speculative_use_rejection_sampling)"
    if spec.speculative_accept_threshold_single < 1 or spec.speculative_accept_threshold_acc < 1:
        return "acceptance thresholds below 1 (speculative_accept_threshold_single/acc)"
    if spec_utils.SIMULATE_ACC_LEN > 0:
        return "simulated acceptance (SGLANG_SIMULATE_ACC_LEN)"
    if eagle_utils._can_use_sparse_uno_tree_target_sampling(uno_target_max_top_k, info):
        return "the sparse UNO target path"
    return None


class _Edits:
    """Whether the logits were already preprocessed in place (a fallback must not redo it)."""

    done = False


_PREPROCESSING = ("acc_additive_penalties", "acc_scaling_penalties", "logit_bias")


def _sglang(original: Any, call: tuple, edited: bool) -> tuple[Tensor, Tensor, Tensor]:
    """SGLang's own ``eagle_sample``, with the seeds it would have had (the plugin keys every
    batch; SGLang has none outside deterministic mode) and, after our in-place
    preprocessing, without applying it a second time."""
    verify_input, batch, logits_output, grammar_mask, max_top_k, watermark, full_mask = call
    info = batch.sampling_info
    saved: dict[str, Any] = {}
    if info.sampling_seed is not None and keys_are_ours():
        saved["sampling_seed"] = info.sampling_seed
    if edited:
        saved.update((name, getattr(info, name)) for name in _PREPROCESSING)
        grammar_mask = None
    for name in saved:
        setattr(info, name, None)
    try:
        return original(verify_input, batch, logits_output, grammar_mask, max_top_k,
                        watermark_state=watermark, watermark_full_mask=full_mask)  # fmt: skip
    finally:
        for name, value in saved.items():
            setattr(info, name, value)


# ----------------------------------------------------------------------------- verification


def _verify(verify_input: Any, batch: Any, logits_output: Any, grammar_mask: Any,
            edits: _Edits) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    from .sampler import step_params

    info = batch.sampling_info
    logits = logits_output.next_token_logits
    bs, n = len(batch.seq_lens), verify_input.draft_token_num
    depth = verify_input.max_tree_depth
    vocab = logits.shape[-1]
    if logits.shape[0] != bs * n:
        raise ValueError(f"{logits.shape[0]} logits rows for {bs} requests of {n} nodes")
    candidates = verify_input.draft_token.reshape(bs, n)
    chain = verify_input.tree_topk == 1
    # Everything that reads the batch comes first: up to here, a failure changes nothing.
    params = step_params(info, bs, vocab, logits.device)
    if chain:
        lengths = chain_lengths(verify_input.retrieve_next_token,
                                verify_input.retrieve_next_sibling, depth)  # fmt: skip
    else:
        tree = sglang_tree(candidates, verify_input.retrieve_next_token,
                           verify_input.retrieve_next_sibling, depth)  # fmt: skip

    edits.done = True
    _preprocess(logits, info, n, grammar_mask)
    probs = process_step(logits, params.repeat_rows(n))
    # A row without mass (all masked, NaN) is greedy on its logits, as SGLang's greedy path.
    # Valid rows always keep their maximal logit, so its probability tells them apart.
    greedy_ids = logits.argmax(-1, keepdim=True)
    at_max = probs.gather(1, greedy_ids)
    probs.scatter_(1, greedy_ids, torch.where(at_max > 0, at_max, 1.0))
    probs = probs.view(bs, n, vocab)
    seed, step = params.seed, batch.seq_lens.to(device=logits.device, dtype=torch.int64)
    if chain:
        out = verify_chain(probs, candidates[:, 1:].long(), draft_lengths=lengths, seed=seed,
                           step=step)  # fmt: skip
        nodes = torch.arange(1, n, device=logits.device).expand(bs, n - 1)
    else:
        out = verify_tree(probs, tree, seed=seed, step=step)
        nodes = out.accepted_nodes
    root_greedy = greedy_ids.view(bs, n)[:, 0]
    predict, accept_index, accepted = sglang_outputs(
        out.token_ids, nodes, out.num_accepted, out.valid, root_greedy,
        verify_input.retrieve_index, depth,
    )  # fmt: skip
    _broadcast_across_tp(predict, accept_index, accepted)
    count("verify", bs)
    return predict, accepted + 1, accept_index


def _preprocess(logits: Tensor, info: Any, n: int, grammar_mask: Any) -> None:
    """SGLang's ``eagle_sample`` preprocessing, in place, in its order (its own functions)."""
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties
    from sglang.srt.utils.async_probe import sanitize_nan_logits

    sanitize_nan_logits(logits, "verify: target model logits")
    if info.acc_additive_penalties is not None:
        logits.add_(torch.repeat_interleave(info.acc_additive_penalties, n, dim=0))
    if info.acc_scaling_penalties is not None:
        apply_scaling_penalties(
            logits, torch.repeat_interleave(info.acc_scaling_penalties, n, dim=0)
        )
    if info.logit_bias is not None:
        logits.add_(torch.repeat_interleave(info.logit_bias, n, dim=0))
    if grammar_mask is not None:
        grammar_mask.apply(logits)


def _broadcast_across_tp(*tensors: Tensor) -> None:
    """Rank 0's results on every rank of the (attention) TP group, as SGLang's sampled path:
    ranks may see slightly different logits."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    group = parallel.attn_tp_group if is_dp_attention_enabled() else parallel.tp_group
    if group.world_size > 1:
        for tensor in tensors:
            group.broadcast(tensor, src=0)


# ----------------------------------------------------------------------------- layouts


class _Links(NamedTuple):
    parent: Tensor  # (B, N) int64, -1 for the root and for nodes no link reaches
    depth: Tensor  # (B, N) int64, valid where reached
    reached: Tensor  # (B, N) bool, on a path of links from the root


def tree_links(next_token: Tensor, next_sibling: Tensor) -> _Links:
    """Parents, depths and reachability of SGLang's first-child/next-sibling trees.

    Fixed-shape ops, no host sync: the parent of a first child is the node pointing to it;
    a later sibling has its chain head's parent (the head found by pointer doubling along the
    reversed sibling links); depth and reachability by pointer doubling along the parents.
    Links out of ``[1, N)`` are no links; cycles are never reached.
    """
    batch, n = next_token.shape
    device = next_token.device
    nt, ns = next_token.long(), next_sibling.long()
    nodes = torch.arange(n, device=device).expand(batch, n)
    rounds = max(1, math.ceil(math.log2(max(n, 2)))) + 1

    def pointed_by(links: Tensor) -> Tensor:
        """``(B, N)``: the node whose link points here, -1 if none."""
        target = torch.where((links > 0) & (links < n), links, n)
        out = torch.full((batch, n + 1), -1, dtype=torch.int64, device=device)
        return out.scatter_(1, target, nodes)[:, :n]

    first_of = pointed_by(nt)  # parent of each first child
    elder = pointed_by(ns)  # previous sibling
    head = torch.where(elder >= 0, elder, nodes)
    for _ in range(rounds):
        head = head.gather(1, head)
    parent = first_of.gather(1, head)
    parent[:, 0] = -1
    # Pointer doubling to the root: the root points to itself, unlinked nodes to a sentinel.
    up = torch.where(parent >= 0, parent, n)
    up[:, 0] = 0
    up = torch.cat((up, torch.full((batch, 1), n, dtype=torch.int64, device=device)), 1)
    dist = torch.cat(
        ((nodes > 0).long(), torch.zeros(batch, 1, dtype=torch.int64, device=device)), 1
    )
    for _ in range(rounds):
        dist = dist + dist.gather(1, up)
        up = up.gather(1, up)
    return _Links(parent, dist[:, :n], up[:, :n] == 0)


def sglang_tree(candidates: Tensor, next_token: Tensor, next_sibling: Tensor,
                max_depth: int) -> TokenTree:  # fmt: skip
    """SGLang's verify tree as a :class:`fastsample.TokenTree` in SGLang's node numbering.

    Nodes SGLang's walk never tests (unreachable, or deeper than ``max_depth - 1``: its
    ``accept_index`` has ``max_depth`` columns) are left out: trailing ones through
    ``num_nodes``, inner ones as inert copies of the root's first child (module docstring).
    Rows that break SGLang's layout (a parent listed after its child, an inner left-out node
    before the root's first child) keep only the root.
    """
    batch, n = candidates.shape
    device = candidates.device
    tokens = candidates.long()
    links = tree_links(next_token, next_sibling)
    nodes = torch.arange(n, device=device).expand(batch, n)
    keep = links.reached & (links.depth < max_depth)
    size = torch.where(keep, nodes, 0).amax(-1) + 1
    inside = nodes < size[:, None]
    first = next_token[:, 0].long()  # the root's first child: kept whenever max_depth > 1
    inert = inside & ~keep  # left out below the last kept node
    bad = (keep & (nodes > 0) & (links.parent >= nodes)) | (inert & (nodes <= first[:, None]))
    bad = bad.any(-1)
    parents = torch.where(keep & ~bad[:, None], links.parent, 0)
    parents[:, 0] = -1
    copies = tokens.gather(1, first.clamp(0, n - 1)[:, None]).expand(batch, n)
    tokens = torch.where(inert, copies, tokens)
    return TokenTree(tokens, parents, torch.where(bad, 1, size))


def chain_lengths(next_token: Tensor, next_sibling: Tensor, max_depth: int) -> Tensor:
    """``(B,)`` drafts of a chain-shaped tree (``topk == 1``): how many of nodes ``1, 2, ...``
    follow ``0 -> 1 -> 2 ...`` from the root without a sibling, at most ``max_depth - 1``.
    A row that stops early verifies fewer drafts (still exact)."""
    n = next_token.shape[1]
    device = next_token.device
    follows = next_token[:, :-1].long() == torch.arange(1, n, device=device)
    alone = next_sibling[:, 1:].long() < 0
    length = (follows & alone).long().cumprod(-1).sum(-1)
    return length.clamp_max(max(max_depth - 1, 0))


def sglang_outputs(
    token_ids: Tensor,
    accepted_nodes: Tensor,
    num_accepted: Tensor,
    valid: Tensor,
    root_greedy: Tensor,
    retrieve_index: Tensor,
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """fastsample's result in SGLang's tensors: ``(predict (B * N,) int32, accept_index
    (B, max_depth) int32, num_correct_drafts (B,) int32)``.

    ``token_ids`` are the emitted tokens (accepted drafts, then the last one), and
    ``accepted_nodes`` the accepted nodes (SGLang's local numbering) in path order. A row
    fastsample flagged invalid (not expected: the targets were repaired) emits its root's
    greedy token.
    """
    batch, n = retrieve_index.shape
    device = retrieve_index.device
    width = min(max_depth, token_ids.shape[1], accepted_nodes.shape[1] + 1)
    accepted = torch.where(valid, num_accepted, 0).clamp_max(width - 1)
    columns = torch.arange(max_depth, device=device)
    used = columns < (accepted + 1)[:, None]
    path = torch.zeros(batch, max_depth, dtype=torch.int64, device=device)
    path[:, 1:width] = accepted_nodes[:, : width - 1].clamp_min(0)
    flat = retrieve_index.long().gather(1, path)
    emitted = torch.zeros(batch, max_depth, dtype=torch.int64, device=device)
    emitted[:, :width] = token_ids[:, :width]
    emitted[:, 0] = torch.where(valid, emitted[:, 0], root_greedy)
    spare = batch * n  # unused slots write a zero past the end
    predict = torch.zeros(spare + 1, dtype=torch.int32, device=device)
    predict.scatter_(0, torch.where(used, flat, spare).flatten(),
                     torch.where(used, emitted, 0).flatten().to(torch.int32))  # fmt: skip
    accept_index = torch.where(used, flat, -1).to(torch.int32)
    return predict[:spare].clone(), accept_index, accepted.to(torch.int32)
