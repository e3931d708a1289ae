"""cufft: convolution in the frequency domain with library FFTs and one complex GEMM (paper §3).

  fprop   Y[s,j]  = sum_i X[s,i] conj(W[j,i])      per frequency (S, f)  @ (f, f')
  bprop   GX[s,i] = sum_j GY[s,j] W[j,i]           per frequency (S, f') @ (f', f)
  accGrad GW[j,i] = sum_s conj(GY[s,j]) X[s,i]     per frequency (f', S) @ (S, f)

Every pass runs Table 1 of the paper: real-to-complex 2-D FFT of both operands over an n x m
basis (the Hermitian half, m//2+1 columns) -> transpose to frequency-major (BDHW -> HWBD) -> one
batched complex GEMM over all F = n*(m//2+1) frequencies -> transpose back -> complex-to-real
inverse FFT -> clip to the pass's output (oh x ow, h x w, kh x kw). Conjugation turns the
circular convolution into Torch's cross-correlation; no kernel is flipped. cuFFT and cuBLAS
through CuPy on the GPU; pocketfft and BLAS through NumPy on the CPU, so CI tests all of it.

The transposes take one of two forms (LAYOUTS), a tuned choice like the basis:
  "strided"  none is a copy: cuFFT's advanced data layout (cufftPlanMany's strides) lets the
             forward FFT write its spectra frequency-major, (F, planes) with the planes of one
             frequency adjacent, and the inverse read them back from there;
  "copy"     the FFTs keep cuFFT's default layout and one copy each way transposes the spectra.
On an H200 the strided plans won at 16 x 16 (1.6x on Table 4's L4) and lost at 13-14, 32 and
64 (down to 0.5x on L2), where cuFFT's own kernels for strided data are slower than a transpose
(benchmarks/exp_layout.py, NOTES.md). The conjugate-transposes the GEMMs need (conj(W)^T in
fprop, conj(GY)^T in accGrad) are cuBLAS operand flags. A pass is then at most: place its
operand in the basis (one kernel: zeros and copy together), two forward FFTs, one GEMM, one
inverse FFT, one clip, and a transpose after each FFT in the "copy" layout; a shared or
full-sized operand skips its placing or FFT.

Normalisation. Neither FFT is scaled (rfft2 norm "backward", irfft2 norm "forward"); the inverse
transform's 1/(n*m) is applied to the smallest real tensor of the pass: the weight as it is
placed (fprop, bprop) or gradWeight as it is clipped (accGrad), f'*f*kh*kw values, never a spectrum.

Zero padding, without a padded input. Operands sit at offset 0 of the basis, zero-extended at the
bottom/right as they are placed. Top/left padding (ph, pw) is a cyclic
shift by (-ph, -pw) given to whichever tensor is kernel-sized: the weight is written into its
basis at rows (u - ph) mod n for fprop and bprop, and gradWeight is read back from rows
(u - ph) mod n in accGrad. The circular correlation then equals the zero-padded one when
n >= h + ph: the zero rows below the input serve as the bottom padding and, wrapped around, as
the top padding. With n >= kh and n >= oh every operand fits, so the smallest basis is
max(h + ph, kh, oh) (one padding, not two), and likewise for m (min_basis).

Basis and GEMM choice. Untuned, a pass uses the smallest 2^a 3^b 5^c 7^d basis >= min_basis,
the "copy" layout and the strided-batched GEMM, without timing anything. With tuning on (MINITORCH_CUFFT_TUNE:
"auto" = on the GPU only, "on", "off"), the first call of a pass for a geometry times the two
layouts, the basis sizes from min_basis up to the next power of two (rows, then columns:
basis_sizes), the three GEMM forms (GEMMS) and the layouts again on the chosen basis, checks the winner against the default, and caches it per device through
backends.tuning (paper §3.4).

Memory. Placed operands, GEMM outputs and inverse outputs live in scratch buffers owned by this
module, one per role, grown when too small and reused by every call (paper §3.3); forward spectra
are fresh pool blocks, since reuse_spectra() may keep them. cuFFT plans (and their work areas)
are cached per device, shape and batch, the PLAN_CACHE_SIZE most recent kept. Above
$MINITORCH_CUFFT_WORKSPACE_MB (default 2048) the batch is processed in chunks; accGrad sums the
chunks' products in the frequency domain. Weight-sized buffers (f' x f planes) are not chunked.

Reuse across passes. Within `with backends.reuse_spectra():` (backends/reuse.py) the FFTs of x,
w and gy are computed once per array object and shared by fprop, bprop and accGrad (6 forward
FFTs per layer and step become 3); train.py wraps every training step in it by default. Spectra
are keyed by backend, role, basis and offset: only whole-batch (unchunked) spectra on the same
basis are shared, and tuned passes may pick different bases.
"""
import contextlib
import functools
import math
import warnings

import numpy as np

from . import cgemm, config, tuning
from .common import check_arrays, check_output_shape, cuda_module, geometry, launch_1d, valid_geometry
from .reuse import Key, reuse_spectra, shared, suspended  # noqa: F401 - reuse_spectra: an alias

# S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, ph x pw zero padding,
# oh x ow output, n x m Fourier basis, F = n*(m//2+1) frequencies (Hermitian half)

GEMMS = ("batched", "loop", "gauss")
LAYOUTS = ("copy", "strided")  # how spectra become frequency-major (module docstring)
DEFAULT_LAYOUT = "copy"        # the untuned choice: never slower than before layouts existed
# A host loop of more per-frequency GEMM calls than this is never a candidate (launch-bound).
LOOP_GEMM_MAX_CALLS = 512
# How far a tuned winner may stray from the default configuration before it is rejected.
TUNE_CHECK_TOL = 1e-4


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Stride 1 with any zero padding, kernel and input (rectangular ones included), where the
    f' x f weight planes of the smallest basis fit cuFFT's 32-bit plan offsets (_fits)."""
    g = valid_geometry(x_shape, w_shape, stride, padding)
    return g is not None and (g.sh, g.sw) == (1, 1) and _fits(g, _default_basis(g))


def check_geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """None, or ValueError saying why cufft cannot take this geometry (layers quote it)."""
    _stride1_geometry(x_shape, w_shape, stride, padding)


def _fits(g, basis):
    """Whether a basis keeps every cuFFT plan of g within C ints: the weight's f' x f planes are
    never chunked (one image's f or f' planes are fewer, and _batch_chunks bounds the rest)."""
    return g.fo * g.f * basis[0] * basis[1] <= _INT_MAX


def _stride1_geometry(x_shape, w_shape, stride, padding):
    """geometry(), refusing strides other than 1, and weights too large for cuFFT's plans, with a
    ValueError that says what to use instead."""
    g = geometry(x_shape, w_shape, stride, padding)
    if (g.sh, g.sw) != (1, 1):
        raise ValueError(f"cufft supports stride 1 only, got stride {(g.sh, g.sw)} (strided FFT "
                         "convolution is impractical, paper §2); use the gemm backend")
    n, m = _default_basis(g)
    if not _fits(g, (n, m)):
        raise ValueError(f"cufft: {g.fo} x {g.f} weight planes of the {n}x{m} basis exceed cuFFT's "
                         f"32-bit plan offsets ({g.fo * g.f * n * m} > {_INT_MAX} elements); use fbfft "
                         "or gemm")
    return g


# -- the three passes ----------------------------------------------------------------------

def fprop(x, w, stride=(1, 1), padding=(0, 0)):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw)."""
    xp, xa, wa = check_arrays(x=x, w=w)
    g = _stride1_geometry(x.shape, w.shape, stride, padding)

    def run(config):
        basis, layout = tuple(config["basis"]), config["layout"]
        wf = shared(_key("w", basis, (-g.ph, -g.pw)), w, _weight_spectrum, xp, wa, g, basis, layout)  # (F, f', f)
        y = xp.empty((g.S, g.fo, g.oh, g.ow), dtype=np.float32)
        chunks = _batch_chunks(g, basis)
        for sl in chunks:
            owner = x if len(chunks) == 1 else None
            xf = shared(_key("x", basis), owner, _spectrum, xp, xa[sl], basis, layout)  # (F, S', f)
            c = _cgemm(xp, xf, wf, "product", config["gemm"], op_b="C")      # (F, S', f') = X conj(W)^T
            _crop(xp, _inverse(xp, c, basis, layout), y[sl])
        return y

    return _run(xp, "fprop", g, run)


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0)):
    """gx (S, f, h, w): gradient w.r.t. the input of fprop (a full convolution of gy with w)."""
    xp, gya, wa = check_arrays(gy=gy, w=w)
    g = _stride1_geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gya, g, (g.oh, g.ow))

    def run(config):
        basis, layout = tuple(config["basis"]), config["layout"]
        wf = shared(_key("w", basis, (-g.ph, -g.pw)), w, _weight_spectrum, xp, wa, g, basis, layout)  # (F, f', f)
        gx = xp.empty((g.S, g.f, g.h, g.w), dtype=np.float32)
        chunks = _batch_chunks(g, basis)
        for sl in chunks:
            owner = gy if len(chunks) == 1 else None
            gyf = shared(_key("gy", basis), owner, _spectrum, xp, gya[sl], basis, layout)  # (F, S', f')
            c = _cgemm(xp, gyf, wf, "product", config["gemm"])               # (F, S', f) = GY W
            _crop(xp, _inverse(xp, c, basis, layout), gx[sl])  # the weight's (-ph, -pw) shift put row ph at 0
        return gx

    return _run(xp, "bprop", g, run)


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0)):
    """gw (f', f, kh, kw): gradient w.r.t. the weight, summed over the batch."""
    xp, gya, xa = check_arrays(gy=gy, x=x)
    g = _stride1_geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gya, g, (g.oh, g.ow))

    def run(config):
        basis, layout = tuple(config["basis"]), config["layout"]
        chunks = _batch_chunks(g, basis)
        for k, sl in enumerate(chunks):
            gy_owner, x_owner = (gy, x) if len(chunks) == 1 else (None, None)
            gyf = shared(_key("gy", basis), gy_owner, _spectrum, xp, gya[sl], basis, layout)  # (F, S', f')
            xf = shared(_key("x", basis), x_owner, _spectrum, xp, xa[sl], basis, layout)      # (F, S', f)
            if k == 0:                                                       # (F, f', f) = conj(GY)^T X
                gwf = _cgemm(xp, gyf, xf, "gw_sum", config["gemm"], op_a="C")
            else:                                                            # summed over S-chunks
                gwf += _cgemm(xp, gyf, xf, "product", config["gemm"], op_a="C")
        gw = xp.empty((g.fo, g.f, g.kh, g.kw), dtype=np.float32)
        _crop(xp, _inverse(xp, gwf, basis, layout), gw, shift=(g.ph, g.pw), scale=1 / (basis[0] * basis[1]))
        return gw

    return _run(xp, "accgrad", g, run)


# -- steps of the pipeline ------------------------------------------------------------------

def _weight_spectrum(xp, w, g, basis, layout):
    """w (f', f, kh, kw) scaled by 1/(n*m), shifted by (-ph, -pw) in the basis -> (F, f', f)."""
    return _spectrum(xp, w, basis, layout, shift=(g.ph, g.pw), scale=1 / (basis[0] * basis[1]))


def _spectrum(xp, a, basis, layout, shift=(0, 0), scale=1.0):
    """a (p, q, h, w) float32 placed in the n x m basis (_place) -> (F, p, q) complex64, frequency-major.

    The paper's FFT and Trans2D. "strided": in one call, the R2C plan writing frequency k of
    plane b at k*p*q + b (cuFFT's advanced layout, ostride = p*q, odist = 1), the layout the
    GEMM reads; "copy": cuFFT's default layout (p*q, F) into scratch, then one transposing copy.
    A fresh array, never a scratch buffer: reuse_spectra() may keep it for a later pass.
    Both layouts give the same array, so spectra are shared across passes whatever their layout.
    """
    p, q, h, w = a.shape
    n, m = basis
    if (h, w) != (n, m) or shift != (0, 0) or scale != 1 or not _aligned(xp, a):
        a = _place(xp, a, basis, shift, scale)                               # scratch (p, q, n, m)
    F = n * (m // 2 + 1)
    if xp is np:
        spec = np.fft.rfft2(a).astype(np.complex64, copy=False)  # NumPy < 2 returns complex128
        return np.ascontiguousarray(spec.reshape(p * q, F).T).reshape(F, p, q)
    out = xp.empty((F, p, q), dtype=np.complex64)
    plan = _plan(xp, "r2c", basis, p * q, layout)
    if layout == "strided":
        plan.fft(a, out, _FORWARD)           # R2C leaves its input alone: `a` may be x itself
    else:
        natural = _scratch(xp, "natural", (p * q, F), np.complex64)
        plan.fft(a, natural, _FORWARD)
        _gpu_kernels()["transpose"](natural, out.reshape(F, p * q))
    return out


def _aligned(xp, a):
    """Whether cuFFT may read `a` in place: it needs its data aligned (cufftComplex, 8 bytes; we
    ask 16). Whole arrays from the pool are; a batch chunk x[sl] may start 4 bytes off."""
    return xp is np or a.data.ptr % 16 == 0


def _inverse(xp, spec, basis, layout):
    """spec (F, p, q) complex64, frequency-major -> scratch (p, q, n, m) float32, unscaled.

    "strided": the C2R plan reads frequency k of plane b at k*p*q + b (istride = p*q, idist = 1),
    Trans2D back and the inverse FFT in one call; "copy": one transposing copy to (p*q, F), then
    cuFFT's default layout. cuFFT's multi-dimensional C2R overwrites its input: spec (strided)
    is always a GEMM output in scratch, and the copy (copy) is scratch too.
    """
    F, p, q = spec.shape
    n, m = basis
    if xp is np:
        half = spec.reshape(F, p * q).T.reshape(p, q, n, m // 2 + 1)
        return np.fft.irfft2(half, s=basis, norm="forward").astype(np.float32, copy=False)
    out = _scratch(xp, "inverse", (p, q, n, m), np.float32)
    if layout == "copy":
        natural = _scratch(xp, "natural", (p * q, F), np.complex64)
        _gpu_kernels()["transpose"](spec.reshape(F, p * q), natural)
        spec = natural
    _plan(xp, "c2r", basis, p * q, layout).fft(spec, out, _INVERSE)
    return out


def _place(xp, a, basis, shift=(0, 0), scale=1.0):
    """a (p, q, h, w) -> scratch (p, q, n, m): element (u, v) at ((u - sh) mod n, (v - sw) mod m),
    times scale, zeros elsewhere. One pass over the basis on the GPU (zeros and copy together)."""
    p, q, h, w = a.shape
    n, m = basis
    out = _scratch(xp, "placed", (p, q, n, m), np.float32)
    if xp is np:
        out.fill(0)
        out[:, :, _cyclic(h, shift[0], n)[:, None], _cyclic(w, shift[1], m)] = a * np.float32(scale)
    else:
        _gpu_kernels()["place"](xp.ascontiguousarray(a), n, m, h, w, shift[0], shift[1],
                                np.float32(scale), out)
    return out


def _crop(xp, full, out, shift=(0, 0), scale=1.0):
    """out (p, q, oh, ow)[..., u, v] = full (p, q, n, m)[..., (u - sh) mod n, (v - sw) mod m] * scale.

    The pass's clip: (0, 0) for fprop and bprop; gradWeight reads its taps back from the rows
    and columns the weight was shifted to, and takes the inverse FFT's 1/(n*m)."""
    n, m = full.shape[2:]
    oh, ow = out.shape[2:]
    if xp is np:
        out[...] = full[:, :, _cyclic(oh, shift[0], n)[:, None], _cyclic(ow, shift[1], m)]
        if scale != 1:
            out *= np.float32(scale)
    else:
        _gpu_kernels()["crop"](full, n, m, oh, ow, shift[0], shift[1], np.float32(scale), out)
    return out


def _cyclic(count, shift, size):
    """Rows (or columns) (i - shift) mod size for i < count, as a NumPy index array."""
    return (np.arange(count) - shift) % size


@functools.lru_cache(maxsize=None)
def _gpu_kernels():
    """_place, _crop and the copy layout's transposes on the GPU: kernels/cufft.cu, behind functions
    that take the arguments of their NumPy models (tests/test_cufft_emulated.py runs the same C
    arithmetic). RawKernel launches: CuPy's ElementwiseKernel, and its copy into a transposed
    view, spent ~3x the host time per call parsing arguments, which a small pass's kernels do not
    hide; the copy also read or wrote with a stride, where the tiled transpose does neither."""
    module = cuda_module("cufft.cu")
    place_k, crop_k = module.get_function("cufft_place"), module.get_function("cufft_crop")
    transpose_k = module.get_function("cufft_transpose")
    i32 = np.int32

    def place(a, n, m, h, w, sh, sw, scale, out):
        _contiguous(a, out)
        launch_1d(place_k, out.size, (a, out, i32(n), i32(m), i32(h), i32(w), i32(sh), i32(sw), scale,
                                      np.int64(out.size)))

    def crop(full, n, m, oh, ow, sh, sw, scale, out):
        _contiguous(full, out)
        launch_1d(crop_k, out.size, (full, out, i32(n), i32(m), i32(oh), i32(ow), i32(sh), i32(sw), scale,
                                     np.int64(out.size)))

    def transpose(src, dst):
        """dst (cols, rows) = src (rows, cols)^T, complex64, both C-contiguous."""
        rows, cols = src.shape
        _contiguous(src, dst)
        if dst.shape != (cols, rows) or src.dtype != np.complex64 or dst.dtype != np.complex64:
            raise ValueError(f"cufft transpose: {src.dtype} {src.shape} into {dst.dtype} {dst.shape}")
        tiles = ((rows + 31) // 32) * ((cols + 31) // 32)     # one block per 32 x 32 tile
        transpose_k((tiles,), (32, 8), (src, dst, i32(rows), i32(cols)))
    return {"place": place, "crop": crop, "transpose": transpose}


def _contiguous(*arrays):
    if not all(a.flags.c_contiguous for a in arrays):
        raise ValueError("cufft: its place, crop and transpose kernels address C-contiguous arrays only")


# cufftExecR2C's direction argument is ignored; CuPy's Plan.fft asks for one anyway.
_FORWARD, _INVERSE = -1, 1
# cuFFT's plan arguments are C ints: every offset into a plan's input or output must fit.
_INT_MAX = 2**31 - 1
PLAN_CACHE_SIZE = 32  # plans kept per process (each holds a cuFFT work area), least recent dropped
_plans = {}


def _plan(xp, kind, basis, batch, layout):
    """The cached cuFFT plan of `batch` n x m transforms between (batch, n, m) real planes and
    spectra: kind "r2c" (forward) or "c2r" (inverse); layout "strided" for frequency-major
    (F, batch) spectra, "copy" for cuFFT's default (batch, F)."""
    from cupy.cuda import cufft as lib
    n, m = basis
    key = (xp.cuda.Device().id, kind, n, m, batch, layout)
    plan = _plans.pop(key, None)
    if plan is None:
        if batch * n * m > _INT_MAX:
            raise ValueError(f"cufft: {batch} planes of {n}x{m} exceed cuFFT's 32-bit plan offsets "
                             f"({batch * n * m} > {_INT_MAX} elements); use fewer planes per call")
        real, half = [n, m], [n, m // 2 + 1]
        if layout == "copy":
            fft_type = lib.CUFFT_R2C if kind == "r2c" else lib.CUFFT_C2R
            plan = lib.PlanNd((n, m), None, 1, 0, None, 1, 0, fft_type, batch, "C", -1, m)  # default layout
        elif kind == "r2c":
            plan = lib.PlanNd((n, m), real, 1, n * m, half, batch, 1, lib.CUFFT_R2C, batch, "C", -1, m)
        else:
            plan = lib.PlanNd((n, m), half, batch, 1, real, 1, n * m, lib.CUFFT_C2R, batch, "C", -1, m)
        while len(_plans) >= PLAN_CACHE_SIZE:
            _retire(_plans.pop(next(iter(_plans))))                          # the least recent
    _plans[key] = plan                                                       # now the most recent
    return plan


def _cgemm(xp, a, b, role, how, op_a="N", op_b="N"):
    """op_a(a) (F, p, r) @ op_b(b) (F, r, q) -> scratch (F, p, q) for every frequency.

    `how` is one of GEMMS; op_a / op_b are cgemm.matmul's operand ops ("C": conjugate-transpose),
    cuBLAS flags on the GPU, so conj(W)^T and conj(GY)^T are never stored."""
    p = a.shape[1] if op_a == "N" else a.shape[2]
    q = b.shape[2] if op_b == "N" else b.shape[1]
    c = _scratch(xp, role, (a.shape[0], p, q), np.complex64)
    if how == "batched":       # one call: cublasGemmStridedBatchedEx on the GPU
        cgemm.matmul(xp, a, b, out=c, op_a=op_a, op_b=op_b)
    elif how == "loop":        # one cuBLAS GEMM per frequency, issued from the host
        for k in range(a.shape[0]):
            cgemm.matmul(xp, a[k], b[k], out=c[k], op_a=op_a, op_b=op_b)
    elif how == "gauss":       # three real batched GEMMs instead of four (Gauss's trick)
        a, b = cgemm.apply_op(xp, a, op_a), cgemm.apply_op(xp, b, op_b)      # op'ed copies here
        ar, ai = xp.ascontiguousarray(a.real), xp.ascontiguousarray(a.imag)
        br, bi = xp.ascontiguousarray(b.real), xp.ascontiguousarray(b.imag)
        t1 = cgemm.matmul(xp, ar + ai, br)              # ar br + ai br
        t2 = cgemm.matmul(xp, ar, bi - br)              # ar bi - ar br
        t3 = cgemm.matmul(xp, ai, br + bi)              # ai br + ai bi
        xp.subtract(t1, t3, out=c.real)          # ar br - ai bi
        xp.add(t1, t2, out=c.imag)               # ar bi + ai br
    else:
        raise ValueError(f"unknown complex GEMM form {how!r}; expected one of {GEMMS}")
    return c


def _batch_chunks(g, basis):
    """_chunks(g, basis, the cufft workspace in bytes): computed once per geometry and basis."""
    return _chunks(g, tuple(basis), config.mib_bytes("cufft_workspace_mb"))


@functools.lru_cache(maxsize=1024)
def _chunks(g, basis, workspace_bytes):
    """Slices of the batch whose frequency-domain buffers fit workspace_bytes (>= 1 image each).

    Per image a pass holds about f + f' planes of real basis (4nm bytes: the placed input, the
    inverse's output) and of two spectra (16F bytes: the FFT's frequency-major output and the
    GEMM's), plus cuFFT's work area, counted as one more spectrum (24F in all). A chunk also
    keeps every cuFFT offset within a C int (_plan). The f' x f weight-sized planes do not shrink
    with the batch: they come on top of the workspace, and never push the chunks down to single
    images (subtracting them once made OverFeat conv5 run 128 one-image GEMMs, 60x slower).
    """
    n, m = basis
    F = n * (m // 2 + 1)
    per_image = (g.f + g.fo) * (4 * n * m + 24 * F)
    step = max(1, min(workspace_bytes // per_image, _INT_MAX // (max(g.f, g.fo) * n * m)))
    return tuple(slice(s, min(s + step, g.S)) for s in range(0, g.S, step))


# -- scratch buffers: one per role, grown on demand, never handed to the caller ---------------

_scratch_buffers = {}


def _scratch(xp, role, shape, dtype):
    """A view of `shape` on this module's buffer for `role`; the next call overwrites it."""
    size = math.prod(shape)
    device = "cpu" if xp is np else xp.cuda.Device().id
    key = (role, np.dtype(dtype).str, device)
    buf = _scratch_buffers.get(key)
    if buf is None or buf.size < size:
        _retire(_scratch_buffers.pop(key, None))  # the allocator may reuse the old memory
        buf = _scratch_buffers[key] = xp.empty(size, dtype=dtype)
    return buf[:size].reshape(shape)


def held_on_device():
    """The scratch buffers and cuFFT plans (whose work areas are device memory) this module holds
    now. A captured CUDA graph keeps addresses in them: minitorch_fft.graphs holds these objects
    for as long as its graph lives, so a buffer that grows or a plan that leaves the cache does not
    hand memory the graph writes to another allocation. Inside keeping_retired(), the plans and
    buffers dropped meanwhile are kept too (a step that needs more than PLAN_CACHE_SIZE plans
    evicts some of them during its own capture)."""
    return list(_scratch_buffers.values()) + list(_plans.values())


_retired = None   # a list while keeping_retired() runs: what the caches dropped meanwhile


def _retire(obj):
    if _retired is not None and obj is not None:
        _retired.append(obj)


@contextlib.contextmanager
def keeping_retired():
    """`with keeping_retired() as kept:` the plans and scratch buffers this module drops inside
    the block are appended to `kept` instead of being freed while anything may still use them."""
    global _retired
    saved, _retired = _retired, []
    try:
        yield _retired
    finally:
        _retired = saved


def release_buffers():
    """Drop the scratch buffers and cuFFT plans (rebuilt on the next call), e.g. between benchmarks."""
    _scratch_buffers.clear()
    _plans.clear()


# -- spectra shared across passes (backends/reuse.py) ---------------------------------------

@functools.lru_cache(maxsize=None)
def _key(role, basis, offset=(0, 0)):
    """The reuse key of a spectrum: x and gy sit at offset 0; w is shifted by (-ph, -pw)."""
    return Key("cufft", role, tuple(basis), offset)


# -- basis sizes, configurations and tuning --------------------------------------------------

def min_basis(g):
    """The smallest n x m on which every pass of g is exact (module docstring, zero padding)."""
    return (max(g.h + g.ph, g.kh, g.oh), max(g.w + g.pw, g.kw, g.ow))


def basis_sizes(n):
    """n, then the sizes 2^a 3^b 5^c 7^d (cuFFT's fast radices) up to the next power of two (§3.4).

    n itself is kept even when it has other factors: the paper's autotuner found 13 for L5.
    """
    top = 1 << (n - 1).bit_length()
    return [i for i in range(n, top + 1) if i == n or _is_7_smooth(i)]


def _is_7_smooth(i):
    for p in (2, 3, 5, 7):
        while i % p == 0:
            i //= p
    return i == 1


def default_config(g):
    """The untuned choice: the smallest fast basis, the "copy" layout and the strided-batched GEMM."""
    return {"basis": list(_default_basis(g)), "gemm": "batched", "layout": DEFAULT_LAYOUT}


def _default_basis(g):
    n0, m0 = min_basis(g)
    return _smallest_fast(n0), _smallest_fast(m0)


@functools.lru_cache(maxsize=None)
def _smallest_fast(n0):
    """The smallest 7-smooth size >= n0 (asked on every supports() and untuned pass)."""
    return next(i for i in basis_sizes(n0) if _is_7_smooth(i))


def _valid_config(config, g):
    """One the tuner could have made for g: a candidate basis (large enough for g, no larger than
    the next power of two), a GEMM form allowed at that basis and a layout. A cached choice is
    checked before use, so an edited or stale file cannot send a pass to a huge basis or a long
    loop (and a choice cached before layouts were tuned is tuned again)."""
    try:
        n, m = config["basis"]
        how, layout = config["gemm"], config["layout"]
    except (TypeError, KeyError, ValueError):
        return False
    n0, m0 = min_basis(g)
    return (type(n) is int and type(m) is int and _is_basis_size(n, n0) and _is_basis_size(m, m0)
            and _fits(g, (n, m)) and how in _gemm_forms(config) and layout in LAYOUTS)


def _is_basis_size(n, n0):
    """n in basis_sizes(n0), without building the list (this runs on every tuned pass)."""
    return n0 <= n <= 1 << (n0 - 1).bit_length() and (n == n0 or _is_7_smooth(n))


def _tuning_enabled(xp):
    tune = config.get("cufft_tune")
    return tune == "on" or (tune == "auto" and xp is not np)


def _tune_key(xp, pass_name, g):
    return tuning.key(xp, np.float32, g, pass_name, "cufft")


def config_for(pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0), xp=np):
    """The configuration the next call of this pass will use: the cached winner or the default."""
    g = _stride1_geometry(x_shape, w_shape, stride, padding)
    if _tuning_enabled(xp):
        config = tuning.default_cache().get(_tune_key(xp, pass_name, g))
        if _valid_config(config, g):
            return config
    return default_config(g)


def _run(xp, pass_name, g, run):
    """run(config) with the configuration of this pass: default, cached, or tuned now and cached."""
    return run(_config(xp, pass_name, g, run))


_configs = {}   # (pass, g, device, precision) -> (cache, its version, config): _config's memo


def _config(xp, pass_name, g, run):
    """The pass's configuration. Looking a tuned one up in the tuning cache (its key, a JSON entry
    name, the validity check) cost ~20 us of host time per call, more than a small pass's kernels
    take to start, so the answer is remembered until the cache changes (TuneCache.version)."""
    if not _tuning_enabled(xp):
        return default_config(g)
    cache = tuning.default_cache()
    memo = (pass_name, g, -1 if xp is np else xp.cuda.Device().id, cgemm.mode(xp))
    hit = _configs.get(memo)
    if hit is not None and hit[0] is cache and hit[1] == cache.version:
        return hit[2]
    key = _tune_key(xp, pass_name, g)
    config = cache.get(key)
    if not _valid_config(config, g):
        if config is not None:
            warnings.warn(f"ignoring invalid cached cufft choice {config!r} for {pass_name} {tuple(g)}")
        config = _tune(xp, g, run)
        cache.put(key, config)
    _configs[memo] = (cache, cache.version, config)
    return config


def _tune(xp, g, run):
    """The fastest configuration for run: layout, row size, column size, GEMM form, and the layout
    again on the chosen basis (paper §3.4, plus this module's layouts).

    Spectrum sharing is off while timing (every candidate must pay for its FFTs). The winner must
    agree with the default configuration to TUNE_CHECK_TOL, else the default is kept.
    """
    made_before = set(_plans)
    try:
        return _tune_candidates(xp, g, run)
    finally:  # the losing candidates' plans hold cuFFT work areas; the winner's are rebuilt once
        for key in [k for k in _plans if k not in made_before]:
            del _plans[key]


def _tune_candidates(xp, g, run):
    with suspended():
        default = default_config(g)
        n0, m0 = min_basis(g)
        best = tuning.fastest([dict(default, layout=layout) for layout in LAYOUTS], run, xp)
        rows = [dict(best, basis=[n, best["basis"][1]]) for n in basis_sizes(n0)]
        best = tuning.fastest([c for c in rows if _fits(g, c["basis"])], run, xp)
        cols = [dict(best, basis=[best["basis"][0], m]) for m in basis_sizes(m0)]
        best = tuning.fastest([c for c in cols if _fits(g, c["basis"])], run, xp)
        best = tuning.fastest([dict(best, gemm=how) for how in _gemm_forms(best)], run, xp)
        best = tuning.fastest([dict(best, layout=layout) for layout in LAYOUTS], run, xp)
        if best != default:
            reference, got = run(default), run(best)
            err = float(xp.linalg.norm(got - reference)) / max(float(xp.linalg.norm(reference)), 1e-30)
            tol = cgemm.TF32_TOL if cgemm.mode(xp) == "tf32" else TUNE_CHECK_TOL
            if not err <= tol:
                warnings.warn(f"cufft tuning: {best} differs from {default} by {err:.2e} "
                              f"(> {tol}) on geometry {tuple(g)}; keeping the default")
                return default
        return best


def _gemm_forms(config):
    n, m = config["basis"]
    return [how for how in GEMMS if how != "loop" or n * (m // 2 + 1) <= LOOP_GEMM_MAX_CALLS]
