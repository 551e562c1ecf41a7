"""The package layout of docs/architecture.md holds: layers import only downwards, nothing
imports in a circle, no module outgrows a page, and the optional extras stay optional."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "fastsample"

# Lower rank = lower layer. A module may import its own rank or below, never above.
RANKS = {
    "ops": 0,
    "kernels": 1,
    "sampling": 2,
    "controls": 2,
    "stages": 2,
    "verify": 3,
    "distributed": 3,
    "hf": 4,
    "vllm": 4,
    "sglang": 4,
    "tools": 5,
}
TOP = 6  # fastsample/__init__.py and __main__.py
MAX_LINES = 620  # "no module over ~600 lines"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every fastsample module ``name`` imports, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # "from . import x" imports the submodule x when there is one.
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem
                       for a in node.names]
        found.update(t for t in targets if t in known and t != name)
    return found


def rank(name: str) -> int:
    parts = name.split(".")
    return RANKS.get(parts[1], TOP) if len(parts) > 1 else TOP


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_imports_only_point_down_the_layers():
    upward = [
        f"{a} (layer {rank(a)}) imports {b} (layer {rank(b)})"
        for a, targets in graph().items()
        for b in targets
        if rank(b) > rank(a)
    ]
    assert not upward, "\n".join(upward)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycle():
    # A package's __init__ re-exporting its own submodules is not a cycle of meaning, but a
    # submodule importing its package's __init__ back is: drop only the package -> child edges.
    edges = {
        a: {b for b in targets if not b.startswith(a + ".")} for a, targets in graph().items()
    }
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle or [])


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_upward_import_is_detected(tmp_path):
    # The rule above is only as good as the import resolution: a relative import out of ops/
    # into sampling must be seen.
    fake = PACKAGE / "ops" / "race.py"
    got = imports_of("fastsample.ops.race", fake, set(modules()))
    assert "fastsample.ops.noise" in got
    probe = tmp_path / "probe.py"
    probe.write_text("from ..sampling import SampleOutput\n")
    assert imports_of("fastsample.ops.probe", probe, set(modules())) == {"fastsample.sampling"}


def test_no_module_over_a_page():
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_module_says_what_it_is():
    bare = [name for name, path in modules().items()
            if path.read_text().strip() and ast.get_docstring(ast.parse(path.read_text())) is None]
    assert not bare, f"modules without a docstring: {bare}"


@pytest.mark.parametrize("extra", ["triton", "transformers"])
def test_import_fastsample_leaves_the_optional_extras_alone(extra):
    code = f"import sys, fastsample; print({extra!r} in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "False"
