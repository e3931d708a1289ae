"""The direct backend's GPU check in one command (< 4 min on an H100 or H200): bench_direct with
every part (configuration check against float64, network layers against gemm and cuDNN, the
single-plane benchmark), tuning from scratch into a temporary cache unless the setting
tune_cache (MINITORCH_TUNE_CACHE) names one.

  python -m benchmarks.gpu_check_direct                   # then: python -m pytest -m gpu tests/test_direct.py
  python -m benchmarks.gpu_check_direct --parts configs   # correctness only (~1 min)
  python -m benchmarks.gpu_check_direct --out "$OUT"      # results under $OUT instead of results/

With --out DIR, results go to DIR/<device>/bench_direct.{json,md} and DIR/gpu_check_direct.json,
else to results/<device>/. Other arguments go to bench_direct. Prints a short table last; exit
status 1 if any check failed.
"""
import argparse
import os
import sys
import tempfile

from minitorch_fft.backends import config
from benchmarks import bench_direct


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--out", default=None, help="results folder (default results/)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    forwarded = []
    if args.out:
        forwarded += ["--out", args.out, "--json", os.path.join(args.out, "gpu_check_direct.json")]
    cache = config.get("tune_cache") or os.path.join(tempfile.mkdtemp(), "autotune.json")
    with config.override(tune_cache=cache):
        return bench_direct.main(forwarded + rest)


if __name__ == "__main__":
    sys.exit(main())
