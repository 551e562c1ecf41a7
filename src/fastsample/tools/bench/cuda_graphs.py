"""Shared by the GPU benchmarks: time a call replayed in a CUDA graph, and pick the backend.

:func:`graph_time` captures one call in a CUDA graph after a warm-up on a side stream and
replays it (ten replays per CUDA-event pair, medians over repeats), which is how an engine
runs a sampling step: launches cost ~1-2 us per graph node instead of ~4-8 us of host time.
A call that cannot be captured (it syncs, or is not capturable) is timed eagerly and marked.
:func:`backend` sets ``FASTSAMPLE_BACKEND`` for a block.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def backend(name: str) -> Iterator[None]:
    """``FASTSAMPLE_BACKEND=name`` for the duration (restored after)."""
    old = os.environ.get("FASTSAMPLE_BACKEND")
    os.environ["FASTSAMPLE_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FASTSAMPLE_BACKEND", None)
        else:
            os.environ["FASTSAMPLE_BACKEND"] = old


def graph_time(fn: Callable[[], object], repeats: int) -> tuple[float, bool]:
    """Median microseconds per call of ``fn`` replayed in a CUDA graph; ``(time, captured)``.
    Falls back to eager timing when capture fails (the call syncs or is not capturable)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compilation, cached device constants
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # not capturable: time it eagerly instead
        graph = None
        torch.cuda.synchronize()
    run = graph.replay if graph is not None else fn
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 100.0)  # ms per 10 calls -> us per call
    return statistics.median(times), graph is not None


def time_contenders(
    contenders: list[tuple[str, str, Callable[[], object]]], batch: int, vocab: int, repeats: int
) -> list[dict]:
    """One row per ``(label, backend, call)``: its graph-replayed time under that backend
    (``"-"``: not fastsample, run under ``auto``), or the error it raised, which is reported
    instead of ending the run."""
    rows = []
    for label, name, fn in contenders:
        row: dict = {"call": label, "backend": name, "B": batch, "V": vocab}
        with backend(name if name != "-" else "auto"):
            try:
                micros, captured = graph_time(fn, repeats)
            except Exception as error:
                rows.append({**row, "error": f"{type(error).__name__}: {error}"})
                continue
        rows.append({**row, "us": round(micros, 2), "graph": captured})
    return rows
