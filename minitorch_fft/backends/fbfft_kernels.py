"""Host side of the fbfft CUDA kernels (kernels/fbfft.cu): check, allocate, launch.

  rfft2(x, n, padding)            x (B, h, w) float32 -> F (nf, B) complex64   n = 2..128, nf = n^2/2 + 2
  irfft2(F, n, out_shape, offset) F (nf, B)          -> y (B, out_h, out_w) float32
  rfft1(x, n, pad)                x (B, len) float32  -> F (n//2+1, B) complex64      n = 2..256
  irfft1(F, n, out_len, offset)   F (n//2+1, B)       -> y (B, out_len) float32

F is frequency-major with the batch fastest (the layout the per-frequency GEMM of the
FFT convolution reads), F[freq(ky, kx), b] = rfft2(plane_b)[ky, kx] (1-D: F[k, b] = rfft(signal_b)[k]);
the 2-D half-spectrum leaves out its conjugate duplicates F[ky][0], F[ky][n/2] for ky > n/2
(fbfft_plan.compact / expand convert from and to np.fft's layout). Zero padding and clipping
are implicit: no padded or cropped copy is ever made. CuPy arrays only; the launch plans
are fbfft_plan.py, and the CPU path's emulator of the same kernels is fbfft_emulator.py.

Every launch checks its arguments and raises ValueError naming what is wrong; with
MINITORCH_FBFFT_CHECK=1 (or config.override(fbfft_check=True)) each launch is followed by a device
synchronisation, so a kernel fault surfaces at the call that caused it.
"""
import functools
import math

import numpy as np

from . import config
from .common import cuda_module
from .device import is_cupy
from .fbfft_plan import SIZES, SIZES_1D, check_size, plan, plan1, stored_frequencies

# Every instantiation the module compiles (NVRTC name expressions).
NAME_EXPRESSIONS = (tuple(f"fbfft_{k}<{n}>" for k in ("rfft2", "irfft2") for n in SIZES)
                    + tuple(f"fbfft_{k}<{n}>" for k in ("rfft1", "irfft1") for n in SIZES_1D))
STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory


@functools.lru_cache(maxsize=None)
def _plan(name, n):
    """(blocks' batch width, threads, shared-memory bytes) of kernel `name` at size n; computed
    once, since every launch asks."""
    if name.endswith("1"):
        p = plan1(n)
        return p.signals, p.threads, p.smem_bytes
    p = plan(n)
    return p.planes, p.threads, p.smem_bytes


@functools.lru_cache(maxsize=None)
def kernel(name, n):
    """The compiled RawKernel fbfft_<name><n> (name 'rfft2', 'irfft2', 'rfft1' or 'irfft1');
    compiled once, with the dynamic shared memory its plan needs allowed."""
    if name not in ("rfft2", "irfft2", "rfft1", "irfft1"):
        raise ValueError(f"fbfft: no kernel {name!r}")
    check_size(n, SIZES_1D if name.endswith("1") else SIZES)
    kern = cuda_module("fbfft.cu", ("--std=c++17",), NAME_EXPRESSIONS).get_function(f"fbfft_{name}<{n}>")
    smem = _plan(name, n)[2]
    if smem > STATIC_SMEM_LIMIT:
        kern.max_dynamic_shared_size_bytes = smem
    return kern


def _launch(name, n, B, args):
    _launcher(name, n, B, args[2:])(*args[:2])


@functools.lru_cache(maxsize=4096)
def _launcher(name, n, B, scalars):
    """launch(src, dst): kernel `name` at size n over B planes with the int/float arguments
    `scalars`, grid and shared memory worked out once (the FFT convolution launches the same few
    geometries every step; each launch then costs CuPy's own call, ~7 us on an H200 host)."""
    import cupy as cp
    width, threads, smem = _plan(name, n)
    kern, grid, block = kernel(name, n), ((B + width - 1) // width,), (threads,)

    def launch(src, dst):
        kern(grid, block, (src, dst) + scalars, shared_mem=smem)
        if config.get("fbfft_check"):   # read per launch: gpu_check_fbfft.py turns it on at run time
            cp.cuda.runtime.deviceSynchronize()  # host-device sync point: debug only
    return launch


def _check_cupy(name, a, dtype):
    if not is_cupy(a):
        raise TypeError(f"fbfft: {name} must be a CuPy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"fbfft: {name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"fbfft: {name} must be C-contiguous (no hidden copies are made)")


def _output(out, shape, dtype):
    """`out` checked against the shape and dtype a wrapper writes, or a new CuPy array of them."""
    if out is None:
        import cupy as cp
        return cp.empty(shape, dtype=dtype)
    _check_cupy("out", out, dtype)
    if tuple(out.shape) != shape:
        raise ValueError(f"fbfft: out must have shape {shape}, got {tuple(out.shape)}")
    return out


def rfft2(x, n, padding=(0, 0), out=None):
    """F (nf, B) complex64 = 2-D FFT of each x plane placed at offset `padding`
    (top, left) of an n x n zero plane. x is (B, h, w) float32 (or (..., h, w): the
    leading dimensions are the batch), h + top <= n, w + left <= n."""
    check_size(n)
    _check_cupy("x", x, np.float32)
    if x.ndim < 3:
        raise ValueError(f"fbfft: x must be (B, h, w) or (..., h, w), got shape {tuple(x.shape)}")
    h, w = x.shape[-2:]
    B = math.prod(x.shape[:-2])
    launch = rfft2_launcher(n, B, h, w, tuple(padding))
    out = _output(out, (stored_frequencies(n), B), np.complex64)
    launch(x, out)
    return out


@functools.lru_cache(maxsize=4096)
def rfft2_launcher(n, B, h, w, padding=(0, 0)):
    """launch(x, F): rfft2 of B planes of h x w at offset `padding` into F (nf, B), its sizes
    checked here, once per geometry. For callers that run one geometry again and again (fbfft's
    passes): x and F must be C-contiguous float32 / complex64 CuPy arrays of these sizes, which
    launch() does not check again."""
    check_size(n)
    top, left = padding
    if B < 1 or h < 1 or w < 1:
        raise ValueError(f"fbfft: empty input of {B} planes of {h}x{w}")
    if top < 0 or left < 0 or top + h > n or left + w > n:
        raise ValueError(f"fbfft: input {h}x{w} at offset ({top}, {left}) does not fit "
                         f"the {n}x{n} basis")
    if B >= 2**31:
        raise ValueError(f"fbfft: batch {B} exceeds the kernels' int32 batch index")
    i32 = np.int32
    return _launcher("rfft2", n, B, (i32(B), i32(h), i32(w), i32(top), i32(left)))


def irfft2(F, n, out_shape=None, offset=(0, 0), scale=None, out=None):
    """y (B, out_h, out_w) float32 = window (offset, out_shape) of the inverse 2-D FFT of
    each Hermitian half-spectrum F (nf, B) complex64, times scale (default 1/n^2,
    the inverse of rfft2). out_shape defaults to (n, n)."""
    check_size(n)
    _check_cupy("F", F, np.complex64)
    nf = stored_frequencies(n)
    if F.ndim != 2 or F.shape[0] != nf:
        raise ValueError(f"fbfft: F must have shape ({nf}, B) for n = {n}, got {tuple(F.shape)}")
    B = F.shape[1]
    out_shape = (n, n) if out_shape is None else tuple(out_shape)
    launch = irfft2_launcher(n, B, out_shape, tuple(offset), scale)
    out = _output(out, (B,) + out_shape, np.float32)
    launch(F, out)
    return out


@functools.lru_cache(maxsize=4096)
def irfft2_launcher(n, B, out_shape, offset=(0, 0), scale=None):
    """launch(F, y): irfft2 of F (nf, B) into y (B, out_h, out_w), the window checked here, once
    per geometry (as rfft2_launcher: the arrays are not checked again)."""
    check_size(n)
    out_h, out_w = out_shape
    row_off, col_off = offset
    if B < 1 or B >= 2**31:
        raise ValueError(f"fbfft: F must hold 1 to 2^31 - 1 planes, got B = {B}")
    if out_h < 1 or out_w < 1 or row_off < 0 or col_off < 0 or row_off + out_h > n or col_off + out_w > n:
        raise ValueError(f"fbfft: output window {out_h}x{out_w} at ({row_off}, {col_off}) "
                         f"does not fit the {n}x{n} basis")
    scale = 1.0 / (n * n) if scale is None else scale
    i32 = np.int32
    return _launcher("irfft2", n, B, (i32(B), i32(row_off), i32(col_off), i32(out_h), i32(out_w),
                                      np.float32(scale)))


def rfft1(x, n, pad=0, out=None):
    """F (n//2+1, B) complex64 = FFT of each row of x (B, len) float32 (or (..., len)) placed
    at offset `pad` of a length-n zero signal, len + pad <= n."""
    check_size(n, SIZES_1D)
    _check_cupy("x", x, np.float32)
    if x.ndim < 2:
        raise ValueError(f"fbfft: x must be (B, len) or (..., len), got shape {tuple(x.shape)}")
    length = x.shape[-1]
    B = math.prod(x.shape[:-1])
    if B < 1 or length < 1:
        raise ValueError(f"fbfft: empty input of shape {tuple(x.shape)}")
    if pad < 0 or pad + length > n:
        raise ValueError(f"fbfft: signal of length {length} at offset {pad} does not fit the basis {n}")
    if B >= 2**31:
        raise ValueError(f"fbfft: batch {B} exceeds the kernels' int32 batch index")
    out = _output(out, (n // 2 + 1, B), np.complex64)
    _launch("rfft1", n, B, (x, out, np.int32(B), np.int32(length), np.int32(pad)))
    return out


def irfft1(F, n, out_len=None, offset=0, scale=None, out=None):
    """y (B, out_len) float32 = window [offset, offset + out_len) of the inverse FFT of each
    Hermitian half-spectrum F (n//2+1, B) complex64, times scale (default 1/n, the inverse
    of rfft1). out_len defaults to n."""
    check_size(n, SIZES_1D)
    _check_cupy("F", F, np.complex64)
    if F.ndim != 2 or F.shape[0] != n // 2 + 1:
        raise ValueError(f"fbfft: F must have shape ({n // 2 + 1}, B), got {tuple(F.shape)}")
    B = F.shape[1]
    out_len = n if out_len is None else out_len
    if B < 1 or B >= 2**31:
        raise ValueError(f"fbfft: F must hold 1 to 2^31 - 1 signals, got B = {B}")
    if out_len < 1 or offset < 0 or offset + out_len > n:
        raise ValueError(f"fbfft: output window of {out_len} at {offset} does not fit the basis {n}")
    out = _output(out, (B, out_len), np.float32)
    scale = 1.0 / n if scale is None else scale
    _launch("irfft1", n, B, (F, out, np.int32(B), np.int32(offset), np.int32(out_len), np.float32(scale)))
    return out
