#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU: the CUDA tests (graph capture under
# sync-debug "error", the race's far-tail test, CPU/CUDA Philox agreement), the self-check
# and the GPU benchmark. Writes logs and the benchmark JSON to ${OUT:-./device-out}.
# Usage: bash scripts/device_check.sh   (aim: under 8 minutes on an H200, install included;
# not yet run with the Triton backend, so the first run should leave room for a rerun)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./device-out}"
mkdir -p "$OUT"
status=0

python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
# Any CUDA build of torch >= 2.4 works; use what the machine has if it has one.
python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    || pip install --quiet "torch>=2.4" 2>&1 | tail -2
pip install --quiet -e ".[test]" 2>&1 | tail -2
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"

# CUDA tests only (everything else runs in CI on CPU). FASTSAMPLE_BACKEND=auto takes the
# Triton kernels for CUDA tensors, so these hold the kernels to graph capture under
# sync-debug "error"; the torch ops are checked once more with FASTSAMPLE_BACKEND=torch.
FASTSAMPLE_BACKEND=torch timeout 150 python -m pytest -q -rs tests/test_cuda_graphs.py 2>&1 \
    | tee "$OUT/cuda-tests-torch-backend.txt" || status=1
timeout 300 python -m pytest -q -rs tests/test_cuda_graphs.py tests/ops/test_philox.py \
    tests/ops/test_seeds.py tests/test_exactness.py tests/test_bad_input.py \
    -k "cuda or capture or graph or device_mismatch" 2>&1 | tee "$OUT/cuda-tests.txt" || status=1
timeout 200 python -m pytest -q -rs tests/verify -k "cuda" 2>&1 \
    | tee "$OUT/cuda-tests-verify.txt" || status=1
timeout 200 python -m pytest -q -rs tests/ops/test_small_top_k.py -k "cuda" 2>&1 \
    | tee "$OUT/cuda-tests-small-top-k.txt" || status=1
# The engine step's kernels compiled: staged buffer bitwise against the torch ops on CUDA,
# tokens, the state update, 3 + 1 launches, capture in a CUDA graph.
timeout 200 python -m pytest -q -rs tests/kernels/test_triton_stages_cuda.py 2>&1 \
    | tee "$OUT/cuda-tests-stages.txt" || status=1

# Do int32 radix keys (CPU only so far) work and pay on CUDA? Bitwise check and timing.
timeout 120 python scripts/cuda_radix_keys_probe.py 2>&1 | tee "$OUT/cuda-radix-keys.txt" || status=1

timeout 120 python -m fastsample selfcheck --device cuda 2>&1 | tee "$OUT/selfcheck.txt" || status=1

timeout 300 python -m fastsample bench --device cuda --json "$OUT/bench-cuda.json" \
    2>&1 | tee "$OUT/bench-cuda.txt" || status=1

timeout 200 python -m fastsample bench --controls --device cuda --json "$OUT/bench-controls-cuda.json" \
    2>&1 | tee "$OUT/bench-controls-cuda.txt" || status=1
timeout 200 python -m fastsample bench --verify --device cuda --json "$OUT/bench-verify-cuda.json" \
    2>&1 | tee "$OUT/bench-verify-cuda.txt" || status=1

# The Triton backend on the GPU: device work per call, then graph-captured timings of the
# samplers and of verification against torch.multinomial, the seed's race, one read pass,
# the torch ops and FlashInfer (when it imports).
timeout 120 python -m fastsample bench --launches --device cuda 2>&1 | tee "$OUT/launches-cuda.txt" || status=1
timeout 150 python -m fastsample.tools.bench.sampling_cuda --repeats 10 --json "$OUT/sampling-cuda.json" \
    2>&1 | tee "$OUT/sampling-cuda.txt" || status=1
timeout 120 python -m fastsample.tools.bench.verify_cuda --repeats 10 --json "$OUT/verify-cuda.json" \
    2>&1 | tee "$OUT/verify-cuda.txt" || status=1
exit $status
