"""direct: convolution summed as it is defined, in registers, with no unrolled matrix.

  fprop   y[s,o,oy,ox]  = sum_{c,i,j} x[s,c,oy*sh-ph+i, ox*sw-pw+j] w[o,c,i,j]
  bprop   gx[s,c,iy,ix] = sum_{o,i,j} gy[s,o,oy,ox] w[o,c,i,j]   over the taps with
                          iy+ph-i = oy*sh and ix+pw-j = ox*sw (no zeros inserted for the stride)
  accGrad gw[o,c,i,j]   = sum_{s,oy,ox} gy[s,o,oy,ox] x[s,c,oy*sh-ph+i, ox*sw-pw+j]

S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, sh x sw stride,
ph x pw padding, oh x ow output.

Any stride, padding and rectangular kernel. On the GPU, kernels/direct.cu, one of several
kernel configurations per pass (direct_plans: register-blocked tiles, a residue-class bprop,
a deterministic split-batch accGrad, a single-plane kernel): untuned (direct_tune off) a fixed
heuristic choice, else every configuration that fits is run through backends.tuning's recipe
against "naive" and the fastest is cached per (device, geometry, pass); config=NAME forces one.
On the CPU, NumPy: one contraction per kernel tap, vectorised over everything else, with the
same index arithmetic (bprop by residue classes too).

Hazard: the "reg" bprop multiplies zero weights with the gy values of missing taps, so an inf or
NaN in gy can reach a few more input pixels than the definition says; finite inputs are unaffected.
"""
import functools

import numpy as np

from . import tuning
from .common import check_arrays, check_output_shape, geometry, launch_1d, valid_geometry
from .direct_plans import (CONFIGS, PLANE_MAX_K, _classes, candidates, config_named, default_config,  # noqa: F401 - API
                           device_limits, kernel, new_output, plan, template_name)

TUNE_CHECK_TOL = 1e-4   # largest relative difference from naive a tuned configuration may have
HOPELESS = 3.0          # a configuration over 3x the best after a timing round is timed no more


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



# -- GPU: kernels and launches -------------------------------------------------------------------

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
    y = new_output(cp, (g.S, g.fo, g.oh, g.ow))
    pl = plan("fprop", cfg.name, g)
    if cfg.family == "naive":
        launch_1d(kernel("fprop_naive"), y.size, (x, w, y) + _conv_args(g))
    elif cfg.family == "plane":
        kernel(template_name("fprop", cfg, g.kh))(pl.grid, pl.block, _launch_plane(pl, g, x, w, y))
    else:
        wt = cp.ascontiguousarray(w.transpose(1, 2, 3, 0))                   # (f, kh, kw, f')
        kernel(template_name("fprop", cfg))(pl.grid, pl.block, (x, wt, y) + _conv_args(g) + _i32(pl.args),
                                            shared_mem=pl.smem)
    return y


def _bprop_gpu(cfg, gy, w, g):
    import cupy as cp
    gx = new_output(cp, (g.S, g.f, g.h, g.w))
    pl = plan("bprop", cfg.name, g)
    if cfg.family == "naive":
        launch_1d(kernel("bprop_naive"), gx.size, (gy, w, gx) + _conv_args(g))
    elif cfg.family == "plane":
        kernel(template_name("bprop", cfg, g.kh))(pl.grid, pl.block, _launch_plane(pl, g, gy, w, gx))
    else:
        wblk = new_output(cp, (pl.extra["shape"],))  # sub-filters in the block's shared-memory order
        launch_1d(kernel("bprop_weights"), wblk.size,
                  (w, wblk) + _i32((g.f, g.fo, g.kh, g.kw, g.sh, g.sw) + pl.extra["args"]))
        kernel(template_name("bprop", cfg))(pl.grid, pl.block,
                                            (gy, wblk, gx) + _conv_args(g) + _i32(pl.args),
                                            shared_mem=pl.smem)
    return gx


def _accgrad_gpu(cfg, gy, x, g):
    import cupy as cp
    gw = new_output(cp, (g.fo, g.f, g.kh, g.kw))
    pl = plan("accgrad", cfg.name, g)
    if cfg.family == "naive":
        sms = device_limits(cp.cuda.Device().id)[0]
        kernel("accgrad_naive")((int(min(gw.size, sms * 32)),), (256,), (gy, x, gw) + _conv_args(g))
    else:
        nsplit = pl.extra
        ws = new_output(cp, (nsplit, gw.size))        # partial sums ws[z][o][c*kh*kw + tap]
        kernel(template_name("accgrad", cfg))(pl.grid, pl.block, (gy, x, ws) + _conv_args(g) + _i32(pl.args),
                                              shared_mem=pl.smem)
        launch_1d(kernel("sum_partials"), gw.size, (ws, gw, np.int32(nsplit), np.int64(gw.size)))
    return gw



# -- choosing a configuration: forced, tuned (tuning.remembered) or default ---------------------

def _choose(pass_name, g, run, forced):
    """The Config this GPU pass runs: `forced` (a name) if given, else the tuned one where
    direct_tune is on, else default_config."""
    import cupy as cp
    if forced is not None:
        cfg = config_named(pass_name, forced)
        if plan(pass_name, forced, g) is None:
            raise ValueError(f"direct {pass_name} config {forced!r} does not fit geometry {tuple(g)}")
        return cfg
    names = _names(pass_name, g, cp.cuda.Device().id)
    if len(names) == 1 or not tuning.enabled("direct_tune", cp):
        return config_named(pass_name, default_config(pass_name, g, names))
    return config_named(pass_name, _tuned(cp, pass_name, g, run, names)["choice"])


@functools.lru_cache(maxsize=4096)
def _names(pass_name, g, device_id):
    """candidates() on this device, computed once per geometry (the per-call path)."""
    return tuple(candidates(pass_name, g, *device_limits(device_id)))


def _tuned(xp, pass_name, g, run, names):
    """The tuning record of this pass: remembered, or the configurations `names` (naive first)
    run through tuning.tune, each checked against naive's output to TUNE_CHECK_TOL."""
    key = tuning.key(xp, np.float32, g, pass_name, "direct")
    return tuning.remembered(
        key, lambda: tuning.tune(names, lambda name: run(config_named(pass_name, name)), xp, against="naive",
                                 tol=TUNE_CHECK_TOL, drop_slower=HOPELESS, warn=True),
        valid=lambda choice: choice in names, untuned=lambda: default_config(pass_name, g, names))
