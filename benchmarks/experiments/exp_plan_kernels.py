"""Experiment (not a benchmark of record): which CUDA kernels PyTorch's cuDNN (cudnn.benchmark) and our
cudnn backend run for one convolution pass, their GPU times, and whether PyTorch's output keeps a NaN of
its input that gemm's keeps.

Session 66: OverFeat-fast conv3's TF32-mode fprop (256->512, 12x12, 3x3) ran at 0.959x cuDNN TF32 in table3;
exp_host_cudnn put our plan (eng67) at 0.181 ms GPU-only against PyTorch's 0.176, and our plan search
refuses cuDNN's fused Winograd engine eng6 there, which hides NaN (session 56). Does PyTorch run it?

  PYTHONPATH=. python3 benchmarks/experiments/exp_plan_kernels.py --tf32

Call 5 (dbea634): PyTorch keeps the NaN, and runs the same implicit-GEMM kernel family as our plan (eng67),
`..._segment_k_off_...` at 117 us where our plan's `..._segment_k_on_...` took 124. --plans then takes every
plan our search times for the pass within --within of the best (cudnn backend's _planned_graph), and for each
gives its main kernel's name and time, its GPU-only time, and the search's own measure (bursts of four,
tuning's rounds) three times in shuffled orders: is the search's ranking stable, and does it follow the kernel?
PyTorch's conv2d (cudnn.benchmark) is timed GPU-only beside the fastest plan, alternated, three times.

  PYTHONPATH=. python3 benchmarks/experiments/exp_plan_kernels.py --tf32 --plans "overfeat_fast conv3"

Calls 6 and 7 (f263ba1, 552d26c): the top four plans ran 0.170-0.172 ms GPU-only and the search's measure ranked
them differently each time (noise); PyTorch's conv2d and the best plan were within 1 % in both of call 7's
processes, where call 4's process had run the cached plan 3 % slower than PyTorch's kernel: the plan's speed moves
from process to process (benchmarks/NOTES.md, session 66).
"""
import argparse
import random
import statistics
from collections import defaultdict

import cupy as cp
import torch
import torch.nn.functional as TF

from minitorch_fft import backends
from minitorch_fft.backends import cgemm, config, tuning
from minitorch_fft.backends import cudnn as cudnn_backend
from benchmarks.harness import median_ms

CASES = {  # name: (x shape, w shape, stride, padding)
    "overfeat_fast conv3": ((128, 256, 12, 12), (512, 256, 3, 3), (1, 1), (1, 1)),
    "overfeat_fast conv4": ((128, 512, 12, 12), (1024, 512, 3, 3), (1, 1), (1, 1)),
}


def kernels(fn, runs=20):
    """{kernel name: mean GPU us} of fn()'s CUDA kernels, over `runs` calls under torch.profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time / runs
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def plans(name, tf32, within):
    """The --plans table for CASES[name]'s fprop."""
    xs, ws, stride, pad = CASES[name]
    x = cp.random.standard_normal(xs, dtype=cp.float32)
    w = (cp.random.standard_normal(ws, dtype=cp.float32) / (ws[1] * ws[2] * ws[3]) ** 0.5).astype(cp.float32)
    g = backends.geometry(xs, ws, stride, pad)
    y_shape = (xs[0], ws[0], g.oh, g.ow)
    cudnn, limit = cudnn_backend._frontend()[0], config.mib_bytes("cudnn_workspace_mb")
    handle = cudnn_backend._handle(cp, cudnn)
    graph, uids = cudnn_backend._planned_graph(cudnn, handle, "fprop", g, "tf32" if tf32 else "fp32", limit,
                                               cudnn_backend.HEURISTICS, every_engine=True)
    built = {}
    for plan_name, index in cudnn_backend._plan_indices(graph).items():
        try:
            built[plan_name] = cudnn_backend._build(cudnn, handle, graph, uids, index, limit)
        except Exception:  # noqa: BLE001 - deselected, unbuildable or over the workspace bound
            pass
    out = cp.empty(y_shape, dtype=cp.float32)
    runs = {n: (lambda p=p: p.run(cp, x, w, out)) for n, p in built.items()}
    first = {n: tuning.timeit(f, cp, warmup=1, repeat=3, inner=4) for n, f in runs.items()}
    best = min(first.values())
    names = [n for n in sorted(first, key=first.get) if first[n] <= within * best]
    searched = defaultdict(list)
    for _ in range(3):   # the search's measure: ROUNDS interleaved rounds of bursts, in a shuffled order
        order = names[:]
        random.shuffle(order)
        rounds = defaultdict(list)
        for _ in range(tuning.ROUNDS):
            for n in order:
                rounds[n].append(tuning.timeit(runs[n], cp, warmup=1, repeat=tuning.REPEAT, inner=4))
        for n in names:
            searched[n].append(statistics.median(rounds[n]))
    print(f"\n{name} fprop ({'TF32' if tf32 else 'strict'}, {cgemm.mode(cp)}): {len(built)} plans built, "
          f"{len(names)} within {within}x of the best")
    xt, wt = torch.from_dlpack(x), torch.from_dlpack(w)
    torch_conv = lambda: TF.conv2d(xt, wt, stride=stride, padding=pad)   # noqa: E731
    torch_conv()
    pairs = [(median_ms(torch_conv, "cupy", 3, 30, spin_us=3000), median_ms(runs[names[0]], "cupy", 3, 30, spin_us=3000))
             for _ in range(3)]   # PyTorch's conv2d and the search's best, alternated (both on the legacy stream)
    print("GPU-only ms, PyTorch's cuDNN against the fastest plan, three times: "
          + ", ".join(f"{a:.4f} / {b:.4f}" for a, b in pairs))
    print(f"{'plan':48} {'gpu ms':>8} {'kernel us':>9}  {'search ms (3 times)':22} main kernel")
    for n in names:
        ks = kernels(runs[n])
        main, us = next(iter(ks.items()))
        gpu = median_ms(runs[n], "cupy", 3, 30, spin_us=3000)
        print(f"{n[:48]:48} {gpu:8.4f} {us:9.1f}  {' '.join(f'{t:.4f}' for t in searched[n]):22} {main[:110]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tf32", action="store_true", help="PyTorch's cuDNN TF32 against the framework's TF32 mode")
    ap.add_argument("--plans", choices=list(CASES), help="every plan of this case's fprop within --within of the best")
    ap.add_argument("--within", type=float, default=1.15)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
    if args.plans:
        with config.override(tf32=args.tf32):
            plans(args.plans, args.tf32, args.within)
        return
    cudnn = backends.get("cudnn")
    for name, (xs, ws, stride, pad) in CASES.items():
        x = torch.randn(xs, device="cuda")
        w = torch.randn(ws, device="cuda") / (ws[1] * ws[2] * ws[3]) ** 0.5
        xc, wc = cp.from_dlpack(x), cp.from_dlpack(w)
        with config.override(tf32=args.tf32):
            ours = kernels(lambda: cudnn.fprop(xc, wc, stride=stride, padding=pad))
        theirs = kernels(lambda: TF.conv2d(x, w, stride=stride, padding=pad))
        # NaN: one input pixel of image 0, channel 0; gemm's output marks what must be NaN
        xn = x.clone()
        xn[0, 0, xs[2] // 2, xs[3] // 2] = float("nan")
        must = cp.isnan(backends.get("gemm").fprop(cp.from_dlpack(xn), wc, stride=stride, padding=pad))
        got = cp.from_dlpack(torch.isnan(TF.conv2d(xn, w, stride=stride, padding=pad)).contiguous())
        lost = int((must & ~got).sum())
        print(f"\n{name} fprop ({'TF32' if args.tf32 else 'strict'}): NaN outputs gemm gives {int(must.sum())}, "
              f"PyTorch's conv2d lost {lost}")
        for who, ks in (("PyTorch cuDNN", theirs), ("our cudnn", ours)):
            print(f"  {who}: {sum(ks.values()):.1f} us a call")
            for k, us in list(ks.items())[:4]:
                print(f"    {us:8.1f} us  {k[:150]}")


if __name__ == "__main__":
    main()
