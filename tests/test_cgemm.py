"""backends.cgemm: the FFT backends' GEMM in strict fp32 (default) or TF32, and its switch."""
import ctypes
import sys
import types

import numpy as np
import pytest

from minitorch_fft.backends import cgemm


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    """Each test starts from the environment's setting and leaves no process setting behind."""
    cgemm.set_tf32(None)
    monkeypatch.delenv(cgemm.ENV, raising=False)
    yield
    cgemm.set_tf32(None)


GPU = object()  # stands for cupy where only `xp is not numpy` matters


def test_default_is_strict_and_the_environment_switches_it(monkeypatch):
    assert not cgemm.tf32_enabled() and cgemm.mode(GPU) == "fp32"
    monkeypatch.setenv(cgemm.ENV, "1")
    assert cgemm.tf32_enabled() and cgemm.mode(GPU) == "tf32"
    monkeypatch.setenv(cgemm.ENV, "0")
    assert cgemm.mode(GPU) == "fp32"
    monkeypatch.setenv(cgemm.ENV, "yes")
    with pytest.raises(ValueError, match="MINITORCH_CGEMM_TF32='yes' is not allowed: it takes 0 or 1"):
        cgemm.tf32_enabled()


def test_context_manager_sets_and_restores_the_mode(monkeypatch):
    with cgemm.tf32():
        assert cgemm.mode(GPU) == "tf32"
        with cgemm.tf32(False):
            assert cgemm.mode(GPU) == "fp32"
        assert cgemm.mode(GPU) == "tf32"
    assert cgemm.mode(GPU) == "fp32"
    monkeypatch.setenv(cgemm.ENV, "1")                     # the block overrides the environment...
    with pytest.raises(RuntimeError, match="inside"):
        with cgemm.tf32(False):
            assert cgemm.mode(GPU) == "fp32"
            raise RuntimeError("inside")
    assert cgemm.mode(GPU) == "tf32"                        # ...and restores it, also after an error


def test_setter_overrides_until_reset(monkeypatch):
    cgemm.set_tf32(True)
    assert cgemm.mode(GPU) == "tf32"
    with cgemm.tf32(False):
        assert cgemm.mode(GPU) == "fp32"
    assert cgemm.mode(GPU) == "tf32"
    cgemm.set_tf32(None)                                    # back to the environment
    assert cgemm.mode(GPU) == "fp32"
    with pytest.raises(TypeError, match="True, False or None"):
        cgemm.set_tf32(1)


def rand(rng, shape, dtype):
    x = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dtype == np.complex64 else 0)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.complex64, np.float32])
def test_numpy_is_never_affected(rng, dtype):
    a, b = rand(rng, (5, 3, 4), dtype), rand(rng, (5, 4, 2), dtype)
    expected = np.matmul(a, b)
    with cgemm.tf32():
        assert cgemm.mode(np) == "fp32"
        np.testing.assert_array_equal(cgemm.matmul(np, a, b), expected)
        out = np.empty_like(expected)
        assert cgemm.matmul(np, a, b, out=out) is out
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(cgemm.matmul(np, a[0], b[0]), expected[0])


# -- the cuBLAS call, on the CPU: a column-major model of cublasGemmStridedBatchedEx ------------

class _Device(np.ndarray):
    """A NumPy array that answers .data.ptr as a CuPy array does."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _column_major(ptr, dtype, rows, cols, ld, stride, count):
    """The (count, rows, cols) column-major matrices at ptr, leading dimension ld, as a view."""
    item = np.dtype(dtype).itemsize
    size = ((count - 1) * stride + (cols - 1) * ld + rows) * item
    flat = np.ctypeslib.as_array((ctypes.c_byte * size).from_address(ptr)).view(dtype)
    return np.lib.stride_tricks.as_strided(flat, (count, rows, cols), (stride * item, item, ld * item))


def _gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA,
                             B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, count, compute, algo):
    """C_i = alpha op(A_i) op(B_i) + beta C_i, column-major, as cuBLAS defines it (op 0 = N,
    1 = T, 2 = C); the compute type is recorded in CALLS."""
    assert Atype == Btype == Ctype and compute in (68, 77) and algo == -1
    CALLS.append(compute)
    dtype = {0: np.float32, 4: np.complex64}[Atype]
    scalar = lambda p: _column_major(p, dtype, 1, 1, 1, 1, 1)[0, 0, 0]  # noqa: E731

    def operand(ptr, op, rows, cols, ld, stride):  # op(M) is rows x cols: M is stored cols x rows if op
        if op == 0:
            return _column_major(ptr, dtype, rows, cols, ld, stride, count)
        stored = _column_major(ptr, dtype, cols, rows, ld, stride, count).transpose(0, 2, 1)
        return stored.conj() if op == 2 else stored
    a = operand(A, transa, m, k, lda, strideA)
    b = operand(B, transb, k, n, ldb, strideB)
    c = _column_major(C, dtype, m, n, ldc, strideC, count)
    c[...] = scalar(alpha) * (a @ b) + (scalar(beta) * c if scalar(beta) else 0)


CALLS = []


@pytest.fixture
def cublas_model(monkeypatch):
    """A fake xp whose matmul in TF32 mode goes through the model above instead of the GPU."""
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = types.SimpleNamespace(gemmStridedBatchedEx=_gemm_strided_batched_ex)
    for name in ("cupy_backends", "cupy_backends.cuda"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.cublas", libs.cublas)
    return types.SimpleNamespace(
        __name__="cupy", ndarray=_Device,
        ascontiguousarray=lambda a: np.ascontiguousarray(a).view(_Device),
        broadcast_to=np.broadcast_to, matmul=np.matmul, conj=np.conj, iscomplexobj=np.iscomplexobj,
        empty=lambda shape, dtype: np.empty(shape, dtype).view(_Device),
        cuda=types.SimpleNamespace(device=types.SimpleNamespace(get_cublas_handle=lambda: 0)))


def _op(a, op):
    return a if op == "N" else a.swapaxes(-1, -2).conj() if op == "C" else a.swapaxes(-1, -2)


@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("dtype", [np.complex64, np.float32])
def test_the_cublas_arguments_describe_the_row_major_product(rng, cublas_model, dtype, tf32):
    xp = cublas_model
    a, b = rand(rng, (6, 3, 5), dtype).view(_Device), rand(rng, (6, 5, 4), dtype).view(_Device)
    cases = {"batched": (a, b), "2-D": (a[2], b[2]), "broadcast": (a, b[0]), "broadcast a": (a[0], b),
             "odd sizes": (a[:, :1], b[:, :, 3:]),
             "transposed views": (b.conj().transpose(0, 2, 1), a.transpose(0, 2, 1))}
    CALLS.clear()
    with cgemm.tf32(tf32):
        for case, (x, y) in cases.items():
            np.testing.assert_allclose(cgemm.matmul(xp, x, y), np.matmul(x, y), rtol=1e-5, atol=1e-5,
                                       err_msg=case)
        out = np.full((6, 3, 4), np.nan, dtype=dtype).view(_Device)
        assert cgemm.matmul(xp, a, b, out=out) is out
        np.testing.assert_allclose(out, np.matmul(a, b), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(cgemm.matmul(xp, a[:, :, :0], b[:, :0]), np.zeros((6, 3, 4), dtype))
        with pytest.raises(ValueError, match="out must be C-contiguous"):
            cgemm.matmul(xp, a, b, out=np.empty((6, 4, 3), dtype).view(_Device).transpose(0, 2, 1))
        with pytest.raises(ValueError, match="not aligned"):
            cgemm.matmul(xp, a, a)
        x64 = a.astype(np.complex128)                      # other dtypes: xp.matmul, untouched
        np.testing.assert_array_equal(cgemm.matmul(xp, x64, x64.transpose(0, 2, 1)),
                                      np.matmul(x64, x64.transpose(0, 2, 1)))
    assert set(CALLS) == {77 if tf32 else 68}, "the compute type follows the mode"


@pytest.mark.parametrize("op_b", cgemm.OPS)
@pytest.mark.parametrize("op_a", cgemm.OPS)
@pytest.mark.parametrize("dtype", [np.complex64, np.float32])
def test_operand_ops_and_accumulation(rng, cublas_model, dtype, op_a, op_b):
    """op(a) @ op(b) through the cuBLAS flags (the model) and through NumPy, beta = 1 included."""
    a = rand(rng, (6, 3, 5) if op_a == "N" else (6, 5, 3), dtype)
    b = rand(rng, (6, 5, 4) if op_b == "N" else (6, 4, 5), dtype)
    want = np.matmul(_op(a.astype(np.complex128), op_a), _op(b.astype(np.complex128), op_b))
    a, b = a.view(_Device), b.view(_Device)   # device arrays for the model; NumPy takes them too
    for xp in (cublas_model, np):
        got = cgemm.matmul(xp, a, b, op_a=op_a, op_b=op_b)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        out = (got.copy() if xp is np else np.array(got).view(_Device))
        assert cgemm.matmul(xp, a, b, out=out, op_a=op_a, op_b=op_b, accumulate=True) is out
        np.testing.assert_allclose(out, 2 * want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cgemm.matmul(xp, a[1], b[1], op_a=op_a, op_b=op_b), want[1],
                                   rtol=1e-5, atol=1e-5)


def test_bad_ops_and_accumulate_without_out_are_refused(rng):
    a = rand(rng, (2, 3, 3), np.complex64)
    with pytest.raises(ValueError, match="op_a and op_b must be one of"):
        cgemm.matmul(np, a, a, op_a="H")
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        cgemm.matmul(np, a, a, accumulate=True)


@pytest.mark.parametrize("a_shape,b_shape,op_b,what", [((2**31, 8), (8, 4), "N", "rows"),
                                                       ((4, 8), (2**31, 8), "T", "columns"),
                                                       ((4, 2**31), (2**31, 4), "N", "K")])
def test_a_gemm_past_cublas_int_sizes_is_refused_before_any_work(a_shape, b_shape, op_b, what):
    """cuBLAS's m, n, k and leading dimensions are ints: a larger product gets an error that names the size
    and the limit, from the plan (shapes only: nothing is allocated or launched)."""
    with pytest.raises(ValueError, match=f"'{what}': 2147483648.*2147483647"):
        cgemm._gemm_plan(a_shape, b_shape, np.dtype(np.float32), "N", op_b)
    assert cgemm._gemm_plan((2**31 - 1, 8), (8, 4), np.dtype(np.float32), "N", "N").p == 2**31 - 1


# -- on the GPU: the switch really changes the arithmetic ----------------------------------------

def _gpu_operands(case):
    """(a, b) complex64/float32 CuPy operands shaped like the backends' GEMMs, K = 256 terms."""
    import cupy as cp
    rng = cp.random.default_rng(7)

    def c64(*shape):
        return (rng.standard_normal(shape, dtype=cp.float32)
                + 1j * rng.standard_normal(shape, dtype=cp.float32)).astype(cp.complex64)

    if case == "batched":        # cufft "batched", fbfft fprop/bprop: (F, S, f) @ (F, f, f')
        return c64(64, 128, 256), c64(64, 256, 96)
    if case == "transposed":     # fbfft accGrad: conj(GY)^T (a transposed view) @ X
        return cp.conj(c64(64, 256, 96)).transpose(0, 2, 1), c64(64, 256, 128)
    if case == "2-D":            # cufft "loop": one frequency at a time
        return c64(128, 256), c64(256, 96)
    return (rng.standard_normal((64, 128, 256), dtype=cp.float32),   # cufft "gauss": real GEMMs
            rng.standard_normal((64, 256, 96), dtype=cp.float32))


def _rel(got, ref):
    import cupy as cp
    return float(cp.linalg.norm(got.astype(ref.dtype) - ref) / cp.linalg.norm(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["batched", "transposed", "2-D", "float32"])
def test_tf32_changes_the_gemm_measurably_and_stays_close(case):
    import cupy as cp
    if int(cp.cuda.Device().compute_capability) < 80:
        pytest.skip("TF32 needs compute capability 8.0 or higher")
    a, b = _gpu_operands(case)
    wide = np.complex128 if a.dtype == np.complex64 else np.float64
    ref = cp.matmul(a.astype(wide), b.astype(wide))               # float64 arithmetic
    strict = cgemm.matmul(cp, a, b)
    assert _rel(strict, cp.matmul(a, b).astype(wide)) <= 1e-6      # fp32 mode: xp.matmul's GEMM
    with cgemm.tf32():
        fast = cgemm.matmul(cp, a, b)
        out = cp.empty_like(fast)
        assert cgemm.matmul(cp, a, b, out=out) is out
    cp.testing.assert_array_equal(out, fast)
    assert fast.dtype == a.dtype and fast.shape == strict.shape
    err_strict, err_tf32, apart = _rel(strict, ref), _rel(fast, ref), _rel(fast, strict.astype(wide))
    print(f"{case}: relative error fp32 {err_strict:.2e}, tf32 {err_tf32:.2e}, tf32 vs fp32 {apart:.2e}")
    assert err_strict <= 1e-5
    assert apart > 1e-5, "TF32 mode gave fp32 results: the compute type did not take effect"
    assert err_tf32 < 1e-2
    assert cgemm.mode(cp) == "fp32"                               # restored after the block


@pytest.mark.gpu
@pytest.mark.parametrize("op_b", cgemm.OPS)
@pytest.mark.parametrize("op_a", cgemm.OPS)
def test_gpu_operand_ops_match_float64(op_a, op_b):
    """Every op pair on the GPU, at fbfft's shapes (F frequencies of (128, 96) x (96, 64)), in
    strict fp32 against complex128, and beta = 1 accumulation."""
    import cupy as cp
    rng = cp.random.default_rng(3)

    def c64(*shape):
        return (rng.standard_normal(shape, dtype=cp.float32)
                + 1j * rng.standard_normal(shape, dtype=cp.float32)).astype(cp.complex64)
    a = c64(36, 128, 96) if op_a == "N" else c64(36, 96, 128)
    b = c64(36, 96, 64) if op_b == "N" else c64(36, 64, 96)
    ref = cp.matmul(_op(a.astype(cp.complex128), op_a), _op(b.astype(cp.complex128), op_b))
    got = cgemm.matmul(cp, a, b, op_a=op_a, op_b=op_b)
    assert got.shape == (36, 128, 64) and got.flags.c_contiguous
    assert _rel(got, ref) <= 1e-5
    cgemm.matmul(cp, a, b, out=got, op_a=op_a, op_b=op_b, accumulate=True)
    assert _rel(got, 2 * ref) <= 1e-5


def test_host_operands_on_the_device_path_are_refused(rng, cublas_model):
    """A NumPy operand given to the device matmul raises a TypeError naming it, instead of
    failing on .data.ptr (or, worse, handing cuBLAS a host address)."""
    a = rand(rng, (2, 3, 4), np.complex64).view(_Device)
    b = rand(rng, (2, 4, 5), np.complex64)                       # host memory
    with pytest.raises(TypeError, match=r"b must be a cupy.ndarray, got numpy.ndarray"):
        cgemm.matmul(cublas_model, a, b)
    with pytest.raises(TypeError, match=r"out must be a cupy.ndarray"):
        cgemm.matmul(cublas_model, a, b.view(_Device), out=np.empty((2, 3, 5), np.complex64))


def test_shares_libcublas_compares_the_resolved_functions(monkeypatch):
    """shares_libcublas() is positive only where the library, already loaded, resolves the identity
    function (through its dependencies too) to the very address ours does. libc and libm stand in
    for libcublas and PyTorch: libm reaches libc's malloc through its dependency."""
    libc, libm = ctypes.CDLL("libc.so.6"), ctypes.CDLL("libm.so.6")
    monkeypatch.setattr(cgemm, "_IDENTITY_SYMBOL", "malloc")
    monkeypatch.setattr(cgemm, "_libcublas", lambda: libc)
    assert cgemm.shares_libcublas("libc.so.6")
    assert cgemm.shares_libcublas("libm.so.6")
    assert not cgemm.shares_libcublas("libminitorch_not_loaded.so.1")      # not loaded: not opened
    other = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(lambda n: None)
    monkeypatch.setattr(cgemm, "_libcublas", lambda: types.SimpleNamespace(malloc=other))
    assert not cgemm.shares_libcublas("libc.so.6")                         # another copy
    monkeypatch.setattr(cgemm, "_IDENTITY_SYMBOL", "cos")
    monkeypatch.setattr(cgemm, "_libcublas", lambda: libm)
    assert not cgemm.shares_libcublas("libc.so.6")                         # does not reach it


def test_relaxed_capture_mode_exchanges_and_restores(monkeypatch):
    """relaxed_capture_mode() sets this thread's capture mode to relaxed for the block and gives the
    previous one back, also when the block raises (a stand-in for the driver's exchange call)."""
    modes = {"thread": 0}                                  # CU_STREAM_CAPTURE_MODE_GLOBAL

    def exchange(ref):
        modes["thread"], ref._obj.value = ref._obj.value, modes["thread"]
        return 0

    monkeypatch.setattr(cgemm, "_libcuda", lambda: types.SimpleNamespace(cuThreadExchangeStreamCaptureMode=exchange))
    with cgemm.relaxed_capture_mode():
        assert modes["thread"] == 2
    assert modes["thread"] == 0
    with pytest.raises(KeyError), cgemm.relaxed_capture_mode():
        raise KeyError("inside")
    assert modes["thread"] == 0
    monkeypatch.setattr(cgemm, "_libcuda", lambda: types.SimpleNamespace(cuThreadExchangeStreamCaptureMode=lambda ref: 1))
    with pytest.raises(RuntimeError, match="cuThreadExchangeStreamCaptureMode failed with CUDA driver status 1"):
        with cgemm.relaxed_capture_mode():
            pass


def test_a_capture_s_handle_is_this_thread_s(rng, cublas_model):
    """Two threads inside capturing() at once, each with its own handle: each thread's GEMM goes to
    its own (a captured PyTorch step runs its backward on another thread, with PyTorch's handle of
    that thread), and a thread outside any capture to CuPy's."""
    import threading
    both_inside, seen = threading.Barrier(2), {}
    a, b = rand(rng, (2, 3, 4), np.float32).view(_Device), rand(rng, (2, 4, 5), np.float32).view(_Device)

    def run(ptr):
        def gemm(handle, *args):
            seen.setdefault(ptr, []).append(handle)
            _gemm_strided_batched_ex(handle, *args)
        with cgemm.capturing(types.SimpleNamespace(ptr=ptr, gemm=gemm)):
            both_inside.wait(timeout=10)
            got = cgemm.matmul(cublas_model, a, b)
            both_inside.wait(timeout=10)
        np.testing.assert_allclose(got, a @ b, rtol=1e-5)
    threads = [threading.Thread(target=run, args=(ptr,)) for ptr in (101, 202)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == {101: [101], 202: [202]}
    CALLS.clear()
    cgemm.matmul(cublas_model, a, b)              # this thread never captured: CuPy's handle (0 here)
    assert CALLS and seen == {101: [101], 202: [202]}
