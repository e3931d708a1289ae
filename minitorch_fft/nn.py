"""Layers with Torch's names and PyTorch's keywords.

Modules are thin classes with plain attributes. Parameters and submodules are
found by walking attributes in assignment order, which gives PyTorch's
state_dict key layout (``features.0.weight``) for free.
"""
import math
from collections.abc import Mapping

import numpy as np

from . import functional as F
from . import random as _random
from .checkpoint import CheckpointError, state_array
from .device import to_device
from .tensor import Parameter, Tensor, check_sizes
from .utils import pair, positive_int


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
        out = [(prefix + k, v) for k, v in vars(self).items() if isinstance(v, Parameter)]
        for name, child in self.children():
            out += child.named_parameters(prefix + name + ".")
        return out

    def parameters(self):
        """Each Parameter once, in definition order (a tied weight is listed, and updated, once)."""
        seen, out = set(), []
        for _, p in self.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
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
        """Move every parameter (and its gradient) to `device`, in place."""
        for p in self.parameters():
            p.data = to_device(p.data, device)
            if p.grad is not None:
                p.grad = to_device(p.grad, device)
        return self

    # -- state ----------------------------------------------------------------
    def state_dict(self):
        """name -> NumPy array copy, with PyTorch's keys and shapes."""
        return {k: to_device(p.data, "cpu").copy() for k, p in self.named_parameters()}

    def load_state_dict(self, state):
        """Copy `state` (name -> array) into the parameters, all or nothing: every key, shape and
        dtype is checked before any parameter changes; a CheckpointError (a ValueError) names the
        first problem. Values are taken as PyTorch's load_state_dict copies them into float32
        parameters: float16 and float32 exactly, a float64 that fits rounded to the nearest
        float32 (bit for bit what torch's copy_ gives), NaN and inf copied as they are. Refused,
        where PyTorch would cast: a finite float64 beyond float32's range (it would become inf),
        complex (the imaginary part would be lost), integer, bool and non-numeric arrays."""
        self.assign_state(self.checked_state(state))
        return self

    def checked_state(self, state):
        """load_state_dict's checks: [(parameter, its new data on its device)], or CheckpointError.
        Nothing changes here; assign_state() then only rebinds attributes, which cannot fail."""
        if not isinstance(state, Mapping):
            raise CheckpointError(f"a state_dict is a mapping of names to arrays, got {type(state).__name__}")
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(state))
        unexpected = sorted(map(str, set(state) - set(params)))
        if missing or unexpected:
            raise CheckpointError(f"state_dict keys do not match: missing {missing}, unexpected {unexpected}")
        values = [(p, state_array(state[k], p.shape, f"state_dict[{k!r}]")) for k, p in params.items()]
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
    """Torch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn from the framework's stream."""
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
    """2-D cross-correlation layer; `backend` picks the algorithm ("auto", "gemm", ...)."""

    def __init__(self, in_planes, out_planes, kernel_size, stride=1, padding=0, bias=True,
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
            import backends
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
    def __init__(self, kernel_size, stride=None):
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else pair(stride, "stride")
        if min(self.kernel_size) < 1 or min(self.stride) < 1:
            raise ValueError(f"SpatialMaxPooling: kernel_size {self.kernel_size} and stride "
                             f"{self.stride} must be >= 1")

    def forward(self, x):
        return F.max_pool2d(x, self.kernel_size, self.stride)

    def __repr__(self):
        return f"SpatialMaxPooling({self.kernel_size[0]}x{self.kernel_size[1]}, stride {self.stride[0]})"


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
        return F.reshape(x, (x.shape[0],) + self.shape)

    def __repr__(self):
        return f"View({', '.join(map(str, self.shape))})"


class Flatten(Module):
    def forward(self, x):
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


__all__ = ["Module", "Sequential", "SpatialConvolution", "SpatialMaxPooling", "ReLU", "Linear",
           "Dropout", "View", "Flatten", "LogSoftMax", "ClassNLLCriterion", "CrossEntropyCriterion",
           "Tensor", "Parameter"]
