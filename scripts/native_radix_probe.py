"""Measurement probe, not library code: how far a native CPU histogram would take the exact
top-p of issue 4 (top_p=0.9 alone, ``>= 20x`` an HF-style pipeline).

In eager PyTorch the radix selection of ``fastsample.ops.select`` spends most of its ~16-19 ms
(B=64, V=128256, 2 cores) in two ``scatter_add_`` histograms over every weight, ~0.9 ns per
entry per thread whatever the buckets. This script JIT-compiles (``torch.utils.cpp_extension``:
needs a C++ compiler and ``pip install ninja``) the same two rounds as one plain loop per row:
round 1 adds every weight to the bucket of its top 16 pattern bits; round 2 skips the weights
outside the chosen bucket (a compare, no add) instead of routing them to dump buckets. Each
row is summed in index order in float32, as ``scatter_add_`` does on CPU, so the histograms,
hence the thresholds, are bitwise those of the library (checked; with 4 interleaved
sub-histograms in round 1 the summation order differs, and the thresholds still agreed). The
bucket search (``select.descend``) is the library's. ``-fopenmp`` matters: ``at::parallel_for``
is OpenMP in the header, and without it the loop ran on one thread (34 ms).

    python scripts/native_radix_probe.py

On the 2-core machine of BENCHMARKS.md (2026-12-01, three runs): eager radix 18-22 ms, native
8.5-15.7 ms (one table) or 9.1-13.1 ms (four), all 64 thresholds bitwise equal.
"""

from __future__ import annotations

import torch
from fused_exp_probe import _median_ms  # the sibling probe's timer (scripts/ is on the path)
from torch.utils.cpp_extension import load_inline

from fastsample.ops import select

KERNEL = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

// hist (B, buckets) float32, zeroed here; values (B, V) float32 contiguous, non-negative.
// first: bucket (pattern >> shift) & mask for every entry. Otherwise: the same bucket for the
// entries with pattern >> (shift + width) == prefix[b] and no sign bit; the others skipped.
// tables > 1 (round 1): that many interleaved sub-histograms, summed at the end, so that
// neighbouring entries on one bucket do not wait on each other (a different summation
// order: the masses are no longer bitwise those of scatter_add_).
void radix_round(torch::Tensor hist, torch::Tensor values, torch::Tensor prefix,
                 int64_t shift, int64_t width, bool first, int64_t tables) {
  const int64_t rows = values.size(0), vocab = values.size(1), buckets = hist.size(1);
  const int32_t mask = (1 << width) - 1;
  const int32_t* patterns = reinterpret_cast<const int32_t*>(values.data_ptr<float>());
  const float* weights = values.data_ptr<float>();
  const int64_t* wanted = prefix.data_ptr<int64_t>();
  float* out = hist.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(first && tables > 1 ? tables * buckets : 0);
    for (int64_t r = begin; r < end; ++r) {
      float* row_hist = out + r * buckets;
      std::memset(row_hist, 0, sizeof(float) * buckets);
      const int32_t* row = patterns + r * vocab;
      const float* w = weights + r * vocab;
      if (first && tables == 1) {
        for (int64_t i = 0; i < vocab; ++i) row_hist[(row[i] >> shift) & mask] += w[i];
      } else if (first) {
        std::fill(scratch.begin(), scratch.end(), 0.0f);
        float* sub = scratch.data();
        int64_t i = 0;
        for (; i + 4 <= vocab; i += 4) {
          sub[(row[i] >> shift) & mask] += w[i];
          sub[buckets + ((row[i + 1] >> shift) & mask)] += w[i + 1];
          sub[2 * buckets + ((row[i + 2] >> shift) & mask)] += w[i + 2];
          sub[3 * buckets + ((row[i + 3] >> shift) & mask)] += w[i + 3];
        }
        for (; i < vocab; ++i) sub[(row[i] >> shift) & mask] += w[i];
        for (int64_t b = 0; b < buckets; ++b)
          row_hist[b] = (sub[b] + sub[buckets + b]) + (sub[2 * buckets + b] + sub[3 * buckets + b]);
      } else {
        const int32_t want = static_cast<int32_t>(wanted[r]);
        const int64_t high = shift + width;
        int64_t i = 0;
        for (; i + 16 <= vocab; i += 16) {
          int hit = 0;  // a branch-free test of 16 entries (vectorised), then the rare adds
          for (int j = 0; j < 16; ++j) hit |= (row[i + j] >> high) == want;
          if (!hit) continue;
          for (int j = 0; j < 16; ++j) {
            const int32_t p = row[i + j];
            if (p >= 0 && (p >> high) == want) row_hist[(p >> shift) & mask] += w[i + j];
          }
        }
        for (; i < vocab; ++i) {
          const int32_t p = row[i];
          if (p >= 0 && (p >> high) == want) row_hist[(p >> shift) & mask] += w[i];
        }
      }
    }
  });
}
"""


def native_threshold(
    module, weights: torch.Tensor, fraction: torch.Tensor, tables: int
) -> torch.Tensor:
    """``select.descending_threshold(weights, fraction, "share")`` with the native rounds
    (``tables`` sub-histograms in round 1)."""
    batch = weights.shape[0]
    group = 64
    table = torch.empty(batch, (1 << 16) + 2 * group)
    prefix = torch.zeros(batch, 1, dtype=torch.int64)
    above = torch.zeros(batch, dtype=torch.float64)
    target = fraction
    remaining = 31
    for round_index, width in enumerate((16, 15)):
        remaining -= width
        hist = table[:, : (1 << width) + 2 * group]
        hist[:, :group] = 0
        hist[:, -group:] = 0
        real = hist[:, group:-group]
        digits = torch.empty(batch, 1 << width)  # contiguous rows for the kernel
        first = round_index == 0
        module.radix_round(digits, weights, prefix.squeeze(1), remaining, width, first, tables)
        real.copy_(digits)
        sums = select.group_sums(hist)
        if round_index == 0:
            target = target * sums.sum(-1)
        digit, above = select.descend(hist, target, above, sums)
        prefix = (prefix << width) | (digit - group).clamp_(0, (1 << width) - 1)
    return prefix.squeeze(1).to(torch.int32).view(torch.float32)


def main() -> None:
    module = load_inline(
        "fastsample_native_radix_probe",
        cpp_sources=KERNEL,
        functions=["radix_round"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],  # at::parallel_for: OpenMP
        extra_ldflags=["-fopenmp"],
    )
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 128256, generator=gen) * 3
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))
    fraction = torch.full((64,), 0.9, dtype=torch.float64)
    want = select.descending_threshold(weights, fraction, "share").view(torch.int32)
    read_pass = _median_ms(lambda: logits.sum(-1))
    print(f"B=64 V=128256 float32, {torch.get_num_threads()} threads; read pass {read_pass:.3f} ms")
    eager = _median_ms(lambda: select.descending_threshold(weights, fraction, "share"))
    print(f"{'eager radix':<24} {eager:7.3f} ms {eager / read_pass:6.2f} passes")
    for tables in (1, 4):
        got = native_threshold(module, weights, fraction, tables).view(torch.int32)
        same = int((got == want).sum())
        ms = _median_ms(lambda tables=tables: native_threshold(module, weights, fraction, tables))
        name = f"native, {tables} table{'s' if tables > 1 else ''}"
        print(f"{name:<24} {ms:7.3f} ms {ms / read_pass:6.2f} passes  {same}/64 rows bitwise")


if __name__ == "__main__":
    main()
