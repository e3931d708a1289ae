"""Benchmark: the cufft backend against gemm and cuDNN (through PyTorch), every pass, one process.

Layers: the paper's Table 4 (S = 128, no padding) and the stride-1 layers of AlexNet and
OverFeat-fast, batch 128. cuDNN runs twice, with torch.backends.cudnn.benchmark on: strict fp32
(allow_tf32 off for cuDNN and cuBLAS, what the paper compared) and PyTorch's default TF32. Each
implementation's result is checked against a float64 reference (PyTorch on the GPU) before it
is timed; timings are medians of CUDA events after warm-up, on fresh random data per layer.

  python -m benchmarks.bench_cufft                             # every layer (< 8 min on an H100)
  python -m benchmarks.bench_cufft --quick                     # three layers, a smoke test
  python -m benchmarks.bench_cufft --layers table4.L3,alexnet.conv3 --repeat 20
  MINITORCH_CUFFT_TUNE=off python -m benchmarks.bench_cufft   # cufft untuned: smallest basis

Writes results/<device>/bench_cufft.json and .md: median ms per pass; cufft's basis and GEMM
form; speed-ups of cufft over cuDNN strict and TF32; TRED/s, the paper's Table 4 metric
(S f f' kh kw oh ow / time, in 10^12 per second); the extra device memory each pass needs
beyond its inputs (allocator high-water mark); relative errors against float64.

Both independent passes (as the paper timed them) and the fused training step: a second table
times, per layer, fprop + bprop + accGrad as one step inside backends.reuse_spectra() (bprop
reuses fprop's weight spectrum, accGrad fprop's input and bprop's gradient spectra, as in
train.py) against the sum of the three independent passes, for cufft and for fbfft where it
supports the layer, with cuDNN strict's three passes beside them. The fused step's results are
checked against float64 too.
"""
import argparse
import sys
import time
from pathlib import Path

from minitorch_fft.backends import config
from benchmarks.harness import NETWORK_LAYERS as LAYERS
from benchmarks.harness import (PASSES, RESULTS_DIR, cupy_tf32, median_ms, peak_extra_bytes, poisoned,
                                provenance, reference64, rel_error, set_tf32, setup_cudnn, write_results)

# -- defaults --------------------------------------------------------------------------------
BATCH = 128
WARMUP = 3
REPEAT = 10
SEED = 0
QUICK = ("table4.L4", "table4.L5", "alexnet.conv3")
IMPLS = ("cufft", "gemm", "cudnn_strict", "cudnn_tf32")
STEP_IMPLS = ("cufft", "fbfft")    # FFT backends timed as a fused step (fbfft where it supports the layer)
# Largest relative error against float64 that counts as correct (TF32 keeps 10 mantissa bits).
TOLERANCE = {"cufft": 1e-4, "gemm": 1e-4, "cudnn_strict": 1e-4, "cudnn_tf32": 1e-2}

MARKDOWN_COLUMNS = [
    ("layer", "layer", ""), ("pass", "pass", ""), ("basis", "basis", ""), ("GEMM", "gemm_form", ""),
    ("layout", "layout", ""),
    ("cufft ms", "ms_cufft", ".3f"), ("gemm ms", "ms_gemm", ".3f"),
    ("cuDNN strict ms", "ms_cudnn_strict", ".3f"), ("cuDNN TF32 ms", "ms_cudnn_tf32", ".3f"),
    ("x strict", "speedup_strict", ".2f"), ("x TF32", "speedup_tf32", ".2f"),
    ("TRED/s", "tred_cufft", ".2f"), ("cufft MiB", "mib_cufft", ".0f"),
    ("cuDNN strict MiB", "mib_cudnn_strict", ".0f"), ("cufft err", "err_cufft", ".1e"),
]
STEP_COLUMNS = [
    ("layer", "layer", ""), ("backend", "backend", ""),
    ("3 passes ms", "ms_passes", ".3f"), ("step ms", "ms_step", ".3f"), ("x passes", "speedup_step", ".2f"),
    ("spectra reused", "hits", ""), ("cuDNN strict 3 passes ms", "ms_cudnn_strict", ".3f"),
    ("step x strict", "speedup_strict", ".2f"), ("err", "err_max", ".1e"),
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--layers", default=",".join(LAYERS),
                        help="comma-separated layer names (default: all): " + ", ".join(LAYERS))
    parser.add_argument("--quick", action="store_true", help="only " + ", ".join(QUICK))
    parser.add_argument("--batch", type=int, default=BATCH, help="batch size S (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=REPEAT, help="timed runs (default %(default)s)")
    parser.add_argument("--seed", type=int, default=SEED, help="random data seed (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default results/)")
    args = parser.parse_args()
    names = QUICK if args.quick else tuple(n.strip() for n in args.layers.split(",") if n.strip())
    unknown = [n for n in names if n not in LAYERS]
    if unknown or not names:
        parser.error(f"unknown layer(s) {unknown or names}; choose from {', '.join(LAYERS)}")
    if args.batch < 1 or args.warmup < 0 or args.repeat < 1:
        parser.error(f"need --batch >= 1, --warmup >= 0, --repeat >= 1, got {args.batch}, "
                     f"{args.warmup}, {args.repeat}")
    args.names = names
    return args


STEP_NOTES = ("Fused training step (second table): the three passes run back to back inside "
              "backends.reuse_spectra(), as train.py runs them; 3 passes ms = the sum of the independent "
              "passes' medians (first table for cufft); x passes = 3 passes ms / step ms; spectra reused = "
              "FFTs the step did not recompute (3 when every pass is unchunked on one basis); step x "
              "strict = cuDNN strict's three passes / step ms; err = the largest relative error of the "
              "independent and fused results against float64.")


def bench_layer(name, args, tqdm_bar):
    """One row per pass: every implementation checked against float64, then timed and measured."""
    import cupy as cp
    import torch
    import torch.nn.functional as TF

    from minitorch_fft import backends
    from minitorch_fft.backends import cufft, gemm

    f, fo, hw, k, p = LAYERS[name]
    S, pad, stride = args.batch, (p, p), (1, 1)
    oh = hw + 2 * p - k + 1
    rng = cp.random.default_rng(args.seed + list(LAYERS).index(name))  # fresh data per layer
    x = rng.standard_normal((S, f, hw, hw), dtype=cp.float32)
    w = rng.standard_normal((fo, f, k, k), dtype=cp.float32)
    gy = rng.standard_normal((S, fo, oh, oh), dtype=cp.float32)
    xt, wt, gyt = (torch.from_dlpack(a) for a in (x, w, gy))       # the same memory, no copy

    reference = reference64(x, w, gy, stride, pad)

    def ours(backend):
        return {"fprop": lambda: backend.fprop(x, w, stride, pad),
                "bprop": lambda: backend.bprop(gy, w, x.shape, stride, pad),
                "accgrad": lambda: backend.accgrad(gy, x, w.shape, stride, pad)}

    cudnn = {"fprop": lambda: TF.conv2d(xt, wt, padding=pad),
             "bprop": lambda: torch.nn.grad.conv2d_input(xt.shape, wt, gyt, padding=pad),
             "accgrad": lambda: torch.nn.grad.conv2d_weight(xt, wt.shape, gyt, padding=pad)}
    runs = {"cufft": (ours(cufft), "cupy"), "gemm": (ours(gemm), "cupy"),
            "cudnn_strict": (cudnn, "torch"), "cudnn_tf32": (cudnn, "torch")}

    rows = {pn: {"layer": name, "pass": pn, "S": S, "f": f, "fo": fo, "h": hw, "w": hw, "k": k,
                 "pad": p, "oh": oh, "ow": oh} for pn in PASSES}
    for impl in IMPLS:
        fns, lib = runs[impl]
        # strict: no TF32 anywhere; otherwise PyTorch's defaults (TF32 on for cuDNN convolutions)
        set_tf32("tf32" if impl == "cudnn_tf32" else "strict")
        for pn in PASSES:
            tqdm_bar.set_postfix_str(f"{name} {impl} {pn}")
            fn, row = fns[pn], rows[pn]
            start = time.perf_counter()
            got = fn()                                   # cufft tunes on this first call
            torch.cuda.synchronize()
            row[f"first_call_s_{impl}"] = time.perf_counter() - start
            if lib == "cupy":                            # checked: the call on NaN-filled memory
                del got
                got = poisoned(fn)
            row[f"err_{impl}"] = rel_error(got, reference[pn])
            del got
            row[f"ms_{impl}"] = median_ms(fn, lib, args.warmup, args.repeat)
            if impl == "cufft":
                cufft.release_buffers()                  # count the scratch buffers it rebuilds
            row[f"mib_{impl}"] = peak_extra_bytes(fn, lib) / 2**20
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()

    reductions = S * f * fo * k * k * oh * oh
    for pn, row in rows.items():
        config = cufft.config_for(pn, x.shape, w.shape, stride, pad, xp=cp)
        row["basis"] = "{}x{}".format(*config["basis"])
        row["gemm_form"] = config["gemm"]
        row["layout"] = config["layout"]
        row["speedup_strict"] = row["ms_cudnn_strict"] / row["ms_cufft"]
        row["speedup_tf32"] = row["ms_cudnn_tf32"] / row["ms_cufft"]
        row["tred_cufft"] = reductions / (row["ms_cufft"] * 1e-3) / 1e12

    # The fused step: cufft's independent passes were timed above; fbfft's are timed here.
    step_rows = []
    for impl in STEP_IMPLS:
        backend = backends.get(impl)
        if not backend.supports(x.shape, w.shape, stride, pad):
            continue
        tqdm_bar.set_postfix_str(f"{name} {impl} step")
        errs = [rows[pn]["err_cufft"] for pn in PASSES] if impl == "cufft" else []
        if impl == "cufft":
            passes_ms = [rows[pn]["ms_cufft"] for pn in PASSES]
        else:
            passes_ms = []
            for pn, fn in ours(backend).items():
                errs.append(rel_error(fn(), reference[pn]))
                passes_ms.append(median_ms(fn, "cupy", args.warmup, args.repeat))
        outputs, cache = fused_step(backend, x, w, gy, stride, pad)
        errs += [rel_error(out, reference[pn]) for out, pn in zip(outputs, PASSES)]
        del outputs
        ms_step = median_ms(lambda: fused_step(backend, x, w, gy, stride, pad), "cupy", args.warmup, args.repeat)
        strict = sum(rows[pn]["ms_cudnn_strict"] for pn in PASSES)
        step_rows.append({"layer": name, "backend": impl, "ms_passes": sum(passes_ms),
                          **{f"ms_{pn}": ms for pn, ms in zip(PASSES, passes_ms)},
                          "ms_step": ms_step, "speedup_step": sum(passes_ms) / ms_step, "hits": cache.hits,
                          "ms_cudnn_strict": strict, "speedup_strict": strict / ms_step, "err_max": max(errs)})
        if impl == "cufft":
            cufft.release_buffers()
        cp.get_default_memory_pool().free_all_blocks()
    return list(rows.values()), step_rows


def fused_step(backend, x, w, gy, stride, padding):
    """fprop, bprop and accGrad of one layer as a training step runs them, in one reuse_spectra()
    block: bprop reuses fprop's weight spectrum, accGrad fprop's x and bprop's gy spectra.

    Returns ((y, gx, gw), the block's StepCache).
    """
    from minitorch_fft import backends
    with backends.reuse_spectra() as cache:
        out = (backend.fprop(x, w, stride, padding), backend.bprop(gy, w, x.shape, stride, padding),
               backend.accgrad(gy, x, w.shape, stride, padding))
    return out, cache


def main():
    args = parse_args()
    import cupy as cp
    import torch
    from tqdm import tqdm

    from minitorch_fft.backends import tuning

    if not torch.cuda.is_available():
        sys.exit("bench_cufft needs a CUDA GPU visible to PyTorch and CuPy")
    cudnn_setup = setup_cudnn(torch)
    device = tuning.device_name(cp)
    meta = provenance(device, torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                      cupy=cp.__version__, cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                      batch=args.batch, warmup=args.warmup, repeat=args.repeat, seed=args.seed,
                      **cudnn_setup,
                      cufft_tune=config.get("cufft_tune"), cupy_tf32=cupy_tf32(cp))

    rows, step_rows = [], []
    bar = tqdm(args.names, desc="layers")
    for name in bar:
        layer_rows, layer_step_rows = bench_layer(name, args, bar)
        rows += layer_rows
        step_rows += layer_step_rows

    failures = [f"{r['layer']} {r['pass']} {impl}: rel err {r[f'err_{impl}']:.1e} > {TOLERANCE[impl]}"
                for r in rows for impl in IMPLS if not r[f"err_{impl}"] <= TOLERANCE[impl]]
    failures += [f"{r['layer']} {r['backend']} (passes or fused step): rel err {r['err_max']:.1e} > "
                 f"{TOLERANCE['cufft']}" for r in step_rows if not r["err_max"] <= TOLERANCE["cufft"]]
    notes = ("Median ms of CUDA events; x strict / x TF32 = cuDNN time / cufft time; TRED/s in "
             "10^12 equivalent time-domain reductions per second; MiB = device memory a pass needs "
             "beyond its inputs (output included); err = relative error of cufft against float64.\n\n"
             + STEP_NOTES)
    if failures:
        notes += "\n\nFAILED correctness checks:\n" + "\n".join(f"- {f}" for f in failures)
    paths = write_results("bench_cufft", meta, rows, MARKDOWN_COLUMNS,
                          title=f"cufft vs gemm vs cuDNN, batch {args.batch}, {device}",
                          notes=notes, out_dir=args.out,
                          sections=[("Fused training step: fprop + bprop + accGrad", step_rows, STEP_COLUMNS)],
                          extra={"step_rows": step_rows})
    print("\n".join(str(p) for p in paths))
    if failures:
        sys.exit("correctness check failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
