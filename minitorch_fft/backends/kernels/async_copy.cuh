// cp.async helpers shared by direct.cu and im2col.cu (each includes this file; kernel_source inlines it).

// Global -> shared copies through cp.async (sm_80+): the copy needs no register and every copy of
// a fill is in flight at once, so a fill costs about one memory latency, not one per element
// (with one or two blocks per SM nothing else hides it). src_size 0 writes a zero: the padding.
// Every fill ends with async_wait_all() before the __syncthreads() that publishes it.
__device__ __forceinline__ void async_copy4(float* dst, const float* src, bool valid)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 4 : 0));
#else
    *dst = valid ? __ldg(src) : 0.f;
#endif
}

__device__ __forceinline__ void async_wait_all()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Double buffering: close a group of copies; wait for all groups but the newest.
__device__ __forceinline__ void async_commit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void async_wait_but_one()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}
