"""cudnn: NVIDIA cuDNN's convolution on CuPy arrays, through cuDNN's Python frontend.

  fprop   y  = conv_fprop(x, W)      cuDNN operation graphs of one node each (and a bias), float32 in and
  bprop   gx = conv_dgrad(gy, W)     out, compute type float; the arrays' device pointers go
  accGrad gW = conv_wgrad(x, gy)     to cuDNN as they are (dense NCHW, or NHWC: Layout), nothing is copied

A vendor backend (backends.VENDOR): it wraps a library instead of an algorithm of ours, so that
auto can pick cuDNN where our algorithms lose, and `auto_backends=ours` leaves it out.

Needs the optional extra `pip install minitorch-fft[cudnn]` (nvidia-cudnn-frontend, module
`cudnn`, and libcudnn from nvidia-cudnn-cu13) and a GPU; elsewhere supports() is False and the
passes raise saying why. CuPy arrays only.

Engine search, once per (device, geometry, pass, precision), what torch.backends.cudnn.benchmark
does with no limit, over a superset of its candidates: every plan cuDNN's heuristics modes A and
B and its fallback list propose (deduplicated), plus every other engine of the graph at its
default knobs; each plan that builds within the workspace bound runs once on the call's own data
(twice where the first run is slow), once on a copy with NaN in its first image (a plan whose
output loses a NaN that gemm's keeps is refused: _nan_check), is checked against `gemm` and timed
by backends.tuning's recipe in bursts of SEARCH_INNER back-to-back runs (a plan whose checked run
and a second run are over FIRST_RUN_CUTOFF x the best so far is not timed, one over HOPELESS x the
best after a round is timed no more). The winner is remembered in the tuning cache as its cuDNN
plan name, engine id and knobs, which rebuild exactly that plan on a fresh graph
(create_execution_plan), or where a knob has no name in the frontend's enum, find it by name
among the listed plans: a later process times nothing. The search took 0.08-1.1 s per pass on an
H100 (PyTorch's benchmark search 0.02-0.9 s; results/nvidia-h100-80gb-hbm3/cudnn_b7afe80/,
bench_cudnn's first_call_s).

The call: everything is built once per geometry and pass (graph, plan, operand order), kept in
this process (_built); a call allocates its output (and workspace, if the plan needs one) and
executes. It calls the lowered graph's pointer form (an array of device pointers in the graph's
operand order), the call the frontend's execute_plan_at_index itself ends in after normalising
its variant pack in Python (that costs a median 33 us more per call on an H100, same results
folder); the pointer form is checked against the public execute once per built plan, and the
public execute is used where this frontend lacks the pointer form or the two disagree.

Precision: strict fp32 by default (engines with the TENSOR_CORE numerical note, which run float
convolutions in TF32, are excluded, as PyTorch does with allow_tf32=False, and every plan is
checked against gemm to CHECK_TOL); TF32 exactly when the framework's tf32 setting is on
(cgemm.mode: one switch for the FFT backends' GEMMs and cuDNN). Engines that down-convert their
inputs (DOWN_CONVERT_INPUTS) are always excluded.

MINITORCH_CUDNN_TUNE=off (cudnn_tune) skips the search: cuDNN's first plan (modes A, then the
fallback list) that builds, fits and keeps a NaN of its input (_first: one run on _nan_probe's copy
of the call's data, outside a capture) is used, untimed and not cached on disk (the random-geometry
tests run so). A layer's first call on data holding NaN or inf, which is not searched, takes it too.

Workspace: plans needing more than the cudnn_workspace_mb setting are skipped; the chosen plan's
workspace is taken from CuPy's pool per call. Kernels run on CuPy's current stream. The default,
4 GiB, admits every plan PyTorch's unbounded benchmark search picked on the zoo's layers: on VGG-16
conv1_2's accGrad (b64) it is an engine with a 3.5 GiB workspace, 1.6x faster than the best plan
within 1 GiB (8.97 against 14.05 ms on an H100, exp_cudnn_plans at b8837cb). The bound is part of
the tuning key, so a choice searched under another bound is searched again.

Layout: the passes take layout="nhwc" for channels-last operands (CuPy arrays of their logical
(S, C, H, W) shape laid out (S, H, W, C), as a channels-last PyTorch tensor's memory is): the graph
declares NHWC strides for every tensor and the result is laid out so too. That is what cuDNN's
TF32 engines run natively; given NCHW they convert both ways and hold the copies as workspace
(VGG-16 conv1_2's TF32 bprop, b64: a 1568 MiB workspace, benchmarks/NOTES.md session 42). NHWC
plans are built, searched and cached apart ("_nhwc" in the tuning key). The framework's own
backends, and so run_pass, are NCHW only: minitorch_fft.pytorch calls these passes directly for a
channels-last layer, under auto where auto.nhwc_route timed them faster than the NCHW passes on copies.

Bias: fprop(..., bias=b) adds b (f',) to every output plane. It runs whichever is faster for the
geometry, layout and precision: cuDNN's conv + bias graph (a bias node after the convolution, one
kernel), or the plain fprop's plan followed by a bias add ("unfused"), searched like a pass of its
own ("fprop_bias" in the tuning key, the unfused pair one of its candidates; with the search off,
the unfused pair). The fused graph is the win where cuDNN's convolution is a tensor-core kernel
that can take the add in its epilogue: VGG-16 b64 channels-last in TF32, 5.62 ms for the 13
convolutions with their bias against 8.16 for the convolutions and PyTorch's adds; in strict fp32
NCHW its plans were 1.0-2.5x slower than the plain convolution with the add (H200,
exp_bias_fusion, session 43).
"""
import ctypes
import functools
import warnings

import numpy as np

from . import cgemm, config, gemm, tuning
from .common import check_arrays, check_output_shape, geometry, pass_output_shape, valid_geometry
from .device import cupy_or_none, gpu_available

# S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, oh x ow output

# Largest relative difference from gemm (strict fp32) a plan may have: auto's CHECK_TOL, the bound
# our own FFT backends meet, and 3x under TF32's ~3e-4, so a plan computing in TF32 is never chosen
# should the note filter miss one. 1e-5 refused cuDNN's FFT wgrad on VGG-16 conv4_2 (1.1e-5 from
# gemm; PyTorch's strict search picks it, 4.3x faster than the best plan within 1e-5, on an H100).
CHECK_TOL = 1e-4
# After a timing round, a plan over 1.3x the best is timed no more: the rounds' spread is a few
# per cent, so it cannot win, and the search's time goes to the plans that can.
HOPELESS = 1.3
# A plan whose first (checked) run takes over 10x the best so far of the plans' accepted first (or
# second) runs, plus 2 ms, and whose second run does too, is not timed: the search's time is
# bounded by two runs of each plan that cannot win, not seven (engine 0 at its default knobs ran
# 29-115x slower than the best plan on VGG-16 conv4_2 and AlexNet conv2 accGrad on an H100).
# The second run, since session 33: a first launch's one-time cost can be far over 2 ms.
# OverFeat-fast conv1's bprop (11x11, stride 4, b128, H200, exp_cudnn_plans): engine 50's first
# run took 86 ms, its second 0.82, its median 0.75, the plan PyTorch's strict search runs (the
# same kernels); cut after one run, the search chose engine 4 at 0.95 ms and auto lost the pass
# to cuDNN strict (0.963x).
FIRST_RUN_CUTOFF, FIRST_RUN_SLACK_MS = 10, 2.0
# Plans are timed in bursts of this many back-to-back runs (tuning.timeit's inner), as a step and
# table3 run them: timed one run per event pair, a 0.3 ms pass's launch latency hid a 6 % difference
# between near-tied plans (ResNet-18's conv2 TF32 fprop at 74bf06d, H100: the search had
# eng67_k2=4_k27=4 at 0.3237 ms and eng67_k2=1_k27=8 at 0.3246; table3 gave them 0.331 and 0.312).
SEARCH_INNER = 4   # costs 4x the runs of the timed rounds (24 a round per plan, against 6)
HEURISTICS = ("A", "B", "FALLBACK")   # the heuristic modes whose plans are searched
SEARCH_REVISION = 4   # in the tuning key and revision(): plans searched before it are searched again
UNTUNED_HEURISTICS = ("A", "FALLBACK")  # cudnn_tune=off: the first of these plans that builds


def revision(pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0), math="fp32"):
    """auto's cue to time cudnn again (backends.auto): 1 since its plans are searched in bursts
    (SEARCH_INNER), so a choice between cudnn and the other backends made with a plan chosen the
    old way is made again; 2 since a slow first run gets a second (FIRST_RUN_CUTOFF); 3 since a
    plan that hides a NaN of its input is no candidate (_nan_probe), so no cached choice keeps one; 4
    since a plan must keep every NaN gemm keeps, and a layer whose probe reaches no output is no
    longer left without a plan (_nan_check)."""
    return SEARCH_REVISION


@functools.lru_cache(maxsize=None)
def _frontend():
    """(cudnn module, None) where the frontend, libcudnn and a GPU are usable, else (None, why)."""
    if cupy_or_none() is None or not gpu_available():
        return None, "no CUDA GPU is usable (CuPy missing or no device visible)"
    try:
        import cudnn
        cudnn.backend_version()            # raises where libcudnn could not be loaded
    except Exception as e:  # noqa: BLE001 - ImportError, or a frontend that cannot find libcudnn
        return None, (f"the cuDNN frontend is not usable ({type(e).__name__}: {e}); "
                      "install the extra: pip install 'minitorch-fft[cudnn]'")
    return cudnn, None


def available():
    """Whether cuDNN's frontend, libcudnn and a GPU are all usable in this process."""
    return _frontend()[0] is not None


def versions():
    """{"frontend": ..., "cudnn": ...} where available, else {} (for benchmark and test logs)."""
    cudnn, _ = _frontend()
    return {} if cudnn is None else {"frontend": cudnn.__version__, "cudnn": str(cudnn.backend_version())}


DEVICES = ("cuda",)   # the array kinds it runs on (CuPy only; the other backends take both)


def supports(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """Any valid geometry, where cuDNN is usable (never on a machine without it)."""
    return available() and valid_geometry(x_shape, w_shape, stride, padding) is not None


def check_geometry(x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """ValueError saying why supports() is False (backends._reason shows it)."""
    _, why = _frontend()
    if why is not None:
        raise ValueError(f"cuDNN is not usable here: {why}")


# -- public passes ------------------------------------------------------------------------------

def fprop(x, w, stride=(1, 1), padding=(0, 0), layout="nchw", bias=None, out=None):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw), plus bias (f')
    on every plane if given (the module docstring: fused or not). layout "nhwc": x and w are
    channels-last (_checked), and so is y. out: an array to write y into (_checked_out), returned."""
    xp, x, w = _checked(layout, x=x, w=w)
    g = geometry(x.shape, w.shape, stride, padding)
    if bias is not None:
        bias = _checked_bias(xp, bias, g.fo)
    _require(xp)
    return _run(xp, "fprop" if bias is None else "fprop_bias", g, x, w, (g.S, g.fo, g.oh, g.ow), layout, bias, out)


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0), layout="nchw", out=None):
    """gx (S, f, h, w): gradient w.r.t. the input of fprop (layout and out: as fprop's)."""
    xp, gy, w = _checked(layout, gy=gy, w=w)
    g = geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    _require(xp)
    return _run(xp, "bprop", g, gy, w, (g.S, g.f, g.h, g.w), layout, out=out)


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0), layout="nchw", out=None):
    """gw (f', f, kh, kw): gradient w.r.t. the weight, summed over the batch (layout and out: as
    fprop's; "nhwc" gives gw channels-last too, as PyTorch's channels-last convolutions do)."""
    xp, gy, x = _checked(layout, gy=gy, x=x)
    g = geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    _require(xp)
    return _run(xp, "accgrad", g, x, gy, (g.fo, g.f, g.kh, g.kw), layout, out=out)   # cuDNN's wgrad: (x, dy)


LAYOUTS = ("nchw", "nhwc")


def _checked_bias(xp, bias, planes):
    """A bias of fprop: an array of x's kind, float32, of shape (f',); made contiguous."""
    if type(bias) is not xp.ndarray:
        raise TypeError(f"cudnn: the bias must be a {xp.__name__} array like x, got {type(bias).__name__}")
    if bias.dtype != np.float32:
        raise TypeError(f"cudnn: the bias must be float32 (backends do not cast), got {bias.dtype}")
    if bias.shape != (planes,):
        raise ValueError(f"cudnn: the bias must have shape ({planes},) (one value per output plane), "
                         f"got {bias.shape}")
    return xp.ascontiguousarray(bias)


def _checked(layout, **arrays):
    """check_arrays for "nchw" (C-contiguous, made so); for "nhwc", CuPy float32 arrays of their
    logical (S, C, H, W) shape laid out channels-last (a channels-last PyTorch tensor's memory: the
    transpose to (S, H, W, C) C-contiguous), taken as they are, else ValueError naming the array."""
    if layout == "nchw":
        return check_arrays(**arrays)
    if layout != "nhwc":
        raise ValueError(f"cudnn: layout must be one of {LAYOUTS}, got {layout!r}")
    cp = cupy_or_none()
    for name, a in arrays.items():
        if cp is None or type(a) is not cp.ndarray:
            raise TypeError(f"cudnn: layout 'nhwc' takes CuPy arrays, got {type(a).__name__} for {name}")
        if a.dtype != np.float32 or not _laid_out(a, "nhwc"):
            raise ValueError(f"cudnn: layout 'nhwc' takes 4-d float32 arrays laid out channels-last, got {name} "
                             f"of dtype {a.dtype}, shape {a.shape}, strides {a.strides}")
    return (cp, *arrays.values())


def _checked_out(cp, out, shape, layout):
    """out, where a pass may write its result there: a CuPy float32 array of the result's logical
    shape, laid out as `layout` (C-contiguous for "nchw"; channels-last for "nhwc"), on the current
    device; else ValueError (TypeError for another kind of array) naming what differs."""
    if type(out) is not cp.ndarray:
        raise TypeError(f"cudnn: out must be a CuPy array, got {type(out).__name__}")
    if out.dtype != np.float32 or out.shape != tuple(shape) or not _laid_out(out, layout):
        raise ValueError(f"cudnn: out must be a float32 array of shape {tuple(shape)} laid out {layout}, got dtype "
                         f"{out.dtype}, shape {out.shape}, strides {out.strides}")
    if out.device.id != cp.cuda.runtime.getDevice():
        raise ValueError(f"cudnn: out is on GPU {out.device.id}, the pass runs on GPU {cp.cuda.runtime.getDevice()}")
    return out


def _laid_out(a, layout):
    """Whether array a is dense laid out as `layout`: C-contiguous for "nchw"; for "nhwc", 4-d with
    its transpose to (S, H, W, C) C-contiguous (a channels-last PyTorch tensor's memory)."""
    if layout == "nchw":
        return a.flags.c_contiguous
    return a.ndim == 4 and a.transpose(0, 2, 3, 1).flags.c_contiguous


def _span(a):
    """[first, last) device addresses of array a's elements (a view's strides may be negative)."""
    low = high = a.data.ptr
    for n, stride in zip(a.shape, a.strides):
        low, high = low + min(0, (n - 1) * stride), high + max(0, (n - 1) * stride)
    return low, high + a.itemsize


def _overlap(a, b):
    """Whether the address ranges of arrays a and b meet (by address, not by CuPy allocation: two
    wrappers of one buffer, such as the PyTorch adapter's views, are separate allocations to CuPy)."""
    if not a.size or not b.size:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _strides(dims, layout):
    """Strides in elements of logical (N, C, H, W) `dims` laid out as `layout`."""
    if layout == "nchw":
        return _dense(dims)
    n, c, h, w = dims
    return [h * w * c, 1, w * c, c]


def _empty(cp, shape, layout):
    """An uninitialised float32 array of logical `shape` laid out as `layout`."""
    if layout == "nchw":
        return cp.empty(shape, dtype=np.float32)
    n, c, h, w = shape
    return cp.empty((n, h, w, c), dtype=np.float32).transpose(0, 3, 1, 2)


def prepare(pass_name, g, xp):
    """run(a, b) -> out: this pass of geometry g on the plan the last call built (backends.run_pass's
    prepared path, which has checked the arrays: a, b as the pass takes them, C-contiguous float32
    CuPy arrays of g's shapes), or None where no plan is built for the current settings."""
    if xp is np or _frontend()[0] is None:
        return None
    plan = _built.get(_plan_key(xp, pass_name, g))
    if plan is None:
        return None
    out_shape, empty, f32 = pass_output_shape(g, pass_name), xp.empty, np.float32
    if pass_name == "accgrad":                 # the pass takes (gy, x); cuDNN's wgrad (x, dy)
        return lambda gy, x: plan.run(xp, x, gy, empty(out_shape, dtype=f32))
    return lambda a, b: plan.run(xp, a, b, empty(out_shape, dtype=f32))


def _require(xp):
    """Refuse, after the arguments' own checks, what cuDNN cannot run: NumPy arrays, or no cuDNN."""
    if xp is np:
        raise TypeError("the cudnn backend runs on CuPy (GPU) arrays only, got NumPy arrays; "
                        "use another backend on the CPU (or backend='auto')")
    _, why = _frontend()
    if why is not None:
        raise RuntimeError(f"the cudnn backend cannot run: {why}")


# -- graphs, plans and their execution ----------------------------------------------------------

_handles = {}   # CUDA device id -> cudnn.Handle
_built = {}     # (device, pass, geometry, precision, workspace bytes, searched, layout) -> _Plan (_Unfused)
_POINTERS = ctypes.c_uint64 * 3   # a variant pack's device pointers: (a, b, out) in operand order
_POINTERS4 = ctypes.c_uint64 * 4  # with the bias: (a, b, out, bias)


class _Plan:
    """One built plan of a pass's graph: run(cp, a, b, out) executes it on a, b into out.

    a, b, out are the graph's three tensors in _graph's order ((x, w, y) for fprop, (dy, w, dx)
    for bprop, (x, dy, dw) for accGrad), dense float32 in the graph's layout (NCHW or NHWC); c
    the bias of fprop_bias's graph (f',), its fourth tensor."""

    def __init__(self, cudnn, handle, graph, uids, index, workspace):
        self.cudnn, self.handle, self.graph, self.uids = cudnn, handle, graph, uids
        self.index, self.workspace = index, workspace
        self.name = graph.get_plan_name_at_index(index)
        engine, knobs = graph.get_engine_and_knobs_at_index(index)
        # What rebuilds this plan in another process (_replay): JSON-able, knobs as [type, value]
        self.choice = {"name": self.name, "engine": int(engine),
                       "knobs": sorted([int(k), int(v)] for k, v in knobs.items())}
        self.pointer_form = _pointer_form(graph, uids, index)
        self.unchecked = None        # check(): the pointer form, where its check waits for a call outside a capture
        self.checked = False         # check(): compared once, not again (_first's probe checks it before _prepare)
        self.provisional = False     # _prepare: built for one call, unsearched (_run keeps it not)

    def run(self, cp, a, b, out, c=None):
        if self.unchecked is not None and not _capturing(cp):   # its check syncs: never in a capture
            form, self.pointer_form, self.unchecked = self.unchecked, self.unchecked, None
            try:
                self.check(cp, a, b, out.shape, c)
            except BaseException:   # (out of memory for the check's outputs): checked at a later call
                self.pointer_form, self.unchecked = None, form
                raise
        stream = cp.cuda.get_current_stream().ptr
        if self.handle.stream != stream:        # what cudnn.set_stream checks too, one call less
            self.cudnn.set_stream(self.handle, stream)
        ws = cp.empty(self.workspace, dtype=np.uint8) if self.workspace else None
        ws_ptr = 0 if ws is None else ws.data.ptr
        ptrs = (a.data.ptr, b.data.ptr, out.data.ptr)
        if c is not None:
            ptrs += (c.data.ptr,)
        if self.pointer_form is None:
            self._execute_public(ptrs, ws_ptr)
        else:
            execute, order, cpp_index = self.pointer_form
            if c is None:
                pack = _POINTERS(ptrs[order[0]], ptrs[order[1]], ptrs[order[2]])   # alive until it returns
            else:
                pack = _POINTERS4(*[ptrs[i] for i in order])
            execute(ctypes.addressof(pack), len(order), ws_ptr, self.handle.backend_handle, cpp_index)
        return out

    def run_public(self, cp, a, b, out, c=None):
        """run() through the frontend's public execute_plan_at_index (the check's reference, and
        the host time it costs for bench_cudnn)."""
        self.cudnn.set_stream(self.handle, cp.cuda.get_current_stream().ptr)
        ws = cp.empty(self.workspace, dtype=np.uint8) if self.workspace else None
        ptrs = (a.data.ptr, b.data.ptr, out.data.ptr) + (() if c is None else (c.data.ptr,))
        self._execute_public(ptrs, 0 if ws is None else ws.data.ptr)
        return out

    def _execute_public(self, ptrs, ws_ptr):
        self.graph.execute_plan_at_index(dict(zip(self.uids, ptrs)), ws_ptr or None, index=self.index,
                                         handle=self.handle)

    def check(self, cp, a, b, out_shape, c=None):
        """Use the pointer form only where it computes what the public execute computes on a, b
        (the same plan: equal up to the order of a split reduction's atomic sums). Where a, b (the
        caller's data) give NaN or inf, which no difference compares, on random data of their shapes.
        Inside a CUDA graph capture (a plan first built there: after an out-of-memory error dropped
        the plans, test_faults_gpu's graphed steps) nothing can be compared, and a check run there
        would be captured with the step: the public execute serves until the plan's first call
        outside a capture, which checks (run()). Out of memory for its random operands or second
        runs raises, as for its first run, the form kept and unchecked: running out of memory says
        nothing of it (run() checks again at a later call; _keeps_nan takes the plan unprobed)."""
        if self.pointer_form is None or self.checked:
            return
        if _capturing(cp):
            self.unchecked, self.pointer_form = self.pointer_form, None
            return
        public = self.run_public(cp, a, b, cp.empty(out_shape, dtype=np.float32), c)   # a failing plan raises here
        try:   # every host-device sync in here: one refused (another thread's capture) leaves the public execute
            if not bool(cp.isfinite(public).all()):
                public = None            # freed before the random operands are drawn
                rng = cp.random.default_rng(0)
                a, b = (rng.standard_normal(v.shape, dtype=np.float32) for v in (a, b))
                c = None if c is None else rng.standard_normal(c.shape, dtype=np.float32)
                public = self.run_public(cp, a, b, cp.empty(out_shape, dtype=np.float32), c)
            ours = self.run(cp, a, b, cp.empty(out_shape, dtype=np.float32), c)
            err = tuning.rel_error(cp, ours, public)           # a host-device sync
            why = None if err <= CHECK_TOL else f"relative difference {err:.2e}"
        except Exception as e:  # noqa: BLE001 - another signature: the public execute serves
            from . import _is_out_of_memory
            if _is_out_of_memory(e):  # says nothing of the pointer form: unchecked, the caller's to handle
                raise
            why = f"{type(e).__name__}: {e}"[:200]
        if why is not None:
            self.pointer_form = None     # before the warning: one raised as an error leaves no disagreeing form
            warnings.warn(f"cudnn: the frontend's pointer form disagrees with its execute_plan_at_index ({why}) "
                          f"on plan {self.name}; using the latter (~40-130 us more host time per call)",
                          RuntimeWarning, stacklevel=2)
        self.checked = True


def _pointer_form(graph, uids, index):
    """(execute, order, C++ plan index) for the lowered graph's _execute_with_raw_ptrs: what the
    frontend's own execute calls once it has turned its variant pack into device pointers sorted
    by uid (order[i] = which of (a, b, out) is the i-th); None where this frontend has no such
    call (then run() takes the public execute). Private to the frontend, hence checked (_Plan.check)."""
    try:
        lowered = graph._lowered_graph
        execute = lowered._execute_with_raw_ptrs
        cpp_index = graph.plans[index].cpp_index
        lowered._prepare_variant_pack_template()    # the operand order is built lazily
        sorted_uids = list(lowered._get_variant_pack_uids_sorted())
    except Exception:  # noqa: BLE001 - another frontend version: the public execute serves
        return None
    if cpp_index is None or sorted(sorted_uids) != sorted(uids):
        return None
    return execute, tuple(uids.index(uid) for uid in sorted_uids), cpp_index


def _handle(cp, cudnn):
    """This device's cuDNN handle (run() binds it to CuPy's current stream)."""
    device = cp.cuda.runtime.getDevice()
    handle = _handles.get(device)
    if handle is None:
        handle = _handles[device] = cudnn.create_handle()
    return handle


def _plan_key(cp, pass_name, g, layout="nchw"):
    """_built's key: the device, the pass and geometry, the settings a plan depends on, the layout."""
    return (cp.cuda.runtime.getDevice(), pass_name, g, cgemm.mode(cp), config.mib_bytes("cudnn_workspace_mb"),
            tuning.enabled("cudnn_tune", cp), layout)


def _run(cp, pass_name, g, a, b, out_shape, layout="nchw", c=None, out=None):
    if out is None:
        out = _empty(cp, out_shape, layout)
    elif any(_overlap(_checked_out(cp, out, out_shape, layout), t) for t in (a, b, c) if t is not None):
        raise ValueError("cudnn: out overlaps an operand of the pass (or the bias); it must be memory of its own")
    return _plan(cp, pass_name, g, a, b, out_shape, layout, c).run(cp, a, b, out, c)


def _plan(cp, pass_name, g, a, b, out_shape, layout="nchw", c=None):
    """The pass's plan for the current settings: the one built, else prepared (and kept, unless it
    was built for one call only)."""
    key = _plan_key(cp, pass_name, g, layout)
    plan = _built.get(key)
    if plan is None:
        plan = _prepare(cp, pass_name, g, *key[3:], a, b, out_shape, c)
        if not plan.provisional:     # else a later call, on finite data, searches
            _built[key] = plan
    return plan


UNFUSED = {"name": "unfused", "engine": -1, "knobs": []}   # fprop_bias's choice of the plain plan and an add


class _Unfused:
    """fprop_bias as the plain fprop's plan (searched and kept as fprop's own) followed by the bias
    added in place: run(cp, x, w, out, bias). The fused plans' rival in the search, and the choice
    where the search is off."""

    pointer_form = unchecked = None
    provisional, workspace, name = False, 0, UNFUSED["name"]   # built(): its workspace is the plain plan's

    def __init__(self, g, layout, plain=None):
        self.g, self.layout, self.plain, self.choice = g, layout, plain, dict(UNFUSED)

    def run(self, cp, a, b, out, c=None):
        plain = self.plain
        if plain is None:   # fprop's plan, found (or prepared) at the first call
            plain = _plan(cp, "fprop", self.g, a, b, out.shape, self.layout)
            if not plain.provisional:
                self.plain = plain
        plain.run(cp, a, b, out)
        return out if c is None else _add_planes(out, c, self.layout)

    def check(self, cp, a, b, out_shape, c=None):
        """Nothing: the plain plan checked its own pointer form."""


def _add_planes(out, c, layout):
    """out += c (f',) on every plane, in place; out laid out as `layout`."""
    if layout == "nchw":
        out += c.reshape(1, -1, 1, 1)
    else:                                  # NHWC memory as (positions, planes): a row-wise add
        rows = out.transpose(0, 2, 3, 1)
        rows += c
    return out


def _graph(cudnn, handle, pass_name, g, layout="nchw"):
    """(the pass's graph, lowered and without plans; uids of its (a, b, out) tensors, and the bias's
    after them for fprop_bias), every tensor laid out as `layout`. One node, and for fprop_bias a
    bias node after the convolution (its output virtual)."""
    F = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=F, intermediate_data_type=F, compute_data_type=F, handle=handle)
    x_dims, w_dims, y_dims = [g.S, g.f, g.h, g.w], [g.fo, g.f, g.kh, g.kw], [g.S, g.fo, g.oh, g.ow]
    conv = dict(padding=[g.ph, g.pw], stride=[g.sh, g.sw], dilation=[1, 1], compute_data_type=F)
    # Every stride given: a tensor without one is laid out by cuDNN's own inference (channels-last,
    # seen on an H100), which reads NCHW memory as something else.
    def tensor(name, dims):
        return graph.tensor(name=name, dim=dims, stride=_strides(dims, layout), data_type=F)
    extra = ()
    if pass_name == "fprop":
        a, b = tensor("x", x_dims), tensor("w", w_dims)
        out, out_dims = graph.conv_fprop(a, b, **conv), y_dims
    elif pass_name == "fprop_bias":
        a, b, c = tensor("x", x_dims), tensor("w", w_dims), tensor("bias", [1, g.fo, 1, 1])
        conv_out = graph.conv_fprop(a, b, **conv)
        conv_out.set_data_type(F)
        out, out_dims, extra = graph.bias(name="bias", input=conv_out, bias=c), y_dims, (c.uid,)
    elif pass_name == "bprop":
        a, b = tensor("dy", y_dims), tensor("w", w_dims)
        out, out_dims = graph.conv_dgrad(a, b, **conv), x_dims
    else:
        a, b = tensor("x", x_dims), tensor("dy", y_dims)
        out, out_dims = graph.conv_wgrad(a, b, **conv), w_dims
    out.set_dim(out_dims).set_stride(_strides(out_dims, layout))
    out.set_output(True).set_data_type(F)
    graph.validate()
    graph.build_operation_graph()
    return graph, (a.uid, b.uid, out.uid) + extra


def _dense(dims):
    """C-contiguous strides (in elements) of `dims`: NCHW as CuPy holds it."""
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return strides[::-1]


def _planned_graph(cudnn, handle, pass_name, g, math, limit, modes, every_engine, layout="nchw"):
    """(graph with the plans of heuristic `modes` listed, and with every_engine each engine they
    left out at its default knobs; filtered by precision and workspace; uids). Plans the filters
    refuse fail at build_plan_at_index. Where a query of `modes` fails (mode B is the least used),
    UNTUNED_HEURISTICS' plans are listed instead, with a warning."""
    graph, uids = _graph(cudnn, handle, pass_name, g, layout)
    try:
        graph.create_execution_plans([getattr(cudnn.heur_mode, m) for m in modes])
    except Exception as e:  # noqa: BLE001 - planning is one-shot: a fresh graph for the fallback
        if tuple(modes) == UNTUNED_HEURISTICS:
            raise
        warnings.warn(f"cudnn: cuDNN's heuristics {modes} failed ({type(e).__name__}: {e}); listing "
                      f"{UNTUNED_HEURISTICS}'s plans only", RuntimeWarning, stacklevel=2)
        graph, uids = _graph(cudnn, handle, pass_name, g, layout)
        graph.create_execution_plans([getattr(cudnn.heur_mode, m) for m in UNTUNED_HEURISTICS])
    if every_engine:
        _append_other_engines(graph)
    notes = [cudnn.numerical_note.DOWN_CONVERT_INPUTS]
    if math == "fp32":
        notes.append(cudnn.numerical_note.TENSOR_CORE)   # float convolutions in TF32
    graph.deselect_numeric_notes(notes)
    graph.deselect_workspace_greater_than(limit)
    return graph, uids


def _append_other_engines(graph):
    """Append a plan for every engine of the graph (global ids 0 .. get_engine_count() - 1) that no
    listed plan uses, at its default knobs: engines the heuristics leave out entirely."""
    try:
        count = graph.get_engine_count()
        listed = {graph.get_engine_and_knobs_at_index(i)[0] for i in range(graph.get_execution_plan_count())}
    except Exception:  # noqa: BLE001 - a frontend that cannot say: the heuristics' plans only
        return
    for engine in range(count):
        if engine not in listed:
            try:
                graph.create_execution_plan(engine, {})
            except Exception:  # noqa: BLE001 - an engine that does not serve this graph
                pass


def _build(cudnn, handle, graph, uids, index, limit):
    """The _Plan of the graph's plan `index`; raises where it does not build or fit the bound."""
    graph.build_plan_at_index(index)   # raises for a deselected or unbuildable plan
    workspace = graph.get_workspace_size_plan_at_index(index)
    if workspace > limit:
        raise MemoryError(f"needs {workspace} workspace bytes, over cudnn_workspace_mb")
    return _Plan(cudnn, handle, graph, uids, index, workspace)


def _plan_indices(graph):
    """{plan name: index} of the graph's plans, in cuDNN's order (a name listed twice: the first)."""
    indices = {}
    for i in range(graph.get_execution_plan_count()):
        try:
            indices.setdefault(graph.get_plan_name_at_index(i), i)
        except Exception:  # noqa: BLE001 - a plan cuDNN cannot even name is no candidate
            pass
    return indices


def _first(cudnn, handle, pass_name, g, math, limit, layout="nchw", keeps_nan=None):
    """The first plan of cuDNN's heuristic order (UNTUNED_HEURISTICS) that builds and fits; for
    fprop_bias, untimed, the unfused pair (its fused plans' speed varies too much to take one blind).
    keeps_nan: plan -> whether it keeps the NaN of _nan_probe's input (_prepare's _keeps_nan); a plan
    for which it is False, or raises, is passed over like one that does not build. The untimed paths
    (cudnn_tune off, and a layer's first call on data holding NaN or inf, which is not searched)
    took cuDNN's first plan blind, and cuDNN 9.19's fused Winograd engines hide NaN (session 56).
    Inside a CUDA graph capture no probe runs (keeps_nan None: its syncs are refused there), so a
    plan first built there (after an out-of-memory error dropped the plans) is taken unprobed."""
    if pass_name == "fprop_bias":
        return _Unfused(g, layout)
    graph, uids = _planned_graph(cudnn, handle, pass_name, g, math, limit, UNTUNED_HEURISTICS, every_engine=False,
                                 layout=layout)
    reasons = {}
    for name, index in _plan_indices(graph).items():
        try:
            plan = _build(cudnn, handle, graph, uids, index, limit)
        except Exception as e:  # noqa: BLE001 - the next plan in cuDNN's order, then say why
            reasons[name] = f"{type(e).__name__}: {e}"[:200]
            continue
        try:
            if keeps_nan is None or keeps_nan(plan):
                return plan
            reasons[name] = "hides a NaN of its input (_nan_check)"
        except Exception as e:  # noqa: BLE001 - its probe run failed: the next plan, as for one that does not build
            reasons[name] = f"its NaN probe failed: {type(e).__name__}: {e}"[:200]
    raise RuntimeError(f"no cuDNN plan builds, fits and keeps a NaN for {pass_name} of geometry {tuple(g)}: "
                       f"{reasons or 'none proposed'}")


def _search(cp, cudnn, handle, pass_name, g, math, limit, a, b, out_shape, layout="nchw", c=None):
    """tuning.tune's record over every plan of HEURISTICS and every other engine, run on a, b (and
    the bias c of fprop_bias, whose candidates end with the unfused pair: fprop's plan, searched
    first, and the add); its choice is the winner's _Plan.choice."""
    unfused = {}
    if pass_name == "fprop_bias":
        unfused[UNFUSED["name"]] = _Unfused(g, layout, _plan(cp, "fprop", g, a, b, out_shape, layout))
    try:
        graph, uids = _planned_graph(cudnn, handle, pass_name, g, math, limit, HEURISTICS, every_engine=True,
                                     layout=layout)
        indices = _plan_indices(graph)
    except Exception as e:  # noqa: BLE001 - the conv + bias graph is not cuDNN's to run here: the unfused pair
        if not unfused:
            raise
        warnings.warn(f"cudnn: no plan of the conv + bias graph for geometry {tuple(g)} ({type(e).__name__}: "
                      f"{e}"[:300] + "); the convolution and an add instead", RuntimeWarning, stacklevel=2)
        graph, uids, indices = None, None, {}
    if not indices and not unfused:
        raise RuntimeError(f"cuDNN proposes no plan for {pass_name} of geometry {tuple(g)}")
    plans = {}   # name -> _Plan, built on first run

    def build(name):
        if name in unfused:
            return unfused[name]
        if name not in plans:
            plan = _build(cudnn, handle, graph, uids, indices[name], limit)
            if not plans:   # the pointer form is one call for every plan: checked on the first
                plan.check(cp, a, b, out_shape, c)
            elif next(iter(plans.values())).pointer_form is None:
                plan.pointer_form = None
            plans[name] = plan
        return plans[name]

    reference = _reference(pass_name, g, a, b, c)
    tol = cgemm.TF32_TOL if math == "tf32" else CHECK_TOL
    ran, first_ms = set(), {}   # plans run; their checked runs' ms (those that agree with gemm)
    nan_check = []              # _nan_check's, made at the first plan's run

    def refusal(plan):
        if not nan_check:
            nan_check.append(_nan_check(cp, pass_name, g, a, b, c, out_shape, layout))
        return nan_check[0] and nan_check[0](plan)

    def run(name):
        plan, out = build(name), _empty(cp, out_shape, layout)
        if name in ran:
            return plan.run(cp, a, b, out, c)
        ran.add(name)
        for attempt in ("first", "second"):   # a second: the first can pay a one-time cost (FIRST_RUN_CUTOFF)
            ms = tuning.timeit(lambda: plan.run(cp, a, b, out, c), cp, warmup=0, repeat=1)
            if not first_ms or ms <= FIRST_RUN_CUTOFF * min(first_ms.values()) + FIRST_RUN_SLACK_MS:
                break
        else:
            raise TimeoutError(f"its {attempt} run took {ms:.3f} ms, over {FIRST_RUN_CUTOFF}x the best plan's "
                               f"({min(first_ms.values()):.3f} ms) + {FIRST_RUN_SLACK_MS} ms: not timed")
        why = refusal(plan)
        if why:
            raise ValueError(why)
        if tuning.rel_error(cp, out, reference) <= tol:   # tune() checks it again, and says why not
            first_ms[name] = ms
        return out

    # Disagreeing plans are expected here (FFT engines, default knobs), not kernel bugs: no warning.
    record = tuning.tune(list(indices) + list(unfused), run, cp, reference=reference, reference_name="gemm", tol=tol,
                         drop_slower=HOPELESS, inner=SEARCH_INNER)
    choice = build(record["choice"])
    if record["choice"] not in ran and record["choice"] not in unfused and not _capturing(cp):   # a lone one, never run
        why = refusal(choice)
        if why:
            raise RuntimeError(f"cuDNN's only plan for {pass_name} of geometry {tuple(g)}, {record['choice']}, {why}")
    return dict(record, choice=choice.choice)


def _nan_check(cp, pass_name, g, a, b, c, out_shape, layout):
    """plan -> why it is refused (a NaN of its input lost), or None: the plan runs on _nan_probe(a),
    and every output that gemm's (_reference) makes NaN for the probe must be NaN in the plan's
    too (an FFT or Winograd plan spreads NaN wider: allowed). None instead of a function where the
    probe's NaN reaches no output (a layer padded by its kernel size or more can read only padding
    at the grid's rows): nothing to check. The probe and the mask live as long as the function."""
    probe = _nan_probe(a)
    must = cp.isnan(_reference(pass_name, g, probe, b, c))
    count = int(must.sum())
    if count == 0:
        return None

    def refusal(plan):
        lost = int((must & ~cp.isnan(plan.run(cp, probe, b, _empty(cp, out_shape, layout), c))).sum())
        return (f"hides a NaN of its input: {lost} of the {count} outputs gemm makes NaN for the probe (NaN on "
                f"every third row and column of image 0) came out finite (_nan_probe)") if lost else None
    return refusal


def _keeps_nan(cp, pass_name, g, a, b, c, out_shape, layout, made, plan):
    """Whether plan keeps the NaN of _nan_probe(a) (_first's check of an untimed plan), its pointer
    form checked first (_Plan.check: the probe runs through it); `made` (a list) holds the
    _nan_check, made at the first plan's check. Where that cannot be made (the probe's copy or
    gemm's reference out of memory), a warning, and the plans are taken unprobed; where the plan's
    check or probe run is out of memory, a warning, and this plan is taken unprobed (running out of
    memory says nothing of NaN: passing over it, _first could refuse every plan where it ran
    before). Any other failure raises: _first passes to the next plan."""
    if not made:
        try:
            made.append(_nan_check(cp, pass_name, g, a, b, c, out_shape, layout))
        except Exception as e:  # noqa: BLE001 - the untimed path ran without a probe before: as it did
            warnings.warn(f"cudnn: no NaN probe for the untimed plan of {pass_name}, geometry {tuple(g)} "
                          f"({type(e).__name__}: {e}"[:300] + "); cuDNN's first plan is taken unprobed",
                          RuntimeWarning, stacklevel=2)
            made.append(None)
    if made[0] is None:
        return True
    try:
        plan.check(cp, a, b, out_shape, c)
        return made[0](plan) is None
    except Exception as e:  # noqa: BLE001 - out of memory: unprobed, as where the probe cannot be made
        from . import _is_out_of_memory
        if not _is_out_of_memory(e):
            raise
        warnings.warn(f"cudnn: out of memory checking plan {plan.name} for {pass_name}, geometry {tuple(g)}, on the "
                      f"NaN probe ({type(e).__name__}: {e}"[:300] + "); the plan is taken unprobed", RuntimeWarning,
                      stacklevel=2)
        return True   # a check that ran out of memory left checked False: _prepare's raises it as before


def _capturing(cp):
    """Whether the current stream is being captured; the legacy stream while another captures, which
    CuPy cannot ask, counts as capturing. No check or probe runs then: its syncs are refused, and its
    runs would join the graph (_Plan.check, _prepare)."""
    try:
        return cp.cuda.get_current_stream().is_capturing()
    except Exception:  # noqa: BLE001 - as good as capturing
        return True


def _nan_probe(a):
    """A copy of a pass's first operand (fprop's and accGrad's x, bprop's gradOutput), laid out as it
    is, with NaN on every third row and column of every plane of image 0: what _search runs each
    plan on once (and _first its untimed plan), refusing a plan whose output loses a NaN that gemm's
    keeps (_nan_check).

    Session 55 (benchmarks/NOTES.md): cuDNN 9.19's fused Winograd engine for fp32 3x3 fprops (eng6)
    gives a finite output for an input holding NaN, through the public execute and the pointer form
    alike; every other plan listed for three small 3x3 fprops put NaN where the bad pixels reach (the
    FFT engines everywhere). auto chose cudnn for the digits net's conv2 with eng6 now and then, and
    test_errors' NaN test failed then: a silent wrong answer, which a check on finite data cannot
    see. Its first GPU run (session 56) refused eng7 too, the fused Winograd bprop, on OverFeat-fast's
    three 3x3 bprops; it costs the converted fp32 step about 1.4 ms there (reduce-overhead, 2.03x
    PyTorch strict before, 1.89x after, in two processes: results/nvidia-h200/README.md), and it is
    on by default: a faster wrong answer is no option. Where the grid reaches no output (a layer
    padded by its kernel size or more: its outputs can read only padding at those rows), there is
    nothing to check; the first version refused every plan there, so such a layer found none
    (session 56's review)."""
    probe = a.copy(order="K")
    probe[0, :, ::3, ::3] = np.nan
    return probe


def _is_choice(choice):
    """Whether a cached choice has _Plan.choice's format (an edited file may hold anything)."""
    return (isinstance(choice, dict) and isinstance(choice.get("name"), str) and type(choice.get("engine")) is int
            and isinstance(choice.get("knobs"), list)
            and all(isinstance(kv, list) and len(kv) == 2 and all(type(v) is int for v in kv)
                    for kv in choice["knobs"]))


def _replay(cudnn, handle, pass_name, g, math, limit, choice, layout="nchw"):
    """The _Plan of a cached choice, no timing. Rebuilt from its engine id and knobs on a fresh
    graph where the frontend can name every knob; else (knob_type.NOT_SET stands for a knob cuDNN
    has and the frontend's enum lacks, e.g. USE_TEX, k3 in 'eng25_k2=2_k3=0': seen on an H100 with
    cuDNN 9.19) found by its name, which cuDNN spells with every knob, among the searched plans.
    fprop_bias's UNFUSED: the unfused pair."""
    if pass_name == "fprop_bias" and choice == UNFUSED:
        return _Unfused(g, layout)
    not_set = int(cudnn.knob_type.NOT_SET)
    if all(k != not_set for k, _ in choice["knobs"]):
        graph, uids = _graph(cudnn, handle, pass_name, g, layout)
        try:
            graph.create_execution_plan(choice["engine"], {cudnn.knob_type(k): v for k, v in choice["knobs"]})
            plan = _build(cudnn, handle, graph, uids, graph.get_execution_plan_count() - 1, limit)
        except Exception:  # noqa: BLE001 - found by name below
            plan = None
        if plan is not None and plan.name == choice["name"]:
            return plan
    graph, uids = _planned_graph(cudnn, handle, pass_name, g, math, limit, HEURISTICS, every_engine=True,
                                 layout=layout)
    index = _plan_indices(graph).get(choice["name"])
    if index is None:
        raise LookupError(f"cuDNN lists no plan {choice['name']} for {pass_name} of geometry {tuple(g)}")
    return _build(cudnn, handle, graph, uids, index, limit)


def _prepare(cp, pass_name, g, math, limit, search, layout, a, b, out_shape, c=None):
    """The _Plan of this pass: the choice of the tuning cache (searched on a, b if new), or with
    search off (cudnn_tune), the first plan of cuDNN's heuristic order that builds and fits
    (fprop_bias: the unfused pair)."""
    cudnn, _ = _frontend()
    handle = _handle(cp, cudnn)
    keeps_nan = None if _capturing(cp) else functools.partial(_keeps_nan, cp, pass_name, g, a, b, c, out_shape,
                                                               layout, [])
    if not search:
        plan = _first(cudnn, handle, pass_name, g, math, limit, layout, keeps_nan)
    else:
        replayed = {}

        def valid(choice):   # a cached choice that no longer builds (another cuDNN) is searched again
            try:
                replayed["plan"] = (_replay(cudnn, handle, pass_name, g, math, limit, choice, layout)
                                    if _is_choice(choice) else None)
            except Exception:  # noqa: BLE001
                replayed["plan"] = None
            return replayed["plan"] is not None

        key = tuning_key(cp, g, pass_name, math, limit, layout)
        record = tuning.remembered(key, lambda: _search(cp, cudnn, handle, pass_name, g, math, limit, a, b, out_shape,
                                                        layout, c),
                                   valid=valid, untuned=lambda: _first(cudnn, handle, pass_name, g, math, limit,
                                                                       layout, keeps_nan).choice)
        plan = replayed.get("plan") or _replay(cudnn, handle, pass_name, g, math, limit, record["choice"], layout)
        plan.provisional = tuning.for_this_call_only(record)   # a, b held NaN or inf: not searched
    plan.check(cp, a, b, out_shape, c)
    return plan


def tuning_key(cp, g, pass_name, math, limit, layout="nchw"):
    """The tuning cache's key of a pass's plan choice: the workspace bound `limit` (bytes) is in it,
    since it decides which plans compete; "_b" since plans are timed in bursts (SEARCH_INNER), so
    choices timed one run at a time are searched again; "_s" the search's revision (SEARCH_REVISION);
    "_nhwc" for channels-last tensors (NCHW keys carry no layout, as before layouts existed)."""
    suffix = "" if layout == "nchw" else f"_{layout}"
    return tuning.key(cp, np.float32, g, pass_name, f"cudnn@{limit}B_b{SEARCH_INNER}_s{SEARCH_REVISION}{suffix}",
                      math=math)


def _reference(pass_name, g, a, b, c=None):
    """gemm's output for the pass (strict fp32): what every plan is checked against."""
    stride, padding = (g.sh, g.sw), (g.ph, g.pw)
    if pass_name == "fprop":
        return gemm.fprop(a, b, stride, padding)
    if pass_name == "fprop_bias":
        return _add_planes(gemm.fprop(a, b, stride, padding), c, "nchw")
    if pass_name == "bprop":
        return gemm.bprop(a, b, (g.S, g.f, g.h, g.w), stride, padding)
    return gemm.accgrad(b, a, (g.fo, g.f, g.kh, g.kw), stride, padding)


def built():
    """{(device, pass, geometry, precision, workspace bytes, searched, layout): (plan name, workspace
    bytes)} of the plans built in this process (tests and benchmarks read it)."""
    return {k: (p.name, p.workspace) for k, p in _built.items()}


def built_plans():
    """The built plans themselves (_Plan, _Unfused): what a captured CUDA graph holds while it lives
    (backends.held_on_device)."""
    return list(_built.values())


def release_buffers():
    """Forget the built graphs (their plans hold no device memory of ours; workspace is per call)."""
    _built.clear()
