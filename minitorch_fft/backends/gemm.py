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
  accGrad gW   = sum_s gy_s @ x_s^T        per-image products (x_s @ gy_s^T, (S, f, f')) summed

or "flat": x (or gy) transposed to (f, S*P) (a copy, the stride's gather folded in), one GEMM
over the whole batch, its product transposed back into NCHW. Per-image GEMMs have N = P columns:
at 7x7 planes (P = 49) they leave the GPU half idle, where the flat GEMM's N = S*P does not.

Other kernels' accGrad has the same two forms: "flat" as above, and "per_image", products
gy_s (f', P) @ cols_s^T (P, f*kh*kw) summed over the batch (im2col image by image), for the small
gradients of few-plane layers, whose flat GEMM is one long K on a few output tiles. A third,
"implicit", makes no column matrix: kernels/im2col.cu's accgrad_small sums gy x taps over chunks of
output positions, each block one partial gradient in registers, and the partials are summed after
(VGG-16's conv1_1 accGrad, b64: per_image 1.9 ms, 64 GEMMs of one tile each with K = 50176;
implicit 0.87-1.03; cuDNN strict 0.8; benchmarks/NOTES.md, session 14). It is a candidate where its
block fits. A fourth, "rows", has kernels for 3x3 s1, 7x7 s2 and 11x11 s4 kernels (accgrad_rows_*):
tiles of one output row, each thread a window of taps sliding along the input rows in registers
(VGG-16 conv1_1 0.69-0.71 ms, ResNet's conv1 1.23-1.27 against cuDNN strict's 1.60; session 15).

Strided 1x1 fprop and bprop have two more forms on the GPU, "fused" and "fused64": one kernel
(kernels/pointwise.cu) that does the gather (or the scatter) and the GEMM in one pass, its B tile read
from x at stride (sh, sw) and its columns the pixels of all the images (S*oh*ow of them, so 7x7
planes fill tiles); bprop's kernel writes the zeros between the strided pixels itself. The two differ
in the tile: 128 or 64 rows (f' for fprop, f for bprop) by 128 pixels. They are for ResNet's
stride-2 shortcuts, where the gather and a GEMM per image took 0.12-0.17 ms at batch 128 against
cuDNN strict's 0.065-0.074 (H100): the copy, and the GEMM's re-read of it, are what fusing saves
(benchmarks/experiments/exp_pointwise.py times every form against cuDNN).

Which form runs is tuned per geometry and pass where the gemm_tune setting tunes (the GPU by
default, backends.tuning's recipe). Untuned: 1x1 fprop and bprop per-image; 1x1 accGrad whichever
of its partials and the flat form's copies moves fewer bytes (x 1.5: exp_gemm_1x1, session 12);
other accGrads per-image up to SMALL_GRADIENT weights.
"""
import functools

import numpy as np

from . import cgemm, config, layout, tuning
from .common import (batch_slices, check_arrays, check_kinds, check_output_shape, cuda_module, geometry,
                     sm_count, valid_geometry)

# S batch, f in-planes, f' out-planes (fo), kh x kw kernel, oh x ow output


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Any valid geometry: every stride, padding and rectangular kernel."""
    return valid_geometry(x_shape, w_shape, stride, padding) is not None


def revision(pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0), math="fp32"):
    """auto's cue to time gemm again where its speed changed (backends.auto); the same in either GEMM
    precision (math), since gemm's GEMMs are strict in both. 1x1 kernels without
    padding: 1 since their bprop and accGrad became plain GEMMs (4197e11, 2-3x faster on ResNet-50's
    layers), 2 since each pass's form is tuned, accGrad 3 since its per-image partials are summed by
    sum_rows, strided bprop 3 while col2im placed its taps (slower: 1.02 -> 1.12 ms on ResNet-50's
    conv15, exp_gemm_forms), 4 since the zeroed gx and its scatter are back, 5 since the fused forms
    (kernels/pointwise.cu) joined them, 6 since auto times the fused launch as run_pass's prepared
    path makes it (prepare()); strided fprop 3 since the fused forms joined it, 4 since that. Other kernels'
    accGrad: 1 since its form is tuned (per-image products: VGG-16's and ResNet's 3-plane first
    layers), 2 since the implicit form (accgrad_small) joined them, 3 since im2col and col2im take a
    (positions, taps, images) grid (no 64-bit division per element; their fprop and bprop 1 since
    then), 4 since accgrad_small has no division per element and 16-byte shared loads, 5 since its
    gy fill takes 16-byte global loads where tiles are whole, 6 since implicit8 (8 outputs a thread)
    joined the forms, 7 since the rows form joined them and the partial gradients are summed by one
    kernel (sum_rows), 8 since the rows form fills two buffers by cp.async, 9 since those fills step
    pointers (a few instructions a copy, not ~60), 10 since the per-image products are summed by
    sum_rows too, not CuPy's axis-0 sum. The form's own tuning record is keyed by the revision too
    (form_key), so a changed form is timed again."""
    return _revision(pass_name, geometry(x_shape, w_shape, stride, padding))


def _revision(pass_name, g):
    if pass_name.endswith("_nhwc"):   # the channels-last 1x1 passes (session 46)
        return 1
    if _pointwise(g):
        if pass_name == "accgrad":
            return 3
        return {"fprop": 4, "bprop": 6}[pass_name] if _strided(g) else 2
    return 10 if pass_name == "accgrad" else 1


def _batch_chunks(g):
    """Slices of the batch whose workspace fits gemm_workspace_mb (at least one image): the column
    matrix, and beside it the (f', n*oh*ow) matrix each pass also holds (fprop's product before
    its transpose into y, bprop's and accGrad's gy matrix)."""
    return _image_chunks(g, (g.f * g.kh * g.kw + g.fo) * g.oh * g.ow * 4)


def _int32_args(g, n):
    return tuple(np.int32(v) for v in (n, g.f, g.h, g.w, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.oh, g.ow))


def _im2col(xp, x, g, per_image=False):
    """x (n, f, h, w) -> cols (f*kh*kw, n*oh*ow); per_image: (n, f*kh*kw, oh*ow), image by image."""
    n, K, P = x.shape[0], g.f * g.kh * g.kw, g.oh * g.ow
    if xp is np:
        xpad = np.pad(x, ((0, 0), (0, 0), (g.ph, g.ph), (g.pw, g.pw))) if g.ph or g.pw else x
        win = np.lib.stride_tricks.sliding_window_view(xpad, (g.kh, g.kw), axis=(2, 3))
        win = win[:, :, ::g.sh, ::g.sw][:, :, :g.oh, :g.ow]      # (n, f, oh, ow, kh, kw) view
        if per_image:
            return win.transpose(0, 1, 4, 5, 2, 3).reshape(n, K, P)
        return win.transpose(1, 4, 5, 0, 2, 3).reshape(K, n * P)
    cols = xp.empty((n, K, P) if per_image else (K, n * P), dtype=np.float32)
    kernel = cuda_module("im2col.cu").get_function("im2col_images" if per_image else "im2col")
    _launch_planes(kernel, P, K, n, (x, cols) + _int32_args(g, n))
    return cols


IM_IMAGES = 8   # kernels/im2col.cu: the images a thread of im2col or col2im takes


def _launch_planes(kernel, positions, planes, n, args):
    """im2col's or col2im's grid: x over the plane's positions (im2col's output positions, col2im's
    pixels), y over the taps or planes (the kernel loops past 65535), z over groups of images."""
    bx = min(256, 32 * -(-positions // 32))                      # whole warps
    by = min(n, max(1, 256 // bx))
    kernel((-(-positions // bx), min(planes, 65535), -(-n // (by * IM_IMAGES))), (bx, by), args)


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
    kernel = cuda_module("im2col.cu").get_function("col2im")
    _launch_planes(kernel, g.h * g.w, g.f, n, (cols, gx) + _int32_args(g, n))
    return gx


def _pointwise(g):
    """A 1x1 kernel without padding: the GEMM-only path."""
    return g.kh == g.kw == 1 and g.ph == g.pw == 0


def _columns(xp, x, g):
    """x (n, f, h, w) -> (n, f, oh*ow): the 1x1 kernel's columns (a gather where strided)."""
    return xp.ascontiguousarray(_taps(x, g)).reshape(x.shape[0], g.f, g.oh * g.ow)


GEMM_DIM = cgemm.INT_MAX   # a GEMM's rows, columns or K at most (cuBLAS's ints; a test lowers it)


def _image_chunks(g, per_image):
    """Slices of the batch of at most gemm_workspace_mb, `per_image` bytes an image, and of at most
    GEMM_DIM output pixels (a chunk's n*oh*ow is a GEMM's rows or K in every form), even
    (common.batch_slices)."""
    pixels = g.oh * g.ow
    if pixels > GEMM_DIM:
        raise ValueError(f"gemm: one image's {g.oh}x{g.ow} output pixels exceed a GEMM's {GEMM_DIM} rows "
                         f"(cuBLAS's int sizes); cut the image")
    return batch_slices(g.S, min(config.mib_bytes("gemm_workspace_mb") // max(1, per_image), GEMM_DIM // pixels))


def _strided(g):
    return g.sh > 1 or g.sw > 1


def _batch_of(out):
    """out (n, p, q) as cgemm.matmul's out for a matrix broadcast over n: (p, q) where n is 1
    (matmul gives a batch of one as a plain matrix)."""
    return out[0] if out.shape[0] == 1 else out


FORMS = ("per_image", "flat")
TUNE_TOL = 1e-4   # one form against another while tuning: the same products, summed in another order


SMALL_GRADIENT = 16384   # f' * f*kh*kw at most: accGrad's flat GEMM has a few output tiles and a K of
                         # S*oh*ow (VGG-16 conv1_1: 64 x 27, K = 3.2M), and per-image products split that K


def _form(xp, pass_name, g, run, forms=FORMS, default=None):
    """The form of this pass (of `forms`): tuned where gemm_tune tunes, else `default`, or where that
    is None the rule in the module doc."""
    if default is None:
        if _pointwise(g):
            flat = pass_name == "accgrad" and g.fo * g.f > 1.5 * g.oh * g.ow * (g.fo + g.f)
        else:
            flat = g.fo * g.f * g.kh * g.kw > SMALL_GRADIENT       # only accGrad asks here
        default = "flat" if flat else "per_image"
    if not tuning.enabled("gemm_tune", xp):
        return default

    def tune():
        return tuning.tune(forms, run, xp, against=default, tol=TUNE_TOL)
    return tuning.remembered(form_key(xp, pass_name, g), tune,
                             valid=lambda form: form in forms, untuned=lambda: default)["choice"]


def form_key(xp, pass_name, g):
    """The tuning cache's key of the pass's form: with gemm's revision for it, so that a form whose
    speed changed is timed again."""
    return tuning.key(xp, np.float32, tuple(g), pass_name, f"gemm_form_r{_revision(pass_name, g)}")


def _flat(a):
    """a (n, planes, oh, ow), or a strided view of that shape -> (planes, n*oh*ow), the column order
    of im2col (a copy, C-contiguous: the reshape of the transposed view copies)."""
    return a.transpose(1, 0, 2, 3).reshape(a.shape[1], -1)


def _taps(x, g):
    """x (n, f, h, w) -> the 1x1 kernel's taps (n, f, oh, ow), a view (strided where the stride is)."""
    return x[:, :, ::g.sh, ::g.sw]


def _fprop_1x1(xp, x, w, g):
    w2 = w.reshape(g.fo, g.f)                                      # (f', f)

    def run(form):
        y = xp.empty((g.S, g.fo, g.oh, g.ow), dtype=np.float32)
        if form in FUSED:
            return _fused(xp, "fprop", w2, x, y, g, form)
        y3 = y.reshape(g.S, g.fo, g.oh * g.ow)                     # (S, f', P), a view of y
        if form == "per_image":
            for sl in _image_chunks(g, g.f * g.oh * g.ow * 4 if _strided(g) else 0):
                cgemm.matmul(xp, w2, _columns(xp, x[sl], g), out=_batch_of(y3[sl]), strict=True)   # (n, f', P)
            return y
        for sl in _image_chunks(g, (g.f + g.fo) * g.oh * g.ow * 4):
            yf = cgemm.matmul(xp, w2, _flat(_taps(x[sl], g)), strict=True)   # (f', n*P)
            y[sl] = yf.reshape(g.fo, -1, g.oh, g.ow).transpose(1, 0, 2, 3)
        return y
    return run(_form(xp, "fprop", g, run, _pointwise_forms(xp, g)))


def _bprop_1x1(xp, gy, w, g):
    # W^T made contiguous (f * f' floats) rather than cuBLAS's transpose flag: with the flag and
    # W broadcast over the batch, cuBLAS ran ResNet-50's stride-1 1x1 bprops at half speed
    # (29.7 against 14.3 ms summed over the network; exp_gemm_1x1, H100, session 12)
    w2t = xp.ascontiguousarray(w.reshape(g.fo, g.f).T)            # (f, f')
    gy3 = gy.reshape(g.S, g.fo, g.oh * g.ow)                       # (S, f', P)

    def run(form):
        if form in FUSED:                                          # it writes gx's zeros too
            return _fused(xp, "bprop", w2t, gy, xp.empty((g.S, g.f, g.h, g.w), dtype=np.float32), g, form)
        gx = (xp.zeros if _strided(g) else xp.empty)((g.S, g.f, g.h, g.w), dtype=np.float32)
        if form == "per_image" and not _strided(g):
            cgemm.matmul(xp, w2t, gy3, out=_batch_of(gx.reshape(g.S, g.f, g.h * g.w)), strict=True)
            return gx
        per_image = (g.f + (g.fo if form == "flat" else 0)) * g.oh * g.ow * 4
        for sl in _image_chunks(g, per_image):
            if form == "per_image":
                cols = cgemm.matmul(xp, w2t, gy3[sl], strict=True).reshape(-1, g.f, g.oh, g.ow)   # (n, f, oh, ow)
            else:
                cols = cgemm.matmul(xp, w2t, _flat(gy[sl]), strict=True)            # (f, n*P)
                cols = cols.reshape(g.f, -1, g.oh, g.ow).transpose(1, 0, 2, 3)                  # (n, f, oh, ow)
            _taps(gx[sl], g)[...] = cols                           # the taps; with a stride the rest stay 0
        return gx
    return run(_form(xp, "bprop", g, run, _pointwise_forms(xp, g)))


def _accgrad_1x1(xp, gy, x, g):
    P = g.oh * g.ow
    gy3 = gy.reshape(g.S, g.fo, P)                                 # (S, f', P)

    def run(form):
        if form == "per_image":
            # (S, f, f') partials, summed. x_s @ gy_s^T rather than gy_s @ x_s^T: cuBLAS ran that
            # order 1.2-3.8x faster on ResNet-50's 1x1 layers (exp_gemm_1x1, H100, session 12)
            gwt = xp.zeros((g.f, g.fo), dtype=np.float32)
            for sl in _image_chunks(g, (g.fo * g.f + (g.f * P if _strided(g) else 0)) * 4):
                parts = cgemm.matmul(xp, _columns(xp, x[sl], g), gy3[sl], op_b="T", strict=True)   # (n, f, f')
                gwt += _sum_rows(xp, parts.reshape(-1, g.f * g.fo)).reshape(g.f, g.fo)
            return xp.ascontiguousarray(gwt.T).reshape(g.fo, g.f, 1, 1)
        gw = xp.zeros((g.fo, g.f), dtype=np.float32)
        for sl in _image_chunks(g, (g.fo + g.f) * P * 4):
            cgemm.matmul(xp, _flat(gy[sl]), _flat(_taps(x[sl], g)), out=gw, op_b="T",
                         accumulate=True, strict=True)             # gw += (f', n*P) @ (n*P, f)
        return gw.reshape(g.fo, g.f, 1, 1)
    return run(_form(xp, "accgrad", g, run))


# -- 1x1 passes on channels-last arrays: GEMMs on their memory as it is -----------------------------
# A channels-last (NHWC) activation, logical shape (n, c, h, w), is in memory the (n*h*w, c) matrix of
# its pixels' channel vectors, so a 1x1 kernel's passes are GEMMs on it with no layout copies at stride
# 1 (auto's "gemm" route for channels-last layers, auto.nhwc_route; an operand laid out otherwise is
# laid out channels-last first):
#   fprop   Y (S*oh*ow, f')  = X_s @ W^T     X_s (S*oh*ow, f): the strided pixels (a gather where strided)
#   bprop   GX_s (S*oh*ow, f) = GY @ W       scattered into zeros where strided
#   accGrad gW (f', f)        = GY^T @ X_s   one GEMM ("flat", its K every pixel of the batch), or
#                                            per-image partials summed ("per_image": where gW is small,
#                                            the flat GEMM has few output tiles to spread its long K over)
# W (f', f, 1, 1) is the (f', f) matrix in either layout.

NHWC_PARTIALS = 65536   # f' * f at most for accgrad_nhwc's per_image form (a partial per image: 256 KiB)


def nhwc_supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Whether fprop_nhwc, bprop_nhwc and accgrad_nhwc take the geometry: a 1x1 kernel without padding."""
    g = valid_geometry(x_shape, w_shape, stride, padding)
    return g is not None and _pointwise(g)


def _nhwc_geometry(x_shape, w_shape, stride, padding):
    g = geometry(x_shape, w_shape, stride, padding)
    if not _pointwise(g):
        raise ValueError(f"gemm: the channels-last passes take 1x1 kernels without padding, got kernel "
                         f"{g.kh}x{g.kw}, padding {(g.ph, g.pw)}")
    return g


def _nhwc_operands(xp, *names_arrays):
    """The arrays (checked by common.check_kinds, the geometry by _nhwc_geometry) as the GEMMs take
    them: each activation laid out channels-last (layout.to_nhwc: itself where it is, else a copy),
    the weight (f', f, 1, 1) as the (f', f) matrix."""
    return [xp.ascontiguousarray(a.reshape(a.shape[0], -1)) if name == "w" else layout.to_nhwc(a)
            for name, a in names_arrays]


def _pixels(a):
    """A channels-last 4-d array (logical (n, c, h, w)) as the (n*h*w, c) matrix of its pixels: a view."""
    n, c, h, w = a.shape
    return a.transpose(0, 2, 3, 1).reshape(n * h * w, c)


def _nhwc_empty(xp, n, c, h, w, zeros=False):
    """A new channels-last array of logical shape (n, c, h, w) (its memory (n, h, w, c))."""
    return (xp.zeros if zeros else xp.empty)((n, h, w, c), dtype=np.float32).transpose(0, 3, 1, 2)


def _strided_pixels(xp, x, g):
    """x's pixels at the stride, (n*oh*ow, f): _pixels(x) itself at stride 1, else a gathered copy."""
    if not _strided(g):
        return _pixels(x)
    return xp.ascontiguousarray(x[:, :, ::g.sh, ::g.sw].transpose(0, 2, 3, 1)).reshape(-1, g.f)


def fprop_nhwc(x, w, stride=(1, 1), padding=(0, 0)):
    """fprop of a 1x1 kernel without padding on a channels-last x, its y channels-last: Y = X_s @ W^T."""
    xp = check_kinds(x=x, w=w)
    g = _nhwc_geometry(x.shape, w.shape, stride, padding)
    x, w2 = _nhwc_operands(xp, ("x", x), ("w", w))
    y = _nhwc_empty(xp, g.S, g.fo, g.oh, g.ow)
    for sl in _image_chunks(g, g.f * g.oh * g.ow * 4 if _strided(g) else 0):
        cgemm.matmul(xp, _strided_pixels(xp, x[sl], g), w2, op_b="T", out=_pixels(y[sl]), strict=True)
    return y


def bprop_nhwc(gy, w, x_shape, stride=(1, 1), padding=(0, 0)):
    """bprop of a 1x1 kernel without padding on a channels-last gy, its gx channels-last: GX_s = GY @ W."""
    xp = check_kinds(gy=gy, w=w)
    g = _nhwc_geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    gy, w2 = _nhwc_operands(xp, ("gy", gy), ("w", w))
    gx = _nhwc_empty(xp, g.S, g.f, g.h, g.w, zeros=_strided(g))
    if not _strided(g):
        for sl in _image_chunks(g, 0):
            cgemm.matmul(xp, _pixels(gy[sl]), w2, out=_pixels(gx[sl]), strict=True)
        return gx
    for sl in _image_chunks(g, g.f * g.oh * g.ow * 4):
        cols = cgemm.matmul(xp, _pixels(gy[sl]), w2, strict=True)            # (n*oh*ow, f)
        # through gx's NHWC view, channels innermost on both sides (the copy coalesced)
        gx[sl].transpose(0, 2, 3, 1)[:, ::g.sh, ::g.sw] = cols.reshape(-1, g.oh, g.ow, g.f)
    return gx


def accgrad_nhwc(gy, x, w_shape, stride=(1, 1), padding=(0, 0)):
    """accGrad of a 1x1 kernel without padding on channels-last gy and x: gW = GY^T @ X_s, its form
    ("flat" or "per_image") tuned per geometry where gemm_tune tunes, else flat."""
    xp = check_kinds(gy=gy, x=x)
    g = _nhwc_geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    gy, x = _nhwc_operands(xp, ("gy", gy), ("x", x))
    P, gather = g.oh * g.ow, (g.f * g.oh * g.ow * 4 if _strided(g) else 0)

    def run(form):
        gw = xp.zeros((g.fo, g.f), dtype=np.float32)
        if form == "flat":
            for sl in _image_chunks(g, gather):
                cgemm.matmul(xp, _pixels(gy[sl]), _strided_pixels(xp, x[sl], g), op_a="T", out=gw,
                             accumulate=True, strict=True)                     # gw += (f', n*P) @ (n*P, f)
            return gw.reshape(tuple(w_shape))
        for sl in _image_chunks(g, g.fo * g.f * 4 + gather):
            n = sl.stop - sl.start
            parts = cgemm.matmul(xp, _pixels(gy[sl]).reshape(n, P, g.fo),
                                 _strided_pixels(xp, x[sl], g).reshape(n, P, g.f), op_a="T", strict=True)
            gw += _sum_rows(xp, parts.reshape(n, g.fo * g.f)).reshape(g.fo, g.f)   # (n, f', f) summed
        return gw.reshape(tuple(w_shape))
    forms = _accgrad_nhwc_forms(g)
    return run(_form(xp, "accgrad_nhwc", g, run, forms, default="flat") if len(forms) > 1 else "flat")


def _accgrad_nhwc_forms(g):
    """accgrad_nhwc's forms: per-image partials only while f' f <= NHWC_PARTIALS."""
    return FORMS if g.fo * g.f <= NHWC_PARTIALS else ("flat",)


def prepare_nhwc(pass_name, g, xp):
    """run(a, b, out) for a channels-last 1x1 pass that is one GEMM on matrices, or None where it is
    more (a stride's gather or scatter, accGrad's per-image partials or a form not yet tuned, a batch
    of more than GEMM_DIM pixels; otherwise at stride 1 the whole batch is one chunk): for a caller
    that makes the matrices itself and calls a pass many times (the PyTorch adapter), with the
    operands' checks, layouts, geometry and chunks worked out here once.
    The matrices, C-contiguous float32 on the GPU: an activation's pixels (S*h*w, planes), the
    weight (f', f), the output's pixels (fprop, bprop) or gW (accGrad), which run fills and returns."""
    if xp is np or _strided(g) or not _pointwise(g) or g.S * g.oh * g.ow > GEMM_DIM:   # the last: chunked
        return None
    if pass_name == "fprop":
        return lambda x, w, y: cgemm.matmul(xp, x, w, op_b="T", out=y, strict=True)
    if pass_name == "bprop":
        return lambda gy, w, gx: cgemm.matmul(xp, gy, w, out=gx, strict=True)
    if len(_accgrad_nhwc_forms(g)) > 1 and tuning.enabled("gemm_tune", xp):
        form = (tuning.peek(form_key(xp, "accgrad_nhwc", g)) or {}).get("choice")
        if form != "flat":
            return None
    return lambda gy, x, gw: cgemm.matmul(xp, gy, x, op_a="T", out=gw, strict=True)   # gW = GY^T @ X (overwritten)


# -- the fused forms of the strided 1x1 fprop and bprop (kernels/pointwise.cu) ---------------------
# pointwise_gemm's tile: BM rows of the product (f' for fprop, f for bprop), each form its BM, by
# FUSED_BN pixels; K (f or f') in steps of FUSED_BK
FUSED = {"fused": 128, "fused64": 64}
FUSED_BN, FUSED_BK = 128, 8
FUSED_NAMES = tuple(f"pointwise_gemm<{bm}, {FUSED_BN}, {bprop}>" for bm in FUSED.values()
                    for bprop in ("false", "true"))


def _pointwise_forms(xp, g):
    """The forms of a 1x1 fprop or bprop: the fused ones join the GEMM forms where the stride gathers,
    on the GPU (the CPU has no kernel)."""
    return FORMS + tuple(FUSED) if xp is not np and _strided(g) else FORMS


def _fused_plan(g, n, form, bprop):
    """pointwise_gemm's launch over n images: (name expression, blocks, threads a block). The grid is
    1-D: row tiles (of f' or f) times column tiles (of n*oh*ow pixels), row tiles fastest."""
    bm = FUSED[form]
    rows = g.f if bprop else g.fo
    blocks = -(-rows // bm) * -(-n * g.oh * g.ow // FUSED_BN)
    return f"pointwise_gemm<{bm}, {FUSED_BN}, {'true' if bprop else 'false'}>", blocks, bm * FUSED_BN // 64


def _fused_lda(K):
    """The row pitch of pointwise_gemm's A: K rounded up to whole K steps (its float4 loads need no
    bounds check)."""
    return -(-K // FUSED_BK) * FUSED_BK


def _fused_operand(xp, a):
    """a (M, K) as pointwise_gemm reads it: rows of _fused_lda(K) floats, zero past K, 16-byte aligned.
    A copy (M x lda floats, the size of W) only where K is not a multiple of FUSED_BK or a is misaligned."""
    lda = _fused_lda(a.shape[1])
    if lda == a.shape[1] and a.flags.c_contiguous and a.data.ptr % 16 == 0:
        return a
    padded = xp.zeros((a.shape[0], lda), dtype=np.float32)
    padded[:, :a.shape[1]] = a
    return padded


def _fused_chunks(g):
    """Slices of the batch whose strided and dense tensors (x and y, gx and gy) each hold fewer than
    2^31 floats: pointwise_gemm's offsets are 32-bit."""
    per_image = max(g.f * g.h * g.w, g.fo * g.oh * g.ow)
    if per_image >= 2**31:
        raise ValueError(f"gemm's fused form: one image's {per_image} floats exceed its 32-bit offsets")
    return batch_slices(g.S, (2**31 - 1) // per_image)


def _fused(xp, pass_name, a, b, out, g, form):
    """The fused form of fprop, y = W @ the taps of x (a = W (f', f), b = x, out = y), or of bprop,
    gx = W^T @ gy scattered into the stride's cells (a = W^T (f, f'), b = gy, out = gx, every element
    written): kernels/pointwise.cu's pointwise_gemm, chunk by chunk. Returns out."""
    bprop = pass_name == "bprop"
    name, _, threads = _fused_plan(g, 1, form, bprop)
    kernel = cuda_module("pointwise.cu", name_expressions=FUSED_NAMES).get_function(name)
    a = _fused_operand(xp, a)
    for sl in _fused_chunks(g):
        n = sl.stop - sl.start
        o = out[sl]
        pairs = bprop and g.sw == 2 and g.w % 2 == 0 and o.data.ptr % 8 == 0   # float2 stores of the cells
        ints = (n, g.f, g.fo, g.h, g.w, g.sh, g.sw, g.oh, g.ow, a.shape[1], pairs)
        kernel((_fused_plan(g, n, form, bprop)[1],), (threads,), (a, b[sl], o) + tuple(np.int32(v) for v in ints))
    return out


def prepare(pass_name, g, xp):
    """run(a, b) -> out for backends.run_pass's prepared path (the arrays checked there: a, b as the
    pass takes them, C-contiguous float32 CuPy arrays of g's shapes): where the pass's tuned form
    is fused, its kernel launch with everything but the arrays worked out here (one chunk, and no
    copy of the weight for fprop); else the pass itself, minus the dispatch."""
    if xp is np:
        return None
    if _pointwise(g) and pass_name in ("fprop", "bprop"):
        form = _form(xp, pass_name, g, None) if not tuning.enabled("gemm_tune", xp) else \
            (tuning.peek(form_key(xp, pass_name, g)) or {}).get("choice")
        run = None
        if form in FUSED and _strided(g):
            run = _fused_prepared(xp, pass_name, g, form)
        elif form == "per_image" and not _strided(g):
            run = _per_image_prepared(xp, pass_name, g)
        if run is not None:
            return run
    fn = globals()[pass_name]
    rest = {"fprop": (), "bprop": ((g.S, g.f, g.h, g.w),), "accgrad": ((g.fo, g.f, g.kh, g.kw),)}[pass_name]
    stride, padding = (g.sh, g.sw), (g.ph, g.pw)
    return lambda a, b: fn(a, b, *rest, stride=stride, padding=padding)


def _per_image_prepared(xp, pass_name, g):
    """The stride-1 1x1 fprop or bprop as prepare() runs it: one strided-batched GEMM over the batch,
    W (or W^T) broadcast, straight into the output (the per_image form, which is one GEMM there)."""
    P, f32, empty = g.oh * g.ow, np.float32, xp.empty
    if pass_name == "fprop":
        shape, w_shape, in_shape, out3 = (g.S, g.fo, g.oh, g.ow), (g.fo, g.f), (g.S, g.f, P), (g.S, g.fo, P)

        def run(x, w):
            y = empty(shape, dtype=f32)
            cgemm.matmul(xp, w.reshape(w_shape), x.reshape(in_shape), out=_batch_of(y.reshape(out3)), strict=True)
            return y
        return run
    shape, w_shape, in_shape, out3 = (g.S, g.f, g.h, g.w), (g.fo, g.f), (g.S, g.fo, P), (g.S, g.f, P)

    def run(gy, w):
        gx = empty(shape, dtype=f32)
        w2t = xp.ascontiguousarray(w.reshape(w_shape).T)          # as _bprop_1x1 (cuBLAS's flag is slower)
        cgemm.matmul(xp, w2t, gy.reshape(in_shape), out=_batch_of(gx.reshape(out3)), strict=True)
        return gx
    return run


def _fused_prepared(xp, pass_name, g, form):
    """The fused form's launch for prepare(), or None where it takes more than one launch (the
    batch in chunks) or a padded copy of the weight (K not a whole number of FUSED_BK steps)."""
    bprop = pass_name == "bprop"
    if len(_fused_chunks(g)) != 1 or _fused_lda(g.fo if bprop else g.f) != (g.fo if bprop else g.f):
        return None
    name, blocks, threads = _fused_plan(g, g.S, form, bprop)
    kernel = cuda_module("pointwise.cu", name_expressions=FUSED_NAMES).get_function(name)
    ints = [tuple(np.int32(v) for v in (g.S, g.f, g.fo, g.h, g.w, g.sh, g.sw, g.oh, g.ow,
                                        g.fo if bprop else g.f, pairs)) for pairs in (0, 1)]
    f32, empty = np.float32, xp.empty
    if not bprop:
        shape = (g.S, g.fo, g.oh, g.ow)

        def run(x, w):                         # w (f', f, 1, 1) is W (f', f) as it is
            if w.data.ptr % 16:
                return None                    # float4 loads: the full path copies it aligned
            y = empty(shape, dtype=f32)
            kernel((blocks,), (threads,), (w, x, y) + ints[0])
            return y
        return run
    shape, pairs = (g.S, g.f, g.h, g.w), g.sw == 2 and g.w % 2 == 0
    fo, f = g.fo, g.f

    def run(gy, w):
        w2t = xp.ascontiguousarray(w.reshape(fo, f).T)   # W^T (f, f'), fresh: aligned
        gx = empty(shape, dtype=f32)
        kernel((blocks,), (threads,), (w2t, gy, gx) + ints[pairs and gx.data.ptr % 8 == 0])
        return gx
    return run


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
        cols = cgemm.matmul(xp, w2, _flat(gy[sl]), op_a="T", strict=True)  # (f*kh*kw, n*oh*ow)
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
    K, P = g.f * g.kh * g.kw, g.oh * g.ow

    def run(form):
        gw = xp.zeros((g.fo, K), dtype=np.float32)
        if form == "flat":
            for sl in _batch_chunks(g):
                cgemm.matmul(xp, _flat(gy[sl]), _im2col(xp, x[sl], g), out=gw, op_b="T",
                             accumulate=True, strict=True)         # gw += (f', f*kh*kw)
            return gw.reshape(tuple(w_shape))
        if form in IMPLICIT:
            return _accgrad_implicit(xp, gy, x, g, form).reshape(tuple(w_shape))
        if form == "rows":
            return _accgrad_rows(xp, gy, x, g).reshape(tuple(w_shape))
        # per-image products (n, f', K), summed: the batch splits the GEMM's K, and gy's
        # (f', oh*ow) plane blocks are already operands (no transposed copy of gy)
        for sl in _image_chunks(g, (K * P + g.fo * K) * 4):
            parts = cgemm.matmul(xp, gy[sl].reshape(-1, g.fo, P), _im2col(xp, x[sl], g, per_image=True),
                                 op_b="T", strict=True)           # (n, f', K), or (f', K) for n = 1
            gw += _sum_rows(xp, parts.reshape(-1, g.fo * K)).reshape(g.fo, K)
        return gw.reshape(tuple(w_shape))
    forms = FORMS + tuple(f for f in IMPLICIT if _implicit_fits(g, f)) + (("rows",) if _rows_plan(g, xp) else ())
    return run(_form(xp, "accgrad", g, run, forms))


# accgrad_small's register block and tile (kernels/im2col.cu: AG_TO, AG_TK, AG_TP): a thread holds
# AG_TO x AG_TK gradient elements, and a block sums AG_TP output positions per shared-memory tile
AG_TO, AG_TK, AG_TP = 4, 4, 32
AG_CPU_BLOCKS = 7       # the NumPy path's blocks: chunks that start and end inside images
# the implicit forms: kernel and outputs a thread (AG_TO, or 8: half the threads, each twice the FMAs
# per shared load, for blocks too large to share an SM, ResNet's conv1 at 592 threads x 56 registers)
IMPLICIT = {"implicit": ("accgrad_small", AG_TO), "implicit8": ("accgrad_small8", 8)}


def _implicit_block(g, form="implicit"):
    """accgrad_small's thread block (x over the taps f*kh*kw, y over f') and shared bytes: the two
    tiles (AG_TP rows of ag_ld(columns) floats), the tap table (3 ints a tap column) and the position
    table (AG_TP x 24 bytes)."""
    to = IMPLICIT[form][1]
    bx, by = -(-g.f * g.kh * g.kw // AG_TK), -(-g.fo // to)
    cols_k, cols_o = bx * AG_TK, by * to
    return bx, by, AG_TP * (_ag_ld(cols_k) + _ag_ld(cols_o)) * 4 + 3 * cols_k * 4 + AG_TP * 24


def _ag_ld(columns):
    """kernels/im2col.cu's ag_ld: a tile row's pitch in floats, 4 more than a multiple of 32."""
    return columns + (4 - columns) % 32


def _resident_blocks(kernel, threads, smem):
    """Blocks of `threads` threads and `smem` shared bytes that one SM holds at once (sm_90: 2048
    threads, 64K registers, 227 KiB of shared memory, 32 blocks), from the kernel's register count."""
    warps = -(-threads // 32)
    return max(1, min(32, 64 // warps, 65536 // (kernel.num_regs * 32 * warps), (227 << 10) // (smem + 1024)))


def _implicit_fits(g, form="implicit"):
    """Whether the form's kernel takes this geometry: its block within 1024 threads and 48 KiB of tiles."""
    bx, by, smem = _implicit_block(g, form)
    return bx * by <= 1024 and smem <= 48 * 1024


@functools.lru_cache(maxsize=None)
def _implicit_launch(g, form, device_id):
    """(kernel, blocks) of the implicit form on this device: the driver's answers (registers) asked
    once per geometry, not on every call."""
    bx, by, smem = _implicit_block(g, form)
    kernel = cuda_module("im2col.cu").get_function(IMPLICIT[form][0])
    return kernel, _resident_blocks(kernel, bx * by, smem) * sm_count(device_id)


def _accgrad_implicit(xp, gy, x, g, form="implicit"):
    """gw (f', f*kh*kw) without a column matrix (the "implicit" accGrad form): partial gradients over
    chunks of the S*oh*ow output positions, each from gy's chunk and the taps gathered from x,
    summed over the chunks. kernels/im2col.cu's accgrad_small on the GPU; on the CPU the same chunks
    in NumPy, so that CI checks the chunking across image boundaries."""
    K, P, total = g.f * g.kh * g.kw, g.oh * g.ow, g.S * g.oh * g.ow
    if xp is np:
        blocks = AG_CPU_BLOCKS
    else:
        bx, by, smem = _implicit_block(g, form)
        kernel, blocks = _implicit_launch(g, form, xp.cuda.Device().id)
    chunk = -(-total // min(blocks, -(-total // AG_TP)))
    chunk = -(-chunk // AG_TP) * AG_TP                             # whole tiles
    nblocks = -(-total // chunk)
    if xp is np:
        partials = np.empty((nblocks, g.fo, K), dtype=np.float32)
        gy3 = gy.reshape(g.S, g.fo, P)
        for b in range(nblocks):
            p = np.arange(b * chunk, min(total, (b + 1) * chunk))
            s, r = p // P, p % P
            partials[b] = gy3[s, :, r].T @ _taps_at(x, g, s, r // g.ow, r % g.ow)   # (f', n) @ (n, K)
        return partials.sum(axis=0)
    partials = xp.empty((nblocks, g.fo, K), dtype=np.float32)
    whole = P % AG_TP == 0 and gy.data.ptr % 16 == 0                # accgrad_small's 16-byte gy loads
    args = (x, gy, partials) + _int32_args(g, g.S) + (np.int32(g.fo), np.int64(chunk), np.int32(whole))
    kernel((nblocks,), (bx, by), args, shared_mem=smem)
    return _sum_rows(xp, partials.reshape(nblocks, -1)).reshape(g.fo, K)


# the rows forms (kernels/im2col.cu accgrad_rows_*): (kernel width, stride) -> kernel, kernel rows a
# thread; a thread holds AR_TO outputs of them, and a tile is at most ROWS_TP output positions
ROWS = {(3, 1): ("accgrad_rows_k3s1", 3), (7, 2): ("accgrad_rows_k7s2", 1), (11, 4): ("accgrad_rows_k11s4", 1)}
AR_TO, ROWS_TP = 8, 64
ROWS_SMEM = 96 << 10    # shared bytes a block at most (two buffers of gy's tile and the input rows)
ROWS_CPU_BLOCKS = 5     # the NumPy path's blocks


@functools.lru_cache(maxsize=None)
def _max_threads(name, device_id):
    """The largest block kernel `name` (kernels/im2col.cu) launches with, from its registers: the
    driver asked once a process and device, not on every accGrad."""
    return cuda_module("im2col.cu").get_function(name).max_threads_per_block


def _rows_plan(g, xp=np):
    """The rows form's launch for g, or None where it does not take g: (kernel, threads a group,
    groups, tp, tiles a row, shared bytes). Groups: of 4, 2 and 1, within the block's thread limit
    (the kernel's, from its registers, on the GPU; 512 on the CPU), the number that wastes the
    fewest warp lanes, the most on a tie; tp: the largest tile of at most ROWS_TP positions that
    divides the output row and the groups (whole tiles), else a partial last tile."""
    spec = ROWS.get((g.kw, g.sw))
    if spec is None or g.kh % spec[1]:
        return None
    name, ri = spec
    max_threads = 512 if xp is np else _max_threads(name, xp.cuda.Device().id)
    nog = -(-g.fo // AR_TO)
    group = g.f * (g.kh // ri) * nog
    fits = [n for n in (1, 2, 4) if group * n <= max_threads]   # (c, kernel rows, outputs) x groups
    if not fits:
        return None
    groups = min(fits, key=lambda n: ((-group * n) % 32 / (group * n), -n))
    whole = [t for t in range(min(g.ow, ROWS_TP), 0, -1) if g.ow % t == 0 and t % groups == 0]
    tp = whole[0] if whole and whole[0] >= min(g.ow, 16) else groups * -(-min(g.ow, 32) // groups)
    rows, width = g.f * g.kh, (tp - 1) * g.sw + g.kw
    buffer = -(-(tp * _ag_ld(nog * AR_TO) + rows * (width | 1)) // 4) * 4   # kernels/im2col.cu ar_buffer
    smem = 2 * buffer * 4 + 2 * rows * 4
    if smem > ROWS_SMEM:
        return None
    return name, group, groups, tp, -(-g.ow // tp), smem


@functools.lru_cache(maxsize=None)
def _rows_launch(g, device_id):
    """(kernel, blocks) of the rows form on this device, its shared-memory limit raised where the
    plan needs more than the default 48 KiB: once per geometry, not on every call."""
    import cupy
    name, group, groups, _, _, smem = _rows_plan(g, cupy)
    kernel = cuda_module("im2col.cu").get_function(name)
    if smem > 48 << 10:
        kernel.max_dynamic_shared_size_bytes = smem
    return kernel, _resident_blocks(kernel, group * groups, smem) * sm_count(device_id)


def _accgrad_rows(xp, gy, x, g):
    """gw (f', f*kh*kw) by the rows form: partial gradients over chunks of tiles (tp output positions
    of one output row), each group of a block one partial, summed after. kernels/im2col.cu's
    accgrad_rows_* on the GPU; on the CPU the same tiles, chunks and groups in NumPy, so that CI
    checks the plan (partial tiles, chunks across rows and images, groups), not the kernel's own
    indexing (the GPU tests do)."""
    K, P = g.f * g.kh * g.kw, g.oh * g.ow
    name, group, groups, tp, tiles_row, smem = _rows_plan(g, xp)
    if xp is np:
        blocks = ROWS_CPU_BLOCKS
    else:
        kernel, blocks = _rows_launch(g, xp.cuda.Device().id)
    tiles = g.S * g.oh * tiles_row
    chunk = -(-tiles // min(blocks, tiles))
    nblocks = -(-tiles // chunk)
    if xp is np:
        partials = np.zeros((nblocks * groups, g.fo, K), dtype=np.float32)
        gy3, qg = gy.reshape(g.S, g.fo, P), tp // groups
        for b in range(nblocks):
            t = np.arange(b * chunk, min(tiles, (b + 1) * chunk))
            s, oy, ox0 = t // (g.oh * tiles_row), t // tiles_row % g.oh, t % tiles_row * tp
            for n in range(groups):
                ox = (ox0[:, None] + n * qg + np.arange(qg)).ravel()
                keep = ox < g.ow                                    # the partial last tile's zeros
                if not keep.any():
                    continue
                ss, oo, ox = np.repeat(s, qg)[keep], np.repeat(oy, qg)[keep], ox[keep]
                partials[b * groups + n] = gy3[ss, :, oo * g.ow + ox].T @ _taps_at(x, g, ss, oo, ox)
        return partials.sum(axis=0)
    partials = xp.empty((nblocks * groups, g.fo, K), dtype=np.float32)
    args = (x, gy, partials) + tuple(np.int32(v) for v in (g.S, g.f, g.h, g.w, g.kh, g.sh, g.ph, g.pw, g.oh,
                                                           g.ow, g.fo, tp, tiles_row))
    kernel((nblocks,), (group, groups), args + (np.int64(chunk),), shared_mem=smem)
    return _sum_rows(xp, partials.reshape(nblocks * groups, -1)).reshape(g.fo, K)


def _sum_rows(xp, a):
    """The sum of a 2-D float32 array's rows, in a fixed order (kernels/im2col.cu sum_rows on the GPU)."""
    if xp is np:
        return a.sum(axis=0)
    a = xp.ascontiguousarray(a, dtype=np.float32)
    rows, cols = a.shape
    out = xp.empty(cols, dtype=np.float32)
    cuda_module("im2col.cu").get_function("sum_rows")((-(-cols // 32),), (32, 32),
                                                      (a, out, np.int32(rows), np.int32(cols)))
    return out


def _taps_at(x, g, s, oy, ox):
    """The column entries of output positions (s, oy, ox) (arrays of n): (n, f*kh*kw), in the column
    matrix's row order (f, kh, kw), zero where a tap falls in the padding."""
    i, j = np.meshgrid(np.arange(g.kh), np.arange(g.kw), indexing="ij")
    iy = oy[:, None] * g.sh - g.ph + i.ravel()                     # (n, kh*kw)
    ix = ox[:, None] * g.sw - g.pw + j.ravel()
    inside = (iy >= 0) & (iy < g.h) & (ix >= 0) & (ix < g.w)
    v = x[s[:, None, None], np.arange(g.f)[None, :, None], np.clip(iy, 0, g.h - 1)[:, None, :],
          np.clip(ix, 0, g.w - 1)[:, None, :]]                      # (n, f, kh*kw)
    return np.where(inside[:, None, :], v, 0).reshape(len(s), -1)
