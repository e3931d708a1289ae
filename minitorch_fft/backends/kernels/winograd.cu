// Winograd F(M x M, 3 x 3) transforms (backends/winograd.py has the algorithm and the layouts).
//
// One thread per (plane, tile); consecutive threads take consecutive tiles p = (image, i, j), so
// every one of the ALPHA^2 stores of the GEMM-ready layout (ALPHA^2, planes, P) is coalesced
// (accGrad's grouped layout and its row parts: grouped() below).
// Tiles are read with the zero padding implied (a bounds check per element: no padded copy),
// and the output transform writes only the tile elements inside the output (the last tiles
// are clipped). All register arrays are indexed by unrolled constants.
//
// The matrices are those of backends/winograd.py's toom_cook() for the points it names
// (F(2,3): 0, 1, -1, inf; F(4,3): 0, 1, -1, 1/2, -2, inf); tests/test_winograd.py checks the
// literals below against it. Zero entries are skipped at compile time (0 * x is not foldable
// in IEEE arithmetic, so the zero test is written out), ones fold to plain adds.

template <int M> struct F3;

template <> struct F3<2> {
    static constexpr int ALPHA = 4;
    __device__ __forceinline__ static double G(int i, int j) {
        constexpr double g[4][3] = {{-1., 0., 0.}, {1. / 2., 1. / 2., 1. / 2.}, {1. / 2., -1. / 2., 1. / 2.},
                                    {0., 0., 1.}};
        return g[i][j];
    }
    __device__ __forceinline__ static float AT(int i, int j) {
        constexpr float a[2][4] = {{1.f, 1.f, 1.f, 0.f}, {0.f, 1.f, -1.f, 1.f}};
        return a[i][j];
    }
    __device__ __forceinline__ static float BT(int i, int j) {
        constexpr float b[4][4] = {{-1.f, 0.f, 1.f, 0.f}, {0.f, 1.f, 1.f, 0.f}, {0.f, -1.f, 1.f, 0.f},
                                   {0.f, -1.f, 0.f, 1.f}};
        return b[i][j];
    }
};

template <> struct F3<4> {
    static constexpr int ALPHA = 6;
    __device__ __forceinline__ static double G(int i, int j) {
        constexpr double g[6][3] = {{1., 0., 0.}, {1. / 3., 1. / 3., 1. / 3.}, {-1. / 3., 1. / 3., -1. / 3.},
                                    {-16. / 15., -8. / 15., -4. / 15.}, {1. / 15., -2. / 15., 4. / 15.},
                                    {0., 0., 1.}};
        return g[i][j];
    }
    __device__ __forceinline__ static float AT(int i, int j) {
        constexpr float a[4][6] = {{1.f, 1.f, 1.f, 1.f, 1.f, 0.f},
                                   {0.f, 1.f, -1.f, 1.f / 2.f, -2.f, 0.f},
                                   {0.f, 1.f, 1.f, 1.f / 4.f, 4.f, 0.f},
                                   {0.f, 1.f, -1.f, 1.f / 8.f, -8.f, 1.f}};
        return a[i][j];
    }
    __device__ __forceinline__ static float BT(int i, int j) {
        constexpr float b[6][6] = {{1.f, -3.f / 2.f, -2.f, 3.f / 2.f, 1.f, 0.f},
                                   {0.f, -1.f, 1.f / 2.f, 5.f / 2.f, 1.f, 0.f},
                                   {0.f, 1.f, -5.f / 2.f, 1.f / 2.f, 1.f, 0.f},
                                   {0.f, -2.f, -1.f, 2.f, 1.f, 0.f},
                                   {0.f, 1.f / 2.f, -1.f, -1.f / 2.f, 1.f, 0.f},
                                   {0.f, 1.f, -3.f / 2.f, -2.f, 3.f / 2.f, 1.f}};
        return b[i][j];
    }
};

// acc + c * v, with c a compile-time constant: nothing for 0, no multiply for +-1
template <class T>
__device__ __forceinline__ T madd(T acc, T c, T v) {
    if (c == T(0)) return acc;
    if (c == T(1)) return acc + v;
    if (c == T(-1)) return acc - v;
    return c * v + acc;   // contracted to one FMA
}

// The thread's tile: k = plane * P + p, p = (image * th + i) * tw + j; false past the last one.
// 32-bit index arithmetic: backends/winograd.py launches fewer than 2^31 threads (planes * P).
struct Tile {
    int plane, p, image, i, j;
};

__device__ __forceinline__ bool which_tile(int planes, int P, int th, int tw, Tile& t) {
    const long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)planes * P) return false;
    t.plane = (int)k / P;
    t.p = (int)k - t.plane * P;
    t.j = t.p % tw;
    const int q = t.p / tw;
    t.i = q % th;
    t.image = q / th;
    return true;
}

// Where transformed element e of tile p of a plane goes in the grouped layout
// (groups, E, planes, Pg): tiles are cut into groups of Pg (whole images), each group a block of
// E GEMM operands, the ALPHA^2 elements of the tile or a range of whole rows of them (E = rows *
// ALPHA). fprop and bprop use one group (Pg = P) and every row; accGrad several groups, so that
// one strided-batched GEMM sums each group apart, and the rows in parts where its tiles would
// hold more memory than its operands (backends/winograd.py says why).
__device__ __forceinline__ float* grouped(float* base, const Tile& t, int planes, int Pg, int E) {
    const int g = t.p / Pg;
    return base + ((long long)g * E * planes + t.plane) * Pg + (t.p - g * Pg);
}

// V = B^T d B for every ALPHA x ALPHA tile d of x (n, f, h, w), in the grouped layout with
// groups * Pg tiles (images past n are zeros) and the rows a0 .. a0 + rows - 1 of each tile's
// ALPHA x ALPHA elements; tile (i, j) starts at row i*M - ph, column j*M - pw (ph, pw may be
// negative: bprop's cropping).
template <int M>
__global__ void winograd_input(const float* __restrict__ x, float* __restrict__ v, int n, int f, int h, int w,
                               int th, int tw, int ph, int pw, int groups, int Pg, int a0, int rows) {
    constexpr int A = F3<M>::ALPHA;
    Tile t;
    if (!which_tile(f, groups * Pg, th, tw, t)) return;
    if (t.image >= n) h = w = 0;                  // the last group's missing images: all zeros
    const float* plane = x + ((long long)t.image * f + t.plane) * h * w;
    const int r0 = t.i * M - ph, c0 = t.j * M - pw;
    float d[A][A];
#pragma unroll
    for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int b = 0; b < A; ++b) {
            const int r = r0 + a, c = c0 + b;
            d[a][b] = (r >= 0 && r < h && c >= 0 && c < w) ? __ldg(plane + (long long)r * w + c) : 0.f;
        }
    }
    float t_rows[A][A];   // B^T d
#pragma unroll
    for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int b = 0; b < A; ++b) {
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < A; ++k) s = madd(s, F3<M>::BT(a, k), d[k][b]);
            t_rows[a][b] = s;
        }
    }
    const long long stride = (long long)f * Pg;   // between transformed elements
    float* out = grouped(v, t, f, Pg, rows * A);
#pragma unroll
    for (int a = 0; a < A; ++a) {
        if (a < a0 || a >= a0 + rows) continue;
#pragma unroll
        for (int b = 0; b < A; ++b) {
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < A; ++k) s = madd(s, F3<M>::BT(b, k), t_rows[a][k]);
            out[((a - a0) * A + b) * stride] = s;
        }
    }
}

// Z = A g A^T for every M x M tile g of gy (n, fo, oh, ow) at (i*M, j*M), in the grouped layout
// as winograd_input (its rows a0 .. a0 + rows - 1); zeros past the last row and column (fprop's
// clipped tiles) and image.
template <int M>
__global__ void winograd_gradient(const float* __restrict__ gy, float* __restrict__ z, int n, int fo, int oh,
                                  int ow, int th, int tw, int groups, int Pg, int a0, int rows) {
    constexpr int A = F3<M>::ALPHA;
    Tile t;
    if (!which_tile(fo, groups * Pg, th, tw, t)) return;
    if (t.image >= n) oh = ow = 0;
    const float* plane = gy + ((long long)t.image * fo + t.plane) * oh * ow;
    const int r0 = t.i * M, c0 = t.j * M;
    float g[M][M];
#pragma unroll
    for (int a = 0; a < M; ++a) {
#pragma unroll
        for (int b = 0; b < M; ++b) {
            const int r = r0 + a, c = c0 + b;
            g[a][b] = (r < oh && c < ow) ? __ldg(plane + (long long)r * ow + c) : 0.f;
        }
    }
    float t_rows[A][M];   // A g
#pragma unroll
    for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int b = 0; b < M; ++b) {
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < M; ++k) s = madd(s, F3<M>::AT(k, a), g[k][b]);
            t_rows[a][b] = s;
        }
    }
    const long long stride = (long long)fo * Pg;
    float* out = grouped(z, t, fo, Pg, rows * A);
#pragma unroll
    for (int a = 0; a < A; ++a) {
        if (a < a0 || a >= a0 + rows) continue;
#pragma unroll
        for (int b = 0; b < A; ++b) {
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < M; ++k) s = madd(s, F3<M>::AT(k, b), t_rows[a][k]);
            out[((a - a0) * A + b) * stride] = s;
        }
    }
}

// y (n, fo, oh, ow) from the GEMM's prod (ALPHA^2, fo, P): A^T m A of every tile, clipped.
template <int M>
__global__ void winograd_output(const float* __restrict__ prod, float* __restrict__ y, int n, int fo, int oh,
                                int ow, int th, int tw) {
    constexpr int A = F3<M>::ALPHA;
    const int P = n * th * tw;
    Tile t;
    if (!which_tile(fo, P, th, tw, t)) return;
    const long long stride = (long long)fo * P;
    const float* in = prod + (long long)t.plane * P + t.p;
    float m[A][A];
#pragma unroll
    for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int b = 0; b < A; ++b) m[a][b] = __ldg(in + (a * A + b) * stride);
    }
    float rows[M][A];   // A^T m
#pragma unroll
    for (int a = 0; a < M; ++a) {
#pragma unroll
        for (int b = 0; b < A; ++b) {
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < A; ++k) s = madd(s, F3<M>::AT(a, k), m[k][b]);
            rows[a][b] = s;
        }
    }
    float* plane = y + ((long long)t.image * fo + t.plane) * oh * ow;
    const int r0 = t.i * M, c0 = t.j * M;
#pragma unroll
    for (int a = 0; a < M; ++a) {
#pragma unroll
        for (int b = 0; b < M; ++b) {
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < A; ++k) s = madd(s, F3<M>::AT(b, k), rows[a][k]);
            const int r = r0 + a, c = c0 + b;
            if (r < oh && c < ow) plane[(long long)r * ow + c] = s;
        }
    }
}

// U (ALPHA^2, fo, f) = G w G^T of w (fo, f, 3, 3), in double, rounded once. ROTATE (bprop): U
// (ALPHA^2, f, fo) of the filters rotated by 180 degrees with in/out planes swapped. One thread
// per filter, consecutive threads on consecutive filters of U (coalesced stores).
template <int M, bool ROTATE>
__global__ void winograd_weight(const float* __restrict__ w, float* __restrict__ u, int fo, int f) {
    constexpr int A = F3<M>::ALPHA;
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= fo * f) return;
    const int o = ROTATE ? k % fo : k / f, i = ROTATE ? k / fo : k % f;
    const float* g = w + ((long long)o * f + i) * 9;
    double gg[3][3];
#pragma unroll
    for (int a = 0; a < 3; ++a) {
#pragma unroll
        for (int b = 0; b < 3; ++b) gg[a][b] = ROTATE ? g[(2 - a) * 3 + 2 - b] : g[a * 3 + b];
    }
    double rows[A][3];   // G g
#pragma unroll
    for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int b = 0; b < 3; ++b) {
            double s = 0.;
#pragma unroll
            for (int c = 0; c < 3; ++c) s = madd(s, F3<M>::G(a, c), gg[c][b]);
            rows[a][b] = s;
        }
    }
#pragma unroll
    for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int b = 0; b < A; ++b) {
            double s = 0.;
#pragma unroll
            for (int c = 0; c < 3; ++c) s = madd(s, F3<M>::G(b, c), rows[a][c]);
            u[(long long)(a * A + b) * fo * f + k] = (float)s;
        }
    }
}

// gw (fo, f, 3, 3) = G^T [sum over groups of part] G, in double, rounded once: part (parts,
// groups, E, fo, f) holds accGrad's GEMM, one sum per group of tiles, its ALPHA^2 elements in
// `parts` ranges of whole rows, E = ALPHA^2 / parts each. One thread per filter.
template <int M>
__global__ void winograd_weight_grad(const float* __restrict__ part, float* __restrict__ gw, int groups, int fo,
                                     int f, int parts) {
    constexpr int A = F3<M>::ALPHA;
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= fo * f) return;
    const long long plane = (long long)fo * f;
    const int rows_a_part = A / parts, E = rows_a_part * A;
    double m[A][A];
#pragma unroll
    for (int e = 0; e < A * A; ++e) m[e / A][e % A] = 0.;
    for (int g = 0; g < groups; ++g) {
#pragma unroll
        for (int a = 0; a < A; ++a) {
            const int q = a / rows_a_part;   // the part row a is in
            const float* row = part + (((long long)q * groups + g) * E + (a - q * rows_a_part) * A) * plane + k;
#pragma unroll
            for (int b = 0; b < A; ++b) m[a][b] += __ldg(row + b * plane);
        }
    }
    double rows[3][A];   // G^T m
#pragma unroll
    for (int a = 0; a < 3; ++a) {
#pragma unroll
        for (int b = 0; b < A; ++b) {
            double s = 0.;
#pragma unroll
            for (int c = 0; c < A; ++c) s = madd(s, F3<M>::G(c, a), m[c][b]);
            rows[a][b] = s;
        }
    }
#pragma unroll
    for (int a = 0; a < 3; ++a) {
#pragma unroll
        for (int b = 0; b < 3; ++b) {
            double s = 0.;
#pragma unroll
            for (int c = 0; c < A; ++c) s = madd(s, F3<M>::G(c, b), rows[a][c]);
            gw[(long long)k * 9 + a * 3 + b] = (float)s;
        }
    }
}

#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS
template __global__ void winograd_input<2>(const float*, float*, int, int, int, int, int, int, int, int, int, int, int,
                                           int);
template __global__ void winograd_input<4>(const float*, float*, int, int, int, int, int, int, int, int, int, int, int,
                                           int);
template __global__ void winograd_gradient<2>(const float*, float*, int, int, int, int, int, int, int, int, int, int);
template __global__ void winograd_gradient<4>(const float*, float*, int, int, int, int, int, int, int, int, int, int);
template __global__ void winograd_weight<2, false>(const float*, float*, int, int);
template __global__ void winograd_weight<2, true>(const float*, float*, int, int);
template __global__ void winograd_weight<4, false>(const float*, float*, int, int);
template __global__ void winograd_weight<4, true>(const float*, float*, int, int);
template __global__ void winograd_weight_grad<2>(const float*, float*, int, int, int, int);
template __global__ void winograd_weight_grad<4>(const float*, float*, int, int, int, int);
template __global__ void winograd_output<2>(const float*, float*, int, int, int, int, int, int);
template __global__ void winograd_output<4>(const float*, float*, int, int, int, int, int, int);
#endif
