"""session 13: ResNet-18's stride-2 1x1 passes ran 0.12 -> 0.18 ms (ours) between 4197e11 and 349d866
in table3, whose spans hold 5 back-to-back calls (host time shows). GPU-only time (spin) against
back-to-back time, gemm directly with gemm_tune on and off, and through auto[ours].

  PYTHONPATH=. python3 benchmarks/experiments/exp_host_1x1.py      # a CUDA GPU

Session 13 ran it at 349d866 with a bug in the auto call for bprop and accGrad (the w_shape/x_shape
argument missing, fixed since): only the two fprop rows ran."""

import cupy as cp
from minitorch_fft import backends
from minitorch_fft.backends import config, gemm
from benchmarks.harness import median_ms
for xs, ws, p in [((128, 64, 56, 56), (128, 64, 1, 1), "fprop"), ((128, 256, 14, 14), (512, 256, 1, 1), "fprop"),
                  ((128, 128, 28, 28), (256, 128, 1, 1), "accgrad"), ((128, 256, 14, 14), (512, 256, 1, 1), "bprop")]:
    x = cp.random.standard_normal(xs, dtype=cp.float32); w = cp.random.standard_normal(ws, dtype=cp.float32)
    oh = (xs[2] - 1) // 2 + 1
    gy = cp.random.standard_normal((xs[0], ws[0], oh, oh), dtype=cp.float32)
    a, b = {"fprop": (x, w), "bprop": (gy, w), "accgrad": (gy, x)}[p]
    third = {"fprop": (), "bprop": (xs,), "accgrad": (ws,)}[p]
    res = []
    for label, fn in (("gemm tune on", lambda: getattr(gemm, p)(a, b, *third, stride=(2, 2))),
                      ("gemm tune off", None), ("auto[ours]", lambda: backends.run_pass("auto", p, a, b, *third, x_shape=xs, w_shape=ws, stride=(2, 2), padding=(0, 0)))):
        if label == "gemm tune off":
            with config.override(gemm_tune="off"):
                f = lambda: getattr(gemm, p)(a, b, *third, stride=(2, 2))
                f(); gpu = median_ms(f, "cupy", 3, 20, spin_us=2000); b2b = median_ms(lambda: [f() for _ in range(5)], "cupy", 3, 20) / 5
                host = median_ms(f, "cpu", 3, 20)
        else:
            with config.override(auto_backends="ours"):
                fn(); gpu = median_ms(fn, "cupy", 3, 20, spin_us=2000); b2b = median_ms(lambda: [fn() for _ in range(5)], "cupy", 3, 20) / 5
                host = median_ms(fn, "cpu", 3, 20)
        res.append(f"{label}: gpu {gpu:.3f} b2b {b2b:.3f} host {host:.3f}")
    print(f"{xs}->{ws[0]} {p}: " + " | ".join(res), flush=True)
