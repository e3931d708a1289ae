"""Experiment (not a benchmark of record): the tiledfft backend's error against float64, per basis.

tiledfft's NumPy path (float32 transforms, complex64 GEMM: the arithmetic its CUDA kernels
do) runs its three passes with each basis (8, 16, 32) on every distinct 3x3 and 5x5 stride-1
convolution of the zoo (AlexNet, OverFeat-fast, VGG-16, ResNet-18/50) at a small batch, and on
random stride-1 geometries, against PyTorch float64. Weights are scaled by 1/sqrt(f kh kw) as a
layer's initialisation. On the CPU: the error is a property of the arithmetic, not of the device.

  python -m benchmarks.experiments.exp_tiledfft_error               # ~3 min on one core
  python -m benchmarks.experiments.exp_tiledfft_error --batch 1 --random 10

Writes results/<cpu>/experiments/exp_tiledfft_error.{json,md}. Exit status 1 if any error is
above --tol.
"""
import argparse
import platform
import sys
from pathlib import Path

import numpy as np

from minitorch_fft.backends import tiledfft
from benchmarks.harness import PASSES, RESULTS_DIR, distinct_conv_layers, provenance, reference64, rel_error, \
    write_results

NETWORKS = ("alexnet", "overfeat_fast", "vgg16", "resnet18", "resnet50")
KERNELS = (3, 5)
TOL = 1e-5


def zoo_layers(batch):
    """[(names, x shape, w shape, padding)]: each distinct stride-1 3x3 or 5x5 geometry once."""
    found = {}
    for net in NETWORKS:
        for name, xs, ws, stride, pad, _ in distinct_conv_layers(net, batch):
            if stride == (1, 1) and ws[2] == ws[3] and ws[2] in KERNELS:
                found.setdefault((xs, ws, pad), []).append(f"{net}.{name}")
    return [(", ".join(names), xs, ws, pad) for (xs, ws, pad), names in found.items()]


def random_layers(count, rng):
    """count random stride-1 geometries: kernels 1-15, planes 1-80, up to 64 planes each side."""
    out = []
    for i in range(count):
        kh, kw = (int(v) for v in rng.integers(1, 16, 2))
        ph, pw = int(rng.integers(0, kh + 1)), int(rng.integers(0, kw + 1))
        h, w = int(rng.integers(max(1, kh - 2 * ph), 81)), int(rng.integers(max(1, kw - 2 * pw), 81))
        S, f, fo = int(rng.integers(1, 5)), int(rng.integers(1, 65)), int(rng.integers(1, 65))
        out.append((f"random {i}", (S, f, h, w), (fo, f, kh, kw), (ph, pw)))
    return out


def errors(xs, ws, pad, rng):
    """[{basis, err_<pass>}] of every basis that takes the kernel, and the default basis per pass."""
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float32)
    oh, ow = xs[2] + 2 * pad[0] - ws[2] + 1, xs[3] + 2 * pad[1] - ws[3] + 1
    gy = rng.standard_normal((xs[0], ws[0], oh, ow)).astype(np.float32)
    ref = {k: v.numpy() for k, v in reference64(x, w, gy, (1, 1), pad).items()}
    rows = []
    for n in tiledfft.BASES:
        if max(ws[2:]) > n - 1:
            continue
        got = {"fprop": tiledfft.fprop(x, w, padding=pad, basis=n),
               "bprop": tiledfft.bprop(gy, w, xs, padding=pad, basis=n),
               "accgrad": tiledfft.accgrad(gy, x, ws, padding=pad, basis=n)}
        rows.append({"basis": n, **{f"err_{pn}": rel_error(got[pn], ref[pn]) for pn in PASSES}})
    default = {"fprop": tiledfft.basis((oh, ow), ws[2:]), "bprop": tiledfft.basis(xs[2:], ws[2:]),
               "accgrad": tiledfft.basis((oh, ow), ws[2:])}
    return rows, "/".join(str(default[pn]) for pn in PASSES)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="the zoo layers' batch (default %(default)s)")
    parser.add_argument("--random", type=int, default=40, help="random geometries (default %(default)s)")
    parser.add_argument("--tol", type=float, default=TOL, help="error reported as failing above (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    for kind, layers in (("zoo", zoo_layers(args.batch)), ("random", random_layers(args.random, rng))):
        for label, xs, ws, pad in layers:
            per_basis, default = errors(xs, ws, pad, rng)
            for r in per_basis:
                row = {"set": kind, "layer": label, "x": str(xs), "w": str(ws), "pad": str(pad),
                       "default_basis": default, **r}
                rows.append(row)
                print(f"{label[:40]:40s} x {str(xs):22s} w {str(ws):20s} n {r['basis']:2d} " +
                      "  ".join(f"{pn} {r[f'err_{pn}']:.2e}" for pn in PASSES), flush=True)
    summary = []
    for kind in ("zoo", "random"):
        for n in tiledfft.BASES:
            mine = [r for r in rows if r["set"] == kind and r["basis"] == n]
            if mine:
                summary.append({"set": kind, "basis": n, "geometries": len(mine),
                                **{f"max_{pn}": max(r[f"err_{pn}"] for r in mine) for pn in PASSES}})
    meta = provenance(f"cpu ({platform.machine()}, NumPy float32)", numpy=np.__version__)
    columns = [("set", "set", ""), ("layer", "layer", ""), ("x", "x", ""), ("w", "w", ""), ("pad", "pad", ""),
               ("basis", "basis", "d"), ("default basis f/b/a", "default_basis", "")] + \
        [(f"{pn} error", f"err_{pn}", ".2e") for pn in PASSES]
    summary_columns = [("set", "set", ""), ("basis", "basis", "d"), ("geometries", "geometries", "d")] + \
        [(f"max {pn} error", f"max_{pn}", ".2e") for pn in PASSES]
    write_results("exp_tiledfft_error", meta, summary, summary_columns,
                  "tiledfft: error against float64 by basis", out_dir=args.out, subdir="experiments",
                  sections=[("every geometry", rows, columns)], extra={"geometries": rows},
                  notes=f"tiledfft's NumPy path (float32 FFTs, complex64 GEMM) against PyTorch float64; the "
                        f"zoo's distinct stride-1 3x3 and 5x5 layers at batch {args.batch}, and {args.random} "
                        f"random stride-1 geometries (seed {args.seed}).")
    bad = [r for r in rows if not all(r[f"err_{pn}"] <= args.tol for pn in PASSES)]
    for r in bad:
        print(f"above {args.tol}: {r['layer']} basis {r['basis']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
