"""The framework's random streams (initialisation, dropout masks).

On the CPU one NumPy Generator drives everything, so a seed gives bit-identical training.
On the GPU dropout masks come from a counter-based generator, Philox4x32-10 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011): element i of the n-th mask drawn on a
device is a pure function of (seed, n, i). The seed and n live in a small device array that the
mask kernel reads and a one-thread kernel advances (kernels/dropout.cu, compiled on first use),
so a training step captured as a CUDA graph (minitorch_fft.graphs) draws a fresh mask at every
replay; a counter passed as a kernel argument would be frozen into the graph. Both streams are in
get_state(), so a resumed run draws the masks it would have drawn.
"""
import functools
from pathlib import Path

import numpy as np

from .backends.common import cuda_module, launch_1d
from .utils import is_int


_rng = np.random.default_rng(0)
_seed = 0
_gpu_states = {}   # device id -> uint64 array [seed, masks drawn], on that device
_pending = {}      # device id -> masks drawn, from set_state(), for a device not used yet

# Philox4x32-10's constants (Random123's philox.h)
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def manual_seed(seed):
    """Seed the CPU generator and the GPU dropout stream (its mask counter back to 0). `seed`: an
    int >= 0, as NumPy's generators take."""
    global _rng, _seed
    if not is_int(seed):
        raise TypeError(f"manual_seed takes an int >= 0, got {type(seed).__name__} {seed!r}")
    if seed < 0:
        raise ValueError(f"manual_seed takes an int >= 0, got {seed}")
    _rng = np.random.default_rng(seed)
    _seed = int(seed)
    _pending.clear()
    for state in _gpu_states.values():
        state.set(_state_values(0))


def _state_values(masks_drawn):
    """A device's dropout state as a host array: [seed, masks drawn], uint64."""
    return np.array([_seed % 2**64, masks_drawn], dtype=np.uint64)


def generator():
    """The NumPy Generator (used for initialisation and CPU dropout)."""
    return _rng


def uniform(shape, xp=np):
    """float32 uniform [0, 1) samples from the CPU generator (NumPy only)."""
    if xp is not np:
        raise TypeError("random.uniform draws from the CPU generator; GPU dropout masks come "
                        "from random.dropout_mask")
    return _rng.random(shape, dtype=np.float32)


def philox4x32(counter, key, rounds=10):
    """Philox4x32-R in NumPy: counter (4, ...) and key (2, ...) uint32 -> (4, ...) uint32. The
    model that kernels/dropout.cu follows; tested against Random123's known answers."""
    c = [np.asarray(w, dtype=np.uint64) for w in counter]
    k0, k1 = (np.asarray(w, dtype=np.uint64) for w in key)
    mask = np.uint64(0xFFFFFFFF)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & mask, (k1 + PHILOX_W[1]) & mask
        p0, p1 = np.uint64(PHILOX_M[0]) * c[0], np.uint64(PHILOX_M[1]) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & mask]
    return np.stack(c).astype(np.uint32)


def uniform_from_bits(bits):
    """The top 24 bits of a uint32 as a float32 in [0, 1): exact, and never 1."""
    return (np.asarray(bits, dtype=np.uint32) >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


def dropout_reference(seed, n, size, p):
    """The keep mask (bool, `size` elements) of the n-th GPU mask drawn after manual_seed(seed)
    with drop probability p, computed in NumPy: the GPU kernel must give exactly this."""
    i = np.arange(size, dtype=np.uint64)
    lo = np.uint64(0xFFFFFFFF)
    bits = philox4x32((i & lo, i >> np.uint64(32), np.uint64(n) & lo, np.uint64(n) >> np.uint64(32)),
                      (np.uint64(seed) & lo, (np.uint64(seed) >> np.uint64(32)) & lo))[0]
    return uniform_from_bits(bits) >= np.float32(p)


_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


@functools.lru_cache(maxsize=None)
def _kernels():
    """(mask, advance): kernels/dropout.cu's two kernels, compiled on first use (CuPy)."""
    module = cuda_module("dropout.cu", directory=_KERNEL_DIR)
    return module.get_function("minitorch_dropout_philox"), module.get_function("minitorch_dropout_advance")


def _gpu_state(cp):
    dev = cp.cuda.Device().id
    state = _gpu_states.get(dev)
    if state is None:
        state = _gpu_states[dev] = cp.asarray(_state_values(_pending.pop(dev, 0)))
    return state


def dropout_mask(x, p):
    """(x * mask, mask) on the GPU: mask is 1/(1-p) where kept, 0 where dropped (inverted dropout),
    drawn from the device's Philox stream, which then advances by one mask. Two kernels, no host
    round trip: the step can be captured in a CUDA graph."""
    import cupy as cp
    mask, advance = _kernels()
    state = _gpu_state(cp)
    x = cp.ascontiguousarray(x, dtype=np.float32)   # element i of the mask is x's i-th in C order
    y, m = cp.empty_like(x), cp.empty_like(x)
    if x.size:
        launch_1d(mask, x.size, (x, state, np.float32(p), np.float32(1.0 / (1.0 - p)), y, m, np.uint64(x.size)))
    advance((1,), (1,), (state,))
    return y, m


def get_state():
    """A JSON-serialisable snapshot: the CPU generator, the GPU dropout seed and the number of
    masks each device has drawn (reading those waits for the GPU)."""
    return {"numpy": _rng.bit_generator.state, "seed": _seed,
            "gpu_masks_drawn": {str(d): int(s[1]) for d, s in _gpu_states.items()}}


def on_device(state, device):
    """get_state()'s snapshot with its one GPU's mask count moved to GPU `device`. A
    data-parallel rank resumes rank 0's snapshot this way: every rank draws as many masks as rank
    0, but on its own GPU (a count kept under rank 0's device id would be lost on rank 1)."""
    drawn = state.get("gpu_masks_drawn", {})
    if len(drawn) > 1:
        raise ValueError(f"the snapshot has mask counts for {len(drawn)} GPUs ({', '.join(drawn)}); "
                         "a data-parallel rank's has one")
    return {**state, "gpu_masks_drawn": {str(device): n for n in drawn.values()}}


def set_state(state):
    """Restore get_state()'s snapshot (or, from checkpoints before the GPU stream had state, the
    bare NumPy generator state)."""
    global _seed
    if "numpy" not in state:          # older checkpoints: the NumPy bit generator's state only
        _rng.bit_generator.state = state
        return
    _rng.bit_generator.state = state["numpy"]
    _seed = int(state["seed"])
    drawn = {int(d): int(n) for d, n in state.get("gpu_masks_drawn", {}).items()}
    # Devices this process has used are set now; the others when they draw their first mask
    # (a checkpoint from another machine, or read where no GPU is usable, never touches CUDA here).
    _pending.clear()
    for dev, s in _gpu_states.items():
        s.set(_state_values(drawn.pop(dev, 0)))
    _pending.update(drawn)
