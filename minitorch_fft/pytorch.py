"""The project's convolutions inside PyTorch: one custom operator, a drop-in Conv2d, convert(model).

    from minitorch_fft.pytorch import convert
    model = convert(torchvision.models.alexnet())      # every nn.Conv2d it can serve, in place

`torch.ops.minitorch_fft.conv2d(x, weight, stride, padding, backend, bias=None)` runs the
framework's fprop and adds the bias (in place, or inside cuDNN's fprop for a channels-last layer on
cudnn); its backward is one more operator, conv2d_grads, which gives the bias's gradient first and
then runs accGrad and bprop, each only where its input needs a gradient, accGrad first (the input
gradient, usually the larger output, is then not alive during accGrad's workspace, often the larger
one: the comment above EagerConv2d), bprop on accGrad's gradOutput spectrum (conv2d_bprop and
conv2d_accgrad run one pass each). Every pass goes through backends.run_pass, so `auto` tunes per
geometry and pass with the framework's tuning cache, and `backends.config` settings apply (`with
backends.config.override(tf32=True):` is the TF32 mode). conv2d() and Conv2d call the operator where
something traces them (torch.compile, make_fx, FakeTensor, vmap) and, eagerly, the same passes as an
autograd.Function (EagerConv2d), which skips the dispatcher's Python (~95 us a call on an H100).

Tensors cross without copies: a CUDA tensor becomes a CuPy array over its own memory (which the
array keeps alive) and a result comes back through a DLPack capsule; CPU tensors through
.numpy() / torch.from_numpy (a non-contiguous one is made contiguous first, as the backends
would). Neither direction orders streams: a pass runs on PyTorch's current stream, as PyTorch's
own operators do (a CuPy ExternalStream), and allocates from PyTorch's caching allocator, so it
orders with PyTorch's work, counts in torch.cuda.max_memory_allocated(), and can be captured by
torch.cuda.graph (the allocations then come from the graph's private pool; CuPy refuses cuBLAS
calls in a capture, so the GEMMs go to PyTorch's own cuBLAS handle for the capture stream, with the
workspace PyTorch gives it, as the stock model's captured GEMMs do: backends.cgemm.BorrowedHandle;
where PyTorch has yet to make that handle on the capturing thread, it makes it there, in relaxed
capture mode. Where PyTorch does not call the libcublas CuPy loaded, a handle of our own made at
the device's first eager pass, backends.cgemm.GraphHandle, whose 32 MiB workspace is taken from
the first capture's pool, so eager steps never hold it; sessions 35-36 measured those 32 MiB as
the graph rows' peak over stock's on ResNet-50 and VGG-16). Capture after one eager step: `auto`
times the backends and cuFFT plans are made at a layer's first call, which a capture cannot hold.
The auto_memory_mb cap does not apply here (it limits CuPy's own pool). The passes' memory checks count
PyTorch's reserved, unused blocks as available (backends.common.register_pool), and PyTorch's
out-of-memory error takes run_pass's gemm fallback as CuPy's does.

Channels-last: a layer whose input or weight is channels-last (model.to(memory_format=
torch.channels_last), channels-last inputs) gives channels-last results, forward and backward, as
the fake implementations declare and as PyTorch's cuDNN convolutions decide (a tensor that is both
NCHW- and NHWC-contiguous, one plane or 1x1 planes, counts as channels-last only where strided
exactly so, as model.to() lays out such a weight: a grayscale first layer's NCHW input says nothing).
On the GPU with backend cudnn, where cuDNN is installed, the passes run cuDNN's NHWC plans on the
tensors as they are (backends.cudnn, layout "nhwc"): no layout conversion, and in TF32 mode the
VGG-16 step's compiled peak under the stock model's (session 42). A 1x1 kernel without padding is
one GEMM on the tensors as they are (gemm.fprop_nhwc and the others: a channels-last activation is
the matrix of its pixels; prepared from a layer's second call on the GPU, _gemm_prepared), with
backend gemm, CPU and GPU. Our other algorithms take NCHW only: with auto, each pass takes the route
auto timed for it, once per geometry, pass and precision (backends.nhwc_route), among those its
candidates (auto_backends) offer: cuDNN's NHWC plans; the 1x1 GEMM; or copies to NCHW, auto's NCHW
pass and the result copied back (the fastest, copies included; its memory is weighed only where the
nhwc_route_mb setting bounds it: each route's temporaries counted while auto times it, a route over
the bound above the leanest one's never winning: at 64 MiB VGG-16 b64's TF32 reduce-overhead step
peaks under the stock model's at 0.99x its speed, where unbounded three accGrads' copies put it 532 MiB
over, and ResNet-50 b128 fp32 runs 1.39x stock where unbounded 1.44x (its requested peak the same), so
it is unset by default, session 60; on the CPU, untimed, the GEMM where it takes the layer).
Elsewhere (another backend, a geometry none of these takes) the NCHW passes run on copies and their
results are laid out channels-last again. The NHWC calls take no gemm fallback on running out of
memory (run_pass's, which is NCHW).

Pass graphs (the pass_graphs setting, MINITORCH_PASS_GRAPHS=1; off by default): on CUDA, a layer's
forward and its backward each replay as one CUDA graph once their operands and results come back to
the addresses they had (a training loop's caching allocator repeats them), instead of ~80-350 us of
Python a call. The results stay new tensors of the caching allocator's; the passes' temporaries live
in an arena the graphs share (one tensor, sized to the largest layer's temporaries as counted in its
eager calls; what does not fit it comes from a pool), held while they live (pass_graph_stats(),
release_pass_graphs()); each layer's passes then share spectra among themselves only, and each
result is copied once on the device into the tensor returned, but on cuDNN's NHWC plans and the 1x1
GEMM route, which write it there (elsewhere the boundary is no longer copy-free). The arena is as
large as the largest layer's temporaries (converted AlexNet b128: 444 MiB, conv1's fprop;
benchmarks/NOTES.md, sessions 48-50), held beside the step's peak, where eagerly they come and go:
hence off by default, and pass_graph_mb leaves the layers that take more eager. The
section "a layer's passes as one CUDA graph" below has the details.

float32 only; other dtypes raise TypeError. Under autocast the operator runs in float32 (its
inputs are cast, as PyTorch does for its own fp32-only operators); the result is float32.

Reverse-mode autograd only: torch.func.vmap runs the operator per sample (custom_op's fallback),
but torch.func's derivative transforms (grad, vjp, jacrev, jvp, jacfwd, hessian) of a converted
layer's input, weight or bias, and forward-mode AD, raise NotImplementedError (custom_op's autograd
cannot serve them: PyTorch raised an error of its own under grad, and jvp gave zero tangents,
silently); a frozen layer inside them runs. A second backward raises PyTorch's error (no derivative
is registered for the backward's operator). Not checked, and still zero tangents: jvp under
torch.compile, and a direct torch.ops call under jvp.

Spectra reuse across the autograd boundary (backends/reuse.py) is opt-in: wrap forward and
backward, not the optimiser step, in `with minitorch_fft.pytorch.reuse_spectra():`. reuse.py keys a
spectrum by the identity of the array it came from, and each pass here sees a new CuPy/NumPy view
of its tensor, so the block also keeps one view per tensor, found again by (storage address,
shape, strides, version counter): that is what lets bprop find fprop's weight spectrum. It is safe
where reuse.py's hazards hold: inside forward+backward autograd itself refuses saved tensors
modified in place (the version counter, which the key also carries), and a view held by the
block keeps its tensor alive, and so its storage's address from being reused. It is not
safe, and is therefore not the default, where a change bypasses the version counter (writes
through `.data`, a DLPack or NumPy alias, a CUDA graph replay): the key would match a stale
spectrum, as autograd's own check would miss it; a storage swapped through `.data` may even be
freed and its address reused by another tensor while the block holds the old view. Memory: by
default (inputs=False) no spectrum lives from forward to backward, where
a step's memory peaks: accGrad's gradOutput spectrum serves bprop and nothing else is kept.
reuse_spectra(inputs=True) also keeps each layer's input spectrum for its accGrad: more memory, and
not reliably faster (converted AlexNet b128 on an H100, session 13: peak 1706 against 1417 MiB,
the stock model's 1499; a step 9.0 against 9.6 ms measured alone, 9.82 against 9.76 in
bench_pytorch's run). A view is held only until its last pass (accGrad takes x last, bprop gy and w). Keep
the block outside a torch.compile'd function (Dynamo does not trace it).
"""
import bisect
import collections
import contextlib
import functools
import itertools
import logging
import math
import threading
import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from . import backends
from .backends import cgemm, cufft_buffers

log = logging.getLogger(__name__)
Tensor = torch.Tensor
GeometryError = backends.GeometryError   # bad shapes: a ValueError, and a RuntimeError as nn.Conv2d raises


# -- crossing to NumPy / CuPy and back -----------------------------------------------------------

_views = None   # inside reuse_spectra(): {(device index, address, shape, strides, version): array view}


def _set_views(views):
    global _views
    _views = views


_open_views = backends.utils.OpenBlocks(_set_views)   # the open blocks' dicts; _views is the last's


@contextlib.contextmanager
def _view_block():
    """_views a dict of the block's own while it runs. At its end the dict leaves the open ones
    wherever it is, so two threads' blocks that end out of order leave each other's as they were
    (as backends.reuse's blocks; a view kept past every block would hold its tensor for good)."""
    with _open_views.open({}):
        yield


def _key(t):
    try:   # get_device(): the CUDA index, -1 on the CPU (the two never share an address range here)
        return (t.get_device(), t.data_ptr(), t.shape, t.stride(), t._version)
    except RuntimeError:   # inference tensors have no version counter: never shared
        return None


def _array(t, cp, keep=True):
    """t as a NumPy (cp None) or CuPy array on the same memory: the same view object for the same
    tensor state inside reuse_spectra(), so that reuse.py's identity key finds its spectrum. keep
    False: no later pass takes t (bprop is the last of a layer's passes, accGrad where no bprop
    follows), so a new view is not held (it would keep t alive until the block ends: the first
    layer's gradOutput, 95 MiB on AlexNet b128). A CUDA tensor is viewed as it is, not detached first
    (a call less a view, ~15 views a step on AlexNet: the passes run where autograd records nothing,
    an autograd.Function's forward and backward or below the dispatcher's autograd key); the view
    owns the tensor, and through it the storage, unless the tensor's storage is swapped (`.data =`),
    one of the writes under which reuse_spectra() is not safe (module docstring)."""
    views = _views                       # read once: another thread's block may end meanwhile
    if cp is None:
        t = t.detach()                   # NumPy refuses a tensor that requires grad
    if not t.is_contiguous():            # a copy, as the backends would make (e.g. the expanded
        t = t.contiguous()               # gradient of a sum(), a caller's strided input, a channels-
        key = None                       # last layer's operand): no later pass sees it, so not kept
    else:
        key = None if views is None else _key(t)
    if key is not None and key in views:
        return views.pop(key)            # each tensor feeds two passes: hand it out once more, then drop
    a = t.numpy() if cp is None else _cupy_view(t, cp)
    if key is not None and keep:
        views[key] = a
    return a


def _cupy_bytes(t, cp):
    """A contiguous CUDA tensor's bytes as a CuPy uint8 array on its memory, keeping t alive (as
    _cupy_view, without DLPack: no stream ordering asked for, which a capture would record)."""
    memory = cp.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t, t.device.index)
    return cp.ndarray((memory.size,), cp.uint8, cp.cuda.MemoryPointer(memory, 0))


def _cupy_view(t, cp, strides=None, shape=None):
    """A contiguous float32 CUDA tensor as a CuPy array on its memory, keeping t alive (the UnownedMemory's
    owner); with strides (bytes), a dense one of another layout (channels-last); with shape, its memory
    as a C-contiguous array of that shape (as many elements). What
    cp.from_dlpack(t) gives without DLPack's Python: PyTorch's __dlpack__ looks up the current
    device and stream to order the two, and the pass already runs on PyTorch's current stream
    (_cuda_scope). 3 us against 31 on an H100 (benchmarks/NOTES.md, session 11)."""
    memory = cp.cuda.UnownedMemory(t.data_ptr(), t.numel() * 4, t, t.device.index)
    return cp.ndarray(tuple(t.shape) if shape is None else shape, cp.float32, cp.cuda.MemoryPointer(memory, 0),
                      strides)


def _cupy_nhwc(t, cp):
    """A dense channels-last float32 CUDA tensor as a CuPy array of its logical (N, C, H, W) shape on
    its memory, with its NHWC strides (what backends.cudnn's layout "nhwc" and backends.layout take)."""
    return _cupy_view(t, cp, tuple(4 * s for s in t.stride()))


def _dense_strides(shape, nhwc):
    """The strides torch.empty(shape) has, shape (N, C, H, W), with memory_format=torch.channels_last
    where nhwc."""
    _, c, h, w = shape
    return (c * h * w, 1, w * c, c) if nhwc else (c * h * w, h * w, w, 1)


def _channels_last(t):
    """Whether t is a 4-d tensor laid out channels-last (model.to(memory_format=torch.channels_last)'s
    layout). A dense tensor both NCHW- and NHWC-contiguous (one channel, or 1x1 planes) is channels-last
    only where its strides are exactly channels-last's and not NCHW's, as model.to() lays out such a
    weight and PyTorch's suggest_memory_format reads it (an empty tensor counts by its strides too,
    where PyTorch says NCHW: Conv2d.forward hands an empty batch to PyTorch's own convolution); an
    NCHW batch of one channel says nothing."""
    if t.dim() != 4 or not t.is_contiguous(memory_format=torch.channels_last):
        return False
    if not t.is_contiguous():
        return True
    return t.stride() == _dense_strides(t.shape, True) and t.stride() != _dense_strides(t.shape, False)


def _nhwc(a, b):
    """Whether a pass (or a layer) on a and b is channels-last: either one is, as PyTorch's cuDNN
    convolutions decide from input and weight (a grayscale first layer's NCHW input says nothing,
    and its weight decides)."""
    return _channels_last(a) or _channels_last(b)


def _laid_out(t, shape, nhwc):
    """An empty float32 tensor of `shape` on t's device, channels-last where nhwc: what the operators
    return, for their fake implementations."""
    return torch.empty(shape, dtype=torch.float32, device=t.device,
                       memory_format=torch.channels_last if nhwc else torch.contiguous_format)


def _from_cupy(a):
    """A CuPy array as a tensor on its memory, through a DLPack capsule made with stream -1: the
    consumer, PyTorch, is on the producer's stream, so neither side orders anything (3 us against
    12 for torch.from_dlpack(a), which asks CuPy for a capsule on its current stream).

    While an operator runs (_owned_outputs), a tensor on the storage of the torch.empty block that holds
    it instead: a storage of PyTorch's own, with its allocator's deleter, which inductor's CUDA graphs
    (torch.compile's reduce-overhead) require of a graph's outputs (they free a warm-up's outputs through
    it; a DLPack capsule's deleter stopped them: "Expected standard deleter"). Its own tensor, not a
    view of the block's (an operator's output that autograd sees as a view may not be changed in place:
    a ReLU(inplace=True) after it, where the torch.ops path runs untraced). Where no owned block holds it (a result of a size not
    foreseen), a copy into a new tensor, counted in _copied_out."""
    if _local.owning:
        base = _owned.get(a.data.mem.ptr)
        if base is None:
            _copied_out[0] += 1
            if not _dense(a):
                a = _cupy.ascontiguousarray(a)
            t = torch.empty_strided(a.shape, [s // 4 for s in a.strides], dtype=torch.float32,
                                    device=torch.device("cuda", a.device.id))
            _cupy_view(t, _cupy, a.strides)[...] = a
            return t
        return _on_storage(base, a.shape, a.strides, a.data.ptr - a.data.mem.ptr)
    return torch.from_dlpack(a.__dlpack__(stream=-1))


def _on_storage(base, shape, strides, offset):
    """A float32 tensor of `shape` and `strides` (bytes) on base's storage from byte `offset`: its
    own tensor (set_), not a view of base."""
    return torch.empty(0, dtype=torch.float32, device=base.device).set_(
        base.untyped_storage(), offset // 4, tuple(shape), tuple(s // 4 for s in strides))


def _dense(a):
    """Whether array a covers its bytes once each, with no negative stride (C order, channels-last, ...)."""
    return all(s >= 0 for s in a.strides) and (
        a.size == 0 or sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize == a.nbytes)


class _OperatorState(threading.local):
    """Per thread (autograd runs each device's backward on a thread of its own): whether an operator's
    implementation runs (torch.ops' call: traced code's), and the byte sizes whose CuPy allocations a
    tensor of PyTorch's serves meanwhile (_owned_outputs)."""
    operator = False
    owning = frozenset()


_local = _OperatorState()


@contextlib.contextmanager
def _as_operator():
    was, _local.operator = _local.operator, True
    try:
        yield
    finally:
        _local.operator = was


@contextlib.contextmanager
def _owned_outputs(passes, geometry):
    """The operators' results on tensors of PyTorch's (_from_cupy): the CuPy allocations of each
    result's byte size, while the passes run, come from torch.empty (_Stream's malloc; a temporary of the
    same size too, a few us each). The eager path keeps DLPack's zero-copy tensors."""
    g = backends.geometry(*geometry)
    was, _local.owning = _local.owning, frozenset(
        4 * math.prod(backends.common.pass_output_shape(g, p[0])) for p in passes)
    try:
        yield
    finally:
        _local.owning = was


@contextlib.contextmanager
def reuse_spectra(inputs=False):
    """Forward and backward inside the block share FFT spectra across a layer's passes (module
    docstring: where that is safe). Yields backends' StepCache (hits, misses). inputs=False (the
    default here, unlike backends.reuse_spectra) keeps no spectrum from forward to backward, where
    the step's memory peaks: with inputs=True converted AlexNet held 310 MiB of them there, its
    peak above the stock model's (module docstring: the figures). Under torch.compile's
    reduce-overhead keep inputs=False: a spectrum kept from forward to backward would live in the
    cudagraph trees' pool between their forward and backward graphs, and the trees refuse the step
    ("tensor(s) in the cudagraph pool not tracked as outputs"; benchmarks/NOTES.md, session 55)."""
    with backends.reuse_spectra(inputs) as cache, _view_block():
        yield cache


class _Temporaries:
    """The bytes a crossing's CuPy arrays hold at their most (peak), counted by the allocator
    (_Stream) while this is `_measuring`: workspaces, spectra, copies, and the results of the routes
    that do not write into the caller's tensors. Not counted: what PyTorch allocates in the crossing
    (a copy of an operand in another layout, and a capture's cuBLAS workspaces, which come from the
    graphs' pool, not their arena). Memory freed here that was allocated before is not subtracted.
    It keeps the order of the allocations too, for transient(): what a capture of the same passes
    would take."""
    __slots__ = ("sizes", "live", "peak", "events")

    def __init__(self):
        self.sizes, self.live, self.peak, self.events = {}, 0, 0, []

    def took(self, p, size):
        self.sizes[p] = (size, len(self.events))
        self.events.append(size)
        self.live += size
        self.peak = max(self.peak, self.live)

    def gave(self, p):
        size, i = self.sizes.pop(p, (0, None))
        if i is not None:
            self.events.append(-1 - i)
        self.live -= size

    def transient(self):
        """(peak, footprint) of the allocations given back before the count ended, those still held
        left out (made once and kept: a cuFFT buffer, which a capture of the same passes finds made):
        the bytes they held at their most, and the bytes an _Arena cutting them in their order (first
        fit) spans, its holes included: what a capture of these passes takes of one."""
        kept = {i for _, i in self.sizes.values()}
        arena, at = _Arena(0, 1 << 62), {}
        live = peak = 0
        for i, event in enumerate(self.events):
            if event < 0:   # a take given back, so not kept
                live -= self.events[-1 - event]
                arena.give(at.pop(-1 - event))
            elif i not in kept:
                at[i] = arena.take(event)
                live += event
                peak = max(peak, live)
        return peak, arena.high


class _Both(_Temporaries):
    """A count inside another (_counted within _graphed's): every allocation and release counted by both."""
    __slots__ = ("outer",)

    def __init__(self, outer):
        super().__init__()
        self.outer = outer

    def took(self, p, size):
        super().took(p, size)
        self.outer.took(p, size)

    def gave(self, p):
        super().gave(p)
        self.outer.gave(p)


@contextlib.contextmanager
def _counted():
    """A _Temporaries counting what CuPy allocates inside the block (its peak and live bytes after
    it): auto's channels-last routes while it times them (backends.nhwc_route). A count already
    running (_graphed's) goes on counting it too, and is running again after it. One count for the
    process, as _graphed's: blocks of two threads that overlap may end out of order, which would
    leave the first's count running; the routes are timed at a layer's first call in a pass,
    one pass at a time in a training step."""
    global _measuring
    outer = _measuring
    _measuring = counted = _Temporaries() if outer is None else _Both(outer)
    try:
        yield counted
    finally:
        _measuring = outer


class _Arena:
    """One block of device memory (`tensor`: a uint8 tensor of PyTorch's caching allocator, on the
    stream the graphs replay on) that the CuPy allocations of the pass-graph captures on one stream
    are cut from, first fit, in multiples of 512 bytes (PyTorch's own alignment). The graphs replay
    one at a time on that stream and none holds anything past its end, so their temporaries share it
    as they shared the pool; cut from one block sized to the largest layer's footprint (_arena_for),
    they do not fragment across the pool's segments (~2x the largest, benchmarks/NOTES.md, session
    49). take() answers None where no hole fits: that allocation comes from the pool.

    The allocator's free calls give() whenever CuPy lets go of a block, which may be inside take()
    or give() themselves (the garbage collector runs there) or on another thread: a give() that
    finds the arena busy is queued and done by whichever call holds it, so the holes are only ever
    changed by one call at a time."""
    ALIGN = 512
    __slots__ = ("tensor", "base", "size", "holes", "taken", "high", "lock", "queued")

    def __init__(self, base, size, tensor=None):
        self.tensor, self.base, self.size = tensor, base, size
        self.holes = [(base, size)]   # free (address, bytes), by address; no two adjacent
        self.taken = {}               # address -> bytes, of the allocations cut and not given back
        self.high = 0                 # the most bytes from base any allocation reached (what was used)
        self.lock = threading.Lock()
        self.queued = []              # addresses given back while the arena was busy

    def take(self, size):
        """The address of `size` bytes (rounded up to ALIGN) at the first hole they fit, or None."""
        with self.lock:
            self._given_queued()
            p = self._cut(max(1, -(-size // self.ALIGN)) * self.ALIGN)
            self._given_queued()   # what was given back meanwhile (the garbage collector, in _cut)
            return p

    def _cut(self, size):
        for i, (p, n) in enumerate(self.holes):
            if n >= size:
                if n == size:
                    del self.holes[i]
                else:
                    self.holes[i] = (p + size, n - size)
                self.taken[p] = size
                self.high = max(self.high, p + size - self.base)
                return p
        return None

    def give(self, p):
        """The allocation at p back to the holes, merged with its neighbours (queued where busy)."""
        if not self.lock.acquire(blocking=False):
            self.queued.append(p)   # list.append is atomic: the call holding the arena takes it
            return
        try:
            self.queued.append(p)
            self._given_queued()
        finally:
            self.lock.release()

    def _given_queued(self):
        while self.queued:
            p = self.queued.pop()
            size = self.taken.pop(p)
            i = bisect.bisect_left(self.holes, (p, 0))
            if i < len(self.holes) and self.holes[i][0] == p + size:
                size += self.holes.pop(i)[1]
            if i and sum(self.holes[i - 1]) == p:
                self.holes[i - 1] = (self.holes[i - 1][0], self.holes[i - 1][1] + size)
            else:
                self.holes.insert(i, (p, size))


_measuring = None     # a _Temporaries while _graphed runs a key's eager calls or _counted a route's run, else
                      # None; one for the process: what other threads allocate meanwhile is counted too
_owned = {}           # address -> the uint8 tensor that serves that CuPy allocation (_owned_outputs), until CuPy frees it
_copied_out = [0]     # results copied into a tensor of PyTorch's because no owned block held them (_from_cupy)
_capturing = {}       # capture stream pointer -> the _Arena its CuPy allocations are cut from, while _capture captures
_arena_of = {}        # address -> the _Arena it was cut from, until given back (a block kept keeps its arena)
_cupy = None
_graph_handles = {}   # device index -> None (captures borrow PyTorch's handle) or cgemm.GraphHandle:
                      # set at the device's first eager pass
_streams = {}         # (device index, stream pointer) -> _Stream: made once per PyTorch stream
_NOT_CAPTURING = contextlib.nullcontext()


class _Stream:
    """What a pass on one PyTorch stream needs from CuPy, made once per stream: CuPy's device,
    the stream as CuPy's ExternalStream, and an allocator that takes memory from PyTorch's
    caching allocator on that stream (so it counts in torch.cuda.max_memory_allocated, and a
    capture gets it from the graph's pool: a cudaMalloc inside a capture is an error), or, while a
    pass graph is captured on the stream, cuts it from that capture's arena (_capturing, _Arena).

    The allocator calls the caching allocator's raw functions, not torch.cuda.caching_allocator_alloc:
    that wrapper enters a device guard (Python) on every allocation, and a pass makes 4-6 of them.
    The raw call allocates on the CUDA runtime's current device, which CuPy's device context (entered
    around every crossing, _crossing) has set to this one."""

    def __init__(self, cp, device_index, ptr):
        self.device = cp.cuda.Device(device_index)
        self.device_name = torch.device("cuda", device_index)
        with warnings.catch_warnings():
            # CuPy 14 deprecates ExternalStream for Stream.from_external, which wants the
            # __cuda_stream__ protocol; a pointer is what we have
            warnings.simplefilter("ignore", DeprecationWarning)
            self.stream = cp.cuda.ExternalStream(ptr, device_index)
        alloc = torch._C._cuda_cudaCachingAllocator_raw_alloc      # (size, stream): on the current device
        delete = torch._C._cuda_cudaCachingAllocator_raw_delete    # (pointer): device and stream recorded

        def malloc(size, device_id):
            if _capturing:
                arena = _capturing.get(ptr)
                if arena is not None:
                    p = arena.take(size)
                    if p is not None:
                        _arena_of[p] = arena
                        return p
            if size in _local.owning:   # a result's size: a tensor's own block, for the result to be made on
                t = torch.empty(size, dtype=torch.uint8, device=self.device_name)
                p = t.data_ptr()
                _owned[p] = t
            else:
                p = alloc(size, ptr)
            measuring = _measuring   # read once: another thread may end its count meanwhile
            if measuring is not None:
                measuring.took(p, size)
            return p

        def free(p, device_id):
            if _arena_of:
                arena = _arena_of.pop(p, None)
                if arena is not None:
                    arena.give(p)
                    return
            measuring = _measuring
            if measuring is not None:
                measuring.gave(p)
            if _owned and _owned.pop(p, None) is not None:
                return            # the tensor's block: PyTorch's again once no view of it is left
            delete(p)
        self.malloc = cp.cuda.memory.PythonFunctionAllocator(malloc, free).malloc
        # the memory checks count what PyTorch's allocator keeps reserved unused (it frees that and
        # retries before it fails): the GPU's free memory alone refused passes it could serve
        backends.common.register_pool(self.malloc, functools.partial(_cached_unused_bytes, device_index),
                                      "PyTorch's cached, unused blocks")


def _cached_unused_bytes(index):
    """Bytes PyTorch's caching allocator holds reserved on GPU `index` but not allocated."""
    return torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)


def _cuda_scope(index):
    """(cupy, _Stream, capture context) for a pass on GPU `index`, on PyTorch's current stream there:
    the caller enters `with on.device, on.stream, cp.cuda.using_allocator(on.malloc), capture:`.
    Per call this is two dict look-ups and two C calls: the stream's raw pointer (a Stream object,
    torch.cuda.current_stream(), costs 5.5 us) and whether it is being captured. While it is, the
    GEMMs go to a cuBLAS handle bound to it (capture: cgemm.capturing; CuPy refuses its own)."""
    global _cupy
    if _cupy is None:
        import cupy
        _cupy = cupy
    cp = _cupy
    ptr = torch._C._cuda_getCurrentRawStream(index)
    on = _streams.get((index, ptr))
    if on is None:
        on = _streams[index, ptr] = _Stream(cp, index, ptr)
    if not torch.cuda.is_current_stream_capturing():
        if index not in _graph_handles:
            # Where PyTorch calls the libcublas ours do, a capture's GEMMs go to PyTorch's
            # handle for the capture stream, with the workspace PyTorch binds to it, which its own
            # captured GEMMs use (None here). Else a handle of our own; cublasCreate allocates, so it
            # is made eagerly, without a workspace: eager passes never use it, and its 32 MiB were
            # the converted ResNet-50's eager step peak over the stock model's (+22 MiB,
            # benchmarks/NOTES.md, session 14)
            with on.device, on.stream:
                _graph_handles[index] = None if _torch_shares_libcublas() else cgemm.GraphHandle(ptr, None)
        return cp, on, _NOT_CAPTURING
    if index not in _graph_handles:
        raise RuntimeError("minitorch_fft.conv2d: first call on this GPU inside a CUDA graph capture; "
                           "run one eager step first (auto tunes and cuFFT plans are made at a layer's "
                           "first call, which a capture cannot hold)")
    handle = _graph_handles[index]
    if handle is None:
        # PyTorch's handle for this stream, its stream and workspace bound by PyTorch as for its
        # own GEMMs (the workspace: from the graph's pool at the stream's first captured GEMM, as
        # the stock model's step pays it); its math mode set for our GEMMs (cgemm.BorrowedHandle).
        # PyTorch makes a thread's handle at its first GEMM there, here if the model has none of
        # PyTorch's before: cublasCreate allocates, which the capture allows in relaxed mode only
        with torch.cuda.device(index), cgemm.relaxed_capture_mode():
            blas = torch.cuda.current_blas_handle()
        return cp, on, cgemm.capturing(cgemm.BorrowedHandle(blas))
    if handle.stream_ptr != ptr:
        handle.bind(ptr)
    if handle.workspace is None:
        # the first capture's: from its graph's pool (PyTorch's allocator may allocate there), and
        # kept for the process (graphs sharing it must not be replayed concurrently, nor captured:
        # two first captures at once on one GPU would each set one, the first left to its pool)
        workspace = torch.empty(cgemm.GRAPH_WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        handle.set_workspace(_cupy_bytes(workspace, cp))
    return cp, on, cgemm.capturing(handle)


def _torch_shares_libcublas():
    """Whether PyTorch's CUDA library calls the libcublas our GEMMs use, so that its cuBLAS handles
    are ours to take (cgemm.shares_libcublas: the same function addresses, not merely one file)."""
    import os
    return cgemm.shares_libcublas(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so"))


def _run(pass_name, backend, a, b, x_shape, w_shape, stride, padding, later=None, bias=None):
    """One pass of backends.run_pass on tensors a, b (same device, float32); a new tensor, fprop's
    with the bias added (_crossing).
    later: the layer's passes still to run on these tensors in this step (run_pass's argument:
    which spectra this pass keeps for them, inside reuse_spectra()); None is fprop's, after which
    both backward passes may run (a channels-last layer's fprop keeps nothing: _channels_last_passes).
    A view of `a` is held for a later pass that takes it (fprop's x for accGrad, accGrad's gy for
    bprop), of `b` only in fprop (w, for bprop): _array."""
    nhwc = _nhwc(a, b)   # (x, w), (gy, w) or (gy, x): as the operators' fake implementations say
    return _crossing(backend, x_shape, w_shape, stride, padding, [(pass_name, a, b, later)], nhwc, bias)[0]


def _crossing(backend, x_shape, w_shape, stride, padding, passes, nhwc=False, bias=None):
    """Passes of one layer, [(pass_name, a, b, later)] as _run takes them, run in order in one
    crossing: the tensors checked first, then the device's CuPy scope entered once for all of them
    (a backward's accGrad and bprop share it, where each entered its own before session 37); a new
    tensor for each pass. Each pass's two tensors are checked to share a device; the passes are one
    layer's, on one device (the first pass's: its scope serves all). nhwc: the layer is channels-last
    (_channels_last_passes). bias: added in place to the first result, fprop's (in cuDNN's graph
    where _channels_last_passes can)."""
    for pass_name, a, b, _ in passes:
        _check_float32(pass_name, a, b)
    geometry = (tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding))
    owned = (_owned_outputs(passes, geometry) if _local.operator and passes[0][1].is_cuda
             else contextlib.nullcontext())
    if (passes[0][1].is_cuda and backends.config.get("pass_graphs")
            and not torch.cuda.is_current_stream_capturing()):   # in a caller's capture: as they are
        results = _graphed(backend, geometry, passes, nhwc, bias)   # into tensors of PyTorch's already
        if results is not None:
            return results
        with owned:
            results = _isolated(backend, geometry, passes, nhwc, bias)
    else:
        with owned:
            results = _passes(backend, geometry, passes, nhwc, bias)
    return [_as_laid_out(r, nhwc) for r in results]


def _as_laid_out(t, nhwc):
    """t, a result of a layer that is channels-last where nhwc, with the strides the fake implementations
    give (_laid_out: channels-last's, else C order's). A result both NCHW- and NHWC-contiguous (one
    channel, or 1x1 planes: a one-class head's output, a 1x1 layer's weight gradient) keeps whatever
    strides its dimensions of size 1 got on the way: NumPy and DLPack give C order's to a channels-last
    layer's, and a backend's own (direct's one-channel output, tiledfft's 1x1 weight gradient) can
    leave channels-last's on an NCHW layer's. The next layer reads its layout from them (_channels_last),
    so the real run and the fake one (torch.compile's plan) would lay that layer out differently, and
    code such as `y.view(n, -1)` raises on what should be NCHW. The same memory read the same way (the
    strides differ only on dimensions of size 1), as a tensor of its own (_on_storage: not a view for
    autograd to see)."""
    if t.dim() != 4:
        return t
    strides = _dense_strides(t.shape, nhwc)
    layout = torch.channels_last if nhwc else torch.contiguous_format
    if t.stride() == strides or not t.is_contiguous(memory_format=layout):
        return t
    return _on_storage(t, t.shape, tuple(4 * s for s in strides), 4 * t.storage_offset())   # float32: 4 bytes


def _passes(backend, geometry, passes, nhwc=False, bias=None, outs=None):
    """_crossing's passes, run one by one (checked, geometry as tuples). outs: tensors the results
    may be written into, one a pass, laid out as the results are (a pass graph's); the routes that
    take an output array write there (_channels_last_passes), the others ignore them."""
    if nhwc:
        return _channels_last_passes(backend, geometry, passes, bias, outs)
    first = passes[0][1]
    if first.is_cpu:
        results = [torch.from_numpy(np.ascontiguousarray(_pass(pass_name, backend, a, b, None, geometry, later)))
                   for pass_name, a, b, later in passes]
    elif first.is_cuda:
        cp, on, capture = _cuda_scope(first.get_device())
        with on.device, on.stream, cp.cuda.using_allocator(on.malloc), capture:
            results = [_from_cupy(cp.ascontiguousarray(_pass(pass_name, backend, a, b, cp, geometry, later)))
                       for pass_name, a, b, later in passes]
    else:
        raise TypeError(f"minitorch_fft.conv2d runs on CPU and CUDA tensors, got device {first.device}")
    _add_bias(results[0], bias)
    return results


def _channels_last_passes(backend, geometry, passes, bias=None, outs=None):
    """A channels-last layer's passes, each result channels-last (as the fake implementations say). Each
    pass takes a route (_route): "cudnn", cuDNN's NHWC kernels on the tensors as they are (an operand in
    the other layout copied to channels-last first), with no layout conversion (VGG-16 b64 in TF32 mode,
    session 42: NCHW cuDNN calls converted layouts in ~4 ms of a 38 ms compiled step and held the copies
    as workspace); "gemm", a 1x1 layer's GEMM on the tensors as they are; or "nchw", our NCHW passes on
    copies made by backends.layout's transpose (_nchw_array), their results copied back. With auto,
    the route auto timed for the pass (backends.nhwc_route, among those its candidates offer: the
    auto_backends setting); with cudnn or gemm, that backend's own where it takes the geometry. The
    cudnn route and the prepared GEMM one write a pass's result into its tensor of outs where given
    (_nhwc_pass), with no copy. A bias goes into cuDNN's fprop (its conv + bias graph where that is
    the faster: backends/cudnn.py), or is added to the GEMM route's result, or to the NCHW fprop's
    once it is copied back. On the GPU the device's CuPy scope is entered once for all of it: the
    copies stay CuPy arrays, and nothing crosses to a tensor but the results (a copy's two crossings
    and two scope entries a pass were ~1 ms of converted AlexNet's host time a step, session 45). On
    the CPU the GEMM route runs on NumPy views of the tensors; the "nchw" passes on contiguous copies
    (_nchw_passes)."""
    first = passes[0][1]
    if first.is_cpu:
        # fprop keeps no view for the backward, as on the GPU: the backward's passes may take the GEMM route
        passes = [(p, a, b, () if p == "fprop" else later) for p, a, b, later in passes]
        routes = [_route(backend, p[0], geometry, np) for p in passes]
        if "gemm" not in routes:
            return _nchw_passes(backend, geometry, passes, bias)
        return [_nhwc_pass(route, None, geometry, pass_name, a, b, bias) if route == "gemm"
                else _nchw_passes(backend, geometry, [(pass_name, a, b, ())], bias)[0]   # tuned on the CPU
                for (pass_name, a, b, _), route in zip(passes, routes)]
    if not first.is_cuda:
        return _nchw_passes(backend, geometry, passes, bias)   # which says what it runs on
    outs = outs or [None] * len(passes)
    with _scope(first.get_device()) as cp:   # once for the crossing: routes, copies, passes and copies back
        routes = [_route(backend, p[0], geometry, cp) for p in passes]
        if "nchw" not in routes:   # every pass on cuDNN's plans or the GEMM route: no copies to count or release
            return [_nhwc_pass(route, cp, geometry, pass_name, a, b, bias, out)
                    for (pass_name, a, b, _), route, out in zip(passes, routes, outs)]
        results, copies = [], {}
        # the NCHW passes' uses of each tensor: its copy is dropped after the last of them (the other routes
        # take the tensors as they are)
        uses = collections.Counter(id(t) for (_, a, b, _), route in zip(passes, routes) if route == "nchw"
                                   for t in (a, b))
        route_of = {p[0]: route for p, route in zip(passes, routes)}
        for (pass_name, a, b, later), route, out in zip(passes, routes, outs):   # in the order given (accGrad first)
            if route != "nchw":
                results.append(_nhwc_pass(route, cp, geometry, pass_name, a, b, bias, out))
                continue
            # Views and spectra are kept only for a later pass of this crossing that also runs NCHW on the
            # same copies: fprop's feed none (the backward copies x anew, and even an NCHW x is seen as a
            # new view), and a backward pass on cuDNN's plans takes neither (kept, they would live until
            # the reuse_spectra() block ends: gy's copy, 822 MB on VGG-16 conv1_2 at b64)
            kept = () if pass_name == "fprop" else tuple(p for p in later or () if route_of.get(p) == "nchw")
            a2, b2 = (_nchw_array(copies, t, cp, keep) for t, keep in zip((a, b), _keeps(kept)))
            y = _pass_arrays(pass_name, backend, a2, b2, geometry, kept)
            del a2, b2
            _release_copies(copies, uses, a, b)   # before the copy back: its output then may take their blocks
            results.append(_from_cupy(backends.layout.to_nhwc(y)))
            del y
            if pass_name == "fprop":
                _add_bias(results[-1], bias)   # on cuDNN's route its plan adds it
    return results


def _route(backend, pass_name, geometry, xp):
    """The route of a channels-last layer's pass on xp's arrays (_channels_last_passes): auto's timed
    choice (backends.nhwc_route: "nchw" where its candidates offer no other); with backend cudnn its
    NHWC plans where it serves the geometry (the GPU, cuDNN installed), with gemm a 1x1 kernel's GEMM
    without padding (gemm.nhwc_supports); else "nchw"."""
    if backend == "auto":
        return backends.nhwc_route(pass_name, *geometry, xp, measure=None if xp is np else _counted)
    if backend == "cudnn" and xp is not np and backends.get("cudnn").supports(*geometry):
        return "cudnn"
    if backend == "gemm" and backends.gemm.nhwc_supports(*geometry):
        return "gemm"
    return "nchw"


def _release_copies(copies, uses, *tensors):
    """Count one use of each tensor off `uses`; drop its NCHW copy after the layer's last NCHW pass on it
    (x's after accGrad, gy's after bprop where both run NCHW)."""
    for t in tensors:
        uses[id(t)] -= 1
        if not uses[id(t)]:
            copies.pop(id(t), None)


@contextlib.contextmanager
def _scope(index):
    """The device's CuPy scope (_cuda_scope), entered; yields cupy. A capture's context is made anew
    each time: cgemm.capturing's can be entered once."""
    cp, on, capture = _cuda_scope(index)
    with on.device, on.stream, cp.cuda.using_allocator(on.malloc), capture:
        yield cp


def _nhwc_pass(route, cp, geometry, pass_name, a, b, bias, out=None):
    """One pass on the tensors laid out channels-last as they are (inside the device's CuPy scope; cp
    None: on the CPU, on NumPy views), as a channels-last tensor: route "cudnn", cuDNN's NHWC plans, the
    bias, if given, into fprop's (the only pass that takes one); route "gemm", a 1x1 layer's pass as one
    GEMM on the pixels (gemm.fprop_nhwc, bprop_nhwc, accgrad_nhwc), fprop's bias added after. out: a
    channels-last tensor of the result's shape (a pass graph's, _graphed) that cuDNN's plan and the
    prepared GEMM write into and return; the GEMM route's full path ignores it."""
    y = _gemm_prepared(cp, geometry, pass_name, a, b, out) if route == "gemm" and cp is not None else None
    if y is None:
        x_shape, w_shape, stride, padding = geometry
        third = _third(pass_name, x_shape, w_shape)
        a, b = (_nhwc_array(t.contiguous(memory_format=torch.channels_last), cp) for t in (a, b))
        if route == "cudnn":
            extra = {} if pass_name != "fprop" or bias is None else {"bias": _cupy_view(bias.contiguous(), cp)}
            if out is not None:
                extra["out"] = _cupy_nhwc(out, cp)
            y = getattr(backends.get("cudnn"), pass_name)(a, b, *third, stride=stride, padding=padding, layout="nhwc",
                                                          **extra)
            return _from_cupy(y) if out is None else out
        y = getattr(backends.gemm, f"{pass_name}_nhwc")(a, b, *third, stride=stride, padding=padding)
        y = torch.from_numpy(y) if cp is None else _from_cupy(y)
    return _add_bias(y, bias) if pass_name == "fprop" else y


def _nhwc_array(t, cp):
    """A dense channels-last float32 tensor as an array of its logical (N, C, H, W) shape on its memory, with
    its NHWC strides: a NumPy view on the CPU (cp None), else a CuPy one (_cupy_nhwc)."""
    return t.detach().numpy() if cp is None else _cupy_nhwc(t, cp)


_gemm_runs = {}   # (pass, geometry, config.state()) -> gemm.prepare_nhwc's run, None (the full path), or _FIRST
_FIRST = object()  # seen once: the full path ran (and tuned accGrad's form); prepared at the next call


def _gemm_prepared(cp, geometry, pass_name, a, b, out=None):
    """A 1x1 layer's pass on the "gemm" route as one prepared GEMM (gemm.prepare_nhwc) from its second
    call on, its matrices made straight from the tensors (_cupy_matrix) and its result a new tensor laid
    out as the operator says; None where the full path must run (the first call, which tunes accGrad's
    form; a pass that is more than one GEMM; an operand not dense in the layout the GEMM reads: the full
    path lays it out). out: the result's tensor where given (a pass graph's, laid out as the operator
    says), else a new one. What it skips, a pass: the full path's operand and layout checks, the geometry
    and chunk look-ups, the 4-d views and the DLPack crossing back (session 46: ResNet-50's channels-last
    step is host-bound on a slow host, 108 such passes a step)."""
    key = (pass_name, geometry, backends.config.state())
    run = _gemm_runs.get(key)
    if run is None:
        if key not in _gemm_runs:
            _gemm_runs[key] = _FIRST
        return None
    if run is _FIRST:
        run = _gemm_runs[key] = backends.gemm.prepare_nhwc(pass_name, backends.geometry(*geometry), cp)
        if run is None:
            return None
    x_shape, w_shape, stride, padding = geometry
    if pass_name == "accgrad":   # (gy, x) -> gW: pixels, pixels -> a weight's matrix
        out_shape, pixels = w_shape, (True, True, False)
    else:                        # fprop (x, w) -> y, bprop (gy, w) -> gx: pixels, a weight's matrix -> pixels
        out_shape = (x_shape[0], w_shape[0], x_shape[2], x_shape[3]) if pass_name == "fprop" else x_shape
        pixels = (True, False, True)
    if not a.numel() or not all(_dense_as(t, p) for t, p in zip((a, b), pixels)):
        return None
    if out is None:
        out = torch.empty(out_shape, dtype=torch.float32, device=a.device, memory_format=torch.channels_last)
    run(*(_cupy_matrix(t, cp, p) for t, p in zip((a, b, out), pixels)))
    return out


def _dense_as(t, pixels):
    """Whether t's memory is the matrix _cupy_matrix makes: its pixels' (an activation laid out
    channels-last), or a 1x1 weight's (f', f), dense in either layout."""
    if pixels:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _cupy_matrix(t, cp, pixels):
    """A dense float32 CUDA tensor's memory as a C-contiguous CuPy matrix, keeping t alive: its pixels
    (numel / planes, planes) for an activation laid out channels-last, else (f', numel / f') for a 1x1
    weight or its gradient."""
    size = t.numel()
    return _cupy_view(t, cp, shape=(size // t.shape[1], t.shape[1]) if pixels else (t.shape[0], size // t.shape[0]))


def _nchw_array(copies, t, cp, keep):
    """t as an NCHW (C-contiguous) CuPy array, inside the device's CuPy scope: a view of t itself where
    it is contiguous (_array, kept for a later pass as keep says), else one copy per tensor object kept
    in `copies` (a layer's passes on the same gradOutput share its copy, the same array object; inside
    reuse_spectra(), where both backward passes run NCHW on FFT backends that share spectra, accGrad's
    gy spectrum then serves bprop). A channels-last tensor is copied by backends.layout's transpose,
    the kernel auto timed the route with; any other layout by PyTorch. The copies stay CuPy arrays: no
    crossing to a tensor and back."""
    if t.is_contiguous():
        return _array(t, cp, keep)
    if id(t) not in copies:
        copies[id(t)] = (backends.layout.to_nchw(_cupy_nhwc(t, cp)) if _channels_last(t)
                         else _cupy_view(t.contiguous(), cp))
    return copies[id(t)]


def _nchw_passes(backend, geometry, passes, bias):
    """A channels-last layer's passes run as NCHW ones (_passes, on contiguous copies of their
    operands), each result copied back to channels-last."""
    plain = _passes(backend, geometry, passes, bias=bias)
    return [t.contiguous(memory_format=torch.channels_last) for t in plain]


def _pass(pass_name, backend, a, b, cp, geometry, later):
    """backends.run_pass on a and b as arrays (NumPy where cp is None, else CuPy, in its scope), with
    the pass's third argument (backends' contract): none for fprop, x_shape for bprop, w_shape for
    accGrad. geometry: (x_shape, w_shape, stride, padding), tuples."""
    keep_a, keep_b = _keeps(later)
    return _pass_arrays(pass_name, backend, _array(a, cp, keep_a), _array(b, cp, keep_b), geometry, later)


def _keeps(later):
    """(keep a, keep b): whether a pass's two operands' views are held for a later pass (_array): both
    for fprop (later None: both backward passes may follow; not a channels-last layer's, whose fprop
    _channels_last_passes gives ()), else a, gradOutput, where a later pass of the crossing takes it
    (accGrad's for bprop)."""
    return (True, True) if later is None else (bool(later), False)


def _pass_arrays(pass_name, backend, a, b, geometry, later):
    """backends.run_pass on arrays a and b, with the pass's third argument (_third)."""
    x_shape, w_shape, stride, padding = geometry
    return backends.run_pass(backend, pass_name, a, b, *_third(pass_name, x_shape, w_shape), x_shape=x_shape,
                             w_shape=w_shape, stride=stride, padding=padding, later=later)


def _third(pass_name, x_shape, w_shape):
    """A pass's arguments after its two arrays (backends' contract): none for fprop, x_shape for
    bprop, w_shape for accGrad."""
    return () if pass_name == "fprop" else (x_shape if pass_name == "bprop" else w_shape,)


def _check_float32(what, a, b):
    """TypeError unless both tensors are float32; ValueError unless they share a device."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        t = a if a.dtype != torch.float32 else b
        raise TypeError(f"minitorch_fft.conv2d ({what}) takes float32 tensors only, got {t.dtype} "
                        "(the backends compute in fp32; use nn.Conv2d for other dtypes; under autocast "
                        "float16 and bfloat16 inputs run in float32, float64 ones do not)")
    if a.device != b.device:
        raise ValueError(f"minitorch_fft.conv2d ({what}): tensors on different devices, {a.device} "
                         f"and {b.device}")


# -- a layer's passes as one CUDA graph (the pass_graphs setting) ---------------------------------
# A crossing (one layer's fprop, or its backward's passes) costs the host ~80-350 us of Python a
# call (benchmarks/NOTES.md, session 46), about what its kernels take on the GPU for AlexNet's and
# ResNet-50's small layers, whose converted steps were therefore host-bound. In a training loop the
# caching allocator hands the same addresses out step after step, so a crossing whose operands and
# results sit where they sat before can replay what it launched then: one cudaGraphLaunch.
# - Key: the device, PyTorch's current stream, the backend, geometry, passes, layout, the settings
#   (backends.config.state()) and each operand's address, shape and strides.
# - The results are new tensors from the caching allocator, as eagerly; the graph writes them at the
#   addresses they had when it was captured, so it replays only where they come out there again
#   (else the passes run eagerly). A result the caller holds on to is never written again.
# - Captured at the third call of a key (or later) whose results came out where one of its last
#   GRAPH_SEEN eager calls' did: the first calls tune and plan (auto, cuDNN's search, cuFFT's
#   plans), which a capture cannot hold. Until then each call runs eagerly with its results at
#   those addresses, so the next layer's operands sit where they will sit once this one replays.
# - The results are written into those tensors where the route takes an output (cuDNN's NHWC plans,
#   the prepared 1x1 GEMM), else copied there at the end.
# - The passes' temporaries (workspaces, spectra, the copied results before their copy) are cut
#   from an arena per device and stream (_Arena: one tensor, first fit), which the pass graphs
#   captured there share: the graphs replay one at a time on that stream, and none holds anything
#   past its end. It is sized to the largest layer's footprint counted on the device: its eager
#   call's temporaries cut in their order by the same first fit, those it keeps (a cuFFT buffer
#   made once, found made by the capture) left out (_Temporaries.transient, _arena_for; a new arena
#   where a later count outgrows it). What does not fit it, and what PyTorch allocates in a capture
#   (a cuBLAS workspace), comes from a private memory pool per device and stream (a new one after a
#   failed capture), shared the same way. Both are held while graphs live
#   (pass_graph_stats()["arena_bytes"] and ["pool_bytes"]; release_pass_graphs()). A capture that
#   fails leaves its pool unusable (PyTorch still counts it as being captured into; where PyTorch's
#   capture_end raises before it ends allocating to the pool, that pool stays reserved for the
#   process), and a pool whose graphs are all gone may not be captured into again: a fresh pool
#   serves the next capture.
# - The arena is about the largest crossing's temporaries (benchmarks/NOTES.md, session 48: conv1's
#   fprop on converted AlexNet b128), held beside the step's own peak. The pool alone fragmented to
#   ~2x it where crossings of different sizes took turns in its blocks (sessions 49-50).
# - The pass_graph_mb setting bounds each captured crossing's temporaries, not the arena. The
#   allocator counts a layer's temporaries in its eager calls (_Temporaries: at their most, those the
#   passes keep left out; not the layer's first call on a device, which may tune). A layer's passes
#   whose latest count is over the bound run eagerly, whatever their operands' addresses, and
#   graphs they had are dropped; the arena is sized among the others' footprints (which can exceed
#   the bound a little: holes, and 512-byte blocks). What overflows the arena into the pool, and
#   PyTorch's cuBLAS workspaces for the capture stream, come on top.
# - Each crossing is self-contained: its own reuse_spectra() block (accGrad's gradOutput spectrum
#   serves bprop in it) and nothing kept from or for another crossing (a spectrum kept across a
#   replay would sit in memory another graph's temporaries reuse). inputs=True and the
#   reuse_weight_spectra setting therefore share nothing where pass graphs run. A crossing that runs
#   eagerly under the setting (a key that is off, a layer over pass_graph_mb, operands that move)
#   is self-contained too, so that no view or spectrum it keeps waits for a graphed backward that
#   never takes it.
# - cufft's scratch buffers and plans, and cudnn's built plans, alive at the capture are held as
#   long as the graph lives (backends.held_on_device; minitorch_fft.graphs holds both for a step): an out-of-memory
#   fallback that drops them does not free what a graph still launches.
# - Inside a caller's own capture (torch.cuda.graph, CUDA graph trees) the passes run as they are
#   and are captured with the caller's graph. A key whose capture fails, or whose results moved
#   GRAPH_CAPTURES times, runs eagerly from then on.

GRAPH_AFTER = 2        # eager calls of a key before its first capture
GRAPH_SEEN = 2         # the results' addresses of this many recent eager calls are candidates (a caller
                       # that holds one call's results through the next alternates between two)
GRAPH_CAPTURES = 4     # captures of one key at most
GRAPH_KEYS = 4096      # keys remembered, least recent dropped (with its graphs)
GRAPH_NEW_KEYS = 32    # keys of one backend, geometry and passes made beyond this many (8 more per capture):
                       # its new keys run eagerly without the copy (operands that move every call)

_pass_graphs = {}      # key -> _PassGraph, least recent first
_families = collections.Counter()   # (backend, geometry, passes) -> keys made, less 8 per capture
_temporaries = {}      # (device, backend, geometry, passes, layout, config.state()), a layer's passes -> the
                       # bytes of temporaries its latest eager call took at their most, any key's, those it
                       # kept left out (_Temporaries.transient; 0 after its first, not counted): the
                       # pass_graph_mb setting's measure
_footprints = {}       # the same kinds -> the bytes of an _Arena their latest eager call's temporaries span (the
                       # arena is sized to the largest: _arena_for)
_over = set()          # the kinds above found over pass_graph_mb: they run eagerly
_capture_on = {}       # (device index, stream pointer) -> (side stream, memory pool id): where captures run
_arenas = {}           # (device index, stream pointer) -> the _Arena its captures cut their CuPy allocations from
_pools = set()         # (device index, memory pool id) of every pool captured into since the last release
_graph_counts = collections.Counter()   # "eager", "captures", "replays", "failed" (pass_graph_stats)


class _PassGraph:
    """One key's state (_graphed): its graphs by the results' addresses they write ({where: (graph,
    what it holds alive, its pool, its arena)}), the eager calls made and their results' recent
    addresses, captures made, off (runs eagerly, self-contained: _isolated)."""
    __slots__ = ("graphs", "runs", "seen", "captures", "off")

    def __init__(self):
        self.graphs, self.seen = {}, []
        self.runs = self.captures = 0
        self.off = False


def _graphed(backend, geometry, passes, nhwc, bias):
    """The crossing's results through its pass graph (replayed, or captured and replayed), or
    eagerly into the addresses a capture would take; None where it runs eagerly on its own
    (_isolated: a key that is off, a layer over pass_graph_mb, a layer whose operands move). Not
    inside a caller's capture."""
    first = passes[0][1]
    index = first.get_device()
    stream = torch._C._cuda_getCurrentRawStream(index)
    operands = [t for _, a, b, _ in passes for t in (a, b)] + ([] if bias is None else [bias])
    names = tuple((p, later) for p, _, _, later in passes)
    kind = (index, backend, geometry, names, nhwc, backends.config.state())
    if kind in _over:
        return None
    key = (stream, kind, tuple((t.data_ptr(), t.shape, t.stride()) for t in operands))
    entry = _pass_graphs.pop(key, None)
    if entry is None:
        family = (backend, geometry, names)
        if _families[family] >= GRAPH_NEW_KEYS:
            return None
        _families[family] += 1
        entry = _PassGraph()
        while len(_pass_graphs) >= GRAPH_KEYS:
            _pass_graphs.pop(next(iter(_pass_graphs)))   # a launch in flight finishes (cudaGraphExecDestroy)
    _pass_graphs[key] = entry
    if entry.off:
        return None
    g = backends.geometry(*geometry)
    outs = [_laid_out(first, backends.common.pass_output_shape(g, p), nhwc) for p, _, _, _ in passes]
    where = tuple(o.data_ptr() for o in outs)
    graph = entry.graphs.get(where)
    if graph is not None:
        graph[0].replay()
        _graph_counts["replays"] += 1
        return outs
    if entry.runs < GRAPH_AFTER or where not in entry.seen:
        entry.runs += 1
        entry.seen = (entry.seen + [where])[-GRAPH_SEEN:]
        _graph_counts["eager"] += 1
        global _measuring
        _measuring = measured = _Temporaries()
        try:
            outs = _into(outs, _isolated(backend, geometry, passes, nhwc, bias, outs))   # results given back
        finally:
            _measuring = None
        # the layer's first eager call may have tuned (auto's candidates): 0, seen; its later ones count
        _temporaries[kind], _footprints[kind] = measured.transient() if kind in _temporaries else (0, 0)
        limit = backends.config.get("pass_graph_mb")
        if limit is not None and _temporaries[kind] > limit * 2**20:
            _over.add(kind)
            for k, e in _pass_graphs.items():   # its keys' graphs, captured before a count went over: dropped
                if k[1] == kind:
                    e.off, e.graphs = True, {}
            log.info("pass graphs: %s takes %.1f MiB of temporaries, over pass_graph_mb (%g); it runs eagerly",
                     _what(backend, geometry, names), _temporaries[kind] / 2**20, limit)
        return outs
    what = _what(backend, geometry, names)
    if entry.captures >= GRAPH_CAPTURES:
        entry.off, entry.graphs = True, {}
        log.info("pass graphs: %s's results moved %d times; it runs eagerly", what, entry.captures)
        return None
    entry.captures += 1
    try:
        graph = _capture(backend, geometry, passes, nhwc, bias, outs, index, stream)
    except Exception as e:  # noqa: BLE001 - whatever a capture refuses: the passes run eagerly
        entry.off, entry.graphs = True, {}
        _graph_counts["failed"] += 1
        log.warning("pass graphs: %s could not be captured (%s: %s); it runs eagerly", what, type(e).__name__,
                    str(e)[:200])
        _capture_on.pop((index, stream), None)   # its pool: PyTorch may still count it as being captured into
        return None
    _families[backend, geometry, names] -= 8
    while len(entry.graphs) >= GRAPH_SEEN:
        entry.graphs.pop(next(iter(entry.graphs)))
    entry.graphs[where] = graph
    _graph_counts["captures"] += 1
    graph[0].replay()
    _graph_counts["replays"] += 1
    return outs


def _what(backend, geometry, names):
    return f"{'+'.join(p for p, _ in names)} on {backend} of x {geometry[0]}, w {geometry[1]}"


def _into(outs, results):
    """outs, each overwritten with its result (unless the pass wrote it there: the same tensor)."""
    for out, result in zip(outs, results):
        if result is not out:
            out.copy_(result)
    return outs


def _isolated(backend, geometry, passes, nhwc, bias, outs=None):
    """The crossing's passes sharing spectra among themselves alone: a view dict and a spectrum
    block of their own, fprop keeping nothing for the backward (a pass graph holds nothing past
    its end). outs: as _passes takes them."""
    with _view_block(), backends.reuse_spectra(inputs=False):
        return _passes(backend, geometry, [(p, a, b, () if p == "fprop" else later) for p, a, b, later in passes],
                       nhwc, bias, outs)


def _arena_for(index, stream):
    """The _Arena for a capture on this device and stream: sized to the largest footprint counted on
    the device (_footprints: a layer's temporaries cut in their order, first fit, as a capture of its
    passes cuts them; the layers over pass_graph_mb left out, and not only the layers captured so
    far: a layer's later capture then finds it large enough), made anew where that outgrew the last
    one, whose graphs are then dropped first (captured again at their keys' next calls, into the new
    one); None where nothing was counted, or where PyTorch cannot give the new one (the capture
    then takes its temporaries from the pool, as before the arena)."""
    need = max((t for kind, t in _footprints.items() if kind[0] == index and kind not in _over), default=0)
    arena = _arenas.get((index, stream))
    if arena is not None and arena.size >= need:
        return arena
    if arena is not None:   # let go of it before the new one is made (a block kept past a capture keeps it)
        del _arenas[index, stream]
        for entry in _pass_graphs.values():
            entry.graphs = {w: g for w, g in entry.graphs.items() if g[3] is not arena}
        arena = None
    if not need:
        return None
    size = -(-need // 2**21) * 2**21
    try:
        tensor = torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}")
    except torch.OutOfMemoryError as e:
        log.warning("pass graphs: no %.1f MiB arena (%s); captures take their temporaries from the pool",
                    size / 2**20, str(e)[:200])
        return None
    arena = _arenas[index, stream] = _Arena(tensor.data_ptr(), size, tensor)
    return arena


def _pool_live(pool, entries):
    """Whether a graph of `entries` (_PassGraph) was captured into `pool`: PyTorch may let a pool whose
    graphs are all gone go, and it must not be captured into again."""
    return any(graph[2] == pool for entry in entries for graph in entry.graphs.values())


def _capture(backend, geometry, passes, nhwc, bias, outs, index, stream):
    """(graph, what it holds, its pool, its arena) of the crossing writing its results into outs,
    captured on a side stream of this stream's, its CuPy allocations cut from the stream's arena
    (_arena_for) and the rest from the graphs' shared pool (nothing runs: the caller replays it)."""
    arena = _arena_for(index, stream)   # first: a new arena drops the old one's graphs, perhaps a pool's last
    side, pool = _capture_on.get((index, stream), (None, None))
    if side is None or not _pool_live(pool, _pass_graphs.values()):
        # the first capture here, or every graph of the pool is gone (PyTorch may have let it go): a new one
        side, pool = _capture_on[index, stream] = side or torch.cuda.Stream(index), torch.cuda.graph_pool_handle()
        _pools.add((index, pool))
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream(index))
    with cufft_buffers.keeping_retired() as retired, torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        if arena is not None:
            _capturing[side.cuda_stream] = arena
        try:
            _into(outs, _isolated(backend, geometry, passes, nhwc, bias, outs))
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()
            raise
        finally:
            _capturing.pop(side.cuda_stream, None)
        graph.capture_end()
    return graph, (*backends.held_on_device(), *retired), pool, arena


def pass_graph_stats():
    """{"eager", "captures", "replays", "failed": crossings so far run each way under pass_graphs
    ("eager": into the addresses a capture would take, before a key's capture or where its results
    moved), "over": layers' passes (a device, backend, geometry, passes, layout and settings) found
    over pass_graph_mb, which run eagerly, "graphs": graphs alive, "pool_bytes": the bytes the pools
    captured into since the last release reserve on the GPU, "pool_free_bytes": those of them not
    allocated between replays (temporaries that did not fit the arena: torch.cuda.memory_allocated()
    counts the rest, e.g. a cuBLAS workspace made in a capture), "arena_bytes": the arenas' bytes the
    captures cut their CuPy allocations from (the graphs' temporaries; allocated, so counted by
    torch.cuda.memory_allocated()), an arena let go of included while a block cut from it is kept
    (a cufft buffer made in a capture: until backends.cufft.release_buffers())}."""
    pool_bytes = pool_free = 0
    if _pools:
        pools = {pool for _, pool in _pools}
        for seg in torch.cuda.memory_snapshot():
            if tuple(seg.get("segment_pool_id", ())) in pools:
                pool_bytes += seg["total_size"]
                pool_free += seg["total_size"] - seg["allocated_size"]
    return {**{k: _graph_counts[k] for k in ("eager", "captures", "replays", "failed")}, "over": len(_over),
            "graphs": sum(len(e.graphs) for e in _pass_graphs.values()), "pool_bytes": pool_bytes,
            "pool_free_bytes": pool_free,
            "arena_bytes": sum(a.size for a in {id(a): a for a in (*_arenas.values(), *_arena_of.values())}.values())}


def release_pass_graphs():
    """Drop every pass graph and the buffers they hold; later calls start over. PyTorch frees a pool's
    segments once no graph uses it, at the next torch.cuda.empty_cache(), except those with a block
    still allocated: a cuBLAS workspace made during a capture (PyTorch keeps one per handle and stream
    until torch._C._cuda_clearCublasWorkspaces()), a cufft scratch buffer grown during one (until
    backends.cufft.release_buffers()), and a pool a capture failed in where PyTorch never ended
    allocating to it. An arena goes with its graphs, unless a block cut from it is still kept (the
    same cufft buffer: it goes at release_buffers())."""
    for index in {index for index, _ in _pools}:
        torch.cuda.synchronize(index)  # nothing they launched still runs when their buffers go
    _pass_graphs.clear()
    _families.clear()
    _temporaries.clear()
    _footprints.clear()
    _over.clear()
    _capture_on.clear()
    _arenas.clear()   # an arena whose allocation a buffer still holds lives until that is given back
    _pools.clear()
    _graph_counts.clear()


# -- the operators ------------------------------------------------------------------------------

@torch.library.custom_op("minitorch_fft::conv2d", mutates_args=())
def _conv2d(x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int], backend: str,
            bias: Optional[Tensor] = None) -> Tensor:
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with weight (f', f, kh, kw), plus bias (f')
    if given: fprop, the bias added in place on its fresh output (or inside cuDNN's fprop: _crossing)."""
    _check_bias(x, weight, bias)
    with _as_operator():
        return _run("fprop", backend, x, weight, x.shape, weight.shape, stride, padding, bias=bias)


@torch.library.custom_op("minitorch_fft::conv2d_bprop", mutates_args=())
def _conv2d_bprop(gy: Tensor, weight: Tensor, x_shape: Sequence[int], stride: Sequence[int],
                  padding: Sequence[int], backend: str) -> Tensor:
    """gx (S, f, h, w) from gy (S, f', oh, ow): bprop."""
    with _as_operator():
        return _run("bprop", backend, gy, weight, x_shape, weight.shape, stride, padding, later=())


@torch.library.custom_op("minitorch_fft::conv2d_accgrad", mutates_args=())
def _conv2d_accgrad(gy: Tensor, x: Tensor, w_shape: Sequence[int], stride: Sequence[int],
                    padding: Sequence[int], backend: str) -> Tensor:
    """gw (f', f, kh, kw) from gy and x, summed over the batch: accGrad."""
    with _as_operator():
        return _run("accgrad", backend, gy, x, x.shape, w_shape, stride, padding, later=())


@torch.library.custom_op("minitorch_fft::conv2d_grads", mutates_args=())
def _conv2d_grads(gy: Tensor, x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int],
                  backend: str, output_mask: Sequence[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """(gx, gw, gb), those output_mask asks for (the others empty): the bias's gradient (gy summed
    over batch and space), then accGrad, then bprop on the gradOutput spectrum accGrad made. The
    traced backward's one operator: it shares what the eager backward shares inside
    reuse_spectra() (accGrad's gy spectrum serves bprop), which one operator a pass could not
    (neither knows the other runs): in the caller's reuse_spectra() block if one is open (an
    untraced call), else in a block of its own, which ends with the call. The bias's gradient is
    its too, and first, so that nothing but gy is alive for it beside the passes' workspaces: as a
    reduction of the compiled graph's, inductor ran it after the layer's accGrad and kept the
    tensors it reads alive through it (converted AlexNet b128, H200, session 30: the ReLU's output
    and a second copy of conv1's gradOutput, 190 MiB, the compiled step's peak above the stock
    model's)."""
    want_x, want_w, _ = output_mask
    with reuse_spectra(inputs=False) if _views is None and want_x and want_w else contextlib.nullcontext(), \
            _as_operator():
        grads = _grads(gy, x, weight, stride, padding, backend, *output_mask)
    return tuple(gy.new_empty(0) if g is None else g for g in grads)   # the unwanted: empty, each its own


def _grads(gy, x, weight, stride, padding, backend, want_x, want_w, want_b):
    """(gx, gw, gb), None where not wanted: the bias's gradient, then accGrad (keeping gy's spectrum
    for bprop where it runs next, inside reuse_spectra()), then bprop. Both paths' backward."""
    gb = _bias_grad(gy) if want_b else None
    passes = []
    if want_w:   # first: the comment above EagerConv2d
        passes.append(("accgrad", gy, x, ("bprop",) if want_x else ()))
    if want_x:
        passes.append(("bprop", gy, weight, ()))
    grads = iter(_crossing(backend, x.shape, weight.shape, stride, padding, passes, _nhwc(x, weight))
                 if passes else ())
    gw = next(grads) if want_w else None
    gx = next(grads) if want_x else None
    return gx, gw, gb


def _bias_grad(gy):
    """gy (S, f', oh, ow) summed over batch and space: the bias's gradient (f'). On CUDA, where gy
    is dense (NCHW or channels-last), a matrix-vector product with a vector of ones (cuBLAS's
    GEMV, which PyTorch runs with TF32 off whatever its settings; NCHW then sums the batch's (S,
    f') partial sums): it reads gy once at near the memory's speed where
    PyTorch's reduction over (0, 2, 3) took about twice as long (VGG-16 b64, H200: 0.94 against
    1.79 ms a step channels-last, 1.00 against 1.49 NCHW; exp_bias_fusion, session 43). The ones
    are the call's own, freed before the passes run: any vector kept across calls is memory the
    stock model does not hold at its peak (kept, VGG-16 b64's longest, 12.25 MiB, put the
    converted step's peak that much over the stock model's; kept up to 1 MiB, 0.77 MiB: session
    43, calls 3 and 4). Like any of PyTorch's GEMMs, the first on a stream makes PyTorch's cuBLAS
    workspace for it (32 MiB on an H200), kept: a model without a Linear layer of its own holds it
    beside the stock model's peak. Under autocast (mv is among its float16 operations) and
    deterministic algorithms (PyTorch's cuBLAS GEMV asks for CUBLAS_WORKSPACE_CONFIG), the sum."""
    if (not gy.is_cuda or gy.dim() != 4 or gy.dtype != torch.float32 or gy.numel() == 0
            or torch.is_autocast_enabled("cuda") or torch.are_deterministic_algorithms_enabled()):
        return gy.sum((0, 2, 3))
    s, c, h, w = gy.shape
    if gy.is_contiguous():
        rows, n = gy.view(s * c, h * w), h * w          # (planes of the batch, positions)
    elif gy.is_contiguous(memory_format=torch.channels_last):
        rows, n = gy.permute(0, 2, 3, 1).reshape(-1, c).t(), s * h * w   # a view: (f', positions)
    else:
        return gy.sum((0, 2, 3))
    sums = torch.mv(rows, torch.ones(n, dtype=torch.float32, device=gy.device))
    return sums if rows.shape[0] == c else sums.view(s, c).sum(0)


def _check_bias(x, weight, bias):
    """A bias, if any, is float32 on x's device with one value per output plane (before any pass)."""
    if bias is None:
        return
    _check_float32("fprop", x, bias)
    if tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"minitorch_fft.conv2d: bias of shape {tuple(bias.shape)} for a weight of shape "
                         f"{tuple(weight.shape)}: it takes one value per output plane, ({weight.shape[0]},)")


def _add_bias(y, bias):
    if bias is not None:
        y.add_(bias.view(1, -1, 1, 1))
    return y


def _out_size(size, k, s, p):
    return (size + 2 * p - k) // s + 1   # SymInt arithmetic under dynamic shapes


@_conv2d.register_fake
def _(x, weight, stride, padding, backend, bias=None):
    _check_float32("fprop", x, weight)
    _check_bias(x, weight, bias)
    torch._check(x.dim() == 4 and weight.dim() == 4 and x.shape[1] == weight.shape[1],
                 lambda: f"conv2d: input {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    oh = _out_size(x.shape[2], weight.shape[2], stride[0], padding[0])
    ow = _out_size(x.shape[3], weight.shape[3], stride[1], padding[1])
    return _laid_out(x, (x.shape[0], weight.shape[0], oh, ow), _nhwc(x, weight))


@_conv2d_bprop.register_fake
def _(gy, weight, x_shape, stride, padding, backend):
    _check_float32("bprop", gy, weight)
    return _laid_out(gy, x_shape, _nhwc(gy, weight))


@_conv2d_accgrad.register_fake
def _(gy, x, w_shape, stride, padding, backend):
    _check_float32("accgrad", gy, x)
    return _laid_out(gy, w_shape, _nhwc(gy, x))


@_conv2d_grads.register_fake
def _(gy, x, weight, stride, padding, backend, output_mask):
    _check_float32("accgrad", gy, x)
    _check_float32("bprop", gy, weight)
    want_x, want_w, want_b = output_mask
    nhwc = _nhwc(x, weight)
    return (_laid_out(gy, x.shape, nhwc) if want_x else gy.new_empty(0),
            _laid_out(gy, weight.shape, nhwc) if want_w else gy.new_empty(0),
            gy.new_empty(weight.shape[0] if want_b else 0))


def _setup_context(ctx, inputs, output):
    x, weight, stride, padding, backend, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.geometry = (list(stride), list(padding), backend)


def _backward(ctx, gy):
    """The gradients of (x, weight, bias) that are wanted, from one operator, conv2d_grads: the
    bias's, accGrad's and then bprop's (the comment above EagerConv2d). This path is the traced one
    (torch.compile, which plans its own memory), where the caller's reuse_spectra() is not entered.
    Gradients for the operator's inputs, in their order: x, weight, stride, padding, backend, bias."""
    x, weight = ctx.saved_tensors
    stride, padding, backend = ctx.geometry
    need = ctx.needs_input_grad       # without bias, a call to the operator that left it out has 5
    mask = [need[0], need[1], len(need) > 5 and need[5]]
    if not any(mask):
        return (None,) * len(need)
    grads = torch.ops.minitorch_fft.conv2d_grads(gy, x, weight, stride, padding, backend, mask)
    gx, gw, gb = (g if wanted else None for g, wanted in zip(grads, mask))
    return (gx, gw, None, None, None, gb)[:len(need)]


_conv2d.register_autograd(_backward, setup_context=_setup_context)
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("minitorch_fft::conv2d", _device, torch.float32)


# -- the eager path: the same passes without the dispatcher ---------------------------------------
# torch.ops' Python (custom_op's dispatch and autograd wrapper) costs ~95 us a call on an H100
# (benchmarks/NOTES.md, session 11), more than some passes take on the GPU. An eager call has no
# use for it, so conv2d() runs EagerConv2d there; whatever must see the operator (Dynamo, make_fx,
# FakeTensorMode and other dispatch modes, functorch's transforms) gets torch.ops, as do direct
# callers of torch.ops.minitorch_fft.conv2d. Both end in _crossing (through _run and _grads), so they
# compute the same thing.

# A layer's backward runs accGrad before bprop. In a step the memory peaks in the backward, and
# there the order decides what is alive beside each pass's workspace: bprop first keeps its output
# (the input gradient, as large as the layer's input) alive through accGrad, whose FFT workspace
# holds both operands' spectra and the weight's (AlexNet b128's features.8 in TF32 mode: 207 MB
# beside a 33 MB input gradient, the converted step 22 MiB above the stock model's peak, session
# 23); accGrad first keeps only the weight gradient alive through bprop.


class EagerConv2d(torch.autograd.Function):
    """The operator's forward and backward as an autograd.Function, its arguments in the operator's
    order: fprop (and the bias), then the bias's gradient, accGrad and bprop, each only where its
    input needs a gradient (the profiler lists it by this name)."""

    @staticmethod
    def forward(ctx, x, weight, stride, padding, backend, bias):
        _check_bias(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.geometry = (stride, padding, backend)   # lists, as _setup_context keeps them
        return _run("fprop", backend, x, weight, x.shape, weight.shape, stride, padding, bias=bias)

    @staticmethod
    def backward(ctx, gy):
        if torch.is_grad_enabled():
            # backward(create_graph=True): the operators' backward, whose passes have no derivative
            # registered, so that autograd says so if a second backward reaches them, as it does
            # for the operator (geometry and saved tensors are kept alike for this)
            return _backward(ctx, gy)
        x, weight = ctx.saved_tensors
        stride, padding, backend = ctx.geometry
        need_x, need_w, *_, need_b = ctx.needs_input_grad
        gx, gw, gb = _grads(gy, x, weight, stride, padding, backend, need_x, need_w, need_b)
        return gx, gw, None, None, None, gb

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(_NO_FORWARD_AD)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager(*tensors):
    """Whether a call may run EagerConv2d: plain CPU or CUDA tensors (a bias of None aside), and
    nothing that must see the operator (Dynamo first: it then folds the rest away; a dispatch mode
    such as FakeTensorMode or make_fx's; a torch function mode; functorch's vmap/grad; the JIT tracer)."""
    return (not torch.compiler.is_compiling()
            and all(t is None or type(t) in _PLAIN for t in tensors) and (tensors[0].is_cuda or tensors[0].is_cpu)
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._is_torch_function_mode_enabled()
            and torch._C._functorch.peek_interpreter_stack() is None
            and not torch._C._get_tracing_state())


# Whether autocast is on for any device type: one C call where PyTorch has it, else "maybe", and
# _autocast asks the tensors' device type.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast(*tensors):
    """The tensors as the operator's autocast rule hands them on (torch.library.register_autocast
    to float32, below): under autocast for their device type, floating-point tensors other than
    float64 cast to float32, differentiably (None, a missing bias, stays None)."""
    if not _any_autocast():
        return tensors
    kind = tensors[0].device.type
    if not torch.is_autocast_enabled(kind):
        return tensors
    return tuple(t.float() if t is not None and t.is_floating_point() and t.dtype != torch.float64
                 and t.device.type == kind else t for t in tensors)


_NO_FORWARD_AD = ("minitorch_fft.pytorch.conv2d has no forward-mode derivative (torch.autograd.forward_ad, "
                  "torch.func.jvp, jacfwd, hessian): use reverse mode (loss.backward(), torch.autograd.grad), or "
                  "torch.nn.Conv2d for the layers that need it")
_NO_FUNC_GRAD = ("minitorch_fft.pytorch.conv2d runs under torch.func.vmap and functional_call, but cannot be "
                 "differentiated by torch.func's derivative transforms (grad, grad_and_value, vjp, jacrev, jvp, "
                 "jacfwd, hessian): use torch.autograd (loss.backward(), torch.autograd.grad), or "
                 "torch.nn.Conv2d for the layers that need them")


def _under_func_derivative(*tensors):
    """Whether a torch.func transform that differentiates (grad, vjp, jvp and those built on them)
    tracks one of the tensors. custom_op's autograd cannot serve one (PyTorch raised an error that
    asks for an autograd.Function's setup_context under grad, and jvp and jacfwd gave zero tangents,
    silently); vmap can (custom_op's fallback runs the operator per sample), and so can a transform
    that tracks none of them (a frozen layer inside grad or jvp). Not asked under Dynamo, which
    cannot trace the question: there, jvp still gives zero tangents (PyTorch's custom_op)."""
    functorch = torch._C._functorch
    if functorch.peek_interpreter_stack() is None or torch.compiler.is_compiling():
        return False
    for t in tensors:
        while isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t):
            if functorch.is_gradtrackingtensor(t):   # grad's and jvp's wrapper, at some level
                return True
            t = functorch.get_unwrapped(t)
    return False


def conv2d(x, weight, stride=1, padding=0, backend="auto", bias=None):
    """torch.ops.minitorch_fft.conv2d with int-or-pair stride and padding, and the bias (f') added
    if given; an eager call runs EagerConv2d instead, the same passes without the dispatcher.
    NotImplementedError under torch.func's derivative transforms and forward-mode AD
    (_under_func_derivative; a direct torch.ops call there is not checked)."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        # TypeError, as nn.Conv2d's, not the dispatcher's; a tracer's proxy (torch.fx) takes Tensors' place
        if t is not None and not isinstance(t, torch.Tensor) and not hasattr(type(t), "__torch_function__"):
            raise TypeError(f"conv2d: {name} must be a torch.Tensor, got {type(t).__name__}")
    stride, padding = _pair(stride, "stride"), _pair(padding, "padding")
    if _under_func_derivative(x, weight, bias):
        raise NotImplementedError(_NO_FUNC_GRAD)
    if _eager(x, weight, bias):
        x, weight, bias = _autocast(x, weight, bias)
        return EagerConv2d.apply(x, weight, stride, padding, backend, bias)
    return torch.ops.minitorch_fft.conv2d(x, weight, stride, padding, backend, bias)


def _pair(v, name):
    """[h, w] of an int or a pair of ints (NumPy's too, as PyTorch takes them); TypeError naming the
    argument otherwise (a float, None, a string such as 'same': nn.functional.conv2d's to run)."""
    return list(backends.utils.pair(v, f"conv2d: {name}"))


# -- the module and the conversion --------------------------------------------------------------

def unsupported(conv):
    """Why this nn.Conv2d cannot run on the backends (a string), or None if it can."""
    if type(conv) is not torch.nn.Conv2d and not isinstance(conv, Conv2d):   # a subclass of ours is the user's
        return f"{type(conv).__name__} is a subclass of nn.Conv2d (its forward may differ)"
    if conv.groups != 1:
        return f"groups={conv.groups} (the backends take groups=1)"
    dilation = torch.nn.modules.utils._pair(conv.dilation)   # an int set on a layer stays an int
    if dilation != (1, 1):
        return f"dilation={dilation} (the backends take dilation 1)"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (the backends zero-pad)"
    if isinstance(conv.padding, str):
        return f"padding={conv.padding!r} (numeric padding only)"
    return None


def _check_backend(backend):
    """ValueError for a backend name that is not registered, or one that cannot run in this process
    (cudnn without cuDNN's frontend, libcudnn or a GPU): said when the layer is made, not at its
    first forward."""
    if backend != "auto":
        module = backends.get(backend)   # ValueError naming the registered ones
        if not getattr(module, "available", lambda: True)():
            why = getattr(module, "_frontend", lambda: (None, "not available"))()[1]
            raise ValueError(f"backend {backend!r} cannot run in this process ({why}); use 'auto' or another of "
                             f"{[n for n in backends.names() if n != backend]}")


@torch.fx.wrap
def _layer(x, weight, bias, stride, padding, backend):
    """Conv2d's forward. What nn.Conv2d takes beside a batch, it takes too: an unbatched (C, H, W)
    image, as a batch of one; an empty batch, through PyTorch's own convolution (an empty output
    and gradients). The bias goes into the operator, which adds it in place on its fresh output (as
    nn.Conv2d's cuDNN path does: no second output-sized tensor; a channels-last layer on cuDNN may
    add it inside the convolution) and returns its gradient from the layer's backward operator
    (conv2d_grads: why). A leaf of torch.fx's symbolic tracing (torch.fx.wrap), so that a traced
    model (torch.fx.symbolic_trace, torchvision's create_feature_extractor) calls this, with its
    branches, where tracing through it would keep only the operator's call."""
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return _layer(x.unsqueeze(0), weight, bias, stride, padding, backend).squeeze(0)
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[0] == 0:
        return torch.nn.functional.conv2d(x, weight, bias, stride, padding)   # groups, dilation 1 (unsupported())
    return conv2d(x, weight, stride, padding, backend, bias)


_GEOMETRY_ATTRIBUTES = frozenset({"groups", "dilation", "padding_mode", "padding"})   # what unsupported() reads


class Conv2d(torch.nn.Conv2d):
    """nn.Conv2d on the project's backends: same arguments, parameters, init, state_dict keys;
    `backend` one of backends.names() or "auto". groups 1, dilation 1 and numeric zero padding
    only (ValueError otherwise)."""

    def __init__(self, *args, backend="auto", **kwargs):
        super().__init__(*args, **kwargs)
        _check_backend(backend)
        reason = unsupported(self)
        if reason is not None:
            raise ValueError(f"minitorch_fft.pytorch.Conv2d: {reason}; use torch.nn.Conv2d")
        self.backend = backend

    def __setattr__(self, name, value):
        """A converted layer's groups, dilation, padding_mode or padding set to what the backends do
        not take is refused (ValueError; the old value kept), not run as if zero-padded: set them
        before convert(), which leaves such layers as nn.Conv2d."""
        if name not in _GEOMETRY_ATTRIBUTES or "backend" not in self.__dict__:   # nn.Conv2d.__init__ sets them first
            return super().__setattr__(name, value)
        missing = object()
        old = getattr(self, name, missing)   # (nn.Conv2d's __setstate__ sets a padding_mode an old pickle lacks)
        super().__setattr__(name, value)
        try:
            reason = unsupported(self)
        except Exception:   # a value unsupported() cannot read (dilation=None): refused as well
            reason = f"{name}={value!r}"
        if reason is not None:
            if old is missing:
                object.__delattr__(self, name)
            else:
                super().__setattr__(name, old)
            raise ValueError(f"minitorch_fft.pytorch.Conv2d: {reason}; set it before convert(), which leaves such "
                             "layers as nn.Conv2d, or use torch.nn.Conv2d")

    def forward(self, x):
        return _layer(x, self.weight, self.bias, self.stride, self.padding, self.backend)

    def __prepare_scriptable__(self):
        """torch.jit.script asks every module of a model this first: TorchScript cannot compile the
        forward's Python (NumPy or CuPy under it), and failed deep inside with "function '_layer' is
        called recursively". torch.jit.trace, torch.export, torch.fx and torch.compile take it."""
        raise TypeError("minitorch_fft.pytorch.Conv2d cannot be scripted (torch.jit.script): its forward runs "
                        "Python on NumPy or CuPy; trace it (torch.jit.trace, torch.export), or use torch.compile")

    def extra_repr(self):
        return f"{super().extra_repr()}, backend={self.backend!r}"


def convert(model, backend="auto", channels_last=False):
    """Every nn.Conv2d of `model` it can serve becomes a Conv2d in place (the same module object,
    so the same Parameters, hooks and state_dict keys); returns the model. The layers left alone
    are logged (logger minitorch_fft.pytorch) with the reason; unsupported() says it for one.

    channels_last=True also runs the model channels-last, as `model.to(memory_format=
    torch.channels_last)` would: every 4-d parameter, gradient and buffer re-laid channels-last in
    place (the same tensor objects, whatever torch.__future__ says; the same values and state_dict;
    5-d ones left as they are; the gradients the layers make later are channels-last too). The model's
    inputs are not copied: a convolution whose weight is
    channels-last gives a channels-last output whatever its input's layout (ours as PyTorch's own),
    so the first layer takes the caller's NCHW batch as it is (a pass that needs it channels-last
    lays out a transient copy, freed after the pass; the tensor kept for the backward is the
    caller's), and from its output on the activations are channels-last: elementwise ops, batch norm
    and pooling keep the layout (but for an activation of one channel, which PyTorch's elementwise
    kernels give C order's strides), so each later converted layer takes the channels-last routes
    (cuDNN's NHWC plans without layout conversion, the 1x1 GEMM, or our NCHW passes on copies: see
    above). A weight of one input channel or a 1x1 kernel, which is NCHW- and NHWC-contiguous
    both, is strided exactly channels-last, as model.to() lays it out, and counts so (only a 1x1
    kernel on one channel, the same strides either way, says nothing: that layer follows its input's
    layout). It is meant for NCHW models in TF32 mode: there our NCHW calls into cuDNN convert layouts inside
    cuDNN at every pass (workspace and time; 5.3 ms of ResNet-50 b128's 42 ms of kernels under
    torch.compile), where inductor runs a stock model channels-last under torch.compile (session
    61, reduce-overhead against the stock NCHW model: ResNet-50 b128 1.01-1.03x, where the NCHW
    layers run 0.82x; VGG-16 b64 0.99x, its peak under stock's with MINITORCH_NHWC_ROUTE_MB=64).
    What channels-last changes for the model's own code: `x.view(n, -1)` of a channels-last
    activation raises (reshape and flatten do not), code that reads storage as NCHW reads other
    values, and an optimizer made before convert() keeps its state NCHW (PyTorch's fused optimizers
    then compute wrong steps): convert first, then make the optimizer. channels_last=False leaves
    the model's layout as it finds it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert() takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(channels_last, bool):
        raise TypeError(f"convert(): channels_last takes True or False, got {channels_last!r}")
    _check_backend(backend)
    if channels_last:
        lazy = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
                if torch.nn.parameter.is_lazy(t)]
        if lazy:
            raise ValueError(f"convert(channels_last=True): {len(lazy)} uninitialized (lazy) parameters or buffers "
                             f"({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}), whose layout cannot be "
                             "set; run one forward first, then convert")
    converted, left = 0, []
    for name, m in model.named_modules():
        if isinstance(m, Conv2d):
            m.backend = backend
            converted += 1
        elif isinstance(m, torch.nn.Conv2d):
            reason = unsupported(m)
            if reason is None:
                m.__class__, m.backend = Conv2d, backend
                converted += 1
            else:
                left.append((name, reason))
    for name, reason in left:
        log.warning("convert: left %s as nn.Conv2d: %s", name or "the model", reason)
    log.info("convert: %d Conv2d layers on backend %r, %d left alone", converted, backend, len(left))
    if channels_last:
        with torch.no_grad():   # in place, not model.to(): the same tensors, shared buffers still shared
            for t in itertools.chain(model.parameters(), model.buffers()):
                for u in (t, t.grad):
                    if u is not None and u.dim() == 4 and u.stride() != _dense_strides(u.shape, True):
                        # strided channels-last even where NCHW-contiguous too (one channel, 1x1): a copy;
                        # none where so strided already (a second convert: the same storage, as a graph took it)
                        u.data = torch.empty_like(u.data, memory_format=torch.channels_last).copy_(u.data)
    return model


__all__ = ["Conv2d", "EagerConv2d", "GeometryError", "convert", "conv2d", "pass_graph_stats", "release_pass_graphs",
           "reuse_spectra", "unsupported"]
