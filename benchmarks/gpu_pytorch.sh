#!/usr/bin/env bash
# Issue 19's adapter work on a lent GPU, in one go: the gpu-marked tests of tests/test_pytorch.py;
# exp_pytorch_host's breakdown of the adapter's host time and memory (AlexNet b128) for this tree,
# and its whole-step part for a base tree (the same script, public API only); bench_pytorch on
# AlexNet b128, PyTorch strict and converted fp32, eager and CUDA graph; the short table last.
# Logs and the bench's result files go to $OUT (or /tmp). A kept tuning cache saves auto's tuning:
#   MINITORCH_COMMIT=<sha sent> BASE=<older checkout> BASE_COMMIT=<its sha> \
#       MINITORCH_TUNE_CACHE=<autotune.json> bash benchmarks/gpu_pytorch.sh
set -uo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
out=${OUT:-/tmp}
exp=$here/benchmarks/experiments/exp_pytorch_host.py
nvidia-smi -L
echo "commit: ${MINITORCH_COMMIT:-not named}; base: ${BASE:-none} at ${BASE_COMMIT:-not named}; tuning cache: \
${MINITORCH_TUNE_CACHE:-default}" | tee "$out/commit.txt"
timeout 55 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=5 tests/test_pytorch.py \
    > "$out/pytest_gpu.log" 2>&1
echo "pytest rc $?"; tail -12 "$out/pytest_gpu.log"
timeout 50 python3 "$exp" --batch 128 --profile-out "$out/profile_b128.txt" 2>&1 | tee "$out/host_b128.log"
if [ -n "${BASE:-}" ]; then
    (cd "$BASE" && MINITORCH_COMMIT=$BASE_COMMIT timeout 22 python3 "$exp" --batch 128 \
        --step-only) 2>&1 | tee "$out/host_base_b128.log"
fi
timeout 65 python3 -m benchmarks.bench_pytorch --nets alexnet --impls strict,fp32 --out "$out/results" 2>&1 \
    | tee "$out/bench_alexnet.log" | grep -v "^|"
echo; echo "== summary (commit ${MINITORCH_COMMIT:-?}; base ${BASE_COMMIT:-none}) =="
grep -E "passed|failed|error" "$out/pytest_gpu.log" | tail -2
grep -E "^  (alloc|torch|cp\.|adapter|_cuda|enter)|sum \(ms\)|median extra|refused" "$out/host_b128.log"
echo "this tree:"; grep -E "^  (stock|converted)" "$out/host_b128.log"
[ -n "${BASE:-}" ] && { echo "base:"; grep -E "^  (stock|converted)" "$out/host_base_b128.log"; }
grep -E "^\| alexnet" "$out/results"/*/bench_pytorch_alexnet.md
grep -E "SHORTFALL|done" "$out/bench_alexnet.log"
