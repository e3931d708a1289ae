"""Convolution backends: one module per algorithm, one explicit registry.

Every backend module exposes the same four functions (Torch's three passes plus
a capability predicate):

  fprop(x, w, stride=(1, 1), padding=(0, 0)) -> y
  bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0)) -> gx
  accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0)) -> gw
  supports(x_shape, w_shape, stride, padding) -> bool

Arrays are float32 NCHW, NumPy or CuPy, and come back of the same kind. Bias is
added outside the backends. Cross-correlation, as in Torch and PyTorch.

`with reuse_spectra():` around one training step (forward and backward) lets the FFT
backends compute each x, w and gy spectrum once and share it across the passes
(backends/reuse.py); train.py does this by default.
"""
import functools
import math
import warnings

import numpy as np

from . import auto, common, config, cudnn, cufft, direct, fbfft, gemm, layout, polyphase, reuse, tiledfft, winograd
from .common import PASSES, GeometryError, geometry
from .reuse import reuse_spectra
from .device import get_array_module

_REGISTRY = {
    "gemm": gemm,
    "cufft": cufft,
    "fbfft": fbfft,
    "direct": direct,
    "polyphase": polyphase,  # strided layers, as fbfft (or cufft) on their polyphase components
    "winograd": winograd,    # 3x3 stride-1 layers, F(2x2,3x3) / F(4x4,3x3)
    "tiledfft": tiledfft,    # stride-1 layers as overlap-save FFTs on 8/16/32-point tiles
    "cudnn": cudnn,          # NVIDIA's library (a vendor backend, below); GPU only, optional extra
}


# Backends that wrap a vendor's library rather than an algorithm of ours. The setting
# auto_backends=ours leaves them out, so the benchmarks can report "ours alone" beside "with cuDNN".
VENDOR = ("cudnn",)


def names(device=None):
    """The registered backends (``"auto"`` is a layer option, not a backend); with `device` ("cpu" or
    "cuda"), those that run there (a backend's DEVICES tuple, both where it declares none)."""
    if device is None:
        return list(_REGISTRY)
    return [n for n, b in _REGISTRY.items() if device in getattr(b, "DEVICES", ("cpu", "cuda"))]


def get(name):
    """The backend module called `name`; ValueError for an unknown name."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown convolution backend {name!r}; registered: {names()} "
                         "(layers also accept 'auto')")
    return _REGISTRY[name]


def auto_registry():
    """The backends auto may choose from: the registry as the auto_backends setting
    ($MINITORCH_AUTO_BACKENDS) restricts it (auto.OPT_IN's only where it names them); ValueError
    for a name that is not registered."""
    wanted = config.get("auto_backends")
    if wanted is None:
        return _REGISTRY
    if wanted == ("ours",):
        return {n: b for n, b in _REGISTRY.items() if n not in VENDOR}
    unknown = [n for n in wanted if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"{config.SETTINGS['auto_backends'].env} names {unknown}, which are not "
                         f"registered backends; registered: {names()} (or 'ours' for all but {list(VENDOR)})")
    return {n: _REGISTRY[n] for n in wanted}


def choose(name, pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0), xp=np):
    """The backend that runs `pass_name` of this geometry under the layer's setting `name`
    ("auto" asks the autotuner, which may time the candidates on `xp`'s device once)."""
    if pass_name not in PASSES:
        raise ValueError(f"unknown pass {pass_name!r}; expected one of {PASSES}")
    if name == "auto":
        registry = auto_registry()
        picked = auto.remembered(registry, pass_name, x_shape, w_shape, stride, padding, xp)
        if picked is not None:                       # every call after a layer's first
            return registry[picked]
        geometry(x_shape, w_shape, stride, padding)  # an invalid geometry says why first
        with reuse.suspended():  # a timed candidate pays for its own FFTs, every repeat
            picked = auto.pick(registry, pass_name, x_shape, w_shape, stride, padding, xp)
        if picked is None:
            raise ValueError(f"no backend supports input {tuple(x_shape)}, weight {tuple(w_shape)}, "
                             f"stride {stride}, padding {padding}"
                             + ("" if registry is _REGISTRY else f" among {list(registry)}, the candidates the "
                                f"auto_backends setting ({config.SETTINGS['auto_backends'].env}) leaves"))
        return registry[picked]
    backend = get(name)
    if not backend.supports(x_shape, w_shape, stride, padding):
        geometry(x_shape, w_shape, stride, padding)  # an invalid geometry says why first
        raise ValueError(f"backend {name!r} does not support {pass_name} for input {tuple(x_shape)}, "
                         f"weight {tuple(w_shape)}, stride {stride}, padding {padding}"
                         f"{_reason(backend, x_shape, w_shape, stride, padding)}; "
                         f"use backend='auto'{_takers(name, x_shape, w_shape, stride, padding, xp)}")
    return backend


def _takers(name, x_shape, w_shape, stride, padding, xp):
    """A refusal's list of the other backends that support the geometry and run on `xp`'s arrays
    (supports() says whether in this process: cudnn's is False without its frontend)."""
    takers = [n for n in names() if n != name and get(n).supports(x_shape, w_shape, stride, padding)
              and auto.runs_on(get(n), xp)]
    return f" or one that takes it here: {takers}" if takers else " (no other backend takes it here)"


def nhwc_route(pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0), xp=np, measure=None):
    """How "auto" runs `pass_name` of a channels-last layer on `xp`'s arrays: "cudnn" (cuDNN's NHWC
    plans on the arrays as they are, where cudnn is among its candidates and supports the geometry),
    "gemm" (a 1x1 kernel without padding, with gemm among the candidates: gemm's GEMMs on the pixels)
    or "nchw" (copies to NCHW, run_pass's auto pass, the result copied back), timed once and cached
    (auto.nhwc_route; "nchw" untimed where it is the only route). measure: a context manager that
    counts the temporaries allocated in it (auto.nhwc_route: the routes' memory, weighed under the
    nhwc_route_mb setting)."""
    return auto.nhwc_route(auto_registry(), run_pass, pass_name, x_shape, w_shape, stride, padding, xp, measure)


def _reason(backend, x_shape, w_shape, stride, padding):
    """': <the backend's own explanation>' where it has check_geometry() (its limit), else ''."""
    check = getattr(backend, "check_geometry", None)
    if check is not None:
        try:
            check(x_shape, w_shape, stride, padding)
        except ValueError as e:
            return f" ({e})"
    return ""


def _is_out_of_memory(exc):
    """CuPy's OutOfMemoryError is a MemoryError; PyTorch's (torch.OutOfMemoryError, a RuntimeError:
    the PyTorch adapter's passes allocate from PyTorch's caching allocator) is matched by name, so
    that this module does not import torch; cuFFT reports plan allocation failures itself."""
    return (isinstance(exc, MemoryError) or any(t.__name__ == "OutOfMemoryError" for t in type(exc).__mro__)
            or "CUFFT_ALLOC_FAILED" in str(exc))


_warned = set()
_prepared = {}   # (name, pass, x_shape, w_shape, stride, padding, config.state()) -> _Prepared


def run_pass(name, pass_name, *args, x_shape, w_shape, stride, padding, later=None):
    """Run one pass on the backend chosen for it. If that backend runs out of GPU memory,
    free what it allocated and fall back to `gemm` with a small workspace (the batch then
    goes through in chunks, down to one image), saying so once per layer geometry.

    later: the passes the layer will still run on these arrays in this step (default: every pass
    after this one), so that inside reuse_spectra() a pass keeps only spectra one of them takes.

    A layer's GPU calls after its first take a prepared path (_Prepared): one lookup on the
    arguments as given and the settings' state, the arrays checked, then the backend's call for
    this geometry (its prepare()'d one where it offers one, else its pass function), with none of
    the choosing and checking in between."""
    try:
        ready = _prepared.get((name, pass_name, x_shape, w_shape, stride, padding, config.state()))
    except TypeError:   # unhashable shapes (lists): the full path below takes them
        ready = None
    if ready is not None:
        out = ready(args, later)
        if out is not None:
            _drop_unclaimed(pass_name, later, args[0])
            return out
    xp = get_array_module(*args[:2])
    backend = choose(name, pass_name, x_shape, w_shape, stride, padding, xp)
    _check_output_fits(backend, pass_name, xp, x_shape, w_shape, stride, padding)
    call = lambda b: getattr(b, pass_name)(*args, stride=stride, padding=padding)  # noqa: E731
    try:
        if reuse.active() is None:
            out = call(backend)
        else:
            roles, _ = _kept_roles(name, pass_name, backend, later, xp, x_shape, w_shape, stride, padding)
            with reuse.keeping(roles):
                out = call(backend)
    except Exception as e:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if not _is_out_of_memory(e):
            raise
        # Keep the message, not the exception: its traceback pins the failed attempt's
        # frames and with them every buffer it allocated (seen: 533 MB kept on an H200).
        first_error = f"{type(e).__name__}: {e}"
    else:
        _prepare(name, pass_name, backend, args, xp, x_shape, w_shape, stride, padding)
        _drop_unclaimed(pass_name, later, args[0])
        return out
    _release(backend)
    budget_mb = config.get("gemm_workspace_mb")
    while True:
        budget_mb /= 4
        key = (backend.__name__, pass_name, tuple(x_shape), tuple(w_shape))
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"{backend.__name__.split('.')[-1]} ran out of GPU memory in {pass_name} for input "
                          f"{tuple(x_shape)}, weight {tuple(w_shape)} ({first_error}); falling back to gemm "
                          f"with a {budget_mb:g} MiB workspace", ResourceWarning, stacklevel=3)
        try:
            with config.override(gemm_workspace_mb=budget_mb):
                return call(gemm)
        except Exception as e:  # noqa: BLE001
            if not _is_out_of_memory(e) or budget_mb < 2**-20:   # one byte: a single image already
                raise
            _free_gpu_pool()


def _drop_unclaimed(pass_name, later, gy):
    """After a layer's last pass of the step (a backward pass with no pass of the layer to come),
    drop any spectrum of its gy still kept: the earlier backward pass kept it for this one, which
    ran on another backend or basis (backends/reuse.py, Hazards). No-op outside reuse_spectra()."""
    block = reuse.active()
    if (block is None or not len(block) or pass_name == "fprop"
            or (PASSES[PASSES.index(pass_name) + 1:] if later is None else later)):
        return
    block.discard(gy, "gy")


class _Prepared:
    """One pass of one geometry as run_pass last ran it: run(a, b) is the backend's call for it (its
    prepare(pass_name, g, xp), e.g. cudnn's built plan, gemm's fused kernel launch; else its pass
    function with the geometry's other arguments bound), taken while nothing that decided it has
    changed, and where the arrays are those the full path would accept as they are. Otherwise (and
    where run raises) it answers None, and the full path runs, with its checks, messages and
    out-of-memory fallback.

    What decided it, and is checked on each call: the settings (config.state(), in the key), the
    device, the registry, the backend's pass function (a test may replace it), and under auto
    the tuning record the choice came from (a new process's memory, as tests make, drops it). The
    output's size is not checked against free memory again: the full path checked it at the
    geometry's first call, and where memory is short now an allocation fails, this answers None,
    and the full path checks and says so (or falls back). The check asked the driver for its free
    memory on every call in the PyTorch adapter, whose allocator is not CuPy's pool: 40-65 us
    each for converted AlexNet's two outputs above the threshold (session 37, H200).

    Spectra: gemm's, cudnn's, winograd's and tiledfft's prepare()'d calls keep none, so
    reuse_spectra() has nothing to say to them. A pass function may (cufft, polyphase over it),
    and so may the prepare()'d calls of a backend that says so (PREPARED_SPECTRA: fbfft,
    polyphase): inside a reuse_spectra() block it runs under reuse.keeping() with the roles the
    full path would give it (_kept_roles), worked out once per (later, the block's `inputs`) and
    kept from the first call at which every consumer pass had its backend chosen (before that, an
    untuned consumer counts as the same backend, and the answer may change)."""

    __slots__ = ("cp", "run", "backend", "pass_name", "fn", "registry", "device", "shapes", "rest",
                 "record_key", "record", "spectra", "where", "roles")

    def __init__(self, cp, run, backend, pass_name, args, record, spectra=False, where=None):
        self.cp, self.run, self.backend, self.pass_name = cp, run, backend, pass_name
        self.fn, self.registry, self.device = getattr(backend, pass_name), _REGISTRY, cp.cuda.runtime.getDevice()
        self.shapes, self.rest = (args[0].shape, args[1].shape), tuple(args[2:])
        self.record_key, self.record = record if record is not None else (None, None)
        self.spectra, self.where, self.roles = spectra, where, {}

    def __call__(self, args, later=None):
        a, b = args[0], args[1]
        nd = self.cp.ndarray
        if not (type(a) is nd and type(b) is nd and (a.shape, b.shape) == self.shapes
                and a.dtype == np.float32 and b.dtype == np.float32 and a.flags.c_contiguous
                and b.flags.c_contiguous and args[2:] == self.rest
                and getattr(self.backend, self.pass_name) is self.fn and _REGISTRY is self.registry
                and (self.record is None or auto._memory.get(self.record_key) is self.record)
                and self.cp.cuda.runtime.getDevice() == self.device):
            return None
        try:
            block = reuse.active() if self.spectra else None
            if block is None:
                return self.run(a, b)
            with reuse.keeping(self._roles(later, block.inputs)):
                return self.run(a, b)
        except Exception:  # noqa: BLE001 - the full path runs it again, and reports or falls back
            return None

    def _roles(self, later, inputs):
        roles = self.roles.get((later, inputs))
        if roles is None:
            name, x_shape, w_shape, stride, padding = self.where
            roles, final = _kept_roles(name, self.pass_name, self.backend, later, self.cp, x_shape, w_shape,
                                       stride, padding)
            if final:
                self.roles[(later, inputs)] = roles
        return roles


def _prepare(name, pass_name, backend, args, xp, x_shape, w_shape, stride, padding):
    """After a full call on the GPU: remember the call for the next ones (_Prepared): the backend's
    prepare()'d one where it offers one, else its pass function with this geometry bound."""
    if xp is np or not common.plain_args(x_shape, w_shape, stride, padding):
        return
    g = geometry(x_shape, w_shape, stride, padding)
    record = None
    if name == "auto":
        record = auto.record_of(pass_name, x_shape, w_shape, stride, padding, xp)
        if record is None:
            return
    prepare = getattr(backend, "prepare", None)
    run = None if prepare is None else prepare(pass_name, g, xp)
    spectra = run is None or getattr(backend, "PREPARED_SPECTRA", False)
    if run is None:
        run = functools.partial(_pass_call, getattr(backend, pass_name), tuple(args[2:]), stride, padding)
    _prepared[(name, pass_name, x_shape, w_shape, stride, padding, config.state())] = \
        _Prepared(xp, run, backend, pass_name, args, record, spectra, (name, x_shape, w_shape, stride, padding))


def _pass_call(fn, rest, stride, padding, a, b):
    """A backend's pass function on (a, b, *rest): a prepared call's run where it has no prepare()."""
    return fn(a, b, *rest, stride=stride, padding=padding)


# Which later pass takes each spectrum a pass computes (backends/reuse.py's table). accGrad's gy
# goes to bprop where a caller runs bprop after it (the PyTorch adapter: later=("bprop",)).
_CONSUMER = {"fprop": {"x": "accgrad", "w": "bprop"}, "bprop": {"gy": "accgrad"}, "accgrad": {"gy": "bprop"}}


def _kept_roles(name, pass_name, backend, later, xp, x_shape, w_shape, stride, padding):
    """(roles, final): the spectra roles `pass_name` on `backend` may keep for a later pass of the
    layer: those whose consumer runs later, on the same backend. Under auto a consumer not tuned yet
    counts as the same (the first step keeps what it may need, as before), and final is False then
    (the answer may change once it is tuned). A weight's spectrum only where
    the reuse_weight_spectra setting asks: it is 10-40x the weight (a 3x3 kernel's 16x16 basis:
    1152 bytes for 36), and kept from fprop to bprop every layer's is alive at the end of
    forward, the step's peak (AlexNet b128 under auto: 1.54 -> 1.33 GiB without them, PyTorch
    strict 1.46; its step 9.1 -> 10.3 ms, one run on an H100, exp_step_memory at ce7656c)."""
    later = PASSES[PASSES.index(pass_name) + 1:] if later is None else later
    registry = auto_registry() if name == "auto" else None
    block = reuse.active()
    keep_inputs = block is None or block.inputs
    roles, final = set(), True
    for role, consumer in _CONSUMER[pass_name].items():
        if (consumer not in later or role == "w" and not config.get("reuse_weight_spectra")
                or role == "x" and not keep_inputs):
            continue
        if registry is not None:
            picked = auto.remembered(registry, consumer, x_shape, w_shape, stride, padding, xp)
            if picked is None:
                final = False
            elif registry[picked] is not backend:
                continue
        roles.add(role)
    return frozenset(roles), final


def _check_output_fits(backend, pass_name, xp, x_shape, w_shape, stride, padding):
    """ValueError, before anything is allocated, where the pass's output cannot fit in what the
    device (or host) has free, even once the backends' scratch and the step's spectra are let go.
    (A backend's workspace is not counted: each bounds its own, chunking the batch.)"""
    g = geometry(x_shape, w_shape, stride, padding)
    nbytes = _output_bytes(g, pass_name)
    if nbytes <= common.CHECK_ABOVE_BYTES:   # unchecked (common.check_fits): nothing to format
        return
    def what():   # formatted only where the output does not fit
        return (f"{pass_name}'s output {common.pass_output_shape(g, pass_name)} (input {tuple(x_shape)}, "
                f"weight {tuple(w_shape)})")
    try:
        common.check_fits(nbytes, xp, what)
    except ValueError:
        _release(backend)       # what they hold may be what is missing: one more look without it
        common.check_fits(nbytes, xp, what)


@functools.lru_cache(maxsize=4096)
def _output_bytes(g, pass_name):
    """Bytes of the float32 array the pass returns."""
    return math.prod(common.pass_output_shape(g, pass_name)) * 4


def _release(backend):
    """Let go of what a backend and the step keep on the device (after it ran out of memory)."""
    _prepared.clear()
    if hasattr(backend, "release_buffers"):  # scratch it kept would otherwise stay allocated
        backend.release_buffers()
    reuse.drop()  # so would the step's shared spectra; later passes recompute theirs
    _free_gpu_pool()


def held_on_device():
    """What the backends keep across calls and a captured CUDA graph must keep alive as long as it
    may replay (minitorch_fft.graphs, the PyTorch adapter's pass graphs): cufft's scratch buffers and
    plans (device memory the graph's kernels address), and cudnn's built plans (a runtime-compiled
    engine's code and state; the other backends allocate per call). An out-of-memory fallback
    (run_pass's _release) drops both caches, which must not free what a live graph launches.
    `with cufft.keeping_retired() as kept:` also keeps what cufft's caches drop during a capture."""
    return [*cufft.held_on_device(), *cudnn.built_plans()]


def _free_gpu_pool():
    from .device import cupy_or_none
    cp = cupy_or_none()
    # Not while a CUDA graph is captured (its memory comes from a pool of its own): cudaFree waits
    # for the device, which a capture forbids.
    if cp is not None and not cp.cuda.get_current_stream().is_capturing():
        cp.get_default_memory_pool().free_all_blocks()


__all__ = ["names", "get", "auto_registry", "choose", "run_pass", "reuse_spectra", "geometry", "GeometryError",
           "held_on_device", "PASSES", "config"]
