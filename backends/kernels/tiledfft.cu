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
// are consecutive planes of one tile (or of two, where planes is not a multiple of kPlanes), so
// each entry keeps its own destination, rows and columns (clipped at the output's edges).
template <int N>
struct Stage {
    // Floats an entry's staged block takes: rows of N, plus N/2, so that the kRows-lane groups of a
    // warp (one per entry) start N/2 banks apart and their stores never share a bank.
    static constexpr int kEntry = N * N + N / 2;
    static constexpr int kGroups = fbfft::Plan<N>::kThreads / N;   // rows copied at once, N lanes each
    static_assert(fbfft::Plan<N>::kThreads % N == 0, "tiledfft: a copy group is N lanes");
    static_assert(fbfft::Plan<N>::kPlanes * kEntry <= 2 * fbfft::Plan<N>::kSmemElems,
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
    __shared__ long long dst_of[P::kPlanes];   // entry e's block in out (its row 0, column 0)
    __shared__ int rows_of[P::kPlanes], cols_of[P::kPlanes];   // its rows and columns (0: past B)
    if (blockDim.x != P::kThreads) __trap();
    const int tid = threadIdx.x;
    const long long b0 = (long long)blockIdx.x * P::kPlanes;
    {
        const int p = tid % P::kPlanes, r = tid / P::kPlanes;
        fbfft::irfft2_rows<N, 0>(in, smem, b0 + p, B, r, p);
    }
    if (tid < P::kPlanes) {
        // the tile's block: basis rows row_off .. row_off + mh - 1 go to output rows i*mh + .., clipped
        const long long b = b0 + tid;
        const tiledfft::Tile t = tiledfft::tile_of(b < B ? b : 0, planes, th, tw);
        dst_of[tid] = t.plane * oh * ow + (long long)t.i * mh * ow + t.j * mw;
        rows_of[tid] = b < B ? min(mh, oh - t.i * mh) : 0;
        cols_of[tid] = min(mw, ow - t.j * mw);
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
    __syncthreads();
    // Copy: group g (N lanes) takes rows r = g, g + kGroups, ... of the kPlanes * mh (entry, row)
    // pairs, stepping (e, oy) by kGroups = q mh + s without a division in the loop.
    const int x = tid % N, g = tid / N;
    const int q = St::kGroups / mh, s = St::kGroups - q * mh;
    int e = g / mh, oy = g - e * mh;
    const float* stage = reinterpret_cast<const float*>(smem);
    while (e < P::kPlanes) {
        if (oy < rows_of[e] && x < cols_of[e])
            out[dst_of[e] + (long long)oy * ow + x] = stage[e * St::kEntry + oy * N + x];
        oy += s;
        e += q;
        if (oy >= mh) { oy -= mh; ++e; }
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
