"""The fbfft convolution backend against PyTorch float64: CPU (the kernels' emulator) and GPU."""
import numpy as np
import pytest

from minitorch_fft import backends
from minitorch_fft.backends import fbfft
from conftest import DEVICES
from reference import check_backend

CASES = [  # (S, f, f', h, w, kh, kw, padding)
    (2, 3, 4, 9, 11, 3, 5, (0, 0)),
    (3, 2, 5, 13, 12, 4, 3, (1, 2)),      # rectangular, asymmetric padding
    (1, 1, 1, 5, 5, 5, 5, (0, 0)),        # batch 1, single channel, kernel = input
    (2, 8, 6, 13, 13, 3, 3, (1, 1)),      # the networks' 3x3 layers
    (2, 4, 3, 27, 27, 5, 5, (2, 2)),      # AlexNet conv2's shape
    (2, 2, 3, 7, 6, 2, 2, (3, 1)),        # padding larger than the kernel
    (2, 3, 2, 60, 60, 9, 9, (0, 0)),      # basis 64
    (1, 2, 2, 100, 70, 9, 9, (2, 2)),     # basis 128, the largest (Table 4's L1 runs there)
    (2, 2, 3, 4, 3, 2, 2, (0, 0)),        # basis 4
    (4, 2, 2, 1, 1, 1, 1, (0, 0)),        # basis 2, the smallest
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_three_passes_match_the_reference(device, case, rng):
    S, f, fo, h, w, kh, kw, pad = case
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
    check_backend(fbfft, x, wt, (1, 1), pad, device=device, rng=rng)


@pytest.mark.gpu
def test_network_sized_layers_gpu(rng):
    """Batch 128 layers of the paper's grid on the GPU, bases 8 to 64."""
    for S, f, fo, hw, k, p in [(128, 16, 16, 4, 3, 1), (128, 64, 64, 13, 3, 1), (16, 96, 128, 27, 5, 2),
                               (64, 32, 32, 32, 9, 0), (8, 16, 16, 56, 9, 4)]:
        x = rng.standard_normal((S, f, hw, hw)).astype(np.float32)
        wt = rng.standard_normal((fo, f, k, k)).astype(np.float32)
        check_backend(fbfft, x, wt, (1, 1), (p, p), device="cuda", rng=rng)


def test_the_cases_cover_every_basis_size():
    sizes = {fbfft.basis(backends.geometry((S, f, h, w), (fo, f, kh, kw), 1, pad))
             for S, f, fo, h, w, kh, kw, pad in CASES}
    assert sizes == {2, 4, 8, 16, 32, 64, 128}


def test_supports_and_basis():
    assert fbfft.supports((1, 1, 13, 13), (1, 1, 3, 3), (1, 1), (1, 1))
    assert fbfft.basis(backends.geometry((1, 1, 13, 13), (1, 1, 3, 3), 1, 1)) == 16
    assert fbfft.basis(backends.geometry((1, 1, 27, 27), (1, 1, 5, 5), 1, 2)) == 32
    assert not fbfft.supports((1, 1, 13, 13), (1, 1, 3, 3), (2, 2), (1, 1))      # strided
    assert fbfft.basis(backends.geometry((1, 1, 64, 64), (1, 1, 9, 9), 1, 1)) == 128
    assert fbfft.supports((1, 1, 64, 64), (1, 1, 9, 9), (1, 1), (1, 1))          # basis 128
    assert not fbfft.supports((1, 1, 128, 128), (1, 1, 3, 3), (1, 1), (1, 1))    # basis 256
    with pytest.raises(ValueError, match="kernels go up to 128"):
        fbfft.fprop(np.ones((1, 1, 130, 130), np.float32), np.ones((1, 1, 3, 3), np.float32))
    with pytest.raises(ValueError, match="stride 1 only"):
        fbfft.fprop(np.ones((1, 1, 9, 9), np.float32), np.ones((1, 1, 3, 3), np.float32), stride=(2, 2))
    assert "fbfft" in backends.names()


def test_chunked_batch_gives_the_same_answer(rng, monkeypatch, settings):
    x = rng.standard_normal((3, 2, 9, 9)).astype(np.float32)
    wt = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    assert fbfft._plan(x.shape, wt.shape, (1, 1), (1, 1))[2] == (None,)   # whole batch, planned once
    settings(fbfft_workspace_mb=2**-20)  # one image per chunk
    # the pass plans are cached per geometry: a new workspace must still give new chunks
    assert fbfft._plan(x.shape, wt.shape, (1, 1), (1, 1))[2] == (slice(0, 1), slice(1, 2), slice(2, 3))
    check_backend(fbfft, x, wt, (1, 1), (1, 1), rng=rng)


def test_planned_passes_take_any_int_sequence_and_refuse_non_ints(rng):
    """The pass plans are cached on the arguments: lists and NumPy ints are checked and made plain
    first (same answer as tuples), and 8.0 never reaches a cached plan."""
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    wt = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    want = fbfft.bprop(gy, wt, (2, 3, 8, 8), (1, 1), (1, 1))
    np.testing.assert_array_equal(fbfft.bprop(gy, wt, [2, 3, np.int64(8), 8], [1, 1], [1, 1]), want)
    np.testing.assert_array_equal(fbfft.accgrad(gy, x, [4, 3, 3, 3], 1, 1), fbfft.accgrad(gy, x, (4, 3, 3, 3),
                                                                                        (1, 1), (1, 1)))
    with pytest.raises(TypeError, match="input shape must be a sequence of ints"):
        fbfft.bprop(gy, wt, (2, 3, 8.0, 8), (1, 1), (1, 1))
    with pytest.raises(ValueError, match=r"gy must have shape \(2, 4, 8, 8\)"):
        fbfft.bprop(gy[:, :3], wt, (2, 3, 8, 8), (1, 1), (1, 1))


# -- the prepared passes (fbfft.prepare) on the CPU, on a stand-in for CuPy -------------------------

def _operands(rng, g):
    x = rng.standard_normal((g.S, g.f, g.h, g.w)).astype(np.float32)
    wt = rng.standard_normal((g.fo, g.f, g.kh, g.kw)).astype(np.float32)
    gy = rng.standard_normal((g.S, g.fo, g.oh, g.ow)).astype(np.float32)
    return {"fprop": (x, wt), "bprop": (gy, wt), "accgrad": (gy, x)}, {"bprop": (g.S, g.f, g.h, g.w),
                                                                       "accgrad": wt.shape}


@pytest.mark.parametrize("case", [c for c in CASES if c[0] > 1 or c[7] != (0, 0)][:6])
@pytest.mark.parametrize("pass_name", backends.PASSES)
def test_prepared_pass_launches_what_the_pass_function_launches(pass_name, case, rng, monkeypatch):
    """fbfft.prepare's run makes the pass function's FFT launches, GEMM (its operands' shapes, op flags)
    and inverse launch (sizes, offsets: x at (ph, pw), bprop's window read back there), in its order,
    on a stand-in for CuPy; its result has the pass function's shape."""
    from recorder import Recorder
    fake = Recorder().install(monkeypatch)
    S, f, fo, h, w, kh, kw, pad = case
    g = backends.geometry((S, f, h, w), (fo, f, kh, kw), (1, 1), pad)
    args, third = _operands(rng, g)
    fake.watch(**dict(zip(("a", "b"), args[pass_name])))      # each spectrum's owner: the operand itself
    full = getattr(fbfft, pass_name)(*args[pass_name], *((third[pass_name],) if pass_name in third else ()),
                                     stride=(1, 1), padding=pad)
    launched, fake.calls = fake.calls, []
    run = fbfft.prepare(pass_name, g, fake)
    assert run is not None
    prepared = run(*args[pass_name])
    assert fake.calls == launched
    assert [c[0] for c in launched] == ["shared", "rfft2", "shared", "rfft2", "gemm", "irfft2"]
    assert prepared.shape == full.shape and prepared.dtype == full.dtype == np.float32


def test_prepared_passes_share_spectra_as_the_pass_functions(rng, monkeypatch):
    """Inside reuse_spectra(), a layer's three prepared passes find and keep the spectra the pass
    functions do (accGrad takes fprop's x, bprop accGrad's gy: 3 of 6 FFTs saved with the weight's
    kept), and nothing is prepared where the batch goes in chunks or on NumPy."""
    from recorder import Recorder
    fake = Recorder().install(monkeypatch)
    g = backends.geometry((3, 4, 9, 9), (5, 4, 3, 3), (1, 1), (1, 1))
    args, third = _operands(rng, g)
    order = (("fprop", ()), ("accgrad", (third["accgrad"],)), ("bprop", (third["bprop"],)))
    runs = {pn: fbfft.prepare(pn, g, fake) for pn in backends.PASSES}
    recorded = []
    for prepared in (False, True):
        fake.calls = []
        with backends.reuse_spectra() as cache:
            for pn, rest in order:
                if prepared:
                    runs[pn](*args[pn])
                else:
                    getattr(fbfft, pn)(*args[pn], *rest, stride=(1, 1), padding=(1, 1))
            assert cache.hits == 3 and len(cache) == 0
        recorded.append(fake.calls)
    assert recorded[0] == recorded[1] and [c[0] for c in recorded[1]].count("rfft2") == 3
    assert fbfft.prepare("fprop", g, np) is None
    with backends.config.override(fbfft_workspace_mb=2**-20):    # one image a chunk
        assert fbfft.prepare("fprop", g, fake) is None


@pytest.mark.parametrize("pad", [(1, 1), (2, 0)])
def test_prepared_and_full_passes_find_each_others_spectra(pad, rng, monkeypatch):
    """In one reuse_spectra() block the pass function's fprop keeps x's spectrum for a prepared accGrad,
    and a prepared fprop's for the pass function's accGrad (the same key, x at (ph, pw), and owner):
    one hit each way, and x transformed once."""
    from recorder import Recorder
    fake = Recorder().install(monkeypatch)
    g = backends.geometry((3, 4, 9, 9), (5, 4, 3, 3), (1, 1), pad)
    args, third = _operands(rng, g)
    prepared = {pn: fbfft.prepare(pn, g, fake) for pn in ("fprop", "accgrad")}
    full = {"fprop": lambda x, w: fbfft.fprop(x, w, (1, 1), pad),
            "accgrad": lambda gy, x: fbfft.accgrad(gy, x, third["accgrad"], (1, 1), pad)}
    for first, second in ((full, prepared), (prepared, full)):
        fake.calls = []
        with backends.reuse_spectra() as cache:
            first["fprop"](*args["fprop"])
            second["accgrad"](*args["accgrad"])
        assert cache.hits == 1 and cache.hit_keys[0].role == "x" and cache.hit_keys[0].offset == pad
        assert [c[0] for c in fake.calls].count("rfft2") == 3      # w, x; then gy only
