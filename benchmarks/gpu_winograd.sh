#!/usr/bin/env bash
# The winograd backend's GPU checks and benchmark in one go, for a lent GPU with a time limit:
# nvcc's resource report of kernels/winograd.cu, the gpu-marked tests that touch the backend
# (its own, the random 3x3 agreement, NVRTC), benchmarks/bench_winograd.py, then auto's gpu tests.
# Logs and results go to $OUT (or /tmp).
#   MINITORCH_COMMIT=<the sha you sent> bash benchmarks/gpu_winograd.sh [bench_winograd arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi -L
echo "commit: ${MINITORCH_COMMIT:-not named (set MINITORCH_COMMIT)}" | tee "$out/commit.txt"
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=5 tests/test_winograd.py \
    tests/test_cuda_compile.py -k "winograd or narrow" tests/test_reliability.py 2>&1 | tee "$out/pytest_gpu_winograd.log" | tail -8
timeout 150 python3 -m benchmarks.bench_winograd --out "$out/results" "$@" 2>&1 | tee "$out/bench_winograd.log" | tail -45
timeout 40 python3 -m pytest -m gpu -q -p no:cacheprovider -rf -x tests/test_auto.py 2>&1 | tee "$out/pytest_gpu_auto.log" | tail -4
