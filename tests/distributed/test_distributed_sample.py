"""fastsample.distributed.sample (:mod:`fastsample.distributed.sampling`) on 2 and 4 gloo
processes over loopback (127.0.0.1), against one-process :func:`fastsample.sample`:

* bitwise equality with ``fastsample.sample`` under the same seeds on block-aligned shards
  (every control, several draws, greedy, three dtypes, the ``seed=None`` path), ranks in a
  scrambled order;
* uneven shards (one holding a single token): every rank returns the same result, greedy and
  validity are the single-process ones, drawn probabilities are those of ``process``;
* greedy ties across shards (lowest global id), invalid rows (bad on one shard = invalid
  everywhere), a vocabulary large enough for coarse slots;
* the benchmark and the README's standalone script.

The scenarios and the process group are in tests/distributed_helpers.py.
"""

from __future__ import annotations

import math
import os

import torch

import fastsample as fs
from distributed_helpers import (
    BITWISE_SETTINGS,
    GROUP_TIMEOUT,
    SEEDS,
    bitwise_cases,
    bitwise_input,
    invalid_input,
    mixed_logits,
    results,
    same,
    ties_input,
    uneven_input,
)


def test_bitwise_equal_to_one_process_on_aligned_shards(group):
    """Block-aligned shards (in scrambled rank order): every output bitwise equal to
    fastsample.sample on the full vocabulary with the same seeds, on every rank."""
    got = results(group, "bitwise")
    for case in bitwise_cases():
        name, source, dtype, n = case
        x, ctl = bitwise_input(source, dtype)
        want = fs.sample(
            **{source: x}, num_samples=n, seed=SEEDS, step=11, **BITWISE_SETTINGS[name](ctl)
        )
        for rank, per_rank in enumerate(got):
            assert same(per_rank[case], want), f"{case} rank {rank}"
    x, ctl = bitwise_input("logits", "float32")
    want = fs.sample(x, seed=SEEDS, stream=7)
    for per_rank in got:
        assert same(per_rank["stream"], want)
    torch.manual_seed(1000)  # rank 0's generator state
    want = fs.sample(x, num_samples=2, **ctl)
    for per_rank in got:
        assert same(per_rank["generator"], want)


def test_uneven_shards_agree_and_match_one_process(group):
    got = results(group, "uneven")
    x, ctl = uneven_input()
    for name in got[0]:
        for per_rank in got[1:]:
            assert same(per_rank[name], got[0][name]), name
    out = got[0]["tensor"]
    want = fs.sample(x, seed=SEEDS[:40], step=2, **ctl)
    greedy = ctl["temperature"] == 0
    assert torch.equal(out.valid, want.valid)
    assert torch.equal(out.token_ids[greedy], want.token_ids[greedy])
    assert greedy[5] and out.token_ids[5, 0] == 20
    processed = fs.process(x, **ctl)
    for name, kwargs in (("tensor", ctl), ("tensor n=3", ctl)):
        out = got[0][name]
        processed = fs.process(x, **kwargs)
        kept = processed.gather(1, out.token_ids)
        first = kept[:, 0]
        assert (first[out.valid] > 0).all(), name
        torch.testing.assert_close(out.probs[:, 0][out.valid], first[out.valid], rtol=1e-5, atol=0)
    scalar = got[0]["scalar"]
    processed = fs.process(x, temperature=0.9, top_k=7, top_p=0.8)
    assert scalar.valid.all() and (processed.gather(1, scalar.token_ids) > 0).all()
    probs_out = got[0]["probs"]
    processed = fs.process(probs=x.softmax(-1), top_k=9, min_p=0.02)
    torch.testing.assert_close(probs_out.probs, processed.gather(1, probs_out.token_ids))


def test_greedy_ties_go_to_the_lowest_global_id(group):
    got = results(group, "greedy_ties")
    x = ties_input()
    for name in got[0]:
        for per_rank in got[1:]:
            assert same(per_rank[name], got[0][name]), name
    assert got[0]["n=1"].token_ids[:, 0].tolist() == [3, 21, 0, 0]
    assert got[0]["n=3"].token_ids[2].tolist() == [0, 1, 2]
    assert got[0]["n=3"].token_ids[3].tolist() == [0, 12, 30]
    for name, kwargs in (
        ("n=1", dict(temperature=0.0)),
        ("n=3", dict(temperature=0.0, num_samples=3)),
        ("mixed n=1", dict(temperature=torch.tensor([0.0, 0.0, 1.0, 0.0]), seed=1)),
        ("mixed n=3", dict(temperature=torch.tensor([0.0, 0.0, 1.0, 0.0]), seed=1, num_samples=3)),
    ):
        want = fs.sample(x, **kwargs)
        greedy = torch.tensor([True, True, "mixed" not in name, True])
        assert torch.equal(got[0][name].token_ids[greedy], want.token_ids[greedy]), name
        assert torch.equal(got[0][name].valid, want.valid), name


def test_rows_invalid_on_any_shard_are_invalid_everywhere(group):
    world, _ = group
    got = results(group, "invalid")
    x, probs, ctl = invalid_input(world)
    for name in ("logits", "probs"):
        for per_rank in got[1:]:
            assert same(per_rank[name], got[0][name]), name
    logits_out = got[0]["logits"]
    # Row 4 keeps a single token: valid for one draw, not for two.
    assert logits_out.valid.tolist() == [True, False, False, False, False, True, True, False]
    assert logits_out.token_ids[1].tolist() == [0, 1]
    assert logits_out.probs[1:4].eq(0).all() and logits_out.logprobs[1:4].eq(-math.inf).all()
    want = fs.sample(x, num_samples=2, **ctl)
    assert torch.equal(logits_out.valid, want.valid)
    probs_out = got[0]["probs"]
    want = fs.sample(probs=probs.nan_to_num(0.0), **ctl)
    assert torch.equal(probs_out.valid, want.valid)
    assert probs_out.valid.tolist() == [True, False, False, False, True, False, False, False]


def test_large_vocabulary_uses_coarse_slots(group):
    got = results(group, "large_vocab")
    assert all(r["widest"] <= 1024 for r in got)
    for per_rank in got[1:]:
        assert same(per_rank["out"], got[0]["out"])
    x = mixed_logits(300_000, 4, seed=12)
    out = got[0]["out"]
    processed = fs.process(x, temperature=0.8)
    assert out.valid.all()
    torch.testing.assert_close(out.probs, processed.gather(1, out.token_ids))


def runtime_problems(per_rank: list[dict]) -> list[str]:
    """Scenarios over their share of the group's time: the whole run must leave half of
    ``GROUP_TIMEOUT`` spare (a group killed at the timeout never reaches this check)."""
    problems = []
    for rank, got in enumerate(per_rank):
        times = {k: v for k, v in got.items() if k.endswith(" seconds")}
        if sum(times.values()) > GROUP_TIMEOUT / 2:
            problems.append(f"rank {rank}: {sum(times.values()):.0f} s in all: {times}")
    return problems


def test_scenario_runtimes_are_recorded(group):
    """Per-scenario seconds on every rank (shown with -rA), the total bounded well below the
    timeout that kills the group."""
    world, per_rank = group
    times = {k: round(v, 2) for k, v in per_rank[0].items() if k.endswith("seconds")}
    print(f"world {world}: {times}")
    assert not runtime_problems(per_rank)
    slow = [{"exact seconds": GROUP_TIMEOUT / 4, "joint seconds": GROUP_TIMEOUT / 3}]
    assert runtime_problems(slow)  # the check can fail: a slow but finished run


def test_bench_distributed_runs(tmp_path, capsys):
    """``python -m fastsample bench --distributed 2`` on a tiny case: every row, the ratio and
    the bytes (the real figures are in BENCHMARKS.md)."""
    import json

    from fastsample.__main__ import main

    path = tmp_path / "dist.json"
    argv = ["bench", "--distributed", "2", "--batch", "4", "--vocab", "3000", "--repeats", "2"]
    assert main([*argv, "--warmup", "0", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    rows = {(r["setting"], r["contender"]): r for r in doc["results"]}
    assert len(rows) == 3 * len(doc["settings"]["controls"])
    for (_, contender), row in rows.items():
        assert row["median_ms"] > 0
        if contender == "fs.distributed":
            assert row["speedup_vs_gather"] > 0 and row["collectives"] >= 1
            assert 0 < row["payload_bytes"] <= 4 * 1024 * 8 * row["collectives"]
    assert "vs gather" in capsys.readouterr().out


def test_readme_script_runs(tmp_path):
    """The README's standalone 2-process script runs as a user would run it."""
    import pathlib
    import re
    import subprocess
    import sys

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    scripts = [b for b in blocks if b.startswith("# not run here: a standalone script")]
    assert len(scripts) == 1
    path = tmp_path / "vocab_parallel.py"
    path.write_text(scripts[0])
    src = pathlib.Path(fs.__file__).resolve().parents[1]  # src/, above the fastsample package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The two processes print concurrently: their lines may interleave.
    found = dict(re.findall(r"rank (\d): (tokens \[[^\]]*\])", done.stdout))
    assert sorted(found) == ["0", "1"] and found["0"] == found["1"], done.stdout
