"""Benchmark: the winograd backend, F(2x2,3x3) and F(4x4,3x3), against cuDNN strict fp32 on the
3x3 stride-1 layers of VGG-16 (batch 64) and ResNet-18/50 (batch 128), in one process.

Per layer, pass and implementation (winograd F2 and F4, the gemm backend, cuDNN): the relative
error against float64 (PyTorch, same operands; every CuPy allocation NaN-filled before the checked
call, harness.poisoned), the median time (CUDA events after warm-up) and the effective TFLOP/s
(direct-convolution FLOPs 2*S*f*f'*9*oh*ow over the time) beside the device's fp32 ceiling,
measured in the same run as a strict fp32 8192^3 cuBLAS SGEMM (and the copy bandwidth, for the
memory bound). cuDNN runs in benchmark mode over every algorithm with TF32 off
(torch.backends.cudnn.allow_tf32 = False). For fprop of every layer, the time of each stage
(input transform, GEMM, output transform) of each variant; then the largest error of each
variant and pass over random 3x3 geometries.

  python -m benchmarks.bench_winograd                   # every layer (~2 min on an H100)
  python -m benchmarks.bench_winograd --quick           # VGG conv1_2 and conv4_2, fewer repeats
  python -m benchmarks.bench_winograd --layers vgg16.conv4_2 --batch 32

Writes results/<device>/bench_winograd.json and .md (--out for another folder). Exit status 1
if a winograd result is further than --tol from float64.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

from minitorch_fft.backends import cgemm, gemm, winograd
from benchmarks.harness import (PASSES, RESULTS_DIR, median_ms, poisoned, provenance, reference64, rel_error,
                                set_tf32, setup_cudnn, write_results)

# -- defaults --------------------------------------------------------------------------------
WARMUP = 2
REPEAT = 7
TOL = 1e-5          # the auto-eligibility bound (backends/winograd.py)
# name: (f, f', h = w, batch); 3x3, stride 1, padding 1. VGG-16's conv3_3, conv4_3 and conv5_2-3
# repeat conv3_2, conv4_2 and conv5_1; ResNet-50's stride-1 3x3 convolutions (the bottlenecks'
# middle layers) have ResNet-18's geometries.
LAYERS = {
    "vgg16.conv1_1": (3, 64, 224, 64),
    "vgg16.conv1_2": (64, 64, 224, 64),
    "vgg16.conv2_1": (64, 128, 112, 64),
    "vgg16.conv2_2": (128, 128, 112, 64),
    "vgg16.conv3_1": (128, 256, 56, 64),
    "vgg16.conv3_2": (256, 256, 56, 64),
    "vgg16.conv4_1": (256, 512, 28, 64),
    "vgg16.conv4_2": (512, 512, 28, 64),
    "vgg16.conv5_1": (512, 512, 14, 64),
    "resnet.layer1": (64, 64, 56, 128),
    "resnet.layer2": (128, 128, 28, 128),
    "resnet.layer3": (256, 256, 14, 128),
    "resnet.layer4": (512, 512, 7, 128),
}
QUICK = ("vgg16.conv1_2", "vgg16.conv4_2")
RANDOM_GEOMETRIES = 40   # random 3x3 geometries for the error study (S <= 8, f, f' <= 256, planes <= 64)
IMPLS = ("winograd_f2", "winograd_f4", "gemm", "cudnn_strict")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--layers", default=",".join(LAYERS), help="comma-separated, of: " + ", ".join(LAYERS))
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, 3 repeats")
    parser.add_argument("--batch", type=int, default=None, help="batch size for every layer (default: the table's)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=REPEAT, help="timed runs (default %(default)s)")
    parser.add_argument("--tol", type=float, default=TOL, help="relative error allowed (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random data seed (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default results/)")
    args = parser.parse_args(argv)
    args.layer_names = QUICK if args.quick else tuple(n.strip() for n in args.layers.split(",") if n.strip())
    if args.quick:
        args.repeat = min(args.repeat, 3)
    bad = [n for n in args.layer_names if n not in LAYERS]
    if bad:
        parser.error(f"unknown layer(s): {bad}")
    if (args.batch is not None and args.batch < 1) or args.warmup < 0 or args.repeat < 1:
        parser.error("need --batch >= 1, --warmup >= 0, --repeat >= 1")
    return args


def log(*a):
    print(*a, flush=True)


def ceilings(cp):
    """(fp32 TFLOP/s of a strict 8192^3 SGEMM, copy GB/s counting reads and writes), measured."""
    n = 8192
    a, b = (cp.random.standard_normal((n, n), dtype=cp.float32) for _ in range(2))
    ms = median_ms(lambda: cgemm.matmul(cp, a, b, strict=True), "cupy", 2, 5)
    src = cp.random.standard_normal(2**28, dtype=cp.float32)       # 1 GiB
    dst = cp.empty_like(src)
    copy_ms = median_ms(lambda: dst.__setitem__(Ellipsis, src), "cupy", 2, 5)
    return 2 * n**3 / ms / 1e9, 2 * src.nbytes / copy_ms / 1e6


def run_layer(name, args, cp, torch):
    f, fo, hw, batch = LAYERS[name]
    S = args.batch or batch
    xs, ws, pad = (S, f, hw, hw), (fo, f, 3, 3), (1, 1)
    rng = cp.random.default_rng(args.seed)
    x = rng.standard_normal(xs, dtype=cp.float32)
    w = (rng.standard_normal(ws, dtype=cp.float32) / np.float32(np.sqrt(9 * f)))
    gy = rng.standard_normal((S, fo, hw, hw), dtype=cp.float32)
    ref = reference64(x, w, gy, (1, 1), pad)
    xt, wt, gyt = (torch.from_dlpack(a) for a in (x, w, gy))
    flops = 2 * S * f * fo * 9 * hw * hw
    calls = {
        "fprop": {m: (lambda m=m: winograd.fprop(x, w, padding=pad, tile=m)) for m in winograd.TILES},
        "bprop": {m: (lambda m=m: winograd.bprop(gy, w, xs, padding=pad, tile=m)) for m in winograd.TILES},
        "accgrad": {m: (lambda m=m: winograd.accgrad(gy, x, ws, padding=pad, tile=m)) for m in winograd.TILES},
    }
    cudnn = {"fprop": lambda: torch.nn.functional.conv2d(xt, wt, padding=pad),
             "bprop": lambda: torch.nn.grad.conv2d_input(xs, wt, gyt, padding=pad),
             "accgrad": lambda: torch.nn.grad.conv2d_weight(xt, ws, gyt, padding=pad)}
    rows, failed = [], []
    for pn in PASSES:
        row = {"layer": name, "S": S, "f": f, "fo": fo, "hw": hw, "pass": pn}
        for m in winograd.TILES:
            impl = f"winograd_f{m}"
            err = rel_error(poisoned(calls[pn][m]), ref[pn])
            row[f"err_{impl}"] = err
            if not err <= args.tol:
                failed.append(f"{name} {pn} {impl}: relative error {err:.2e} > {args.tol}")
            row[f"ms_{impl}"] = median_ms(calls[pn][m], "cupy", args.warmup, args.repeat)
        ours = {"fprop": lambda: gemm.fprop(x, w, padding=pad), "bprop": lambda: gemm.bprop(gy, w, xs, padding=pad),
                "accgrad": lambda: gemm.accgrad(gy, x, ws, padding=pad)}[pn]
        row["err_gemm"] = rel_error(poisoned(ours), ref[pn])
        row["ms_gemm"] = median_ms(ours, "cupy", args.warmup, args.repeat)
        row["err_cudnn_strict"] = rel_error(cudnn[pn](), ref[pn])
        row["ms_cudnn_strict"] = median_ms(cudnn[pn], "torch", args.warmup, args.repeat)
        for impl in IMPLS:
            row[f"tflops_{impl}"] = flops / row[f"ms_{impl}"] / 1e9
        for m in winograd.TILES:
            row[f"speedup_f{m}"] = row["ms_cudnn_strict"] / row[f"ms_winograd_f{m}"]
        rows.append(row)
        log(f"{name:15s} {pn:8s} " + "  ".join(
            f"{impl} {row[f'ms_{impl}']:7.3f} ms {row[f'tflops_{impl}']:5.1f} TF/s err {row[f'err_{impl}']:.1e}"
            for impl in IMPLS))
    stages = fprop_stages(x, w, pad, args)
    for st in stages:
        st["layer"] = name
    del ref, xt, wt, gyt
    return rows, stages, failed


def random_errors(args, cp, count=RANDOM_GEOMETRIES):
    """[{tile, pass, max_err, worst geometry}] over `count` random 3x3 geometries against float64."""
    rng = np.random.default_rng(args.seed + 1)
    worst = {}
    for _ in range(count):
        S, f, fo = int(rng.integers(1, 9)), int(rng.integers(1, 257)), int(rng.integers(1, 257))
        ph, pw = (int(v) for v in rng.integers(0, 3, 2))
        h, w = (int(v) for v in rng.integers(3, 65, 2))
        xs, ws = (S, f, h, w), (fo, f, 3, 3)
        x = cp.asarray(rng.standard_normal(xs, dtype=np.float32))
        wt = cp.asarray((rng.standard_normal(ws) / np.sqrt(9 * f)).astype(np.float32))
        gy = cp.asarray(rng.standard_normal((S, fo, h + 2 * ph - 2, w + 2 * pw - 2), dtype=np.float32))
        ref = reference64(x, wt, gy, (1, 1), (ph, pw))
        for m in winograd.TILES:
            got = {"fprop": winograd.fprop(x, wt, padding=(ph, pw), tile=m),
                   "bprop": winograd.bprop(gy, wt, xs, padding=(ph, pw), tile=m),
                   "accgrad": winograd.accgrad(gy, x, ws, padding=(ph, pw), tile=m)}
            for pn in PASSES:
                err = rel_error(got[pn], ref[pn])
                if (m, pn) not in worst or not err <= worst[m, pn]["max_err"]:
                    worst[m, pn] = {"tile": m, "pass": pn, "max_err": err, "geometry": f"x {xs} pad {(ph, pw)} f' {fo}"}
    return list(worst.values())


def fprop_stages(x, w, pad, args):
    """[{tile, ms_input, ms_gemm, ms_output, workspace MiB}] of fprop, one chunk (the whole batch
    where it fits): the transform kernels and the batched GEMM timed apart."""
    import cupy as cp
    S, f, h, wd = x.shape
    out = []
    for m in winograd.TILES:
        th, tw = winograd.tiles(h, wd, m)
        first = winograd._conv_chunks("fprop", S, f, w.shape[0], (h, wd), (h, wd), m)[0]
        n = first.stop - first.start
        xc = x[:n]
        u = winograd._weight_transform(cp, w, m)
        v = winograd._input_transform(cp, xc, pad, th, tw, m)
        prod = cgemm.matmul(cp, u, v)
        t_in = median_ms(lambda: winograd._input_transform(cp, xc, pad, th, tw, m), "cupy", args.warmup, args.repeat)
        t_gemm = median_ms(lambda: cgemm.matmul(cp, u, v), "cupy", args.warmup, args.repeat)
        t_out = median_ms(lambda: winograd._output_transform(cp, prod, n, h, wd, m), "cupy", args.warmup,
                          args.repeat)
        gemm_flops = 2 * u.shape[0] * u.shape[1] * u.shape[2] * v.shape[2]
        out.append({"tile": m, "images": n, "ms_input": t_in, "ms_gemm": t_gemm, "ms_output": t_out,
                    "gemm_tflops": gemm_flops / t_gemm / 1e9,
                    "workspace_mib": (v.nbytes + prod.nbytes) / 2**20})
        del v, prod
    return out


def main(argv=None):
    args = parse_args(argv)
    import cupy as cp
    import torch
    from minitorch_fft.backends import tuning
    cudnn_meta = setup_cudnn(torch)
    set_tf32("strict")
    if cgemm.mode(cp) != "fp32":
        sys.exit("bench_winograd: the tf32 setting is on; this benchmark measures strict fp32")
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
    randoms = random_errors(args, cp, 10 if args.quick else RANDOM_GEOMETRIES)
    failed += [f"random {r['geometry']} {r['pass']} F{r['tile']}: relative error {r['max_err']:.2e} > {args.tol}"
               for r in randoms if not r["max_err"] <= args.tol]
    meta = provenance(device, cupy=cp.__version__, torch=torch.__version__, **cudnn_meta,
                      sgemm_fp32_tflops=round(peak, 2), copy_gb_per_s=round(copy_gbs, 1),
                      warmup=args.warmup, repeat=args.repeat, tol=args.tol)
    columns = [("layer", "layer", ""), ("S", "S", ""), ("pass", "pass", "")]
    for impl in IMPLS:
        columns += [(f"{impl} ms", f"ms_{impl}", ".3f"), (f"{impl} TFLOP/s", f"tflops_{impl}", ".1f"),
                    (f"{impl} err", f"err_{impl}", ".1e")]
    columns += [("F2 / cuDNN", "speedup_f2", ".2f"), ("F4 / cuDNN", "speedup_f4", ".2f")]
    stage_columns = [("layer", "layer", ""), ("tile", "tile", ""), ("images", "images", ""),
                     ("input ms", "ms_input", ".3f"), ("GEMM ms", "ms_gemm", ".3f"),
                     ("output ms", "ms_output", ".3f"), ("GEMM TFLOP/s", "gemm_tflops", ".1f"),
                     ("workspace MiB", "workspace_mib", ".0f")]
    notes = (f"Effective TFLOP/s = direct-convolution FLOPs (2*S*f*f'*9*oh*ow) / time; the device's "
             f"strict fp32 SGEMM (8192^3, cuBLAS) ran at {peak:.1f} TFLOP/s and a copy at {copy_gbs:.0f} GB/s "
             f"in this run. Errors: ||out - ref|| / ||ref|| against PyTorch float64 on the same operands.")
    paths = write_results("bench_winograd", meta, rows, columns, "Winograd F(2x2,3x3) and F(4x4,3x3) "
                          "against cuDNN strict fp32", notes=notes, out_dir=args.out,
                          sections=[("fprop stages (one chunk)", stages, stage_columns),
                                    ("Largest error over random geometries", randoms,
                                     [("tile", "tile", ""), ("pass", "pass", ""), ("max error", "max_err", ".1e"),
                                      ("at", "geometry", "")])],
                          extra={"stages": stages, "random": randoms, "failed": failed})
    log("\n" + "\n".join(f"{r['layer']:15s} {r['pass']:8s} F2 {r['speedup_f2']:.2f}x F4 {r['speedup_f4']:.2f}x "
                         f"cudnn {r['tflops_cudnn_strict']:.1f} TF/s  err F2 {r['err_winograd_f2']:.1e} "
                         f"F4 {r['err_winograd_f4']:.1e}" for r in rows))
    log("\n".join(f"random geometries F{r['tile']} {r['pass']:8s} max error {r['max_err']:.1e} at {r['geometry']}"
                   for r in randoms))
    log(f"wrote {', '.join(str(p) for p in paths)}")
    if failed:
        log("FAILED:\n" + "\n".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
