"""``python -m fastsample bench --samplers`` runs every contender and writes its rows."""

from __future__ import annotations

import importlib.util
import json

from fastsample.__main__ import main
from fastsample.tools.bench import samplers


def test_samplers_mode_times_every_stage_and_saves_json(tmp_path, capsys):
    path = tmp_path / "samplers.json"
    code = main(["bench", "--samplers", "--batch", "2", "--vocab", "3000", "--repeats", "2",
                 "--min-repeats", "1", "--budget", "0.01", "--warmup", "1", "--fresh", "2",
                 "--json", str(path)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    rows = json.loads(path.read_text())["results"]
    names = {row["contender"] for row in rows}
    assert {"step", "all", *samplers.STAGES} <= names
    if importlib.util.find_spec("llama_cpp") is not None:  # .ci/run installs it
        assert "llama.cpp" in names
    assert all(row["median_ms"] > 0 for row in rows)
    assert "vs step" in printed and "+dry" in printed
