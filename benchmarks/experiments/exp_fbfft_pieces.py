"""Experiment (not a benchmark of record): what each piece of an fbfft pass costs the host, called
alone many times (timeit), on a layer small enough that the GPU never holds the host back. Session
36 put converted AlexNet's passes at ~245 us of host each on an H200 host, ~185 of them inside
backends.run_pass (exp_compile_gap --split, eb2aa83); this says where inside. The pieces run twice:
on CuPy's memory pool (the framework) and inside the PyTorch adapter's scope (its allocator on
PyTorch's caching allocator, PyTorch's stream), as converted models run them. The last rows time
the raw calls under the pieces, their arguments worked out once: CuPy's RawKernel launch, CuPy's
cuBLAS wrapper, the same GEMM through ctypes, and an empty Python call (added after session 36's
run, results/nvidia-h200/experiments/exp_fbfft_pieces_9396a9e.log, which has no such rows).

  python -m benchmarks.experiments.exp_fbfft_pieces [--shape 1,8,16,13,13,3] [--number 2000]
"""
import argparse
import contextlib
import timeit


def us(cp, fn, number):
    """Best of three timeit runs of fn, in microseconds a call; the GPU drained before and after."""
    fn()
    cp.cuda.Device().synchronize()
    best = min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6
    cp.cuda.Device().synchronize()
    return best


def cublas_args(cp, a, op_a, b, op_b, out, compute):
    """cublasGemmStridedBatchedEx's arguments for out = op_a(a) @ op_b(b) on CuPy's handle, as
    cgemm._gemm passes them (its plan worked out here once)."""
    from minitorch_fft.backends import cgemm
    plan = cgemm._gemm_plan(a.shape, b.shape, a.dtype, op_a, op_b)
    return (cp.cuda.device.get_cublas_handle(), plan.op_b, plan.op_a, plan.q, plan.p, plan.r, plan.one,
            b.data.ptr, plan.dtype, plan.ldb, plan.stride_b, a.data.ptr, plan.dtype, plan.lda, plan.stride_a,
            plan.zero, out.data.ptr, plan.dtype, plan.q, plan.p * plan.q, plan.count, compute,
            cgemm._CUBLAS_GEMM_DEFAULT)


def pieces(cp, x, w, pad):
    """[(label, fn)]: an fbfft fprop whole and in its pieces, in the order the pass runs them."""
    from minitorch_fft import backends
    from minitorch_fft.backends import cgemm, common, fbfft, fbfft_kernels, fbfft_plan, reuse
    xs, ws, stride = tuple(x.shape), tuple(w.shape), (1, 1)
    g, n, _ = fbfft._plan(xs, ws, stride, pad)
    fft, ifft = fbfft._kernels(cp)
    nf = fbfft_plan.stored_frequencies(n)
    wf, xf = fft(w, n, (0, 0)), fft(x, n, pad)
    spectrum = cp.empty((nf, g.S, g.f), dtype=cp.complex64)
    yf = cgemm.matmul(cp, xf, wf, op_b="C")
    y = cp.empty((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
    launcher = fbfft_kernels.rfft2_launcher(n, g.S * g.f, g.h, g.w, pad)
    key = fbfft._key("x", n, pad)
    # the same rfft2 launch and fprop GEMM as the pass makes, their arguments worked out here once
    import numpy as np
    from cupy_backends.cuda.libs import cublas
    width, threads, smem = fbfft_kernels._plan("rfft2", n)
    kern, block = fbfft_kernels.kernel("rfft2", n), (threads,)
    grid = ((g.S * g.f + width - 1) // width,)
    i32 = np.int32
    kernel_args = (x, spectrum, i32(g.S * g.f), i32(g.h), i32(g.w), i32(pad[0]), i32(pad[1]))
    stream_ptr = cp.cuda.get_current_stream().ptr
    gemm_args = cublas_args(cp, xf, "N", wf, "C", yf, cgemm._CUBLAS_COMPUTE_32F)
    cupy_gemm = cublas.gemmStridedBatchedEx
    lib = cgemm._libcublas()

    def ctypes_gemm(*args):
        lib.cublasSetStream_v2(args[0], stream_ptr)
        return lib.cublasGemmStridedBatchedEx(*args)
    args = dict(x_shape=xs, w_shape=ws, stride=stride, padding=pad)
    backends.run_pass("fbfft", "fprop", x, w, **args)         # the prepared path from here on

    def in_block():
        with reuse.reuse_spectra(False):
            backends.run_pass("fbfft", "fprop", x, w, **args, later=())
    return [
        ("run_pass fbfft fprop (prepared)", lambda: backends.run_pass("fbfft", "fprop", x, w, **args)),
        ("  the same in a reuse_spectra block", in_block),
        ("reuse_spectra block, empty", lambda: _enter_exit(reuse.reuse_spectra(False))),
        ("fbfft.fprop", lambda: fbfft.fprop(x, w, stride, pad)),
        ("  check_arrays", lambda: common.check_arrays(x=x, w=w)),
        ("  fbfft._plan", lambda: fbfft._plan(xs, ws, stride, pad)),
        ("  reuse.shared, no block (fft of w)", lambda: reuse.shared(fbfft._key("w", n), w, fft, w, n, (0, 0))),
        ("  cp.empty spectrum", lambda: cp.empty((nf, g.S, g.f), dtype=cp.complex64)),
        ("  rfft2 launch (out given)", lambda: launcher(x, spectrum)),
        ("  fft of x (allocate + launch)", lambda: fft(x, n, pad)),
        ("  cgemm.matmul (allocates)", lambda: cgemm.matmul(cp, xf, wf, op_b="C")),
        ("  cgemm.matmul (out given)", lambda: cgemm.matmul(cp, xf, wf, out=yf, op_b="C")),
        ("  cp.empty y", lambda: cp.empty((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)),
        ("  ifft into y", lambda: ifft(yf, n, (0, 0), y)),
        ("  _key", lambda: fbfft._key("x", n, pad)),
        ("  reuse.keeping enter+exit", lambda: _enter_exit(reuse.keeping(frozenset()))),
        ("  key hash", lambda: hash(key)),
        # below the pieces: what the launches and the GEMM cost without our wrappers (the levers of
        # NOTES session 36 "Next" 1), and a Python call for scale
        ("RawKernel call, arguments ready", lambda: kern(grid, block, kernel_args, shared_mem=smem)),
        ("CuPy's cublas.gemmStridedBatchedEx, arguments ready", lambda: cupy_gemm(*gemm_args)),
        ("ctypes cublasGemmStridedBatchedEx, CuPy's handle", lambda: ctypes_gemm(*gemm_args)),
        ("cublasSetStream (CuPy's)", lambda: cublas.setStream(handle, stream_ptr)),
        ("an empty Python call", lambda: None),
    ]


def _enter_exit(manager):
    with manager:
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,8,16,13,13,3", help="S,f,f',h,w,k: a k x k fbfft layer, padding k//2")
    ap.add_argument("--number", type=int, default=2000, help="calls per timeit run")
    args = ap.parse_args()
    S, f, fo, h, w_, k = (int(v) for v in args.shape.split(","))

    import cupy as cp
    import torch

    from minitorch_fft import pytorch as pt
    pad = (k // 2, k // 2)
    xt = torch.randn(S, f, h, w_, device="cuda")
    wt = torch.randn(fo, f, k, k, device="cuda")
    pt._run("fprop", "fbfft", xt, wt, xt.shape, wt.shape, (1, 1), pad)   # the adapter's scope made
    cp_, on, _ = pt._cuda_scope(xt.get_device())
    scopes = {"CuPy's pool": contextlib.nullcontext,
              "the adapter's scope": lambda: _stack(on.device, on.stream, cp.cuda.using_allocator(on.malloc))}
    print(f"fbfft fprop, x {(S, f, h, w_)}, w {(fo, f, k, k)}, padding {pad}: host us per call "
          f"(best of 3 x {args.number}; GPU work queued, not waited for)")
    results = {}
    for name, scope in scopes.items():
        with scope():
            x, w = pt._cupy_view(xt, cp), pt._cupy_view(wt, cp)
            for label, fn in pieces(cp, x, w, pad):
                results.setdefault(label, {})[name] = us(cp, fn, args.number)
    adapter = [("adapter _run fprop (eager, no grad)", lambda: pt._run("fprop", "fbfft", xt, wt, xt.shape, wt.shape,
                                                                        (1, 1), pad)),
               ("adapter _cuda_scope", lambda: pt._cuda_scope(xt.get_device())),
               ("adapter scope enter+exit", lambda: _enter_exit(_stack(on.device, on.stream,
                                                                       cp.cuda.using_allocator(on.malloc)))),
               ("adapter _cupy_view", lambda: pt._cupy_view(xt, cp)),
               ("adapter _from_cupy(cp.ascontiguousarray)", lambda: pt._from_cupy(cp.ascontiguousarray(
                   pt._cupy_view(xt, cp))))]
    names = list(scopes)
    print(f"\n| piece | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for label, by in results.items():
        print(f"| {label} | {' | '.join(f'{by[n]:.1f}' for n in names)} |")
    for label, fn in adapter:
        print(f"| {label} | | {us(cp, fn, args.number):.1f} |")


@contextlib.contextmanager
def _stack(*managers):
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


if __name__ == "__main__":
    main()
