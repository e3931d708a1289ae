"""cgemm: the FFT backends' frequency-domain GEMM, in strict fp32 (default) or TF32.

Both FFT backends (cufft, fbfft) multiply spectra one frequency at a time: (F, p, r) @ (F, r, q)
complex64, one strided-batched cuBLAS GEMM over all F frequencies (cufft's "gauss" form does the
same with three float32 GEMMs). `matmul(xp, a, b)` runs that GEMM in the process's precision:

  fp32  (default) xp.matmul, unchanged: float32 products and sums, unit roundoff 2^-24 (6e-8);
        the FFT backends land within about 1e-6 of float64 (benchmarks/NOTES.md).
  tf32  the same GEMM with cuBLAS compute type CUBLAS_COMPUTE_32F_FAST_TF32: tensor cores round
        every input to TF32 (8-bit exponent, 10 explicit mantissa bits: unit roundoff 2^-11,
        4.9e-4) and accumulate in float32. Expect relative errors of the order of 1e-3 instead of
        1e-6, the trade cuDNN's and PyTorch's TF32 modes make. Compute capability 8.0 and up
        (Ampere, Hopper); only the GEMM changes, the FFTs stay float32.

Switch: MINITORCH_CGEMM_TF32=1 (0, the default, is fp32), or in code `set_tf32(True)` and
`with tf32(): ...`, which restores the previous setting when the block ends. NumPy never changes:
on the CPU `matmul` is np.matmul in either mode, and mode(np) is always "fp32".

Why the compute type is passed per call instead of flipping a global switch:
- CuPy's switches (the CUPY_TF32 environment variable, read once at first use, and
  cupy._core._routines_linalg.set_compute_type) reach only its 2-D dot path (gemmEx); its batched
  matmul passes the legacy compute type CUDA_C_32F to cublasGemmStridedBatchedEx whatever they
  say (cupy/_core/_routines_linalg.pyx, `matmul`). They are also process-wide, so they would move
  the real float32 GEMMs onto TF32 as well: the gemm backend, which the autotuner checks against.
- cublasSetMathMode(CUBLAS_TF32_TENSOR_OP_MATH) on CuPy's shared cuBLAS handle would leak the same
  way, and whether the legacy compute type honours it for complex GEMMs is not documented.
So TF32 mode calls cublasGemmStridedBatchedEx itself with CUBLAS_COMPUTE_32F_FAST_TF32 (the call
CuPy's matmul makes, with the compute type changed) and nothing global is touched.

Autotuning keys carry mode(xp) (backends.tuning.key), so a choice tuned under TF32 is never
reused in fp32 mode; checks of one result against another use TF32_TOL where the mode is tf32.
"""
import contextlib
import math
import os

import numpy as np

ENV = "MINITORCH_CGEMM_TF32"
# Relative error allowed between a result through a TF32 GEMM and a strict one (the tolerance
# benchmarks/paper.py gives cuDNN's TF32 convolutions); 20x TF32's unit roundoff.
TF32_TOL = 1e-2

# Values fixed by NVIDIA's headers (library_types.h, cublas_api.h), not by the CuPy version.
_CUDA_R_32F, _CUDA_C_32F = 0, 4
_CUBLAS_OP_N = 0
_CUBLAS_COMPUTE_32F_FAST_TF32 = 77
_CUBLAS_GEMM_DEFAULT = -1

_override = None  # True / False from set_tf32() or tf32(); None follows the environment


def tf32_enabled():
    """Whether the complex GEMM runs in TF32 on the GPU: set_tf32()/tf32() if used, else $MINITORCH_CGEMM_TF32."""
    if _override is not None:
        return _override
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 (strict fp32) or 1 (TF32), got {value!r}")
    return value == "1"


def set_tf32(enabled):
    """TF32 on (True) or off (False) for this process; None goes back to $MINITORCH_CGEMM_TF32."""
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_tf32 takes True, False or None, got {enabled!r}")
    _override = enabled


@contextlib.contextmanager
def tf32(enabled=True):
    """`with cgemm.tf32():` runs the block's GEMMs in TF32 (fp32 with enabled=False), then
    restores the setting that was in force before, also when the block raises."""
    global _override
    saved = _override
    set_tf32(enabled)
    try:
        yield
    finally:
        _override = saved


def mode(xp):
    """'tf32' or 'fp32': the precision matmul(xp, ...) runs in now ('fp32' for NumPy, always)."""
    return "tf32" if xp is not np and tf32_enabled() else "fp32"


def matmul(xp, a, b, out=None):
    """a (..., p, r) @ b (..., r, q) -> (..., p, q), as xp.matmul, in mode(xp)'s precision.

    TF32 applies to float32 and complex64 operands; other dtypes, and every NumPy call, go to
    xp.matmul. `out`, if given, must be C-contiguous, of the result's shape and dtype, and must
    not overlap a or b (the scratch buffers the backends pass never do).
    """
    if (mode(xp) == "fp32" or a.dtype != b.dtype or a.dtype not in (np.float32, np.complex64)
            or a.ndim < 2 or b.ndim < 2):
        return xp.matmul(a, b, out=out)
    return _tf32_matmul(xp, a, b, out)


def _tf32_matmul(xp, a, b, out):
    """One cublasGemmStridedBatchedEx with CUBLAS_COMPUTE_32F_FAST_TF32 over the batch."""
    from cupy_backends.cuda.libs import cublas

    (p, r), (r2, q) = a.shape[-2:], b.shape[-2:]
    if r != r2:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} are not aligned ({r} != {r2})")
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    # Row-major, one matrix after the other: what cuBLAS's strided batch needs. A copy only where
    # the operand is a view (a transpose, a broadcast); xp.matmul copies in the same cases.
    if a.shape[:-2] != batch:
        a = xp.broadcast_to(a, batch + (p, r))
    if b.shape[:-2] != batch:
        b = xp.broadcast_to(b, batch + (r, q))
    a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
    shape = batch + (p, q)
    if out is None:
        out = xp.empty(shape, dtype=a.dtype)
    elif out.shape != shape or out.dtype != a.dtype or not out.flags.c_contiguous:
        raise ValueError(f"matmul: out must be C-contiguous {a.dtype} of shape {shape}, got "
                         f"{out.dtype} {out.shape} (C-contiguous: {out.flags.c_contiguous})")
    count = math.prod(batch)
    if out.size == 0:
        return out
    if r == 0:
        out.fill(0)
        return out
    one, zero = np.ones(1, a.dtype), np.zeros(1, a.dtype)  # alpha, beta, read from the host
    dtype = _CUDA_C_32F if a.dtype == np.complex64 else _CUDA_R_32F
    # cuBLAS is column-major: the row-major C = A B is the column-major C^T = B^T A^T, so b comes
    # first with its row length q as leading dimension (CuPy's matmul makes the same swap).
    cublas.gemmStridedBatchedEx(
        xp.cuda.device.get_cublas_handle(), _CUBLAS_OP_N, _CUBLAS_OP_N, q, p, r,
        one.ctypes.data, b.data.ptr, dtype, q, r * q, a.data.ptr, dtype, r, p * r,
        zero.ctypes.data, out.data.ptr, dtype, q, p * q, count,
        _CUBLAS_COMPUTE_32F_FAST_TF32, _CUBLAS_GEMM_DEFAULT)
    return out
