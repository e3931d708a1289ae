#!/usr/bin/env bash
# The sweep (python -m benchmarks.sweep) on every GPU of one host at once, one shard per GPU, then the
# shards' part files merged into OUT_DIR/<device>/sweep.jsonl. Rerun to resume, as with one GPU.
#   bash benchmarks/sweep_gpus.sh MINUTES OUT_DIR [FIRST_GPU]
# MINUTES is each shard's --max-minutes; FIRST_GPU (default 0) leaves the GPUs below it alone.
# Shard and GPU numbers differ when FIRST_GPU > 0: with G GPUs and FIRST_GPU = k, the N = G - k
# shards 0..N-1 run on GPUs k..G-1 (shard I on GPU k + I, as --shard I/N). Logs and tuning caches are
# named by GPU: OUT_DIR/sweep_gpu<gpu>.log, /tmp/tune_gpu<gpu>.json. Name the commit you sent
# with MINITORCH_COMMIT, as for benchmarks/gpu_all.sh; SWEEP_ARGS passes more options to every
# shard (SWEEP_ARGS=--remeasure-unnamed, SWEEP_ARGS=--quick). Exits non-zero if any shard failed (the
# rows it measured are merged all the same) or the merge failed.
set -uo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    echo "usage: bash benchmarks/sweep_gpus.sh MINUTES OUT_DIR [FIRST_GPU]" >&2
    exit 2
fi
minutes=$1
first=${3:-0}
mkdir -p "$2" || exit 1
out=$(cd "$2" && pwd)                     # before the cd below: OUT_DIR is relative to the caller
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0                 # nothing here uses NCCL; the multi-GPU hosts require it off
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -eq 0 ]; then
    echo "sweep_gpus: nvidia-smi -L lists no GPU" >&2
    exit 1
fi
if ! [[ $first =~ ^[0-9]+$ ]] || [ "$first" -ge "$gpus" ]; then
    echo "sweep_gpus: FIRST_GPU must be a GPU index, 0 to $((gpus - 1)) (of $gpus); got '$first'" >&2
    exit 2
fi
n=$((gpus - first))
echo "sweep_gpus: $n shard(s) on GPUs $first..$((gpus - 1)), $minutes minute(s) each, into $out"
pids=()
for ((gpu = first; gpu < gpus; gpu++)); do
    CUDA_VISIBLE_DEVICES=$gpu MINITORCH_TUNE_CACHE=/tmp/tune_gpu$gpu.json \
        python3 -m benchmarks.sweep run --shard "$((gpu - first))/$n" --max-minutes "$minutes" --out "$out" \
        ${SWEEP_ARGS:-} \
        >"$out/sweep_gpu$gpu.log" 2>&1 &
    pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "sweep_gpus: shard $i/$n (GPU $((first + i))) failed: see $out/sweep_gpu$((first + i)).log" >&2
        failed=1
    fi
done
# A first run leaves part files and no sweep.jsonl yet: the targets are found from the parts.
for dir in "$out"/*/; do
    for stem in sweep sweep_quick; do
        if compgen -G "$dir$stem.part[0-9]*.jsonl" >/dev/null; then
            python3 -m benchmarks.sweep merge "$dir$stem.jsonl" || failed=1
        fi
    done
done
exit "$failed"
