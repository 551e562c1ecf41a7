"""Exact order statistics (fastsample.ops.select) against sorting, including ties and garbage."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import fastsample.ops.select as select_module
from fastsample.ops.select import (
    _bisect_threshold,
    candidate_entries,
    descending_threshold,
    first_argmax,
    largest_entries,
    top_entries,
)
from reference import reference_threshold, threshold_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("by", ["count", "mass", "share"])
@pytest.mark.parametrize(
    "method", ["radix", "radix_wide_chunked", "radix_int64_keys", "bisect", "sorted"]
)
def test_threshold_matches_sorting(dtype, by, method, monkeypatch):
    values = threshold_rows(dtype, 1000, seed=1)
    gen = np.random.default_rng(2)
    select = _bisect_threshold if method == "bisect" else descending_threshold
    if method == "sorted":  # the short-row path, on rows of 1000
        monkeypatch.setattr(select_module, "_SORT_BELOW", 1001)
    if method in ("radix_wide_chunked", "radix_int64_keys"):
        # The 16-bit digits of long rows, and one row per chunk (5 rows: every chunk path).
        monkeypatch.setattr(select_module, "_WIDE_FROM", 2)
        monkeypatch.setattr(select_module, "_CHUNK_BYTES", 1)
    if method == "radix_int64_keys":  # torch < 2.8: scatter_add_ takes no int32 index
        monkeypatch.setattr(select_module, "_FLOAT32_KEYS", torch.int64)
    for _ in range(5):
        if by == "count":
            target = torch.tensor(gen.integers(1, 1001, size=5), dtype=torch.float64)
        else:
            fraction = torch.tensor(gen.random(5), dtype=torch.float64)
            target = fraction * values.double().sum(-1)
        # "share": the same mass targets, as fractions of the row's mass.
        got = select(values, fraction if by == "share" else target, by)
        amount = "count" if by == "count" else "mass"
        for r in range(values.shape[0]):
            row = values[r].double().numpy()
            want = reference_threshold(row, float(target[r]), amount)
            # Masses are summed in a different order than numpy's: accept either neighbour
            # only when the target sits within rounding of a cumulative mass.
            near = amount == "mass" and _near_boundary(row, target[r])
            assert float(got[r]) == want or near


def _near_boundary(row: np.ndarray, target: torch.Tensor) -> bool:
    ranked = np.sort(row)[::-1]
    return bool(np.min(np.abs(np.cumsum(ranked) - float(target))) < 1e-6 * ranked.sum())


def test_int32_keys_only_on_cpu(monkeypatch):
    """int32 radix keys were measured on CPU only; other devices keep int64 keys."""
    monkeypatch.setattr(select_module, "_FLOAT32_KEYS", torch.int32)
    assert select_module.key_dtype(torch.float32, torch.device("cpu")) == torch.int32
    assert select_module.key_dtype(torch.float32, torch.device("cuda")) == torch.int64
    assert select_module.key_dtype(torch.float64, torch.device("cpu")) == torch.int64
    monkeypatch.setattr(select_module, "_FLOAT32_KEYS", torch.int64)  # torch < 2.8
    assert select_module.key_dtype(torch.float32, torch.device("cpu")) == torch.int64


def test_wide_digits_on_a_long_row_match_sorting():
    """Rows of at least 32,768 entries take the two 16-bit rounds, in chunks of rows."""
    assert select_module._WIDE_FROM <= 40_000
    gen = torch.Generator().manual_seed(3)
    values = torch.rand(3, 40_000, generator=gen) ** 8  # many entries per top bucket
    values[1, ::7] = 0.25  # ties across the row, exactly at a bucket edge
    values[2] = torch.randint(0, 50, (40_000,), generator=gen) / 64.0
    for by, fraction in (("count", 0.01), ("count", 0.6), ("mass", 0.5), ("mass", 0.97)):
        total = 40_000.0 if by == "count" else values.double().sum(-1)
        target = torch.full((3,), fraction, dtype=torch.float64) * total
        got = descending_threshold(values, target, by)
        for r in range(3):
            row = values[r].double().numpy()
            want = reference_threshold(row, float(target[r]), by)
            assert float(got[r]) == want or (by == "mass" and _near_boundary(row, target[r]))


@pytest.mark.parametrize("wide", [False, True, "sorted"])
def test_threshold_keeps_ties_and_survives_garbage(wide, monkeypatch):
    if wide != "sorted":  # rows of 6: sorted unless the radix is asked for
        monkeypatch.setattr(select_module, "_SORT_BELOW", 0)
    if wide is True:
        monkeypatch.setattr(select_module, "_WIDE_FROM", 2)
    values = torch.tensor(
        [
            [0.5, 0.25, 0.5, 0.5, 0.125, 0.0],
            [math.nan, 1.0, -2.0, math.inf, 0, 1],
            [1.0, -3.0, -math.nan, -math.inf, -0.0, 2.0],  # negative patterns, odd and even
        ]
    )
    for dtype in (torch.float32, torch.float64):
        # Row 0: the 2nd largest is 0.5 (all three 0.5s are >= it); the three reach mass 1.2.
        for by, amount in (("count", 2.0), ("mass", 1.2)):
            target = torch.full((3,), amount, dtype=torch.float64)
            got = descending_threshold(values.to(dtype), target, by)
            assert got.shape == (3,)  # the garbage rows give some value, never an error
            assert got[0] == 0.5


@pytest.mark.parametrize("vocab", [1000, 40_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_empty_batch(vocab, dtype):
    for by in ("count", "mass", "share"):
        empty = torch.zeros(0, vocab, dtype=dtype)
        got = descending_threshold(empty, torch.zeros(0, dtype=torch.float64), by)
        assert got.shape == (0,) and got.dtype == dtype


@pytest.mark.parametrize("keys", [None, torch.int64])
@pytest.mark.parametrize("rounds", ["short", "wide", "sorted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_negative_zero_counts_as_zero(rounds, dtype, keys, monkeypatch):
    """``-0.0`` weights (probabilities may hold them) are zeros, in odd and even columns and
    in every round: a set sign bit makes a negative key, which must never count as a weight
    (with int32 keys it wraps around in round 2, with int64 keys it does not)."""
    if rounds != "sorted":  # rows of 300: sorted unless the radix is asked for
        monkeypatch.setattr(select_module, "_SORT_BELOW", 0)
    if rounds == "wide":
        monkeypatch.setattr(select_module, "_WIDE_FROM", 2)
    if keys is not None:
        monkeypatch.setattr(select_module, "_FLOAT32_KEYS", keys)
    gen = torch.Generator().manual_seed(5)
    values = torch.rand(4, 300, generator=gen, dtype=torch.float64) ** 2
    values[:, 100:] = 0.0
    values[0, 100::2] = -0.0
    values[1, 101::2] = -0.0
    values[2, 100:] = -0.0
    values[3, :] = -0.0
    values = values.to(dtype)
    for count in (1.0, 50.0, 100.0, 101.0, 250.0, 300.0):
        target = torch.full((4,), count, dtype=torch.float64)
        got = descending_threshold(values, target, "count")
        for r in range(4):
            row = (values[r].double() + 0.0).numpy()  # + 0.0: -0.0 -> 0.0
            assert float(got[r]) == reference_threshold(row, count, "count"), (r, count)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_top_entries_orders_ties_by_index_across_blocks(dtype):
    gen = torch.Generator().manual_seed(3)
    values = torch.randint(0, 5, (6, 2000), generator=gen).float()
    values[1, ::3] = -math.inf
    values[2] = 7.0  # every entry tied
    values[4] -= 4.0  # negative values
    values[5] = torch.where(torch.rand(2000, generator=gen) < 0.5, -0.0, 0.0)  # equal zeros
    values = values.to(dtype)
    got_values, got_ids = top_entries(values, 300)
    for r in range(6):
        row = values[r].double().numpy()
        order = np.lexsort((np.arange(2000), -row))[:300]
        assert got_ids[r].tolist() == order.tolist()
        assert torch.equal(got_values[r], values[r, order])
    values = values.float()
    large_values, large_ids = largest_entries(values, 300)
    assert torch.equal(large_values, got_values)  # same multiset of values, sorted
    assert torch.equal(values.gather(1, large_ids), large_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [2999, 4096, 20_000])
def test_candidates_from_the_reaching_entries_are_the_fixed_shape_ones(vocab, dtype, monkeypatch):
    """``candidate_entries(host=True)`` (CPU eager: the entries reaching the smallest candidate
    block maximum, data-dependent shapes) gives the fixed-shape way's values, sorted, and
    ids and positions that hold them; ties, NaN and sparse rows fall back to the fixed way."""
    gen = torch.Generator().manual_seed(vocab)
    calls = []
    reaching = select_module._entries_reaching

    def spy(*args):
        found = reaching(*args)
        calls.append(found is not None)
        return found

    monkeypatch.setattr(select_module, "_entries_reaching", spy)
    continuous = torch.randn(8, vocab, generator=gen) * torch.tensor([3.0, 1, 0.3, 10] * 2)[:, None]
    continuous[5, ::2] = -math.inf  # masked, with enough finite blocks
    ties = torch.randint(-2, 3, (2, vocab), generator=gen).float()
    nan = continuous[:2].clone()
    nan[1, 7] = math.nan
    sparse = torch.full((1, vocab), -math.inf)
    sparse[0, [3, vocab // 2]] = 1.0  # fewer finite blocks than candidates: the floor is -inf
    # With each case, the largest num the reaching entries serve (sparse: one finite block).
    cases = [(continuous, 11), (ties, 0), (nan, 0), (sparse, 1)]
    for (values, engaged), num in itertools.product(cases, (1, 9, 11)):
        values = values.to(dtype)
        calls.clear()
        fast = candidate_entries(values, num, host=True)
        fixed = candidate_entries(values, num)
        assert calls == [num <= engaged], (values, num)
        finite = ~values.isnan().any(-1)
        assert torch.equal(fast.values[finite], fixed.values[finite])
        assert torch.equal(values.gather(1, fast.ids)[finite], fast.values[finite])
        assert torch.equal(fast.content.gather(1, fast.positions)[finite], fast.values[finite])
        assert torch.equal(fast.blocks, fixed.blocks)


@pytest.mark.parametrize("vocab", [256, 512, 1000, 1024, 4096])
def test_first_argmax_is_the_first_maximal_index(vocab):
    """Whole-block and short-block layouts, contiguous or not, ties within and across blocks."""
    gen = torch.Generator().manual_seed(vocab)
    values = torch.randint(-3, 3, (12, vocab), generator=gen).float()
    values[1] = -math.inf
    values[2, 7::300] = math.inf
    values[3, vocab - 1] = 9.0  # the very last entry
    for x in (values, values.t().contiguous().t()):  # the second is not contiguous
        want = values.numpy().argmax(-1)  # numpy also returns the first maximal index
        assert first_argmax(x).tolist() == want.tolist()
    values[4, 3] = math.nan
    assert 0 <= first_argmax(values)[4] < vocab


def test_first_argmax_and_short_vocabularies():
    values = torch.tensor([[1.0, 5.0, 5.0], [2.0, 0.0, 2.0], [math.nan, 1.0, 0.0]])
    assert first_argmax(values).tolist() == [1, 0, 0]
    wide = torch.zeros(2, 1000)
    wide[0, 999] = 1
    wide[1, 513] = wide[1, 700] = 3
    assert first_argmax(wide).tolist() == [999, 513]
    assert top_entries(torch.tensor([[3.0]]), 1)[1].tolist() == [[0]]


def test_short_rows_are_sorted_not_given_a_radix_table(monkeypatch):
    """Rows shorter than ``_SORT_BELOW`` take the sort: no ``(B, 2**11 + 128)`` table."""
    assert select_module._SORT_BELOW <= 1 << 11
    calls = []
    monkeypatch.setattr(select_module, "key_scratch", lambda *a: calls.append(a))
    values = torch.rand(50, 8, generator=torch.Generator().manual_seed(4))
    got = descending_threshold(values, torch.full((50,), 3.0, dtype=torch.float64), "count")
    assert not calls
    assert torch.equal(got, values.sort(-1, descending=True).values[:, 2])
