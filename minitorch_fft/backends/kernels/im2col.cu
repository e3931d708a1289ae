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

// The "rows" accGrad form (gemm.py ROWS): the same sum as accgrad_small's, for few-plane layers whose
// kernel width and stride have an instantiation below (VGG-16 conv1_1, 3x3 s1; ResNet's conv1, 7x7
// s2; AlexNet's conv1, 11x11 s4), without a taps tile. A tile is `tp` output positions of one output
// row (image s, row oy, columns ox0..ox0+tp-1). Shared memory holds gy's tile (tp x f', as
// accgrad_small's) and the input rows the tile reads: for each plane c and kernel row i, the
// (tp-1)*SW + KW input columns from ox0*SW - pw on, zero outside the plane. Tap (c, i, j) at tile
// position q is that row's element q*SW + j: a thread owning a kernel row keeps its KW taps in
// registers as a window that slides by SW elements a position, and loads SW new ones, where
// accgrad_small's fill gathered every tap of every position.
// - Thread (tx, ty): tx = (c*(kh/RI) + ir)*NOG + og owns outputs og*AR_TO.. (NOG = ceil(f'/AR_TO))
//   and kernel rows ir*RI..ir*RI+RI-1 of plane c, all KW taps of each; ty is one of blockDim.y
//   groups, each taking tp/blockDim.y consecutive positions of the tile.
// - Per position a thread issues RI*SW + AR_TO/4 shared loads for AR_TO*RI*KW FMAs (3 + 2 for 72
//   on VGG's conv1_1).
// - Two buffers: tile t+1's gy and rows are copied (cp.async, 4 bytes each, zero past the row's end
//   and outside the plane) while tile t is summed. Without them the first form of this kernel
//   waited on global loads half its time (ncu, session 15: 1.22 ms on VGG-16 conv1_1, 39 % issue).
//   A fill copy costs a few instructions: each thread steps pointers by constants (a flattened walk
//   with carries and 64-bit offsets worked out per element cost ~60 instructions a copy, 1.15 ms).
// Block b sums tiles [b*chunk, (b+1)*chunk) of the (S, oh, tiles_row) tiles and writes each group's
// partial gradient to partials[b*blockDim.y + ty][f'][f*kh*kw] (the caller sums them: sum_rows).
// Shared memory: two buffers of ar_buffer() floats, then the row table (2 ints a row).
#define AR_TO 8

#include "async_copy.cuh"

__device__ __forceinline__ int ar_buffer(int tp, int ld_o, int rows, int ld_x)
{
    return (tp * ld_o + rows * ld_x + 3) & ~3;          // 16-byte aligned: the gy tile takes 16-byte loads
}

template <int KW, int SW, int RI>
__device__ __forceinline__ void accgrad_rows_tiles(const float* __restrict__ x, const float* __restrict__ gy,
                                                   float* __restrict__ partials,
                                                   int S, int f, int h, int w, int kh, int sh,
                                                   int ph, int pw, int oh, int ow, int fo,
                                                   int tp, int tiles_row, long long chunk)
{
    extern __shared__ __align__(16) float smem[];
    const int NOG = (fo + AR_TO - 1) / AR_TO, nir = kh / RI, R = f * kh;
    const int ld_o = ag_ld(NOG * AR_TO), xl = (tp - 1) * SW + KW, ld_x = xl | 1;
    const int buf = ar_buffer(tp, ld_o, R, ld_x);       // a buffer: gy [tp][ld_o], then rows [f*kh][ld_x]
    int* r_off = (int*)(smem + 2 * buf);                // [f*kh]: the row's plane offset c*h*w
    int* r_i = r_off + R;                               // [f*kh]: its kernel row i
    const int nt = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int HW = h * w, P = oh * ow, K = f * kh * KW;
    for (int r = tid; r < R; r += nt) {
        const int c = r / kh;
        r_off[r] = c * HW;
        r_i[r] = r - c * kh;
    }
    // The fills: thread tid is column lane tid % QL of row lane tid / QL (QL = 8 columns; blocks
    // under 8 threads, 1). gy's tile: row lanes take outputs o, column lanes positions q (a warp
    // reads 4 gy rows of 32 bytes and writes 32 banks); the input rows: row lanes take rows, column
    // lanes columns. Each thread's copies step a pointer by constants.
    const int QL = nt >= 8 ? 8 : 1, lq = tid % QL, lr = tid / QL, nrow = nt / QL;
    auto stage = [&](int s, int oy, int xt, float* base) {
        float* sg = base;
        float* sx = base + tp * ld_o;
        const int ox0 = xt * tp, qend = min(tp, ow - ox0);          // positions past the row's end: zero
        if (lr < nrow) {
            const long long gbase = (long long)s * fo * P + (long long)oy * ow + ox0;   // gy[s][0][oy][ox0]
            // a copy that writes a zero still names an address inside the array: clamped
            for (int o = lr; o < fo; o += nrow) {
                const float* src = gy + gbase + (long long)o * P;
                for (int q = lq; q < tp; q += QL) async_copy4(sg + q * ld_o + o, src + min(q, qend - 1), q < qend);
            }
            const long long ximg = (long long)s * f * HW;
            const int iy0 = oy * sh - ph, ix0 = ox0 * SW - pw, ulo = -ix0, uhi = w - 1 - ix0;
            for (int r = lr; r < R; r += nrow) {
                const int iy = iy0 + r_i[r];
                const bool row_in = iy >= 0 && iy < h;
                const float* src = x + ximg + r_off[r] + (long long)min(max(iy, 0), h - 1) * w + ix0;   // column u at src + u
                for (int u = lq; u < xl; u += QL)
                    async_copy4(sx + r * ld_x + u, src + min(max(u, ulo), uhi), row_in && u >= ulo && u <= uhi);
            }
        }
        async_commit();
    };
    const int og = threadIdx.x % NOG, cr = threadIdx.x / NOG;        // cr = c*nir + ir
    const int c = cr / nir, ir = cr - c * nir;
    const int xoff = tp * ld_o + (c * kh + ir * RI) * ld_x;           // the thread's first row in a buffer
    const int qg = tp / blockDim.y, q0 = threadIdx.y * qg;
    float acc[AR_TO][RI * KW];
#pragma unroll
    for (int u = 0; u < AR_TO; ++u)
#pragma unroll
        for (int v = 0; v < RI * KW; ++v) acc[u][v] = 0.f;
    const long long T = (long long)S * oh * tiles_row;
    const long long t0 = blockIdx.x * chunk, t1 = min(T, t0 + chunk);
    // the next tile to stage as (image, row, column tile): divided once, then stepped
    int s = (int)(t0 / ((long long)oh * tiles_row));
    int oy = (int)(t0 - (long long)s * oh * tiles_row) / tiles_row;
    int xt = (int)(t0 - (long long)s * oh * tiles_row) - oy * tiles_row;
    auto advance = [&]() { if (++xt == tiles_row) { xt = 0; if (++oy == oh) { oy = 0; ++s; } } };
    __syncthreads();                                      // the row table
    if (t0 < t1) { stage(s, oy, xt, smem); advance(); }
    int cur = 0;
    for (long long t = t0; t < t1; ++t) {
        if (t + 1 < t1) {
            stage(s, oy, xt, smem + (cur ^ 1) * buf);
            advance();
            async_wait_but_one();
        } else {
            async_wait_all();
        }
        __syncthreads();
        const float* sg = smem + cur * buf;
        const float* xr = sg + xoff;
        float win[RI][KW];
#pragma unroll
        for (int r = 0; r < RI; ++r)
#pragma unroll
            for (int j = 0; j < KW - SW; ++j) win[r][j] = xr[r * ld_x + q0 * SW + j];
#pragma unroll 2
        for (int q = q0; q < q0 + qg; ++q) {
#pragma unroll
            for (int r = 0; r < RI; ++r)
#pragma unroll
                for (int j = KW - SW; j < KW; ++j) win[r][j] = xr[r * ld_x + q * SW + j];
            float a[AR_TO];
#pragma unroll
            for (int u = 0; u < AR_TO; u += 4) {
                const float4 v = *reinterpret_cast<const float4*>(sg + q * ld_o + og * AR_TO + u);
                a[u] = v.x; a[u + 1] = v.y; a[u + 2] = v.z; a[u + 3] = v.w;
            }
#pragma unroll
            for (int u = 0; u < AR_TO; ++u)
#pragma unroll
                for (int r = 0; r < RI; ++r)
#pragma unroll
                    for (int j = 0; j < KW; ++j) acc[u][r * KW + j] = fmaf(a[u], win[r][j], acc[u][r * KW + j]);
#pragma unroll
            for (int r = 0; r < RI; ++r)
#pragma unroll
                for (int j = 0; j < KW - SW; ++j) win[r][j] = win[r][j + SW];
        }
        __syncthreads();                                  // before the next stage overwrites this buffer
        cur ^= 1;
    }
    float* out = partials + ((long long)blockIdx.x * blockDim.y + threadIdx.y) * fo * K;
#pragma unroll
    for (int u = 0; u < AR_TO; ++u) {
        const int o = og * AR_TO + u;
        if (o < fo) {
#pragma unroll
            for (int r = 0; r < RI; ++r)
#pragma unroll
                for (int j = 0; j < KW; ++j) out[(long long)o * K + (c * kh + ir * RI + r) * KW + j] = acc[u][r * KW + j];
        }
    }
}

#define ACCGRAD_ROWS(NAME, KW, SW, RI)                                                                   \
    extern "C" __global__ void NAME(const float* __restrict__ x, const float* __restrict__ gy,        \
                                    float* __restrict__ partials, int S, int f, int h, int w, int kh,  \
                                    int sh, int ph, int pw, int oh, int ow, int fo, int tp,           \
                                    int tiles_row, long long chunk)                                   \
    {                                                                                                  \
        accgrad_rows_tiles<KW, SW, RI>(x, gy, partials, S, f, h, w, kh, sh, ph, pw, oh, ow, fo, tp,   \
                                       tiles_row, chunk);                                              \
    }
ACCGRAD_ROWS(accgrad_rows_k3s1, 3, 1, 3)     // a thread: 8 outputs x a whole 3x3 plane (72 FMAs a position)
ACCGRAD_ROWS(accgrad_rows_k7s2, 7, 2, 1)     // 8 outputs x one 7-tap kernel row (56)
ACCGRAD_ROWS(accgrad_rows_k11s4, 11, 4, 1)   // 8 outputs x one 11-tap kernel row (88)

// out[c] = the sum over r of a[r][c] for a (rows, cols) row-major array, in a fixed order (the
// implicit forms' partial gradients). Block (32, 32): 32 columns, each summed by 32 threads over rows
// 32 apart, 4 loads in flight, then a tree over the 32. CuPy's axis-0 sum of VGG-16 conv1_1's
// partials (1188 x 1728) took 0.115 ms (session 14).
extern "C" __global__ void sum_rows(const float* __restrict__ a, float* __restrict__ out, int rows, int cols)
{
    __shared__ float part[32][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (col < cols) {
        int r = threadIdx.y;
        for (; r + 96 < rows; r += 128) {
#pragma unroll
            for (int m = 0; m < 4; ++m) acc[m] += a[(long long)(r + 32 * m) * cols + col];
        }
        for (int m = 0; r < rows; r += 32, ++m) acc[m & 3] += a[(long long)r * cols + col];
    }
    part[threadIdx.y][threadIdx.x] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    __syncthreads();
    for (int half = 16; half > 0; half >>= 1) {
        if (threadIdx.y < half) part[threadIdx.y][threadIdx.x] += part[threadIdx.y + half][threadIdx.x];
        __syncthreads();
    }
    if (threadIdx.y == 0 && col < cols) out[col] = part[0][threadIdx.x];
}
