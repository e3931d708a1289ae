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
# Workers take a file each (the lent machines have pytest-xdist). Session 13: 209 s with five on a machine
# whose kernel caches were warm; on a fresh machine the CUDA compiles come first and five workers ran
# past 330 s, six past 420 s with two tests left: give it a whole call. PYTEST_WORKERS sets the count
# (a machine with more CPU cores). test_reliability's random geometries are the longest test by far
# (290-440 s in one process on an H200, sessions 43-46): the file runs beside the rest in a process of
# its own, started first, its GPU_SHARDS shards on RELIABILITY_WORKERS workers (3), and the rest on
# the workers left; its log is appended to pytest_gpu.log. test_pytorch is the longest file after it
# (past 265 s on one worker in session 59, which left the rest's run waiting on it): it runs in a
# process of its own too, its tests spread over PYTORCH_WORKERS workers (3) by --dist load (83 passed,
# 2 skipped in 116 s on 8 workers, session 59); its log is appended as well. PYTEST_WORKERS (10) bounds
# the three processes' workers together (the rest take what the other two leave, one at least).
workers=${PYTEST_WORKERS:-10}        # in all: test_reliability's, test_pytorch's and the rest's
rworkers=${RELIABILITY_WORKERS:-3}
pworkers=${PYTORCH_WORKERS:-3}
python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=8 -n "$rworkers" --dist load \
    tests/test_reliability.py > "$out/pytest_gpu_reliability.log" 2>&1 &
reliability=$!
python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=8 -n "$pworkers" --dist load \
    tests/test_pytorch.py > "$out/pytest_gpu_pytorch.log" 2>&1 &
adapter=$!
python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=10 \
    -n "$(( workers > rworkers + pworkers + 1 ? workers - rworkers - pworkers : 1 ))" \
    --dist loadfile --ignore=tests/test_reliability.py --ignore=tests/test_pytorch.py tests/ 2>&1 \
    | tee "$out/pytest_gpu.log" | tail -25
rest_rc=${PIPESTATUS[0]}
wait "$adapter"
pytorch_rc=$?
wait "$reliability"
reliability_rc=$?
for part in pytorch reliability; do
    { echo "== tests/test_$part.py, its own process =="; cat "$out/pytest_gpu_$part.log"; } >> "$out/pytest_gpu.log"
    tail -3 "$out/pytest_gpu_$part.log"
done
echo "pytest exit status: the rest $rest_rc, test_pytorch $pytorch_rc, test_reliability $reliability_rc" \
    | tee -a "$out/pytest_gpu.log"
python3 -m benchmarks.gpu_check_fbfft --no-timing --out "$out" 2>&1 | tee "$out/gpu_check_fbfft.log" | tail -40
check_rc=${PIPESTATUS[0]}
exit $(( rest_rc || pytorch_rc || reliability_rc || check_rc ))   # non-zero where any part failed
