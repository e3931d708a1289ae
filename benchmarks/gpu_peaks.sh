#!/usr/bin/env bash
# Issue 19's peak-memory targets in TF32 mode on a lent GPU, in one call (session 23's branch
# s23-peaks: winograd's fprop/bprop chunks bounded by their operands, the adapter's backward
# accGrad first): where the converted AlexNet and OverFeat-fast steps peak against the stock ones
# (exp_adapter_peak --tf32), then bench_pytorch's four rows for both networks on the same tuning
# cache; the short table last. The GPU tests are gpu_all.sh's (a call of their own). Logs and
# result files go to $OUT (or /tmp) as one tarball (8 files come back from a lent machine).
#   MINITORCH_COMMIT=<sha sent> bash benchmarks/gpu_peaks.sh       (6-9 minutes with cold caches)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}   # keeps a carried wheel's site (cuDNN)
out=${OUT:-/tmp}
results=/tmp/minitorch_peaks
mkdir -p "$results"
nvidia-smi -L | tee "$out/device.txt"
echo "commit: ${MINITORCH_COMMIT:-not named (set MINITORCH_COMMIT)}" | tee "$out/commit.txt"
export MINITORCH_TUNE_CACHE=/tmp/peaks_tune.json   # the experiment's TF32 tuning serves the bench's TF32 rows
for net in alexnet:100 overfeat_fast:170; do
    timeout "${net#*:}" python3 benchmarks/experiments/exp_adapter_peak.py passes --net "${net%:*}" --tf32 \
        --modes stock inputs=False > "$results/exp_adapter_peak_${net%:*}_tf32.log" 2>&1
    echo "exp_adapter_peak ${net%:*} rc $?"
done
timeout 300 python3 -m benchmarks.bench_pytorch --nets alexnet,overfeat_fast --out "$results" \
    > "$results/bench_pytorch.log" 2>&1
echo "bench_pytorch rc $?"
tar czf "$out/results.tgz" -C "$results" .
echo; echo "== summary (commit ${MINITORCH_COMMIT:-?}) =="
grep -hE "^(stock|inputs=False): peak|^    peak \+" "$results"/exp_adapter_peak_*_tf32.log
grep -hE "^\| (alexnet|overfeat_fast) " "$results"/*/bench_pytorch_*.md
grep -hE "SHORTFALL" "$results/bench_pytorch.log"
