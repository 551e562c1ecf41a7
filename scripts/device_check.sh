#!/usr/bin/env bash
# The one prepared run for the GPU machine (one H200, no package registry, its own python3:
# Python 3.12, torch 2.11 + CUDA 13, triton 3.6.0, pytest, numpy, scipy; nvcc 13.0). It uses
# that python3 as it is: no venv, no downloads (PIP_NO_INDEX=1), fastsample from src/ by
# PYTHONPATH. Every step is time-boxed and a failing step never stops the others; all it
# writes goes under $OUT, and $OUT/summary.md, rewritten after every step and last of all,
# lists each step with ran/skipped/failed, its seconds and what it measured.
#
# How to run it:
#   1. here, with the network, for the FlashInfer rows (optional):
#      python scripts/flashinfer_carry.py   (flashinfer-python 0.7.4 trimmed to what its
#      sampling kernels need, plus apache-tvm-ffi: .whl/, ~18 MiB, ignored by git; without
#      .whl the run measures without FlashInfer and says so)
#   2. the device tool: run(command="bash scripts/device_check.sh", carry=[".whl"],
#      timeout_s=390), then give_back unless rerunning at once
# The script stops starting steps after DEADLINE_S (default 300 s) and then writes the
# summary: about 5.5 minutes of command plus 1-2 minutes of machine start, 7 in all, which
# leaves room in the 15-minute lease for one rerun. What comes back (at most 8 files):
#   summary.md  steps.log (every step's output)  sampling-cuda.json  verify-cuda.json
#   bench-cuda.json
#
# Steps, in order (the order puts the GPU targets' figures before the longer checks):
#   env                 python3, torch, triton, numpy, GPU, nvcc
#   flashinfer-install  the carried wheels and FlashInfer bundle into a folder on PYTHONPATH
#   flashinfer-jit      FlashInfer builds its sampling kernels with nvcc (in the background,
#                       beside cuda-tests); skipped past FLASHINFER_JIT_BUDGET_S (150 s), and
#                       the benchmarks then run without FlashInfer. Here (CUDA 13.0 nvcc from
#                       PyPI, no GPU) its three files compiled from the trimmed bundle in 73,
#                       28 and 8 s of CPU each; built in parallel there, about a minute
#   cuda-tests          the CUDA tests on the Triton backend: graph capture under sync-debug
#                       "error", the race's far tail, CPU/CUDA Philox agreement, verification,
#                       the k best blocks, and the float64 top-k case that Triton 3.6's
#                       interpreter gets wrong (compiled by 3.6 here: right or not?)
#   sampling-cuda       graph-captured fast_sample / sample against torch.multinomial, the
#                       seed's race, one read pass and FlashInfer (--repeats 5: replays cost
#                       microseconds, the run's time goes to compiling the kernels)
#   verify-cuda         graph-captured verify_chain / verify_tree against the HF port and
#                       FlashInfer's chain_speculative_sampling (--repeats 5)
#   launches            device work per call of each backend (bench --launches)
#   cuda-tests-torch    the graph-capture tests once more on the torch ops
#   selfcheck           exactness, bad rows, batch invariance, graph capture on the GPU
#   bench               eager timings against torch.multinomial, --quick: two cases (the full
#                       grid's eager times are launch-bound on a GPU; sampling-cuda's
#                       graph-captured table is what the targets read)
#   radix-keys-probe    int32 against int64 radix keys on CUDA (bitwise, timed: ~10 s)
# Dropped from the earlier version: a venv and pip installs (no registry there), and the eager
# bench --controls / --verify on CUDA (their GPU figures are the graph-captured ones above).
#
# bash scripts/device_check.sh --rehearse: the same steps on a machine without CUDA (CI runs it
# through tests/tools/test_device_check.py): each GPU step runs its command's cheap entry point
# (the benchmark modules' no-CUDA exit, argparse of the exact flags, pytest --collect-only of
# the exact selection, the FlashInfer bundle lookup) and is recorded as skipped with that line.
# bash scripts/device_check.sh --list-steps prints "name kind" per step (kind: host or gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

STEPS=(env:host flashinfer-install:gpu flashinfer-jit:gpu cuda-tests:gpu sampling-cuda:gpu
       verify-cuda:gpu launches:gpu cuda-tests-torch:gpu selfcheck:gpu bench:gpu
       radix-keys-probe:gpu)

MODE=gpu
case "${1:-}" in
    --list-steps) for entry in "${STEPS[@]}"; do echo "${entry%%:*} ${entry#*:}"; done; exit 0 ;;
    --rehearse) MODE=rehearse; export CUDA_VISIBLE_DEVICES="" ;;  # cheap on a GPU machine too
    "") ;;
    *) echo "usage: bash scripts/device_check.sh [--rehearse | --list-steps]" >&2; exit 2 ;;
esac

OUT="${OUT:-./device-out}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CARRY_DIR="${CARRY_DIR:-$ROOT/.whl}"
DEADLINE_S="${DEADLINE_S:-300}"
FLASHINFER_JIT_BUDGET_S="${FLASHINFER_JIT_BUDGET_S:-150}"
LOGS=$(mktemp -d)
FI_SITE="$LOGS/flashinfer-site"  # outside the checkout: nothing the run writes travels back
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
: > "$OUT/steps.log"
rm -f "$OUT/sampling-cuda.json" "$OUT/verify-cuda.json" "$OUT/bench-cuda.json"

if [ "$MODE" = gpu ] && ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    MODE=no-cuda  # rehearse, but the run failed: a GPU run was asked for
    echo "no CUDA device: every GPU step is rehearsed instead (nothing measured)"
fi

NAMES=() STATUS=() SECS=() NOTES=()

record() {  # record NAME STATUS SECONDS NOTE
    local known=0 entry
    for entry in "${STEPS[@]}"; do [ "${entry%%:*}" = "$1" ] && known=1; done
    [ $known = 1 ] || { echo "device_check.sh: step $1 is not in STEPS" >&2; exit 3; }
    NAMES+=("$1") STATUS+=("$2") SECS+=("$3") NOTES+=("${4//|/\\|}")
    printf '%-18s %-7s %4ss  %s\n' "$1" "$2" "$3" "$4"
    write_summary
}

write_summary() {  # write_summary [final]: the key figures are read once, at the end
    local i entry name done_steps=" ${NAMES[*]} "
    {
        echo "# device_check summary"
        echo
        case "$MODE" in
            gpu) echo "- mode: GPU run" ;;
            rehearse) echo "- mode: rehearsal (no GPU work: each GPU step's entry point exercised, nothing measured)" ;;
            no-cuda) echo "- mode: a GPU run without a CUDA device: rehearsed instead, nothing measured" ;;
        esac
        echo "- python3: $(command -v python3); PYTHONPATH=$PYTHONPATH"
        echo "- elapsed: ${SECONDS} s of the ${DEADLINE_S} s deadline; output: steps.log and the JSON files beside this one"
        echo
        echo "| step | status | seconds | what it measured, or why not |"
        echo "|---|---|---:|---|"
        for entry in "${STEPS[@]}"; do  # in STEPS order (flashinfer-jit is recorded late)
            name=${entry%%:*}
            case "$done_steps" in
                *" $name "*)
                    for i in "${!NAMES[@]}"; do
                        [ "${NAMES[$i]}" = "$name" ] \
                            && echo "| $name | ${STATUS[$i]} | ${SECS[$i]} | ${NOTES[$i]} |"
                    done ;;
                *) echo "| $name | pending | | not reached yet |" ;;
            esac
        done
        echo
        echo "## Key figures"
        echo
        if [ "${1:-}" = final ]; then
            # As a file, not -m: no torch import for a JSON reader.
            python3 src/fastsample/tools/bench/cuda_summary.py --sampling "$OUT/sampling-cuda.json" \
                --verify "$OUT/verify-cuda.json" 2>&1
        else
            echo "(read from the benchmark JSON when the run ends)"
        fi
    } > "$LOGS/summary.md" && cp "$LOGS/summary.md" "$OUT/summary.md"  # no half-written one
}

last_line() { grep -v '^\s*$' "$1" | tail -n 1 | cut -c1-220; }

append_log() {  # the step's log into steps.log, under a header
    { echo; echo "===== $1 ($2)"; cat "$LOGS/$1.log"; } >> "$OUT/steps.log"
}

# gpu_step NAME LIMIT EXPECT COMMAND...: on a GPU, COMMAND time-boxed to LIMIT seconds (or
# what is left of the deadline), its note the log's last line, or WROTE (a file it wrote) and
# that line; in a rehearsal, the same COMMAND must print EXPECT (its no-CUDA answer) within
# 60 s, and the step is skipped with that line.
gpu_step() {
    local name=$1 limit=$2 expect=$3 wrote=$WROTE left t0 rc
    shift 3
    WROTE=""
    left=$((DEADLINE_S - SECONDS))
    if [ "$MODE" = gpu ] && [ $left -lt 15 ]; then
        record "$name" skipped 0 "out of time: the ${DEADLINE_S} s deadline was reached"
        return
    fi
    [ "$MODE" = gpu ] || limit=60
    [ $limit -gt $left ] && [ $left -gt 0 ] && limit=$left
    t0=$SECONDS
    echo "\$ $*" > "$LOGS/$name.log"
    timeout -k 5 "$limit" "$@" >> "$LOGS/$name.log" 2>&1
    rc=$?
    append_log "$name" "exit $rc"
    if [ "$MODE" != gpu ]; then
        if [ $rc -ne 124 ] && [ $rc -ne 137 ] && grep -qE -- "$expect" "$LOGS/$name.log"; then
            record "$name" skipped $((SECONDS - t0)) "no CUDA device; rehearsed: $(grep -E -- "$expect" "$LOGS/$name.log" | tail -n 1 | cut -c1-160)"
        else
            record "$name" failed $((SECONDS - t0)) "rehearsal did not print '$expect' (exit $rc): $(last_line "$LOGS/$name.log")"
        fi
    elif [ $rc -eq 0 ]; then
        record "$name" ran $((SECONDS - t0)) "${wrote:+$wrote; }last line: $(last_line "$LOGS/$name.log")"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        record "$name" failed $((SECONDS - t0)) "timed out after $limit s: $(last_line "$LOGS/$name.log")"
    else
        record "$name" failed $((SECONDS - t0)) "exit $rc: $(last_line "$LOGS/$name.log")"
    fi
}
WROTE=""

# --- env
t0=$SECONDS
{
    python3 - <<'PY'
import platform, sys
print("python", platform.python_version(), sys.executable)
import numpy, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "numpy", numpy.__version__)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton not installed")
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
else:
    print("gpu none")
PY
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    command -v nvidia-smi >/dev/null && nvidia-smi -L
} > "$LOGS/env.log" 2>&1
rc=$?
append_log env "exit $rc"
env_note=$(grep -E '^(python|torch|triton|gpu) ' "$LOGS/env.log" | cut -d' ' -f1-4 | paste -sd';' -)
if grep -q '^torch ' "$LOGS/env.log"; then
    record env ran $((SECONDS - t0)) "$env_note"
else
    record env failed $((SECONDS - t0)) "python3 has no torch: $(last_line "$LOGS/env.log")"
fi

# --- flashinfer-install: .whl/*.whl (apache-tvm-ffi) and .whl/flashinfer-*-sampling.tar.xz
t0=$SECONDS
shopt -s nullglob
wheels=("$CARRY_DIR"/*.whl)
bundles=("$CARRY_DIR"/flashinfer-*-sampling.tar.xz)
shopt -u nullglob
FLASHINFER=0
if [ ${#bundles[@]} -eq 0 ]; then
    note="no FlashInfer bundle in ${CARRY_DIR#"$ROOT"/} (python scripts/flashinfer_carry.py makes it; carry .whl): the benchmarks run without FlashInfer"
    echo "$note" > "$LOGS/flashinfer-install.log"
    append_log flashinfer-install skipped
    record flashinfer-install skipped $((SECONDS - t0)) "$note"
elif [ "$MODE" != gpu ]; then
    note="no CUDA device; rehearsed: found ${bundles[*]##*/} and ${#wheels[@]} wheel(s), installs nothing"
    echo "$note" > "$LOGS/flashinfer-install.log"
    append_log flashinfer-install rehearsed
    record flashinfer-install skipped $((SECONDS - t0)) "$note"
else
    {
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$FI_SITE" "${wheels[@]}" \
        && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
            "${bundles[0]}" "$FI_SITE"
    } > "$LOGS/flashinfer-install.log" 2>&1
    rc=$?
    append_log flashinfer-install "exit $rc"
    if [ $rc -eq 0 ]; then
        FLASHINFER=1
        record flashinfer-install ran $((SECONDS - t0)) "${bundles[0]##*/} and ${#wheels[@]} wheel(s) into $FI_SITE"
    else
        record flashinfer-install failed $((SECONDS - t0)) "exit $rc: $(last_line "$LOGS/flashinfer-install.log")"
    fi
fi

# --- flashinfer-jit: its first calls build the JIT "sampling" module (sampling.cu,
# renorm.cu, the binding) with the machine's nvcc, for sm_90 only; the build is cached under
# ~/.cache/flashinfer, so the benchmarks that follow load it.
FI_JIT='
import sys, time
try:
    import flashinfer
    import flashinfer.sampling as fis
except Exception as error:
    print(f"flashinfer not importable: {type(error).__name__}: {error}")
    sys.exit(3)
import torch
start = time.perf_counter()
probs = torch.full((2, 1000), 1e-3, device="cuda")
fis.sampling_from_probs(probs)
draft = torch.full((2, 3, 1000), 1e-3, device="cuda")
target = torch.full((2, 4, 1000), 1e-3, device="cuda")
fis.chain_speculative_sampling(draft, torch.zeros(2, 3, dtype=torch.int32, device="cuda"), target)
torch.cuda.synchronize()
print(f"flashinfer {flashinfer.__version__}: sampling kernels compiled and run in "
      f"{time.perf_counter() - start:.0f} s")
'
JIT_PID=""
if [ "$MODE" != gpu ]; then
    # The snippet itself, up to its import of flashinfer (not on this path here).
    gpu_step flashinfer-jit 60 "flashinfer not importable" python3 -c "$FI_JIT"
elif [ $FLASHINFER = 0 ]; then
    record flashinfer-jit skipped 0 "FlashInfer not installed (see flashinfer-install)"
else
    JIT_T0=$SECONDS
    echo "\$ python3 -c \"\$FI_JIT\"  (budget ${FLASHINFER_JIT_BUDGET_S} s, beside cuda-tests)" > "$LOGS/flashinfer-jit.log"
    ( export PYTHONPATH="$FI_SITE:$PYTHONPATH" FLASHINFER_CUDA_ARCH_LIST="9.0"
      timeout -k 5 "$FLASHINFER_JIT_BUDGET_S" python3 -c "$FI_JIT" >> "$LOGS/flashinfer-jit.log" 2>&1
      echo "$? $((SECONDS - JIT_T0))" > "$LOGS/flashinfer-jit.rc" ) &
    JIT_PID=$!
fi

join_flashinfer_jit() {
    [ -n "$JIT_PID" ] || return
    wait "$JIT_PID"
    local rc seconds  # its own seconds, not the wait's
    read -r rc seconds < "$LOGS/flashinfer-jit.rc" || { rc=1; seconds=$((SECONDS - JIT_T0)); }
    append_log flashinfer-jit "exit $rc"
    if [ "$rc" = 0 ]; then
        export PYTHONPATH="$FI_SITE:$PYTHONPATH"
        record flashinfer-jit ran "$seconds" "$(last_line "$LOGS/flashinfer-jit.log")"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        record flashinfer-jit skipped "$seconds" "the JIT build passed its ${FLASHINFER_JIT_BUDGET_S} s budget and was stopped: the benchmarks run without FlashInfer"
    else
        record flashinfer-jit failed "$seconds" "exit $rc: $(last_line "$LOGS/flashinfer-jit.log"); the benchmarks run without FlashInfer"
    fi
    JIT_PID=""
}

# --- the CUDA tests (everything else runs in CI on CPU). FASTSAMPLE_BACKEND=auto takes the
# Triton kernels for CUDA tensors; cuda-tests-torch checks the torch ops' graph capture.
COLLECT=()
[ "$MODE" = gpu ] || COLLECT=(--collect-only)
COLLECTED="tests? collected( \([0-9]+ deselected\))? in "  # and no collection error
CUDA_TESTS=(tests/test_cuda_graphs.py tests/ops/test_philox.py tests/ops/test_seeds.py
            tests/test_exactness.py tests/test_bad_input.py tests/verify tests/ops/test_small_top_k.py
            tests/kernels/test_triton_cuda_agreement.py tests/kernels/test_triton_stages_cuda.py)
gpu_step cuda-tests 150 "$COLLECTED" \
    python3 -m pytest -q -rs -p no:cacheprovider "${COLLECT[@]}" "${CUDA_TESTS[@]}" \
    -k "cuda or capture or graph or device_mismatch"

join_flashinfer_jit
NO_CUDA_BENCH="no CUDA device here"
WROTE="sampling-cuda.json (key figures below)"
gpu_step sampling-cuda 120 "$NO_CUDA_BENCH" \
    python3 -m fastsample.tools.bench.sampling_cuda --repeats 5 --json "$OUT/sampling-cuda.json"
WROTE="verify-cuda.json (key figures below)"
gpu_step verify-cuda 90 "$NO_CUDA_BENCH" \
    python3 -m fastsample.tools.bench.verify_cuda --repeats 5 --json "$OUT/verify-cuda.json"
NO_CUDA_CLI="--device cuda, but torch.cuda.is_available\(\) is False"
gpu_step launches 45 "$NO_CUDA_CLI" python3 -m fastsample bench --launches --device cuda
gpu_step cuda-tests-torch 60 "$COLLECTED" env FASTSAMPLE_BACKEND=torch \
    python3 -m pytest -q -rs -p no:cacheprovider "${COLLECT[@]}" tests/test_cuda_graphs.py
gpu_step selfcheck 90 "$NO_CUDA_CLI" python3 -m fastsample selfcheck --device cuda
WROTE="bench-cuda.json"
gpu_step bench 60 "$NO_CUDA_CLI" \
    python3 -m fastsample bench --device cuda --quick --json "$OUT/bench-cuda.json"
gpu_step radix-keys-probe 30 "$NO_CUDA_BENCH" python3 scripts/cuda_radix_keys_probe.py

write_summary final
rm -rf "$LOGS"
echo
cat "$OUT/summary.md"
failed=0
for status in "${STATUS[@]}"; do [ "$status" = failed ] && failed=1; done
[ "$MODE" = no-cuda ] && failed=1
exit $failed
