"""polyphase: a strided convolution as a stride-1 FFT convolution of its polyphase components.

The FFT backends do stride 1 only (the paper's limit); the first layers of AlexNet and
OverFeat-fast (11 x 11, stride 4) are strided. With stride (sh, sw), split every kernel tap
index as ky = sh qy + ry (0 <= ry < sh) and every padded input row as sh a + ry:

  y[s, j, oy, ox] = sum_{i, ky, kx} xpad[s, i, sh oy + ky, sw ox + kx] w[j, i, ky, kx]
                  = sum_{(i, ry, rx), qy, qx} x2[s, (i, ry, rx), oy + qy, ox + qx] w2[j, (i, ry, rx), qy, qx]

  x2[s, (i, ry, rx), a, b]   = xpad[s, i, sh a + ry, sw b + rx]        (space-to-depth)
  w2[j, (i, ry, rx), qy, qx] = w[j, i, sh qy + ry, sw qx + rx], 0 past the kernel

a stride-1, unpadded convolution with f sh sw input planes and a ceil(kh/sh) x ceil(kw/sw)
kernel, whose output is the strided layer's output exactly. AlexNet's conv1 (3 -> 64, 11 x 11,
stride 4, 224^2 padded by 2) becomes 48 -> 64 planes, 3 x 3, 57^2: fbfft on a 64 basis.

  fprop    y   = inner.fprop(x2, w2)
  bprop    gx  = depth-to-space of inner.bprop(gy, w2), the padding cut off
  accGrad  gw  = depth-to-space of inner.accgrad(gy, x2), the taps past kh x kw cut off

The inner backend is fbfft where its basis (<= 128) holds the phase images, else cufft. Each
rearrangement (of the input, the weight, or a gradient) is one kernel on the GPU
(kernels/polyphase.cu): no arithmetic happens outside the inner convolution. Inside
`backends.reuse_spectra()` x2 and w2 are built once per step (fprop's serve bprop and accGrad)
so the inner backend's spectra are shared across the passes as for any stride-1 layer.

supports() is True only for strides other than (1, 1): a stride-1 layer has one phase, and the
inner backend serves it directly.
"""
import functools
import math

import numpy as np

from . import cufft, fbfft
from .common import check_arrays, check_output_shape, cuda_module, geometry, valid_geometry
from .reuse import Key, shared

INNER = (fbfft, cufft)  # first that supports the phase-image geometry


def phases(g):
    """(KH, KW, Ha, Wa): the sub-kernel size and phase-image size of strided geometry g."""
    KH, KW = -(-g.kh // g.sh), -(-g.kw // g.sw)
    return KH, KW, g.oh + KH - 1, g.ow + KW - 1


def inner_shapes(g):
    """(x2 shape, w2 shape) of the stride-1 convolution that geometry g becomes."""
    KH, KW, Ha, Wa = phases(g)
    planes = g.f * g.sh * g.sw
    return (g.S, planes, Ha, Wa), (g.fo, planes, KH, KW)


@functools.lru_cache(maxsize=256)
def _inner(g):
    """The inner backend of geometry g (asked on every pass: remembered per geometry)."""
    x2, w2 = inner_shapes(g)
    return next((b for b in INNER if b.supports(x2, w2, (1, 1), (0, 0))), None)


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """A stride other than (1, 1) whose phase images an inner FFT backend can take."""
    g = valid_geometry(x_shape, w_shape, stride, padding)
    return g is not None and (g.sh, g.sw) != (1, 1) and _inner(g) is not None


def check_geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """None, or ValueError saying why polyphase cannot take this geometry (layers quote it)."""
    _geometry(x_shape, w_shape, stride, padding)


def _geometry(x_shape, w_shape, stride, padding, gy=None):
    """(Geometry, inner backend); a gy of the wrong shape is named before the stride is."""
    g = geometry(x_shape, w_shape, stride, padding)
    if gy is not None:
        check_output_shape("gy", gy, g, (g.oh, g.ow))
    if (g.sh, g.sw) == (1, 1):
        raise ValueError("polyphase is for strided convolutions; at stride 1 use fbfft or cufft directly")
    inner = _inner(g)
    if inner is None:
        x2, w2 = inner_shapes(g)
        raise ValueError(f"polyphase: no FFT backend takes the phase images {x2} with kernels {w2}; "
                         f"use gemm or direct")
    return g, inner


# On the GPU each rearrangement is one kernel (kernels/polyphase.cu): every element of the
# result reads where it comes from (zero outside the source), so there is no zero fill, padded
# copy or transposing copy. On the CPU the same maps are written with reshape/transpose.


def _launch(kind, src, out, h, w, sh, sw, ph, pw, A, B):
    """polyphase_<kind> from src into out (_launcher's launch); returns out."""
    return _launcher(kind, out.size, h, w, sh, sw, ph, pw, A, B)(src, out)


@functools.lru_cache(maxsize=1024)
def _launcher(kind, size, h, w, sh, sw, ph, pw, A, B):
    """launch(src, out) -> out: polyphase_<kind> over the rows of an `out` of `size` elements, one
    row per (block, threadIdx.y), columns across threadIdx.x (a warp or two: the rows are short);
    the grid, kernel and integer arguments worked out once per geometry."""
    cols = B if kind == "gather" else w
    rows = size // cols
    tx = 32 if cols <= 32 else 64 if cols <= 64 else 128
    ty = 256 // tx
    grid, block = (int(min(-(-rows // ty), 2**31 - 1)),), (tx, ty)
    kern = cuda_module("polyphase.cu").get_function(f"polyphase_{kind}")
    i32 = np.int32
    scalars = (i32(h), i32(w), i32(sh), i32(sw), i32(ph), i32(pw), i32(A), i32(B), np.int64(rows))

    def launch(src, out):
        kern(grid, block, (src, out) + scalars)
        return out
    return launch


def _covered(h, w, rows, cols):
    """Rows and columns of an h x w plane that fall inside the phase grid, which reaches `rows`
    rows and `cols` columns past the plane's origin (the rest lie past the last window)."""
    return max(0, min(h, rows)), max(0, min(w, cols))


def _gather(xp, a, g, pad, A, B):
    """(P, C, h, w) -> (P, C sh sw, A, B): the phase images of `a` zero-padded by `pad`."""
    P, C, h, w = a.shape
    (ph, pw), (sh, sw) = pad, (g.sh, g.sw)
    if xp is not np:
        out = xp.empty((P, C * sh * sw, A, B), dtype=np.float32)
        return _launch("gather", a, out, h, w, sh, sw, ph, pw, A, B)
    big = np.zeros((P, C, sh * A, sw * B), dtype=np.float32)
    nh, nw = _covered(h, w, sh * A - ph, sw * B - pw)
    big[:, :, ph:ph + nh, pw:pw + nw] = a[:, :, :nh, :nw]
    six = big.reshape(P, C, A, sh, B, sw).transpose(0, 1, 3, 5, 2, 4)
    return np.ascontiguousarray(six).reshape(P, C * sh * sw, A, B)


def _scatter(xp, a2, g, pad, shape):
    """The inverse map, (P, C sh sw, A, B) -> (P, C, h, w) = `shape`; elements no phase image
    covers (past the last window) are 0."""
    P, C, h, w = shape
    (ph, pw), (sh, sw) = pad, (g.sh, g.sw)
    A, B = a2.shape[2:]
    if xp is not np:
        out = xp.empty(shape, dtype=np.float32)
        return _launch("scatter", a2, out, h, w, sh, sw, ph, pw, A, B)
    six = a2.reshape(P, C, sh, sw, A, B).transpose(0, 1, 4, 2, 5, 3)
    big = np.ascontiguousarray(six).reshape(P, C, sh * A, sw * B)
    out = np.zeros(shape, dtype=np.float32)
    nh, nw = _covered(h, w, sh * A - ph, sw * B - pw)
    out[:, :, :nh, :nw] = big[:, :, ph:ph + nh, pw:pw + nw]
    return out


def _space_to_depth(xp, x, g):
    """x (S, f, h, w) -> x2 (S, f sh sw, Ha, Wa), the zero padding written out."""
    _, _, Ha, Wa = phases(g)
    return _gather(xp, x, g, (g.ph, g.pw), Ha, Wa)


def _split_kernel(xp, w, g):
    """w (f', f, kh, kw) -> w2 (f', f sh sw, KH, KW), zero past the kernel."""
    KH, KW, _, _ = phases(g)
    return _gather(xp, w, g, (0, 0), KH, KW)


def _x2_key(g):
    # x2's size depends on the kernel too (Ha = oh + KH - 1): two strided layers reading one input
    # with the same stride and padding but different kernels must not share it.
    _, _, Ha, Wa = phases(g)
    return Key("polyphase", "x", (g.sh, g.sw, Ha, Wa), (g.ph, g.pw))


def _w2_key(g):
    KH, KW, _, _ = phases(g)
    return Key("polyphase", "w", (g.sh, g.sw, KH, KW), (0, 0))


def _x2(xp, x, g):
    return shared(_x2_key(g), x, _space_to_depth, xp, x, g)


def _w2(xp, w, g):
    return shared(_w2_key(g), w, _split_kernel, xp, w, g)


def prepare(pass_name, g, xp):
    """run(a, b) -> out for backends.run_pass's prepared path (a, b checked there: C-contiguous float32
    CuPy arrays of g's shapes): the pass as the pass function runs it, its rearrangements' launches
    worked out here once and the inner convolution the inner backend's own prepared call; x2 and w2
    found or kept through reuse.shared as there (PREPARED_SPECTRA). None on the CPU or where the
    inner backend prepares nothing (cufft; fbfft with its batch in chunks): run_pass then calls the
    pass function. test_polyphase checks on the CPU that it launches what the pass function does."""
    inner = None if xp is np else _inner(g)
    prepare_inner = getattr(inner, "prepare", None)
    if prepare_inner is None or (g.sh, g.sw) == (1, 1):
        return None
    x2_shape, w2_shape = inner_shapes(g)
    run_inner = prepare_inner(pass_name, geometry(x2_shape, w2_shape, (1, 1), (0, 0)), xp)
    if run_inner is None:
        return None
    KH, KW, Ha, Wa = phases(g)
    empty, f32 = xp.empty, np.float32

    def rearrange(kind, shape, h, w, pad, A, B):
        """f(src) -> a new array of `shape` that polyphase_<kind> fills from src."""
        launch = _launcher(kind, math.prod(shape), h, w, g.sh, g.sw, *pad, A, B)
        return lambda src: launch(src, empty(shape, dtype=f32))

    pad = (g.ph, g.pw)
    if pass_name in ("fprop", "accgrad"):
        key_x, gather_x = _x2_key(g), rearrange("gather", x2_shape, g.h, g.w, pad, Ha, Wa)
    if pass_name in ("fprop", "bprop"):
        key_w, gather_w = _w2_key(g), rearrange("gather", w2_shape, g.kh, g.kw, (0, 0), KH, KW)
    if pass_name == "fprop":
        def run(x, w):
            x2 = shared(key_x, x, gather_x, x)
            return run_inner(x2, shared(key_w, w, gather_w, w))
    elif pass_name == "bprop":
        scatter = rearrange("scatter", (g.S, g.f, g.h, g.w), g.h, g.w, pad, Ha, Wa)

        def run(gy, w):
            return scatter(run_inner(gy, shared(key_w, w, gather_w, w)))
    else:
        scatter = rearrange("scatter", (g.fo, g.f, g.kh, g.kw), g.kh, g.kw, (0, 0), KH, KW)

        def run(gy, x):
            return scatter(run_inner(gy, shared(key_x, x, gather_x, x)))
    return run


PREPARED_SPECTRA = True   # prepare()'s run keeps and finds x2, w2 and the inner spectra as the pass function does


def fprop(x, w, stride=(1, 1), padding=(0, 0)):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw) at `stride`."""
    xp, xa, wa = check_arrays(x=x, w=w)
    g, inner = _geometry(x.shape, w.shape, stride, padding)
    return inner.fprop(_x2(xp, xa, g), _w2(xp, wa, g))


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0)):
    """gx (S, f, h, w): gradient w.r.t. the input."""
    xp, gya, wa = check_arrays(gy=gy, w=w)
    g, inner = _geometry(x_shape, w.shape, stride, padding, gya)
    x2_shape, _ = inner_shapes(g)
    return _scatter(xp, inner.bprop(gya, _w2(xp, wa, g), x2_shape), g, (g.ph, g.pw), tuple(x_shape))


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0)):
    """gw (f', f, kh, kw): gradient w.r.t. the weight, summed over the batch."""
    xp, gya, xa = check_arrays(gy=gy, x=x)
    g, inner = _geometry(x.shape, w_shape, stride, padding, gya)
    _, w2_shape = inner_shapes(g)
    return _scatter(xp, inner.accgrad(gya, _x2(xp, xa, g), w2_shape), g, (0, 0), tuple(w_shape))
