"""The tiledfft backend against PyTorch float64: its NumPy path (the tiling, index arithmetic,
layouts and GEMM forms the GPU runs too), the CUDA kernels compiled for the host (CPU) against the
NumPy transforms, and the GPU path (gpu marker); its tiling arithmetic, and what it refuses."""
import ctypes
import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings
from hypothesis import strategies as st

from minitorch_fft import backends
import test_fbfft_kernels
from minitorch_fft.backends import tiledfft
from minitorch_fft.backends.common import KERNEL_DIR
from conftest import host_library
from reference import check_backend

TOL = 1e-5   # as every backend in fp32


def forced(n):
    """The backend with its basis forced to n (check_backend calls the plain contract)."""
    return SimpleNamespace(
        fprop=lambda x, w, stride, padding: tiledfft.fprop(x, w, stride, padding, basis=n),
        bprop=lambda gy, w, xs, stride, padding: tiledfft.bprop(gy, w, xs, stride, padding, basis=n),
        accgrad=lambda gy, x, ws, stride, padding: tiledfft.accgrad(gy, x, ws, stride, padding, basis=n))


CASES = [  # (S, f, f', h, w, kh, kw, padding)
    (2, 3, 4, 20, 13, 3, 3, (1, 1)),     # larger than the 8 basis, rectangular: clipped last tiles
    (1, 2, 3, 5, 5, 3, 5, (0, 2)),       # smaller than every basis: one tile
    (2, 2, 2, 40, 9, 7, 2, (3, 4)),      # a tall plane, a rectangular kernel
    (1, 1, 1, 1, 1, 1, 1, (0, 0)),       # one element
    (1, 2, 2, 3, 3, 3, 3, (5, 1)),       # padding beyond k - 1: bprop reads its gradient cropped
    (2, 3, 2, 16, 16, 5, 5, (2, 2)),     # a plane of the 16 basis's size
    (1, 2, 3, 32, 8, 1, 1, (0, 0)),      # 1x1 kernel: every window element is valid
    (1, 2, 2, 34, 30, 7, 7, (0, 3)),     # larger than the 32 basis
]


@pytest.mark.parametrize("n", tiledfft.BASES)
@pytest.mark.parametrize("case", CASES)
def test_three_passes_match_the_reference(n, case, rng):
    S, f, fo, h, w, kh, kw, pad = case
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
    check_backend(forced(n), x, wt, (1, 1), pad, tol=TOL, rng=rng)


@pytest.mark.parametrize("n", tiledfft.BASES)
def test_kernels_up_to_the_basis_limit(n, rng):
    """Kernels of n - 1 per side: two valid outputs a tile, planes larger than the basis."""
    k = n - 1
    x = rng.standard_normal((1, 2, n + 7, n + 3)).astype(np.float32)
    wt = rng.standard_normal((2, 2, k, k)).astype(np.float32)
    check_backend(forced(n), x, wt, (1, 1), (1, k - 1), tol=TOL, rng=rng)


@st.composite
def geometries(draw):
    """Stride 1, a basis, a kernel that fits it, padding 0 .. k - 1 and beyond, planes smaller than,
    equal to and larger than the basis."""
    n = draw(st.sampled_from(tiledfft.BASES))
    kh, kw = draw(st.integers(1, n - 1)), draw(st.integers(1, n - 1))
    ph, pw = draw(st.integers(0, kh + 1)), draw(st.integers(0, kw + 1))
    most = 3 * n
    h = draw(st.integers(max(1, kh - 2 * ph), max(most, kh)))
    w = draw(st.integers(max(1, kw - 2 * pw), max(most, kw)))
    return n, (draw(st.integers(1, 3)), draw(st.integers(1, 4)), h, w), (draw(st.integers(1, 4)), kh, kw), (ph, pw)


@hsettings(max_examples=60, deadline=None, derandomize=True, database=None,
           suppress_health_check=list(HealthCheck))
@given(geometries())
def test_random_geometries_match_the_reference(geom):
    n, (S, f, h, w), (fo, kh, kw), pad = geom
    rng = np.random.default_rng(h * 1000 + w)
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
    check_backend(forced(n), x, wt, (1, 1), pad, tol=TOL, rng=rng)


def test_default_basis_matches_the_reference(rng):
    """The plain contract (the default basis), as a layer calls it."""
    x = rng.standard_normal((2, 3, 23, 17)).astype(np.float32)
    wt = rng.standard_normal((4, 3, 5, 3)).astype(np.float32)
    check_backend(tiledfft, x, wt, (1, 1), (2, 1), tol=TOL, rng=rng)


# -- the tiling arithmetic ----------------------------------------------------------------------

def test_tiling_counts_and_window_origins():
    t = tiledfft.tiling((224, 224), (3, 3), 32)                 # 30 valid outputs a tile, 8 tiles cover 224
    assert t == tiledfft.Tiling(n=32, mh=30, mw=30, th=8, tw=8)
    rows, cols = tiledfft.window_origins(t, (1, 1))
    assert rows.tolist() == cols.tolist() == [-1, 29, 59, 89, 119, 149, 179, 209]
    t = tiledfft.tiling((13, 20), (5, 2), 8)                    # rectangular kernel: 4 x 7 outputs a tile
    assert t == tiledfft.Tiling(n=8, mh=4, mw=7, th=4, tw=3)
    rows, cols = tiledfft.window_origins(t, (2, 0))
    assert rows.tolist() == [-2, 2, 6, 10] and cols.tolist() == [0, 7, 14]
    assert tiledfft.tiling((1, 1), (1, 1), 8) == tiledfft.Tiling(8, 8, 8, 1, 1)
    assert tiledfft.tiling((6, 6), (7, 7), 8) == tiledfft.Tiling(8, 2, 2, 3, 3)   # the largest kernel
    # bprop: padding k - 1 - p is negative where p > k - 1: its windows start inside the plane
    rows, _ = tiledfft.window_origins(tiledfft.tiling((3, 3), (3, 3), 8), (2 - 5, 0))
    assert rows.tolist() == [3]


def test_every_output_is_covered_once():
    """The tiles' valid parts cover the output exactly: each element once."""
    for out_hw, k_hw, n in [((224, 224), (3, 3), 32), ((13, 20), (5, 2), 8), ((57, 9), (15, 1), 16)]:
        t = tiledfft.tiling(out_hw, k_hw, n)
        hits = np.zeros((t.th * t.mh, t.tw * t.mw), dtype=int)
        for i in range(t.th):
            for j in range(t.tw):
                hits[i * t.mh:(i + 1) * t.mh, j * t.mw:(j + 1) * t.mw] += 1
        assert (hits == 1).all()
        assert (t.th - 1) * t.mh < out_hw[0] <= t.th * t.mh and (t.tw - 1) * t.mw < out_hw[1] <= t.tw * t.mw


def test_windows_read_zeros_outside_the_plane():
    """The gathered windows against a padded copy (the test's, not the backend's)."""
    a = np.arange(2 * 3 * 7 * 5, dtype=np.float32).reshape(2, 3, 7, 5) + 1
    t = tiledfft.tiling((7, 5), (3, 3), 8)
    got = tiledfft._windows(a, (1, 2), t)
    padded = np.zeros((2, 3, 1 + t.th * t.mh + 8, 2 + t.tw * t.mw + 8), dtype=np.float32)
    padded[:, :, 1:8, 2:7] = a
    for i in range(t.th):
        for j in range(t.tw):
            np.testing.assert_array_equal(got[:, :, i, j], padded[:, :, i * t.mh:i * t.mh + 8, j * t.mw:j * t.mw + 8])


def test_default_basis():
    assert tiledfft.basis((224, 224), (3, 3)) == 32
    assert tiledfft.basis((5, 5), (3, 3)) == 8              # one tile of the smallest basis
    assert tiledfft.basis((4, 4), (9, 9)) == 16             # 9x9 does not fit 8
    assert tiledfft.basis((30, 30), (16, 16)) == 32


def test_a_batch_larger_than_the_workspace_runs_in_chunks(settings, rng):
    """fbfft_workspace_mb bounds the spectra: a tiny budget, one image a chunk, the same result."""
    x = rng.standard_normal((3, 2, 19, 11)).astype(np.float32)
    wt = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    settings(fbfft_workspace_mb=1e-4)
    assert len(tiledfft._chunks(3, tiledfft._spectrum_bytes(tiledfft.tiling((19, 11), (3, 3), 8), 5))) == 3
    check_backend(forced(8), x, wt, (1, 1), (1, 1), tol=TOL, rng=rng)


# -- what it takes and what it refuses ----------------------------------------------------------

def test_registered_and_an_auto_candidate(settings, tmp_path, monkeypatch):
    """Selectable by name on both devices, and timed by auto by default (not in auto.OPT_IN)."""
    assert "tiledfft" in backends.names("cpu") and "tiledfft" in backends.names("cuda")
    # tiledfft's CUDA kernels joined the GPU set: every registered backend runs there now
    assert backends.names("cuda") == backends.names()
    assert "tiledfft" not in backends.auto.OPT_IN
    geom = dict(x_shape=(1, 2, 6, 6), w_shape=(2, 2, 3, 3), stride=(1, 1), padding=(1, 1))
    assert backends.choose("tiledfft", "fprop", **geom) is tiledfft
    monkeypatch.setattr(backends.auto, "_memory", {})
    settings(auto_tune="on", tune_cache=str(tmp_path / "tune.json"))
    backends.choose("auto", "fprop", **geom)
    timed, = backends.auto.choices()
    assert {"gemm", "tiledfft"} <= set(timed["ms"])


def test_revision_marks_the_staged_inverse():
    """fprop and bprop run the staged inverse (revision 1: auto times them again); accGrad's inverse
    is fbfft's, unchanged (0)."""
    geom = ((2, 3, 40, 40), (4, 3, 3, 3), (1, 1), (1, 1))
    assert [tiledfft.revision(p, *geom) for p in ("fprop", "bprop", "accgrad")] == [1, 1, 0]


def test_the_basis_is_tuned_again_after_a_revision(settings, tmp_path):
    """With tuning on (here on the CPU), fprop's and bprop's basis records carry the revision in
    their key (timed again after the staged inverse), accGrad's do not (its revision is 0)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 20, 20)).astype(np.float32)
    w = rng.standard_normal((2, 2, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((1, 2, 20, 20)).astype(np.float32)
    settings(tiledfft_tune="on", tune_cache=str(tmp_path / "cache.json"))
    tiledfft.fprop(x, w, padding=(1, 1))
    tiledfft.bprop(gy, w, x.shape, padding=(1, 1))
    tiledfft.accgrad(gy, x, w.shape, padding=(1, 1))
    keys = [json.loads(k) for k in json.loads((tmp_path / "cache.json").read_text())["devices"]["cpu"]]
    assert sorted((k[3], k[4]) for k in keys) == [("accgrad", "tiledfft"), ("bprop", "tiledfft_r1"),
                                                  ("fprop", "tiledfft_r1")]


def test_tf32_mode_compares_the_bases_at_the_tf32_tolerance(settings, tmp_path, monkeypatch):
    """In TF32 mode every basis rounds its GEMM's operands to TF32, ~4e-4 from another basis: the
    tuner compares them at cgemm.TF32_TOL (at 1e-4 it refused all but the default, session 22), and
    the revision is one higher there, so records tuned the old way are timed again. The mode is
    stood in for on the CPU (NumPy's GEMMs never round)."""
    from minitorch_fft.backends import cgemm, tuning
    geom = ((2, 3, 40, 40), (4, 3, 3, 3), (1, 1), (1, 1))
    assert [tiledfft.revision(p, *geom, math="tf32") for p in ("fprop", "bprop", "accgrad")] == [2, 2, 1]
    tols, tune = [], tuning.tune
    monkeypatch.setattr(tuning, "tune", lambda *a, tol, **k: tols.append(tol) or tune(*a, tol=tol, **k))
    monkeypatch.setattr(cgemm, "mode", lambda xp: "tf32")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 20, 20)).astype(np.float32)
    w = rng.standard_normal((2, 2, 3, 3)).astype(np.float32)
    settings(tiledfft_tune="on", tune_cache=str(tmp_path / "cache.json"))
    tiledfft.fprop(x, w, padding=(1, 1))
    assert tols == [cgemm.TF32_TOL]
    keys = [json.loads(k) for k in json.loads((tmp_path / "cache.json").read_text())["devices"]["cpu"]]
    assert [(k[1], k[4]) for k in keys] == [("tf32", "tiledfft_r2")]
    monkeypatch.undo()
    assert tuning.variant_tol(np, tiledfft.TUNE_TOL) == tiledfft.TUNE_TOL   # fp32: strict


def test_supports():
    assert tiledfft.supports((2, 3, 224, 224), (8, 3, 3, 3), (1, 1), (1, 1))
    assert tiledfft.supports((2, 3, 224, 224), (8, 3, 5, 5), (1, 1), (2, 2))
    assert tiledfft.supports((1, 1, 40, 40), (1, 1, 31, 31))
    assert not tiledfft.supports((1, 1, 40, 40), (1, 1, 32, 3))         # past the 32 basis
    assert not tiledfft.supports((1, 1, 40, 40), (1, 1, 3, 3), (2, 2))  # strided
    assert not tiledfft.supports((1, 1, 4, 4), (1, 2, 3, 3))            # invalid


@pytest.mark.parametrize("call,err,pattern", [
    (lambda x, w: tiledfft.fprop(x, w, stride=(2, 2)), ValueError, "stride 1 only"),
    (lambda x, w: tiledfft.fprop(x, np.ones((2, 3, 33, 3), np.float32)), ValueError, "up to 31 per side"),
    (lambda x, w: tiledfft.fprop(x, w, basis=12), ValueError, r"basis must be one of \(8, 16, 32\)"),
    (lambda x, w: tiledfft.fprop(x, np.ones((2, 3, 9, 9), np.float32), basis=8), ValueError,
     "basis 8 takes kernels up to 7 per side, got 9x9"),
    (lambda x, w: tiledfft.bprop(np.ones((1, 2, 5, 5), np.float32), w, x.shape), ValueError, "gy must have shape"),
    (lambda x, w: tiledfft.accgrad(np.ones((1, 2, 38, 38), np.float32), x.astype(np.float64), w.shape),
     TypeError, "float32"),
])
def test_bad_input_is_refused_clearly(call, err, pattern):
    x, w = np.ones((1, 3, 40, 40), np.float32), np.ones((2, 3, 3, 3), np.float32)
    with pytest.raises(err, match=pattern):
        call(x, w)


def test_a_named_layer_says_why_it_cannot_take_a_geometry():
    with pytest.raises(ValueError, match="'tiledfft' does not support fprop.*stride 1 only"):
        backends.choose("tiledfft", "fprop", (1, 1, 8, 8), (1, 1, 3, 3), (2, 2), (0, 0))


# -- the CUDA kernels compiled for the host (CPU), against the NumPy transforms --------------------
# fbfft's host shim (test_fbfft_kernels.EMULATION: one std::thread per CUDA thread, a std::barrier
# for __syncthreads) runs kernels/tiledfft.cu unmodified, so the CPU checks the kernels' own window
# reads, batch order and clipped writes, which the NumPy path mirrors.

EMULATION = test_fbfft_kernels.EMULATION.replace('#include "KERNEL_PATH"', '''#include <algorithm>
using std::min;
template <class T> static inline T __ldg(const T* p) { return *p; }
// A warp shuffle through a block-wide table: exact where, as in tiledfft_irfft2, every thread of
// the block calls it the same number of times (the barriers are the block's). Its barriers also
// order the kernel's shared memory, so a barrier missing around the shuffles would not show here.
template <class T> static T __shfl_sync(unsigned, T v, int src) {
    static T table[1024];
    __syncthreads();
    table[threadIdx.x] = v;
    __syncthreads();
    return table[(threadIdx.x & ~31u) + src];
}
#include "KERNEL_PATH"''') + r"""
template <int N> static void tiled_fwd(const float* in, float* out, const int* a) {
    using P = fbfft::Plan<N>;
    launch((a[0] + P::kPlanes - 1) / P::kPlanes, P::kThreads, [=] {
        tiledfft_rfft2<N>(in, (float2*)out, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                          a[11]); });
}
template <int N> static void tiled_inv(const float* in, float* out, const int* a, float scale) {
    using P = fbfft::Plan<N>;
    launch((a[0] + P::kPlanes - 1) / P::kPlanes, P::kThreads, [=] {
        tiledfft_irfft2<N>((const float2*)in, out, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                           scale); });
}
extern "C" int emu_tiled_rfft2(int n, const float* in, float* out, const int* a) {
    switch (n) { case 8: tiled_fwd<8>(in, out, a); break; case 16: tiled_fwd<16>(in, out, a); break;
                 case 32: tiled_fwd<32>(in, out, a); break; default: return 1; }
    return 0;
}
extern "C" int emu_tiled_irfft2(int n, const float* in, float* out, const int* a, float scale) {
    switch (n) { case 8: tiled_inv<8>(in, out, a, scale); break; case 16: tiled_inv<16>(in, out, a, scale); break;
                 case 32: tiled_inv<32>(in, out, a, scale); break; default: return 1; }
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """tiledfft.cu (with fbfft.cu) compiled for the host as a shared library (skips without g++)."""
    return host_library(tmp_path_factory, "tiledfft_emu",
                        EMULATION.replace("KERNEL_PATH", str(KERNEL_DIR / "tiledfft.cu")),
                        ("-std=c++20", "-pthread", "-Wno-unknown-pragmas"))


def _ptr(a):
    assert a.flags.c_contiguous
    return a.ctypes.data_as(ctypes.c_void_p)


def _ints(*values):
    return (ctypes.c_int * len(values))(*values)


KERNEL_CASES = [  # (n, S, c, h, w, kh, kw, pad): the windows of fprop / bprop
    (8, 2, 3, 13, 9, 3, 3, (1, 1)),      # clipped last tiles, windows before the plane
    (16, 1, 2, 40, 23, 5, 3, (2, 1)),
    (32, 1, 2, 45, 33, 3, 3, (1, 1)),
    (8, 1, 2, 5, 6, 3, 3, (-3, 0)),      # bprop's negative padding: windows start inside the plane
    (8, 1, 1, 3, 3, 3, 3, (9, 9)),       # windows wholly in the padding
    (32, 1, 16, 56, 56, 3, 3, (1, 1)),   # planes a multiple of a block's entries: blocks inside one tile
    (16, 1, 32, 28, 28, 3, 3, (1, 1)),
    (8, 3, 5, 20, 17, 3, 3, (1, 1)),     # 180 entries: three blocks, the last partial, entries across tiles
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_emulated_forward_kernel_matches_numpy(emulated, rng, case):
    n, S, c, h, w, kh, kw, pad = case
    a = rng.standard_normal((S, c, h, w)).astype(np.float32)
    t = tiledfft.tiling((h, w), (kh, kw), n)          # any tiling: the kernel and NumPy take the same
    for origin, limit in ((pad, (n, n)), ((0, 0), (t.mh, t.mw))):   # input windows; gradient blocks
        ref = tiledfft._spectra(np, a, origin, t, limit)                  # (nf, P, c)
        got = np.full(ref.shape, np.nan, dtype=np.complex64)              # poisoned
        P = S * t.th * t.tw
        assert emulated.emu_tiled_rfft2(n, _ptr(a), _ptr(got), _ints(P * c, c, h, w, t.th, t.tw, t.mh, t.mw,
                                                                      *origin, *limit)) == 0
        assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref) + 1e-6


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_emulated_inverse_kernel_matches_numpy(emulated, rng, case):
    n, S, c, h, w, kh, kw, _ = case
    oh, ow = h, w
    t = tiledfft.tiling((oh, ow), (kh, kw), n)
    # Hermitian-consistent spectra: those of real windows (what the GEMM's products are too)
    yf = tiledfft._spectra(np, rng.standard_normal((S, c, oh + n, ow + n)).astype(np.float32), (0, 0), t, (n, n))
    for offset in ((0, 0), (kh - 1, kw - 1)):                              # fprop's block; bprop's
        ref = tiledfft._write_valid(np, yf, t, offset, np.empty((S, c, oh, ow), np.float32))
        got = np.full((S, c, oh, ow), np.nan, dtype=np.float32)          # poisoned: every element written
        assert emulated.emu_tiled_irfft2(n, _ptr(yf), _ptr(got), _ints(yf.shape[1] * c, c, oh, ow, t.th, t.tw,
                                                                        t.mh, t.mw, *offset),
                                         ctypes.c_float(1.0 / (n * n))) == 0
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


# -- the GPU path against float64 ------------------------------------------------------------------

def zoo_layers():
    """Each distinct stride-1 3x3 and 5x5 geometry of the zoo once, at batch 1: (x shape, w shape, padding)."""
    from benchmarks.harness import distinct_conv_layers
    found = {}
    for net in ("alexnet", "overfeat_fast", "vgg16", "resnet18", "resnet50"):
        for _, xs, ws, stride, pad, _ in distinct_conv_layers(net, 1):
            if stride == (1, 1) and ws[2] == ws[3] and ws[2] in (3, 5):
                found.setdefault((xs, ws, pad), None)
    return list(found)


@pytest.mark.gpu
@pytest.mark.parametrize("n", tiledfft.BASES)
def test_cuda_zoo_layers_against_float64(n, fresh_rng):
    """The zoo's 3x3 and 5x5 stride-1 layers, all three passes, every CuPy allocation NaN-filled
    first (harness.poisoned): an element the kernels forget to write fails the check."""
    from benchmarks.harness import poisoned
    layers = zoo_layers()
    assert len(layers) >= 10
    for xs, ws, pad in layers:
        x = fresh_rng.standard_normal(xs).astype(np.float32)
        wt = (fresh_rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float32)
        poisoned(lambda: check_backend(forced(n), x, wt, (1, 1), pad, device="cuda", tol=TOL, rng=fresh_rng))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_cuda_odd_geometries_against_float64(case, fresh_rng):
    """CASES on the GPU, every basis: clipped tiles, one-tile planes, negative bprop padding, 1x1."""
    S, f, fo, h, w, kh, kw, pad = case
    x = fresh_rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = fresh_rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
    for n in tiledfft.bases((kh, kw)):
        check_backend(forced(n), x, wt, (1, 1), pad, device="cuda", tol=TOL, rng=fresh_rng)


@pytest.mark.gpu
def test_cuda_random_geometries_against_float64(fresh_rng):
    for _ in range(25):
        kh, kw = (int(v) for v in fresh_rng.integers(1, 12, 2))
        ph, pw = int(fresh_rng.integers(0, kh + 2)), int(fresh_rng.integers(0, kw + 2))
        h, w = int(fresh_rng.integers(max(1, kh - 2 * ph), 70)), int(fresh_rng.integers(max(1, kw - 2 * pw), 70))
        S, f, fo = (int(v) for v in fresh_rng.integers(1, 9, 3))
        x = fresh_rng.standard_normal((S, f, h, w)).astype(np.float32)
        wt = fresh_rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
        for n in tiledfft.bases((kh, kw)):
            check_backend(forced(n), x, wt, (1, 1), (ph, pw), device="cuda", tol=TOL, rng=fresh_rng)


@pytest.mark.gpu
def test_cuda_batch_in_chunks_and_tuned_basis(settings, tmp_path, rng):
    """A workspace of one image a chunk gives the same result; with tuning on, the basis is tuned
    per pass (tuning.remembered, cached on disk) and still correct."""
    x = rng.standard_normal((3, 8, 40, 36)).astype(np.float32)
    wt = (rng.standard_normal((6, 8, 3, 3)) / 9).astype(np.float32)
    settings(fbfft_workspace_mb=0.2)
    check_backend(forced(16), x, wt, (1, 1), (1, 1), device="cuda", tol=TOL, rng=rng)
    settings(fbfft_workspace_mb=2048.0, tiledfft_tune="on", tune_cache=str(tmp_path / "cache.json"))
    check_backend(tiledfft, x, wt, (1, 1), (1, 1), device="cuda", tol=TOL, rng=rng)
    assert (tmp_path / "cache.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["float64", "mixed", "gy shape", "basis", "stride"])
def test_cuda_bad_input_is_refused_clearly(case):
    import cupy as cp
    x, w = cp.ones((1, 3, 40, 40), np.float32), cp.ones((2, 3, 3, 3), np.float32)
    call, err, pattern = {
        "float64": (lambda: tiledfft.fprop(x.astype(cp.float64), w), TypeError, "float32"),
        "mixed": (lambda: tiledfft.fprop(x, cp.asnumpy(w)), TypeError, "must all be NumPy or all CuPy"),
        "gy shape": (lambda: tiledfft.bprop(cp.ones((1, 2, 5, 5), np.float32), w, x.shape), ValueError,
                     "gy must have shape"),
        "basis": (lambda: tiledfft.accgrad(cp.ones((1, 2, 32, 32), np.float32), x, (2, 3, 9, 9), basis=8),
                  ValueError, "basis 8 takes kernels up to 7 per side"),
        "stride": (lambda: tiledfft.fprop(x, w, stride=(2, 2)), ValueError, "stride 1 only"),
    }[case]
    with pytest.raises(err, match=pattern):
        call()


def test_a_float_basis_is_refused():
    """16.0 == 16: a float basis passed the check and failed deep in the pass (TypeError)."""
    x = np.zeros((1, 2, 10, 10), np.float32)
    w = np.zeros((3, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match=r"tiledfft basis must be one of \(8, 16, 32\), got 16.0"):
        tiledfft.fprop(x, w, padding=(1, 1), basis=16.0)


# -- the prepared passes (tiledfft.prepare) on the CPU, on a stand-in for CuPy ----------------------

@pytest.mark.parametrize("case", CASES[:5])
@pytest.mark.parametrize("pass_name", backends.PASSES)
def test_prepared_pass_launches_what_the_pass_function_launches(pass_name, case, rng, settings, monkeypatch):
    """tiledfft.prepare's run makes the pass function's launches (the weight's or operands' spectra
    with their windows' sizes, pads and limits, the GEMM's shapes and op flags, the inverse with its
    block's offset and scale), in its order, on a stand-in for CuPy at the heuristic basis; its result
    has the pass function's shape."""
    from recorder import Recorder
    settings(tiledfft_tune="off")
    fake = Recorder().install(monkeypatch)
    S, f, fo, h, w, kh, kw, pad = case
    g = backends.geometry((S, f, h, w), (fo, f, kh, kw), (1, 1), pad)
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
    gy = rng.standard_normal((S, fo, g.oh, g.ow)).astype(np.float32)
    args = {"fprop": (x, wt), "bprop": (gy, wt), "accgrad": (gy, x)}[pass_name]
    third = {"fprop": (), "bprop": (x.shape,), "accgrad": (wt.shape,)}[pass_name]
    full = getattr(tiledfft, pass_name)(*args, *third, stride=(1, 1), padding=pad)
    launched, fake.calls = fake.calls, []
    run = tiledfft.prepare(pass_name, g, fake)
    assert run is not None
    prepared = run(*args)
    assert fake.calls == launched and [c[0] for c in launched].count("gemm") == 1 and len(launched) == 4
    assert prepared.shape == full.shape and prepared.dtype == full.dtype == np.float32


def test_prepared_basis_is_the_tuned_one_and_nothing_else_is_prepared(settings, tmp_path, monkeypatch):
    """_chosen_basis (what prepare runs) answers the basis _basis would take: none before the pass is
    tuned, the tuned one after (tuned here on the CPU, tiledfft_tune on), the heuristic's where it does
    not tune; prepare answers None on NumPy and where the batch goes in chunks."""
    settings(tune_cache=str(tmp_path / "t.json"), tiledfft_tune="on")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 12, 11)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    g = backends.geometry(x.shape, w.shape, (1, 1), (1, 1))
    assert tiledfft._chosen_basis(np, "fprop", g) is None
    tiledfft.fprop(x, w, (1, 1), (1, 1))                       # tunes the basis
    record = backends.tuning.peek(tiledfft._basis_key(np, "fprop", g))
    assert record is not None and tiledfft._chosen_basis(np, "fprop", g) == record["choice"] in tiledfft.BASES
    assert tiledfft._chosen_basis(np, "bprop", g) is None      # another pass, not tuned
    with backends.config.override(tiledfft_tune="off"):
        assert tiledfft._chosen_basis(np, "bprop", g) == tiledfft.basis((g.h, g.w), (3, 3))
    assert tiledfft.prepare("fprop", g, np) is None
    from recorder import Recorder
    fake = Recorder().install(monkeypatch)
    with backends.config.override(tiledfft_tune="off"):
        assert tiledfft.prepare("fprop", g, fake) is not None
        with backends.config.override(fbfft_workspace_mb=2**-20):   # one image a chunk
            assert tiledfft.prepare("fprop", g, fake) is None
