"""The reporting half of the benchmark, shared by every mode: the progress line, the main
table, machine info (what the numbers depend on), and saving JSON and plots.
"""

from __future__ import annotations

import datetime
import glob
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from typing import Any, TextIO

import torch

from .harness import Contender, Result


class Progress:
    """A single self-overwriting status line on a terminal's stderr (silent otherwise)."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total, self.done, self.width = total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        self._write(f"[{self.done}/{self.total}] {label}")

    def clear(self) -> None:
        self._write("")

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        self.stream.write("\r" + text.ljust(self.width) + ("\r" if not text else ""))
        self.stream.flush()
        self.width = len(text)


# ---------------------------------------------------------------------------- the table


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "failed"
    return f"{ms:.0f}" if ms >= 1000 else f"{ms:.4g}"


def _fmt_ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def _fmt_mem(r: Result, measured: bool) -> str:
    if not measured or r.median_ms is None:
        return ""
    if r.extra_mem_fraction is None:
        return "n/a"
    pct = 100 * r.extra_mem_fraction
    return f"+{pct:.1f}%" if pct < 10 else f"+{pct:.0f}%"


class Table:
    """The stdout table, printed one case at a time as results come in."""

    HEADERS = ("case", "contender", "median ms", "vs multinomial", "read passes", "mem")

    def __init__(self, contenders: Sequence[Contender], out: TextIO) -> None:
        self.out = out
        self.measured = {c.name for c in contenders if c.measure_memory}
        name_width = max([len(self.HEADERS[1]), *(len(c.name) for c in contenders)])
        self.widths = (23, name_width, 10, 14, 11, 7)

    def _line(self, cells: Sequence[str]) -> str:
        left = [f"{cells[0]:<{self.widths[0]}}", f"{cells[1]:<{self.widths[1]}}"]
        right = [f"{c:>{w}}" for c, w in zip(cells[2:], self.widths[2:], strict=True)]
        return "  ".join(left + right).rstrip()

    def header(self) -> None:
        print(self._line(self.HEADERS), file=self.out)
        print("-" * len(self._line(self.HEADERS)), file=self.out)

    def case(self, rows: Sequence[Result]) -> None:
        for r in rows:
            label = f"B={r.batch} V={r.vocab} {r.dtype}"
            cells = (
                label,
                r.contender,
                _fmt_ms(r.median_ms),
                _fmt_ratio(r.speedup_vs_multinomial),
                _fmt_ratio(r.read_passes),
                _fmt_mem(r, r.contender in self.measured),
            )
            print(self._line(cells), file=self.out)
            if r.error:
                print(f"    ({r.contender} failed: {r.error})", file=self.out)
        print(file=self.out, flush=True)


# ---------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_name() -> str:
    cache = last_level_cache()
    return f"{cpu_model()}, {cache}" if cache else cpu_model()


def last_level_cache() -> str | None:
    """The CPU's largest cache, e.g. ``"L3 32 MiB"``, from Linux's sysfs; None elsewhere.

    It says what a "read pass" measures: an input that fits in it is read from cache, not
    from memory, so the same code shows more read passes on a host with a bigger cache.
    """
    best: tuple[int, int] | None = None
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level"), encoding="utf-8") as f:
                level = int(f.read())
            with open(os.path.join(index, "size"), encoding="utf-8") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            size_bytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (ValueError, IndexError):
            continue
        if best is None or (level, size_bytes) > best:
            best = (level, size_bytes)
    if best is None:
        return None
    level, size_bytes = best
    return f"L{level} {size_bytes / (1 << 20):g} MiB"


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers depend on, saved next to them."""
    is_cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if is_cuda else _cpu_name(),
        "cuda": torch.version.cuda if is_cuda else None,
        "cpu_model": cpu_model(),
        "cpu_cache": last_level_cache(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------- files


def save_json(path: str, rows: Sequence[Any], info: dict[str, Any], settings: dict) -> None:
    """``{"machine": info, "settings": settings, "results": rows}``, the layout of every
    mode's ``--json``; dataclass rows are saved as dicts."""
    results = [asdict(r) if is_dataclass(r) else r for r in rows]
    doc = {"machine": info, "settings": settings, "results": results}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def require_matplotlib() -> Any:
    """Import matplotlib (Agg backend) or exit with how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "error: --plot needs matplotlib, an optional extra: "
            'pip install "fastsample[plot]"  (or: pip install matplotlib)'
        ) from None
    return plt


def save_plot(
    path: str, rows: Sequence[Result], title: str, *, baseline: str, hatched: str
) -> None:
    """Grouped bars: speed-up over ``baseline`` per case and contender (log scale); the
    ``hatched`` row (the read pass, a floor rather than a sampler) is drawn hatched."""
    plt = require_matplotlib()
    cases = list(dict.fromkeys((r.batch, r.vocab, r.dtype) for r in rows))
    names = [n for n in dict.fromkeys(r.contender for r in rows) if n != baseline]
    speedup = {(r.batch, r.vocab, r.dtype, r.contender): r.speedup_vs_multinomial for r in rows}
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cases) + 2), 4.5))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(cases))]
        ys = [speedup.get((*c, name)) or math.nan for c in cases]
        bars = ax.bar(xs, ys, width, label=name, hatch="//" if name == hatched else None)
        ax.bar_label(bars, fmt="%.3g", fontsize=5, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"B={b}\nV={v}\n{d}" for b, v, d in cases], fontsize=7)
    ax.set_ylabel(f"speed-up over {baseline} (x)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
