"""Autotuning shared by the backends: time candidates, keep the fastest, remember it per device.

A choice is keyed by (device name, dtype, GEMM precision, geometry, pass, backend) and its value
is anything JSON can hold. The GEMM precision is backends.cgemm's mode, "fp32" or "tf32": a
choice tuned with the FFT backends' GEMM on TF32 is never reused in strict fp32, nor the other
way round. Choices live in memory and in one JSON file holding every device's choices:

  {"version": 2,
   "devices": {"NVIDIA H100 80GB HBM3": {"[\"float32\", \"fp32\", [128, ...], \"fprop\", \"cufft\"]": {...}}}}

The file is $MINITORCH_TUNE_CACHE if set (with ~ expanded; a relative path is taken from the
working directory the first time it is seen), else ~/.cache/minitorch_fft/autotune.json.

Faults lose nothing:
- A file that is corrupt or of another format version is ignored with a warning. At the next
  choice it is moved aside to <file>.bak, not overwritten, and a new file is written (version 1
  keys had no GEMM precision: its choices, all made in fp32, are tuned again once).
- A file that exists but cannot be read (permissions, I/O error) is never replaced: this process
  keeps its choices in memory only.
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
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX: writes stay atomic, but concurrent writers may drop a choice
    fcntl = None

from .utils import atomic_file

from . import cgemm, config

VERSION = 2  # 2: the GEMM precision joined the key


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


def key(xp, dtype, geometry, pass_name, backend, math=None):
    """The key of one choice: (device name, dtype, GEMM precision, geometry tuple, pass, backend),
    all JSON-able. The precision is cgemm.mode(xp) ("fp32" or "tf32") unless `math` names it."""
    math = cgemm.mode(xp) if math is None else math
    if math not in ("fp32", "tf32"):
        raise ValueError(f"GEMM precision must be 'fp32' or 'tf32', got {math!r}")
    return (device_name(xp), np.dtype(dtype).name, math, tuple(int(v) for v in geometry), pass_name, backend)


def _entry_name(rest):
    """The JSON object key of (dtype, precision, geometry, pass, backend) inside a device's section."""
    dtype, math, geometry, pass_name, backend = rest
    return json.dumps([dtype, math, list(geometry), pass_name, backend])


class TuneCache:
    """Choices in memory, mirrored to one JSON file (see the module docstring)."""

    def __init__(self, path):
        self.path = Path(path).expanduser().absolute()
        self._devices, _ = self._read(warn=True)          # {device name: {entry name: value}}
        self._own = {}                                     # what this object put(), same layout
        self.version = 0   # counts put()s: lets a caller memoise get() (backends/cufft.py's _config)

    def get(self, key):
        """The stored choice for `key`, or None."""
        device, *rest = key
        return self._devices.get(device, {}).get(_entry_name(rest))

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
        """({device: {entry: value}}, state) from the file. state is "ok", "missing", "unreadable"
        (the file exists but cannot be read) or "invalid" (corrupt, or another format version)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, "missing"
        except OSError as e:
            if warn:
                warnings.warn(f"cannot read autotune cache {self.path} ({e}); tuning from scratch, "
                              "and keeping new choices in memory only")
            return {}, "unreadable"
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
            if warn:
                warnings.warn(f"ignoring corrupt autotune cache {self.path} ({str(e)[:200]}); it will be "
                              f"rebuilt, the old file kept as {self._backup().name}")
            return {}, "invalid"
        version = data.get("version") if isinstance(data, dict) else None
        if version != VERSION:
            if warn:
                warnings.warn(f"ignoring autotune cache {self.path} of format version {version!r} "
                              f"(this code writes version {VERSION}); it will be rebuilt, the old file "
                              f"kept as {self._backup().name}")
            return {}, "invalid"
        devices = data.get("devices")
        if not isinstance(devices, dict) or not all(isinstance(v, dict) for v in devices.values()):
            if warn:
                warnings.warn(f"ignoring corrupt autotune cache {self.path} (no 'devices' mapping); "
                              f"it will be rebuilt, the old file kept as {self._backup().name}")
            return {}, "invalid"
        return devices, "ok"

    def _backup(self):
        return self.path.with_name(self.path.name + ".bak")

    def _write(self):
        """Under the lock: merge what this object put into what is on disk now, then replace the
        file atomically. An unreadable file is left alone; an invalid one is moved to .bak first."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                merged, state = self._read(warn=False)
                if state == "unreadable":
                    warnings.warn(f"not writing autotune cache {self.path}: it exists but cannot be "
                                  "read, and replacing it would lose its choices; keeping choices in "
                                  "memory only")
                    return
                for device, entries in self._own.items():     # others' newer choices stay
                    merged.setdefault(device, {}).update(entries)
                self._devices = merged
                if state == "invalid":
                    os.replace(self.path, self._backup())
                with atomic_file(self.path) as f:
                    json.dump({"version": VERSION, "devices": merged}, f, indent=1, sort_keys=True)
        except OSError as e:
            warnings.warn(f"cannot write autotune cache {self.path} ({e}); keeping choices in memory only")

    @contextlib.contextmanager
    def _locked(self):
        """An exclusive lock on <file>.lock for a read-merge-replace. The lock file is opened
        read-only (created 0666 less the umask), so every user who can read it can lock it.
        Without fcntl, or on a filesystem without flock (some NFS, Lustre, FUSE mounts), the
        write goes ahead unlocked, with a warning: still atomic, but a concurrent writer's
        choice may be dropped."""
        if fcntl is None:
            yield
            return
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDONLY | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                warnings.warn(f"cannot lock autotune cache {self.path} ({e}); writing it unlocked")
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


def timeit(fn, xp=np, warmup=1, repeat=5):
    """Median milliseconds of fn() over `repeat` runs, after `warmup` untimed runs.

    GPU: CUDA events recorded around each run on the current stream, then waited on (a host-device
    sync point per run). CPU: time.perf_counter.
    """
    if warmup < 0 or repeat < 1:
        raise ValueError(f"timeit needs warmup >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}")
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
    return statistics.median(times)


def fastest(candidates, run, xp=np, warmup=1, repeat=3):
    """The candidate c for which run(c) has the smallest median time (a lone candidate is not timed)."""
    candidates = list(candidates)
    if not candidates:
        raise ValueError("fastest: no candidates to time")
    if len(candidates) == 1:
        return candidates[0]
    times = [timeit(functools.partial(run, c), xp, warmup, repeat) for c in candidates]
    return candidates[int(np.argmin(times))]
