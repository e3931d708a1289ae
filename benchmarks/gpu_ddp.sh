#!/usr/bin/env bash
# Issue #20 on a multi-GPU machine kind, in one go: the data-parallel tests (tests/test_distributed.py,
# gpu-marked: one rank, then every visible GPU), then benchmarks/bench_ddp.py on 1, 2, 4, 8 GPUs (those
# visible). Every process gets NCCL_NVLS_ENABLE=0. Logs and results go to $OUT (or /tmp).
#   MINITORCH_COMMIT=<the sha you sent> bash benchmarks/gpu_ddp.sh [bench_ddp arguments]
#   DDP_TESTS=0 skips the tests (a second call for another network).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp}
nvidia-smi -L
nvidia-smi topo -m > "$out/topo.txt" 2>&1
echo "commit: ${MINITORCH_COMMIT:-not named (set MINITORCH_COMMIT)}" | tee "$out/commit.txt"
if [ "${DDP_TESTS:-1}" = 1 ]; then
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=8 tests/test_distributed.py \
        2>&1 | tee "$out/pytest_gpu_distributed.log" | tail -14
fi
timeout "${BENCH_TIMEOUT_S:-420}" python3 -m benchmarks.bench_ddp --out "$out/results" "$@" 2>&1 \
    | tee "$out/bench_ddp.log" | tail -30
