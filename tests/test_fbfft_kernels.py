"""fbfft kernels: the NumPy emulator (fbfft's CPU path) and the CUDA source compiled for the
host, against np.fft (CPU); the CUDA kernels against cuFFT through cupy.fft (gpu marker).

Spectra fed to the inverse are always rfft2 of real planes: the kernels read each
spectrum as Hermitian-consistent (see fbfft.cu), as cuFFT's C2R also assumes.
"""
import ctypes
import re
import sys

import numpy as np
import pytest

from minitorch_fft.backends import fbfft_emulator, fbfft_kernels, fbfft_plan
from minitorch_fft.backends.common import KERNEL_DIR
from conftest import host_library


def geometries(n):
    """(B, h, w, pad_top, pad_left): the whole plane; a batch that leaves the last block
    partly empty, with an off-centre, non-square input; one pixel in the far corner."""
    planes = fbfft_plan.plan(n).planes
    h, w = max(1, n - 3), n // 2 + 1
    return [(5, n, n, 0, 0),
            (2 * planes + 3, h, w, min(2, n - h), min(1, n - w)),
            (3, 1, 1, n - 1, n - 1)]


CASES = [(n,) + g for n in fbfft_plan.SIZES for g in geometries(n)]
CASE_IDS = [f"n{n}-B{B}-{h}x{w}-at{t},{l}" for n, B, h, w, t, l in CASES]
TOL = 1e-5  # relative (norm-wise) error in float32; an FFT of size 64 reaches ~1e-7


def padded(x, n, top, left):
    P = np.zeros(x.shape[:1] + (n, n), dtype=np.float64)
    P[:, top:top + x.shape[1], left:left + x.shape[2]] = x
    return P


def rel_err(got, ref):
    got = np.asarray(got)
    assert np.all(np.isfinite(got)), "non-finite values: an element was never written"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def spectrum_case(rng, n, B):
    """A Hermitian-consistent spectrum in the kernels' (nf, B) layout and its real planes (B, n, n)."""
    planes = rng.standard_normal((B, n, n))
    full = np.fft.rfft2(planes).transpose(1, 2, 0)
    return np.ascontiguousarray(fbfft_plan.compact(full, n), dtype=np.complex64), planes


def windows(n):
    """(out_h, out_w, row_off, col_off): whole plane, an interior window, a corner pixel."""
    return [(n, n, 0, 0), (n - 3, n // 2 + 1, 2, 1) if n > 4 else (1, 2, 1, 0),
            (1, 1, n - 1, n - 1)]


# ---- NumPy emulator, fbfft's CPU path -------------------------------------------------

@pytest.mark.parametrize("n,B,h,w,top,left", CASES, ids=CASE_IDS)
def test_emulator_rfft2_matches_numpy(rng, n, B, h, w, top, left):
    x = rng.standard_normal((B, h, w)).astype(np.float32)
    F = fbfft_emulator.rfft2(x, n, (top, left))  # asserts every output written exactly once
    ref = np.fft.rfft2(padded(x, n, top, left)).transpose(1, 2, 0)
    assert F.shape == (n * n // 2 + 2, B) and F.dtype == np.complex64
    assert rel_err(F, fbfft_plan.compact(ref, n)) < TOL
    assert rel_err(fbfft_plan.expand(F, n), ref) < TOL


@pytest.mark.parametrize("n", fbfft_plan.SIZES)
def test_emulator_irfft2_matches_numpy(rng, n):
    B = fbfft_plan.plan(n).planes + 1
    F, planes = spectrum_case(rng, n, B)
    for oh, ow, ro, co in windows(n):
        y = fbfft_emulator.irfft2(F, n, (oh, ow), (ro, co))  # asserts every output written once
        ref = planes[:, ro:ro + oh, co:co + ow]
        assert y.shape == (B, oh, ow) and y.dtype == np.float32
        assert rel_err(y, ref) < TOL
    y = fbfft_emulator.irfft2(F, n, scale=1.0)
    assert rel_err(y, planes * n * n) < TOL


def test_emulator_is_the_algorithm_not_numpy(rng):
    """Guard against an emulator that only wraps np.fft: it must use bit-reversed registers."""
    v = [np.array([k], dtype=np.complex64) for k in range(8)]
    fbfft_emulator.dif_fft(v, False)
    X = np.fft.fft(np.arange(8))
    got = np.array([v[fbfft_emulator.bit_reverse(k, 3)][0] for k in range(8)])
    assert np.allclose(got, X, atol=1e-5)
    assert not np.allclose([v[k][0] for k in range(8)], X, atol=1e-3)


@pytest.mark.parametrize("n", fbfft_plan.SIZES)
def test_shared_memory_bank_conflicts_as_documented(n):
    want = {"columns": 1, "rows": 1}
    assert fbfft_plan.bank_conflicts(n) == want


def test_twiddle_table_in_source_matches_plan():
    src = (KERNEL_DIR / "fbfft.cu").read_text()
    body = src[src.index("kTwiddle[kTwiddleN] = {"):]
    body = body[:body.index("};")]
    vals = [float(v) for v in re.findall(r"(-?\d\.\d+e[-+]\d+)f", body)]
    table = np.array(vals, dtype=np.float32).reshape(-1, 2)
    want = fbfft_plan.twiddle_table()
    assert table.shape == (fbfft_plan.TWIDDLE_N, 2)
    assert np.array_equal(table[:, 0], want.real) and np.array_equal(table[:, 1], want.imag)


def test_instantiated_sizes_match_wrapper():
    """fbfft.cu's explicit-instantiation list (nvcc checks) = the wrapper's name expressions."""
    src = (KERNEL_DIR / "fbfft.cu").read_text()
    block = src[src.index("// BEGIN SIZES"):src.index("// END SIZES")]
    sizes = tuple(int(v) for v in re.findall(r"FBFFT_INSTANTIATE\((\d+)\)", block))
    block1 = src[src.index("// BEGIN 1D SIZES"):src.index("// END 1D SIZES")]
    sizes1 = tuple(int(v) for v in re.findall(r"FBFFT_INSTANTIATE_1D\((\d+)\)", block1))
    assert sizes == fbfft_plan.SIZES and sizes1 == fbfft_plan.SIZES_1D
    assert fbfft_kernels.NAME_EXPRESSIONS == tuple(
        f"fbfft_{name}<{n}>" for name in ("rfft2", "irfft2") for n in sizes) + tuple(
        f"fbfft_{name}<{n}>" for name in ("rfft1", "irfft1") for n in sizes1)


@pytest.mark.parametrize("bad", [1, 3, 12, 256, 512])
def test_unsupported_size_raises(bad):
    x = np.zeros((1, 1, 1), dtype=np.float32)
    calls = [lambda: fbfft_plan.plan(bad), lambda: fbfft_emulator.rfft2(x, bad),
             lambda: fbfft_kernels.rfft2(x, bad), lambda: fbfft_kernels.kernel("rfft2", bad),
             lambda: fbfft_kernels.irfft2(x, bad)]
    if bad not in fbfft_plan.SIZES_1D:
        calls += [lambda: fbfft_plan.plan1(bad), lambda: fbfft_emulator.rfft1(x[0], bad),
                  lambda: fbfft_kernels.rfft1(x[0], bad), lambda: fbfft_kernels.kernel("irfft1", bad)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"size {bad}\b.*supported sizes are"):
            call()


def test_emulator_rejects_inputs_that_do_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        fbfft_emulator.rfft2(np.zeros((1, 8, 8), np.float32), 8, (1, 0))
    with pytest.raises(ValueError, match="does not fit"):
        fbfft_emulator.irfft2(np.zeros((34, 1), np.complex64), 8, (8, 8), (0, 1))
    with pytest.raises(ValueError, match=r"spectrum must have shape \(34, B\)"):
        fbfft_emulator.irfft2(np.zeros((8, 5, 1), np.complex64), 8)


@pytest.mark.parametrize("n", fbfft_plan.SIZES)
def test_compact_layout(n):
    """nf = n^2/2 + 2 values stored: every (ky, kx) of the half-spectrum but the conjugate
    duplicates in columns 0 and n/2; row_base places them as fbfft.cu does; expand undoes
    compact on any Hermitian-consistent spectrum."""
    nf = fbfft_plan.stored_frequencies(n)
    stored = fbfft_plan._stored(n)
    assert len(stored) == nf == n * n // 2 + 2
    assert [int(fbfft_plan.row_base(n, ky)) + kx for ky, kx in stored] == list(range(nf))
    full = np.fft.rfft2(np.random.default_rng(n).standard_normal((3, n, n))).transpose(1, 2, 0)
    np.testing.assert_allclose(fbfft_plan.expand(fbfft_plan.compact(full, n), n), full, atol=1e-9)


# ---- the CUDA source itself, compiled for the host (CPU) ---------------------------
# A small shim maps the CUDA features fbfft.cu uses onto C++20: one std::thread per CUDA
# thread, __syncthreads as a std::barrier, __shared__ as a static (one block at a time).
# The kernels run unmodified, so this checks the real index arithmetic, not a copy.

EMULATION = r"""
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__
#define __shared__ static
#define __launch_bounds__(...)
#define FBFFT_SHARED_BUFFER(name) static float2 name[1 << 14]
struct float2 { float x, y; };
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct Dim { unsigned x = 0, y = 0, z = 0; };
static thread_local Dim threadIdx, blockIdx;
static Dim blockDim, gridDim;
static std::barrier<>* emu_barrier = nullptr;
static inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
[[noreturn]] static inline void __trap() { std::fprintf(stderr, "__trap\n"); std::abort(); }
#include "KERNEL_PATH"

template <class F> static void launch(unsigned grid, unsigned block, F kernel) {
    gridDim.x = grid; blockDim.x = block;
    for (unsigned bx = 0; bx < grid; ++bx) {
        std::barrier<> bar(block); emu_barrier = &bar;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t)
            ts.emplace_back([=] { threadIdx.x = t; blockIdx.x = bx; kernel(); });
        for (auto& th : ts) th.join();
    }
}
template <int N> static void plan(int* v) {
    using P = fbfft::Plan<N>;
    int vals[] = {P::kSplit, P::kPlanes, P::kThreads, P::kColStride, P::kRowStride, P::kSmemElems, P::kSmemBytes,
                  P::kStageOut};
    for (int i = 0; i < 8; ++i) v[i] = vals[i];
}
template <int N> static void plan1(int* v) {
    using P = fbfft::Plan1<N>;
    int vals[] = {P::kL, P::kSplit, P::kM, P::kSignals, P::kThreads, P::kRow, P::kSmemBytes};
    for (int i = 0; i < 7; ++i) v[i] = vals[i];
}
template <int N> static void fwd1(const float* in, float* out, int B, int len, int pad) {
    using P = fbfft::Plan1<N>;
    launch((B + P::kSignals - 1) / P::kSignals, P::kThreads,
           [=] { fbfft_rfft1<N>(in, (float2*)out, B, len, pad); });
}
template <int N> static void inv1(const float* in, float* out, int B, int off, int len, float s) {
    using P = fbfft::Plan1<N>;
    launch((B + P::kSignals - 1) / P::kSignals, P::kThreads,
           [=] { fbfft_irfft1<N>((const float2*)in, out, B, off, len, s); });
}
template <int N> static void fwd(const float* in, float* out, int B, int h, int w, int t, int l) {
    using P = fbfft::Plan<N>;
    launch((B + P::kPlanes - 1) / P::kPlanes, P::kThreads,
           [=] { fbfft_rfft2<N>(in, (float2*)out, B, h, w, t, l); });
}
template <int N> static void inv(const float* in, float* out, int B, int ro, int co, int oh, int ow, float s) {
    using P = fbfft::Plan<N>;
    launch((B + P::kPlanes - 1) / P::kPlanes, P::kThreads,
           [=] { fbfft_irfft2<N>((const float2*)in, out, B, ro, co, oh, ow, s); });
}
#define DISPATCH(CALL) switch (n) { case 2: CALL(2); break; case 4: CALL(4); break; \
    case 8: CALL(8); break; case 16: CALL(16); break; case 32: CALL(32); break; \
    case 64: CALL(64); break; case 128: CALL(128); break; default: return 1; } return 0;
#define DISPATCH1(CALL) switch (n) { case 2: CALL(2); break; case 4: CALL(4); break; \
    case 8: CALL(8); break; case 16: CALL(16); break; case 32: CALL(32); break; \
    case 64: CALL(64); break; case 128: CALL(128); break; case 256: CALL(256); break; \
    default: return 1; } return 0;
extern "C" int emu_plan(int n, int* v) {
#define C(N) plan<N>(v)
    DISPATCH(C)
#undef C
}
extern "C" int emu_rfft2(int n, const float* in, float* out, int B, int h, int w, int t, int l) {
#define C(N) fwd<N>(in, out, B, h, w, t, l)
    DISPATCH(C)
#undef C
}
extern "C" int emu_irfft2(int n, const float* in, float* out, int B, int ro, int co, int oh, int ow, float s) {
#define C(N) inv<N>(in, out, B, ro, co, oh, ow, s)
    DISPATCH(C)
#undef C
}
extern "C" int emu_plan1(int n, int* v) {
#define C(N) plan1<N>(v)
    DISPATCH1(C)
#undef C
}
extern "C" int emu_rfft1(int n, const float* in, float* out, int B, int len, int pad) {
#define C(N) fwd1<N>(in, out, B, len, pad)
    DISPATCH1(C)
#undef C
}
extern "C" int emu_irfft1(int n, const float* in, float* out, int B, int off, int len, float s) {
#define C(N) inv1<N>(in, out, B, off, len, s)
    DISPATCH1(C)
#undef C
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """fbfft.cu compiled for the host as a shared library (skips without g++)."""
    return host_library(tmp_path_factory, "fbfft_emu",
                        EMULATION.replace("KERNEL_PATH", str(KERNEL_DIR / "fbfft.cu")),
                        ("-std=c++20", "-pthread", "-Wno-unknown-pragmas"))


def _ptr(a):
    assert a.flags.c_contiguous
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("n", fbfft_plan.SIZES)
def test_emulated_plan_matches_fbfft_plan(emulated, n):
    v = (ctypes.c_int * 8)()
    assert emulated.emu_plan(n, v) == 0
    p = fbfft_plan.plan(n)
    assert list(v) == [p.split, p.planes, p.threads, p.col_stride, p.row_stride, p.smem_elems, p.smem_bytes,
                       int(p.stage_out)]


@pytest.mark.parametrize("n,B,h,w,top,left", CASES, ids=CASE_IDS)
def test_emulated_rfft2_matches_numpy(emulated, rng, n, B, h, w, top, left):
    x = rng.standard_normal((B, h, w)).astype(np.float32)
    F = np.full((n * n // 2 + 2, B), np.nan, dtype=np.complex64)  # poisoned
    assert emulated.emu_rfft2(n, _ptr(x), _ptr(F), B, h, w, top, left) == 0
    ref = np.fft.rfft2(padded(x, n, top, left)).transpose(1, 2, 0)
    assert rel_err(F, fbfft_plan.compact(ref, n)) < TOL


@pytest.mark.parametrize("n", fbfft_plan.SIZES)
def test_emulated_irfft2_matches_numpy(emulated, rng, n):
    B = fbfft_plan.plan(n).planes + 1
    F, planes = spectrum_case(rng, n, B)
    for oh, ow, ro, co in windows(n):
        y = np.full((B, oh, ow), np.nan, dtype=np.float32)  # poisoned
        assert emulated.emu_irfft2(n, _ptr(F), _ptr(y), B, ro, co, oh, ow,
                                   ctypes.c_float(1.0 / (n * n))) == 0
        assert rel_err(y, planes[:, ro:ro + oh, co:co + ow]) < TOL


# ---- CUDA kernels against cuFFT (GPU) ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n,B,h,w,top,left", CASES, ids=CASE_IDS)
def test_cuda_rfft2_matches_cufft(n, B, h, w, top, left, fresh_rng):
    import cupy as cp
    rng = fresh_rng  # fresh data every run, its seed in the report
    x = cp.asarray(rng.standard_normal((B, h, w)).astype(np.float32))
    out = cp.full((n * n // 2 + 2, B), np.nan, dtype=np.complex64)  # poisoned
    F = fbfft_kernels.rfft2(x, n, (top, left), out=out)
    cp.cuda.runtime.deviceSynchronize()
    P = cp.zeros((B, n, n), dtype=np.float32)
    P[:, top:top + h, left:left + w] = x
    ref = cp.fft.rfft2(P).transpose(1, 2, 0)
    assert F is out
    assert rel_err(cp.asnumpy(F), fbfft_plan.compact(cp.asnumpy(ref), n)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("n", fbfft_plan.SIZES)
def test_cuda_irfft2_matches_cufft(n, fresh_rng):
    import cupy as cp
    rng = fresh_rng
    B = 3 * fbfft_plan.plan(n).planes + 5
    planes = cp.asarray(rng.standard_normal((B, n, n)).astype(np.float32))
    spec = cp.fft.rfft2(planes)                                    # (B, n, nh)
    F = cp.asarray(fbfft_plan.compact(cp.asnumpy(spec.transpose(1, 2, 0)), n).astype(np.complex64))
    full = cp.fft.irfft2(spec, s=(n, n))
    for oh, ow, ro, co in windows(n):
        out = cp.full((B, oh, ow), np.nan, dtype=np.float32)       # poisoned
        y = fbfft_kernels.irfft2(F, n, (oh, ow), (ro, co), out=out)
        cp.cuda.runtime.deviceSynchronize()
        assert rel_err(cp.asnumpy(y), cp.asnumpy(full[:, ro:ro + oh, co:co + ow])) < TOL


@pytest.mark.gpu
def test_cuda_round_trip_large_batch():
    import cupy as cp
    x = cp.random.standard_normal((70001, 13, 13), dtype=np.float32)
    y = fbfft_kernels.irfft2(fbfft_kernels.rfft2(x, 16, (1, 2)), 16, (13, 13), (1, 2))
    assert rel_err(cp.asnumpy(y), cp.asnumpy(x)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rfft2", "irfft2"])
@pytest.mark.parametrize("n", fbfft_plan.SIZES)
def test_cuda_kernels_live_in_registers(name, n):
    k = fbfft_kernels.kernel(name, n)
    assert k.local_size_bytes == 0, f"fbfft_{name}<{n}> uses local memory (spills)"
    assert k.max_threads_per_block >= fbfft_plan.plan(n).threads


@pytest.mark.gpu
def test_cuda_rejects_bad_arguments():
    import cupy as cp
    x = cp.zeros((4, 8, 8), dtype=cp.float32)
    with pytest.raises(ValueError, match="does not fit"):
        fbfft_kernels.rfft2(x, 8, (1, 0))
    with pytest.raises(TypeError, match="float32"):
        fbfft_kernels.rfft2(x.astype(cp.float64), 8)
    with pytest.raises(ValueError, match="C-contiguous"):
        fbfft_kernels.rfft2(x.transpose(0, 2, 1), 8)
    F = cp.zeros((34, 4), dtype=cp.complex64)
    with pytest.raises(ValueError, match="does not fit"):
        fbfft_kernels.irfft2(F, 8, (8, 8), (0, 1))
    with pytest.raises(ValueError, match="shape"):
        fbfft_kernels.irfft2(F, 16)
    with pytest.raises(ValueError, match="out must have shape"):
        fbfft_kernels.rfft2(x, 8, out=cp.empty((34, 3), cp.complex64))


# ---- 1-D kernels: NumPy emulator and host-compiled source against np.fft (CPU), CUDA against cuFFT (GPU) ----

def geometries1(n):
    """(B, len, pad): the whole signal; a batch that leaves the last block partly empty, with an
    off-centre input; one sample at the far end."""
    signals = fbfft_plan.plan1(n).signals
    length = max(1, n - 3)
    return [(5, n, 0), (signals + 3, length, min(2, n - length)), (3, 1, n - 1)]


CASES_1D = [(n,) + g for n in fbfft_plan.SIZES_1D for g in geometries1(n)]
CASE_IDS_1D = [f"n{n}-B{B}-len{ln}-at{p}" for n, B, ln, p in CASES_1D]


def windows1(n):
    """(out_len, offset): the whole signal, an interior window, the last sample."""
    return [(n, 0), (max(1, n - 3), min(1, n - 1)), (1, n - 1)]


def signal_spectrum_case(rng, n, B):
    signals = rng.standard_normal((B, n))
    return np.ascontiguousarray(np.fft.rfft(signals, axis=1).T, dtype=np.complex64), signals


def padded1(x, n, pad):
    P = np.zeros((x.shape[0], n))
    P[:, pad:pad + x.shape[1]] = x
    return P


@pytest.mark.parametrize("n,B,length,pad", CASES_1D, ids=CASE_IDS_1D)
def test_emulator_rfft1_matches_numpy(rng, n, B, length, pad):
    x = rng.standard_normal((B, length)).astype(np.float32)
    assert rel_err(fbfft_emulator.rfft1(x, n, pad), np.fft.rfft(padded1(x, n, pad), axis=1).T) < TOL


@pytest.mark.parametrize("n", fbfft_plan.SIZES_1D)
def test_emulator_irfft1_matches_numpy(rng, n):
    F, signals = signal_spectrum_case(rng, n, 7)
    for out_len, off in windows1(n):
        assert rel_err(fbfft_emulator.irfft1(F, n, out_len, off), signals[:, off:off + out_len]) < TOL


@pytest.mark.parametrize("n", fbfft_plan.SIZES_1D)
def test_emulated_plan1_matches_fbfft_plan(emulated, n):
    v = (ctypes.c_int * 7)()
    assert emulated.emu_plan1(n, v) == 0
    p = fbfft_plan.plan1(n)
    assert list(v) == [p.L, p.split, p.m, p.signals, p.threads, p.row, p.smem_bytes]


@pytest.mark.parametrize("n,B,length,pad", CASES_1D, ids=CASE_IDS_1D)
def test_emulated_rfft1_matches_numpy(emulated, rng, n, B, length, pad):
    x = rng.standard_normal((B, length)).astype(np.float32)
    F = np.full((n // 2 + 1, B), np.nan, dtype=np.complex64)  # poisoned
    assert emulated.emu_rfft1(n, _ptr(x), _ptr(F), B, length, pad) == 0
    assert rel_err(F, np.fft.rfft(padded1(x, n, pad), axis=1).T) < TOL


@pytest.mark.parametrize("n", fbfft_plan.SIZES_1D)
def test_emulated_irfft1_matches_numpy(emulated, rng, n):
    B = fbfft_plan.plan1(n).signals + 1
    F, signals = signal_spectrum_case(rng, n, B)
    for out_len, off in windows1(n):
        y = np.full((B, out_len), np.nan, dtype=np.float32)  # poisoned
        assert emulated.emu_irfft1(n, _ptr(F), _ptr(y), B, off, out_len, ctypes.c_float(1.0 / n)) == 0
        assert rel_err(y, signals[:, off:off + out_len]) < TOL


def test_emulator_1d_rejects_inputs_that_do_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        fbfft_emulator.rfft1(np.zeros((1, 8), np.float32), 8, 1)
    with pytest.raises(ValueError, match="does not fit"):
        fbfft_emulator.irfft1(np.zeros((5, 1), np.complex64), 8, 8, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("n,B,length,pad", CASES_1D, ids=CASE_IDS_1D)
def test_cuda_rfft1_matches_cufft(n, B, length, pad, fresh_rng):
    import cupy as cp
    rng = fresh_rng  # fresh data every run, its seed in the report
    x = cp.asarray(rng.standard_normal((B, length)).astype(np.float32))
    out = cp.full((n // 2 + 1, B), np.nan, dtype=np.complex64)  # poisoned
    F = fbfft_kernels.rfft1(x, n, pad, out=out)
    cp.cuda.runtime.deviceSynchronize()
    P = cp.zeros((B, n), dtype=np.float32)
    P[:, pad:pad + length] = x
    assert F is out
    assert rel_err(cp.asnumpy(F), cp.asnumpy(cp.fft.rfft(P, axis=1).T)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("n", fbfft_plan.SIZES_1D)
def test_cuda_irfft1_matches_cufft(n, fresh_rng):
    import cupy as cp
    rng = fresh_rng
    B = 3 * fbfft_plan.plan1(n).signals + 5
    signals = cp.asarray(rng.standard_normal((B, n)).astype(np.float32))
    F = cp.ascontiguousarray(cp.fft.rfft(signals, axis=1).T).astype(cp.complex64)
    for out_len, off in windows1(n):
        out = cp.full((B, out_len), np.nan, dtype=np.float32)  # poisoned
        y = fbfft_kernels.irfft1(F, n, out_len, off, out=out)
        cp.cuda.runtime.deviceSynchronize()
        assert rel_err(cp.asnumpy(y), cp.asnumpy(signals[:, off:off + out_len])) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rfft1", "irfft1"])
@pytest.mark.parametrize("n", fbfft_plan.SIZES_1D)
def test_cuda_1d_kernels_live_in_registers(name, n):
    k = fbfft_kernels.kernel(name, n)
    assert k.local_size_bytes == 0, f"fbfft_{name}<{n}> uses local memory (spills)"
    assert k.max_threads_per_block >= fbfft_plan.plan1(n).threads


def test_launchers_check_their_sizes_before_touching_the_gpu():
    """fbfft's passes launch through rfft2_launcher / irfft2_launcher, which check a geometry once
    and are cached: a misfit must raise there, naming the limit (no CuPy needed to see it)."""
    with pytest.raises(ValueError, match=r"input 9x8 at offset \(0, 0\) does not fit the 8x8 basis"):
        fbfft_kernels.rfft2_launcher(8, 1, 9, 8, (0, 0))
    with pytest.raises(ValueError, match="exceeds the kernels' int32 batch index"):
        fbfft_kernels.rfft2_launcher(8, 2**31, 8, 8, (0, 0))
    with pytest.raises(ValueError, match=r"output window 4x4 at \(5, 0\) does not fit the 8x8 basis"):
        fbfft_kernels.irfft2_launcher(8, 3, (4, 4), (5, 0))
    with pytest.raises(ValueError, match=r"size 12\b.*supported sizes are"):
        fbfft_kernels.irfft2_launcher(12, 3, (4, 4), (0, 0))


class _DeviceArray(np.ndarray):
    """Stands for a CuPy array in the wrapper test below."""


def test_wrappers_allocate_check_and_launch_with_the_kernels_arguments(monkeypatch):
    """rfft2 / irfft2 / rfft1 / irfft1 on the CPU with CuPy and the launch faked: each wrapper
    allocates (or checks) its output and hands the launch the scalars in the order of the
    kernel's signature (kernels/fbfft.cu), which only a GPU run would otherwise show."""
    import types
    launches = []

    def launcher(name, n, B, scalars):
        return lambda src, dst: launches.append((name, n, B, tuple(float(v) for v in scalars), src, dst))
    fake_cupy = types.SimpleNamespace(empty=lambda shape, dtype: np.empty(shape, dtype).view(_DeviceArray))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(fbfft_kernels, "is_cupy", lambda a: isinstance(a, _DeviceArray))
    monkeypatch.setattr(fbfft_kernels, "_launcher", launcher)
    for cached in (fbfft_kernels.rfft2_launcher, fbfft_kernels.irfft2_launcher):
        cached.cache_clear()
    try:
        dev = lambda shape, dtype: np.zeros(shape, dtype).view(_DeviceArray)  # noqa: E731
        x = dev((2, 3, 5, 6), np.float32)
        F = fbfft_kernels.rfft2(x, 8, (1, 2))
        assert (F.shape, F.dtype) == ((34, 6), np.complex64)
        assert launches[-1][:4] == ("rfft2", 8, 6, (6, 5, 6, 1, 2)) and launches[-1][4] is x and launches[-1][5] is F
        y = fbfft_kernels.irfft2(F, 8, (4, 5), (1, 2))
        assert (y.shape, y.dtype) == ((6, 4, 5), np.float32)
        assert launches[-1][:4] == ("irfft2", 8, 6, (6, 1, 2, 4, 5, 1 / 64)) and launches[-1][5] is y
        out = dev((6, 4, 5), np.float32)
        assert fbfft_kernels.irfft2(F, 8, (4, 5), (1, 2), scale=0.5, out=out) is out
        assert launches[-1][3][-1] == 0.5
        with pytest.raises(ValueError, match=r"out must have shape \(6, 4, 5\)"):
            fbfft_kernels.irfft2(F, 8, (4, 5), (1, 2), out=dev((6, 5, 4), np.float32))
        with pytest.raises(TypeError, match="out must be complex64"):
            fbfft_kernels.rfft2(x, 8, (1, 2), out=dev((34, 6), np.float32))
        s = dev((3, 7), np.float32)
        F1 = fbfft_kernels.rfft1(s, 16, 2)
        assert (F1.shape, F1.dtype) == ((9, 3), np.complex64) and launches[-1][:4] == ("rfft1", 16, 3, (3, 7, 2))
        y1 = fbfft_kernels.irfft1(F1, 16, 10, 3)
        assert (y1.shape, y1.dtype) == ((3, 10), np.float32)
        assert launches[-1][:4] == ("irfft1", 16, 3, (3, 3, 10, 1 / 16))
        assert len(launches) == 5      # the refused calls launched nothing
    finally:
        for cached in (fbfft_kernels.rfft2_launcher, fbfft_kernels.irfft2_launcher):
            cached.cache_clear()
