#!/usr/bin/env bash
# Experiment (session 24, NOT run yet): does a process that has just tuned its TF32-mode choices run
# the eager step slower than one that reads the same choices from the cache? ResNet-18's TF32 eager
# step in paper.step (tuned in-process) ran at 74.8 % in GPU kernels, 0.88x PyTorch TF32, where
# exp_step_host on a cache ran GPU-bound (benchmarks/NOTES.md, session 24). Two rounds on one machine,
# each: A tunes (a fresh cache), then B reads A's cache; the same steps, profiles and allocations
# (exp_step_host), the short table of each last. Logs go to $OUT (or /tmp).
#   bash benchmarks/experiments/exp_tuned_vs_cached.sh [net]      (resnet18: ~4-6 minutes)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
net=${1:-resnet18}
for round in 1 2; do
    cache=/tmp/tuned_vs_cached_$round.json
    rm -f "$cache"
    for who in A B; do
        MINITORCH_TUNE_CACHE=$cache timeout 280 python3 -m benchmarks.experiments.exp_step_host --net "$net" \
            --top 40 > "$out/exp_step_host_${net}_${round}${who}.log" 2>&1
        rc=$?
        what="reads the cache"
        [ "$who" = A ] && what="tunes"
        echo "round $round $who ($what): rc $rc"
    done
done
for f in "$out"/exp_step_host_"$net"_*.log; do
    echo "== $(basename "$f")"
    sed -n '/^mode /,$p' "$f"
done
