"""direct's kernel configurations, their launch plans and the kernels that run them.

CONFIGS lists each pass's configurations: "naive" (one thread or block per output element: slow,
obviously right, every geometry) first, then the templated families of kernels/direct.cu:
"tile" (register-blocked tiles), "reg" (bprop's residue classes with a window of gy in
registers) and "plane" (Iandola et al.'s single-plane kernel, S = f = f' = 1). A configuration
supports a geometry when its launch plan fits the device (shared memory, grid): plan() is that
arithmetic, in pure Python, mirrored by the kernels; candidates() the configurations that fit;
default_config() the untuned choice. kernel() compiles a template instance on first use.
"""
import functools
from collections import namedtuple

import numpy as np

from . import config
from .common import cuda_module

# S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, sh x sw stride,
# ph x pw padding, oh x ow output; KK = kh*kw taps.

SMEM_BUDGET = 48 * 1024      # shared memory a tiled block aims at; more only if one channel needs it
ACCGRAD_SMEM_BUDGET = 100 * 1024  # accGrad keeps several channels' tiles: two blocks per SM fit
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
_BY_NAME = {p: {c.name: c for c in configs} for p, configs in CONFIGS.items()}


def _classes(g):
    """bprop's coarse grid: iy + ph = sh*a + ry with a in [a0, a0+A), likewise ix + pw = sw*b + rx with
    b in [b0, b0+B); class ry takes taps i = ry + sh*m, m < ceil((kh-ry)/sh) <= MH (likewise MW)."""
    a0, b0 = g.ph // g.sh, g.pw // g.sw
    A = (g.h - 1 + g.ph) // g.sh - a0 + 1
    B = (g.w - 1 + g.pw) // g.sw - b0 + 1
    return a0, A, b0, B, -(-g.kh // g.sh), -(-g.kw // g.sw)


# -- launch plans (pure Python, mirrored by the kernels) -----------------------------------------

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
def device_limits(device_id):
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
    sms, smem_max = device_limits(device_id)
    return _plan_for(pass_name, config_named(pass_name, config), g, sms, smem_max)


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


def config_named(pass_name, name):
    """The Config of pass_name called `name`; ValueError naming the known ones otherwise."""
    found = _BY_NAME[pass_name].get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown direct {pass_name} config {name!r}; "
                         f"known: {[c.name for c in CONFIGS[pass_name]]}")
    return found


def default_config(pass_name, g, names):
    """Untuned choice: the single-plane kernel where it applies, else the tile whose block covers
    the most planes without exceeding the planes there are (fewest wasted lanes), else naive."""
    plane = [n for n in names if n.startswith("plane")]
    if plane:
        return plane[0]
    tiles = [config_named(pass_name, n) for n in names if n.startswith(("tile", "reg"))]
    if not tiles:
        return "naive"
    planes = g.f if pass_name == "bprop" else g.fo

    def width(c):                                    # planes one block covers
        return c.params[0] * (1 if pass_name == "bprop" else c.params[3])
    fitting = [c for c in tiles if width(c) <= max(planes, 4)]
    return max(fitting, key=width).name if fitting else min(tiles, key=width).name


# -- kernels ---------------------------------------------------------------------------------------

def template_name(pass_name, cfg, k=None):
    """The C++ name expression of a templated configuration (k: the plane kernel's size)."""
    if cfg.family == "plane":
        rx, ry, contig = cfg.params
        return f"plane_corr<{k}, {rx}, {ry}, {'true' if contig else 'false'}>"
    return f"{pass_name}_{cfg.family}<{', '.join(str(v) for v in cfg.params)}>"


_kernels = {}


def kernel(name):
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
            kern.max_dynamic_shared_size_bytes = device_limits(dev)[1]
        _kernels[(dev, name)] = kern
    return kern


def new_output(xp, shape):
    """An output array: NaN-filled when the direct_poison setting is on, so an element no kernel writes shows up."""
    return xp.full(shape, np.nan, np.float32) if config.get("direct_poison") else xp.empty(shape, np.float32)

