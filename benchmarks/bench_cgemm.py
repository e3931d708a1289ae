"""The frequency-domain GEMM alone, in the ways the FFT backends can run it, on the layers' shapes.

  python -m benchmarks.bench_cgemm [--quick] [--out DIR]

Per frequency the FFT convolution multiplies complex matrices (F of them, F = n (n/2 + 1) for an
n x n basis): fprop (S, f) @ conj(W)^T (f, f'), bprop (S, f') @ W (f', f), accGrad
conj(GY)^T (f', S) @ X (S, f). The forms timed, all true fp32 arithmetic (no TF32):

  current  what backends/fbfft.py ran before this benchmark: CuPy's complex matmul, after
           materialising conj(W)^T (fprop) or conj(GY)^T (accGrad) as contiguous copies
  opc      one complex cublasGemmStridedBatchedEx (CUBLAS_COMPUTE_32F), conjugate transposes
           taken by the GEMM's op flags: no copies
  gauss    Gauss's three-multiplication form as ONE real strided-batched GEMM over 3F matrices:
           planes (re, im, re +- im) of each operand stored one after the other, products
           T1 = Ar Br, T2 = Ai Bi, T3 = (Ar +- Ai)(Br + Bi); the inverse FFT would combine
           them (Cr = T1 -+ T2, Ci = +-(T3 - T1 - T2) ...). 3/4 of the complex form's flops.
  3m       cublasCgemm3mStridedBatched (cuBLAS's own Gauss form), op flags, called via ctypes

Each is checked against a complex128 product first (relative error), then timed: CUDA events,
warm-up, median. TFLOP/s counts the complex form's 8 p q r F real flops for every form, so it
is an equivalent rate. Results: results/<device>/bench_cgemm.{json,md}.
"""
import argparse
import ctypes

from benchmarks.harness import (BATCH, PASSES, RESULTS_DIR, TABLE4, conv_layers, median_ms, provenance, rel_error,
                                write_results)

OP_N, OP_T, OP_C = 0, 1, 2
CUDA_R_32F, CUDA_C_32F = 0, 4
COMPUTE_32F = 68
GEMM_DEFAULT = -1


def layers(quick):
    """[(name, x_shape, w_shape, padding)] of the stride-1 layers fbfft serves."""
    out = [(f"table4.{k}", (BATCH, f, hw, hw), (fo, f, kk, kk), (0, 0)) for k, (f, fo, hw, kk) in TABLE4.items()
           if k != "L1"]
    for net in ("alexnet", "overfeat_fast"):
        out += [(f"{net}.{n}", xs, ws, p) for n, xs, ws, s, p in conv_layers(net, BATCH) if tuple(s) == (1, 1)]
    return out[:3] if quick else out


def shapes(x_shape, w_shape, padding):
    """{pass: (F, p, r, q)} for the per-frequency GEMMs of fbfft's basis."""
    from minitorch_fft import backends
    from minitorch_fft.backends import fbfft
    g = backends.geometry(x_shape, w_shape, (1, 1), padding)
    n = fbfft.basis(g)
    F = n * (n // 2 + 1)
    return n, {"fprop": (F, g.S, g.f, g.fo), "bprop": (F, g.S, g.fo, g.f), "accgrad": (F, g.fo, g.S, g.f)}


def _cublas3m():
    """cublasCgemm3mStridedBatched from the libcublas this process loaded, or None."""
    import cupy as cp
    cp.cuda.device.get_cublas_handle()
    path = next((line.split()[-1] for line in open("/proc/self/maps")
                 if "libcublas.so" in line and "libcublasLt" not in line), None)
    if path is None:
        return None
    fn = getattr(ctypes.CDLL(path), "cublasCgemm3mStridedBatched", None)
    if fn is None:
        return None
    v, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    fn.argtypes = [v, i, i, i, i, i, v, v, i, ll, v, i, ll, v, v, i, ll, i]
    fn.restype = i
    return fn


def gemm_ex(a, b, out, opa, opb, m, n, k, lda, ldb, count, dtype):
    """Column-major C (m x n) = op(A) op(B) for `count` matrices, strided by whole matrices."""
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    import cupy as cp
    one = np.ones(1, np.complex64 if dtype == CUDA_C_32F else np.float32)
    zero = np.zeros_like(one)
    cublas.gemmStridedBatchedEx(cp.cuda.device.get_cublas_handle(), opa, opb, m, n, k,
                                one.ctypes.data, a.data.ptr, dtype, lda, a[0].size, b.data.ptr, dtype, ldb,
                                b[0].size, zero.ctypes.data, out.data.ptr, dtype, m, out[0].size, count,
                                COMPUTE_32F, GEMM_DEFAULT)
    return out


def forms(pass_name, A, B, fn3m):
    """{form: callable -> complex (F, p, q) or planar T (3, F, p, q)} and a decoder to complex.

    Stored operands, as the FFT kernels lay them out (frequency-major, planes fastest):
      fprop  A = X (F, S, f),   B = W (F, f', f)   C = A conj(B)^T
      bprop  A = GY (F, S, f'), B = W (F, f', f)   C = A B
      accgrad A = GY (F, S, f'), B = X (F, S, f)   C = conj(A)^T B
    """
    import cupy as cp
    F = A.shape[0]
    if pass_name == "fprop":
        p, r, q = A.shape[1], A.shape[2], B.shape[1]
    elif pass_name == "bprop":
        p, r, q = A.shape[1], A.shape[2], B.shape[2]
    else:
        p, r, q = A.shape[2], A.shape[1], B.shape[2]
    out = cp.empty((F, p, q), cp.complex64)
    # column-major view: C^T (q x p) = op(B)^T-ish; cuBLAS's A is our B and vice versa
    if pass_name == "fprop":   # C^T = conj(B) A^T: B stored (q x r) row-major = (r x q) col-major -> op C
        opa, lda, opb, ldb = OP_C, r, OP_N, r
    elif pass_name == "bprop":
        opa, lda, opb, ldb = OP_N, q, OP_N, r
    else:                      # C^T = B^T conj(A): A stored (r x p) row-major = (p x r) col-major -> op C
        opa, lda, opb, ldb = OP_N, q, OP_C, p

    def current():
        if pass_name == "fprop":
            return cp.matmul(A, cp.ascontiguousarray(cp.conj(B).transpose(0, 2, 1)))
        if pass_name == "bprop":
            return cp.matmul(A, B)
        return cp.matmul(cp.conj(A).transpose(0, 2, 1), B)

    def opc():
        return gemm_ex(B, A, out, opa, opb, q, p, r, lda, ldb, F, CUDA_C_32F)

    # Gauss planes: the sum plane's sign puts the conjugation on one side (see the module doc)
    sa = -1 if pass_name == "fprop" else 1   # fprop: X plane re - im; accGrad: GY re + im
    sb = -1 if pass_name == "accgrad" else 1  # accGrad: X plane re - im; W always re + im
    A3 = cp.stack([A.real, A.imag, A.real + sa * A.imag])
    B3 = cp.stack([B.real, B.imag, B.real + sb * B.imag])
    T = cp.empty((3 * F, p, q), cp.float32)
    opr = {OP_C: OP_T, OP_N: OP_N}

    def gauss():
        return gemm_ex(B3.reshape(3 * F, *B.shape[1:]), A3.reshape(3 * F, *A.shape[1:]), T,
                       opr[opa], opr[opb], q, p, r, lda, ldb, 3 * F, CUDA_R_32F)

    def decode(Tp):
        t1, t2, t3 = Tp.reshape(3, F, p, q)
        if pass_name == "bprop":
            return (t1 - t2) + 1j * (t3 - t1 - t2)
        return (t1 + t2) + 1j * (t1 - t2 - t3)

    fs = {"current": (current, None), "opc": (opc, None), "gauss": (gauss, decode)}
    if fn3m is not None:
        one, zero = (ctypes.c_float * 2)(1, 0), (ctypes.c_float * 2)(0, 0)
        handle = cp.cuda.device.get_cublas_handle()

        def g3m():
            status = fn3m(handle, opa, opb, q, p, r, ctypes.addressof(one), B.data.ptr, lda, B[0].size,
                          A.data.ptr, ldb, A[0].size, ctypes.addressof(zero), out.data.ptr, q, out[0].size, F)
            if status != 0:
                raise RuntimeError(f"cublasCgemm3mStridedBatched returned {status}")
            return out
        fs["3m"] = (g3m, None)
    return fs


def reference(pass_name, A, B):
    import cupy as cp
    A, B = A.astype(cp.complex128), B.astype(cp.complex128)
    if pass_name == "fprop":
        return cp.matmul(A, cp.conj(B).transpose(0, 2, 1))
    if pass_name == "bprop":
        return cp.matmul(A, B)
    return cp.matmul(cp.conj(A).transpose(0, 2, 1), B)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three layers only")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    import cupy as cp
    from tqdm import tqdm

    from minitorch_fft.backends import tuning
    fn3m = _cublas3m()
    rng = cp.random.default_rng(0)
    rows, names = [], ["current", "opc", "gauss"] + (["3m"] if fn3m else [])
    todo = [(ln, xs, ws, pad, pn) for ln, xs, ws, pad in layers(args.quick) for pn in PASSES]
    for ln, xs, ws, pad, pn in tqdm(todo, desc="cgemm"):
        n, sh = shapes(xs, ws, pad)
        F, p, r, q = sh[pn]
        a_shape = {"fprop": (F, p, r), "bprop": (F, p, r), "accgrad": (F, r, p)}[pn]
        b_shape = {"fprop": (F, q, r), "bprop": (F, r, q), "accgrad": (F, r, q)}[pn]
        A = (rng.standard_normal(a_shape, dtype=cp.float32) + 1j * rng.standard_normal(a_shape, dtype=cp.float32)).astype(cp.complex64)
        B = (rng.standard_normal(b_shape, dtype=cp.float32) + 1j * rng.standard_normal(b_shape, dtype=cp.float32)).astype(cp.complex64)
        ref = reference(pn, A, B)
        row = {"layer": ln, "pass": pn, "basis": n, "F": F, "p": p, "r": r, "q": q}
        flops = 8.0 * F * p * q * r
        for name, (fn, decode) in forms(pn, A, B, fn3m).items():
            got = fn()
            got = decode(got) if decode else got
            row[f"err_{name}"] = rel_error(got, ref)
            del got
            row[f"ms_{name}"] = median_ms(fn, "cupy", args.warmup, args.repeat)
            row[f"tflops_{name}"] = flops / row[f"ms_{name}"] / 1e9
        for name in names[1:]:
            row[f"x_{name}"] = row["ms_current"] / row[f"ms_{name}"]
        rows.append(row)
        del A, B, ref
        cp.get_default_memory_pool().free_all_blocks()
    meta = provenance(tuning.device_name(cp), cupy=cp.__version__, warmup=args.warmup, repeat=args.repeat,
                      cgemm3m_found=fn3m is not None)
    for r_ in rows:
        r_["dims"] = f"{r_['F']} x ({r_['p']}, {r_['r']}, {r_['q']})"
    cols = [("layer", "layer", ""), ("pass", "pass", ""), ("n", "basis", ""), ("F x (p, r, q)", "dims", "")]
    cols += [(f"{nm} ms", f"ms_{nm}", ".3f") for nm in names]
    cols += [(f"x {nm}", f"x_{nm}", ".2f") for nm in names[1:]]
    cols += [(f"{nm} TFLOP/s", f"tflops_{nm}", ".1f") for nm in names]
    cols += [(f"err {nm}", f"err_{nm}", ".1e") for nm in names]
    notes = ("Median ms of CUDA events; x form = current ms / form ms; TFLOP/s = 8 F p q r / time "
             "(complex-equivalent); err = relative error against a complex128 product.")
    paths = write_results("bench_cgemm", meta, rows, cols, "The frequency-domain GEMM's forms, fp32", notes,
                          out_dir=args.out)
    print(paths[1].read_text().split("\n\n", 2)[-1][-6000:])


if __name__ == "__main__":
    main()
