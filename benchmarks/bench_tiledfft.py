"""Benchmark: the tiledfft backend on the GPU, each basis (8, 16, 32), against winograd (F(2x2) and
F(4x4)) and cuDNN strict fp32 (PyTorch's, benchmark mode over every algorithm, TF32 off) on the
large-plane 3x3 layers of VGG-16 (batch 64) and ResNet's 3x3 64 at 56^2 (batch 128), in one process.

Per layer, pass and implementation: the relative error against float64 (PyTorch, same operands;
every CuPy allocation NaN-filled before the checked call, harness.poisoned), the median time (CUDA
events after warm-up) and the effective TFLOP/s (direct-convolution FLOPs 2*S*f*f'*9*oh*ow over the
time), beside the device's strict fp32 SGEMM rate measured in the same run. For fprop, each basis's
stages timed apart (window transform, GEMM, inverse; one chunk) to say where its time goes.

  python -m benchmarks.bench_tiledfft                   # the four layers (~1 min on an H100)
  python -m benchmarks.bench_tiledfft --layers vgg16.conv3_2 --repeat 20

Writes results/<device>/bench_tiledfft.json and .md (--out for another folder). Exit status 1 if a
tiledfft result is further than --tol from float64.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

from minitorch_fft.backends import cgemm, fbfft_plan, tiledfft, winograd
from benchmarks.bench_winograd import ceilings
from benchmarks.harness import (PASSES, RESULTS_DIR, median_ms, poisoned, provenance, reference64, rel_error,
                                set_tf32, setup_cudnn, write_results)

# -- defaults --------------------------------------------------------------------------------
WARMUP = 2
REPEAT = 7
TOL = 1e-5
# name: (f, f', h = w, batch); 3x3, stride 1, padding 1
LAYERS = {
    "vgg16.conv1_2": (64, 64, 224, 64),
    "vgg16.conv2_2": (128, 128, 112, 64),
    "vgg16.conv3_2": (256, 256, 56, 64),
    "resnet.layer1": (64, 64, 56, 128),
}
TILED = tuple(f"tiledfft_{n}" for n in tiledfft.BASES)
IMPLS = TILED + ("winograd_f2", "winograd_f4", "cudnn_strict")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--layers", default=",".join(LAYERS), help="comma-separated, of: " + ", ".join(LAYERS))
    parser.add_argument("--batch", type=int, default=None, help="batch size for every layer (default: the table's)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=REPEAT, help="timed runs (default %(default)s)")
    parser.add_argument("--tol", type=float, default=TOL, help="relative error allowed (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random data seed (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default results/)")
    args = parser.parse_args(argv)
    args.layer_names = tuple(n.strip() for n in args.layers.split(",") if n.strip())
    bad = [n for n in args.layer_names if n not in LAYERS]
    if bad:
        parser.error(f"unknown layer(s): {bad}")
    if (args.batch is not None and args.batch < 1) or args.warmup < 0 or args.repeat < 1:
        parser.error("need --batch >= 1, --warmup >= 0, --repeat >= 1")
    return args


def log(*a):
    print(*a, flush=True)


def run_layer(name, args, cp, torch):
    f, fo, hw, batch = LAYERS[name]
    S = args.batch or batch
    xs, ws, pad = (S, f, hw, hw), (fo, f, 3, 3), (1, 1)
    rng = cp.random.default_rng(args.seed)
    x = rng.standard_normal(xs, dtype=cp.float32)
    w = rng.standard_normal(ws, dtype=cp.float32) / np.float32(np.sqrt(9 * f))
    gy = rng.standard_normal((S, fo, hw, hw), dtype=cp.float32)
    ref = reference64(x, w, gy, (1, 1), pad)
    xt, wt, gyt = (torch.from_dlpack(a) for a in (x, w, gy))
    flops = 2 * S * f * fo * 9 * hw * hw
    calls = {"fprop": {}, "bprop": {}, "accgrad": {}}
    for n in tiledfft.BASES:
        calls["fprop"][f"tiledfft_{n}"] = lambda n=n: tiledfft.fprop(x, w, padding=pad, basis=n)
        calls["bprop"][f"tiledfft_{n}"] = lambda n=n: tiledfft.bprop(gy, w, xs, padding=pad, basis=n)
        calls["accgrad"][f"tiledfft_{n}"] = lambda n=n: tiledfft.accgrad(gy, x, ws, padding=pad, basis=n)
    for m in winograd.TILES:
        calls["fprop"][f"winograd_f{m}"] = lambda m=m: winograd.fprop(x, w, padding=pad, tile=m)
        calls["bprop"][f"winograd_f{m}"] = lambda m=m: winograd.bprop(gy, w, xs, padding=pad, tile=m)
        calls["accgrad"][f"winograd_f{m}"] = lambda m=m: winograd.accgrad(gy, x, ws, padding=pad, tile=m)
    calls["fprop"]["cudnn_strict"] = lambda: torch.nn.functional.conv2d(xt, wt, padding=pad)
    calls["bprop"]["cudnn_strict"] = lambda: torch.nn.grad.conv2d_input(xs, wt, gyt, padding=pad)
    calls["accgrad"]["cudnn_strict"] = lambda: torch.nn.grad.conv2d_weight(xt, ws, gyt, padding=pad)
    rows, failed = [], []
    for pn in PASSES:
        row = {"layer": name, "S": S, "f": f, "fo": fo, "hw": hw, "pass": pn}
        for impl, call in calls[pn].items():
            lib = "torch" if impl == "cudnn_strict" else "cupy"
            err = rel_error(call() if lib == "torch" else poisoned(call), ref[pn])
            row[f"err_{impl}"] = err
            if impl in TILED and not err <= args.tol:
                failed.append(f"{name} {pn} {impl}: relative error {err:.2e} > {args.tol}")
            row[f"ms_{impl}"] = median_ms(call, lib, args.warmup, args.repeat)
            row[f"tflops_{impl}"] = flops / row[f"ms_{impl}"] / 1e9
            cp.get_default_memory_pool().free_all_blocks()
        best = min(TILED, key=lambda i: row[f"ms_{i}"])
        row["best_tiled"] = best
        row["tiled_vs_cudnn"] = row["ms_cudnn_strict"] / row[f"ms_{best}"]
        row["tiled_vs_winograd"] = min(row["ms_winograd_f2"], row["ms_winograd_f4"]) / row[f"ms_{best}"]
        rows.append(row)
        log(f"{name:14s} {pn:8s} " + "  ".join(f"{impl} {row[f'ms_{impl}']:7.3f} ms err {row[f'err_{impl}']:.1e}"
                                              for impl in IMPLS))
    stages = fprop_stages(cp, x, w, pad, args)
    for st in stages:
        st["layer"] = name
    del ref, xt, wt, gyt
    return rows, stages, failed


def fprop_stages(cp, x, w, pad, args):
    """[{basis, images, ms_forward, ms_gemm, ms_inverse, ...}] of fprop, one chunk (the whole batch
    where it fits): the window transform, the batched GEMM and the inverse timed apart."""
    S, f, h, wd = x.shape
    fo = w.shape[0]
    out = []
    for n in tiledfft.BASES:
        t = tiledfft.tiling((h, wd), (3, 3), n)
        first = tiledfft._chunks(S, tiledfft._spectrum_bytes(t, f + fo))[0]
        xc = x[first]
        y = cp.empty((xc.shape[0], fo, h, wd), dtype=cp.float32)
        wf = tiledfft._weight_spectrum(cp, w, n)
        xf = tiledfft._spectra(cp, xc, pad, t, (n, n))
        yf = cgemm.matmul(cp, xf, wf, op_b="C")
        t_w = median_ms(lambda: tiledfft._weight_spectrum(cp, w, n), "cupy", args.warmup, args.repeat)
        t_fwd = median_ms(lambda: tiledfft._spectra(cp, xc, pad, t, (n, n)), "cupy", args.warmup, args.repeat)
        t_gemm = median_ms(lambda: cgemm.matmul(cp, xf, wf, op_b="C"), "cupy", args.warmup, args.repeat)
        t_inv = median_ms(lambda: tiledfft._write_valid(cp, yf, t, (0, 0), y), "cupy", args.warmup, args.repeat)
        nf = fbfft_plan.stored_frequencies(n)
        gemm_flops = 8 * nf * xf.shape[1] * f * fo          # complex multiply-adds, 8 real FLOPs each
        moved = xc.nbytes + xf.nbytes
        out.append({"basis": n, "images": xc.shape[0], "tiles": xf.shape[1], "ms_weights": t_w, "ms_forward": t_fwd,
                    "ms_gemm": t_gemm, "ms_inverse": t_inv, "gemm_tflops": gemm_flops / t_gemm / 1e9,
                    "forward_gb_per_s": moved / t_fwd / 1e6, "inverse_gb_per_s": (yf.nbytes + y.nbytes) / t_inv / 1e6,
                    "workspace_mib": (xf.nbytes + yf.nbytes) / 2**20})
        del xf, yf, y, wf
        cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None):
    args = parse_args(argv)
    import cupy as cp
    import torch
    from minitorch_fft.backends import tuning
    cudnn_meta = setup_cudnn(torch)
    set_tf32("strict")
    if cgemm.mode(cp) != "fp32":
        sys.exit("bench_tiledfft: the tf32 setting is on; this benchmark measures strict fp32")
    device = tuning.device_name(cp)
    peak, copy_gbs = ceilings(cp)
    log(f"{device}: strict fp32 SGEMM 8192^3 {peak:.1f} TFLOP/s, copy {copy_gbs:.0f} GB/s")
    rows, stages, failed = [], [], []
    for name in args.layer_names:
        r, s, fl = run_layer(name, args, cp, torch)
        rows += r
        stages += s
        failed += fl
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    meta = provenance(device, cupy=cp.__version__, torch=torch.__version__, **cudnn_meta,
                      sgemm_fp32_tflops=round(peak, 2), copy_gb_per_s=round(copy_gbs, 1),
                      warmup=args.warmup, repeat=args.repeat, tol=args.tol)
    columns = [("layer", "layer", ""), ("S", "S", ""), ("pass", "pass", "")]
    for impl in IMPLS:
        columns += [(f"{impl} ms", f"ms_{impl}", ".3f"), (f"{impl} TFLOP/s", f"tflops_{impl}", ".1f"),
                    (f"{impl} err", f"err_{impl}", ".1e")]
    columns += [("best tiled", "best_tiled", ""), ("best tiled / cuDNN", "tiled_vs_cudnn", ".2f"),
                ("best tiled / best winograd", "tiled_vs_winograd", ".2f")]
    stage_columns = [("layer", "layer", ""), ("basis", "basis", ""), ("images", "images", ""),
                     ("tiles", "tiles", ""), ("weights ms", "ms_weights", ".3f"), ("forward ms", "ms_forward", ".3f"),
                     ("forward GB/s", "forward_gb_per_s", ".0f"), ("GEMM ms", "ms_gemm", ".3f"),
                     ("GEMM TFLOP/s", "gemm_tflops", ".1f"), ("inverse ms", "ms_inverse", ".3f"),
                     ("inverse GB/s", "inverse_gb_per_s", ".0f"), ("workspace MiB", "workspace_mib", ".0f")]
    notes = (f"Effective TFLOP/s = direct-convolution FLOPs (2*S*f*f'*9*oh*ow) / time; the device's strict fp32 "
             f"SGEMM (8192^3, cuBLAS) ran at {peak:.1f} TFLOP/s and a copy at {copy_gbs:.0f} GB/s in this run. "
             "Ratios > 1: the best tiledfft basis is faster. Errors: ||out - ref|| / ||ref|| against PyTorch "
             "float64 on the same operands. Stages: GEMM TFLOP/s counts 8 real FLOPs per complex multiply-add; "
             "GB/s counts bytes read + written (forward: planes + spectra, inverse: spectra + output).")
    paths = write_results("bench_tiledfft", meta, rows, columns, "Tiled FFT (bases 8, 16, 32) against winograd "
                          "and cuDNN strict fp32", notes=notes, out_dir=args.out,
                          sections=[("fprop stages (one chunk)", stages, stage_columns)],
                          extra={"stages": stages, "failed": failed})
    log("\n" + "\n".join(
        f"{r['layer']:14s} {r['pass']:8s} " + " ".join(f"t{n} {r[f'ms_tiledfft_{n}']:6.2f}" for n in tiledfft.BASES)
        + f"  wF2 {r['ms_winograd_f2']:6.2f} wF4 {r['ms_winograd_f4']:6.2f} cudnn {r['ms_cudnn_strict']:6.2f} ms"
        f"  best/cudnn {r['tiled_vs_cudnn']:.2f}x best/wino {r['tiled_vs_winograd']:.2f}x"
        f"  err {max(r[f'err_{i}'] for i in TILED):.1e}" for r in rows))
    log("\n".join(f"{s['layer']:14s} n={s['basis']:2d} fwd {s['ms_forward']:.3f} gemm {s['ms_gemm']:.3f} "
                  f"({s['gemm_tflops']:.1f} TF/s) inv {s['ms_inverse']:.3f} ms, {s['images']} images" for s in stages))
    log(f"wrote {', '.join(str(p) for p in paths)}")
    if failed:
        log("FAILED:\n" + "\n".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
