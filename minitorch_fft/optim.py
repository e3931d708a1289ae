"""Stochastic gradient descent with momentum and weight decay (PyTorch's update rule)."""
import functools
from pathlib import Path

import numpy as np

from .backends import reuse
from .backends.common import cuda_module, launch_1d

from .checkpoint import CheckpointError, finite_number, state_array
from .device import get_array_module, to_device
from .tensor import Tensor, no_grad


class SGD:
    """p -= lr * v,  v = momentum * v + (grad + weight_decay * p).

    `lr_schedule(epoch) -> factor` is the schedule hook: ``start_epoch(e)`` sets
    ``lr = base_lr * lr_schedule(e)``.
    """

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0, lr_schedule=None):
        """lr, momentum and weight_decay are checked as torch.optim.SGD checks them (>= 0; lr 0 is
        allowed, momentum above 1 too) and, beyond PyTorch, must be finite real numbers (no NaN,
        inf, bool or tensor): a NaN learning rate would silently turn every weight into NaN.
        PyTorch's dampening and nesterov do not exist here."""
        self.params = list(params)
        if not self.params:
            raise ValueError("SGD got an empty parameter list")
        for p in self.params:
            if not isinstance(p, Tensor):
                raise TypeError(f"SGD optimises Tensors, got a {type(p).__name__} in the parameter list")
        self.base_lr = self.lr = _hyperparameter("lr", lr)
        self.momentum = _hyperparameter("momentum", momentum)
        self.weight_decay = _hyperparameter("weight_decay", weight_decay)
        if lr_schedule is not None and not callable(lr_schedule):
            raise TypeError(f"lr_schedule must be a function epoch -> factor, got {lr_schedule!r}")
        self.lr_schedule = lr_schedule
        self.velocity = [None] * len(self.params)

    def start_epoch(self, epoch):
        if self.lr_schedule is not None:
            self.lr = self.base_lr * float(self.lr_schedule(epoch))

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        # The update is in place: spectra an enclosing backends.reuse_spectra() block computed
        # from these weights (keyed by the array, not its values) would be stale afterwards.
        reuse.drop()
        with no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                if tuple(p.grad.shape) != tuple(p.data.shape):   # broadcast silently otherwise (or read past it)
                    raise ValueError(f"SGD: parameter {i} has a gradient of shape {tuple(p.grad.shape)} for its "
                                     f"shape {tuple(p.data.shape)}")
                if (self.momentum and get_array_module(p.data) is not np and p.data.flags.c_contiguous
                        and (self.velocity[i] is None or self.velocity[i].flags.c_contiguous)):
                    self._fused_step(i, p)
                    continue
                d = p.grad
                if self.weight_decay:
                    d = d + self.weight_decay * p.data
                if self.momentum:
                    if self.velocity[i] is None:
                        self.velocity[i] = d.copy()
                    else:
                        v = self.velocity[i]
                        v *= self.momentum
                        v += d
                    d = self.velocity[i]
                p.data -= self.lr * d

    def _fused_step(self, i, p):
        """The same update as step()'s, as one GPU kernel per parameter instead of four
        (kernels/sgd.cu; p.data and its velocity C-contiguous)."""
        xp = get_array_module(p.data)
        g = xp.ascontiguousarray(p.grad, dtype=np.float32)   # its shape checked by step()
        first = self.velocity[i] is None
        if first:
            self.velocity[i] = xp.empty_like(p.data)
        if p.data.size:
            launch_1d(_sgd_kernel(), p.data.size,
                      (g, np.float32(self.lr), np.float32(self.momentum), np.float32(self.weight_decay),
                       np.int32(first), p.data, self.velocity[i], np.int64(p.data.size)))

    def state_dict(self):
        return {"lr": self.lr, "base_lr": self.base_lr, "momentum": self.momentum,
                "weight_decay": self.weight_decay,
                "velocity": [None if v is None else to_device(v, "cpu").copy() for v in self.velocity]}

    def load_state_dict(self, state):
        """Restore state_dict()'s output, all or nothing: every field is checked (the numbers as
        __init__ checks them, each buffer as Module.load_state_dict checks a parameter) before
        any changes; a CheckpointError (a ValueError) names the first problem."""
        self.assign_state(self.checked_state(state))

    def checked_state(self, state):
        """load_state_dict's checks: the new fields, buffers on their parameters' devices; nothing
        changes here. assign_state() then only rebinds attributes, which cannot fail."""
        keys = ("lr", "base_lr", "momentum", "weight_decay", "velocity")
        if not isinstance(state, dict) or set(state) != set(keys):
            got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"optimizer state must be a dict with keys {list(keys)}, got {got}")
        new = {}
        for k in keys[:4]:
            try:
                new[k] = _hyperparameter(k, state[k])
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"optimizer state: {e}") from None
        vel = state["velocity"]
        if not isinstance(vel, (list, tuple)) or len(vel) != len(self.params):
            n = len(vel) if isinstance(vel, (list, tuple)) else type(vel).__name__
            raise CheckpointError(f"optimizer state has {n} buffers, the model has {len(self.params)} parameters")
        vel = [None if v is None else state_array(v, p.shape, f"optimizer buffer {i}")
               for i, (v, p) in enumerate(zip(vel, self.params))]
        new["velocity"] = [None if v is None else to_device(v, p.device) for v, p in zip(vel, self.params)]
        return new

    def assign_state(self, new):
        self.lr, self.base_lr = new["lr"], new["base_lr"]
        self.momentum, self.weight_decay, self.velocity = new["momentum"], new["weight_decay"], new["velocity"]


def _hyperparameter(name, v):
    """v as a float: a finite real number >= 0 (not a bool), else ValueError naming it."""
    if not finite_number(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


@functools.lru_cache(maxsize=None)
def _sgd_kernel():
    """kernels/sgd.cu's update: d = g + wd p;  v = d (first step) or momentum v + d;  p -= lr v.
    Compiled on first use (CuPy)."""
    return cuda_module("sgd.cu", directory=_KERNEL_DIR).get_function("minitorch_sgd_momentum")
