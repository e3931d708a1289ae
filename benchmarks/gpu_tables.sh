#!/usr/bin/env bash
# Issue 17's tables for the zoo's networks on a lent GPU, one network per invocation so that each
# fits one call's 10 minutes: table3 (auto over our algorithms, auto with cudnn, cuDNN strict and
# TF32 through PyTorch), then the training step (eager and CUDA graph, PyTorch strict and TF32,
# peak memory). Tuning every candidate afresh is most of the time (session 11: VGG-16's table3 with
# the TF32 row ran past 285 s, ResNet-50's past 260 s), so the tuning cache is read from $TUNE and
# written back into $OUT: carry it from call to call (`python -m benchmarks.tune_coverage $TUNE`, on the
# CPU, says which networks' choices it holds; `python -m benchmarks.tune_zoo $TUNE --networks N
# --seconds 540`, on the GPU, fills in what it lacks, in a call of its own). --tf32 adds the `auto TF32` rows, table3's
# and the step's (the framework's TF32 mode, its own tuning). --ours adds the step over our own algorithms alone (MINITORCH_AUTO_BACKENDS=ours, issue 18's
# headline; its own result file). Each step has a time limit; what it finished is in $OUT/results.tgz
# (tables) and its log. TABLE3_RUNS=3 times each network three times: each layer-pass's median,
# summed (session 15: a layer-pass of one run now and then 2-6x slower than in the others, ours and
# cuDNN's alike, e.g. ResNet-18's conv12 fprop 1.62 ms against 0.27).
# TABLE3_S and STEP_S set the two limits (330 and 230 s, a call's 10 minutes between them): VGG-16's
# table3 with --tf32 and 3 runs needs TABLE3_S=570 --no-step on a fresh cache (session 24: cut at
# 330 s; 252 s with a warm one); TABLE3_S=1 runs the step alone.
#   MINITORCH_COMMIT=<sha sent> TUNE=.dev/tune/autotune.json bash benchmarks/gpu_tables.sh vgg16 [--tf32] [--no-step] [--ours]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
# The step's kernel fractions run torch.profiler after its rows are timed; Kineto's CUPTI stays
# subscribed after a session unless TEARDOWN_CUPTI=1, and our strict eager steps ran 8-13 % slower then
# (exp_profiler_residue, session 25). With it, a later session re-initialises CUPTI (checked
# beside live CUDA graphs, CUDA 13).
export TEARDOWN_CUPTI=${TEARDOWN_CUPTI:-1}
out=${OUT:-/tmp}
net=${1:?name a network: alexnet, overfeat_fast, vgg16, resnet18 or resnet50}
shift
tf32=() step=1 ours=0
for arg in "$@"; do
    case $arg in
        --tf32) tf32=(--cgemm-tf32) ;;
        --no-step) step=0 ;;
        --ours) ours=1 ;;
        *) echo "unknown option $arg" >&2; exit 2 ;;
    esac
done
# A TUNE that names no file is a mistake, not a cold start: refused before any work (session 29 lost a
# call's tuning to one, a path built from a variable the same command line had just changed)
if [ -n "${TUNE:-}" ] && [ ! -f "$TUNE" ]; then
    echo "gpu_tables.sh: TUNE=$TUNE is not a file (leave TUNE unset to tune afresh)" >&2
    exit 2
fi
nvidia-smi -L | tee "$out/device.txt"
echo "commit: ${MINITORCH_COMMIT:-not named (set MINITORCH_COMMIT)}" | tee "$out/commit.txt"
export MINITORCH_TUNE_CACHE=${TMPDIR:-/tmp}/minitorch_tune.json
[ -n "${TUNE:-}" ] && cp "$TUNE" "$MINITORCH_TUNE_CACHE"   # a file: checked above
# what the carried cache holds of this network's choices (the rest is tuned afresh: the long part)
python3 -m benchmarks.tune_coverage "$MINITORCH_TUNE_CACHE" --networks "$net" 2>&1 | tail -n 1
results=${TMPDIR:-/tmp}/minitorch_results
mkdir -p "$results"
save() {   # the tables and the cache so far, whatever the next step does
    cp "$MINITORCH_TUNE_CACHE" "$out/autotune.json" 2>/dev/null
    tar czf "$out/results.tgz" -C "$results" .
}
timeout "${TABLE3_S:-330}" python3 -m benchmarks.paper table3 --networks "$net" --impls auto "${tf32[@]}" --quick \
    --runs "${TABLE3_RUNS:-1}" --out "$results" > "$out/table3_$net.log" 2>&1
rc=$?; echo "table3 $net: exit $rc"; status=$rc   # the script exits with the first step that failed
ran=("$out/table3_$net.log")   # the logs this run wrote: a reused $OUT may hold an earlier run's others
save
if [ "$step" = 1 ]; then
    timeout "${STEP_S:-230}" python3 -m benchmarks.paper step --networks "$net" "${tf32[@]}" --quick --out "$results" \
        > "$out/step_$net.log" 2>&1
    rc=$?; echo "step $net: exit $rc"; [ "$status" -eq 0 ] && status=$rc
    ran+=("$out/step_$net.log")
    save
fi
if [ "$ours" = 1 ]; then
    MINITORCH_AUTO_BACKENDS=ours timeout "${STEP_S:-230}" python3 -m benchmarks.paper step --networks "$net" --quick \
        --out "$results" > "$out/step_ours_$net.log" 2>&1
    rc=$?; echo "step (ours alone) $net: exit $rc"; [ "$status" -eq 0 ] && status=$rc
    ran+=("$out/step_ours_$net.log")
    save
fi
# the summary, of the steps that ran (until session 60 the last line tested for step_ours's log, and
# the script exited 1 after every run without --ours)
for f in "${ran[@]}"; do
    grep -E "^\| $net \||SHORTFALL|^- " "$f" | grep -v "^- [a-z_]*: " | head -20
done
exit "$status"
