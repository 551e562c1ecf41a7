"""The history stages' building blocks (:mod:`fastsample.stages.history`) against brute force:
per-token maxima and counts (:func:`_per_token`) and match lengths (:func:`match_lengths`).
The stages' laws and the peers' agreement are in test_chain_law.py and test_chain_peers.py."""

from __future__ import annotations

import pytest
import torch

from fastsample.stages.history import _per_token, match_lengths


def _brute_per_token(ids: list[int], values: list[int]) -> tuple[list[int], list[int]]:
    largest, count = [], []
    for token in ids:
        same = [v for t, v in zip(ids, values, strict=True) if t == token]
        largest.append(max(same) if token >= 0 else -1)
        count.append(len(same) if token >= 0 else 0)
    return largest, count


def test_per_token_maxima_and_counts_match_brute_force():
    gen = torch.Generator().manual_seed(3)
    for width, vocab in ((1, 3), (7, 4), (64, 10), (300, 50)):
        ids = torch.randint(-1, vocab, (5, width), generator=gen)
        values = torch.randint(-1, width + 1, (5, width), generator=gen)
        largest, count = _per_token(ids, values)
        for b in range(5):
            want = _brute_per_token(ids[b].tolist(), values[b].tolist())
            assert largest[b].tolist() == want[0]
            assert count[b].tolist() == want[1]


def test_match_lengths_match_brute_force():
    gen = torch.Generator().manual_seed(4)
    hist = torch.randint(-1, 3, (6, 40), generator=gen)
    hist[0] = torch.tensor([1, 2] * 20)  # matches that run to the start
    limit = torch.tensor([40, 5, 0, 2, 40, 1])
    got = match_lengths(hist, limit)
    for b in range(6):
        row = hist[b].tolist()
        for c in range(40):
            m = 0
            while (m < limit[b] and c - 1 - m >= 0 and row[c - 1 - m] == row[39 - m]
                   and row[39 - m] >= 0):  # fmt: skip
                m += 1
            assert got[b, c].item() == m, (b, c)


def test_history_stages_compile_fullgraph():
    """No host sync: a step with DRY (breakers), no-repeat n-grams and windowed penalties
    traces whole under ``torch.compile(fullgraph=True)`` and draws the eager step's tokens."""
    import fastsample as fs

    vocab = 40
    stats = fs.TokenStats.from_prompts([[1, 2, 3, 1, 2], [4, 4, 4], [5, 6, 5, 6, 5]], vocab,
                                       history=16)  # fmt: skip
    params = fs.StepParams(3, vocab, dry_multiplier=0.8, dry_allowed_length=1,
                           dry_sequence_breakers=[[[3]], [], [[6, 5]]], no_repeat_ngram_size=2,
                           penalty_last_n=4, repetition_penalty=1.2,
                           seed=torch.arange(3))  # fmt: skip
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))

    def step(x):
        return fs.sample_step(x, params=params, state=stats, step=1).token_ids

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(logits), step(logits))


@pytest.mark.parametrize("per_row", [False, True])
def test_the_eager_edits_of_the_changed_entries_equal_every_entrys(per_row):
    """On CPU in eager mode DRY and the n-gram ban compute and scatter only the entries they
    change; traced (every entry, as on the GPU) the staged logits are bitwise the same, with
    settings as numbers and as per-row tensors (one row off), on contexts built to repeat."""
    import fastsample as fs
    from fastsample.stages import staged_logits

    vocab, batch = 50, 4
    gen = torch.Generator().manual_seed(3)
    phrase = torch.randint(0, vocab, (batch, 6), generator=gen)
    prompts = torch.cat((phrase, torch.randint(0, vocab, (batch, 9), generator=gen), phrase,
                         phrase[:, :3]), dim=1)  # fmt: skip
    stats = fs.TokenStats.from_prompts(prompts, vocab, history=32)
    if per_row:
        settings = dict(dry_multiplier=torch.tensor([0.8, 0.0, 1.5, 0.3]),
                        dry_base=torch.tensor([1.75, 2.0, 1.1, 3.0]),
                        dry_allowed_length=torch.tensor([2, 1, 0, 3]),
                        no_repeat_ngram_size=torch.tensor([3, 0, 2, 4]))  # fmt: skip
    else:
        settings = dict(dry_multiplier=0.8, dry_allowed_length=1, no_repeat_ngram_size=3)
    params = fs.StepParams(batch, vocab, dry_sequence_breakers=[[], [[7]], [], [[1, 2]]],
                           **settings)  # fmt: skip
    logits = torch.randn(batch, vocab, generator=gen)

    def edit(x):
        return staged_logits(x, params=params, state=stats)

    eager = edit(logits)
    traced = torch.compile(edit, fullgraph=True, backend="eager")(logits)
    assert torch.equal(eager, traced)
    assert (eager != logits).sum() >= batch  # the stages acted


def test_the_histories_width_past_the_contexts_changes_nothing():
    """Padding before every row's context (a history wider than the contexts, dropped on CPU)
    leaves DRY (breakers included), the n-gram ban and the windowed penalties as they are."""
    import fastsample as fs
    from fastsample.stages import staged_logits

    vocab = 30
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [6, 7, 8, 9, 6, 7, 8]]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
    params = fs.StepParams(3, vocab, dry_multiplier=0.8, dry_allowed_length=1,
                           dry_sequence_breakers=[[], [[5, 4]], [[9]]], no_repeat_ngram_size=3,
                           penalty_last_n=-1, repetition_penalty=1.3,
                           frequency_penalty=0.2)  # fmt: skip
    edited = [staged_logits(logits, params=params,
                            state=fs.TokenStats.from_prompts(prompts, vocab, history=width))
              for width in (8, 64)]  # fmt: skip
    assert torch.equal(edited[0], edited[1])
    assert not torch.equal(edited[0], logits)


@pytest.mark.parametrize("width", [1, 40, 128, 129, 300])
def test_window_counts_by_pairs_equal_the_sorts(width):
    """A window's per-entry token counts: the all-pairs compare (narrow windows) and the sort
    (wide ones) give the same counts, padding (-1) counting 0."""
    from fastsample.stages.history import _counts, _per_token

    gen = torch.Generator().manual_seed(width)
    ids = torch.randint(0, 12, (5, width), generator=gen)
    ids[0, : width // 2] = -1  # a row whose context starts late
    ids[3] = -1  # an empty row
    want = _per_token(ids, torch.zeros_like(ids))[1]
    assert torch.equal(_counts(ids), want)
    assert width < 3 or want.max() > 1  # repeats to count


def test_lowering_skips_padding_entries_even_when_marked():
    """A padding (-1) entry marked as changed writes nothing: on CPU its flat index would
    land in the row before (here the last token of the last row)."""
    from fastsample.stages.history import _lower_

    x = torch.zeros(2, 5)
    ids = torch.tensor([[-1, 2], [1, 3]])
    _lower_(x, ids, torch.ones(2, 2, dtype=torch.bool),
            lambda pick, current: torch.full_like(current, -1.0))  # fmt: skip
    want = torch.zeros(2, 5)
    want[0, 2] = want[1, 1] = want[1, 3] = -1.0
    assert torch.equal(x, want)
