"""Experiment (not a benchmark of record): which interpolation points keep F(4x4,3x3)'s error low.

The winograd backend's NumPy path (float32, the same transforms and tiling as its CUDA kernels)
runs its three passes with each candidate set of finite points (infinity is always the last) on
a few 3x3 layers, against PyTorch float64. On the CPU: the choice is a property of the
arithmetic, not of the device.

  python -m benchmarks.experiments.exp_winograd_points              # ~1 min on one core

Writes results/cpu/experiments/exp_winograd_points.{json,md}.
"""
import argparse
import contextlib
import platform
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

from minitorch_fft.backends import winograd
from benchmarks.harness import PASSES, RESULTS_DIR, provenance, reference64, rel_error, write_results

HALF = Fraction(1, 2)
CANDIDATES = {                      # label: F(4,3)'s five finite points
    "0, +-1, +-2 (Lavin)": (0, 1, -1, 2, -2),
    "0, +-1, +-1/2": (0, 1, -1, HALF, -HALF),
    "0, +-1, 1/2, -2": (0, 1, -1, HALF, -2),
    "0, +-1, -1/2, 2": (0, 1, -1, -HALF, 2),
}
# (x shape, f'): the 3x3 layers' channel counts and planes at batch 1-2, padding 1
LAYERS = (((2, 64, 56, 56), 64), ((1, 256, 28, 28), 256), ((1, 512, 14, 14), 512))


@contextlib.contextmanager
def points(finite):
    """F(4,3) computed on `finite` (and infinity) inside the block."""
    saved = winograd.POINTS[4]
    winograd.POINTS[4] = finite
    winograd.matrices.cache_clear()
    try:
        yield
    finally:
        winograd.POINTS[4] = saved
        winograd.matrices.cache_clear()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    for xs, fo in LAYERS:
        x = rng.standard_normal(xs).astype(np.float32)
        w = (rng.standard_normal((fo, xs[1], 3, 3)) / np.sqrt(9 * xs[1])).astype(np.float32)
        gy = rng.standard_normal((xs[0], fo, xs[2], xs[3])).astype(np.float32)
        ref = {k: v.numpy() for k, v in reference64(x, w, gy, (1, 1), (1, 1)).items()}
        for label, finite in CANDIDATES.items():
            with points(finite):
                got = {"fprop": winograd.fprop(x, w, padding=(1, 1), tile=4),
                       "bprop": winograd.bprop(gy, w, xs, padding=(1, 1), tile=4),
                       "accgrad": winograd.accgrad(gy, x, w.shape, padding=(1, 1), tile=4)}
            row = {"layer": f"x {xs} f' {fo}", "points": label}
            row.update({f"err_{pn}": rel_error(got[pn], ref[pn]) for pn in PASSES})
            rows.append(row)
            print(f"{row['layer']:28s} {label:22s} " + "  ".join(f"{pn} {row[f'err_{pn}']:.2e}" for pn in PASSES),
                  flush=True)
    meta = provenance(f"cpu ({platform.machine()}, NumPy float32)", numpy=np.__version__)
    columns = [("layer", "layer", ""), ("finite points", "points", "")] + \
        [(f"{pn} error", f"err_{pn}", ".2e") for pn in PASSES]
    write_results("exp_winograd_points", meta, rows, columns, "F(4x4,3x3): error against float64 by "
                  "interpolation points", out_dir=args.out, subdir="experiments",
                  notes="The winograd backend's NumPy path (float32), padding 1, against PyTorch float64.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
