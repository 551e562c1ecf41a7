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
from fastsample.tools import bench

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
    assert [r["contender"] for r in rows] == [c.name for c in bench.all_contenders()]
    for r in rows:
        assert (r["batch"], r["vocab"], r["dtype"]) == (2, 1000, "float32")
        assert r["error"] is None, r
        assert r["median_ms"] > 0 and r["min_ms"] > 0
        assert 3 <= r["repeats"] == len(r["times_ms"]) <= 5
        assert all(t > 0 for t in r["times_ms"])
        assert r["speedup_vs_multinomial"] > 0 and r["read_passes"] > 0
    by_name = {r["contender"]: r for r in rows}
    assert by_name[bench.READ_PASS]["read_passes"] == pytest.approx(1.0)
    assert by_name[bench.MULTINOMIAL]["speedup_vs_multinomial"] == pytest.approx(1.0)


def test_json_reports_memory_for_fastsample_rows_only(saved):
    measured = {c.name for c in bench.all_contenders() if c.measure_memory}
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


def test_last_level_cache_is_the_highest_level(monkeypatch, tmp_path):
    """The largest cache names what a read pass reads from (sysfs layout of Linux)."""
    caches = (("index0", 1, "48K"), ("index2", 2, "2048K"), ("index3", 3, "32768K"))
    for name, level, size in caches:
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(f"{level}\n")
        (tmp_path / name / "size").write_text(f"{size}\n")
    (tmp_path / "index9").mkdir()  # unreadable entries are skipped
    monkeypatch.setattr(bench.glob, "glob", lambda _: sorted(map(str, tmp_path.iterdir())))
    assert bench.last_level_cache() == "L3 32 MiB"
    monkeypatch.setattr(bench.glob, "glob", lambda _: [])
    assert bench.last_level_cache() is None


def test_cpu_memory_measurement_matches_known_allocations():
    # eager race: the noise and the quotient are each one input-sized float32 tensor; the
    # read pass allocates only its (B,) output, which is live at the end and not counted.
    case = bench.make_case(4, 4096, "float32", torch.device("cpu"))
    eager = bench.extra_memory_fraction(lambda: bench._eager_race(case.probs), case)
    read_pass = bench.extra_memory_fraction(lambda: case.probs.sum(-1), case)
    assert eager == pytest.approx(2.0, abs=0.05)
    assert read_pass == pytest.approx(0.0, abs=0.01)


def test_memory_measurement_failure_is_none_not_a_crash(monkeypatch):
    def broken(fn):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(bench, "_cpu_extra_bytes", broken)
    case = bench.make_case(2, 100, "float32", torch.device("cpu"))
    assert bench.extra_memory_fraction(lambda: case.probs.sum(-1), case) is None
    row = bench.Result(2, 100, "float32", "fs.race", "fastsample", 1.0, 1.0, 1)
    assert bench._fmt_mem(row, measured=True) == "n/a"


def test_peak_above_final():
    assert bench._peak_above_final([]) == 0
    assert bench._peak_above_final([100, 50, -100, 8, -50]) == 150 - 8


def test_table_lists_every_contender_with_ratios():
    out = io.StringIO()
    contenders = bench.all_contenders()
    timing = bench.Timing(warmup=0, min_repeats=1, max_repeats=2, budget_s=0.0)
    rows = bench.run_bench([(2, 300, "bfloat16")], torch.device("cpu"), timing, contenders, out=out)
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
    monkeypatch.setattr(bench, "GROUPS", dict(bench.GROUPS))
    bench.register_group(
        "extra",
        [
            bench.Contender("extra.argmax", lambda case: lambda: case.probs.argmax(-1), True),
            bench.Contender("extra.never", lambda case: None),  # does not apply: no row
        ],
    )
    with pytest.raises(ValueError, match="already registered"):
        bench.register_group("extra", [])
    with pytest.raises(ValueError, match="duplicate"):
        bench.register_group("clash", [bench.Contender("fs.race", lambda case: None)])
    contenders = bench.all_contenders(["extra.*"])
    assert [c.name for c in contenders] == [
        bench.READ_PASS,
        bench.MULTINOMIAL,
        "extra.argmax",
        "extra.never",
    ]
    timing = bench.Timing(warmup=0, min_repeats=1, max_repeats=1, budget_s=0.0)
    rows = bench.run_bench(
        [(2, 50, "float32")], torch.device("cpu"), timing, contenders, out=io.StringIO()
    )
    assert [(r.contender, r.group) for r in rows][-1] == ("extra.argmax", "extra")
    assert rows[-1].speedup_vs_multinomial > 0 and rows[-1].extra_mem_fraction is not None


def test_failing_contender_is_reported_not_fatal(monkeypatch):
    def boom(case):
        def call():
            raise RuntimeError("unsupported\nsecond line")

        return call

    monkeypatch.setattr(bench, "GROUPS", dict(bench.GROUPS))
    bench.register_group("broken", [bench.Contender("broken.boom", boom)])
    timing = bench.Timing(warmup=0, min_repeats=1, max_repeats=1, budget_s=0.0)
    out = io.StringIO()
    rows = bench.run_bench(
        [(2, 50, "float32")],
        torch.device("cpu"),
        timing,
        bench.all_contenders(["broken.*"]),
        out=out,
    )
    assert rows[-1].median_ms is None and rows[-1].error == "RuntimeError: unsupported"
    assert "broken.boom failed: RuntimeError: unsupported" in out.getvalue()


def test_case_grid_quick_full_and_restricted():
    def grid(*argv):
        return bench._case_grid(build_parser().parse_args(["bench", *argv]))

    assert grid("--quick") == list(bench.QUICK_CASES)
    assert len(grid()) == 4 * 3 * 2
    assert grid("--quick", "--batch", "1", "8", "--vocab", "32000", "--dtype", "bfloat16") == [
        (1, 32000, "bfloat16"),
        (8, 32000, "bfloat16"),
    ]


def test_input_is_seeded_softmax_in_dtype():
    a = bench.make_case(3, 500, "bfloat16", torch.device("cpu"), seed=1)
    b = bench.make_case(3, 500, "bfloat16", torch.device("cpu"), seed=1)
    assert a.probs.dtype == torch.bfloat16 and torch.equal(a.probs, b.probs)
    assert torch.allclose(a.probs.float().sum(-1), torch.ones(3), atol=0.02)


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


def test_warm_timing_precedes_each_timed_call_by_the_same_contender():
    """With ``warm_s``, every timed call of a contender directly follows an untimed call of
    the same contender (its steady state), whatever ran before."""
    log: list[str] = []
    calls = {name: (lambda name=name: log.append(name)) for name in ("a", "b")}
    timing = bench.Timing(warmup=0, min_repeats=3, max_repeats=3, budget_s=0.0)
    times = bench.time_interleaved(calls, torch.device("cpu"), timing, warm_s=1e-9)
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3}
    # Rounds of (untimed a, timed a, untimed b, timed b): no call follows the other contender
    # without an untimed call of its own first.
    assert log == ["a", "a", "b", "b"] * 3
    log.clear()
    bench.time_interleaved(calls, torch.device("cpu"), timing)
    assert log == ["a", "b"] * 3
