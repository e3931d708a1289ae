"""cufft's device memory: scratch buffers, one per role, and the cuFFT plan cache.

Placed operands, GEMM outputs and inverse outputs live in scratch buffers, one per (role, dtype,
device), grown when too small and reused by every call (paper §3.3): a view handed out is
overwritten by the next call for that role. cuFFT plans (and their work areas) are cached per
device, shape, batch and layout, the PLAN_CACHE_SIZE most recent kept.

Hazard: a captured CUDA graph keeps the addresses of the buffers and plans it used.
held_on_device() lists them for minitorch_fft.graphs to hold while the graph lives, and inside
keeping_retired() whatever the caches drop (a buffer that grows, a plan evicted) is kept too,
instead of being freed while a graph may still write to it.
"""
import contextlib
import math

import numpy as np

# cuFFT's plan arguments are C ints: every offset into a plan's input or output must fit.
INT_MAX = 2**31 - 1
PLAN_CACHE_SIZE = 32  # plans kept per process (each holds a cuFFT work area), least recent dropped

_plans = {}            # (device, kind, n, m, batch, layout) -> plan, least recent first
_scratch_buffers = {}  # (role, dtype, device) -> flat buffer
_retired = None        # a list while keeping_retired() runs: what the caches dropped meanwhile


def scratch(xp, role, shape, dtype):
    """A view of `shape` on the buffer for `role`; the next call for `role` overwrites it."""
    size = math.prod(shape)
    device = "cpu" if xp is np else xp.cuda.Device().id
    key = (role, np.dtype(dtype).str, device)
    buf = _scratch_buffers.get(key)
    if buf is None or buf.size < size:
        _retire(_scratch_buffers.pop(key, None))  # the allocator may reuse the old memory
        buf = _scratch_buffers[key] = xp.empty(size, dtype=dtype)
    return buf[:size].reshape(shape)


def plan(xp, kind, basis, batch, layout):
    """The cached cuFFT plan of `batch` n x m transforms between (batch, n, m) real planes and
    spectra: kind "r2c" (forward) or "c2r" (inverse); layout "strided" for frequency-major
    (F, batch) spectra, "copy" for cuFFT's default (batch, F)."""
    from cupy.cuda import cufft as lib
    n, m = basis
    key = (xp.cuda.Device().id, kind, n, m, batch, layout)
    found = _plans.pop(key, None)
    if found is None:
        if batch * n * m > INT_MAX:
            raise ValueError(f"cufft: {batch} planes of {n}x{m} exceed cuFFT's 32-bit plan offsets "
                             f"({batch * n * m} > {INT_MAX} elements); use fewer planes per call")
        real, half = [n, m], [n, m // 2 + 1]
        if layout == "copy":
            fft_type = lib.CUFFT_R2C if kind == "r2c" else lib.CUFFT_C2R
            found = lib.PlanNd((n, m), None, 1, 0, None, 1, 0, fft_type, batch, "C", -1, m)  # default layout
        elif kind == "r2c":
            found = lib.PlanNd((n, m), real, 1, n * m, half, batch, 1, lib.CUFFT_R2C, batch, "C", -1, m)
        else:
            found = lib.PlanNd((n, m), half, batch, 1, real, 1, n * m, lib.CUFFT_C2R, batch, "C", -1, m)
        while len(_plans) >= PLAN_CACHE_SIZE:
            _retire(_plans.pop(next(iter(_plans))))                          # the least recent
    _plans[key] = found                                                      # now the most recent
    return found


@contextlib.contextmanager
def dropping_new_plans():
    """Plans made inside the block are dropped at its end (the losing tuning candidates' plans
    hold cuFFT work areas; the winner's are rebuilt once)."""
    made_before = set(_plans)
    try:
        yield
    finally:
        for key in [k for k in _plans if k not in made_before]:
            del _plans[key]


def held_on_device():
    """The scratch buffers and cuFFT plans (whose work areas are device memory) held now. A
    captured CUDA graph keeps addresses in them: minitorch_fft.graphs holds these objects for as
    long as its graph lives, so a buffer that grows or a plan that leaves the cache does not hand
    memory the graph writes to another allocation. Inside keeping_retired(), the plans and buffers
    dropped meanwhile are kept too (a step that needs more than PLAN_CACHE_SIZE plans evicts some
    of them during its own capture)."""
    return list(_scratch_buffers.values()) + list(_plans.values())


def _retire(obj):
    if _retired is not None and obj is not None:
        _retired.append(obj)


@contextlib.contextmanager
def keeping_retired():
    """`with keeping_retired() as kept:` the plans and scratch buffers dropped inside the block
    are appended to `kept` instead of being freed while anything may still use them."""
    global _retired
    saved, _retired = _retired, []
    try:
        yield _retired
    finally:
        _retired = saved


def release_buffers():
    """Drop the scratch buffers and cuFFT plans (rebuilt on the next call), e.g. between benchmarks.
    Inside keeping_retired() they are kept as retired: a layer that runs out of memory while a CUDA
    graph is captured releases them, and the graph holds nodes of plans used earlier in the capture
    (destroying them there crashed cudaStreamEndCapture on an H100)."""
    for obj in list(_scratch_buffers.values()) + list(_plans.values()):
        _retire(obj)
    _scratch_buffers.clear()
    _plans.clear()
