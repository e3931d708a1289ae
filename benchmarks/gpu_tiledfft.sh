#!/usr/bin/env bash
# The tiledfft backend's GPU checks and benchmark in one go, for a lent GPU with a time limit: the
# gpu-marked tests of the backend and of every CUDA source (NVRTC), then benchmarks/bench_tiledfft.py.
# Logs and results go to $OUT (or /tmp).
#   MINITORCH_COMMIT=<the sha you sent> bash benchmarks/gpu_tiledfft.sh [bench_tiledfft arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi -L
echo "commit: ${MINITORCH_COMMIT:-not named (set MINITORCH_COMMIT)}" | tee "$out/commit.txt"
timeout ${PYTEST_LIMIT:-100} python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=8 tests/test_tiledfft.py \
    tests/test_cuda_compile.py 2>&1 | tee "$out/pytest_gpu_tiledfft.log" | tail -14
timeout ${BENCH_LIMIT:-85} python3 -m benchmarks.bench_tiledfft --out "$out/results" "$@" 2>&1 \
    | tee "$out/bench_tiledfft.log" | tail -22
