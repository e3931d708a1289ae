// Inverted dropout on the GPU (minitorch_fft/random.py, dropout_mask), Philox4x32-10 counters.
//
// Element i of the n-th mask drawn after manual_seed(seed) keeps x[i] when the top 24 bits of
// word 0 of Philox4x32-10(counter = (i lo, i hi, n lo, n hi), key = (seed lo, seed hi)), as a
// float in [0, 1), are >= p: exactly random.dropout_reference. state = [seed, masks drawn]
// lives on the device, read by the mask kernel and advanced by a one-thread kernel, so a CUDA
// graph that captures both draws a new mask at every replay.

__device__ __forceinline__ unsigned int minitorch_philox_word0(
        unsigned int c0, unsigned int c1, unsigned int c2, unsigned int c3,
        unsigned int k0, unsigned int k1) {
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0; c1 = lo1; c2 = hi0 ^ c3 ^ k1; c3 = lo0;
    }
    return c0;
}

// y = x * m, m = scale where kept and 0 where dropped; x, y, m of `size` elements.
extern "C" __global__ void minitorch_dropout_philox(const float* __restrict__ x,
                                                    const unsigned long long* __restrict__ state,
                                                    float p, float scale, float* __restrict__ y,
                                                    float* __restrict__ m, unsigned long long size)
{
    const unsigned long long seed = state[0], n = state[1];
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < size;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned int bits = minitorch_philox_word0(
            (unsigned int)i, (unsigned int)(i >> 32), (unsigned int)n, (unsigned int)(n >> 32),
            (unsigned int)seed, (unsigned int)(seed >> 32));
        // the top 24 bits times 2^-24: exact, in [0, 1)
        const float mi = (float)(bits >> 8) * 5.9604644775390625e-08f >= p ? scale : 0.f;
        m[i] = mi;
        y[i] = x[i] * mi;
    }
}

// One thread: the next mask draws a new stream.
extern "C" __global__ void minitorch_dropout_advance(unsigned long long* state)
{
    state[1] += 1;
}
