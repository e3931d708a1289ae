// NCHW <-> NHWC copies (backends/layout.py): per image, a row-major R x C matrix transposed, R x C
// floats in, C x R out. NHWC -> NCHW is R = h*w pixels by C = channels; NCHW -> NHWC the other way.
//
// A block moves a 32 x 32 tile through shared memory with 32 x 8 threads, each 4 elements: a warp
// reads 32 consecutive floats of one input row and writes 32 consecutive floats of one output row,
// so both sides are coalesced (a plain strided copy is coalesced on one side only). The tile's rows
// are padded by one float, so the column reads of the write phase hit 32 different banks. Edge tiles
// check both bounds. Images go along the grid's z, strided by gridDim.z (the grid's z is at most
// 65535); offsets within an image are 32-bit (layout.py gives an image of 2^31 floats or more, its
// IMAGE_MAX, to CuPy's strided copy instead), the image's base 64-bit.

#define LAYOUT_TILE 32
#define LAYOUT_ROWS 8

extern "C" __global__ void __launch_bounds__(LAYOUT_TILE * LAYOUT_ROWS)
batched_transpose(const float* __restrict__ in, float* __restrict__ out, int images, int R, int C)
{
    __shared__ float tile[LAYOUT_TILE][LAYOUT_TILE + 1];
    const int c0 = blockIdx.x * LAYOUT_TILE, r0 = blockIdx.y * LAYOUT_TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (long long n = blockIdx.z; n < images; n += gridDim.z) {
        const float* src = in + n * (long long)R * C;
        float* dst = out + n * (long long)R * C;
#pragma unroll
        for (int i = ty; i < LAYOUT_TILE; i += LAYOUT_ROWS) {
            const int r = r0 + i, c = c0 + tx;
            if (r < R && c < C)
                tile[i][tx] = src[r * C + c];
        }
        __syncthreads();
#pragma unroll
        for (int i = ty; i < LAYOUT_TILE; i += LAYOUT_ROWS) {
            const int c = c0 + i, r = r0 + tx;
            if (r < R && c < C)
                dst[c * R + r] = tile[tx][i];
        }
        __syncthreads();   // the tile is read before the next image's loads overwrite it
    }
}
