"""The benchmark's shared harness: inputs, interleaved timing, memory measuring, machine
info; and the layering of ``fastsample.tools`` (no import cycles, modes below the CLI)."""

from __future__ import annotations

import argparse
import ast
import pathlib

import pytest
import torch

from fastsample.tools.bench import cli, harness, probs, report

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "src" / "fastsample" / "tools"


def test_last_level_cache_is_the_highest_level(monkeypatch, tmp_path):
    """The largest cache names what a read pass reads from (sysfs layout of Linux)."""
    caches = (("index0", 1, "48K"), ("index2", 2, "2048K"), ("index3", 3, "32768K"))
    for name, level, size in caches:
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(f"{level}\n")
        (tmp_path / name / "size").write_text(f"{size}\n")
    (tmp_path / "index9").mkdir()  # unreadable entries are skipped
    monkeypatch.setattr(report.glob, "glob", lambda _: sorted(map(str, tmp_path.iterdir())))
    assert report.last_level_cache() == "L3 32 MiB"
    monkeypatch.setattr(report.glob, "glob", lambda _: [])
    assert report.last_level_cache() is None


def test_cpu_memory_measurement_matches_known_allocations():
    # eager race: the noise and the quotient are each one input-sized float32 tensor; the
    # read pass allocates only its (B,) output, which is live at the end and not counted.
    case = harness.make_case(4, 4096, "float32", torch.device("cpu"))
    eager = harness.extra_memory_fraction(lambda: probs.eager_race(case.probs), case.probs)
    read_pass = harness.extra_memory_fraction(lambda: case.probs.sum(-1), case.probs)
    assert eager == pytest.approx(2.0, abs=0.05)
    assert read_pass == pytest.approx(0.0, abs=0.01)


def test_memory_measurement_failure_is_none_not_a_crash(monkeypatch):
    def broken(fn):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(harness, "_cpu_extra_bytes", broken)
    case = harness.make_case(2, 100, "float32", torch.device("cpu"))
    assert harness.extra_memory_fraction(lambda: case.probs.sum(-1), case.probs) is None
    row = harness.Result(2, 100, "float32", "fs.race", "fastsample", 1.0, 1.0, 1)
    assert report._fmt_mem(row, measured=True) == "n/a"


def test_peak_above_final():
    assert harness._peak_above_final([]) == 0
    assert harness._peak_above_final([100, 50, -100, 8, -50]) == 150 - 8


def test_input_is_seeded_softmax_in_dtype():
    a = harness.make_case(3, 500, "bfloat16", torch.device("cpu"), seed=1)
    b = harness.make_case(3, 500, "bfloat16", torch.device("cpu"), seed=1)
    assert a.probs.dtype == torch.bfloat16 and torch.equal(a.probs, b.probs)
    assert torch.allclose(a.probs.float().sum(-1), torch.ones(3), atol=0.02)


def test_warm_timing_precedes_each_timed_call_by_the_same_contender():
    """With ``warm_s``, every timed call of a contender directly follows an untimed call of
    the same contender (its steady state), whatever ran before."""
    log: list[str] = []
    calls = {name: (lambda name=name: log.append(name)) for name in ("a", "b")}
    timing = harness.Timing(warmup=0, min_repeats=3, max_repeats=3, budget_s=0.0)
    times = harness.time_interleaved(calls, torch.device("cpu"), timing, warm_s=1e-9)
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3}
    # Rounds of (untimed a, timed a, untimed b, timed b): no call follows the other contender
    # without an untimed call of its own first.
    assert log == ["a", "a", "b", "b"] * 3
    log.clear()
    harness.time_interleaved(calls, torch.device("cpu"), timing)
    assert log == ["a", "b"] * 3


def _module_name(path: pathlib.Path) -> str:
    parts = ("fastsample", "tools", *path.relative_to(TOOLS).with_suffix("").parts)
    return ".".join(parts).removesuffix(".__init__")


def _imports(path: pathlib.Path) -> set[str]:
    """The fastsample.tools names ``path`` imports anywhere: at module level or inside a
    function (a lazy import closes a cycle as surely as an eager one)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            root = ".".join([*base, node.module] if node.module else base)
            if not node.level:
                root = node.module or ""
            names = [root, *(f"{root}.{a.name}" for a in node.names)]
        found |= {n for n in names if n.startswith("fastsample.tools") and n != module}
    return found


def test_tools_import_graph_has_no_cycle():
    """``from . import x`` counts as importing the package (whose ``__init__`` runs), so a
    mode reaching back into ``bench`` shows up as a cycle here."""
    graph = {_module_name(p): _imports(p) for p in TOOLS.rglob("*.py")}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*trail, node, dep]))
            if dep not in state:
                visit(dep, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert graph["fastsample.tools.bench.harness"] == set()  # the bottom layer
    assert graph["fastsample.tools.bench.report"] == {"fastsample.tools.bench.harness"}


def test_modes_are_chosen_by_their_option_default_probs():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)

    def chosen(*argv):
        return cli.chosen_module(parser.parse_args(list(argv)))

    assert chosen() == "probs" and chosen("--quick") == "probs"
    assert chosen("--controls") == "controls"
    assert chosen("--verify", "--controls") == "verify"
    assert chosen("--distributed", "2") == "distributed"
    assert chosen("--distributed", "0") == "distributed"  # run, and refused there
    for mode in cli.MODES:
        assert (TOOLS / "bench" / f"{mode.module}.py").exists(), mode
