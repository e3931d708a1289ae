// The cufft backend's two real-space kernels (backends/cufft.py: _place and _crop), one thread
// per output element in a grid-stride loop with 64-bit indices.
//
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
