"""The polyphase backend (strided layers as stride-1 FFT convolutions) against PyTorch float64."""
import numpy as np
import pytest

from minitorch_fft import backends
from minitorch_fft.backends import cufft, fbfft, polyphase
from conftest import DEVICES, host_library
from reference import check_backend, conv_reference, rel_error

CASES = [  # (S, f, f', h, w, kh, kw, stride, padding)
    (2, 3, 4, 23, 23, 11, 11, (4, 4), (2, 2)),   # AlexNet conv1's shape, scaled down
    (2, 3, 4, 27, 27, 11, 11, (4, 4), (0, 0)),   # OverFeat conv1's: 27 - 11 = 16, divisible by 4
    (2, 3, 2, 26, 25, 11, 11, (4, 4), (0, 0)),   # input rows past the last window (gradient 0)
    (3, 2, 5, 13, 12, 4, 3, (2, 3), (1, 2)),     # rectangular stride and padding
    (2, 2, 3, 9, 9, 3, 3, (2, 1), (1, 1)),       # stride in one direction only
    (1, 1, 1, 7, 7, 2, 2, (2, 2), (3, 3)),       # padding larger than the kernel
    (2, 2, 2, 5, 5, 5, 5, (3, 3), (0, 0)),       # one output: kernel = input
    (2, 2, 2, 8, 8, 1, 1, (2, 2), (0, 0)),       # 1 x 1 kernel: one phase carries every tap
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_three_passes_match_the_reference(device, case, rng):
    S, f, fo, h, w, kh, kw, stride, pad = case
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
    check_backend(polyphase, x, wt, stride, pad, device=device, rng=rng)


def test_phase_geometry_of_the_networks_first_layers():
    g = backends.geometry((128, 3, 224, 224), (64, 3, 11, 11), 4, 2)            # AlexNet conv1
    assert polyphase.inner_shapes(g) == ((128, 48, 57, 57), (64, 48, 3, 3))
    assert polyphase._inner(g) is fbfft
    g = backends.geometry((128, 3, 231, 231), (96, 3, 11, 11), 4, 0)            # OverFeat-fast conv1
    assert polyphase.inner_shapes(g) == ((128, 48, 58, 58), (96, 48, 3, 3))
    assert polyphase.supports((128, 3, 231, 231), (96, 3, 11, 11), (4, 4), (0, 0))


def test_supports_and_errors():
    assert not polyphase.supports((1, 1, 13, 13), (1, 1, 3, 3), (1, 1), (1, 1))   # stride 1: not for it
    assert not polyphase.supports((1, 1, 13, 13), (1, 1, 3, 3), (2, 2), (-1, 0))  # invalid geometry
    # phase images beyond fbfft's 128 basis go to cufft
    g = backends.geometry((1, 1, 600, 600), (1, 1, 4, 4), 2, 0)
    assert polyphase._inner(g) is cufft
    with pytest.raises(ValueError, match="for strided convolutions"):
        polyphase.fprop(np.ones((1, 1, 9, 9), np.float32), np.ones((1, 1, 3, 3), np.float32))
    with pytest.raises(ValueError, match="channel mismatch"):
        polyphase.fprop(np.ones((1, 2, 9, 9), np.float32), np.ones((1, 1, 3, 3), np.float32), stride=2)
    assert "polyphase" in backends.names()


def test_spectra_and_phase_images_are_shared_across_a_step(rng):
    """Within reuse_spectra() the phase images of x and w are built once, so the inner backend's
    spectra of them are found again by bprop and accGrad (3 of the 6 forward FFTs saved)."""
    x = rng.standard_normal((2, 3, 23, 23)).astype(np.float32)
    w = rng.standard_normal((4, 3, 11, 11)).astype(np.float32)
    gy = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    with backends.reuse_spectra() as cache:
        polyphase.fprop(x, w, stride=4, padding=2)
        polyphase.bprop(gy, w, x.shape, stride=4, padding=2)
        polyphase.accgrad(gy, x, w.shape, stride=4, padding=2)
    roles = sorted((k.backend, k.role) for k in cache.hit_keys)
    assert roles == [("fbfft", "gy"), ("fbfft", "w"), ("fbfft", "x"), ("polyphase", "w"), ("polyphase", "x")]


@pytest.mark.gpu
def test_network_first_layers_gpu(rng):
    """AlexNet's and OverFeat-fast's conv1 at batch 16 on the GPU (fbfft inside, basis 64)."""
    for x_shape, w_shape, pad in [((16, 3, 224, 224), (64, 3, 11, 11), 2), ((16, 3, 231, 231), (96, 3, 11, 11), 0)]:
        x = rng.standard_normal(x_shape).astype(np.float32)
        wt = rng.standard_normal(w_shape).astype(np.float32)
        check_backend(polyphase, x, wt, (4, 4), (pad, pad), device="cuda", rng=rng)


# -- kernels/polyphase.cu compiled for the host: its index arithmetic against the NumPy maps --

EMULATION = r"""
#define __global__
#define __restrict__
struct Dim { unsigned x = 0, y = 0, z = 0; };
static Dim threadIdx, blockIdx, blockDim, gridDim;
#include "KERNEL_PATH"
template <class F> static void launch(unsigned grid, unsigned tx, unsigned ty, F k) {
    gridDim.x = grid; blockDim.x = tx; blockDim.y = ty;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned y = 0; y < ty; ++y)
            for (unsigned x = 0; x < tx; ++x) { blockIdx.x = b; threadIdx.x = x; threadIdx.y = y; k(); }
}
#define ARGS const float* x, float* y, int h, int w, int sh, int sw, int ph, int pw, int A, int B, \
             long long rows, int grid, int tx, int ty
extern "C" void gather(ARGS) { launch(grid, tx, ty, [=] { polyphase_gather(x, y, h, w, sh, sw, ph, pw, A, B, rows); }); }
extern "C" void scatter(ARGS) { launch(grid, tx, ty, [=] { polyphase_scatter(x, y, h, w, sh, sw, ph, pw, A, B, rows); }); }
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    from minitorch_fft.backends.common import KERNEL_DIR
    return host_library(tmp_path_factory, "polyphase_emu",
                        EMULATION.replace("KERNEL_PATH", str(KERNEL_DIR / "polyphase.cu")), ("-std=c++17",))


@pytest.mark.parametrize("case", CASES)
def test_emulated_kernels_match_the_numpy_maps(emulated, case, rng):
    """polyphase_gather / polyphase_scatter, launched as polyphase._launch shapes them (and with
    a grid of 3 blocks, so the grid-stride loop wraps), give the NumPy path's arrays exactly."""
    import ctypes
    S, f, fo, h, w, kh, kw, stride, pad = case
    g = backends.geometry((S, f, h, w), (fo, f, kh, kw), stride, pad)
    _, _, A, B = polyphase.phases(g)
    ptr = ctypes.c_void_p

    def run(fn, src, out, cols, grid=None):
        rows = out.size // cols
        tx = 32 if cols <= 32 else 64 if cols <= 64 else 128
        ty = 256 // tx
        fn(src.ctypes.data_as(ptr), out.ctypes.data_as(ptr),
           *(ctypes.c_int(v) for v in (h, w, g.sh, g.sw, g.ph, g.pw, A, B)), ctypes.c_longlong(rows),
           ctypes.c_int(grid or -(-rows // ty)), ctypes.c_int(tx), ctypes.c_int(ty))
        return out

    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    want = polyphase._gather(np, x, g, (g.ph, g.pw), A, B)
    x2 = rng.standard_normal(want.shape).astype(np.float32)
    want2 = polyphase._scatter(np, x2, g, (g.ph, g.pw), (S, f, h, w))
    for grid in (None, 3):
        got = run(emulated.gather, x, np.full(want.shape, np.nan, np.float32), B, grid)
        np.testing.assert_array_equal(got, want)
        got2 = run(emulated.scatter, x2, np.full(want2.shape, np.nan, np.float32), w, grid)
        np.testing.assert_array_equal(got2, want2)


def test_one_input_into_two_kernels_of_one_stride_shares_nothing_wrong(rng):
    """An input read by two strided layers of the same stride and padding but different kernels
    (an inception-style branch): their phase images differ in size (Ha = oh + KH - 1), so under
    reuse_spectra() each layer must build its own. Both must match PyTorch in float64."""
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    branches = [rng.standard_normal((4, 3, k, k)).astype(np.float32) for k in (3, 2)]
    with backends.reuse_spectra():
        ys = [polyphase.fprop(x, w, stride=2) for w in branches]
    for w, y in zip(branches, ys):
        ref, _, _ = conv_reference(x, w, np.zeros((2, 4, 4, 4)), (2, 2), (0, 0))
        assert y.shape == ref.shape == (2, 4, 4, 4)
        assert rel_error(y, ref) < 1e-5


# -- the prepared passes (polyphase.prepare) on the CPU, on a stand-in for CuPy ---------------------

@pytest.mark.parametrize("case", CASES[:5])
@pytest.mark.parametrize("pass_name", backends.PASSES)
def test_prepared_pass_launches_what_the_pass_function_launches(pass_name, case, rng, monkeypatch):
    """polyphase.prepare's run makes the pass function's launches (the rearrangements' grids and
    integer arguments, the inner fbfft pass's FFTs, GEMM and inverse) in its order, on a stand-in
    for CuPy; its result has the pass function's shape."""
    from recorder import Recorder
    fake = Recorder().install(monkeypatch)
    S, f, fo, h, w, kh, kw, stride, pad = case
    g = backends.geometry((S, f, h, w), (fo, f, kh, kw), stride, pad)
    assert polyphase._inner(g) is fbfft
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
    gy = rng.standard_normal((S, fo, g.oh, g.ow)).astype(np.float32)
    args = {"fprop": (x, wt), "bprop": (gy, wt), "accgrad": (gy, x)}[pass_name]
    third = {"fprop": (), "bprop": (x.shape,), "accgrad": (wt.shape,)}[pass_name]
    fake.watch(x=x, w=wt, gy=gy)
    full = getattr(polyphase, pass_name)(*args, *third, stride=stride, padding=pad)
    launched, fake.calls = fake.calls, []
    run = polyphase.prepare(pass_name, g, fake)
    assert run is not None
    prepared = run(*args)
    assert fake.calls == launched
    kinds = [c[0] for c in launched]
    assert kinds.count("gemm") == 1 and sum(k.startswith("polyphase_") for k in kinds) == 2
    assert prepared.shape == full.shape and prepared.dtype == full.dtype == np.float32


def test_prepares_nothing_the_inner_backend_would_not(monkeypatch):
    """No prepared call on NumPy, at stride 1, or where the inner backend is cufft (no prepare())."""
    from recorder import Recorder
    fake = Recorder().install(monkeypatch)
    g = backends.geometry((2, 3, 23, 23), (4, 3, 11, 11), (4, 4), (2, 2))
    assert polyphase.prepare("fprop", g, fake) is not None
    assert polyphase.prepare("fprop", g, np) is None
    monkeypatch.setattr(polyphase, "_inner", lambda g: cufft)
    assert polyphase.prepare("fprop", g, fake) is None
