#!/usr/bin/env bash
# The fused layer kernels on one GPU, in one go: nvcc's resource report of kernels/fused.cu (in the
# background), the GPU tests of the fused kernels, the eager training step of AlexNet (b128) and
# ResNet-50 (b64) on the gemm backend for this tree and for BEFORE_TREE (the same script times both),
# the CUDA-graph tests; a before/after table last. Logs go to $OUT (or /tmp).
#   MINITORCH_COMMIT=<the sha you sent> BEFORE_TREE=<path to the tree before> bash benchmarks/gpu_fused.sh
set -uo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi -L | tee "$out/device.txt"
echo "commit: ${MINITORCH_COMMIT:-not named (set MINITORCH_COMMIT)}" | tee "$out/commit.txt"
(timeout 90 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_compile.py -k fused > "$out/nvcc.log" 2>&1) &
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=5 tests/test_fused.py 2>&1 \
    | tee "$out/pytest_gpu_fused.log" | tail -8
for tree in "${BEFORE_TREE:-}" "$here"; do
    [ -n "$tree" ] || continue
    (cd "$tree" && PYTHONPATH="$tree" timeout 40 python3 "$here/benchmarks/experiments/exp_fused_step.py" \
        alexnet:128 resnet50:64 --tree "$tree") 2>&1 | tee -a "$out/steps.jsonl" | tail -3
done
timeout 40 python3 -m pytest -m gpu -v -p no:cacheprovider -rf tests/test_graphs.py 2>&1 \
    | tee "$out/pytest_gpu_graphs.log" | tail -4
wait
grep -E "fused.cu:|passed|failed|skipped" "$out/nvcc.log" | tail -16
python3 - "$out/steps.jsonl" "$here" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {(r["model"], r["tree"] == sys.argv[2]): r for r in rows}
print("model      batch  before ms  after ms  change")
for (model, after), r in sorted(by.items()):
    b = by.get((model, False))
    if after and b:
        print(f"{model:10s} {r['batch']:5d}  {b['median_ms']:9.2f}  {r['median_ms']:8.2f}  {r['median_ms'] - b['median_ms']:+7.2f}")
PY
