// a26d51f's backends/kernels/im2col.cu, im2col and col2im only (benchmarks/experiments/exp_im2col.py's "rows")
// im2col / col2im for the unrolled-GEMM backend (backends/gemm.py).
//
// Layout of the column matrix, row-major: cols[f][kh][kw][S][oh][ow], i.e. a
// (f*kh*kw) x (S*oh*ow) matrix whose columns are output positions. fprop is then
// one GEMM W(f', f*kh*kw) @ cols. Output position index is fastest, so the writes
// of im2col and the reads of col2im are coalesced across a warp.
//
// Both kernels loop over rows (or planes) with a grid stride and 64-bit row offsets: a column matrix
// can hold more than 2^31 elements before the backend's chunking caps it. Within a row, 32 bits.

// x at kernel tap (i, j) of output position (oy, ox), image s, plane c: zero outside the plane
// (implicit zero padding: no padded copy of x is made).
__device__ __forceinline__ float tap(const float* __restrict__ x, int s, int c, int i, int j, int oy, int ox,
                                     int f, int h, int w, int sh, int sw, int ph, int pw)
{
    const int iy = oy * sh - ph + i;
    const int ix = ox * sw - pw + j;
    return (iy >= 0 && iy < h && ix >= 0 && ix < w) ? x[(((long long)s * f + c) * h + iy) * w + ix] : 0.f;
}

// One column-matrix row per block and loop step: a row is one (plane c, tap (i, j), image s) and
// holds the oh*ow output positions, so its decomposition is uniform across the block and costs once
// per row, and each thread does one 32-bit division per element (its position's oy). The element-
// per-thread form before it spent six 64-bit divisions on each element: on ResNet-50's conv13
// (128->128 56x56 3x3 s2, b128, 115M elements) that was most of im2col's time.
// PER_IMAGE false: cols[f][kh][kw][S][oh][ow], the (f*kh*kw) x (S*oh*ow) matrix above; row
// r = ((c*kh + i)*kw + j)*S + s. PER_IMAGE true: cols[S][f][kh][kw][oh][ow], a stack of S
// (f*kh*kw) x (oh*ow) matrices, for accGrad's per-image products (gemm.py: each image's gy plane
// block is then already its other operand, so gy needs no transposed copy); r = ((s*f + c)*kh + i)*kw + j.
template <bool PER_IMAGE>
__device__ __forceinline__ void unroll(const float* __restrict__ x, float* __restrict__ cols,
                                       int S, int f, int h, int w, int kh, int kw,
                                       int sh, int sw, int ph, int pw, int oh, int ow)
{
    const int P = oh * ow;
    const long long rows = (long long)f * kh * kw * S;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        long long t = r;
        int s = 0;
        if (!PER_IMAGE) { s = (int)(t % S); t /= S; }
        const int j = (int)(t % kw); t /= kw;
        const int i = (int)(t % kh); t /= kh;
        const int c = (int)(t % f);
        if (PER_IMAGE) s = (int)(t / f);
        const float* __restrict__ plane = x + ((long long)s * f + c) * h * w;
        float* __restrict__ row = cols + r * P;
        for (int p = threadIdx.x; p < P; p += blockDim.x) {
            const int oy = p / ow, ox = p - oy * ow;
            const int iy = oy * sh - ph + i, ix = ox * sw - pw + j;
            row[p] = (iy >= 0 && iy < h && ix >= 0 && ix < w) ? plane[iy * w + ix] : 0.f;
        }
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

// Gather formulation: one thread per input pixel sums the column entries of every kernel tap that
// covers it. No atomics, so the result is deterministic. One (image, plane) per block and loop step,
// as im2col's rows: the pixel's decomposition is one 32-bit division.
extern "C" __global__ void col2im(const float* __restrict__ cols, float* __restrict__ gx,
                                  int S, int f, int h, int w, int kh, int kw,
                                  int sh, int sw, int ph, int pw, int oh, int ow)
{
    const int HW = h * w;
    const long long P = (long long)oh * ow, planes = (long long)S * f;
    for (long long q = blockIdx.x; q < planes; q += gridDim.x) {
        const int c = (int)(q % f), s = (int)(q / f);
        float* __restrict__ out = gx + q * HW;
        for (int pix = threadIdx.x; pix < HW; pix += blockDim.x) {
            const int iy = pix / w, ix = pix - iy * w;
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
                    acc += cols[(((long long)c * kh + i) * kw + j) * S * P + s * P + (long long)oy * ow + ox];
                }
            }
            out[pix] = acc;
        }
    }
}
