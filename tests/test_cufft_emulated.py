"""cufft's GPU branch, run on the CPU: cuFFT plans, the two elementwise kernels and cuBLAS's
operand flags replaced by NumPy stand-ins that follow their documented semantics.

The GPU tests check the real thing on a GPU; these let CI catch what only the GPU branch
does: the plans' strides and distances in both spectrum layouts (cufftPlanMany addresses
element (b, i, j) at b*dist + (i*embed[1] + j)*stride), C's integer arithmetic in the place
and crop kernels, cuFFT's alignment requirement, and C2R destroying its input.
"""
import sys
import types

import numpy as np
import pytest

from minitorch_fft.backends import cgemm, cufft, cufft_buffers
from minitorch_fft.backends.common import geometry

R2C, C2R = 0x2A, 0x2C


class FakePlan:
    """cufftPlanMany for 2-D R2C / C2R, addressed as cuFFT does, computed with numpy.fft."""

    def __init__(self, shape, inembed, istride, idist, onembed, ostride, odist, fft_type, batch,
                 order, last_axis, last_size):
        n, m = shape
        half = m // 2 + 1
        real, cplx = ([n, m], 1, n * m), ([n, half], 1, n * half)
        if inembed is None:                      # NULL embed: the default layout, strides ignored
            inembed, istride, idist = real if fft_type == R2C else cplx
        if onembed is None:
            onembed, ostride, odist = cplx if fft_type == R2C else real
        self.n, self.m, self.half, self.type, self.batch = n, m, half, fft_type, batch
        self.inp, self.out = (inembed, istride, idist), (onembed, ostride, odist)

    def _index(self, layout, rows, cols):
        embed, stride, dist = layout
        b, i, j = np.meshgrid(np.arange(self.batch), np.arange(rows), np.arange(cols), indexing="ij")
        return b * dist + (i * embed[1] + j) * stride

    def fft(self, a, out, direction):
        assert a.flags.c_contiguous and out.flags.c_contiguous
        assert a.ctypes.data % 8 == 0 and out.ctypes.data % 8 == 0, "cuFFT needs 8-byte aligned data"
        flat_in, flat_out = a.reshape(-1), out.reshape(-1)
        n, m, half = self.n, self.m, self.half
        if self.type == R2C:
            src, dst = self._index(self.inp, n, m), self._index(self.out, n, half)
            assert src.max() < flat_in.size and dst.max() < flat_out.size
            flat_out[dst] = np.fft.rfft2(flat_in[src].astype(np.float64))
        else:
            src, dst = self._index(self.inp, n, half), self._index(self.out, n, m)
            assert src.max() < flat_in.size and dst.max() < flat_out.size
            flat_out[dst] = np.fft.irfft2(flat_in[src], s=(n, m), norm="forward")
            flat_in[...] = np.nan                # cuFFT's C2R may destroy its input


def c_mod(a, b):
    return np.fmod(a, b)                         # C's %: the sign of the dividend


def place_kernel(a, n, m, h, w, sh, sw, scale, out):
    """The body of cufft's place kernel, one output element per index i."""
    i = np.arange(out.size, dtype=np.int64)
    c, r, plane = c_mod(i, m), c_mod(i // m, n), i // (n * m)
    u, v = c_mod(r + sh, n), c_mod(c + sw, m)
    inside = (u < h) & (v < w)
    source = a.reshape(-1)[np.where(inside, (plane * h + u) * w + v, 0)]
    out.reshape(-1)[...] = np.where(inside, source * scale, 0)


def crop_kernel(full, n, m, oh, ow, sh, sw, scale, out):
    """The body of cufft's crop kernel."""
    i = np.arange(out.size, dtype=np.int64)
    v, u, plane = c_mod(i, ow), c_mod(i // ow, oh), i // (oh * ow)
    index = (plane * n + c_mod(u - sh + n, n)) * m + c_mod(v - sw + m, m)
    assert index.min() >= 0 and index.max() < full.size
    out[...] = (full.reshape(-1)[index] * scale).reshape(out.shape)


def transpose_kernel(src, dst):
    """The tiled transpose, tile by tile with its bounds checks, as cufft.cu's blocks run it."""
    rows, cols = src.shape
    assert src.flags.c_contiguous and dst.flags.c_contiguous and dst.shape == (cols, rows)
    for r0 in range(0, rows, 32):
        for c0 in range(0, cols, 32):
            tile = src[r0:min(r0 + 32, rows), c0:min(c0 + 32, cols)]
            dst[c0:c0 + tile.shape[1], r0:r0 + tile.shape[0]] = tile.T


class FakeCupy(types.ModuleType):
    """NumPy under another name, so that cufft takes its GPU branch (`xp is not np`)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float, order="C"):
        """Device memory nobody wrote reads as NaN, not as whatever the host heap held: a
        plan that reads a slot it should not gives NaN every run, never a result by chance."""
        a = np.empty(shape, dtype, order)
        a[...] = np.nan if a.dtype.kind in "fc" else 0
        return a

    def empty_like(self, a, dtype=None):
        return self.empty(a.shape, a.dtype if dtype is None else dtype)


@pytest.fixture
def gpu_branch(monkeypatch, settings):
    xp = FakeCupy("fake_cupy")
    xp.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0))
    fake_cufft = types.SimpleNamespace(PlanNd=FakePlan, CUFFT_R2C=R2C, CUFFT_C2R=C2R)
    cupy_mod, cuda_mod = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    cuda_mod.cufft, cupy_mod.cuda = fake_cufft, cuda_mod
    for name, mod in (("cupy", cupy_mod), ("cupy.cuda", cuda_mod), ("cupy.cuda.cufft", fake_cufft)):
        monkeypatch.setitem(sys.modules, name, mod)

    numpy_matmul = cgemm.matmul                  # its NumPy branch stands in for cuBLAS's op flags
    monkeypatch.setattr(cgemm, "matmul", lambda xp_, *args, **kwargs: numpy_matmul(np, *args, **kwargs))
    monkeypatch.setattr(cufft, "_gpu_kernels",
                        lambda: {"place": place_kernel, "crop": crop_kernel, "transpose": transpose_kernel})
    monkeypatch.setattr(cufft, "_aligned", lambda xp_, a: a.ctypes.data % 16 == 0)
    monkeypatch.setattr(cufft, "check_arrays",
                        lambda **arrays: (xp, *[np.ascontiguousarray(a) for a in arrays.values()]))
    settings(cufft_tune="off")
    monkeypatch.setattr(cufft_buffers, "_scratch_buffers", {})
    monkeypatch.setattr(cufft_buffers, "_plans", {})
    return xp


def passes(x, w, gy, padding):
    return (cufft.fprop(x, w, padding=padding), cufft.bprop(gy, w, x.shape, padding=padding),
            cufft.accgrad(gy, x, w.shape, padding=padding))


CASES = [((3, 2, 7, 8), (4, 2, 3, 3), (1, 2)),
         ((3, 2, 8, 8), (4, 2, 3, 3), (0, 0)),     # x fills the basis: read by the plan in place
         ((2, 3, 6, 7), (4, 3, 3, 3), (4, 4)),     # padding beyond the kernel
         ((5, 3, 9, 9), (4, 3, 3, 3), (0, 0)),     # odd f*n*m: chunks of x start misaligned
         ((4, 4, 9, 9), (3, 4, 1, 1), (0, 0)),     # gy fills the basis too
         ((2, 3, 1, 1), (2, 3, 3, 3), (1, 1))]


@pytest.mark.parametrize("x_shape,w_shape,padding", CASES)
@pytest.mark.parametrize("layout", cufft.LAYOUTS)
@pytest.mark.parametrize("how", cufft.GEMMS)
@pytest.mark.parametrize("chunked", [False, True])
def test_gpu_branch_matches_the_cpu_branch(gpu_branch, monkeypatch, rng, x_shape, w_shape, padding,
                                           layout, how, chunked, settings):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    g = geometry(x_shape, w_shape, (1, 1), padding)
    gy = rng.standard_normal((g.S, g.fo, g.oh, g.ow)).astype(np.float32)
    with monkeypatch.context() as m:             # the CPU branch, as CI runs it elsewhere
        m.setattr(cufft, "check_arrays", lambda **arrays: (np, *arrays.values()))
        expected = passes(x, w, gy, padding)
    originals = x.copy(), w.copy(), gy.copy()
    monkeypatch.setattr(cufft, "DEFAULT_LAYOUT", layout)
    monkeypatch.setattr(cufft, "default_config", lambda g_, real=cufft.default_config: dict(real(g_), gemm=how))
    if chunked:
        settings(cufft_workspace_mb=2**-20)
        assert len(cufft._batch_chunks(g, cufft.default_config(g)["basis"])) == g.S
    got = passes(x, w, gy, padding)
    for name, a, b in zip(("fprop", "bprop", "accgrad"), expected, got, strict=True):
        scale = max(float(np.abs(a).max()), 1e-30)
        assert float(np.abs(a - b).max()) / scale < 1e-5, name
    for before, after in zip(originals, (x, w, gy), strict=True):
        np.testing.assert_array_equal(before, after)    # R2C read x, w, gy in place: never written
    assert {key[-1] for key in cufft_buffers._plans} == {layout}


def test_a_swapped_stride_is_caught(gpu_branch, rng):
    """The emulation is strict enough to see a wrong plan: swap the strided layout's ostride and
    odist and the results go wrong."""
    real = FakePlan.__init__

    def swapped(self, *args):
        real(self, *args)
        embed, stride, dist = self.out
        if self.type == R2C and stride != 1:
            self.out = (embed, dist, stride)
    x = rng.standard_normal((3, 2, 8, 8)).astype(np.float32)
    w = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    cufft.DEFAULT_LAYOUT = "strided"
    try:
        right = cufft.fprop(x, w)
        FakePlan.__init__ = swapped
        cufft_buffers._plans.clear()
        wrong = cufft.fprop(x, w)
    finally:
        FakePlan.__init__ = real
        cufft.DEFAULT_LAYOUT = "copy"
    # The swapped plan reads slots nothing wrote (NaN, see FakeCupy.empty): allclose, unlike
    # max(|right - wrong|) > tol, counts NaN as a difference.
    assert wrong.shape == right.shape and np.isfinite(right).all()
    assert not np.allclose(wrong, right, rtol=0, atol=1e-2 * np.abs(right).max())
