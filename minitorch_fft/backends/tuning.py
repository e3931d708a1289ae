"""Autotuning shared by the backends: one recipe that times candidates, checks them against a
reference, selects a winner and remembers it per device (auto, cufft, direct and cudnn use it).

The recipe, tune(candidates, run, ...):
  1. Every candidate runs once untimed (compilation, plans, buffers); that run is also the checked
     one: a candidate that raises, or whose output is further than `tol` (relative, Frobenius norm)
     from the reference, is skipped with its reason kept.
  2. ROUNDS rounds visit the survivors in turn (a b c, a b c, ...), each round a warm-up run and
     the median of REPEAT timed runs (timeit); a candidate's time is the median of its rounds.
     Interleaving spreads clock and thermal drift over every candidate instead of charging it to
     whichever ran last. Optionally (drop_slower) a candidate more than that factor behind the
     best after a round is not timed again.
  3. select(): the fastest wins, unless others are within `margin` of it (time <= (1 + margin) x
     fastest); among those tied the caller's preference decides, then time (or, where the caller
     asks for host times, as auto does, the least host work a call, where it saves more than
     margin x the faster's time). "why" says which.
     Before a preference decides, the tied candidates are timed ROUNDS rounds more (interleaved
     again) and judged on the median of all their rounds: a tie is where one slow round decides
     (session 16: winograd timed at 0.493 ms against fbfft's 0.490 put OverFeat-fast's conv3 bprop
     on fbfft, which table3 measured at 0.461 against winograd's 0.396).
The result is one record format, stored as is in the cache below:

  {"choice": <JSON-able>, "ms": {label: median ms}, "skipped": {label: reason}, "why": "fastest"}

plus "host_ms" {label: median ms of host work a call} where the caller asked for host times (auto),
and the fields a caller adds (auto: "revisions", "inner").

remembered(key, tune) is the lookup every tuner uses: an in-process memo (valid while the
cache's version is unchanged: a lookup through the file's JSON entry names costs ~20 us, more
than a small pass's kernels take to start), else the cache, else tune() and store. enabled(name,
xp) reads the tune settings (auto_tune, cufft_tune, direct_tune, cudnn_tune): "auto" = on the GPU only,
"on", "off".

A record is keyed by (device name, dtype, GEMM precision, geometry, pass, backend) (TuneCache
itself stores any JSON value). The GEMM precision is backends.cgemm's mode, "fp32" or "tf32": a
choice tuned with the FFT backends' GEMM on TF32 is never reused in strict fp32, nor the other
way round. Choices live in memory and in one JSON file holding every device's choices:

  {"version": 3,
   "devices": {"NVIDIA H100 80GB HBM3": {"[\"float32\", \"fp32\", [128, ...], \"fprop\", \"cufft\"]": {...}}}}

The file is $MINITORCH_TUNE_CACHE if set (with ~ expanded; a relative path is taken from the
working directory the first time it is seen), else ~/.cache/minitorch_fft/autotune.json.

Faults lose nothing, and nothing that is not the cache's own is touched:
- The cache replaces only a file it wrote, known by its format marker ("format": MARKER; files
  from before the marker are exactly {"version": int, "devices": {...}}). Anything else at the
  path (a foreign or unparseable file, a directory, a device, a FIFO, a link to nothing, a file
  that cannot be read) is left untouched, with one warning, and choices stay in memory.
- A file of its own but of another format version, or with malformed entries, is ignored with
  a warning and, at the next choice, copied to a numbered backup (<file>.bak, then .bak.2, ...:
  an older backup is never replaced) before a new file is written (version 1 keys had no GEMM
  precision; version 2 had one record format per tuner: their choices are tuned again once).
- A symbolic link at the path is followed: a cache shared through a link stays shared (its
  target is read and replaced, the link stays). Files are opened non-blocking and checked to be
  regular files before they are read, so no open or read can block.
- Writes go to a temporary file, fsynced, with the umask's usual permissions, then renamed over
  the old one (os.replace), so a reader never sees half a file.
- A writer holds an exclusive lock (fcntl.flock on <file>.lock, where the platform and the
  filesystem have it; the lock file is opened read-only, so users sharing a cache can all lock
  it) while it re-reads the file, merges and replaces it, so processes tuning side by side keep
  each other's choices (the last writer wins on the same key, and both are valid).
- A cache that cannot be written (read-only home, full disk) warns and keeps working in memory.
"""
import contextlib
import functools
import itertools
import json
import logging
import os
import stat
import statistics
import time
import warnings
from pathlib import Path

import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX: writes stay atomic, but concurrent writers may drop a choice
    fcntl = None

from .utils import atomic_file, is_int, open_lock_file

from . import cgemm, config

VERSION = 4  # 2: the GEMM precision joined the key; 3: one record format for every tuner;
# 4: winograd and cudnn joined auto's candidates and gemm runs 1x1 kernels as plain GEMMs, so a
# choice made before never timed them (an older cache goes to a numbered backup; tuning runs again)
MARKER = "minitorch_fft tuning cache"   # the "format" field of every file this module writes
ROUNDS, REPEAT = 3, 5   # timing rounds per candidate, timed runs per round (module docstring)

log = logging.getLogger("minitorch_fft.tuning")


def cache_path():
    """Where the on-disk cache lives: $MINITORCH_TUNE_CACHE, else ~/.cache/minitorch_fft/autotune.json."""
    override = config.get("tune_cache")
    return _absolute(str(override)) if override else Path.home() / ".cache" / "minitorch_fft" / "autotune.json"


@functools.lru_cache(maxsize=None)
def _absolute(raw):
    """raw with ~ expanded, made absolute once: a later chdir does not move the cache."""
    return Path(raw).expanduser().absolute()


def device_name(xp):
    """'cpu' for NumPy; the CUDA device's name (e.g. 'NVIDIA H100 80GB HBM3') for CuPy."""
    if xp is np:
        return "cpu"
    return _cuda_device_name(xp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _cuda_device_name(device_id):
    # cudaGetDeviceProperties costs milliseconds (measured: ~2 ms per cufft call on an H200
    # when this ran on every pass), so it is asked once per device.
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def variant_tol(xp, strict_tol):
    """The tolerance a backend's tuner compares one variant's output with another's at (tiledfft's
    bases, winograd's group counts; winograd's tiles until session 31, which runs F(2x2) alone in
    TF32 mode): strict_tol in fp32, cgemm.TF32_TOL where the GEMMs run in TF32 (both sides then
    round their operands to TF32, ~4e-4 apart on VGG-16's layers, and a strict 1e-4 refused every
    variant but the default: session 22)."""
    return cgemm.TF32_TOL if cgemm.mode(xp) == "tf32" else strict_tol


def key(xp, dtype, geometry, pass_name, backend, math=None):
    """The key of one choice: (device name, dtype, GEMM precision, geometry tuple, pass, backend),
    all JSON-able. The precision is cgemm.mode(xp) ("fp32" or "tf32") unless `math` names it."""
    math = cgemm.mode(xp) if math is None else math
    if math not in ("fp32", "tf32"):
        raise ValueError(f"GEMM precision must be 'fp32' or 'tf32', got {math!r}")
    dtype_name, ints = _plain(dtype, tuple(geometry))
    return (device_name(xp), dtype_name, math, ints, pass_name, backend)


@functools.lru_cache(maxsize=4096)
def _plain(dtype, geometry):
    """(dtype's name, geometry as Python ints): ~30 us uncached, and tuned passes build a key
    on every call (remembered()'s memo is keyed by it)."""
    return np.dtype(dtype).name, tuple(int(v) for v in geometry)


def _entry_name(rest):
    """The JSON object key of (dtype, precision, geometry, pass, backend) inside a device's section."""
    dtype, math, geometry, pass_name, backend = rest
    return json.dumps([dtype, math, list(geometry), pass_name, backend])


class _Foreign(Exception):
    """What is at the cache's path is not a cache this module wrote: never replaced."""


def _ours(data):
    """Whether parsed JSON is a cache this module wrote (the module docstring's marker rule)."""
    if not isinstance(data, dict):
        return False
    if data.get("format") == MARKER:
        return True
    return (set(data) == {"version", "devices"} and isinstance(data["version"], int)
            and not isinstance(data["version"], bool) and isinstance(data["devices"], dict))


def _read_regular(path):
    """The bytes of the regular file at `path` (links followed), None where nothing is there;
    _Foreign for anything else. Opened non-blocking and checked before reading: a FIFO or a
    device is never read, so this cannot block."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        if os.path.lexists(path):
            raise _Foreign("a symbolic link to nothing") from None
        return None
    except OSError as e:
        raise _Foreign(f"it cannot be opened: {e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _Foreign("not a regular file" + (" (a directory)" if stat.S_ISDIR(st.st_mode) else ""))
    if st.st_size > MAX_CACHE_BYTES:   # read whole at every new choice, and decoded: 2 GB held for a 1 GB file
        os.close(fd)
        raise _Foreign(f"it holds {st.st_size:,} bytes, more than a tuning cache's limit of {MAX_CACHE_BYTES:,}")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(MAX_CACHE_BYTES + 1)
        except OSError as e:
            raise _Foreign(f"it cannot be read: {e}") from None


# The largest tuning cache read: the zoo's networks tuned on one GPU, every record kept, took 4.3 MB
# (results/nvidia-h200/tuning/autotune_s60_call6.json); a file far past that is not one of ours.
MAX_CACHE_BYTES = 256 << 20


def _read_only_mode(path):
    """The permission bits of the file at `path` where its owner may not write it (made read-only),
    else None (writable, or nothing there)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):   # nothing there (as Path.exists() says)
        return None
    return None if mode & stat.S_IWUSR else mode


class TuneCache:
    """Choices in memory, mirrored to one JSON file (see the module docstring)."""

    def __init__(self, path):
        self.path = Path(path).expanduser().absolute()
        self._warned = set()                               # each refusal is said once
        self._devices, _, _ = self._read(warn=True)        # {device name: {entry name: value}}
        self._own = {}                                     # what this object put(), same layout
        self.version = 0   # counts put()s: lets a caller memoise get() (remembered()'s memo)

    def get(self, key):
        """The stored choice for `key`, or None."""
        device, *rest = key
        return self._devices.get(device, {}).get(_entry_name(rest))

    def devices(self):
        """The device names the cache holds choices for, sorted."""
        return sorted(self._devices)

    def unwritable(self):
        """Why put() could not reach the file, or None: the file is not a tuning cache this code
        wrote (never replaced), or the folder it would be written in is missing and cannot be
        made, or is not writable. For a caller about to spend minutes tuning (put() itself only
        warns, and keeps the choices in memory)."""
        folder = self._target().parent
        while not folder.exists() and folder != folder.parent:   # put() makes the missing folders
            folder = folder.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            return f"cannot write in {folder}"
        if self._read(warn=False)[1] == "foreign":
            return f"{self.path} is not a tuning cache this code wrote, and is never replaced"
        if _read_only_mode(self._target()) is not None:
            return f"{self.path} is read-only, and is kept so"
        return None

    def foreign(self):
        """Why what is at the path is not a tuning cache this code wrote (left untouched and never
        replaced: the choices stay in memory), or None: a cache of its own, or nothing there. For a
        caller that refuses such a path before any work (train.py); the cache itself only warns."""
        try:
            raw = _read_regular(self._target())
        except _Foreign as e:
            return str(e)
        if raw is None or self._read(warn=False)[1] != "foreign":
            return None
        return "it is not a tuning cache this code wrote (no format marker, or not JSON)"

    def put(self, key, value):
        """Store `value` (JSON-able) for `key`, in memory and on disk."""
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"a tuning choice must be JSON-able, got {value!r} ({e})") from None
        device, *rest = key
        self._devices.setdefault(device, {})[_entry_name(rest)] = value
        self._own.setdefault(device, {})[_entry_name(rest)] = value
        self._write()
        self.version += 1

    def _read(self, warn):
        """(devices, state, raw) from the file: devices {device: {entry: value}}; state "ok",
        "missing", "foreign" (never replaced, see the module docstring) or "stale" (its own, of
        another version or with malformed entries: backed up, then replaced); raw its bytes."""
        try:
            raw = _read_regular(self._target())
        except _Foreign as e:
            if warn:
                self._warn(f"leaving {self.path} untouched: {e}; it is not a tuning cache this code "
                           "wrote, so choices stay in memory only")
            return {}, "foreign", None
        if raw is None:
            return {}, "missing", None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
            data, why = None, f"it does not parse as JSON ({str(e)[:100]})"
        else:
            why = "it has no tuning cache's format marker"
        if not _ours(data):
            if warn:
                self._warn(f"leaving {self.path} untouched: {why}, so it is not a tuning cache this "
                           "code wrote; choices stay in memory only")
            return {}, "foreign", raw
        version, devices = data.get("version"), data.get("devices")
        if version != VERSION or not isinstance(devices, dict) or not all(
                isinstance(v, dict) for v in devices.values()):
            if warn:
                what = (f"of format version {version!r} (this code writes version {VERSION})"
                        if version != VERSION else "with malformed entries")
                self._warn(f"ignoring autotune cache {self.path} {what}; it will be rebuilt, the old "
                           "file kept as a numbered backup beside it")
            return {}, "stale", raw
        return devices, "ok", raw

    def _target(self):
        """The file read and replaced: the path, or where a link at it points (a shared cache
        stays shared: the link is never replaced)."""
        if self.path.is_symlink():
            target = Path(os.path.realpath(self.path))
            if target.exists():
                return target
        return self.path            # a link to nothing stays the path: _read_regular refuses it

    def _refuse(self):
        self._warn(f"not writing autotune cache {self.path}: what is there is not a tuning cache this "
                   "code wrote, and replacing it would lose it; keeping choices in memory only")

    def _warn(self, message):
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    def _back_up(self, target, raw):
        """Copy `raw` (the stale file's bytes) to the first free <file>.bak, .bak.2, ...: created
        exclusively, so an older backup is never replaced."""
        for n in itertools.count(1):
            backup = target.with_name(target.name + (".bak" if n == 1 else f".bak.{n}"))
            try:
                with open(backup, "xb") as f:
                    f.write(raw)
                return backup
            except FileExistsError:
                continue

    def _write(self):
        """Under the lock: merge what this object put into what is on disk now, then replace the
        file atomically. A foreign file is left alone; a stale one is backed up first."""
        try:
            if not self.path.is_symlink():
                self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._read(warn=False)[1] == "foreign":   # refused before a lock file is made beside it
                return self._refuse()
            target = self._target()
            mode = _read_only_mode(target)
            if mode is not None:   # made read-only: kept so
                return self._warn(f"not writing autotune cache {self.path}: it is read-only (mode {mode:04o}); "
                                  "keeping new choices in memory only")
            with self._locked(target):
                merged, state, raw = self._read(warn=False)
                if state == "foreign":                         # it changed since the check above
                    return self._refuse()
                for device, entries in self._own.items():     # others' newer choices stay
                    merged.setdefault(device, {}).update(entries)
                self._devices = merged
                if state == "stale":
                    self._back_up(target, raw)
                with atomic_file(target) as f:
                    json.dump({"format": MARKER, "version": VERSION, "devices": merged}, f, indent=1,
                              sort_keys=True)
        except OSError as e:
            self._warn(f"cannot write autotune cache {self.path} ({e}); keeping choices in memory only")

    @contextlib.contextmanager
    def _locked(self, target):
        """An exclusive lock on <target>.lock for a read-merge-replace. The lock file is opened
        read-only (created 0666 less the umask), so every user who can read it can lock it; never
        through a link (a link to nothing would create its target) and non-blocking (a FIFO there
        would hang the open). Without fcntl, on a filesystem without flock (some NFS, Lustre,
        FUSE mounts), or where the lock path is not a plain file, the write goes ahead unlocked,
        with a warning: still atomic, but a concurrent writer's choice may be dropped."""
        if fcntl is None:
            yield
            return
        try:
            fd = open_lock_file(target.with_name(target.name + ".lock"))
        except OSError as e:
            self._warn(f"cannot lock autotune cache {self.path} ({e}); writing it unlocked")
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                self._warn(f"cannot lock autotune cache {self.path} ({e}); writing it unlocked")
                yield
                return
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)




_caches = {}


def default_cache():
    """The process's TuneCache for cache_path() (the environment is read at each call)."""
    path = cache_path()
    if path not in _caches:
        _caches[path] = TuneCache(path)
    return _caches[path]


def timeit(fn, xp=np, warmup=1, repeat=5, inner=1):
    """Median milliseconds of fn() over `repeat` runs, after `warmup` untimed runs.

    GPU: CUDA events recorded around each timed span on the current stream, then waited on (a
    host-device sync point per span). CPU: time.perf_counter. inner: fn() runs that many times back to back in
    each timed span, and the time is given per run: the launches queue up as in a training step,
    so a run's launch latency no longer counts in full (on a 0.3 ms pass it hid a 6 % difference
    between two cuDNN plans, session 22).
    """
    if warmup < 0 or repeat < 1 or inner < 1:
        raise ValueError(f"timeit needs warmup >= 0, repeat >= 1 and inner >= 1, got warmup={warmup}, "
                         f"repeat={repeat}, inner={inner}")
    if inner > 1:
        one = fn

        def fn():
            for _ in range(inner):
                one()
    for _ in range(warmup):
        fn()
    times = []
    if xp is np:
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    else:
        start, end = xp.cuda.Event(), xp.cuda.Event()
        for _ in range(repeat):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(start, end))
    return statistics.median(times) / inner


def enabled(setting, xp):
    """Whether the tune setting `setting` ("auto_tune", "cufft_tune", "direct_tune" or "cudnn_tune") has tuning
    on for arrays of `xp`: "on", or "auto" on the GPU."""
    mode = config.get(setting)
    return mode == "on" or (mode == "auto" and xp is not np)


def rel_error(xp, got, ref):
    """|got - ref| / |ref| (Frobenius norms), or |got| where ref is zero."""
    den = float(xp.linalg.norm(ref))
    return float(xp.linalg.norm(got - ref)) / den if den else float(xp.linalg.norm(got))


class Untunable(Exception):
    """The data cannot check the candidates: the reference holds NaN or inf (the caller's own
    data, as cufft and direct tune on it). remembered() then gives the caller's untuned choice for
    this call, caches nothing, and a later call with finite data tunes."""


def tune(candidates, run, xp=np, *, reference=None, against=None, reference_name="the reference",
         tol=0.0, label=str, margin=0.0, prefer=None, explain=None, drop_slower=None, warn=False, inner=1,
         host=False):
    """Time `candidates` with run(candidate) -> output by the recipe in the module docstring and
    return the record {"choice", "ms", "skipped", "why"}.

    reference: an output every candidate must match to `tol` (reference_name names it in the
    reasons); or against: the candidate whose output is the reference (it runs first; if it
    raises, so does tune). Neither: no check.
    label(candidate) -> str names it in "ms" and "skipped" (and must be unique).
    margin, prefer(label) -> sortable, explain(label) -> str: select()'s tie rule (with a prefer,
    candidates tied after the rounds are timed ROUNDS rounds more before it decides).
    drop_slower: a factor; after a round, a candidate slower than it x the best is timed no more.
    warn: a candidate that disagrees with the reference is also a warning (a kernel bug), not
    only a log line. inner: runs back to back per timed span (timeit), times given per run.
    host: also time the host's part of every timed run (the clock around run(), nothing waited on:
    what issuing the call costs), kept as the record's "host_ms" {label: median ms a run}; among
    candidates the margin and the preference leave tied, one whose host work is less than the
    faster's by more than margin x its time wins (select's host).
    A lone candidate is neither run nor timed.
    """
    candidates = list(candidates)
    if not candidates:
        raise ValueError("tune: no candidates")
    if len(candidates) == 1:
        return {"choice": candidates[0], "ms": {}, "skipped": {}, "why": "only candidate"}
    if inner < 1:
        raise ValueError(f"tune: inner must be >= 1, got {inner}")
    by_label = {label(c): c for c in candidates}
    if len(by_label) != len(candidates):
        raise ValueError(f"tune: candidate labels are not unique: {[label(c) for c in candidates]}")
    order = list(by_label)
    rounds, skipped = {}, {}
    if against is not None:
        ref_label = label(against)
        order.remove(ref_label)
        order.insert(0, ref_label)
        reference = run(against)                      # its untimed first run
        rounds[ref_label] = []
    else:
        ref_label = reference_name
    if reference is not None and not bool(xp.isfinite(reference).all()):   # a host-device sync
        raise Untunable(f"{ref_label} is not finite")
    for name in order:                                # the untimed first run, also the checked one
        if name in rounds:
            continue
        try:
            out = run(by_label[name])
            err = None if reference is None else rel_error(xp, out, reference)
        except Exception as e:  # noqa: BLE001 - any failure only disqualifies the candidate
            skipped[name] = f"{type(e).__name__}: {e}"[:300]
            continue
        if err is not None and not err <= tol:
            skipped[name] = f"disagrees with {ref_label} (relative error {err:.2e} > {tol})"
            if warn:
                warnings.warn(f"tuning: {name} {skipped[name]}; not used", RuntimeWarning, stacklevel=2)
            continue
        rounds[name] = []

    bursts = {"inner": inner} if inner > 1 else {}   # timeit(fn, xp, warmup, repeat) otherwise, as stubs take it
    issued = {name: [] for name in rounds} if host else None   # host ms of each timed run (and warm-up's)

    def hosted(name):
        if issued is None:
            return lambda: run(by_label[name])

        def call():
            start = time.perf_counter()
            out = run(by_label[name])
            issued[name].append((time.perf_counter() - start) * 1e3)
            return out
        return call

    def time_rounds(names, drop=None):             # interleaved: a b c, a b c, ...
        for _ in range(ROUNDS):
            for name in list(names):
                try:
                    rounds[name].append(timeit(hosted(name), xp, warmup=1, repeat=REPEAT, **bursts))
                except Exception as e:  # noqa: BLE001
                    skipped[name] = f"{type(e).__name__}: {e}"[:300]
                    del rounds[name]
                    names.remove(name)
            if drop is not None and names:
                best = min(rounds[name][-1] for name in names)
                names[:] = [name for name in names if rounds[name][-1] <= drop * best]

    time_rounds([name for name in order if name in rounds], drop_slower)
    if prefer is not None and rounds:
        tied = _tied({name: statistics.median(ms) for name, ms in rounds.items()}, margin)
        if len(tied) > 1:                             # a preference would decide: time them again
            time_rounds(tied)
    for name, why in skipped.items():
        log.info("tuning: skipped %s (%s)", name, why)
    if not rounds:
        raise RuntimeError(f"every candidate failed: {skipped}")
    # decided on the values the record keeps, so that a caller can tell from a record what today's rule makes of it
    times = {name: round(statistics.median(ms), 4) for name, ms in rounds.items()}
    host_ms = None if issued is None else {name: round(statistics.median(issued[name]), 4) for name in times
                                           if issued[name]}
    winner, why = select(times, margin, prefer, explain, host=host_ms)
    record = {"choice": by_label[winner], "ms": times, "skipped": skipped, "why": why}
    if host_ms is not None:
        record["host_ms"] = host_ms
    return record


def select(times, margin=0.0, prefer=None, explain=None, host=None):
    """(winner, why) from times {label: ms}: the fastest, unless others are within `margin` (a
    fraction) of it; among those tied, the least prefer(label) (default: none preferred), then the
    faster, unless `host` {label: ms} has every one of them and some call costs the host less than
    the faster's by more than `margin` x the faster's time: then the one of those with the least
    host work (a difference of a few microseconds decides nothing: it would flip from process to
    process). why is "fastest", or says how far behind the winner is and explain(winner) (or the
    host times)."""
    if not times:
        raise ValueError("select: no timed candidates")
    # exact ties (the stored times are rounded) go by label: a cache file's dicts come back in another order
    fastest = min(times, key=lambda name: (times[name], name))
    tied = _tied(times, margin)
    rank = prefer or (lambda name: 0)
    best = min(rank(name) for name in tied)
    group = [name for name in tied if rank(name) == best]
    winner = faster = min(group, key=lambda name: (times[name], name))
    lighter = []
    if host is not None and all(name in host for name in group):
        lighter = [name for name in group if host[faster] - host[name] > margin * times[faster]]
        if lighter:
            winner = min(lighter, key=lambda name: (host[name], name))
    if winner == fastest:
        return winner, "fastest"
    within = f"{times[winner] / times[fastest] - 1:.1%} slower than {fastest}, within the {margin:.1%} margin"
    if lighter:
        return winner, (f"{within}: less host work a call ({host[winner]:.3f} ms against {faster}'s "
                        f"{host[faster]:.3f})")
    return winner, f"{within}: {explain(winner)}" if explain else within


def _tied(times, margin):
    """The labels of `times` within `margin` (a fraction) of the fastest, the fastest among them."""
    fastest = min(times.values())
    return [name for name in times if times[name] <= (1 + margin) * fastest]


def is_record(record):
    """Whether `record` has tune()'s format (an edited or damaged file may hold anything)."""
    return (isinstance(record, dict) and "choice" in record and isinstance(record.get("ms"), dict)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in record["ms"].values())
            and isinstance(record.get("skipped"), dict) and isinstance(record.get("why"), str))


_memo = {}   # tuning key -> (cache, its version, record): remembered()'s per-call answer


def peek(key):
    """The record remembered() would answer from this process's memo for `key` (the cache
    unchanged since), else None: a look that never reads the file and never tunes."""
    hit = _memo.get(key)
    cache = default_cache()
    return hit[2] if hit is not None and hit[0] is cache and hit[1] == cache.version else None


def peek_choice(key, options):
    """The choice of peek(key)'s record where it is an int among `options` (what the tuner's valid
    test would accept: a prepared call fixes its variant from it), else None."""
    record = peek(key)
    choice = None if record is None else record.get("choice")
    return choice if is_int(choice) and choice in options else None


UNTUNED = "untuned this call"   # the why of remembered()'s record for one call only


def for_this_call_only(record):
    """Whether remembered() gave `record` for one call only (its data could not tune): what is
    built from it must not outlive the call."""
    return record.get("why", "").startswith(UNTUNED)


def remembered(key, tune, valid=None, untuned=None):
    """The record for `key`: from this process's memo while the cache is unchanged, else from
    the cache if is_record and valid(record["choice"]) (a bad one warns), else tune() -> record,
    stored in the cache. The memo is left alone on hits: a record is checked when read from disk.
    If tune() raises Untunable, the record of untuned() (the caller's default) is returned for this
    call only: neither cached nor remembered."""
    cache = default_cache()
    hit = _memo.get(key)
    if hit is not None and hit[0] is cache and hit[1] == cache.version:
        return hit[2]
    record = cache.get(key)
    if record is not None and not (is_record(record) and (valid is None or valid(record["choice"]))):
        why = ("its choice is not among this process's candidates (a backend not installed here, or a choice "
               "the tuner could not have made)" if is_record(record) else "not a tuning record")
        warnings.warn(f"ignoring invalid cached tuning record {record!r:.200} for {key}: {why}; tuning again")
        record = None
    if record is None:
        try:
            record = tune()
        except Untunable as e:
            if untuned is None:
                raise
            return {"choice": untuned(), "ms": {}, "skipped": {}, "why": f"{UNTUNED}: {e}"}
        cache.put(key, record)
    _memo[key] = (cache, cache.version, record)
    return record
