"""Stochastic gradient descent with momentum and weight decay (PyTorch's update rule)."""
import functools
from pathlib import Path

import numpy as np

from backends import reuse
from backends.common import cuda_module, launch_1d

from .device import get_array_module, to_device
from .tensor import no_grad
from .utils import is_number


class SGD:
    """p -= lr * v,  v = momentum * v + (grad + weight_decay * p).

    `lr_schedule(epoch) -> factor` is the schedule hook: ``start_epoch(e)`` sets
    ``lr = base_lr * lr_schedule(e)``.
    """

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0, lr_schedule=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("SGD got an empty parameter list")
        for name, v, lo in (("lr", lr, 0.0), ("momentum", momentum, 0.0), ("weight_decay", weight_decay, 0.0)):
            if not is_number(v) or not np.isfinite(v) or v < lo or (name == "lr" and v == 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if name == 'lr' else '>= 0'}, got {v!r}")
        self.base_lr = self.lr = float(lr)
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
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
        g = xp.ascontiguousarray(p.grad, dtype=np.float32)
        if g.shape != p.data.shape:   # the kernel would read past g
            raise ValueError(f"gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
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
        vel = state["velocity"]
        if len(vel) != len(self.params):
            raise ValueError(f"optimizer state has {len(vel)} buffers, the model has {len(self.params)} parameters")
        for v, p in zip(vel, self.params):
            if v is not None and tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"optimizer buffer of shape {tuple(v.shape)} for a parameter of shape {tuple(p.shape)}")
        self.lr, self.base_lr = float(state["lr"]), float(state["base_lr"])
        self.momentum, self.weight_decay = float(state["momentum"]), float(state["weight_decay"])
        self.velocity = [None if v is None else get_array_module(p.data).asarray(v, dtype=np.float32)
                         for v, p in zip(vel, self.params)]


_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


@functools.lru_cache(maxsize=None)
def _sgd_kernel():
    """kernels/sgd.cu's update: d = g + wd p;  v = d (first step) or momentum v + d;  p -= lr v.
    Compiled on first use (CuPy)."""
    return cuda_module("sgd.cu", directory=_KERNEL_DIR).get_function("minitorch_sgd_momentum")
