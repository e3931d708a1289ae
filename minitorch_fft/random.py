"""The framework's random streams (initialisation, dropout masks).

On the CPU one NumPy Generator drives everything, so a seed gives bit-identical training.
On the GPU dropout masks come from a counter-based generator, Philox4x32-10 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011): element i of the n-th mask drawn on a
device is a pure function of (seed, n, i). The seed and n live in a small device array that the
mask kernel reads and a one-thread kernel advances, so a training step captured as a CUDA graph
(minitorch_fft.graphs) draws a fresh mask at every replay; a counter passed as a kernel argument
would be frozen into the graph. Both streams are in get_state(), so a resumed run draws the
masks it would have drawn.
"""
import numpy as np


_rng = np.random.default_rng(0)
_seed = 0
_gpu_states = {}   # device id -> uint64 array [seed, masks drawn], on that device
_pending = {}      # device id -> masks drawn, from set_state(), for a device not used yet

# Philox4x32-10's constants (Random123's philox.h)
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def manual_seed(seed):
    """Seed the CPU generator and the GPU dropout stream (its mask counter back to 0)."""
    global _rng, _seed
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
    model that the GPU kernel below follows; tested against Random123's known answers."""
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


_DROPOUT_PREAMBLE = r"""
__device__ __forceinline__ unsigned int minitorch_philox_word0(
        unsigned int c0, unsigned int c1, unsigned int c2, unsigned int c3,
        unsigned int k0, unsigned int k1) {
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0; c1 = lo1; c2 = hi0 ^ c3 ^ k1; c3 = lo0;
    }
    return c0;
}
"""

_KERNELS = {}


def _kernels():
    if not _KERNELS:
        import cupy as cp
        _KERNELS["mask"] = cp.ElementwiseKernel(
            "float32 x, raw uint64 state, float32 p, float32 scale", "float32 y, float32 m",
            """
            const unsigned long long e = (unsigned long long)i, seed = state[0], n = state[1];
            const unsigned int bits = minitorch_philox_word0(
                (unsigned int)e, (unsigned int)(e >> 32), (unsigned int)n, (unsigned int)(n >> 32),
                (unsigned int)seed, (unsigned int)(seed >> 32));
            m = (float)(bits >> 8) * 5.9604644775390625e-08f >= p ? scale : 0.f;
            y = x * m;
            """, "minitorch_dropout_philox", preamble=_DROPOUT_PREAMBLE)
        _KERNELS["advance"] = cp.ElementwiseKernel(
            "", "raw uint64 state", "state[1] += 1;", "minitorch_dropout_advance")
    return _KERNELS


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
    k = _kernels()
    state = _gpu_state(cp)
    y, m = k["mask"](x, state, np.float32(p), np.float32(1.0 / (1.0 - p)))
    k["advance"](state, size=1)
    return y, m


def get_state():
    """A JSON-serialisable snapshot: the CPU generator, the GPU dropout seed and the number of
    masks each device has drawn (reading those waits for the GPU)."""
    return {"numpy": _rng.bit_generator.state, "seed": _seed,
            "gpu_masks_drawn": {str(d): int(s[1]) for d, s in _gpu_states.items()}}


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
