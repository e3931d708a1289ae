"""auto: the per-layer, per-pass autotuner (the layer default, ``backend="auto"``).

For each (device, dtype, GEMM precision, geometry, pass) the first call times every registered
backend that ``supports()`` the geometry on fresh random data of the pass's shapes, checks each
candidate's result against ``gemm`` before it may win, and caches the choice in memory and on
disk through ``backends.tuning`` (so a second run does not tune again). Choices are per pass:
fprop, bprop and accGrad of one layer may use different backends.

Timing. Each candidate runs once untimed (compilation, plans, buffers; this is the result that is
checked), then ROUNDS rounds visit the candidates in turn (a b c, a b c, ...), each round a
warm-up run and the median of REPEAT timed runs (CUDA events, device sync); a candidate's time is
the median of its rounds. Interleaving spreads clock and thermal drift over every candidate
instead of charging it to whichever ran last. Cost: 1 + ROUNDS * (1 + REPEAT) = 19 runs of each
candidate per (geometry, pass), against 7 with one round of 5; paid once per device and
precision, since choices are cached on disk.

Selection. Differences of a few percent are within run-to-run spread, so the fastest does not
simply win. Every candidate within MARGIN of the fastest (time <= (1 + MARGIN) x fastest;
``MINITORCH_AUTO_MARGIN``, a fraction, default 0.03; 0 lets the fastest win) is tied, and among
the tied the winner is, in this order of preference:
  1. the backend already chosen for most of the layer's other passes (same geometry), so that a
     layer's passes stay on one FFT backend and share spectra (backends.reuse): the tuner times
     each pass alone with sharing suspended, so it cannot see that saving;
  2. the first in TIE_ORDER: fbfft, cufft, polyphase (the FFT backends, for the same reason;
     fbfft's pass is three kernels and a GEMM, cufft's up to ten: places, FFTs, transposes,
     GEMM, inverse, crop), gemm, direct;
  3. the faster.
The record keeps every candidate's median ms and says why its backend won ("why").

Precision. With the FFT backends' GEMM on TF32 (backends.cgemm) candidates are checked against
gemm to cgemm.TF32_TOL instead of CHECK_TOL, and choices are keyed apart from fp32 ones.

A candidate that raises or runs out of memory is skipped, with the reason kept in the record.
``MINITORCH_AUTO_MEMORY_MB`` caps the extra GPU memory a candidate may take (CuPy's pool limit
is lowered while it runs, so a big-buffer candidate fails and is skipped).

On the CPU nothing is timed unless ``MINITORCH_AUTO_TUNE=on``: the first backend in
PREFERENCE that supports the geometry is used, which keeps CPU runs deterministic and fast.
"""
import logging
import statistics
import warnings
from collections import Counter

import numpy as np

from . import cgemm, config, tuning
from .common import PASSES, geometry, plain_args

log = logging.getLogger("minitorch_fft.auto")

# Untimed order (CPU default): cheapest-to-set-up first.
PREFERENCE = ("gemm", "cufft", "fbfft", "direct", "polyphase")
# Order among candidates tied within the margin: the FFT backends first (their timings leave out
# the spectra a step shares across passes), then the rest; backends not listed come last.
TIE_ORDER = ("fbfft", "cufft", "polyphase", "gemm", "direct")
ROUNDS, REPEAT = 3, 5   # timing rounds per candidate, timed runs per round (see the docstring)
MARGIN = config.SETTINGS["auto_margin"].default   # default tie margin, a fraction of the fastest time
CHECK_TOL = 1e-4  # a candidate further than this from gemm (relative) never wins (fp32 GEMM)
_memory = {}      # key -> record, this process's choices
_fast = {}        # (pass, shapes as given, xp, device, precision) -> (key, backend): remembered()


def _tuning_on(xp):
    mode = config.get("auto_tune")
    return mode == "on" or (mode == "auto" and xp is not np)


def margin():
    """The tie margin: the auto_margin setting ($MINITORCH_AUTO_MARGIN, a fraction, 0.03 = 3%)."""
    return config.get("auto_margin")


def _geometry_key(x_shape, w_shape, stride, padding):
    g = geometry(x_shape, w_shape, stride, padding)
    return (g.S, g.f, g.fo, g.h, g.w, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw)


def _fast_key(pass_name, x_shape, w_shape, stride, padding, xp):
    """The arguments as given, the device and the GEMM precision: what a layer passes on every
    call, hashed as is. None unless they are common.plain_args (geometry() must check anything
    else), or where the precision setting is invalid (the full path then reports it in its
    usual order)."""
    if not plain_args(x_shape, w_shape, stride, padding):
        return None
    try:
        mode = cgemm.mode(xp)
    except ValueError:
        return None
    device = None if xp is np else xp.cuda.runtime.getDevice()
    return (pass_name, x_shape, w_shape, stride, padding, xp, device, mode)


def remembered(registry, pass_name, x_shape, w_shape, stride, padding, xp=np):
    """pick()'s answer if this process already made it for these very arguments, else None.

    The per-call path of every auto layer after its first step: one dict lookup on the
    arguments as given, instead of normalising the geometry and building the tuning key. (It
    was meant to save 20-30 us a pass; on an H200 host the saving was within run-to-run noise,
    benchmarks/NOTES.md, session 5.)"""
    fast = _fast_key(pass_name, x_shape, w_shape, stride, padding, xp)
    hit = _fast.get(fast) if fast is not None else None
    if hit is None:
        return None
    _tuning_on(xp)  # rejects a bad MINITORCH_AUTO_TUNE, remembered or not
    key, name = hit
    known = _memory.get(key)   # the record the answer came from, unless _memory was reset since
    if known is None or known.get("backend") != name or name not in registry:
        return None
    return name


def pick(registry, pass_name, x_shape, w_shape, stride, padding, xp=np):
    """The name of the backend that runs this pass of this geometry."""
    name, key = _pick(registry, pass_name, x_shape, w_shape, stride, padding, xp)
    fast = _fast_key(pass_name, x_shape, w_shape, stride, padding, xp)
    if name is not None and fast is not None:
        _fast[fast] = (key, name)   # remembered() finds it from the arguments next time
    return name


def _pick(registry, pass_name, x_shape, w_shape, stride, padding, xp):
    """(backend name or None, the tuning key of this choice)."""
    tune = _tuning_on(xp)  # also rejects a bad MINITORCH_AUTO_TUNE, cached choice or not
    geom = _geometry_key(x_shape, w_shape, stride, padding)
    key = tuning.key(xp, np.float32, geom, pass_name, "auto")
    known = _memory.get(key)
    if known is not None and known.get("backend") in registry:
        return known["backend"], key  # chosen earlier in this process: every later pass of a layer
    candidates = [n for n in PREFERENCE if n in registry and registry[n].supports(x_shape, w_shape, stride, padding)]
    candidates += [n for n in registry if n not in candidates and registry[n].supports(x_shape, w_shape, stride, padding)]
    if not candidates:
        return None, key
    if len(candidates) == 1 or not tune:
        _memory[key] = {"backend": candidates[0], "ms": {}, "skipped": {}, "untimed": True}
        return candidates[0], key
    record = known or tuning.default_cache().get(key)
    if record is not None and not _valid_record(record):
        warnings.warn(f"ignoring a malformed autotune record for {pass_name} {geom}: {record!r:.200}; "
                      "tuning again")
        record = None
    if record is None or record.get("backend") not in candidates:
        record = _tune(registry, candidates, pass_name, x_shape, w_shape, stride, padding, xp,
                       _siblings(xp, geom, pass_name))
        tuning.default_cache().put(key, record)
    _memory[key] = record
    return record["backend"], key


def _valid_record(record):
    """What _tune writes: a backend name, {backend: ms} and {backend: reason} (an edited or
    damaged cache file must not crash the layer or format_choices)."""
    return (isinstance(record, dict) and isinstance(record.get("backend"), str)
            and isinstance(record.get("ms"), dict)
            and all(isinstance(v, (int, float)) for v in record["ms"].values())
            and isinstance(record.get("skipped"), dict))


def _siblings(xp, geom, pass_name):
    """{pass: backend} already chosen for this layer geometry's other passes (here or on disk)."""
    chosen = {}
    for other in PASSES:
        if other != pass_name:
            k = tuning.key(xp, np.float32, geom, other, "auto")
            record = _memory.get(k) or tuning.default_cache().get(k)
            if record is not None and _valid_record(record):
                chosen[other] = record["backend"]
    return chosen


def select(times, siblings=None, tie_margin=MARGIN):
    """(winner, why) from times {backend: ms} by the rule in the module docstring; siblings is
    {pass: backend} chosen for the layer's other passes."""
    if not times:
        raise ValueError("select: no timed candidates")
    siblings = siblings or {}
    fastest = min(times, key=times.get)
    tied = [name for name in times if times[name] <= (1 + tie_margin) * times[fastest]]
    votes = Counter(siblings.values())
    rank = {name: i for i, name in enumerate(TIE_ORDER)}
    winner = min(tied, key=lambda name: (-votes[name], rank.get(name, len(TIE_ORDER)), times[name]))
    if winner == fastest:
        return winner, "fastest"
    within = f"{times[winner] / times[fastest] - 1:.1%} slower than {fastest}, within the {tie_margin:.1%} margin"
    if votes[winner]:
        passes = ", ".join(p for p in PASSES if siblings.get(p) == winner)
        return winner, f"{within}: the layer's {passes} backend"
    return winner, f"{within}: tie order {', '.join(TIE_ORDER)}"


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


def _tune(registry, candidates, pass_name, x_shape, w_shape, stride, padding, xp, siblings=None):
    args = _pass_inputs(xp, pass_name, x_shape, w_shape, stride, padding)
    run = lambda name: getattr(registry[name], pass_name)(*args, stride=stride, padding=padding)  # noqa: E731
    reference = run("gemm") if "gemm" in registry else None
    tol = cgemm.TF32_TOL if cgemm.mode(xp) == "tf32" else CHECK_TOL
    rounds, skipped = {}, {}
    cap_mb = config.get("auto_memory_mb")
    for name in candidates:  # the untimed first run: warm-up (compilation, plans, buffers) and check
        try:
            with _memory_cap(xp, cap_mb):
                err = None if reference is None else _rel_error(xp, run(name), reference)
            if err is not None and not err <= tol:
                skipped[name] = f"disagrees with gemm (relative error {err:.2e} > {tol})"
                continue
            rounds[name] = []
        except Exception as e:  # noqa: BLE001 - any failure only disqualifies the candidate
            skipped[name] = f"{type(e).__name__}: {e}"[:300]
            _free_pool(xp)
    for _ in range(ROUNDS):  # interleaved: a b c, a b c, ...
        for name in list(rounds):
            try:
                with _memory_cap(xp, cap_mb):
                    rounds[name].append(tuning.timeit(lambda: run(name), xp, warmup=1, repeat=REPEAT))
            except Exception as e:  # noqa: BLE001
                skipped[name] = f"{type(e).__name__}: {e}"[:300]
                del rounds[name]
                _free_pool(xp)
    for name, why in skipped.items():
        log.info("auto %s %s %s: skipped %s (%s)", pass_name, tuple(x_shape), tuple(w_shape), name, why)
    if not rounds:
        raise RuntimeError(f"auto: every backend failed for {pass_name} of input {tuple(x_shape)}, "
                           f"weight {tuple(w_shape)}: {skipped}")
    times = {name: statistics.median(ms) for name, ms in rounds.items()}
    winner, why = select(times, siblings, margin())
    return {"backend": winner, "ms": {k: round(v, 4) for k, v in times.items()}, "skipped": skipped,
            "why": why}


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
    for (device, dtype, math, geom, pass_name, _), rec in _memory.items():
        rows.append({"device": device, "dtype": dtype, "math": math, "geometry": list(geom), "pass": pass_name,
                     **rec})
    return rows


def format_choices():
    """A plain-text table of choices: one line per layer geometry and pass (a tie won on the
    margin rule says so after the times)."""
    lines = [f"{'input (S,f,h,w)':<22}{'weight (fo,f,kh,kw)':<22}{'stride':<8}{'pad':<8}{'pass':<9}"
             f"{'gemm':<6}{'backend':<8} ms per candidate"]
    for r in choices():
        S, f, fo, h, w, kh, kw, sh, sw, ph, pw = r["geometry"]
        ms = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["ms"].items(), key=lambda kv: kv[1])) or "(untimed)"
        why = f" ({r['why']})" if r.get("why", "fastest") != "fastest" else ""
        lines.append(f"{str((S, f, h, w)):<22}{str((fo, f, kh, kw)):<22}{str((sh, sw)):<8}{str((ph, pw)):<8}"
                     f"{r['pass']:<9}{r['math']:<6}{r['backend']:<8} {ms}{why}")
    return "\n".join(lines)
