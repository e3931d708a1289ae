"""tiledfft: overlap-save FFT convolution on n x n tiles (cuDNN's FFT_TILING idea), n = 8, 16 or 32.

fbfft transforms a whole plane in one basis, which on 224^2 planes means a 256 basis and a
3x3 kernel padded to it. Here the output is cut into tiles of mh x mw = (n - kh + 1) x (n - kw + 1)
elements; tile (i, j) reads the n x n input window at row i*mh - ph, column j*mw - pw (overlap-save:
neighbouring windows overlap by kh - 1 rows, kw - 1 columns). The circular correlation of the
window with the kernel (zero-padded to n x n) equals the linear one at rows < mh and columns < mw,
the tile's valid outputs; the rest wraps and is dropped.

  fprop   Y (nf, P, f') = X @ W^H          X (nf, P, f) the windows' spectra, W (nf, f', f) the
                                           kernels'; each tile's inverse keeps its mh x mw corner
  bprop   GX (nf, P, f) = GY @ W           GY the spectra of gy's windows at padding k - 1 - p: a
                                           convolution with w, i.e. the correlation with w rotated
                                           by 180 degrees and its planes swapped; the valid block
                                           of a tile's inverse is then at (kh - 1, kw - 1)
  accGrad GW (nf, f', f) = G^H @ X         G (nf, P, f') each tile's mh x mw gradient block at
                                           the origin of an n x n basis, zeros after it

P = S * th * tw tiles, nf = n^2/2 + 2 stored frequencies (fbfft's half-spectrum without its
conjugate duplicates). Each product is a batched complex GEMM over planes, one per frequency
(cgemm.matmul, the conjugate transposes as the GEMM's operand flags), on fbfft's frequency-major
layout with (tiles, planes) as its batch: the same forms as fbfft's passes, with tiles for images.
fprop and bprop take the same weight spectrum. accGrad sums all tiles of all images in the GEMM
(its K dimension), in the frequency domain: one inverse transform per weight, not one per tile.
For accGrad a tile's gradient block g (mh x mw) and window d (n x n) give sum_ij g[i, j] d[i + u,
j + v], u < kh, v < kw, without wrapping (i + u <= mh - 1 + kh - 1 = n - 1): the spectrum D conj(G).

Zero padding is implicit: a window element outside the plane is zero, and no padded copy of the
plane is made. On the GPU the transforms are fbfft's 2-D FFT passes (kernels/fbfft.cu) run on
tiles (kernels/tiledfft.cu): thread (r, c) of window (i, j) loads x[i*mh - ph + r, j*mw - pw + c]
where that is inside the plane (and, for gradient blocks, inside the block) and 0 otherwise, and
the inverse writes only the window's valid mh x mw block, clipped at the output's last row and
column, straight into the output. bprop's padding k - 1 - p is negative where p > k - 1: its
windows then start inside the plane, the same reads. The weights' spectrum and accGrad's inverse
are fbfft's own rfft2 / irfft2 (fbfft_kernels). On the CPU the same passes run in NumPy: same
tiling, layouts, GEMM forms and offsets, the windows gathered with their outside masked to zero
(_windows) and transformed by numpy.fft, the weights' spectrum in float64 rounded once.

Arithmetic is fp32 throughout, as the other FFT backends (complex64 spectra and GEMM; TF32 where
cgemm's tf32 setting is on).

The basis: kernels up to n - 1 per side. Forced with basis=8, 16 or 32; else tuned per geometry
and pass where the tiledfft_tune setting tunes (the GPU by default: backends.tuning's recipe over the
bases that take the kernel, each checked against the heuristic's basis), otherwise the heuristic
basis(): the fewest frequency-domain products (tiles x stored frequencies). A batch whose spectra
exceed the fbfft_workspace_mb setting runs in chunks (this backend is fbfft's transform on tiles,
and shares its frequency-domain budget).

auto takes it among its candidates (it is not in auto.OPT_IN): on the large-plane 3x3 layers of
VGG-16 and ResNet it was the fastest of ours and cuDNN strict in every pass measured, 1.02x to 3.0x
cuDNN strict and 1.07x to 1.8x the faster winograd tile, every basis within 5.5e-6 of float64
(H100, results/nvidia-h100-80gb-hbm3/bench_tiledfft.md; benchmarks/NOTES.md, "Tiled FFT on the GPU").
"""
import functools
from collections import namedtuple

import numpy as np

from . import cgemm, config, fbfft_plan, tuning
from .common import batch_slices, check_arrays, check_output_shape, cuda_module, geometry, valid_geometry
from .utils import is_int

# S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, oh x ow output,
# ph x pw padding, n x n Fourier basis (a tile), mh x mw valid outputs of a tile,
# th x tw tiles per plane, P = S*th*tw tiles, nf = n^2/2 + 2 stored frequencies

BASES = (8, 16, 32)
DEVICES = ("cpu", "cuda")
TUNE_TOL = 1e-4   # one basis against another while tuning, strict fp32: both far inside it when correct

Tiling = namedtuple("Tiling", "n mh mw th tw")


# -- what the backend takes ----------------------------------------------------------------------

def revision(pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0), math="fp32"):
    """auto's cue to time tiledfft again where its speed changed (backends.auto): fprop and bprop 1
    since the inverse stages its output in shared memory (kernels/tiledfft.cu; 7-25 % faster
    inverses, bit for bit the same results, exp_tiled_stages). accGrad's inverse is fbfft's, once a
    weight: unchanged, 0. In TF32 mode (math "tf32") one more, since the bases are compared at the
    TF32 tolerance (tuning.variant_tol; before, every basis but the default was refused there).
    The basis's own tuning record is keyed by it too (_basis)."""
    return _revision(pass_name, math)


def _revision(pass_name, math="fp32"):
    return (0 if pass_name == "accgrad" else 1) + (math == "tf32")


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
    if not is_int(n) or n not in BASES:   # 16.0 == 16, and then no kernel takes it
        raise ValueError(f"tiledfft basis must be one of {BASES}, got {n!r}")
    if max(kh, kw) > n - 1:
        raise ValueError(f"tiledfft basis {n} takes kernels up to {n - 1} per side, got {kh}x{kw}")
    mh, mw = n - kh + 1, n - kw + 1
    return Tiling(n, mh, mw, -(-oh // mh), -(-ow // mw))


def window_origins(t, pad):
    """(rows (th,), cols (tw,)): where each tile's n x n input window starts, at offset -pad of
    the plane (negative: before the plane, read as zeros)."""
    return np.arange(t.th) * t.mh - pad[0], np.arange(t.tw) * t.mw - pad[1]


def bases(k_hw):
    """The bases that take a kh x kw kernel."""
    return tuple(n for n in BASES if max(k_hw) <= n - 1)


def basis(out_hw, k_hw):
    """The heuristic basis: the one of bases(k_hw) with the fewest frequency-domain products
    (tiles x stored frequencies); the smaller on a tie (224^2 with 3x3: 32; 6^2 or less: 8)."""
    def cost(n):
        t = tiling(out_hw, k_hw, n)
        return t.th * t.tw * fbfft_plan.stored_frequencies(n)
    return min(bases(k_hw), key=cost)


def _chunks(S, per_image_bytes):
    """Slices of the batch whose spectra fit fbfft_workspace_mb (one image at least)."""
    return batch_slices(S, config.mib_bytes("fbfft_workspace_mb") // max(1, per_image_bytes))


def _spectrum_bytes(t, planes):
    """Bytes of one image's spectra over `planes` planes (complex64, every tile)."""
    return 8 * fbfft_plan.stored_frequencies(t.n) * t.th * t.tw * planes


# -- the three passes ----------------------------------------------------------------------------

def fprop(x, w, stride=(1, 1), padding=(0, 0), basis=None):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw)."""
    xp, x, w = check_arrays(x=x, w=w)
    g = check_geometry(x.shape, w.shape, stride, padding)

    def run(n):
        t = tiling((g.oh, g.ow), (g.kh, g.kw), n)
        return _correlate(xp, x, _weight_spectrum(xp, w, n), "C", (g.ph, g.pw), (0, 0), (g.oh, g.ow), t)
    return run(_basis(xp, "fprop", g, (g.oh, g.ow), basis, run))


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0), basis=None):
    """gx (S, f, h, w): gy convolved with w (the correlation with w rotated by 180 degrees, in/out
    planes swapped), at padding (kh - 1 - ph, kw - 1 - pw)."""
    xp, gy, w = check_arrays(gy=gy, w=w)
    g = check_geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    pad = (g.kh - 1 - g.ph, g.kw - 1 - g.pw)                           # negative: gy's plane is cropped

    def run(n):
        t = tiling((g.h, g.w), (g.kh, g.kw), n)
        return _correlate(xp, gy, _weight_spectrum(xp, w, n), "N", pad, (g.kh - 1, g.kw - 1), (g.h, g.w), t)
    return run(_basis(xp, "bprop", g, (g.h, g.w), basis, run))


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0), basis=None):
    """gw (f', f, kh, kw): the weight gradient, summed over the batch and every tile."""
    xp, gy, x = check_arrays(gy=gy, x=x)
    g = check_geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))

    def run(n):
        t = tiling((g.oh, g.ow), (g.kh, g.kw), n)
        gw = xp.empty((fbfft_plan.stored_frequencies(n), g.fo, g.f), dtype=np.complex64)   # (nf, f', f)
        for k, sl in enumerate(_chunks(g.S, _spectrum_bytes(t, g.f + g.fo))):
            xf = _spectra(xp, x[sl], (g.ph, g.pw), t, (n, n))                   # (nf, P', f)
            gyf = _spectra(xp, gy[sl], (0, 0), t, (t.mh, t.mw))                 # (nf, P', f'): the blocks
            cgemm.matmul(xp, gyf, xf, out=gw, op_a="C", accumulate=k > 0)       # gw (+)= G^H X
        return _weight_gradient(xp, gw, n, (g.kh, g.kw))
    return run(_basis(xp, "accgrad", g, (g.oh, g.ow), basis, run))


def _basis(xp, pass_name, g, out_hw, forced, run):
    """n for this pass: `forced` (checked), the tuned basis where tiledfft_tune tunes, else basis()."""
    k_hw = (g.kh, g.kw)
    if forced is not None:
        tiling(out_hw, k_hw, forced)                                    # ValueError where it cannot
        return forced
    default, options = basis(out_hw, k_hw), bases(k_hw)
    if len(options) == 1 or not tuning.enabled("tiledfft_tune", xp):
        return default
    tune = lambda: tuning.tune(options, run, xp, against=default, tol=tuning.variant_tol(xp, TUNE_TOL))  # noqa: E731
    return tuning.remembered(_basis_key(xp, pass_name, g), tune,
                             valid=lambda n: is_int(n) and n in options, untuned=lambda: default)["choice"]


def _basis_key(xp, pass_name, g):
    """The tuning key of the pass's basis (bases timed before a revision are timed again)."""
    r = _revision(pass_name, cgemm.mode(xp))
    return tuning.key(xp, np.float32, tuple(g), pass_name, f"tiledfft_r{r}" if r else "tiledfft")


def _chosen_basis(xp, pass_name, g):
    """The basis _basis would take for the pass without tuning: the only one, the heuristic's where
    tiledfft_tune does not tune, else the tuned one (None where this process's tuning memory holds
    no valid record of it for the cache as it is)."""
    k_hw = (g.kh, g.kw)
    options = bases(k_hw)
    if len(options) == 1 or not tuning.enabled("tiledfft_tune", xp):
        return basis((g.h, g.w) if pass_name == "bprop" else (g.oh, g.ow), k_hw)
    return tuning.peek_choice(_basis_key(xp, pass_name, g), options)


def prepare(pass_name, g, xp):
    """run(a, b) -> out for backends.run_pass's prepared path (a, b checked there: C-contiguous float32
    CuPy arrays of g's shapes): a pass at a basis already chosen whose batch fits the workspace in one
    piece, as its launches (the weight's or the operands' spectra, the inverse: _launcher's, their
    grids and integer arguments worked out here once) and one GEMM (cgemm.prepare); None on the CPU,
    where the batch goes in chunks or the basis is not tuned yet (run_pass then calls the pass
    function, which tunes it). The basis is the one chosen when the call is prepared: a tuning cache
    replaced later (another process's, a cleared memory) is not read again for it, as for winograd's
    tile (results the same at any basis; only its speed may differ from a re-read choice's). The
    output is made after the GEMM (the pass function makes it first): the operands' spectra are freed
    before it. test_tiledfft checks on the CPU that it launches what the pass function launches."""
    n = None if xp is np else _chosen_basis(xp, pass_name, g)
    if n is None:
        return None
    bprop = pass_name == "bprop"
    t = tiling((g.h, g.w) if bprop else (g.oh, g.ow), (g.kh, g.kw), n)
    if len(_chunks(g.S, _spectrum_bytes(t, g.f + g.fo))) != 1:
        return None
    from . import fbfft_kernels
    P, nf, empty, c64, f32 = g.S * t.th * t.tw, fbfft_plan.stored_frequencies(n), xp.empty, np.complex64, np.float32

    def spectra(c, h, w, pad, limit):
        """f(a) -> the spectra (nf, P, c) of a's windows (_spectra's launch)."""
        launch = _launcher("rfft2", n, P * c, (P * c, c, h, w, t.th, t.tw, t.mh, t.mw, *pad, *limit))
        return lambda a: launch(a, empty((nf, P, c), dtype=c64))

    if pass_name == "accgrad":       # G^H (nf, P, f') @ X (nf, P, f) -> gw (nf, f', f) -> (f', f, kh, kw)
        spectra_x = spectra(g.f, g.h, g.w, (g.ph, g.pw), (n, n))
        spectra_gy = spectra(g.fo, g.oh, g.ow, (0, 0), (t.mh, t.mw))
        gemm = cgemm.prepare(xp, (nf, P, g.fo), (nf, P, g.f), op_a="C")
        inverse = fbfft_kernels.irfft2_launcher(n, g.fo * g.f, (g.kh, g.kw))
        out_shape = (g.fo, g.f, g.kh, g.kw)

        def products(gy, x):
            xf = spectra_x(x)
            return gemm(spectra_gy(gy), xf)
    else:                            # fprop X @ W^H (nf, P, f'); bprop GY @ W (nf, P, f)
        weight = fbfft_kernels.rfft2_launcher(n, g.fo * g.f, g.kh, g.kw)
        c, out_planes = (g.fo, g.f) if bprop else (g.f, g.fo)
        in_hw, out_hw = ((g.oh, g.ow), (g.h, g.w)) if bprop else ((g.h, g.w), (g.oh, g.ow))
        pad = (g.kh - 1 - g.ph, g.kw - 1 - g.pw) if bprop else (g.ph, g.pw)
        offset = (g.kh - 1, g.kw - 1) if bprop else (0, 0)
        spectra_a = spectra(c, *in_hw, pad, (n, n))
        gemm = cgemm.prepare(xp, (nf, P, c), (nf, g.fo, g.f), op_b="N" if bprop else "C")
        write = _launcher("irfft2", n, P * out_planes, (P * out_planes, out_planes, *out_hw, t.th, t.tw, t.mh, t.mw,
                                                         *offset), np.float32(1.0 / (n * n)))
        out_shape = (g.S, out_planes, *out_hw)

        def products(a, w):
            wf = empty((nf, g.fo, g.f), dtype=c64)
            weight(w, wf)
            return gemm(spectra_a(a), wf)

        def inverse(product, out):
            write(product, out)
    if gemm is None:
        return None

    def run(a, b):
        product = products(a, b)     # the operands' spectra freed here
        out = empty(out_shape, dtype=f32)
        inverse(product, out)
        return out
    return run


def _correlate(xp, a, wf, op, pad, offset, out_hw, t):
    """out (S, fo, oh, ow): the spectra of a (S, c, h, w)'s windows at offset -pad (zeros outside
    it) times op(wf) (wf (nf, fo, c); op "C": W^H, fprop; "N": W, bprop), each tile's block at
    `offset` of its inverse written in place."""
    S, c = a.shape[:2]
    fo = wf.shape[1] if op == "C" else wf.shape[2]
    out = xp.empty((S, fo) + tuple(out_hw), dtype=np.float32)
    for sl in _chunks(S, _spectrum_bytes(t, c + fo)):
        af = _spectra(xp, a[sl], pad, t, (t.n, t.n))                   # (nf, P', c)
        yf = cgemm.matmul(xp, af, wf, op_b=op)                          # (nf, P', fo)
        _write_valid(xp, yf, t, offset, out[sl])
    return out


# -- the transforms: CUDA kernels on the GPU, the same arithmetic in NumPy on the CPU ------------

def _spectra(xp, a, pad, t, limit):
    """a (S, c, h, w) -> (nf, S*th*tw, c) complex64: the spectrum of every tile's n x n window (at
    row i*mh - pad[0], column j*mw - pad[1]), reading only its first limit = (rows, cols) and
    zeros outside the plane; frequency-major with the planes fastest (the GEMM's batch)."""
    S, c, h, w = a.shape
    P, nf = S * t.th * t.tw, fbfft_plan.stored_frequencies(t.n)
    if xp is not np:
        F = xp.empty((nf, P, c), dtype=np.complex64)
        _launch("rfft2", t.n, P * c, a, F, (P * c, c, h, w, t.th, t.tw, t.mh, t.mw, *pad, *limit))
        return F
    tiles = np.fft.rfft2(_windows(a, pad, t, limit))                   # (S, c, th, tw, n, n//2+1)
    tiles = tiles.transpose(4, 5, 0, 2, 3, 1).reshape(t.n, t.n // 2 + 1, P * c)   # (n, n//2+1, S*th*tw*c)
    return np.ascontiguousarray(fbfft_plan.compact(tiles, t.n), dtype=np.complex64).reshape(nf, P, c)


def _windows(a, pad, t, limit=None):
    """a (S, c, h, w) -> (S, c, th, tw, n, n): every tile's n x n window, zeros outside the plane and
    past the window's first limit = (rows, cols) (indices clamped, then masked: the kernel's bounds
    check)."""
    h, w = a.shape[2:]
    lh, lw = limit or (t.n, t.n)
    r0, c0 = window_origins(t, pad)
    rows, cols = r0[:, None] + np.arange(t.n), c0[:, None] + np.arange(t.n)   # (th, n), (tw, n)
    rin = (rows >= 0) & (rows < h) & (np.arange(t.n) < lh)
    cin = (cols >= 0) & (cols < w) & (np.arange(t.n) < lw)
    d = a[:, :, np.clip(rows, 0, h - 1)[:, None, :, None], np.clip(cols, 0, w - 1)[None, :, None, :]]
    return d * (rin[:, None, :, None] & cin[None, :, None, :])                  # (S, c, th, tw, n, n)


def _write_valid(xp, yf, t, offset, out):
    """yf (nf, S'*th*tw, fo) -> out (S', fo, oh, ow): each tile's inverse, its mh x mw block at
    `offset` of the basis written at (i*mh, j*mw), the last tiles clipped."""
    S, fo, oh, ow = out.shape
    if xp is not np:
        _launch("irfft2", t.n, yf.shape[1] * fo, yf, out, (yf.shape[1] * fo, fo, oh, ow, t.th, t.tw, t.mh, t.mw,
                                                          *offset), np.float32(1.0 / (t.n * t.n)))
        return out
    full = fbfft_plan.expand(yf.reshape(yf.shape[0], -1), t.n)               # (n, n//2+1, S'*th*tw*fo)
    tiles = np.fft.irfft2(full, s=(t.n, t.n), axes=(0, 1))                  # (n, n, S'*th*tw*fo)
    block = tiles[offset[0]:offset[0] + t.mh, offset[1]:offset[1] + t.mw]
    block = block.reshape(t.mh, t.mw, S, t.th, t.tw, fo).transpose(2, 5, 3, 0, 4, 1)   # (S', fo, th, mh, tw, mw)
    out[...] = block.reshape(S, fo, t.th * t.mh, t.tw * t.mw)[:, :, :oh, :ow]
    return out


def _weight_spectrum(xp, w, n):
    """w (fo, c, kh, kw) -> its spectrum on the n x n basis, (nf, fo, c) complex64: fbfft's rfft2 on
    the GPU; in float64, rounded once, on the CPU."""
    fo, c, kh, kw = w.shape
    if xp is not np:
        from . import fbfft_kernels
        W = xp.empty((fbfft_plan.stored_frequencies(n), fo, c), dtype=np.complex64)
        fbfft_kernels.rfft2_launcher(n, fo * c, kh, kw)(w, W)
        return W
    W = np.fft.rfft2(w.astype(np.float64), s=(n, n)).transpose(2, 3, 0, 1)   # (n, n//2+1, fo, c)
    W = fbfft_plan.compact(W.reshape(n, n // 2 + 1, fo * c), n)              # (nf, fo*c)
    return np.ascontiguousarray(W, dtype=np.complex64).reshape(-1, fo, c)


def _weight_gradient(xp, gw, n, k_hw):
    """gw (nf, fo, f) -> (fo, f, kh, kw): one inverse per weight, its kh x kw corner."""
    fo, f = gw.shape[1:]
    if xp is not np:
        from . import fbfft_kernels
        out = xp.empty((fo, f) + tuple(k_hw), dtype=np.float32)
        fbfft_kernels.irfft2_launcher(n, fo * f, tuple(k_hw))(gw, out)
        return out
    full = fbfft_plan.expand(gw.reshape(gw.shape[0], fo * f), n)             # (n, n//2+1, fo*f)
    g = np.fft.irfft2(full, s=(n, n), axes=(0, 1))[:k_hw[0], :k_hw[1]]      # (kh, kw, fo*f)
    return np.ascontiguousarray(g.reshape(*k_hw, fo, f).transpose(2, 3, 0, 1), dtype=np.float32)


# -- CUDA ----------------------------------------------------------------------------------------

NAME_EXPRESSIONS = tuple(f"tiledfft_{k}<{n}>" for k in ("rfft2", "irfft2") for n in BASES)


@functools.lru_cache(maxsize=None)
def _kernel(name, n):
    """The compiled tiledfft_<name><n> and its launch (planes a block, threads, shared bytes)."""
    p = fbfft_plan.plan(n)
    kernel = cuda_module("tiledfft.cu", ("--std=c++17",), NAME_EXPRESSIONS).get_function(f"tiledfft_{name}<{n}>")
    return kernel, p.planes, p.threads, p.smem_bytes


def _launch(name, n, B, src, dst, ints, *rest):
    """One launch over B (tile, plane) entries (_launcher's)."""
    _launcher(name, n, B, tuple(ints), *rest)(src, dst)


@functools.lru_cache(maxsize=1024)
def _launcher(name, n, B, ints, *rest):
    """launch(src, dst) -> dst over B (tile, plane) entries, fbfft's 2-D plan (a block takes `planes` of
    them), its grid and arguments worked out once per geometry; ValueError past the 32-bit index."""
    if B >= 2**31:
        raise ValueError(f"tiledfft: {B} tile-planes in one chunk exceed the kernels' 32-bit index; "
                         "lower fbfft_workspace_mb")
    kernel, planes, threads, smem = _kernel(name, n)
    grid, block, scalars = ((B + planes - 1) // planes,), (threads,), (*(np.int32(v) for v in ints), *rest)

    def launch(src, dst):
        kernel(grid, block, (src, dst, *scalars), shared_mem=smem)
        return dst
    return launch
