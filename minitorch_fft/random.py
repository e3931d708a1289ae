"""The framework's random stream (dropout masks, initialisation).

On the CPU one NumPy Generator drives everything, so a seed gives bit-identical
training and its state can be checkpointed. On the GPU dropout masks come from
CuPy's generator, seeded from the same seed.
"""
import numpy as np

from .device import cupy_or_none

_rng = np.random.default_rng(0)


def manual_seed(seed):
    """Seed the CPU generator and, where CuPy is present, the GPU one."""
    global _rng
    _rng = np.random.default_rng(seed)
    cp = cupy_or_none()
    if cp is not None:
        try:
            cp.random.seed(seed)
        except Exception:  # CuPy present but no usable GPU: nothing to seed
            pass


def generator():
    """The NumPy Generator (used for initialisation and CPU dropout)."""
    return _rng


def uniform(shape, xp=np):
    """float32 uniform [0, 1) samples on the device of `xp`."""
    if xp is np:
        return _rng.random(shape, dtype=np.float32)
    return xp.random.random(shape, dtype=np.float32)


def get_state():
    """A JSON-serialisable snapshot of the CPU generator."""
    return _rng.bit_generator.state


def set_state(state):
    _rng.bit_generator.state = state
