"""NCHW <-> NHWC copies of 4-d float32 arrays, for channels-last layers that run NCHW passes (auto's
"nchw" route, auto.nhwc_route, and the PyTorch adapter that takes it).

An array's logical shape is (N, C, H, W) in both layouts; channels-last ("NHWC") is its memory laid
out as (N, H, W, C), the strides a channels-last PyTorch tensor has. On the GPU each copy is one
launch of a tiled batched transpose (kernels/layout.cu; an image of IMAGE_MAX floats or more, past
its 32-bit offsets, CuPy's strided copy), coalesced on both sides: CuPy's
ascontiguousarray of a transposed view is coalesced on one side only, and in session 44 it made
VGG-16 conv1_2's copies (two 822 MB tensors a pass) cost 2.5 ms against the pass's own 3.0. On the CPU,
NumPy's copy.
"""
import numpy as np

from .common import cuda_module
from .device import get_array_module

TILE = 32                # kernels/layout.cu's LAYOUT_TILE: a block moves a TILE x TILE tile
IMAGE_MAX = 2**31        # floats an image, the kernel's 32-bit offsets: a larger image takes CuPy's strided copy
BLOCK = (TILE, 8)        # LAYOUT_TILE x LAYOUT_ROWS threads
MAX_GRID_YZ = 65535      # the grid's y and z limits
_kernels = {}     # device id -> the compiled batched_transpose


def to_nchw(a):
    """A C-contiguous (NCHW) copy of 4-d float32 `a`; `a` itself if it is C-contiguous already."""
    _check(a)
    if a.flags.c_contiguous:
        return a
    xp = get_array_module(a)
    if xp is np or not a.transpose(0, 2, 3, 1).flags.c_contiguous or _large(a):   # the CPU, another layout
        return xp.ascontiguousarray(a)
    n, c, h, w = a.shape
    out = xp.empty(a.shape, dtype=np.float32)
    _transpose(xp, a.transpose(0, 2, 3, 1), out, n, h * w, c)
    return out


def to_nhwc(a):
    """A channels-last copy of 4-d float32 `a` (logical shape kept, NHWC strides); `a` itself if it is
    laid out channels-last already."""
    _check(a)
    if a.transpose(0, 2, 3, 1).flags.c_contiguous:
        return a
    xp = get_array_module(a)
    n, c, h, w = a.shape
    if xp is np or not a.flags.c_contiguous or _large(a):
        return xp.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    out = xp.empty((n, h, w, c), dtype=np.float32)
    _transpose(xp, a, out, n, c, h * w)
    return out.transpose(0, 3, 1, 2)


def _check(a):
    if getattr(a, "ndim", None) != 4 or a.dtype != np.float32:
        raise ValueError(f"layout: takes 4-d float32 arrays, got shape {getattr(a, 'shape', None)}, "
                         f"dtype {getattr(a, 'dtype', None)}")


def _large(a):
    """Whether an image of a has IMAGE_MAX floats or more (past the kernel's offsets)."""
    return a.size // max(a.shape[0], 1) >= IMAGE_MAX


def _transpose(cp, src, dst, images, rows, cols):
    """dst (images, cols, rows) = src (images, rows, cols) transposed, both C-contiguous in memory."""
    if src.size == 0:
        return
    tiles_x, tiles_y = -(-cols // TILE), -(-rows // TILE)
    if tiles_y > MAX_GRID_YZ:   # past the grid's y limit (over 2^21 pixels a plane): CuPy's strided copy
        dst.reshape(images, cols, rows)[...] = src.reshape(images, rows, cols).transpose(0, 2, 1)
        return
    device = cp.cuda.Device().id
    kernel = _kernels.get(device)
    if kernel is None:
        kernel = _kernels[device] = cuda_module("layout.cu").get_function("batched_transpose")
    grid = (tiles_x, tiles_y, min(images, MAX_GRID_YZ))
    kernel(grid, BLOCK, (src, dst, np.int32(images), np.int32(rows), np.int32(cols)))
