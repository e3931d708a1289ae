"""direct: convolution summed as it is defined, in registers, with no unrolled matrix.

  fprop   y[s,o,oy,ox]  = sum_{c,i,j} x[s,c,oy*sh-ph+i, ox*sw-pw+j] w[o,c,i,j]
  bprop   gx[s,c,iy,ix] = sum_{o,i,j} gy[s,o,oy,ox] w[o,c,i,j]   over the taps with
                          iy+ph-i = oy*sh and ix+pw-j = ox*sw (no zeros inserted for the stride)
  accGrad gw[o,c,i,j]   = sum_{s,oy,ox} gy[s,o,oy,ox] x[s,c,oy*sh-ph+i, ox*sw-pw+j]

Any stride, padding and rectangular kernel. On the GPU, kernels/direct.cu: register-blocked
tiles (each thread accumulates several output planes x several positions; input tile and weights
in shared memory, filled with cp.async), a residue-class bprop (each class of input pixels,
(iy+ph) mod sh, is a stride-1 correlation with a sub-filter; the "reg" variant keeps a window of
gy in registers and double-buffers its shared memory), an accGrad that splits the batch over
blocks and sums the partial results in a fixed order (no atomics, deterministic), and Iandola et
al.'s single-plane kernel for S = f = f' = 1 (fprop, and bprop at stride 1). On the CPU, NumPy:
one contraction per kernel tap, vectorised over everything else, with the same index arithmetic
(bprop by residue classes too).

Configurations. Each pass has a list of kernel configurations (CONFIGS): "naive" (one thread or
block per output element: slow, obviously right, works for every geometry) first, then the
templated ones. A configuration supports a geometry when its launch plan fits the device (shared
memory, grid). Untuned (MINITORCH_DIRECT_TUNE=off) a pass takes a fixed heuristic choice. Tuned
("auto", the default, tunes on the GPU): the first call of a pass for a geometry runs every
supported configuration, rejects any whose result differs from naive's by more than
TUNE_CHECK_TOL, times the rest (CUDA events, warm-up, median) and remembers the fastest per
(device, geometry, pass) through backends.tuning. fprop/bprop/accgrad(..., config=NAME) force one.

Memory: outputs, the rearranged weights (about f' * f * kh * kw floats) and accGrad's partial
sums (nsplit * f' * f * kh * kw floats, nsplit ~ 4 x SMs / blocks per split) come from CuPy's
pool; nothing grows with the batch beyond the output.

Hazard: the "reg" bprop multiplies zero weights with the gy values of missing taps, so an inf or
NaN in gy can reach a few more input pixels than the definition says (the FFT backends spread
them further still); finite inputs are unaffected.
"""
import functools
import warnings
from collections import namedtuple

import numpy as np

from . import config, tuning
from .common import check_arrays, check_output_shape, cuda_module, geometry, launch_1d, valid_geometry

# S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, sh x sw stride,
# ph x pw padding, oh x ow output; KK = kh*kw taps; q = oy*ow + ox a flattened output position.

TUNE_CHECK_TOL = 1e-4        # largest relative difference from naive a tuned winner may have
TUNE_INNER = 3               # runs per timed span while tuning
SMEM_BUDGET = 48 * 1024      # shared memory a tiled block aims at; more only if one channel needs it
ACCGRAD_SMEM_BUDGET = 100 * 1024  # accGrad keeps several channels' tiles: two blocks per SM fit
CACHE_FORMAT = 1
_OPTIONS = ("--std=c++17",)

Config = namedtuple("Config", "name family params")  # family: naive | tile | reg | plane


def _configs():
    fprop = [Config("naive", "naive", ())]
    fprop += [Config(f"tile_fb{fb}_p{p}_t{ts}_g{fg}", "tile", (fb, p, ts, fg))
              for fb, p, ts, fg in [(16, 4, 64, 4), (16, 8, 32, 4), (16, 4, 64, 2), (8, 4, 64, 2),
                                    (8, 8, 64, 4), (4, 4, 64, 1)]]
    bprop = [Config("naive", "naive", ())]
    bprop += [Config(f"tile_fb{fb}_p{p}_tq{tq}", "tile", (fb, p, tq))
              for fb, p, tq in [(3, 8, 32), (4, 8, 32), (8, 4, 64), (16, 4, 32), (16, 4, 64)]]
    bprop += [Config(f"reg_fb{fb}_py{py}_px{px}_mt{mt}", "reg", (fb, py, px, mt))
              for fb, py, px, mt in [(3, 16, 1, 3), (3, 16, 2, 3), (4, 16, 2, 3), (4, 8, 2, 3), (4, 16, 2, 2),
                                     (8, 8, 1, 5)]]
    accgrad = [Config("naive", "naive", ())]
    accgrad += [Config(f"tile_fb{fb}_r{r}_te{te}_g{fg}", "tile", (fb, r, te, fg))
                for fb, r, te, fg in [(16, 3, 128, 2), (16, 4, 128, 2), (16, 2, 128, 2), (8, 4, 64, 2),
                                      (4, 4, 64, 1)]]
    plane = [Config(f"plane_rx{rx}_ry{ry}_{'contig' if c else 'strided'}", "plane", (rx, ry, c))
             for rx, ry, c in [(1, 8, False), (2, 8, False), (4, 4, True), (2, 4, False)]]
    return {"fprop": tuple(fprop + plane), "bprop": tuple(bprop + plane), "accgrad": tuple(accgrad)}


CONFIGS = _configs()
PLANE_MAX_K = 7


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Any valid geometry: every stride, padding and rectangular kernel ("naive" always fits)."""
    return valid_geometry(x_shape, w_shape, stride, padding) is not None


# -- public passes ------------------------------------------------------------------------------

def fprop(x, w, stride=(1, 1), padding=(0, 0), *, config=None):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw).

    config: on the GPU, the name of a configuration of CONFIGS["fprop"] to force (no tuning).
    """
    xp, x, w = check_arrays(x=x, w=w)
    g = geometry(x.shape, w.shape, stride, padding)
    if xp is np:
        return _fprop_cpu(x, w, g)
    run = functools.partial(_fprop_gpu, x=x, w=w, g=g)
    return run(_choose("fprop", g, run, config))


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0), *, config=None):
    """gx (S, f, h, w): gradient w.r.t. the input of fprop."""
    xp, gy, w = check_arrays(gy=gy, w=w)
    g = geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    if xp is np:
        return _bprop_cpu(gy, w, g)
    run = functools.partial(_bprop_gpu, gy=gy, w=w, g=g)
    return run(_choose("bprop", g, run, config))


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0), *, config=None):
    """gw (f', f, kh, kw): gradient w.r.t. the weight, summed over the batch."""
    xp, gy, x = check_arrays(gy=gy, x=x)
    g = geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    if xp is np:
        return _accgrad_cpu(gy, x, g)
    run = functools.partial(_accgrad_gpu, gy=gy, x=x, g=g)
    return run(_choose("accgrad", g, run, config))


# -- CPU: one contraction per tap ----------------------------------------------------------------

def _tap_window(a, i, j, g, n_rows, n_cols):
    """a[..., i + sh*r, j + sw*c] for r < n_rows, c < n_cols: the strided view one tap reads."""
    return a[:, :, i:i + g.sh * (n_rows - 1) + 1:g.sh, j:j + g.sw * (n_cols - 1) + 1:g.sw]


def _fprop_cpu(x, w, g):
    xpad = np.pad(x, ((0, 0), (0, 0), (g.ph, g.ph), (g.pw, g.pw))) if g.ph or g.pw else x
    y = np.zeros((g.S, g.oh, g.ow, g.fo), np.float32)                  # planes last while summing
    for i in range(g.kh):
        for j in range(g.kw):
            # (S, f, oh, ow): x[s, c, oy*sh - ph + i, ox*sw - pw + j]
            win = _tap_window(xpad, i, j, g, g.oh, g.ow)
            y += np.tensordot(win, w[:, :, i, j], axes=([1], [1]))     # (S, oh, ow, f')
    return np.ascontiguousarray(y.transpose(0, 3, 1, 2))               # (S, f', oh, ow)


def _classes(g):
    """bprop's coarse grid: iy + ph = sh*a + ry with a in [a0, a0+A), likewise ix + pw = sw*b + rx with
    b in [b0, b0+B); class ry takes taps i = ry + sh*m, m < ceil((kh-ry)/sh) <= MH (likewise MW)."""
    a0, b0 = g.ph // g.sh, g.pw // g.sw
    A = (g.h - 1 + g.ph) // g.sh - a0 + 1
    B = (g.w - 1 + g.pw) // g.sw - b0 + 1
    return a0, A, b0, B, -(-g.kh // g.sh), -(-g.kw // g.sw)


def _bprop_cpu(gy, w, g):
    """The GPU's residue-class algorithm: gx at iy = sh*a + ry - ph sums gy[a-m] w[ry + sh*m]."""
    a0, A, b0, B, MH, MW = _classes(g)
    # gyp[:, :, r, u] = gy[:, :, r + a0 - (MH-1), u + b0 - (MW-1)], zero outside gy
    r0, u0 = a0 - (MH - 1), b0 - (MW - 1)
    gyp = np.zeros((g.S, g.fo, A + MH - 1, B + MW - 1), np.float32)
    ylo, yhi = max(0, r0), min(g.oh, r0 + A + MH - 1)
    xlo, xhi = max(0, u0), min(g.ow, u0 + B + MW - 1)
    if ylo < yhi and xlo < xhi:
        gyp[:, :, ylo - r0:yhi - r0, xlo - u0:xhi - u0] = gy[:, :, ylo:yhi, xlo:xhi]
    # gx in padded coordinates Y = iy + ph, X = ix + pw, rows up to sh*(a0+A)
    gxp = np.zeros((g.S, g.f, g.sh * (a0 + A), g.sw * (b0 + B)), np.float32)
    for ry in range(g.sh):
        for rx in range(g.sw):
            acc = np.zeros((g.S, A, B, g.f), np.float32)
            for m in range(-(-(g.kh - ry) // g.sh) if ry < g.kh else 0):
                for n in range(-(-(g.kw - rx) // g.sw) if rx < g.kw else 0):
                    win = gyp[:, :, MH - 1 - m:MH - 1 - m + A, MW - 1 - n:MW - 1 - n + B]  # gy[a-m, b-n]
                    acc += np.tensordot(win, w[:, :, ry + g.sh * m, rx + g.sw * n], axes=([1], [0]))
            gxp[:, :, g.sh * a0 + ry::g.sh, g.sw * b0 + rx::g.sw] = acc.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(gxp[:, :, g.ph:g.ph + g.h, g.pw:g.pw + g.w])


def _accgrad_cpu(gy, x, g):
    xpad = np.pad(x, ((0, 0), (0, 0), (g.ph, g.ph), (g.pw, g.pw))) if g.ph or g.pw else x
    gw = np.empty((g.fo, g.f, g.kh, g.kw), np.float32)
    for i in range(g.kh):
        for j in range(g.kw):
            win = _tap_window(xpad, i, j, g, g.oh, g.ow)               # (S, f, oh, ow)
            gw[:, :, i, j] = np.tensordot(gy, win, axes=([0, 2, 3], [0, 2, 3]))  # (f', f)
    return gw


# -- GPU: launch plans (pure Python, mirrored by the kernels) ------------------------------------

Plan = namedtuple("Plan", "grid block smem args extra")


def _round4(n):
    return -(-n // 4) * 4


def _phase_tile(g, positions):
    """Input tile of fprop/accgrad for `positions` consecutive output positions: rows_max, pwc, rs, iwp."""
    nspan = min(g.oh, (positions - 1) // g.ow + 2)        # output rows such a run can touch
    rows_max = (nspan - 1) * g.sh + g.kh
    iwp = (g.ow - 1) * g.sw + g.kw                        # padded columns the outputs touch
    pwc = -(-iwp // g.sw)                                 # columns per phase (u % sw)
    return rows_max, pwc, g.sw * pwc, iwp


def _fits_int32(g):
    return max(g.h * g.w, g.oh * g.ow) < 2**31 - 2**20


def _fprop_plan(cfg, g, smem_max):
    fb, p, ts, fg = cfg.params
    fbb, kk = _round4(fb) * fg, g.kh * g.kw
    rows_max, pwc, rs, iwp = _phase_tile(g, ts * p)
    fixed, per_ch = 4 * iwp, 4 * (kk * fbb + rows_max * rs)
    budget = SMEM_BUDGET if fixed + per_ch <= SMEM_BUDGET else smem_max
    cc = min(g.f, (budget - fixed) // per_ch)
    if cc < 1 or not _fits_int32(g):
        return None
    ngroups, ntiles = -(-g.fo // (fb * fg)), -(-(g.oh * g.ow) // (ts * p))
    return Plan((ngroups * ntiles, min(g.S, 65535)), (ts * fg,), fixed + cc * per_ch,
                (cc, rows_max, pwc, rs), None)


def _bprop_plan(cfg, g, smem_max):
    fb, p, tq = cfg.params
    ncls = g.sh * g.sw
    cpb = min(ncls, 256 // tq)                            # classes per block, one per tq threads
    fgn = max(1, min(256 // (tq * cpb), -(-g.f // fb)))   # groups of fb input planes per block
    ncg, nfgrp, fbb = -(-ncls // cpb), -(-g.f // (fb * fgn)), _round4(fb) * fgn
    a0, A, b0, B, MH, MW = _classes(g)
    nspan = min(A, (tq * p - 1) // B + 2)
    rows_max, rsg = nspan + MH - 1, B + MW - 1
    per_ch = 4 * (cpb * MH * MW * fbb + rows_max * rsg)
    budget = SMEM_BUDGET if per_ch <= SMEM_BUDGET else smem_max
    cc = min(g.fo, budget // per_ch)
    if cc < 1 or not _fits_int32(g):
        return None
    ntiles = -(-(A * B) // (tq * p))
    weights = dict(shape=ncg * nfgrp * g.fo * cpb * MH * MW * fbb,
                   args=(MH, MW, fb, _round4(fb), fgn, cpb, ncg, nfgrp))
    return Plan((ntiles * nfgrp * ncg, min(g.S, 65535)), (tq * cpb * fgn,), cc * per_ch,
                (A, B, a0, b0, MH, MW, cpb, fgn, cc, rows_max), weights)


def _bprop_reg_plan(cfg, g, smem_max):
    fb, py, px, mt = cfg.params
    a0, A, b0, B, MH, MW = _classes(g)
    if MH > mt or MW > mt or not _fits_int32(g):
        return None
    ncls = g.sh * g.sw
    cpb = min(ncls, 8)                                    # classes per block, one warp each
    nstrip = max(1, min(8 // cpb, -(-A // py)))           # strips of py coarse rows, one warp each
    ncg, nfgrp, fbp = -(-ncls // cpb), -(-g.f // fb), _round4(fb)
    ty, tx = nstrip * py, 32 * px
    per_ch = cpb * mt * mt * fbp + (ty + mt - 1) * (tx + mt - 1)            # floats, one buffer
    budget = SMEM_BUDGET if 8 * (per_ch + 3) <= SMEM_BUDGET else smem_max
    cc = min(g.fo, (budget // 8 - 3) // per_ch)                            # two float4-aligned buffers
    if cc < 1:
        return None
    tiles = -(-A // ty) * -(-B // tx)
    weights = dict(shape=ncg * nfgrp * g.fo * cpb * mt * mt * fbp, args=(mt, mt, fb, fbp, 1, cpb, ncg, nfgrp))
    return Plan((tiles * nfgrp * ncg, min(g.S, 65535)), (32 * cpb * nstrip,), 8 * _round4(cc * per_ch),
                (A, B, a0, b0, cpb, nstrip, cc), weights)


def _accgrad_plan(cfg, g, smem_max, sms):
    fb, r, te, fg = cfg.params
    fbb, kk = _round4(fb) * fg, g.kh * g.kw
    ne, eb, ohw = g.f * kk, te * r, g.oh * g.ow
    cc_max = min(g.f, (eb - 1) // kk + 2)                 # channels an entry group can span
    budget = min(smem_max, ACCGRAD_SMEM_BUDGET)
    for tp in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1):    # the longest run of positions that fits
        tp = min(tp, ohw)
        rows_max, pwc, rs, iwp = _phase_tile(g, tp)
        smem = 4 * (tp * fbb + cc_max * rows_max * rs + tp + iwp)
        if smem <= budget:
            break
    else:
        return None
    if not _fits_int32(g):
        return None
    nfog, neg = -(-g.fo // (fb * fg)), -(-ne // eb)
    items = g.S * -(-ohw // tp)
    nsplit = int(max(1, min(items, 65535, -(-4 * sms // (nfog * neg)))))
    return Plan((nfog, neg, nsplit), (te * fg,), smem, (tp, cc_max, rows_max, pwc, rs), nsplit)


def _plane_io(g, pass_name):
    """Single-plane fast path: (in_h, in_w, pad_h, pad_w, out_h, out_w, flip) or None.

    bprop at stride 1 is a correlation of gy with the flipped filter, padded by k-1-p (a negative
    padding is a crop)."""
    if (g.S, g.f, g.fo, g.sh, g.sw) != (1, 1, 1, 1, 1) or g.kh != g.kw or g.kh > PLANE_MAX_K:
        return None
    if pass_name == "fprop":
        return g.h, g.w, g.ph, g.pw, g.oh, g.ow, False
    if pass_name == "bprop":
        return g.oh, g.ow, g.kh - 1 - g.ph, g.kw - 1 - g.pw, g.h, g.w, True
    return None


def _plane_plan(cfg, g, pass_name):
    io = _plane_io(g, pass_name)
    if io is None:
        return None
    rx, ry, _ = cfg.params
    out_h, out_w = io[4], io[5]
    grid = (-(-out_w // (32 * rx)), -(-out_h // (4 * ry)))
    if grid[1] > 65535 or not _fits_int32(g):
        return None
    return Plan(grid, (32, 4), 0, io, None)


@functools.lru_cache(maxsize=None)
def _device_limits(device_id):
    """(multiprocessors, opt-in shared memory per block in bytes) of a CUDA device."""
    import cupy as cp
    attrs = cp.cuda.Device(device_id).attributes
    return attrs["MultiProcessorCount"], attrs["MaxSharedMemoryPerBlockOptin"]


def plan(pass_name, config, g):
    """The launch plan of configuration `config` (a name) for pass_name on geometry g on the current
    GPU, or None if it does not fit (naive always fits)."""
    import cupy as cp
    return _cached_plan(pass_name, config, g, cp.cuda.Device().id)


@functools.lru_cache(maxsize=4096)
def _cached_plan(pass_name, config, g, device_id):
    sms, smem_max = _device_limits(device_id)
    return _plan_for(pass_name, _config(pass_name, config), g, sms, smem_max)


def _plan_for(pass_name, cfg, g, sms, smem_max):
    if cfg.family == "naive":
        return Plan(None, None, 0, (), None)
    if cfg.family == "plane":
        return _plane_plan(cfg, g, pass_name)
    if pass_name == "fprop":
        return _fprop_plan(cfg, g, smem_max)
    if cfg.family == "reg":
        return _bprop_reg_plan(cfg, g, smem_max)
    if pass_name == "bprop":
        return _bprop_plan(cfg, g, smem_max)
    return _accgrad_plan(cfg, g, smem_max, sms)


def candidates(pass_name, g, sms=132, smem_max=227 * 1024):
    """Names of the configurations of pass_name that support geometry g (naive first)."""
    return [c.name for c in CONFIGS[pass_name] if _plan_for(pass_name, c, g, sms, smem_max) is not None]


def _config(pass_name, name):
    for c in CONFIGS[pass_name]:
        if c.name == name:
            return c
    raise ValueError(f"unknown direct {pass_name} config {name!r}; "
                     f"known: {[c.name for c in CONFIGS[pass_name]]}")


# -- GPU: kernels and launches -------------------------------------------------------------------

def template_name(pass_name, cfg, k=None):
    """The C++ name expression of a templated configuration (k: the plane kernel's size)."""
    if cfg.family == "plane":
        rx, ry, contig = cfg.params
        return f"plane_corr<{k}, {rx}, {ry}, {'true' if contig else 'false'}>"
    return f"{pass_name}_{cfg.family}<{', '.join(str(v) for v in cfg.params)}>"


_kernels = {}


def _kernel(name):
    """A kernel of direct.cu by name: an extern "C" one, or a template instance compiled on first use
    (one NVRTC compile per instance, cached by CuPy on disk). Tiled kernels may use the device's
    opt-in shared memory (above 48 KiB)."""
    import cupy as cp
    dev = cp.cuda.Device().id
    kern = _kernels.get((dev, name))
    if kern is None:
        templated = "<" in name
        source = "correlate1d.cu" if name.startswith("correlate1d") else "direct.cu"
        mod = cuda_module(source, _OPTIONS, (name,) if templated else None)
        kern = mod.get_function(name)
        if templated and source == "direct.cu" and "plane" not in name:
            kern.max_dynamic_shared_size_bytes = _device_limits(dev)[1]
        _kernels[(dev, name)] = kern
    return kern


def _new(xp, shape):
    """An output array: NaN-filled when POISON is set, so an element no kernel writes shows up."""
    return xp.full(shape, np.nan, np.float32) if config.get("direct_poison") else xp.empty(shape, np.float32)


def _conv_args(g):
    return _i32((g.S, g.f, g.h, g.w, g.fo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.oh, g.ow))


def _i32(values):
    return tuple(np.int32(v) for v in values)


def _launch_plane(pl, g, src, w, out):
    import cupy as cp
    in_h, in_w, pad_h, pad_w, out_h, out_w, flip = pl.args
    w2 = cp.ascontiguousarray(w[0, 0, ::-1, ::-1] if flip else w[0, 0])       # (k, k)
    return (src, w2, out) + _i32((in_h, in_w, pad_h, pad_w, out_h, out_w))


def _fprop_gpu(cfg, x, w, g):
    import cupy as cp
    y = _new(cp, (g.S, g.fo, g.oh, g.ow))
    pl = plan("fprop", cfg.name, g)
    if cfg.family == "naive":
        launch_1d(_kernel("fprop_naive"), y.size, (x, w, y) + _conv_args(g))
    elif cfg.family == "plane":
        _kernel(template_name("fprop", cfg, g.kh))(pl.grid, pl.block, _launch_plane(pl, g, x, w, y))
    else:
        wt = cp.ascontiguousarray(w.transpose(1, 2, 3, 0))                   # (f, kh, kw, f')
        _kernel(template_name("fprop", cfg))(pl.grid, pl.block, (x, wt, y) + _conv_args(g) + _i32(pl.args),
                                             shared_mem=pl.smem)
    return y


def _bprop_gpu(cfg, gy, w, g):
    import cupy as cp
    gx = _new(cp, (g.S, g.f, g.h, g.w))
    pl = plan("bprop", cfg.name, g)
    if cfg.family == "naive":
        launch_1d(_kernel("bprop_naive"), gx.size, (gy, w, gx) + _conv_args(g))
    elif cfg.family == "plane":
        _kernel(template_name("bprop", cfg, g.kh))(pl.grid, pl.block, _launch_plane(pl, g, gy, w, gx))
    else:
        wblk = _new(cp, (pl.extra["shape"],))        # sub-filters in the block's shared-memory order
        launch_1d(_kernel("bprop_weights"), wblk.size,
                  (w, wblk) + _i32((g.f, g.fo, g.kh, g.kw, g.sh, g.sw) + pl.extra["args"]))
        _kernel(template_name("bprop", cfg))(pl.grid, pl.block,
                                             (gy, wblk, gx) + _conv_args(g) + _i32(pl.args),
                                             shared_mem=pl.smem)
    return gx


def _accgrad_gpu(cfg, gy, x, g):
    import cupy as cp
    gw = _new(cp, (g.fo, g.f, g.kh, g.kw))
    pl = plan("accgrad", cfg.name, g)
    if cfg.family == "naive":
        sms = _device_limits(cp.cuda.Device().id)[0]
        _kernel("accgrad_naive")((int(min(gw.size, sms * 32)),), (256,), (gy, x, gw) + _conv_args(g))
    else:
        nsplit = pl.extra
        ws = _new(cp, (nsplit, gw.size))              # partial sums ws[z][o][c*kh*kw + tap]
        _kernel(template_name("accgrad", cfg))(pl.grid, pl.block, (gy, x, ws) + _conv_args(g) + _i32(pl.args),
                                               shared_mem=pl.smem)
        launch_1d(_kernel("sum_partials"), gw.size, (ws, gw, np.int32(nsplit), np.int64(gw.size)))
    return gw


# -- choosing a configuration: forced, remembered, tuned or default ------------------------------

_chosen = {}  # (device id, pass, geometry, direct_tune) -> Config: the per-call lookup, no device query


def _choose(pass_name, g, run, config):
    import cupy as cp
    if config is not None:
        cfg = _config(pass_name, config)
        if plan(pass_name, config, g) is None:
            raise ValueError(f"direct {pass_name} config {config!r} does not fit geometry {tuple(g)}")
        return cfg
    device_id, tune = cp.cuda.Device().id, config.get("direct_tune")
    cfg = _chosen.get((device_id, pass_name, g, tune))
    if cfg is not None:
        return cfg
    names = candidates(pass_name, g, *_device_limits(device_id))
    if tune == "off" or len(names) == 1:
        cfg = _config(pass_name, default_config(pass_name, g, names))
    else:
        key = tuning.key(cp, np.float32, g, pass_name, "direct")
        cfg = _config(pass_name, _remembered(key, names, lambda: tune(pass_name, g, run, names)))
    _chosen[device_id, pass_name, g, tune] = cfg
    return cfg


def _remembered(key, names, tune):
    """The configuration name stored under `key` in the tuning cache, if it is still one of `names`;
    else tune() -> (best name, {name: ms}), whose result is stored and returned."""
    cache = tuning.default_cache()
    stored = cache.get(key)
    if isinstance(stored, dict) and stored.get("format") == CACHE_FORMAT and stored.get("config") in names:
        return stored["config"]
    best, times = tune()
    cache.put(key, {"format": CACHE_FORMAT, "config": best, "ms": times})
    return best


def default_config(pass_name, g, names):
    """Untuned choice: the single-plane kernel where it applies, else the tile whose block covers
    the most planes without exceeding the planes there are (fewest wasted lanes), else naive."""
    plane = [n for n in names if n.startswith("plane")]
    if plane:
        return plane[0]
    tiles = [_config(pass_name, n) for n in names if n.startswith(("tile", "reg"))]
    if not tiles:
        return "naive"
    planes = g.f if pass_name == "bprop" else g.fo

    def width(c):                                    # planes one block covers
        return c.params[0] * (1 if pass_name == "bprop" else c.params[3])
    fitting = [c for c in tiles if width(c) <= max(planes, 4)]
    return max(fitting, key=width).name if fitting else min(tiles, key=width).name


def tune(pass_name, g, run, names, warmup=1, repeat=5):
    """Time every configuration in `names` (naive first) on run(cfg) -> output; return (best name,
    {name: ms}). A configuration whose output differs from naive's by more than TUNE_CHECK_TOL
    (relative, Frobenius norm) is rejected with a warning. One that takes over 3x the best time so
    far in a single run keeps that time; the others get the median of `repeat` spans of TUNE_INNER
    back-to-back runs, after `warmup`."""
    import cupy as cp
    first = _config(pass_name, names[0])
    run(first)                        # compiles it; naive is slow on big layers, so the run that
    kept = {}                         # makes the reference is also its one timing
    times = {first.name: tuning.timeit(lambda: kept.update(ref=run(first)), cp, 0, 1)}
    reference = kept["ref"]
    ref_norm = float(cp.linalg.norm(reference))
    for name in names[1:]:
        cfg = _config(pass_name, name)
        diff = float(cp.linalg.norm(run(cfg) - reference))
        err = diff / ref_norm if ref_norm else diff
        if not err <= TUNE_CHECK_TOL:
            warnings.warn(f"direct: {pass_name} config {name} differs from {first.name} by {err:.2e} "
                          f"(relative) on geometry {tuple(g)}; not used", RuntimeWarning, stacklevel=2)
            continue
        once = tuning.timeit(lambda: run(cfg), cp, 0, 1)   # hopeless ones are not timed further
        if once > 3 * min(times.values()):
            times[name] = once
            continue
        # back-to-back runs: a short kernel is timed by its duration, not by one launch's latency
        span = tuning.timeit(lambda: [run(cfg) for _ in range(TUNE_INNER)], cp, warmup, repeat)
        times[name] = span / TUNE_INNER
    return min(times, key=times.get), times


# -- the 1-D case: one long mask over long signals (kernels/correlate1d.cu) ----------------------

# (outputs per thread, threads per block) of every correlate1d<OUT, THREADS> instance; OUT odd.
CORRELATE1D_CONFIGS = ((7, 256), (15, 128), (15, 256), (23, 128), (31, 64), (31, 128))
MAX_GRID_Y = 65535
_correlate1d_chosen = {}  # (device id, B, L, K, direct_tune) -> (OUT, THREADS)


def correlate1d(x, mask, *, config=None):
    """y (..., L - K + 1) = valid cross-correlation of each row of x (..., L) with mask (K,):
    y[..., i] = sum_j x[..., i + j] mask[j] (no flip, like the 2-D passes).

    float32. On the GPU, register-blocked (kernels/correlate1d.cu), tuned over
    CORRELATE1D_CONFIGS per (B, L, K) like the 2-D passes; config=(OUT, THREADS) forces one.
    On the CPU, NumPy (a sliding-window view times the mask).
    """
    xp, x, mask = check_arrays(x=x, mask=mask)
    if x.ndim < 1 or mask.ndim != 1:
        raise ValueError(f"correlate1d: x must be (..., L) and mask (K,), got shapes {x.shape} and {mask.shape}")
    L, K = x.shape[-1], mask.shape[0]
    if K < 1 or K > L:
        raise ValueError(f"correlate1d: the mask length K = {K} must be between 1 and the signal length L = {L}")
    batch = x.shape[:-1]
    B = int(np.prod(batch))
    n_out = L - K + 1
    if B == 0:
        return xp.empty(batch + (n_out,), np.float32)
    if xp is np:
        windows = np.lib.stride_tricks.sliding_window_view(x.reshape(B, L), K, axis=-1)   # (B, n_out, K)
        return (windows @ mask).astype(np.float32).reshape(batch + (n_out,))
    if B > MAX_GRID_Y:
        raise ValueError(f"correlate1d: at most {MAX_GRID_Y} signals per call (grid y), got {B}")
    import cupy as cp
    x2 = cp.ascontiguousarray(x).reshape(B, L)
    mask = cp.ascontiguousarray(mask)

    def run(cfg):
        out, threads = cfg
        y = _new(cp, (B, n_out))
        tile = out * threads
        _kernel(f"correlate1d<{out}, {threads}>")(((n_out + tile - 1) // tile, B), (threads,),
                                                  (x2, mask, y, np.int64(L), np.int32(K), np.int64(n_out)))
        return y

    if config is not None:
        if tuple(config) not in CORRELATE1D_CONFIGS:
            raise ValueError(f"correlate1d: config {config!r} is not one of {CORRELATE1D_CONFIGS}")
        return run(tuple(config)).reshape(batch + (n_out,))
    return run(_choose_correlate1d(B, L, K, run)).reshape(batch + (n_out,))


def _choose_correlate1d(B, L, K, run):
    """The remembered, cached, tuned or (direct_tune off) default configuration for one problem size."""
    import cupy as cp
    device_id = cp.cuda.Device().id
    tune = config.get("direct_tune")
    memo = (device_id, B, L, K, tune)
    if memo in _correlate1d_chosen:
        return _correlate1d_chosen[memo]
    cfg = (15, 128)
    if tune != "off":
        by_name = {f"{o}x{t}": (o, t) for o, t in CORRELATE1D_CONFIGS}   # cached by name, "OUTxTHREADS"

        def tune():
            times = {name: tuning.timeit(lambda c=c: run(c), cp, 1, 5) for name, c in by_name.items()}
            return min(times, key=times.get), times
        key = tuning.key(cp, np.float32, (B, L, K), "correlate1d", "direct")
        cfg = by_name[_remembered(key, list(by_name), tune)]
    _correlate1d_chosen[memo] = cfg
    return cfg
