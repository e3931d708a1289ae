"""gemm: unrolled convolution (im2col + one GEMM per pass), as cuDNN's classic path.

  fprop   y  = W  @ cols(x)           W (f', f*kh*kw), cols (f*kh*kw, S*oh*ow)
  bprop   gx = col2im(W^T @ gy)       gy as (f', S*oh*ow)
  accGrad gW = gy @ cols(x)^T

cuBLAS (through CuPy) on the GPU, BLAS (through NumPy) on the CPU. im2col/col2im
are CUDA kernels (kernels/im2col.cu) on the GPU and strided NumPy views on the
CPU. The column matrix is the workspace: above MINITORCH_GEMM_WORKSPACE_MB the batch is
processed in chunks, so memory stays bounded for any batch size.
"""
import numpy as np

from . import cgemm, config
from .common import check_arrays, check_output_shape, cuda_module, geometry, launch_1d, valid_geometry

# S batch, f in-planes, f' out-planes (fo), kh x kw kernel, oh x ow output


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Any valid geometry: every stride, padding and rectangular kernel."""
    return valid_geometry(x_shape, w_shape, stride, padding) is not None


def _batch_chunks(g):
    """Slices of the batch whose column matrix fits the workspace (at least one image)."""
    per_image = g.f * g.kh * g.kw * g.oh * g.ow * 4
    step = max(1, config.mib_bytes("gemm_workspace_mb") // per_image)
    return [slice(s, min(s + step, g.S)) for s in range(0, g.S, step)]


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


def fprop(x, w, stride=(1, 1), padding=(0, 0)):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw)."""
    xp, x, w = check_arrays(x=x, w=w)
    g = geometry(x.shape, w.shape, stride, padding)
    y = xp.empty((g.S, g.fo, g.oh, g.ow), dtype=np.float32)
    w2 = w.reshape(g.fo, -1)                                       # (f', f*kh*kw)
    for sl in _batch_chunks(g):
        n = sl.stop - sl.start
        yc = cgemm.matmul(xp, w2, _im2col(xp, x[sl], g), strict=True)   # (f', n*oh*ow)
        y[sl] = yc.reshape(g.fo, n, g.oh, g.ow).transpose(1, 0, 2, 3)
    return y


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0)):
    """gx (S, f, h, w): gradient w.r.t. the input of fprop."""
    xp, gy, w = check_arrays(gy=gy, w=w)
    g = geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    gx = xp.empty((g.S, g.f, g.h, g.w), dtype=np.float32)
    w2 = w.reshape(g.fo, -1)                                       # (f', f*kh*kw)
    for sl in _batch_chunks(g):
        cols = cgemm.matmul(xp, w2, _gy_matrix(gy[sl]), op_a="T", strict=True)  # (f*kh*kw, n*oh*ow)
        gx[sl] = _col2im(xp, cols, g, sl.stop - sl.start)
    return gx


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0)):
    """gw (f', f, kh, kw): gradient w.r.t. the weight, summed over the batch."""
    xp, gy, x = check_arrays(gy=gy, x=x)
    g = geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    gw = xp.zeros((g.fo, g.f * g.kh * g.kw), dtype=np.float32)
    for sl in _batch_chunks(g):
        cgemm.matmul(xp, _gy_matrix(gy[sl]), _im2col(xp, x[sl], g), out=gw, op_b="T",
                     accumulate=True, strict=True)                 # gw += (f', f*kh*kw)
    return gw.reshape(tuple(w_shape))
