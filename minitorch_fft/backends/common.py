"""What every convolution backend shares: argument checks and output geometry.

Dimension legend used across backends:
  S batch, f input planes, f' output planes, h x w input, kh x kw kernel,
  ph x pw zero padding (each side), sh x sw stride, oh x ow output.
"""
import functools
import math
import os
import re
from collections import namedtuple
from pathlib import Path

import numpy as np

from .device import cupy_or_none, get_array_module, is_cupy
from .utils import is_int, pair

Geometry = namedtuple("Geometry", "S f fo h w kh kw sh sw ph pw oh ow")


class GeometryError(ValueError, RuntimeError):
    """Shapes, stride or padding that no convolution can take. A ValueError, and a RuntimeError as
    PyTorch's conv2d raises for the same shapes, so code written around nn.Conv2d catches it where
    the PyTorch adapter's Conv2d stands in for one."""

PASSES = ("fprop", "bprop", "accgrad")
KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


def geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Check a convolution's shapes and return its Geometry; GeometryError (a ValueError) names what
    is wrong.

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
        raise GeometryError(f"conv2d: input must be 4-D (batch, planes, height, width), got shape {x_shape}")
    if len(w_shape) != 4:
        raise GeometryError(f"conv2d: weight must be 4-D (out planes, in planes, kh, kw), got shape {w_shape}")
    (sh, sw), (ph, pw) = pair(stride, "stride"), pair(padding, "padding")
    S, f, h, w = x_shape
    fo, fw, kh, kw = w_shape
    if min(x_shape) < 1:
        raise GeometryError(f"conv2d: input has a zero-size dimension: shape {x_shape}")
    if min(w_shape) < 1:
        raise GeometryError(f"conv2d: weight has a zero-size dimension: shape {w_shape}")
    if f != fw:
        raise GeometryError(f"conv2d: channel mismatch: input has {f} planes, weight expects {fw} "
                            f"(input {x_shape}, weight {w_shape})")
    if sh < 1 or sw < 1:
        raise GeometryError(f"conv2d: stride must be >= 1, got {(sh, sw)}")
    if ph < 0 or pw < 0:
        raise GeometryError(f"conv2d: padding must be >= 0, got {(ph, pw)}")
    if kh > h + 2 * ph or kw > w + 2 * pw:
        raise GeometryError(f"conv2d: kernel {kh}x{kw} is larger than the padded input "
                            f"{h + 2 * ph}x{w + 2 * pw} (input {h}x{w}, padding {(ph, pw)})")
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    g = Geometry(S, f, fo, h, w, kh, kw, sh, sw, ph, pw, oh, ow)
    # Each pass's output is one of these three and the other two exist already: one larger than all
    # of the machine's memory can never be made (padding 60000 on a 1x1 input asked for 53.6 GiB).
    for pass_name in PASSES:
        shape = pass_output_shape(g, pass_name)
        nbytes = math.prod(shape) * 4
        if nbytes > machine_bytes(nbytes):
            raise GeometryError(f"conv2d: {pass_name}'s output {shape} (input {x_shape}, weight {w_shape}, "
                                f"stride {(sh, sw)}, padding {(ph, pw)}) would take {format_bytes(nbytes)}, more "
                                f"than this machine's {format_bytes(machine_bytes(nbytes))} of memory")
    return g


def pass_output_shape(g, pass_name):
    """The array a pass returns: y for fprop, gx for bprop, gw for accGrad."""
    return {"fprop": (g.S, g.fo, g.oh, g.ow), "bprop": (g.S, g.f, g.h, g.w),
            "accgrad": (g.fo, g.f, g.kh, g.kw)}[pass_name]


# Memory checked before it is asked for. Sizes up to CHECK_ABOVE_BYTES are not checked: a shortfall
# there is an ordinary out-of-memory error (which backends.run_pass handles), and the check costs a
# driver call or a read of /proc/meminfo, too much for every small pass.
CHECK_ABOVE_BYTES = 64 * 2**20


def batch_slices(S, most):
    """Slices of a batch of S images, each of at most `most` images (one at least): as few as
    that allows, of sizes that differ by one at most (128 images at most 103 a slice: 64 + 64,
    not 103 + 25; as many pieces, the same work, the smaller workspace). Every backend that
    bounds its workspace cuts its batch so."""
    most = max(1, int(most))
    n = -(-S // most)
    size, extra = divmod(S, n)                   # the first `extra` slices take one image more
    starts = [i * size + min(i, extra) for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def check_fits(nbytes, xp, what):
    """Raise ValueError naming `what` (a string, or a function that returns it: formatted only
    for a size that is checked), its size and the limit where `nbytes` more cannot be allocated
    now on xp's device (numpy: the host's available memory; cupy: the GPU's free memory with what
    the current memory pool holds unused, within the pool's limit if it has one)."""
    if nbytes <= CHECK_ABOVE_BYTES or _pool_holds(xp, nbytes):
        return
    limit, source = available_bytes(xp)
    if limit is not None and nbytes > limit:
        what = what() if callable(what) else what
        raise ValueError(f"{what} needs {format_bytes(nbytes)}, more than the {format_bytes(limit)} {source}")


def _pool_holds(xp, nbytes):
    """Whether CuPy's current memory pool already holds `nbytes` unused, and may (no limit set):
    then the check passes without asking the driver, as available_bytes would (it adds the same
    unused bytes to the driver's free figure; like it, this counts fragments and blocks kept for
    other streams, so CuPy may still have to cudaMalloc). That is the usual case from a training
    step's second iteration on (the last step's buffers went back to the pool), and it spares a
    large pass a memGetInfo (5 us of the 40 that auto's 1x1 fprop cost the host on an H100,
    benchmarks/experiments/exp_host_pieces.py)."""
    if xp is np:
        return False
    pool = _current_pool(xp)
    return pool is not None and not pool.get_limit() and pool.free_bytes() >= nbytes


def available_bytes(xp):
    """(bytes that can be allocated now on xp's device, where that figure comes from), or
    (None, reason) where it cannot be known (no /proc/meminfo; a CUDA-graph capture under way, in
    which the warm-up step's eager run has checked the same sizes)."""
    if xp is np:
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
            return kib * 1024, "of memory available on the host (MemAvailable)"
        except (OSError, StopIteration, ValueError, IndexError):
            pages = _sysconf("SC_AVPHYS_PAGES")
            return (None, "unknown") if pages is None else (pages * _sysconf("SC_PAGE_SIZE"),
                                                            "of free physical memory on the host")
    cp = xp
    if cp.cuda.get_current_stream().is_capturing():
        return None, "unknown while a CUDA graph is captured"
    free = _gpu_free_bytes(cp)
    pool = _current_pool(cp)
    if pool is None:
        cached = _FOREIGN_POOLS.get(cp.cuda.get_allocator())
        if cached is not None:
            return free + cached[0](), f"free on the GPU (with {cached[1]})"
        return free, "free on the GPU"
    available = free + pool.free_bytes()          # blocks the pool holds unused are reused first
    if pool.get_limit():
        capped = max(0, pool.get_limit() - pool.total_bytes())
        if capped + pool.free_bytes() < available:
            return capped + pool.free_bytes(), (f"the GPU's memory pool may still take (its limit is "
                                                f"{format_bytes(pool.get_limit())})")
    return available, "free on the GPU (with CuPy's pool's unused blocks)"


def _gpu_free_bytes(cp):
    """The current GPU's free memory as the driver reports it (cudaMemGetInfo)."""
    return cp.cuda.runtime.memGetInfo()[0]


# Allocators of another library's memory pool, which keeps freed memory reserved (the PyTorch
# adapter's, on PyTorch's caching allocator): allocator -> (function giving the bytes that pool holds
# unused, their name in messages). register_pool() adds one.
_FOREIGN_POOLS = {}


def register_pool(allocator, unused_bytes, what):
    """While `allocator` (a function given to cupy.cuda.using_allocator) is CuPy's current one, the
    memory checks count `unused_bytes()` as available beside the GPU's free memory, and name them
    `what`: bytes its pool holds unused, which it hands out again, or gives back to the driver
    before it fails. Without them, the GPU's free memory alone would refuse a pass that the pool
    can serve (PyTorch keeps what a step freed reserved: the GPU may show a few MiB free). The
    figure can be too high (PyTorch's: free blocks in a live CUDA graph's private pool, fragments
    of split segments); a pass it lets through then fails to allocate, with the pool's own
    out-of-memory error, which backends.run_pass answers with its gemm fallback."""
    _FOREIGN_POOLS[allocator] = (unused_bytes, what)


def _current_pool(cp):
    """CuPy's current MemoryPool (a graph's capture has its own), or None where the allocator is
    not a MemoryPool's."""
    allocator = cp.cuda.get_allocator()
    pool = getattr(allocator, "__self__", None)
    if not isinstance(pool, cp.cuda.MemoryPool) and allocator == cp.get_default_memory_pool().malloc:
        pool = cp.get_default_memory_pool()
    return pool if isinstance(pool, cp.cuda.MemoryPool) else None


def machine_bytes(nbytes=0):
    """All the memory of this machine a tensor could live in: the host's physical memory, or the
    GPU's where larger (asked only when `nbytes` exceeds the host's, so a CPU run never starts CUDA)."""
    host = (_sysconf("SC_PHYS_PAGES") or 0) * (_sysconf("SC_PAGE_SIZE") or 0) or math.inf
    if nbytes <= host:
        return host
    cp = cupy_or_none()
    try:
        return max(host, cp.cuda.runtime.memGetInfo()[1]) if cp is not None else host
    except Exception:  # noqa: BLE001 - no driver or no device: the host's figure stands
        return host


def _sysconf(name):
    try:
        return os.sysconf(name)
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n):
    """1.5 GiB, 72.8 TiB: sizes in messages."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


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
    xp = check_kinds(**arrays)
    return (xp, *[xp.ascontiguousarray(a) for a in arrays.values()])


def check_kinds(**arrays):
    """check_arrays's checks without its copies (the arrays' layouts are the caller's): float32 NumPy
    or CuPy arrays, all of one kind. Returns NumPy or CuPy."""
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
    return get_array_module(*arrays.values())


def check_output_shape(name, arr, g, expected_oh_ow):
    """gradOutput must have the forward output's shape."""
    want = (g.S, g.fo) + expected_oh_ow
    if tuple(arr.shape) != want:
        raise ValueError(f"{name} must have shape {want} for this geometry, got {tuple(arr.shape)}")


@functools.lru_cache(maxsize=None)
def cuda_module(filename, options=("--std=c++17",), name_expressions=None, directory=KERNEL_DIR):
    """Compile <directory>/<filename> once per process through CuPy (NVRTC): the backends'
    kernels (minitorch_fft/backends/kernels/, the default) and the core's (minitorch_fft/kernels/)."""
    import cupy as cp
    src = kernel_source(Path(directory) / filename)
    return cp.RawModule(code=src, options=options, name_expressions=name_expressions)


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


def kernel_source(path):
    """The text of a CUDA source with its `#include "file"` of sibling sources inlined (tiledfft.cu
    includes fbfft.cu). Inlined, not found through -I: CuPy's kernel cache keys on the source text
    alone, so an edit to an included file must change the text that is compiled."""
    path = Path(path)
    return _LOCAL_INCLUDE.sub(lambda m: kernel_source(path.parent / m.group(1)), path.read_text())


def launch_1d(kernel, total, args, block=256):
    """Launch a grid-stride kernel over `total` elements; blocks capped at 32 per SM."""
    import cupy as cp
    if total <= 0:
        raise ValueError(f"{kernel.__name__ if hasattr(kernel, '__name__') else 'kernel'}: "
                         f"nothing to launch (total={total})")
    grid = int(min((total + block - 1) // block, sm_count(cp.cuda.Device().id) * 32))
    kernel((grid,), (block,), args)


@functools.lru_cache(maxsize=None)
def sm_count(device_id):
    """The CUDA device's SM count. Device().attributes queries every attribute: asked once per
    device, not per launch."""
    import cupy as cp
    return cp.cuda.Device(device_id).attributes["MultiProcessorCount"]
