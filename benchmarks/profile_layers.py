"""Where each layer's time goes: FFT kernels, GEMM, other kernels, and host time no kernel covers.

  python -m benchmarks.profile_layers [--backend fbfft] [--nets alexnet overfeat_fast table4] [--out DIR]

For every convolution of the chosen networks and every pass, the backend runs `--iters` times
under torch.profiler (CUPTI sees CuPy's kernels too: it traces the whole CUDA context). Kernel
time is summed by category from the kernel names:

  fft    our FFT kernels (fbfft_*) and cuFFT's (regular_fft, vector_fft, ... from libcufft)
  gemm   cuBLAS / CUTLASS kernels (names with gemm, sm90_xmma, cutlass)
  other  everything else: elementwise copies, conj, transposes, reductions, our direct kernels,
         the cufft backend's own place / crop / transpose kernels (kernels/cufft.cu: cufft_*)

wall is the median of CUDA events around one call; host = wall - kernel time, the part of the
call in which the GPU waits for Python (a negative value only means overlapping kernels).
Layers the backend does not support (stride > 1) run on `--strided` (polyphase), else `direct`. Results go to
results/<device>/profile_<backend>.{json,md}.
"""
import argparse

from benchmarks.harness import (BATCH, PASSES, RESULTS_DIR, TABLE4, Layer, conv_layers, provenance, setup_cudnn,
                                write_results)

CATEGORIES = ("fft", "gemm", "other")


def category(kernel_name):
    name = kernel_name.lower()
    if name.startswith("cufft_"):       # the cufft backend's own place, crop and transpose kernels
        return "other"
    if name.startswith("fbfft") or "fft" in name:
        return "fft"
    if "gemm" in name or "xmma" in name or "cutlass" in name:
        return "gemm"
    return "other"


def kernel_times(fn, iters):
    """{category: device ms per call} and the number of kernels per call."""
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        cp.cuda.Device().synchronize()
    sums, count = dict.fromkeys(CATEGORIES, 0.0), 0
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.name.startswith(("Memcpy", "Memset")):
            continue
        sums[category(e.name)] += e.device_time / 1e3 / iters
        count += 1
    return sums, count / iters


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="fbfft")
    parser.add_argument("--strided", default="polyphase", help="backend for the layers --backend cannot take")
    parser.add_argument("--nets", nargs="+", default=["table4", "alexnet", "overfeat_fast"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import cupy as cp
    import torch
    from tqdm import tqdm

    from minitorch_fft import backends
    from minitorch_fft.backends import tuning
    cudnn_setup = setup_cudnn(torch)
    torch.backends.cudnn.allow_tf32 = False      # strict: the baseline this profile compares with
    specs = []
    for net in args.nets:
        if net == "table4":
            specs += [(f"table4.{k}", (BATCH, f, hw, hw), (fo, f, kk, kk), (1, 1), (0, 0))
                      for k, (f, fo, hw, kk) in TABLE4.items()]
        else:
            specs += [(f"{net}.{n}", xs, ws, s, p) for n, xs, ws, s, p in conv_layers(net, BATCH)]
    rows = []
    for i, (name, xs, ws, s, p) in enumerate(tqdm(specs, desc="layers")):
        layer = Layer(xs, ws, s, p, seed=args.seed + i)
        chosen = next(n for n in (args.backend, args.strided, "direct") if backends.get(n).supports(xs, ws, s, p))
        backend = backends.get(chosen)
        for pn in PASSES:
            fn = layer.ours(backend, pn)
            wall, err = layer.measure(fn, "cupy", pn, 1e-4, args)
            ks, launches = kernel_times(fn, args.iters)
            flagged = []   # cuDNN strict's misses of 1e-4 (its 5x5 weight gradients): timed, and said
            cudnn, _ = layer.measure(layer.cudnn(pn), "torch", pn, 1e-4, args, flagged=flagged)
            kernel = sum(ks.values())
            rows.append({"layer": name, "pass": pn, "backend": chosen, "wall_ms": wall,
                         **{f"{c}_ms": ks[c] for c in CATEGORIES}, "kernel_ms": kernel,
                         "host_ms": wall - kernel, "launches": launches, "cudnn_strict_ms": cudnn,
                         "x_strict": cudnn / wall, "err": err,
                         "cudnn_check": flagged[0] if flagged else "ok"})
        del layer
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    totals = {}
    for r in rows:
        net = r["layer"].split(".")[0]
        t = totals.setdefault(net, {"layer": net, "pass": "all", "backend": ""})
        for k in ("wall_ms", "fft_ms", "gemm_ms", "other_ms", "kernel_ms", "host_ms", "cudnn_strict_ms"):
            t[k] = t.get(k, 0.0) + r[k]
    for t in totals.values():
        t["x_strict"] = t["cudnn_strict_ms"] / t["wall_ms"]
    from minitorch_fft.backends import cgemm
    meta = provenance(tuning.device_name(cp), cupy=cp.__version__, torch=torch.__version__,
                      backend=args.backend, iters=args.iters, warmup=args.warmup, repeat=args.repeat,
                      cgemm_mode=cgemm.mode(cp), **cudnn_setup)
    cols = [("layer", "layer", ""), ("pass", "pass", ""), ("backend", "backend", ""),
            ("wall ms", "wall_ms", ".3f"), ("fft ms", "fft_ms", ".3f"), ("gemm ms", "gemm_ms", ".3f"),
            ("other ms", "other_ms", ".3f"), ("host ms", "host_ms", ".3f"), ("kernels/call", "launches", ".0f"),
            ("cuDNN strict ms", "cudnn_strict_ms", ".3f"), ("x strict", "x_strict", ".2f"), ("err", "err", ".1e"),
            ("cuDNN check", "cudnn_check", "")]
    notes = ("wall: median of CUDA events around one call; fft/gemm/other: kernel time per call by category "
             "(torch.profiler, mean of --iters calls); host = wall - kernel time (a median less a mean: an "
             "estimate); cuDNN strict in the same run, checked against float64 to 1e-4 (a miss is timed and "
             "named in the last column).")
    paths = write_results(f"profile_{args.backend}", meta, rows + list(totals.values()), cols,
                          f"Time per layer and pass by kernel category, {args.backend}", notes, out_dir=args.out)
    print(paths[1].read_text().split("\n\n", 2)[-1][-9000:])


if __name__ == "__main__":
    main()
