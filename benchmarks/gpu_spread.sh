#!/usr/bin/env bash
# Single-GPU jobs side by side on a machine with several GPUs: job i runs with
# CUDA_VISIBLE_DEVICES=i and OUT=$OUT/job<i>, all at once, each under a time limit (SPREAD_S, default
# 540 s); then every job's folder goes into one $OUT/spread.tgz (the device tool returns at most 8
# files) and each job's last lines are printed. Every timing a job takes is on its own GPU, side by
# side with its baseline as usual; the host's CPUs are shared, so say so beside host-bound figures.
#   MINITORCH_COMMIT=<sha sent> bash benchmarks/gpu_spread.sh "bash benchmarks/gpu_all.sh" \
#       "bash benchmarks/gpu_tables.sh vgg16 --no-step" "bash benchmarks/gpu_tables.sh resnet18 --no-step"
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
gpus=$(nvidia-smi -L | wc -l)
if [ "$#" -eq 0 ] || [ "$#" -gt "$gpus" ]; then
    echo "gpu_spread.sh: give 1 to $gpus jobs (one per visible GPU), got $#" >&2
    exit 2
fi
nvidia-smi -L
pids=() i=0
for job in "$@"; do
    mkdir -p "$out/job$i"
    echo "job$i on GPU $i: $job" | tee "$out/job$i/job.txt"
    CUDA_VISIBLE_DEVICES=$i OUT="$out/job$i" timeout "${SPREAD_S:-540}" bash -c "$job" \
        > "$out/job$i/stdout.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
done
status=0 i=0
for pid in "${pids[@]}"; do
    wait "$pid"
    code=$?
    echo "job$i: exit $code" | tee -a "$out/job$i/job.txt"
    [ "$code" = 0 ] || status=1
    i=$((i + 1))
done
tar czf "$out/spread.tgz" -C "$out" $(cd "$out" && ls -d job*) && rm -rf "$out"/job*
for ((i = 0; i < $#; i++)); do
    echo "== job$i"
    tar xzOf "$out/spread.tgz" "job$i/stdout.log" | tail -"${SPREAD_TAIL:-12}"
done
exit $status
