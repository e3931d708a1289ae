#!/usr/bin/env bash
# Every GPU check in one go, for a lent GPU with a time limit: the gpu-marked tests, then the
# fbfft kernel check (build info and correctness; bench_fft.py times them). Logs go to $OUT (or /tmp).
#   bash benchmarks/gpu_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi -L
python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=5 tests/ 2>&1 | tee "$out/pytest_gpu.log" | tail -25
python3 benchmarks/gpu_check_fbfft.py --no-timing 2>&1 | tee "$out/gpu_check_fbfft.log" | tail -40
