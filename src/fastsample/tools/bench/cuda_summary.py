"""The key figures of the graph-captured GPU benchmarks, as markdown, from their JSON files.

``python -m fastsample.tools.bench.cuda_summary [--sampling PATH] [--verify PATH]`` reads what
``sampling_cuda --json`` and ``verify_cuda --json`` wrote and prints one table each, one line
per ``(B, V)``: microseconds per graph-replayed call of the contenders the GPU targets are
stated against (the read pass, ``torch.multinomial``, the seed's race, FlashInfer) and the
ratios those targets name. ``scripts/device_check.sh`` appends it to its summary, so the
figures come back in one short file beside the full JSON. A missing file is said, not an
error (a rehearsal without a GPU writes none).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (column, the row's "call" prefix, its "backend")
SAMPLING_COLUMNS = [
    ("read pass", "read pass", "-"),
    ("multinomial", "torch.multinomial", "-"),
    ("seed's race", "seed's race", "-"),
    ("fast_sample", "fast_sample(", "triton"),
    ("sample T/k/p", "sample(logits, T/top-k/top-p tensors)", "triton"),
    ("FlashInfer top-k/top-p", "flashinfer top_k_top_p", "-"),
    ("FlashInfer from probs", "flashinfer sampling_from_probs", "-"),
]
# (column, A, B): A's time over B's; in an "X vs Y" column, how many times faster X is than Y.
SAMPLING_RATIOS = [
    ("fast_sample vs multinomial", "multinomial", "fast_sample"),
    ("fast_sample vs race", "seed's race", "fast_sample"),
    ("fast_sample in read passes", "fast_sample", "read pass"),
    ("sample vs FlashInfer", "FlashInfer top-k/top-p", "sample T/k/p"),
]
VERIFY_COLUMNS = [
    ("chain K=4", "verify_chain K=4", "triton"),
    ("chain K=4 torch ops", "verify_chain K=4", "torch"),
    ("HF port", "reference (HF port)", "-"),
    ("FlashInfer chain", "flashinfer chain_speculative_sampling", "-"),
    ("tree a", "verify_tree a", "triton"),
    ("tree b", "verify_tree b", "triton"),
    ("chain K=16", "verify_chain K=16", "triton"),
]
VERIFY_RATIOS = [
    ("chain vs FlashInfer", "FlashInfer chain", "chain K=4"),
    ("tree a / chain K=16 (target <= 2)", "tree a", "chain K=16"),
]


def table(rows: list[dict], columns: list, ratios: list) -> list[str]:
    """Markdown lines: one per ``(B, V)`` in the rows' order; ``us`` per column ("e" marks a
    call timed eagerly because it could not be captured), then the ratios."""
    cases: dict[tuple[int, int], dict[str, dict]] = {}
    for row in rows:
        for name, prefix, backend in columns:
            if row["call"].startswith(prefix) and row["backend"] == backend:
                cases.setdefault((row["B"], row["V"]), {})[name] = row
    heads = [name for name, _, _ in columns] + [name for name, _, _ in ratios]
    lines = ["| B | V | " + " | ".join(heads) + " |", "|---:|---:|" + "---:|" * len(heads)]
    for (batch, vocab), found in cases.items():
        cells = []
        for name, _, _ in columns:
            row = found.get(name)
            if row is None:
                cells.append("-")
            elif "us" not in row:
                cells.append("error")
            else:
                cells.append(f"{row['us']:g}" + ("" if row.get("graph") else " e"))
        for _, top, bottom in ratios:
            a, b = found.get(top, {}).get("us"), found.get(bottom, {}).get("us")
            cells.append(f"{a / b:.2f}x" if a and b else "-")
        lines.append(f"| {batch} | {vocab} | " + " | ".join(cells) + " |")
    return lines


def summary(sampling: Path | None, verify: Path | None) -> list[str]:
    out: list[str] = []
    for title, path, columns, ratios in (
        ("graph-captured sampling (sampling_cuda), us per call", sampling, SAMPLING_COLUMNS,
         SAMPLING_RATIOS),
        ("graph-captured verification (verify_cuda), us per call", verify, VERIFY_COLUMNS,
         VERIFY_RATIOS),
    ):  # fmt: skip
        out.append(f"### {title}")
        if path is None or not path.is_file():
            out.append(f"no JSON at {path}: the benchmark did not run or did not finish")
        else:
            out += table(json.loads(path.read_text()), columns, ratios)
        out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sampling", type=Path, help="sampling_cuda's JSON")
    parser.add_argument("--verify", type=Path, help="verify_cuda's JSON")
    args = parser.parse_args(argv)
    print("\n".join(summary(args.sampling, args.verify)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
