"""``bench --launches``: the device work of one call, per public call and backend.

On a GPU at decode batch sizes every device op is a kernel launch (~4-8 us of host time
eagerly, ~1-2 us per node in a CUDA graph), so the number of them per call sets the latency
long before the bytes do. This mode counts, for one call:

* **aten ops**: every aten operator dispatched to a device, seen by a ``TorchDispatchMode``;
  views (no data touched) and ``empty*`` allocations (no kernel) are not counted, and neither
  are the package's own ``fastsample::`` operators (they are counted by their launches);
* **kernel launches**: Triton kernels launched by :mod:`fastsample.kernels` (its launch
  counter, :func:`fastsample.kernels.launch.launches`).

The sum is the device work per call. It is counted on any device; on CPU the Triton backend
runs through Triton's interpreter (slow, but the count is the same as on a GPU). Beside the
public calls (the engine step and its state update too: :mod:`.launches_step`) it counts the
two baselines: the seed's 4-op race (``exponential_``, div, ``argmax``, ``gather``) and
``torch.multinomial``.

Table columns: call, backend, aten ops, kernels, total.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The samplers from their module, not the package: tools sit below fastsample/__init__.
from ... import sampling as fs
from .cuda_graphs import backend

_ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


@dataclass(frozen=True)
class Work:
    """Device work of one call: ``aten`` ops (with their names) and Triton ``kernels``."""

    aten: int
    kernels: int
    names: tuple[str, ...] = ()
    error: str = ""  # the call raised: the table says so instead of a count

    @property
    def total(self) -> int:
        return self.aten + self.kernels


class _AtenCounter(TorchDispatchMode):
    """Records every counted aten op dispatched while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        namespace = schema.name.split("::")[0]
        returns = schema.returns
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        allocation = func.__name__.split(".")[0] in _ALLOCATIONS
        if namespace == "aten" and not is_view and not allocation:
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _kernel_launches() -> int:
    """Launches so far by fastsample's Triton launchers (0 when the kernels never loaded)."""
    import sys

    module = sys.modules.get("fastsample.kernels.launch")
    return module.launches() if module is not None else 0


def device_work(call: Callable[[], object]) -> Work:
    """Count the device work of one ``call()`` (see the module docstring)."""
    before = _kernel_launches()
    with _AtenCounter() as counter:
        call()
    return Work(len(counter.names), _kernel_launches() - before, tuple(counter.names))


def public_calls(
    batch: int, vocab: int, device: torch.device
) -> list[tuple[str, Callable[[], object]]]:
    """``(label, call)`` for the public calls counted, on fresh random input."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, vocab, device=device, generator=gen)
    probs = torch.softmax(logits, -1)
    seeds = torch.arange(batch, device=device)
    steps = torch.zeros(batch, dtype=torch.int64, device=device)
    # Control tensors are made here, not in the calls: only the library's own work counts.
    temperature = torch.full((batch,), 0.8, device=device)
    top_k = torch.full((batch,), 50, device=device, dtype=torch.int64)
    top_p = torch.full((batch,), 0.9, device=device)
    min_p = torch.full((batch,), 0.05, device=device)
    greedy_rows = torch.where(seeds % 2 == 0, 0.0, temperature)  # T = 0 on even rows
    return [
        ("fast_sample(probs)", lambda: fs.fast_sample(probs)),
        ("fast_sample(probs, 2, seed=7)", lambda: fs.fast_sample(probs, 2, seed=7)),
        ("fast_sample(probs, seed=, step= tensors)",
         lambda: fs.fast_sample(probs, seed=seeds, step=steps)),
        ("sample_from_probs(probs)", lambda: fs.sample_from_probs(probs)),
        ("sample_from_probs(probs, seed=7)", lambda: fs.sample_from_probs(probs, seed=7)),
        ("sample_from_probs(probs, 2, seed=, step= tensors)",
         lambda: fs.sample_from_probs(probs, 2, seed=seeds, step=steps)),
        ("sample_from_probs(probs, method='race')",
         lambda: fs.sample_from_probs(probs, method="race")),
        ("sample(logits, T, top_k, top_p, min_p tensors, seed=, step= tensors)",
         lambda: fs.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                           min_p=min_p, seed=seeds, step=steps)),
        ("sample(logits, T (greedy rows), top_k, top_p tensors, 2 draws, seed= tensor)",
         lambda: fs.sample(logits, temperature=greedy_rows, top_k=top_k, top_p=top_p,
                           num_samples=2, seed=seeds)),
        ("sample(logits, T=0.8, top_k=50, top_p=0.9, seed=7)",
         lambda: fs.sample(logits, temperature=0.8, top_k=50, top_p=0.9, seed=7)),
        ("sample(logits, temperature=0)", lambda: fs.sample(logits, temperature=0)),
        ("sample(logits, temperature=0, num_samples=2)",
         lambda: fs.sample(logits, temperature=0, num_samples=2)),
    ]  # fmt: skip


def baseline_calls(
    batch: int, vocab: int, device: torch.device
) -> list[tuple[str, Callable[[], object]]]:
    """The seed's 4-op race and ``torch.multinomial``, on the same kind of input."""
    gen = torch.Generator(device=device).manual_seed(1)
    probs = torch.softmax(torch.randn(batch, vocab, device=device, generator=gen), -1)

    def seed_race() -> object:
        noise = torch.empty_like(probs).exponential_(1)
        index = (probs / noise).argmax(-1, keepdim=True)
        return probs.gather(1, index), index

    return [
        ("seed race (exponential_, div, argmax, gather)", seed_race),
        ("torch.multinomial(probs, 1)", lambda: torch.multinomial(probs, 1)),
    ]


def count_all(
    batch: int, vocab: int, device: torch.device, backends: tuple[str, ...]
) -> list[tuple[str, str, Work]]:
    """``(call, backend, work)`` for every public call and backend, then the baselines.

    Each call runs once uncounted first (first-call setup such as cached constants is not
    per-call work).
    """
    from .launches_step import step_calls
    from .launches_verify import distributed_calls, one_rank_group, verify_calls

    rows: list[tuple[str, str, Work]] = []
    for name in backends:
        with backend(name), one_rank_group() as grouped:
            calls = public_calls(batch, vocab, device) + step_calls(batch, vocab, device)
            calls += verify_calls(batch, vocab, device)
            if grouped:
                calls += distributed_calls(batch, vocab, device)
            rows += [(label, name, _counted(call)) for label, call in calls]
    rows += [(label, "-", _counted(call)) for label, call in baseline_calls(batch, vocab, device)]
    return rows


def _counted(call: Callable[[], object]) -> Work:
    """:func:`device_work` after one uncounted call; a call that raises is reported, not fatal."""
    try:
        call()
        return device_work(call)
    except Exception as error:  # one broken call must not hide the others' counts
        return Work(0, 0, error=f"{type(error).__name__}: {error}".splitlines()[0][:80])


def available_backends() -> tuple[str, ...]:
    """``torch``, and ``triton`` when it is installed."""
    from ...kernels.backend import triton_installed

    return ("torch", "triton") if triton_installed() else ("torch",)


def format_table(rows: list[tuple[str, str, Work]]) -> str:
    """A Markdown table: call, backend, aten ops, kernels, total."""
    lines = ["| call | backend | aten ops | kernels | total |", "|---|---|---:|---:|---:|"]
    for call, name, work in rows:
        if work.error:
            lines.append(f"| `{call}` | {name} | failed: {work.error} | | |")
        else:
            lines.append(f"| `{call}` | {name} | {work.aten} | {work.kernels} | {work.total} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``python -m fastsample bench --launches``: print the table for one small batch."""
    from .harness import pick_device

    device = pick_device(args.device)
    batch = (args.batch or [4])[0]
    vocab = (args.vocab or [1000])[0]
    backends = available_backends()
    print(f"# device work per call: B={batch}, V={vocab}, {device} (backends: {backends})")
    if device.type == "cpu" and "triton" in backends:
        print("# triton on CPU runs through Triton's interpreter (counts as on a GPU)")
    print(format_table(count_all(batch, vocab, device, backends)))
    return 0
