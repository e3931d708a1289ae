"""Experiment (not a benchmark of record): does a pass's time follow where its arrays sit in GPU memory?

Session 64 found auto's choice for ResNet-50's conv47 fprop (1024->2048, 1x1 stride 2, 14x14) flipping between gemm
(its fused stride-2 kernel) and cudnn from one tuning to the next, and, within one process, gemm's time moving with
the address of the tuner's inputs (0.68 to 0.79 ms), the same address giving the same time.

Here each case's input x is placed at many offsets inside one arena (a single allocation, so the offsets are exact
and the pool plays no part), the weight and the output staying where they are; then x is held still and the output
moved (pad blocks held from CuPy's pool before each call). Timed at each placement: gemm's prepared call (as auto
times and runs it), cudnn's prepared call, and the stride's gather alone (x[:, :, ::sh, ::sw] copied, the memory
traffic of gemm's gather form). Each as auto's tuner timed it until session 65 (tuning.timeit: one warm-up, the
median of five single calls; it times bursts of four since) and GPU-only (a spin kernel hides the launch; median of 15).

  PYTHONPATH=. python3 benchmarks/experiments/exp_placement.py                 # conv47, 48 placements
  PYTHONPATH=. python3 benchmarks/experiments/exp_placement.py --cases all --places 24
"""
import argparse
import statistics

import cupy as cp

from minitorch_fft import backends
from minitorch_fft.backends import tuning
from benchmarks.harness import median_ms

CASES = {  # name: (x shape, w shape, stride, pass)
    "conv47": ((128, 1024, 14, 14), (2048, 1024, 1, 1), (2, 2), "fprop"),
    "conv28": ((128, 512, 28, 28), (1024, 512, 1, 1), (2, 2), "fprop"),
    "conv15": ((128, 256, 56, 56), (512, 256, 1, 1), (2, 2), "fprop"),
    "conv29": ((128, 1024, 14, 14), (256, 1024, 1, 1), (1, 1), "fprop"),
}
ALIGN = 2 << 20   # offsets are whole 2 MiB pages plus a fixed 512-byte skew: every placement equally aligned


def runs(name, xs, ws, stride, p):
    """{what: fn(x, w) -> array} for the case: gemm's and cudnn's prepared calls, and the stride's gather."""
    g = backends.geometry(xs, ws, stride, (0, 0))
    out = {}
    for backend in ("gemm", "cudnn"):
        mod = backends.get(backend)
        if getattr(mod, "available", lambda: True)():
            x0, w0 = cp.random.standard_normal(xs, dtype=cp.float32), cp.random.standard_normal(ws, dtype=cp.float32)
            getattr(mod, p)(x0, w0, stride=stride)           # tunes gemm's form, builds cudnn's plan
            out[backend] = mod.prepare(p, g, cp)
    form = tuning.peek(backends.get("gemm").form_key(cp, p, g))
    print(f"{name}: gemm's form {form}")
    sh, sw = stride
    out["gather"] = lambda x, w: cp.ascontiguousarray(x[:, :, ::sh, ::sw])
    return out


def time_both(fn):
    """(as the tuner times it, GPU-only) in ms."""
    fn()
    return tuning.timeit(fn, cp, warmup=1, repeat=5), median_ms(fn, "cupy", 2, 15, spin_us=2000)


def summary(label, ms):
    q = statistics.quantiles(ms, n=10)
    return (f"{label:26} min {min(ms):7.4f}  p10 {q[0]:7.4f}  median {statistics.median(ms):7.4f}  "
            f"p90 {q[-1]:7.4f}  max {max(ms):7.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="conv47", help="comma-separated of %s, or all" % ", ".join(CASES))
    ap.add_argument("--places", type=int, default=48, help="placements of x (and of the output)")
    args = ap.parse_args()
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    for name in names:
        xs, ws, stride, p = CASES[name]
        fns = runs(name, xs, ws, stride, p)
        w = cp.random.standard_normal(ws, dtype=cp.float32)
        nbytes = 4 * xs[0] * xs[1] * xs[2] * xs[3]
        step = -(-nbytes // ALIGN) * ALIGN + ALIGN          # a page apart at least
        arena = cp.empty(step * args.places + ALIGN, dtype=cp.uint8)
        base = -arena.data.ptr % ALIGN + 512
        print(f"\n{name} {p}: x {xs}, w {ws}, stride {stride}; arena at {arena.data.ptr:#x}, {arena.nbytes >> 20} MiB")
        print(f"{'place':>5} {'x addr':>14} " + " ".join(f"{k + ' tuner':>13} {k + ' gpu':>11}" for k in fns))
        per = {k: ([], []) for k in fns}
        for i in range(args.places):
            off = base + i * step
            x = arena[off:off + nbytes].view(cp.float32).reshape(xs)
            x[...] = cp.random.standard_normal(xs, dtype=cp.float32)
            cells = []
            for k, fn in fns.items():
                t, gpu = time_both(lambda fn=fn, x=x: fn(x, w))
                per[k][0].append(t)
                per[k][1].append(gpu)
                cells.append(f"{t:13.4f} {gpu:11.4f}")
            print(f"{i:5d} {x.data.ptr:#14x} " + " ".join(cells), flush=True)
        for k, (t, gpu) in per.items():
            print(summary(f"{name} {k} tuner", t))
            print(summary(f"{name} {k} gpu-only", gpu))
        if "cudnn" in per:
            wins = sum(c < g for g, c in zip(per["gemm"][0], per["cudnn"][0]))
            print(f"{name}: cudnn timed faster than gemm (tuner's timing) at {wins} of {args.places} placements")
        x = arena[base:base + nbytes].view(cp.float32).reshape(xs)
        print(f"\n{name}: x at {x.data.ptr:#x} held still, the output moved by a pad block held from the pool")
        pads, outs = [], {k: [] for k in fns}
        for i in range(args.places // 2):
            pads.append(cp.empty((1 + i % 7) * ALIGN * 3 + 4096 * i, dtype=cp.uint8))
            cells = []
            for k, fn in fns.items():
                y = fn(x, w)
                ptr = y.data.ptr
                del y
                t, gpu = time_both(lambda fn=fn, x=x: fn(x, w))
                outs[k].append(gpu)
                cells.append(f"{k} y {ptr:#x} {t:.4f} {gpu:.4f}")
            print(f"{i:5d} " + "  ".join(cells), flush=True)
        for k, gpu in outs.items():
            print(summary(f"{name} {k} gpu, y moved", gpu))
        del arena, pads, x
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
