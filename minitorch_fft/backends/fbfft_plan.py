"""Launch plans of the fbfft kernels (kernels/fbfft.cu): what the launcher needs to know.

The sizes the kernels are instantiated for, each size's Plan (threads, planes per block,
shared-memory strides and bytes), the frequency-major spectrum layout (stored_frequencies,
row_base, and compact/expand to and from np.fft's layout), the twiddle table and the
shared-memory bank arithmetic. Kept apart from the kernels' emulator (fbfft_emulator.py), so
the GPU launcher (fbfft_kernels.py) imports only this. The arithmetic mirrors fbfft.cu's
Plan<N> and Plan1<N>; tests/test_fbfft_kernels.py compares the two.

  n the FFT size, nh = n // 2 + 1 half-spectrum columns, nf = n^2 / 2 + 2 stored frequencies,
  B planes (2-D) or signals (1-D), L = n / 2 complex points of a 1-D signal.
  A spectrum is (nf, B) complex64, frequency-major: F[row_base(n, ky) + kx, b]; rows past n/2
  store only 0 < kx < n/2 (the rest are conjugates of rows n - ky).
"""
from collections import namedtuple

import numpy as np

SIZES = (2, 4, 8, 16, 32, 64, 128)         # 2-D kernels
SIZES_1D = (2, 4, 8, 16, 32, 64, 128, 256)  # 1-D kernels
TWIDDLE_N = 256  # kTwiddleN: the twiddle table holds exp(-2 pi i k / 256)

Plan = namedtuple("Plan", "n split m log_m rows nh planes threads col_stride row_stride smem_elems smem_bytes "
                         "stage_out")
Plan1 = namedtuple("Plan1", "n L split m log_m signals threads row smem_bytes")


def check_size(n, sizes=SIZES):
    """ValueError unless n is an FFT size the kernels are instantiated for."""
    if n not in sizes:
        raise ValueError(f"fbfft: FFT size {n!r} is not supported; supported sizes are {sizes}")


def plan(n):
    """The 2-D kernels' Plan<N>: launch geometry and shared-memory strides (see fbfft.cu)."""
    check_size(n)
    split = 2 if n > 32 else 1
    m = n // split
    rows = n // 2
    planes = {2: 128, 4: 128, 8: 64, 16: 32, 32: 8, 64: 4, 128: 1}[n]
    if n <= 16:
        col_stride = planes + 16 // rows
        row_stride = n * col_stride
    elif n == 32:
        col_stride, row_stride = 9, n * 9 + 8
    elif n == 64:
        col_stride, row_stride = 5, n * 5 + 4
    else:
        col_stride, row_stride = 1, n + 1
    stage_out = n <= 32  # the inverse stages its output in shared memory (fbfft.cu)
    return Plan(n, split, m, m.bit_length() - 1, rows, n // 2 + 1, planes,
                rows * split * planes, col_stride, row_stride, rows * row_stride, rows * row_stride * 8, stage_out)


def stored_frequencies(n):
    """nf = n^2/2 + 2: the values of an n x n real signal's half-spectrum that are stored."""
    return n * n // 2 + 2


def row_base(n, row):
    """Index in the (nf, B) layout of row `row`'s kx = 0 (fbfft.cu's row_base): a row past n/2
    stores only 0 < kx < n/2, at row_base + kx as well."""
    nh = n // 2 + 1
    row = np.asarray(row, dtype=np.int64)  # a number or an array of rows
    return np.where(row <= n // 2, row * nh, (n // 2 + 1) * nh + (row - n // 2 - 1) * (n // 2 - 1) - 1)


def _stored(n):
    """(ky, kx) of every stored frequency, in storage order."""
    return [(ky, kx) for ky in range(n) for kx in range(n // 2 + 1) if ky <= n // 2 or 0 < kx < n // 2]


def _stored_index(n, F):
    """(ky, kx) index arrays of the stored frequencies, on F's device (NumPy or CuPy)."""
    ky, kx = np.array(_stored(n)).T
    if isinstance(F, np.ndarray):
        return ky, kx
    import cupy
    return cupy.asarray(ky), cupy.asarray(kx)


def compact(F, n):
    """np.fft's half-spectra laid out (n, nh, B) -> the kernels' (nf, B) (NumPy or CuPy)."""
    ky, kx = _stored_index(n, F)
    return F[ky, kx]


def expand(F, n):
    """The kernels' (nf, B) -> (n, nh, B), the unstored values rebuilt as conjugates (NumPy
    or CuPy arrays)."""
    xp = np if isinstance(F, np.ndarray) else __import__("cupy")
    full = xp.empty((n, n // 2 + 1) + F.shape[1:], dtype=F.dtype)
    ky, kx = _stored_index(n, F)
    full[ky, kx] = F
    for col in sorted({0, n // 2}):
        full[n // 2 + 1:, col] = xp.conj(full[n // 2 - 1:0:-1, col])
    return full


def plan1(n):
    """The 1-D kernels' Plan1<N> (see fbfft.cu): L = n/2 complex points per signal, split
    over `split` threads, `signals` signals per block, one row of `row` complex slots each."""
    check_size(n, SIZES_1D)
    L = n // 2
    split = L // 32 if L > 32 else 1
    m = L // split
    signals = 256 if n <= 32 else 8192 // n
    return Plan1(n, L, split, m, m.bit_length() - 1, signals, signals * split, L + 1, signals * (L + 1) * 8)


def twiddle_table():
    """kTwiddle: exp(-2 pi i k / 256) rounded to float32, k = 0..255."""
    w = np.exp(-2j * np.pi * np.arange(TWIDDLE_N) / TWIDDLE_N)
    return (w.real.astype(np.float32) + 1j * w.imag.astype(np.float32)).astype(np.complex64)


def bank_conflicts(n):
    """Worst-case ways of shared-memory bank conflict per access, for each of the four
    access patterns (pass-1 stores / pass-2 loads of the forward; the inverse does the
    same pattern the other way round). 64-bit accesses are served a half-warp at a time;
    a half-warp's 16 words are conflict-free when they fall in 16 distinct bank pairs.
    Threads of one address (broadcast) count once."""
    p = plan(n)
    tid = np.arange(p.threads)
    cols = tid % p.rows, (tid // p.rows) % p.planes                  # (xp, p)
    rows = (tid // p.planes) % p.rows, tid % p.planes                # (r, p)
    patterns = {
        "columns": [cols[0] * p.col_stride + cols[1] + r * p.row_stride for r in range(p.rows)],
        "rows": [rows[0] * p.row_stride + x * p.col_stride + rows[1] for x in range(n)],
    }
    worst = {}
    for name, accesses in patterns.items():
        ways = 1
        for addr in accesses:
            for h0 in range(0, p.threads, 16):
                words = np.unique(addr[h0:h0 + 16])
                ways = max(ways, np.bincount(words % 16).max())
        worst[name] = int(ways)
    return worst
