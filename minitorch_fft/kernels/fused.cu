// The layers around the convolutions on the GPU (minitorch_fft/fused.py): ReLU, the residual
// add + ReLU, a convolution's bias and its gradient, and batch normalisation. Each is one pass
// over the activations; a per-channel reduction is one pass plus a kernel of one thread per
// channel that combines the blocks' partial sums (no atomics: the sums are deterministic).
//
// NCHW activations are n * channels planes of hw values each; plane p is channel p % channels.
// The per-channel element-wise kernels give each block `span` values of one plane (grid: planes
// * chunks blocks), so the channel costs one division per block, not one per value.
//
// ReLU keeps its mask as 1 bit per value (a warp's 32 decisions in one word, from a ballot):
// 1/32 of the activation. Saving the output instead would keep a whole array alive where a
// max pooling follows (it saves only its argmax).

// -- ReLU ------------------------------------------------------------------------------------
// y = max(v, 0) with v = x (or x + r), NaN propagated as in Torch; bit i of mask is v_i > 0.
// The loop runs while the warp's first value is in range, so all 32 lanes reach the ballot;
// blockDim is a multiple of 32, so a warp's values share one mask word.
template <bool ADD>
__device__ __forceinline__ void relu_pass(const float* __restrict__ x, const float* __restrict__ r,
                                          float* __restrict__ y, unsigned* __restrict__ mask,
                                          long long total)
{
    const int lane = threadIdx.x & 31;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i - lane < total;
         i += (long long)gridDim.x * blockDim.x) {
        const bool in = i < total;
        const float v = in ? (ADD ? x[i] + r[i] : x[i]) : 0.f;
        const bool keep = v > 0.f;
        const unsigned bits = __ballot_sync(0xffffffffu, keep);
        if (in) y[i] = keep || isnan(v) ? v : 0.f;
        if (lane == 0) mask[i >> 5] = bits;
    }
}

extern "C" __global__ void minitorch_relu_fwd(const float* __restrict__ x, float* __restrict__ y,
                                              unsigned* __restrict__ mask, long long total)
{
    relu_pass<false>(x, x, y, mask, total);
}

extern "C" __global__ void minitorch_add_relu_fwd(const float* __restrict__ a, const float* __restrict__ b,
                                                  float* __restrict__ y, unsigned* __restrict__ mask,
                                                  long long total)
{
    relu_pass<true>(a, b, y, mask, total);
}

// gx = g where the mask's bit is set, else 0 (0 also where g is NaN: Torch's threshold_backward).
extern "C" __global__ void minitorch_relu_bwd(const float* __restrict__ g, const unsigned* __restrict__ mask,
                                              float* __restrict__ gx, long long total)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        gx[i] = (mask[i >> 5] >> (i & 31)) & 1u ? g[i] : 0.f;
}

// -- per-channel element-wise passes ---------------------------------------------------------
struct PlaneChunk {
    long long base;   // the plane's first value
    int c;            // its channel
    int begin, end;   // this block's positions in it
};

__device__ __forceinline__ PlaneChunk plane_chunk(int channels, int hw, int chunks, int span)
{
    const long long p = blockIdx.x / chunks;
    PlaneChunk q;
    q.base = p * hw;
    q.c = (int)(p % channels);
    q.begin = (int)(blockIdx.x % chunks) * span;
    q.end = min(hw, q.begin + span);
    return q;
}

// y += bias[c], in place (the convolution's bias).
extern "C" __global__ void minitorch_bias_add(float* __restrict__ y, const float* __restrict__ bias,
                                              int channels, int hw, int chunks, int span)
{
    const PlaneChunk q = plane_chunk(channels, hw, chunks, span);
    const float b = bias[q.c];
    for (int s = q.begin + threadIdx.x; s < q.end; s += blockDim.x)
        y[q.base + s] += b;
}

// Batch norm forward: y = (x - mean[c]) * scale[c] + offset[c] (centred first: no cancellation
// when |mean| >> std).
extern "C" __global__ void minitorch_bn_apply(const float* __restrict__ x, const float* __restrict__ mean,
                                              const float* __restrict__ scale, const float* __restrict__ offset,
                                              float* __restrict__ y, int channels, int hw, int chunks, int span)
{
    const PlaneChunk q = plane_chunk(channels, hw, chunks, span);
    const float m = mean[q.c], a = scale[q.c], b = offset[q.c];
    for (int s = q.begin + threadIdx.x; s < q.end; s += blockDim.x)
        y[q.base + s] = (x[q.base + s] - m) * a + b;
}

// Batch norm backward: gx = a[c] g + b[c] (x - mean[c]) + d[c] (minitorch_bn_backward_coefs).
extern "C" __global__ void minitorch_bn_backward_dx(const float* __restrict__ g, const float* __restrict__ x,
                                                    const float* __restrict__ mean, const float* __restrict__ a,
                                                    const float* __restrict__ b, const float* __restrict__ d,
                                                    float* __restrict__ gx, int channels, int hw, int chunks,
                                                    int span)
{
    const PlaneChunk q = plane_chunk(channels, hw, chunks, span);
    const float m = mean[q.c], ac = a[q.c], bc = b[q.c], dc = d[q.c];
    for (int s = q.begin + threadIdx.x; s < q.end; s += blockDim.x)
        gx[q.base + s] = ac * g[q.base + s] + bc * (x[q.base + s] - m) + dc;
}

// -- per-channel sums: pass 1 of every reduction ---------------------------------------------
// Block k of channel c (blockIdx.x = c * blocks + k) sums a strided share of the channel's
// n * hw values, in double, and writes partial[(c * blocks + k) * 2 + {0, 1}]:
//   KIND 0 (a conv's bias gradient): sum a
//   KIND 1 (batch statistics):       sum (a - k), sum (a - k)^2, with k = a's first value in the
//                                    channel, a shift that keeps the squares from cancelling
//   KIND 2 (batch norm backward):    sum a, sum a (b - center[c])   (a = dy, b = x)
// A thread walks (sample i, position s) by the grid row's stride without dividing; UNROLL loads
// are issued before they are summed, to keep enough reads in flight.
constexpr int UNROLL = 4;

__device__ __forceinline__ void block_sum(double& s1, double& s2)
{
    __shared__ double part[2][32];
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_down_sync(0xffffffffu, s1, o);
        s2 += __shfl_down_sync(0xffffffffu, s2, o);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { part[0][warp] = s1; part[1][warp] = s2; }
    __syncthreads();
    if (warp == 0) {
        const bool have = lane < (int)(blockDim.x >> 5);
        s1 = have ? part[0][lane] : 0.;
        s2 = have ? part[1][lane] : 0.;
        for (int o = 16; o > 0; o >>= 1) {
            s1 += __shfl_down_sync(0xffffffffu, s1, o);
            s2 += __shfl_down_sync(0xffffffffu, s2, o);
        }
    }
}

template <int KIND>
__device__ __forceinline__ void channel_sums(const float* __restrict__ a, const float* __restrict__ b,
                                             const float* __restrict__ center, int n, int channels, int hw,
                                             int blocks, double* __restrict__ partial)
{
    const int c = blockIdx.x / blocks, k = blockIdx.x % blocks;
    const int stride = blocks * blockDim.x;
    const int dn = stride / hw, ds = stride % hw;
    const int t = k * blockDim.x + threadIdx.x;
    int i = t / hw, s = t % hw;
    const float shift = KIND == 1 ? a[(long long)c * hw] : KIND == 2 ? center[c] : 0.f;
    const float pad = KIND == 1 ? shift : 0.f;   // a value that adds nothing
    double s1 = 0., s2 = 0.;
    while (i < n) {
        float va[UNROLL], vb[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long at = ((long long)i * channels + c) * hw + s;
            va[u] = i < n ? a[at] : pad;
            vb[u] = KIND == 2 && i < n ? b[at] : shift;
            s += ds;
            i += dn;
            if (s >= hw) { s -= hw; ++i; }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (KIND == 0) {
                s1 += va[u];
            } else if (KIND == 1) {
                const double d = (double)va[u] - shift;
                s1 += d;
                s2 += d * d;
            } else {
                s1 += va[u];
                s2 += (double)va[u] * ((double)vb[u] - shift);
            }
        }
    }
    block_sum(s1, s2);
    if (threadIdx.x == 0) {
        partial[2 * blockIdx.x] = s1;
        partial[2 * blockIdx.x + 1] = s2;
    }
}

// The unused pointers of a kind (b, center) are passed as a: never read.
extern "C" __global__ void minitorch_channel_sums_bias(const float* __restrict__ a, int n, int channels,
                                                       int hw, int blocks, double* __restrict__ partial)
{
    channel_sums<0>(a, a, a, n, channels, hw, blocks, partial);
}

extern "C" __global__ void minitorch_channel_sums_stats(const float* __restrict__ x, int n, int channels,
                                                        int hw, int blocks, double* __restrict__ partial)
{
    channel_sums<1>(x, x, x, n, channels, hw, blocks, partial);
}

extern "C" __global__ void minitorch_channel_sums_backward(const float* __restrict__ g, const float* __restrict__ x,
                                                           const float* __restrict__ mean, int n, int channels,
                                                           int hw, int blocks, double* __restrict__ partial)
{
    channel_sums<2>(g, x, mean, n, channels, hw, blocks, partial);
}

// -- per-channel finishing kernels (one thread per channel) -----------------------------------
__device__ __forceinline__ void total(const double* __restrict__ partial, int c, int blocks,
                                      double& s1, double& s2)
{
    s1 = s2 = 0.;
    for (int k = 0; k < blocks; ++k) {
        s1 += partial[2 * (c * blocks + k)];
        s2 += partial[2 * (c * blocks + k) + 1];
    }
}

// gb[c] = sum over n, h, w of g (minitorch_channel_sums_bias's partials).
extern "C" __global__ void minitorch_bias_grad(const double* __restrict__ partial, int blocks,
                                               float* __restrict__ gb, int channels)
{
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels; c += gridDim.x * blockDim.x) {
        double s1, s2;
        total(partial, c, blocks, s1, s2);
        gb[c] = (float)s1;
    }
}

// Training: the batch's mean and biased variance (minitorch_channel_sums_stats's partials over
// `count` values per channel), what forward applies (scale = weight / sqrt(var + eps),
// offset = bias) and backward keeps (mean, invstd); the running statistics move in place,
// running = (1 - m) running + m batch with the unbiased variance (PyTorch's rule).
__device__ __forceinline__ void train_coefs(const double* __restrict__ partial, int blocks,
                                            const float* __restrict__ x, int hw, long long count, double m,
                                            float* __restrict__ running_mean, float* __restrict__ running_var,
                                            const float* __restrict__ weight, const float* __restrict__ bias,
                                            float eps, float* __restrict__ mean, float* __restrict__ invstd,
                                            float* __restrict__ scale, float* __restrict__ offset, int c)
{
    double s1, s2;
    total(partial, c, blocks, s1, s2);
    const double d = s1 / count;                   // mean - shift
    const double mu = (double)x[(long long)c * hw] + d;
    const double var = fmax(s2 / count - d * d, 0.);
    const double inv = 1. / sqrt(var + (double)eps);
    mean[c] = (float)mu;
    invstd[c] = (float)inv;
    scale[c] = (float)(weight[c] * inv);
    offset[c] = bias[c];
    running_mean[c] = (float)((1. - m) * running_mean[c] + m * mu);
    running_var[c] = (float)((1. - m) * running_var[c] + m * var * count / (count - 1));
}

#define BN_TRAIN_PARAMS                                                                              \
    const double* __restrict__ partial, int blocks, const float* __restrict__ x, int hw, long long count
#define BN_TRAIN_OUTS                                                                                \
    float* __restrict__ running_mean, float* __restrict__ running_var, const float* __restrict__ weight, \
    const float* __restrict__ bias, float eps, float* __restrict__ mean, float* __restrict__ invstd,     \
    float* __restrict__ scale, float* __restrict__ offset, int channels

// momentum a number (fixed for a module, so a CUDA graph may keep it as an argument) ...
extern "C" __global__ void minitorch_bn_train_coefs(BN_TRAIN_PARAMS, double momentum, BN_TRAIN_OUTS)
{
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels; c += gridDim.x * blockDim.x)
        train_coefs(partial, blocks, x, hw, count, momentum, running_mean, running_var, weight, bias, eps,
                    mean, invstd, scale, offset, c);
}

// ... or read on the device: the cumulative average's 1/n changes at every replay of a graph.
extern "C" __global__ void minitorch_bn_train_coefs_at(BN_TRAIN_PARAMS, const double* __restrict__ momentum,
                                                       BN_TRAIN_OUTS)
{
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels; c += gridDim.x * blockDim.x)
        train_coefs(partial, blocks, x, hw, count, *momentum, running_mean, running_var, weight, bias, eps,
                    mean, invstd, scale, offset, c);
}

// Evaluation: the same coefficients from the running statistics as they are.
extern "C" __global__ void minitorch_bn_eval_coefs(const float* __restrict__ running_mean,
                                                   const float* __restrict__ running_var,
                                                   const float* __restrict__ weight, const float* __restrict__ bias,
                                                   float eps, float* __restrict__ mean, float* __restrict__ invstd,
                                                   float* __restrict__ scale, float* __restrict__ offset, int channels)
{
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels; c += gridDim.x * blockDim.x) {
        const double inv = 1. / sqrt((double)running_var[c] + (double)eps);
        mean[c] = running_mean[c];
        invstd[c] = (float)inv;
        scale[c] = (float)(weight[c] * inv);
        offset[c] = bias[c];
    }
}

// Backward from minitorch_channel_sums_backward's partials (sum dy, sum dy (x - mean)):
//   gbias = sum dy, gweight = invstd sum dy (x - mean) = sum dy xhat;
//   gx = a dy + b (x - mean) + d with a = weight invstd and, in training (the batch's mean and
//   variance depend on x), b = -a invstd gweight / count, d = -a gbias / count; else b = d = 0.
extern "C" __global__ void minitorch_bn_backward_coefs(const double* __restrict__ partial, int blocks,
                                                       long long count, int training,
                                                       const float* __restrict__ invstd,
                                                       const float* __restrict__ weight,
                                                       float* __restrict__ a, float* __restrict__ b,
                                                       float* __restrict__ d, float* __restrict__ gweight,
                                                       float* __restrict__ gbias, int channels)
{
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels; c += gridDim.x * blockDim.x) {
        double sg, sgc;
        total(partial, c, blocks, sg, sgc);
        const double inv = invstd[c], ac = weight[c] * inv, gw = sgc * inv;
        a[c] = (float)ac;
        b[c] = training ? (float)(-ac * inv * gw / count) : 0.f;
        d[c] = training ? (float)(-ac * sg / count) : 0.f;
        gweight[c] = (float)gw;
        gbias[c] = (float)sg;
    }
}
