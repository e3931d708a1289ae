"""Shared fixtures: the `gpu` marker skips cleanly where CuPy or a GPU is missing."""
import contextlib
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from minitorch_fft.device import gpu_available


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Backend/model tests run once per device; the cuda variant carries the gpu marker.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def backend_usable(name):
    """Whether backend `name` can run on this machine (cudnn: only where cuDNN is installed)."""
    from minitorch_fft import backends
    return getattr(backends.get(name), "available", lambda: True)()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def fresh_rng(request):
    """A generator on a new seed every run (fresh data, as the measuring method asks), with the
    seed in the test's report, so a failure can be replayed with default_rng(seed)."""
    seed = np.random.SeedSequence().entropy
    request.node.add_report_section("call", "seed", f"np.random.default_rng({seed})")
    return np.random.default_rng(seed)


def host_library(tmp_path_factory, name, source, flags=()):
    """C++ `source` (a CUDA file behind a host shim) compiled as a shared library and loaded;
    skips without a host compiler, or where it lacks C++20 <barrier>."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/clang++) for the CUDA-source emulation")
    d = tmp_path_factory.mktemp(name)
    (d / "emu.cpp").write_text(source)
    lib = d / f"lib{name}.so"
    res = subprocess.run([cxx, *flags, "-O1", "-shared", "-fPIC", "-o", str(lib), str(d / "emu.cpp")],
                         capture_output=True, text=True)
    if res.returncode != 0 and "barrier" in res.stderr and "No such file" in res.stderr:
        pytest.skip(f"{cxx} lacks C++20 <barrier>")
    assert res.returncode == 0, f"host compile of {name} failed:\n{res.stderr[-4000:]}"
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="session", autouse=True)
def tuning_cache_of_this_process(tmp_path_factory):
    """auto's tuning cache, one file for each test process (each xdist worker): a copy of the one
    $MINITORCH_TUNE_CACHE names (a seed of timed records, so the GPU tests need not time them all
    again), else an empty file. Shared, one worker's timed choice was what another's test read,
    so a test asserting what a timed choice built passed or failed by the order the files ran in
    (session 52); and the tests never write to the user's own cache (~/.cache/minitorch_fft)."""
    from minitorch_fft.backends import config, tuning
    seed = os.environ.get("MINITORCH_TUNE_CACHE")
    mine = tmp_path_factory.mktemp("tuning") / "autotune.json"
    if seed and tuning.cache_path().is_file():
        shutil.copyfile(tuning.cache_path(), mine)
    os.environ["MINITORCH_TUNE_CACHE"] = str(mine)
    config.reload()
    yield mine
    if seed is None:
        os.environ.pop("MINITORCH_TUNE_CACHE", None)
    else:
        os.environ["MINITORCH_TUNE_CACHE"] = seed
    config.reload()


@pytest.fixture(autouse=True)
def pass_graphs_released():
    """The PyTorch adapter's pass graphs (and the pools and buffers they hold) end with the test that
    made them (config.reload() gives every test new keys anyway: without this they would only hold memory)."""
    yield
    import sys
    adapter = sys.modules.get("minitorch_fft.pytorch")
    if adapter is not None:
        adapter.release_pass_graphs()


@pytest.fixture(autouse=True)
def settings_read_afresh(monkeypatch):
    """backends.config reads each variable once; every test starts from the environment as it is,
    and monkeypatch.setenv/delenv take effect at once (config.reload() after each)."""
    from minitorch_fft.backends import config
    config.reload()
    for name in ("setenv", "delenv"):
        def follow(*args, _real=getattr(monkeypatch, name), **kwargs):
            _real(*args, **kwargs)
            config.reload()
        setattr(monkeypatch, name, follow)
    yield
    config.reload()


@pytest.fixture
def settings():
    """settings(name=value, ...) overrides backends.config settings until the test ends: the one
    way tests change a setting (never by patching module attributes)."""
    from minitorch_fft.backends import config
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(config.override(**values))
