"""gemm: unrolled convolution (im2col + one GEMM per pass), as cuDNN's classic path.

  fprop   y  = W  @ cols(x)           W (f', f*kh*kw), cols (f*kh*kw, S*oh*ow)
  bprop   gx = col2im(W^T @ gy)       gy as (f', S*oh*ow)
  accGrad gW = gy @ cols(x)^T

cuBLAS (through CuPy) on the GPU, BLAS (through NumPy) on the CPU. im2col/col2im
are CUDA kernels (kernels/im2col.cu) on the GPU and strided NumPy views on the
CPU. The column matrix and the (f', S*oh*ow) matrix beside it are the workspace: above
MINITORCH_GEMM_WORKSPACE_MB the batch is processed in chunks, so memory stays bounded for any
batch size (512 MiB by default: in a training step it sits on top of the activations, weights,
gradients and momentum, and a chunk of it is already a GEMM that fills the GPU).

1x1 kernels without padding need no im2col: each image's (f, h*w) plane is already its column
matrix. With stride (sh, sw) the columns are x[:, :, ::sh, ::sw], one gather; then

  fprop   y_s  = W @ x_s                   one strided-batched GEMM, W broadcast over the batch,
  bprop   gx_s = W^T @ gy_s                writing NCHW directly; a stride scatters gx into zeros
  accGrad gW   = sum_s gy_s @ x_s^T        either per-image products (x_s @ gy_s^T, (S, f, f'))
                                           summed, or gy and x transposed to (f', S*P), (f, S*P)
                                           and one GEMM: about whichever moves fewer bytes
"""
import numpy as np

from . import cgemm, config
from .common import (batch_slices, check_arrays, check_output_shape, cuda_module, geometry, launch_1d,
                     valid_geometry)

# S batch, f in-planes, f' out-planes (fo), kh x kw kernel, oh x ow output


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Any valid geometry: every stride, padding and rectangular kernel."""
    return valid_geometry(x_shape, w_shape, stride, padding) is not None


def revision(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """auto's cue to time gemm again where its speed changed (backends.auto): 1 for 1x1 kernels
    without padding, whose bprop and accGrad became plain GEMMs in 4197e11 (2-3x faster on
    ResNet-50's layers); 0 elsewhere."""
    return 1 if _pointwise(geometry(x_shape, w_shape, stride, padding)) else 0


def _batch_chunks(g):
    """Slices of the batch whose workspace fits gemm_workspace_mb (at least one image): the column
    matrix, and beside it the (f', n*oh*ow) matrix each pass also holds (fprop's product before
    its transpose into y, bprop's and accGrad's gy matrix)."""
    return _image_chunks(g, (g.f * g.kh * g.kw + g.fo) * g.oh * g.ow * 4)


def _int32_args(g, n):
    return tuple(np.int32(v) for v in (n, g.f, g.h, g.w, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.oh, g.ow))


def _im2col(xp, x, g):
    """x (n, f, h, w) -> cols (f*kh*kw, n*oh*ow)."""
    n = x.shape[0]
    if xp is np:
        xpad = np.pad(x, ((0, 0), (0, 0), (g.ph, g.ph), (g.pw, g.pw))) if g.ph or g.pw else x
        win = np.lib.stride_tricks.sliding_window_view(xpad, (g.kh, g.kw), axis=(2, 3))
        win = win[:, :, ::g.sh, ::g.sw][:, :, :g.oh, :g.ow]      # (n, f, oh, ow, kh, kw) view
        return win.transpose(1, 4, 5, 0, 2, 3).reshape(g.f * g.kh * g.kw, n * g.oh * g.ow)
    cols = xp.empty((g.f * g.kh * g.kw, n * g.oh * g.ow), dtype=np.float32)
    launch_1d(cuda_module("im2col.cu").get_function("im2col"), cols.size, (x, cols) + _int32_args(g, n))
    return cols


def _col2im(xp, cols, g, n):
    """cols (f*kh*kw, n*oh*ow) -> gx (n, f, h, w), summing overlapping taps."""
    if xp is np:
        c6 = cols.reshape(g.f, g.kh, g.kw, n, g.oh, g.ow)
        gpad = np.zeros((n, g.f, g.h + 2 * g.ph, g.w + 2 * g.pw), dtype=np.float32)
        ys, xs = g.sh * (g.oh - 1) + 1, g.sw * (g.ow - 1) + 1
        for i in range(g.kh):
            for j in range(g.kw):
                gpad[:, :, i:i + ys:g.sh, j:j + xs:g.sw] += c6[:, i, j].transpose(1, 0, 2, 3)
        return gpad[:, :, g.ph:g.ph + g.h, g.pw:g.pw + g.w]
    gx = xp.empty((n, g.f, g.h, g.w), dtype=np.float32)
    launch_1d(cuda_module("im2col.cu").get_function("col2im"), gx.size, (cols, gx) + _int32_args(g, n))
    return gx


def _gy_matrix(gy):
    """gy (n, f', oh, ow) -> (f', n*oh*ow), the column order of im2col (a copy)."""
    n, fo, oh, ow = gy.shape
    return gy.transpose(1, 0, 2, 3).reshape(fo, n * oh * ow)


def _pointwise(g):
    """A 1x1 kernel without padding: the GEMM-only path."""
    return g.kh == g.kw == 1 and g.ph == g.pw == 0


def _columns(xp, x, g):
    """x (n, f, h, w) -> (n, f, oh*ow): the 1x1 kernel's columns (a gather where strided)."""
    if _strided(g):
        x = xp.ascontiguousarray(x[:, :, ::g.sh, ::g.sw])   # (n, f, oh, ow): oh = ceil(h / sh)
    return x.reshape(x.shape[0], g.f, g.oh * g.ow)


def _image_chunks(g, per_image):
    """Slices of the batch of at most gemm_workspace_mb, `per_image` bytes an image, even
    (common.batch_slices)."""
    return batch_slices(g.S, config.mib_bytes("gemm_workspace_mb") // max(1, per_image))


def _strided(g):
    return g.sh > 1 or g.sw > 1


def _batch_of(out):
    """out (n, p, q) as cgemm.matmul's out for a matrix broadcast over n: (p, q) where n is 1
    (matmul gives a batch of one as a plain matrix)."""
    return out[0] if out.shape[0] == 1 else out


def _fprop_1x1(xp, x, w, g):
    y = xp.empty((g.S, g.fo, g.oh, g.ow), dtype=np.float32)
    w2 = w.reshape(g.fo, g.f)                                      # (f', f)
    y3 = y.reshape(g.S, g.fo, g.oh * g.ow)                         # (S, f', P), a view of y
    for sl in _image_chunks(g, g.f * g.oh * g.ow * 4 if _strided(g) else 0):
        cgemm.matmul(xp, w2, _columns(xp, x[sl], g), out=_batch_of(y3[sl]), strict=True)   # (n, f', P)
    return y


def _bprop_1x1(xp, gy, w, g):
    # W^T made contiguous (f * f' floats) rather than cuBLAS's transpose flag: with the flag and
    # W broadcast over the batch, cuBLAS ran ResNet-50's stride-1 1x1 bprops at half speed
    # (29.7 against 14.3 ms summed over the network; exp_gemm_1x1, H100, session 12)
    w2t = xp.ascontiguousarray(w.reshape(g.fo, g.f).T)            # (f, f')
    gy3 = gy.reshape(g.S, g.fo, g.oh * g.ow)                       # (S, f', P)
    if not _strided(g):
        gx = xp.empty((g.S, g.f, g.h, g.w), dtype=np.float32)
        cgemm.matmul(xp, w2t, gy3, out=_batch_of(gx.reshape(g.S, g.f, g.h * g.w)), strict=True)
        return gx
    gx = xp.zeros((g.S, g.f, g.h, g.w), dtype=np.float32)
    for sl in _image_chunks(g, g.f * g.oh * g.ow * 4):
        cols = cgemm.matmul(xp, w2t, gy3[sl], strict=True)            # (n, f, P), or (f, P) for n = 1
        gx[sl, :, ::g.sh, ::g.sw] = cols.reshape(-1, g.f, g.oh, g.ow)  # the taps; the rest stay 0
    return gx


def _accgrad_1x1(xp, gy, x, g):
    P = g.oh * g.ow
    gy3 = gy.reshape(g.S, g.fo, P)                                 # (S, f', P)
    if g.fo * g.f <= 1.5 * P * (g.fo + g.f):
        # per-image products, summed: (S, f, f') partials, about as many bytes as transposing gy
        # and x or fewer. x_s @ gy_s^T rather than gy_s @ x_s^T: cuBLAS ran that order 1.2-3.8x
        # faster on ResNet-50's 1x1 layers; the 1.5 is where the copies won there (7x7 planes of
        # 512 and 2048 planes: exp_gemm_1x1, H100, session 12)
        gwt = xp.zeros((g.f, g.fo), dtype=np.float32)
        per_image = (g.fo * g.f + (g.f * P if _strided(g) else 0)) * 4
        for sl in _image_chunks(g, per_image):
            parts = cgemm.matmul(xp, _columns(xp, x[sl], g), gy3[sl], op_b="T", strict=True)  # (n, f, f')
            gwt += parts.reshape(-1, g.f, g.fo).sum(axis=0)
        return xp.ascontiguousarray(gwt.T).reshape(g.fo, g.f, 1, 1)
    gw = xp.zeros((g.fo, g.f), dtype=np.float32)
    for sl in _image_chunks(g, (g.fo + g.f) * P * 4):
        n = sl.stop - sl.start
        a = gy3[sl].transpose(1, 0, 2).reshape(g.fo, n * P)        # (f', n*P), a copy
        b = _columns(xp, x[sl], g).transpose(1, 0, 2).reshape(g.f, n * P)   # (f, n*P), a copy
        cgemm.matmul(xp, a, b, out=gw, op_b="T", accumulate=True, strict=True)
    return gw.reshape(g.fo, g.f, 1, 1)


def fprop(x, w, stride=(1, 1), padding=(0, 0)):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw)."""
    xp, x, w = check_arrays(x=x, w=w)
    g = geometry(x.shape, w.shape, stride, padding)
    if _pointwise(g):
        return _fprop_1x1(xp, x, w, g)
    y = xp.empty((g.S, g.fo, g.oh, g.ow), dtype=np.float32)
    w2 = w.reshape(g.fo, -1)                                       # (f', f*kh*kw)
    for sl in _batch_chunks(g):
        n = sl.stop - sl.start
        yc = cgemm.matmul(xp, w2, _im2col(xp, x[sl], g), strict=True)   # (f', n*oh*ow)
        y[sl] = yc.reshape(g.fo, n, g.oh, g.ow).transpose(1, 0, 2, 3)
        del yc   # now, not when the next chunk's product replaces it: within the workspace
    return y


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0)):
    """gx (S, f, h, w): gradient w.r.t. the input of fprop."""
    xp, gy, w = check_arrays(gy=gy, w=w)
    g = geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    if _pointwise(g):
        return _bprop_1x1(xp, gy, w, g)
    gx = xp.empty((g.S, g.f, g.h, g.w), dtype=np.float32)
    w2 = w.reshape(g.fo, -1)                                       # (f', f*kh*kw)
    for sl in _batch_chunks(g):
        cols = cgemm.matmul(xp, w2, _gy_matrix(gy[sl]), op_a="T", strict=True)  # (f*kh*kw, n*oh*ow)
        gx[sl] = _col2im(xp, cols, g, sl.stop - sl.start)
        del cols   # as in fprop
    return gx


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0)):
    """gw (f', f, kh, kw): gradient w.r.t. the weight, summed over the batch."""
    xp, gy, x = check_arrays(gy=gy, x=x)
    g = geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    if _pointwise(g):
        return _accgrad_1x1(xp, gy, x, g)
    gw = xp.zeros((g.fo, g.f * g.kh * g.kw), dtype=np.float32)
    for sl in _batch_chunks(g):
        cgemm.matmul(xp, _gy_matrix(gy[sl]), _im2col(xp, x[sl], g), out=gw, op_b="T",
                     accumulate=True, strict=True)                 # gw += (f', f*kh*kw)
    return gw.reshape(tuple(w_shape))
