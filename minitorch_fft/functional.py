"""Differentiable operations, each written once against the array module ``xp``.

Only ``conv2d`` is device-specific, and it delegates to ``backends``.
"""
import functools
from pathlib import Path

import numpy as np

import backends
from backends import cgemm
from backends.common import cuda_module, launch_1d

from . import random as _random
from .device import get_array_module
from .utils import is_number, pair as _pair
from .tensor import Function, Tensor, check_sizes


# -- elementwise and shape ---------------------------------------------------
class Add(Function):
    def forward(self, a, b):
        return a + b

    def backward(self, g):
        return g, g


class Mul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a * b

    def backward(self, g):
        return (g * self.b if self.needs_input_grad[0] else None,
                g * self.a if self.needs_input_grad[1] else None)


class Sum(Function):
    def forward(self, x):
        self.shape = x.shape
        return x.sum(dtype=x.dtype).reshape(())

    def backward(self, g):
        return get_array_module(g).broadcast_to(g, self.shape).copy()


class Reshape(Function):
    def forward(self, x, shape):
        self.in_shape = x.shape
        try:
            return x.reshape(shape)
        except ValueError:
            raise ValueError(f"cannot view a tensor of shape {tuple(x.shape)} as {tuple(shape)}: "
                             "the element counts differ") from None

    def backward(self, g):
        return g.reshape(self.in_shape)


def _check_same_shape(a, b, op):
    if a.shape != b.shape:
        raise ValueError(f"{op}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)} (no broadcasting)")


class Shift(Function):
    """x + c for a number c."""

    def forward(self, x, c):
        return x + x.dtype.type(c)

    def backward(self, g):
        return g


class Scale(Function):
    """x * c for a number c."""

    def forward(self, x, c):
        self.c = c
        return x * x.dtype.type(c)

    def backward(self, g):
        return g * g.dtype.type(self.c)


def _operands(a, b, op):
    """(a, b) as Tensors of one shape, or (a, number); TypeError for anything else."""
    if not isinstance(a, Tensor) or not (isinstance(b, Tensor) or is_number(b)):
        raise TypeError(f"{op} takes Tensors of one shape, or a Tensor and a number; got "
                        f"{type(a).__name__} and {type(b).__name__}")
    if isinstance(b, Tensor):
        _check_same_shape(a, b, op)


def add(a, b):
    """a + b for Tensors of one shape (no broadcasting), or a Tensor plus a number."""
    _operands(a, b, "add")
    return Add.apply(a, b) if isinstance(b, Tensor) else Shift.apply(a, c=float(b))


def mul(a, b):
    """a * b elementwise for Tensors of one shape (no broadcasting), or a Tensor times a number."""
    _operands(a, b, "mul")
    return Mul.apply(a, b) if isinstance(b, Tensor) else Scale.apply(a, c=float(b))


def sum(x):  # noqa: A001 - the Torch name
    return Sum.apply(x)


def reshape(x, shape):
    return Reshape.apply(x, shape=check_sizes((shape,), "reshape"))


# -- layers' maths -----------------------------------------------------------
class ReLUFn(Function):
    def forward(self, x):
        self.mask = x > 0
        return get_array_module(x).maximum(x, 0)  # maximum propagates NaN, as Torch does

    def backward(self, g):
        return g * self.mask


def relu(x):
    return ReLUFn.apply(x)


class LinearFn(Function):
    """y = x w^T + b. The GEMMs go through backends.cgemm in strict fp32 (on the GPU, cuBLAS with
    the transposes as operand flags; on the CPU, np.matmul): the one GEMM path a CUDA graph can
    capture (minitorch_fft.graphs)."""

    def forward(self, x, w, b=None):
        self.x, self.w = x, w
        y = cgemm.matmul(get_array_module(x), x, w, op_b="T", strict=True)  # (S, in) @ (in, out)
        if b is not None:
            y += b
        return y

    def backward(self, g):
        xp = get_array_module(g)
        gx = cgemm.matmul(xp, g, self.w, strict=True) if self.needs_input_grad[0] else None
        gw = cgemm.matmul(xp, g, self.x, op_a="T", strict=True) if self.needs_input_grad[1] else None
        gb = g.sum(axis=0) if len(self.needs_input_grad) > 2 else None
        return (gx, gw, gb)[:len(self.parents)]


def linear(x, weight, bias=None):
    if x.ndim != 2:
        raise ValueError(f"linear expects input of shape (batch, features), got {tuple(x.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: input has {x.shape[1]} features, weight expects {weight.shape[1]}")
    return LinearFn.apply(x, weight) if bias is None else LinearFn.apply(x, weight, bias)


class MaxPool2dFn(Function):
    """Max pooling without padding, floor mode (Torch's default). The argmax of each window
    (its offset i * kw + j, the last NaN if there is one, so NaN propagates as in Torch) is
    kept for backward, which routes each output's gradient to that element only.

    On the GPU each pass is one kernel of kernels/pool.cu (no synchronisation with the host: a
    boolean-mask assignment would wait for the GPU at every window offset); on the CPU the
    same arithmetic runs over the k*k strided views."""

    def forward(self, x, kernel_size, stride):
        xp = get_array_module(x)
        (kh, kw), (sh, sw) = kernel_size, stride
        n, c, h, w = x.shape
        oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
        self.x_shape, self.geom = x.shape, (kh, kw, sh, sw, oh, ow)
        if xp is not np:
            x = xp.ascontiguousarray(x)
            out = xp.empty((n, c, oh, ow), dtype=x.dtype)
            arg = xp.empty((n, c, oh, ow), dtype=np.uint8)
            _pool("fwd", x.size, x, h, w, kh, kw, sh, sw, oh, ow, out, arg)
            self.arg = arg
            return out
        out, arg = None, np.zeros((n, c, oh, ow), dtype=np.uint8)
        # One pass per kernel offset: k*k strided views, no im2col copy.
        for i in range(kh):
            for j in range(kw):
                v = x[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
                if out is None:
                    out = v.copy()
                    continue
                take = (v > out) | np.isnan(v)  # NaN wins, so it propagates
                out = np.where(take, v, out)
                arg = np.where(take, np.uint8(i * kw + j), arg)
        self.arg = arg
        return out

    def backward(self, g):
        xp = get_array_module(g)
        kh, kw, sh, sw, oh, ow = self.geom
        if xp is not np:
            _, _, h, w = self.x_shape
            gx = xp.empty(self.x_shape, dtype=g.dtype)
            _pool("bwd", gx.size, xp.ascontiguousarray(g), self.arg, h, w, kh, kw, sh, sw, oh, ow, gx)
            return gx
        gx = np.zeros(self.x_shape, dtype=g.dtype)
        for i in range(kh):
            for j in range(kw):
                gx[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] += \
                    np.where(self.arg == i * kw + j, g, 0)
        return gx


_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
# pool.cu's kernels are templated on the index type: 32-bit index arithmetic unless an array
# reaches 2^31 elements (64-bit division and remainder are emulated on the GPU).
POOL_NAME_EXPRESSIONS = tuple(f"minitorch_maxpool_{kind}<{t}>" for kind in ("fwd", "bwd")
                              for t in ("int", "long long"))


@functools.lru_cache(maxsize=None)
def _pool_kernel(kind, wide):
    """kernels/pool.cu's minitorch_maxpool_<kind> for int (or, `wide`, long long) indices,
    compiled on first use (CuPy)."""
    module = cuda_module("pool.cu", ("--std=c++17",), POOL_NAME_EXPRESSIONS, directory=_KERNEL_DIR)
    return module.get_function(f"minitorch_maxpool_{kind}<{'long long' if wide else 'int'}>")


def _pool(kind, size, *args):
    """Launch the max-pooling kernel `kind` ('fwd' or 'bwd') over arrays of up to `size`
    elements: args are the inputs (contiguous), then h, w, kh, kw, sh, sw, oh, ow, then the
    outputs (fresh, contiguous); one thread per element of the first output."""
    wide = size >= 2**31
    cast = np.int64 if wide else np.int32
    n_in = 1 if kind == "fwd" else 2
    ins, geom, outs = args[:n_in], tuple(cast(v) for v in args[n_in:n_in + 8]), args[n_in + 8:]
    total = outs[0].size
    if total:
        launch_1d(_pool_kernel(kind, wide), total, ins + outs + (np.int64(total),) + geom)
    return outs


def max_pool2d(x, kernel_size, stride=None):
    k = _pair(kernel_size, "kernel_size")
    s = k if stride is None else _pair(stride, "stride")
    if x.ndim != 4:
        raise ValueError(f"max_pool2d expects NCHW input (4 dims), got shape {tuple(x.shape)}")
    if min(k) < 1 or min(s) < 1:
        raise ValueError(f"max_pool2d: kernel_size {k} and stride {s} must be >= 1")
    if x.shape[2] < k[0] or x.shape[3] < k[1]:
        raise ValueError(f"max_pool2d: kernel {k} larger than the input's {tuple(x.shape[2:])}")
    if k[0] * k[1] > MAX_POOL_WINDOW:
        raise ValueError(f"max_pool2d: a {k[0]}x{k[1]} window has {k[0] * k[1]} elements; the "
                         f"argmax is kept in one byte, so windows hold at most {MAX_POOL_WINDOW}")
    return MaxPool2dFn.apply(x, kernel_size=k, stride=s)


# The backward pass routes each gradient to its window's argmax, stored as a uint8 offset.
MAX_POOL_WINDOW = 256


class DropoutFn(Function):
    def forward(self, x, p):
        xp = get_array_module(x)
        if xp is not np:   # one kernel, its Philox counter on the device (CUDA-graph safe)
            y, self.scale = _random.dropout_mask(x, p)
            return y
        keep = _random.uniform(x.shape, xp) >= p
        self.scale = keep.astype(x.dtype) / (1.0 - p)  # inverted dropout: eval is the identity
        return x * self.scale

    def backward(self, g):
        return g * self.scale


def dropout(x, p=0.5, training=True):
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    return DropoutFn.apply(x, p=p)


def _log_softmax(x):
    xp = get_array_module(x)
    m = x.max(axis=1, keepdims=True)
    z = x - m
    return z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))


class LogSoftmaxFn(Function):
    def forward(self, x):
        self.y = _log_softmax(x)
        return self.y

    def backward(self, g):
        xp = get_array_module(g)
        return g - xp.exp(self.y) * g.sum(axis=1, keepdims=True)


def log_softmax(x):
    if x.ndim != 2:
        raise ValueError(f"log_softmax expects (batch, classes), got shape {tuple(x.shape)}")
    return LogSoftmaxFn.apply(x)


_targets_prechecked = False   # set by minitorch_fft.graphs while it captures a step


def _check_targets(x, target):
    if isinstance(target, Tensor):
        raise TypeError("targets must be an integer array of class indices, not a Tensor "
                        "(Tensors hold float32 data)")
    xp = get_array_module(x.data)
    t = xp.asarray(target)
    if t.ndim != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(f"targets must have shape ({x.shape[0]},), got {tuple(t.shape)}")
    if t.dtype.kind not in "iu":
        raise TypeError(f"targets must be integer class indices, got dtype {t.dtype}")
    if not _targets_prechecked:   # inside a CUDA graph capture the caller checks each batch first
        check_target_range(t, x.shape[1])
    return t.astype(np.int64)


def check_target_range(t, n_classes):
    """ValueError unless every class index in `t` lies in [0, n_classes): one count (on the GPU,
    one host-device synchronisation), the bounds only for the message when it fails."""
    xp = get_array_module(t)
    if t.size and int(xp.count_nonzero((t < 0) | (t >= n_classes))):
        raise ValueError(f"targets must lie in [0, {n_classes}), got values in "
                         f"[{int(t.min())}, {int(t.max())}]")


class NLLFn(Function):
    """Mean negative log-likelihood of the targets, input already log-probabilities."""

    def forward(self, logp, target):
        xp = get_array_module(logp)
        self.target, self.shape = target, logp.shape
        picked = logp[xp.arange(logp.shape[0]), target]
        return (-picked.mean()).reshape(()).astype(logp.dtype)

    def backward(self, g):
        xp = get_array_module(g)
        gx = xp.zeros(self.shape, dtype=g.dtype)
        gx[xp.arange(self.shape[0]), self.target] = -g / self.shape[0]
        return gx


class CrossEntropyFn(Function):
    """LogSoftMax + ClassNLL fused: one pass, and the stable softmax - onehot gradient."""

    def forward(self, x, target):
        xp = get_array_module(x)
        self.logp, self.target = _log_softmax(x), target
        return (-self.logp[xp.arange(x.shape[0]), target].mean()).reshape(()).astype(x.dtype)

    def backward(self, g):
        xp = get_array_module(g)
        n = self.logp.shape[0]
        gx = xp.exp(self.logp)
        gx[xp.arange(n), self.target] -= 1.0
        return gx * (g / n)


def nll_loss(logp, target):
    return NLLFn.apply(logp, target=_check_targets(logp, target))


def cross_entropy(x, target):
    if x.ndim != 2:
        raise ValueError(f"cross_entropy expects (batch, classes), got shape {tuple(x.shape)}")
    return CrossEntropyFn.apply(x, target=_check_targets(x, target))


# -- convolution: the only device-specific op, through the backend registry --
class Conv2dFn(Function):
    """Each pass goes to the backend chosen for it (they may differ per pass)."""

    def forward(self, x, w, b=None, *, stride, padding, backend):
        self.x, self.w = x, w
        self.stride, self.padding, self.backend = stride, padding, backend
        y = self._run("fprop", x, w)
        if b is not None:
            y += b.reshape(1, -1, 1, 1)
        return y

    def _run(self, pass_name, *arrays):
        return backends.run_pass(self.backend, pass_name, *arrays, x_shape=self.x.shape,
                                 w_shape=self.w.shape, stride=self.stride, padding=self.padding)

    def backward(self, g):
        x, w = self.x, self.w
        g = get_array_module(g).ascontiguousarray(g)
        gx = gw = gb = None
        if self.needs_input_grad[0]:  # skipped for the first layer: nobody wants d(image)
            gx = self._run("bprop", g, w, x.shape)
        if self.needs_input_grad[1]:
            gw = self._run("accgrad", g, x, w.shape)
        if len(self.parents) > 2 and self.needs_input_grad[2]:
            gb = g.sum(axis=(0, 2, 3))
        return (gx, gw, gb)[:len(self.parents)]


def conv2d(x, weight, bias=None, stride=1, padding=0, backend="auto"):
    """Cross-correlation of NCHW `x` with `weight` (out, in, kh, kw), as Torch computes it."""
    stride, padding = _pair(stride, "stride"), _pair(padding, "padding")
    # Validate here, with the caller's names, before any backend sees the arrays.
    backends.geometry(x.shape, weight.shape, stride, padding)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"conv2d: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    args = (x, weight) if bias is None else (x, weight, bias)
    return Conv2dFn.apply(*args, stride=stride, padding=padding, backend=backend)
