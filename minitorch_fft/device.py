"""Array modules and devices (the helpers live in backends.device, the ground floor)."""
from .backends.device import (cupy_or_none, device_of, get_array_module, gpu_available,  # noqa: F401
                             is_cupy, normalize_device, synchronize, to_device)
