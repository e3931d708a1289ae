"""Benchmark: the direct backend against gemm and cuDNN (through PyTorch), and Iandola et al.'s
single-plane benchmark, in one process.

Three parts, each optional:
  configs  every kernel configuration of every pass, forced one by one with NaN-poisoned outputs, on
           a few geometries (strided, padded, rectangular, single-plane), against PyTorch float64.
  layers   AlexNet conv1 and OverFeat-fast conv1 (strided 11x11, batch 128) and AlexNet conv3-5
           (3x3, 13x13): direct (autotuned: its first call tunes), gemm, cuDNN strict fp32
           (allow_tf32 off for cuDNN and cuBLAS) and cuDNN TF32 (PyTorch's default), every pass.
           Each result is checked against float64; timings are medians of CUDA events around
           INNER back-to-back calls (per call), after warm-up, on fresh random data per layer.
  plane    one 8192 x 8192 float32 plane, k x k filters, k = 2..7, no padding: direct against the
           bandwidth bound (image read + output written, at the measured device-to-device copy
           rate), cupyx.scipy.ndimage.correlate and cupyx.scipy.signal.correlate2d.

  python -m benchmarks.bench_direct                      # everything (~3 min on an H100)
  python -m benchmarks.bench_direct --parts layers --layers alexnet.conv1 --repeat 20
  MINITORCH_DIRECT_TUNE=off python -m benchmarks.bench_direct --parts layers   # untuned

Writes results/<device>/bench_direct.json and .md (--out for another folder): device, date,
command, versions; per layer and pass the median ms of each implementation, the speed-ups, the
configuration direct chose and every configuration's tuning time; per k the plane times and the
fraction of the bandwidth bound; the configuration check's errors. Exit status 1 if any check failed.
"""
import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from minitorch_fft.backends import config
from benchmarks.harness import (PASSES, RESULTS_DIR, median_ms, provenance, reference64, rel_error, set_tf32,
                                setup_cudnn, write_results, write_text)

# -- defaults --------------------------------------------------------------------------------
BATCH = 128
WARMUP = 3
REPEAT = 10
SEED = 0
INNER = 5   # back-to-back calls per timed span: launches queue up, as in training
PARTS = ("configs", "layers", "plane")
# name: (f, f', h = w, k, stride, padding)
LAYERS = {
    "alexnet.conv1": (3, 64, 224, 11, 4, 2),
    "overfeat.conv1": (3, 96, 231, 11, 4, 0),
    "alexnet.conv3": (192, 384, 13, 3, 1, 1),
    "alexnet.conv4": (384, 256, 13, 3, 1, 1),
    "alexnet.conv5": (256, 256, 13, 3, 1, 1),
}
IMPLS = ("direct", "gemm", "cudnn_strict", "cudnn_tf32")
TOLERANCE = {"direct": 1e-4, "gemm": 1e-4, "cudnn_strict": 1e-4, "cudnn_tf32": 1e-2}
CONFIG_TOL = 1e-5
# name: (x shape, w shape, stride, padding) for the configuration check
CHECK_GEOMETRIES = {
    "alexnet.conv1.S4": ((4, 3, 224, 224), (64, 3, 11, 11), (4, 4), (2, 2)),
    "overfeat.conv1.S2": ((2, 3, 231, 231), (96, 3, 11, 11), (4, 4), (0, 0)),
    "3x3.13.S8": ((8, 64, 13, 13), (96, 64, 3, 3), (1, 1), (1, 1)),
    "rect5x3.s23.p21": ((3, 5, 37, 41), (7, 5, 5, 3), (2, 3), (2, 1)),
    "1x1.s2": ((2, 16, 15, 15), (8, 16, 1, 1), (2, 2), (0, 0)),
    "plane.k3.p1": ((1, 1, 300, 517), (1, 1, 3, 3), (1, 1), (1, 1)),
    "plane.k6.p0": ((1, 1, 300, 517), (1, 1, 6, 6), (1, 1), (0, 0)),
}
PLANE_SIZE = 8192
PLANE_KS = (2, 3, 4, 5, 6, 7)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS))
    parser.add_argument("--layers", default=",".join(LAYERS),
                        help="comma-separated, of: " + ", ".join(LAYERS))
    parser.add_argument("--batch", type=int, default=BATCH, help="batch size S (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=REPEAT, help="timed runs (default %(default)s)")
    parser.add_argument("--seed", type=int, default=SEED, help="random data seed (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default results/)")
    parser.add_argument("--json", type=Path, default=None, help="also write the whole result here")
    args = parser.parse_args(argv)
    args.parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    args.layer_names = tuple(n.strip() for n in args.layers.split(",") if n.strip())
    bad = [p for p in args.parts if p not in PARTS] + [n for n in args.layer_names if n not in LAYERS]
    if bad:
        parser.error(f"unknown part(s) or layer(s): {bad}")
    if args.batch < 1 or args.warmup < 0 or args.repeat < 1:
        parser.error("need --batch >= 1, --warmup >= 0, --repeat >= 1")
    return args


def log(*a):
    print(*a, flush=True)


def gpu_ms(fn, lib, args, inner=INNER):
    """Median ms per call: CUDA events around `inner` back-to-back calls, median over args.repeat
    spans after args.warmup. Host overhead between launches hides behind the queued kernels, so a
    short kernel is timed by its own duration, not by the launch latency of a lone call."""
    return median_ms(lambda: [fn() for _ in range(inner)], lib, args.warmup, args.repeat) / inner


def random(shape, rng):
    import cupy as cp
    return rng.standard_normal(shape, dtype=cp.float32)


# -- part 1: every configuration ------------------------------------------------------------

class StickyCudaError(RuntimeError):
    """A kernel faulted: every later CUDA call in this process fails, so the run stops."""

    def __init__(self, rows):
        super().__init__("a kernel faulted; the CUDA context is unusable")
        self.rows = rows


def check_configs(args):
    """Force every configuration of every pass on CHECK_GEOMETRIES; poisoned outputs; vs float64."""
    import cupy as cp

    from minitorch_fft.backends import common, direct, direct_plans
    rows = []
    with config.override(direct_poison=True):   # outputs NaN-filled before each launch
        for gi, (name, (xs, ws, stride, pad)) in enumerate(CHECK_GEOMETRIES.items()):
            rng = cp.random.default_rng(args.seed + 100 + gi)
            g = common.geometry(xs, ws, stride, pad)
            x, w, gy = random(xs, rng), random(ws, rng), random((g.S, g.fo, g.oh, g.ow), rng)
            ref = reference64(x, w, gy, stride, pad)
            calls = {"fprop": lambda c: direct.fprop(x, w, stride, pad, config=c),
                     "bprop": lambda c: direct.bprop(gy, w, xs, stride, pad, config=c),
                     "accgrad": lambda c: direct.accgrad(gy, x, ws, stride, pad, config=c)}
            for pn in PASSES:
                for cfg in direct.candidates(pn, g, *direct_plans.device_limits(cp.cuda.Device().id)):
                    row = {"geometry": name, "pass": pn, "config": cfg}
                    try:
                        start = time.perf_counter()
                        out = calls[pn](cfg)
                        cp.cuda.Device().synchronize()
                        row["first_call_s"] = time.perf_counter() - start
                        row["err"] = rel_error(out, ref[pn])
                        row["ok"] = row["err"] <= CONFIG_TOL
                    except Exception as e:  # noqa: BLE001 - reported, and the check fails
                        row.update(err=float("nan"), ok=False, error=f"{type(e).__name__}: {e}")
                    rows.append(row)
                    if not row["ok"]:
                        log(f"  CONFIG FAIL {name} {pn} {cfg}: {row.get('error', row['err'])}")
                    if "CUDA" in row.get("error", ""):  # a kernel fault poisons the context: stop here
                        raise StickyCudaError(rows)
            log(f"configs: {name} done ({sum(r['geometry'] == name for r in rows)} runs)")
    return rows


# -- part 2: network layers -------------------------------------------------------------------

def bench_layer(name, args):
    import cupy as cp
    import torch

    from minitorch_fft.backends import direct, gemm, tuning
    from minitorch_fft.backends.common import geometry

    f, fo, hw, k, s, p = LAYERS[name]
    S, stride, pad = args.batch, (s, s), (p, p)
    g = geometry((S, f, hw, hw), (fo, f, k, k), stride, pad)
    rng = cp.random.default_rng(args.seed + list(LAYERS).index(name))  # fresh data per layer
    x, w, gy = random((S, f, hw, hw), rng), random((fo, f, k, k), rng), random((S, fo, g.oh, g.ow), rng)
    xt, wt, gyt = (torch.from_dlpack(a) for a in (x, w, gy))         # the same memory, no copy
    ref = reference64(x, w, gy, stride, pad)

    def ours(backend):
        return {"fprop": lambda: backend.fprop(x, w, stride, pad),
                "bprop": lambda: backend.bprop(gy, w, x.shape, stride, pad),
                "accgrad": lambda: backend.accgrad(gy, x, w.shape, stride, pad)}

    def conv_backward(mask):
        return torch.ops.aten.convolution_backward(gyt, xt, wt, None, stride, pad, (1, 1), False, (0, 0), 1,
                                                   mask)
    cudnn = {"fprop": lambda: torch.nn.functional.conv2d(xt, wt, stride=stride, padding=pad),
             "bprop": lambda: conv_backward((True, False, False))[0],
             "accgrad": lambda: conv_backward((False, True, False))[1]}
    runs = {"direct": (ours(direct), "cupy"), "gemm": (ours(gemm), "cupy"),
            "cudnn_strict": (cudnn, "torch"), "cudnn_tf32": (cudnn, "torch")}
    rows = {pn: {"layer": name, "pass": pn, "S": S, "f": f, "fo": fo, "h": hw, "k": k, "stride": s,
                 "pad": p, "oh": g.oh} for pn in PASSES}
    for impl in IMPLS:
        fns, lib = runs[impl]
        strict = impl != "cudnn_tf32"
        set_tf32("strict" if strict else "tf32")
        for pn in PASSES:
            row = rows[pn]
            try:
                start = time.perf_counter()
                got = fns[pn]()                                  # direct tunes on this first call
                torch.cuda.synchronize()
                cp.cuda.Device().synchronize()
                row[f"first_call_s_{impl}"] = round(time.perf_counter() - start, 3)
                row[f"err_{impl}"] = rel_error(got, ref[pn])
                del got
                row[f"ms_{impl}"] = gpu_ms(fns[pn], lib, args)
            except Exception as e:  # noqa: BLE001 - one failure must not hide the other results
                row[f"error_{impl}"] = f"{type(e).__name__}: {e}"
                log(f"  ERROR {name} {impl} {pn}: {row[f'error_{impl}']}")
                traceback.print_exc()
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    for pn, row in rows.items():
        entry = tuning.default_cache().get(tuning.key(cp, "float32", g, pn, "direct"))
        if isinstance(entry, dict):
            row["direct_config"] = entry.get("choice")
            row["direct_tuning_ms"] = {c: round(t, 4) for c, t in entry.get("ms", {}).items()}
        for other in ("gemm", "cudnn_strict", "cudnn_tf32"):
            if row.get("ms_direct") and row.get(f"ms_{other}"):
                row[f"x_{other}"] = row[f"ms_{other}"] / row["ms_direct"]
        log(f"layers: {name} {pn}: direct {row.get('ms_direct', float('nan')):.3f} ms "
            f"({row.get('direct_config')}), gemm {row.get('ms_gemm', float('nan')):.3f}, "
            f"cuDNN strict {row.get('ms_cudnn_strict', float('nan')):.3f}, "
            f"TF32 {row.get('ms_cudnn_tf32', float('nan')):.3f}")
    del ref
    return list(rows.values())


# -- part 3: one plane ------------------------------------------------------------------------

def copy_bandwidth(nbytes, args):
    """Device-to-device copy rate in bytes/s, counting bytes read and written."""
    import cupy as cp
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    ms = gpu_ms(lambda: cp.copyto(b, a), "cupy", args)
    return 2 * nbytes / (ms * 1e-3)


def bench_plane(args):
    import cupy as cp
    import cupyx.scipy.ndimage as ndi
    import cupyx.scipy.signal as sig

    from minitorch_fft.backends import direct, tuning
    from minitorch_fft.backends.common import geometry
    n = PLANE_SIZE
    bandwidth = copy_bandwidth(n * n * 4, args)
    log(f"plane: device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write)")
    rng = cp.random.default_rng(args.seed + 7)
    img = random((1, 1, n, n), rng)
    rows = []
    for k in PLANE_KS:
        w = random((1, 1, k, k), rng)
        g = geometry(img.shape, w.shape, (1, 1), (0, 0))
        row = {"k": k, "n": n, "oh": g.oh, "copy_TBps": bandwidth / 1e12}
        row["bound_ms"] = (n * n + g.oh * g.ow) * 4 / bandwidth * 1e3
        try:
            ours = direct.fprop(img, w)                          # tunes
            theirs = sig.correlate2d(img[0, 0], w[0, 0], mode="valid")
            row["err_vs_correlate2d"] = rel_error(ours[0, 0], theirs)
            del ours, theirs
            row["ms_direct"] = gpu_ms(lambda: direct.fprop(img, w), "cupy", args)
            row["pct_bound"] = 100 * row["bound_ms"] / row["ms_direct"]
            entry = tuning.default_cache().get(tuning.key(cp, "float32", g, "fprop", "direct"))
            if isinstance(entry, dict):
                row["direct_config"] = entry.get("choice")
                row["direct_tuning_ms"] = {c: round(t, 4) for c, t in entry.get("ms", {}).items()}
            plane, w2 = img[0, 0], w[0, 0]
            row["ms_ndimage"] = gpu_ms(lambda: ndi.correlate(plane, w2, mode="constant"), "cupy", args)
            row["ms_correlate2d"] = gpu_ms(lambda: sig.correlate2d(plane, w2, mode="valid"), "cupy", args)
            row["x_ndimage"] = row["ms_ndimage"] / row["ms_direct"]
            row["x_correlate2d"] = row["ms_correlate2d"] / row["ms_direct"]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        log(f"plane: k={k}: direct {row.get('ms_direct', float('nan')):.3f} ms "
            f"({row.get('pct_bound', float('nan')):.0f}% of bound {row['bound_ms']:.3f} ms, "
            f"{row.get('direct_config')}), ndimage {row.get('ms_ndimage', float('nan')):.3f}, "
            f"correlate2d {row.get('ms_correlate2d', float('nan')):.3f}")
        rows.append(row)
        cp.get_default_memory_pool().free_all_blocks()
    return rows


# -- report -----------------------------------------------------------------------------------

def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def summary(result):
    """The short table printed last, and the list of failed checks."""
    lines, failures = [], []
    for r in result.get("configs", []):
        if not r["ok"]:
            failures.append(f"config {r['geometry']} {r['pass']} {r['config']}: {r.get('error', r['err'])}")
    if result.get("configs"):
        worst = max(result["configs"], key=lambda r: r["err"] if r["err"] == r["err"] else float("inf"))
        lines.append(f"configs: {len(result['configs'])} runs, {sum(not r['ok'] for r in result['configs'])} "
                     f"failed, worst rel err {worst['err']:.1e} ({worst['geometry']} {worst['pass']} "
                     f"{worst['config']})")
    if result.get("layers"):
        lines.append(f"{'layer':15} {'pass':8} {'direct':>8} {'gemm':>8} {'strict':>8} {'tf32':>8} "
                     f"{'x gemm':>7} {'x strict':>8}  config")
        for r in result["layers"]:
            lines.append(f"{r['layer']:15} {r['pass']:8} {fmt(r.get('ms_direct'), '8.3f')} "
                         f"{fmt(r.get('ms_gemm'), '8.3f')} {fmt(r.get('ms_cudnn_strict'), '8.3f')} "
                         f"{fmt(r.get('ms_cudnn_tf32'), '8.3f')} {fmt(r.get('x_gemm'), '7.2f')} "
                         f"{fmt(r.get('x_cudnn_strict'), '8.2f')}  {r.get('direct_config')}")
            for impl in IMPLS:
                err = r.get(f"err_{impl}")
                if f"error_{impl}" in r or err is None or not err <= TOLERANCE[impl]:
                    failures.append(f"{r['layer']} {r['pass']} {impl}: {r.get(f'error_{impl}', err)}")
    if result.get("plane"):
        lines.append(f"{'k':>2} {'direct':>8} {'bound':>8} {'%bound':>6} {'ndimage':>8} {'corr2d':>8} "
                     f"{'x ndi':>6} {'x c2d':>6}  config")
        for r in result["plane"]:
            lines.append(f"{r['k']:>2} {fmt(r.get('ms_direct'), '8.3f')} {r['bound_ms']:8.3f} "
                         f"{fmt(r.get('pct_bound'), '6.0f')} {fmt(r.get('ms_ndimage'), '8.3f')} "
                         f"{fmt(r.get('ms_correlate2d'), '8.3f')} {fmt(r.get('x_ndimage'), '6.2f')} "
                         f"{fmt(r.get('x_correlate2d'), '6.2f')}  {r.get('direct_config')}")
            err = r.get("err_vs_correlate2d")
            if "error" in r or err is None or not err <= 1e-5:
                failures.append(f"plane k={r['k']}: {r.get('error', err)}")
    return "\n".join(lines), failures


def main(argv=None):
    args = parse_args(argv)
    import cupy as cp
    import torch

    from minitorch_fft.backends import tuning
    if not torch.cuda.is_available():
        sys.exit("bench_direct needs a CUDA GPU visible to PyTorch and CuPy")
    cudnn_setup = setup_cudnn(torch)
    device = tuning.device_name(cp)
    meta = provenance(device, torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                      cupy=cp.__version__, cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                      batch=args.batch, warmup=args.warmup, repeat=args.repeat, seed=args.seed,
                      parts=",".join(args.parts), **cudnn_setup,
                      direct_tune=config.get("direct_tune"),
                      tune_cache=str(tuning.cache_path()))
    log(f"bench_direct on {device}: parts {', '.join(args.parts)}")
    result, start = {"meta": meta}, time.perf_counter()
    parts = args.parts
    if "configs" in parts:
        try:
            result["configs"] = check_configs(args)
        except StickyCudaError as e:
            result["configs"], parts = e.rows, ()
            log("STOPPING: a kernel faulted (see CONFIG FAIL above); later parts would only fail too")
    if "layers" in parts:
        result["layers"] = []
        for name in args.layer_names:
            result["layers"] += bench_layer(name, args)
    if "plane" in parts:
        result["plane"] = bench_plane(args)
    meta["seconds"] = round(time.perf_counter() - start, 1)

    table, failures = summary(result)
    result["failures"] = failures
    columns = [("layer", "layer", ""), ("pass", "pass", ""), ("direct ms", "ms_direct", ".3f"),
               ("gemm ms", "ms_gemm", ".3f"), ("cuDNN strict ms", "ms_cudnn_strict", ".3f"),
               ("cuDNN TF32 ms", "ms_cudnn_tf32", ".3f"), ("x gemm", "x_gemm", ".2f"),
               ("x strict", "x_cudnn_strict", ".2f"), ("x TF32", "x_cudnn_tf32", ".2f"),
               ("direct config", "direct_config", ""), ("direct err", "err_direct", ".1e")]
    notes = (f"Median ms per call of CUDA events around {INNER} back-to-back calls, after warm-up; "
             "x = other time / direct time (> 1: direct is "
             "faster). Single plane (8192^2, valid correlation):\n\n```\n"
             + "\n".join(ln for ln in table.splitlines() if not ln.startswith(("layer", "alex", "over")))
             + "\n```\n" + ("\nFAILED CHECKS:\n" + "\n".join(failures) if failures else ""))
    json_path, md_path = write_results("bench_direct", meta, result.get("layers", []), columns,
                                       "direct backend against gemm and cuDNN", notes, out_dir=args.out)
    # the full result (configs and plane too) beside the layer rows
    write_text(json_path, json.dumps(result, indent=1, default=str) + "\n")
    if args.json:
        write_text(args.json, json.dumps(result, indent=1, default=str) + "\n")
    log(f"\nwrote {json_path} and {md_path} ({meta['seconds']} s)\n")
    log(table)
    if failures:
        log("\nFAILED CHECKS:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
