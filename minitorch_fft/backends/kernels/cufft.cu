// The cufft backend's own kernels (backends/cufft.py); cuFFT and cuBLAS do the rest.
//
// place and crop, its two real-space kernels (_place, _crop), run one thread per output element
// in a grid-stride loop with 64-bit indices:
// place: out (planes, n, m) <- a (planes, h, w) put in the n x m basis, shifted cyclically by
//        (-sh, -sw) and scaled; zeros elsewhere (the zero extension and the copy in one pass).
// crop:  out (planes, oh, ow) <- full (planes, n, m) read back from rows (u - sh) mod n and
//        columns (v - sw) mod m, scaled (the pass's clip; accGrad's taps and its 1/(n*m)).
// 0 <= sh < n and 0 <= sw < m, so every % below has a non-negative dividend.

extern "C" __global__ void cufft_place(const float* __restrict__ a, float* __restrict__ out,
                                       int n, int m, int h, int w, int sh, int sw, float scale,
                                       long long total)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(i % m), r = (int)((i / m) % n);
        const long long plane = i / ((long long)n * m);
        const int u = (r + sh) % n, v = (c + sw) % m;       // the element of a this slot holds
        out[i] = (u < h && v < w) ? a[(plane * h + u) * w + v] * scale : 0.0f;
    }
}

extern "C" __global__ void cufft_crop(const float* __restrict__ full, float* __restrict__ out,
                                      int n, int m, int oh, int ow, int sh, int sw, float scale,
                                      long long total)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int v = (int)(i % ow), u = (int)((i / ow) % oh);
        const long long plane = i / ((long long)oh * ow);
        out[i] = full[(plane * n + (u - sh + n) % n) * m + (v - sw + m) % m] * scale;
    }
}

// transpose: out (cols, rows) <- in (rows, cols), complex64 (float2), through a 32 x 33 tile in
// shared memory so that both the reads and the writes are coalesced (the padding column keeps
// the tile's column reads free of bank conflicts). The "copy" layout's Trans2D: cuFFT's natural
// (planes, F) spectra to the GEMM's frequency-major (F, planes) and back. Blocks of 32 x 8
// threads, each moving four elements; a 1-D grid of ceil(rows / 32) * ceil(cols / 32) blocks, one
// per tile, row of tiles by row of tiles (gridDim.x has room for any plane count; y would not).
extern "C" __global__ void cufft_transpose(const float2* __restrict__ in, float2* __restrict__ out,
                                           int rows, int cols)
{
    __shared__ float2 tile[32][33];
    const int tiles_c = (cols + 31) / 32;
    const int r0 = (int)(blockIdx.x / tiles_c) * 32, c0 = (int)(blockIdx.x % tiles_c) * 32;
    for (int j = threadIdx.y; j < 32; j += 8) {
        const int r = r0 + j, c = c0 + threadIdx.x;
        if (r < rows && c < cols)
            tile[j][threadIdx.x] = in[(long long)r * cols + c];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += 8) {
        const int c = c0 + j, r = r0 + threadIdx.x;
        if (c < cols && r < rows)
            out[(long long)c * rows + r] = tile[threadIdx.x][j];
    }
}
