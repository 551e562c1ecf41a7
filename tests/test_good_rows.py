"""Bad rows never touch good rows, for every public function.

Each test runs one seeded call on a batch that mixes good and bad rows, and the same call on
the good rows alone (each row keeping its own seed, controls and data): the good rows'
results must be bitwise equal, and the bad rows flagged. Seeds make a row's randomness its
own (counter-based, keyed by the request), so dropping the bad rows changes nothing else.
The last tests are negative controls: a broken copy in which one bad row shifts the good
rows' ids fails these checks.
"""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
import fastsample.sampling as sampling_module
import fastsample.stages.draw
import fastsample.verify.chain as chain_module
import test_bad_input

NAN, INF = float("nan"), float("inf")
B, V = 12, 300
BAD = [1, 4, 5, 8, 11]  # good rows before, between and after them
GOOD = [row for row in range(B) if row not in BAD]


def rows_of(value, rows):
    """Index every per-row input (tensors with a batch dimension) by ``rows``."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == B:
        return value[rows]
    if isinstance(value, fs.TokenTree):
        return fs.TokenTree(*(rows_of(part, rows) for part in value))
    return value


def assert_good_rows_unchanged(call, args, kwargs, bad=BAD):
    """``call(*args, **kwargs)`` on the whole batch, then on its good rows alone: the good
    rows' outputs are bitwise equal. Returns the whole batch's output."""
    good = torch.tensor([row for row in range(B) if row not in bad])
    full = call(*args, **kwargs)
    alone = call(
        *(rows_of(a, good) for a in args), **{k: rows_of(v, good) for k, v in kwargs.items()}
    )
    full_parts = [full] if isinstance(full, torch.Tensor) else list(full)
    alone_parts = [alone] if isinstance(alone, torch.Tensor) else list(alone)
    for whole, part in zip(full_parts, alone_parts, strict=True):
        if whole is None:
            continue
        assert torch.equal(whole[good], part), "a bad row changed a good row's result"
    return full


def assert_flagged(valid, bad=BAD):
    assert valid.tolist() == [row not in bad for row in range(B)]


def logits_batch(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, V, generator=gen) * 3).to(dtype)


def spoil_probs(probs):
    """One bad row of each kind at the rows of ``BAD``."""
    probs = probs.clone()
    probs[1, 7] = NAN
    probs[4, 250] = INF
    probs[5, 3] = -1e-3
    probs[8] = 0.0
    probs[11, 299] = 1e38 if probs.dtype == torch.float16 else 3e38  # f16: +inf
    if probs.dtype != torch.float16:
        probs[11, 298] = 3e38  # a total of 6e38: overflows float32 sums
    if probs.dtype == torch.float64:
        probs[11, 297] = INF
    return probs


def spoil_logits(logits):
    logits = logits.clone()
    logits[1, 7] = NAN
    logits[4, 250] = INF
    logits[5] = -INF  # every token masked
    logits[8, :] = NAN
    logits[11, 0] = NAN
    return logits


def seeds():
    return {"seed": torch.arange(B) * 7919 + 3, "step": torch.arange(B) % 3}


# ---------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("method", ["race", "inverse_cdf"])
def test_sample_from_probs(method, dtype):
    probs = spoil_probs(torch.softmax(logits_batch(1), -1).to(dtype))
    out = assert_good_rows_unchanged(
        fs.sample_from_probs, (probs, 2), {"method": method, **seeds()}
    )
    assert_flagged(out.valid)
    assert (out.token_ids[BAD] == torch.tensor([0, 1])).all()


def test_fast_sample():
    probs = spoil_probs(torch.softmax(logits_batch(2), -1))
    _, sample_index = assert_good_rows_unchanged(fs.fast_sample, (probs, 3), seeds())
    assert (sample_index[BAD] == torch.tensor([0, 1, 2])).all()
    assert ((sample_index >= 0) & (sample_index < V)).all()


def tensor_controls():
    """Per-row controls with good values everywhere (greedy, small and large top-k, ...)."""
    return {
        "temperature": torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 0.5, 0.0, 1.0, 2.0, 0.8, 1e-3, 1.0]),
        "top_k": torch.tensor([0, 5, 50, 0, 300, 2, 0, 10, 0, 1, 40, 7]),
        "top_p": torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.3, 1.0, 0.8, 0.99, 1.0, 0.7, 0.9]),
        "min_p": torch.tensor([0.0, 0.05, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.01, 0.0, 0.0, 0.3]),
    }


@pytest.mark.parametrize("num_samples,top_logprobs", [(1, 0), (2, 3)])
@pytest.mark.parametrize("source", ["logits", "probs"])
def test_sample_with_tensor_controls(source, num_samples, top_logprobs):
    """Bad rows by data and by control value (and a bad stream), mixed in one batch."""
    logits = logits_batch(3)
    controls = tensor_controls()
    if source == "logits":
        x = spoil_logits(logits)
        x[1] = logits[1]  # row 1 is bad by its temperature instead
    else:
        x = spoil_probs(torch.softmax(logits, -1))
        x[1] = torch.softmax(logits[1], -1)
    controls["temperature"][1] = -1.0
    controls["top_p"][4] = 0.0  # row 4 is bad twice over
    controls["top_k"][8] = -3
    controls["min_p"][11] = 1.5
    stream = torch.arange(B) + 5
    stream[5] = -1  # out of [0, 2**24): flagged
    kwargs = {**controls, **seeds(), "stream": stream, "num_samples": num_samples}
    out = assert_good_rows_unchanged(
        fs.sample, (), {source: x, "top_logprobs": top_logprobs, **kwargs}
    )
    assert not out.valid[BAD].any()
    if num_samples == 1:  # with 2 draws, rows keeping a single token are invalid as well
        assert out.valid[GOOD].all()
    assert (out.token_ids[BAD] == torch.arange(num_samples)).all()
    assert (out.probs[BAD] == 0).all() and (out.logprobs[BAD] == -INF).all()


@pytest.mark.parametrize(
    "controls",
    [
        {},
        {"temperature": 0.8, "top_p": 0.9},
        {"top_k": 5},  # logits: the small top-k shortcut
        {"temperature": 0.0},  # all greedy: one max pass
        {"min_p": 0.1, "temperature": 1.5},
    ],
    ids=["off", "T-top_p", "small-top_k", "greedy", "min_p"],
)
@pytest.mark.parametrize("source", ["logits", "probs"])
def test_sample_with_number_controls(source, controls):
    logits = logits_batch(4)
    x = spoil_logits(logits) if source == "logits" else spoil_probs(torch.softmax(logits, -1))
    bad = BAD
    if source == "probs" and controls.get("temperature") == 0.0:
        bad = [1, 4, 5, 8]  # greedy rows need no sum: the overflowing row 11 is fine
    out = assert_good_rows_unchanged(fs.sample, (), {source: x, **controls, **seeds()}, bad)
    assert_flagged(out.valid, bad)


@pytest.mark.parametrize("source", ["logits", "probs"])
def test_process(source):
    logits = logits_batch(5)
    x = spoil_logits(logits) if source == "logits" else spoil_probs(torch.softmax(logits, -1))
    controls = tensor_controls()
    controls["temperature"][1] = float("nan")
    out = assert_good_rows_unchanged(fs.process, (), {source: x, **controls})
    assert not out[BAD].any()  # invalid rows are all zeros
    good_sums = out[GOOD].sum(-1, dtype=torch.float64)
    assert torch.allclose(good_sums, torch.ones(len(GOOD), dtype=torch.float64))


# ---------------------------------------------------------------------------- verification


def chain_batch(seed, k=4):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(B, k + 1, V, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(B, k, V, generator=gen) * 2, -1)
    # Drafts the target likes, so that walks go deep and later positions are read.
    tokens = (target[:, :k] + draft).argmax(-1)
    return target, draft, tokens


@pytest.mark.parametrize("with_draft", [True, False])
def test_verify_chain(with_draft):
    target, draft, tokens = chain_batch(6)
    lengths = torch.full((B,), 4)
    target[1, 0, 5] = NAN
    target[1, 0, tokens[1, 0]] = NAN  # read at once, whatever the walk
    tokens[4, 0] = V  # a draft id out of range
    lengths[5] = 9  # out of [0, K]
    draft[8, 0, tokens[8, 0]] = -1.0  # a negative q(x) at the first draft
    target[8, 0, tokens[8, 0]] = -1.0
    target[11, :, :] = NAN
    out = assert_good_rows_unchanged(
        fs.verify_chain,
        (target, tokens, draft if with_draft else None),
        {"draft_lengths": lengths, **seeds()},
    )
    assert_flagged(out.valid)
    assert (out.token_ids[BAD] == -1).all()


@pytest.mark.parametrize("tensor_parents", [False, True])
@pytest.mark.parametrize("mode", ["a", "b"])
def test_verify_tree(mode, tensor_parents):
    parents = [-1, 0, 0, 0, 1, 1, 2, 4]
    n = len(parents)
    gen = torch.Generator().manual_seed(7)
    target = torch.softmax(torch.randn(B, n, V, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(B, n, V, generator=gen) * 2, -1)
    tokens = torch.rand(B, V, generator=gen).argsort(-1)[:, :n]  # distinct siblings
    sizes = torch.full((B,), n)
    target[1] = NAN
    tokens[4, 2] = -5  # a token id out of range
    sizes[5] = 0  # num_nodes out of [1, N]
    tree_parents = torch.tensor(parents).repeat(B, 1) if tensor_parents else parents
    if tensor_parents:
        tree_parents[8, 0] = 0  # the root's entry must be -1
        tree_parents[11, 3] = 3  # a cycle
    else:
        target[8, 0, :] = -1.0  # the root's first child is always tested: p(t) < 0
        target[11, 0, :] = INF
    q = None
    if mode == "b":
        q = draft
        tokens[2, 3] = tokens[2, 1]  # repeated siblings (children of node 0)
    tree = fs.TokenTree(tokens, tree_parents, sizes)
    bad = BAD + ([2] if mode == "b" else [])
    out = assert_good_rows_unchanged(fs.verify_tree, (target, tree, q), seeds(), bad)
    assert_flagged(out.valid, bad)
    assert (out.token_ids[bad] == -1).all()


# ---------------------------------------------------------------------------- negative controls


def shift_when_any_bad(ids, valid, vocab):
    """A broken copy's bug: one bad row anywhere moves every row's ids by one (in range)."""
    shift = (~valid).any().to(ids.dtype)
    return torch.where(ids > 0, ids - shift, ids + shift).clamp(0, vocab - 1)


def test_negative_control_samplers(monkeypatch):
    """With ``finish`` broken so that a bad row shifts the good rows' ids, the checks above
    fail for sample_from_probs, fast_sample and sample."""
    real = sampling_module.finish

    def broken_finish(weights, token_ids, genuine, total, clean, *rest):
        out = real(weights, token_ids, genuine, total, clean, *rest)
        return out._replace(token_ids=shift_when_any_bad(out.token_ids, clean, V))

    monkeypatch.setattr(sampling_module, "finish", broken_finish)  # sample_from_probs
    monkeypatch.setattr(fastsample.stages.draw, "finish", broken_finish)  # sample
    probs = spoil_probs(torch.softmax(logits_batch(1), -1))
    cases = [
        lambda: test_sample_from_probs("inverse_cdf", torch.float32),
        lambda: test_sample_from_probs("race", torch.float32),
        lambda: test_fast_sample(),
        lambda: test_sample_with_tensor_controls("logits", 1, 0),
        lambda: test_sample_with_number_controls("logits", {"top_k": 5}),
        lambda: assert_good_rows_unchanged(fs.sample, (), {"probs": probs, **seeds()}),
    ]
    for case in cases:
        with pytest.raises(AssertionError, match="a bad row changed a good row's result"):
            case()
    # The same-batch comparisons of test_bad_input.py (generator noise) fail as well.
    for method in ("inverse_cdf", "race"):
        with pytest.raises(AssertionError):
            test_bad_input.test_bad_rows_are_flagged_and_do_not_touch_good_rows(
                method, 1, torch.float32
            )
    for randomness in ("generator", "seeded"):
        with pytest.raises(AssertionError):
            test_bad_input.test_fast_sample_bad_rows(randomness)


def test_negative_control_verify_chain(monkeypatch):
    real = chain_module._verify_chain

    def broken(*args):
        out = real(*args)
        shifted = shift_when_any_bad(out.token_ids, out.valid, V)
        return out._replace(token_ids=torch.where(out.token_ids >= 0, shifted, -1))

    monkeypatch.setattr(chain_module, "_verify_chain", broken)
    with pytest.raises(AssertionError, match="a bad row changed a good row's result"):
        test_verify_chain(True)
