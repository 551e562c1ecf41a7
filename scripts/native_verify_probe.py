"""Measurement probe, not library code: how far a fused native CPU kernel would take
``verify_chain`` (issue 5: at most 3 read passes of one ``(B, V)`` slice beyond the gather).

The one ``(B, V)`` stage of a chain verification reads, per request, the target row and the
draft row at the request's first rejection and reduces them: block sums of ``p`` and of
``max(p - q, 0)``, the minimum of each row and the draft row's sum (the validity checks). In
eager PyTorch (``fastsample.verify.draw.summarize``) the rows are first copied out with
``index_select``, since each request's row sits at its own position, and every reduction is
its own pass. This script JIT-compiles (``torch.utils.cpp_extension``: needs a C++ compiler
and ``pip install ninja``) one kernel that reads both rows once per request and produces the
same summaries, and prints both, with ``verify_chain`` itself, in read passes of
``target_probs[:, 0].sum(-1)`` (the unit of ``bench --verify``).

    python scripts/native_verify_probe.py
"""

from __future__ import annotations

import torch
from fused_exp_probe import _median_ms, _vector_flags  # the sibling probe's (scripts/ on path)
from torch.utils.cpp_extension import load_inline

import fastsample
from fastsample.verify.draw import summarize

KERNEL = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <limits>
using Vec = at::vec::Vectorized<float>;

// Per request b: p = target[target_rows[b]], q = draft[draft_rows[b]], each read once.
std::vector<torch::Tensor> residual_summary(torch::Tensor target, torch::Tensor target_rows,
                                            torch::Tensor draft, torch::Tensor draft_rows) {
  const int64_t batch = target_rows.size(0), vocab = target.size(1), blocks = vocab / 256;
  auto opts = target.options();
  auto sums_p = torch::empty({batch, blocks}, opts);
  auto sums_r = torch::empty({batch, blocks}, opts);
  auto min_p = torch::empty({batch}, opts);
  auto min_q = torch::empty({batch}, opts);
  auto mass_q = torch::empty({batch}, opts);
  const float* tp = target.data_ptr<float>();
  const float* dp = draft.data_ptr<float>();
  const int64_t* tr = target_rows.data_ptr<int64_t>();
  const int64_t* dr = draft_rows.data_ptr<int64_t>();
  float* sp = sums_p.data_ptr<float>();
  float* sr = sums_r.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    const Vec zero(0.0f);
    for (int64_t b = begin; b < end; ++b) {
      const float* p = tp + tr[b] * vocab;
      const float* q = dp + dr[b] * vocab;
      Vec low_p(std::numeric_limits<float>::infinity()), low_q = low_p, total_q(0.0f);
      for (int64_t j = 0; j < blocks; ++j) {
        Vec acc_p(0.0f), acc_r(0.0f);
        for (int64_t i = j * 256; i < (j + 1) * 256; i += Vec::size()) {
          const Vec vp = Vec::loadu(p + i), vq = Vec::loadu(q + i);
          acc_p = acc_p + vp;
          acc_r = acc_r + at::vec::maximum(vp - vq, zero);
          low_p = at::vec::minimum(low_p, vp);  // NaN propagates, as amin does
          low_q = at::vec::minimum(low_q, vq);
          total_q = total_q + vq;
        }
        auto add = [](Vec& a, Vec& c) { return a + c; };
        sp[b * blocks + j] = at::vec::vec_reduce_all<float>(add, acc_p);
        sr[b * blocks + j] = at::vec::vec_reduce_all<float>(add, acc_r);
      }
      auto lowest = [](Vec& a, Vec& c) { return at::vec::minimum(a, c); };
      auto add = [](Vec& a, Vec& c) { return a + c; };
      min_p.data_ptr<float>()[b] = at::vec::vec_reduce_all<float>(lowest, low_p);
      min_q.data_ptr<float>()[b] = at::vec::vec_reduce_all<float>(lowest, low_q);
      mass_q.data_ptr<float>()[b] = at::vec::vec_reduce_all<float>(add, total_q);
    }
  });
  return {sums_p, sums_r, min_p, min_q, mass_q};
}
"""


def main() -> None:
    module = load_inline(
        "fastsample_native_verify_probe",
        cpp_sources=KERNEL,
        functions=["residual_summary"],
        extra_cflags=_vector_flags(),
        extra_ldflags=["-fopenmp"],
    )
    batch, k, vocab = 64, 4, 128256  # bench --verify's case
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 3
    target = logits.softmax(-1)
    draft = (logits[:, :k] + torch.randn(batch, k, vocab, generator=gen)).softmax(-1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).view(batch, k)
    # Each request's row at its own position, as after the first rejection.
    position = torch.randint(0, k, (batch,), generator=gen)
    rows = torch.arange(batch)
    target_table, target_rows = target.view(-1, vocab), rows * (k + 1) + position
    draft_table, draft_rows = draft.view(-1, vocab), rows * k + position

    native = module.residual_summary(target_table, target_rows, draft_table, draft_rows)
    eager = summarize(target_table, target_rows, draft_table, draft_rows)
    for name, got, want in (
        ("target block sums", native[0], eager.target_sums),
        ("residual block sums", native[1], eager.residual_sums),
        ("draft mass", native[4], eager.draft_mass),
    ):
        assert want is not None
        error = ((got.double() - want).abs() / want.abs().clamp_min(1e-30)).max().item()
        print(f"{name:<20} max rel. difference from eager {error:.1e}")
    assert bool((native[2] >= 0).all() == eager.target_ok.all())

    read_pass = _median_ms(lambda: target[:, 0].sum(-1))
    timings = {
        "eager summarize": _median_ms(
            lambda: summarize(target_table, target_rows, draft_table, draft_rows)
        ),
        "native summary": _median_ms(
            lambda: module.residual_summary(target_table, target_rows, draft_table, draft_rows)
        ),
        "fs.verify_chain": _median_ms(lambda: fastsample.verify_chain(target, tokens, draft)),
    }
    print(
        f"B={batch} K={k} V={vocab} float32, {torch.get_num_threads()} threads; "
        f"read pass (target_probs[:, 0].sum(-1)) {read_pass:.3f} ms"
    )
    for name, ms in timings.items():
        print(f"{name:<18} {ms:7.3f} ms {ms / read_pass:5.2f} passes")
    rest = timings["fs.verify_chain"] - timings["eager summarize"] + timings["native summary"]
    print(f"{'chain, native stage':<18} {rest:7.3f} ms {rest / read_pass:5.2f} passes (estimate)")


if __name__ == "__main__":
    main()
