"""The power of the suite's law tests, computed and demonstrated.

1. Every law test's sample size against its claim: each module of tests/ that judges a law
   registers its laws (``law_cases()``, :class:`stattests.LawCase`); for each,
   ``stattests.detectable_bias`` (the smallest relative bias on about 10% of the mass that
   the test detects with probability 0.99, at its false-alarm rate of 1e-6) is at most the
   claim, and the claim meets the target (2% at V <= 1,000, 5% below 32k, 10% at V >= 32k)
   unless the case names the full-power test that carries its law (``carried_by``).
2. Broken copies of the sampler, run through the suite's own procedures at the sizes the
   real tests use, are rejected: +10% on half the vocabulary, even-index tokens x1.5, an
   off-by-one index. (Half the tail rate: ``test_exactness.test_tail_mass_inverse_cdf``
   judges a half-rate count of the same draws, and ``test_tail_window_rejects_half_and_
   double_the_rate`` computes that window's power.)
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import test_exactness
from stattests import (
    LawCase,
    detectable_bias,
    half_biased,
    law_rejected,
    parity_biased,
    target_bias,
)
from test_exactness import CASES, case_row, drawn_as, sampler, single_draw_counts

TESTS = Path(__file__).parent
# The law functions of stattests, and the helpers' functions that call them: a module calling
# any of these judges a law (test_helpers_judging_functions_are_known keeps the list whole).
JUDGING_FUNCTIONS = {
    "assert_law",
    "law_rejected",
    "law_test",
    "assert_laws",  # verify_helpers
    "laws_rejected",  # verify_helpers
    "assert_drawn_laws",  # verify_helpers
    "drawn_laws_rejected",  # verify_helpers
}
_JUDGES = re.compile(r"\b(" + "|".join(sorted(JUDGING_FUNCTIONS)) + r")\(")
# Modules that call the law functions without judging a law of their own: the toolkit, this
# module, and the helpers whose procedures the registered test modules call.
HELPERS = {"verify_helpers", "distributed_helpers"}
_NOT_JUDGES = {"stattests", "test_power", *HELPERS}


def judging_modules() -> list[Path]:
    """The test modules that judge a law: every file of tests/ calling a law function."""
    return sorted(
        path
        for path in TESTS.rglob("*.py")
        if path.stem not in _NOT_JUDGES and _JUDGES.search(path.read_text())
    )


def load(path: Path):
    """The module of ``path`` as pytest imports it (by its base name, its folder on the path),
    or None where it cannot import here (a module skipped as a whole, e.g. without triton)."""
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    try:
        return importlib.import_module(path.stem)
    except pytest.skip.Exception:
        return None


def registered() -> list[LawCase]:
    cases = []
    for path in judging_modules():
        module = load(path)
        if module is not None and hasattr(module, "law_cases"):
            cases += [replace(c, name=f"{path.stem}: {c.name}") for c in module.law_cases()]
    return cases


LAW_CASES = registered()


def test_every_law_test_is_registered():
    """Each module that judges a law registers its laws (``law_cases``) with their sizes."""
    modules = {path.stem: load(path) for path in judging_modules()}
    unregistered = {n for n, m in modules.items() if m is not None and not hasattr(m, "law_cases")}
    assert not unregistered, f"judge a law but register none: {sorted(unregistered)}"
    names = [c.name for c in LAW_CASES]
    assert len(names) == len(set(names)), "two registered law cases share a name"


def test_helpers_judging_functions_are_known():
    """A helper function that calls a law function is itself one (else its callers would
    escape the registry)."""
    for name in HELPERS:
        tree = ast.parse((TESTS / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _JUDGES.search(ast.unparse(node)):
                assert node.name in JUDGING_FUNCTIONS, f"{name}.{node.name} judges a law"


@pytest.mark.parametrize("case", LAW_CASES, ids=[c.name for c in LAW_CASES])
def test_each_law_test_detects_its_claimed_bias(case):
    law = case.probs()
    delta, worst = detectable_bias(law, case.draws)
    print(f"{case.name}: {case.draws} draws detect {delta:.4f} ({worst})")
    assert delta <= case.claim, f"{case.name}: {case.draws} draws detect only {delta:.3f} ({worst})"
    if not case.carried_by:
        target = target_bias(len(law))
        assert case.claim <= target, f"{case.name}: claims {case.claim}, target {target}"


# ----------------------------------------------------------------------------- broken copies


def broken(real, kind: str):
    """A broken copy of a sampler: the weights it sees or the ids it returns altered."""

    def draw(batch: torch.Tensor) -> torch.Tensor:
        if kind == "off_by_one":
            return (real(batch) + 1) % batch.shape[1]
        law = batch[0].double().cpu().numpy()
        wrong = half_biased(law) if kind == "half" else parity_biased(law)
        wrong = torch.tensor(wrong, dtype=batch.dtype, device=batch.device)
        return real(wrong.expand_as(batch))

    return draw


# (broken copy, case of test_exactness): each at the size of that case's real test.
BROKEN = [("half", 5), ("even", 5), ("off_by_one", 4)]


@pytest.mark.parametrize("kind,case", BROKEN, ids=[f"{k}-V{CASES[c][1]}" for k, c in BROKEN])
def test_broken_copies_fail_the_single_draw_law_test(kind, case):
    kind_, vocab, dtype, draws = CASES[case]
    row = case_row(kind_, vocab, dtype)
    gen = torch.Generator(test_exactness.DEVICE).manual_seed(123)
    counts = single_draw_counts(broken(sampler("inverse_cdf", gen), kind), drawn_as(row), draws)
    assert law_rejected(counts, row.double().numpy())
