// SGD with momentum and weight decay, one parameter per launch (minitorch_fft/optim.py,
// SGD._fused_step): the update step() does on the CPU, in the same order.
//   d = g + wd p  (g when wd = 0);   v = d on the first step, else momentum v + d;   p -= lr v
// g, p, v of `size` elements; p and v are updated in place.

extern "C" __global__ void minitorch_sgd_momentum(const float* __restrict__ g, float lr, float momentum,
                                                  float wd, int first, float* __restrict__ p,
                                                  float* __restrict__ v, long long size)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < size;
         i += (long long)gridDim.x * blockDim.x) {
        const float pi = p[i];
        const float d = wd != 0.f ? g[i] + wd * pi : g[i];
        const float vi = first ? d : momentum * v[i] + d;
        v[i] = vi;
        p[i] = pi - lr * vi;
    }
}
