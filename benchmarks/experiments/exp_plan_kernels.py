"""Experiment (not a benchmark of record): which CUDA kernels PyTorch's cuDNN (cudnn.benchmark) and our
cudnn backend run for one convolution pass, their GPU times, and whether PyTorch's output keeps a NaN of
its input that gemm's keeps.

Session 66: OverFeat-fast conv3's TF32-mode fprop (256->512, 12x12, 3x3) ran at 0.959x cuDNN TF32 in table3;
exp_host_cudnn put our plan (eng67) at 0.181 ms GPU-only against PyTorch's 0.176, and our plan search
refuses cuDNN's fused Winograd engine eng6 there, which hides NaN (session 56). Does PyTorch run it?

  PYTHONPATH=. python3 benchmarks/experiments/exp_plan_kernels.py --tf32
"""
import argparse
from collections import defaultdict

import cupy as cp
import torch
import torch.nn.functional as TF

from minitorch_fft import backends
from minitorch_fft.backends import config

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tf32", action="store_true", help="PyTorch's cuDNN TF32 against the framework's TF32 mode")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
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
