"""What every benchmark shares: the layers measured, the float64 reference, relative error,
timing, provenance and result files.

  layers      TABLE4 (the paper's Table 4), NETWORK_LAYERS (its networks' conv layers by name),
              conv_layers(net, batch) (a zoo model's convolutions, traced), Layer (random operands
              on the GPU, their float64 references, each pass timed after its check)
  reference   reference64(x, w, gy, ...): the three passes in float64 through PyTorch;
              torch_model / torch_gradients / step_check / torch_fp32_errors: a whole training
              step against PyTorch float64 on the same weights
  error       rel_error(got, ref) = ||got - ref|| / ||ref||, in float64
  timing      median_ms(fn, lib): median of CUDA events (lib "cupy" or "torch") or of the host
              clock (lib "cpu"), after warm-up; peak_extra_bytes; peak_step_bytes (allocated and
              reserved, measured alike for CuPy and PyTorch); poisoned (NaN-filled allocations)
  cuDNN       setup_cudnn (benchmark mode over every algorithm) and set_tf32("strict" | "tf32")
  provenance  provenance(device, ...): device, UTC date, command line, commit, versions;
              device_identity(cp) says which GPU of the host a process ran on
  results     write_results(name, meta, rows, columns, title): results/<device>/<name>.{json,md}
              (experiments: results/<device>/experiments/);
              write_text(path, text): one file, atomically (minitorch_fft.utils.atomic_file)

Settings come from backends.config only; nothing here reads the environment.
"""
import contextlib
import datetime
import gc
import json
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from minitorch_fft import backends
from minitorch_fft.utils import atomic_file

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
PASSES = backends.PASSES     # ("fprop", "bprop", "accgrad"): Torch's three passes, in that order
BATCH = 128
TOLERANCE = {"strict": 1e-4, "tf32": 1e-2}   # relative error against float64 (TF32 keeps 10 mantissa bits)

# -- the layers ----------------------------------------------------------------------------------

# Paper Table 4 layers: name -> (f, f', h = w, k), S = 128, stride 1, no padding
TABLE4 = {"L1": (3, 96, 128, 11), "L2": (64, 64, 64, 9), "L3": (128, 128, 32, 9),
          "L4": (128, 128, 16, 7), "L5": (384, 384, 13, 3)}
# Table 4's layers and the networks' stride-1 conv layers by name: (f, f', h = w, k, padding)
NETWORK_LAYERS = {
    **{f"table4.{name}": (f, fo, hw, k, 0) for name, (f, fo, hw, k) in TABLE4.items()},
    "alexnet.conv2": (64, 192, 27, 5, 2),
    "alexnet.conv3": (192, 384, 13, 3, 1),
    "alexnet.conv4": (384, 256, 13, 3, 1),
    "alexnet.conv5": (256, 256, 13, 3, 1),
    "overfeat.conv2": (96, 256, 28, 5, 0),
    "overfeat.conv3": (256, 512, 12, 3, 1),
    "overfeat.conv4": (512, 1024, 12, 3, 1),
    "overfeat.conv5": (1024, 1024, 12, 3, 1),
}


def conv_layers(model_name, batch):
    """[(name, x_shape, w_shape, stride, padding)] of a zoo model's convolutions in the order the
    forward pass runs them, traced by one forward pass on the CPU (batch 1) in which each
    convolution returns zeros of its output's shape instead of computing."""
    import numpy as np

    import minitorch_fft as mt
    from minitorch_fft import models
    from minitorch_fft import functional as F

    found = []

    def traced(x, weight, bias=None, stride=1, padding=0, backend="auto"):
        stride, padding = F._pair(stride, "stride"), F._pair(padding, "padding")
        g = backends.geometry(x.shape, weight.shape, stride, padding)
        found.append(((batch,) + tuple(x.shape[1:]), tuple(weight.shape), stride, padding))
        return mt.Tensor(np.zeros((x.shape[0], g.fo, g.oh, g.ow), np.float32))

    net = models.get(model_name, num_classes=10, backend="gemm").eval()
    real, F.conv2d = F.conv2d, traced
    try:
        with mt.no_grad():
            net(mt.Tensor(np.zeros((1,) + models.input_shape(model_name), np.float32)))
    finally:
        F.conv2d = real
    return [(f"conv{i + 1}",) + geom for i, geom in enumerate(found)]


def distinct_conv_layers(model_name, batch):
    """[(name, x_shape, w_shape, stride, padding, count)]: conv_layers' geometries once each, in
    first-use order, named by the first layer with it, `count` how many layers share it."""
    out = {}
    for name, *geom in conv_layers(model_name, batch):
        key = tuple(geom)
        out[key] = out[key][:-1] + (out[key][-1] + 1,) if key in out else (name, *geom, 1)
    return list(out.values())


# -- the float64 reference and relative error ----------------------------------------------------

def _torch(a):
    """A torch tensor of `a` (a tensor, a CuPy array through DLPack without a copy, or NumPy)."""
    import torch
    if isinstance(a, torch.Tensor):
        return a
    if type(a).__module__.startswith("cupy"):
        return torch.from_dlpack(a)
    return torch.as_tensor(a)


def reference64(x, w, gy, stride=(1, 1), padding=(0, 0)):
    """{"fprop": y, "bprop": gx, "accgrad": gw} in float64 through PyTorch, on the operands' device
    (CuPy arrays, NumPy arrays or torch tensors, NCHW). Not timed: cuDNN's heuristic float64
    algorithm runs, not a benchmark-mode search of every one (a sweep profile put that search at
    a third of the sweep's time)."""
    import torch
    import torch.nn.functional as TF
    x64, w64, gy64 = (_torch(a).double() for a in (x, w, gy))
    stride, padding = tuple(stride), tuple(padding)
    searching, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, False
    try:
        return {"fprop": TF.conv2d(x64, w64, stride=stride, padding=padding),
                "bprop": torch.nn.grad.conv2d_input(x64.shape, w64, gy64, stride=stride, padding=padding),
                "accgrad": torch.nn.grad.conv2d_weight(x64, w64.shape, gy64, stride=stride, padding=padding)}
    finally:
        torch.backends.cudnn.benchmark = searching


def rel_error(got, ref):
    """||got - ref|| / ||ref|| (2-norm over every element) in float64, complex128 for complex
    operands, on the device they are on (NumPy, CuPy or torch; mixed: as torch tensors). A NaN in
    `got` gives NaN, so `not err <= tol` fails; a zero `ref` gives the absolute error."""
    libraries = {type(a).__module__.split(".")[0] for a in (got, ref)}
    if libraries in ({"numpy"}, {"cupy"}):
        if libraries == {"numpy"}:
            import numpy as xp
        else:
            import cupy as xp
        wide = lambda a: a.astype(xp.complex128 if xp.iscomplexobj(a) else xp.float64)  # noqa: E731
        got, ref = wide(xp.asarray(got)), wide(xp.asarray(ref))
        num, den = float(xp.linalg.norm((got - ref).ravel())), float(xp.linalg.norm(ref.ravel()))
    else:
        import torch
        got, ref = _torch(got), _torch(ref)
        wide = lambda a: a.to(torch.complex128 if a.is_complex() else torch.float64)  # noqa: E731
        got, ref = wide(got), wide(ref).to(got.device)
        num, den = float(torch.linalg.vector_norm(got - ref)), float(torch.linalg.vector_norm(ref))
    return num / den if den else num


class Layer:
    """Random operands of one convolution on the GPU, float64 references, and timed passes."""

    def __init__(self, x_shape, w_shape, stride, padding, seed):
        import cupy as cp
        import torch
        self.geom = (tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding))
        g = backends.geometry(x_shape, w_shape, stride, padding)
        self.g = g
        rng = cp.random.default_rng(seed)
        self.x = rng.standard_normal(x_shape, dtype=cp.float32)
        self.w = rng.standard_normal(w_shape, dtype=cp.float32)
        self.gy = rng.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
        self.xt, self.wt, self.gyt = (torch.from_dlpack(a) for a in (self.x, self.w, self.gy))
        self.ref = reference64(self.xt, self.wt, self.gyt, stride, padding)

    def _args(self, pass_name):
        return {"fprop": (self.x, self.w), "bprop": (self.gy, self.w, self.x.shape),
                "accgrad": (self.gy, self.x, self.w.shape)}[pass_name]

    def ours(self, backend, pass_name):
        """The backend module's pass alone (profiles, kernel counts)."""
        s, p = self.geom[2], self.geom[3]
        args = self._args(pass_name)
        return lambda: getattr(backend, pass_name)(*args, stride=s, padding=p)

    def dispatched(self, name, pass_name):
        """The pass as a layer runs it under backend setting `name`: backends.run_pass, which
        chooses the backend (auto: a lookup of its tuned choice) on every call, as cuDNN's
        conv2d pays its own dispatch inside the timed call."""
        x_shape, w_shape, s, p = self.geom
        args = self._args(pass_name)
        return lambda: backends.run_pass(name, pass_name, *args, x_shape=x_shape, w_shape=w_shape,
                                         stride=s, padding=p)

    def cudnn(self, pass_name):
        import torch
        import torch.nn.functional as TF
        s, p = self.geom[2], self.geom[3]
        return {"fprop": lambda: TF.conv2d(self.xt, self.wt, stride=s, padding=p),
                "bprop": lambda: torch.nn.grad.conv2d_input(self.xt.shape, self.wt, self.gyt, stride=s, padding=p),
                "accgrad": lambda: torch.nn.grad.conv2d_weight(self.xt, self.wt.shape, self.gyt,
                                                               stride=s, padding=p)}[pass_name]

    def measure(self, fn, lib, pass_name, tol, args, flagged=None):
        """(median ms, relative error); the result is checked before it is timed. Ours must pass
        the check; a reference library's miss is timed anyway and appended to `flagged`.
        args.inner (default 1) calls run back to back in each timed span, the time given per call:
        launches queue up as in a training step, so a call's host time counts where it exceeds
        its GPU time, not in full before every kernel."""
        got = poisoned(fn) if lib == "cupy" else fn()
        err = rel_error(got, self.ref[pass_name])
        del got
        if not err <= tol:
            if flagged is None:
                raise AssertionError(f"relative error {err:.2e} > {tol}")
            flagged.append(f"relative error {err:.1e} > {tol}")
        inner = getattr(args, "inner", 1)

        def burst():
            for _ in range(inner):
                fn()
        return median_ms(burst, lib, args.warmup, args.repeat) / inner, err


# -- a training step against PyTorch float64 ------------------------------------------------------

def torch_model(name, num_classes):
    """The same architecture in PyTorch (torchvision's AlexNet, VGG-16 and ResNets; OverFeat-fast
    written out)."""
    import torch.nn as nn
    import torchvision
    if name in ("alexnet", "vgg16", "resnet18", "resnet34", "resnet50"):
        return getattr(torchvision.models, name)(num_classes=num_classes)
    return nn.Sequential(
        nn.Conv2d(3, 96, 11, 4), nn.ReLU(), nn.MaxPool2d(2, 2), nn.Conv2d(96, 256, 5), nn.ReLU(),
        nn.MaxPool2d(2, 2), nn.Conv2d(256, 512, 3, padding=1), nn.ReLU(), nn.Conv2d(512, 1024, 3, padding=1),
        nn.ReLU(), nn.Conv2d(1024, 1024, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2), nn.Flatten(),
        nn.Dropout(), nn.Linear(36864, 3072), nn.ReLU(), nn.Dropout(), nn.Linear(3072, 4096), nn.ReLU(),
        nn.Linear(4096, num_classes))


def torch_gradients(model, torch_net, x_np, y_np, dtype, torch_device="cpu", branch=None):
    """(loss, [weight gradients]) of a copy of `torch_net` in `dtype` that carries our model's
    weights and buffers (batch norms' running statistics; copied in order, shapes checked), in
    eval mode (dropout is random in each framework), on x_np and y_np; the gradients as float64
    CPU tensors. branch: an OurBranch recorded from our model's forward on the same batch, which
    the copy then takes at every ReLU and max-pool (its flips are counted in the branch)."""
    import copy

    import torch

    import minitorch_fft as mt
    ours = model.parameters() + model.buffers()
    if [tuple(p.shape) for p in ours] != [tuple(q.shape) for q in [*torch_net.parameters(), *torch_net.buffers()]]:
        raise ValueError("step check: the two models' parameters or buffers differ in order or shape")
    net = copy.deepcopy(torch_net).to(dtype).to(torch_device).eval()
    with torch.no_grad():
        for p, q in zip(ours, [*net.parameters(), *net.buffers()]):
            q.copy_(torch.as_tensor(mt.to_device(p.data, "cpu")))
    handles = [] if branch is None else branch.replay(net)
    try:
        x = torch.as_tensor(x_np, dtype=dtype, device=torch_device)
        loss = torch.nn.functional.cross_entropy(net(x), torch.as_tensor(y_np, device=torch_device))
    finally:
        for h in handles:
            h.remove()
    if branch is not None:
        branch.check_all_taken()
    loss.backward()
    return loss.item(), [q.grad.detach().double().cpu() for q in net.parameters()]


# -- the branch at the kinks ---------------------------------------------------------------------
# A ReLU's gradient switches where its input crosses 0, a max-pool's where two inputs of a window
# tie. An input within rounding of a kink may fall on either side in fp32 and in float64, and the
# two gradients then differ by a whole term, whoever computes them: VGG-16's conv1 weight gradient
# is 1.5e-2 from float64 in PyTorch float32 (H100, session 21), while every conv pass of ours is
# within 1e-5 of it. A check of the arithmetic has the references take the tested net's branch.

KINK_TOL = 1e-4   # a flip this far (relative to its call's input RMS) from the kink is not rounding


def kinked_modules(net):
    """(name, module) of a PyTorch net's ReLUs and max-pools, the modules where a branch is taken."""
    import torch
    return [(name, m) for name, m in net.named_modules() if isinstance(m, (torch.nn.ReLU, torch.nn.MaxPool2d))]


def replay_branch(net, take, flips, too_large, tol=KINK_TOL):
    """Forward hooks that make PyTorch `net` take a recorded branch: each ReLU (made out of place, so
    the hook sees its input) returns input * mask, each max-pool gathers the recorded argmax, where
    take(name, module) gives this call's mask (bool, the input's shape) or indices (int64, the
    output's, flat over each plane as max_pool2d's return_indices). Each call also measures its own
    branch against the recorded one: a ReLU input on the other side of 0, or a window whose own
    maximum is above the recorded element, is a flip of size |input| (or the gap) over the RMS of
    the call's input, appended to `flips` as (name, size), and to `too_large` above `tol`.
    Returns the handles (remove() them to end the replay)."""
    import torch
    handles = []
    for name, m in kinked_modules(net):
        if isinstance(m, torch.nn.ReLU):
            m.inplace = False

        def hook(m, inp, out, name=name):
            x, kept = inp[0], take(name, m)
            relu = isinstance(m, torch.nn.ReLU)
            if tuple(kept.shape) != tuple((x if relu else out).shape):
                raise ValueError(f"branch replay: {name} recorded {tuple(kept.shape)}, the reference's call has "
                                 f"{tuple((x if relu else out).shape)} (another architecture, or calls out of order)")
            kept = kept.to(x.device)
            rms = float(x.detach().double().pow(2).mean().sqrt()) or 1.0
            if relu:
                replayed = x * kept.to(x.dtype)
                gaps = x.detach()[(x.detach() > 0) != kept].abs()
            else:
                replayed = x.flatten(2).gather(2, kept.flatten(2)).view(kept.shape)
                gaps = out.detach() - replayed.detach()
                gaps = gaps[gaps > 0]
            for gap in gaps.double().cpu().tolist():
                flips.append((name, gap / rms))
                if gap / rms > tol:
                    too_large.append((name, gap / rms))
            return replayed
        handles.append(m.register_forward_hook(hook))
    return handles


class OurBranch:
    """Our model's branch at its kinks, for torch_gradients to replay in a PyTorch copy:

        branch = OurBranch()
        with branch.recording():       # our forward: each ReLU's mask and each max-pool's argmax,
            model(x)                   # in call order (relu, add_relu, max_pool2d)
        torch_gradients(model, torch_net, x_np, y_np, torch.float64, "cuda", branch=branch)

    The zoo's models and torchvision's call their ReLUs and max-pools in the same order (ResNet's
    add_relu is torchvision's block.relu after the sum), so the i-th ReLU call of ours is the i-th
    ReLU call there; shapes are checked at each. Each replay starts from the first call, and counts
    its flips (flips, too_large: see replay_branch) into `flips` and `too_large`."""

    def __init__(self):
        self.masks, self.indices, self.flips, self.too_large = [], [], [], []
        self._next = None

    @contextlib.contextmanager
    def recording(self):
        import torch.nn.functional as TF

        import minitorch_fft.functional as F
        relu, add_relu, max_pool2d = F.relu, F.add_relu, F.max_pool2d

        def mask(y):
            self.masks.append(_torch(y.data) > 0)
            return y

        def pool(x, kernel_size, stride=None, padding=0):
            y = max_pool2d(x, kernel_size, stride, padding)
            self.indices.append(TF.max_pool2d(_torch(x.data), kernel_size, stride, padding,
                                              return_indices=True)[1])
            return y

        F.relu, F.add_relu, F.max_pool2d = lambda x: mask(relu(x)), lambda a, b: mask(add_relu(a, b)), pool
        try:
            yield self
        finally:
            F.relu, F.add_relu, F.max_pool2d = relu, add_relu, max_pool2d

    def replay(self, net):
        """Hooks on PyTorch `net` that take this branch from its first call (replay_branch)."""
        import torch
        masks, indices = iter(self.masks), iter(self.indices)
        self._next = (masks, indices)

        def take(name, m):
            try:
                return next(masks if isinstance(m, torch.nn.ReLU) else indices)
            except StopIteration:
                raise ValueError(f"branch replay: {name} is called more often than ours recorded "
                                 f"({len(self.masks)} ReLU, {len(self.indices)} max-pool calls)") from None
        return replay_branch(net, take, self.flips, self.too_large)

    def check_all_taken(self):
        """ValueError unless the last replay took every recorded call (the same architecture)."""
        left = [sum(1 for _ in it) for it in self._next]
        if any(left):
            raise ValueError(f"branch replay: {left[0]} ReLU and {left[1]} max-pool calls of ours were never "
                             "reached in the reference (another architecture?)")


def flip_report(flips):
    """One line on replay_branch's `flips`: how many kinks went the other way, and the largest."""
    worst = max((size for _, size in flips), default=0.0)
    return f"{len(flips)} kink(s) on the other side, the largest {worst:.1e} of its input's RMS"


def step_errors(model, got, ref):
    """{"loss": ..., parameter name: ...} relative errors of `got` against `ref`, each a
    (loss, [gradients]) pair as torch_gradients returns it."""
    errors = {"loss": abs(got[0] - ref[0]) / abs(ref[0])}
    for (name, _), g, r in zip(model.named_parameters(), got[1], ref[1], strict=True):
        errors[name] = rel_error(g, r)
    return errors


def step_check(model, torch_net, x_np, y_np, torch_device="cpu", reference=None):
    """Relative errors {name: err} of our model's loss and weight gradients against the same
    weights in PyTorch, float64 (torch_gradients; `reference` if already computed, and then
    torch_net is not used), both in eval mode.
    Our model runs on the device its parameters are on. Gradients are left zeroed afterwards."""
    import torch
    if reference is None:
        reference = torch_gradients(model, torch_net, x_np, y_np, torch.float64, torch_device)
    return step_errors(model, our_gradients(model, x_np, y_np), reference)


def our_gradients(model, x_np, y_np, branch=None):
    """(loss, [weight gradients]) of our model on x_np and y_np in eval mode, as torch_gradients
    gives PyTorch's (float64 CPU tensors), on the device its parameters are on; `branch` (an
    OurBranch) records the forward's branch. Gradients are left zeroed afterwards."""
    import torch

    import minitorch_fft as mt
    xp = model.parameters()[0].xp
    model.eval()
    model.zero_grad()
    try:
        with branch.recording() if branch is not None else contextlib.nullcontext():
            logits = model(mt.Tensor(xp.asarray(x_np)))
        loss = mt.CrossEntropyCriterion()(logits, xp.asarray(y_np))
        loss.backward()
        return (float(loss.item()), [torch.as_tensor(mt.to_device(p.grad, "cpu"), dtype=torch.float64)
                                     for p in model.parameters()])
    finally:
        model.zero_grad()
        model.train()


def torch_fp32_errors(model, torch_net, x_np, y_np, torch_device="cpu", reference=None, tf32=False, branch=None):
    """{name: relative error} of PyTorch float32 against PyTorch float64 (`reference` if already
    computed), both on our model's weights, batch and labels (torch_gradients): the error fp32
    arithmetic itself makes here, with cuDNN and cuBLAS strict (no TF32; tf32=True: PyTorch's TF32
    defaults, the yardstick of our TF32 mode) and cuDNN's heuristic algorithms (its benchmark
    search off, so no approximate algorithm it might time as fastest). branch: both take our
    model's recorded branch (OurBranch), so that the yardstick is rounding alone."""
    import torch
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.benchmark)
    torch.backends.cudnn.allow_tf32 = tf32 and TORCH_TF32_DEFAULTS["cudnn"]
    torch.backends.cuda.matmul.allow_tf32 = tf32 and TORCH_TF32_DEFAULTS["matmul"]
    torch.backends.cudnn.benchmark = False
    try:
        if reference is None:
            reference = torch_gradients(model, torch_net, x_np, y_np, torch.float64, torch_device, branch)
        got = torch_gradients(model, torch_net, x_np, y_np, torch.float32, torch_device, branch)
    finally:
        (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.benchmark) = saved
    return step_errors(model, got, reference)


# -- timing --------------------------------------------------------------------------------------

_SPIN_SRC = r"""extern "C" __global__ void spin(long long cycles)
{ long long t0 = clock64(); while (clock64() - t0 < cycles) {} }"""


def _spin_kernel(spin_us):
    """(kernel, cycles): a one-thread kernel that keeps the GPU busy for spin_us microseconds."""
    import cupy as cp
    import numpy as np
    if not hasattr(_spin_kernel, "kernel"):
        _spin_kernel.kernel = cp.RawKernel(_SPIN_SRC, "spin")
    khz = cp.cuda.Device().attributes["ClockRate"]
    return _spin_kernel.kernel, np.int64(spin_us * 1e-6 * khz * 1e3)


class StackSampler:
    """A sampling profile of Python threads: another thread reads their stacks every `interval_s`
    (sys._current_frames) and counts, per source line, the samples where it was the innermost
    frame (own) and where it was on the stack at all (within). cProfile's per-call hooks cost
    about what the adapter's small functions cost, and inflate them; a sample costs the profiled
    threads only the GIL hand-overs, made frequent while sampling (sys.setswitchinterval).

    Biased toward calls that release the GIL (a CuPy launch, a cuBLAS call, a synchronize): a
    sample waits for the GIL, which pure-Python code hands over only every switch interval, and a
    releasing call at once. So it says where threads block and wait well, and where the Python
    between those calls goes poorly: on the PyTorch adapter's AlexNet step (session 22) half the
    samples fell on kernel launch and GEMM lines. Time the pieces for that (exp_pytorch_host).

    thread_id: the one thread to sample (default: the one entering the block); all_threads=True
    samples every thread but the sampler's, so that work PyTorch's autograd engine runs on its
    device threads (a CUDA backward's Python) is seen too. A stack whose innermost function is
    one of `waits` (a thread blocked on another: the main thread in the engine's backward) is
    not counted.

        with StackSampler(all_threads=True) as sampler:
            for _ in range(50): step()
        print(sampler.report(25))
    """

    # the main thread in a CUDA backward; threads parked on a lock or an event (tqdm's monitor)
    WAITS = ("_engine_run_backward", "wait", "_wait_for_tstate_lock")

    def __init__(self, interval_s=1e-4, thread_id=None, all_threads=False, waits=WAITS):
        import threading
        self.interval_s, self.thread_id = interval_s, thread_id
        self.all_threads, self.waits = all_threads, set(waits)
        self.own, self.within, self.samples, self.ticks = {}, {}, 0, 0
        self._stop, self._thread = threading.Event(), None

    def __enter__(self):
        import threading
        self._target = self.thread_id or threading.get_ident()   # default: the thread entering the block
        self._stop.clear()                                       # a second block samples too (counts add up)
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval_s / 2)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        return False

    def _run(self):
        import threading
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            self.ticks += 1
            frames = sys._current_frames()
            if self.all_threads:
                for tid, frame in frames.items():
                    if tid != me:
                        self.sample(frame)
            elif self._target in frames:
                self.sample(frames[self._target])

    def sample(self, frame):
        """Count one stack, innermost frame first (not where it waits on another thread)."""
        if frame.f_code.co_name in self.waits:
            return
        self.samples += 1
        code = frame.f_code
        where = f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
        self.own[where] = self.own.get(where, 0) + 1
        seen = set()                 # a recursive function counts once per sample
        while frame is not None:
            code = frame.f_code
            seen.add(f"{code.co_filename}:{code.co_firstlineno} ({code.co_name})")
            frame = frame.f_back
        for func in seen:
            self.within[func] = self.within.get(func, 0) + 1

    def own_of(self, suffix):
        """Own samples of the source lines whose description ends with `suffix`, e.g. "(name)"."""
        return sum(n for where, n in self.own.items() if where.endswith(suffix))

    def report(self, top=25, strip=()):
        """Two tables as text: the source lines with the most own samples, the functions with
        the most samples within them; paths shortened by the prefixes in `strip`."""
        def short(where):
            for prefix in strip:
                where = where.replace(prefix, "")
            return where
        lines = [f"{self.samples} stacks counted in {self.ticks} samples, one every {self.interval_s * 1e6:.0f} us",
                 "", "share  own: innermost source line"]
        for where, n in sorted(self.own.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"{n / max(self.samples, 1):6.1%}  {short(where)}")
        lines += ["", "share  within: function on the stack"]
        for where, n in sorted(self.within.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"{n / max(self.samples, 1):6.1%}  {short(where)}")
        return "\n".join(lines)


def median_ms(fn, lib, warmup=3, repeat=10, before=None, spin_us=None):
    """Median milliseconds of fn() over `repeat` timed calls, after `warmup` untimed ones, with
    Python's garbage collector paused (as timeit does): a collection inside a timed span stalls
    the host that launches the work, on either side of a comparison (session 15: table3 runs had
    layer-passes of ours and of cuDNN's 2-6x slower than in the other runs; _median_ms below).

    lib "cupy" or "torch": CUDA events recorded on that library's current stream, the one the
    work is queued on; each timed call ends with a wait on its end event (a sync point). lib
    "cpu": the host clock around the call, nothing synchronised (NumPy work, or what issuing GPU
    work costs the host). `before` runs untimed before each call (e.g. to restore an input).
    spin_us (cupy only): a spin kernel keeps the GPU busy that long before each timed call, so
    the host's enqueue of fn() is hidden and only the GPU's time is counted (the device is
    synchronised after warm-up then)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _median_ms(fn, lib, warmup, repeat, before, spin_us)
    finally:
        if enabled:
            gc.enable()


def _median_ms(fn, lib, warmup, repeat, before, spin_us):
    """median_ms's measurement, the collector's state left to the caller."""
    if warmup < 0 or repeat < 1:
        raise ValueError(f"need warmup >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}")
    if lib == "cpu":
        if spin_us:
            raise ValueError("spin_us needs lib 'cupy'")
        for _ in range(warmup):
            if before:
                before()
            fn()
        times = []
        for _ in range(repeat):
            if before:
                before()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    if lib == "cupy":
        import cupy
        new_event, elapsed = cupy.cuda.Event, cupy.cuda.get_elapsed_time
    elif lib == "torch":
        import torch

        def new_event():
            return torch.cuda.Event(enable_timing=True)

        def elapsed(start, end):
            return start.elapsed_time(end)
    else:
        raise ValueError(f"lib must be 'cupy', 'torch' or 'cpu', got {lib!r}")
    if spin_us and lib != "cupy":
        raise ValueError("spin_us needs lib 'cupy'")
    for _ in range(warmup):
        if before:
            before()
        fn()
    if spin_us:
        spin, cycles = _spin_kernel(spin_us)
        cupy.cuda.Device().synchronize()
    start, end = new_event(), new_event()
    times = []
    for _ in range(repeat):
        if before:
            before()
        if spin_us:
            spin((1,), (1,), (cycles,))   # keeps the GPU busy while the host enqueues below
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(elapsed(start, end))
    return statistics.median(times)


def peak_extra_bytes(fn, lib):
    """Device memory fn() needs beyond what is allocated before it (inputs), output included.

    torch: the caching allocator's exact peak. cupy: the memory pool's size after one call, starting
    from an emptied pool; the pool keeps what it frees, so this is its high-water mark (to the
    pool's rounding).
    """
    if lib == "torch":
        import torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    if lib == "cupy":
        import cupy
        pool = cupy.get_default_memory_pool()
        cupy.cuda.Device().synchronize()
        pool.free_all_blocks()
        before = pool.used_bytes()
        fn()
        cupy.cuda.Device().synchronize()
        return pool.total_bytes() - before
    raise ValueError(f"lib must be 'cupy' or 'torch', got {lib!r}")


def peak_step_bytes(fn, lib, pools=()):
    """Peak device memory of a training step, everything it holds included (weights, gradients,
    momentum, activations, workspaces): {"peak": bytes, "reserved": bytes}, each measured alike on
    both sides, so that allocated compares with allocated and reserved with reserved.

    peak: the high-water mark of the bytes live tensors hold during one call. torch: the caching
    allocator's max_memory_allocated. cupy: the bytes the pools have handed out and not yet taken
    back, followed allocation by allocation through a MemoryHook (pool_peak), to the pools' 512-byte
    rounding. `pools` are CUDA graphs' own pools (GraphedStep.pool): every block in one, handed out
    or free, holds a buffer its graph's replays write (a replay allocates nothing), so each counts
    whole (up to session 24 only its blocks in use at the start were: VGG-16's graph step read 1.65
    GiB against its eager step's 5.42). reserved: what the allocator holds from the device. torch:
    max_memory_reserved. cupy: the default pool's size (plus that of `pools`) after one call from an
    emptied pool: the pool keeps what it frees, so its size is its high-water mark, with its
    rounding and fragmentation (what "peak" meant for cupy before session 10)."""
    if lib == "torch":
        import torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return {"peak": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    if lib == "cupy":
        import cupy
        all_pools = (cupy.get_default_memory_pool(), *pools)
        cupy.cuda.Device().synchronize()
        all_pools[0].free_all_blocks()
        with pool_peak(all_pools) as hook:
            fn()
        cupy.cuda.Device().synchronize()
        graphs_free = sum(p.total_bytes() - p.used_bytes() for p in pools)   # the graphs' buffers
        return {"peak": hook.peak + graphs_free, "reserved": sum(p.total_bytes() for p in all_pools)}
    raise ValueError(f"lib must be 'cupy' or 'torch', got {lib!r}")


def pool_peak(pools):
    """`with pool_peak(pools) as hook:` a cupy MemoryHook following the bytes CuPy's pools hand out
    and take back inside the block: hook.live now, hook.peak its high-water mark, starting from the
    bytes `pools` have in use. Hooks are per thread: allocations made by other threads are missed."""
    import cupy

    class PoolPeak(cupy.cuda.MemoryHook):
        name = "minitorch_pool_peak"

        def __init__(self, live):
            self.live = self.peak = live
            self.handed_out = {}   # pointer -> bytes, so a free is taken back at its malloc's size

        def malloc_postprocess(self, mem_ptr, mem_size, **_):
            if mem_ptr:            # 0: the allocation failed
                self.handed_out[mem_ptr] = mem_size
                self.live += mem_size
                self.peak = max(self.peak, self.live)

        def free_postprocess(self, mem_ptr, mem_size, **_):
            self.live -= self.handed_out.pop(mem_ptr, mem_size)

    return PoolPeak(sum(p.used_bytes() for p in pools))


def pool_misses():
    """`with pool_misses() as misses:` misses.sizes, the bytes of each device allocation
    (cudaMalloc: a CuPy pool's miss) made inside the block (a cupy MemoryHook: this thread's)."""
    import cupy

    class PoolMisses(cupy.cuda.MemoryHook):
        name = "minitorch_pool_misses"

        def __init__(self):
            self.sizes = []

        def alloc_preprocess(self, device_id, mem_size):
            self.sizes.append(mem_size)

    return PoolMisses()


def poisoned(fn):
    """fn() with every CuPy allocation it makes filled with 0xFF bytes (NaN as float32) first.

    The pool hands back blocks that the previous implementation filled with the right answer
    for the same data: an output element a backend forgot to write would pass the check. Here
    it is NaN, and the check fails."""
    import cupy as cp
    previous = cp.cuda.get_allocator()

    def allocate(size):
        mem = previous(size)
        if size:
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
        return mem

    cp.cuda.set_allocator(allocate)
    try:
        return fn()
    finally:
        cp.cuda.set_allocator(previous)


# -- cuDNN, the baseline -------------------------------------------------------------------------

TORCH_TF32_DEFAULTS = {}   # PyTorch's TF32 settings as the process started (setup_cudnn fills it)


def setup_cudnn(torch):
    """cuDNN as every baseline here runs it: benchmark mode over every algorithm it has.

    torch.backends.cudnn.benchmark_limit defaults to 10: cuDNN would time only its heuristics'
    first ten plans, while our tuners time every candidate (results before session 4 ran with
    that default; a benchmark audit found cuDNN TF32 slower than strict on Table 4 L1-L3 bprop,
    which a full search should not give). 0 tries them all. Records PyTorch's TF32 defaults in
    TORCH_TF32_DEFAULTS (what set_tf32("tf32") restores) and returns the settings for a result's
    meta."""
    torch.backends.cudnn.benchmark = True
    if hasattr(torch.backends.cudnn, "benchmark_limit"):
        torch.backends.cudnn.benchmark_limit = 0
    if not TORCH_TF32_DEFAULTS:    # a second call would record set_tf32's values, not PyTorch's
        TORCH_TF32_DEFAULTS.update(cudnn=torch.backends.cudnn.allow_tf32,
                                   matmul=torch.backends.cuda.matmul.allow_tf32)
    return {"cudnn_benchmark": True,
            "cudnn_benchmark_limit": getattr(torch.backends.cudnn, "benchmark_limit", None),
            "torch_tf32_defaults": dict(TORCH_TF32_DEFAULTS)}


def set_tf32(mode):
    """PyTorch's cuDNN and cuBLAS in "strict" fp32 (TF32 off) or in its "tf32" defaults."""
    import torch
    on = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = on and TORCH_TF32_DEFAULTS["cudnn"]
    torch.backends.cuda.matmul.allow_tf32 = on and TORCH_TF32_DEFAULTS["matmul"]


# -- provenance ----------------------------------------------------------------------------------

def slug(name):
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (a directory name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def provenance(device, **versions):
    """Where, when and how: device name, UTC date, exact command line, source commit, the
    settings that differ from their defaults (MINITORCH_AUTO_BACKENDS=ours, say, which the command
    line does not show), platform and versions."""
    return {
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv)),
        "commit": source_commit(),
        "settings": backends.config.changed(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **versions,
    }


def host_probe_ms(repeat=7):
    """Median milliseconds of a fixed pure-Python workload on this host: a measure of how fast the
    interpreter runs here, beside results whose rows are host-bound (the PyTorch adapter's eager
    step). Lent machines of one kind differ: the same converted AlexNet step took 5.5-6.9 ms of
    host time on one H100 machine and 8.8-9.9 on another (session 22). Lower is faster."""
    def work():
        total = 0
        for i in range(100_000):
            total += i & 7
        return total
    return median_ms(work, "cpu", 0, repeat)


def device_identity(cp):
    """Which GPU of the host this process runs on, from CuPy: {"device_index", "pci_bus_id",
    "device_name"} (what CUDA_VISIBLE_DEVICES selected, named by the device itself)."""
    from minitorch_fft.backends import tuning
    device = cp.cuda.Device()
    return {"device_index": device.id, "pci_bus_id": device.pci_bus_id,
            "device_name": tuning.device_name(cp)}


def cupy_tf32(cp):
    """"1" when CuPy's own float32 matmul runs on TF32 (CUPY_TF32=1 as CuPy read it), else "0";
    "unknown" where this CuPy does not say."""
    import numpy as np
    try:
        from cupy._core import _routines_linalg as linalg
        return "1" if linalg.get_compute_type(np.dtype(np.float32)) == linalg.COMPUTE_TYPE_TF32 else "0"
    except (ImportError, AttributeError):
        return "unknown"


def source_commit(root=RESULTS_DIR.parent):
    """The commit the measured code comes from.

    The setting `commit` (MINITORCH_COMMIT) when set: a copy of the tree on a lent machine may
    carry a stale .git, so the caller names the commit it sent. Otherwise git's HEAD, marked when
    tracked files differ from it (then HEAD alone does not say what ran), or "unknown" without git."""
    named = backends.config.get("commit")
    if named:
        return named

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(root).resolve():
            return "unknown (not a git checkout of this tree; set MINITORCH_COMMIT)"  # an outer repo
        head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here; set MINITORCH_COMMIT)"
    return f"{head} with uncommitted changes" if dirty else head


# -- result files --------------------------------------------------------------------------------

def write_text(path, text):
    """Write `path` atomically (its folder is made): readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(text)
    return path


def save_figure(fig, path, **savefig_args):
    """A Matplotlib figure to a PNG file, atomically (savefig_args: dpi, bbox_inches, ...)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", **savefig_args)
    return path


def markdown_table(rows, columns):
    """A Markdown table of `rows` (dicts); columns is [(header, key, format spec)]."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for _, key, spec in columns:
            value = row.get(key)
            cells.append("" if value is None else format(value, spec) if spec else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def meta_lines(meta):
    """The provenance as Markdown list items (the command in backticks)."""
    return [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]


def write_results(name, meta, rows, columns, title, notes="", out_dir=RESULTS_DIR, sections=(), extra=None,
                  subdir=""):
    """Write out_dir/<device slug>/<subdir>/<name>.json (meta + rows) and .md (provenance + table),
    each atomically.

    sections: more Markdown tables after the main one, as (heading, rows, columns); extra: more
    top-level JSON keys (a section's rows among them); subdir: "experiments" for the one-off
    experiments' results. Returns the two paths.
    """
    folder = Path(out_dir) / slug(meta["device"]) / subdir
    json_path = write_text(folder / f"{name}.json",
                           json.dumps({"meta": meta, "rows": rows, **(extra or {})}, indent=1) + "\n")
    body = [markdown_table(rows, columns)]
    for heading, section_rows, section_columns in sections:
        body += ["", f"## {heading}", "", markdown_table(section_rows, section_columns)]
    md_path = write_text(folder / f"{name}.md",
                         "\n".join([f"# {title}", ""] + meta_lines(meta) + ["", notes.strip(), ""] + body) + "\n")
    return json_path, md_path
