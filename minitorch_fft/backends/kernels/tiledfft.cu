// tiledfft: the tiled (overlap-save) FFT convolution's transforms, N = 8, 16, 32 (the algorithm,
// layouts and formulas: backends/tiledfft.py). fbfft's 2-D FFT passes (fbfft.cu) run unchanged on
// tiles instead of planes; only the reads and the writes differ.
//
// The batch of "planes" the fbfft passes see is here (tiles, planes) flattened, planes fastest:
// b = p * planes + plane, p = (image * th + i) * tw + j. So a spectrum (nf, B) is the GEMM-ready
// (nf, P, planes) that cgemm multiplies per frequency, as fbfft's (nf, S, f).
//
//   tiledfft_rfft2<N>   in : float  (S, planes, h, w)
//                       out: float2 (nf, P, planes)   the spectrum of tile (image, i, j)'s n x n
//                            window of each plane: rows i*mh - top + y, columns j*mw - left + x,
//                            y, x < N, read where they lie inside the plane and inside the
//                            window's first lh rows and lw columns, zero elsewhere
//                            (fprop/bprop: lh = lw = N, the input's windows; accGrad: the
//                            gradient's mh x mw blocks, top = left = 0, lh = mh, lw = mw)
//   tiledfft_irfft2<N>  in : float2 (nf, P, planes)   Hermitian half-spectra
//                       out: float  (S, planes, oh, ow)   of each tile's inverse (scaled), the
//                            mh x mw block at (row_off, col_off) of the basis, written at
//                            (i*mh, j*mw) of the output and clipped at its last row and column,
//                            staged in shared memory so that each of its rows is one store run
//
// Zero padding is implied by the bounds checks (no padded copy, no gathered windows), and the
// inverse writes in place (no n x n tiles in memory). top, left may be negative (bprop's
// cropping where the padding exceeds k - 1) or exceed N (a window wholly in the padding).
// Launch: as fbfft's 2-D kernels (Plan<N>: kPlanes tiles-planes per block, kThreads threads,
// kSmemBytes of dynamic shared memory). N <= 32 only: one thread per 1-D FFT (kSplit = 1).

#include "fbfft.cu"

namespace tiledfft {

// Where batch entry b of the (P, planes) batch lies: its plane's offset in (S, planes, ...) and
// its tile (i, j).
struct Tile {
    long long plane;  // image * planes + plane
    int i, j;
};

__device__ __forceinline__ Tile tile_of(long long b, int planes, int th, int tw)
{
    const long long p = b / planes;
    const int plane = (int)(b - p * planes);
    Tile t;
    t.j = (int)(p % tw);
    const long long q = p / tw;
    t.i = (int)(q % th);
    t.plane = (q / th) * planes + plane;
    return t;
}

}  // namespace tiledfft

template <int N>
__global__ void __launch_bounds__(fbfft::Plan<N>::kThreads, fbfft::Plan<N>::kMinBlocks)
tiledfft_rfft2(const float* __restrict__ in, float2* __restrict__ out, int B, int planes, int h, int w,
               int th, int tw, int mh, int mw, int top, int left, int lh, int lw)
{
    using P = fbfft::Plan<N>;
    static_assert(P::kSplit == 1, "tiledfft: N <= 32 (one thread per 1-D FFT)");
    FBFFT_SHARED_BUFFER(smem);  // P::kSmemBytes, passed at launch
    if (blockDim.x != P::kThreads) __trap();
    const int tid = threadIdx.x;
    const long long b0 = (long long)blockIdx.x * P::kPlanes;
    {
        // pass 1, thread (xp, p): columns xp and xp + n/2 of the window, as fbfft's rfft2_columns
        const int xp = tid % P::kRows, p = tid / P::kRows;
        const long long b = b0 + p;
        const bool ok = b < B;
        const tiledfft::Tile t = tiledfft::tile_of(ok ? b : 0, planes, th, tw);
        const int r0 = t.i * mh - top, c0 = t.j * mw - left;       // the window's origin
        const int rend = min(h, r0 + lh), cend = min(w, c0 + lw);  // rows, columns read: [0, end)
        const int x1 = c0 + xp, x2 = c0 + xp + N / 2;
        const bool ok1 = ok && x1 >= 0 && x1 < cend, ok2 = ok && x2 >= 0 && x2 < cend;
        const float* plane = in + t.plane * h * w;
        auto load = [&](int y) {
            const int r = r0 + y;
            const bool row_ok = r >= 0 && r < rend;
            const float re = (row_ok && ok1) ? __ldg(plane + (long long)r * w + x1) : 0.f;
            const float im = (row_ok && ok2) ? __ldg(plane + (long long)r * w + x2) : 0.f;
            return make_float2(re, im);
        };
        fbfft::rfft2_columns_of<N, 0>(smem, xp, p, load);
    }
    __syncthreads();
    {
        const int p = tid % P::kPlanes, r = tid / P::kPlanes;
        fbfft::rfft2_rows<N, 0>(out, smem, b0 + p, B, r, p);
    }
}

// The inverse's output goes through shared memory (over S, after a barrier), as fbfft's inverse does:
// a thread's own columns are runs of n/2 floats at most (two per row of a block), while a staged
// copy writes each row of a block as one run of mw floats, N lanes a row. A block's batch entries
// are consecutive planes of one tile (or of several, where planes is not a multiple of kPlanes), so
// each entry has its own destination, rows and columns (clipped at the output's edges). Warp w
// copies entries w*kPerWarp .. (w+1)*kPerWarp - 1, whose metadata its first lanes work out and
// shuffle to the rest: no shared memory past the transform's own. (A first version kept them in
// static shared memory and walked (entry, row) pairs with three shared loads a row: slower at
// N = 32, not profiled; registers hold the SM to 5 blocks of 128 threads either way.)
template <int N>
struct Stage {
    using P = fbfft::Plan<N>;
    // Floats an entry's staged block takes: rows of N, plus N/2, so that the kRows-lane groups of a
    // warp (one per entry) start N/2 banks apart and their stores never share a bank.
    static constexpr int kEntry = N * N + N / 2;
    static constexpr int kPerWarp = P::kPlanes / (P::kThreads / 32);   // entries a warp copies
    static constexpr int kRowsAtOnce = 32 / N;                        // rows a warp copies at once
    static_assert(P::kThreads % 32 == 0 && P::kPlanes % (P::kThreads / 32) == 0 && kPerWarp <= 32,
                  "tiledfft: each warp copies the same number of entries");
    static_assert(P::kPlanes * kEntry <= 2 * P::kSmemElems,
                  "tiledfft: the output staging does not fit in the transform's shared memory");
};

template <int N>
__global__ void __launch_bounds__(fbfft::Plan<N>::kThreads, fbfft::Plan<N>::kMinBlocks)
tiledfft_irfft2(const float2* __restrict__ in, float* __restrict__ out, int B, int planes, int oh, int ow,
                int th, int tw, int mh, int mw, int row_off, int col_off, float scale)
{
    using P = fbfft::Plan<N>;
    using St = Stage<N>;
    static_assert(P::kSplit == 1, "tiledfft: N <= 32 (one thread per 1-D FFT)");
    FBFFT_SHARED_BUFFER(smem);  // P::kSmemBytes, passed at launch
    if (blockDim.x != P::kThreads) __trap();
    const int tid = threadIdx.x;
    const long long b0 = (long long)blockIdx.x * P::kPlanes;
    {
        const int p = tid % P::kPlanes, r = tid / P::kPlanes;
        fbfft::irfft2_rows<N, 0>(in, smem, b0 + p, B, r, p);
    }
    __syncthreads();
    const int xp = tid % P::kRows, p = tid / P::kRows;
    float2 v[P::kM];
    fbfft::irfft2_columns<N, 0>(v, smem, xp, p);   // column xp in .x, xp + n/2 in .y, row y in reg_of(y)
    __syncthreads();                               // every thread has read S: stage over it
    {
        float* stage = reinterpret_cast<float*>(smem) + p * St::kEntry;
        const int ox1 = xp - col_off, ox2 = xp + N / 2 - col_off;
        const bool ok1 = ox1 >= 0 && ox1 < mw, ok2 = ox2 >= 0 && ox2 < mw;
#pragma unroll
        for (int y = 0; y < N; ++y) {
            const int oy = y - row_off;
            if (oy < 0 || oy >= mh) continue;
            const float2 z = v[fbfft::reg_of<N>(y)];
            if (ok1) stage[oy * N + ox1] = scale * z.x;
            if (ok2) stage[oy * N + ox2] = scale * z.y;
        }
    }
    // This warp's entries: lane l < kPerWarp works out entry e0 + l's block (where it starts in
    // out, its rows and columns after clipping; 0 rows past the batch), overlapping the barrier.
    const int lane = tid % 32, e0 = (tid / 32) * St::kPerWarp;
    long long my_dst = 0;
    int my_rows = 0, my_cols = 0;
    if (lane < St::kPerWarp) {
        const long long b = b0 + e0 + lane;
        if (b < B) {
            const tiledfft::Tile t = tiledfft::tile_of(b, planes, th, tw);
            my_dst = t.plane * oh * ow + (long long)t.i * mh * ow + t.j * mw;
            my_rows = min(mh, oh - t.i * mh);
            my_cols = min(mw, ow - t.j * mw);
        }
    }
    __syncthreads();
    // Copy: N lanes a row, kRowsAtOnce rows of one entry at a time.
    const int x = lane % N, g = lane / N;
    const float* stage = reinterpret_cast<const float*>(smem);
#pragma unroll
    for (int k = 0; k < St::kPerWarp; ++k) {
        const long long dst = __shfl_sync(0xffffffffu, my_dst, k);
        const int rows = __shfl_sync(0xffffffffu, my_rows, k), cols = __shfl_sync(0xffffffffu, my_cols, k);
        const float* src = stage + (e0 + k) * St::kEntry + x;
        if (x < cols)
            for (int oy = g; oy < rows; oy += St::kRowsAtOnce) out[dst + (long long)oy * ow + x] = src[oy * N];
    }
}

#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS
#define TILEDFFT_INSTANTIATE(N)                                                                     \
    template __global__ void tiledfft_rfft2<N>(const float* __restrict__, float2* __restrict__, int, int, \
                                               int, int, int, int, int, int, int, int, int, int);      \
    template __global__ void tiledfft_irfft2<N>(const float2* __restrict__, float* __restrict__, int, int, \
                                                int, int, int, int, int, int, int, int, float);
TILEDFFT_INSTANTIATE(8)
TILEDFFT_INSTANTIATE(16)
TILEDFFT_INSTANTIATE(32)
#endif
