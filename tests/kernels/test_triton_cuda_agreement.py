"""On a GPU: the compiled kernels agree with the torch ops where older Triton interpreters do not.

The kernel tests beside this file use CPU tensors, so they run only through the interpreter
and skip on a CUDA machine. With Triton 3.6.0 and 3.8.0 (NumPy 2.3 and 2.4) the interpreter
fails four of them that pass with 3.9: float64 logits with a per-row top-k tensor keep no entry
of a row, which also breaks ``top_logprobs`` and token identity. The GPU machine compiles the
kernels with Triton 3.6.0, so this runs that case there (``scripts/device_check.sh``'s
cuda-tests): it tells an interpreter quirk from kernels that need a newer Triton.
"""

from __future__ import annotations

import math

import pytest
import torch

import fastsample as fs

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_top_k_tensor_on_masked_logits_matches_torch_ops(dtype, monkeypatch):
    inf = math.inf
    x = torch.tensor([[1.0, 3.0, -inf, 3.0, 2.0, -inf], [0.0, 0.0, 5.0, 0.0, 0.0, 1.0]],
                     dtype=dtype, device="cuda")  # fmt: skip
    top_k = torch.tensor([2, 4], device="cuda")
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("FASTSAMPLE_BACKEND", backend)
        results[backend] = fs.sample(x, temperature=0.9, top_k=top_k, seed=2, top_logprobs=3)
    ours, theirs = results["triton"], results["torch"]
    assert torch.equal(ours.token_ids, theirs.token_ids)
    assert torch.equal(ours.top_token_ids, theirs.top_token_ids)
    torch.testing.assert_close(ours.top_logprobs, theirs.top_logprobs, rtol=1e-6, atol=0)
    assert torch.isfinite(ours.top_logprobs[:, :2]).all()  # both rows keep at least 2 entries
