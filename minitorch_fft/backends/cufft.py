"""cufft: convolution in the frequency domain with library FFTs and one complex GEMM (paper §3).

  fprop   Y[s,j]  = sum_i X[s,i] conj(W[j,i])      per frequency (S, f)  @ (f, f')
  bprop   GX[s,i] = sum_j GY[s,j] W[j,i]           per frequency (S, f') @ (f', f)
  accGrad GW[j,i] = sum_s conj(GY[s,j]) X[s,i]     per frequency (f', S) @ (S, f)

S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, ph x pw zero padding,
oh x ow output, n x m Fourier basis, F = n*(m//2+1) frequencies (the Hermitian half).

A pass: place each operand in the n x m basis (zero-extended; the kernel-sized tensor cyclically
shifted by (-ph, -pw), which makes the circular correlation the zero-padded one when n >= h + ph:
min_basis) -> real-to-complex FFT -> frequency-major spectra (F, planes) -> one batched complex
GEMM over all F frequencies (conjugate-transposes as cuBLAS operand flags) -> inverse FFT -> crop
to the pass's output. The inverse's 1/(n*m) is applied to the smallest real tensor (the weight as
placed, or gradWeight as cropped). cuFFT and cuBLAS through CuPy on the GPU; pocketfft and BLAS
through NumPy on the CPU, so CI tests the same pipeline.

A configuration is (basis, GEMM form, layout): LAYOUTS say how spectra become frequency-major
("strided": cuFFT's advanced layout writes them so; "copy": one transposing copy each way).
Untuned, default_config; with cufft_tune on, a staged search through backends.tuning (_tune),
cached per device. Batches beyond the cufft_workspace_mb setting run in chunks; scratch buffers
and plans live in cufft_buffers; spectra are shared across passes inside reuse_spectra().
benchmarks/NOTES.md ("Backend notes moved from module docstrings") has the measurements.
"""
import functools

import numpy as np

from . import cgemm, config, tuning
from .common import (batch_slices, check_arrays, check_output_shape, cuda_module, geometry, launch_1d,
                     valid_geometry)
from . import cufft_buffers as buffers
from .cufft_buffers import INT_MAX, held_on_device, keeping_retired, release_buffers  # noqa: F401 - API
from .reuse import Key, reuse_spectra, shared, suspended  # noqa: F401 - reuse_spectra: an alias

GEMMS = ("batched", "loop", "gauss")
LAYOUTS = ("copy", "strided")  # how spectra become frequency-major (module docstring)
DEFAULT_LAYOUT = "copy"        # the untuned choice: never slower than before layouts existed
# cufftExecR2C's direction argument is ignored; CuPy's Plan.fft asks for one anyway.
_FORWARD, _INVERSE = -1, 1
_INT_MAX = INT_MAX   # cuFFT's plan offsets are C ints (a test lowers it)
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
    plan = buffers.plan(xp, "r2c", basis, p * q, layout)
    if layout == "strided":
        plan.fft(a, out, _FORWARD)           # R2C leaves its input alone: `a` may be x itself
    else:
        natural = buffers.scratch(xp, "natural", (p * q, F), np.complex64)
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
    out = buffers.scratch(xp, "inverse", (p, q, n, m), np.float32)
    if layout == "copy":
        natural = buffers.scratch(xp, "natural", (p * q, F), np.complex64)
        _gpu_kernels()["transpose"](spec.reshape(F, p * q), natural)
        spec = natural
    buffers.plan(xp, "c2r", basis, p * q, layout).fft(spec, out, _INVERSE)
    return out


def _place(xp, a, basis, shift=(0, 0), scale=1.0):
    """a (p, q, h, w) -> scratch (p, q, n, m): element (u, v) at ((u - sh) mod n, (v - sw) mod m),
    times scale, zeros elsewhere. One pass over the basis on the GPU (zeros and copy together)."""
    p, q, h, w = a.shape
    n, m = basis
    out = buffers.scratch(xp, "placed", (p, q, n, m), np.float32)
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


def _cgemm(xp, a, b, role, how, op_a="N", op_b="N"):
    """op_a(a) (F, p, r) @ op_b(b) (F, r, q) -> scratch (F, p, q) for every frequency.

    `how` is one of GEMMS; op_a / op_b are cgemm.matmul's operand ops ("C": conjugate-transpose),
    cuBLAS flags on the GPU, so conj(W)^T and conj(GY)^T are never stored."""
    p = a.shape[1] if op_a == "N" else a.shape[2]
    q = b.shape[2] if op_b == "N" else b.shape[1]
    c = buffers.scratch(xp, role, (a.shape[0], p, q), np.complex64)
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
    keeps every cuFFT offset within a C int (cufft_buffers.plan). The f' x f weight-sized planes do not shrink
    with the batch: they come on top of the workspace, and never push the chunks down to single
    images (subtracting them once made OverFeat conv5 run 128 one-image GEMMs, 60x slower).
    """
    n, m = basis
    F = n * (m // 2 + 1)
    per_image = (g.f + g.fo) * (4 * n * m + 24 * F)
    return tuple(batch_slices(g.S, min(workspace_bytes // per_image, _INT_MAX // (max(g.f, g.fo) * n * m))))


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


def config_for(pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0), xp=np):
    """The configuration the next call of this pass will use: the cached winner or the default."""
    g = _stride1_geometry(x_shape, w_shape, stride, padding)
    if tuning.enabled("cufft_tune", xp):
        record = tuning.default_cache().get(tuning.key(xp, np.float32, g, pass_name, "cufft"))
        if tuning.is_record(record) and _valid_config(record["choice"], g):
            return record["choice"]
    return default_config(g)


def _run(xp, pass_name, g, run):
    """run(config) with the configuration of this pass: default, cached, or tuned now and cached."""
    return run(_config(xp, pass_name, g, run))


def _config(xp, pass_name, g, run):
    """The pass's configuration: the default untuned, else tuning.remembered's (memo, cache, or
    _tune now). A cached choice is checked by _valid_config before use."""
    if not tuning.enabled("cufft_tune", xp):
        return default_config(g)
    key = tuning.key(xp, np.float32, g, pass_name, "cufft")
    return tuning.remembered(key, lambda: _tune(xp, g, run), lambda c: _valid_config(c, g),
                             untuned=lambda: default_config(g))["choice"]


def _stages(g):
    """The staged search (paper §3.4, plus this module's layouts): each stage maps the previous
    winner to the next candidates: layout, row size, column size, GEMM form, layout again."""
    n0, m0 = min_basis(g)
    return (lambda c: [dict(c, layout=layout) for layout in LAYOUTS],
            lambda c: [dict(c, basis=[n, c["basis"][1]]) for n in basis_sizes(n0)],
            lambda c: [dict(c, basis=[c["basis"][0], m]) for m in basis_sizes(m0)],
            lambda c: [dict(c, gemm=how) for how in _gemm_forms(c)],
            lambda c: [dict(c, layout=layout) for layout in LAYOUTS])


def _tune(xp, g, run):
    """The record of the staged search: one tuning.tune per stage, the fastest going on to the
    next; every candidate is checked against the default configuration's output (TUNE_CHECK_TOL,
    or cgemm.TF32_TOL on TF32), and bases beyond cuFFT's plan limit (_fits) are never run.

    Spectrum sharing is off while timing (every candidate must pay for its FFTs), and the plans
    made meanwhile are dropped (the losers' work areas; the winner's are rebuilt once)."""
    tol = cgemm.TF32_TOL if cgemm.mode(xp) == "tf32" else TUNE_CHECK_TOL
    best, ms, skipped = default_config(g), {}, {}
    with suspended(), buffers.dropping_new_plans():
        reference = run(best)
        for stage in _stages(g):
            record = tuning.tune([c for c in stage(best) if _fits(g, c["basis"])], run, xp,
                                 reference=reference, reference_name="the default configuration",
                                 tol=tol, label=_label, warn=True)
            best = record["choice"]
            ms.update(record["ms"])
            skipped.update(record["skipped"])
    return {"choice": best, "ms": ms, "skipped": skipped,
            "why": "fastest of each stage: layout, rows, columns, GEMM form, layout"}


def _label(config):
    """A configuration's name in a tuning record: "14x16 batched copy"."""
    return "{}x{} {} {}".format(*config["basis"], config["gemm"], config["layout"])


def _gemm_forms(config):
    n, m = config["basis"]
    return [how for how in GEMMS if how != "loop" or n * (m // 2 + 1) <= LOOP_GEMM_MAX_CALLS]
