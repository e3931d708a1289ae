"""Experiment (not a benchmark of record): what each step of a dispatched pass costs the host, on
the GPU machine's CPU (exp_host_cudnn gives the totals: auto's 1x1 fprop through the cudnn backend
39-80 us a call against PyTorch's 17-32). Each piece is called alone, many times (timeit), on
ResNet-50's conv2 (64->64 56x56 1x1; its 103 MB output is over common.CHECK_ABOVE_BYTES, so the
free-memory check runs) and ResNet-18's conv8 (a 51 MB output, under it).

  PYTHONPATH=. python3 benchmarks/experiments/exp_host_pieces.py      # a CUDA GPU, cuDNN frontend
"""
import timeit

import cupy as cp
import torch
import torch.nn.functional as TF

from minitorch_fft import backends
from minitorch_fft.backends import cgemm, common, cudnn, device


def us(fn, n=2000):
    fn()
    cp.cuda.Device().synchronize()
    best = min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6
    cp.cuda.Device().synchronize()
    return best


def main():
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    for name, xs, ws, s in (("resnet50 conv2", (128, 64, 56, 56), (64, 64, 1, 1), (1, 1)),
                            ("resnet18 conv8", (128, 64, 56, 56), (128, 64, 1, 1), (2, 2))):
        p = (0, 0)
        x = cp.random.standard_normal(xs, dtype=cp.float32)
        w = cp.random.standard_normal(ws, dtype=cp.float32)
        g = common.geometry(xs, ws, s, p)
        out_shape = (g.S, g.fo, g.oh, g.ow)
        xt, wt = torch.from_dlpack(x), torch.from_dlpack(w)
        backends.run_pass("auto", "fprop", x, w, x_shape=xs, w_shape=ws, stride=s, padding=p)
        backends.run_pass("cudnn", "fprop", x, w, x_shape=xs, w_shape=ws, stride=s, padding=p)
        plan = cudnn._built[cudnn._plan_key(cp, "fprop", g)]
        y = cp.empty(out_shape, dtype=cp.float32)
        nbytes = y.nbytes
        pieces = [
            ("get_array_module", lambda: device.get_array_module(x, w)),
            ("check_arrays", lambda: common.check_arrays(x=x, w=w)),
            ("geometry", lambda: common.geometry(xs, ws, s, p)),
            ("getDevice", lambda: cp.cuda.runtime.getDevice()),
            ("get_current_stream().ptr", lambda: cp.cuda.get_current_stream().ptr),
            ("cgemm.mode", lambda: cgemm.mode(cp)),
            ("cp.empty(out)", lambda: cp.empty(out_shape, dtype=cp.float32)),
            ("memGetInfo", lambda: cp.cuda.runtime.memGetInfo()),
            ("available_bytes", lambda: common.available_bytes(cp)),
            ("check_fits", lambda: common.check_fits(nbytes, cp, "out")),
            ("_check_output_fits", lambda: backends._check_output_fits(cudnn, "fprop", cp, xs, ws, s, p)),
            ("choose auto", lambda: backends.choose("auto", "fprop", xs, ws, s, p, cp)),
            ("plan.run (out given)", lambda: plan.run(cp, x, w, y)),
            ("cudnn._run", lambda: cudnn._run(cp, "fprop", g, x, w, out_shape)),
            ("cudnn.fprop", lambda: cudnn.fprop(x, w, stride=s, padding=p)),
            ("run_pass cudnn", lambda: backends.run_pass("cudnn", "fprop", x, w, x_shape=xs, w_shape=ws,
                                                          stride=s, padding=p)),
            ("run_pass auto", lambda: backends.run_pass("auto", "fprop", x, w, x_shape=xs, w_shape=ws,
                                                         stride=s, padding=p)),
            ("torch conv2d", lambda: TF.conv2d(xt, wt, stride=s)),
        ]
        print(f"\n{name} fprop, host us per call (best of 3 x 2000; GPU work queued, not waited for)")
        for label, fn in pieces:
            n = 300 if label in ("plan.run (out given)", "cudnn._run", "cudnn.fprop", "run_pass cudnn",
                                 "run_pass auto", "torch conv2d") else 2000
            print(f"  {label:28} {us(fn, n):8.2f}", flush=True)


if __name__ == "__main__":
    main()
