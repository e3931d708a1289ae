// a42914b's backends/kernels/im2col.cu (benchmarks/experiments/exp_im2col.py's "old"): element per thread
// im2col / col2im for the unrolled-GEMM backend (backends/gemm.py).
//
// Layout of the column matrix, row-major: cols[f][kh][kw][S][oh][ow], i.e. a
// (f*kh*kw) x (S*oh*ow) matrix whose columns are output positions. fprop is then
// one GEMM W(f', f*kh*kw) @ cols. Output position index is fastest, so the writes
// of im2col and the reads of col2im are coalesced across a warp.
//
// Both kernels use a grid-stride loop with 64-bit indices: a column matrix can
// hold more than 2^31 elements before the backend's chunking caps it.

// x at kernel tap (i, j) of output position (oy, ox), image s, plane c: zero outside the plane
// (implicit zero padding: no padded copy of x is made).
__device__ __forceinline__ float tap(const float* __restrict__ x, int s, int c, int i, int j, int oy, int ox,
                                     int f, int h, int w, int sh, int sw, int ph, int pw)
{
    const int iy = oy * sh - ph + i;
    const int ix = ox * sw - pw + j;
    return (iy >= 0 && iy < h && ix >= 0 && ix < w) ? x[(((long long)s * f + c) * h + iy) * w + ix] : 0.f;
}

// One column-matrix element per loop step. PER_IMAGE false: cols[f][kh][kw][S][oh][ow], the
// (f*kh*kw) x (S*oh*ow) matrix above. PER_IMAGE true: cols[S][f][kh][kw][oh][ow], a stack of S
// (f*kh*kw) x (oh*ow) matrices, for accGrad's per-image products (gemm.py: each image's gy plane
// block is then already its other operand, so gy needs no transposed copy).
template <bool PER_IMAGE>
__device__ __forceinline__ void unroll(const float* __restrict__ x, float* __restrict__ cols,
                                       int S, int f, int h, int w, int kh, int kw,
                                       int sh, int sw, int ph, int pw, int oh, int ow)
{
    const long long total = (long long)f * kh * kw * S * oh * ow;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long t = idx;
        const int ox = t % ow; t /= ow;
        const int oy = t % oh; t /= oh;
        int s = 0;
        if (!PER_IMAGE) { s = t % S; t /= S; }
        const int j = t % kw; t /= kw;
        const int i = t % kh; t /= kh;
        const int c = t % f;
        if (PER_IMAGE) s = (int)(t / f);
        cols[idx] = tap(x, s, c, i, j, oy, ox, f, h, w, sh, sw, ph, pw);
    }
}

extern "C" __global__ void im2col(const float* __restrict__ x, float* __restrict__ cols,
                                  int S, int f, int h, int w, int kh, int kw,
                                  int sh, int sw, int ph, int pw, int oh, int ow)
{
    unroll<false>(x, cols, S, f, h, w, kh, kw, sh, sw, ph, pw, oh, ow);
}

extern "C" __global__ void im2col_images(const float* __restrict__ x, float* __restrict__ cols,
                                         int S, int f, int h, int w, int kh, int kw,
                                         int sh, int sw, int ph, int pw, int oh, int ow)
{
    unroll<true>(x, cols, S, f, h, w, kh, kw, sh, sw, ph, pw, oh, ow);
}

// Gather formulation: one thread per input pixel sums the column entries of every
// kernel tap that covers it. No atomics, so the result is deterministic.
extern "C" __global__ void col2im(const float* __restrict__ cols, float* __restrict__ gx,
                                  int S, int f, int h, int w, int kh, int kw,
                                  int sh, int sw, int ph, int pw, int oh, int ow)
{
    const long long total = (long long)S * f * h * w;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long t = idx;
        const int ix = t % w; t /= w;
        const int iy = t % h; t /= h;
        const int c  = t % f;
        const int s  = (int)(t / f);
        float acc = 0.f;
        // Only taps i with (iy + ph - i) divisible by sh land on an output row.
        for (int i = (iy + ph) % sh; i < kh; i += sh) {
            const int yy = iy + ph - i;
            if (yy < 0) break;  // i only grows, so yy only shrinks
            const int oy = yy / sh;
            if (oy >= oh) continue;
            for (int j = (ix + pw) % sw; j < kw; j += sw) {
                const int xx = ix + pw - j;
                if (xx < 0) break;
                const int ox = xx / sw;
                if (ox >= ow) continue;
                acc += cols[((((long long)c * kh + i) * kw + j) * S + s) * oh * (long long)ow
                            + (long long)oy * ow + ox];
            }
        }
        gx[idx] = acc;
    }
}
