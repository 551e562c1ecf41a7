"""EAGLE verification in SGLang with fastsample (``fastsample.sglang.eagle``), on SGLang's own
tensors, without an engine.

Trees are built as EAGLE builds them: SGLang's draft loop (``select_top_k_tokens`` on the
draft's top-k at each step, as ``eagle_worker_v2.draft_forward``) with a bigram draft model,
then SGLang's ``organize_draft_results`` and ``build_tree_kernel_efficient``. SGLang's CPU ops
for building and greedily verifying trees (``sgl_kernel``'s ``build_tree_kernel_efficient_cpu``
and ``verify_tree_greedy_cpu``) have no CPU wheel here (the tests' stub raises), so the
fixture runs SGLang's own Triton kernels for the same ops (``spec_tree.py``:
``sgl_build_tree_kernel_efficient_triton`` and ``verify_tree_greedy_kernel_triton``, what
SGLang runs on XPU) in Triton's interpreter. SGLang's original ``eagle_sample`` then runs as
SGLang's CPU build runs it: every request verified greedily. The target model is a bigram
too: node ``i``'s target logits are ``TARGET[token of node i]``.

* **Law** (:func:`test_law_of_the_first_two_tokens`): ``LAW_DRAWS`` (200,000) copies of one
  request, one seed each, temperature 1.2, top-k 5, top-p 0.7, min-p 0.05, verified on one
  EAGLE tree (top-2, 3 steps, 6 nodes). The pair (first emitted token, the token after it
  when the first is an accepted draft, else "none") follows the exact float64 law of
  sampling from the target alone: ``p_root(t) p_t(s)`` with ``p`` the joint-cut processed
  target (tests/reference.py, ``cut_order="joint"``). False alarm 1e-6; at this size the test
  detects a relative bias of ``LAW_CLAIM`` (7%) on 10% of the mass with probability 0.99
  (``stattests.detectable_bias``, checked by tests/test_power.py). The law at full power (2%)
  is carried by fastsample's own tests of the same code: tree mode a in
  tests/verify/test_tree.py, the joint cut in tests/test_cut_order.py. Negative controls at
  the same size, all rejected: the law with the sequential cut (top-p after top-k, SGLang's
  CUDA verification kernel), the law at temperature 1, and SGLang's own CPU verification
  (greedy: one pair for every row).
* Greedy rows of a mixed batch give exactly SGLang's greedy verification (``predict``,
  ``accept_index``, ``accept_lens``); an all-greedy batch is SGLang's own call.
* Shapes, dtypes and SGLang's invariants of the outputs; the chain path (``topk == 1``)
  equals the tree path bitwise; per-request settings equal fastsample's public calls
  bitwise; a seeded request gives the same tokens in any batch; SGLang's in-place
  preprocessing (penalties, bias, grammar mask) is SGLang's.
* Trees SGLang's walk does not fully reach (NGRAM-like, built by hand: an unlinked node, a
  node below ``max_tree_depth``) and malformed links.
* Unsupported features and errors go to SGLang's function with one warning per reason.
"""

from __future__ import annotations

import itertools
import logging
import types

import numpy as np
import pytest
import torch

eu = pytest.importorskip(
    "sglang.srt.speculative.eagle_utils",
    reason="SGLang does not import here (tests/sglang_plugin/conftest.py sets up its CPU stubs)",
)

import sglang.kernels.ops.speculative.spec_tree as spec_tree  # noqa: E402
import sglang.srt.speculative.spec_utils as spec_utils  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    CaptureHiddenMode,
    ForwardMode,
)
from sglang.srt.plugins import hook_registry  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: E402

import fastsample as fs  # noqa: E402
from fastsample.sglang import eagle  # noqa: E402
from fastsample.sglang.state import CALLS, STATE  # noqa: E402
from reference import reference_probs  # noqa: E402
from stattests import LawCase, assert_law, law_rejected  # noqa: E402

V = 16
TOP_K_ALL = 1 << 30
_gen = np.random.default_rng(5)
TARGET = _gen.normal(size=(V, V)) * 1.5  # bigram target: logits after each token
DRAFT = TARGET + _gen.normal(size=(V, V)) * 0.5  # a close bigram draft


# ----------------------------------------------------------------------------- fixtures


class _Spec(types.SimpleNamespace):
    pass


def spec(**changes) -> _Spec:
    """SGLang's speculative settings read by ``eagle_sample`` (defaults: SGLang's)."""
    values = dict(
        speculative_use_rejection_sampling=False, speculative_use_block_verification=False,
        speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0,
    )  # fmt: skip
    return _Spec(**{**values, **changes})


@pytest.fixture(autouse=True)
def sglang_on_cpu(monkeypatch):
    """SGLang's tree kernels in Triton's interpreter for its CPU ops (module docstring), its
    speculative settings, a one-rank TP group, and the plugin's warnings and counts afresh."""
    from triton.runtime.interpreter import InterpretedFunction

    for name in ("sgl_build_tree_kernel_efficient_triton", "verify_tree_greedy_kernel_triton"):
        kernel = getattr(spec_tree, name)
        if not isinstance(kernel, InterpretedFunction):
            monkeypatch.setattr(spec_tree, name, InterpretedFunction(kernel.fn))
    monkeypatch.setattr(spec_tree, "sgl_build_tree_kernel_efficient_cpu",
                        spec_tree.sgl_build_tree_kernel_triton)  # fmt: skip

    def verify_tree_greedy_cpu(*, predicts, accept_index, accept_token_num, candidates,
                               retrive_index, retrive_next_token, retrive_next_sibling,
                               target_predict):  # fmt: skip
        spec_tree.verify_tree_greedy_triton(predicts, accept_index, accept_token_num, candidates,
                                            retrive_index, retrive_next_token,
                                            retrive_next_sibling, target_predict)  # fmt: skip

    monkeypatch.setattr(spec_tree, "sgl_verify_tree_greedy_cpu", verify_tree_greedy_cpu)
    monkeypatch.setattr(eu, "get_spec", spec)
    monkeypatch.setattr(STATE, "warned", set())
    CALLS.clear()
    with get_parallel().override(tp_group=types.SimpleNamespace(world_size=1)):
        yield


# ----------------------------------------------------------------------------- SGLang's inputs


def softmax(logits: np.ndarray) -> torch.Tensor:
    return torch.softmax(torch.tensor(logits, dtype=torch.float32), -1)


def eagle_tree(roots: list[int], seq_lens: list[int], topk: int, steps: int, n: int,
               draft: np.ndarray = DRAFT) -> EagleVerifyInput:  # fmt: skip
    """The verify input SGLang's EAGLE worker builds for requests whose last token is
    ``roots[b]``, with a bigram draft model (``draft_forward``'s loop, SGLang's functions)."""
    later = spec_utils._select_top_k_tokens_later._torchdynamo_orig_callable  # not compiled
    roots_t = torch.tensor(roots)
    topk_p, topk_index = spec_utils.fast_topk(softmax(draft)[roots_t], topk, dim=-1)
    scores, score_list, token_list, parents_list = None, [], [], []
    for i in range(steps):
        if i == 0:
            ids, _, scores, info = spec_utils._select_top_k_tokens_first(topk_p, topk_index,
                                                                         None, topk)  # fmt: skip
        else:
            ids, _, scores, info = later(i, topk_p, topk_index, None, scores, topk)
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
        if i == steps - 1:
            break
        topk_p, topk_index = spec_utils.fast_topk(softmax(draft)[ids], topk, dim=-1)
    parent_list, top_index, draft_tokens = eu.organize_draft_results(
        score_list, token_list, parents_list, n
    )
    lens = torch.tensor(seq_lens)
    mask, positions, index, next_token, next_sibling, tokens = eu.build_tree_kernel_efficient(
        roots_t, parent_list, top_index, draft_tokens, lens, int(lens.sum()), topk, steps, n,
        tree_mask_mode=eu.default_tree_mask_mode(),
    )  # fmt: skip
    return EagleVerifyInput(
        draft_token=tokens, custom_mask=mask, positions=positions, retrieve_index=index,
        retrieve_next_token=next_token, retrieve_next_sibling=next_sibling,
        retrieve_cum_len=None, spec_steps=steps, topk=topk, draft_token_num=n,
        capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=int(lens.sum()),
        seq_lens_cpu=lens,
    )  # fmt: skip


def tiled(tree: EagleVerifyInput, rows: int) -> EagleVerifyInput:
    """``rows`` copies of a one-request verify input (SGLang's per-row flat indices)."""
    n = tree.draft_token_num
    index = torch.arange(rows)[:, None] * n + tree.retrieve_index[:1]
    lens = tree.seq_lens_cpu[:1].expand(rows)
    return EagleVerifyInput(
        draft_token=tree.draft_token[:n].repeat(rows), custom_mask=tree.custom_mask,
        positions=tree.positions[:n].repeat(rows), retrieve_index=index,
        retrieve_next_token=tree.retrieve_next_token[:1].expand(rows, n).contiguous(),
        retrieve_next_sibling=tree.retrieve_next_sibling[:1].expand(rows, n).contiguous(),
        retrieve_cum_len=None, spec_steps=tree.spec_steps, topk=tree.topk, draft_token_num=n,
        capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=int(lens.sum()),
        seq_lens_cpu=lens,
    )  # fmt: skip


def sampling_info(temperature, top_k, top_p, min_p, seed=None, **extra) -> SamplingBatchInfo:
    """SGLang's per-batch settings; a greedy request has ``top_k == 1`` (SGLang's rule)."""
    top_k = torch.tensor(top_k, dtype=torch.int32)
    greedy = top_k <= 1
    return SamplingBatchInfo(
        temperatures=torch.tensor(temperature, dtype=torch.float32).view(-1, 1),
        top_ps=torch.tensor(top_p, dtype=torch.float32), top_ks=top_k,
        min_ps=torch.tensor(min_p, dtype=torch.float32), is_all_greedy=bool(greedy.all()),
        is_any_greedy=bool(greedy.any()), need_top_p_sampling=any(p < 1 for p in top_p),
        need_top_k_sampling=any(k != TOP_K_ALL for k in top_k.tolist()),
        need_min_p_sampling=any(m > 0 for m in min_p), vocab_size=V, device="cpu",
        sampling_seed=None if seed is None else torch.tensor(seed, dtype=torch.int64), **extra,
    )  # fmt: skip


def schedule_batch(tree: EagleVerifyInput, info: SamplingBatchInfo):
    """What ``eagle_sample`` reads of SGLang's ``ScheduleBatch``."""
    return types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, device="cpu",
                                 seq_lens=tree.seq_lens_cpu.clone(), sampling_info=info,
                                 return_logprob=False)  # fmt: skip


def target_logits(tree: EagleVerifyInput) -> types.SimpleNamespace:
    """``logits_output``: node ``i``'s target logits after its token (bigram), float32."""
    rows = torch.tensor(TARGET, dtype=torch.float32)[tree.draft_token]
    return types.SimpleNamespace(next_token_logits=rows.contiguous())


def run(hook: bool, tree, info, logits=None, **kwargs):
    """SGLang's ``eagle_sample`` (``hook=False``) or the plugin's, on copies of the logits;
    returns ``(predict, accept_lens, accept_index)`` and the logits as the call left them."""
    output = logits if logits is not None else target_logits(tree)
    output = types.SimpleNamespace(next_token_logits=output.next_token_logits.clone())
    batch = schedule_batch(tree, info)
    if hook:
        got = eagle.fastsample_eagle_sample(eu.eagle_sample, tree, batch, output, **kwargs)
    else:
        got = eu.eagle_sample(tree, batch, output, **kwargs)
    return got, output.next_token_logits


def same(got, want) -> bool:
    """Two results of ``eagle_sample`` are equal, bitwise."""
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def children_of(tree, b: int, node: int) -> list[int]:
    """A node's children in SGLang's links (first child, then the next siblings)."""
    kids, child = [], int(tree.retrieve_next_token[b, node])
    while child >= 0:
        kids.append(child)
        child = int(tree.retrieve_next_sibling[b, child])
    return kids


def accepted_paths(tree, accept_lens, accept_index) -> list[list[int]]:
    """Each row's accepted nodes in SGLang's local numbering (root first)."""
    n = tree.draft_token_num
    return [[int(i) - b * n for i in accept_index[b, : int(accept_lens[b])]]
            for b in range(accept_index.shape[0])]  # fmt: skip


# ----------------------------------------------------------------------------- the law

LAW_ROOT = 3
LAW_SEQ_LEN = 11
# Temperature, top-k, top-p, min-p: at the root and both its draft children the joint cut
# keeps other tokens than the sequential one, and temperature 1 moves the law too.
LAW_CONTROLS = (1.2, 5, 0.7, 0.05)
LAW_TREE = dict(topk=2, steps=3, n=6)
LAW_DRAWS = 200_000
LAW_CLAIM = 0.07
LAW_CHUNK = 50_000


def law_children() -> list[int]:
    """The root's draft children: the draft's top-2 after the root token (EAGLE's step 0)."""
    return [int(t) for t in np.argsort(-softmax(DRAFT)[LAW_ROOT].numpy(), kind="stable")[:2]]


def pair_law(cut_order: str = "joint", temperature: float = LAW_CONTROLS[0]) -> np.ndarray:
    """Exact law of (first token, second token or ``V`` = none) when sampling from the target
    alone, the second token emitted in the same verification only after an accepted draft:
    ``p_root(t) p_t(s)`` for the root's draft children ``t``, ``p_root(t)`` at "none" else."""

    def p(token: int) -> np.ndarray:
        return reference_probs(TARGET[token], temperature, *LAW_CONTROLS[1:], cut_order=cut_order)

    law = np.zeros((V, V + 1))
    root = p(LAW_ROOT)
    children = law_children()
    for t in range(V):
        if t in children:
            law[t, :V] = root[t] * p(t)
        else:
            law[t, V] = root[t]
    return law.ravel()


def law_cases():
    yield LawCase(
        "EAGLE tree through eagle_sample: first two tokens (V=16, pairs)", pair_law, LAW_DRAWS,
        LAW_CLAIM,
        carried_by="tests/verify/test_tree.py (tree mode a, 2%) and tests/test_cut_order.py "
        "(the joint cut, 2%): the same verify_tree and process code, at full power there",
    )  # fmt: skip


def pair_counts(predict, accept_lens, accept_index) -> np.ndarray:
    first = predict[accept_index[:, 0].long()].long()
    second = torch.where(accept_lens >= 2, predict[accept_index[:, 1].clamp_min(0).long()], V)
    return np.bincount((first * (V + 1) + second.long()).numpy(), minlength=V * (V + 1))


def test_law_of_the_first_two_tokens():
    one = eagle_tree([LAW_ROOT], [LAW_SEQ_LEN], **LAW_TREE)
    children = [int(one.draft_token[c]) for c in children_of(one, 0, 0)]
    assert sorted(children) == sorted(law_children())  # the law's tree is SGLang's
    t, k, p, m = LAW_CONTROLS
    counts = np.zeros(V * (V + 1), dtype=np.int64)
    with torch.inference_mode():
        for start in range(0, LAW_DRAWS, LAW_CHUNK):
            rows = min(LAW_CHUNK, LAW_DRAWS - start)
            tree = tiled(one, rows)
            info = sampling_info([t] * rows, [k] * rows, [p] * rows, [m] * rows,
                                 seed=list(range(start, start + rows)))  # fmt: skip
            (predict, lens, index), _ = run(True, tree, info)
            counts += pair_counts(predict, lens, index)
    assert CALLS["verify"] == -(-LAW_DRAWS // LAW_CHUNK) and not CALLS["handed"]
    assert counts[: V * (V + 1)].reshape(V, V + 1)[:, :V].sum() > LAW_DRAWS // 2  # drafts accepted
    assert_law(counts, pair_law(), what="EAGLE verification through eagle_sample")
    assert law_rejected(counts, pair_law("transformers"))  # top-p after top-k (SGLang's kernel)
    assert law_rejected(counts, pair_law(temperature=1.0))  # the temperature ignored
    # SGLang's own verification on this CPU (greedy): one pair for every row, at this size.
    tree = tiled(one, 4)
    (predict, lens, index), _ = run(False, tree, sampling_info([t] * 4, [k] * 4, [p] * 4, [m] * 4))
    greedy = pair_counts(predict, lens, index)
    assert greedy.max() == 4
    assert law_rejected(greedy * (LAW_DRAWS // 4), pair_law())


# ----------------------------------------------------------------------------- greedy rows

ROOTS = [3, 8, 0, 12, 5, 3]
SEQ_LENS = [7, 30, 12, 9, 21, 7]


def mixed_info(seed=(11, 12, 13, 14, 15, 16)) -> SamplingBatchInfo:
    """Rows 0, 2 and 4 greedy (SGLang's ``top_k == 1``), the others sampled, each its own way."""
    return sampling_info([1.0, 0.7, 1.0, 1.3, 1.0, 0.5], [1, 5, 1, TOP_K_ALL, 1, 3],
                         [1.0, 0.9, 1.0, 0.8, 1.0, 1.0], [0.0, 0.0, 0.0, 0.1, 0.0, 0.0],
                         seed=list(seed))  # fmt: skip


@pytest.mark.parametrize("shape", [(2, 3, 6), (3, 3, 8), (1, 4, 5)], ids=lambda s: f"topk{s[0]}")
def test_greedy_rows_equal_sglang_greedy_verification(shape):
    topk, steps, n = shape
    tree = eagle_tree(ROOTS, SEQ_LENS, topk, steps, n)
    (want, _), (got, _) = run(False, tree, mixed_info()), run(True, tree, mixed_info())
    assert CALLS["verify"] == 1
    for b in (0, 2, 4):
        assert torch.equal(got[0][b * n : (b + 1) * n], want[0][b * n : (b + 1) * n]), b
        assert torch.equal(got[1][b], want[1][b]) and torch.equal(got[2][b], want[2][b]), b
    assert max(int(want[1][b]) for b in (0, 2, 4)) >= 3  # deep greedy paths were compared


def test_all_greedy_batch_is_sglang_own_call(caplog):
    tree = eagle_tree(ROOTS, SEQ_LENS, 2, 3, 6)
    info = sampling_info([1.0] * 6, [1] * 6, [1.0] * 6, [0.0] * 6)
    (want, _), (got, _) = run(False, tree, info), run(True, tree, info)
    assert same(got, want)
    assert not CALLS["verify"] and not CALLS["handed"] and not plugin_warnings(caplog)


# ----------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("shape", [(2, 3, 6), (3, 3, 8), (1, 4, 5)], ids=lambda s: f"topk{s[0]}")
def test_outputs_have_sglang_shapes_and_invariants(shape):
    topk, steps, n = shape
    tree = eagle_tree(ROOTS, SEQ_LENS, topk, steps, n)
    (want, _), (got, _) = run(False, tree, mixed_info()), run(True, tree, mixed_info())
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.int32
    predict, lens, index = got
    bs, depth = len(ROOTS), tree.max_tree_depth
    assert index.shape == (bs, depth) and predict.shape == (bs * n,)
    logits = target_logits(tree).next_token_logits
    for b, path in enumerate(accepted_paths(tree, lens, index)):
        assert 1 <= len(path) <= depth and path[0] == 0
        assert (index[b, len(path) :] == -1).all()
        for parent, child in itertools.pairwise(path):  # each accepted node a child of the last
            assert child in children_of(tree, b, parent)
            assert predict[b * n + parent] == tree.draft_token[b * n + child]  # its token
        last = predict[b * n + path[-1]]
        assert logits[b * n + path[-1], last] > -torch.inf  # drawn from a real row
        off_path = torch.ones(n, dtype=torch.bool)
        off_path[path] = False
        assert (predict[b * n : (b + 1) * n][off_path] == 0).all()


def test_chain_path_equals_tree_path():
    """``topk == 1`` trees are chains: ``verify_chain`` and ``verify_tree`` give the same
    result with the same keys (the same streams and counters), bitwise."""
    tree = eagle_tree(ROOTS, SEQ_LENS, 1, 5, 6)
    as_tree = eagle_tree(ROOTS, SEQ_LENS, 1, 5, 6)
    as_tree.topk = -1  # an irregular tree to the plugin: verify_tree
    chain, _ = run(True, tree, mixed_info())
    walked, _ = run(True, as_tree, mixed_info())
    assert same(chain, walked)
    assert max(chain[1].tolist()) >= 3


def test_per_request_settings_equal_fastsample_calls():
    """Each request's own temperature, top-k, top-p, min-p (joint cut) and key: the plugin's
    outputs are those of ``fs.process`` and ``fs.verify_tree`` called directly, bitwise."""
    topk, steps, n = 3, 3, 8
    tree = eagle_tree(ROOTS, SEQ_LENS, topk, steps, n)
    info = mixed_info()
    (predict, lens, index), _ = run(True, tree, info)
    greedy = info.top_ks <= 1
    temperature = torch.where(greedy, 0.0, info.temperatures.view(-1))
    top_k = torch.where(greedy | (info.top_ks >= V), 0, info.top_ks).long()
    probs = fs.process(target_logits(tree).next_token_logits,
                       temperature=temperature.repeat_interleave(n),
                       top_k=top_k.repeat_interleave(n), top_p=info.top_ps.repeat_interleave(n),
                       min_p=info.min_ps.repeat_interleave(n), cut_order="joint")  # fmt: skip
    parents = torch.full((len(ROOTS), n), 0)
    parents[:, 0] = -1
    for b in range(len(ROOTS)):
        for node in range(n):
            for child in children_of(tree, b, node):
                parents[b, child] = node
    out = fs.verify_tree(probs.view(len(ROOTS), n, V),
                         fs.TokenTree(tree.draft_token.view(-1, n), parents),
                         seed=info.sampling_seed, step=tree.seq_lens_cpu.long())  # fmt: skip
    assert torch.equal(lens, (out.num_accepted + 1).int())
    for b, path in enumerate(accepted_paths(tree, lens, index)):
        assert path[1:] == out.accepted_nodes[b, : len(path) - 1].tolist()
        assert predict[[b * n + i for i in path]].tolist() == out.token_ids[b, : len(path)].tolist()


def test_seeded_request_gives_the_same_tokens_in_any_batch():
    n = 6
    alone = eagle_tree([ROOTS[1]], [SEQ_LENS[1]], 2, 3, n)
    info = sampling_info([0.7], [5], [0.9], [0.0], seed=[12])
    (predict, lens, index), _ = run(True, alone, info)
    batch = eagle_tree(ROOTS, SEQ_LENS, 2, 3, n)
    (b_predict, b_lens, b_index), _ = run(True, batch, mixed_info())
    assert int(b_lens[1]) == int(lens[0])
    assert accepted_paths(batch, b_lens, b_index)[1] == accepted_paths(alone, lens, index)[0]
    assert torch.equal(b_predict[b_index[1, : int(lens[0])].long()],
                       predict[index[0, : int(lens[0])].long()])  # fmt: skip


class _Grammar:
    """A grammar mask as SGLang applies it (``GrammarMask.apply``): these tokens only."""

    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def apply(self, logits: torch.Tensor) -> None:
        masked = torch.ones(logits.shape[-1], dtype=torch.bool)
        masked[self.allowed] = False
        logits.masked_fill_(masked, -torch.inf)


def preprocessed_info(greedy: bool = False) -> SamplingBatchInfo:
    bs = len(ROOTS)
    gen = torch.Generator().manual_seed(3)
    extra = dict(acc_additive_penalties=torch.randn(bs, V, generator=gen),
                 acc_scaling_penalties=1 + torch.rand(bs, V, generator=gen),
                 logit_bias=torch.randn(bs, V, generator=gen))  # fmt: skip
    if greedy:
        return sampling_info([1.0] * bs, [1] * bs, [1.0] * bs, [0.0] * bs, **extra)
    info = mixed_info()
    for name, value in extra.items():
        setattr(info, name, value)
    return info


def test_preprocessing_is_sglang_own_in_place():
    """Penalties, logit bias and the grammar mask change the logits in place exactly as
    SGLang's ``eagle_sample`` does (``compute_spec_logprobs`` reads them afterwards), and the
    emitted tokens obey the grammar."""
    tree = eagle_tree(ROOTS, SEQ_LENS, 2, 3, 6)
    grammar = _Grammar([1, 3, 4, 9, 13, 14])
    (_, sglang_logits) = run(False, tree, preprocessed_info(), grammar_mask=grammar)
    (predict, lens, index), logits = run(True, tree, preprocessed_info(), grammar_mask=grammar)
    assert torch.equal(logits, sglang_logits)
    assert not torch.equal(logits, target_logits(tree).next_token_logits)
    emitted = [predict[index[b, i].long()].item() for b in range(6) for i in range(int(lens[b]))]
    assert set(emitted) <= set(grammar.allowed)


# ----------------------------------------------------------------------------- tree layouts


def hand_tree(next_token: list[int], next_sibling: list[int], tokens: list[int],
              max_depth: int, rows: int = 1) -> types.SimpleNamespace:  # fmt: skip
    """A verify input built by hand (SGLang's layout: first child / next sibling, -1 none;
    ``max_tree_depth`` as NGRAM's, an irregular tree: ``tree_topk == -1``)."""
    n = len(tokens)
    return types.SimpleNamespace(
        draft_token=torch.tensor(tokens).repeat(rows), draft_token_num=n,
        max_tree_depth=max_depth, tree_topk=-1,
        retrieve_index=torch.arange(rows * n).view(rows, n),
        retrieve_next_token=torch.tensor([next_token] * rows),
        retrieve_next_sibling=torch.tensor([next_sibling] * rows),
        seq_lens_cpu=torch.full((rows,), 9),
    )  # fmt: skip


# root: children 1, 2; node 1: child 4; node 2: child 5; node 4: child 6 (depth 3, below
# max_tree_depth 3); node 3 is linked from nowhere.
NEXT_TOKEN = [1, 4, 5, -1, 6, -1, -1]
NEXT_SIBLING = [-1, 2, -1, -1, -1, -1, -1]
HAND_TOKENS = [3, 10, 8, 7, 9, 7, 11]  # likely tokens: deep paths are accepted


def test_unreached_nodes_are_left_out():
    tree = eagle.sglang_tree(torch.tensor([HAND_TOKENS]), torch.tensor([NEXT_TOKEN]),
                             torch.tensor([NEXT_SIBLING]), 3)  # fmt: skip
    assert tree.parents.tolist() == [[-1, 0, 0, 0, 1, 2, 0]]
    assert tree.token_ids[0, 3] == tree.token_ids[0, 1]  # inert copy of the first child
    assert tree.num_nodes.tolist() == [6]  # node 6 trailing
    rows = 3000
    info = sampling_info([1.0] * rows, [TOP_K_ALL] * rows, [1.0] * rows, [0.0] * rows,
                         seed=list(range(rows)))  # fmt: skip
    hand = hand_tree(NEXT_TOKEN, NEXT_SIBLING, HAND_TOKENS, 3, rows)
    (predict, lens, index), _ = run(True, hand, info)
    paths = accepted_paths(hand, lens, index)
    assert {tuple(p) for p in paths} >= {(0,), (0, 1), (0, 1, 4), (0, 2, 5)}
    assert all(3 not in p and 6 not in p for p in paths)
    # The left-out nodes' tokens and logits change nothing, bitwise.
    changed = hand_tree(NEXT_TOKEN, NEXT_SIBLING, [3, 10, 8, 2, 9, 7, 0], 3, rows)
    logits = target_logits(changed)
    logits.next_token_logits.view(rows, 7, V)[:, [3, 6]] = torch.randn(rows, 2, V)
    again, _ = run(True, changed, info, logits=logits)
    assert same(again, (predict, lens, index))


def test_malformed_links_keep_only_the_root():
    """A parent listed after its child (not SGLang's layout): the row is verified without
    drafts (its one token drawn from the target at the root: exact, nothing accepted)."""
    tree = eagle.sglang_tree(torch.tensor([[3, 9, 13]]), torch.tensor([[2, -1, 1]]),
                             torch.tensor([[-1, -1, -1]]), 3)  # fmt: skip
    assert tree.num_nodes.tolist() == [1]
    hand = hand_tree([2, -1, 1], [-1, -1, -1], [3, 9, 13], 3)
    (_, lens, index), _ = run(True, hand, sampling_info([1.0], [1], [1.0], [0.0], seed=[1]))
    assert lens.tolist() == [1] and index.tolist() == [[0, -1, -1]]


# ----------------------------------------------------------------------------- SGLang's code


def plugin_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fastsample.sglang"]


def spy():
    """A stand-in for SGLang's function: records the seeds it was called with."""
    calls = []

    def original(verify_input, batch, *args, **kwargs):
        calls.append(batch.sampling_info.sampling_seed)
        return "sglang"

    return original, calls


@pytest.mark.parametrize("feature", ["rejection", "threshold", "watermark"])
def test_unsupported_features_go_to_sglang_with_one_warning(feature, monkeypatch, caplog):
    tree = eagle_tree(ROOTS, SEQ_LENS, 2, 3, 6)
    kwargs = {}
    if feature == "rejection":
        monkeypatch.setattr(eu, "get_spec", lambda: spec(speculative_use_rejection_sampling=True))
    elif feature == "threshold":
        monkeypatch.setattr(eu, "get_spec", lambda: spec(speculative_accept_threshold_acc=0.5))
    else:
        kwargs["watermark_state"] = object()
    original, calls = spy()
    with caplog.at_level(logging.WARNING, logger="fastsample.sglang"):
        for _ in range(2):
            info = mixed_info()
            info.has_watermark_candidates = feature == "watermark"
            info.fastsample_own_seed = True  # the plugin's key: SGLang would have had none
            batch = schedule_batch(tree, info)
            got = eagle.fastsample_eagle_sample(original, tree, batch, target_logits(tree),
                                                **kwargs)  # fmt: skip
            assert got == "sglang"
            assert torch.equal(info.sampling_seed, mixed_info().sampling_seed)  # put back
    assert calls == [None, None] and CALLS["handed"] == 2 and not CALLS["verify"]
    warned = plugin_warnings(caplog)
    assert len(warned) == 1 and "SGLang's own eagle_sample" in warned[0]


def test_an_error_hands_the_call_to_sglang_once_preprocessed(monkeypatch, caplog):
    """fastsample fails after preprocessing the logits in place: SGLang's function verifies
    the call without preprocessing them again (its result and logits are those of SGLang
    alone), with one warning for two failing calls."""
    tree = eagle_tree(ROOTS, SEQ_LENS, 2, 3, 6)
    want, want_logits = run(False, tree, preprocessed_info())

    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    monkeypatch.setattr(eagle, "verify_tree", broken)
    with caplog.at_level(logging.WARNING, logger="fastsample.sglang"):
        for _ in range(2):
            info = preprocessed_info()
            got, logits = run(True, tree, info)
            assert same(got, want)
            assert torch.equal(logits, want_logits)
            assert info.logit_bias is not None and info.acc_additive_penalties is not None
    assert CALLS["handed"] == 2 and not CALLS["verify"]
    warned = plugin_warnings(caplog)
    assert len(warned) == 1 and "failed" in warned[0]


def test_install_registers_an_around_hook():
    registered = []
    registry = types.SimpleNamespace(register=lambda *args: registered.append(args))
    assert eagle.install(registry, hook_registry.HookType) == [eagle.EAGLE_SAMPLE]
    assert registered == [(eagle.EAGLE_SAMPLE, eagle.fastsample_eagle_sample,
                           hook_registry.HookType.AROUND)]  # fmt: skip
    # SGLang's own wrapper for that hook: eagle_sample's signature, fastsample verifies.
    wrapped = hook_registry._wrap_fn(eu.eagle_sample, eagle.fastsample_eagle_sample,
                                     hook_registry.HookType.AROUND)  # fmt: skip
    tree = eagle_tree(ROOTS, SEQ_LENS, 2, 3, 6)
    output = target_logits(tree)
    got = wrapped(tree, schedule_batch(tree, mixed_info()), output, None)
    want, _ = run(True, tree, mixed_info())
    assert same(got, want) and CALLS["verify"] == 2
