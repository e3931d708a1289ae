"""Layers with Torch's names and PyTorch's keywords.

Modules are thin classes with plain attributes. Parameters, buffers and submodules are
found by walking attributes in assignment order, which gives PyTorch's
state_dict key layout (``features.0.weight``, ``bn1.running_mean``) for free.
"""
import math
from collections.abc import Mapping

import numpy as np

from . import functional as F
from . import random as _random
from .checkpoint import CheckpointError, buffer_array, state_array
from .device import device_of, to_device
from .tensor import Parameter, Tensor, check_sizes, check_tensors
from .backends.common import format_bytes, machine_bytes
from .utils import pair, positive_int


class Buffer:
    """A module's state that is not trained (BatchNorm's running statistics): in state_dict() and
    checkpoints, moved by Module.to(), never in parameters(). `data` is a raw array of any dtype
    (num_batches_tracked is int64, as PyTorch's). A layer updates it in place (`*=`, `+=`), never
    by rebinding `data`: a captured CUDA graph replays into the memory it saw at capture."""

    def __init__(self, data):
        self.data = data

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    device = property(lambda self: device_of(self.data))

    def __repr__(self):
        return f"Buffer(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class Module:
    training = True

    def forward(self, *args):
        raise NotImplementedError

    def __call__(self, *args):
        return self.forward(*args)

    # -- tree walking ---------------------------------------------------------
    def children(self):
        """(name, module) pairs of the direct submodules, in definition order."""
        return [(k, v) for k, v in vars(self).items() if isinstance(v, Module)]

    def named_parameters(self, prefix=""):
        return [(k, v) for k, v in self.named_state(prefix) if isinstance(v, Parameter)]

    def parameters(self):
        """Each Parameter once, in definition order (a tied weight is listed, and updated, once)."""
        seen, out = set(), []
        for _, p in self.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def named_buffers(self, prefix=""):
        return [(k, v) for k, v in self.named_state(prefix) if isinstance(v, Buffer)]

    def buffers(self):
        return [b for _, b in self.named_buffers()]

    def named_state(self, prefix=""):
        """(name, Parameter or Buffer) in PyTorch's state_dict order: a module's own parameters,
        then its own buffers, then each submodule's, depth first."""
        own = vars(self).items()
        out = [(prefix + k, v) for k, v in own if isinstance(v, Parameter)]
        out += [(prefix + k, v) for k, v in own if isinstance(v, Buffer)]
        for name, child in self.children():
            out += child.named_state(prefix + name + ".")
        return out

    def modules(self):
        out = [self]
        for _, child in self.children():
            out += child.modules()
        return out

    # -- modes, devices, gradients --------------------------------------------
    def train(self, mode=True):
        for m in self.modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def to(self, device):
        """Move every parameter (and its gradient) and every buffer to `device`, in place."""
        for p in self.parameters():
            p.data = to_device(p.data, device)
            if p.grad is not None:
                p.grad = to_device(p.grad, device)
        for b in self.buffers():
            b.data = to_device(b.data, device)
        return self

    # -- state ----------------------------------------------------------------
    def state_dict(self):
        """name -> NumPy array copy of every parameter and buffer, with PyTorch's keys, order,
        shapes and dtypes."""
        return {k: to_device(p.data, "cpu").copy() for k, p in self.named_state()}

    def load_state_dict(self, state):
        """Copy `state` (name -> array) into the parameters, all or nothing: every key, shape and
        dtype is checked before any parameter changes; a CheckpointError (a ValueError) names the
        first problem. Values are taken as PyTorch's load_state_dict copies them into float32
        parameters: float16 and float32 exactly, a float64 that fits rounded to the nearest
        float32 (bit for bit what torch's copy_ gives), NaN and inf copied as they are. Refused,
        where PyTorch would cast: a finite float64 beyond float32's range (it would become inf),
        complex (the imaginary part would be lost), integer, bool and non-numeric arrays. Buffers
        take their own dtype: an integer buffer (num_batches_tracked) takes integers only.
        PyTorch tensors on the CPU are taken as they are (torchvision's state_dict())."""
        self.assign_state(self.checked_state(state))
        return self

    def checked_state(self, state):
        """load_state_dict's checks: [(parameter or buffer, its new data on its device)], or
        CheckpointError. Nothing changes here; assign_state() then only rebinds attributes, which
        cannot fail (a captured CUDA graph sees the new addresses and captures again)."""
        if not isinstance(state, Mapping):
            raise CheckpointError(f"a state_dict is a mapping of names to arrays, got {type(state).__name__}")
        params = dict(self.named_state())
        missing = sorted(set(params) - set(state))
        unexpected = sorted(map(str, set(state) - set(params)))
        if missing or unexpected:
            raise CheckpointError(f"state_dict keys do not match: missing {missing}, unexpected {unexpected}")
        values = [(p, buffer_array(state[k], p.shape, p.dtype, f"state_dict[{k!r}]") if isinstance(p, Buffer)
                   else state_array(state[k], p.shape, f"state_dict[{k!r}]")) for k, p in params.items()]
        return [(p, to_device(v, p.device)) for p, v in values]

    @staticmethod
    def assign_state(values):
        for p, v in values:
            p.data = v

    def __repr__(self):
        kids = self.children()
        if not kids:
            return type(self).__name__ + "()"
        body = "\n".join(f"  ({k}): " + repr(m).replace("\n", "\n  ") for k, m in kids)
        return f"{type(self).__name__}(\n{body}\n)"


def _uniform(shape, fan_in):
    """Torch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn from the framework's stream. A
    shape whose draw (float64, then cast: 12 bytes an element) exceeds the machine's memory is a
    ValueError before any is drawn (models.get("alexnet", num_classes=10**9) asked NumPy for 30 TiB
    part-way through building the model; a size just under the memory could meet the OOM killer)."""
    need = 12 * math.prod(shape)
    limit = machine_bytes()   # the host's: the draw is NumPy's, wherever the model goes next
    if need > limit:
        raise ValueError(f"a parameter of shape {tuple(shape)} needs {format_bytes(need)} to initialise (drawn in "
                         f"float64, then float32), more than this machine's {format_bytes(limit)}")
    bound = 1.0 / math.sqrt(fan_in)
    return Parameter(_random.generator().uniform(-bound, bound, size=shape).astype(np.float32))


class Sequential(Module):
    def __init__(self, *modules):
        for m in modules:
            if not isinstance(m, Module):
                raise TypeError(f"Sequential takes Modules, got {type(m).__name__}")
        self.layers = list(modules)

    def children(self):
        return [(str(i), m) for i, m in enumerate(self.layers)]

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x


class SpatialConvolution(Module):
    """2-D cross-correlation layer; `backend` picks the algorithm ("auto", "gemm", ...).

    The arguments come in PyTorch's order, (in_planes, out_planes, kernel_size, stride, padding), each
    size an int or an (h, w) pair; not Lua Torch's (nIn, nOut, kW, kH, dW, dH, padW, padH), whose
    fourth argument is a kernel width. `bias` and `backend` are keywords only, so a Lua-style call
    with more than five numbers is refused."""

    def __init__(self, in_planes, out_planes, kernel_size, stride=1, padding=0, *, bias=True,
                 backend="auto"):
        in_planes = positive_int(in_planes, "in_planes")
        out_planes = positive_int(out_planes, "out_planes")
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = pair(stride, "stride")
        self.padding = pair(padding, "padding")
        if min(self.kernel_size) < 1:
            raise ValueError(f"kernel_size must be >= 1, got {self.kernel_size}")
        if min(self.stride) < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if min(self.padding) < 0:
            raise ValueError(f"padding must be >= 0, got {self.padding}")
        if backend != "auto":
            from . import backends
            backends.get(backend)  # fail now on an unknown name, not at the first batch
        self.in_planes, self.out_planes, self.backend = in_planes, out_planes, backend
        kh, kw = self.kernel_size
        fan_in = in_planes * kh * kw
        self.weight = _uniform((out_planes, in_planes, kh, kw), fan_in)
        self.bias = _uniform((out_planes,), fan_in) if bias else None

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.backend)

    def __repr__(self):
        kh, kw = self.kernel_size
        s = f"SpatialConvolution({self.in_planes} -> {self.out_planes}, {kh}x{kw}"
        if self.stride != (1, 1):
            s += f", stride {self.stride[0] if self.stride[0] == self.stride[1] else self.stride}"
        if self.padding != (0, 0):
            s += f", pad {self.padding[0] if self.padding[0] == self.padding[1] else self.padding}"
        if self.backend != "auto":
            s += f", backend={self.backend}"
        return s + ")"


class SpatialMaxPooling(Module):
    def __init__(self, kernel_size, stride=None, padding=0):
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else pair(stride, "stride")
        self.padding = pair(padding, "padding")
        _check_pool("SpatialMaxPooling", self.kernel_size, self.stride, self.padding)

    def forward(self, x):
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def __repr__(self):
        return _pool_repr("SpatialMaxPooling", self.kernel_size, self.stride, self.padding)


class SpatialAveragePooling(Module):
    """Average pooling; count_include_pad=True (torch's default) divides by the window's size."""

    def __init__(self, kernel_size, stride=None, padding=0, count_include_pad=True):
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else pair(stride, "stride")
        self.padding = pair(padding, "padding")
        self.count_include_pad = bool(count_include_pad)
        _check_pool("SpatialAveragePooling", self.kernel_size, self.stride, self.padding)

    def forward(self, x):
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.count_include_pad)

    def __repr__(self):
        return _pool_repr("SpatialAveragePooling", self.kernel_size, self.stride, self.padding)


class SpatialAdaptiveAveragePooling(Module):
    """Average pooling to a fixed (oh, ow) output whatever the input size (torchvision's avgpool)."""

    def __init__(self, output_size):
        self.output_size = pair(output_size, "output_size")
        if min(self.output_size) < 1:
            raise ValueError(f"SpatialAdaptiveAveragePooling: output_size {self.output_size} must be >= 1")

    def forward(self, x):
        return F.adaptive_avg_pool2d(x, self.output_size)

    def __repr__(self):
        return f"SpatialAdaptiveAveragePooling({self.output_size[0]}x{self.output_size[1]})"


def _check_pool(name, k, s, p):
    if min(k) < 1 or min(s) < 1:
        raise ValueError(f"{name}: kernel_size {k} and stride {s} must be >= 1")
    if min(p) < 0 or p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"{name}: padding {p} must be >= 0 and at most half the kernel {k}")


def _pool_repr(name, k, s, p):
    out = f"{name}({k[0]}x{k[1]}, stride {s[0] if s[0] == s[1] else s}"
    if p != (0, 0):
        out += f", pad {p[0] if p[0] == p[1] else p}"
    return out + ")"


class SpatialBatchNormalization(Module):
    """Batch normalisation of NCHW input per plane, PyTorch's BatchNorm2d: in training the batch's
    mean and (biased) variance normalise, and the running statistics move towards the batch's
    (unbiased variance) by `momentum`, or, with momentum=None, to the cumulative average over
    the num_batches_tracked batches; in evaluation the running statistics normalise."""

    def __init__(self, planes, eps=1e-5, momentum=0.1, affine=True):
        self.planes = positive_int(planes, "planes")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"SpatialBatchNormalization: eps must be a finite number > 0, got {eps!r}")
        if momentum is not None and not (isinstance(momentum, (int, float)) and 0 <= momentum <= 1):
            raise ValueError(f"SpatialBatchNormalization: momentum must be in [0, 1] or None (the "
                             f"cumulative average), got {momentum!r}")
        self.eps, self.momentum, self.affine = float(eps), momentum, bool(affine)
        if affine:
            self.weight = Parameter(np.ones(planes, np.float32))
            self.bias = Parameter(np.zeros(planes, np.float32))
        else:
            self.weight = self.bias = None
        self.running_mean = Buffer(np.zeros(planes, np.float32))
        self.running_var = Buffer(np.ones(planes, np.float32))
        self.num_batches_tracked = Buffer(np.zeros((), np.int64))

    def forward(self, x):
        check_tensors("batch_norm", x=x)
        if x.ndim != 4 or x.shape[1] != self.planes:
            raise ValueError(f"{self!r} expects NCHW input with {self.planes} planes, got shape "
                             f"{tuple(x.shape)}")
        momentum = self.momentum
        if self.training:
            self.num_batches_tracked.data += 1             # in place, on the device
            if momentum is None:                           # 1/n, on the device: no host sync
                momentum = 1.0 / self.num_batches_tracked.data
        return F.batch_norm(x, self.running_mean.data, self.running_var.data, self.weight, self.bias,
                            self.training, momentum, self.eps)

    def __repr__(self):
        return f"SpatialBatchNormalization({self.planes}, eps={self.eps}, momentum={self.momentum})"


class ReLU(Module):
    def forward(self, x):
        return F.relu(x)


class Linear(Module):
    def __init__(self, in_features, out_features, bias=True):
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        self.weight = _uniform((out_features, in_features), in_features)
        self.bias = _uniform((out_features,), in_features) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def __repr__(self):
        return f"Linear({self.in_features} -> {self.out_features})"


class Dropout(Module):
    def __init__(self, p=0.5):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)

    def __repr__(self):
        return f"Dropout({self.p})"


class View(Module):
    """Reshape each sample to `shape` (Torch's nn.View); the batch dimension is kept. Sizes are
    ints (NumPy's too) or one tuple of them, one of them may be -1; others are refused as
    torch's view refuses them (a TypeError naming a float or bool size)."""

    def __init__(self, *shape):
        self.shape = check_sizes(shape, "View")

    def forward(self, x):
        check_tensors("View", x=x)
        return F.reshape(x, (x.shape[0],) + self.shape)

    def __repr__(self):
        return f"View({', '.join(map(str, self.shape))})"


class Flatten(Module):
    def forward(self, x):
        check_tensors("Flatten", x=x)
        return F.reshape(x, (x.shape[0], -1))


class LogSoftMax(Module):
    def forward(self, x):
        return F.log_softmax(x)


class ClassNLLCriterion(Module):
    def forward(self, logp, target):
        return F.nll_loss(logp, target)


class CrossEntropyCriterion(Module):
    """LogSoftMax followed by ClassNLLCriterion, fused."""

    def forward(self, x, target):
        return F.cross_entropy(x, target)


__all__ = ["Module", "Buffer", "Sequential", "SpatialConvolution", "SpatialMaxPooling",
           "SpatialAveragePooling", "SpatialAdaptiveAveragePooling", "SpatialBatchNormalization", "ReLU", "Linear",
           "Dropout", "View", "Flatten", "LogSoftMax", "ClassNLLCriterion", "CrossEntropyCriterion",
           "Tensor", "Parameter"]
