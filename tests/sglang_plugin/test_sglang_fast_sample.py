"""``fast_sample`` inside SGLang's own call site, with the plugin hooked.

SGLang's EAGLE draft proposal (``spec_utils.sample_draft_proposal``) draws with the module's
``fast_sample``; with ``SGLANG_PLUGINS=fastsample`` that name is the plugin's
(:func:`fastsample.sglang.sampler.fastsample_fast_sample`), keyed on (seed, position, draft
step). The child process (fast_sample_child.py) loads SGLang's plugins as every SGLang process
does and calls SGLang's function; the law of its proposals is tested here against
``softmax(logits / T)`` in float64, with the untempered softmax as the negative control at the
same size. SGLang's own seeded ``fast_sample`` fails on CPU tensors (its hash is a Triton GPU
kernel): the child records how.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sglang_helpers import HAVE_SGLANG, SKIP_REASON

from stattests import LawCase, assert_law, draws_needed, law_rejected

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)

CHILD = Path(__file__).with_name("fast_sample_child.py")
LOGITS = np.array([2.0, 1.2, 0.7, 0.6, 0.0, -0.3, -1.0, -1.1, -2.0, -2.5, 0.3, 1.0])
TEMPERATURE = 0.7
CLAIM = 0.05


def law(temperature: float = TEMPERATURE) -> np.ndarray:
    w = np.exp((LOGITS - LOGITS.max()) / temperature)
    return w / w.sum()


DRAWS = draws_needed(law(), CLAIM)


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    calls = tmp_path_factory.mktemp("fast-sample") / "calls.txt"
    env = {**os.environ, "SGLANG_PLUGINS": "fastsample", "FASTSAMPLE_SGLANG_CALLS": str(calls)}
    run = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(LOGITS.tolist()), str(TEMPERATURE), str(DRAWS)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    from fastsample.sglang import read_calls

    return {**json.loads(run.stdout.strip().splitlines()[-1]), "calls": read_calls(calls)}


def test_sglang_calls_the_plugins_fast_sample(child):
    """Three proposal calls in the child (one batch, the same shuffled, another draft step),
    each through the plugin; SGLang's own function, saved before the hooks, is called once
    directly and is not counted."""
    assert child["calls"]["fast_sample"] == 3
    assert child["exact_q"] and child["q_x_matches"]


def test_the_proposals_law_and_its_negative_control(child):
    """Detects a bias of 5% of the probability mass (BIAS_MASS sets) with probability 0.99 at
    this size; the untempered softmax is rejected at the same size."""
    counts = np.array(child["counts"])
    assert counts.sum() == DRAWS
    assert_law(counts, law(), what="fast_sample in sample_draft_proposal")
    assert law_rejected(counts, law(1.0))


def test_seeded_proposals_do_not_depend_on_the_batch(child):
    """The same (seed, position, draft step) rows in a shuffled batch propose the same tokens;
    another draft step is another stream (agreeing only as two independent draws would)."""
    assert child["invariant"]
    collide = float((law() ** 2).sum())
    assert abs(child["same_as_other_step"] - collide) < 0.05


def test_sglangs_own_seeded_fast_sample_does_not_run_on_cpu(child):
    """Why the plugin's replacement matters on CPU (if SGLang's starts running here, this test
    says so and the README's note is to be revised)."""
    assert child["sglang_own"] != "ran"


def law_cases():
    yield LawCase(
        "SGLang sample_draft_proposal via fastsample, V=12", law(), DRAWS, CLAIM,
        carried_by="tests/test_exactness.py::test_fast_sample_joint_law_matches_multinomial_law "
        "(fs.fast_sample's law at 2%); here: that SGLang's call site reaches it, keyed",
    )  # fmt: skip
