"""Autotuning shared by the backends: time candidates, keep the fastest, remember it per device.

A choice is keyed by (device name, dtype, GEMM precision, geometry, pass, backend) and its value
is anything JSON can hold. The GEMM precision is backends.cgemm's mode, "fp32" or "tf32": a
choice tuned with the FFT backends' GEMM on TF32 is never reused in strict fp32, nor the other
way round. Choices live in memory and in one JSON file holding every device's choices:

  {"version": 2,
   "devices": {"NVIDIA H100 80GB HBM3": {"[\"float32\", \"fp32\", [128, ...], \"fprop\", \"cufft\"]": {...}}}}

The file is $MINITORCH_TUNE_CACHE if set, else ~/.cache/minitorch_fft/autotune.json. A file that
is corrupt or of another format version is ignored with a warning and rewritten at the next
choice (version 1 keys had no GEMM precision: its choices, all made in fp32, are tuned again
once). Writes go to a temporary file renamed over the old one (os.replace), so a reader never
sees half a file; a writer re-reads the file and merges before writing, so processes tuning side
by side keep each other's choices (the last writer wins on the same key, and both are valid).
A cache that cannot be written (read-only home, full disk) warns and keeps working in memory.
"""
import functools
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from . import cgemm

VERSION = 2  # 2: the GEMM precision joined the key


def cache_path():
    """Where the on-disk cache lives: $MINITORCH_TUNE_CACHE, else ~/.cache/minitorch_fft/autotune.json."""
    override = os.environ.get("MINITORCH_TUNE_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "minitorch_fft" / "autotune.json"


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
        self.path = Path(path)
        self._devices = self._read(warn=True)          # {device name: {entry name: value}}

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
        self._write()

    def _read(self, warn):
        """{device: {entry: value}} from the file; {} if it is missing, unreadable or bad."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            if warn:
                warnings.warn(f"cannot read autotune cache {self.path} ({e}); tuning from scratch")
            return {}
        try:
            data = json.loads(text)
        except ValueError as e:
            if warn:
                warnings.warn(f"ignoring corrupt autotune cache {self.path} ({e}); it will be rebuilt")
            return {}
        version = data.get("version") if isinstance(data, dict) else None
        if version != VERSION:
            if warn:
                warnings.warn(f"ignoring autotune cache {self.path} of format version {version!r} "
                              f"(this code writes version {VERSION}); it will be rebuilt")
            return {}
        devices = data.get("devices")
        if not isinstance(devices, dict) or not all(isinstance(v, dict) for v in devices.values()):
            if warn:
                warnings.warn(f"ignoring corrupt autotune cache {self.path} (no 'devices' mapping); "
                              "it will be rebuilt")
            return {}
        return devices

    def _write(self):
        """Merge with what is on disk now (ours wins), then replace the file atomically."""
        merged = self._read(warn=False)
        for device, entries in self._devices.items():
            merged.setdefault(device, {}).update(entries)
        self._devices = merged
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": VERSION, "devices": merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            warnings.warn(f"cannot write autotune cache {self.path} ({e}); keeping choices in memory only")


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
