"""Tensor and a minimal reverse-mode autograd (teenygrad's Function design).

A Function subclass implements ``forward``/``backward`` on raw arrays (NumPy or
CuPy) and saves explicitly what backward needs. ``needs_input_grad`` lets
backward skip work nobody asked for, e.g. the first convolution's gradInput.
Gradients are raw arrays stored in ``Tensor.grad`` and accumulate.
"""
import contextlib

import numpy as np

from .device import device_of, get_array_module, is_cupy, to_device

_grad_enabled = True


@contextlib.contextmanager
def no_grad():
    """Inside this block no graph is recorded (evaluation, optimiser updates)."""
    global _grad_enabled
    prev, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = prev


def is_grad_enabled():
    return _grad_enabled


def _as_float32(data):
    """The dtype policy: every Tensor holds float32. Other real dtypes are cast."""
    if isinstance(data, Tensor):
        data = data.data
    if not is_cupy(data):
        data = np.asarray(data)
    if data.dtype == np.float32:
        return data
    if data.dtype.kind not in "biuf":
        raise TypeError(f"Tensor data must be real numbers, got dtype {data.dtype}")
    return data.astype(np.float32)


class Tensor:
    """A float32 array (NumPy or CuPy) with an optional gradient."""

    def __init__(self, data, requires_grad=False):
        self.data = _as_float32(data)
        self.requires_grad = requires_grad
        self.grad = None
        self._ctx = None  # the Function that produced this tensor, if recorded

    # -- plain properties ---------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    device = property(lambda self: device_of(self.data))
    xp = property(lambda self: get_array_module(self.data))

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={tuple(self.shape)}, device={self.device}{grad})"

    def numpy(self):
        return to_device(self.data, "cpu")

    def item(self):
        if self.data.size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {tuple(self.shape)}")
        return float(self.data.reshape(-1)[0])

    def detach(self):
        return Tensor(self.data)

    def to(self, device):
        """A tensor on `device`; parameters are moved in place by Module.to."""
        return Tensor(to_device(self.data, device), requires_grad=self.requires_grad)

    # -- autograd -----------------------------------------------------------
    def backward(self, grad=None):
        """Backpropagate from this tensor through the recorded graph."""
        if self._ctx is None and not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad")
        xp = self.xp
        if grad is None:
            if self.data.size != 1:
                raise ValueError(f"backward() without a gradient needs a scalar, got shape {self.shape}")
            grad = xp.ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else grad
            if isinstance(grad, np.ndarray) and xp is not np or is_cupy(grad) and xp is np:
                raise TypeError(f"backward(): the gradient is a {type(grad).__name__} but the tensor "
                                f"lives on {'the GPU' if xp is not np else 'the CPU'}")
            grad = xp.asarray(grad)        # a number or a list is fine for a tensor of its shape
            if tuple(grad.shape) != tuple(self.shape):
                raise ValueError(f"backward(): gradient of shape {tuple(grad.shape)} for a tensor of "
                                 f"shape {tuple(self.shape)}")
            grad = grad.astype(self.data.dtype, copy=False)
        topo = _topological_order(self)
        grads = {id(self): grad}
        for t in reversed(topo):
            g = grads.pop(id(t), None)
            if g is None:
                continue
            if t._ctx is None:  # a leaf: accumulate
                if t.requires_grad:
                    t.grad = g if t.grad is None else t.grad + g
                continue
            ctx = t._ctx
            in_grads = ctx.backward(g)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            for parent, pg, needed in zip(ctx.parents, in_grads, ctx.needs_input_grad):
                if not needed or pg is None:
                    continue
                if pg.shape != parent.shape:   # not an assert: it must hold under python -O too
                    raise RuntimeError(f"{type(ctx).__name__}.backward gave shape {pg.shape} for an "
                                       f"input of shape {parent.shape}")
                k = id(parent)
                grads[k] = pg if k not in grads else grads[k] + pg

    # -- a few operators, enough for models and tests ----------------------
    def reshape(self, *shape):
        from . import functional as F
        return F.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    def __add__(self, other):
        from . import functional as F
        return F.add(self, other)

    def __mul__(self, other):
        from . import functional as F
        return F.mul(self, other)

    def __radd__(self, other):   # number + Tensor
        return self.__add__(other)

    def __rmul__(self, other):   # number * Tensor
        return self.__mul__(other)

    def sum(self):
        from . import functional as F
        return F.sum(self)


class Parameter(Tensor):
    """A Tensor that a Module owns and an optimiser updates."""

    def __init__(self, data):
        super().__init__(data, requires_grad=True)


def _topological_order(root):
    order, seen = [], set()
    stack = [(root, False)]
    while stack:  # iterative DFS: deep nets must not hit Python's recursion limit
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if t._ctx is not None:
            stack.extend((p, False) for p in t._ctx.parents if id(p) not in seen)
    return order


class Function:
    """One differentiable operation. Subclasses define forward and backward on raw arrays."""

    def __init__(self, *parents):
        self.parents = parents
        self.needs_input_grad = tuple(p.requires_grad for p in parents)

    def forward(self, *arrays, **kwargs):
        raise NotImplementedError

    def backward(self, grad_output):
        raise NotImplementedError

    @classmethod
    def apply(cls, *tensors, **kwargs):
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"{cls.__name__} takes Tensors, got {type(t).__name__}")
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise TypeError(f"{cls.__name__}: inputs are on different devices {sorted(devices)}; "
                            "move them with .to(device)")
        ctx = cls(*tensors)
        out = Tensor(ctx.forward(*[t.data for t in tensors], **kwargs))
        if _grad_enabled and any(ctx.needs_input_grad):
            out.requires_grad = True
            out._ctx = ctx
        return out
