"""Experiment (not a benchmark of record): the host cost of each piece of one fbfft pass.

exp_host.py times whole passes; this times the pieces one pass is made of (a CuPy allocation, a
kernel launch, the kernel wrappers, the complex GEMM wrapper and the raw cuBLAS call under it,
the argument checks, the pass, the dispatch) on a tiny layer, where the GPU waits for the host,
and on AlexNet's conv3, with cuDNN's conv2d beside them. "host us": median perf_counter time of
one call with no synchronisation inside (what issuing it costs); "event us": median CUDA-event
time of one call from an idle GPU (what a per-pass benchmark sees).

  python -m benchmarks.experiments.exp_host_parts
"""
import statistics
import time

from benchmarks.harness import median_ms


def host_us(fn, n=2000):
    """Median host time of fn() in us; the queue is drained every 100 calls."""
    import cupy as cp
    for _ in range(50):
        fn()
    cp.cuda.Device().synchronize()
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if i % 100 == 99:
            cp.cuda.Device().synchronize()
    cp.cuda.Device().synchronize()
    return statistics.median(ts) * 1e6


def event_us(fn, n=200):
    """Median CUDA-event time of fn() in us, each call from an idle GPU."""
    return median_ms(fn, "cupy", 20, n) * 1e3


def main():
    import cupy as cp
    import numpy as np
    import torch
    from cupy_backends.cuda.libs import cublas

    from minitorch_fft import backends
    from minitorch_fft.backends import cgemm, common, fbfft, fbfft_kernels

    rows = []

    def row(name, fn):
        rows.append((name, host_us(fn), event_us(fn)))

    for cfg in [((1, 1, 3, 3), (1, 1, 3, 3), (0, 0)), ((128, 192, 13, 13), (384, 192, 3, 3), (1, 1))]:
        xs, ws, pad = cfg
        x = cp.random.standard_normal(xs, dtype=cp.float32); w = cp.random.standard_normal(ws, dtype=cp.float32)
        g = common.geometry(xs, ws, (1, 1), pad); n = fbfft.basis(g)
        tag = f"S{xs[0]} f{xs[1]} fo{ws[0]} n{n}"
        xf = fbfft_kernels.rfft2(x.reshape(-1, xs[2], xs[3]), n, pad)
        wf = fbfft_kernels.rfft2(w.reshape(-1, ws[2], ws[3]), n)
        nf = xf.shape[0]
        xf3, wf3 = xf.reshape(nf, xs[0], xs[1]), wf.reshape(nf, ws[0], ws[1])
        yf = cgemm.matmul(cp, xf3, wf3, op_b="C")
        y = cp.empty((g.S, g.fo, g.oh, g.ow), cp.float32)
        kern = fbfft_kernels.kernel("rfft2", n)
        width, threads, smem = fbfft_kernels._plan("rfft2", n)
        B = xs[0] * xs[1]
        xr = x.reshape(-1, xs[2], xs[3])
        args = (xr, xf, np.int32(B), np.int32(xs[2]), np.int32(xs[3]), np.int32(pad[0]), np.int32(pad[1]))
        launch = fbfft_kernels.rfft2_launcher(n, B, xs[2], xs[3], pad)
        rows.append((f"--- {tag}", 0, 0))
        row("cp.empty", lambda: cp.empty((nf, B), cp.complex64))
        row("RawKernel call (rfft2, out given)",
            lambda: kern(((B + width - 1) // width,), (threads,), args, shared_mem=smem))
        row("fbfft_kernels.rfft2_launcher launch", lambda: launch(xr, xf))
        row("fbfft_kernels.rfft2 wrapper", lambda: fbfft_kernels.rfft2(xr, n, pad))
        row("fbfft_kernels.irfft2 wrapper",
            lambda: fbfft_kernels.irfft2(yf.reshape(nf, -1), n, (g.oh, g.ow), (0, 0), out=y.reshape(-1, g.oh, g.ow)))
        row("cgemm.matmul op_b=C", lambda: cgemm.matmul(cp, xf3, wf3, op_b="C"))
        h = cp.cuda.device.get_cublas_handle()
        one, zero = np.ones(1, np.complex64), np.zeros(1, np.complex64)
        o1, z1 = one.ctypes.data, zero.ctypes.data
        p, r, q = xs[0], xs[1], ws[0]
        row("raw cublas.gemmStridedBatchedEx",
            lambda: cublas.gemmStridedBatchedEx(h, 2, 0, q, p, r, o1, wf3.data.ptr, 4, r, q * r, xf3.data.ptr, 4, r,
                                                p * r, z1, yf.data.ptr, 4, q, p * q, nf, 68, -1))
        row("get_cublas_handle", lambda: cp.cuda.device.get_cublas_handle())
        row("one.ctypes.data", lambda: one.ctypes.data)
        row("cgemm.mode", lambda: cgemm.mode(cp))
        row("check_arrays", lambda: common.check_arrays(x=x, w=w))
        row("fbfft._plan", lambda: fbfft._plan(xs, ws, (1, 1), pad))
        row("x.reshape", lambda: xr.reshape(-1, xs[2], xs[3]))
        row("fbfft.fprop", lambda: fbfft.fprop(x, w, (1, 1), pad))
        for name in ("fbfft", "auto"):
            row(f"run_pass {name} fprop", lambda name=name: backends.run_pass(
                name, "fprop", x, w, x_shape=xs, w_shape=ws, stride=(1, 1), padding=pad))
        xt, wt = torch.from_dlpack(x), torch.from_dlpack(w)
        torch.backends.cudnn.allow_tf32 = False
        row("torch conv2d (cuDNN strict)", lambda: torch.nn.functional.conv2d(xt, wt, padding=pad))
        row("torch.empty", lambda: torch.empty((nf, B), device="cuda"))
    print(f"{'what':40} {'host us':>9} {'event us':>9}")
    for name, hu, eu in rows:
        print(f"{name:40} {hu:9.1f} {eu:9.1f}")


if __name__ == "__main__":
    main()
