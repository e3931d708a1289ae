"""correlate1d: one long mask over many long signals, the 1-D case of direct's convolution.

  y[b, i] = sum_j x[b, i + j] mask[j]      i < L - K + 1 (valid; no flip, like the 2-D passes)

B signals of length L, a mask of length K. On the GPU, kernels/correlate1d.cu: each thread keeps
OUT consecutive outputs in registers and a block of THREADS threads shares its input window;
(OUT, THREADS) is tuned per (B, L, K) through backends.tuning (direct_tune), checked against
DEFAULT's output. On the CPU, NumPy: a sliding-window view times the mask.
"""
import numpy as np

from . import tuning
from .common import check_arrays
from .direct_plans import kernel, new_output

# (outputs per thread, threads per block) of every correlate1d<OUT, THREADS> instance; OUT odd.
CONFIGS = ((7, 256), (15, 128), (15, 256), (23, 128), (31, 64), (31, 128))
DEFAULT = (15, 128)           # the untuned choice, and the reference a tuned one must match
TUNE_CHECK_TOL = 1e-4
MAX_GRID_Y = 65535            # signals per call: one grid row each


def correlate1d(x, mask, *, config=None):
    """y (..., L - K + 1) = valid cross-correlation of each row of x (..., L) with mask (K,).

    float32. config=(OUT, THREADS) forces one of CONFIGS on the GPU.
    """
    xp, x, mask = check_arrays(x=x, mask=mask)
    if x.ndim < 1 or mask.ndim != 1:
        raise ValueError(f"correlate1d: x must be (..., L) and mask (K,), got shapes {x.shape} and {mask.shape}")
    L, K = x.shape[-1], mask.shape[0]
    if K < 1 or K > L:
        raise ValueError(f"correlate1d: the mask length K = {K} must be between 1 and the signal length L = {L}")
    batch = x.shape[:-1]
    B = int(np.prod(batch))
    n_out = L - K + 1
    if B == 0:
        return xp.empty(batch + (n_out,), np.float32)
    if xp is np:
        windows = np.lib.stride_tricks.sliding_window_view(x.reshape(B, L), K, axis=-1)   # (B, n_out, K)
        return (windows @ mask).astype(np.float32).reshape(batch + (n_out,))
    if B > MAX_GRID_Y:
        raise ValueError(f"correlate1d: at most {MAX_GRID_Y} signals per call (grid y), got {B}")
    import cupy as cp
    x2 = cp.ascontiguousarray(x).reshape(B, L)                                            # (B, L)
    mask = cp.ascontiguousarray(mask)

    def run(cfg):
        out, threads = cfg
        y = new_output(cp, (B, n_out))
        tile = out * threads
        kernel(f"correlate1d<{out}, {threads}>")(((n_out + tile - 1) // tile, B), (threads,),
                                                 (x2, mask, y, np.int64(L), np.int32(K), np.int64(n_out)))
        return y

    if config is not None:
        if tuple(config) not in CONFIGS:
            raise ValueError(f"correlate1d: config {config!r} is not one of {CONFIGS}")
        return run(tuple(config)).reshape(batch + (n_out,))
    return run(_choose(cp, B, L, K, run)).reshape(batch + (n_out,))


_BY_NAME = {f"{o}x{t}": (o, t) for o, t in CONFIGS}   # tuning records name them "OUTxTHREADS"


def _choose(xp, B, L, K, run):
    """DEFAULT untuned; else the tuning record's choice for (B, L, K): remembered, or every
    configuration through tuning.tune, checked against DEFAULT's output."""
    if not tuning.enabled("direct_tune", xp):
        return DEFAULT
    key = tuning.key(xp, np.float32, (B, L, K), "correlate1d", "direct")
    record = tuning.remembered(
        key, lambda: tuning.tune(list(_BY_NAME), lambda name: run(_BY_NAME[name]), xp,
                                 against="{}x{}".format(*DEFAULT), tol=TUNE_CHECK_TOL, warn=True),
        valid=lambda choice: choice in _BY_NAME, untuned=lambda: "{}x{}".format(*DEFAULT))
    return _BY_NAME[record["choice"]]
