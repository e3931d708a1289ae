"""What every convolution backend shares: argument checks and output geometry.

Dimension legend used across backends:
  S batch, f input planes, f' output planes, h x w input, kh x kw kernel,
  ph x pw zero padding (each side), sh x sw stride, oh x ow output.
"""
import functools
from collections import namedtuple
from pathlib import Path

import numpy as np

from .device import cupy_or_none, get_array_module, is_cupy
from .utils import is_int, pair

Geometry = namedtuple("Geometry", "S f fo h w kh kw sh sw ph pw oh ow")

PASSES = ("fprop", "bprop", "accgrad")
KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


def geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Check a convolution's shapes and return its Geometry; ValueError names what is wrong.

    Every pass asks (the backends, the autotuner, the layer): valid geometries are remembered,
    so the checks run once per shape (a few microseconds of Python saved per pass). Arguments
    are made plain ints first (TypeError otherwise), so 8.0 or True never share 8's or 1's entry;
    the usual call, tuples of plain ints, goes straight to the cache (about 1 us)."""
    if plain_args(x_shape, w_shape, stride, padding):
        return _geometry_cached(x_shape, w_shape, stride, padding)
    return _geometry_cached(_dims(x_shape, "input shape"), _dims(w_shape, "weight shape"),
                            pair(stride, "stride"), pair(padding, "padding"))


def plain_args(x_shape, w_shape, stride, padding):
    """Whether a convolution's arguments are tuples of plain ints (stride and padding of two), as
    layers pass them: usable as cache keys as given. 8.0, True or a NumPy integer equal 8 or 1
    as keys, so they take the checked path instead; lists are unhashable."""
    return (type(x_shape) is tuple and type(w_shape) is tuple and type(stride) is tuple
            and type(padding) is tuple and len(stride) == len(padding) == 2
            and all(type(v) is int for v in x_shape + w_shape + stride + padding))


def _dims(shape, name):
    """shape as a tuple of Python ints (NumPy integers included); TypeError naming `name` otherwise."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {shape!r}") from None
    if not all(is_int(d) for d in dims):
        raise TypeError(f"{name} must be a sequence of ints, got {shape!r}")
    return tuple(int(d) for d in dims)


@functools.lru_cache(maxsize=4096)
def _geometry_cached(x_shape, w_shape, stride, padding):
    return _geometry(x_shape, w_shape, stride, padding)


def _geometry(x_shape, w_shape, stride, padding):
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if len(x_shape) != 4:
        raise ValueError(f"input must be 4-D (S, f, h, w), got shape {x_shape}")
    if len(w_shape) != 4:
        raise ValueError(f"weight must be 4-D (f', f, kh, kw), got shape {w_shape}")
    (sh, sw), (ph, pw) = pair(stride, "stride"), pair(padding, "padding")
    S, f, h, w = x_shape
    fo, fw, kh, kw = w_shape
    if min(x_shape) < 1:
        raise ValueError(f"input has a zero-size dimension: shape {x_shape}")
    if min(w_shape) < 1:
        raise ValueError(f"weight has a zero-size dimension: shape {w_shape}")
    if f != fw:
        raise ValueError(f"channel mismatch: input has {f} planes, weight expects {fw} "
                         f"(input {x_shape}, weight {w_shape})")
    if sh < 1 or sw < 1:
        raise ValueError(f"stride must be >= 1, got {(sh, sw)}")
    if ph < 0 or pw < 0:
        raise ValueError(f"padding must be >= 0, got {(ph, pw)}")
    if kh > h + 2 * ph or kw > w + 2 * pw:
        raise ValueError(f"kernel {kh}x{kw} is larger than the padded input "
                         f"{h + 2 * ph}x{w + 2 * pw} (input {h}x{w}, padding {(ph, pw)})")
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    return Geometry(S, f, fo, h, w, kh, kw, sh, sw, ph, pw, oh, ow)


def valid_geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """The Geometry, or None where geometry() would refuse it (for the supports() predicates)."""
    try:
        return geometry(x_shape, w_shape, stride, padding)
    except (ValueError, TypeError):
        return None


def check_arrays(**arrays):
    """float32, one array kind (NumPy or CuPy), made contiguous. Returns (xp, arrays...)."""
    cp = cupy_or_none()
    values = tuple(arrays.values())
    if cp is not None and all(type(a) is cp.ndarray and a.dtype == np.float32 and a.flags.c_contiguous
                              for a in values):
        return (cp, *values)  # the common case on the GPU, checked in a few microseconds
    for name, a in arrays.items():
        if not (isinstance(a, np.ndarray) or is_cupy(a)):
            raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(a).__name__}")
    kinds = {name: ("cupy" if is_cupy(a) else "numpy") for name, a in arrays.items()}
    if len(set(kinds.values())) > 1:
        raise TypeError(f"arrays must all be NumPy or all CuPy, got {kinds}")
    for name, a in arrays.items():
        if a.dtype != np.float32:
            raise TypeError(f"{name} must be float32, got {a.dtype} (backends do not cast; "
                            "Tensor() casts for you)")
    xp = get_array_module(*arrays.values())
    return (xp, *[xp.ascontiguousarray(a) for a in arrays.values()])


def check_output_shape(name, arr, g, expected_oh_ow):
    """gradOutput must have the forward output's shape."""
    want = (g.S, g.fo) + expected_oh_ow
    if tuple(arr.shape) != want:
        raise ValueError(f"{name} must have shape {want} for this geometry, got {tuple(arr.shape)}")


@functools.lru_cache(maxsize=None)
def cuda_module(filename, options=("--std=c++17",), name_expressions=None, directory=KERNEL_DIR):
    """Compile <directory>/<filename> once per process through CuPy (NVRTC): the backends'
    kernels (backends/kernels/, the default) and the core's (minitorch_fft/kernels/)."""
    import cupy as cp
    src = (Path(directory) / filename).read_text()
    return cp.RawModule(code=src, options=options, name_expressions=name_expressions)


def launch_1d(kernel, total, args, block=256):
    """Launch a grid-stride kernel over `total` elements; blocks capped at 32 per SM."""
    import cupy as cp
    if total <= 0:
        raise ValueError(f"{kernel.__name__ if hasattr(kernel, '__name__') else 'kernel'}: "
                         f"nothing to launch (total={total})")
    grid = int(min((total + block - 1) // block, _sm_count(cp.cuda.Device().id) * 32))
    kernel((grid,), (block,), args)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id):
    # Device().attributes queries every attribute: asked once per device, not per launch.
    import cupy as cp
    return cp.cuda.Device(device_id).attributes["MultiProcessorCount"]
