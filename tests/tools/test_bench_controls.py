"""``python -m fastsample bench --controls``: every setting runs, ratios are computed, and
the contenders (the HF-style reference pipeline, our vLLM and SGLang re-implementations)
sample the laws their projects define."""

from __future__ import annotations

import json

import numpy as np
import torch

from fastsample.__main__ import main
from fastsample.tools.bench import controls as bench_controls
from reference import reference_probs
from stattests import LawCase, assert_law
from torch_threads import one_thread


def test_controls_bench_runs_every_setting(tmp_path, capsys):
    path = tmp_path / "controls.json"
    argv = [
        "bench",
        "--controls",
        "--batch",
        "3",
        "--vocab",
        "700",
        "--repeats",
        "2",
        "--min-repeats",
        "1",
        "--warmup",
        "0",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    doc = json.loads(path.read_text())
    settings = {r["setting"] for r in doc["results"]}
    assert settings == set(bench_controls.SETTINGS)
    for r in doc["results"]:
        assert r["median_ms"] > 0
        if r["contender"].startswith("fs"):
            assert r["speedup_vs_hf"] > 0 and r["read_passes"] > 0
    assert "vs hf" in capsys.readouterr().out
    step = bench_controls.STEP_SETTING
    step_rows = {r["contender"] for r in doc["results"] if r["setting"] == step}
    assert {"fs.step", "fs.step+pen+lp", "fs.step+pen+lp.raw"} <= step_rows


def test_cold_calls_are_timed_after_each_workload(tmp_path, capsys):
    """``--cold``: every fastsample row has its median right after the matmul and after the
    sort pipeline, and each workload ran before every timed cold call."""
    ran = {"matmul": 0, "sort": 0}
    real = bench_controls.cold_workloads

    def counted(batch, vocab, device):
        workloads = real(batch, vocab, device)
        return {
            name: (lambda name=name, w=w: (ran.__setitem__(name, ran[name] + 1), w())[1])
            for name, w in workloads.items()
        }

    bench_controls.cold_workloads, path = counted, tmp_path / "cold.json"
    try:
        argv = ["bench", "--controls", "--cold", "--batch", "2", "--vocab", "700",
                "--setting", "k=50", "--contender", "fs", "--repeats", "2",
                "--min-repeats", "1", "--warmup", "0", "--json", str(path)]  # fmt: skip
        assert main(argv) == 0
    finally:
        bench_controls.cold_workloads = real
    rows = {r["contender"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["fs"]["after_matmul_ms"] > 0 and rows["fs"]["after_sort_ms"] > 0
    assert rows["fs"]["cold"] > 0 and rows["hf"]["cold"] is None  # fastsample's rows only
    assert ran == {"matmul": bench_controls.COLD_ROUNDS, "sort": bench_controls.COLD_ROUNDS}
    assert "matmul ms" in capsys.readouterr().out


def test_fresh_logits_cycle_through_the_pool():
    """``--fresh N``: every contender's calls take the pool's tensors in turn."""
    pool = [torch.randn(2, 700) for _ in range(3)]
    calls = bench_controls.setting_calls(bench_controls.STEP_SETTING, pool[0], False, pool=pool)
    seen = []
    real = torch.Tensor.sum

    def spy(self, *args, **kwargs):
        seen.append(self.data_ptr())
        return real(self, *args, **kwargs)

    torch.Tensor.sum = spy  # the read pass's call
    try:
        for _ in range(4):
            calls["read_pass"]()
    finally:
        torch.Tensor.sum = real
    assert seen == [t.data_ptr() for t in (*pool, pool[0])]
    for name in ("fs.step", "fs.step+pen+lp", "fs.step+pen+lp.raw"):
        out = calls[name]()
        assert out.token_ids.shape == (2, 1) and bool(out.valid.all())


# The contenders' laws are judged as sanity checks: a contender drawing a slightly wrong law
# would time the same, so these tests guard the benchmark's fairness, not the library's law.
CONTENDER_DRAWS = 200_000  # 10 calls of 20,000 rows
CONTENDER_CLAIM = 0.075  # the bias on 10% of the mass these draws detect (worst: 0.071)
NOT_THE_LIBRARY = (
    "a benchmark contender, not the library: our re-implementation of a peer's pipeline, "
    "checked for the law it publishes (a slightly wrong law would time the same); the "
    "library's law: tests/test_controls.py::test_sample_frequencies_match_reference"
)
# (sampler, controls, cuts for the reference or None for min-p). vLLM keeps the reference's
# set (top-k, then top-p on the survivors); SGLang takes top-p on the full distribution,
# the reference's law without a top-k. Each law keeps 2-5 of the 12 tokens.
PEER_CASES = (
    ("vllm", {"temperature": 0.7, "top_k": 8, "top_p": 0.96}, (8, 0.96)),
    ("vllm", {"top_k": 5}, (5, 1.0)),
    ("vllm", {"min_p": 0.1}, None),
    ("sglang", {"temperature": 1.3, "top_p": 0.7}, (0, 0.7)),
    ("sglang", {"top_k": 4, "min_p": 0.2}, None),
)
PEERS = {"vllm": bench_controls.vllm_sample, "sglang": bench_controls.sglang_sample}
HF_CONTROLS = {"temperature": 0.7, "top_k": 8, "top_p": 0.96}


def contender_logits(dtype: torch.dtype) -> torch.Tensor:
    """One row of 12 logits (4 of them within the top-p cuts below)."""
    return torch.randn(1, 12, generator=torch.Generator().manual_seed(0), dtype=dtype) * 2


def peer_law(controls: dict, cuts) -> np.ndarray:
    x = contender_logits(torch.float32)[0].double().numpy()
    t = controls.get("temperature", 1.0)
    if cuts is not None:
        return reference_probs(x, t, *cuts)
    # min-p (after top-k): keep p >= min_p * max p of the survivors
    want = reference_probs(x, t, controls.get("top_k", 0))
    want = np.where(want >= controls["min_p"] * want.max(), want, 0.0)
    return want / want.sum()


def hf_law() -> np.ndarray:
    x = contender_logits(torch.float64)[0].numpy()
    return reference_probs(x, *(HF_CONTROLS[c] for c in ("temperature", "top_k", "top_p")))


def contender_counts(sampler, logits: torch.Tensor, controls: dict) -> np.ndarray:
    """Token counts of CONTENDER_DRAWS single draws, on one thread (small-op chains stall in
    torch's parallel regions on a busy machine: fastsample.ops.threads)."""
    torch.manual_seed(1)
    calls = CONTENDER_DRAWS // 20_000
    with one_thread(logits.device):
        ids = torch.cat([sampler(logits.expand(20_000, -1), controls) for _ in range(calls)])
    return np.bincount(ids.reshape(-1).long().numpy(), minlength=logits.shape[1])


def test_hf_pipeline_samples_the_documented_law():
    """The baseline is a faithful HF pipeline: its top-k + top-p law is the reference's
    (HF keeps the smallest set whose mass exceeds top_p: the same set for untied rows)."""
    logits = contender_logits(torch.float64)
    counts = contender_counts(bench_controls.hf_pipeline, logits, HF_CONTROLS)
    assert_law(counts, hf_law(), what="hf pipeline")


def test_peer_samplers_sample_their_published_law():
    for peer, controls, cuts in PEER_CASES:
        counts = contender_counts(PEERS[peer], contender_logits(torch.float32), controls)
        assert_law(counts, peer_law(controls, cuts), what=f"{peer} {controls}")


def test_busy_loops_run_beside_the_block_and_stop_after_it():
    from fastsample.tools.bench.busy import busy_loops

    with busy_loops(2, limit_s=30) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    with busy_loops(1, limit_s=0.01) as procs:  # bounded by itself as well
        procs[0].wait(timeout=10)


def law_cases():
    """The contenders' laws (tests/test_power.py checks the claim; the target is the
    library's, carried by test_controls)."""
    yield LawCase("hf pipeline V=12", hf_law, CONTENDER_DRAWS, CONTENDER_CLAIM, NOT_THE_LIBRARY)
    for peer, controls, cuts in PEER_CASES:
        law = peer_law(controls, cuts)
        yield LawCase(
            f"{peer} {controls} V=12", law, CONTENDER_DRAWS, CONTENDER_CLAIM, NOT_THE_LIBRARY
        )
