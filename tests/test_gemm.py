"""The gemm backend's three passes against PyTorch float64, over many random geometries."""
import ctypes
import re
import types

import numpy as np
import pytest

from minitorch_fft import backends
from minitorch_fft.backends import gemm, layout
from minitorch_fft.backends.common import KERNEL_DIR, batch_slices
from conftest import DEVICES, host_library
from minitorch_fft.device import to_device
from reference import check_backend, conv_reference, rel_error


def random_geometry(rng):
    """Strides, paddings, rectangular kernels and inputs, batch 1 and single channels included."""
    kh, kw = rng.integers(1, 8, 2)
    sh, sw = rng.integers(1, 5, 2)
    ph, pw = rng.integers(0, 4, 2)
    h = int(rng.integers(max(1, kh - 2 * ph), 20))
    w = int(rng.integers(max(1, kw - 2 * pw), 20))
    S, f, fo = rng.choice([1, 2, 3]), rng.choice([1, 2, 5]), rng.choice([1, 3, 4])
    return (S, f, h, w), (fo, f, kh, kw), (int(sh), int(sw)), (int(ph), int(pw))


@pytest.mark.parametrize("device,n", [("cpu", 60), pytest.param("cuda", 300, marks=pytest.mark.gpu)])
def test_random_geometries(device, n):
    rng = np.random.default_rng(2024)
    worst = 0.0
    for _ in range(n):
        xs, ws, stride, pad = random_geometry(rng)
        x = rng.standard_normal(xs).astype(np.float32)
        w = rng.standard_normal(ws).astype(np.float32)
        worst = max(worst, *check_backend(gemm, x, w, stride, pad, device=device, rng=rng).values())
    assert worst <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_network_layers(device):
    """AlexNet's strided conv1 and a 3x3 layer, at small batch."""
    rng = np.random.default_rng(5)
    for xs, ws, stride, pad in [((2, 3, 59, 59), (8, 3, 11, 11), (4, 4), (2, 2)),
                                ((2, 16, 13, 13), (24, 16, 3, 3), (1, 1), (1, 1))]:
        x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
        check_backend(gemm, x, w, stride, pad, device=device, rng=rng)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_chunking_gives_the_same_answer(device, monkeypatch, settings):
    """A workspace smaller than one batch forces chunks (here: one image each)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 3, 10, 10)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    settings(gemm_workspace_mb=2**-20)
    g = backends.geometry(x.shape, w.shape, (1, 1), (1, 1))
    assert len(gemm._batch_chunks(g)) == 5
    check_backend(gemm, x, w, (1, 1), (1, 1), device=device, rng=rng)


def test_each_pass_stays_within_its_workspace_on_the_cpu(settings):
    """The workspace bound counts everything a chunk holds beside the pass's output: the column
    matrix and the (f', n*oh*ow) matrix (fprop's product before its transpose, the gy matrix of
    bprop and accGrad). Measured by tracemalloc (NumPy's allocations), each pass's peak beyond
    its output stays within gemm_workspace_mb; a column-matrix-only count went over by the gy
    matrix. The answers are checked against float64 too."""
    import tracemalloc
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 6, 20, 20)).astype(np.float32)
    w = rng.standard_normal((32, 6, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((12, 32, 18, 18)).astype(np.float32)
    per_image = (6 * 9 + 32) * 18 * 18 * 4                  # columns and the f' matrix, one image
    settings(gemm_workspace_mb=3.5 * per_image / 2**20)     # 3 images a chunk: 4 chunks
    g = backends.geometry(x.shape, w.shape, (1, 1), (0, 0))
    assert [sl.stop - sl.start for sl in gemm._batch_chunks(g)] == [3, 3, 3, 3]
    for name, call in (("fprop", lambda: gemm.fprop(x, w)), ("bprop", lambda: gemm.bprop(gy, w, x.shape)),
                       ("accgrad", lambda: gemm.accgrad(gy, x, w.shape))):
        tracemalloc.start()
        try:
            out = call()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak - out.nbytes <= 3.5 * per_image, name
    check_backend(gemm, x, w, (1, 1), (0, 0), device="cpu", rng=rng)


def test_chunks_are_as_few_as_the_workspace_allows_and_even(settings):
    """The batch is split into the fewest chunks the workspace allows, of sizes within one image
    of each other: the largest chunk, which sets the step's peak, is as small as that count
    allows (AlexNet b128's conv1 accGrad: 103 images a chunk fit, so 64 + 64, not 103 + 25)."""
    for S, fit in [(128, 103), (13, 3), (12, 3), (5, 1), (7, 7), (7, 100), (1, 1)]:
        g = backends.geometry((S, 3, 12, 12), (4, 3, 3, 3), (1, 1), (0, 0))
        per_image = (3 * 9 + 4) * 10 * 10 * 4
        settings(gemm_workspace_mb=(fit + 0.5) * per_image / 2**20)
        chunks = gemm._batch_chunks(g)
        sizes = [sl.stop - sl.start for sl in chunks]
        assert chunks[0].start == 0 and chunks[-1].stop == S and all(
            a.stop == b.start for a, b in zip(chunks, chunks[1:]))            # the batch, once, in order
        assert len(sizes) == -(-S // min(fit, S)) and max(sizes) - min(sizes) <= 1 and max(sizes) <= fit


def test_registry():
    assert "gemm" in backends.names()
    assert backends.get("gemm") is gemm
    assert backends.choose("auto", "fprop", (1, 1, 5, 5), (1, 1, 3, 3)) is gemm
    with pytest.raises(ValueError, match="unknown convolution backend 'nope'"):
        backends.get("nope")
    with pytest.raises(ValueError, match="unknown pass"):
        backends.choose("gemm", "forward", (1, 1, 5, 5), (1, 1, 3, 3))


@pytest.mark.parametrize("x_shape,w_shape,stride,pad,msg", [
    ((1, 3, 8, 8), (4, 2, 3, 3), 1, 0, "channel mismatch"),
    ((3, 8, 8), (4, 3, 3, 3), 1, 0, "4-D"),
    ((1, 3, 4, 4), (4, 3, 7, 7), 1, 1, "larger than the padded input"),
    ((0, 3, 8, 8), (4, 3, 3, 3), 1, 0, "zero-size"),
    ((1, 3, 8, 8), (4, 3, 3, 3), 0, 0, "stride must be >= 1"),
    ((1, 3, 8, 8), (4, 3, 3, 3), 1, -1, "padding must be >= 0"),
])
def test_bad_geometry_is_a_clear_error(x_shape, w_shape, stride, pad, msg):
    x = np.zeros(x_shape, np.float32) if min(x_shape) > 0 else np.zeros(x_shape, np.float32)
    with pytest.raises(ValueError, match=msg):
        gemm.fprop(x, np.ones(w_shape, np.float32), stride=(stride, stride), padding=(pad, pad))
    assert not gemm.supports(x_shape, w_shape, (stride, stride), (pad, pad))


def test_dtype_and_gradient_shape_errors():
    x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
    with pytest.raises(TypeError, match="float32"):
        gemm.fprop(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="gy must have shape"):
        gemm.bprop(np.ones((1, 3, 4, 4), np.float32), w, x.shape)
    # non-contiguous inputs work
    xt = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    assert np.allclose(gemm.fprop(xt, w), gemm.fprop(x, w))


# -- 1x1 kernels: GEMMs on the (f, h*w) planes, no im2col ---------------------------------------

POINTWISE = [((3, 5, 7, 9), (4, 5, 1, 1), (1, 1)),    # odd planes, stride 1
             ((3, 5, 7, 9), (4, 5, 1, 1), (2, 2)),    # stride 2 on odd planes: the last row/col taken
             ((2, 6, 8, 5), (3, 6, 1, 1), (2, 3)),    # unequal strides
             ((2, 40, 3, 3), (40, 40, 1, 1), (1, 1)),  # f' f > 1.5 P (f' + f): accGrad through one GEMM
             ((2, 40, 5, 5), (40, 40, 1, 1), (2, 2)),
             ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("xs,ws,stride", POINTWISE)
def test_pointwise_kernels_match_float64(device, xs, ws, stride, monkeypatch):
    """All three passes on the GEMM-only path: im2col and col2im are never called (until session
    12 bprop and accGrad went through them, which this test, then without the trap, let pass)."""
    rng = np.random.default_rng(11)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    assert gemm._pointwise(backends.geometry(xs, ws, stride, (0, 0)))

    def trap(*args):
        raise AssertionError("a 1x1 kernel without padding went through im2col/col2im")
    monkeypatch.setattr(gemm, "_im2col", trap)
    monkeypatch.setattr(gemm, "_col2im", trap)
    check_backend(gemm, x, w, stride, (0, 0), device=device, rng=rng)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", gemm.FORMS)
@pytest.mark.parametrize("xs,ws,stride", POINTWISE)
def test_pointwise_forms_match_float64(device, form, xs, ws, stride, monkeypatch, settings):
    """Each 1x1 form, forced on every pass, whole batch and one image a chunk."""
    rng = np.random.default_rng(13)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    monkeypatch.setattr(gemm, "_form", lambda xp, pass_name, g, run, forms=None: form)
    check_backend(gemm, x, w, stride, (0, 0), device=device, rng=rng)
    settings(gemm_workspace_mb=2**-20)
    check_backend(gemm, x, w, stride, (0, 0), device=device, rng=rng)


NHWC_CASES = POINTWISE + [((4, 8, 6, 6), (16, 8, 1, 1), (1, 1))]   # f' f = 128 <= NHWC_PARTIALS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", gemm.FORMS)
@pytest.mark.parametrize("xs,ws,stride", NHWC_CASES)
def test_channels_last_pointwise_passes_match_float64(device, form, xs, ws, stride, monkeypatch, settings):
    """The channels-last 1x1 passes (auto's "gemm" route: fprop_nhwc, bprop_nhwc, accgrad_nhwc) on
    NHWC arrays give NHWC results equal to float64, accGrad in each form, whole batch and one image a
    chunk; the NHWC operands are taken as they are (no layout copy), the weight in either layout."""
    rng = np.random.default_rng(17)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    S, fo = xs[0], ws[0]
    oh, ow = (xs[2] - 1) // stride[0] + 1, (xs[3] - 1) // stride[1] + 1
    gy = rng.standard_normal((S, fo, oh, ow)).astype(np.float32)
    y_ref, gx_ref, gw_ref = conv_reference(x, w, gy, stride, (0, 0))
    xd, gyd = (layout.to_nhwc(to_device(a, device)) for a in (x, gy))
    weights = (to_device(w, device), layout.to_nhwc(to_device(w, device)))
    monkeypatch.setattr(gemm, "_form", lambda xp, pass_name, g, run, forms=None, default=None: form)
    copies, real = [], layout.to_nhwc

    def to_nhwc(a):
        out = real(a)
        if out is not a:
            copies.append(a.shape)
        return out
    monkeypatch.setattr(layout, "to_nhwc", to_nhwc)
    for chunked in (False, True):
        if chunked:
            settings(gemm_workspace_mb=2**-20)
        for wl in weights:
            y = gemm.fprop_nhwc(xd, wl, stride)
            gx = gemm.bprop_nhwc(gyd, wl, xs, stride)
            gw = gemm.accgrad_nhwc(gyd, xd, ws, stride)
            assert all(a.transpose(0, 2, 3, 1).flags.c_contiguous for a in (y, gx))
            assert gw.shape == ws
            for got, ref in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
                assert rel_error(got, ref) <= 1e-5
    assert copies == []


@pytest.mark.parametrize("device,n", [("cpu", 40), pytest.param("cuda", 80, marks=pytest.mark.gpu)])
def test_channels_last_pointwise_passes_on_random_geometries(device, n):
    """fprop_nhwc, bprop_nhwc and accgrad_nhwc against float64 on random 1x1 geometries: strides 1-4
    (unequal), batch 1 and single planes included, accGrad in its tuned or default form."""
    rng = np.random.default_rng(2046)
    worst = 0.0
    for _ in range(n):
        S, f, fo = (int(v) for v in rng.integers(1, [5, 9, 9]))
        h, w = (int(v) for v in rng.integers(1, 20, 2))
        stride = tuple(int(v) for v in rng.integers(1, 5, 2))
        x = rng.standard_normal((S, f, h, w)).astype(np.float32)
        wt = rng.standard_normal((fo, f, 1, 1)).astype(np.float32)
        oh, ow = (h - 1) // stride[0] + 1, (w - 1) // stride[1] + 1
        gy = rng.standard_normal((S, fo, oh, ow)).astype(np.float32)
        refs = conv_reference(x, wt, gy, stride, (0, 0))
        xd, gyd = (layout.to_nhwc(to_device(a, device)) for a in (x, gy))
        wd = to_device(wt, device)
        got = (gemm.fprop_nhwc(xd, wd, stride), gemm.bprop_nhwc(gyd, wd, x.shape, stride),
               gemm.accgrad_nhwc(gyd, xd, wt.shape, stride))
        worst = max(worst, *(rel_error(a, r) for a, r in zip(got, refs)))
    assert worst <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", gemm.FORMS)
@pytest.mark.parametrize("stride", [(1, 1), (2, 1)], ids=["s1", "s2x1"])
def test_pointwise_passes_cut_the_batch_at_cublas_int_sizes(monkeypatch, device, form, stride):
    """A GEMM's rows or K are a chunk's n*oh*ow pixels: with GEMM_DIM lowered to two images' pixels and a
    half (cuBLAS's 2^31 - 1 in earnest), every 1x1 pass, channels-last and NCHW, each in `form` (forced),
    cuts a batch of 5 into chunks of 2 images at most and still agrees with float64; an image of more
    pixels than that is refused by name; prepare_nhwc leaves a batch past it to the chunked full path
    and prepares one under it."""
    rng = np.random.default_rng(31)
    S, f, fo, h, w = 5, 6, 4, 8, 6
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, 1, 1)).astype(np.float32)
    oh, ow = (h - 1) // stride[0] + 1, (w - 1) // stride[1] + 1
    gy = rng.standard_normal((S, fo, oh, ow)).astype(np.float32)
    refs = conv_reference(x, wt, gy, stride, (0, 0))
    monkeypatch.setattr(gemm, "GEMM_DIM", 2 * oh * ow + oh * ow // 2)
    monkeypatch.setattr(gemm, "_form", lambda xp, pass_name, g, run, forms=None, default=None: form)
    rows = []
    real = backends.cgemm.matmul
    monkeypatch.setattr(backends.cgemm, "matmul", lambda xp, a, b, **k: rows.append((a.shape, b.shape)) or
                        real(xp, a, b, **k))
    xd, gyd, wd = (to_device(a, device) for a in (x, gy, wt))
    xl, gyl = layout.to_nhwc(xd), layout.to_nhwc(gyd)
    g = backends.geometry(x.shape, wt.shape, stride, (0, 0))
    xp = np if device == "cpu" else __import__("cupy")
    runs = [(gemm.fprop_nhwc(xl, wd, stride), gemm.bprop_nhwc(gyl, wd, x.shape, stride),
             gemm.accgrad_nhwc(gyl, xl, wt.shape, stride))]
    runs += [(gemm._fprop_1x1(xp, xd, wd, g), gemm._bprop_1x1(xp, gyd, wd, g), gemm._accgrad_1x1(xp, gyd, xd, g))]
    for got in runs:
        for a, r in zip(got, refs):
            assert rel_error(a, r) <= 1e-5
    assert all(max(a + b) <= gemm.GEMM_DIM for a, b in rows), rows           # 5 images' pixels in none
    assert any(2 * oh * ow in a + b for a, b in rows), rows                    # two images' in some
    dense = backends.geometry(x.shape, wt.shape, (1, 1), (0, 0))
    assert gemm.prepare_nhwc("fprop", dense, object()) is None             # 5 images' pixels: past it
    monkeypatch.setattr(gemm, "GEMM_DIM", S * h * w)
    assert callable(gemm.prepare_nhwc("fprop", dense, object()))           # at it: one GEMM
    monkeypatch.setattr(gemm, "GEMM_DIM", oh * ow - 1)
    with pytest.raises(ValueError, match=f"one image's {oh}x{ow} output pixels exceed a GEMM's {oh * ow - 1} rows"):
        gemm.fprop_nhwc(xl, wd, stride)


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_pointwise_passes_take_other_layouts_and_refuse_other_kernels(device):
    """An NCHW operand is laid out channels-last first (a copy), with the same result; a kernel other than
    1x1 without padding is refused before any work, naming the limit."""
    rng = np.random.default_rng(19)
    x, w = rng.standard_normal((2, 6, 5, 4)).astype(np.float32), rng.standard_normal((3, 6, 1, 1)).astype(np.float32)
    y_ref, _, _ = conv_reference(x, w, np.zeros((2, 3, 5, 4)), (1, 1), (0, 0))
    y = gemm.fprop_nhwc(to_device(x, device), to_device(w, device))
    assert y.transpose(0, 2, 3, 1).flags.c_contiguous and rel_error(y, y_ref) <= 1e-5
    assert gemm.nhwc_supports(x.shape, w.shape, (2, 2)) and not gemm.nhwc_supports(x.shape, w.shape, (1, 1), (1, 1))
    with pytest.raises(ValueError, match="1x1 kernels without padding"):
        gemm.fprop_nhwc(to_device(x, device), to_device(w, device), padding=(1, 1))
    w3 = to_device(rng.standard_normal((3, 6, 3, 3)).astype(np.float32), device)
    assert not gemm.nhwc_supports(x.shape, w3.shape)
    with pytest.raises(ValueError, match="1x1 kernels without padding"):
        gemm.fprop_nhwc(to_device(x, device), w3)
    with pytest.raises(TypeError, match="float32"):
        gemm.fprop_nhwc(to_device(x.astype(np.float64), device), to_device(w, device))


def test_channels_last_pointwise_passes_stay_strict_and_flat_past_the_partials_bound(monkeypatch, settings):
    """Every GEMM of the channels-last 1x1 passes asks for strict fp32, TF32 mode or not (gemm's GEMMs
    are strict in both); where f' f is above NHWC_PARTIALS accGrad takes the flat form without asking
    _form (no per-image partials to tune); prepare_nhwc has no NumPy form."""
    rng = np.random.default_rng(23)
    xs, ws = (3, 6, 5, 4), (5, 6, 1, 1)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    gy = rng.standard_normal((3, 5, 5, 4)).astype(np.float32)
    y_ref, gx_ref, gw_ref = conv_reference(x, w, gy, (1, 1), (0, 0))
    strict, real = [], gemm.cgemm.matmul
    monkeypatch.setattr(gemm.cgemm, "matmul", lambda *a, **k: strict.append(k.get("strict")) or real(*a, **k))
    monkeypatch.setattr(gemm, "NHWC_PARTIALS", ws[0] * ws[1] - 1)

    def no_form(*args, **kwargs):
        raise AssertionError("accGrad's form asked for above NHWC_PARTIALS")
    monkeypatch.setattr(gemm, "_form", no_form)
    settings(tf32=True)
    xd, gyd = layout.to_nhwc(x), layout.to_nhwc(gy)
    for got, ref in ((gemm.fprop_nhwc(xd, w), y_ref), (gemm.bprop_nhwc(gyd, w, xs), gx_ref),
                     (gemm.accgrad_nhwc(gyd, xd, ws), gw_ref)):
        assert rel_error(got, ref) <= 1e-5
    assert strict == [True, True, True]
    g = backends.geometry(xs, ws, (1, 1), (0, 0))
    assert all(gemm.prepare_nhwc(p, g, np) is None for p in ("fprop", "bprop", "accgrad"))


ACCGRAD_FORM_CASES = [((2, 3, 11, 9), (5, 3, 3, 3), (1, 1), (1, 1)),   # few planes; accgrad_small: 14 threads
                      ((3, 4, 10, 12), (6, 4, 5, 3), (2, 1), (2, 0)),   # strided, rectangular, padded
                      ((1, 2, 7, 7), (3, 2, 7, 7), (1, 1), (0, 0)),     # batch 1, kernel = plane
                      ((2, 3, 30, 26), (64, 3, 7, 7), (2, 2), (3, 3)),  # ResNet's conv1: 592-thread blocks
                      ((3, 3, 16, 8), (6, 3, 3, 3), (1, 1), (1, 1))]    # oh*ow = 128: whole tiles


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", gemm.FORMS + tuple(gemm.IMPLICIT))
@pytest.mark.parametrize("xs,ws,stride,padding", ACCGRAD_FORM_CASES)
def test_accgrad_forms_match_float64(device, form, xs, ws, stride, padding, monkeypatch, settings):
    """accGrad's flat GEMM, its per-image products (im2col image by image) and its implicit forms
    (partial gradients over chunks of output positions that cross images, no column matrix; 4 or 8
    outputs a thread),
    whole batch and one image a chunk; fprop and bprop are unchanged by the form."""
    rng = np.random.default_rng(15)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    monkeypatch.setattr(gemm, "_form", lambda xp, pass_name, g, run, forms=None: form)
    check_backend(gemm, x, w, stride, padding, device=device, rng=rng)
    settings(gemm_workspace_mb=2**-20)
    check_backend(gemm, x, w, stride, padding, device=device, rng=rng)


ROWS_CASES = [((2, 3, 11, 9), (5, 3, 3, 3), (1, 1), (1, 1)),       # partial tiles (tp 12 > ow 9), 4 groups
              ((3, 3, 16, 8), (6, 3, 3, 3), (1, 1), (1, 1)),       # whole tiles
              ((2, 3, 20, 56), (64, 3, 3, 3), (1, 1), (1, 1)),     # VGG-16 conv1_1's block: 96 threads, tp 56
              ((2, 3, 12, 150), (10, 3, 3, 3), (1, 1), (1, 1)),    # 5 tiles a row, the last partial
              ((3, 4, 10, 12), (6, 4, 3, 3), (2, 1), (1, 0)),      # row stride 2, no column padding
              ((2, 3, 30, 26), (64, 3, 7, 7), (2, 2), (3, 3)),     # ResNet's conv1: 2 groups of 168 threads
              ((1, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3)),   # ResNet's conv1 whole: 2 tiles a row, > 48 KiB
              ((2, 3, 35, 31), (8, 3, 11, 11), (4, 4), (2, 2)),    # AlexNet's conv1 kernel: 4 groups of 33
              ((1, 3, 67, 67), (64, 3, 11, 11), (4, 4), (2, 2))]   # AlexNet's conv1 block: 1 group of 264


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("xs,ws,stride,padding", ROWS_CASES)
def test_accgrad_rows_form_matches_float64(device, xs, ws, stride, padding, monkeypatch):
    """The rows form (tiles of one output row, each thread a window of kernel taps sliding along
    it), forced on accGrad: its plan for each case, and the three passes against float64."""
    g = backends.geometry(xs, ws, stride, padding)
    name, group, groups, tp, tiles_row, smem = gemm._rows_plan(g)
    assert name == gemm.ROWS[(ws[3], stride[1])][0] and group * groups <= 512 and tp % groups == 0
    assert tiles_row * tp >= g.ow and (tiles_row - 1) * tp < g.ow
    rng = np.random.default_rng(17)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    monkeypatch.setattr(gemm, "_form", lambda xp, pass_name, g, run, forms=None: "rows")
    check_backend(gemm, x, w, stride, padding, device=device, rng=rng)


def test_accgrad_rows_form_takes_only_its_kernels():
    """The rows form is offered for the (kernel width, stride) pairs it has kernels for, with the
    kernel rows a thread dividing kh, and two buffers within ROWS_SMEM (96 KiB) of shared memory."""
    plan = lambda xs, ws, s, p: gemm._rows_plan(backends.geometry(xs, ws, s, p))
    assert plan((64, 3, 224, 224), (64, 3, 3, 3), (1, 1), (1, 1))[1:4] == (24, 4, 56)
    assert plan((128, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3))[1:4] == (168, 2, 56)
    assert plan((128, 3, 224, 224), (64, 3, 11, 11), (4, 4), (2, 2))[1:4] == (264, 1, 55)
    assert plan((8, 3, 32, 32), (8, 3, 5, 3), (1, 1), (1, 1)) is None        # kh 5: not 3 rows a thread
    assert plan((8, 3, 32, 32), (8, 3, 5, 5), (1, 1), (1, 1)) is None        # no 5-wide kernel
    assert plan((8, 64, 224, 224), (64, 64, 3, 3), (1, 1), (1, 1)) is None   # 192 input rows: > 96 KiB


@pytest.mark.parametrize("device", DEVICES)
def test_im2col_image_by_image_is_the_columns_regrouped(device):
    xp = np if device == "cpu" else pytest.importorskip("cupy")
    g = backends.geometry((3, 2, 6, 5), (4, 2, 3, 2), (2, 1), (1, 1))
    x = xp.asarray(np.random.default_rng(16).standard_normal((3, 2, 6, 5)).astype(np.float32))
    host = (lambda a: a) if xp is np else xp.asnumpy
    flat = host(gemm._im2col(xp, x, g))                             # (K, S*P)
    stacked = host(gemm._im2col(xp, x, g, per_image=True))          # (S, K, P)
    K, P = 2 * 3 * 2, g.oh * g.ow
    assert stacked.shape == (3, K, P)
    np.testing.assert_array_equal(stacked, flat.reshape(K, 3, P).transpose(1, 0, 2))


def test_accgrad_tunes_the_implicit_form_where_its_block_fits(settings, tmp_path):
    """The implicit form is a candidate only where accgrad_small's block fits (1024 threads, 48 KiB
    of tiles): VGG-16's conv1_1 and ResNet's conv1, not a 512 x 4608 gradient. Each candidate the
    geometry takes is timed."""
    from minitorch_fft.backends import tuning
    fits = lambda xs, ws, s, p: gemm._implicit_fits(backends.geometry(xs, ws, s, p))
    assert fits((64, 3, 224, 224), (64, 3, 3, 3), (1, 1), (1, 1)) and fits((128, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3))
    assert not fits((8, 512, 14, 14), (512, 512, 3, 3), (1, 1), (1, 1))
    settings(gemm_tune="on", tune_cache=str(tmp_path / "t.json"))
    rng = np.random.default_rng(17)
    x, w = rng.standard_normal((2, 3, 9, 9)).astype(np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((2, 4, 9, 9)).astype(np.float32)
    gemm.accgrad(gy, x, w.shape, (1, 1), (1, 1))
    g = backends.geometry(x.shape, w.shape, (1, 1), (1, 1))
    record = tuning.default_cache().get(gemm.form_key(np, "accgrad", g))
    assert set(record["ms"]) == {"per_image", "flat", "implicit", "implicit8", "rows"}   # 3x3 s1: rows too
    # 8 outputs a thread halve ResNet conv1's block (592 -> 296 threads)
    assert gemm._implicit_block(backends.geometry((128, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3)), "implicit8")[:2] == (37, 8)


def test_the_untuned_form_rule():
    form = lambda xs, ws, s, p, pass_name: gemm._form(np, pass_name, backends.geometry(xs, ws, s, p), None)
    assert form((64, 3, 224, 224), (64, 3, 3, 3), (1, 1), (1, 1), "accgrad") == "per_image"    # 64 x 27
    assert form((8, 256, 14, 14), (256, 256, 3, 3), (1, 1), (1, 1), "accgrad") == "flat"       # 256 x 2304
    assert form((8, 64, 56, 56), (256, 64, 1, 1), (1, 1), (0, 0), "bprop") == "per_image"


def test_pointwise_form_is_tuned_where_gemm_tune_tunes(settings, tmp_path):
    """gemm_tune on (the CPU here): both forms timed, the choice cached under gemm.form_key;
    off: the rule's default, nothing cached."""
    from minitorch_fft.backends import tuning
    settings(gemm_tune="on", tune_cache=str(tmp_path / "t.json"))
    rng = np.random.default_rng(14)
    x, w = rng.standard_normal((2, 6, 7, 7)).astype(np.float32), rng.standard_normal((5, 6, 1, 1)).astype(np.float32)
    gemm.fprop(x, w)
    g = backends.geometry(x.shape, w.shape, (1, 1), (0, 0))
    record = tuning.default_cache().get(gemm.form_key(np, "fprop", g))
    assert record["choice"] in gemm.FORMS and set(record["ms"]) == set(gemm.FORMS)
    settings(gemm_tune="off", tune_cache=str(tmp_path / "u.json"))
    assert gemm._form(np, "fprop", g, lambda form: pytest.fail("ran a form while untuned")) == "per_image"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stride", [(1, 1), (2, 2)])
def test_pointwise_chunked_gives_the_same_answer(device, stride, settings):
    """A workspace of one image at a time for the stride's gather and accGrad's partials."""
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal((4, 6, 9, 9)).astype(np.float32), rng.standard_normal((5, 6, 1, 1)).astype(np.float32)
    settings(gemm_workspace_mb=2**-20)
    assert len(gemm._image_chunks(backends.geometry(x.shape, w.shape, stride, (0, 0)), 4)) == 4
    check_backend(gemm, x, w, stride, (0, 0), device=device, rng=rng)


def test_pointwise_path_is_taken_only_without_padding():
    assert not gemm._pointwise(backends.geometry((1, 2, 5, 5), (3, 2, 1, 1), (1, 1), (1, 1)))
    assert not gemm._pointwise(backends.geometry((1, 2, 5, 5), (3, 2, 1, 3), (1, 1), (0, 0)))


# -- the fused forms of the strided 1x1 fprop and bprop (kernels/pointwise.cu) ---------------------

RESNET_SHORTCUTS = [((128, 64, 56, 56), (128, 64, 1, 1)),      # 64 -> 128 56x56 s2
                    ((128, 128, 28, 28), (256, 128, 1, 1)),    # 128 -> 256 28x28 s2
                    ((128, 256, 14, 14), (512, 256, 1, 1))]    # 256 -> 512 14x14 s2
FUSED_EDGES = [((2, 24, 9, 11), (40, 24, 1, 1), (2, 2)),     # f' < a tile, 60 pixels: one partial tile
               ((3, 72, 13, 13), (136, 72, 1, 1), (2, 2)),   # f' 136: a partial row tile; 147 pixels
               ((1, 16, 7, 7), (8, 16, 1, 1), (2, 2)),       # batch 1, odd planes (clipped cells)
               ((2, 20, 10, 9), (70, 20, 1, 1), (2, 1)),     # stride (2, 1): cells of one column
               ((2, 13, 9, 10), (17, 13, 1, 1), (2, 2)),     # f, f' not multiples of 8: A padded; pairs
               ((2, 12, 6, 10), (9, 12, 1, 1), (1, 2)),      # stride (1, 2), even rows: pairs
               ((2, 8, 10, 10), (6, 8, 1, 1), (3, 3)),       # stride 3: cells clipped at the edge
               ((2, 64, 14, 14), (128, 64, 1, 1), (2, 2))]   # a ResNet shortcut, two images


def fused_reference(w, x, stride):
    """fprop's y in float64, NumPy or CuPy as x is."""
    xp = np if isinstance(x, np.ndarray) else pytest.importorskip("cupy")
    taps = x[:, :, ::stride[0], ::stride[1]].astype(np.float64)
    return xp.einsum("oc,nchw->nohw", w[:, :, 0, 0].astype(np.float64), taps)


def fused_bprop_reference(w, gy, x_shape, stride):
    """bprop's gx in float64 from gy: W^T gy at the strided pixels, zeros between them."""
    xp = np if isinstance(gy, np.ndarray) else pytest.importorskip("cupy")
    gx = xp.zeros(x_shape, dtype=np.float64)
    gx[:, :, ::stride[0], ::stride[1]] = xp.einsum("oc,nohw->nchw", w[:, :, 0, 0].astype(np.float64),
                                                   gy.astype(np.float64))
    return gx


def fused_operands(rng, xs, ws, stride):
    g = backends.geometry(xs, ws, stride, (0, 0))
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    gy = rng.standard_normal((g.S, g.fo, g.oh, g.ow)).astype(np.float32)
    return g, x, w, gy


def test_fused_forms_are_offered_for_strided_pointwise_on_the_gpu(monkeypatch):
    """fused and fused64 join per_image and flat for strided 1x1 fprop and bprop on the GPU (any
    array module but NumPy); never on the CPU, nor for stride 1, nor for accGrad (not asked)."""
    gpu = types.SimpleNamespace()                                   # stands in for cupy
    strided = backends.geometry((4, 64, 56, 56), (128, 64, 1, 1), (2, 2), (0, 0))
    plain = backends.geometry((4, 64, 56, 56), (128, 64, 1, 1), (1, 1), (0, 0))
    assert gemm._pointwise_forms(gpu, strided) == ("per_image", "flat", "fused", "fused64")
    assert gemm._pointwise_forms(np, strided) == gemm.FORMS
    assert gemm._pointwise_forms(gpu, plain) == gemm.FORMS
    asked = []
    monkeypatch.setattr(gemm, "_form", lambda xp, pass_name, g, run, forms=gemm.FORMS:
                        asked.append((pass_name, forms)) or "per_image")
    x, w = np.ones((1, 4, 6, 6), np.float32), np.ones((3, 4, 1, 1), np.float32)
    gemm.fprop(x, w, (2, 2))
    gemm.bprop(np.ones((1, 3, 3, 3), np.float32), w, x.shape, (2, 2))
    assert asked == [("fprop", gemm.FORMS), ("bprop", gemm.FORMS)]   # the CPU: the GEMM forms only


def test_fused_forms_bump_the_strided_revisions():
    """auto times gemm's strided 1x1 fprop and bprop again (their form records too, form_key)."""
    g = backends.geometry((2, 8, 5, 5), (4, 8, 1, 1), (2, 2), (0, 0))
    assert [gemm._revision(p, g) for p in ("fprop", "bprop", "accgrad")] == [4, 6, 3]
    one = backends.geometry((2, 8, 5, 5), (4, 8, 1, 1), (1, 1), (0, 0))
    assert [gemm._revision(p, one) for p in ("fprop", "bprop", "accgrad")] == [2, 2, 3]
    assert gemm.form_key(np, "fprop", g)[-1] == "gemm_form_r4" and gemm.form_key(np, "bprop", g)[-1] == "gemm_form_r6"


def test_fused_plan_covers_the_product():
    """The 1-D grid: row tiles of f' (fprop) or f (bprop) times column tiles of the batch's pixels;
    ResNet's shortcuts at batch 128."""
    plan = lambda xs, ws, form, bprop, n=None: gemm._fused_plan(
        backends.geometry(xs, ws, (2, 2), (0, 0)), n or xs[0], form, bprop)
    (x1, w1), (x2, w2), (x3, w3) = RESNET_SHORTCUTS
    assert plan(x1, w1, "fused", False) == ("pointwise_gemm<128, 128, false>", 784, 256)      # 100352 pixels
    assert plan(x1, w1, "fused64", False) == ("pointwise_gemm<64, 128, false>", 2 * 784, 128)
    assert plan(x1, w1, "fused", True) == ("pointwise_gemm<128, 128, true>", 784, 256)        # f = 64: half a tile
    assert plan(x2, w2, "fused", False) == ("pointwise_gemm<128, 128, false>", 2 * 196, 256)
    assert plan(x3, w3, "fused", False) == ("pointwise_gemm<128, 128, false>", 4 * 49, 256)   # 6272 pixels
    assert plan(x3, w3, "fused64", True) == ("pointwise_gemm<64, 128, true>", 4 * 49, 128)
    assert plan((3, 72, 13, 13), (136, 72, 1, 1), "fused", False) == ("pointwise_gemm<128, 128, false>", 2 * 2, 256)
    assert set(gemm.FUSED_NAMES) == {plan(x1, w1, form, bprop)[0] for form in gemm.FUSED for bprop in (False, True)}


def test_fused_names_are_instantiated_in_the_source():
    """Each name expression gemm asks NVRTC for is explicitly instantiated for nvcc's check
    (test_cuda_compile compiles pointwise.cu with them, for registers and spills)."""
    text = (KERNEL_DIR / "pointwise.cu").read_text()
    block = text[text.index("#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS"):]
    listed = {re.sub(r"\s+", " ", m) for m in re.findall(r"void (pointwise_gemm<[^>]*>)", block)}
    assert listed == set(gemm.FUSED_NAMES)


def test_fused_chunks_keep_offsets_within_32_bits():
    g = backends.geometry((128, 64, 56, 56), (128, 64, 1, 1), (2, 2), (0, 0))
    assert gemm._fused_chunks(g) == [slice(0, 128)]
    big = backends.geometry((64, 256, 512, 512), (64, 256, 1, 1), (2, 2), (0, 0))   # 2^26 floats an image
    assert [sl.stop - sl.start for sl in gemm._fused_chunks(big)] == [22, 21, 21]   # 31 images of 2^26 at most
    assert all((sl.stop - sl.start) * 256 * 512 * 512 < 2**31 for sl in gemm._fused_chunks(big))
    assert gemm._fused_lda(64) == 64 and gemm._fused_lda(13) == 16 and gemm._fused_lda(17) == 24


# The kernel compiled for the host: one std::thread per CUDA thread, a std::barrier for __syncthreads
# (as tests/test_fbfft_kernels.py's shim), blocks one after another. fmaf is the host's fused
# multiply-add, so the host build sums as the GPU does.
POINTWISE_EMULATION = r"""
#include <barrier>
#include <cmath>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
template <class T> static inline T __ldg(const T* p) { return *p; }
struct Dim { unsigned x = 0, y = 0, z = 0; };
static thread_local Dim threadIdx;
static Dim blockIdx;
static std::barrier<>* emu_barrier = nullptr;
static inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
#include "KERNEL_PATH"

template <int BM, bool BPROP>
static void launch(unsigned blocks, unsigned threads, const float* a, const float* b, float* c, const int* v) {
    for (unsigned bx = 0; bx < blocks; ++bx) {
        std::barrier<> bar(threads);
        emu_barrier = &bar;
        blockIdx.x = bx;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; ++t)
            ts.emplace_back([=] {
                threadIdx.x = t;
                pointwise_gemm<BM, 128, BPROP>(a, b, c, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8],
                                               v[9], v[10]);
            });
        for (auto& th : ts) th.join();
    }
}
extern "C" int emu_pointwise_gemm(int bm, int bprop, unsigned blocks, unsigned threads, const float* a,
                                  const float* b, float* c, const int* v) {
    if (threads != (unsigned)bm * 2) return 1;
    if (bm == 128) bprop ? launch<128, true>(blocks, threads, a, b, c, v) : launch<128, false>(blocks, threads, a, b, c, v);
    else if (bm == 64) bprop ? launch<64, true>(blocks, threads, a, b, c, v) : launch<64, false>(blocks, threads, a, b, c, v);
    else return 1;
    return 0;
}
"""


@pytest.fixture(scope="module")
def pointwise_emulated(tmp_path_factory):
    """kernels/pointwise.cu compiled for the host as a shared library (skips without g++)."""
    return host_library(tmp_path_factory, "pointwise_emu",
                        POINTWISE_EMULATION.replace("KERNEL_PATH", str(KERNEL_DIR / "pointwise.cu")),
                        ("-std=c++20", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas"))


class _HostPointwise:
    """pointwise_gemm called as CuPy's RawKernel is, run by the host build: the launch is checked
    first (a 1-D grid, the block of the name's tile, device float32 arrays then 11 int32s), since a
    wrong type or order would be read as garbage on the GPU."""

    def __init__(self, lib, name, log):
        bm, bn, bprop = re.fullmatch(r"pointwise_gemm<(\d+), (\d+), (true|false)>", name).groups()
        self.lib, self.bm, self.bprop, self.log = lib, int(bm), bprop == "true", log
        assert int(bn) == gemm.FUSED_BN

    def __call__(self, grid, block, args):
        from test_cgemm import _Device
        assert len(grid) == len(block) == 1 and block[0] == self.bm * gemm.FUSED_BN // 64 and len(args) == 14
        for arr in args[:3]:
            assert type(arr) is _Device and arr.dtype == np.float32 and arr.flags.c_contiguous
        assert all(type(v) is np.int32 for v in args[3:])
        a, b, c = (ctypes.c_void_p(arr.ctypes.data) for arr in args[:3])
        ints = (ctypes.c_int * 11)(*(int(v) for v in args[3:]))
        assert self.lib.emu_pointwise_gemm(self.bm, int(self.bprop), grid[0], block[0], a, b, c, ints) == 0
        self.log.append((self.bm, self.bprop, grid[0], tuple(int(v) for v in args[3:])))


def run_fused_on_host(lib, monkeypatch, pass_name, w, operand, out_shape, g, form):
    """gemm._fused's GPU branch on the host: a fake CuPy of NumPy arrays that answer .data.ptr, and
    cuda_module handing out the host build. The output starts as NaN: every element must be written."""
    from test_cgemm import _Device
    log = []
    dev = lambda a: np.ascontiguousarray(a).view(_Device)                     # noqa: E731
    fake = types.SimpleNamespace(zeros=lambda shape, dtype: dev(np.zeros(shape, dtype)))
    module = types.SimpleNamespace(get_function=lambda name: _HostPointwise(lib, name, log))
    monkeypatch.setattr(gemm, "cuda_module", lambda *args, **kwargs: module)
    a = w.reshape(g.fo, g.f) if pass_name == "fprop" else np.ascontiguousarray(w.reshape(g.fo, g.f).T)
    out = dev(np.full(out_shape, np.nan, np.float32))
    assert gemm._fused(fake, pass_name, dev(a), dev(operand), out, g, form) is out
    return np.asarray(out), log


@pytest.mark.parametrize("form", tuple(gemm.FUSED))
@pytest.mark.parametrize("xs,ws,stride", FUSED_EDGES)
def test_emulated_fused_kernel_matches_float64(pointwise_emulated, monkeypatch, form, xs, ws, stride):
    """The kernel's own indexing on the CPU: partial row and column tiles, columns across images,
    K not a multiple of its step (A padded), stride cells clipped at the edge, float2 and scalar
    zeros; every element of y and gx written (NaN-poisoned), gx's zeros exactly zero."""
    g, x, w, gy = fused_operands(np.random.default_rng(21), xs, ws, stride)
    y, log = run_fused_on_host(pointwise_emulated, monkeypatch, "fprop", w, x, (g.S, g.fo, g.oh, g.ow), g, form)
    ref = fused_reference(w, x, stride)
    assert np.linalg.norm(y - ref) <= 1e-5 * np.linalg.norm(ref)
    gx, log_b = run_fused_on_host(pointwise_emulated, monkeypatch, "bprop", w, gy, xs, g, form)
    ref = fused_bprop_reference(w, gy, xs, stride)
    assert np.isfinite(gx).all() and np.linalg.norm(gx - ref) <= 1e-5 * np.linalg.norm(ref)
    mask = np.ones(xs, bool)
    mask[:, :, ::g.sh, ::g.sw] = False
    assert (gx[mask] == 0).all()
    (*_, ints_f), (*_, ints_b) = log[0], log_b[0]                     # (n, ..., lda, pairs)
    assert ints_f[-2:] == (gemm._fused_lda(g.f), 0)
    assert ints_b[-2:] == (gemm._fused_lda(g.fo), g.sw == 2 and g.w % 2 == 0)   # float2 cells where rows are even


def test_emulated_fused_kernel_in_chunks(pointwise_emulated, monkeypatch):
    """One image a chunk (as where an image's tensors near 2^31 floats): slices of x, y, gy, gx and
    each chunk's own grid."""
    xs, ws, stride = (3, 16, 9, 9), (24, 16, 1, 1), (2, 2)
    g, x, w, gy = fused_operands(np.random.default_rng(22), xs, ws, stride)
    monkeypatch.setattr(gemm, "_fused_chunks", lambda g: batch_slices(g.S, 1))
    y, log = run_fused_on_host(pointwise_emulated, monkeypatch, "fprop", w, x, (g.S, g.fo, g.oh, g.ow), g, "fused64")
    assert [entry[3][0] for entry in log] == [1, 1, 1]                       # n of each launch
    ref = fused_reference(w, x, stride)
    assert np.linalg.norm(y - ref) <= 1e-5 * np.linalg.norm(ref)
    gx, _ = run_fused_on_host(pointwise_emulated, monkeypatch, "bprop", w, gy, xs, g, "fused")
    ref = fused_bprop_reference(w, gy, xs, stride)
    assert np.linalg.norm(gx - ref) <= 1e-5 * np.linalg.norm(ref)


@pytest.mark.gpu
@pytest.mark.parametrize("form", tuple(gemm.FUSED))
@pytest.mark.parametrize("xs,ws", RESNET_SHORTCUTS)
def test_fused_forms_on_resnet_shortcuts(form, xs, ws, monkeypatch):
    """ResNet's stride-2 1x1 shortcuts at batch 128 through the fused forms, fprop and bprop, against
    CuPy's float64 einsum; y and gx NaN-poisoned first (the kernel writes every element)."""
    import cupy as cp
    rng = cp.random.default_rng(23)
    x, w = rng.standard_normal(xs, dtype=cp.float32), rng.standard_normal(ws, dtype=cp.float32)
    g = backends.geometry(xs, ws, (2, 2), (0, 0))
    gy = rng.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
    with monkeypatch.context() as mp:
        mp.setattr(gemm, "_form", lambda xp, pass_name, g, run, forms=None: form)
        mp.setattr(cp, "empty", lambda shape, dtype=float: cp.full(shape, cp.nan, dtype))   # poisoned
        y, gx = gemm.fprop(x, w, (2, 2)), gemm.bprop(gy, w, xs, (2, 2))
    ref = fused_reference(w, x, (2, 2))
    assert float(cp.linalg.norm(y - ref) / cp.linalg.norm(ref)) <= 1e-5
    ref = fused_bprop_reference(w, gy, xs, (2, 2))
    assert bool(cp.isfinite(gx).all()) and float(cp.linalg.norm(gx - ref) / cp.linalg.norm(ref)) <= 1e-5
    assert not bool(gx[:, :, 1::2].any()) and not bool(gx[:, :, :, 1::2].any())


@pytest.mark.gpu
@pytest.mark.parametrize("form", tuple(gemm.FUSED))
@pytest.mark.parametrize("xs,ws,stride", FUSED_EDGES)
def test_fused_forms_on_edge_shapes(form, xs, ws, stride, monkeypatch):
    """The fused form forced on fprop and bprop (accGrad keeps its rule) against PyTorch float64:
    partial tiles, batch 1, stride (2, 1), (1, 2) and 3; whole batch and one image a chunk."""
    rng = np.random.default_rng(24)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    real = gemm._form
    monkeypatch.setattr(gemm, "_form", lambda xp, pass_name, g, run, forms=gemm.FORMS:
                        form if pass_name != "accgrad" else real(xp, pass_name, g, run, forms))
    check_backend(gemm, x, w, stride, (0, 0), device="cuda", rng=rng)
    monkeypatch.setattr(gemm, "_fused_chunks", lambda g: batch_slices(g.S, 1))
    check_backend(gemm, x, w, stride, (0, 0), device="cuda", rng=rng)


@pytest.mark.gpu
def test_fused_forms_are_tuned_and_agree(settings, tmp_path):
    """gemm_tune on the GPU: a strided 1x1 fprop and bprop time all four forms, the fused ones checked
    against per_image (none skipped)."""
    import cupy as cp
    from minitorch_fft.backends import tuning
    settings(gemm_tune="on", tune_cache=str(tmp_path / "t.json"))
    xs, ws = (16, 128, 28, 28), (256, 128, 1, 1)
    x, w = cp.random.standard_normal(xs, dtype=cp.float32), cp.random.standard_normal(ws, dtype=cp.float32)
    g = backends.geometry(xs, ws, (2, 2), (0, 0))
    gemm.fprop(x, w, (2, 2))
    gemm.bprop(cp.random.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32), w, xs, (2, 2))
    for p in ("fprop", "bprop"):
        record = tuning.default_cache().get(gemm.form_key(cp, p, g))
        assert set(record["ms"]) == set(gemm.FORMS + tuple(gemm.FUSED)) and not record["skipped"], record
