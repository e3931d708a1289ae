"""Convolution backends: one module per algorithm, one explicit registry.

Every backend module exposes the same four functions (Torch's three passes plus
a capability predicate):

  fprop(x, w, stride=(1, 1), padding=(0, 0)) -> y
  bprop(gy, w, x_shape, stride=(1, 1), padding=(0, 0)) -> gx
  accgrad(gy, x, w_shape, stride=(1, 1), padding=(0, 0)) -> gw
  supports(x_shape, w_shape, stride, padding) -> bool

Arrays are float32 NCHW, NumPy or CuPy, and come back of the same kind. Bias is
added outside the backends. Cross-correlation, as in Torch and PyTorch.
"""
from . import gemm
from .common import PASSES, geometry

_REGISTRY = {
    "gemm": gemm,
}

# What "auto" tries, in order of preference, until the autotuner replaces it.
_AUTO_ORDER = ("gemm",)


def names():
    """The registered backends (``"auto"`` is a layer option, not a backend)."""
    return list(_REGISTRY)


def get(name):
    """The backend module called `name`; ValueError for an unknown name."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown convolution backend {name!r}; registered: {names()} "
                         "(layers also accept 'auto')")
    return _REGISTRY[name]


def choose(name, pass_name, x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
    """The backend that runs `pass_name` of this geometry under the layer's setting `name`."""
    if pass_name not in PASSES:
        raise ValueError(f"unknown pass {pass_name!r}; expected one of {PASSES}")
    if name == "auto":
        for candidate in _AUTO_ORDER:
            if _REGISTRY[candidate].supports(x_shape, w_shape, stride, padding):
                return _REGISTRY[candidate]
        geometry(x_shape, w_shape, stride, padding)  # raises the precise reason
        raise ValueError(f"no backend supports input {tuple(x_shape)}, weight {tuple(w_shape)}, "
                         f"stride {stride}, padding {padding}")
    backend = get(name)
    if not backend.supports(x_shape, w_shape, stride, padding):
        geometry(x_shape, w_shape, stride, padding)  # an invalid geometry says why first
        raise ValueError(f"backend {name!r} does not support {pass_name} for input {tuple(x_shape)}, "
                         f"weight {tuple(w_shape)}, stride {tuple(stride)}, padding {tuple(padding)}; "
                         f"use backend='auto' or another of {names()}")
    return backend


__all__ = ["names", "get", "choose", "geometry", "PASSES"]
