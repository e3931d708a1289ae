// im2col / col2im for the unrolled-GEMM backend (backends/gemm.py).
//
// Layout of the column matrix, row-major: cols[f][kh][kw][S][oh][ow], i.e. a
// (f*kh*kw) x (S*oh*ow) matrix whose columns are output positions. fprop is then
// one GEMM W(f', f*kh*kw) @ cols. Output position index is fastest, so the writes
// of im2col and the reads of col2im are coalesced across a warp.
//
// Offsets into the column matrix are 64-bit: it can hold more than 2^31 elements before the backend's
// chunking caps it. Within a plane, 32 bits.

// The grid covers (positions, taps, images): blockIdx.y is the tap k = (c*kh + i)*kw + j (looping
// by gridDim.y past 65535), blockIdx.x with threadIdx.x the output position p = oy*ow + ox, and
// blockIdx.z with threadIdx.y a group of IM_IMAGES images, taken blockDim.y apart. A thread works out
// its position's source offset once and copies it for each of its images, so an element costs a
// load and a store, not the six 64-bit divisions of the element-per-thread form this replaced
// (ResNet-50's conv13, 128->128 56x56 3x3 s2 at b128, 115M elements: those divisions were most of
// im2col's 1.0 ms; session 14, benchmarks/experiments/exp_im2col.py). Stores are coalesced along p in both layouts:
// PER_IMAGE false: cols[f][kh][kw][S][oh][ow], the (f*kh*kw) x (S*oh*ow) matrix above.
// PER_IMAGE true: cols[S][f][kh][kw][oh][ow], a stack of S (f*kh*kw) x (oh*ow) matrices, for
// accGrad's per-image products (gemm.py: each image's gy plane block is then already its other
// operand, so gy needs no transposed copy).
#define IM_IMAGES 8

template <bool PER_IMAGE>
__device__ __forceinline__ void unroll(const float* __restrict__ x, float* __restrict__ cols,
                                       int S, int f, int h, int w, int kh, int kw,
                                       int sh, int sw, int ph, int pw, int oh, int ow)
{
    const int P = oh * ow, K = f * kh * kw;
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P) return;
    const int oy = p / ow, ox = p - oy * ow;
    const int s0 = blockIdx.z * blockDim.y * IM_IMAGES + threadIdx.y;
    const long long plane = (long long)h * w;
    for (int k = blockIdx.y; k < K; k += gridDim.y) {
        const int c = k / (kh * kw), t = k - c * (kh * kw), i = t / kw, j = t - i * kw;
        const int iy = oy * sh - ph + i, ix = ox * sw - pw + j;
        const bool inside = iy >= 0 && iy < h && ix >= 0 && ix < w;
        const float* __restrict__ src = x + c * plane + (inside ? iy * w + ix : 0);
        for (int m = 0, s = s0; m < IM_IMAGES && s < S; ++m, s += blockDim.y) {
            const long long at = PER_IMAGE ? ((long long)s * K + k) * P + p : ((long long)k * S + s) * P + p;
            cols[at] = inside ? src[s * f * plane] : 0.f;
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
// covers it. No atomics, so the result is deterministic. The grid as im2col's, over (pixels, planes,
// images): a thread finds its pixel's first covering tap and output row once (the taps that land
// on an output row step by the stride, their rows by one), then sums for each of its images.
extern "C" __global__ void col2im(const float* __restrict__ cols, float* __restrict__ gx,
                                  int S, int f, int h, int w, int kh, int kw,
                                  int sh, int sw, int ph, int pw, int oh, int ow)
{
    const int HW = h * w;
    const long long P = (long long)oh * ow;
    const int pix = blockIdx.x * blockDim.x + threadIdx.x;
    if (pix >= HW) return;
    const int iy = pix / w, ix = pix - iy * w;
    const int i0 = (iy + ph) % sh, oy0 = (iy + ph - i0) / sh;   // tap i0 + m*sh lands on row oy0 - m
    const int j0 = (ix + pw) % sw, ox0 = (ix + pw - j0) / sw;
    const int s0 = blockIdx.z * blockDim.y * IM_IMAGES + threadIdx.y;
    for (int c = blockIdx.y; c < f; c += gridDim.y) {
        for (int m = 0, s = s0; m < IM_IMAGES && s < S; ++m, s += blockDim.y) {
            float acc = 0.f;
            for (int i = i0, oy = oy0; i < kh && oy >= 0; i += sh, --oy) {
                if (oy >= oh) continue;
                for (int j = j0, ox = ox0; j < kw && ox >= 0; j += sw, --ox) {
                    if (ox >= ow) continue;
                    acc += cols[(((long long)c * kh + i) * kw + j) * S * P + s * P + oy * ow + ox];
                }
            }
            gx[((long long)s * f + c) * HW + pix] = acc;
        }
    }
}

// accGrad for small weight gradients (f' * f*kh*kw at most gemm.SMALL_GRADIENT), without a column
// matrix: the few-plane first layers (VGG-16 conv1_1: 64 x 27 weights over 3.2M output positions),
// whose GEMMs are one long K on a few output tiles. Block b sums the products over output positions
// [b*chunk, (b+1)*chunk) of the flattened (S, oh*ow), a tile of AG_TP positions at a time: gy's tile
// (AG_TP x f') and the taps' tile (AG_TP x f*kh*kw, gathered from x with implicit zero padding) in
// shared memory, each thread an AG_TO x AG_TK block of the gradient in registers. Block b writes its
// partial gradient to partials[b][f'][f*kh*kw]; the caller sums them over b (a fixed order: the
// result is deterministic). Thread (tx, ty) owns outputs ty*AG_TO.. and taps tx*AG_TK..; blockDim is
// (ceil(K / AG_TK), ceil(f' / AG_TO)), and the tiles have blockDim's columns, zero past f' and K.
// - No division per element: each tap's (plane offset, i, j) is tabled once per block, each tile
//   position's (image, first row and column) once per tile.
// - A tile row (one position) holds a thread's 4 outputs or taps side by side: one 16-byte shared
//   load each, 2 loads per 16 FMAs. Rows are ag_ld() floats apart, 4 more than a multiple of 32, so
//   the fill's warps (8 positions x 4 columns) store to 32 different banks.
// - The fill loads AG_BATCH elements before it stores them: that many global loads in flight a thread.
//   Where every tile lies in one image (`whole`), gy's fill takes 16-byte loads: ncu (session 14) had
//   VGG-16 conv1_1's accGrad issue-bound (SM 70 % busy, DRAM 21 %), FMAs a third of the instructions
//   and the fill's index arithmetic most of the rest.
// Session 14 (exp_gemm_forms, exp_accgrad_small, H100): the first form, a division per element and one
// load in flight, ran VGG-16 conv1_1's accGrad in 3.27 ms and ResNet's conv1's in 5.67.
// Shared memory: the two tiles, the tap table (3 ints a tap column), the position table (AG_TP long
// longs twice, AG_TP ints twice).
#define AG_TO 4
#define AG_TK 4
#define AG_TP 32
#define AG_BATCH 4
static_assert(AG_TP == 32, "accgrad_small's fill maps an element's position as (e >> 2) & 31");

__device__ __forceinline__ int ag_ld(int columns) { return columns + ((4 - columns) & 31); }

template <int TO>   // outputs a thread: AG_TO, or 8 where the block's threads are many (ResNet's conv1)
__device__ __forceinline__ void accgrad_tiles(const float* __restrict__ x, const float* __restrict__ gy,
                                              float* __restrict__ partials,
                                              int S, int f, int h, int w, int kh, int kw,
                                              int sh, int sw, int ph, int pw, int oh, int ow,
                                              int fo, long long chunk, int whole)
{
    static_assert(TO % 4 == 0, "a thread's outputs are read 4 at a time");
    extern __shared__ __align__(16) float smem[];
    const int K = f * kh * kw, P = oh * ow, HW = h * w;
    const int cols_o = blockDim.y * TO, cols_k = blockDim.x * AG_TK;
    const int ld_o = ag_ld(cols_o), ld_k = ag_ld(cols_k);
    float* sg = smem;                                  // [AG_TP][ld_o]: gy
    float* sc = sg + AG_TP * ld_o;                     // [AG_TP][ld_k]: the taps
    int* k_off = (int*)(sc + AG_TP * ld_k);            // [cols_k]: the tap's plane offset c*h*w
    int* k_i = k_off + cols_k;                         // [cols_k]: its row i, or a huge value past K
    int* k_j = k_i + cols_k;                           // [cols_k]: its column j
    long long* q_img = (long long*)(k_j + cols_k);    // [AG_TP]: s*f*h*w, or -1 past the chunk (8-byte
                                                       // aligned: the words before are multiples of 4)
    long long* q_gy = q_img + AG_TP;                   // [AG_TP]: s*f'*P + r, gy's offset of plane 0
    int* q_y = (int*)(q_gy + AG_TP);                   // [AG_TP]: oy*sh - ph
    int* q_x = q_y + AG_TP;                            // [AG_TP]: ox*sw - pw
    const int nt = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    for (int k = tid; k < cols_k; k += nt) {
        const int c = k / (kh * kw), t = k - c * (kh * kw), i = t / kw;
        k_off[k] = c * HW;
        k_i[k] = k < K ? i : (1 << 29);                // past K: every tap of the column falls outside
        k_j[k] = t - i * kw;
    }
    const long long total = (long long)S * P;
    const long long begin = blockIdx.x * chunk;
    const long long end = min(total, begin + chunk);
    float acc[TO][AG_TK];
#pragma unroll
    for (int u = 0; u < TO; ++u)
#pragma unroll
        for (int v = 0; v < AG_TK; ++v) acc[u][v] = 0.f;
    for (long long p0 = begin; p0 < end; p0 += AG_TP) {
        for (int q = tid; q < AG_TP; q += nt) {        // a block may have fewer threads than AG_TP
            const long long p = p0 + q;
            const int s = (int)(p / P), r = (int)(p - (long long)s * P), oy = r / ow;
            q_img[q] = p < end ? (long long)s * f * HW : -1;
            q_gy[q] = (long long)s * fo * P + r;
            q_y[q] = oy * sh - ph;
            q_x[q] = (r - oy * ow) * sw - pw;
        }
        __syncthreads();
        if (whole) {
            // whole tiles (oh*ow a multiple of AG_TP, gy 16-byte aligned): the tile's positions are
            // consecutive in one image, so a thread loads 4 of an output's in one 16-byte load
            const long long base = q_gy[0];
            for (int e0 = tid; e0 < cols_o * (AG_TP / 4); e0 += nt * 2) {
                float4 v[2];
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const int e = e0 + b * nt, o = e / (AG_TP / 4), m = e % (AG_TP / 4);
                    v[b] = (e < cols_o * (AG_TP / 4) && o < fo)
                         ? *reinterpret_cast<const float4*>(gy + base + (long long)o * P + 4 * m)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const int e = e0 + b * nt, o = e / (AG_TP / 4), m = e % (AG_TP / 4);
                    if (e < cols_o * (AG_TP / 4)) {
                        float* d = sg + 4 * m * ld_o + o;
                        d[0] = v[b].x; d[ld_o] = v[b].y; d[2 * ld_o] = v[b].z; d[3 * ld_o] = v[b].w;
                    }
                }
            }
        } else
        // element e: column (e >> 7)*4 + (e & 3), position (e >> 2) & 31: a warp takes 8 positions
        // of 4 columns (gy: 4 rows of 32 bytes from global memory)
        for (int e0 = tid; e0 < cols_o * AG_TP; e0 += nt * AG_BATCH) {
            float v[AG_BATCH];
#pragma unroll
            for (int b = 0; b < AG_BATCH; ++b) {
                const int e = e0 + b * nt, o = (e >> 7) * 4 + (e & 3), q = (e >> 2) & 31;
                v[b] = (e < cols_o * AG_TP && o < fo && q_img[q] >= 0) ? gy[q_gy[q] + (long long)o * P] : 0.f;
            }
#pragma unroll
            for (int b = 0; b < AG_BATCH; ++b) {
                const int e = e0 + b * nt;
                if (e < cols_o * AG_TP) sg[((e >> 2) & 31) * ld_o + (e >> 7) * 4 + (e & 3)] = v[b];
            }
        }
        for (int e0 = tid; e0 < cols_k * AG_TP; e0 += nt * AG_BATCH) {
            float v[AG_BATCH];
#pragma unroll
            for (int b = 0; b < AG_BATCH; ++b) {
                const int e = e0 + b * nt, k = (e >> 7) * 4 + (e & 3), q = (e >> 2) & 31;
                bool inside = false;
                int iy = 0, ix = 0;
                if (e < cols_k * AG_TP) {
                    iy = q_y[q] + k_i[k]; ix = q_x[q] + k_j[k];
                    inside = q_img[q] >= 0 && iy >= 0 && iy < h && ix >= 0 && ix < w;
                }
                v[b] = inside ? x[q_img[q] + k_off[k] + iy * w + ix] : 0.f;
            }
#pragma unroll
            for (int b = 0; b < AG_BATCH; ++b) {
                const int e = e0 + b * nt;
                if (e < cols_k * AG_TP) sc[((e >> 2) & 31) * ld_k + (e >> 7) * 4 + (e & 3)] = v[b];
            }
        }
        __syncthreads();
#pragma unroll 4
        for (int q = 0; q < AG_TP; ++q) {
            float av[TO];
#pragma unroll
            for (int u = 0; u < TO; u += 4) {
                const float4 a = *reinterpret_cast<const float4*>(sg + q * ld_o + threadIdx.y * TO + u);
                av[u] = a.x; av[u + 1] = a.y; av[u + 2] = a.z; av[u + 3] = a.w;
            }
            const float4 b = *reinterpret_cast<const float4*>(sc + q * ld_k + threadIdx.x * AG_TK);
            const float bv[AG_TK] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int u = 0; u < TO; ++u)
#pragma unroll
                for (int v = 0; v < AG_TK; ++v) acc[u][v] = fmaf(av[u], bv[v], acc[u][v]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < TO; ++u) {
        const int o = threadIdx.y * TO + u;
#pragma unroll
        for (int v = 0; v < AG_TK; ++v) {
            const int k = threadIdx.x * AG_TK + v;
            if (o < fo && k < K) partials[((long long)blockIdx.x * fo + o) * K + k] = acc[u][v];
        }
    }
}

// The two register blocks (gemm.py IMPLICIT): 4 x 4 and 8 x 4 gradient elements a thread.
extern "C" __global__ void accgrad_small(const float* __restrict__ x, const float* __restrict__ gy,
                                         float* __restrict__ partials,
                                         int S, int f, int h, int w, int kh, int kw,
                                         int sh, int sw, int ph, int pw, int oh, int ow,
                                         int fo, long long chunk, int whole)
{
    accgrad_tiles<AG_TO>(x, gy, partials, S, f, h, w, kh, kw, sh, sw, ph, pw, oh, ow, fo, chunk, whole);
}

extern "C" __global__ void accgrad_small8(const float* __restrict__ x, const float* __restrict__ gy,
                                          float* __restrict__ partials,
                                          int S, int f, int h, int w, int kh, int kw,
                                          int sh, int sw, int ph, int pw, int oh, int ow,
                                          int fo, long long chunk, int whole)
{
    accgrad_tiles<8>(x, gy, partials, S, f, h, w, kh, kw, sh, sw, ph, pw, oh, ow, fo, chunk, whole);
}
