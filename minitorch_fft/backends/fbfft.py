"""fbfft: FFT convolution on our own CUDA FFT (kernels/fbfft.cu, the paper's section 5).

  fprop   Y[s,j]  = sum_i X[s,i] conj(W[j,i])      per frequency (S, f)  @ (f, f')
  bprop   GX[s,i] = sum_j GY[s,j] W[j,i]           per frequency (S, f') @ (f', f)
  accGrad GW[j,i] = sum_s conj(GY[s,j]) X[s,i]     per frequency (f', S) @ (S, f)

FFT -> complex GEMM -> inverse FFT, and nothing in between: the forward kernel reads the real
planes with their zero padding implied (the plane sits at offset (ph, pw) of the basis, zeros
elsewhere) and writes frequency-major spectra (nf, planes), so the planes of one
frequency are already the GEMM's row-major matrix; the inverse kernel reads that layout and
writes only the window each pass needs (oh x ow for fprop, h x w at (ph, pw) for bprop,
kh x kw for accGrad), scaled by 1/n^2 on the way out. No padded copy, no transposition
kernel, no crop.

Basis: the smallest power of two n >= max(h + ph, kh, oh) and >= max(w + pw, kw, ow): the zero
rows past the input serve as bottom padding and, wrapped around, as top padding (the cufft
backend's docstring has the argument). The kernels implement n <= 128; supports() is False
beyond that or for strides other than 1.

Reuse across passes, as in cufft: within `with backends.reuse_spectra():` fprop's weight
spectrum serves bprop, and fprop's input spectrum and bprop's gradient spectrum serve accGrad
(6 forward FFTs per layer and step become 3; backends/reuse.py). fprop multiplies by conj(W)^T
and accGrad by conj(GY)^T through the GEMM's operand flags (cgemm.matmul's op "C"), so the kept
spectra are the raw ones, and no conjugated or transposed copy is ever made.
Whole-batch spectra only: a chunked pass keeps none.

On the CPU the same passes run the kernels' emulator (fbfft_emulator), so CI checks the
padding, layout and clipping arithmetic that the GPU runs.
"""
import functools

import numpy as np

from . import cgemm, config, fbfft_emulator, fbfft_kernels, fbfft_plan
from .common import batch_slices, check_arrays, check_output_shape, geometry, plain_args, valid_geometry
from .reuse import Key, shared

# S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, ph x pw zero padding,
# oh x ow output, n x n Fourier basis, nf = n^2/2 + 2 frequencies (the Hermitian half without its
# conjugate duplicates: the GEMM skips them; fbfft.cu's header)

MAX_BASIS = max(fbfft_plan.SIZES)


def basis(g):
    """The power-of-two basis n for geometry g, or None beyond the kernels' sizes."""
    need = max(g.h + g.ph, g.kh, g.oh, g.w + g.pw, g.kw, g.ow)
    n = 1 << max(1, (need - 1).bit_length())
    return n if n <= MAX_BASIS else None


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Stride 1, any zero padding, and a basis of at most 128 x 128."""
    g = valid_geometry(x_shape, w_shape, stride, padding)
    return g is not None and (g.sh, g.sw) == (1, 1) and basis(g) is not None


def check_geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """None, or ValueError saying why fbfft cannot take this geometry (layers quote it)."""
    _geometry(x_shape, w_shape, stride, padding)


def _geometry(x_shape, w_shape, stride, padding):
    g = geometry(x_shape, w_shape, stride, padding)
    if (g.sh, g.sw) != (1, 1):
        raise ValueError(f"fbfft supports stride 1 only, got stride {(g.sh, g.sw)}; use gemm or direct")
    n = basis(g)
    if n is None:
        need = max(g.h + g.ph, g.kh, g.oh, g.w + g.pw, g.kw, g.ow)
        raise ValueError(f"fbfft needs a Fourier basis of {need} for input {g.h}x{g.w} with padding "
                         f"{(g.ph, g.pw)}; its kernels go up to {MAX_BASIS}; use cufft")
    return g, n


def _plan(x_shape, w_shape, stride, padding):
    """(Geometry, basis n, batch chunks) of a pass, worked out once per geometry: every step
    runs the same few, and the checks and sizes cost more host time than a small layer's kernels
    (benchmarks/experiments/exp_host_parts.py). chunks is (None,) when the whole batch fits the workspace."""
    if not plain_args(x_shape, w_shape, stride, padding):   # 8.0, lists, NumPy ints: checked first
        g = geometry(x_shape, w_shape, stride, padding)
        x_shape, w_shape = (g.S, g.f, g.h, g.w), (g.fo, g.f, g.kh, g.kw)
        stride, padding = (g.sh, g.sw), (g.ph, g.pw)
    return _plan_cached(x_shape, w_shape, stride, padding, config.mib_bytes("fbfft_workspace_mb"))


@functools.lru_cache(maxsize=1024)
def _plan_cached(x_shape, w_shape, stride, padding, workspace_bytes):
    g, n = _geometry(x_shape, w_shape, stride, padding)
    chunks = _batch_chunks(g, n, g.f + g.fo, workspace_bytes)
    return g, n, (None,) if len(chunks) == 1 else tuple(chunks)


def _kernels(xp):
    """The FFT pair for this array module: CUDA kernels on the GPU, their emulator on the CPU.

      fft(a, n, offset)      a (p, q, h, w) placed at `offset` of the basis -> (nf, p, q), fresh
      ifft(F, n, offset, out)  F (nf, ...) -> out (..., oh, ow), the window at `offset`
    """
    pair = _PAIRS.get(xp)
    if pair is None:
        pair = _PAIRS[xp] = _make_kernels(xp)
    return pair


_PAIRS = {}


def _make_kernels(xp):
    if xp is np:
        def fft(a, n, offset):
            p, q, h, w = a.shape
            F = fbfft_emulator.rfft2(a.reshape(p * q, h, w), n, offset, check_coverage=False)
            return F.reshape(-1, p, q)

        def ifft(F, n, offset, out):
            y = fbfft_emulator.irfft2(F.reshape(F.shape[0], -1), n, out.shape[-2:], offset, check_coverage=False)
            out.reshape(y.shape)[...] = y
            return out
        return fft, ifft

    # The GPU pair launches the kernels straight on C-contiguous arrays (the passes' operands, whole
    # or sliced along the batch, always are): the kernels address B planes from a pointer, so no
    # reshape is needed, and the sizes are checked once per geometry by the cached launchers.
    def fft(a, n, offset):
        p, q, h, w = a.shape
        F = xp.empty((fbfft_plan.stored_frequencies(n), p, q), dtype=np.complex64)
        fbfft_kernels.rfft2_launcher(n, p * q, h, w, offset)(a, F)
        return F

    def ifft(F, n, offset, out):
        oh, ow = out.shape[-2:]
        planes = out.size // (oh * ow)
        if F.size != fbfft_plan.stored_frequencies(n) * planes:   # the kernel would read past F
            raise ValueError(f"fbfft: a spectrum of {F.size} values cannot fill {planes} output planes "
                             f"of basis {n} ({fbfft_plan.stored_frequencies(n)} frequencies each)")
        fbfft_kernels.irfft2_launcher(n, planes, (oh, ow), offset)(F, out)
        return out
    return fft, ifft


def prepare(pass_name, g, xp):
    """run(a, b) -> out for backends.run_pass's prepared path (a, b checked there: C-contiguous float32
    CuPy arrays of g's shapes): a pass whose batch fits the workspace in one piece, as the pass
    function runs it (its spectra found or kept through reuse.shared, so run_pass runs it under the
    roles it gives the pass function: PREPARED_SPECTRA), with the basis, launchers, keys and the
    GEMM's cuBLAS arguments (cgemm.prepare) worked out here once. None on the CPU or where the batch
    goes in chunks (run_pass then calls the pass function). The output is made after the GEMM (the
    pass function makes it first): a spectrum nobody keeps is freed before it. test_fbfft checks on
    the CPU that it launches what the pass function launches."""
    if xp is np:
        return None
    x_shape, w_shape = (g.S, g.f, g.h, g.w), (g.fo, g.f, g.kh, g.kw)
    _, n, chunks = _plan(x_shape, w_shape, (g.sh, g.sw), (g.ph, g.pw))
    if chunks != (None,):
        return None
    nf, pad, empty, f32 = fbfft_plan.stored_frequencies(n), (g.ph, g.pw), xp.empty, np.float32

    def transform(role):
        """spectrum(a): reuse.shared's spectrum (nf, p, q) of operand `role` (p x q planes of h x w)."""
        p, q, h, w = {"x": x_shape, "w": w_shape, "gy": (g.S, g.fo, g.oh, g.ow)}[role]
        offset = pad if role == "x" else (0, 0)
        key, launch = _key(role, n, offset), fbfft_kernels.rfft2_launcher(n, p * q, h, w, offset)

        def fft(a):
            F = empty((nf, p, q), dtype=np.complex64)
            launch(a, F)
            return F
        return lambda a: shared(key, a, fft, a)

    if pass_name == "fprop":          # (nf, S, f) @ conj(nf, f', f)^T -> y (S, f', oh, ow)
        gemm = cgemm.prepare(xp, (nf, g.S, g.f), (nf, g.fo, g.f), op_b="C")
        ifft, out_shape = fbfft_kernels.irfft2_launcher(n, g.S * g.fo, (g.oh, g.ow), (0, 0)), (g.S, g.fo, g.oh, g.ow)
        spectrum_w, spectrum_x = transform("w"), transform("x")

        def operands(x, w):           # the GEMM's, each found or made in the pass function's order
            wf = spectrum_w(w)
            return spectrum_x(x), wf
    elif pass_name == "bprop":        # (nf, S, f') @ (nf, f', f) -> gx (S, f, h, w), read back at (ph, pw)
        gemm = cgemm.prepare(xp, (nf, g.S, g.fo), (nf, g.fo, g.f))
        ifft, out_shape = fbfft_kernels.irfft2_launcher(n, g.S * g.f, (g.h, g.w), pad), x_shape
        spectrum_w, spectrum_gy = transform("w"), transform("gy")

        def operands(gy, w):
            wf = spectrum_w(w)
            return spectrum_gy(gy), wf
    else:                             # conj(nf, S, f')^T @ (nf, S, f) -> gw (f', f, kh, kw)
        gemm = cgemm.prepare(xp, (nf, g.S, g.fo), (nf, g.S, g.f), op_a="C")
        ifft, out_shape = fbfft_kernels.irfft2_launcher(n, g.fo * g.f, (g.kh, g.kw), (0, 0)), w_shape
        spectrum_gy, spectrum_x = transform("gy"), transform("x")

        def operands(gy, x):
            return spectrum_gy(gy), spectrum_x(x)
    if gemm is None:
        return None

    def run(a, b):
        left, right = operands(a, b)
        product = gemm(left, right)
        del left, right               # a spectrum no later pass keeps is freed here
        out = empty(out_shape, dtype=f32)
        ifft(product, out)
        return out
    return run


PREPARED_SPECTRA = True   # prepare()'s run keeps and finds spectra as the pass function does


def _batch_chunks(g, n, planes_per_image, workspace_bytes):
    """Slices of the batch whose spectra fit workspace_bytes (at least one image each)."""
    per_image = planes_per_image * fbfft_plan.stored_frequencies(n) * 8 * 2  # spectra in, GEMM out
    return batch_slices(g.S, workspace_bytes // per_image)


@functools.lru_cache(maxsize=None)
def _key(role, n, offset=(0, 0)):
    """The reuse key of a spectrum: x sits at (ph, pw) of the basis, w and gy at the origin."""
    return Key("fbfft", role, (n, n), offset)


# In the passes below, a spectrum (nf, p, q) is frequency-major: the GEMM's batch of nf
# matrices. A chunk `sl` of None is the whole batch, used as it is (slicing a CuPy array costs
# microseconds of host time, and a whole-batch spectrum can be shared across passes).

def fprop(x, w, stride=(1, 1), padding=(0, 0)):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw)."""
    xp, xa, wa = check_arrays(x=x, w=w)
    g, n, chunks = _plan(x.shape, w.shape, stride, padding)
    fft, ifft = _kernels(xp)
    pad = (g.ph, g.pw)
    wf = shared(_key("w", n), w, fft, wa, n, (0, 0))                        # (nf, f', f), kept for bprop
    y = xp.empty((g.S, g.fo, g.oh, g.ow), dtype=np.float32)
    for sl in chunks:
        xs, ys = (xa, y) if sl is None else (xa[sl], y[sl])
        xf = shared(_key("x", n, pad), x if sl is None else None, fft, xs, n, pad)  # (nf, S', f)
        yf = cgemm.matmul(xp, xf, wf, op_b="C")                                     # (nf, S', f')
        ifft(yf, n, (0, 0), ys)                                                     # (S', f', oh, ow)
    return y


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0)):
    """gx (S, f, h, w): gradient w.r.t. the input of fprop (a full convolution of gy with w)."""
    xp, gya, wa = check_arrays(gy=gy, w=w)
    g, n, chunks = _plan(x_shape, w.shape, stride, padding)
    if gya.shape != (g.S, g.fo, g.oh, g.ow):
        check_output_shape("gy", gya, g, (g.oh, g.ow))
    fft, ifft = _kernels(xp)
    wf = shared(_key("w", n), w, fft, wa, n, (0, 0))                        # (nf, f', f)
    gx = xp.empty((g.S, g.f, g.h, g.w), dtype=np.float32)
    for sl in chunks:
        gys, gxs = (gya, gx) if sl is None else (gya[sl], gx[sl])
        gyf = shared(_key("gy", n), gy if sl is None else None, fft, gys, n, (0, 0))  # (nf, S', f')
        gxf = cgemm.matmul(xp, gyf, wf)                                             # (nf, S', f)
        # The input sat at (ph, pw) in fprop's basis: its gradient is read back from there.
        ifft(gxf, n, (g.ph, g.pw), gxs)                                             # (S', f, h, w)
    return gx


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0)):
    """gw (f', f, kh, kw): gradient w.r.t. the weight, summed over the batch."""
    xp, gya, xa = check_arrays(gy=gy, x=x)
    g, n, chunks = _plan(x.shape, w_shape, stride, padding)
    if gya.shape != (g.S, g.fo, g.oh, g.ow):
        check_output_shape("gy", gya, g, (g.oh, g.ow))
    fft, ifft = _kernels(xp)
    pad = (g.ph, g.pw)
    gwf = None
    for sl in chunks:
        gys, xs = (gya, xa) if sl is None else (gya[sl], xa[sl])
        whole = sl is None
        gyf = shared(_key("gy", n), gy if whole else None, fft, gys, n, (0, 0))   # (nf, S', f')
        xf = shared(_key("x", n, pad), x if whole else None, fft, xs, n, pad)     # (nf, S', f)
        # (nf, f', f), summed over S-chunks in place (the GEMM's beta = 1)
        gwf = cgemm.matmul(xp, gyf, xf, out=gwf, op_a="C", accumulate=gwf is not None)
    return ifft(gwf, n, (0, 0), xp.empty((g.fo, g.f, g.kh, g.kw), dtype=np.float32))
