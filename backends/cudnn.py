"""cudnn: NVIDIA cuDNN's convolution on CuPy arrays, through cuDNN's Python frontend.

  fprop   y  = conv_fprop(x, W)      cuDNN operation graphs of one node each, float32 in and
  bprop   gx = conv_dgrad(gy, W)     out, compute type float; the arrays' device pointers go
  accGrad gW = conv_wgrad(x, gy)     to cuDNN as they are (NCHW, dense), nothing is copied

A vendor backend (backends.VENDOR): it wraps a library instead of an algorithm of ours, so that
auto can pick cuDNN where our algorithms lose, and `auto_backends=ours` leaves it out.

Needs the optional extra `pip install minitorch-fft[cudnn]` (nvidia-cudnn-frontend, module
`cudnn`, and libcudnn from nvidia-cudnn-cu13) and a GPU; elsewhere supports() is False and the
passes raise saying why. CuPy arrays only.

Engine search: per (device, geometry, pass, precision) the graph's plans are listed by cuDNN's
heuristics (modes A then FALLBACK), every plan that builds and fits the workspace is run on the
call's own data, checked against `gemm` and timed by backends.tuning's recipe, and the fastest
plan's name is remembered in the tuning cache (what torch.backends.cudnn.benchmark does, with no
limit on the number of engines). Built graphs stay in this process (_built), keyed by device,
pass, geometry, precision and workspace bound, so a later call only executes.

Precision: strict fp32 by default (engines with the TENSOR_CORE numerical note, which run float
convolutions in TF32, are excluded, as PyTorch does with allow_tf32=False); TF32 exactly when
the framework's tf32 setting is on (cgemm.mode: one switch for the FFT backends' GEMMs and
cuDNN). Engines that down-convert their inputs (DOWN_CONVERT_INPUTS) are always excluded.

MINITORCH_CUDNN_TUNE=off (cudnn_tune) skips the search: cuDNN's first plan that builds and fits is
used, untimed and not cached on disk (the random-geometry tests run so).

Workspace: plans needing more than the cudnn_workspace_mb setting are skipped; the chosen plan's
workspace is taken from CuPy's pool per call. Kernels run on CuPy's current stream.
"""
import functools

import numpy as np

from . import cgemm, config, gemm, tuning
from .common import check_arrays, check_output_shape, geometry, valid_geometry
from .device import cupy_or_none, gpu_available

# S batch, f in-planes, f' out-planes (fo), h x w input, kh x kw kernel, oh x ow output

# Largest relative difference from gemm (strict fp32) a plan may have: in strict mode tight enough
# that a plan computing in TF32 (~3e-4) is never chosen, should the note filter miss one.
CHECK_TOL = 1e-5
HOPELESS = 3.0     # a plan over 3x the best after a timing round is timed no more
HEURISTICS = ("A", "FALLBACK")   # cuDNN's heuristic modes, in order: the plans searched


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

def fprop(x, w, stride=(1, 1), padding=(0, 0)):
    """y (S, f', oh, ow) = x (S, f, h, w) cross-correlated with w (f', f, kh, kw)."""
    xp, x, w = check_arrays(x=x, w=w)
    g = geometry(x.shape, w.shape, stride, padding)
    _require(xp)
    return _run(xp, "fprop", g, x, w, (g.S, g.fo, g.oh, g.ow))


def bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0)):
    """gx (S, f, h, w): gradient w.r.t. the input of fprop."""
    xp, gy, w = check_arrays(gy=gy, w=w)
    g = geometry(x_shape, w.shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    _require(xp)
    return _run(xp, "bprop", g, gy, w, (g.S, g.f, g.h, g.w))


def accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0)):
    """gw (f', f, kh, kw): gradient w.r.t. the weight, summed over the batch."""
    xp, gy, x = check_arrays(gy=gy, x=x)
    g = geometry(x.shape, w_shape, stride, padding)
    check_output_shape("gy", gy, g, (g.oh, g.ow))
    _require(xp)
    return _run(xp, "accgrad", g, x, gy, (g.fo, g.f, g.kh, g.kw))   # cuDNN's wgrad takes (x, dy)


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
_built = {}     # (device, pass, geometry, precision, workspace bytes, searched) -> _Plan


class _Plan:
    """One pass's cuDNN graph with its chosen plan built: run(a, b, out) executes it."""

    def __init__(self, graph, uids, index, workspace):
        self.graph, self.uids, self.index, self.workspace = graph, uids, index, workspace

    def run(self, cp, a, b, out):
        cudnn, _ = _frontend()
        handle = _handle(cp, cudnn)
        ws = cp.empty(self.workspace, dtype=np.uint8) if self.workspace else None
        # Bare device pointers: the graph's declared NCHW layouts describe them (the arrays are
        # C-contiguous float32, checked by check_arrays and by construction of out).
        pack = dict(zip(self.uids, (a.data.ptr, b.data.ptr, out.data.ptr)))
        self.graph.execute_plan_at_index(pack, None if ws is None else ws.data.ptr, index=self.index,
                                         handle=handle)
        return out


def _handle(cp, cudnn):
    """This device's cuDNN handle, bound to CuPy's current stream (set_stream is a no-op when
    the stream is unchanged)."""
    device = cp.cuda.Device().id
    handle = _handles.get(device)
    if handle is None:
        handle = _handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle, cp.cuda.get_current_stream().ptr)
    return handle


def _run(cp, pass_name, g, a, b, out_shape):
    math = cgemm.mode(cp)
    limit = config.mib_bytes("cudnn_workspace_mb")
    search = tuning.enabled("cudnn_tune", cp)
    key = (cp.cuda.Device().id, pass_name, g, math, limit, search)
    plan = _built.get(key)
    if plan is None:
        plan = _built[key] = _prepare(cp, pass_name, g, math, limit, search, a, b, out_shape)
    return plan.run(cp, a, b, cp.empty(out_shape, dtype=np.float32))


def _graph(cp, pass_name, g, math, limit):
    """(graph with its plans listed and filtered, uids of its (a, b, out) tensors)."""
    cudnn, _ = _frontend()
    F = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=F, intermediate_data_type=F, compute_data_type=F,
                          handle=_handle(cp, cudnn))
    x_dims, w_dims, y_dims = [g.S, g.f, g.h, g.w], [g.fo, g.f, g.kh, g.kw], [g.S, g.fo, g.oh, g.ow]
    conv = dict(padding=[g.ph, g.pw], stride=[g.sh, g.sw], dilation=[1, 1], compute_data_type=F)
    # Every stride given: a tensor without one is laid out by cuDNN's own inference (channels-last,
    # seen on an H100), which reads NCHW memory as something else.
    def tensor(name, dims):
        return graph.tensor(name=name, dim=dims, stride=_dense(dims), data_type=F)
    if pass_name == "fprop":
        a, b = tensor("x", x_dims), tensor("w", w_dims)
        out, out_dims = graph.conv_fprop(a, b, **conv), y_dims
    elif pass_name == "bprop":
        a, b = tensor("dy", y_dims), tensor("w", w_dims)
        out, out_dims = graph.conv_dgrad(a, b, **conv), x_dims
    else:
        a, b = tensor("x", x_dims), tensor("dy", y_dims)
        out, out_dims = graph.conv_wgrad(a, b, **conv), w_dims
    out.set_dim(out_dims).set_stride(_dense(out_dims))
    out.set_output(True).set_data_type(F)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([getattr(cudnn.heur_mode, m) for m in HEURISTICS])
    notes = [cudnn.numerical_note.DOWN_CONVERT_INPUTS]
    if math == "fp32":
        notes.append(cudnn.numerical_note.TENSOR_CORE)   # float convolutions in TF32
    graph.deselect_numeric_notes(notes)
    graph.deselect_workspace_greater_than(limit)
    graph.check_support()
    return graph, (a.uid, b.uid, out.uid)


def _dense(dims):
    """C-contiguous strides (in elements) of `dims`: NCHW as CuPy holds it."""
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return strides[::-1]


def _prepare(cp, pass_name, g, math, limit, search, a, b, out_shape):
    """The _Plan of this pass: the plan named by the tuning cache (searched on a, b if new), or
    with search off (cudnn_tune), the first of cuDNN's heuristic order that builds and fits."""
    graph, uids = _graph(cp, pass_name, g, math, limit)
    names = [graph.get_plan_name_at_index(i) for i in range(graph.get_execution_plan_count())]
    built = {}   # plan name -> (index, workspace bytes), filled by build()

    def build(name):
        if name not in built:
            index = names.index(name)
            graph.build_plan_at_index(index)   # raises for a deselected or unbuildable plan
            workspace = graph.get_workspace_size_plan_at_index(index)
            if workspace > limit:
                raise MemoryError(f"needs {workspace} workspace bytes, over cudnn_workspace_mb")
            built[name] = (index, workspace)
        return built[name]

    def run(name):
        index, workspace = build(name)
        return _Plan(graph, uids, index, workspace).run(cp, a, b, cp.empty(out_shape, dtype=np.float32))

    if not search:
        reasons = {}
        for name in names:
            try:
                return _Plan(graph, uids, *build(name))
            except Exception as e:  # noqa: BLE001 - the next plan in cuDNN's order, then say why
                reasons[name] = f"{type(e).__name__}: {e}"[:200]
        raise RuntimeError(f"no cuDNN plan builds for {pass_name} of geometry {tuple(g)}: {reasons or 'none proposed'}")

    def searched():
        if not names:
            raise RuntimeError(f"cuDNN proposes no plan for {pass_name} of geometry {tuple(g)}")
        reference = _reference(pass_name, g, a, b)
        tol = cgemm.TF32_TOL if math == "tf32" else CHECK_TOL
        return tuning.tune(_unique(names), run, cp, reference=reference, reference_name="gemm", tol=tol,
                           drop_slower=HOPELESS, warn=True)

    key = tuning.key(cp, np.float32, g, pass_name, "cudnn", math=math)
    record = tuning.remembered(key, searched, valid=lambda name: name in names and _fits(build, name),
                               untuned=lambda: names[0])
    index, workspace = build(record["choice"])
    return _Plan(graph, uids, index, workspace)


def _fits(build, name):
    """Whether the plan `name` builds within the workspace bound (a cached choice may not)."""
    try:
        build(name)
    except Exception:  # noqa: BLE001 - any failure means: search again
        return False
    return True


def _unique(names):
    if len(set(names)) != len(names):   # never seen; tuning.tune needs unique labels
        raise RuntimeError(f"cuDNN's plan names are not unique: {names}")
    return names


def _reference(pass_name, g, a, b):
    """gemm's output for the pass (strict fp32): what every plan is checked against."""
    stride, padding = (g.sh, g.sw), (g.ph, g.pw)
    if pass_name == "fprop":
        return gemm.fprop(a, b, stride, padding)
    if pass_name == "bprop":
        return gemm.bprop(a, b, (g.S, g.f, g.h, g.w), stride, padding)
    return gemm.accgrad(b, a, (g.fo, g.f, g.kh, g.kw), stride, padding)


def built():
    """{(device, pass, geometry, precision, workspace bytes, searched): (plan name, workspace
    bytes)} of the plans built in this process (tests and benchmarks read it)."""
    return {k: (p.graph.get_plan_name_at_index(p.index), p.workspace) for k, p in _built.items()}


def release_buffers():
    """Forget the built graphs (their plans hold no device memory of ours; workspace is per call)."""
    _built.clear()
