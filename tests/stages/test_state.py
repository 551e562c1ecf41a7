"""TokenStats: the penalties' per-request state.

Built from prompts, updated with emitted tokens (``-1`` ignored, duplicates counted, counts
capped at their type), kept equal to a rebuild from scratch, reordered, appended, assigned in
place; its memory per request as the README states; the update compiles with
``fullgraph=True`` (no host sync, fixed shapes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
from fastsample.ops import bitmask


def seen_ids(stats: fs.TokenStats) -> list[list[int]]:
    bits = bitmask.unpack(stats.seen_mask, stats.vocab)
    return [torch.nonzero(row)[:, 0].tolist() for row in bits]


def test_from_prompts_sets_the_prompt_bits_and_nothing_else():
    stats = fs.TokenStats.from_prompts([[5, 6, 6, 69], [], [0, 31, 32, 63, 64]], vocab=70)
    want = [[5, 6, 69], [], [0, 31, 32, 63, 64]]  # word edges and the partial last word
    assert seen_ids(stats) == want
    assert torch.equal(stats.prompt_mask, stats.seen_mask)
    assert stats.output_counts.dtype == torch.int16 and not stats.output_counts.any()
    assert stats.output_len.tolist() == [0, 0, 0]
    tensor_form = fs.TokenStats.from_prompts(torch.tensor([[5, 6, 6, 69, -1], [-1] * 5,
                                                           [0, 31, 32, 63, 64]]), vocab=70)
    assert torch.equal(tensor_form.prompt_mask, stats.prompt_mask)


@pytest.mark.parametrize(("largest", "dtype"), [(255, torch.uint8), (256, torch.int16),
                                                 (32767, torch.int16), (32768, torch.int32)])
def test_counts_take_the_narrowest_exact_type(largest, dtype):
    stats = fs.TokenStats.empty(2, 10, max_output_tokens=largest)
    assert stats.output_counts.dtype == dtype


def test_memory_per_request_at_a_llama3_vocabulary():
    """The README's figures: two 16,032-byte masks, the counts, the length."""
    for largest, per_count in ((255, 1), (32767, 2), (100_000, 4)):
        stats = fs.TokenStats.empty(1, 128_256, max_output_tokens=largest)
        assert stats.bytes_per_request == 2 * 16_032 + per_count * 128_256 + 8
        assert stats.bytes_per_request == sum(
            t.element_size() * t.numel()
            for t in (stats.prompt_mask, stats.seen_mask, stats.output_counts, stats.output_len)
        )


def test_update_counts_duplicates_ignores_padding_and_matches_a_rebuild():
    vocab = 70
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in (0, 5, 12)]
    stats = fs.TokenStats.from_prompts(prompts, vocab)
    emitted: list[list[int]] = [[], [], []]
    for step in range(6):
        ids = torch.from_numpy(rng.integers(-1, vocab, size=(3, 1 + step % 3)))
        ids[0, 0] = 64 if step == 2 else ids[0, 0]  # the partial last word
        stats.update(ids)
        for b in range(3):
            emitted[b] += [int(t) for t in ids[b] if t >= 0]
    rebuilt = fs.TokenStats.from_prompts(prompts, vocab)
    for b in range(3):
        counts = np.bincount(emitted[b], minlength=vocab)
        assert stats.output_counts[b].tolist() == counts.tolist()
        assert stats.output_len[b] == len(emitted[b])
        assert seen_ids(stats)[b] == sorted(set(prompts[b]) | set(emitted[b]))
    rebuilt.update(torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(e, dtype=torch.int64) for e in emitted], batch_first=True, padding_value=-1))
    for name in ("prompt_mask", "seen_mask", "output_counts", "output_len"):
        assert torch.equal(getattr(rebuilt, name), getattr(stats, name)), name


def test_counts_stop_at_their_type():
    stats = fs.TokenStats.empty(1, 8, max_output_tokens=255)
    for _ in range(70):
        stats.update(torch.tensor([[3, 3, 3, 3]]))
    assert stats.output_counts[0, 3] == 255 and stats.output_counts.dtype == torch.uint8


def test_verification_tokens_with_padding_update_the_emitted_ones():
    stats = fs.TokenStats.from_prompts([[1], [2]], vocab=20)
    emitted = torch.tensor([[4, 4, 9, -1, -1], [7, -1, -1, -1, -1]])  # verify_chain's layout
    stats.update(emitted)
    assert stats.output_len.tolist() == [3, 1]
    assert stats.output_counts[0, 4] == 2 and stats.output_counts[0, 9] == 1
    assert seen_ids(stats) == [[1, 4, 9], [2, 7]]


def test_rows_follow_the_batch():
    stats = fs.TokenStats.from_prompts([[1], [2], [3]], vocab=40, max_output_tokens=100)
    stats.update(torch.tensor([[5], [6], [7]]))
    picked = stats.select([2, 0])
    assert seen_ids(picked) == [[3, 7], [1, 5]]
    joined = fs.TokenStats.cat([picked, fs.TokenStats.from_prompts([[9]], vocab=40)])
    assert joined.batch == 3 and joined.output_counts.dtype == torch.int16
    assert seen_ids(joined) == [[3, 7], [1, 5], [9]]
    joined.assign([0], fs.TokenStats.from_prompts([[33]], vocab=40, max_output_tokens=10))
    assert seen_ids(joined) == [[33], [1, 5], [9]] and joined.output_len.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="wider type"):
        picked.assign([0], fs.TokenStats.empty(1, 40, max_output_tokens=10**6))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="max_output_tokens"):
        fs.TokenStats.empty(1, 10, max_output_tokens=-1)
    with pytest.raises(TypeError, match=r"prompts\[0\] must hold Python ints"):
        fs.TokenStats.from_prompts([[1.5]], vocab=10)
    stats = fs.TokenStats.empty(2, 10)
    with pytest.raises(ValueError, match="token_ids has 1 rows, the stats 2"):
        stats.update(torch.tensor([[1]]))


def test_update_compiles_without_graph_breaks():
    stats = fs.TokenStats.from_prompts([[1, 2], [3]], vocab=50)
    twin = fs.TokenStats.from_prompts([[1, 2], [3]], vocab=50)
    step = torch.compile(lambda ids: stats.update(ids), fullgraph=True)
    for ids in (torch.tensor([[4, -1], [3, 3]]), torch.tensor([[49, 4], [-1, -1]])):
        step(ids)
        twin.update(ids)
    for name in ("seen_mask", "output_counts", "output_len"):
        assert torch.equal(getattr(stats, name), getattr(twin, name)), name


def _position_sets(stats: fs.TokenStats) -> list[set[int]]:
    rows: list[set[int]] = [set() for _ in range(stats.batch)]
    for row, column in stats.seen_positions():
        assert row.shape[0] < 32768  # every chunk under the grain
        for b, c in zip(row.tolist(), column.tolist(), strict=True):
            assert c not in rows[b]  # each seen token once
            rows[b].add(c)
    return rows


def test_kept_seen_positions_follow_the_updates():
    """The positions the sparse penalties visit, kept step by step (new tokens only, each
    once: a token twice in one step, padding, tokens the prompt had), equal a fresh scan of
    the mask, across chunks of the grain; assign drops them (found again), and penalties
    with them equal the dense formula bitwise. Negative control: an update that skips the
    positions leaves them stale, and the comparison sees it."""
    from fastsample.stages import penalties

    gen = torch.Generator().manual_seed(12)
    batch, vocab = 70, 5003  # a partial last word; 70 rows x ~500 tokens: several chunks
    prompts = torch.randint(0, vocab, (batch, 400), generator=gen)
    stats = fs.TokenStats.from_prompts(prompts, vocab)
    assert len(stats.seen_positions()) >= 1
    for step in range(120):
        width = 1 if step % 3 else 3
        tokens = torch.randint(-1, vocab, (batch, width), generator=gen)
        if width == 3:
            tokens[:, 1] = tokens[:, 0]  # a token twice in a step
        tokens[:, 0] = torch.where(torch.rand(batch, generator=gen) < 0.3, prompts[:, 0],
                                   tokens[:, 0])  # fmt: skip
        stats.update(tokens)
    assert len(stats.seen_positions()) >= 2
    assert _position_sets(stats) == [set(row) for row in seen_ids(stats)]
    x = torch.randn(batch, vocab, generator=gen) * 3
    rep, freq = torch.rand(batch, generator=gen) + 0.5, torch.randn(batch, generator=gen)
    kept = penalties.apply_(x.clone(), stats, rep, freq, 0.3)
    dense = penalties._dense_(x.clone(), stats, rep, freq, 0.3, torch.arange(batch), None)
    assert torch.equal(kept, dense)
    stats.assign([4], fs.TokenStats.from_prompts([[1, 2]], vocab))
    assert stats._positions is None
    assert _position_sets(stats)[4] == {1, 2}

    stale = fs.TokenStats.from_prompts(prompts[:4], vocab)
    stale.seen_positions()
    stale._add_newly_seen = lambda *args: None  # the planted bug
    stale.update(torch.full((4, 1), vocab - 2))
    assert _position_sets(stale) != [set(row) for row in seen_ids(stale)]
