// Polyphase rearrangements for backends/polyphase.py: a stride-(sh, sw) convolution becomes
// a stride-1 one on the sh * sw phase images of its zero-padded input.
//
//   gather   y (P, C*sh*sw, A, B)[p, (c, ry, rx), a, b] = xpad[p, c, sh*a + ry, sw*b + rx]
//            (xpad: x (P, C, h, w) at offset (ph, pw) of a zero plane; 0 outside x)
//   scatter  y (P, C, h, w)[p, c, r, q] = x (P, C*sh*sw, A, B)[p, (c, R % sh, Q % sw), R / sh, Q / sw],
//            R = r + ph, Q = q + pw; 0 where (R / sh, Q / sw) falls outside A x B
//
// One output row per (threadIdx.y, block) step, its columns across threadIdx.x: the row's
// coordinates cost one division chain per row, and each element a multiply-add and a compare.
// The first version (elementwise, eight runtime divisions per element) ran at about a third of
// copy bandwidth. This one measured only a little faster: 0.11-0.17 ms per AlexNet conv1 pass
// against 0.14-0.17 (benchmarks/NOTES.md). So division was not the main cost. The suspect is
// the access pattern: the gather's reads, and the scatter's writes, go sw floats apart across a
// warp. Rows are visited in a grid-stride loop with 64-bit row indices.

extern "C" __global__ void polyphase_gather(const float* __restrict__ x, float* __restrict__ y,
                                            int h, int w, int sh, int sw, int ph, int pw,
                                            int A, int B, long long rows)
{
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < rows;
         row += (long long)gridDim.x * blockDim.y) {
        const int a = (int)(row % A);
        const long long t = row / A;
        const int phase = (int)(t % (sh * sw));
        const long long plane = t / (sh * sw);
        const int ry = phase / sw, rx = phase % sw;
        const int xr = sh * a + ry - ph;  // input row
        const bool row_ok = xr >= 0 && xr < h;
        const float* in = x + (plane * h + (row_ok ? xr : 0)) * (long long)w;
        float* out = y + row * B;
        for (int b = threadIdx.x; b < B; b += blockDim.x) {
            const int xc = sw * b + rx - pw;  // input column
            out[b] = (row_ok && xc >= 0 && xc < w) ? in[xc] : 0.f;
        }
    }
}

extern "C" __global__ void polyphase_scatter(const float* __restrict__ x, float* __restrict__ y,
                                             int h, int w, int sh, int sw, int ph, int pw,
                                             int A, int B, long long rows)
{
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < rows;
         row += (long long)gridDim.x * blockDim.y) {
        const int r = (int)(row % h);
        const long long plane = row / h;
        const int R = r + ph, a = R / sh, ry = R % sh;
        const bool row_ok = a < A;
        // the phase images of this row: plane's first phase, row a
        const float* in = x + ((plane * sh * sw + (long long)ry * sw) * A + (row_ok ? a : 0)) * (long long)B;
        float* out = y + row * w;
        for (int q = threadIdx.x; q < w; q += blockDim.x) {
            const int Q = q + pw, b = Q / sw, rx = Q % sw;
            out[q] = (row_ok && b < B) ? in[(long long)rx * A * B + b] : 0.f;
        }
    }
}
