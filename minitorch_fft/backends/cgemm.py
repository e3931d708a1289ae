"""cgemm: the FFT backends' frequency-domain GEMM, in strict fp32 (default) or TF32.

Both FFT backends (cufft, fbfft) multiply spectra one frequency at a time: (F, p, r) @ (F, r, q)
complex64, one strided-batched cuBLAS GEMM over all F frequencies (cufft's "gauss" form does the
same with three float32 GEMMs). `matmul(xp, a, b, op_a=, op_b=)` runs that GEMM, an operand
optionally transposed or conjugate-transposed by the GEMM itself (fbfft's fprop multiplies by
conj(W)^T, its accGrad by conj(GY)^T: no copies), in the process's precision:

  fp32  (default) cuBLAS compute type CUBLAS_COMPUTE_32F: float32 products and sums, unit
        roundoff 2^-24 (6e-8), the GEMM xp.matmul runs; the FFT backends land within about 1e-6
        of float64 (benchmarks/NOTES.md).
  tf32  the same GEMM with compute type CUBLAS_COMPUTE_32F_FAST_TF32: tensor cores round every
        input to TF32 (8-bit exponent, 10 explicit mantissa bits: unit roundoff 2^-11, 4.9e-4)
        and accumulate in float32. Expect relative errors of the order of 1e-3 instead of 1e-6,
        the trade cuDNN's and PyTorch's TF32 modes make. Compute capability 8.0 and up (Ampere,
        Hopper); only the GEMM changes, the FFTs stay float32.

Switch: MINITORCH_CGEMM_TF32=1 (0, the default, is fp32), or in code `set_tf32(True)` and
`with tf32(): ...`, which restores the previous setting when the block ends. NumPy never changes:
on the CPU `matmul` is np.matmul on the op'ed views in either mode, and mode(np) is always "fp32".

Why the compute type is passed per call instead of flipping a global switch:
- CuPy's switches (the CUPY_TF32 environment variable, read once at first use, and
  cupy._core._routines_linalg.set_compute_type) reach only its 2-D dot path (gemmEx); its batched
  matmul passes the legacy compute type CUDA_C_32F to cublasGemmStridedBatchedEx whatever they
  say (cupy/_core/_routines_linalg.pyx, `matmul`). They are also process-wide, so they would move
  the real float32 GEMMs onto TF32 as well: the gemm backend, which the autotuner checks against.
- cublasSetMathMode(CUBLAS_TF32_TENSOR_OP_MATH) on CuPy's shared cuBLAS handle would leak the same
  way, and whether the legacy compute type honours it for complex GEMMs is not documented.
So matmul calls cublasGemmStridedBatchedEx itself (the call CuPy's matmul makes, with the op
flags and the compute type chosen here) and nothing global is touched.

Autotuning keys carry mode(xp) (backends.tuning.key), so a choice tuned under TF32 is never
reused in fp32 mode; checks of one result against another use TF32_TOL where the mode is tf32.
"""
import contextlib
import functools
import math
import threading
from collections import namedtuple

import numpy as np

from . import config

ENV = config.SETTINGS["tf32"].env
# Relative error allowed between a result through a TF32 GEMM and a strict one (the tolerance
# benchmarks/paper.py gives cuDNN's TF32 convolutions); 20x TF32's unit roundoff.
TF32_TOL = 1e-2

# Values fixed by NVIDIA's headers (library_types.h, cublas_api.h), not by the CuPy version.
_CUDA_R_32F, _CUDA_C_32F = 0, 4
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_COMPUTE_32F_FAST_TF32 = 77
_CUBLAS_GEMM_DEFAULT = -1

def tf32_enabled():
    """Whether the complex GEMM runs in TF32 on the GPU: the tf32 setting (backends.config:
    set_tf32()/tf32() in code, else $MINITORCH_CGEMM_TF32)."""
    return config.get("tf32")


def set_tf32(enabled):
    """TF32 on (True) or off (False) for this process; None goes back to $MINITORCH_CGEMM_TF32."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_tf32 takes True, False or None, got {enabled!r}")
    config.set("tf32", enabled)


def tf32(enabled=True):
    """`with cgemm.tf32():` runs the block's GEMMs in TF32 (fp32 with enabled=False), then
    restores the setting that was in force before, also when the block raises."""
    if not isinstance(enabled, bool):
        raise TypeError(f"tf32 takes True or False, got {enabled!r}")
    return config.override(tf32=enabled)


def mode(xp):
    """'tf32' or 'fp32': the precision matmul(xp, ...) runs in now ('fp32' for NumPy, always)."""
    return "tf32" if xp is not np and tf32_enabled() else "fp32"


# 1 and 0 of each dtype as host arrays: the GEMM's alpha and beta (host pointer mode); they live
# as long as the module, so their addresses can be kept in the plans below
_SCALARS = {t: (np.ones(1, t), np.zeros(1, t)) for t in (np.float32, np.complex64)}
INT_MAX = 2**31 - 1   # cuBLAS's sizes and leading dimensions are ints (the batch strides are 64-bit)
OPS = ("N", "T", "C")  # as stored, transposed, conjugate-transposed (last two axes)
_CUBLAS_OP = {"N": 0, "T": 1, "C": 2}


def apply_op(xp, a, op):
    """op(a) on the last two axes, as an array expression (a view, or a conjugated copy)."""
    if op == "N":
        return a
    a = a.swapaxes(-1, -2)
    return xp.conj(a) if op == "C" and xp.iscomplexobj(a) else a


def matmul(xp, a, b, out=None, op_a="N", op_b="N", accumulate=False, strict=False):
    """op_a(a) (..., p, r) @ op_b(b) (..., r, q) -> (..., p, q), in mode(xp)'s precision.

    op_a / op_b: "N" as stored, "T" transposed, "C" conjugate-transposed (the last two axes). On
    the GPU the op is the GEMM's own operand flag, so conj(W)^T or conj(GY)^T is never
    materialised: benchmarks/bench_cgemm.py measured those copies at up to 40 % of fprop's GEMM
    time on the large layers. accumulate=True adds the product into `out` (cuBLAS beta = 1)
    instead of overwriting it. strict=True keeps this GEMM in fp32 whatever the mode (the real
    GEMMs of the gemm backend and of Linear layers, which TF32 mode is not meant to reach).

    float32 and complex64 operands of one dtype with equal batch shapes (or a batch of one,
    broadcast) go to one cublasGemmStridedBatchedEx with compute type CUBLAS_COMPUTE_32F (strict
    fp32) or CUBLAS_COMPUTE_32F_FAST_TF32 (TF32 mode); anything else, and every NumPy call, runs
    xp.matmul on the op'ed views. `out`, if given, must be C-contiguous, of the result's shape and
    dtype, and must not overlap a or b (the scratch buffers the backends pass never do).
    """
    if op_a not in OPS or op_b not in OPS:
        raise ValueError(f"matmul: op_a and op_b must be one of {OPS}, got {op_a!r}, {op_b!r}")
    if accumulate and out is None:
        raise ValueError("matmul: accumulate=True needs out, the array to add the product into")
    if (xp is np or a.dtype != b.dtype or a.dtype not in (np.float32, np.complex64)
            or a.ndim < 2 or b.ndim < 2 or not _batchable(a, b)):
        result = xp.matmul(apply_op(xp, a, op_a), apply_op(xp, b, op_b))
        if out is None:
            return result
        if accumulate:
            out += result
        else:
            out[...] = result
        return out
    return _gemm(xp, a, b, out, op_a, op_b, accumulate, strict)


def _batchable(a, b):
    """Batch shapes one strided-batched GEMM covers: equal, or one side a single matrix."""
    ba, bb = a.shape[:-2], b.shape[:-2]
    return ba == bb or math.prod(ba) == 1 or math.prod(bb) == 1


def _gemm(xp, a, b, out, op_a, op_b, accumulate, strict):
    """One cublasGemmStridedBatchedEx over the batch, operand ops as cuBLAS flags (_launch), the
    operands checked and the plan looked up on every call."""

    for name, arr in (("a", a), ("b", b), ("out", out)):
        if arr is not None and not isinstance(arr, xp.ndarray):
            raise TypeError(f"matmul: with {xp.__name__}, {name} must be a {xp.__name__}.ndarray, got "
                            f"{type(arr).__module__}.{type(arr).__name__}; move it to the device first")
    g = _gemm_plan(a.shape, b.shape, a.dtype, op_a, op_b)   # sizes worked out once per shape
    if not a.flags.c_contiguous:
        a = xp.ascontiguousarray(a)   # the backends' operands always are: no copy there
    if not b.flags.c_contiguous:
        b = xp.ascontiguousarray(b)
    if out is None:
        out = xp.empty(g.out_shape, dtype=a.dtype)
    elif out.shape != g.out_shape or out.dtype != a.dtype or not out.flags.c_contiguous:
        raise ValueError(f"matmul: out must be C-contiguous {a.dtype} of shape {g.out_shape}, got "
                         f"{out.dtype} {out.shape} (C-contiguous: {out.flags.c_contiguous})")
    if g.count * g.p * g.q == 0:
        return out
    if g.r == 0:
        if not accumulate:
            out.fill(0)
        return out
    _launch(xp, g, a, b, out, accumulate, _compute(xp, strict))
    return out


def _compute(xp, strict):
    """The cuBLAS compute type of a GEMM now: TF32's where the mode is tf32 and the GEMM not strict."""
    return _CUBLAS_COMPUTE_32F_FAST_TF32 if not strict and mode(xp) == "tf32" else _CUBLAS_COMPUTE_32F


def _launch(xp, g, a, b, out, accumulate, compute):
    """The cublasGemmStridedBatchedEx of plan g on C-contiguous a, b and out: through CuPy on its
    handle, or, while a CUDA graph is captured, on the handle capturing() names."""
    capture = getattr(_capture, "now", None)
    if capture is None:
        from cupy_backends.cuda.libs import cublas
        gemm, handle = cublas.gemmStridedBatchedEx, xp.cuda.device.get_cublas_handle()
    else:
        handle, gemm = capture
    # alpha and beta are read from the host during the call (host pointer mode; in a graph,
    # their values at capture time)
    gemm(
        handle, g.op_b, g.op_a, g.q, g.p, g.r,
        g.one, b.data.ptr, g.dtype, g.ldb, g.stride_b, a.data.ptr, g.dtype, g.lda, g.stride_a,
        g.one if accumulate else g.zero, out.data.ptr, g.dtype, g.q, g.p * g.q, g.count, compute,
        _CUBLAS_GEMM_DEFAULT)


def prepare(xp, a_shape, b_shape, dtype=np.complex64, op_a="N", op_b="N", strict=False):
    """gemm(a, b, out=None, accumulate=False) -> out: matmul's GEMM for a caller that runs one shape
    again and again (the FFT backends' prepared passes), its cuBLAS arguments and compute type worked
    out here once: the mode as it is now (a caller keys what it keeps on the settings' state). a and
    b must be C-contiguous CuPy arrays of these shapes and of `dtype` (float32 or complex64), out
    (made if None) of the result's; gemm does not check them again. None where the product is
    empty (matmul's own cases: a zero-size result, or a zero inner size)."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.complex64) or xp is np:
        raise ValueError(f"cgemm.prepare: a GPU GEMM of float32 or complex64, got {dtype} on {xp.__name__}")
    g = _gemm_plan(tuple(a_shape), tuple(b_shape), dtype, op_a, op_b)
    if g.count * g.p * g.q * g.r == 0:
        return None
    compute, empty, shape = _compute(xp, strict), xp.empty, g.out_shape

    def gemm(a, b, out=None, accumulate=False):
        if out is None:
            out = empty(shape, dtype=dtype)
        _launch(xp, g, a, b, out, accumulate, compute)
        return out
    return gemm


# -- CUDA graphs ---------------------------------------------------------------------------------
# CuPy refuses every cuBLAS call while a stream is being captured (its wrappers' cublasSetStream
# raises NotImplementedError, cupy/cupy#6290). minitorch_fft.graphs captures a training step all
# the same: for the capture, _gemm calls libcublas's cublasGemmStridedBatchedEx directly (ctypes,
# the library CuPy loaded) on a handle bound to the capture stream with a workspace, as the cuBLAS
# guide's "CUDA Graphs Support" section asks (without one, cuBLAS may allocate inside the graph):
# one of the graph's own (GraphHandle), or one whose owner binds both, as PyTorch does for its own
# (BorrowedHandle).

# .now: (handle, gemm function) while capturing() on this thread; unset or None: CuPy's handle and
# wrapper. Per thread: a captured PyTorch step runs its backward on autograd's device thread, and
# PyTorch's handles (BorrowedHandle) are per thread, so two threads capturing at once must not see
# each other's
_capture = threading.local()
GRAPH_WORKSPACE_BYTES = 32 << 20   # cuBLAS's recommended workspace on Hopper


@contextlib.contextmanager
def capturing(handle):
    """The block's GEMMs go to `handle` (a GraphHandle or BorrowedHandle) instead of CuPy's: for stream capture."""
    saved, _capture.now = getattr(_capture, "now", None), (handle.ptr, handle.gemm)
    try:
        yield
    finally:
        _capture.now = saved


class GraphHandle:
    """A cuBLAS handle bound to one stream, with its own workspace (an array the caller keeps
    alive: allocate it from the graph's memory pool); `gemm` has cupy_backends' argument order.
    workspace None: none yet (the handle is made before a capture, since cublasCreate allocates;
    set_workspace gives it one before its first GEMM, which may be inside the capture)."""

    def __init__(self, stream_ptr, workspace):
        import ctypes
        lib = _libcublas()
        handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.ptr, self._lib, self.workspace = handle.value, lib, workspace
        self.bind(stream_ptr)

    def bind(self, stream_ptr):
        """Issue on `stream_ptr` from now on. Makes no allocation, so it may run during a capture
        (cublasSetStream drops the workspace, which is set again here where there is one)."""
        import ctypes
        _check(self._lib.cublasSetStream_v2(ctypes.c_void_p(self.ptr), ctypes.c_void_p(stream_ptr)),
               "cublasSetStream")
        self.stream_ptr = stream_ptr
        if self.workspace is not None:
            self.set_workspace(self.workspace)

    def set_workspace(self, workspace):
        """Use `workspace` (an array the caller keeps alive) from now on."""
        import ctypes
        _check(self._lib.cublasSetWorkspace_v2(ctypes.c_void_p(self.ptr), ctypes.c_void_p(workspace.data.ptr),
                                               ctypes.c_size_t(workspace.nbytes)), "cublasSetWorkspace")
        self.workspace = workspace

    def gemm(self, *args):
        _check(self._lib.cublasGemmStridedBatchedEx(*args), "cublasGemmStridedBatchedEx")

    def close(self):
        if self.ptr is not None:
            self._lib.cublasDestroy_v2(self.ptr)
            self.ptr = None

    def __del__(self):
        try:
            self.close()
        except Exception:   # interpreter shutdown
            pass


class BorrowedHandle:
    """Another library's cuBLAS handle (PyTorch's for its current stream, with its workspace bound:
    minitorch_fft.pytorch) for the GEMMs of a capture (capturing()), so that the capture takes no
    workspace of ours. Usable only where that library calls the libcublas our calls use
    (shares_libcublas()). Its math mode is set to the default here: PyTorch sets TF32 math on its
    handle where it allows TF32, which would run CUBLAS_COMPUTE_32F in TF32; our GEMMs name their
    compute type (TF32 mode's CUBLAS_COMPUTE_32F_FAST_TF32), and the owner sets its own mode again
    when it next takes the handle."""

    def __init__(self, ptr):
        import ctypes
        self._lib, self.ptr = _libcublas(), ptr
        _check(self._lib.cublasSetMathMode(ctypes.c_void_p(ptr), _CUBLAS_DEFAULT_MATH), "cublasSetMathMode")

    def gemm(self, *args):
        _check(self._lib.cublasGemmStridedBatchedEx(*args), "cublasGemmStridedBatchedEx")


_CUBLAS_DEFAULT_MATH = 0
_CU_STREAM_CAPTURE_MODE_RELAXED = 2


@contextlib.contextmanager
def relaxed_capture_mode():
    """While the block runs, this thread may make the CUDA calls a capture in global or thread-local
    mode refuses and invalidates itself on (torch.cuda.graph's default is global): cudaMalloc,
    which cublasCreate makes. For a handle its owner makes at its first use, which may be inside
    the capture (PyTorch's, in a model with no GEMM of PyTorch's before it: session 36 measured the
    capture invalidated, CUBLAS_STATUS_NOT_INITIALIZED, and made whole in this mode). Allocations
    in the block are real ones, outside the graph; stream work in it is still captured. The
    driver's cuThreadExchangeStreamCaptureMode; the previous mode restored at the block's end (a
    failed restore raises, the block's own error then its __context__)."""
    import ctypes
    exchange = _libcuda().cuThreadExchangeStreamCaptureMode
    mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)
    _check_cu(exchange(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        _check_cu(exchange(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")


@functools.lru_cache(maxsize=1)
def _libcuda():
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")              # the driver: loaded wherever CUDA runs
    lib.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuThreadExchangeStreamCaptureMode.restype = ctypes.c_int
    return lib


def _check_cu(status, what):
    if status != 0:
        raise RuntimeError(f"{what} failed with CUDA driver status {status}")


_IDENTITY_SYMBOL = "cublasCreate_v2"   # the function whose address names a libcublas instance


def shares_libcublas(library_path):
    """Whether the library at `library_path`, already loaded, calls the libcublas our calls use
    (_libcublas()): its cuBLAS functions resolve (dlsym through it, which searches the library and
    its dependencies) to the very addresses ours do, so a handle it makes is one our calls may
    take. False where it is not loaded, does not reach cuBLAS (linked statically and hidden), or
    reaches a copy other than _libcublas()'s (a second libcublas file loaded)."""
    import ctypes
    import os
    try:
        theirs = getattr(ctypes.CDLL(library_path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), _IDENTITY_SYMBOL)
    except (OSError, AttributeError):
        return False
    ours = getattr(_libcublas(), _IDENTITY_SYMBOL)
    return ctypes.cast(theirs, ctypes.c_void_p).value == ctypes.cast(ours, ctypes.c_void_p).value


def _libcublas_paths():
    """The distinct libcublas files in this process's memory map, in the map's order."""
    paths = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.rsplit(None, 1)[-1]
            if "/libcublas.so" in name and name not in paths:
                paths.append(name)
    return paths


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


@functools.lru_cache(maxsize=1)
def _libcublas():
    """The libcublas CuPy loaded, found in this process's memory map (the first one there: where
    another library loaded a second copy, possibly that one; shares_libcublas() compares with
    whichever this is, and handles and GEMMs go through it alike), with the argument types of the
    few functions used here."""
    import ctypes

    import cupy as cp
    cp.cuda.device.get_cublas_handle()            # makes CuPy load the library
    paths = _libcublas_paths()
    if not paths:
        raise RuntimeError("CUDA graphs: libcublas is not loaded in this process (looked for it in "
                           "/proc/self/maps after CuPy's first cuBLAS use)")
    lib = ctypes.CDLL(paths[0])
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasDestroy_v2.argtypes = [vp]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasSetMathMode.argtypes = [vp, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [
        vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll, i, i, i]
    for f in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
              "cublasSetMathMode", "cublasGemmStridedBatchedEx"):
        getattr(lib, f).restype = i
    return lib


GemmPlan = namedtuple("GemmPlan", "p q r count out_shape op_a op_b lda ldb stride_a stride_b dtype one zero")


@functools.lru_cache(maxsize=1024)
def _gemm_plan(a_shape, b_shape, dtype, op_a, op_b):
    """The cuBLAS arguments of op_a(a) @ op_b(b) for C-contiguous operands of these shapes.

    cuBLAS is column-major: a row-major matrix is its transpose there, so the row-major
    C = op_a(A) op_b(B) is the column-major C^T = op_b(B)^T op_a(A)^T, which is cuBLAS's
    (m, n, k) = (q, p, r) product of b's and a's stored matrices under the same op flags, each
    with its stored row length as leading dimension. A batch of one is broadcast (stride 0)."""
    p, r = a_shape[-2:] if op_a == "N" else a_shape[-1:-3:-1]
    r2, q = b_shape[-2:] if op_b == "N" else b_shape[-1:-3:-1]
    if r != r2:
        raise ValueError(f"matmul: op_a(a) {op_a} {a_shape} and op_b(b) {op_b} {b_shape} are not aligned "
                         f"({r} != {r2})")
    big = {name: n for name, n in (("rows", p), ("columns", q), ("K", r), ("a's row", a_shape[-1]),
                                    ("b's row", b_shape[-1])) if n > INT_MAX}
    if big:
        raise ValueError(f"matmul: op_a(a) {op_a} {a_shape} @ op_b(b) {op_b} {b_shape}: {big} above cuBLAS's "
                         f"int sizes ({INT_MAX}); cut the product into GEMMs of at most that")
    batch_a, batch_b = math.prod(a_shape[:-2]), math.prod(b_shape[:-2])
    batch = a_shape[:-2] if batch_a >= batch_b else b_shape[:-2]
    one, zero = _SCALARS[dtype.type]
    return GemmPlan(p=p, q=q, r=r, count=math.prod(batch), out_shape=tuple(batch) + (p, q),
                    op_a=_CUBLAS_OP[op_a], op_b=_CUBLAS_OP[op_b], lda=a_shape[-1], ldb=b_shape[-1],
                    stride_a=a_shape[-1] * a_shape[-2] if batch_a > 1 else 0,
                    stride_b=b_shape[-1] * b_shape[-2] if batch_b > 1 else 0,
                    dtype=_CUDA_C_32F if dtype == np.complex64 else _CUDA_R_32F,
                    one=one.ctypes.data, zero=zero.ctypes.data)
