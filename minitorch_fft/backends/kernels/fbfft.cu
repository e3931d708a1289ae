// fbfft: batched 2-D (n = 2..128) and 1-D (n = 2..256) real FFTs of power-of-two size, for the FFT convolution
// backend (after section 5 of Vasilache et al., "Fast convolutional nets with fbfft",
// ICLR 2015). Host wrappers: backends/fbfft_kernels.py. NumPy model of exactly this
// index arithmetic: backends/fbfft_emulator.py (the CPU tests run both against np.fft).
//
// Layouts (row-major, contiguous; B planes, n = N the FFT size, nh = n/2 + 1):
//   fbfft_rfft2<N>   in : float   (B, h, w)        h, w <= n, placed at (pad_top, pad_left)
//                                                   of an implicit n x n zero plane P_b
//                    out: float2  (nf, B)          out[freq(ky, kx)][b] =
//                          sum_{y,x} P_b[y][x] exp(-2 pi i (ky y + kx x) / n)
//                          i.e. rfft2(P)[b, ky, kx], frequency-major with the batch
//                          fastest: the layout the per-frequency GEMM wants (HWBD).
//   fbfft_irfft2<N>  in : float2  (nf, B)          Hermitian half-spectra, as above
//                    out: float   (B, out_h, out_w) out[b][i][j] =
//                          scale * sum_{ky,kx} F_b[ky][kx] exp(+2 pi i (ky y + kx x) / n)
//                          at y = row_off + i, x = col_off + j (scale = 1/n^2 is irfft2).
// Zero padding is implicit (loads outside the input read 0: no padded copy), and the
// inverse stores only the clipped window (no cropping copy), as in the paper's 5.1.
// The inverse reads each spectrum as Hermitian-consistent (what rfft2, and products and
// sums of rfft2 outputs, are): of F[ky][0] and F[ky][n/2] it uses only ky <= n/2.
// So those 2 (n/2 - 1) values (F[n - ky][0] = conj F[ky][0], and the same at n/2) are
// not stored at all: the half-spectrum keeps nf = n^2/2 + 2 of its n (n/2 + 1) values,
// the exact count of a real n x n signal's degrees of freedom, and the per-frequency
// GEMM runs over nf frequencies instead of n (n/2 + 1) (n = 16: 130 instead of 144).
// freq(ky, kx) = ky nh + kx                                      for ky <= n/2,
//              = (n/2 + 1) nh + (ky - n/2 - 1)(n/2 - 1) + kx - 1  for ky > n/2, 0 < kx < n/2.
//
// Algorithm. A 2-D real FFT is a pass of 1-D FFTs down the columns, a transpose, and a
// pass along the rows. Each thread owns whole 1-D FFTs held in registers: a radix-2
// decimation-in-frequency FFT whose register array is indexed by compile-time
// constants only (N is a template parameter, every loop is unrolled), so its twiddles
// are compile-time constants too (operands from the __constant__ table kTwiddle) and
// the bit reversal of DIF's output costs nothing: X[k] simply lives in register
// brev(k). The transpose between the passes goes through shared memory, once.
//   Why not the paper's lanes-hold-elements shuffle FFT: on Kepler that saved shared
//   memory; on sm_90 a warp shuffle moves no more bytes per cycle than shared memory,
//   and a shuffle FFT moves every element log2(n) times where a transpose moves it once.
//
// Forward, per block of kPlanes planes:
//   pass 1 (columns): thread (xp, p) loads columns xp and xp + n/2 of plane p as one
//     complex signal z[y] = P[y][xp] + i P[y][xp + n/2] (two real FFTs for the price of
//     one), FFTs it along y, and splits Z into the two columns' spectra
//        C1[k] = (Z[k] + conj Z[n-k]) / 2,   C2[k] = (Z[k] - conj Z[n-k]) / 2i.
//     A real column's spectrum is Hermitian, so rows ky = 0..n/2 suffice; rows 0 and n/2
//     are real and share one slot: S[0][x] = C_x[0] + i C_x[n/2], S[r][x] = C_x[r].
//   pass 2 (rows): thread (p, r) FFTs row r of S along x: Y = F[r][.] for r >= 1, while
//     row 0 holds FFT(C[0] + i C[n/2]) = F[0][.] + i F[n/2][.], split as above. Thread
//     (p, r) then writes F[r][kx] and F[n-r][kx] = conj F[r][n-kx] (or F[0], F[n/2]),
//     kx = 0..n/2: every thread writes n + 2 values, and a warp's lanes are consecutive
//     planes, so each store is a run of consecutive addresses in the (nf, B) layout.
// Inverse: the same passes backwards (rows of the spectrum first, then columns, two
//   real columns packed into one complex inverse FFT). For the sizes with kStageOut, the
//   clipped window of the block's planes is then staged in shared memory (over S, after a
//   barrier) and written out as one contiguous range: a thread's own columns are runs of
//   n/2 floats or less.
//
// Sizes 2..32 use one thread per column pair / row (kSplit = 1). n = 64 and 128 split
// each 1-D FFT over kSplit = 2 threads by one radix-2 DIF step taken as the values are
// loaded (thread class c keeps outputs k = 2m + c), so no thread holds more than 64
// complex values (n = 128: 180 / 226 registers, no spills); for kSplit = 2 the pairs
// (k, n - k) used by the Hermitian splits always share a class, so the classes never
// exchange data. n = 128 transforms one plane per block (64 KB of shared memory): its
// spectrum stores are single 8-byte elements, a quarter of a 32-byte sector, so it is a
// correctness-first size (the paper's fbfft, too, was slower than cuFFT there).
//
// The 1-D kernels (rfft1 / irfft1, at the end of the namespace) have their own notes.

// Shared memory is dynamic (the launch passes the plan's byte count), so a block may use
// more than the 48 KB static limit (n = 128, and the 1-D plans of 64 to 256). The host
// emulation in tests/test_fbfft_kernels.py defines its own buffer.
#ifndef FBFFT_SHARED_BUFFER
#define FBFFT_SHARED_BUFFER(name) extern __shared__ float2 name[]
#endif

namespace fbfft {

__host__ __device__ constexpr int ilog2(int n) { return n <= 1 ? 0 : 1 + ilog2(n >> 1); }

// Launch geometry and shared-memory layout for one size. The host wrapper
// (fbfft_kernels.py) and the plan (fbfft_plan.py) carry the same table; a CPU test
// compiles this file on the host and checks that they agree.
//
// Shared memory holds the transposed intermediate S[r][x][p] (rows r < n/2, columns
// x < n, planes p < kPlanes) at r * kRowStride + x * kColStride + p. The strides are
// padded so that, per half-warp of 64-bit accesses, pass 1's 16 lanes (consecutive xp,
// then p) and pass 2's (consecutive p, then r) fall in distinct bank pairs:
// x * kColStride + p distinct mod 16 in pass 1, r * kRowStride + p in pass 2.
// kPlanes sets the run length of the spectrum stores (consecutive planes of one
// frequency): n = 64 takes 4 planes, one full 32-byte sector per run, in 81 KB.
template <int N>
struct Plan {
    static_assert(N == 2 || N == 4 || N == 8 || N == 16 || N == 32 || N == 64 || N == 128,
                  "fbfft: N must be one of 2, 4, 8, 16, 32, 64, 128");
    static constexpr int kSplit = N > 32 ? 2 : 1;  // threads sharing one 1-D FFT
    static constexpr int kM = N / kSplit;           // in-register FFT length (<= 64)
    static constexpr int kLogM = ilog2(kM);
    static constexpr int kRows = N / 2;             // column pairs (pass 1) = packed rows (pass 2)
    static constexpr int kNh = N / 2 + 1;           // kx extent of a half-spectrum
    static constexpr int kNf = N * N / 2 + 2;       // frequencies stored (see the header)
#ifndef FBFFT_PLANES_8   // overridable only for tuning experiments (benchmarks/NOTES.md); the
#define FBFFT_PLANES_8 64  // host side (fbfft_plan.plan) carries the defaults
#endif
#ifndef FBFFT_PLANES_16
#define FBFFT_PLANES_16 32
#endif
    static constexpr int kPlanes = N <= 4 ? 128 : N == 8 ? FBFFT_PLANES_8 : N == 16 ? FBFFT_PLANES_16
                                 : N == 32 ? 8 : N == 64 ? 4 : 1;
    static constexpr int kThreads = kRows * kSplit * kPlanes;
    static constexpr int kColStride = N <= 16 ? kPlanes + 16 / kRows : N == 32 ? 9 : N == 64 ? 5 : 1;
    static constexpr int kRowStride = N <= 16 ? N * kColStride : N == 32 ? N * 9 + 8 : N == 64 ? N * 5 + 4 : N + 1;
    static constexpr int kSmemElems = kRows * kRowStride;  // float2
    static constexpr int kSmemBytes = kSmemElems * 8;      // dynamic shared memory of one block
    // The class c = tid / (kRows * kPlanes) must be the same for a whole warp.
    static_assert(kSplit == 1 || (kRows * kPlanes) % 32 == 0, "fbfft: split class not warp-uniform");
    static_assert(kSmemBytes <= 227 * 1024, "fbfft: shared memory over the sm_90 block limit");
    // n = 64: two blocks of 256 threads per SM need <= 128 registers a thread.
    static constexpr int kMinBlocks = N == 64 ? 2 : 1;
    // The inverse stages its output through shared memory where that measured faster on an
    // H200 (benchmarks/NOTES.md): n <= 32, where a thread's own column stores are runs of
    // n/2 floats or less, cut shorter still by the clipped windows of the convolution
    // passes. At 64 it made no difference to the layers, and at 128 (one plane per block,
    // runs of 64 floats already) the extra barrier and round trip cost more than it saved.
    static constexpr bool kStageOut = N <= 32;
};

// Where row `row` of the half-spectrum starts in the (nf, B) layout, minus the kx of its
// first stored entry: row <= n/2 stores kx = 0..n/2 at row_base + kx, a row past n/2 only
// 0 < kx < n/2, also at row_base + kx.
template <int N>
__host__ __device__ constexpr long long row_base(int row)
{
    return row <= N / 2 ? (long long)row * Plan<N>::kNh
                        : (long long)(N / 2 + 1) * Plan<N>::kNh + (long long)(row - N / 2 - 1) * (N / 2 - 1) - 1;
}

// Straight-line (no loop) so that it folds to a constant wherever i is one, which is
// what lets the register arrays below be indexed by it. bits <= 7.
__host__ __device__ constexpr int bit_reverse(int i, int bits)
{
    return (((i & 1) << 6) | ((i & 2) << 4) | ((i & 4) << 2) | (i & 8) | ((i & 16) >> 2) |
            ((i & 32) >> 4) | ((i & 64) >> 6)) >> (7 - bits);
}

// The register that holds X[k] after load_split + dif_fft in thread class k % kSplit:
// k = kSplit * m + c, and DIF leaves X_c[m] in register bit_reverse(m).
template <int N>
__host__ __device__ constexpr int reg_of(int k)
{
    return bit_reverse(k / Plan<N>::kSplit, Plan<N>::kLogM);
}

__device__ __forceinline__ float2 cadd(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }
__device__ __forceinline__ float2 csub(float2 a, float2 b) { return make_float2(a.x - b.x, a.y - b.y); }
__device__ __forceinline__ float2 conjg(float2 a) { return make_float2(a.x, -a.y); }
__device__ __forceinline__ float2 mul_i(float2 a) { return make_float2(-a.y, a.x); }        // i a
__device__ __forceinline__ float2 mul_minus_i(float2 a) { return make_float2(a.y, -a.x); }  // -i a
__device__ __forceinline__ float2 cscale(float2 a, float s) { return make_float2(a.x * s, a.y * s); }

// kTwiddle[k] = exp(-2 pi i k / 256), rounded to float. Indexed only by compile-time
// constants, so every use is a constant-bank operand of an FMUL/FFMA: no loads, no
// registers, no special-function unit.
constexpr int kTwiddleN = 256;
__constant__ float2 kTwiddle[kTwiddleN] = {
    {1.00000000e+00f, 0.00000000e+00f}, {9.99698818e-01f, -2.45412290e-02f}, {9.98795450e-01f, -4.90676761e-02f}, {9.97290432e-01f, -7.35645667e-02f},
    {9.95184720e-01f, -9.80171412e-02f}, {9.92479563e-01f, -1.22410677e-01f}, {9.89176512e-01f, -1.46730468e-01f}, {9.85277653e-01f, -1.70961887e-01f},
    {9.80785251e-01f, -1.95090324e-01f}, {9.75702107e-01f, -2.19101235e-01f}, {9.70031261e-01f, -2.42980182e-01f}, {9.63776052e-01f, -2.66712755e-01f},
    {9.56940353e-01f, -2.90284663e-01f}, {9.49528158e-01f, -3.13681751e-01f}, {9.41544056e-01f, -3.36889863e-01f}, {9.32992816e-01f, -3.59895051e-01f},
    {9.23879504e-01f, -3.82683426e-01f}, {9.14209783e-01f, -4.05241311e-01f}, {9.03989315e-01f, -4.27555084e-01f}, {8.93224299e-01f, -4.49611336e-01f},
    {8.81921291e-01f, -4.71396744e-01f}, {8.70086968e-01f, -4.92898196e-01f}, {8.57728601e-01f, -5.14102757e-01f}, {8.44853580e-01f, -5.34997642e-01f},
    {8.31469595e-01f, -5.55570245e-01f}, {8.17584813e-01f, -5.75808167e-01f}, {8.03207517e-01f, -5.95699310e-01f}, {7.88346410e-01f, -6.15231574e-01f},
    {7.73010433e-01f, -6.34393275e-01f}, {7.57208824e-01f, -6.53172851e-01f}, {7.40951121e-01f, -6.71558976e-01f}, {7.24247098e-01f, -6.89540565e-01f},
    {7.07106769e-01f, -7.07106769e-01f}, {6.89540565e-01f, -7.24247098e-01f}, {6.71558976e-01f, -7.40951121e-01f}, {6.53172851e-01f, -7.57208824e-01f},
    {6.34393275e-01f, -7.73010433e-01f}, {6.15231574e-01f, -7.88346410e-01f}, {5.95699310e-01f, -8.03207517e-01f}, {5.75808167e-01f, -8.17584813e-01f},
    {5.55570245e-01f, -8.31469595e-01f}, {5.34997642e-01f, -8.44853580e-01f}, {5.14102757e-01f, -8.57728601e-01f}, {4.92898196e-01f, -8.70086968e-01f},
    {4.71396744e-01f, -8.81921291e-01f}, {4.49611336e-01f, -8.93224299e-01f}, {4.27555084e-01f, -9.03989315e-01f}, {4.05241311e-01f, -9.14209783e-01f},
    {3.82683426e-01f, -9.23879504e-01f}, {3.59895051e-01f, -9.32992816e-01f}, {3.36889863e-01f, -9.41544056e-01f}, {3.13681751e-01f, -9.49528158e-01f},
    {2.90284663e-01f, -9.56940353e-01f}, {2.66712755e-01f, -9.63776052e-01f}, {2.42980182e-01f, -9.70031261e-01f}, {2.19101235e-01f, -9.75702107e-01f},
    {1.95090324e-01f, -9.80785251e-01f}, {1.70961887e-01f, -9.85277653e-01f}, {1.46730468e-01f, -9.89176512e-01f}, {1.22410677e-01f, -9.92479563e-01f},
    {9.80171412e-02f, -9.95184720e-01f}, {7.35645667e-02f, -9.97290432e-01f}, {4.90676761e-02f, -9.98795450e-01f}, {2.45412290e-02f, -9.99698818e-01f},
    {6.12323426e-17f, -1.00000000e+00f}, {-2.45412290e-02f, -9.99698818e-01f}, {-4.90676761e-02f, -9.98795450e-01f}, {-7.35645667e-02f, -9.97290432e-01f},
    {-9.80171412e-02f, -9.95184720e-01f}, {-1.22410677e-01f, -9.92479563e-01f}, {-1.46730468e-01f, -9.89176512e-01f}, {-1.70961887e-01f, -9.85277653e-01f},
    {-1.95090324e-01f, -9.80785251e-01f}, {-2.19101235e-01f, -9.75702107e-01f}, {-2.42980182e-01f, -9.70031261e-01f}, {-2.66712755e-01f, -9.63776052e-01f},
    {-2.90284663e-01f, -9.56940353e-01f}, {-3.13681751e-01f, -9.49528158e-01f}, {-3.36889863e-01f, -9.41544056e-01f}, {-3.59895051e-01f, -9.32992816e-01f},
    {-3.82683426e-01f, -9.23879504e-01f}, {-4.05241311e-01f, -9.14209783e-01f}, {-4.27555084e-01f, -9.03989315e-01f}, {-4.49611336e-01f, -8.93224299e-01f},
    {-4.71396744e-01f, -8.81921291e-01f}, {-4.92898196e-01f, -8.70086968e-01f}, {-5.14102757e-01f, -8.57728601e-01f}, {-5.34997642e-01f, -8.44853580e-01f},
    {-5.55570245e-01f, -8.31469595e-01f}, {-5.75808167e-01f, -8.17584813e-01f}, {-5.95699310e-01f, -8.03207517e-01f}, {-6.15231574e-01f, -7.88346410e-01f},
    {-6.34393275e-01f, -7.73010433e-01f}, {-6.53172851e-01f, -7.57208824e-01f}, {-6.71558976e-01f, -7.40951121e-01f}, {-6.89540565e-01f, -7.24247098e-01f},
    {-7.07106769e-01f, -7.07106769e-01f}, {-7.24247098e-01f, -6.89540565e-01f}, {-7.40951121e-01f, -6.71558976e-01f}, {-7.57208824e-01f, -6.53172851e-01f},
    {-7.73010433e-01f, -6.34393275e-01f}, {-7.88346410e-01f, -6.15231574e-01f}, {-8.03207517e-01f, -5.95699310e-01f}, {-8.17584813e-01f, -5.75808167e-01f},
    {-8.31469595e-01f, -5.55570245e-01f}, {-8.44853580e-01f, -5.34997642e-01f}, {-8.57728601e-01f, -5.14102757e-01f}, {-8.70086968e-01f, -4.92898196e-01f},
    {-8.81921291e-01f, -4.71396744e-01f}, {-8.93224299e-01f, -4.49611336e-01f}, {-9.03989315e-01f, -4.27555084e-01f}, {-9.14209783e-01f, -4.05241311e-01f},
    {-9.23879504e-01f, -3.82683426e-01f}, {-9.32992816e-01f, -3.59895051e-01f}, {-9.41544056e-01f, -3.36889863e-01f}, {-9.49528158e-01f, -3.13681751e-01f},
    {-9.56940353e-01f, -2.90284663e-01f}, {-9.63776052e-01f, -2.66712755e-01f}, {-9.70031261e-01f, -2.42980182e-01f}, {-9.75702107e-01f, -2.19101235e-01f},
    {-9.80785251e-01f, -1.95090324e-01f}, {-9.85277653e-01f, -1.70961887e-01f}, {-9.89176512e-01f, -1.46730468e-01f}, {-9.92479563e-01f, -1.22410677e-01f},
    {-9.95184720e-01f, -9.80171412e-02f}, {-9.97290432e-01f, -7.35645667e-02f}, {-9.98795450e-01f, -4.90676761e-02f}, {-9.99698818e-01f, -2.45412290e-02f},
    {-1.00000000e+00f, -1.22464685e-16f}, {-9.99698818e-01f, 2.45412290e-02f}, {-9.98795450e-01f, 4.90676761e-02f}, {-9.97290432e-01f, 7.35645667e-02f},
    {-9.95184720e-01f, 9.80171412e-02f}, {-9.92479563e-01f, 1.22410677e-01f}, {-9.89176512e-01f, 1.46730468e-01f}, {-9.85277653e-01f, 1.70961887e-01f},
    {-9.80785251e-01f, 1.95090324e-01f}, {-9.75702107e-01f, 2.19101235e-01f}, {-9.70031261e-01f, 2.42980182e-01f}, {-9.63776052e-01f, 2.66712755e-01f},
    {-9.56940353e-01f, 2.90284663e-01f}, {-9.49528158e-01f, 3.13681751e-01f}, {-9.41544056e-01f, 3.36889863e-01f}, {-9.32992816e-01f, 3.59895051e-01f},
    {-9.23879504e-01f, 3.82683426e-01f}, {-9.14209783e-01f, 4.05241311e-01f}, {-9.03989315e-01f, 4.27555084e-01f}, {-8.93224299e-01f, 4.49611336e-01f},
    {-8.81921291e-01f, 4.71396744e-01f}, {-8.70086968e-01f, 4.92898196e-01f}, {-8.57728601e-01f, 5.14102757e-01f}, {-8.44853580e-01f, 5.34997642e-01f},
    {-8.31469595e-01f, 5.55570245e-01f}, {-8.17584813e-01f, 5.75808167e-01f}, {-8.03207517e-01f, 5.95699310e-01f}, {-7.88346410e-01f, 6.15231574e-01f},
    {-7.73010433e-01f, 6.34393275e-01f}, {-7.57208824e-01f, 6.53172851e-01f}, {-7.40951121e-01f, 6.71558976e-01f}, {-7.24247098e-01f, 6.89540565e-01f},
    {-7.07106769e-01f, 7.07106769e-01f}, {-6.89540565e-01f, 7.24247098e-01f}, {-6.71558976e-01f, 7.40951121e-01f}, {-6.53172851e-01f, 7.57208824e-01f},
    {-6.34393275e-01f, 7.73010433e-01f}, {-6.15231574e-01f, 7.88346410e-01f}, {-5.95699310e-01f, 8.03207517e-01f}, {-5.75808167e-01f, 8.17584813e-01f},
    {-5.55570245e-01f, 8.31469595e-01f}, {-5.34997642e-01f, 8.44853580e-01f}, {-5.14102757e-01f, 8.57728601e-01f}, {-4.92898196e-01f, 8.70086968e-01f},
    {-4.71396744e-01f, 8.81921291e-01f}, {-4.49611336e-01f, 8.93224299e-01f}, {-4.27555084e-01f, 9.03989315e-01f}, {-4.05241311e-01f, 9.14209783e-01f},
    {-3.82683426e-01f, 9.23879504e-01f}, {-3.59895051e-01f, 9.32992816e-01f}, {-3.36889863e-01f, 9.41544056e-01f}, {-3.13681751e-01f, 9.49528158e-01f},
    {-2.90284663e-01f, 9.56940353e-01f}, {-2.66712755e-01f, 9.63776052e-01f}, {-2.42980182e-01f, 9.70031261e-01f}, {-2.19101235e-01f, 9.75702107e-01f},
    {-1.95090324e-01f, 9.80785251e-01f}, {-1.70961887e-01f, 9.85277653e-01f}, {-1.46730468e-01f, 9.89176512e-01f}, {-1.22410677e-01f, 9.92479563e-01f},
    {-9.80171412e-02f, 9.95184720e-01f}, {-7.35645667e-02f, 9.97290432e-01f}, {-4.90676761e-02f, 9.98795450e-01f}, {-2.45412290e-02f, 9.99698818e-01f},
    {-1.83697015e-16f, 1.00000000e+00f}, {2.45412290e-02f, 9.99698818e-01f}, {4.90676761e-02f, 9.98795450e-01f}, {7.35645667e-02f, 9.97290432e-01f},
    {9.80171412e-02f, 9.95184720e-01f}, {1.22410677e-01f, 9.92479563e-01f}, {1.46730468e-01f, 9.89176512e-01f}, {1.70961887e-01f, 9.85277653e-01f},
    {1.95090324e-01f, 9.80785251e-01f}, {2.19101235e-01f, 9.75702107e-01f}, {2.42980182e-01f, 9.70031261e-01f}, {2.66712755e-01f, 9.63776052e-01f},
    {2.90284663e-01f, 9.56940353e-01f}, {3.13681751e-01f, 9.49528158e-01f}, {3.36889863e-01f, 9.41544056e-01f}, {3.59895051e-01f, 9.32992816e-01f},
    {3.82683426e-01f, 9.23879504e-01f}, {4.05241311e-01f, 9.14209783e-01f}, {4.27555084e-01f, 9.03989315e-01f}, {4.49611336e-01f, 8.93224299e-01f},
    {4.71396744e-01f, 8.81921291e-01f}, {4.92898196e-01f, 8.70086968e-01f}, {5.14102757e-01f, 8.57728601e-01f}, {5.34997642e-01f, 8.44853580e-01f},
    {5.55570245e-01f, 8.31469595e-01f}, {5.75808167e-01f, 8.17584813e-01f}, {5.95699310e-01f, 8.03207517e-01f}, {6.15231574e-01f, 7.88346410e-01f},
    {6.34393275e-01f, 7.73010433e-01f}, {6.53172851e-01f, 7.57208824e-01f}, {6.71558976e-01f, 7.40951121e-01f}, {6.89540565e-01f, 7.24247098e-01f},
    {7.07106769e-01f, 7.07106769e-01f}, {7.24247098e-01f, 6.89540565e-01f}, {7.40951121e-01f, 6.71558976e-01f}, {7.57208824e-01f, 6.53172851e-01f},
    {7.73010433e-01f, 6.34393275e-01f}, {7.88346410e-01f, 6.15231574e-01f}, {8.03207517e-01f, 5.95699310e-01f}, {8.17584813e-01f, 5.75808167e-01f},
    {8.31469595e-01f, 5.55570245e-01f}, {8.44853580e-01f, 5.34997642e-01f}, {8.57728601e-01f, 5.14102757e-01f}, {8.70086968e-01f, 4.92898196e-01f},
    {8.81921291e-01f, 4.71396744e-01f}, {8.93224299e-01f, 4.49611336e-01f}, {9.03989315e-01f, 4.27555084e-01f}, {9.14209783e-01f, 4.05241311e-01f},
    {9.23879504e-01f, 3.82683426e-01f}, {9.32992816e-01f, 3.59895051e-01f}, {9.41544056e-01f, 3.36889863e-01f}, {9.49528158e-01f, 3.13681751e-01f},
    {9.56940353e-01f, 2.90284663e-01f}, {9.63776052e-01f, 2.66712755e-01f}, {9.70031261e-01f, 2.42980182e-01f}, {9.75702107e-01f, 2.19101235e-01f},
    {9.80785251e-01f, 1.95090324e-01f}, {9.85277653e-01f, 1.70961887e-01f}, {9.89176512e-01f, 1.46730468e-01f}, {9.92479563e-01f, 1.22410677e-01f},
    {9.95184720e-01f, 9.80171412e-02f}, {9.97290432e-01f, 7.35645667e-02f}, {9.98795450e-01f, 4.90676761e-02f}, {9.99698818e-01f, 2.45412290e-02f},
};

// a * exp(-+2 pi i k / 256): minus for the forward transform, plus for the inverse.
// k is a compile-time constant once the FFT loops are unrolled; k = 0 and the quarter,
// half and three-quarter turns (-i, -1, +i forward) cost no multiplication.
template <bool INV>
__device__ __forceinline__ float2 twiddle(float2 a, int k)
{
    if (k == 0) return a;
    if (k == kTwiddleN / 4) return INV ? mul_i(a) : mul_minus_i(a);
    if (k == kTwiddleN / 2) return make_float2(-a.x, -a.y);
    if (k == 3 * kTwiddleN / 4) return INV ? mul_minus_i(a) : mul_i(a);
    const float2 w = kTwiddle[k];
    const float wy = INV ? -w.y : w.y;
    return make_float2(a.x * w.x - a.y * wy, a.x * wy + a.y * w.x);
}

// In-place radix-2 decimation-in-frequency FFT of length M on registers (natural order
// in, bit-reversed order out: afterwards v[i] = X[bit_reverse(i)]). Stage s combines
// elements `half` = M / 2^(s+1) apart:  (a, b) -> (a + b, (a - b) W_{2 half}^j).
template <int M, bool INV>
__device__ __forceinline__ void dif_fft(float2 (&v)[M])
{
    constexpr int kStages = ilog2(M);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
        const int half = M >> (s + 1);
#pragma unroll
        for (int i = 0; i < M / 2; ++i) {
            const int j = i % half;                       // position inside the butterfly group
            const int lo = (i / half) * 2 * half + j;
            const float2 a = v[lo], b = v[lo + half];
            v[lo] = cadd(a, b);
            v[lo + half] = twiddle<INV>(csub(a, b), j * (kTwiddleN / (2 * half)));
        }
    }
}

// Loads a length-N signal u = load(0..N-1) into v[0..kM) of thread class C, applying
// the first radix-kSplit DIF step on the fly:
//   kSplit = 1:  v[j] = u[j]
//   kSplit = 2:  C = 0: v[j] = u[j] + u[j + M]             -> X[2m]     after dif_fft
//                C = 1: v[j] = (u[j] - u[j + M]) W_N^j      -> X[2m + 1] after dif_fft
// For kSplit = 2, j and M - j are done together: Hermitian sources load the same
// values for u[j], u[N - j] and for u[M - j], u[M + j], so each is loaded once.
template <int N, int C, bool INV, class Load>
__device__ __forceinline__ void load_split(float2 (&v)[Plan<N>::kM], const Load& load)
{
    constexpr int M = Plan<N>::kM;
    if constexpr (Plan<N>::kSplit == 1) {
#pragma unroll
        for (int j = 0; j < M; ++j) v[j] = load(j);
    } else {
        auto step = [&](int j) {
            const float2 a = load(j), b = load(j + M);
            v[j] = C == 0 ? cadd(a, b) : twiddle<INV>(csub(a, b), j * (kTwiddleN / N));
        };
#pragma unroll
        for (int j = 0; j <= M / 2; ++j) {
            step(j);
            if (j > 0 && j < M / 2) step(M - j);
        }
    }
}

// ---- forward ------------------------------------------------------------------------

// Pass 1, thread (xp, p) of class C: the complex signal z[y] = load(y), y < n (columns xp and
// xp + n/2 of plane p, as real and imaginary parts) FFTed along y; writes rows 0..n/2-1 of S[.][xp]
// and S[.][xp + n/2]. Split from its loads so that the tiled FFT (tiledfft.cu) reads tile windows
// through the same pass.
template <int N, int C, class Load>
__device__ __forceinline__ void rfft2_columns_of(float2* smem, int xp, int p, const Load& load)
{
    using P = Plan<N>;
    float2 v[P::kM];
    load_split<N, C, false>(v, load);
    dif_fft<P::kM, false>(v);
    float2* s1 = smem + xp * P::kColStride + p;  // S[.][xp][p]
    float2* s2 = s1 + (N / 2) * P::kColStride;   // S[.][xp + n/2][p]
#pragma unroll
    for (int r = 0; r < N / 2; ++r) {
        if (r % P::kSplit != C) continue;
        if (r == 0) {  // C1[0], C1[n/2], C2[0], C2[n/2] are real: one slot per column
            const float2 z0 = v[reg_of<N>(0)], zh = v[reg_of<N>(N / 2)];
            s1[0] = make_float2(z0.x, zh.x);
            s2[0] = make_float2(z0.y, zh.y);
        } else {       // C1 = (Z[r] + conj Z[n-r]) / 2,  C2 = (Z[r] - conj Z[n-r]) / 2i
            const float2 zk = v[reg_of<N>(r)], zm = conjg(v[reg_of<N>(N - r)]);
            s1[r * P::kRowStride] = cscale(cadd(zk, zm), 0.5f);
            s2[r * P::kRowStride] = cscale(mul_minus_i(csub(zk, zm)), 0.5f);
        }
    }
}

// Pass 1 of plane b of the input, padded on the fly.
template <int N, int C>
__device__ __forceinline__ void rfft2_columns(const float* __restrict__ in, float2* smem,
                                              long long b, int B, int h, int w,
                                              int pad_top, int pad_left, int xp, int p)
{
    const int ix1 = xp - pad_left, ix2 = xp + N / 2 - pad_left;  // input columns
    const bool plane_ok = b < B;
    const bool ok1 = plane_ok && (unsigned)ix1 < (unsigned)w;
    const bool ok2 = plane_ok && (unsigned)ix2 < (unsigned)w;
    const float* plane = in + (plane_ok ? b : 0) * (long long)h * w;
    // z[y] = P[y][xp] + i P[y][xp + n/2]; outside the input it reads 0 (implicit padding)
    auto load = [&](int y) {
        const int iy = y - pad_top;
        const bool row_ok = (unsigned)iy < (unsigned)h;
        const float re = (row_ok && ok1) ? plane[iy * w + ix1] : 0.f;
        const float im = (row_ok && ok2) ? plane[iy * w + ix2] : 0.f;
        return make_float2(re, im);
    };
    rfft2_columns_of<N, C>(smem, xp, p, load);
}

// Pass 2, thread (p, r) of class C: row r of S along x, then the stores of F[r][kx]
// and F[n-r][kx] = conj F[r][n-kx] (row 0: F[0] and F[n/2], split out of
// FFT(C[0] + i C[n/2])), kx = 0..n/2, into out (nf, B); of row n - r > n/2 only
// 0 < kx < n/2 is stored.
template <int N, int C>
__device__ __forceinline__ void rfft2_rows(float2* __restrict__ out, const float2* smem,
                                           long long b, int B, int r, int p)
{
    using P = Plan<N>;
    const float2* s = smem + r * P::kRowStride + p;  // S[r][.][p]
    auto load = [&](int x) { return s[x * P::kColStride]; };
    float2 v[P::kM];
    load_split<N, C, false>(v, load);
    dif_fft<P::kM, false>(v);
    if (b >= B) return;  // a plane past the batch (last block); no barrier follows
    const bool packed = r == 0;
    const long long fstride = B;  // distance between consecutive frequencies in out
    float2* outA = out + row_base<N>(r) * fstride + b;
    float2* outB = out + row_base<N>(packed ? N / 2 : N - r) * fstride + b;
#pragma unroll
    for (int kx = 0; kx <= N / 2; ++kx) {
        if (kx % P::kSplit != C) continue;
        const float2 u = v[reg_of<N>(kx)];                  // Y[kx]
        const float2 m = conjg(v[reg_of<N>((N - kx) % N)]);  // conj Y[n - kx]
        outA[kx * fstride] = packed ? cscale(cadd(u, m), 0.5f) : u;
        if (packed || (kx > 0 && kx < N / 2))                // F[n-r][0], F[n-r][n/2]: not stored
            outB[kx * fstride] = packed ? cscale(mul_minus_i(csub(u, m)), 0.5f) : m;
    }
}

// ---- inverse ------------------------------------------------------------------------

// Pass 1, thread (p, r) of class C: row r of the full spectrum rebuilt from the half
// (row 0 packed as F[0] + i F[n/2]), inverse FFT along kx, into S[r][.][p].
// Thread (p, r) reads F[r][0..n/2] and F[r'][0..n/2], r' = n - r (or n/2): each
// element of the input exactly once.
template <int N, int C>
__device__ __forceinline__ void irfft2_rows(const float2* __restrict__ in, float2* smem,
                                            long long b, int B, int r, int p)
{
    using P = Plan<N>;
    const bool packed = r == 0;
    const bool plane_ok = b < B;
    const long long fstride = B;
    // A plane past the batch (last block) reads plane 0 instead; its results are never stored.
    const float2* inA = in + row_base<N>(r) * fstride + (plane_ok ? b : 0);
    const float2* inB = in + row_base<N>(packed ? N / 2 : N - r) * fstride + (plane_ok ? b : 0);
    // y[kx], kx = 0..n-1, from a = F[r][k] (or F[0][k]) and c = F[r'][k] (or F[n/2][k]):
    //   y[k]     = a                            (packed: a + i c)
    //   y[n - k] = conj F[r][...] = conj c      (packed: conj a + i conj c), 0 < k < n/2
    // Each input element is loaded once, for both of the y's it feeds.
    float2 y[N];
#pragma unroll
    for (int k = 0; k <= N / 2; ++k) {
        // Of row r' > n/2 only 0 < k < n/2 is stored (and used): at k = 0 and n/2 an unpacked
        // row reads a stored neighbour instead, unconditionally (a predicated load costs
        // n = 128 its last registers), and never uses it.
        const int kc = (k > 0 && k < N / 2) ? k : k == 0 ? 1 : N / 2 - 1;
        const float2 a = inA[k * fstride], c = inB[(packed ? k : kc) * fstride];
        y[k] = packed ? cadd(a, mul_i(c)) : a;
        if (k > 0 && k < N / 2) y[N - k] = packed ? cadd(conjg(a), mul_i(conjg(c))) : conjg(c);
    }
    auto load = [&](int kx) { return y[kx]; };
    float2 v[P::kM];
    load_split<N, C, true>(v, load);
    dif_fft<P::kM, true>(v);
    float2* s = smem + r * P::kRowStride + p;
#pragma unroll
    for (int x = 0; x < N; ++x) {
        if (x % P::kSplit != C) continue;
        s[x * P::kColStride] = v[reg_of<N>(x)];
    }
}

// Pass 2, thread (xp, p) of class C: columns xp and xp + n/2 packed as one complex
// inverse FFT along ky (a real column's spectrum G[ky] is Hermitian, so S holds
// ky = 0..n/2, with G[0] + i G[n/2] in slot 0); leaves p1[y] + i p2[y] (unscaled) in
// register reg_of(y) of v.
template <int N, int C>
__device__ __forceinline__ void irfft2_columns(float2 (&v)[Plan<N>::kM], const float2* smem, int xp, int p)
{
    using P = Plan<N>;
    const float2* s1 = smem + xp * P::kColStride + p;  // G1 = G[.][xp]
    const float2* s2 = s1 + (N / 2) * P::kColStride;   // G2 = G[.][xp + n/2]
    // Z[ky] = G1[ky] + i G2[ky] for ky = 0..n-1, using G[n - ky] = conj G[ky]
    auto load = [&](int ky) {
        if (ky == 0) return make_float2(s1[0].x, s2[0].x);
        if (ky == N / 2) return make_float2(s1[0].y, s2[0].y);
        if (ky < N / 2) return cadd(s1[ky * P::kRowStride], mul_i(s2[ky * P::kRowStride]));
        const int k = N - ky;
        return cadd(conjg(s1[k * P::kRowStride]), mul_i(conjg(s2[k * P::kRowStride])));
    };
    load_split<N, C, true>(v, load);
    dif_fft<P::kM, true>(v);
}

// The clipped window of columns xp and xp + n/2, scaled, into `plane` (out_h x out_w):
// the plane's slot in the staging area, or the plane in the output itself.
template <int N, int C>
__device__ __forceinline__ void store_columns(float* plane, bool plane_ok, const float2 (&v)[Plan<N>::kM],
                                              int row_off, int col_off, int out_h, int out_w, float scale,
                                              int xp)
{
    const int ox1 = xp - col_off, ox2 = xp + N / 2 - col_off;  // output columns
    const bool ok1 = plane_ok && (unsigned)ox1 < (unsigned)out_w;
    const bool ok2 = plane_ok && (unsigned)ox2 < (unsigned)out_w;
#pragma unroll
    for (int y = 0; y < N; ++y) {
        if (y % Plan<N>::kSplit != C) continue;
        const int oy = y - row_off;
        if ((unsigned)oy >= (unsigned)out_h) continue;  // clipped: never stored
        const float2 z = v[reg_of<N>(y)];
        if (ok1) plane[oy * out_w + ox1] = scale * z.x;
        if (ok2) plane[oy * out_w + ox2] = scale * z.y;
    }
}


// ---- 1-D ----------------------------------------------------------------------------
// Batched real 1-D FFTs of power-of-two size N = 2..256, same conventions as the 2-D pair:
//   fbfft_rfft1<N>   in : float  (B, len)   len <= N, placed at offset pad of an implicit
//                                           length-N zero signal p_b
//                    out: float2 (N/2 + 1, B)   out[k][b] = sum_t p_b[t] exp(-2 pi i k t / N),
//                                           frequency-major, the batch fastest
//   fbfft_irfft1<N>  in : float2 (N/2 + 1, B)   Hermitian half-spectra
//                    out: float  (B, out_len)   out[b][i] = scale * sum_k F_b[k] exp(+2 pi i k t / N)
//                                           at t = off + i (the full Hermitian sum)
// A real signal of length N is packed as one complex signal of length L = N/2,
// z[m] = p[2m] + i p[2m+1] (even samples real, odd imaginary), and unpacked with
//   X[k] = (Z[k] + conj Z[L-k]) / 2  -  i W_N^k (Z[k] - conj Z[L-k]) / 2,   k = 0..L
// (indices of Z mod L); the inverse rebuilds Z[k] = E[k] + i O[k] from
//   E[k] = (X[k] + conj X[L-k]) / 2,   O[k] = (X[k] - conj X[L-k]) W_N^-k / 2.
// A block takes kSignals signals. Each passes through shared memory once: coalesced loads
// (zero padding implied) into one row per signal, then thread (s, c) reads its signal's
// complex samples and runs the L-point FFT: L <= 32 in one thread's registers (kSplit = 1);
// L = 64, 128 split over kSplit = L / 32 threads by one radix-kSplit DIF step taken as the
// values are loaded (load_radix: class c ends with X[kSplit m + c]). The unpacking pairs
// Z[k] with Z[L-k], which another class may hold, so the spectrum goes back to the row in
// shared memory first. Lanes of a warp are consecutive signals: every store of the
// frequency-major spectrum is a run of consecutive addresses, and the row stride
// (N/2 + 1 complex, odd) keeps those lanes in distinct banks.

template <int N>
struct Plan1 {
    static_assert(N >= 2 && N <= 256 && (N & (N - 1)) == 0, "fbfft: 1-D N must be a power of two in 2..256");
    static constexpr int kL = N / 2;                     // complex FFT length (even/odd packing)
    static constexpr int kSplit = kL > 32 ? kL / 32 : 1; // threads sharing one complex FFT
    static constexpr int kM = kL / kSplit;               // in-register FFT length (<= 32)
    static constexpr int kLogM = ilog2(kM);
    static constexpr int kSignals = N <= 32 ? 256 : 8192 / N;
    static constexpr int kThreads = kSignals * kSplit;
    static constexpr int kRow = kL + 1;                  // complex slots per signal (odd)
    static constexpr int kSmemBytes = kSignals * kRow * 8;
    static_assert(kSignals % 32 == 0, "fbfft: a warp must cover 32 signals of one class");
    static_assert(kSmemBytes <= 227 * 1024, "fbfft: shared memory over the sm_90 block limit");
};

// The first radix-R DIF step of an L-point FFT, taken as the values are loaded: thread
// class C keeps v[j] = W_L^{jC} sum_q u[j + qM] W_R^{qC} (M = L / R), so that after
// dif_fft<M> register bit_reverse(m) holds X[R m + C].
template <int L, int R, int C, bool INV, class Load>
__device__ __forceinline__ void load_radix(float2 (&v)[L / R], const Load& load)
{
    constexpr int M = L / R;
#pragma unroll
    for (int j = 0; j < M; ++j) {
        float2 acc = load(j);
#pragma unroll
        for (int q = 1; q < R; ++q)
            acc = cadd(acc, twiddle<INV>(load(j + q * M), ((q * C) % R) * (kTwiddleN / R)));
        v[j] = twiddle<INV>(acc, j * C * (kTwiddleN / L));
    }
}

template <int N, int C>
__device__ __forceinline__ void rfft1_body(float2* __restrict__ out, float2* row, long long b, int B)
{
    using P = Plan1<N>;
    float2 v[P::kM];
    load_radix<P::kL, P::kSplit, C, false>(v, [&](int m) { return row[m]; });
    dif_fft<P::kM, false>(v);
    __syncthreads();  // every thread of the block has read its samples
#pragma unroll
    for (int m = 0; m < P::kM; ++m) row[P::kSplit * m + C] = v[bit_reverse(m, P::kLogM)];
    __syncthreads();
    if (b >= B) return;  // a signal past the batch; no barrier follows
#pragma unroll
    for (int k = C; k <= P::kL; k += P::kSplit) {
        const float2 z = row[k % P::kL], zc = conjg(row[(P::kL - k) % P::kL]);
        const float2 d = twiddle<false>(csub(z, zc), k * (kTwiddleN / N));  // W_N^k (Z[k] - conj Z[L-k])
        out[(long long)k * B + b] = cscale(cadd(cadd(z, zc), mul_minus_i(d)), 0.5f);
    }
}

template <int N, int C>
__device__ __forceinline__ void irfft1_body(const float2* __restrict__ in, float2* row, long long b,
                                            int B, float scale)
{
    using P = Plan1<N>;
    const long long bb = b < B ? b : 0;  // a signal past the batch reads signal 0, never stored
#pragma unroll
    for (int k = C; k < P::kL; k += P::kSplit) {
        const float2 x = in[(long long)k * B + bb], xc = conjg(in[(long long)(P::kL - k) * B + bb]);
        const float2 e = cadd(x, xc);                                      // 2 E[k]
        const float2 o = twiddle<true>(csub(x, xc), k * (kTwiddleN / N));  // 2 O[k]
        row[k] = cscale(cadd(e, mul_i(o)), 0.5f);                          // Z[k] = E + i O
    }
    __syncthreads();
    float2 v[P::kM];
    load_radix<P::kL, P::kSplit, C, true>(v, [&](int m) { return row[m]; });
    // v[bit_reverse(m)] = sum_k Z[k] W_L^-kt = (N/2) (q[2t] + i q[2t+1]), t = kSplit m + C,
    // where q is the inverse at scale 1/N: times 2 scale gives the output at `scale`.
    dif_fft<P::kM, true>(v);
    __syncthreads();
#pragma unroll
    for (int m = 0; m < P::kM; ++m)
        row[P::kSplit * m + C] = cscale(v[bit_reverse(m, P::kLogM)], 2.f * scale);
}

}  // namespace fbfft

// ---- kernels ------------------------------------------------------------------------
// One block transforms Plan<N>::kPlanes consecutive planes: grid = ceil(B / kPlanes),
// block = Plan<N>::kThreads (checked: a mismatched launch traps instead of silently
// transforming the wrong planes). Thread roles: pass "columns" is (xp, p, c) with xp
// fastest (consecutive lanes read consecutive input columns); pass "rows" is (p, r, c)
// with p fastest (consecutive lanes touch consecutive planes of one frequency).

template <int N>
__global__ void __launch_bounds__(fbfft::Plan<N>::kThreads, fbfft::Plan<N>::kMinBlocks)
fbfft_rfft2(const float* __restrict__ in, float2* __restrict__ out,
            int B, int h, int w, int pad_top, int pad_left)
{
    using P = fbfft::Plan<N>;
    FBFFT_SHARED_BUFFER(smem);  // P::kSmemBytes, passed at launch
    if (blockDim.x != P::kThreads) __trap();
    const int tid = threadIdx.x;
    const long long b0 = (long long)blockIdx.x * P::kPlanes;
    {
        const int xp = tid % P::kRows, p = (tid / P::kRows) % P::kPlanes;
        const int c = tid / (P::kRows * P::kPlanes);
        if (c == 0) fbfft::rfft2_columns<N, 0>(in, smem, b0 + p, B, h, w, pad_top, pad_left, xp, p);
        else if constexpr (P::kSplit == 2)
            fbfft::rfft2_columns<N, 1>(in, smem, b0 + p, B, h, w, pad_top, pad_left, xp, p);
    }
    __syncthreads();
    {
        const int p = tid % P::kPlanes, r = (tid / P::kPlanes) % P::kRows;
        const int c = tid / (P::kPlanes * P::kRows);
        if (c == 0) fbfft::rfft2_rows<N, 0>(out, smem, b0 + p, B, r, p);
        else if constexpr (P::kSplit == 2) fbfft::rfft2_rows<N, 1>(out, smem, b0 + p, B, r, p);
    }
}

template <int N>
__global__ void __launch_bounds__(fbfft::Plan<N>::kThreads, fbfft::Plan<N>::kMinBlocks)
fbfft_irfft2(const float2* __restrict__ in, float* __restrict__ out, int B,
             int row_off, int col_off, int out_h, int out_w, float scale)
{
    using P = fbfft::Plan<N>;
    FBFFT_SHARED_BUFFER(smem);  // P::kSmemBytes, passed at launch
    static_assert(P::kPlanes * N * N <= 2 * P::kSmemElems, "fbfft: output staging does not fit");
    if (blockDim.x != P::kThreads) __trap();
    const int tid = threadIdx.x;
    const long long b0 = (long long)blockIdx.x * P::kPlanes;
    {
        const int p = tid % P::kPlanes, r = (tid / P::kPlanes) % P::kRows;
        const int c = tid / (P::kPlanes * P::kRows);
        if (c == 0) fbfft::irfft2_rows<N, 0>(in, smem, b0 + p, B, r, p);
        else if constexpr (P::kSplit == 2) fbfft::irfft2_rows<N, 1>(in, smem, b0 + p, B, r, p);
    }
    __syncthreads();
    const int xp = tid % P::kRows, p = (tid / P::kRows) % P::kPlanes;
    const int c = tid / (P::kRows * P::kPlanes);
    float2 v[P::kM];
    if (c == 0) fbfft::irfft2_columns<N, 0>(v, smem, xp, p);
    else if constexpr (P::kSplit == 2) fbfft::irfft2_columns<N, 1>(v, smem, xp, p);
    const int window = out_h * out_w;
    if constexpr (P::kStageOut) {
        // The results stay in registers until every thread has read S, then go to a staging
        // copy of the block's output (over S): the global stores become one contiguous,
        // coalesced run per block instead of short runs per plane and row.
        __syncthreads();
        float* plane = reinterpret_cast<float*>(smem) + p * window;
        if (c == 0) fbfft::store_columns<N, 0>(plane, true, v, row_off, col_off, out_h, out_w, scale, xp);
        else if constexpr (P::kSplit == 2)
            fbfft::store_columns<N, 1>(plane, true, v, row_off, col_off, out_h, out_w, scale, xp);
        __syncthreads();
        const long long planes = B - b0 < P::kPlanes ? B - b0 : P::kPlanes;
        const int total = (int)planes * window;
        const float* stage = reinterpret_cast<const float*>(smem);
        float* dst = out + b0 * window;
        for (int i = tid; i < total; i += P::kThreads) dst[i] = stage[i];
    } else {
        const long long b = b0 + p;
        float* plane = out + (b < B ? b : 0) * window;
        if (c == 0) fbfft::store_columns<N, 0>(plane, b < B, v, row_off, col_off, out_h, out_w, scale, xp);
        else if constexpr (P::kSplit == 2)
            fbfft::store_columns<N, 1>(plane, b < B, v, row_off, col_off, out_h, out_w, scale, xp);
    }
}

// One block: Plan1<N>::kSignals consecutive signals, Plan1<N>::kThreads threads; thread
// (s, c) = (tid % kSignals, tid / kSignals). Shared memory holds one row of kRow complex
// slots per signal: first the real samples (two per slot), then the complex spectrum.
template <int N>
__global__ void __launch_bounds__(fbfft::Plan1<N>::kThreads)
fbfft_rfft1(const float* __restrict__ in, float2* __restrict__ out, int B, int len, int pad)
{
    using P = fbfft::Plan1<N>;
    FBFFT_SHARED_BUFFER(smem);  // P::kSmemBytes, passed at launch
    if (blockDim.x != P::kThreads) __trap();
    const int tid = threadIdx.x;
    const long long b0 = (long long)blockIdx.x * P::kSignals;
    float* real = reinterpret_cast<float*>(smem);  // real[s * 2 kRow + t], t < N
    for (int i = tid; i < P::kSignals * N; i += P::kThreads) {  // coalesced: t fastest
        const int s = i / N, t = i % N, it = t - pad;
        const long long b = b0 + s;
        real[s * 2 * P::kRow + t] = (b < B && (unsigned)it < (unsigned)len) ? in[b * len + it] : 0.f;
    }
    __syncthreads();
    const int s = tid % P::kSignals, c = tid / P::kSignals;
    float2* row = smem + s * P::kRow;
    if (c == 0) fbfft::rfft1_body<N, 0>(out, row, b0 + s, B);
    else if constexpr (P::kSplit > 1) {
        if (c == 1) fbfft::rfft1_body<N, 1>(out, row, b0 + s, B);
        else if constexpr (P::kSplit > 2) {
            if (c == 2) fbfft::rfft1_body<N, 2>(out, row, b0 + s, B);
            else fbfft::rfft1_body<N, 3>(out, row, b0 + s, B);
        }
    }
}

template <int N>
__global__ void __launch_bounds__(fbfft::Plan1<N>::kThreads)
fbfft_irfft1(const float2* __restrict__ in, float* __restrict__ out, int B, int off, int out_len,
             float scale)
{
    using P = fbfft::Plan1<N>;
    FBFFT_SHARED_BUFFER(smem);  // P::kSmemBytes, passed at launch
    if (blockDim.x != P::kThreads) __trap();
    const int tid = threadIdx.x;
    const long long b0 = (long long)blockIdx.x * P::kSignals;
    const int s = tid % P::kSignals, c = tid / P::kSignals;
    float2* row = smem + s * P::kRow;
    if (c == 0) fbfft::irfft1_body<N, 0>(in, row, b0 + s, B, scale);
    else if constexpr (P::kSplit > 1) {
        if (c == 1) fbfft::irfft1_body<N, 1>(in, row, b0 + s, B, scale);
        else if constexpr (P::kSplit > 2) {
            if (c == 2) fbfft::irfft1_body<N, 2>(in, row, b0 + s, B, scale);
            else fbfft::irfft1_body<N, 3>(in, row, b0 + s, B, scale);
        }
    }
    __syncthreads();
    const float* real = reinterpret_cast<const float*>(smem);
    for (int i = tid; i < P::kSignals * out_len; i += P::kThreads) {  // coalesced: i fastest
        const int sig = i / out_len, t = i % out_len;
        const long long b = b0 + sig;
        if (b < B) out[b * out_len + t] = real[sig * 2 * P::kRow + off + t];
    }
}

// ---- every instantiation backends/fbfft_kernels.py compiles -----------------------
// (NAME_EXPRESSIONS there; a CPU test keeps the two lists equal). Compiled only for the
// nvcc -cubin checks of tests/test_cuda_compile.py; at run time CuPy instantiates by
// name expression.
#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS
#define FBFFT_INSTANTIATE(N)                                                                   \
    template __global__ void fbfft_rfft2<N>(const float* __restrict__, float2* __restrict__,  \
                                            int, int, int, int, int);                          \
    template __global__ void fbfft_irfft2<N>(const float2* __restrict__, float* __restrict__, \
                                             int, int, int, int, int, float);
#define FBFFT_INSTANTIATE_1D(N)                                                                \
    template __global__ void fbfft_rfft1<N>(const float* __restrict__, float2* __restrict__,  \
                                            int, int, int);                                    \
    template __global__ void fbfft_irfft1<N>(const float2* __restrict__, float* __restrict__, \
                                             int, int, int, float);
// BEGIN SIZES (parsed by tests/test_fbfft_kernels.py)
FBFFT_INSTANTIATE(2)
FBFFT_INSTANTIATE(4)
FBFFT_INSTANTIATE(8)
FBFFT_INSTANTIATE(16)
FBFFT_INSTANTIATE(32)
FBFFT_INSTANTIATE(64)
FBFFT_INSTANTIATE(128)
// END SIZES
// BEGIN 1D SIZES (parsed by tests/test_fbfft_kernels.py)
FBFFT_INSTANTIATE_1D(2)
FBFFT_INSTANTIATE_1D(4)
FBFFT_INSTANTIATE_1D(8)
FBFFT_INSTANTIATE_1D(16)
FBFFT_INSTANTIATE_1D(32)
FBFFT_INSTANTIATE_1D(64)
FBFFT_INSTANTIATE_1D(128)
FBFFT_INSTANTIATE_1D(256)
// END 1D SIZES
#endif
