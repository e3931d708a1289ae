"""The direct backend's GPU check in one command (< 4 min on an H100 or H200): bench_direct with
every part (configuration check against float64, network layers against gemm and cuDNN, the
single-plane benchmark), tuning from scratch into a temporary cache.

  PYTHONPATH=. python3 benchmarks/gpu_check_direct.py   # then: python3 -m pytest -m gpu tests/test_direct.py
  PYTHONPATH=. python3 benchmarks/gpu_check_direct.py --parts configs   # correctness only (~1 min)

Results go to $OUT/<device>/bench_direct.{json,md} and $OUT/gpu_check_direct.json when OUT is set,
else to results/<device>/. Prints a short table last; exit status 1 if any check failed.
"""
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from any directory

from benchmarks import bench_direct  # noqa: E402


def main():
    os.environ.setdefault("MINITORCH_TUNE_CACHE", os.path.join(tempfile.mkdtemp(), "autotune.json"))
    argv = []
    out = os.environ.get("OUT")
    if out:
        argv += ["--out", out, "--json", os.path.join(out, "gpu_check_direct.json")]
    return bench_direct.main(argv + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
