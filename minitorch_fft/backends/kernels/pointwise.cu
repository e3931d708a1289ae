// Strided 1x1 convolutions without padding as one fused gather + GEMM (backends/gemm.py, the fused
// forms of the 1x1 fprop and bprop):
//
//   fprop  y[n, o, i, j]         = sum_c W[o, c] x[n, c, sh*i, sw*j]
//   bprop  gx[n, c, sh*i, sw*j]  = sum_o W[o, c] gy[n, o, i, j], the rest of gx zero
//
// Both are C (M x Q) = A (M x K) @ B (K x Q), strict fp32 FMAs. A is row-major with K contiguous
// (fprop W (f', f); bprop W^T (f, f'), made contiguous by the caller). The Q = S*oh*ow columns are
// the output pixels of all the images, q = (n*oh + i)*ow + j, so a 7x7 plane fills a tile as well as
// a 56x56 one. Each column has two offsets: in the strided tensor (x, gx: n*f*h*w + sh*i*w + sw*j)
// and in the dense one (y, gy: n*f'*oh*ow + i*ow + j). fprop reads B at the first and writes C at
// the second; bprop the other way round.
//
// A block computes a BM x BN tile of C with BM*BN/64 threads, each 8 x 8 outputs in registers: rows
// row0 + [0, 4) and row0 + 16 + [0, 4), columns col0 + [0, 4) and col0 + 32 + [0, 4), so that every
// shared-memory read is a float4 (a warp holds a 32 x 64 tile, its lanes 4 rows by 8 columns). K goes
// in steps of BK through two shared buffers: the next step's global loads are issued into registers
// before the current step's FMAs and stored to the other buffer after them (one barrier a step).
//
// Loads. B's tile (BK x BN): each thread one column, its own pixel, decomposed once, and BK / (threads
// / BN) of its rows; a warp reads 32 consecutive pixels of one plane, sw floats apart, so the gather
// costs the sectors it touches and nothing more. A's tile (BM x BK; W stays in L2): float4s along K
// from rows of lda floats (K rounded up to BK, zero past K, 16-byte aligned: gemm.py pads A where it
// must), so no bounds checks; stored transposed, its rows padded by 4 floats (no bank conflicts).
// Columns past Q read column 0 and write nothing; rows past M read row M - 1 and write nothing.
// Stores go through shared memory, BM/8 rows at a time (two buffers, one barrier each), so that a
// warp writes 32 consecutive pixels of one plane, each thread the column it loaded. bprop writes the
// pixel's whole stride cell, sh x sw clipped at the plane's edge (cells tile the plane: sh*oh >= h):
// its value at the corner, zeros elsewhere, so gx needs no zeroing first; as float2 where sw == 2 and
// w is even (`pairs`, which gemm.py sets only where gx is 8-byte aligned).
//
// The grid is 1-D, row tiles fastest: blocks that share B's columns run side by side and read x from
// L2 once. Offsets are 32-bit: gemm.py cuts the batch so that x and y (gx and gy) hold fewer than
// 2^31 floats.

#define PW_BK 8

template <int BM, int BN, bool BPROP>
__global__ void __launch_bounds__(BM * BN / 64, 32768 / (BM * BN))
pointwise_gemm(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
               int S, int f, int fo, int h, int w, int sh, int sw, int oh, int ow, int lda, int pairs)
{
    constexpr int BK = PW_BK, THREADS = BM * BN / 64;
    constexpr int A_PER = BM * BK / THREADS;   // consecutive k of one row of A a thread loads
    constexpr int A_TPR = BK / A_PER;          // threads a row of A's tile
    constexpr int B_STEP = THREADS / BN;       // rows of B's tile the block loads at once
    constexpr int B_PER = BK / B_STEP;         // rows of B's tile a thread loads
    constexpr int AP = BM + 4;                 // As's row pitch: padded against bank conflicts
    constexpr int CROWS = BM / 8;              // rows of C a store pass stages
    static_assert(BM % 32 == 0 && BN % 64 == 0 && THREADS % BN == 0 && A_PER % 4 == 0 && A_TPR >= 1,
                  "pointwise_gemm: unsupported tile");
    __shared__ __align__(16) float As[2][BK][AP];
    __shared__ __align__(16) float Bs[2][BK][BN];
    __shared__ __align__(16) float Cs[2][CROWS][BN];
    __shared__ int Cq[3][BN];   // a column's offset in C, its stride cell's rows and columns

    const int M = BPROP ? f : fo, K = BPROP ? fo : f;
    const int P = oh * ow, Q = S * P, hw = h * w;
    const int row_tiles = (M + BM - 1) / BM;
    const int m0 = (int)(blockIdx.x % row_tiles) * BM, q0 = (int)(blockIdx.x / row_tiles) * BN;
    const int tid = threadIdx.x, col = tid % BN;

    // The thread's column q: its pixel's offsets in the strided and the dense tensor, and its stride
    // cell. B's offset is kept; C's and the cell wait in shared memory through the K loop, where
    // registers are short (kept in registers, they made ptxas spill at 128).
    const int q = q0 + col;
    const bool q_ok = q < Q;
    const int n = q / P, p = q - n * P, i = p / ow, j = p - i * ow;
    const int strided = q_ok ? n * f * hw + sh * i * w + sw * j : 0, dense = q_ok ? n * fo * P + p : 0;
    const int b_off = BPROP ? dense : strided;
    if (tid < BN) {
        Cq[0][col] = BPROP ? strided : dense;
        Cq[1][col] = h - sh * i < sh ? h - sh * i : sh;
        Cq[2][col] = w - sw * j < sw ? w - sw * j : sw;
    }
    const int b_k = BPROP ? P : hw;   // B (k, q) at b[b_off + k*b_k]; C (m, q) at c[Cq[0][col] + m*c_m]

    const int a_row = tid / A_TPR, b_row = tid / BN;
    const float* a_at = a + (m0 + a_row < M ? m0 + a_row : M - 1) * lda + (tid % A_TPR) * A_PER;
    const float* b_at = b + b_off + b_row * b_k;
    float a_reg[A_PER], b_reg[B_PER];

    // global -> registers: step k0's tiles (B zero past K); both pointers step on to the next
    auto load = [&](int k0) {
#pragma unroll
        for (int v = 0; v < A_PER / 4; ++v) {
            const float4 t = __ldg(reinterpret_cast<const float4*>(a_at) + v);
            a_reg[4 * v] = t.x; a_reg[4 * v + 1] = t.y; a_reg[4 * v + 2] = t.z; a_reg[4 * v + 3] = t.w;
        }
#pragma unroll
        for (int r = 0; r < B_PER; ++r)
            b_reg[r] = k0 + b_row + r * B_STEP < K ? __ldg(b_at + r * B_STEP * b_k) : 0.f;
        a_at += BK;
        b_at += BK * b_k;
    };
    // registers -> shared buffer `buf` (A transposed: As[k][m])
    auto store = [&](int buf) {
#pragma unroll
        for (int e = 0; e < A_PER; ++e) As[buf][(tid % A_TPR) * A_PER + e][a_row] = a_reg[e];
#pragma unroll
        for (int r = 0; r < B_PER; ++r) Bs[buf][b_row + r * B_STEP][col] = b_reg[r];
    };

    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / (BN / 64), wn = warp % (BN / 64);
    const int row0 = wm * 32 + (lane / 8) * 4, col0 = wn * 64 + (lane % 8) * 4;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    load(0);
    store(0);
    __syncthreads();
    const int steps = (K + BK - 1) / BK;
    for (int s = 0; s < steps; ++s) {
        const int buf = s & 1;
        if (s + 1 < steps) load((s + 1) * BK);
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[buf][k][row0]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[buf][k][row0 + 16]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][k][col0]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][k][col0 + 32]);
            const float ar[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float br[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
        }
        if (s + 1 < steps) store(buf ^ 1);   // the buffer every thread finished reading last step
        __syncthreads();
    }

    // Store passes (g, r): rows wm*32 + g*16 + (lane/8)*4 + r of every warp, staged as Cs row
    // wm*4 + lane/8, then written column by column (the thread's own column `col`). The thread's
    // stage rows are b_row + u*B_STEP, rows m_base + g*16 + r + 4*(u*B_STEP % 4) + 32*(u*B_STEP / 4)
    // of C (B_STEP divides 4): constants but for m_base.
    static_assert(4 % B_STEP == 0, "pointwise_gemm: unsupported tile");
    const int cell_h = Cq[1][col], cell_w = Cq[2][col], c_m = BPROP ? hw : P, m_base = m0 + 4 * b_row;
    float* const c_col = c + Cq[0][col] + (long long)m_base * c_m;   // C (m_base, q); m_base may pass M
    const int crow = wm * 4 + lane / 8;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int pass = g * 4 + r, cb = pass & 1;
            const float* v = acc[pass];
            *reinterpret_cast<float4*>(&Cs[cb][crow][col0]) = make_float4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<float4*>(&Cs[cb][crow][col0 + 32]) = make_float4(v[4], v[5], v[6], v[7]);
            __syncthreads();   // with two buffers, none is needed before the next pass's writes
            if (!q_ok) continue;
            // bprop's cell loops are not unrolled: times 64 passes they multiplied the code tenfold
#pragma unroll (BPROP ? 1 : CROWS / B_STEP)
            for (int u = 0; u < CROWS / B_STEP; ++u) {
                const int dm = g * 16 + r + 4 * (u * B_STEP % 4) + 32 * (u * B_STEP / 4);
                if (m_base + dm >= M) continue;
                const int sr = b_row + u * B_STEP;
                const float value = Cs[cb][sr][col];
                float* out = c_col + dm * c_m;
                if (!BPROP) {
                    *out = value;
                } else if (pairs) {
#pragma unroll 1
                    for (int y = 0; y < cell_h; ++y)
                        *reinterpret_cast<float2*>(out + y * w) = make_float2(y == 0 ? value : 0.f, 0.f);
                } else {
#pragma unroll 1
                    for (int y = 0; y < cell_h; ++y)
#pragma unroll 1
                        for (int x = 0; x < cell_w; ++x) out[y * w + x] = (y == 0 && x == 0) ? value : 0.f;
                }
            }
        }
    }
}

#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS
template __global__ void pointwise_gemm<128, 128, false>(const float*, const float*, float*, int, int, int, int,
                                                         int, int, int, int, int, int, int);
template __global__ void pointwise_gemm<64, 128, false>(const float*, const float*, float*, int, int, int, int,
                                                        int, int, int, int, int, int, int);
template __global__ void pointwise_gemm<128, 128, true>(const float*, const float*, float*, int, int, int, int,
                                                        int, int, int, int, int, int, int);
template __global__ void pointwise_gemm<64, 128, true>(const float*, const float*, float*, int, int, int, int,
                                                       int, int, int, int, int, int, int);
#endif
