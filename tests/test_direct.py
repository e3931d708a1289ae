"""The direct backend's three passes against PyTorch float64: network layers, strides, paddings,
rectangular kernels; on the GPU every kernel configuration, forced one by one, with NaN-poisoned
outputs so an element no kernel writes fails the comparison."""
import re
import warnings

import numpy as np
import pytest

from minitorch_fft.backends import common, correlate1d, direct, direct_plans, tuning
from conftest import DEVICES
from minitorch_fft.device import to_device
from reference import check_backend, conv_reference, rel_error

# name: (x shape, w shape, stride, padding)
CASES = {
    "alexnet_conv1_crop": ((2, 3, 59, 59), (64, 3, 11, 11), (4, 4), (2, 2)),
    "overfeat_conv1_crop": ((2, 3, 67, 67), (96, 3, 11, 11), (4, 4), (0, 0)),
    "conv3x3_pad1": ((2, 16, 13, 13), (24, 16, 3, 3), (1, 1), (1, 1)),
    "conv1x1": ((2, 8, 7, 9), (5, 8, 1, 1), (1, 1), (0, 0)),
    "conv1x1_stride2": ((2, 4, 9, 8), (3, 4, 1, 1), (2, 2), (0, 0)),      # pixels no tap reaches
    "rect_3x5_pad12": ((2, 4, 11, 13), (6, 4, 3, 5), (1, 1), (1, 2)),
    "rect_5x2_stride23": ((2, 3, 17, 19), (4, 3, 5, 2), (2, 3), (1, 0)),
    "stride23_pad31": ((1, 5, 20, 23), (7, 5, 4, 6), (2, 3), (3, 1)),
    "pad_beyond_kernel": ((2, 2, 6, 6), (3, 2, 2, 2), (3, 3), (3, 3)),    # whole rows of padding
    "batch1_single_channel": ((1, 1, 12, 10), (1, 1, 3, 3), (1, 1), (0, 0)),
    "single_plane_k7_pad": ((1, 1, 40, 37), (1, 1, 7, 7), (1, 1), (3, 2)),
    "single_plane_k2": ((1, 1, 33, 70), (1, 1, 2, 2), (1, 1), (0, 1)),
    "wide_rows": ((1, 2, 5, 300), (3, 2, 3, 3), (1, 2), (1, 1)),          # a row > a block's positions
    "wide_plane": ((1, 1, 9, 517), (1, 1, 3, 3), (1, 1), (1, 1)),         # bprop's idle lanes far apart
    "tall_multi_tile": ((3, 2, 70, 20), (5, 2, 3, 3), (1, 1), (0, 0)),
    "many_channels": ((2, 70, 6, 6), (9, 70, 3, 3), (1, 1), (1, 1)),        # several channel chunks
}


def _data(case, seed=0):
    xs, ws, stride, pad = CASES[case]
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32),
            stride, pad, rng)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_against_float64_reference(case, device):
    x, w, stride, pad, rng = _data(case)
    check_backend(direct, x, w, stride, pad, device=device, rng=rng)


def test_cpu_bprop_residue_classes_cover_every_pixel():
    """The class decomposition writes each input pixel exactly once: a one-hot gy per output."""
    g = common.geometry((1, 1, 9, 11), (1, 1, 3, 4), (2, 3), (2, 1))
    a0, A, b0, B, MH, MW = direct._classes(g)
    assert (a0, A) == (1, 5) and (b0, B) == (0, 4) and (MH, MW) == (2, 2)
    w = np.ones((1, 1, 3, 4), np.float32)
    gx = direct.bprop(np.ones((1, 1, g.oh, g.ow), np.float32), w, (1, 1, 9, 11), (2, 3), (2, 1))
    # with unit weights, gx counts the output positions whose window covers each pixel
    count = np.zeros((9 + 4, 11 + 2))
    for oy in range(g.oh):
        for ox in range(g.ow):
            count[oy * 2:oy * 2 + 3, ox * 3:ox * 3 + 4] += 1
    assert np.array_equal(gx[0, 0], count[2:11, 1:12])


def test_instantiations_match_configs():
    """direct.cu instantiates (for nvcc -cubin) exactly the configurations direct.py can pick."""
    src = (common.KERNEL_DIR / "direct.cu").read_text()
    block = src[src.index("// BEGIN CONFIGS"):src.index("// END CONFIGS")]
    found, sizes = set(), range(1, direct.PLANE_MAX_K + 1)
    for fam, args in re.findall(r"^(\w+)\(([^)]*)\)", block, re.M):
        vals = [a.strip() for a in args.split(",")]
        if fam == "PLANE_CORR_ALL_K":
            found |= {f"plane_corr<{k}, {vals[0]}, {vals[1]}, {vals[2]}>" for k in sizes}
        else:
            found.add(f"{fam.lower()}<{', '.join(vals)}>")
    expected = set()
    for pass_name, cfgs in direct.CONFIGS.items():
        for cfg in cfgs:
            if cfg.family in ("tile", "reg"):
                expected.add(direct.template_name(pass_name, cfg))
            elif cfg.family == "plane":
                expected |= {direct.template_name(pass_name, cfg, k) for k in sizes}
    assert found == expected


NETWORK_LAYERS = {  # full size, batch 128: every pass must have a tiled configuration that fits
    "alexnet.conv1": ((128, 3, 224, 224), (64, 3, 11, 11), (4, 4), (2, 2)),
    "overfeat.conv1": ((128, 3, 231, 231), (96, 3, 11, 11), (4, 4), (0, 0)),
    "alexnet.conv2": ((128, 64, 27, 27), (192, 64, 5, 5), (1, 1), (2, 2)),
    "alexnet.conv3": ((128, 192, 13, 13), (384, 192, 3, 3), (1, 1), (1, 1)),
    "overfeat.conv5": ((128, 1024, 12, 12), (1024, 1024, 3, 3), (1, 1), (1, 1)),
}


@pytest.mark.parametrize("layer", list(NETWORK_LAYERS))
def test_plans_fit_an_h100(layer):
    g = common.geometry(*NETWORK_LAYERS[layer])
    for pass_name in direct.CONFIGS:
        names = direct.candidates(pass_name, g, sms=132, smem_max=227 * 1024)
        assert names[0] == "naive" and any(n.startswith("tile") for n in names), (pass_name, names)
        assert direct.default_config(pass_name, g, names).startswith("tile")
        for n in names[1:]:
            pl = direct_plans._plan_for(pass_name, direct_plans.config_named(pass_name, n), g, 132, 227 * 1024)
            assert 0 < pl.smem <= 227 * 1024 and pl.block[0] <= 1024


def test_single_plane_plans():
    g = common.geometry((1, 1, 8192, 8192), (1, 1, 3, 3), (1, 1), (0, 0))
    assert direct.default_config("fprop", g, direct.candidates("fprop", g)).startswith("plane")
    assert any(n.startswith("plane") for n in direct.candidates("bprop", g))
    g2 = common.geometry((1, 1, 64, 64), (1, 1, 9, 9), (1, 1), (0, 0))   # k > 7: no plane kernel
    assert not any(n.startswith("plane") for n in direct.candidates("fprop", g2))


def test_errors_match_gemm():
    x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
    with pytest.raises(TypeError, match="float32"):
        direct.fprop(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="channel mismatch"):
        direct.fprop(x, np.ones((3, 4, 3, 3), np.float32))
    with pytest.raises(ValueError, match="gy must have shape"):
        direct.bprop(np.ones((1, 3, 4, 4), np.float32), w, x.shape)
    with pytest.raises(ValueError, match="gy must have shape"):
        direct.accgrad(np.ones((1, 3, 4, 4), np.float32), x, w.shape)
    assert not direct.supports((1, 3, 4, 4), (4, 3, 7, 7), (1, 1), (1, 1))
    assert direct.supports((1, 3, 4, 4), (4, 3, 3, 3), (2, 3), (0, 1))
    xt = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # non-contiguous works
    assert np.allclose(direct.fprop(xt, w), direct.fprop(x, w))


# -- GPU: every configuration, forced --------------------------------------------------------------

def _check_configs(case, settings, tol=1e-5):
    import cupy as cp
    settings(direct_poison=True)
    x, w, stride, pad, rng = _data(case, seed=3)
    g = common.geometry(x.shape, w.shape, stride, pad)
    gy = rng.standard_normal((g.S, g.fo, g.oh, g.ow)).astype(np.float32)
    refs = dict(zip(("fprop", "bprop", "accgrad"), conv_reference(x, w, gy, stride, pad)))
    xd, wd, gyd = cp.asarray(x), cp.asarray(w), cp.asarray(gy)
    calls = {
        "fprop": lambda c: direct.fprop(xd, wd, stride, pad, config=c),
        "bprop": lambda c: direct.bprop(gyd, wd, x.shape, stride, pad, config=c),
        "accgrad": lambda c: direct.accgrad(gyd, xd, w.shape, stride, pad, config=c),
    }
    errs = {}
    for pass_name, call in calls.items():
        for name in direct.candidates(pass_name, g, *direct_plans.device_limits(cp.cuda.Device().id)):
            errs[pass_name, name] = rel_error(call(name), refs[pass_name])   # asserts all finite
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{case}: relative error above {tol}: {bad}"
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_every_config_on_gpu(case, settings):
    errs = _check_configs(case, settings)
    assert any(name.startswith("tile") for _, name in errs)


@pytest.mark.gpu
def test_plane_configs_on_gpu(settings):
    errs = _check_configs("single_plane_k7_pad", settings)
    assert {n for p, n in errs if p == "fprop" and n.startswith("plane")} == {
        c.name for c in direct.CONFIGS["fprop"] if c.family == "plane"}


@pytest.mark.gpu
@pytest.mark.parametrize("k", range(1, direct.PLANE_MAX_K + 1))
def test_plane_every_size_on_gpu(k, monkeypatch, settings):
    """Every plane kernel size, with interior blocks (no bounds checks) and edge blocks."""
    import cupy as cp
    settings(direct_poison=True)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((1, 1, 150, 300)).astype(np.float32)
    w = rng.standard_normal((1, 1, k, k)).astype(np.float32)
    pad = (k // 2, (k - 1) // 2)
    g = common.geometry(x.shape, w.shape, (1, 1), pad)
    gy = rng.standard_normal((1, 1, g.oh, g.ow)).astype(np.float32)
    y_ref, gx_ref, _ = conv_reference(x, w, gy, (1, 1), pad)
    for cfg in direct.CONFIGS["fprop"]:
        if cfg.family == "plane":
            y = direct.fprop(cp.asarray(x), cp.asarray(w), (1, 1), pad, config=cfg.name)
            gx = direct.bprop(cp.asarray(gy), cp.asarray(w), x.shape, (1, 1), pad, config=cfg.name)
            assert rel_error(y, y_ref) <= 1e-5 and rel_error(gx, gx_ref) <= 1e-5, cfg.name


@pytest.mark.gpu
def test_tuner_picks_a_checked_config_and_remembers_it(monkeypatch, tmp_path, settings):
    import cupy as cp
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "tune.json"))
    settings(direct_tune="auto")
    x, w, stride, pad, rng = _data("conv3x3_pad1")
    g = common.geometry(x.shape, w.shape, stride, pad)
    # a broken configuration must be rejected by the check against naive
    real = direct._fprop_gpu
    broken = [c.name for c in direct.CONFIGS["fprop"] if c.family == "tile"][0]

    def sabotaged(cfg, x, w, g):
        y = real(cfg, x, w, g)
        return y * 1.01 if cfg.name == broken else y
    monkeypatch.setattr(direct, "_fprop_gpu", sabotaged)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = direct.fprop(cp.asarray(x), cp.asarray(w), stride, pad)
    assert any(broken in str(c.message) for c in caught)
    entry = tuning.default_cache().get(tuning.key(cp, np.float32, g, "fprop", "direct"))
    assert tuning.is_record(entry) and entry["choice"] != broken
    assert broken not in entry["ms"] and "disagrees with naive" in entry["skipped"][broken] and "naive" in entry["ms"]
    y_ref = conv_reference(x, w, np.zeros((g.S, g.fo, g.oh, g.ow)), stride, pad)[0]
    assert rel_error(y, y_ref) <= 1e-5
    tuning._caches.clear()                                       # from the file now, no new tuning
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: pytest.fail("tuned twice"))
    direct.fprop(cp.asarray(x), cp.asarray(w), stride, pad)


def test_the_gpu_tuner_is_the_recipe_against_naive(tmp_path, monkeypatch, settings):
    """_tuned (the GPU path's tuner) on NumPy stand-ins: naive is the reference, a configuration
    that disagrees is skipped with a warning, a hopeless one is timed one round only, and the
    record is remembered (the cache answers the second time)."""
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "tune.json"))
    g = common.geometry((2, 16, 13, 13), (24, 16, 3, 3), (1, 1), (1, 1))
    names = direct.candidates("fprop", g)
    tile, wrong, slow = names[1], names[2], names[3]
    ms = {name: 2.0 for name in names}
    ms.update({"naive": 50.0, tile: 1.0})
    timed, ran = [], []

    def timeit(fn, xp, warmup, repeat):
        fn()
        timed.append(ran[-1])
        return ms[ran[-1]]
    monkeypatch.setattr(tuning, "timeit", timeit)

    def run(cfg):
        ran.append(cfg.name)
        return np.ones(5) * (1.5 if cfg.name == wrong else 1.0)
    with pytest.warns(RuntimeWarning, match=f"{wrong} disagrees with naive"):
        record = direct._tuned(np, "fprop", g, run, names)
    assert ran[0] == "naive" and record["choice"] == tile and wrong in record["skipped"]
    assert timed.count("naive") == 1 and timed.count(tile) == tuning.ROUNDS      # naive: > 3x, one round
    assert timed.count(slow) == tuning.ROUNDS and record["ms"]["naive"] == 50.0
    ran.clear()
    assert direct._tuned(np, "fprop", g, run, names) == record and ran == []


@pytest.mark.gpu
def test_accgrad_is_deterministic():
    import cupy as cp
    x, w, stride, pad, rng = _data("alexnet_conv1_crop")
    g = common.geometry(x.shape, w.shape, stride, pad)
    gy = cp.asarray(rng.standard_normal((g.S, g.fo, g.oh, g.ow)).astype(np.float32))
    for name in direct.candidates("accgrad", g):
        a = direct.accgrad(gy, cp.asarray(x), w.shape, stride, pad, config=name)
        b = direct.accgrad(gy, cp.asarray(x), w.shape, stride, pad, config=name)
        assert cp.array_equal(a, b), name


@pytest.mark.gpu
def test_unknown_or_unfitting_config_is_a_clear_error():
    import cupy as cp
    x = cp.ones((1, 1, 9, 9), cp.float32)
    w = cp.ones((1, 1, 9, 9), cp.float32)
    with pytest.raises(ValueError, match="unknown direct fprop config"):
        direct.fprop(x, w, config="nope")
    with pytest.raises(ValueError, match="does not fit"):
        direct.fprop(x, w, config=[c.name for c in direct.CONFIGS["fprop"] if c.family == "plane"][0])
    assert to_device(direct.fprop(x, w, config="naive"), "cpu").item() == 81.0


# -- correlate1d: the 1-D case (kernels/correlate1d.cu) ------------------------------------------

# (batch shape, L, K): chunked masks (K > 1024 taps per chunk), K not a multiple of any OUT,
# K = 1 and K = L, signals shorter than one block's tile, several signals.
CORRELATE1D_CASES = [((), 5000, 2047), ((3,), 700, 1), ((2,), 333, 333), ((), 4099, 1031),
                     ((2, 2), 1500, 37), ((), 20, 7)]


def _correlate1d_reference(x, mask):
    """float64, NumPy's own correlate row by row (not the code under test)."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.stack([np.correlate(r, mask.astype(np.float64), "valid") for r in rows])
    return out.reshape(x.shape[:-1] + (out.shape[-1],))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,L,K", CORRELATE1D_CASES)
def test_correlate1d_against_float64(batch, L, K, device):
    rng = np.random.default_rng(L + K)
    x = rng.standard_normal(batch + (L,)).astype(np.float32)
    mask = rng.standard_normal(K).astype(np.float32)
    ref = _correlate1d_reference(x, mask)
    if device == "cpu":
        outs = {"numpy": correlate1d.correlate1d(x, mask)}
    else:
        import cupy as cp
        xd, md = cp.asarray(x), cp.asarray(mask)
        outs = {cfg: cp.asnumpy(correlate1d.correlate1d(xd, md, config=cfg)) for cfg in correlate1d.CONFIGS}
        outs["tuned"] = cp.asnumpy(correlate1d.correlate1d(xd, md))
    for name, y in outs.items():
        assert y.shape == ref.shape, name
        assert rel_error(y, ref) <= 1e-5, (name, rel_error(y, ref))


@pytest.mark.gpu
def test_correlate1d_never_multiplies_inputs_past_the_mask(monkeypatch, settings):
    """The last mask chunk rounds up to whole register groups; the taps past K must be skipped,
    not multiplied by 0: an inf that only the last output reaches stays in the last output."""
    import cupy as cp
    settings(direct_poison=True)
    L, K = 3000, 1030                 # every OUT leaves a partial group in the last chunk
    x = np.random.default_rng(0).standard_normal(L).astype(np.float32)
    x[-1] = np.inf
    mask = np.ones(K, np.float32)
    for cfg in correlate1d.CONFIGS:
        y = cp.asnumpy(correlate1d.correlate1d(cp.asarray(x), cp.asarray(mask), config=cfg))
        assert np.isfinite(y[:-1]).all() and np.isposinf(y[-1]), cfg


def test_correlate1d_errors():
    x, m = np.zeros(10, np.float32), np.ones(3, np.float32)
    with pytest.raises(ValueError, match="mask length K = 11 must be between 1 and the signal length L = 10"):
        correlate1d.correlate1d(x, np.ones(11, np.float32))
    with pytest.raises(ValueError, match="mask"):
        correlate1d.correlate1d(x, np.ones((1, 3), np.float32))
    with pytest.raises(TypeError, match="float32"):
        correlate1d.correlate1d(x.astype(np.float64), m)
    with pytest.raises(ValueError, match="mask length K = 0"):
        correlate1d.correlate1d(x, np.ones(0, np.float32))


def test_correlate1d_instantiations_match_configs():
    src = (common.KERNEL_DIR / "correlate1d.cu").read_text()
    block = src[src.index("// BEGIN CONFIGS"):src.index("// END CONFIGS")]
    found = {tuple(int(v) for v in args.split(",")) for args in re.findall(r"^CORRELATE1D\(([^)]*)\)", block, re.M)}
    assert found == set(correlate1d.CONFIGS)
    assert all(out % 2 == 1 for out, _ in found)        # the kernel's bank-conflict argument
