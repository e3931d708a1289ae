"""Array modules and devices: NumPy on the CPU, CuPy on an NVIDIA GPU.

Everything above this file is written once against ``xp`` (Chainer's
``get_array_module``); only the convolution backends are device-specific.
"""
import numpy as np

try:  # CuPy is optional: the CPU path must never need it.
    import cupy as _cupy
except Exception:  # ImportError, or a CuPy wheel that cannot find its CUDA libraries
    _cupy = None


def cupy_or_none():
    """The cupy module, or None where it is not installed."""
    return _cupy


def gpu_available():
    """True if CuPy is installed and sees at least one CUDA device."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


def is_cupy(a):
    return _cupy is not None and isinstance(a, _cupy.ndarray)


def get_array_module(*arrays):
    """numpy or cupy, from the arrays given (numpy if none is a CuPy array)."""
    if _cupy is not None and any(isinstance(a, _cupy.ndarray) for a in arrays):
        return _cupy
    return np


def device_of(a):
    return "cuda" if is_cupy(a) else "cpu"


def normalize_device(device):
    """'cpu', 'cuda' (or 'cuda:0', 'gpu') -> 'cpu' | 'cuda'; 'auto' picks the GPU if there is one."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda', got {device!r}")
    d = device.lower()
    if d == "auto":
        return "cuda" if gpu_available() else "cpu"
    if d == "cpu":
        return "cpu"
    if d in ("cuda", "gpu") or d.startswith("cuda:"):
        if d.startswith("cuda:") and d != "cuda:0":
            raise ValueError(f"device {device!r}: minitorch-fft runs on the current CUDA device only "
                             f"('cuda' or 'cuda:0'); choose the GPU with CUDA_VISIBLE_DEVICES={d[5:]}")
        if not gpu_available():
            raise ValueError(f"device {device!r} requested but no CUDA GPU is usable "
                             "(CuPy missing or no device visible); use device='cpu'")
        return "cuda"
    raise ValueError(f"unknown device {device!r}; expected 'cpu', 'cuda' or 'auto'")


def to_device(a, device):
    """Move a raw array to 'cpu' or 'cuda' (no copy if it is already there)."""
    device = normalize_device(device)
    if device == "cpu":
        return _cupy.asnumpy(a) if is_cupy(a) else np.asarray(a)
    return _cupy.asarray(a)


def synchronize(xp):
    """Wait for the GPU (a no-op on the CPU). This is a host-device sync point."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
