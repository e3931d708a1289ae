"""tiledfft: overlap-save FFT convolution on n x n tiles (cuDNN's FFT_TILING idea), n = 8, 16 or 32.

fbfft transforms a whole plane in one basis, which on 224^2 planes means a 256 basis and a
3x3 kernel padded to it. Here the output is cut into tiles of mh x mw = (n - kh + 1) x (n - kw + 1)
elements; tile (i, j) reads the n x n input window at row i*mh - ph, column j*mw - pw (overlap-save:
neighbouring windows overlap by kh - 1 rows, kw - 1 columns). The circular correlation of the
window with the kernel (zero-padded to n x n) equals the linear one at rows < mh and columns < mw,
the tile's valid outputs; the rest wraps and is dropped.

  fprop   Y (nf, f', P) = conj(W) @ X     X (nf, f, P) the windows' spectra, W (nf, f', f) the
                                          kernels'; each tile's inverse keeps its valid corner
  bprop   the same with the weights rotated 180 degrees, planes swapped, padding k - 1 - p
  accGrad gW = irfft2 conj(GY @ X^H)      GY (nf, f', P): each tile's mh x mw gradient block at
                                          the origin of an n x n basis, zeros after it

nf = n (n/2 + 1) frequencies, P = S * th * tw tiles. Each product is a batched complex GEMM over
planes, one per frequency (cgemm.matmul), on the GEMM-ready layout (frequencies, planes, S*tiles)
as fbfft's spectra. accGrad sums all tiles of all images in the GEMM (its K dimension), in the
frequency domain: one inverse transform per weight, not one per tile. For accGrad a tile's
gradient block g (mh x mw) and window d (n x n) give sum_ij g[i, j] d[i + u, j + v], u < kh,
v < kw, without wrapping (i + u <= mh - 1 + kh - 1 = n - 1), and its spectrum is D conj(G).

Zero padding is implicit: a window element outside the plane is zero, and no padded copy of the
plane is made. On the CPU each window is gathered with its out-of-plane elements masked to zero
(_windows); the GPU transform kernel will read the same way: lane (r, c) of window (i, j) loads
x[i*mh - ph + r, j*mw - pw + c] when that is inside the plane and 0 otherwise, as fbfft's rfft2
kernel reads a plane placed at an offset of its basis (here the offset differs per tile, and is
negative at the top and left border), and the inverse kernel writes only the window's valid
mh x mw corner, clipped at the output's last row and column. bprop's padding k - 1 - p is
negative where p > k - 1: its windows then start inside the plane, the same reads.

Arithmetic is fp32 throughout, as the other FFT backends: numpy.fft's float32 transforms
(complex64 spectra) and a complex64 GEMM. The weights' spectra are computed in float64 and
rounded once (weights are small, as winograd's weight transform).

The basis is a parameter (basis=8, 16 or 32); by default each pass takes the basis with the
fewest frequency-domain products for its output (basis()), kernels up to n - 1 per side.
A batch whose spectra exceed the fbfft_workspace_mb setting runs in chunks (this backend is
fbfft's transform on tiles, and shares its frequency-domain budget).

DEVICES is ("cpu",): this is the NumPy reference of the algorithm; the CUDA kernels (fbfft's
8/16/32-point transforms reading tiles) are the next step (issue 18). supports() answers for the
shapes alone, as every backend's; on the GPU the backend is unsupported through DEVICES: auto
never considers it there, backends.names("cuda") leaves it out, and CuPy arrays are refused with
that said. On the CPU, auto considers it only where auto_backends names it (auto.OPT_IN).
"""
from collections import namedtuple

import numpy as np

from . import cgemm, config
from .common import check_arrays, check_output_shape, geometry, valid_geometry

# S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, oh x ow output,
# ph x pw padding, n x n Fourier basis (a tile), mh x mw valid outputs of a tile,
# th x tw tiles per plane, P = S*th*tw tiles, nf = n*(n//2 + 1) stored frequencies

BASES = (8, 16, 32)
DEVICES = ("cpu",)   # the NumPy path only, for now: no CUDA kernels yet (see the docstring)

Tiling = namedtuple("Tiling", "n mh mw th tw")


# -- what the backend takes ----------------------------------------------------------------------

def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Stride 1, any zero padding and plane shape, kernels up to 31 per side (the 32 basis's limit)."""
    g = valid_geometry(x_shape, w_shape, stride, padding)
    return g is not None and (g.sh, g.sw) == (1, 1) and max(g.kh, g.kw) < BASES[-1]


def check_geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """The Geometry, or ValueError saying why tiledfft cannot take it (layers quote it)."""
    g = geometry(x_shape, w_shape, stride, padding)
    if (g.sh, g.sw) != (1, 1):
        raise ValueError(f"tiledfft supports stride 1 only, got stride {(g.sh, g.sw)}; use polyphase, gemm or direct")
    if max(g.kh, g.kw) >= BASES[-1]:
        raise ValueError(f"tiledfft takes kernels up to {BASES[-1] - 1} per side (basis {BASES[-1]}), "
                         f"got {g.kh}x{g.kw}; use fbfft, cufft or gemm")
    return g


def tiling(out_hw, k_hw, n):
    """The Tiling of an oh x ow output for a kh x kw kernel on basis n: mh x mw valid outputs a
    tile, th x tw tiles (the last ones clipped); ValueError where the kernel does not fit n."""
    (oh, ow), (kh, kw) = out_hw, k_hw
    if n not in BASES:
        raise ValueError(f"tiledfft basis must be one of {BASES}, got {n!r}")
    if max(kh, kw) > n - 1:
        raise ValueError(f"tiledfft basis {n} takes kernels up to {n - 1} per side, got {kh}x{kw}")
    mh, mw = n - kh + 1, n - kw + 1
    return Tiling(n, mh, mw, -(-oh // mh), -(-ow // mw))


def window_origins(t, pad):
    """(rows (th,), cols (tw,)): where each tile's n x n input window starts, at offset -pad of
    the plane (negative: before the plane, read as zeros)."""
    return np.arange(t.th) * t.mh - pad[0], np.arange(t.tw) * t.mw - pad[1]


def basis(out_hw, k_hw):
    """The default basis: the one of BASES, taking the kernel, with the fewest frequency-domain
    products (tiles x stored frequencies); the smaller on a tie. A stand-in for timing, until the
    GPU kernels can be tuned (224^2 with 3x3: 32; planes of 6^2 or less with 3x3: 8)."""
    def cost(n):
        t = tiling(out_hw, k_hw, n)
        return t.th * t.tw * n * (n // 2 + 1)
    fits = [n for n in BASES if max(k_hw) <= n - 1]
    return min(fits, key=cost)


def _tiling(out_hw, k_hw, forced):
    return tiling(out_hw, k_hw, basis(out_hw, k_hw) if forced is None else forced)


def _require_cpu(xp):
    """Refuse, after the arguments' own checks, CuPy arrays: the CUDA kernels do not exist yet."""
    if xp is not np:
        raise TypeError("the tiledfft backend runs on NumPy (CPU) arrays only for now, got CuPy arrays: "
                        "its CUDA kernels are not written yet; use fbfft, cufft or winograd on the GPU "
                        "(or backend='auto')")


def _chunks(S, per_image_bytes):
    """Slices of the batch whose spectra fit fbfft_workspace_mb (one image at least)."""
    step = max(1, config.mib_bytes("fbfft_workspace_mb") // max(1, per_image_bytes))
    return [slice(s, min(s + step, S)) for s in range(0, S, step)]


def _spectrum_bytes(t, planes):
    """Bytes of one image's spectra over `planes` planes (complex64, every tile)."""
    return 8 * t.n * (t.n // 2 + 1) * t.th * t.tw * planes


# -- the three passes ----------------------------------------------------------------------------

def fprop(x, w, stride=(1, 1), padding=(0, 0), basis=None):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw)."""
    xp, x, w = check_arrays(x=x, w=w)
    g = check_geometry(x.shape, w.shape, stride, padding)
    _require_cpu(xp)
    t = _tiling((g.oh, g.ow), (g.kh, g.kw), basis)
    return _correlate(x, _weight_spectrum(w, t.n), (g.ph, g.pw), (g.oh, g.ow), t)


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0), basis=None):
    """gx (S, f, h, w): gy correlated with w rotated by 180 degrees, in/out planes swapped, at
    padding (kh - 1 - ph, kw - 1 - pw)."""
    xp, gy, w = check_arrays(gy=gy, w=w)
    g = check_geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    _require_cpu(xp)
    t = _tiling((g.h, g.w), (g.kh, g.kw), basis)
    rotated = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)                 # (f, f', kh, kw)
    pad = (g.kh - 1 - g.ph, g.kw - 1 - g.pw)                           # negative: gy's plane is cropped
    return _correlate(gy, _weight_spectrum(rotated, t.n), pad, (g.h, g.w), t)


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0), basis=None):
    """gw (f', f, kh, kw): the weight gradient, summed over the batch and every tile."""
    xp, gy, x = check_arrays(gy=gy, x=x)
    g = check_geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    _require_cpu(xp)
    t = _tiling((g.oh, g.ow), (g.kh, g.kw), basis)
    m = np.zeros((t.n * (t.n // 2 + 1), g.fo, g.f), dtype=np.complex64)          # (nf, f', f)
    for sl in _chunks(g.S, _spectrum_bytes(t, g.f + g.fo)):
        xf = _spectra(_windows(x[sl], (g.ph, g.pw), t), t)                        # (nf, f, P')
        gyf = _spectra(_gradient_blocks(gy[sl], t), t)                            # (nf, f', P')
        cgemm.matmul(np, gyf, xf, out=m, op_b="C", accumulate=True)               # m += GY X^H
    # sum_p X conj(GY) is conj(m): one inverse per weight
    gw = np.fft.irfft2(np.conj(m).reshape(t.n, t.n // 2 + 1, g.fo * g.f), s=(t.n, t.n), axes=(0, 1))
    return np.ascontiguousarray(gw[:g.kh, :g.kw].reshape(g.kh, g.kw, g.fo, g.f).transpose(2, 3, 0, 1))


# -- the pieces: gather, transforms, product, inverse -------------------------------------------

def _correlate(a, wf, pad, out_hw, t):
    """out (S, fo, oh, ow): a (S, c, h, w) read at offset -pad (zeros outside it), correlated with
    the kernels whose conjugate spectrum is wf (nf, fo, c); each tile's valid part written in place."""
    S, fo = a.shape[0], wf.shape[1]
    out = np.empty((S, fo) + tuple(out_hw), dtype=np.float32)
    for sl in _chunks(S, _spectrum_bytes(t, a.shape[1] + fo)):
        af = _spectra(_windows(a[sl], pad, t), t)                                # (nf, c, P')
        yf = cgemm.matmul(np, wf, af)                                            # (nf, fo, P')
        _write_valid(yf, t, out[sl])
    return out


def _windows(a, pad, t):
    """a (S, c, h, w) -> (S, c, th, tw, n, n): every tile's n x n input window, zeros outside the plane
    (indices clamped, then masked: the GPU kernel's bounds check)."""
    h, w = a.shape[2:]
    r0, c0 = window_origins(t, pad)
    rows, cols = r0[:, None] + np.arange(t.n), c0[:, None] + np.arange(t.n)   # (th, n), (tw, n)
    rin, cin = (rows >= 0) & (rows < h), (cols >= 0) & (cols < w)
    d = a[:, :, np.clip(rows, 0, h - 1)[:, None, :, None], np.clip(cols, 0, w - 1)[None, :, None, :]]
    return d * (rin[:, None, :, None] & cin[None, :, None, :])                  # (S, c, th, tw, n, n)


def _gradient_blocks(gy, t):
    """gy (S, fo, oh, ow) -> (S, fo, th, tw, n, n): tile (i, j)'s mh x mw block of gy at the basis's
    origin, zeros after it and past the output's last row and column."""
    S, fo, oh, ow = gy.shape
    full = np.zeros((S, fo, t.th * t.mh, t.tw * t.mw), dtype=np.float32)
    full[:, :, :oh, :ow] = gy
    blocks = full.reshape(S, fo, t.th, t.mh, t.tw, t.mw).transpose(0, 1, 2, 4, 3, 5)   # (S, fo, th, tw, mh, mw)
    out = np.zeros((S, fo, t.th, t.tw, t.n, t.n), dtype=np.float32)
    out[..., :t.mh, :t.mw] = blocks
    return out


def _spectra(tiles, t):
    """tiles (S, c, th, tw, n, n) float32 -> (nf, c, S*th*tw) complex64, frequency-major: the GEMM's
    batch of nf matrices of c planes by S*th*tw tiles."""
    S, c = tiles.shape[:2]
    F = np.fft.rfft2(tiles.astype(np.float32, copy=False))                 # (S, c, th, tw, n, n//2+1) complex64
    F = F.transpose(4, 5, 1, 0, 2, 3)                                       # (n, n//2+1, c, S, th, tw)
    return np.ascontiguousarray(F).reshape(t.n * (t.n // 2 + 1), c, S * t.th * t.tw)


def _weight_spectrum(w, n):
    """w (fo, c, kh, kw) -> conj of its spectrum on the n x n basis, (nf, fo, c) complex64: computed in
    float64 and rounded once."""
    fo, c = w.shape[:2]
    W = np.fft.rfft2(w.astype(np.float64), s=(n, n))                       # (fo, c, n, n//2+1), zero-padded
    W = np.conj(W).transpose(2, 3, 0, 1)                                    # (n, n//2+1, fo, c)
    return np.ascontiguousarray(W, dtype=np.complex64).reshape(n * (n // 2 + 1), fo, c)


def _write_valid(yf, t, out):
    """yf (nf, fo, S'*th*tw) -> out (S', fo, oh, ow): each tile's inverse, its valid mh x mw corner
    written at (i*mh, j*mw), the last tiles clipped."""
    S, fo, oh, ow = out.shape
    F = yf.reshape(t.n, t.n // 2 + 1, fo, S, t.th, t.tw).transpose(3, 2, 4, 5, 0, 1)  # (S', fo, th, tw, n, n//2+1)
    tiles = np.fft.irfft2(F, s=(t.n, t.n))[..., :t.mh, :t.mw]              # (S', fo, th, tw, mh, mw)
    plane = tiles.transpose(0, 1, 2, 4, 3, 5).reshape(S, fo, t.th * t.mh, t.tw * t.mw)
    out[...] = plane[:, :, :oh, :ow]
    return out

