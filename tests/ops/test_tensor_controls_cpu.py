"""Per-row tensor controls on CPU: the small-top-k shortcut driven by tensors, and the bounds of
the tensor-control path (issue 20; issue 18's short-row radix).

The shortcut must be invisible: with per-row ``(B,)`` tensors for temperature, top-k, top-p and
min-p it draws bitwise what the general path draws with the same tensors, and what each row
draws alone with its values as Python numbers. Bad tensor values flag their row and change no
other row; a row with top-k off sends the batch to the general path, with the same draws for
the other rows. On CPU its counting pass reads only the blocks that can hold ties; the counts
are the full pass's. Short rows (``V = 8``) cost memory and ops linear in the input.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastsample as fs
import fastsample.stages.draw
from fastsample.ops import eager, small_top_k
from fastsample.ops.validation import check_controls
from fastsample.tools.bench.harness import _cpu_extra_bytes

FIELDS = ("token_ids", "probs", "logprobs", "valid", "top_token_ids", "top_logprobs")


def row_kinds(vocab: int, seed: int) -> torch.Tensor:
    """Eight rows of float32 logits: peaked, flat, integer ties, -inf masks, all equal, one
    finite entry, a NaN row and a +inf row (the last two invalid)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, vocab, generator=gen)
    x[0] *= 3
    x[1] *= 0.3
    x[2] = torch.randint(-2, 3, (vocab,), generator=gen).float()
    x[3, torch.rand(vocab, generator=gen) < 0.5] = -torch.inf
    x[4] = 1.0
    x[5] = -torch.inf
    x[5, vocab // 3] = 0.5
    x[6, 5] = torch.nan
    x[7, 3] = torch.inf
    return x


def per_row_controls(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Mixed per-row values (greedy rows, cuts on and off), exact in float32, so a row's
    Python numbers are its tensor values."""
    gen = torch.Generator().manual_seed(seed)
    top = min(vocab - 1, 1024)
    return {
        "temperature": torch.tensor([0.7, 0.0, 1.0, 1.3, 0.5, 0.9, 1e6, 0.25])[
            torch.randperm(8, generator=gen)
        ],
        "top_k": torch.tensor([1, 3, 40, top, 7, 300 % top + 1, 2, 50]),
        "top_p": torch.tensor([0.875, 1.0, 0.5, 0.75, 1.0, 0.999, 0.25, 0.9375]),
        "min_p": torch.tensor([0.0, 0.05, 0.0, 0.0078125, 0.25, 0.0, 0.0, 0.125]),
    }


def general(monkeypatch, **kwargs) -> fs.SampleOutput:
    with monkeypatch.context() as patch:
        patch.setattr(small_top_k, "applies", lambda *args: False)
        return fs.sample(**kwargs)


def assert_same(got: fs.SampleOutput, want: fs.SampleOutput, what: object) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or torch.equal(a, b), (name, what)


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(256, "float32"), (300, "bfloat16"), (2999, "float16"), (4096, "float32")]
)
def test_tensor_shortcut_draws_bitwise_those_of_the_general_path(monkeypatch, vocab, dtype):
    x = row_kinds(vocab, seed=vocab).to(getattr(torch, dtype))
    controls = per_row_controls(vocab, seed=vocab)
    seeds = torch.arange(8) * 7919 + vocab
    checked = small_top_k.applies(x, check_controls(*controls.values(), *x.shape, x.device))
    assert checked  # the tensor-driven shortcut serves this call
    for n in (1, 2):
        kwargs = dict(seed=seeds, step=11, num_samples=n, top_logprobs=n + 1)
        fast = fs.sample(x, **controls, **kwargs)
        assert_same(fast, general(monkeypatch, logits=x, **controls, **kwargs), ("tensors", n))
        assert not fast.valid[6:].any()  # the NaN and +inf rows
        for b in range(8):  # each row alone, its values as Python numbers
            numbers = {name: value[b].item() for name, value in controls.items()}
            alone = dict(kwargs, seed=seeds[b : b + 1])
            want = general(monkeypatch, logits=x[b : b + 1], **numbers, **alone)
            got = fs.SampleOutput(*(None if f is None else f[b : b + 1] for f in fast))
            assert_same(got, want, (b, numbers, n))


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("temperature", float("nan")),
        ("temperature", -1.0),
        ("temperature", float("inf")),
        ("top_k", -3),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("min_p", -0.25),
        ("min_p", float("nan")),
    ],
)
def test_bad_tensor_values_flag_their_row_only(name, bad):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2000, generator=gen) * 3
    controls = dict(
        temperature=torch.full((6,), 0.7),
        top_k=torch.tensor([50, 3, 20, 7, 100, 1]),
        top_p=torch.full((6,), 0.9),
        min_p=torch.full((6,), 0.01),
    )
    seeds = torch.arange(6) + 100
    clean = fs.sample(x, **controls, seed=seeds, top_logprobs=2)
    assert clean.valid.all()
    spoiled = {k: v.clone() for k, v in controls.items()}
    spoiled[name][3] = bad
    assert small_top_k.applies(x, check_controls(*spoiled.values(), *x.shape, x.device))
    out = fs.sample(x, **spoiled, seed=seeds, top_logprobs=2)
    assert out.valid.tolist() == [True, True, True, False, True, True]
    assert out.token_ids[3].tolist() == [0] and (out.probs[3] == 0).all()
    others = torch.tensor([0, 1, 2, 4, 5])
    for field in FIELDS:
        assert torch.equal(getattr(out, field)[others], getattr(clean, field)[others]), field


@pytest.mark.parametrize("source", ["logits", "probs"])
def test_a_tensor_of_zero_temperatures_is_served_as_python_greedy(monkeypatch, source):
    """Every row greedy by a CPU tensor of zeros: one blocked max pass as for ``temperature=0``
    (stages.draw._greedy_everywhere), with the general path's outputs bit for bit, bad rows and
    out-of-range (or NaN) tensor controls included; top_logprobs still takes the general path."""
    taken = []
    greedy_everywhere = fastsample.stages.draw._greedy_everywhere

    def spy(controls):
        taken.append(greedy_everywhere(controls))
        return taken[-1]

    monkeypatch.setattr(fastsample.stages.draw, "_greedy_everywhere", spy)
    x = row_kinds(1000, seed=5)
    data = {"logits": x} if source == "logits" else {"probs": torch.softmax(x, -1)}
    if source == "probs":
        data["probs"][2, 7] = -0.25  # a negative probability: invalid
    zeros = torch.zeros(8)
    others = (
        {},
        {"top_k": torch.tensor([5, -1, 3, 0, 2, 1, 1, 1])},  # -1: out of range
        {
            "top_p": torch.tensor([0.9, 1.5] + [1.0] * 6),
            "min_p": torch.tensor([0.1] * 7 + [math.nan]),
        },
    )
    for extra, n in itertools.product(others, (1, 2)):
        kwargs = dict(data, temperature=zeros, num_samples=n, **extra)
        taken.clear()
        fast = fs.sample(**kwargs)
        assert taken == [True]
        with monkeypatch.context() as patch:
            patch.setattr(fastsample.stages.draw, "_greedy_everywhere", lambda controls: False)
            want = fs.sample(**kwargs)
        assert_same(fast, want, (extra, n))
        assert fast.valid.sum() >= 3
    taken.clear()
    fs.sample(**data, temperature=torch.tensor([0.0] * 7 + [0.5]))  # one sampled row
    fs.sample(**data, temperature=zeros, top_logprobs=2)
    assert taken == [False]  # top_logprobs does not ask


def test_a_row_with_top_k_off_changes_no_other_row():
    """With top-k off in one row the batch takes the general path; the other rows draw what
    they draw through the shortcut."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3000, generator=gen) * 2
    t = torch.tensor([0.7, 1.0, 0.0, 1.2, 0.8])
    k = torch.tensor([50, 10, 5, 200, 0])
    p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.9])
    seeds = torch.arange(5) * 3 + 1
    mixed = check_controls(t, k, p, None, 5, 3000, x.device)
    assert not small_top_k.applies(x, mixed)
    out = fs.sample(x, temperature=t, top_k=k, top_p=p, seed=seeds, top_logprobs=3)
    part = fs.sample(
        x[:4], temperature=t[:4], top_k=k[:4], top_p=p[:4], seed=seeds[:4], top_logprobs=3
    )
    assert small_top_k.applies(x[:4], check_controls(t[:4], k[:4], p[:4], None, 4, 3000, x.device))
    for field in FIELDS:
        assert torch.equal(getattr(out, field)[:4], getattr(part, field)), field


def test_tensor_top_k_is_read_only_where_that_is_free(monkeypatch):
    k = torch.tensor([5, 9])
    controls = check_controls(None, k, None, None, 2, 1000, torch.device("cpu"))
    assert small_top_k.candidate_count(controls, 1000) == 9
    assert not eager.host_readable(torch.empty(2, device="meta"))  # off CPU: no read
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert small_top_k.candidate_count(controls, 1000) is None  # a graph: the general path
    static = check_controls(None, 9, torch.full((2,), 0.9), None, 2, 1000, torch.device("cpu"))
    assert small_top_k.candidate_count(static, 1000) == 9  # a Python k needs no read


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_selective_counts_are_the_full_pass_counts(monkeypatch, share):
    """Integer logits tie in every block, bfloat16 rounding ties too, NaN and masked rows; with
    ``share=0`` every selection falls back to the full pass."""
    monkeypatch.setattr(small_top_k, "_SELECTIVE_MAX_SHARE", share)
    original = small_top_k._count_selected
    seen = []

    def checked(logits, x_low, maxima, found, hits, rows):
        counts = original(logits, x_low, maxima, found, hits, rows)
        full = small_top_k._count_at_least(logits, x_low)
        assert torch.equal(counts[rows], full[rows])
        seen.append(int(rows.sum()))
        return counts

    monkeypatch.setattr(small_top_k, "_count_selected", checked)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5000, generator=gen) * 3
    x[1] = torch.randint(-3, 2, (5000,), generator=gen).float()
    x[2, ::3] = -torch.inf
    x[3, 17] = torch.nan
    x[4] = (x[4] * 0.1).bfloat16().float()
    for dtype, k in itertools.product((torch.float32, torch.bfloat16), (1, 40)):
        fs.sample(x.to(dtype), temperature=torch.full((6,), 0.8), top_k=k, top_p=0.9)
    assert len(seen) == 4 and min(seen) >= 4  # the NaN row is skipped (invalid anyway)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_short_rows_cost_memory_and_ops_linear_in_the_input():
    """Issue 18: tensor top-k/top-p at V=8 gave every row a 2,176-bucket radix table (B=50,000:
    ~550 MB, 340x the input). Now: a fixed number of ops whatever the batch, and peak extra
    memory within a small multiple of the input."""

    def call(batch: int):
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch)) * 3
        controls = dict(
            temperature=torch.full((batch,), 0.7),
            top_k=torch.full((batch,), 3),
            top_p=torch.full((batch,), 0.9),
        )
        return x, lambda: fs.sample(x, **controls, seed=torch.arange(batch))

    counts = []
    # Both batches above the 1,024 rows where the all-greedy check of a CPU temperature
    # tensor switches from reading its values to three ops (stages/draw.py).
    for batch in (2000, 16000):
        _, fn = call(batch)
        fn()  # per-device constants are made by the first call
        with _OpCounter() as counter:
            fn()
        counts.append(counter.count)
    assert counts[0] == counts[1]  # no loop over rows or row pieces
    x, fn = call(20000)
    fn()
    extra = _cpu_extra_bytes(fn)
    assert extra <= 40 * x.numel() * x.element_size(), extra / (x.numel() * x.element_size())
