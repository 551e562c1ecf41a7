"""Top-p's cut from the entries above an estimated bound (``fastsample/ops/top_p_entries.py``):
the radix's cut, proven or declined, and the general path's draws bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
import fastsample.ops.top_p_entries as entries
from fastsample.ops.select import block_maxima, descending_threshold
from reference import reference_threshold


@pytest.fixture
def any_share(monkeypatch):
    """Tables of any share of the row (by default past 3% the radix is cheaper and serves the
    call): the cut's numbers do not depend on that cap, so these tests use every setting."""
    monkeypatch.setattr(entries, "_MAX_SHARE", 1.0)
    monkeypatch.setattr(entries, "_GATE_SHARE", 1.0)


def _weights(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    best = logits.float().amax(-1, keepdim=True)
    return ((logits.float() - best) / temperature).exp()


def _rows(seed: int, batch: int, vocab: int, scale: float, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=gen) * scale).to(dtype)


def _near_boundary(row: np.ndarray, target: float) -> bool:
    """The target sits within float32 summation rounding of a cumulative mass."""
    ranked = np.sort(row)[::-1]
    return bool(np.min(np.abs(np.cumsum(ranked) - target)) < 1e-6 * ranked.sum())


def _exact_cut_check(weights: torch.Tensor, top_p: torch.Tensor, got: torch.Tensor) -> int:
    """Asserts each row's cut is the float64 sort's (either neighbour where the target is
    within rounding of a cumulative mass); returns the rows checked strictly."""
    strict = 0
    for r in range(weights.shape[0]):
        row = weights[r].double().numpy()
        target = float(top_p[r]) * row.sum()
        want = reference_threshold(row, target, "mass")
        if _near_boundary(row, target):
            continue
        strict += 1
        assert float(got[r]) == want, (r, float(got[r]), want)
    return strict


# (scale, T, top_p): smooth rows with sets of 1-12% of the row, a peaked one (scale 8: a
# few tokens, held by the block-maxima floor), small and large top_p.
SETTINGS = [(3.0, 0.8, 0.9), (3.0, 1.0, 0.95), (2.0, 0.7, 0.5), (8.0, 1.0, 0.9), (3.0, 0.8, 0.99)]


@pytest.mark.parametrize("scale,temperature,top_p", SETTINGS)
@pytest.mark.parametrize("vocab", [32000, 50001])
def test_cut_is_the_exact_threshold(scale, temperature, top_p, vocab, any_share):
    logits = _rows(1, 16, vocab, scale)
    weights = _weights(logits, temperature)
    p = torch.full((16,), top_p, dtype=torch.float64)
    got = entries.top_p_cut(weights, torch.ones(16), p, block_maxima(logits), vocab)
    assert got is not None  # the estimate held on every row of these settings
    assert _exact_cut_check(weights, p, got) >= 4  # rows away from a boundary
    radix = descending_threshold(weights.contiguous(), p, "share")
    assert torch.equal(got, radix)  # (no row of these seeds sits within rounding)


def test_padding_columns_and_probabilities_order(any_share):
    """An odd vocabulary in the general path's even-width buffer (a 0 column), and block
    maxima of another input that orders like the weights (probabilities)."""
    vocab = 40001
    logits = _rows(2, 8, vocab, 3.0)
    probs = torch.softmax(logits, -1)
    buffer = torch.zeros(8, vocab + 1)
    buffer[:, :vocab] = _weights(logits, 1.0)
    p = torch.linspace(0.3, 0.97, 8, dtype=torch.float64)
    got = entries.top_p_cut(buffer, torch.ones(8), p, block_maxima(probs), vocab)
    assert got is not None
    assert _exact_cut_check(buffer[:, :vocab], p, got) >= 4
    none_given = entries.top_p_cut(buffer, torch.ones(8), p, None, vocab)
    assert torch.equal(got, none_given)


def test_the_proof_declines_a_bound_that_misses(monkeypatch, any_share):
    """A bound estimated far too high (the margin inflated) leaves part of top-p's set out of
    the table: the proof declines (None) rather than give the table's cut.

    Negative control: without the proof, the table's cut is returned and differs from the
    exact one in most rows (so this test would catch a proof that lets such a cut through).
    """
    logits = _rows(3, 16, 32000, 3.0)
    weights = _weights(logits, 0.8)
    p = torch.full((16,), 0.9, dtype=torch.float64)
    maxima = block_maxima(logits)
    monkeypatch.setattr(entries, "_MARGIN", 50.0)  # leave out up to 50x (1 - p) Z
    monkeypatch.setattr(entries, "_FLOOR_BLOCKS", 1)  # and no floor from the block maxima
    assert entries.top_p_cut(weights, torch.ones(16), p, maxima, 32000) is None

    # The control: the same call with the proof read as holding.
    real_all = torch.Tensor.all
    monkeypatch.setattr(torch.Tensor, "all", lambda self, *a, **k: torch.tensor(True))
    wrong = entries.top_p_cut(weights, torch.ones(16), p, maxima, 32000)
    monkeypatch.setattr(torch.Tensor, "all", real_all)
    exact = descending_threshold(weights, p, "share")
    assert wrong is not None and int((wrong != exact).sum()) >= 8


@pytest.mark.parametrize(
    "scale,temperature,declines,summed",
    [(0.5, 2.0, True, False), (3.0, 1.0, True, True), (3.0, 0.8, False, True)],
)
def test_large_sets_are_left_to_the_radix(scale, temperature, declines, summed, monkeypatch):
    """Sets past 3% of the row (flat rows, high temperatures: ~9% at T=1 on N(0, 3^2)) go to
    the radix, cheaper there; ~1.4% at T=0.8 takes the table. A flat row's set, past 12% by
    the first look, declines before the row's mass is summed."""
    logits = _rows(4, 8, 128256, scale)
    weights = _weights(logits, temperature)
    p = torch.full((8,), 0.9, dtype=torch.float64)
    sums = []
    real = entries.block_sums
    monkeypatch.setattr(entries, "block_sums", lambda w: sums.append(1) or real(w))
    got = entries.top_p_cut(weights, torch.ones(8), p, block_maxima(logits), 128256)
    assert (got is None) == declines
    assert sums == ([1] if summed else [])


def test_nan_rows_decline_without_error():
    logits = _rows(5, 4, 32000, 3.0)
    logits[1, 7] = float("nan")
    weights = _weights(logits, 1.0)
    p = torch.full((4,), 0.9, dtype=torch.float64)
    assert entries.top_p_cut(weights, torch.ones(4), p, block_maxima(logits), 32000) is None


def _served(monkeypatch) -> list:
    """Records, per call of the cut, whether the table served it (True) or declined."""
    seen: list = []
    real = entries.top_p_cut

    def counted(*args, **kwargs):
        got = real(*args, **kwargs)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(entries, "top_p_cut", counted)
    return seen


def _without_entries(monkeypatch):
    monkeypatch.setattr(entries, "top_p_cut", lambda *args, **kwargs: None)


CALLS = [
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0, top_p=0.95, min_p=0.001),
    dict(temperature=0.7, top_p=0.5, cut_order="joint"),
    dict(temperature=0.8, top_p=torch.tensor([0.9, 1.0, 0.5, 0.95, 0.8, 0.9])),  # one off
    dict(temperature=torch.tensor([0.8, 1.0, 0.5, 1.2, 0.9, 0.7]), top_p=0.9, num_samples=3),
    dict(temperature=0.8, top_p=0.9, top_logprobs=4),
]


@pytest.mark.parametrize("call", range(len(CALLS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_are_the_general_paths_bitwise(call, dtype, monkeypatch, any_share):
    kwargs = CALLS[call]
    logits = _rows(6 + call, 6, 50001, 3.0, dtype)
    seen = _served(monkeypatch)
    ours = fs.sample(logits, seed=torch.arange(6), step=3, **kwargs)
    assert seen and all(seen)  # the table served the call
    _without_entries(monkeypatch)
    radix = fs.sample(logits, seed=torch.arange(6), step=3, **kwargs)
    for name in ("token_ids", "probs", "logprobs", "valid"):
        assert torch.equal(getattr(ours, name), getattr(radix, name)), name
    if kwargs.get("top_logprobs"):
        assert torch.equal(ours.top_token_ids, radix.top_token_ids)
        assert torch.equal(ours.top_logprobs, radix.top_logprobs)


def test_probabilities_and_process_match_the_radix(monkeypatch, any_share):
    probs = torch.softmax(_rows(9, 5, 40000, 3.0), -1)
    ours = fs.process(probs=probs, temperature=0.9, top_p=0.9)
    drawn = fs.sample(probs=probs, temperature=0.9, top_p=0.9, seed=torch.arange(5), step=0)
    _without_entries(monkeypatch)
    assert torch.equal(ours, fs.process(probs=probs, temperature=0.9, top_p=0.9))
    again = fs.sample(probs=probs, temperature=0.9, top_p=0.9, seed=torch.arange(5), step=0)
    assert torch.equal(drawn.token_ids, again.token_ids)


def test_min_p_floor_settles_the_rows_it_binds(any_share, monkeypatch):
    """With min-p's cut as the floor, the table reaches no lower than it; rows whose top-p
    cut lies below it get the floor, and ``max(cut, floor)`` is the radix's in every row.
    Control: the same table without the floor rule is declined (its mass falls short)."""
    logits = _rows(10, 16, 32000, 3.0)
    weights = _weights(logits, 0.8)
    p = torch.full((16,), 0.9, dtype=torch.float64)
    floor = torch.full((16,), 0.05)
    floor[:4] = 1e-6  # rows where top-p binds
    maxima = block_maxima(logits)
    got = entries.top_p_cut(weights, torch.ones(16), p, maxima, 32000, floor)
    assert got is not None
    radix = descending_threshold(weights, p, "share")
    assert torch.equal(torch.maximum(got, floor), torch.maximum(radix, floor))
    assert torch.equal(got[:4], radix[:4]) and torch.equal(got[4:], floor[4:])
    # Control: a bound raised to the floor alone (no floor rule) cannot be proven.
    real = entries._bound

    def raised(*args):
        return torch.maximum(real(*args)[0], floor), 0.001

    monkeypatch.setattr(entries, "_bound", raised)
    assert entries.top_p_cut(weights, torch.ones(16), p, maxima, 32000) is None


@pytest.mark.parametrize("order", ["transformers", "joint"])
def test_min_p_on_the_general_path_is_the_radixs(order, monkeypatch, any_share):
    """T + top-p + min-p where the min-p candidates decline (many survivors): the general
    path with the floor, bitwise the radix's draws."""
    import fastsample.ops.small_top_k as small_top_k

    monkeypatch.setattr(small_top_k, "min_p_candidates", lambda *args: None)
    logits = _rows(11, 6, 50001, 3.0)
    min_p = torch.tensor([0.05, 1e-5, 0.2, 0.0, 0.1, 0.01])
    kwargs = dict(temperature=0.8, top_p=0.9, min_p=min_p)
    seen = _served(monkeypatch)
    ours = fs.sample(logits, seed=torch.arange(6), step=1, cut_order=order, **kwargs)
    assert seen == [True]
    _without_entries(monkeypatch)
    radix = fs.sample(logits, seed=torch.arange(6), step=1, cut_order=order, **kwargs)
    for name in ("token_ids", "probs", "logprobs", "valid"):
        assert torch.equal(getattr(ours, name), getattr(radix, name)), name


def test_masked_and_integer_rows_match_the_radix(monkeypatch, any_share):
    """Rows mostly masked (-inf logits, as a grammar leaves them) and integer logits (ties
    everywhere): the cut, served or declined, gives the radix's draws."""
    logits = _rows(12, 6, 40000, 3.0)
    logits[:2, 200:] = float("-inf")  # 200 tokens allowed
    logits[2:4] = logits[2:4].round()  # ties at every weight
    ours = fs.sample(logits, temperature=0.9, top_p=0.8, seed=torch.arange(6), step=2)
    _without_entries(monkeypatch)
    radix = fs.sample(logits, temperature=0.9, top_p=0.8, seed=torch.arange(6), step=2)
    for name in ("token_ids", "probs", "logprobs", "valid"):
        assert torch.equal(getattr(ours, name), getattr(radix, name)), name
