"""fbfft's CPU path: the CUDA kernels of kernels/fbfft.cu emulated in NumPy, lane by lane.

fbfft's CPU passes (backends/fbfft.py) run these emulated kernels, so CI checks the GPU
kernels' index arithmetic (plan, thread roles, shared-memory layout, bit-reversed registers,
implicit padding and clipping) against np.fft without a GPU. Each "register" is a NumPy vector
over all threads of one role (the kernel's SIMT lanes side by side); loops run in the kernel's
order. The emulator also checks what a GPU run cannot show: every shared-memory slot is written
once before it is read, and every output element exactly once. benchmarks/NOTES.md ("Backend
notes moved from module docstrings (fbfft)") has the longer account.

  n FFT size, nf = n^2/2 + 2 stored frequencies, B planes (launch plans: fbfft_plan.py)
  rfft2   x (B, h, w) float32 at offset (top, left) of an n x n zero plane -> F (nf, B) complex64
  irfft2  F (nf, B) complex64 -> y (B, out_h, out_w) float32, the window at (row_off, col_off)
  rfft1   x (B, len) float32 at offset pad of a length-n signal -> F (n//2+1, B) complex64
  irfft1  F (n//2+1, B) complex64 -> y (B, out_len) float32
"""
import numpy as np

from .fbfft_plan import TWIDDLE_N, plan, plan1, row_base, stored_frequencies, twiddle_table

_TW = twiddle_table()


def bit_reverse(i, bits):
    return int(format(i, f"0{bits}b")[::-1], 2) if bits else 0


def reg_of(p, k):
    """Register holding X[k] after load_split + dif_fft in thread class k % split."""
    return bit_reverse(k // p.split, p.log_m)


def twiddle(a, k, inverse):
    """a * exp(-+2 pi i k / 256); k = 0 and the quarter, half and three-quarter turns
    multiply exactly."""
    if k == 0:
        return a
    if k == TWIDDLE_N // 4:
        return a * np.complex64(1j if inverse else -1j)
    if k == TWIDDLE_N // 2:
        return -a
    if k == 3 * TWIDDLE_N // 4:
        return a * np.complex64(-1j if inverse else 1j)
    w = _TW[k]
    return a * (np.conj(w) if inverse else w)


def dif_fft(v, inverse):
    """In-place radix-2 DIF on the register list v: afterwards v[i] = X[bit_reverse(i)]."""
    m = len(v)
    for s in range(m.bit_length() - 1):
        half = m >> (s + 1)
        for i in range(m // 2):
            j = i % half
            lo = (i // half) * 2 * half + j
            a, b = v[lo], v[lo + half]
            v[lo] = a + b
            v[lo + half] = twiddle(a - b, j * (TWIDDLE_N // (2 * half)), inverse)


def load_split(p, c, inverse, load):
    """The first radix-`split` DIF step on the fly, as the values are loaded."""
    if p.split == 1:
        return [load(j) for j in range(p.m)]
    v = [None] * p.m
    for j in range(p.m):  # (the kernel visits j and m - j together; same values)
        a, b = load(j), load(j + p.m)
        v[j] = a + b if c == 0 else twiddle(a - b, j * (TWIDDLE_N // p.n), inverse)
    return v


class _Shared:
    """Shared memory of every block (`size` slots of `dtype` each), poisoned; each slot written
    once, read only after. The transposed intermediate S, and the inverse's output staging."""

    def __init__(self, blocks, size, dtype=np.complex64):
        self.mem = np.full((blocks, size), np.nan, dtype=dtype)
        self.written = np.zeros((blocks, size), dtype=bool)

    def store(self, blk, idx, val, mask=None):
        if mask is not None:  # the lanes whose store is predicated off write nothing
            blk, idx, val = blk[mask], idx[mask], val[mask]
        assert not self.written[blk, idx].any(), "fbfft emulator: shared slot written twice"
        self.written[blk, idx] = True
        self.mem[blk, idx] = val

    def load(self, blk, idx):
        assert self.written[blk, idx].all(), "fbfft emulator: shared slot read before written"
        return self.mem[blk, idx]


class _Output:
    """A flat poisoned output that counts the stores to every element."""

    def __init__(self, shape, dtype):
        self.flat = np.full(int(np.prod(shape)), np.nan, dtype=dtype)
        self.count = np.zeros(self.flat.size, dtype=np.int64)
        self.shape = shape

    def store(self, idx, val, mask):
        np.add.at(self.count, idx[mask], 1)
        self.flat[idx[mask]] = val[mask]


def _roles(p, blocks, kind):
    """Per-thread (blk, c, a, p) of a role, over every thread of the grid.

    kind 'columns': tid = xp + rows * (p + planes * c), a = xp
    kind 'rows':    tid = p + planes * (r + rows * c),  a = r
    """
    tid = np.tile(np.arange(p.threads), blocks)
    blk = np.repeat(np.arange(blocks), p.threads)
    if kind == "columns":
        a, pl = tid % p.rows, (tid // p.rows) % p.planes
        c = tid // (p.rows * p.planes)
    else:
        pl, a = tid % p.planes, (tid // p.planes) % p.rows
        c = tid // (p.planes * p.rows)
    return blk, c, a, pl


def _check_batch(B):
    if B < 1:
        raise ValueError(f"fbfft: batch must have at least one plane, got {B}")


def rfft2(x, n, padding=(0, 0), check_coverage=True):
    """Emulates fbfft_rfft2<n>: x (B, h, w) float32 placed at offset `padding` (top, left)
    of an n x n zero plane -> F (nf, B) complex64."""
    p = plan(n)
    pad_top, pad_left = padding
    x = np.ascontiguousarray(x, dtype=np.float32)
    B, h, w = x.shape
    _check_batch(B)
    if not (0 <= pad_top and pad_top + h <= n and 0 <= pad_left and pad_left + w <= n):
        raise ValueError(f"fbfft: input {h}x{w} at offset ({pad_top}, {pad_left}) "
                         f"does not fit the {n}x{n} basis")
    blocks = -(-B // p.planes)
    smem = _Shared(blocks, p.smem_elems)
    out = _Output((stored_frequencies(n), B), np.complex64)
    xflat = x.reshape(-1)

    # pass 1: columns xp and xp + n/2 of plane b as one complex FFT along y
    blk_all, c_all, xp_all, p_all = _roles(p, blocks, "columns")
    for c in range(p.split):
        sel = c_all == c
        blk, xp, pl = blk_all[sel], xp_all[sel], p_all[sel]
        b = blk * p.planes + pl
        ix1, ix2 = xp - pad_left, xp + n // 2 - pad_left
        plane_ok = b < B
        ok1 = plane_ok & (ix1 >= 0) & (ix1 < w)
        ok2 = plane_ok & (ix2 >= 0) & (ix2 < w)
        base = np.where(plane_ok, b, 0).astype(np.int64) * h * w

        def load(y):
            iy = y - pad_top
            row_ok = 0 <= iy < h
            re = np.where(row_ok & ok1, xflat[np.where(row_ok & ok1, base + iy * w + ix1, 0)], 0)
            im = np.where(row_ok & ok2, xflat[np.where(row_ok & ok2, base + iy * w + ix2, 0)], 0)
            return (re + 1j * im).astype(np.complex64)

        v = load_split(p, c, False, load)
        dif_fft(v, False)
        s1 = xp * p.col_stride + pl
        s2 = s1 + (n // 2) * p.col_stride
        for r in range(n // 2):
            if r % p.split != c:
                continue
            if r == 0:
                z0, zh = v[reg_of(p, 0)], v[reg_of(p, n // 2)]
                smem.store(blk, s1, (z0.real + 1j * zh.real).astype(np.complex64))
                smem.store(blk, s2, (z0.imag + 1j * zh.imag).astype(np.complex64))
            else:
                zk, zm = v[reg_of(p, r)], np.conj(v[reg_of(p, n - r)])
                smem.store(blk, s1 + r * p.row_stride, (zk + zm) * np.float32(0.5))
                smem.store(blk, s2 + r * p.row_stride, (zk - zm) * np.complex64(-0.5j))

    # pass 2: row r of S along x; stores F[r], F[n-r] (row 0: F[0], F[n/2])
    blk_all, c_all, r_all, p_all = _roles(p, blocks, "rows")
    for c in range(p.split):
        sel = c_all == c
        blk, r, pl = blk_all[sel], r_all[sel], p_all[sel]
        b = blk * p.planes + pl
        s = r * p.row_stride + pl
        v = load_split(p, c, False, lambda x_: smem.load(blk, s + x_ * p.col_stride))
        dif_fft(v, False)
        packed = r == 0
        base_a, base_b = row_base(n, r), row_base(n, np.where(packed, n // 2, n - r))
        for kx in range(n // 2 + 1):
            if kx % p.split != c:
                continue
            u = v[reg_of(p, kx)]
            m = np.conj(v[reg_of(p, (n - kx) % n)])
            a_val = np.where(packed, (u + m) * np.float32(0.5), u)
            b_val = np.where(packed, (u - m) * np.complex64(-0.5j), m)
            out.store((base_a + kx) * B + b, a_val, b < B)
            keep_b = packed | (0 < kx < n // 2)  # F[n-r][0], F[n-r][n/2]: not stored
            out.store((base_b + kx) * B + b, b_val, (b < B) & keep_b)

    if check_coverage:
        assert (out.count == 1).all(), "fbfft emulator: output not written exactly once"
    return out.flat.reshape(out.shape)


def irfft2(F, n, out_shape=None, offset=(0, 0), scale=None, check_coverage=True):
    """Emulates fbfft_irfft2<n>: F (nf, B) complex64 -> (B, out_h, out_w) float32."""
    p = plan(n)
    F = np.ascontiguousarray(F, dtype=np.complex64)
    nf = stored_frequencies(n)
    if F.ndim != 2 or F.shape[0] != nf:
        raise ValueError(f"fbfft: spectrum must have shape ({nf}, B), got {F.shape}")
    B = F.shape[1]
    _check_batch(B)
    out_h, out_w = (n, n) if out_shape is None else out_shape
    row_off, col_off = offset
    if not (0 <= row_off and row_off + out_h <= n and 0 <= col_off and col_off + out_w <= n
            and out_h >= 1 and out_w >= 1):
        raise ValueError(f"fbfft: output window {out_h}x{out_w} at ({row_off}, {col_off}) "
                         f"does not fit the {n}x{n} basis")
    scale = np.float32(1.0 / (n * n) if scale is None else scale)
    blocks = -(-B // p.planes)
    smem = _Shared(blocks, p.smem_elems)
    out = _Output((B, out_h, out_w), np.float32)
    fflat = F.reshape(-1)

    # pass 1: row r of the full spectrum, rebuilt from the half, inverse FFT along kx
    blk_all, c_all, r_all, p_all = _roles(p, blocks, "rows")
    for c in range(p.split):
        sel = c_all == c
        blk, r, pl = blk_all[sel], r_all[sel], p_all[sel]
        b = blk * p.planes + pl
        bb = np.where(b < B, b, 0).astype(np.int64)
        packed = r == 0
        base_a, base_b = row_base(n, r), row_base(n, np.where(packed, n // 2, n - r))
        y = [None] * n
        for k in range(n // 2 + 1):
            a = fflat[(base_a + k) * B + bb]
            # of row n - r only 0 < k < n/2 is stored (and used): at k = 0, n/2 an unpacked row
            # reads a stored neighbour and never uses it (fbfft.cu: no predicated load)
            kc = k if 0 < k < n // 2 else 1 if k == 0 else n // 2 - 1
            cc = fflat[(base_b + np.where(packed, k, kc)) * B + bb]
            y[k] = np.where(packed, a + 1j * cc, a).astype(np.complex64)
            if 0 < k < n // 2:
                y[n - k] = np.where(packed, np.conj(a) + 1j * np.conj(cc), np.conj(cc)).astype(np.complex64)
        v = load_split(p, c, True, lambda kx: y[kx])
        dif_fft(v, True)
        s = r * p.row_stride + pl
        for x_ in range(n):
            if x_ % p.split == c:
                smem.store(blk, s + x_ * p.col_stride, v[reg_of(p, x_)])

    # pass 2: columns xp and xp + n/2 as one complex inverse FFT along ky; clipped stores
    blk_all, c_all, xp_all, p_all = _roles(p, blocks, "columns")
    stage = _Shared(blocks, p.planes * out_h * out_w, np.float32)  # over S, after a barrier
    for c in range(p.split):
        sel = c_all == c
        blk, xp, pl = blk_all[sel], xp_all[sel], p_all[sel]
        s1 = xp * p.col_stride + pl
        s2 = s1 + (n // 2) * p.col_stride

        def load(ky):
            if ky == 0:
                return (smem.load(blk, s1).real + 1j * smem.load(blk, s2).real).astype(np.complex64)
            if ky == n // 2:
                return (smem.load(blk, s1).imag + 1j * smem.load(blk, s2).imag).astype(np.complex64)
            if ky < n // 2:
                return smem.load(blk, s1 + ky * p.row_stride) + 1j * smem.load(blk, s2 + ky * p.row_stride)
            k = n - ky
            return (np.conj(smem.load(blk, s1 + k * p.row_stride))
                    + 1j * np.conj(smem.load(blk, s2 + k * p.row_stride))).astype(np.complex64)

        v = load_split(p, c, True, load)
        dif_fft(v, True)
        # staged: (barrier) the clipped window goes to the staging copy of the block's planes;
        # else straight to the plane in the output
        ox1, ox2 = xp - col_off, xp + n // 2 - col_off
        b = blk * p.planes + pl
        plane_ok = np.ones(b.size, bool) if p.stage_out else b < B
        ok1 = plane_ok & (ox1 >= 0) & (ox1 < out_w)
        ok2 = plane_ok & (ox2 >= 0) & (ox2 < out_w)
        base = (pl if p.stage_out else np.where(b < B, b, 0)).astype(np.int64) * out_h * out_w
        for y_ in range(n):
            if y_ % p.split != c:
                continue
            oy = y_ - row_off
            if not 0 <= oy < out_h:
                continue
            z = v[reg_of(p, y_)]
            for idx, val, ok in ((base + oy * out_w + ox1, scale * z.real, ok1),
                                 (base + oy * out_w + ox2, scale * z.imag, ok2)):
                if p.stage_out:
                    stage.store(blk, idx, val, ok)
                else:
                    out.store(idx, val, ok)

    if p.stage_out:  # (barrier) each block stores its planes' outputs as one contiguous run
        window = out_h * out_w
        for blk in range(blocks):
            planes = min(p.planes, B - blk * p.planes)
            i = np.arange(planes * window)
            out.store(blk * p.planes * window + i, stage.load(blk, i), np.ones(i.size, bool))

    if check_coverage:
        assert (out.count == 1).all(), "fbfft emulator: output not written exactly once"
    return out.flat.reshape(out.shape)


# ---- 1-D kernels (fbfft_rfft1 / fbfft_irfft1) ------------------------------------------

def load_radix(L, R, c, inverse, load):
    """load_radix<L, R, c>: the first radix-R DIF step as the values are loaded; after
    dif_fft on the result, register bit_reverse(m) holds X[R m + c]."""
    M = L // R
    v = []
    for j in range(M):
        acc = load(j)
        for q in range(1, R):
            acc = acc + twiddle(load(j + q * M), ((q * c) % R) * (TWIDDLE_N // R), inverse)
        v.append(twiddle(acc, j * c * (TWIDDLE_N // L), inverse))
    return v


def rfft1(x, n, pad=0):
    """Emulates fbfft_rfft1<n>: x (B, len) float32 at offset `pad` of a length-n zero signal
    -> F (n//2+1, B) complex64, F[k, b] = np.fft.rfft(signal_b)[k]."""
    p = plan1(n)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"fbfft: x must be (B, len), got shape {x.shape}")
    B, length = x.shape
    _check_batch(B)
    if not (0 <= pad and pad + length <= n and length >= 1):
        raise ValueError(f"fbfft: signal of length {length} at offset {pad} does not fit the basis {n}")
    real = np.zeros((B, 2 * p.row), np.float32)          # the shared-memory rows, zero-padded
    real[:, pad:pad + length] = x
    z = (real[:, 0:n:2] + 1j * real[:, 1:n:2]).astype(np.complex64)   # row[m] = p[2m] + i p[2m+1]
    Z = np.full((B, p.L), np.nan, np.complex64)
    for c in range(p.split):
        v = load_radix(p.L, p.split, c, False, lambda m: z[:, m])
        dif_fft(v, False)
        for m in range(p.m):
            Z[:, p.split * m + c] = v[bit_reverse(m, p.log_m)]
    out = _Output((p.L + 1, B), np.complex64)
    lanes = np.arange(B)
    for c in range(p.split):
        for k in range(c, p.L + 1, p.split):
            zk, zc = Z[:, k % p.L], np.conj(Z[:, (p.L - k) % p.L])
            d = twiddle(zk - zc, k * (TWIDDLE_N // n), False)
            out.store(k * B + lanes, ((zk + zc + d * np.complex64(-1j)) * np.float32(0.5)).astype(np.complex64),
                      np.ones(B, bool))
    assert (out.count == 1).all(), "fbfft emulator: 1-D output not written exactly once"
    return out.flat.reshape(out.shape)


def irfft1(F, n, out_len=None, offset=0, scale=None):
    """Emulates fbfft_irfft1<n>: F (n//2+1, B) complex64 -> y (B, out_len) float32,
    y[b] = scale * n * np.fft.irfft(F[:, b], n)[offset:offset + out_len] (scale 1/n default)."""
    p = plan1(n)
    F = np.ascontiguousarray(F, dtype=np.complex64)
    if F.ndim != 2 or F.shape[0] != p.L + 1:
        raise ValueError(f"fbfft: spectrum must have shape ({p.L + 1}, B), got {F.shape}")
    B = F.shape[1]
    _check_batch(B)
    out_len = n if out_len is None else out_len
    if not (0 <= offset and offset + out_len <= n and out_len >= 1):
        raise ValueError(f"fbfft: output window of {out_len} at {offset} does not fit the basis {n}")
    scale = np.float32(1.0 / n if scale is None else scale)
    Z = np.full((B, p.L), np.nan, np.complex64)
    for c in range(p.split):
        for k in range(c, p.L, p.split):
            x, xc = F[k], np.conj(F[p.L - k])
            e = x + xc
            o = twiddle(x - xc, k * (TWIDDLE_N // n), True)
            Z[:, k] = ((e + o * np.complex64(1j)) * np.float32(0.5)).astype(np.complex64)
    zz = np.full((B, p.L), np.nan, np.complex64)
    for c in range(p.split):
        v = load_radix(p.L, p.split, c, True, lambda m: Z[:, m])
        dif_fft(v, True)
        for m in range(p.m):
            zz[:, p.split * m + c] = v[bit_reverse(m, p.log_m)] * np.float32(2 * scale)
    real = np.empty((B, n), np.float32)
    real[:, 0::2], real[:, 1::2] = zz.real, zz.imag
    return np.ascontiguousarray(real[:, offset:offset + out_len])
