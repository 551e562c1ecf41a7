"""``python -m fastsample bench --generate`` runs end to end (on tiny models here) and reports
every contender with its acceptance."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("transformers")

from fastsample.tools.bench import cli
from fastsample.tools.bench import generate as bench
from fastsample.tools.bench.harness import Timing


def test_generate_mode_is_chosen_by_its_option():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.chosen_module(parser.parse_args(["--generate"])) == "generate"


def test_generate_bench_measures_every_contender():
    setup = bench.Setup(vocab=256, hidden=32, layers=2, prompt=6, new_tokens=5,
                        embed_scale=10.0, head_scale=16.0, batches=(1, 3))
    rows = bench.measure(setup, torch.device("cpu"), Timing(0, 1, 1, 0.0))
    names = [r.contender for r in rows]
    assert names == ["hf.sample B=1", "fs.sample B=1", "hf.assisted B=1", "fs.speculative B=1",
                     "hf.sample B=3", "fs.sample B=3", "fs.speculative B=3"]
    for r in rows:
        assert r.tokens_per_s > 0 and r.tokens_per_pass > 0
        speculative = "assisted" in r.contender or "speculative" in r.contender
        assert (r.acceptance is not None) == speculative
        assert r.acceptance_estimated == ("assisted" in r.contender)
    bench.print_table(rows, setup)
