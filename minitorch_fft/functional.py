"""Differentiable operations, each written once against the array module ``xp``.

Only ``conv2d`` is device-specific, and it delegates to ``backends``.
"""
import contextlib
import functools
from pathlib import Path

import numpy as np

from . import backends
from .backends import cgemm
from .backends.common import cuda_module, launch_1d

from . import fused, random as _random
from .device import get_array_module
from .utils import is_number, pair as _pair
from .tensor import Function, Tensor, check_sizes, check_tensors, is_grad_enabled


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
    """max(x, 0), NaN propagated as in Torch. On the GPU one kernel (fused.relu), its mask kept as
    1 bit per value; backward is one kernel too."""

    def forward(self, x):
        self.fused = fused.applies(x)
        if self.fused:
            y, self.mask = fused.relu(x)
            return y
        self.mask = x > 0
        return get_array_module(x).maximum(x, 0)  # maximum propagates NaN, as Torch does

    def backward(self, g):
        return fused.relu_backward(g, self.mask) if self.fused else g * self.mask


def relu(x):
    check_tensors("relu", x=x)
    return ReLUFn.apply(x)


class AddReLUFn(ReLUFn):
    """max(a + b, 0): a residual block's end (the shortcut's sum, then ReLU) in one GPU kernel,
    with no sum kept; the gradient reaches both inputs unchanged."""

    def forward(self, a, b):
        self.fused = fused.applies(a, b)
        if self.fused:
            y, self.mask = fused.add_relu(a, b)
            return y
        return super().forward(a + b)

    def backward(self, g):
        gx = super().backward(g)
        return gx, gx


def add_relu(a, b):
    """relu(a + b) for Tensors of one shape (no broadcasting)."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        raise TypeError(f"add_relu takes two Tensors, got {type(a).__name__} and {type(b).__name__}")
    _check_same_shape(a, b, "add_relu")
    return AddReLUFn.apply(a, b)


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
    check_tensors("linear", x=x, weight=weight, bias=bias)
    if x.ndim != 2:
        raise ValueError(f"linear expects input of shape (batch, features), got {tuple(x.shape)}")
    if weight.ndim != 2:
        raise ValueError(f"linear expects weight of shape (out_features, in_features), got {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: input has {x.shape[1]} features, weight expects {weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):   # numpy would broadcast any other
        raise ValueError(f"linear: bias must have shape ({weight.shape[0]},), one value per output, "
                         f"got {tuple(bias.shape)}")
    return LinearFn.apply(x, weight) if bias is None else LinearFn.apply(x, weight, bias)


class MaxPool2dFn(Function):
    """Max pooling in floor mode (Torch's default). Padding is an explicit -inf border (one copy
    of the input; the kernels stay padding-free), so a padded element never wins. The argmax of
    each window (its offset i * kw + j, the last NaN if there is one, so NaN propagates as in
    Torch) is kept for backward, which routes each output's gradient to that element only.

    On the GPU each pass is one kernel of kernels/pool.cu (no synchronisation with the host: a
    boolean-mask assignment would wait for the GPU at every window offset); on the CPU the
    same arithmetic runs over the k*k strided views."""

    def forward(self, x, kernel_size, stride, padding=(0, 0)):
        xp = get_array_module(x)
        (kh, kw), (sh, sw) = kernel_size, stride
        self.x_shape, self.padding = x.shape, padding
        x = _padded(x, padding, -np.inf)
        n, c, h, w = x.shape
        oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
        self.geom = (kh, kw, sh, sw, oh, ow)
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
        (ph, pw), (n, c, h, w) = self.padding, self.x_shape
        shape = (n, c, h + 2 * ph, w + 2 * pw)   # the padded input's
        if xp is not np:
            gx = xp.empty(shape, dtype=g.dtype)
            _pool("bwd", gx.size, xp.ascontiguousarray(g), self.arg, *shape[2:], kh, kw, sh, sw, oh, ow, gx)
        else:
            gx = np.zeros(shape, dtype=g.dtype)
            for i in range(kh):
                for j in range(kw):
                    gx[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] += \
                        np.where(self.arg == i * kw + j, g, 0)
        return _unpadded(gx, self.padding)


def _padded(x, padding, value):
    """NCHW `x` inside a border of `value`, `padding` (ph, pw) wide; x itself when it is 0."""
    ph, pw = padding
    if not ph and not pw:
        return x
    n, c, h, w = x.shape
    out = get_array_module(x).full((n, c, h + 2 * ph, w + 2 * pw), value, dtype=x.dtype)
    out[:, :, ph:ph + h, pw:pw + w] = x
    return out


def _unpadded(g, padding):
    """The inverse of _padded for a gradient: the inner region, contiguous."""
    ph, pw = padding
    if not ph and not pw:
        return g
    return get_array_module(g).ascontiguousarray(g[:, :, ph:g.shape[2] - ph, pw:g.shape[3] - pw])


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


def _pool_args(x, kernel_size, stride, padding, op):
    """The checked (kernel, stride, padding) pairs of a pooling of NCHW `x`; ValueError naming
    `op` and the limit otherwise. Padding is at most half the kernel, as torch requires."""
    check_tensors(op, x=x)
    k = _pair(kernel_size, "kernel_size")
    s = k if stride is None else _pair(stride, "stride")
    p = _pair(padding, "padding")
    if x.ndim != 4:
        raise ValueError(f"{op} expects NCHW input (4 dims), got shape {tuple(x.shape)}")
    if min(k) < 1 or min(s) < 1:
        raise ValueError(f"{op}: kernel_size {k} and stride {s} must be >= 1")
    if min(p) < 0 or p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"{op}: padding {p} must be >= 0 and at most half the kernel {k}")
    if x.shape[2] + 2 * p[0] < k[0] or x.shape[3] + 2 * p[1] < k[1]:
        raise ValueError(f"{op}: kernel {k} larger than the input's {tuple(x.shape[2:])} with padding {p}")
    return k, s, p


def max_pool2d(x, kernel_size, stride=None, padding=0):
    k, s, p = _pool_args(x, kernel_size, stride, padding, "max_pool2d")
    if k[0] * k[1] > MAX_POOL_WINDOW:
        raise ValueError(f"max_pool2d: a {k[0]}x{k[1]} window has {k[0] * k[1]} elements; the "
                         f"argmax is kept in one byte, so windows hold at most {MAX_POOL_WINDOW}")
    return MaxPool2dFn.apply(x, kernel_size=k, stride=s, padding=p)


# The backward pass routes each gradient to its window's argmax, stored as a uint8 offset.
MAX_POOL_WINDOW = 256


class AvgPool2dFn(Function):
    """Average pooling in floor mode over the k*k strided views of the zero-padded input. The
    divisor is the window's size (count_include_pad, torch's default) or the number of input
    elements it covers, counted by pooling ones on the input's device (no host copy, so a CUDA
    graph can capture it)."""

    def forward(self, x, kernel_size, stride, padding, count_include_pad):
        xp = get_array_module(x)
        self.x_shape, self.args = x.shape, (kernel_size, stride, padding)
        self.div = float(kernel_size[0] * kernel_size[1])
        if not count_include_pad and any(padding):
            ones = xp.ones((1, 1) + x.shape[2:], dtype=x.dtype)
            self.div = _window_sums(_padded(ones, padding, 0), kernel_size, stride)   # (1, 1, oh, ow)
        return _window_sums(_padded(x, padding, 0), kernel_size, stride) / self.div

    def backward(self, g):
        xp = get_array_module(g)
        (kh, kw), (sh, sw), (ph, pw) = self.args
        n, c, h, w = self.x_shape
        oh, ow = g.shape[2:]
        g = g / self.div
        gx = xp.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=g.dtype)
        for i in range(kh):
            for j in range(kw):
                gx[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] += g
        return _unpadded(gx, (ph, pw))


def _window_sums(x, kernel_size, stride):
    """The sum of each (kh, kw) window of NCHW `x` at `stride`: k*k strided views, no im2col."""
    (kh, kw), (sh, sw) = kernel_size, stride
    oh, ow = (x.shape[2] - kh) // sh + 1, (x.shape[3] - kw) // sw + 1
    out = None
    for i in range(kh):
        for j in range(kw):
            v = x[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
            out = v.copy() if out is None else out + v
    return out


def avg_pool2d(x, kernel_size, stride=None, padding=0, count_include_pad=True):
    k, s, p = _pool_args(x, kernel_size, stride, padding, "avg_pool2d")
    return AvgPool2dFn.apply(x, kernel_size=k, stride=s, padding=p, count_include_pad=bool(count_include_pad))


class GlobalAvgPoolFn(Function):
    """The mean of each plane: NCHW -> (N, C, 1, 1), one reduction."""

    def forward(self, x):
        self.x_shape = x.shape
        return x.mean(axis=(2, 3), keepdims=True)

    def backward(self, g):
        xp = get_array_module(g)
        return xp.broadcast_to(g / (self.x_shape[2] * self.x_shape[3]), self.x_shape).copy()


class AdaptiveAvgPool2dFn(Function):
    """torch's adaptive average pooling where the input does not divide into equal windows:
    output cell (i, j) averages rows floor(i*h/oh) .. ceil((i+1)*h/oh) and the columns alike
    (windows may overlap); one reduction per output cell."""

    def forward(self, x, output_size):
        xp = get_array_module(x)
        self.x_shape, self.cells = x.shape, _adaptive_cells(x.shape[2:], output_size)
        out = xp.empty(x.shape[:2] + tuple(output_size), dtype=x.dtype)
        for i, j, rows, cols in self.cells:
            out[:, :, i, j] = x[:, :, rows, cols].mean(axis=(2, 3))
        return out

    def backward(self, g):
        gx = get_array_module(g).zeros(self.x_shape, dtype=g.dtype)
        for i, j, rows, cols in self.cells:
            count = (rows.stop - rows.start) * (cols.stop - cols.start)
            gx[:, :, rows, cols] += (g[:, :, i, j] / count)[:, :, None, None]
        return gx


def _adaptive_cells(in_size, out_size):
    """[(i, j, row slice, column slice)] of each output cell, torch's adaptive windows."""
    def windows(n, m):
        return [slice(i * n // m, -(-(i + 1) * n // m)) for i in range(m)]
    rows, cols = windows(in_size[0], out_size[0]), windows(in_size[1], out_size[1])
    return [(i, j, r, c) for i, r in enumerate(rows) for j, c in enumerate(cols)]


def adaptive_avg_pool2d(x, output_size):
    """Average pooling to an (oh, ow) output whatever the input's size (torchvision's avgpool):
    the input itself when it already has that size, one mean per plane for 1x1, equal windows
    (avg_pool2d) where the sizes divide, else torch's overlapping windows."""
    check_tensors("adaptive_avg_pool2d", x=x)
    o = _pair(output_size, "output_size")
    if x.ndim != 4:
        raise ValueError(f"adaptive_avg_pool2d expects NCHW input (4 dims), got shape {tuple(x.shape)}")
    if min(o) < 1:
        raise ValueError(f"adaptive_avg_pool2d: output_size {o} must be >= 1")
    (h, w) = x.shape[2:]
    if (h, w) == o:
        return x
    if o == (1, 1):
        return GlobalAvgPoolFn.apply(x)
    if h % o[0] == 0 and w % o[1] == 0:
        k = (h // o[0], w // o[1])
        return AvgPool2dFn.apply(x, kernel_size=k, stride=k, padding=(0, 0), count_include_pad=True)
    return AdaptiveAvgPool2dFn.apply(x, output_size=o)


class BatchNormFn(Function):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, per plane of NCHW x. In training, mean and
    var are the batch's (var biased), and the running statistics are updated in place (PyTorch's
    rule, the unbiased variance); in evaluation, the running statistics are used as they are.
    Saved for backward: the normalised input and 1/sqrt(var + eps) per plane. On the GPU
    (fused.batch_norm_forward/_backward) each pass is one or two passes over the activations."""

    def forward(self, x, weight=None, bias=None, *, running_mean, running_var, training, momentum, eps):
        xp = get_array_module(x)
        c = (1, -1, 1, 1)                                  # a (C,) vector against NCHW
        self.training, self.weight = training, weight
        self.fused = fused.applies(x, *(v for v in (weight, bias, running_mean, running_var) if v is not None))
        if self.fused:   # saved: x itself, the mean and 1/sqrt(var + eps) per plane
            self.x = xp.ascontiguousarray(x)
            y, self.mean, self.invstd = fused.batch_norm_forward(self.x, weight, bias, running_mean,
                                                                 running_var, training, momentum, eps)
            return y
        if training:
            m = x.size // x.shape[1]                        # values per plane
            mean = x.mean(axis=(0, 2, 3))
            xc = x - mean.reshape(c)
            var = (xc * xc).mean(axis=(0, 2, 3))
            if running_mean is not None:                    # in place: a CUDA graph replays here
                running_mean *= 1 - momentum
                running_mean += momentum * mean
                running_var *= 1 - momentum
                running_var += momentum * (m / (m - 1)) * var
        else:
            xc = x - running_mean.reshape(c)
            var = running_var
        self.invstd = 1 / xp.sqrt(var + x.dtype.type(eps))
        self.xhat = xc * self.invstd.reshape(c)
        if weight is None:
            return self.xhat
        return self.xhat * weight.reshape(c) + bias.reshape(c)

    def backward(self, g):
        if self.fused:
            gx, gw, gb = fused.batch_norm_backward(g, self.x, self.mean, self.invstd, self.weight,
                                                   self.training)
            return (gx, gw, gb)[:len(self.parents)]
        c = (1, -1, 1, 1)
        gb = g.sum(axis=(0, 2, 3))
        gw = (g * self.xhat).sum(axis=(0, 2, 3))
        scale = self.invstd if len(self.parents) == 1 else self.invstd * self.weight
        if self.training:     # the batch's mean and var depend on x too
            m = g.size // g.shape[1]
            gx = (g - (gb / m).reshape(c) - self.xhat * (gw / m).reshape(c)) * scale.reshape(c)
        else:
            gx = g * scale.reshape(c)
        return (gx, gw, gb)[:len(self.parents)]


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
               eps=1e-5):
    """PyTorch's F.batch_norm on NCHW `x`: running_mean and running_var are raw arrays (or None
    in training, for batch statistics only), updated in place in training with
    new = (1 - momentum) * old + momentum * batch; `momentum` may be a 0-d array (the cumulative
    average's 1/n, computed on the device). weight and bias: Tensors of shape (C,), or None."""
    check_tensors("batch_norm", x=x, weight=weight, bias=bias)
    if x.ndim != 4:
        raise ValueError(f"batch_norm expects NCHW input (4 dims), got shape {tuple(x.shape)}")
    planes = x.shape[1]
    for name, v in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", weight), ("bias", bias)):
        if v is not None and tuple(v.shape) != (planes,):
            raise ValueError(f"batch_norm: {name} must have shape ({planes},), got {tuple(v.shape)}")
    if (weight is None) != (bias is None):
        raise ValueError("batch_norm: weight and bias come together (affine) or not at all")
    if not training and running_mean is None:
        raise ValueError("batch_norm: evaluation needs the running statistics")
    if training and x.shape[0] * x.shape[2] * x.shape[3] < 2:
        raise ValueError(f"batch_norm: training needs more than 1 value per plane, got input of "
                         f"shape {tuple(x.shape)}")
    args = (x,) if weight is None else (x, weight, bias)
    return BatchNormFn.apply(*args, running_mean=running_mean, running_var=running_var,
                             training=training, momentum=momentum, eps=eps)


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
    check_tensors("dropout", x=x)
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
    check_tensors("log_softmax", x=x)
    if x.ndim != 2:
        raise ValueError(f"log_softmax expects (batch, classes), got shape {tuple(x.shape)}")
    return LogSoftmaxFn.apply(x)


_targets_prechecked = False   # set by minitorch_fft.graphs while it captures a step
_targets_ahead = None         # the TargetBounds train_step queued before the forward pass


def _check_targets(x, target):
    if isinstance(target, Tensor):
        raise TypeError("targets must be an integer array of class indices, not a Tensor "
                        "(Tensors hold float32 data)")
    xp = get_array_module(x.data)
    on_host = get_array_module(target) is np     # host targets (a NumPy array, a list) are checked
    t = np.asarray(target) if on_host else target  # there, before the copy: no device sync
    if t.ndim != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(f"targets must have shape ({x.shape[0]},), got {tuple(t.shape)}")
    if t.dtype.kind not in "iu":
        raise TypeError(f"targets must be integer class indices, got dtype {t.dtype}")
    if not _targets_prechecked:   # inside a CUDA graph capture the caller checks each batch first
        ahead = _targets_ahead
        if ahead is not None and ahead.target is target:
            ahead.check(x.shape[1])
        else:
            check_target_range(t, x.shape[1])
    return xp.asarray(t.astype(np.int64))


def check_target_range(t, n_classes):
    """ValueError unless every class index in `t` lies in [0, n_classes): one count (on the GPU,
    one host-device synchronisation), the bounds only for the message when it fails."""
    xp = get_array_module(t)
    if t.size and int(xp.count_nonzero((t < 0) | (t >= n_classes))):
        raise _out_of_range(n_classes, int(t.min()), int(t.max()))


def _out_of_range(n_classes, low, high):
    return ValueError(f"targets must lie in [0, {n_classes}), got values in [{low}, {high}]")


class TargetBounds:
    """The smallest and largest class index of integer targets on the GPU, reduced there and
    copied to pinned host memory without waiting, so that train_step can queue them ahead of the
    forward pass. The loss's range check then waits for what was queued before them (the previous
    step's work, on the same stream), not for this step's forward.

    check_target_range, run at the loss, waits for everything queued before it: the whole forward
    pass. A host-bound eager step then issues its backward only after the GPU has finished the
    forward, where it could have issued it meanwhile (AlexNet's eager step in TF32 mode on an
    H200: 0.84x PyTorch's, which waits for nothing there; benchmarks/NOTES.md, session 21)."""

    def __init__(self, target):
        import cupy as cp
        import cupyx
        self.target = target
        self._device = cp.stack((target.min(), target.max()))   # kept until the copy is done
        self._host = cupyx.empty_pinned((2,), dtype=self._device.dtype)
        self._device.get(out=self._host, blocking=False)
        self._done = cp.cuda.Event(block=False, disable_timing=True)
        self._done.record()
        self._settled = False

    def settle(self):
        """Wait for the copy if check() never did (the step raised before its loss): CuPy's pinned
        pool may hand the block out again as soon as this object is dropped."""
        if not self._settled:
            self._done.synchronize()
            self._settled = True

    def check(self, n_classes):
        """ValueError unless every index lies in [0, n_classes): waits for the copy (and the work
        queued before it), not for what was queued after."""
        self.settle()
        low, high = int(self._host[0]), int(self._host[1])
        if low < 0 or high >= n_classes:
            raise _out_of_range(n_classes, low, high)


def target_bounds(target):
    """A TargetBounds of `target` where it is a 1-D integer CuPy array (else None: host targets are
    checked on the host, and anything else gets its error from the loss), outside graph capture."""
    if (_targets_prechecked or isinstance(target, Tensor) or get_array_module(target) is np
            or getattr(target, "ndim", None) != 1 or target.dtype.kind not in "iu" or target.size == 0):
        return None
    return TargetBounds(target)


@contextlib.contextmanager
def targets_ahead(bounds):
    """The block's losses check `bounds.target` through `bounds` (None: as usual). Its exit settles
    `bounds`; where the block raised, an error from settling (a sticky CUDA error raises again at
    the event's wait) is dropped so that the block's own error is the one the caller sees."""
    global _targets_ahead
    saved, _targets_ahead = _targets_ahead, bounds
    try:
        yield
    except BaseException:
        if bounds is not None:
            with contextlib.suppress(Exception):
                bounds.settle()
        raise
    else:
        if bounds is not None:
            bounds.settle()
    finally:
        _targets_ahead = saved


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
    check_tensors("nll_loss", logp=logp)
    return NLLFn.apply(logp, target=_check_targets(logp, target))


def cross_entropy(x, target):
    check_tensors("cross_entropy", x=x)
    if x.ndim != 2:
        raise ValueError(f"cross_entropy expects (batch, classes), got shape {tuple(x.shape)}")
    return CrossEntropyFn.apply(x, target=_check_targets(x, target))


# -- convolution: the only device-specific op, through the backend registry --
class Conv2dFn(Function):
    """Each pass goes to the backend chosen for it (they may differ per pass)."""

    def forward(self, x, w, b=None, *, stride, padding, backend):
        self.x, self.w = x, w
        self.stride, self.padding, self.backend = stride, padding, backend
        # The passes backward will run (spectra kept for no other: backends/reuse.py)
        needs = self.needs_input_grad if is_grad_enabled() else (False, False)
        self.later = tuple(p for p, need in zip(("bprop", "accgrad"), needs) if need)
        y = self._run("fprop", x, w)
        if b is not None and fused.applies(y, b) and y.flags.c_contiguous:
            fused.bias_add(y, b)                   # one pass, in place
        elif b is not None:
            y += b.reshape(1, -1, 1, 1)
        return y

    def _run(self, pass_name, *arrays):
        # the passes still to come on these arrays (bprop, then accGrad): spectra are kept for them alone
        later = self.later if pass_name == "fprop" else self.later[self.later.index(pass_name) + 1:]
        return backends.run_pass(self.backend, pass_name, *arrays, x_shape=self.x.shape, w_shape=self.w.shape,
                                 stride=self.stride, padding=self.padding, later=later)

    def backward(self, g):
        x, w = self.x, self.w
        g = get_array_module(g).ascontiguousarray(g)
        gx = gw = gb = None
        if self.needs_input_grad[0]:  # skipped for the first layer: nobody wants d(image)
            gx = self._run("bprop", g, w, x.shape)
        if self.needs_input_grad[1]:
            gw = self._run("accgrad", g, x, w.shape)
        if len(self.parents) > 2 and self.needs_input_grad[2]:
            n, c = g.shape[:2]   # summed over the contiguous h*w first: one pass, not a strided one
            gb = fused.bias_grad(g) if fused.applies(g) else g.reshape(n, c, -1).sum(axis=2).sum(axis=0)
        return (gx, gw, gb)[:len(self.parents)]


def conv2d(x, weight, bias=None, stride=1, padding=0, backend="auto"):
    """Cross-correlation of NCHW `x` with `weight` (out, in, kh, kw), as Torch computes it."""
    check_tensors("conv2d", x=x, weight=weight, bias=bias)
    stride, padding = _pair(stride, "stride"), _pair(padding, "padding")
    # Validate here, with the caller's names, before any backend sees the arrays.
    backends.geometry(x.shape, weight.shape, stride, padding)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"conv2d: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    args = (x, weight) if bias is None else (x, weight, bias)
    return Conv2dFn.apply(*args, stride=stride, padding=padding, backend=backend)
