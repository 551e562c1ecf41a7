"""The verify package as a whole: empty batches, and the verification benchmark."""

from __future__ import annotations

import torch

import fastsample as fs


def test_empty_batch():
    p = torch.rand(0, 3, 10)
    x = torch.zeros(0, 2, dtype=torch.int64)
    for q in (None, p[:, :2]):
        out = fs.verify_chain(p, x, q, seed=torch.zeros(0, dtype=torch.int64))
        assert out.token_ids.shape == (0, 3) and out.valid.shape == (0,)
        tree = fs.TokenTree(torch.zeros(0, 3, dtype=torch.int64), [-1, 0, 0])
        assert fs.verify_tree(p, tree, q if q is None else p).token_ids.shape == (0, 3)


def test_bench_verify_runs_and_saves_json(tmp_path, capsys):
    import json

    from fastsample.__main__ import main

    path = tmp_path / "verify.json"
    args = ["bench", "--verify", "--device", "cpu", "--batch", "2", "--vocab", "300"]
    fast = ["--warmup", "1", "--min-repeats", "2", "--repeats", "2", "--budget", "0.01"]
    assert main([*args, *fast, "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["results"]
    names = [r["contender"] for r in rows]
    assert names[:3] == ["read_pass", "gather", "reference"] and "fs.verify_chain" in names
    assert all(r["median_ms"] > 0 and r["speedup_vs_reference"] > 0 for r in rows)
    assert "fs.verify_tree b" in capsys.readouterr().out
    from fastsample.tools.bench.verify import make_case, reference_verify

    case = make_case(3, 2, 50, "float32", torch.device("cpu"))
    accepted, token = reference_verify(case.target, case.draft, case.tokens)
    assert accepted.shape == (3,) and token.shape == (3, 1)
