#!/usr/bin/env bash
# Issue 17's step-memory work on a lent GPU, in one go: the gpu-marked tests of the files it
# touched, then exp_step_memory's breakdown of AlexNet b128 and ResNet-50 b64 (backend gemm: no
# tuning) for a base tree and for this one, PyTorch strict's peak beside them (in the base run),
# and the short table last. Logs go to $OUT (or /tmp).
#   MINITORCH_COMMIT=<sha sent> BASE=<a checkout to compare with> BASE_COMMIT=<its sha> \
#       bash benchmarks/gpu_step_memory.sh
set -uo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
exp=$here/benchmarks/experiments/exp_step_memory.py
nvidia-smi -L
echo "commit: ${MINITORCH_COMMIT:-not named}; base: $BASE at ${BASE_COMMIT:-not named}" | tee "$out/commit.txt"
PYTHONPATH=. timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_autograd.py tests/test_graphs.py \
    tests/test_harness.py tests/test_gemm.py 2>&1 | tee "$out/pytest_gpu_mem.log" | tail -6
for spec in "alexnet 128 28 20" "resnet50 64 38 22"; do
    set -- $spec
    (cd "$BASE" && PYTHONPATH=. MINITORCH_COMMIT=$BASE_COMMIT timeout "$3" python3 "$exp" --net "$1" --batch "$2" \
        --label "base $BASE_COMMIT" --torch --json "$out/step_memory.jsonl") 2>&1 | tee -a "$out/step_memory.log"
    PYTHONPATH=. timeout "$4" python3 "$exp" --net "$1" --batch "$2" --label "this tree $MINITORCH_COMMIT" \
        --json "$out/step_memory.jsonl" 2>&1 | tee -a "$out/step_memory.log"
done
PYTHONPATH=. python3 "$exp" --table "$out/step_memory.jsonl" 2>&1 | tee "$out/step_memory_table.md"
