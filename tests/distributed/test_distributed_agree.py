"""``check=True`` (:mod:`fastsample.distributed.agree`): bad or disagreeing arguments raise
the same ``ValueError`` on every rank, and a checked call returns what an unchecked one does.
"""

from __future__ import annotations

from distributed_helpers import results


def test_check_raises_the_same_error_on_every_rank(group):
    world, _ = group
    got = results(group, "check")
    expected = {
        "batch": "ranks disagree on the batch size B",
        "vocab_size": "ranks disagree on vocab_size",
        "overlap": "the shards overlap",
        "gap": "",  # a gap or a short cover, depending on which shard shrank
        "top_k": "ranks disagree on top_k",
        "seed": "ranks disagree on seed/step/stream",
        "nan": f"rank {world - 1}: logits row 2 contains NaN",
        "all masked": "logits row 4 is -inf on every rank",
        "type": "rank 0: vocab_start must be a Python int",
    }
    for name, text in expected.items():
        messages = [per_rank[name] for per_rank in got]
        assert messages[0] is not None, name
        assert all(m == messages[0] for m in messages), (name, messages)
        assert text in messages[0], (name, messages[0])
    assert "gap" in got[0]["gap"] or "cover" in got[0]["gap"]
    assert all(per_rank["checked equals unchecked"] for per_rank in got)
