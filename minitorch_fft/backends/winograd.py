"""winograd: Lavin and Gray's minimal filtering F(m x m, 3 x 3) ("Fast Algorithms for
Convolutional Neural Networks", CVPR 2016), m = 2 or 4, alpha = m + 2 the transformed tile.

  fprop   Y  = A^T [ U . V ] A        U = G w G^T (f', f), V = B^T d B (f, tiles), per element
  bprop   the same with the weights rotated 180 degrees, in/out planes swapped, padding 2 - p
  accGrad gW = G^T [ Z . V^T ] G      Z = A gy A^T (f', tiles), V as in fprop, summed over tiles

Each of the alpha^2 transformed elements is one GEMM: (f' x f) @ (f x S*tiles) for fprop and
bprop, (f' x S*tiles) @ (S*tiles x f) for accGrad (the F(3x3, m x m) correlation of input tiles
with gradient tiles, written with the transposes of fprop's matrices: the weight gradient of
y = A^T[(G g) . (B^T d)] is G^T[(A gy) . (B^T d)]). All alpha^2 GEMMs are one strided-batched
cuBLAS call (cgemm.matmul: strict fp32, or TF32 when the tf32 setting is on); accGrad's sums
over tiles run in groups of images, (groups x alpha^2) GEMMs in that one call (or alpha^2 / parts
of them in each of `parts` calls, _row_parts), and the groups are added in float64
(accgrad_groups says why).

The input and gradient transforms are CUDA kernels (kernels/winograd.cu, templated on m) that
read their tiles with the zero padding implied (reads outside the plane are zeros, also for a
negative padding: bprop of a layer padded by more than 2) and write the GEMM-ready layout
(alpha^2, planes, S*tiles) directly; the output transform reads the GEMM's (alpha^2, f', S*tiles)
and writes only the tile elements inside the output (the last tiles are clipped). The weight
transforms (G w G^T, and accGrad's G^T M G) are kernels too, computed in float64 and rounded
once to float32: weights are small, and their rounding is then the only one they add.

Interpolation points (module POINTS): F(2,3) 0, 1, -1, inf (Lavin's); F(4,3) 0, 1, -1, 1/2,
-2, inf. Measured in float32 (benchmarks/experiments/exp_winograd_points.py), Lavin's 0, +-1,
+-2 and the symmetric 0, +-1, +-1/2 gave the same error; mixing 1/2 and -2 gave a third less.
The CUDA file holds the same matrices as literals (so the compiler folds the zeros and ones);
test_winograd checks they equal toom_cook()'s.

Variants: both are within 1e-5 of float64 on every 3x3 stride-1 layer of VGG-16 and ResNet-18/50
and on random geometries (H100: F(2x2) at most 3.4e-6, F(4x4) 7.8e-6, its accGrad the largest;
results/nvidia-h100-80gb-hbm3/bench_winograd.md), so both are eligible for auto in fp32 mode:
the tuner (tuning.remembered, winograd_tune) times them per geometry and pass. Setting
winograd_f4=0 keeps F(2x2) alone (its error is about 4x smaller). In TF32 mode F(2x2) runs
alone: on TF32 GEMMs F(4x4) is 7x a direct TF32 convolution's error (variants). A batch whose
transformed tiles exceed winograd_workspace_mb runs in chunks; in every pass also where they
exceed TRANSIENT_FACTOR times the pass's own operands (fprop and accGrad 2, bprop 1), or 256 MB,
whichever is more (_chunks); fprop's and bprop's weight transform counts against the 256 MB where
their chunks' GEMMs keep MIN_CHUNK_FLOP of work (_conv_chunks). accGrad makes a chunk's tiles in
parts of whole alpha rows where they exceed once the operands, or 256 MB, and each part's GEMMs
keep MIN_CHUNK_FLOP of work (_row_parts).

On the CPU the same algorithm runs in NumPy: same matrices, tiling, index arithmetic and layout.
"""
import functools
from fractions import Fraction

import numpy as np

from . import cgemm, config, tuning
from .common import batch_slices, check_arrays, check_output_shape, cuda_module, geometry, valid_geometry
from .utils import is_int

# S batch, f in-planes, f' out-planes (fo), h x w input, oh x ow output, ph x pw padding,
# m x m output tile, alpha = m + 2 transformed tile, th x tw tiles per plane, P = S*th*tw

R = 3                                   # the kernel size this backend computes
POINTS = {2: (0, 1, -1), 4: (0, 1, -1, Fraction(1, 2), -2)}   # and infinity
TILES = (2, 4)
BLOCK = 128


def toom_cook(m, r=R, points=None):
    """(AT (m, alpha), G (alpha, r), BT (alpha, alpha)) as exact Fractions for F(m, r) on the finite
    `points` plus infinity: y = AT [(G g) * (BT d)] is the correlation y_i = sum_k d_(i+k) g_k.

    A evaluates at the points (infinity: the leading coefficient), BT^T interpolates (the
    Lagrange basis without its denominators, and the monic product at infinity), G evaluates
    the filter with the Lagrange denominators moved into it."""
    pts = [Fraction(p) for p in (POINTS[m] if points is None else points)]
    alpha = m + r - 1
    assert len(pts) == alpha - 1, f"F({m},{r}) needs {alpha - 1} finite points"

    def poly(roots):        # coefficients, lowest power first, of prod (x - root)
        c = [Fraction(1)]
        for root in roots:
            c = [Fraction(0)] + c
            for i in range(len(c) - 1):
                c[i] -= root * c[i + 1]
        return c + [Fraction(0)] * (alpha - len(c))

    AT = [[p ** i for p in pts] + [Fraction(int(i == m - 1))] for i in range(m)]
    G = [[p ** k / _prod(p - q for q in pts if q != p) for k in range(r)] for p in pts]
    G.append([Fraction(int(k == r - 1)) for k in range(r)])
    BT = [poly([q for q in pts if q != p]) for p in pts] + [poly(pts)]
    return AT, G, BT


def _prod(values):
    out = Fraction(1)
    for v in values:
        out *= v
    return out


@functools.lru_cache(maxsize=None)
def matrices(m, dtype=np.float32):
    """(AT, G, BT) of F(m, 3) as arrays of `dtype`."""
    return tuple(np.array([[float(v) for v in row] for row in mat], dtype=dtype) for mat in toom_cook(m))


# -- what the backend takes ----------------------------------------------------------------------

def revision(pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0), math="fp32"):
    """auto's cue to time winograd again where its speed changed (backends.auto): accGrad 1 since its
    groups fill the GPU (GEMM_BLOCKS, accgrad_groups), 2 since the group count is tuned
    (_per_group). In TF32 mode (math "tf32") two more: one since session 22 compared F(4x4) with
    F(2x2) at the TF32 tolerance, one since session 31 runs F(2x2) alone there (variants): the
    choices timed with F(4x4) are timed again. fprop and bprop 1 since their batch chunks are
    bounded by their operands too (_chunks, session 23); accGrad 3 since its chunks and partial
    sums are too (session 32); bprop 2 since its bound is once its operands (session 33); fprop 2
    and bprop 3 since the weight transform counts against the floor where the chunks' GEMMs keep
    their work (_conv_chunks, session 57); accGrad 4 since its chunks' tiles are made in row parts
    (_row_parts, session 58). The tile's own tuning record is keyed by it too."""
    return {"fprop": 2, "bprop": 3, "accgrad": 4}[pass_name] + 2 * (math == "tf32")


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """3x3 kernels, stride 1, any zero padding and plane shape."""
    g = valid_geometry(x_shape, w_shape, stride, padding)
    return g is not None and (g.kh, g.kw, g.sh, g.sw) == (R, R, 1, 1)


def check_geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """The Geometry, or ValueError saying why winograd cannot take it (layers quote it)."""
    g = geometry(x_shape, w_shape, stride, padding)
    if (g.kh, g.kw, g.sh, g.sw) != (R, R, 1, 1):
        raise ValueError(f"winograd supports 3x3 kernels at stride 1 only, got {g.kh}x{g.kw} "
                         f"at stride {(g.sh, g.sw)}; use gemm, direct or an FFT backend")
    return g


def tiles(oh, ow, m):
    """(th, tw): m x m output tiles covering an oh x ow output (the last ones clipped)."""
    return -(-oh // m), -(-ow // m)


# A chunk's tiles: at most this times the pass's operands (per pass), or TRANSIENT_FLOOR bytes where
# that is more (_chunks). bprop at 1: converted OverFeat-fast's compiled TF32 step peaked 67 MiB over
# PyTorch's in conv5's bprop, which runs after its accGrad (the weight gradient alive) with the
# forward's activations held (session 32's trace, read again in session 33: it had been taken for
# fprop's, and bounding fprop left the peak at 2805 MiB). The others at 2: smaller chunks cost time
# (conv5, F(2x2), H200, exp_winograd_chunks, session 33: at 1, fprop 0.893 ms against 0.798, bprop
# 0.884 against 0.787, accGrad 1.118 against 0.892).
TRANSIENT_FACTOR = {"fprop": 2, "bprop": 1, "accgrad": 2}
TRANSIENT_FLOOR = 256 << 20
# fprop's and bprop's weight transform (alpha^2 x f x f' floats) counts against the floor where each
# chunk's GEMMs keep at least this much work, 2 alpha^2 f f' x its columns (images x output tiles)
# flop (_conv_chunks). OverFeat-fast's converted TF32 step under reduce-overhead peaked over PyTorch's
# (2163 / 2149 MiB, session 57) in conv5's passes; its bprop's chunks are the floor's: 3 of 43 images,
# 97 MiB of tiles and as much GEMM output beside the 64 MiB transform. Counted there: 4 chunks of 32
# images, 38.7 GFLOP a chunk, no slower (0.845 against 0.854 ms). Smaller chunks cost time wherever
# else they were measured (exp_winograd_chunks, session 56; benchmarks/NOTES.md): TF32 conv3's bprop
# 1 -> 2 chunks (9.7 GFLOP the smallest chunk, +17 %), conv4's 2 -> 3 (25.4, +11 %); strict fp32's
# F(4x4) bprops counted, conv5's 2 -> 3 (28.5, +15 %) and conv4's 1 -> 2 (21.7, +14 %). So the transform
# counts only where the chunks keep the work measured to cost nothing (38.7 GFLOP, rounded down).
MIN_CHUNK_FLOP = 38e9


def _chunks(S, per_image_floats, operand_floats, factor, floor=None):
    """Slices of the batch whose transformed tiles (per_image_floats an image) fit
    winograd_workspace_mb (one image at least) and hold at most `factor` times the pass's
    operands (operand_floats an image: its input and output planes), or `floor` bytes
    (TRANSIENT_FLOOR if None) where that is more.

    The tiles are 2.25 (F(4x4)) to 4 (F(2x2)) times the planes they come from, so a whole batch's
    took more memory than cuDNN's kernels take beside the same operands: OverFeat-fast's conv5
    (1024 planes, 12x12, b128) at F(4x4) held 340 MB of tiles (and as much GEMM output) for 151 MB
    of operands, and a converted model's TF32 step peaked 102 MiB above PyTorch's there (session
    23, benchmarks/NOTES.md). accGrad, whose operands are the same planes (x and gy), kept the
    workspace's bound alone until F(2x2) became the TF32 mode's only tile (session 31): its
    whole-batch tiles there (604 MB) and its partial sums (_group_cap) put the converted TF32 step
    ~600 MiB above PyTorch's; since session 32 it is bounded like the others."""
    floor = TRANSIENT_FLOOR if floor is None else floor
    bound = min(config.mib_bytes("winograd_workspace_mb"), max(factor * 4 * S * operand_floats, floor))
    return batch_slices(S, bound // (4 * per_image_floats))


def _conv_chunks(pass_name, S, f, fo, in_hw, out_hw, m):
    """_chunks of a pass at F(m x m) from f planes of in_hw to fo planes of out_hw: an image's
    tiles are alpha^2 times the output's tile count times (f + fo) floats, bounded by the
    workspace and by the images' own planes (TRANSIENT_FACTOR[pass_name] times). fprop's and
    bprop's chunks also hold the weight transform (alpha^2 f fo floats), which counts against
    TRANSIENT_FLOOR where every chunk's GEMMs then keep MIN_CHUNK_FLOP of work; accGrad's partial
    sums have their own bound (_group_cap)."""
    alpha = m + R - 1
    th, tw = tiles(*out_hw, m)
    args = S, alpha * alpha * th * tw * (f + fo), _planes(f, fo, in_hw, out_hw), TRANSIENT_FACTOR[pass_name]
    if pass_name == "accgrad":
        return _chunks(*args)
    counted = _chunks(*args, floor=max(TRANSIENT_FLOOR - 4 * alpha * alpha * f * fo, 0))
    if 2 * alpha * alpha * f * fo * th * tw * min(sl.stop - sl.start for sl in counted) >= MIN_CHUNK_FLOP:
        return counted
    return _chunks(*args)


def _planes(f, fo, in_hw, out_hw):
    """Floats of one image's input and output planes: a pass's operands an image."""
    return f * in_hw[0] * in_hw[1] + fo * out_hw[0] * out_hw[1]


# -- the three passes ----------------------------------------------------------------------------

def fprop(x, w, stride=(1, 1), padding=(0, 0), tile=None):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, 3, 3)."""
    xp, x, w = check_arrays(x=x, w=w)
    g = check_geometry(x.shape, w.shape, stride, padding)
    run = lambda m: _conv(xp, x, _weight_transform(xp, w, m), (g.ph, g.pw), (g.oh, g.ow), m, "fprop")   # noqa: E731
    return run(_tile(xp, "fprop", g, tile, run))


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0), tile=None):
    """gx (S, f, h, w): gy correlated with w rotated by 180 degrees, in/out planes swapped."""
    xp, gy, w = check_arrays(gy=gy, w=w)
    g = check_geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    pad = _bprop_padding(g)
    run = lambda m: _conv(xp, gy, _weight_transform(xp, w, m, rotate=True), pad, (g.h, g.w), m, "bprop")  # noqa: E731
    return run(_tile(xp, "bprop", g, tile, run))


def _bprop_padding(g):
    """bprop's padding of gy: 2 - p a side (negative: the plane is cropped)."""
    return R - 1 - g.ph, R - 1 - g.pw


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0), tile=None):
    """gw (f', f, 3, 3): the weight gradient, summed over the batch."""
    xp, gy, x = check_arrays(gy=gy, x=x)
    g = check_geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    run = lambda m: _accgrad(xp, gy, x, g, m)   # noqa: E731
    return run(_tile(xp, "accgrad", g, tile, run))


def prepare(pass_name, g, xp):
    """run(a, b) -> out for backends.run_pass's prepared path (a, b checked there: C-contiguous float32
    CuPy arrays of g's shapes). fprop and bprop in one chunk, at a tile already chosen: their four
    launches (weight, input and output transforms, the GEMM), with the tile, shapes, kernels, integer
    arguments and the GEMM's cuBLAS arguments (cgemm.prepare) worked out here once; else (accGrad, a
    batch in chunks, a tile not tuned yet) None, and run_pass calls the pass function. At
    OverFeat-fast conv3's TF32 fprop (H200, session 66, exp_host_cudnn) the pass function's checks,
    tile lookup and chunk arithmetic made 0.119 ms of host work a call against 0.171 ms of GPU time
    (0.180 back to back); prepared, 0.060 (0.171). test_winograd checks on the CPU that it launches
    what the full path launches."""
    if xp is np or pass_name == "accgrad":
        return None
    m = _chosen_tile(xp, pass_name, g)
    bprop = pass_name == "bprop"
    f_in, f_out = (g.fo, g.f) if bprop else (g.f, g.fo)
    in_hw, out_hw = ((g.oh, g.ow), (g.h, g.w)) if bprop else ((g.h, g.w), (g.oh, g.ow))
    pad = _bprop_padding(g) if bprop else (g.ph, g.pw)
    if m is None or len(_conv_chunks(pass_name, g.S, f_in, f_out, in_hw, out_hw, m)) != 1:
        return None
    alpha, (th, tw) = m + R - 1, tiles(*out_hw, m)
    P = g.S * th * tw
    if max(f_in * P, f_out * P, g.f * g.fo) >= 2**31:   # _launch's bound (the full path says so)
        return None
    module = cuda_module("winograd.cu", name_expressions=NAME_EXPRESSIONS)
    launches = [(module.get_function(name), ((threads + BLOCK - 1) // BLOCK,), _ints(*ints))
                for name, threads, ints in
                ((f"winograd_weight<{m}, {'true' if bprop else 'false'}>", g.fo * g.f, (g.fo, g.f)),
                 (f"winograd_input<{m}>", f_in * P, (g.S, f_in, *in_hw, th, tw, *pad, 1, P, 0, alpha)),
                 (f"winograd_output<{m}>", f_out * P, (g.S, f_out, *out_hw, th, tw)))]
    (weight, w_grid, w_ints), (inputs, v_grid, v_ints), (output, y_grid, y_ints) = launches
    u_shape, v_shape, y_shape = (alpha * alpha, f_out, f_in), (alpha * alpha, f_in, P), (g.S, f_out, *out_hw)
    gemm = cgemm.prepare(xp, u_shape, v_shape, dtype=np.float32)   # the mode now: _prepared keys on the settings
    if gemm is None:
        return None
    f32, empty, block = np.float32, xp.empty, (BLOCK,)

    def run(a, w):                          # a: x (fprop) or gy (bprop); as _conv's one chunk
        u = empty(u_shape, dtype=f32)
        weight(w_grid, block, (w, u, *w_ints))
        v = empty(v_shape, dtype=f32)
        inputs(v_grid, block, (a, v, *v_ints))
        prod = gemm(u, v)                   # (alpha^2, f_out, P)
        del u, v                            # freed before the output is made
        y = empty(y_shape, dtype=f32)
        output(y_grid, block, (prod, y, *y_ints))
        return y
    return run


def _chosen_tile(xp, pass_name, g):
    """The tile _tile would take for the pass without tuning: the only variant, or the tuned one
    (None where this process's tuning memory holds no valid record of it for the cache as it is)."""
    options = variants(cgemm.mode(xp))
    if len(options) == 1 or not tuning.enabled("winograd_tune", xp):
        return options[0]
    return tuning.peek_choice(_tile_key(xp, pass_name, g), options)


def variants(math="fp32"):
    """The tile sizes auto may use: F(2x2); F(4x4) too where the winograd_f4 setting is on and the
    GEMMs are strict fp32 (math, cgemm.mode).

    Not in TF32 mode: its transforms scale what the GEMMs' TF32 rounding leaves. Session 31 (H200,
    OverFeat-fast's layers at b128): F(4x4) on TF32 GEMMs was 2.1e-3 from float64 in every pass on
    random operands, 7x a direct TF32 convolution's 2.9e-4 (F(2x2): 5e-4), and in the TF32 step
    (auto had put its two 1024-plane layers on F(4x4)) the gradients were 3.0-4.4e-3 from float64
    where the check allows twice PyTorch TF32's 1.0e-3; with F(2x2) alone, 8.2e-4
    (benchmarks/experiments/exp_tf32_bound.py --gpu, exp_step_error.py --tf32)."""
    return TILES if config.get("winograd_f4") and math != "tf32" else (2,)


def _tile(xp, pass_name, g, forced, run):
    """m for this pass: `forced` if given, the only variant, or the tuned one (tuning.remembered)."""
    if forced is not None:
        if not is_int(forced) or forced not in TILES:   # 4.0 == 4, and then no kernel takes it
            raise ValueError(f"winograd tile must be one of {TILES}, got {forced!r}")
        return forced
    options = variants(cgemm.mode(xp))
    if len(options) == 1 or not tuning.enabled("winograd_tune", xp):
        return options[0]
    return tuning.remembered(_tile_key(xp, pass_name, g),
                             lambda: tuning.tune(options, run, xp, against=options[0],
                                                 tol=tuning.variant_tol(xp, TUNE_TOL)),
                             valid=lambda m: is_int(m) and m in options, untuned=lambda: options[0])["choice"]


def _tile_key(xp, pass_name, g):
    """The tuning cache's key of the pass's tile (with winograd's revision for it)."""
    r = revision(pass_name, *_shapes(g), cgemm.mode(xp))
    return tuning.key(xp, np.float32, tuple(g), pass_name, f"winograd_r{r}" if r else "winograd")


TUNE_TOL = 1e-4   # F(4x4) against F(2x2) while tuning, strict fp32: both far inside it when correct


def _shapes(g):
    """(x_shape, w_shape, stride, padding) of a Geometry."""
    return (g.S, g.f, g.h, g.w), (g.fo, g.f, g.kh, g.kw), (g.sh, g.sw), (g.ph, g.pw)


def _weight_transform(xp, w, m, rotate=False):
    """U (alpha^2, fo, f) float32 = G w G^T of w (fo, f, 3, 3), computed in float64 and rounded
    once; rotate (bprop): U (alpha^2, f, fo) of the filters rotated by 180 degrees, planes swapped."""
    fo, f = w.shape[:2]
    alpha = m + R - 1
    if xp is not np:
        u = xp.empty((alpha * alpha, f, fo) if rotate else (alpha * alpha, fo, f), dtype=np.float32)
        _launch(f"winograd_weight<{m}, {'true' if rotate else 'false'}>", fo * f, (w, u, *_ints(fo, f)))
        return u
    if rotate:
        w = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)                  # (f, fo, 3, 3)
    _, G, _ = matrices(m, np.float64)
    u = np.einsum("ak,oikl,bl->aboi", G, w.astype(np.float64), G)     # (alpha, alpha, rows, cols)
    return np.ascontiguousarray(u.reshape(alpha * alpha, *w.shape[:2]), dtype=np.float32)


def _conv(xp, x, u, pad, out_hw, m, pass_name):
    """y (S, fo, oh, ow): x (S, f, h, w) correlated with the filters whose transform is u
    (alpha^2, fo, f), x read at offset -pad (zeros outside it), every output tile clipped; in
    pass_name's chunks (fprop or bprop)."""
    S, f, h, w = x.shape
    fo, (oh, ow) = u.shape[1], out_hw
    th, tw = tiles(oh, ow, m)
    y = xp.empty((S, fo, oh, ow), dtype=np.float32)
    for sl in _conv_chunks(pass_name, S, f, fo, (h, w), (oh, ow), m):
        n = sl.stop - sl.start
        v = _input_transform(xp, x[sl], pad, th, tw, m)             # (alpha^2, f, n*th*tw)
        prod = cgemm.matmul(xp, u, v)                               # (alpha^2, fo, n*th*tw)
        # the input tiles freed before the output transform, which writes into y's slice (a
        # contiguous block: no chunk-sized result, no copy): at conv5 of OverFeat-fast (F(2x2), 64
        # images) a chunk held u, v, prod and a 36 MiB result at once, 388 MiB (session 56)
        del v
        _output_transform(xp, prod, n, oh, ow, m, out=y[sl])
        del prod                    # freed before the next chunk's are made, not after
    return y


GROUP_TILES = 4096   # accGrad: tiles one GEMM sums at most (or one image's, if more)
GEMM_BLOCKS = 1024   # accGrad: 128 x 128 output blocks the grouped GEMM aims at (accgrad_groups)


def accgrad_groups(g, m, images):
    """(images per group, groups) of accGrad for a chunk of `images`.

    A GEMM over all S*th*tw tiles would sum up to a million products per weight in float32
    (cuBLAS sums along K in order): its rounding error grows with that length and, on VGG's
    large planes, passed 1e-5 (benchmarks/NOTES.md). Groups of whole images of at most
    GROUP_TILES tiles are summed apart, by one strided-batched GEMM over (groups x alpha^2) (one a
    row part, over groups x alpha^2 / parts, where the tiles are made in parts: _row_parts), and
    the groups' sums added in float64 (winograd_weight_grad).

    Groups also give the GEMM independent outputs to spread over the SMs. `fill` groups would give
    it GEMM_BLOCKS blocks of 128 x 128 outputs; a group takes ceil(images / fill) images, so there
    are `fill` groups or somewhat fewer (ResNet's 128 images at fill 29: 26). With alpha^2
    matrices of f' x f alone, VGG-16's 512-plane layers had 36 x 16 = 576 blocks at F(4x4), and
    the GEMM ran at 38 TFLOP/s against 52 for F(2x2)'s four groups of 16 (exp_winograd_accgrad,
    session 16). On small matrices the rule asks for more groups than pays (ResNet's 64 planes:
    26 groups 0.70 ms, 8-16 groups 0.61-0.62; tiledfft wins there anyway), so where winograd_tune
    tunes, the count is tuned per geometry among group_options (_per_group); this rule is the
    untuned choice. The partial sums (groups x alpha^2 matrices of f' x f; laid out (parts, groups,
    alpha^2 / parts, f', f), _weight_gradient) stay under _group_cap."""
    per_image = tiles(g.oh, g.ow, m)[0] * tiles(g.oh, g.ow, m)[1]
    alpha2 = (m + R - 1) ** 2
    most = _most_groups(g, m)
    fill = -(-GEMM_BLOCKS // (alpha2 * -(-g.fo // 128) * -(-g.f // 128)))    # groups that fill the GPU
    per_group = max(1, min(GROUP_TILES // per_image, -(-images // fill)), -(-images // most))
    per_group = min(images, per_group)
    return per_group, -(-images // per_group)


GROUP_FLOOR = 64 << 20   # accGrad's partial sums may take this much whatever the operands (_group_cap)


def _group_cap(g):
    """Bytes accGrad's partial sums may take: a quarter of the workspace, and no more than the
    pass's operands (x and gy, the whole batch's) or GROUP_FLOOR where that is more: small layers'
    sums keep the groups that fill the GPU (ResNet's 512 planes at 7x7, b128: 26 MB of operands,
    16 MiB of sums a group at F(2x2)).

    The second bound is session 32's. In TF32 mode, where F(2x2) is the only tile, OverFeat-fast's
    conv5 (1024 planes, 12x12, b128) had tuned 8 groups: 512 MiB of sums for 151 MB of operands,
    beside 604 MB of tiles. The converted TF32 step peaked 613 MiB above F(4x4)'s, and above
    PyTorch's (session 31, benchmarks/NOTES.md)."""
    operands = 4 * g.S * _planes(g.f, g.fo, (g.h, g.w), (g.oh, g.ow))
    return min(config.mib_bytes("winograd_workspace_mb") // 4, max(operands, GROUP_FLOOR))


def _most_groups(g, m):
    """The most groups whose partial sums (alpha^2 f' x f matrices each) fit _group_cap; one at least."""
    return max(1, _group_cap(g) // (4 * (m + R - 1) ** 2 * g.fo * g.f))


def group_options(g, m, images):
    """The images-per-group counts accGrad's tuning times for a chunk of `images`: the accuracy
    rule's (GROUP_TILES tiles a group at most, and _group_cap's on the groups), then 2, 4, 8 and
    16 times as many groups, and accgrad_groups' own pick; largest groups first."""
    per_image = tiles(g.oh, g.ow, m)[0] * tiles(g.oh, g.ow, m)[1]
    fewest = -(-images // _most_groups(g, m))
    base = min(images, max(1, GROUP_TILES // per_image, fewest))
    options = {max(fewest, 1, -(-base // k)) for k in (1, 2, 4, 8, 16)}
    options.add(accgrad_groups(g, m, images)[0])
    return tuple(sorted(options, reverse=True))


def _per_group(xp, g, m, images, run):
    """Images per group for a chunk of `images`: tuned among group_options where winograd_tune
    tunes (run(per_group) -> the weight gradient; checked against accgrad_groups' pick), else
    accgrad_groups' pick."""
    default = accgrad_groups(g, m, images)[0]
    options = group_options(g, m, images)
    if len(options) == 1 or not tuning.enabled("winograd_tune", xp):
        return default
    # keyed by the revision (a change to the pass times the counts again) and by the workspace,
    # whose cap on the groups shapes the options
    r = revision("accgrad", *_shapes(g), cgemm.mode(xp))
    key = tuning.key(xp, np.float32, tuple(g), "accgrad",
                     f"winograd_groups_r{r}_f{m}_n{images}_ws{config.get('winograd_workspace_mb'):g}")
    return tuning.remembered(key, lambda: tuning.tune(options, run, xp, against=default,
                                                      tol=tuning.variant_tol(xp, TUNE_TOL)),
                             valid=lambda per: is_int(per) and per in options, untuned=lambda: default)["choice"]


def _accgrad(xp, gy, x, g, m):
    """gw = G^T [sum over tiles of Z V^T] G: each group's sum by the GEMM (the chunks' added into
    it), the groups' sums and the transform in float64; the images a group, tuned (_per_group)."""
    chunks = _conv_chunks("accgrad", g.S, g.f, g.fo, (g.h, g.w), (g.oh, g.ow), m)
    images = chunks[0].stop - chunks[0].start
    run = lambda per: _accgrad_grouped(xp, gy, x, g, m, chunks, per)   # noqa: E731
    return run(_per_group(xp, g, m, images, run))


def _accgrad_grouped(xp, gy, x, g, m, chunks, per_group):
    """_accgrad with `per_group` images a group (the chunks' groups summed into one partial), each
    chunk's tiles made and summed in _row_parts."""
    alpha = m + R - 1
    th, tw = tiles(g.oh, g.ow, m)
    groups = -(-(chunks[0].stop - chunks[0].start) // per_group)
    tiles_a_chunk = groups * per_group * th * tw
    parts = _row_parts(4 * tiles_a_chunk * alpha * alpha * (g.f + g.fo),
                       4 * g.S * _planes(g.f, g.fo, (g.h, g.w), (g.oh, g.ow)), alpha,
                       2 * g.f * g.fo * tiles_a_chunk * alpha * alpha)
    count = alpha // parts                                          # rows a part
    part = xp.empty((parts, groups * count * alpha, g.fo, g.f), dtype=np.float32)
    for k, sl in enumerate(chunks):
        n_groups = -(-(sl.stop - sl.start) // per_group)            # the last chunk may have fewer
        layout = (n_groups, per_group * th * tw)
        for q in range(parts):
            rows = (q * count, count)
            v = _input_transform(xp, x[sl], (g.ph, g.pw), th, tw, m, layout, rows)   # (n_groups*E, f, Pg)
            z = _gradient_transform(xp, gy[sl], th, tw, m, layout, rows)             # (n_groups*E, fo, Pg)
            cgemm.matmul(xp, z, v, out=part[q, :n_groups * count * alpha], op_b="T", accumulate=k > 0)
            del v, z                # freed before the next part's are made
    return _weight_gradient(xp, part.reshape(-1, g.fo, g.f), groups, m, parts)   # (fo, f, 3, 3)


# accGrad's tiles of a chunk are made in ranges of their alpha x alpha rows where they would hold
# more than this times the pass's operands (or TRANSIENT_FLOOR bytes, where that is more): the
# GEMM keeps the chunk's length (its sum over the tiles) and each part has as many whole-row
# elements, a batch of count * alpha products instead of alpha^2; the transforms read their planes
# once a part. OverFeat-fast's converted TF32 step under reduce-overhead peaked at conv5's accGrad
# (session 58): a chunk of 64 images held 144 MiB of input tiles, 144 of gradient tiles and the
# 64 MiB partial sum, 2 times the pass's operands (TRANSIENT_FACTOR, at which the chunks cost
# nothing measured; at 1, three chunks, 1.20x the time, session 33). In two row parts, 144 MiB, at
# 0.95-0.99x (session 58, calls 4-5). A part's GEMM keeps MIN_CHUNK_FLOP of work, as fprop's and
# bprop's chunks do where their weight transform counts: VGG-16's conv4_2 (b64, TF32) in two parts
# of 26 GFLOP ran at 0.86x (exp_winograd_chunks --row-factors, session 58), conv5's of 38.7 at
# 0.95-0.99x.
ROW_FACTOR = 1


def _row_parts(tile_bytes, operand_bytes, alpha, flop):
    """Row parts (a divisor of alpha) for a chunk whose whole tiles take tile_bytes and whose GEMM
    does `flop`: the fewest whose tiles each fit max(ROW_FACTOR * operand_bytes, TRANSIENT_FLOOR),
    among those that leave each part's GEMM MIN_CHUNK_FLOP of work; the most of those if none fits
    (1 where no split keeps the work)."""
    bound = max(ROW_FACTOR * operand_bytes, TRANSIENT_FLOOR)
    options = [p for p in range(1, alpha + 1) if alpha % p == 0 and (p == 1 or flop / p >= MIN_CHUNK_FLOP)]
    return next((p for p in options if tile_bytes <= p * bound), options[-1])


def _weight_gradient(xp, part, groups, m, parts=1):
    """gw (fo, f, 3, 3) = G^T [sum over groups of part] G in float64, rounded once; part
    (parts*groups*E, fo, f): the alpha^2 elements of each group's sum in `parts` ranges of whole
    rows, E = alpha^2 / parts each (_accgrad_grouped)."""
    fo, f = part.shape[1:]
    alpha = m + R - 1
    if xp is not np:
        gw = xp.empty((fo, f, R, R), dtype=np.float32)
        _launch(f"winograd_weight_grad<{m}>", fo * f, (part, gw, *_ints(groups, fo, f, parts)))
        return gw
    _, G, _ = matrices(m, np.float64)
    acc = (part.reshape(parts, groups, alpha // parts, alpha, fo, f).astype(np.float64).sum(axis=1)
           .reshape(alpha, alpha, fo, f))
    return np.einsum("ak,abji,bl->jikl", G, acc, G).astype(np.float32)


# -- transforms: CUDA kernels on the GPU, the same arithmetic in NumPy on the CPU ------------------

def _input_transform(xp, x, pad, th, tw, m, layout=None, rows=None):
    """x (n, f, h, w) -> V (groups*E, f, Pg), E = alpha^2 (or rows' count x alpha): B^T d B of
    every alpha x alpha input tile d, tile (i, j) starting at row i*m - ph, column j*m - pw; zeros
    outside the plane. layout =
    (groups, Pg), the tiles cut into groups of whole images (accGrad; images past n are zeros);
    default one group, (alpha^2, f, n*th*tw). rows = (a0, count): the elements of those rows of
    each tile's alpha x alpha alone, (groups*count*alpha, f, Pg) (accGrad's row parts); default all."""
    n, f, h, w = x.shape
    alpha = m + R - 1
    groups, per = layout or (1, n * th * tw)
    a0, count = rows or (0, alpha)
    if xp is not np:
        v = xp.empty((groups * count * alpha, f, per), dtype=np.float32)
        _launch(f"winograd_input<{m}>", f * groups * per,
                (x, v, *_ints(n, f, h, w, th, tw, *pad, groups, per, a0, count)))
        return v
    _, _, BT = matrices(m)
    ri, rmask = _window(th, m, alpha, pad[0], h)                      # (th, alpha): not `rows`, the parameter
    ci, cmask = _window(tw, m, alpha, pad[1], w)                      # (tw, alpha)
    d = x[:, :, ri[:, :, None, None], ci[None, None, :, :]]           # (n, f, th, alpha, tw, alpha)
    d = d * (rmask[:, :, None, None] & cmask[None, None, :, :])
    t = np.einsum("ai,nfrisj->nfrasj", BT, d)                         # B^T d: rows first, as the kernel
    t = np.einsum("bj,nfrasj->abfnrs", BT, t)                         # then columns: (alpha, alpha, f, n, th, tw)
    return _grouped(t[a0:a0 + count].reshape(count * alpha, f, n * th * tw), groups, per)


def _gradient_transform(xp, gy, th, tw, m, layout, rows=None):
    """gy (n, fo, oh, ow) -> Z (groups*E, fo, Pg), E as _input_transform's: A g A^T of every m x m
    gradient tile g (tile (i, j) at row i*m, column j*m; zeros past the output's last row and column), in
    _input_transform's grouped layout (rows as there)."""
    n, fo, oh, ow = gy.shape
    alpha = m + R - 1
    groups, per = layout
    a0, count = rows or (0, alpha)
    if xp is not np:
        z = xp.empty((groups * count * alpha, fo, per), dtype=np.float32)
        _launch(f"winograd_gradient<{m}>", fo * groups * per,
                (gy, z, *_ints(n, fo, oh, ow, th, tw, groups, per, a0, count)))
        return z
    AT, _, _ = matrices(m)
    ri, rmask = _window(th, m, m, 0, oh)                              # (th, m): not `rows`, the parameter
    ci, cmask = _window(tw, m, m, 0, ow)                              # (tw, m)
    d = gy[:, :, ri[:, :, None, None], ci[None, None, :, :]]          # (n, fo, th, m, tw, m)
    d = d * (rmask[:, :, None, None] & cmask[None, None, :, :])
    t = np.einsum("ia,nfrisj->nfrasj", AT, d)                         # A g (alpha rows)
    t = np.einsum("jb,nfrasj->abfnrs", AT, t)                         # (A g) A^T: (alpha, alpha, fo, n, th, tw)
    return _grouped(t[a0:a0 + count].reshape(count * alpha, fo, n * th * tw), groups, per)


def _grouped(t, groups, per):
    """(E, planes, P) -> (groups*E, planes, per): tiles p of group p // per, zeros past P (E: the
    elements of a tile kept, alpha^2 or a range of its rows)."""
    a2, planes, P = t.shape
    full = np.zeros((a2, planes, groups * per), dtype=np.float32)
    full[:, :, :P] = t
    return np.ascontiguousarray(full.reshape(a2, planes, groups, per).transpose(2, 0, 1, 3)).reshape(-1, planes, per)


def _output_transform(xp, prod, n, oh, ow, m, out=None):
    """prod (alpha^2, fo, n*th*tw) -> y (n, fo, oh, ow): A^T M A of every tile, clipped to oh x ow.
    out: a C-contiguous float32 (n, fo, oh, ow) array to write y into (a batch slice of the pass's
    result), else a new one."""
    fo, alpha = prod.shape[1], m + R - 1
    th, tw = tiles(oh, ow, m)
    if out is not None and (out.shape != (n, fo, oh, ow) or out.dtype != np.float32 or not out.flags.c_contiguous):
        raise ValueError(f"winograd: out must be C-contiguous float32 of shape {(n, fo, oh, ow)}, got {out.dtype} "
                         f"{out.shape} (C-contiguous: {out.flags.c_contiguous})")
    if xp is not np:
        y = xp.empty((n, fo, oh, ow), dtype=np.float32) if out is None else out
        _launch(f"winograd_output<{m}>", fo * n * th * tw, (prod, y, *_ints(n, fo, oh, ow, th, tw)))
        return y
    AT, _, _ = matrices(m)
    t = prod.reshape(alpha, alpha, fo, n, th, tw)
    t = np.einsum("ia,abfnrs->ibfnrs", AT, t)                         # A^T M: rows first, as the kernel
    t = np.einsum("jb,ibfnrs->nfrisj", AT, t)                         # (n, fo, th, m, tw, m)
    y = t.reshape(n, fo, th * m, tw * m)[:, :, :oh, :ow]
    if out is None:
        return np.ascontiguousarray(y, dtype=np.float32)
    out[...] = y
    return out


def _window(count, step, size, pad, limit):
    """(index (count, size), inside (count, size)): element k of tile i sits at i*step - pad + k;
    indices outside [0, limit) are clamped and masked (the kernels' bounds check)."""
    idx = np.arange(count)[:, None] * step - pad + np.arange(size)[None, :]
    inside = (idx >= 0) & (idx < limit)
    return np.clip(idx, 0, limit - 1), inside


# -- CUDA ------------------------------------------------------------------------------------------

NAME_EXPRESSIONS = tuple(f"{k}<{m}>" for k in ("winograd_input", "winograd_gradient", "winograd_output",
                                              "winograd_weight_grad") for m in TILES) + \
    tuple(f"winograd_weight<{m}, {rot}>" for m in TILES for rot in ("false", "true"))


def _ints(*values):
    return tuple(np.int32(v) for v in values)


def _launch(name, threads, args):
    """One thread per (plane, tile): consecutive threads take consecutive tiles (coalesced writes)."""
    if threads >= 2**31:
        raise ValueError(f"winograd: {threads} tiles in one chunk exceed the kernels' 32-bit index; "
                         "lower winograd_workspace_mb")
    kernel = cuda_module("winograd.cu", name_expressions=NAME_EXPRESSIONS).get_function(name)
    kernel(((threads + BLOCK - 1) // BLOCK,), (BLOCK,), args)
