"""Tensor and a minimal reverse-mode autograd (teenygrad's Function design).

A Function subclass implements ``forward``/``backward`` on raw arrays (NumPy or
CuPy) and saves explicitly what backward needs. ``needs_input_grad`` lets
backward skip work nobody asked for, e.g. the first convolution's gradInput.
Gradients are raw arrays stored in ``Tensor.grad`` and accumulate. As in PyTorch, backward()
frees what the graph's operations saved, so a second backward through the same graph is an
error unless the first was called with ``retain_graph=True``.

Memory, as in PyTorch: the graph is made of the Functions, not of the Tensors between them, so an
intermediate output that no Function saved is freed as soon as the caller drops it (a
convolution's output, once the ReLU after it has kept its mask); and backward() frees each
Function's saved arrays right after that Function's own backward, not at the end.
"""
import contextlib

import numpy as np

from .device import device_of, get_array_module, is_cupy, to_device

_grad_enabled = True


@contextlib.contextmanager
def _grad_mode(enabled):
    global _grad_enabled
    prev, _grad_enabled = _grad_enabled, enabled
    try:
        yield
    finally:
        _grad_enabled = prev


def no_grad():
    """Inside this block no graph is recorded (evaluation, optimiser updates)."""
    return _grad_mode(False)


def enable_grad():
    """Inside this block the graph is recorded, under a no_grad() too."""
    return _grad_mode(True)


def is_grad_enabled():
    return _grad_enabled


def _as_float32(data):
    """The dtype policy: every Tensor holds float32. Other real dtypes are cast (rounded to
    nearest, as torch.tensor(..., dtype=torch.float32) rounds). A finite value beyond float32's
    range is refused with a ValueError naming it: PyTorch silently makes it inf, and so would
    astype; here it is an error, as it is in load_state_dict. NaN and inf stay what they are."""
    if isinstance(data, Tensor):
        data = data.data
    if not is_cupy(data):
        data = np.asarray(data)
    if data.dtype == np.float32:
        return data
    if data.dtype.kind not in "biuf":
        raise TypeError(f"Tensor data must be real numbers, got dtype {data.dtype}")
    out = cast_float32(data)
    v = overflow_value(data, out)
    if v is not None:
        raise ValueError(f"Tensor data holds {v!r}, beyond float32's range (largest "
                         f"{float(np.finfo(np.float32).max)!r}): it would become inf")
    return out


def cast_float32(a):
    """a.astype(float32), without NumPy's overflow warning: overflow_value() reports it instead."""
    with np.errstate(over="ignore"):
        return a.astype(np.float32)


def overflow_value(src, cast):
    """The first finite value of `src` that became inf in its float32 `cast`, as a Python float,
    or None. Only wider floats can overflow (int64's largest is 9.2e18, float32's 3.4e38); on the
    GPU this is a host-device sync point, paid only by float64 data."""
    if src.dtype.kind != "f" or src.dtype.itemsize <= 4:
        return None
    xp = get_array_module(cast)
    bad = xp.isinf(cast) & xp.isfinite(src)
    if not bool(bad.any()):
        return None
    return float(src[bad].reshape(-1)[0])


def check_tensors(op, **named):
    """TypeError naming `op` and the argument, before any shape is read, where one that must be a
    Tensor is not (None passes: the optional ones are checked by their callers)."""
    for name, value in named.items():
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(value).__name__}")


def check_sizes(sizes, what):
    """`sizes` (ints, or one tuple/list of them) as a tuple of Python ints for a view or reshape;
    as torch's view: a TypeError naming a size that is not an integer (a float, a bool), a
    ValueError for a size below -1 or more than one -1. NumPy integers are accepted."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    for i, s in enumerate(sizes):
        if not isinstance(s, (int, np.integer)) or isinstance(s, (bool, np.bool_)):
            raise TypeError(f"{what}: sizes must be ints, got {s!r} ({type(s).__name__}) at position {i}")
        if s < -1:
            raise ValueError(f"{what}: invalid size {int(s)} at position {i} (sizes are >= 0, or -1 "
                             "for one inferred dimension)")
    if sum(1 for s in sizes if s == -1) > 1:
        raise ValueError(f"{what}: only one size can be -1, got {tuple(int(s) for s in sizes)}")
    return tuple(int(s) for s in sizes)


class Tensor:
    """A float32 array (NumPy or CuPy) with an optional gradient."""

    def __init__(self, data, requires_grad=False):
        self.data = _as_float32(data)
        self.requires_grad = requires_grad
        self.grad = None
        # hook(tensor, grad), called instead of accumulating into .grad once this leaf's gradient
        # of a backward pass is complete (minitorch_fft.distributed.GradientSync)
        self.grad_hook = None
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
    def backward(self, grad=None, retain_graph=False):
        """Backpropagate from this tensor through the recorded graph. Afterwards the graph's saved
        arrays are freed (PyTorch's default), and a second backward through any part of it raises
        RuntimeError before any gradient changes; retain_graph=True keeps them for another pass."""
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
        root = self._ctx if self._ctx is not None else self
        topo = _topological_order(root)
        freed = next((n for n in topo if isinstance(n, Function) and n.freed), None)
        if freed is not None:     # checked first: a refused backward accumulates nothing
            raise RuntimeError(
                f"backward(): trying to backward through the graph a second time: the first "
                f"backward() freed the values {type(freed).__name__} saved. Call backward("
                "retain_graph=True) the first time to backward through the graph again, or run "
                "the forward pass again")
        grads = {id(root): grad}
        for node in reversed(topo):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            if not isinstance(node, Function):  # a leaf: accumulate. Its gradient is complete here:
                if node.requires_grad:   # reverse topological order visits every consumer first
                    if node.grad_hook is not None:
                        node.grad_hook(node, g)
                    else:
                        node.grad = g if node.grad is None else node.grad + g
                continue
            in_grads = node.backward(g)
            if not retain_graph:  # its one backward has run: what it saved is garbage from here on
                node.free()
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            for parent, shape, pg, needed in zip(node.parents, node.input_shapes, in_grads,
                                                 node.needs_input_grad):
                if not needed or pg is None:
                    continue
                if pg.shape != shape:   # not an assert: it must hold under python -O too
                    raise RuntimeError(f"{type(node).__name__}.backward gave shape {pg.shape} for an "
                                       f"input of shape {shape}")
                k = id(parent)
                grads[k] = pg if k not in grads else grads[k] + pg

    # -- a few operators, enough for models and tests ----------------------
    def reshape(self, *shape):
        from . import functional as F
        return F.reshape(self, check_sizes(shape, "reshape"))

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
    """Every graph node under root (Functions, and the leaf or constant Tensors that no Function
    made), each after all of its parents (a DFS post-order). A node's parents are explored
    last-to-first, so that in the reversed order backward walks, a layer's leaves (its weight and
    bias) come right after the layer's output, not after the whole network below it: their
    gradients are complete, and data-parallel buckets start, as early as PyTorch's (the other
    way, every all-reduce waited for the end of backward)."""
    order, seen = [], set()
    stack = [(root, False)]
    while stack:  # iterative DFS: deep nets must not hit Python's recursion limit
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        if isinstance(node, Function):
            stack.extend((p, False) for p in reversed(node.parents) if id(p) not in seen)
    return order


class Function:
    """One differentiable operation. Subclasses define forward and backward on raw arrays, and
    keep what backward needs as attributes of self; free() drops them after a backward pass."""

    freed = False
    _GRAPH = ("parents", "input_shapes", "needs_input_grad")   # what free() keeps

    def __init__(self, *inputs):
        # The graph's links: the Function that made each input, or the input itself where none
        # did (a leaf, or a constant). Not the input Tensors: each holds its array, and the graph
        # would keep every intermediate output alive until it is dropped, saved or not.
        self.parents = tuple(t if t._ctx is None else t._ctx for t in inputs)
        self.input_shapes = tuple(tuple(t.shape) for t in inputs)
        self.needs_input_grad = tuple(t.requires_grad for t in inputs)

    def free(self):
        """Drop the arrays (and anything else) forward saved; the graph's links stay."""
        for k in [k for k in vars(self) if k not in self._GRAPH]:
            delattr(self, k)
        self.freed = True

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
