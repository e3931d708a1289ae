// correlate1d: batched 1-D valid cross-correlation with a long mask, register-blocked.
// Host side: backends/direct.py (correlate1d). The 1-D case of the direct backend, after the
// walk-through in ../shared/papers/1d-convolution-cuda-walkthrough.txt:
//
//   y[b][i] = sum_{j < K} x[b][i + j] * mask[j],     i < n_out = L - K + 1
//
// Each thread owns OUT consecutive outputs and slides a register window along the input: the
// input value x[i + j] is loaded once and used by all OUT outputs it touches (OUT FMAs per
// shared-memory load instead of one), as in the walk-through's "reg_block" kernel. A block of
// THREADS threads covers kTileOut = OUT * THREADS outputs; the mask is walked in chunks of
// kTileK taps, each chunk staged in shared memory with the kTileOut + kTileK inputs it needs
// (coalesced loads), so any mask length works.
//
// Shared-memory banks: lane t reads xs[t * OUT + c]; OUT is odd, so the 32 lanes of a warp hit
// 32 distinct banks. The mask value ms[k] is the same address for every lane (a broadcast).
// Registers: OUT accumulators and a 2 * OUT window, every index a compile-time constant once
// the j and n loops are unrolled (the window advances by OUT taps, then shifts by renaming).

template <int OUT, int THREADS>
__global__ void __launch_bounds__(THREADS)
correlate1d(const float* __restrict__ x, const float* __restrict__ mask, float* __restrict__ y,
            long long L, int K, long long n_out)
{
    static_assert(OUT % 2 == 1, "correlate1d: OUT must be odd (conflict-free shared memory)");
    constexpr int kTileOut = OUT * THREADS;
    constexpr int kTileK = OUT * (1024 / OUT);  // taps per chunk: a multiple of OUT, about 1024
    __shared__ float xs[kTileOut + kTileK];
    __shared__ float ms[kTileK];
    if (blockDim.x != THREADS) __trap();  // the tile arithmetic assumes exactly THREADS lanes

    const int tid = threadIdx.x;
    const float* xb = x + (long long)blockIdx.y * L;
    float* yb = y + (long long)blockIdx.y * n_out;
    const long long o0 = (long long)blockIdx.x * kTileOut;  // first output of the block

    float acc[OUT];
#pragma unroll
    for (int n = 0; n < OUT; ++n) acc[n] = 0.f;

    for (int k0 = 0; k0 < K; k0 += kTileK) {
        const int kn = min(kTileK, K - k0);  // taps in this chunk
        __syncthreads();                     // the previous chunk is no longer read
        for (int i = tid; i < kTileOut + kTileK; i += THREADS) {
            const long long src = o0 + k0 + i;
            xs[i] = src < L ? __ldg(xb + src) : 0.f;
        }
        for (int i = tid; i < kTileK; i += THREADS) ms[i] = i < kn ? __ldg(mask + k0 + i) : 0.f;
        __syncthreads();

        const float* xt = xs + tid * OUT;  // this thread's window starts at its first output
        float win[2 * OUT];                // win[m] = xt[k + m]
#pragma unroll
        for (int n = 0; n < OUT; ++n) win[n] = xt[n];
        int k = 0;
        for (; k + OUT <= kn; k += OUT) {  // whole groups of OUT taps
#pragma unroll
            for (int n = 0; n < OUT; ++n) win[OUT + n] = xt[k + OUT + n];
#pragma unroll
            for (int j = 0; j < OUT; ++j) {
                const float m = ms[k + j];
#pragma unroll
                for (int n = 0; n < OUT; ++n) acc[n] = fmaf(m, win[n + j], acc[n]);
            }
#pragma unroll
            for (int n = 0; n < OUT; ++n) win[n] = win[OUT + n];
        }
        if (k < kn) {  // the chunk's last taps: a branch uniform over the block; inputs past
                       // the mask are never multiplied (0 * inf would be NaN)
#pragma unroll
            for (int n = 0; n < OUT; ++n) win[OUT + n] = xt[k + OUT + n];
#pragma unroll
            for (int j = 0; j < OUT; ++j) {
                if (k + j < kn) {
                    const float m = ms[k + j];
#pragma unroll
                    for (int n = 0; n < OUT; ++n) acc[n] = fmaf(m, win[n + j], acc[n]);
                }
            }
        }
    }

    const long long i0 = o0 + (long long)tid * OUT;
#pragma unroll
    for (int n = 0; n < OUT; ++n)
        if (i0 + n < n_out) yb[i0 + n] = acc[n];
}

// ---------------------------------------------------------------------------------------------
// Every configuration backends/direct.py can pick (CORRELATE1D_CONFIGS there; a CPU test keeps
// the two lists equal). Compiled only for nvcc -cubin checks; CuPy instantiates by name.
// ---------------------------------------------------------------------------------------------
#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS
#define CORRELATE1D(OUT, THREADS)                                                                  \
    template __global__ void correlate1d<OUT, THREADS>(const float* __restrict__,               \
        const float* __restrict__, float* __restrict__, long long, int, long long);
// BEGIN CONFIGS (parsed by tests/test_direct.py)
CORRELATE1D(7, 256)
CORRELATE1D(15, 128)
CORRELATE1D(15, 256)
CORRELATE1D(23, 128)
CORRELATE1D(31, 64)
CORRELATE1D(31, 128)
// END CONFIGS
#endif
