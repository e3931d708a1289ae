// Max pooling without padding, floor mode (minitorch_fft/functional.py, MaxPool2dFn).
//
// x (planes, h, w) -> y, arg (planes, oh, ow); arg is the window offset a * kw + b of the
// maximum: the first strict maximum in row-major window order, or the last NaN (NaN wins, so it
// propagates as in Torch). Backward is a gather, one thread per input element: it sums the
// gradients of the outputs whose window holds the element and whose argmax it is (no atomics,
// windows may overlap, the sum is deterministic).
//
// Idx is the index type: int unless an array reaches 2^31 elements (64-bit division and
// remainder are emulated on the GPU, many instructions each). The grid-stride loop counts in
// 64 bits; `total` is the number of outputs (y's size forward, gx's backward).

#define POOL_GEOMETRY(Idx) Idx h, Idx w, Idx kh, Idx kw, Idx sh, Idx sw, Idx oh, Idx ow

template <typename Idx>
__global__ void minitorch_maxpool_fwd(const float* __restrict__ x, float* __restrict__ y,
                                      unsigned char* __restrict__ arg, long long total,
                                      POOL_GEOMETRY(Idx))
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const Idx k = (Idx)i;
        const Idx ox = k % ow, oy = (k / ow) % oh, plane = k / (oh * ow);
        const Idx base = (plane * h + oy * sh) * w + ox * sw;
        float best = x[base];
        int best_k = 0;
        for (int a = 0; a < kh; ++a)
            for (int b = 0; b < kw; ++b) {
                const float v = x[base + a * w + b];
                if (v > best || isnan(v)) { best = v; best_k = a * kw + b; }
            }
        y[i] = best;
        arg[i] = (unsigned char)best_k;
    }
}

template <typename Idx>
__global__ void minitorch_maxpool_bwd(const float* __restrict__ g, const unsigned char* __restrict__ arg,
                                      float* __restrict__ gx, long long total, POOL_GEOMETRY(Idx))
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const Idx k = (Idx)i;
        const Idx xx = k % w, yy = (k / w) % h, plane = k / (h * w);
        // the outputs (oy, ox) whose window holds input element (yy, xx)
        const Idx oy0 = yy >= kh ? (yy - kh) / sh + 1 : 0, oy1 = min(yy / sh, oh - 1);
        const Idx ox0 = xx >= kw ? (xx - kw) / sw + 1 : 0, ox1 = min(xx / sw, ow - 1);
        float acc = 0.f;
        for (Idx oy = oy0; oy <= oy1; ++oy)
            for (Idx ox = ox0; ox <= ox1; ++ox) {
                const Idx o = (plane * oh + oy) * ow + ox;
                if (arg[o] == (yy - oy * sh) * kw + (xx - ox * sw)) acc += g[o];
            }
        gx[i] = acc;
    }
}

// What functional.POOL_NAME_EXPRESSIONS compiles at run time, for nvcc (tests/test_cuda_compile.py).
#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS
#define POOL_INSTANTIATE(Idx)                                                                      \
    template __global__ void minitorch_maxpool_fwd<Idx>(const float*, float*, unsigned char*,     \
                                                        long long, POOL_GEOMETRY(Idx));            \
    template __global__ void minitorch_maxpool_bwd<Idx>(const float*, const unsigned char*,       \
                                                        float*, long long, POOL_GEOMETRY(Idx));
POOL_INSTANTIATE(int)
POOL_INSTANTIATE(long long)
#endif
