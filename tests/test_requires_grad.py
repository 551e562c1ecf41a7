"""Inputs that require grad: every public function samples their values, no error, no graph.

Logits straight from a model outside ``torch.no_grad()`` are the most common input there is;
the samplers' in-place and ``out=`` ops refuse such tensors, so every entry point detaches
its inputs once, after the argument checks. Each test compares with the same call on the
detached input (same seeds: bitwise the same outputs) and checks that nothing returned
carries an autograd graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fastsample as fs

B, V = 4, 300


def model_logits(seed: int = 0, shape: tuple[int, ...] = (B,)) -> torch.Tensor:
    """Logits of a tiny model outside no_grad: they require grad (a non-leaf tensor)."""
    torch.manual_seed(seed)
    out = torch.nn.Linear(16, V)(torch.randn(*shape, 16))
    assert out.requires_grad and out.grad_fn is not None
    return out


def no_graph(result) -> None:
    """No tensor in ``result`` (a tensor or a tuple of them) requires grad."""
    tensors = [result] if isinstance(result, torch.Tensor) else list(result)
    for t in tensors:
        assert t is None or not t.requires_grad


def same(a, b) -> None:
    a = [a] if isinstance(a, torch.Tensor) else list(a)
    b = [b] if isinstance(b, torch.Tensor) else list(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


def seeds() -> dict:
    return {"seed": torch.arange(B), "step": 3}


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.7, "top_p": 0.9},
        {"top_k": 5, "top_logprobs": 3},  # the small top-k shortcut
        {"temperature": 0.0, "num_samples": 2},  # all greedy
        {"temperature": torch.tensor([0.0, 0.5, 1.0, 2.0]), "min_p": 0.05, "top_logprobs": 2},
    ],
    ids=["plain", "numbers", "small-top-k", "greedy", "tensor-controls"],
)
@pytest.mark.parametrize("source", ["logits", "probs"])
def test_sample(source, kwargs):
    x = model_logits()
    if source == "probs":
        x = torch.softmax(x, -1)
    got = fs.sample(**{source: x}, **kwargs, **seeds())
    no_graph(got)
    same(got, fs.sample(**{source: x.detach()}, **kwargs, **seeds()))
    assert got.valid.all()


def test_sample_with_control_tensors_that_require_grad():
    """A learned temperature or top-p (a tensor in the graph) is a value too."""
    x = model_logits()
    temperature = torch.full((B,), 0.8, requires_grad=True)
    top_p = torch.full((B,), 0.9).requires_grad_()
    got = fs.sample(x, temperature=temperature * 1.0, top_p=top_p, min_p=top_p * 0.01, **seeds())
    no_graph(got)
    want = fs.sample(
        x.detach(), temperature=torch.full((B,), 0.8), top_p=torch.full((B,), 0.9),
        min_p=torch.full((B,), 0.9) * 0.01, **seeds(),
    )  # fmt: skip
    same(got, want)


@pytest.mark.parametrize("method", ["race", "inverse_cdf", "auto"])
def test_sample_from_probs(method):
    probs = torch.softmax(model_logits(1), -1)
    got = fs.sample_from_probs(probs, 2, method=method, **seeds())
    no_graph(got)
    same(got, fs.sample_from_probs(probs.detach(), 2, method=method, **seeds()))
    gen = torch.Generator().manual_seed(5)
    no_graph(fs.sample_from_probs(probs, method=method, generator=gen))


def test_fast_sample():
    probs = torch.softmax(model_logits(2), -1)
    sample_p, sample_index = fs.fast_sample(probs, 3, **seeds())
    no_graph((sample_p, sample_index))  # sample_p too: gather from probs to differentiate
    same((sample_p, sample_index), fs.fast_sample(probs.detach(), 3, **seeds()))
    assert torch.equal(sample_p, probs.detach().gather(1, sample_index))
    no_graph(fs.fast_sample(probs, check=True))


@pytest.mark.parametrize("source", ["logits", "probs"])
def test_process(source):
    x = model_logits(3)
    if source == "probs":
        x = torch.softmax(x, -1)
    for kwargs in ({}, {"top_k": 7, "temperature": 0.5}, {"temperature": torch.ones(B) * 0}):
        got = fs.process(**{source: x}, **kwargs)
        assert not got.requires_grad and got.grad_fn is None  # process returns no graph
        same(got, fs.process(**{source: x.detach()}, **kwargs))
        assert torch.allclose(got.sum(-1, dtype=torch.float64), torch.ones(B, dtype=torch.float64))


@pytest.mark.parametrize("with_draft", [False, True])
def test_verify_chain(with_draft):
    k = 3
    target = torch.softmax(model_logits(4, (B, k + 1)), -1)
    draft = torch.softmax(model_logits(5, (B, k)), -1)
    drafts = draft.detach().argmax(-1)
    q = draft if with_draft else None
    got = fs.verify_chain(target, drafts, q, **seeds(), check=True)
    no_graph(got)
    want = fs.verify_chain(target.detach(), drafts, None if q is None else q.detach(), **seeds())
    same(got, want)
    assert got.valid.all()


@pytest.mark.parametrize("mode", ["a", "b"])
def test_verify_tree(mode):
    parents = [-1, 0, 0, 1, 1, 2]
    n = len(parents)
    target = torch.softmax(model_logits(6, (B, n)), -1)
    draft = torch.softmax(model_logits(7, (B, n)), -1)
    tokens = torch.rand(B, V, generator=torch.Generator().manual_seed(0)).argsort(-1)[:, :n]
    q = draft if mode == "b" else None
    for tree_parents in (parents, torch.tensor(parents)):
        tree = fs.TokenTree(tokens, tree_parents)
        got = fs.verify_tree(target, tree, q, **seeds())
        no_graph(got)
        qd = None if q is None else q.detach()
        same(got, fs.verify_tree(target.detach(), tree, qd, **seeds()))
        assert got.valid.all()


@pytest.fixture
def one_rank_group():
    """A one-process gloo group in this process (the multi-rank tests live in
    tests/distributed/ and run in their own processes)."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialized here")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("source", ["logits", "probs"])
def test_distributed_sample(one_rank_group, source):
    x = model_logits(8)
    if source == "probs":
        x = torch.softmax(x, -1)
    kwargs = {"vocab_start": 0, "vocab_size": V, "top_k": 20, "seed": torch.arange(B)}
    got = fs.distributed.sample(**{source: x}, **kwargs)
    no_graph(got)
    same(got, fs.distributed.sample(**{source: x.detach()}, **kwargs))
    assert got.valid.all()
