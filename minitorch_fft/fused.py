"""The layers around the convolutions as fused GPU kernels (kernels/fused.cu): ReLU, the residual
add + ReLU, a convolution's bias and its gradient, and batch normalisation, each one pass over
the activations (a reduction: one pass and one small per-channel kernel). functional.py calls
these on float32 CuPy arrays; its NumPy code is the reference they are tested against.

Nothing here waits for the GPU or copies from the host, so a step using them can be captured as
a CUDA graph (minitorch_fft.graphs).
"""
import functools
from pathlib import Path

import numpy as np

from .backends.common import sm_count, cuda_module, launch_1d
from .backends.device import is_cupy

_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
BLOCK = 256              # threads per block (a multiple of 32: ReLU's mask words, the warp sums)
VALUES_PER_THREAD = 4    # of a per-channel element-wise pass
MAX_GRID = 2**31 - 1


@functools.lru_cache(maxsize=None)
def _kernel(name):
    """kernels/fused.cu's kernel `name`, the module compiled on first use (CuPy)."""
    return cuda_module("fused.cu", directory=_KERNEL_DIR).get_function(name)


def applies(*arrays):
    """Whether the fused kernels take these arrays: float32 CuPy arrays (anything else, NumPy
    included, goes through functional's xp code)."""
    return all(is_cupy(a) and a.dtype == np.float32 for a in arrays)


# -- ReLU ----------------------------------------------------------------------------------------
def _mask_words(size, cp):
    return cp.empty((size + 31) // 32, dtype=np.uint32)    # 1 bit per value


def relu(x):
    """(max(x, 0), mask): one pass; the mask holds bit i = x_i > 0, 32 values per uint32."""
    import cupy as cp
    x = cp.ascontiguousarray(x)
    y, mask = cp.empty_like(x), _mask_words(x.size, cp)
    if x.size:
        launch_1d(_kernel("minitorch_relu_fwd"), x.size, (x, y, mask, np.int64(x.size)), BLOCK)
    return y, mask


def add_relu(a, b):
    """(max(a + b, 0), mask) for arrays of one shape: a residual block's end in one pass."""
    import cupy as cp
    a, b = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
    y, mask = cp.empty_like(a), _mask_words(a.size, cp)
    if a.size:
        launch_1d(_kernel("minitorch_add_relu_fwd"), a.size, (a, b, y, mask, np.int64(a.size)), BLOCK)
    return y, mask


def relu_backward(g, mask):
    """g where relu's (or add_relu's) mask bit is set, else 0: one pass."""
    import cupy as cp
    g = cp.ascontiguousarray(g)
    gx = cp.empty_like(g)
    if g.size:
        launch_1d(_kernel("minitorch_relu_bwd"), g.size, (g, mask, gx, np.int64(g.size)), BLOCK)
    return gx


# -- per-channel passes over NCHW arrays -----------------------------------------------------------
def _plane_launch(name, x, args):
    """Launch a per-channel element-wise kernel over NCHW `x`: args, then (channels, hw, chunks,
    span). A block covers `span` positions of one plane: 32..BLOCK threads, so small planes (7x7)
    do not leave most of a block idle."""
    n, c, h, w = x.shape
    hw = h * w
    if not x.size:
        return
    block = min(BLOCK, -(-hw // 32) * 32)
    span = block * VALUES_PER_THREAD
    chunks = -(-hw // span)
    grid = n * c * chunks
    if grid > MAX_GRID:
        raise ValueError(f"{name}: {n * c} planes of {hw} values need {grid} blocks, more than "
                         f"CUDA's {MAX_GRID}")
    _kernel(name)((grid,), (block,), args + (np.int32(c), np.int32(hw), np.int32(chunks), np.int32(span)))


def bias_add(y, bias):
    """y += bias[c] on NCHW `y` (contiguous), in place, in one pass; returns y."""
    _plane_launch("minitorch_bias_add", y, (y, bias))
    return y


def _channel_sums(kernel, arrays, shape):
    """Pass 1 of a per-channel reduction over NCHW `shape`: (partial sums, (channels, blocks, 2)
    float64, blocks per channel). Enough blocks to fill the GPU (8 per SM in all), each thread
    summing 8 values or more."""
    import cupy as cp
    n, c, h, w = shape
    hw = h * w
    blocks = max(1, min(-(-n * hw // (BLOCK * 8)), -(-sm_count(cp.cuda.Device().id) * 8 // c)))
    if c * blocks > MAX_GRID:
        raise ValueError(f"a per-channel sum over {c} channels needs {c * blocks} blocks, more than "
                         f"CUDA's {MAX_GRID}")
    partial = cp.empty((c, blocks, 2), dtype=np.float64)
    _kernel(kernel)((c * blocks,), (BLOCK,), arrays + (np.int32(n), np.int32(c), np.int32(hw),
                                                      np.int32(blocks), partial))
    return partial, blocks


def _per_channel(name, channels, args):
    """Launch a one-thread-per-channel finishing kernel: args, then channels."""
    launch_1d(_kernel(name), channels, args + (np.int32(channels),), BLOCK)


def bias_grad(g):
    """The conv bias's gradient: sum of NCHW `g` (contiguous) over n, h, w, as a (C,) array."""
    import cupy as cp
    c = g.shape[1]
    gb = cp.empty(c, dtype=np.float32)
    partial, blocks = _channel_sums("minitorch_channel_sums_bias", (g,), g.shape)
    _per_channel("minitorch_bias_grad", c, (partial, np.int32(blocks), gb))
    return gb


# -- batch normalisation ----------------------------------------------------------------------------
def batch_norm_forward(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """BatchNormFn's forward on the GPU: (y, mean, invstd), mean and invstd (C,) float32 for
    backward. weight and bias (C,) arrays or None; momentum a number or a 0-d device array
    (read by the kernel: the cumulative average's 1/n, computed on the device).
    Training: one statistics pass, a per-channel kernel (which also moves the running statistics,
    in place, when they are given) and one normalising pass; evaluation: the last two."""
    import cupy as cp
    n, c = x.shape[:2]
    x = cp.ascontiguousarray(x)
    if weight is None:                      # no affine part: weight 1, bias 0
        weight, bias = cp.ones(c, dtype=np.float32), cp.zeros(c, dtype=np.float32)
    mean, invstd, scale, offset = (cp.empty(c, dtype=np.float32) for _ in range(4))
    if training:
        if running_mean is None:            # batch statistics only: the update goes to scratch
            running_mean, running_var = cp.empty(c, dtype=np.float32), cp.empty(c, dtype=np.float32)
        if isinstance(momentum, cp.ndarray):    # read by the kernel, on the device
            kernel, momentum = "minitorch_bn_train_coefs_at", cp.ascontiguousarray(momentum, dtype=np.float64)
        else:
            kernel, momentum = "minitorch_bn_train_coefs", np.float64(momentum)
        partial, blocks = _channel_sums("minitorch_channel_sums_stats", (x,), x.shape)
        _per_channel(kernel, c, (partial, np.int32(blocks), x, np.int32(x.shape[2] * x.shape[3]),
                                 np.int64(x.size // c), momentum, running_mean, running_var, weight, bias,
                                 np.float32(eps), mean, invstd, scale, offset))
    else:
        _per_channel("minitorch_bn_eval_coefs", c, (running_mean, running_var, weight, bias,
                                                    np.float32(eps), mean, invstd, scale, offset))
    y = cp.empty_like(x)
    _plane_launch("minitorch_bn_apply", x, (x, mean, scale, offset, y))
    return y, mean, invstd


def batch_norm_backward(g, x, mean, invstd, weight, training):
    """(gx, gweight, gbias) from batch_norm_forward's saved input, mean and invstd: one
    reduction pass (sum dy, sum dy (x - mean)), a per-channel kernel and one pass for gx."""
    import cupy as cp
    c = g.shape[1]
    g = cp.ascontiguousarray(g)
    if weight is None:
        weight = cp.ones(c, dtype=np.float32)
    partial, blocks = _channel_sums("minitorch_channel_sums_backward", (g, x, mean), g.shape)
    a, b, d, gweight, gbias = (cp.empty(c, dtype=np.float32) for _ in range(5))
    _per_channel("minitorch_bn_backward_coefs", c, (
        partial, np.int32(blocks), np.int64(g.size // c), np.int32(bool(training)), invstd, weight,
        a, b, d, gweight, gbias))
    gx = cp.empty_like(g)
    _plane_launch("minitorch_bn_backward_dx", g, (g, x, mean, a, b, d, gx))
    return gx, gweight, gbias
