"""fbfft's GPU branch, run on the CPU: the CUDA kernels of kernels/fbfft.cu compiled for the
host, cuBLAS's strided-batched GEMM modelled on host memory, and just enough CuPy around them.

The GPU tests check the real thing on a GPU; these let CI check what only the GPU branch does:
the launch arguments fbfft's passes build (the plane count B, the offsets and windows, the
int32/float32 scalars in the kernels' order, grid, block and shared memory), the cuBLAS
arguments of every GEMM (leading dimensions, strides, operand flags, beta = 1 across batch
chunks), slices of the batch addressed by pointer, and which spectra reuse_spectra() shares.

What stands in for the GPU:
- a "device" array is a NumPy array of test_cgemm's subclass that answers .data.ptr; it is the
  fake module's ndarray (common.check_arrays and device.is_cupy recognise it), and cp.empty
  fills it with NaN, so an element that no kernel or GEMM wrote fails the reference check;
- a kernel launch (fbfft_kernels.kernel returns the RawKernel) checks its grid, block, shared
  memory, argument types and buffer sizes against the kernel's plan, then runs the CUDA source
  compiled for the host (test_fbfft_kernels.EMULATION) on the arrays' pointers;
- cublasGemmStridedBatchedEx is test_cgemm's column-major model, reading and writing through
  the pointers it is given, after a check that each operand's span lies inside one array the
  fake made (a wrong size or stride then fails as an assertion, not as a crash).
The results are compared with PyTorch in float64 (reference.check_backend).
"""
import collections
import ctypes
import sys
import types

import numpy as np
import pytest

from minitorch_fft import backends
from minitorch_fft.backends import cgemm, fbfft, fbfft_kernels, fbfft_plan
from minitorch_fft.backends.common import KERNEL_DIR, geometry
from minitorch_fft.backends.reuse import Key
from conftest import host_library
from minitorch_fft.backends import device
from reference import check_backend
from test_cgemm import CALLS as GEMM_CALLS
from test_cgemm import _Device, _gemm_strided_batched_ex
from test_fbfft_kernels import EMULATION

# What each kernel is launched with after its two pointers, and what the pointers address.
SCALARS = {"rfft2": (np.int32,) * 5,                   # B, h, w, top, left
           "irfft2": (np.int32,) * 5 + (np.float32,)}  # B, row_off, col_off, out_h, out_w, scale


def buffers(name, n, scalars):
    """((dtype, size) of src, (dtype, size) of dst) that kernel `name` addresses."""
    nf = fbfft_plan.stored_frequencies(n)
    B, *rest = (int(s) for s in scalars)
    if name == "rfft2":
        h, w = rest[:2]
        return (np.float32, B * h * w), (np.complex64, nf * B)
    out_h, out_w = rest[2:4]
    return (np.complex64, nf * B), (np.float32, B * out_h * out_w)


class EmulatedKernel:
    """fbfft_<name><n> called as CuPy's RawKernel is, run by the host-compiled CUDA source."""

    def __init__(self, lib, name, n, log):
        self.run, self.name, self.n, self.log = getattr(lib, f"emu_{name}"), name, n, log

    def __call__(self, grid, block, args, shared_mem=0):
        src, dst, *scalars = args
        p = fbfft_plan.plan(self.n)
        B = int(scalars[0])
        assert (grid, block, shared_mem) == (((B + p.planes - 1) // p.planes,), (p.threads,), p.smem_bytes)
        assert tuple(type(s) for s in scalars) == SCALARS[self.name], f"{self.name} scalars {scalars}"
        for a, (dtype, size) in zip((src, dst), buffers(self.name, self.n, scalars), strict=True):
            assert type(a) is _Device and a.dtype == dtype and a.flags.c_contiguous, \
                f"{self.name}<{self.n}> wants contiguous device {np.dtype(dtype)}, got {type(a).__name__} {a.dtype}"
            assert a.size == size, f"{self.name}<{self.n}> addresses {size} elements of a buffer of {a.size}"
        values = [ctypes.c_float(s) if type(s) is np.float32 else int(s) for s in scalars]
        assert self.run(self.n, ctypes.c_void_p(src.data.ptr), ctypes.c_void_p(dst.data.ptr), *values) == 0
        self.log[self.name] += 1


def fake_cupy(log):
    """The CuPy that fbfft's GPU branch and the reference check use, on host memory. Every array
    it makes is kept in cp.allocations, the "device memory" the GEMM's bounds check knows."""
    cp = types.ModuleType("cupy")
    cp.ndarray, cp.allocations = _Device, []

    def allocate(a):
        cp.allocations.append(a.view(_Device))
        return cp.allocations[-1]
    cp.empty = lambda shape, dtype: allocate(np.full(shape, np.nan, dtype))   # poisoned
    cp.asarray = lambda a: allocate(np.array(a))
    cp.asnumpy = np.asarray

    def synchronize():
        log["sync"] += 1
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, deviceSynchronize=synchronize),
        device=types.SimpleNamespace(get_cublas_handle=lambda: 0))
    return cp


def checked_cublas(allocations):
    """cublasGemmStridedBatchedEx: cuBLAS's own check of the leading dimensions, a bounds check of
    the memory each batch of matrices spans (on the GPU a fault, or silent corruption), then
    test_cgemm's model."""
    def gemm(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB,
             beta, C, Ctype, ldc, strideC, count, compute, algo):
        item = {0: 4, 4: 8}[Ctype]                          # CUDA_R_32F, CUDA_C_32F
        for name, ptr, (rows, cols), ld, stride in (     # stored column-major: op(M) transposed if op
                ("A", A, (m, k) if transa == 0 else (k, m), lda, strideA),
                ("B", B, (k, n) if transb == 0 else (n, k), ldb, strideB),
                ("C", C, (m, n), ldc, strideC)):
            assert ld >= max(1, rows), f"cuBLAS refuses ld{name} = {ld} for {rows} rows"
            end = ptr + ((count - 1) * stride + (cols - 1) * ld + rows) * item
            assert any(a.ctypes.data <= ptr and end <= a.ctypes.data + a.nbytes for a in allocations), \
                f"{name} spans memory outside every allocation"
        _gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype,
                                 ldb, strideB, beta, C, Ctype, ldc, strideC, count, compute, algo)
    return gemm


def clear_caches():
    """The caches that hold launchers (and so the emulated kernels) or plans across tests."""
    for cached in (fbfft_kernels._launcher, fbfft_kernels.rfft2_launcher, fbfft_kernels.irfft2_launcher,
                   fbfft._plan_cached, cgemm._gemm_plan):
        cached.cache_clear()


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """fbfft.cu compiled for the host as a shared library (skips without g++)."""
    return host_library(tmp_path_factory, "fbfft_emu",
                        EMULATION.replace("KERNEL_PATH", str(KERNEL_DIR / "fbfft.cu")),
                        ("-std=c++20", "-pthread", "-Wno-unknown-pragmas"))


@pytest.fixture
def gpu_branch(monkeypatch, emulated):
    """Installs the fake CuPy and cuBLAS; yields the counts of launches and syncs."""
    log = collections.Counter()
    cp = fake_cupy(log)
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = types.SimpleNamespace(gemmStridedBatchedEx=checked_cublas(cp.allocations))
    for name, module in (("cupy", cp), ("cupy_backends", types.ModuleType("cupy_backends")),
                         ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                         ("cupy_backends.cuda.libs", libs), ("cupy_backends.cuda.libs.cublas", libs.cublas)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(device, "_cupy", cp)
    monkeypatch.setattr(fbfft_kernels, "kernel", lambda name, n: EmulatedKernel(emulated, name, n, log))
    monkeypatch.setattr(fbfft, "_PAIRS", {})
    clear_caches()
    GEMM_CALLS.clear()
    yield log
    clear_caches()


def data(rng, S, f, fo, h, w, kh, kw):
    return (rng.standard_normal((S, f, h, w)).astype(np.float32),
            rng.standard_normal((fo, f, kh, kw)).astype(np.float32))


def counts(log):
    return {k: log[k] for k in ("rfft2", "irfft2", "sync")} | {"gemm": len(GEMM_CALLS)}


CASES = [  # (S, f, f', h, w, kh, kw, padding), basis in the comment
    (4, 2, 2, 1, 1, 1, 1, (0, 0)),        # 2
    (2, 2, 3, 4, 3, 2, 2, (0, 0)),        # 4, rectangular input
    (2, 3, 2, 5, 6, 3, 3, (1, 1)),        # 8
    (1, 1, 1, 5, 5, 5, 5, (0, 0)),        # 8, kernel = input, one plane
    (2, 3, 4, 9, 11, 3, 5, (0, 0)),       # 16, rectangular kernel
    (3, 2, 5, 13, 12, 4, 3, (1, 2)),      # 16, asymmetric padding
    (2, 2, 3, 7, 6, 2, 2, (3, 1)),        # 16, padding larger than the kernel
    (2, 5, 3, 20, 17, 5, 4, (2, 1)),      # 32, x and w fill a block and part of a second
    (2, 3, 2, 60, 60, 9, 9, (0, 0)),      # 64, rows split over two threads
    (1, 2, 2, 100, 70, 9, 9, (2, 2)),     # 128, the largest, one plane a block
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[3]}x{c[4]}-k{c[5]}x{c[6]}-p{c[7][0]},{c[7][1]}" for c in CASES])
def test_three_passes_match_the_reference(gpu_branch, rng, case):
    x, w = data(rng, *case[:7])
    check_backend(fbfft, x, w, (1, 1), case[7], device="cuda", rng=rng)
    # fprop FFTs w and x, bprop w and gy, accGrad gy and x; one GEMM and one inverse each
    assert counts(gpu_branch) == {"rfft2": 6, "irfft2": 3, "sync": 0, "gemm": 3}


def test_the_cases_cover_every_basis_size():
    assert {fbfft.basis(geometry((S, f, h, w), (fo, f, kh, kw), 1, pad))
            for S, f, fo, h, w, kh, kw, pad in CASES} == set(fbfft_plan.SIZES)


def test_chunked_batch(gpu_branch, monkeypatch, rng, settings):
    """One image per chunk: slices of x, gy, y and gx launched by pointer, accGrad's GEMMs summed
    in place (beta = 1), and each launch followed by a sync under config.override(fbfft_check=True)."""
    settings(fbfft_workspace_mb=2**-20)
    settings(fbfft_check=True)
    x, w = data(rng, 3, 2, 4, 10, 7, 3, 2)
    assert len(fbfft._plan(x.shape, w.shape, (1, 1), (2, 1))[2]) == 3
    check_backend(fbfft, x, w, (1, 1), (2, 1), device="cuda", rng=rng)
    # w once per pass that needs it, x and gy once per chunk; an inverse per chunk but accGrad's
    rfft2, irfft2 = 2 + 4 * 3, 2 * 3 + 1
    assert counts(gpu_branch) == {"rfft2": rfft2, "irfft2": irfft2, "sync": rfft2 + irfft2, "gemm": 9}


def test_one_step_reuses_its_spectra(gpu_branch, rng):
    """Inside reuse_spectra(): bprop takes fprop's weight spectrum, accGrad fprop's input spectrum
    (at the padding offset) and bprop's gradient spectrum: three forward FFTs instead of six."""
    pad = (2, 1)
    x, w = data(rng, 2, 3, 4, 11, 9, 3, 4)
    with backends.reuse_spectra() as cache:
        check_backend(fbfft, x, w, (1, 1), pad, device="cuda", rng=rng)
        assert len(cache) == 0, f"spectra kept but never reused (hits: {cache.hit_keys})"
    n = fbfft.basis(geometry(x.shape, w.shape, 1, pad))
    assert cache.hit_keys == [Key("fbfft", "w", (n, n), (0, 0)), Key("fbfft", "gy", (n, n), (0, 0)),
                              Key("fbfft", "x", (n, n), pad)]
    assert (cache.hits, cache.misses) == (3, 3)
    assert counts(gpu_branch) == {"rfft2": 3, "irfft2": 3, "sync": 0, "gemm": 3}


def test_a_spectrum_too_small_for_the_output_is_refused(gpu_branch):
    """The GPU inverse takes its plane count from `out`; a spectrum that does not hold that many
    planes (a misuse: an array reshaped inside reuse_spectra()) raises instead of being read past."""
    import cupy as cp   # the fake one
    fft, ifft = fbfft._kernels(cp)
    n = 8
    F = cp.empty((fbfft_plan.stored_frequencies(n), 2, 3), np.complex64)     # 6 planes
    out = cp.empty((2, 4, 5, 5), np.float32)                              # 8 planes
    with pytest.raises(ValueError, match=r"cannot fill 8 output planes of basis 8"):
        ifft(F, n, (0, 0), out)
    assert gpu_branch["irfft2"] == 0
