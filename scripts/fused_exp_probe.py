"""Measurement probe, not library code: how far a fused native CPU kernel would take the
temperature-only setting of issue 4 (``<= 3`` read passes).

fastsample is pure PyTorch; in eager mode ``exp((x - max) / T)`` plus block sums costs ~9
read passes on the 2-core CPU of BENCHMARKS.md. This script JIT-compiles (with
``torch.utils.cpp_extension``: needs a C++ compiler and ``pip install ninja``) one kernel per
variant that does, per row, the row maximum and the block sums of ``exp((x - max) / T)`` in
one sweep (the row stays in L2 between the two), and prints its time in read passes
(``logits.sum(-1)``). Variants: division by ``T`` and Sleef's 1-ULP exp (what eager torch
computes), multiplication by ``1 / T``, and torch's faster ``exp_u20``.

    python scripts/fused_exp_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

KERNEL = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
using Vec = at::vec::Vectorized<float>;

template <int kVariant>
torch::Tensor block_sums_of_weights(torch::Tensor x, double temperature) {
  const int64_t rows = x.size(0), vocab = x.size(1), blocks = vocab / 256;
  auto sums = torch::empty({rows, blocks}, x.options());
  const float* in = x.data_ptr<float>();
  float* out = sums.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * vocab;
      const float top = at::vec::reduce_all<float>(
          [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, vocab);
      const Vec shift(top), scale(kVariant == 0 ? t : 1.0f / t);
      for (int64_t j = 0; j < blocks; ++j) {
        Vec acc(0.0f);
        for (int64_t i = 0; i < 256; i += Vec::size()) {
          const Vec v = Vec::loadu(row + j * 256 + i) - shift;
          if constexpr (kVariant == 0) acc = acc + (v / scale).exp();
          else if constexpr (kVariant == 1) acc = acc + (v * scale).exp();
          else acc = acc + (v * scale).exp_u20();
        }
        out[r * blocks + j] = at::vec::vec_reduce_all<float>(
            [](Vec& a, Vec& b) { return a + b; }, acc);
      }
    }
  });
  return sums;
}
torch::Tensor divide_exp(torch::Tensor x, double t) { return block_sums_of_weights<0>(x, t); }
torch::Tensor multiply_exp(torch::Tensor x, double t) { return block_sums_of_weights<1>(x, t); }
torch::Tensor multiply_exp_u20(torch::Tensor x, double t) { return block_sums_of_weights<2>(x, t); }
"""


def _median_ms(fn, repeats: int = 40) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _vector_flags() -> list[str]:
    """Compiler flags for a kernel using ATen's CPU vectors at torch's own capability."""
    flags = ["-O3", "-march=native", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # ATen's vectors need the macro
        flags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif torch.backends.cpu.get_cpu_capability() == "AVX2":
        flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def main() -> None:
    flags = _vector_flags()
    variants = ["divide_exp", "multiply_exp", "multiply_exp_u20"]
    module = load_inline(
        "fastsample_fused_exp_probe",
        cpp_sources=KERNEL,
        functions=variants,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
    )
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 128000, generator=gen) * 3
    temperature = 0.7
    want = torch.exp((logits - logits.amax(-1, keepdim=True)) / temperature)
    want = want.view(64, -1, 256).sum(-1)
    read_pass = _median_ms(lambda: logits.sum(-1))
    eager = _median_ms(
        lambda: (
            torch.exp((logits - logits.amax(-1, keepdim=True)) / temperature)
            .view(64, -1, 256)
            .sum(-1)
        )
    )
    print(f"B=64 V=128000 float32, {torch.get_num_threads()} threads; read pass {read_pass:.3f} ms")
    print(f"{'eager torch':<18} {eager:7.3f} ms {eager / read_pass:5.2f} passes")
    for name in variants:
        kernel = getattr(module, name)
        error = ((kernel(logits, temperature) - want).abs() / want).max().item()
        ms = _median_ms(lambda kernel=kernel: kernel(logits, temperature))
        print(f"{name:<18} {ms:7.3f} ms {ms / read_pass:5.2f} passes  max rel err {error:.1e}")


if __name__ == "__main__":
    main()
