"""The three cut orders, each exact against the float64 sort reference of tests/reference.py:
``cut_order="transformers"`` (top-p on the top-k survivors, min-p after both: Hugging Face's
warpers), ``cut_order="vllm"`` (min-p first, as vLLM's ``MinPLogitsProcessor`` before
``apply_top_k_top_p``) and ``cut_order="joint"`` (top-k and top-p each on the whole tempered
row, the kept sets intersected, min-p after: SGLang's sampler, FlashInfer's joint order).

The vLLM order differs from Hugging Face's only when top-p and min-p are both on: top-p's mass
is then that of the tokens surviving min-p and top-k. The joint order differs when top-k and
top-p are both on: top-p's mass is the whole row's. Every path is held to the reference: the general
radix path (tensor controls), the static paths of Python numbers (the candidate-block top-k),
the small-top-k path with per-row tensor ``k`` (CPU eager) and the Triton controls kernel
(interpreter, tests/kernels/test_triton_controls_edges.py). Each law test draws from a row
where its order gives a different law from the others, at 2%; its negative control (the
sequential order) is rejected at the same size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastsample as fs
import fastsample.ops.small_top_k
from reference import min_p_keeping, reference_probs, robust_min_p, robust_top_p
from stattests import LawCase, assert_law, draws_needed, law_rejected
from test_controls import KINDS, assert_matches_reference, make_logits

ORDERS = ("transformers", "vllm", "joint")


def survivors_before_top_p(x, t, k, m, order):
    """The kept weights that top-p's mass is taken over, in ``order`` (for a robust top_p)."""
    if order == "joint":  # the whole row
        return reference_probs(x, t, 0, 1.0, 0.0)
    return reference_probs(x, t, k, 1.0, m if order == "vllm" else 0.0, cut_order="vllm")


def order_batch(vocab, rows, seed, order, k_range=None):
    """Rows of every kind with top-p and min-p on in most rows (where the orders differ)."""
    rng = np.random.default_rng(seed)
    xs, controls = [], []
    for i in range(rows):
        x = make_logits(KINDS[i % len(KINDS)], vocab, rng)
        t = float(rng.choice([0.6, 1.0, 1.5]))
        if k_range is None:
            k = int(rng.choice([0, int(rng.integers(1, vocab + 1))]))
        else:
            k = int(rng.integers(*k_range))
        weights = np.exp((x - x.max()) / t)
        if k_range is not None and k > 1 and rng.random() < 0.7:  # min-p cuts above top-k
            m = min_p_keeping(weights, int(rng.integers(1, k)))
        else:
            m = robust_min_p(weights, rng) if rng.random() < 0.8 else 0.0
        p = robust_top_p(survivors_before_top_p(x, t, k, m, order), rng)
        xs.append(x)
        controls.append((t, k, p, m))
    return np.stack(xs), controls


def reference(xs, controls, order):
    return np.stack(
        [reference_probs(x, *c, cut_order=order) for x, c in zip(xs, controls, strict=True)]
    )


def tensors(controls):
    t, k, p, m = zip(*controls, strict=True)
    return dict(
        temperature=torch.tensor(t), top_k=torch.tensor(k), top_p=torch.tensor(p),
        min_p=torch.tensor(m),
    )  # fmt: skip


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("vocab", [20, 700, 40_000])
def test_process_matches_reference_with_tensor_controls(vocab, order):
    xs, controls = order_batch(vocab, 24, seed=vocab + len(order), order=order)
    got = fs.process(torch.tensor(xs, dtype=torch.float32), **tensors(controls), cut_order=order)
    assert_matches_reference(got, reference(xs, controls, order), f"{order} V={vocab}")


@pytest.mark.parametrize("order", ORDERS)
def test_process_matches_reference_with_python_numbers(order):
    """Python numbers take the static paths: a small top_k through the candidate blocks."""
    xs, controls = order_batch(700, 18, seed=5, order=order)
    for x, (t, k, p, m) in zip(xs, controls, strict=True):
        got = fs.process(torch.tensor(x[None], dtype=torch.float32), temperature=t, top_k=k,
                         top_p=p, min_p=m, cut_order=order)  # fmt: skip
        want = reference_probs(x, t, k, p, m, cut_order=order)[None]
        assert_matches_reference(got, want, f"{order} {t, k, p, m}")


@pytest.mark.parametrize("order", ORDERS)
def test_small_top_k_paths_draw_what_the_general_path_draws(order, monkeypatch):
    """Per-row tensor ``k`` in every row (CPU eager: the small-top-k path) and a Python ``k``:
    bitwise the general path's tokens, whose law the reference fixes."""
    xs, controls = order_batch(3000, 12, seed=11, order=order, k_range=(1, 60))
    t, k, _, m = zip(*controls, strict=True)
    below_min_p = [reference_probs(x, tt, 0, 1.0, mm).astype(bool).sum() < kk
                   for x, tt, kk, mm in zip(xs, t, k, m, strict=True)]  # fmt: skip
    assert sum(below_min_p) >= 4  # rows where min-p, not top-k, sets top-p's floor
    x = torch.tensor(xs, dtype=torch.float32)
    args = dict(**tensors(controls), cut_order=order, seed=torch.arange(12), num_samples=2)
    fast = fs.sample(x, **args)
    monkeypatch.setattr(fs.ops.small_top_k, "applies", lambda *a: False)
    general = fs.sample(x, **args)
    assert torch.equal(fast.token_ids, general.token_ids)
    assert torch.equal(fast.valid, general.valid)  # rows keeping one token cannot draw two
    torch.testing.assert_close(fast.probs, general.probs, rtol=1e-6, atol=0)
    want = reference(xs, controls, order)
    assert_matches_reference(fs.process(x, **tensors(controls), cut_order=order), want, order)


def test_the_orders_differ_where_top_p_and_min_p_meet():
    """The row of the law test below: vLLM's order keeps one token fewer than Hugging Face's."""
    x, (t, k, p, m) = LAW_ROW, LAW_CONTROLS
    kept = {o: np.flatnonzero(reference_probs(x, t, k, p, m, cut_order=o)) for o in ORDERS}
    assert len(kept["vllm"]) < len(kept["transformers"])
    for order in ORDERS:
        got = fs.process(torch.tensor(x[None], dtype=torch.float32), temperature=t, top_k=k,
                         top_p=p, min_p=m, cut_order=order)  # fmt: skip
        assert np.array_equal(np.flatnonzero(got[0].numpy()), kept[order]), order


def test_bad_cut_order_raises_before_work():
    with pytest.raises(ValueError, match="cut_order must be one of 'transformers', 'vllm'"):
        fs.sample(torch.randn(2, 5), cut_order="sglang")
    with pytest.raises(ValueError, match="cut_order"):
        fs.process(torch.randn(2, 5), cut_order=None)


# ---------------------------------------------------------------------------- law

# Weights 8, 4, 2, 1 and a tail of 12 at 0.25 (mass 18): min_p = 0.2 drops the tail (cut 1.6
# keeps 8, 4, 2). With top_p = 0.8: over min-p's survivors (mass 14) the top two reach 12 >=
# 11.2, so vLLM keeps {8, 4}; over the whole row (mass 18) 8 + 4 + 2 = 14 >= 14.4 fails and
# the cut falls to 1, keeping {8, 4, 2, 1}, from which min-p then drops 1: {8, 4, 2}.
LAW_ROW = np.log(np.array([8.0, 4.0, 2.0, 1.0] + [0.25] * 12)) + 0.3
LAW_CONTROLS = (1.0, 0, 0.8, 0.2)
CLAIM = 0.02


def law(order: str) -> np.ndarray:
    return reference_probs(LAW_ROW, *LAW_CONTROLS, cut_order=order)


LAW_DRAWS = draws_needed(law("vllm"), CLAIM)


def test_vllm_order_law_and_its_negative_control():
    t, _, p, m = LAW_CONTROLS
    x = torch.tensor(LAW_ROW, dtype=torch.float32).expand(50_000, -1)
    counts = np.zeros(len(LAW_ROW), dtype=np.int64)
    drawn = 0
    step = 0
    while drawn < LAW_DRAWS:
        rows = min(50_000, LAW_DRAWS - drawn)
        out = fs.sample(x[:rows], temperature=t, top_p=p, min_p=m, cut_order="vllm",
                        seed=torch.arange(rows), step=step)  # fmt: skip
        assert out.valid.all()
        counts += np.bincount(out.token_ids[:, 0].numpy(), minlength=len(LAW_ROW))
        drawn += rows
        step += 1
    assert_law(counts, law("vllm"), what="cut_order='vllm'")
    assert law_rejected(counts, law("transformers"))  # the other order, at this size


# The same row with top_k = 4 and top_p = 0.75: on the top-k survivors (mass 15) 8 + 4 = 12
# reaches 11.25, so the sequential orders keep {8, 4}; on the whole row (mass 18) 12 < 13.5
# and the joint order keeps {8, 4, 2}, which min-p (cut 0.8) leaves alone.
JOINT_CONTROLS = (1.0, 4, 0.75, 0.1)


def joint_law(order: str) -> np.ndarray:
    return reference_probs(LAW_ROW, *JOINT_CONTROLS, cut_order=order)


JOINT_DRAWS = draws_needed(joint_law("joint"), CLAIM)


@pytest.mark.parametrize("controls_as", ["numbers", "tensors"])
def test_joint_order_law_and_its_negative_control(controls_as):
    """Python numbers take the candidate-block path, tensors the small-top-k path (CPU)."""
    t, k, p, m = JOINT_CONTROLS
    x = torch.tensor(LAW_ROW, dtype=torch.float32).expand(50_000, -1)
    counts = np.zeros(len(LAW_ROW), dtype=np.int64)
    drawn = step = 0
    while drawn < JOINT_DRAWS:
        rows = min(50_000, JOINT_DRAWS - drawn)
        args = dict(temperature=t, top_k=k, top_p=p, min_p=m)
        if controls_as == "tensors":
            args = {name: torch.full((rows,), value) for name, value in args.items()}
        out = fs.sample(x[:rows], **args, cut_order="joint", seed=torch.arange(rows), step=step)
        assert out.valid.all()
        counts += np.bincount(out.token_ids[:, 0].numpy(), minlength=len(LAW_ROW))
        drawn += rows
        step += 1
    assert_law(counts, joint_law("joint"), what="cut_order='joint'")
    assert law_rejected(counts, joint_law("transformers"))  # the sequential order


@pytest.mark.parametrize("case", ["block maxima", "group maxima", "exact mass"])
def test_joint_bounds_settle_or_fall_back_to_the_exact_mass(case, monkeypatch):
    """The candidate paths bound a row's mass (ops/joint.py). A heavy tail settles the joint
    cut at the block maxima's bounds; a peaked one (T=0.7) needs, for some rows, the tighter
    lower bound of 32-entry groups; a flat tail whose mass moves top-p's boundary needs the
    exact mass. Whichever decides, the draws are the general path's (batch and one row)."""
    import fastsample.ops.joint as joint
    import fastsample.ops.small_top_k as small

    rng = np.random.default_rng(3)
    if case == "block maxima":
        vocab, t, k, top_p = 20_000, 1.0, 20, 0.9
        rows = rng.normal(size=(4, vocab)) * 3
    elif case == "group maxima":
        vocab, t, k, top_p = 40_000, 0.7, 30, 0.9
        rows = rng.normal(size=(8, vocab)) * 3
    else:  # a tail of mass ~0.6 of the top's, ~1/256 of it a block maximum
        vocab, t, k, top_p = 20_000, 1.0, 20, 0.6
        rows = np.full((4, vocab), -5.5)
        rows[:, :8] = np.log(np.array([60.0, 30.0, 20.0, 12.0, 9.0, 7.0, 5.0, 3.0]))
        rows += rng.normal(size=rows.shape) * 1e-3
    used = []
    originals = joint._group_bound, joint.exact_masses, joint.row_mass
    for name, original in zip(("_group_bound", "exact_masses", "row_mass"), originals,
                              strict=True):  # fmt: skip
        monkeypatch.setattr(joint, name, lambda *a, n=name, f=original: used.append(n) or f(*a))
    batch = rows.shape[0]
    x = torch.tensor(rows, dtype=torch.float32)
    controls = dict(temperature=torch.full((batch,), t), top_k=torch.full((batch,), k),
                    top_p=torch.full((batch,), top_p), min_p=torch.zeros(batch))  # fmt: skip
    args = dict(**controls, cut_order="joint", seed=torch.arange(batch), num_samples=3)
    fast = fs.sample(x, **args)
    assert ("_group_bound" in used) == (case != "block maxima")  # groups before any exact
    assert ("exact_masses" in used or "row_mass" in used) == (case == "exact mass")
    want = [reference_probs(r, t, k, top_p, 0.0, cut_order="joint") for r in rows]
    assert_matches_reference(fs.process(x, **controls, cut_order="joint"), np.stack(want),
                             "joint")  # fmt: skip
    one_row = [fs.sample(x[b : b + 1], **one_row_args(args, b)).token_ids for b in range(batch)]
    with monkeypatch.context() as general:
        general.setattr(small, "applies", lambda *a: False)
        assert torch.equal(fast.token_ids, fs.sample(x, **args).token_ids)
        for b in range(batch):  # one row: the host-rows path against the general one
            want_b = fs.sample(x[b : b + 1], **one_row_args(args, b)).token_ids
            assert torch.equal(one_row[b], want_b)


def one_row_args(args, b):
    return {
        name: value[b : b + 1] if isinstance(value, torch.Tensor) else value
        for name, value in {**args, "num_samples": 1}.items()
    }


def law_cases():
    yield LawCase("cut_order='vllm' V=16", law("vllm"), LAW_DRAWS, CLAIM)
    yield LawCase("cut_order='joint' V=16", joint_law("joint"), JOINT_DRAWS, CLAIM)
