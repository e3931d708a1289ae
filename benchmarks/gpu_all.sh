#!/usr/bin/env bash
# Every GPU check in one go, for a lent GPU with a time limit: the gpu-marked tests, then the
# fbfft kernel check (build info and correctness; python -m benchmarks.bench_fft times them). Logs go
# to $OUT (or /tmp).
#   MINITORCH_COMMIT=<the sha you sent> bash benchmarks/gpu_all.sh
# A lent machine's copy of the tree may carry a stale .git: name the commit, and every benchmark's
# provenance (benchmarks/harness.py) records it.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1   # keeps a carried wheel's site (cuDNN)
out=${OUT:-/tmp}
nvidia-smi -L
echo "commit: ${MINITORCH_COMMIT:-not named (set MINITORCH_COMMIT)}" | tee "$out/commit.txt"
# six workers, a file each (the lent H100s have pytest-xdist). Session 13: 209 s with five on a machine
# whose kernel caches were warm; on a fresh machine the CUDA compiles come first and five workers ran
# past 330 s, six past 420 s with two tests left (test_reliability's, 113 s alone): give it a whole call.
# PYTEST_WORKERS sets the count (a machine with more CPU cores).
python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=10 -n "${PYTEST_WORKERS:-6}" --dist loadfile tests/ 2>&1 \
    | tee "$out/pytest_gpu.log" | tail -25
python3 -m benchmarks.gpu_check_fbfft --no-timing --out "$out" 2>&1 | tee "$out/gpu_check_fbfft.log" | tail -40
