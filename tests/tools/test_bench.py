"""``python -m fastsample bench`` end to end on a tiny grid: table, JSON, plot, registry."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from fastsample.__main__ import build_parser, main
from fastsample.tools.bench import harness, probs

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
TINY = ["bench", "--device", "cpu", "--batch", "2", "--vocab", "1000", "--dtype", "float32"]
FAST = ["--warmup", "1", "--min-repeats", "3", "--repeats", "5", "--budget", "0.01"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main([*TINY, *FAST, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_json_has_a_timed_row_for_every_contender(saved):
    rows = saved["results"]
    assert [r["contender"] for r in rows] == [c.name for c in probs.all_contenders()]
    for r in rows:
        assert (r["batch"], r["vocab"], r["dtype"]) == (2, 1000, "float32")
        assert r["error"] is None, r
        assert r["median_ms"] > 0 and r["min_ms"] > 0
        assert 3 <= r["repeats"] == len(r["times_ms"]) <= 5
        assert all(t > 0 for t in r["times_ms"])
        assert r["speedup_vs_multinomial"] > 0 and r["read_passes"] > 0
    # Every row's ratios are its median against the baselines' medians (a ratio taken the
    # wrong way round, or against another statistic, fails here, also on the baselines).
    by_name = {r["contender"]: r for r in rows}
    multinomial = by_name[probs.MULTINOMIAL]["median_ms"]
    read_pass = by_name[probs.READ_PASS]["median_ms"]
    for r in rows:
        assert r["speedup_vs_multinomial"] == pytest.approx(multinomial / r["median_ms"])
        assert r["read_passes"] == pytest.approx(r["median_ms"] / read_pass)
    assert by_name[probs.MULTINOMIAL]["times_ms"] != by_name[probs.READ_PASS]["times_ms"]


def test_json_reports_memory_for_fastsample_rows_only(saved):
    measured = {c.name for c in probs.all_contenders() if c.measure_memory}
    assert measured == {
        "fs.inverse_cdf",
        "fs.race",
        "fs.auto",
        "fs.fast_sample",
        "fs.inverse_cdf+seed",
        "fs.race+seed",
    }
    for r in saved["results"]:
        if r["contender"] in measured:
            assert r["extra_mem_fraction"] is not None and r["extra_mem_fraction"] >= 0
        else:
            assert r["extra_mem_fraction"] is None


def test_json_has_machine_info(saved):
    machine = saved["machine"]
    for key in ("torch", "device", "device_name", "cpu_model", "torch_threads", "date"):
        assert machine[key], key
    assert machine["torch"] == torch.__version__
    assert saved["settings"]["grid"] == [[2, 1000, "float32"]]


def test_table_lists_every_contender_with_ratios():
    out = io.StringIO()
    contenders = probs.all_contenders()
    timing = harness.Timing(warmup=0, min_repeats=1, max_repeats=2, budget_s=0.0)
    rows = probs.run_bench([(2, 300, "bfloat16")], torch.device("cpu"), timing, contenders, out=out)
    text = out.getvalue()
    assert "vs multinomial" in text and "read passes" in text
    lines = [line.split() for line in text.splitlines()]
    for c in contenders:
        assert ["B=2", "V=300", "bfloat16", c.name] in [line[:4] for line in lines], c.name
    assert len(rows) == len(contenders)
    assert text.count("%") == sum(c.measure_memory for c in contenders)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    json_path, png = tmp_path / "b.json", tmp_path / "b.png"
    with pytest.raises(SystemExit, match=r"pip install \"fastsample\[plot\]\""):
        main([*TINY, *FAST, "--json", str(json_path), "--plot", str(png)])
    assert not png.exists() and not json_path.exists()  # failed before benchmarking


def test_plot_with_matplotlib_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    assert main([*TINY, *FAST, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_registered_group_adds_rows(monkeypatch):
    monkeypatch.setattr(probs, "GROUPS", dict(probs.GROUPS))
    probs.register_group(
        "extra",
        [
            harness.Contender("extra.argmax", lambda case: lambda: case.probs.argmax(-1), True),
            harness.Contender("extra.never", lambda case: None),  # does not apply: no row
        ],
    )
    with pytest.raises(ValueError, match="already registered"):
        probs.register_group("extra", [])
    with pytest.raises(ValueError, match="duplicate"):
        probs.register_group("clash", [harness.Contender("fs.race", lambda case: None)])
    contenders = probs.all_contenders(["extra.*"])
    assert [c.name for c in contenders] == [
        probs.READ_PASS,
        probs.MULTINOMIAL,
        "extra.argmax",
        "extra.never",
    ]
    timing = harness.Timing(warmup=0, min_repeats=1, max_repeats=1, budget_s=0.0)
    rows = probs.run_bench(
        [(2, 50, "float32")], torch.device("cpu"), timing, contenders, out=io.StringIO()
    )
    assert [(r.contender, r.group) for r in rows][-1] == ("extra.argmax", "extra")
    assert rows[-1].speedup_vs_multinomial > 0 and rows[-1].extra_mem_fraction is not None


def test_failing_contender_is_reported_not_fatal(monkeypatch):
    def boom(case):
        def call():
            raise RuntimeError("unsupported\nsecond line")

        return call

    monkeypatch.setattr(probs, "GROUPS", dict(probs.GROUPS))
    probs.register_group("broken", [harness.Contender("broken.boom", boom)])
    timing = harness.Timing(warmup=0, min_repeats=1, max_repeats=1, budget_s=0.0)
    out = io.StringIO()
    rows = probs.run_bench(
        [(2, 50, "float32")],
        torch.device("cpu"),
        timing,
        probs.all_contenders(["broken.*"]),
        out=out,
    )
    assert rows[-1].median_ms is None and rows[-1].error == "RuntimeError: unsupported"
    assert "broken.boom failed: RuntimeError: unsupported" in out.getvalue()


def test_case_grid_quick_full_and_restricted():
    def grid(*argv):
        return probs.case_grid(build_parser().parse_args(["bench", *argv]))

    assert grid("--quick") == list(probs.QUICK_CASES)
    assert len(grid()) == 4 * 3 * 2
    assert grid("--quick", "--batch", "1", "8", "--vocab", "32000", "--dtype", "bfloat16") == [
        (1, 32000, "bfloat16"),
        (8, 32000, "bfloat16"),
    ]


def test_main_needs_a_command():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"]])
def test_python_m_fastsample_help(argv):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "fastsample", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "bench" in done.stdout
    if argv[0] == "bench":
        assert "--quick" in done.stdout and "read pass" in done.stdout


def test_engine_timing_puts_each_timed_call_after_one_of_its_own():
    """bench --engine vllm: a contender's timed call never directly follows another
    contender's call (with the rotation alone the light plugin was timed right after vLLM's
    sampler in two rounds of three), and every call gets a fresh copy of the logits."""
    from fastsample.tools.bench.engine import time_cold, time_fresh

    log: list[tuple[str, int]] = []
    base = torch.zeros(2, 3)

    def contender(name: str):
        def call(x: torch.Tensor) -> None:
            assert x is not base and torch.equal(x, base)
            x.add_(1)  # edits its input in place, as vLLM's sampler does
            log.append((name, len(log)))
        return call

    calls = {name: contender(name) for name in ("vllm", "plugin", "step")}
    timing = harness.Timing(warmup=1, min_repeats=4, max_repeats=4, budget_s=0.0)
    times = time_fresh(calls, base, timing)
    assert all(len(t) == 4 for t in times.values())
    steady = log[3:]  # after the warm-up calls
    assert len(steady) == 2 * 3 * 4
    pairs = [steady[i : i + 2] for i in range(0, len(steady), 2)]
    assert all(first[0] == second[0] for first, second in pairs)
    assert {first[0] for first, _ in pairs} == set(calls)
    log.clear()
    workload_at: list[int] = []
    cold = time_cold(calls, base, lambda: workload_at.append(len(log)), rounds=2)
    assert set(cold) == set(calls)
    # each timed call: right after the workload, which follows an untimed call of its own
    assert [log[i][0] for i in workload_at] == [n for n in calls for _ in range(2)]
    assert all(log[i - 1][0] == log[i][0] for i in workload_at)
