"""Experiment (not a benchmark of record): what one GEMM call and one cuDNN execute cost the host,
by circumstance, at converted AlexNet b128's shapes. Session 37's split (exp_compile_gap --split,
1863cf7) timed cgemm._gemm at 37-134 us a call inside the converted step, where exp_fbfft_pieces
times cgemm.matmul at 25 us on a real layer's size, the same shape called again and again. This
times the same calls three ways:

  again     one shape called again and again (as exp_fbfft_pieces does): us a call over a burst
  in turn   the step's shapes one after another (as a step calls them): us a call over a cycle
  idle      each call alone on an idle GPU (a synchronize before it, as a host-bound step's calls
            often find the GPU): the median call
  after torch   in turn, each call timed alone right after a small PyTorch matmul and convolution on
            the same stream (as in a step, where PyTorch's cuBLAS and cuDNN handles run between
            ours): the median call

for cgemm.matmul (allocating its output, as the passes do), for CuPy's cuBLAS call with its
arguments ready (no Python of ours), and for the cudnn backend's prepared fprop run; in fp32 and
TF32 mode; on CuPy's stream and pool, and inside the PyTorch adapter's scope (PyTorch's stream
and caching allocator).

  python -m benchmarks.experiments.exp_call_host [--reps 30]
"""
import argparse
import contextlib
import statistics
import time

from benchmarks.experiments.exp_fbfft_pieces import _stack, cublas_args

HOW = ("again", "in turn", "idle", "after torch")
# converted AlexNet b128's fbfft GEMMs in the framework's TF32 mode (exp_compile_gap --split): a, op_a, b, op_b
GEMMS = [((2050, 128, 48), "N", (2050, 64, 48), "C"), ((514, 128, 64), "N", (514, 192, 64), "C"),
         ((130, 128, 256), "C", (130, 128, 256), "N"), ((130, 128, 256), "C", (130, 128, 384), "N"),
         ((130, 128, 384), "C", (130, 128, 192), "N"), ((514, 128, 192), "C", (514, 128, 64), "N"),
         ((2050, 128, 64), "C", (2050, 128, 48), "N"), ((130, 128, 384), "N", (130, 384, 192), "N"),
         ((514, 128, 192), "N", (514, 192, 64), "N")]
# the cudnn backend's fprops in the same step: x, w (padding 1)
CONVS = [((128, 192, 13, 13), (384, 192, 3, 3)), ((128, 384, 13, 13), (256, 384, 3, 3)),
         ((128, 256, 13, 13), (256, 256, 3, 3))]


def per_call_us(cp, calls, reps, how):
    """Host us a call: `calls` a list of functions; how 'again' (each function in a burst of
    len(calls) calls), 'in turn' (the list once), 'idle' (each alone after a synchronize) or 'after
    torch' (the list once, each call timed alone right after a PyTorch matmul and convolution)."""
    sync = cp.cuda.get_current_stream().synchronize
    times = []
    if how == "after torch":
        import torch
        a, w = torch.randn(64, 64, device="cuda"), torch.randn(8, 8, 3, 3, device="cuda")
        x = torch.randn(2, 8, 16, 16, device="cuda")
        sync()
    for _ in range(reps):
        if how == "after torch":
            sync()
            for fn in calls:
                torch.mm(a, a)
                torch.nn.functional.conv2d(x, w, padding=1)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            continue
        if how == "idle":
            for fn in calls:
                sync()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            continue
        bursts = [[fn] * len(calls) for fn in calls] if how == "again" else [calls]
        for burst in bursts:
            sync()
            t0 = time.perf_counter()
            for fn in burst:
                fn()
            times.append((time.perf_counter() - t0) / len(burst))
    sync()
    return statistics.median(times) * 1e6


def gemm_calls(cp):
    """(cgemm.matmul calls, CuPy cuBLAS calls with their arguments ready) over GEMMS."""
    from cupy_backends.cuda.libs import cublas

    from minitorch_fft.backends import cgemm
    matmuls, raws = [], []
    for a_shape, op_a, b_shape, op_b in GEMMS:
        a = (cp.random.standard_normal(a_shape, dtype=cp.float32)
             + 1j * cp.random.standard_normal(a_shape, dtype=cp.float32)).astype(cp.complex64)
        b = (cp.random.standard_normal(b_shape, dtype=cp.float32)
             + 1j * cp.random.standard_normal(b_shape, dtype=cp.float32)).astype(cp.complex64)
        out = cgemm.matmul(cp, a, b, op_a=op_a, op_b=op_b)
        compute = cgemm._CUBLAS_COMPUTE_32F_FAST_TF32 if cgemm.mode(cp) == "tf32" else cgemm._CUBLAS_COMPUTE_32F
        args = cublas_args(cp, a, op_a, b, op_b, out, compute)
        matmuls.append(lambda a=a, b=b, op_a=op_a, op_b=op_b: cgemm.matmul(cp, a, b, op_a=op_a, op_b=op_b))
        raws.append(lambda args=args: cublas.gemmStridedBatchedEx(*args))
    return matmuls, raws


def cudnn_calls(cp):
    """The cudnn backend's prepared fprop runs over CONVS (None where the backend cannot run)."""
    from minitorch_fft import backends
    if not backends.cudnn.supports((1, 1, 3, 3), (1, 1, 3, 3)):
        return None
    calls = []
    for x_shape, w_shape in CONVS:
        x = cp.random.standard_normal(x_shape, dtype=cp.float32)
        w = cp.random.standard_normal(w_shape, dtype=cp.float32)
        kw = dict(x_shape=x_shape, w_shape=w_shape, stride=(1, 1), padding=(1, 1))
        backends.run_pass("cudnn", "fprop", x, w, **kw)
        ready = backends._prepared[("cudnn", "fprop", x_shape, w_shape, (1, 1), (1, 1), backends.config.state())]
        calls.append(lambda ready=ready, x=x, w=w: ready.run(x, w))
    return calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    import cupy as cp
    import torch

    from minitorch_fft import backends
    from minitorch_fft import pytorch as pt
    xt = torch.randn(1, 1, 4, 4, device="cuda")
    pt._run("fprop", "gemm", xt, torch.randn(1, 1, 1, 1, device="cuda"), xt.shape, (1, 1, 1, 1), (1, 1), (0, 0))
    _, on, _ = pt._cuda_scope(0)
    scopes = {"CuPy": contextlib.nullcontext,
              "adapter": lambda: _stack(on.device, on.stream, cp.cuda.using_allocator(on.malloc))}
    rows = []
    for mode in ("fp32", "tf32"):
        with backends.config.override(tf32=mode == "tf32"):
            for scope_name, scope in scopes.items():
                with scope():
                    matmuls, raws = gemm_calls(cp)
                    convs = cudnn_calls(cp)
                    kinds = [("cgemm.matmul", matmuls), ("CuPy cuBLAS call", raws)]
                    if convs is not None:
                        kinds.append(("cudnn prepared fprop", convs))
                    for label, calls in kinds:
                        rows.append((label, mode, scope_name,
                                     *(per_call_us(cp, calls, args.reps, how) for how in HOW)))
    print(f"host us a call, medians over {args.reps} repetitions ({torch.cuda.get_device_name()})\n")
    print(f"| call | mode | scope | {' | '.join(HOW)} |\n|---|---|---|{'---|' * len(HOW)}")
    for label, mode, scope_name, *us in rows:
        print(f"| {label} | {mode} | {scope_name} | {' | '.join(f'{v:.1f}' for v in us)} |")


if __name__ == "__main__":
    main()
