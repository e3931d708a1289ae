// Direct convolution kernels for backends/direct.py: the sums of the definition, computed in
// registers, with no unrolled (im2col) matrix.
//
// S batch, f in-planes, f' out-planes (fo), h x wd input, kh x kw kernel, sh x sw stride,
// ph x pw zero padding, oh x ow output. NCHW float32, contiguous.
//
// Families (templates; every size that indexes a register array is a template parameter):
//   *_naive      one thread (fprop, bprop) or one block (accgrad) per output element. Slow, obviously
//                right; the autotuner's reference and the fallback for any geometry.
//   fprop_tile   a block owns FB*FG output planes x TS*P consecutive output positions of one image;
//                each thread accumulates FB planes x P positions in registers. Input tile and weights
//                in shared memory, channel chunk by chunk.
//   bprop_tile   the stride's residue classes: an input pixel iy gets gradient only from taps
//                i = (iy+ph) mod sh + sh*m, so each class is a stride-1 correlation of gy with a
//                sub-filter. No zeros are inserted and no tap is wasted.
//   bprop_reg    the same classes with a register window of gy (sub-filters up to MT x MT,
//                double-buffered shared memory): the fast one for strided first layers.
//   accgrad_tile a block owns FB*FG planes x TE*R (channel, tap) entries of gradWeight and loops over a
//                share of the (image, position tile) work items; partial sums go to a workspace that
//                sum_partials reduces in a fixed order. No atomics: deterministic.
//   plane_corr   the single-plane fast path (S = f = f' = 1, stride 1, k x k, k <= 7): Iandola et al.'s
//                register blocking, input through the read-only path, filter in registers.
//
// Shared-memory fills use cp.async (sm_80+; plain loads below that). Compiles under NVRTC (no
// headers) and nvcc. For nvcc -cubin checks, define
// MINITORCH_EXPLICIT_INSTANTIATIONS to instantiate every configuration direct.py can pick.

#define DIRECT_CONV_PARAMS int S, int f, int h, int wd, int fo, int kh, int kw, int sh, int sw, \
                           int ph, int pw, int oh, int ow

// ---------------------------------------------------------------------------------------------
// Naive kernels
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void fprop_naive(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, DIRECT_CONV_PARAMS)
{
    const long long total = (long long)S * fo * oh * ow;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long t = idx;
        const int ox = t % ow; t /= ow;
        const int oy = t % oh; t /= oh;
        const int o = t % fo;
        const int s = (int)(t / fo);
        float acc = 0.f;
        for (int c = 0; c < f; ++c) {
            const float* xc = x + ((long long)s * f + c) * h * wd;
            const float* wc = w + ((long long)o * f + c) * kh * kw;
            for (int i = 0; i < kh; ++i) {
                const int iy = oy * sh - ph + i;
                if (iy < 0 || iy >= h) continue;
                for (int j = 0; j < kw; ++j) {
                    const int ix = ox * sw - pw + j;
                    if (ix < 0 || ix >= wd) continue;
                    acc += xc[(long long)iy * wd + ix] * wc[i * kw + j];
                }
            }
        }
        y[idx] = acc;
    }
}

// Gather, as col2im: only taps i with (iy + ph - i) divisible by sh reach an output row.
extern "C" __global__ void bprop_naive(const float* __restrict__ gy, const float* __restrict__ w,
                                       float* __restrict__ gx, DIRECT_CONV_PARAMS)
{
    const long long total = (long long)S * f * h * wd;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long t = idx;
        const int ix = t % wd; t /= wd;
        const int iy = t % h; t /= h;
        const int c = t % f;
        const int s = (int)(t / f);
        float acc = 0.f;
        for (int o = 0; o < fo; ++o) {
            const float* gys = gy + ((long long)s * fo + o) * oh * ow;
            const float* wc = w + ((long long)o * f + c) * kh * kw;
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
                    acc += gys[(long long)oy * ow + ox] * wc[i * kw + j];
                }
            }
        }
        gx[idx] = acc;
    }
}

// One block of exactly 256 threads per gradWeight element; a fixed-shape tree reduction.
extern "C" __global__ void __launch_bounds__(256)
accgrad_naive(const float* __restrict__ gy, const float* __restrict__ x, float* __restrict__ gw,
              DIRECT_CONV_PARAMS)
{
    __shared__ float red[256];
    const long long npos = (long long)S * oh * ow;
    const long long nelem = (long long)fo * f * kh * kw;
    for (long long e = blockIdx.x; e < nelem; e += gridDim.x) {
        long long t = e;
        const int j = t % kw; t /= kw;
        const int i = t % kh; t /= kh;
        const int c = t % f;
        const int o = (int)(t / f);
        float acc = 0.f;
        for (long long p = threadIdx.x; p < npos; p += blockDim.x) {
            const int ox = p % ow;
            const long long q = p / ow;
            const int oy = q % oh;
            const int s = (int)(q / oh);
            const int iy = oy * sh - ph + i, ix = ox * sw - pw + j;
            if (iy >= 0 && iy < h && ix >= 0 && ix < wd)
                acc += gy[(((long long)s * fo + o) * oh + oy) * ow + ox]
                     * x[(((long long)s * f + c) * h + iy) * wd + ix];
        }
        red[threadIdx.x] = acc;
        __syncthreads();
        for (int k = 128; k > 0; k >>= 1) {
            if (threadIdx.x < k) red[threadIdx.x] += red[threadIdx.x + k];
            __syncthreads();
        }
        if (threadIdx.x == 0) gw[e] = red[0];
        __syncthreads();
    }
}

// out[i] = sum over z = 0..nsplit-1 of ws[z * n + i], always in that order (deterministic).
extern "C" __global__ void sum_partials(const float* __restrict__ ws, float* __restrict__ out,
                                        int nsplit, long long n)
{
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        float acc = 0.f;
        for (int z = 0; z < nsplit; ++z) acc += ws[z * n + idx];
        out[idx] = acc;
    }
}

// ---------------------------------------------------------------------------------------------
// Shared helpers of the tiled kernels
// ---------------------------------------------------------------------------------------------

// acc[b][k] += wv[b] * v[k] for FB weights read as float4 from shared memory (FB rounded up to 4
// in storage; the padding lanes are loaded and ignored). Broadcast loads: every lane of a warp
// reads the same address.
template <int FB, int P>
__device__ __forceinline__ void fma_block(float (&acc)[FB][P], const float4* __restrict__ w4,
                                          const float (&v)[P])
{
#pragma unroll
    for (int q = 0; q < (FB + 3) / 4; ++q) {
        const float4 wq = w4[q];
        const float wv[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            if (4 * q + l < FB) {
#pragma unroll
                for (int k = 0; k < P; ++k) acc[4 * q + l][k] = fmaf(wv[l], v[k], acc[4 * q + l][k]);
            }
        }
    }
}

#include "async_copy.cuh"

// Copy a nch x nrows x ncols window of a zero-padded source into shared memory:
//   dst[c*dst_cs + r*dst_rs + col(u)] = src[c*src_cs + (row0+r)*src_w + col0+u], 0 outside the
//   src_h x src_w plane; col(u) = colmap[u] if MAP, else u.
// Threads walk the window in flattened order; the (c, r, u) counters advance by the block size
// with carries, so there is no division per element.
template <bool MAP>
__device__ __forceinline__ void fill_window(float* __restrict__ dst, int dst_cs, int dst_rs,
                                            const int* __restrict__ colmap,
                                            const float* __restrict__ src, long long src_cs,
                                            int src_h, int src_w, int row0, int col0,
                                            int nch, int nrows, int ncols, int tid, int nthreads)
{
    const int plane = nrows * ncols;
    const int total = nch * plane;
    const int dc = nthreads / plane, rem = nthreads % plane;
    const int dr = rem / ncols, du = rem % ncols;
    int c = tid / plane;
    int r = (tid % plane) / ncols;
    int u = (tid % plane) % ncols;
    for (int e = tid; e < total; e += nthreads) {
        const int iy = row0 + r, ix = col0 + u;
        const bool in = (unsigned)iy < (unsigned)src_h && (unsigned)ix < (unsigned)src_w;
        async_copy4(dst + c * dst_cs + r * dst_rs + (MAP ? colmap[u] : u),
                    in ? src + c * src_cs + (long long)iy * src_w + ix : src, in);
        u += du;
        r += dr;
        c += dc;
        if (u >= ncols) { u -= ncols; ++r; }
        if (r >= nrows) { r -= nrows; ++c; }
    }
}

// dst[e] = src[e] for e < n.
__device__ __forceinline__ void copy_to_shared(float* __restrict__ dst, const float* __restrict__ src,
                                               int n, int tid, int nthreads)
{
    for (int e = tid; e < n; e += nthreads) async_copy4(dst + e, src + e, true);
}

// The input tile of fprop and accgrad, "phase-split" by the column stride: padded input column u
// (input column u - pw) of tile row r lives at r*rs + (u % sw)*pwc + u / sw, with pwc = ceil(iwp/sw)
// and iwp = (ow-1)*sw + kw the padded width the outputs touch. Output column ox at tap j reads
// padded column ox*sw + j = phase j % sw, index ox + j / sw: neighbouring outputs read
// neighbouring words whatever the stride, so shared-memory reads are free of bank conflicts.
// Offsets split into a per-position base (oy - oy_a)*sh*rs + ox and a per-tap
// i*rs + (j % sw)*pwc + j / sw.

// ---------------------------------------------------------------------------------------------
// fprop_tile<FB, P, TS, FG>: TS*FG threads; thread (ts, fg) computes planes o0 + fg*FB + [0, FB) at
// positions q0 + ts + k*TS, k < P (interleaved: coalesced stores). wt is w transposed to
// (f, kh, kw, f'), so a chunk's weights are rows of f' contiguous floats.
// Shared memory (floats): weights [cc][kh*kw][FBB] | input [cc][rows_max][rs] | column map [iwp] int.
// ---------------------------------------------------------------------------------------------
template <int FB, int P, int TS, int FG>
__global__ void __launch_bounds__(TS * FG, 1)
fprop_tile(const float* __restrict__ x, const float* __restrict__ wt, float* __restrict__ y,
           DIRECT_CONV_PARAMS, int cc, int rows_max, int pwc, int rs)
{
    constexpr int FBP = (FB + 3) / 4 * 4, FBB = FBP * FG, T = TS * FG, TP = TS * P;
    extern __shared__ float4 smem4[];
    float* s_w = reinterpret_cast<float*>(smem4);
    const int KK = kh * kw, ohw = oh * ow, iwp = (ow - 1) * sw + kw;
    float* s_x = s_w + cc * KK * FBB;
    int* s_col = reinterpret_cast<int*>(s_x + cc * rows_max * rs);

    const int tid = threadIdx.x, ts = tid % TS, fg = tid / TS;
    const int ngroups = (fo + FB * FG - 1) / (FB * FG);
    const int group = blockIdx.x % ngroups, tile = blockIdx.x / ngroups;  // groups of a tile adjacent
    const int o0 = group * FB * FG;
    const int q0 = tile * TP, qend = min(q0 + TP, ohw);
    const int oy_a = q0 / ow, oy_b = (qend - 1) / ow;
    const int nrows = (oy_b - oy_a) * sh + kh;

    for (int u = tid; u < iwp; u += T) s_col[u] = (u % sw) * pwc + u / sw;

    int base[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
        const int q = q0 + ts + k * TS;
        base[k] = q < qend ? (q / ow - oy_a) * sh * rs + q % ow : 0;  // 0: a filled, unused cell
    }

    for (int s = blockIdx.y; s < S; s += gridDim.y) {
        float acc[FB][P] = {};
        const float* xs = x + (long long)s * f * h * wd;
        for (int c0 = 0; c0 < f; c0 += cc) {
            const int ncc = min(cc, f - c0);
            __syncthreads();  // the column map is written; the previous chunk's readers are done
            for (int e = tid; e < ncc * KK * FBB; e += T) {
                const int row = e / FBB, ob = e % FBB;  // row = c*KK + tap
                const int fb = ob % FBP, o = o0 + (ob / FBP) * FB + fb;
                const bool in = fb < FB && o < fo;
                async_copy4(s_w + e, in ? wt + (long long)(c0 * KK + row) * fo + o : wt, in);
            }
            fill_window<true>(s_x, rows_max * rs, rs, s_col, xs + (long long)c0 * h * wd,
                              (long long)h * wd, h, wd, oy_a * sh - ph, -pw, ncc, nrows, iwp, tid, T);
            async_wait_all();
            __syncthreads();
            for (int c = 0; c < ncc; ++c) {
                // Tap offsets i*rs + (j % sw)*pwc + j / sw kept in uniform registers: each load is
                // one LDS [per-position register + uniform offset].
                const float4* wt4 = reinterpret_cast<const float4*>(s_w + c * KK * FBB + fg * FBP);
                int roff = c * rows_max * rs;
                for (int i = 0; i < kh; ++i, roff += rs) {
                    int toff = roff, jr = 0;
                    for (int j = 0; j < kw; ++j) {
                        float v[P];
#pragma unroll
                        for (int k = 0; k < P; ++k) v[k] = s_x[base[k] + toff];
                        fma_block<FB, P>(acc, wt4, v);
                        wt4 += FBB / 4;
                        toff += pwc;             // next phase ...
                        if (++jr == sw) {        // ... or the next column of phase 0
                            jr = 0;
                            toff += 1 - sw * pwc;
                        }
                    }
                }
            }
        }
        float* ys = y + (long long)s * fo * ohw;
#pragma unroll
        for (int fb = 0; fb < FB; ++fb) {
            const int o = o0 + fg * FB + fb;
            if (o < fo) {
#pragma unroll
                for (int k = 0; k < P; ++k) {
                    const int q = q0 + ts + k * TS;
                    if (q < qend) ys[(long long)o * ohw + q] = acc[fb][k];
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// bprop_tile<FB, P, TQ>: residue classes. Write iy + ph = sh*a + ry (0 <= ry < sh) and likewise
// ix + pw = sw*b + rx. Then
//   gx[c, iy, ix] = sum_o sum_{m < MHc(ry), n < MWc(rx)} gy[o, a-m, b-n] * w[o, c, ry+sh*m, rx+sw*n]
// with MHc(ry) = ceil((kh - ry)/sh) and gy zero outside oh x ow: for each class (ry, rx) a stride-1
// correlation over the coarse grid a in [a0, a0+A), b in [b0, b0+B), a0 = ph/sh, b0 = pw/sw.
// A block owns TQ*P coarse positions, cpb classes (one per group of TQ threads: the class is
// warp-uniform, so are the tap loops' bounds), fgn*FB input planes; blockDim = TQ*cpb*fgn <= 256.
// wblk (bprop_weights) holds the sub-filters in the block's shared-memory order.
// Shared memory (floats): weights [cc][cpb][MH*MW][FBB] | gy [cc][rows_max][B + MW - 1].
// ---------------------------------------------------------------------------------------------
template <int FB, int P, int TQ>
__global__ void __launch_bounds__(256, 1)
bprop_tile(const float* __restrict__ gy, const float* __restrict__ wblk, float* __restrict__ gx,
           DIRECT_CONV_PARAMS, int A, int B, int a0, int b0, int MH, int MW, int cpb, int fgn, int cc,
           int rows_max)
{
    constexpr int FBP = (FB + 3) / 4 * 4, TPc = TQ * P;
    extern __shared__ float4 smem4[];
    const int T = blockDim.x;
    const int FBB = FBP * fgn, MHW = MH * MW, ncls = sh * sw, ohw = oh * ow;
    const int ncg = (ncls + cpb - 1) / cpb, nfgrp = (f + FB * fgn - 1) / (FB * fgn);
    const int AB = A * B, rsg = B + MW - 1;
    const int cg = blockIdx.x % ncg, rest = blockIdx.x / ncg;  // classes of a tile adjacent
    const int fgrp = rest % nfgrp, tile = rest / nfgrp;
    float* s_w = reinterpret_cast<float*>(smem4);
    float* s_g = s_w + cc * cpb * MHW * FBB;

    const int tid = threadIdx.x, tq = tid % TQ, grp = tid / TQ, cl = grp % cpb, fg = grp / cpb;
    const int cls = cg * cpb + cl;
    const bool active = cls < ncls;
    const int ry = active ? cls / sw : 0, rx = active ? cls % sw : 0;
    const int mhc = (active && ry < kh) ? (kh - ry + sh - 1) / sh : 0;
    const int mwc = (active && rx < kw) ? (kw - rx + sw - 1) / sw : 0;
    const int q0 = tile * TPc, qend = min(q0 + TPc, AB);
    const int a_lo = a0 + q0 / B, a_hi = a0 + (qend - 1) / B;
    const int nrows = a_hi - a_lo + MH;

    int base[P], out[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
        const int q = q0 + tq + k * TQ;
        base[k] = (MH - 1) * rsg + (MW - 1);  // past the tile: read as (a_lo, b0), never stored
        out[k] = -1;
        if (q < qend) {
            const int a = a0 + q / B, b = b0 + q % B;
            base[k] = (a - a_lo + MH - 1) * rsg + (b - b0 + MW - 1);
            const int iy = a * sh + ry - ph, ix = b * sw + rx - pw;
            if (active && iy >= 0 && iy < h && ix >= 0 && ix < wd) out[k] = iy * wd + ix;
        }
    }
    const int wstride = cpb * MHW * FBB;  // floats per gy plane o in wblk
    const float* wsrc = wblk + (long long)(cg * nfgrp + fgrp) * fo * wstride;
    const int c_first = (fgrp * fgn + fg) * FB;

    for (int s = blockIdx.y; s < S; s += gridDim.y) {
        float acc[FB][P] = {};
        for (int o0 = 0; o0 < fo; o0 += cc) {
            const int ncc = min(cc, fo - o0);
            __syncthreads();
            copy_to_shared(s_w, wsrc + (long long)o0 * wstride, ncc * wstride, tid, T);
            fill_window<false>(s_g, rows_max * rsg, rsg, nullptr, gy + ((long long)s * fo + o0) * ohw,
                               (long long)ohw, oh, ow, a_lo - MH + 1, b0 - MW + 1, ncc, nrows, rsg,
                               tid, T);
            async_wait_all();
            __syncthreads();
            for (int oc = 0; oc < ncc; ++oc) {
                const float* gk[P];
#pragma unroll
                for (int k = 0; k < P; ++k) gk[k] = s_g + oc * rows_max * rsg + base[k];
                const float4* wc =
                    reinterpret_cast<const float4*>(s_w + (oc * cpb + cl) * MHW * FBB + fg * FBP);
                for (int m = 0; m < mhc; ++m) {
                    for (int n = 0; n < mwc; ++n) {
                        const int off = -(m * rsg + n);
                        float v[P];
#pragma unroll
                        for (int k = 0; k < P; ++k) v[k] = gk[k][off];
                        fma_block<FB, P>(acc, wc + (m * MW + n) * (FBB / 4), v);
                    }
                }
            }
        }
        float* gxs = gx + (long long)s * f * h * wd;
#pragma unroll
        for (int fb = 0; fb < FB; ++fb) {
            const int c = c_first + fb;
            if (c < f) {
#pragma unroll
                for (int k = 0; k < P; ++k)
                    if (out[k] >= 0) gxs[(long long)c * h * wd + out[k]] = acc[fb][k];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// bprop_reg<FB, PY, PX, MT>: the same residue classes, for sub-filters of at most MT x MT taps
// (MH, MW <= MT; missing taps have zero weights), with a register window: a thread owns PY
// consecutive coarse rows x PX columns 32 apart (lane-consecutive: conflict-free shared loads,
// one warp per class). For each column and tap column n it loads the PY+MT-1 gy values of that
// column once and uses each for up to MT taps: PY*MT*FB FMAs per PY+MT-1 loads, where bprop_tile
// does FB FMAs per load. Block: cpb classes x nstrip strips of PY rows, one warp each
// (32*cpb*nstrip <= 256 threads); block tile nstrip*PY x 32*PX coarse positions, FB input planes.
// Shared memory (floats), twice (double buffering): weights [cc][cpb][MT*MT][FBP] |
// gy [cc][nstrip*PY + MT-1][32*PX + MT-1]. Instances with at most 48 accumulators are held to 128
// registers (two blocks per SM).
// ---------------------------------------------------------------------------------------------
template <int FB, int PY, int PX, int MT>
__global__ void __launch_bounds__(256, FB * PY * PX <= 48 ? 2 : 1)
bprop_reg(const float* __restrict__ gy, const float* __restrict__ wblk, float* __restrict__ gx,
          DIRECT_CONV_PARAMS, int A, int B, int a0, int b0, int cpb, int nstrip, int cc)
{
    constexpr int FBP = (FB + 3) / 4 * 4, TX = 32 * PX, RSG = TX + MT - 1, MTT = MT * MT;
    extern __shared__ float4 smem4[];
    const int T = blockDim.x, ncls = sh * sw, ohw = oh * ow;
    const int TY = nstrip * PY, rows = TY + MT - 1;
    const int ncg = (ncls + cpb - 1) / cpb, nfgrp = (f + FB - 1) / FB;
    const int tiles_x = (B + TX - 1) / TX;
    int rest = blockIdx.x;
    const int cg = rest % ncg; rest /= ncg;                       // classes of a tile adjacent
    const int fgrp = rest % nfgrp; rest /= nfgrp;
    const int tile_x = rest % tiles_x, tile_y = rest / tiles_x;
    const int a_t = a0 + tile_y * TY, b_t = b0 + tile_x * TX;
    // two buffers, each weights [cc][cpb][MT*MT][FBP] | gy [cc][rows][RSG]: chunk k+1 is copied
    // (cp.async) while chunk k is summed
    const int wsize = cc * cpb * MTT * FBP, bsize = (wsize + cc * rows * RSG + 3) / 4 * 4;  // float4-aligned
    float* const s_buf = reinterpret_cast<float*>(smem4);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int cl = warp % cpb, strip = warp / cpb, cls = cg * cpb + cl;
    const bool active = cls < ncls;
    const int ry = active ? cls / sw : 0, rx = active ? cls % sw : 0;
    const int wstride = cpb * MTT * FBP;                          // floats per gy plane o in wblk
    const float* wsrc = wblk + (long long)(cg * nfgrp + fgrp) * fo * wstride;

    for (int s = blockIdx.y; s < S; s += gridDim.y) {
        float acc[PY][PX][FB] = {};
        const float* gys = gy + (long long)s * fo * ohw;
        auto issue = [&](int o0, float* buf) {                    // start copying chunk o0.. into buf
            const int ncc = min(cc, fo - o0);
            copy_to_shared(buf, wsrc + (long long)o0 * wstride, ncc * wstride, tid, T);
            fill_window<false>(buf + wsize, rows * RSG, RSG, nullptr, gys + (long long)o0 * ohw,
                               (long long)ohw, oh, ow, a_t - (MT - 1), b_t - (MT - 1), ncc, rows, RSG,
                               tid, T);
            async_commit();
        };
        __syncthreads();                                          // the previous image is summed
        issue(0, s_buf);
        for (int k = 0, o0 = 0; o0 < fo; ++k, o0 += cc) {
            float* const buf = s_buf + (k & 1) * bsize;
            if (o0 + cc < fo) {
                issue(o0 + cc, s_buf + ((k + 1) & 1) * bsize);  // its buffer was freed by the last sync
                async_wait_but_one();
            } else {
                async_wait_all();
            }
            __syncthreads();
            const int ncc = min(cc, fo - o0);
            for (int oc = 0; active && oc < ncc; ++oc) {
                // gy row r of this strip's window is coarse row a_t + strip*PY + r - (MT-1)
                const float* gcol0 = buf + wsize + (oc * rows + strip * PY) * RSG + lane + MT - 1;
                const float4* w4 = reinterpret_cast<const float4*>(buf + (oc * cpb + cl) * MTT * FBP);
#pragma unroll
                for (int px = 0; px < PX; ++px) {
#pragma unroll
                    for (int n = 0; n < MT; ++n) {
                        const float* gcol = gcol0 + 32 * px - n;        // column b - n
                        float win[PY + MT - 1];
#pragma unroll
                        for (int r = 0; r < PY + MT - 1; ++r) win[r] = gcol[r * RSG];
#pragma unroll
                        for (int m = 0; m < MT; ++m) {
                            float wv[FBP];
#pragma unroll
                            for (int q = 0; q < FBP / 4; ++q) {
                                const float4 t = w4[(m * MT + n) * (FBP / 4) + q];
                                wv[4 * q] = t.x;
                                wv[4 * q + 1] = t.y;
                                wv[4 * q + 2] = t.z;
                                wv[4 * q + 3] = t.w;
                            }
#pragma unroll
                            for (int py = 0; py < PY; ++py)
#pragma unroll
                                for (int fb = 0; fb < FB; ++fb)   // row a - m = window row py + MT-1 - m
                                    acc[py][px][fb] = fmaf(win[py + MT - 1 - m], wv[fb], acc[py][px][fb]);
                        }
                    }
                }
            }
            __syncthreads();                                      // buf may be refilled now
        }
        if (!active) continue;
        float* gxs = gx + (long long)s * f * h * wd;
#pragma unroll
        for (int py = 0; py < PY; ++py) {
            const int a = a_t + strip * PY + py, iy = a * sh + ry - ph;
            if (a >= a0 + A || iy < 0 || iy >= h) continue;
#pragma unroll
            for (int px = 0; px < PX; ++px) {
                const int b = b_t + lane + 32 * px, ix = b * sw + rx - pw;
                if (b >= b0 + B || ix < 0 || ix >= wd) continue;
#pragma unroll
                for (int fb = 0; fb < FB; ++fb) {
                    const int c = fgrp * FB + fb;
                    if (c < f) gxs[((long long)c * h + iy) * wd + ix] = acc[py][px][fb];
                }
            }
        }
    }
}

// The sub-filters of bprop_tile and bprop_reg in their shared-memory order (bprop_reg: MH = MW = MT,
// fgn = 1):
//   wblk[cg][fgrp][o][cl][m*MW + n][slot], slot = fg*FBP + fb, FBB = FBP*fgn slots,
//   = w[o, c, ry + sh*m, rx + sw*n] for class cls = cg*cpb + cl = ry*sw + rx and c = (fgrp*fgn + fg)*FB + fb,
//   0 where the tap, the class, the slot or the plane does not exist.
extern "C" __global__ void bprop_weights(const float* __restrict__ w, float* __restrict__ wblk,
                                         int f, int fo, int kh, int kw, int sh, int sw, int MH, int MW,
                                         int FB, int FBP, int fgn, int cpb, int ncg, int nfgrp)
{
    const int FBB = FBP * fgn, MHW = MH * MW;
    const long long total = (long long)ncg * nfgrp * fo * cpb * MHW * FBB;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long t = idx;
        const int slot = t % FBB; t /= FBB;
        const int mn = t % MHW; t /= MHW;
        const int cl = t % cpb; t /= cpb;
        const int o = t % fo; t /= fo;
        const int fgrp = t % nfgrp;
        const int cg = (int)(t / nfgrp);
        const int cls = cg * cpb + cl, ry = cls / sw, rx = cls % sw;
        const int i = ry + sh * (mn / MW), j = rx + sw * (mn % MW);
        const int fb = slot % FBP, c = (fgrp * fgn + slot / FBP) * FB + fb;
        float v = 0.f;
        if (cls < sh * sw && i < kh && j < kw && fb < FB && c < f)
            v = w[(((long long)o * f + c) * kh + i) * kw + j];
        wblk[idx] = v;
    }
}

// ---------------------------------------------------------------------------------------------
// accgrad_tile<FB, R, TE, FG>: gw[o, c, i, j] = sum_{s, q} gy[s, o, q] * x[s, c, row(q, i), col(q, j)].
// Block (blockIdx.x, blockIdx.y) owns planes o0 + [0, FB*FG) and entries e = c*kh*kw + tap in
// [e0, e0 + TE*R); thread (te, fg) accumulates planes o0 + fg*FB + [0, FB) x entries
// e0 + te + r*TE, r < R. blockIdx.z is the split z: it takes work items (image, tile of tp
// positions) z, z + gridDim.z, ... and writes its partial sums to ws[z][o][e].
// Shared memory (floats): gy [tp][FBB] | input [cc_max][rows_max][rs] | bases [tp] int |
// column map [iwp] int.
// ---------------------------------------------------------------------------------------------
template <int FB, int R, int TE, int FG>
__global__ void __launch_bounds__(TE * FG, 1)
accgrad_tile(const float* __restrict__ gy, const float* __restrict__ x, float* __restrict__ ws,
             DIRECT_CONV_PARAMS, int tp, int cc_max, int rows_max, int pwc, int rs)
{
    constexpr int FBP = (FB + 3) / 4 * 4, FBB = FBP * FG, T = TE * FG, EB = TE * R;
    extern __shared__ float4 smem4[];
    float* s_g = reinterpret_cast<float*>(smem4);
    const int KK = kh * kw, ne = f * KK, ohw = oh * ow, iwp = (ow - 1) * sw + kw;
    float* s_x = s_g + tp * FBB;
    int* s_base = reinterpret_cast<int*>(s_x + cc_max * rows_max * rs);
    int* s_col = s_base + tp;

    const int ntiles = (ohw + tp - 1) / tp, nitems = S * ntiles;
    const int tid = threadIdx.x, te = tid % TE, fg = tid / TE;
    const int o0 = blockIdx.x * FB * FG;
    const int e0 = blockIdx.y * EB;
    const int c_lo = e0 / KK, c_hi = min(f, (min(e0 + EB, ne) - 1) / KK + 1), ncc = c_hi - c_lo;

    for (int u = tid; u < iwp; u += T) s_col[u] = (u % sw) * pwc + u / sw;
    int toff[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int e = e0 + te + r * TE;
        toff[r] = 0;  // a filled cell; the entry is not stored
        if (e < ne) {
            const int c = e / KK - c_lo, t = e % KK, i = t / kw, j = t % kw;
            toff[r] = c * rows_max * rs + i * rs + (j % sw) * pwc + j / sw;
        }
    }

    float acc[FB][R] = {};
    for (int item = blockIdx.z; item < nitems; item += gridDim.z) {
        const int s = item / ntiles, tile = item % ntiles;
        const int q0 = tile * tp, qend = min(q0 + tp, ohw), nq = qend - q0;
        const int oy_a = q0 / ow, oy_b = (qend - 1) / ow;
        const int nrows = (oy_b - oy_a) * sh + kh;
        __syncthreads();  // the column map is written; the previous item's readers are done
        fill_window<true>(s_x, rows_max * rs, rs, s_col, x + ((long long)s * f + c_lo) * h * wd,
                          (long long)h * wd, h, wd, oy_a * sh - ph, -pw, ncc, nrows, iwp, tid, T);
        for (int e = tid; e < nq * FBB; e += T) {
            const int qq = e / FBB, ob = e % FBB;
            const int fb = ob % FBP, o = o0 + (ob / FBP) * FB + fb;
            const bool in = fb < FB && o < fo;
            async_copy4(s_g + e, in ? gy + ((long long)s * fo + o) * ohw + q0 + qq : gy, in);
        }
        for (int qq = tid; qq < nq; qq += T) {
            const int q = q0 + qq;
            s_base[qq] = (q / ow - oy_a) * sh * rs + q % ow;
        }
        async_wait_all();
        __syncthreads();
        const float4* g4 = reinterpret_cast<const float4*>(s_g + fg * FBP);
        const float* xr[R];  // per-entry pointers: one add per load in the position loop
#pragma unroll
        for (int r = 0; r < R; ++r) xr[r] = s_x + toff[r];
#pragma unroll 2
        for (int qq = 0; qq < nq; ++qq) {  // only this tile's positions: no 0 * x terms
            const int b = s_base[qq];
            float v[R];
#pragma unroll
            for (int r = 0; r < R; ++r) v[r] = xr[r][b];
            fma_block<FB, R>(acc, g4 + qq * (FBB / 4), v);
        }
    }
    float* wsz = ws + (long long)blockIdx.z * fo * ne;
#pragma unroll
    for (int fb = 0; fb < FB; ++fb) {
        const int o = o0 + fg * FB + fb;
        if (o < fo) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int e = e0 + te + r * TE;
                if (e < ne) wsz[(long long)o * ne + e] = acc[fb][r];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// plane_corr<K, RX, RY, CONTIG>: y[oy, ox] = sum_{i, j < K} x[oy - ph + i, ox - pw + j] * w[i, j] for
// one plane (x zero outside h x wd; ph, pw may be negative, which bprop uses for a crop).
// Blocks of 32 x 4 threads; a thread owns RY consecutive rows and RX columns: consecutive
// (CONTIG, Iandola et al.: a register window of RX+K-1 inputs per row) or 32 apart (coalesced
// loads and stores). It streams the RY+K-1 input rows it needs once, through the read-only path,
// and keeps the K*K filter in registers. Blocks wholly inside the image skip the bounds checks.
// ---------------------------------------------------------------------------------------------
template <bool CHECK>
__device__ __forceinline__ float load_pixel(const float* __restrict__ x, int iy, int ix, int h, int wd)
{
    if (CHECK && !((unsigned)iy < (unsigned)h && (unsigned)ix < (unsigned)wd)) return 0.f;
    return __ldg(x + (long long)iy * wd + ix);
}

template <int K, int RX, int RY, bool CONTIG, bool CHECK>
__device__ __forceinline__ void plane_body(const float* __restrict__ x, const float (&wr)[K * K],
                                           float* __restrict__ y, int h, int wd, int ph, int pw,
                                           int oh, int ow, int oy0, int ox0)
{
    constexpr int STEP = CONTIG ? 1 : 32;  // distance between a thread's output columns
    float acc[RY][RX] = {};
#pragma unroll
    for (int r = 0; r < RY + K - 1; ++r) {
        const int iy = oy0 - ph + r;
        if (CONTIG) {
            float v[RX + K - 1];
#pragma unroll
            for (int c = 0; c < RX + K - 1; ++c) v[c] = load_pixel<CHECK>(x, iy, ox0 - pw + c, h, wd);
#pragma unroll
            for (int ry = 0; ry < RY; ++ry) {
                const int i = r - ry;
                if (i >= 0 && i < K) {
#pragma unroll
                    for (int rx = 0; rx < RX; ++rx)
#pragma unroll
                        for (int j = 0; j < K; ++j) acc[ry][rx] = fmaf(wr[i * K + j], v[rx + j], acc[ry][rx]);
                }
            }
        } else {
#pragma unroll
            for (int rx = 0; rx < RX; ++rx) {
#pragma unroll
                for (int j = 0; j < K; ++j) {
                    const float v = load_pixel<CHECK>(x, iy, ox0 + rx * STEP - pw + j, h, wd);
#pragma unroll
                    for (int ry = 0; ry < RY; ++ry) {
                        const int i = r - ry;
                        if (i >= 0 && i < K) acc[ry][rx] = fmaf(wr[i * K + j], v, acc[ry][rx]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int ry = 0; ry < RY; ++ry) {
#pragma unroll
        for (int rx = 0; rx < RX; ++rx) {
            const int oy = oy0 + ry, ox = ox0 + rx * STEP;
            if (!CHECK || (oy < oh && ox < ow)) y[(long long)oy * ow + ox] = acc[ry][rx];
        }
    }
}

template <int K, int RX, int RY, bool CONTIG>
__global__ void __launch_bounds__(128)
plane_corr(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
           int h, int wd, int ph, int pw, int oh, int ow)
{
    float wr[K * K];
#pragma unroll
    for (int t = 0; t < K * K; ++t) wr[t] = __ldg(w + t);
    const int by0 = blockIdx.y * 4 * RY, bx0 = blockIdx.x * 32 * RX;
    const int oy0 = by0 + threadIdx.y * RY;
    const int ox0 = CONTIG ? bx0 + threadIdx.x * RX : bx0 + threadIdx.x;
    const bool interior = by0 + 4 * RY <= oh && bx0 + 32 * RX <= ow && by0 - ph >= 0 && bx0 - pw >= 0
                          && by0 + 4 * RY + K - 2 - ph < h && bx0 + 32 * RX + K - 2 - pw < wd;
    if (interior)
        plane_body<K, RX, RY, CONTIG, false>(x, wr, y, h, wd, ph, pw, oh, ow, oy0, ox0);
    else
        plane_body<K, RX, RY, CONTIG, true>(x, wr, y, h, wd, ph, pw, oh, ow, oy0, ox0);
}

// ---------------------------------------------------------------------------------------------
// Every configuration backends/direct.py can pick (CONFIGS there; a CPU test keeps the two lists
// equal). Compiled only for nvcc -cubin checks; at run time CuPy instantiates by name expression.
// ---------------------------------------------------------------------------------------------
#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS
#define FPROP_TILE(FB, P, TS, FG)                                                                  \
    template __global__ void fprop_tile<FB, P, TS, FG>(const float* __restrict__,               \
        const float* __restrict__, float* __restrict__, DIRECT_CONV_PARAMS, int, int, int, int);
#define BPROP_TILE(FB, P, TQ)                                                                      \
    template __global__ void bprop_tile<FB, P, TQ>(const float* __restrict__,                   \
        const float* __restrict__, float* __restrict__, DIRECT_CONV_PARAMS, int, int, int, int,  \
        int, int, int, int, int, int);
#define BPROP_REG(FB, PY, PX, MT)                                                                  \
    template __global__ void bprop_reg<FB, PY, PX, MT>(const float* __restrict__,               \
        const float* __restrict__, float* __restrict__, DIRECT_CONV_PARAMS, int, int, int, int,  \
        int, int, int);
#define ACCGRAD_TILE(FB, R, TE, FG)                                                                \
    template __global__ void accgrad_tile<FB, R, TE, FG>(const float* __restrict__,             \
        const float* __restrict__, float* __restrict__, DIRECT_CONV_PARAMS, int, int, int, int, int);
#define PLANE_CORR(K, RX, RY, CONTIG)                                                              \
    template __global__ void plane_corr<K, RX, RY, CONTIG>(const float* __restrict__,          \
        const float* __restrict__, float* __restrict__, int, int, int, int, int, int);
#define PLANE_CORR_ALL_K(RX, RY, CONTIG)                                                           \
    PLANE_CORR(1, RX, RY, CONTIG) PLANE_CORR(2, RX, RY, CONTIG) PLANE_CORR(3, RX, RY, CONTIG)     \
    PLANE_CORR(4, RX, RY, CONTIG) PLANE_CORR(5, RX, RY, CONTIG) PLANE_CORR(6, RX, RY, CONTIG)     \
    PLANE_CORR(7, RX, RY, CONTIG)

// BEGIN CONFIGS (parsed by tests/test_direct.py)
FPROP_TILE(16, 4, 64, 4)
FPROP_TILE(16, 8, 32, 4)
FPROP_TILE(16, 4, 64, 2)
FPROP_TILE(8, 4, 64, 2)
FPROP_TILE(8, 8, 64, 4)
FPROP_TILE(4, 4, 64, 1)
BPROP_TILE(3, 8, 32)
BPROP_TILE(4, 8, 32)
BPROP_TILE(8, 4, 64)
BPROP_TILE(16, 4, 32)
BPROP_TILE(16, 4, 64)
BPROP_REG(3, 16, 1, 3)
BPROP_REG(3, 16, 2, 3)
BPROP_REG(4, 16, 2, 3)
BPROP_REG(4, 8, 2, 3)
BPROP_REG(4, 16, 2, 2)
BPROP_REG(8, 8, 1, 5)
ACCGRAD_TILE(16, 3, 128, 2)
ACCGRAD_TILE(16, 4, 128, 2)
ACCGRAD_TILE(16, 2, 128, 2)
ACCGRAD_TILE(8, 4, 64, 2)
ACCGRAD_TILE(4, 4, 64, 1)
PLANE_CORR_ALL_K(1, 8, false)
PLANE_CORR_ALL_K(2, 8, false)
PLANE_CORR_ALL_K(4, 4, true)
PLANE_CORR_ALL_K(2, 4, false)
// END CONFIGS
#endif
