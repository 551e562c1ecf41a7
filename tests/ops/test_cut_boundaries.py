"""The cuts on their boundaries: exact processed probabilities, on every path that takes them.

The documented keep rule is ``>=`` everywhere: top-k keeps every weight ``>=`` the k-th largest
(ties at it all kept), top-p keeps every weight ``>= tau`` with ``tau`` the largest threshold
whose kept mass *reaches* ``top_p`` (``>=``), min-p keeps every weight ``>= min_p * max``. The
control tests place their cuts halfway between cumulative masses on purpose
(``reference.robust_top_p``), so a ``>`` for ``>=`` survives them. Here the controls sit exactly
on the boundaries: dyadic probabilities, whose weights ``p / max p`` (and, for float32 logits
``log p`` on CPU, ``exp(x - max x)``) are exact, make ``top_p`` equal to a cumulative mass and
``min_p * max`` equal to a weight, with no rounding anywhere. (float64 ``exp(log p)`` is off by
an ulp, so float64 rows are given as probabilities only.)

Paths: the radix selection of ``ops/select.py`` (the sorted short-row path, the narrow and the
wide radix digits, and the bisection used under ``torch.compile``), the general cuts of
``ops/cuts.py`` (Python and tensor controls, top-k before top-p, the candidate top-p of a small
Python ``top_k``), the min-p-only shortcut on logits, and the small-top-k path
(``ops/small_top_k.py``) with a controlled source.

Mutants these tests were run against (each planted by hand, each caught, then reverted):
``running > target`` in ``top_p_cut_from_candidates`` (the issue's; caught by
``test_issue_example_top_k_then_top_p`` and ``test_top_k_then_top_p``); ``>`` for ``>=`` in
``select._last_meeting`` (radix), ``mass <= target`` in ``select._sorted_threshold`` and ``q >
target`` in ``select._bisect_threshold`` (by ``test_thresholds_on_exact_boundaries`` and
``test_top_p_equal_to_a_cumulative_mass``); ``keep_at_least`` keeping ``w / cut > 1`` instead of
``>= 1`` (by every ``process`` test here); the min-p shortcut keeping ``w > min_p`` (by
``test_min_p_equal_to_a_weight``); the small-top-k path's keep rule (by
``test_small_top_k_path_on_the_boundaries``).
"""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
from fastsample.ops import select, small_top_k
from fastsample.ops.select import _bisect_threshold, descending_threshold
from fastsample.ops.validation import check_controls
from uniforms import ControlledUniforms

# Weights p / max p = 1, .5, .25, .25: cumulative shares .5, .75, .875, 1.
P = [0.5, 0.25, 0.125, 0.125]
# Cumulative shares .5, .75, .875, .9375, 1: the crossing entry has a smaller neighbour.
P_STEP = [0.5, 0.25, 0.125, 0.0625, 0.0625]
DTYPES = [torch.float32, torch.float64]
LOGITS = {torch.float32: (False, True), torch.float64: (False,)}  # exact weights from logits


@pytest.fixture(params=["sorted", "radix"])
def radix(request, monkeypatch):
    """The threshold selection of ``descending_threshold``: rows this short are sorted; the
    radix rounds are forced (their wide 16-bit digits, slow on many calls, are held to the
    same boundaries in ``test_thresholds_on_exact_boundaries``)."""
    if request.param != "sorted":
        monkeypatch.setattr(select, "_SORT_BELOW", 0)
    return request.param


def expected(p: list[float], kept: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``p`` restricted to ``kept`` and renormalized, one rounding per entry (dyadic sums)."""
    w = torch.tensor(p, dtype=torch.float64)
    mask = torch.zeros(len(p), dtype=torch.bool)
    mask[kept] = True
    w = torch.where(mask, w, 0.0).to(dtype)
    return (w / w.sum())[None, :]


def process_rows(p: list[float], dtype: torch.dtype, tensors: bool, logits: bool = False, **ctl):
    """``fs.process`` of one row, controls as Python numbers or as ``(1,)`` tensors."""
    x = torch.tensor([p], dtype=dtype)
    if tensors:
        ctl = {
            k: torch.tensor([v], dtype=torch.int64 if k == "top_k" else dtype)
            for k, v in ctl.items()
        }
    return fs.process(x.log(), **ctl) if logits else fs.process(probs=x, **ctl)


@pytest.mark.parametrize("method", ["sorted", "radix", "radix_wide", "bisect"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_thresholds_on_exact_boundaries(method, dtype, monkeypatch):
    """``descending_threshold`` with targets equal to a count or a cumulative mass: the
    threshold is the entry where the amount from the top first *reaches* the target."""
    if method != "sorted":
        monkeypatch.setattr(select, "_SORT_BELOW", 0)
    if method == "radix_wide":
        monkeypatch.setattr(select, "_WIDE_FROM", 2)
    pick = _bisect_threshold if method == "bisect" else descending_threshold
    values = torch.tensor([[0.25, 1.0, 0.0, 0.25, 0.5, 0.0]], dtype=dtype)  # mass 2
    cases = {
        "count": {1: 1.0, 2: 0.5, 3: 0.25, 4: 0.25, 5: 0.0},
        "mass": {1.0: 1.0, 1.5: 0.5, 1.75: 0.25, 2.0: 0.25},
        "share": {0.5: 1.0, 0.75: 0.5, 0.875: 0.25, 1.0: 0.25},
    }
    for by, table in cases.items():
        for target, want in table.items():
            got = pick(values, torch.tensor([float(target)], dtype=torch.float64), by)
            assert got.tolist() == [want], (by, target)


# (probabilities, top_p, kept ids): top_p equal to a cumulative share.
TOP_P_CASES = [
    (P, 0.5, [0]),
    (P, 0.75, [0, 1]),
    (P, 0.875, [0, 1, 2, 3]),  # reached at a tie: both .125 kept
    (P_STEP, 0.875, [0, 1, 2]),
    (P_STEP, 0.9375, [0, 1, 2, 3, 4]),
]


@pytest.mark.parametrize("tensors", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_p_equal_to_a_cumulative_mass(radix, dtype, tensors):
    for p, top_p, kept in TOP_P_CASES:
        got = process_rows(p, dtype, tensors, top_p=top_p)
        assert torch.equal(got, expected(p, kept, dtype)), (p, top_p)


def test_issue_example_top_k_then_top_p():
    """The issue's example, verbatim: top-k keeps all four (ties at .125), then top-p = .5 is
    reached by the first token alone."""
    got = fs.process(torch.tensor([0.5, 0.25, 0.125, 0.125]).log()[None], top_k=3, top_p=0.5)
    assert got.tolist() == [[1.0, 0.0, 0.0, 0.0]]


# Weights 1, .5, .5, .25, .25: top-k = 2 or 3 keeps the three largest (mass 2, ties at .5).
Q = [0.5, 0.25, 0.25, 0.125, 0.125]
TOP_K_TOP_P_CASES = [
    (P, 3, 0.5, [0]),  # the issue's example, on probabilities
    (P, 3, 0.75, [0, 1]),
    (Q, 3, 0.5, [0]),
    (Q, 2, 0.5, [0]),
    (Q, 3, 0.75, [0, 1, 2]),  # reached at the tie at .5
    (Q, 2, 1.0, [0, 1, 2]),  # top-p off: the top-k cut alone, ties kept
]


@pytest.mark.parametrize("top_p_tensor", [False, True])
@pytest.mark.parametrize("top_k_tensor", [False, True])  # False: the candidate top-p
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_then_top_p(radix, dtype, top_k_tensor, top_p_tensor):
    for p, k, top_p, kept in TOP_K_TOP_P_CASES:
        x = torch.tensor([p], dtype=dtype)
        top_k = torch.tensor([k]) if top_k_tensor else k
        top_p_arg = torch.tensor([top_p], dtype=dtype) if top_p_tensor else top_p
        want = expected(p, kept, dtype)
        assert torch.equal(fs.process(probs=x, top_k=top_k, top_p=top_p_arg), want), (k, top_p)
        if dtype == torch.float32:  # exact weights from logits (see the module docstring)
            got = fs.process(x.log(), top_k=top_k, top_p=top_p_arg)
            assert torch.equal(got, want), (k, top_p)


@pytest.mark.parametrize("tensors", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_ties_at_the_kth_weight(radix, dtype, tensors):
    p = [0.5, 0.25, 0.125, 0.125, 0.0, 0.0625]
    for k, kept in ((2, [0, 1]), (3, [0, 1, 2, 3]), (4, [0, 1, 2, 3]), (5, [0, 1, 2, 3, 5])):
        for logits in LOGITS[dtype]:
            got = process_rows(p, dtype, tensors, logits=logits, top_k=k)
            assert torch.equal(got, expected(p, kept, dtype)), (k, logits)


@pytest.mark.parametrize("tensors", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_min_p_equal_to_a_weight(dtype, tensors):
    """min_p * max equal to a weight keeps it; alone (on logits: the shortcut keeping
    ``w > pred(min_p)``) and after a top-k cut (the candidates' path)."""
    for min_p, kept in ((0.25, [0, 1, 2, 3]), (0.5, [0, 1]), (1.0, [0])):
        for logits in LOGITS[dtype]:
            want = expected(P, kept, dtype)
            got = process_rows(P, dtype, tensors, logits=logits, min_p=min_p)
            assert torch.equal(got, want), (min_p, logits)
            got = process_rows(P, dtype, tensors, logits=logits, top_k=3, min_p=min_p)
            assert torch.equal(got, want), (min_p, logits, "top_k")


def test_logit_weights_are_exact():
    """The precondition of the logits cases: float32 log of a dyadic probability gives back
    the dyadic weight (exp((x - max) / T) rounds exactly here)."""
    for p in (P, Q, [0.5, 0.25, 0.125, 0.125, 0.0, 0.0625]):
        everything = list(range(len(p)))
        assert torch.equal(
            fs.process(torch.tensor([p]).log()), expected(p, everything, torch.float32)
        )


# The small-top-k path: logits of V = 300 (>= one block), -inf around the kept tokens, which
# sit in different blocks and at the end of the row.
SMALL_IDS = [40, 41, 290, 299]


def small_path(top_k, top_p=None, min_p=None) -> torch.Tensor:
    """The kept distribution of ``small_top_k.draw`` over the whole row, one row per control
    form (Python numbers; tensors, which this path also takes on CPU)."""
    x = torch.full((1, 300), -torch.inf)
    x[0, SMALL_IDS] = torch.tensor(P).log()
    rows = []
    for tensors in (False, True):
        ctl = [None, top_k, top_p, min_p]
        if tensors:
            ctl = [None if c is None else torch.tensor([c]) for c in ctl]
        controls = check_controls(*ctl, 1, 300, x.device)
        assert small_top_k.applies(x, controls)
        drawn = small_top_k.draw(x, controls, 1, ControlledUniforms([[0.0]]))
        assert drawn.token_ids.tolist() == [[40]]  # u = 0: the first kept token
        kept = drawn.read(torch.arange(300)[None]).double() / drawn.total
        rows.append(kept.float())
    assert torch.equal(rows[0], rows[1])
    return rows[0]


def test_small_top_k_path_on_the_boundaries():
    def want(kept):
        out = torch.zeros(1, 300)
        out[0, SMALL_IDS] = expected(P, kept, torch.float32)[0]
        return out

    cases = [
        (dict(top_k=3), [0, 1, 2, 3]),  # ties at the k-th weight, across blocks
        (dict(top_k=2), [0, 1]),
        (dict(top_k=3, top_p=0.5), [0]),  # the issue's example on this path
        (dict(top_k=3, top_p=0.75), [0, 1]),
        (dict(top_k=3, top_p=0.875), [0, 1, 2, 3]),
        (dict(top_k=3, min_p=0.5), [0, 1]),
        (dict(top_k=3, min_p=0.25), [0, 1, 2, 3]),
    ]
    for ctl, kept in cases:
        assert torch.equal(small_path(**ctl), want(kept)), ctl
