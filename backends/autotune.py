"""auto: the per-layer, per-pass autotuner (the layer default, ``backend="auto"``).

For each (device, dtype, geometry, pass) the first call times every registered backend that
``supports()`` the geometry on fresh random data of the pass's shapes (warm-up, device sync,
median), checks each candidate's result against ``gemm`` before it may win, and caches the
winner in memory and on disk through ``backends.tuning`` (so a second run does not tune
again). Winners are per pass: fprop, bprop and accGrad of one layer may use different backends.

A candidate that raises or runs out of memory is skipped, with the reason kept in the record.
``MINITORCH_AUTO_MEMORY_MB`` caps the extra GPU memory a candidate may take (CuPy's pool limit
is lowered while it runs, so a big-buffer candidate fails and is skipped).

On the CPU nothing is timed unless ``MINITORCH_AUTO_TUNE=on``: the first backend in
PREFERENCE that supports the geometry is used, which keeps CPU runs deterministic and fast.
"""
import logging
import os

import numpy as np

from . import tuning
from .common import geometry

log = logging.getLogger("minitorch_fft.autotune")

# Untimed order (CPU default, and the tie-break): cheapest-to-set-up first.
PREFERENCE = ("gemm", "cufft", "fbfft", "direct")
CHECK_TOL = 1e-4  # a candidate further than this from gemm (relative) never wins
_memory = {}      # key -> record, this process's choices


def _tuning_on(xp):
    mode = os.environ.get("MINITORCH_AUTO_TUNE", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"MINITORCH_AUTO_TUNE must be auto, on or off, got {mode!r}")
    return mode == "on" or (mode == "auto" and xp is not np)


def _geometry_key(x_shape, w_shape, stride, padding):
    g = geometry(x_shape, w_shape, stride, padding)
    return (g.S, g.f, g.fo, g.h, g.w, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw)


def pick(registry, pass_name, x_shape, w_shape, stride, padding, xp=np):
    """The name of the backend that runs this pass of this geometry."""
    candidates = [n for n in PREFERENCE if n in registry and registry[n].supports(x_shape, w_shape, stride, padding)]
    candidates += [n for n in registry if n not in candidates and registry[n].supports(x_shape, w_shape, stride, padding)]
    if not candidates:
        return None
    key = tuning.key(xp, np.float32, _geometry_key(x_shape, w_shape, stride, padding), pass_name, "auto")
    if len(candidates) == 1 or not _tuning_on(xp):
        _memory[key] = {"backend": candidates[0], "ms": {}, "skipped": {}, "untimed": True}
        return candidates[0]
    record = _memory.get(key) or tuning.default_cache().get(key)
    if record is None or record.get("backend") not in candidates:
        record = _tune(registry, candidates, pass_name, x_shape, w_shape, stride, padding, xp)
        tuning.default_cache().put(key, record)
    _memory[key] = record
    return record["backend"]


def _pass_inputs(xp, pass_name, x_shape, w_shape, stride, padding):
    """Fresh random float32 arguments of one pass (never zeros: they hide bugs and time differently)."""
    g = geometry(x_shape, w_shape, stride, padding)
    if xp is np:
        rand = np.random.default_rng().standard_normal
    else:
        rand = xp.random.standard_normal
    gy_shape = (g.S, g.fo, g.oh, g.ow)
    if pass_name == "fprop":
        return (rand(x_shape, dtype=np.float32), rand(w_shape, dtype=np.float32))
    if pass_name == "bprop":
        return (rand(gy_shape, dtype=np.float32), rand(w_shape, dtype=np.float32), tuple(x_shape))
    return (rand(gy_shape, dtype=np.float32), rand(x_shape, dtype=np.float32), tuple(w_shape))


def _rel_error(xp, got, ref):
    den = float(xp.linalg.norm(ref))
    return float(xp.linalg.norm(got - ref)) / den if den else float(xp.linalg.norm(got))


def _tune(registry, candidates, pass_name, x_shape, w_shape, stride, padding, xp):
    args = _pass_inputs(xp, pass_name, x_shape, w_shape, stride, padding)
    run = lambda name: getattr(registry[name], pass_name)(*args, stride=stride, padding=padding)  # noqa: E731
    reference = run("gemm") if "gemm" in registry else None
    times, skipped = {}, {}
    cap_mb = os.environ.get("MINITORCH_AUTO_MEMORY_MB")
    for name in candidates:
        try:
            with _memory_cap(xp, cap_mb):
                out = run(name)  # also the warm-up: compilation, plans, buffers
                if reference is not None:
                    err = _rel_error(xp, out, reference)
                    if not err <= CHECK_TOL:
                        skipped[name] = f"disagrees with gemm (relative error {err:.2e} > {CHECK_TOL})"
                        continue
                times[name] = tuning.timeit(lambda: run(name), xp, warmup=1, repeat=5)
        except Exception as e:  # noqa: BLE001 - any failure only disqualifies the candidate
            skipped[name] = f"{type(e).__name__}: {e}"[:300]
            _free_pool(xp)
    for name, why in skipped.items():
        log.info("auto %s %s %s: skipped %s (%s)", pass_name, tuple(x_shape), tuple(w_shape), name, why)
    if not times:
        raise RuntimeError(f"auto: every backend failed for {pass_name} of input {tuple(x_shape)}, "
                           f"weight {tuple(w_shape)}: {skipped}")
    winner = min(times, key=times.get)
    return {"backend": winner, "ms": {k: round(v, 4) for k, v in times.items()}, "skipped": skipped}


class _memory_cap:
    """Lower CuPy's pool limit to (in use + cap) while a candidate runs; a no-op without a cap."""

    def __init__(self, xp, cap_mb):
        self.xp, self.cap = xp, None if cap_mb is None or xp is np else float(cap_mb) * 2**20

    def __enter__(self):
        if self.cap is not None:
            pool = self.xp.get_default_memory_pool()
            self.old = pool.get_limit()
            pool.set_limit(size=int(pool.used_bytes() + self.cap))

    def __exit__(self, *exc):
        if self.cap is not None:
            self.xp.get_default_memory_pool().set_limit(size=self.old)


def _free_pool(xp):
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()


def choices():
    """This process's tuning records: a list of JSON-able dicts, one per (geometry, pass)."""
    rows = []
    for (device, dtype, geom, pass_name, _), rec in _memory.items():
        rows.append({"device": device, "dtype": dtype, "geometry": list(geom), "pass": pass_name, **rec})
    return rows


def format_choices():
    """A plain-text table of choices: one line per layer geometry and pass."""
    lines = [f"{'input (S,f,h,w)':<22}{'weight (fo,f,kh,kw)':<22}{'stride':<8}{'pad':<8}{'pass':<9}"
             f"{'backend':<8} ms per candidate"]
    for r in choices():
        S, f, fo, h, w, kh, kw, sh, sw, ph, pw = r["geometry"]
        ms = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["ms"].items(), key=lambda kv: kv[1])) or "(untimed)"
        lines.append(f"{str((S, f, h, w)):<22}{str((fo, f, kh, kw)):<22}{str((sh, sw)):<8}{str((ph, pw)):<8}"
                     f"{r['pass']:<9}{r['backend']:<8} {ms}")
    return "\n".join(lines)
