"""Every CUDA source under minitorch_fft/backends/kernels/ and minitorch_fft/kernels/ (the core's pooling,
dropout, SGD and fused layer kernels) compiles for sm_90, and its kernels live in registers: ptxas reports
no spill stores or loads (and, for the fbfft kernels, whose register arrays must be indexed by
constants only, no stack frame at all).

Templates are instantiated the project's way: each source lists every instantiation its
backend compiles inside `#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS` (CuPy instantiates by
name expression at run time instead). CuPy compiles the same sources through NVRTC,
which the last test checks too where CuPy's NVRTC bindings load (no GPU needed).
Run with -s to see the register counts.

The core's kernels also run on the CPU: core_host_library() compiles one for the host, and
core_gpu_branch() runs a core module's GPU branch on it through a fake CuPy that checks each
launch's argument types; test_optim, test_graphs and test_layers compare both with the NumPy path.
"""
import contextlib
import ctypes
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import minitorch_fft
from minitorch_fft.backends import fbfft_kernels, tiledfft, winograd
from minitorch_fft.backends.common import KERNEL_DIR, kernel_source
from conftest import host_library
from minitorch_fft import functional

CORE_KERNEL_DIR = Path(minitorch_fft.__file__).resolve().parent / "kernels"
CORE_SOURCES = ("pool.cu", "dropout.cu", "sgd.cu", "fused.cu")   # what functional, random, optim and fused load
# fused.cu's kernels use warp ballots, shuffles and block barriers, which the host build (one thread
# after another) cannot run: they are tested on the GPU only (test_fused.py), the others on the host too.
HOST_SOURCES = ("pool.cu", "dropout.cu", "sgd.cu")
SOURCES = sorted(KERNEL_DIR.glob("*.cu")) + sorted(CORE_KERNEL_DIR.glob("*.cu"))
MACRO = "MINITORCH_EXPLICIT_INSTANTIATIONS"
# NVRTC name expressions a backend or the core asks for (checked to resolve under NVRTC).
NAME_EXPRESSIONS = {"fbfft.cu": fbfft_kernels.NAME_EXPRESSIONS, "pool.cu": functional.POOL_NAME_EXPRESSIONS,
                    "winograd.cu": winograd.NAME_EXPRESSIONS, "tiledfft.cu": tiledfft.NAME_EXPRESSIONS}
# Kernels that must not even have a stack frame (register arrays indexed by constants).
NO_STACK = re.compile(r"fbfft|winograd|tiledfft")


def find_nvcc():
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def check_instantiations_listed(src):
    text = src.read_text()
    if re.search(r"template\s*<[^>]*>\s*__global__", text) and MACRO not in text:
        pytest.fail(f"{src.name} has __global__ templates but no `#ifdef {MACRO}` block "
                    "instantiating what its backend compiles")


def ptxas_report(text):
    """{mangled kernel: {'registers', 'stack', 'spill_stores', 'spill_loads'}} from -Xptxas -v."""
    kernels = {}
    for m in re.finditer(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads", text):
        kernels[m.group(1)] = dict(stack=int(m.group(2)), spill_stores=int(m.group(3)),
                                   spill_loads=int(m.group(4)))
    for m in re.finditer(r"Compiling entry function '(\S+)' for '\w+'\s*\n"
                         r"(?:.*\n)*?.*Used (\d+) registers", text):
        kernels.setdefault(m.group(1), {})["registers"] = int(m.group(2))
    return kernels


@pytest.mark.parametrize("src", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles_for_sm90_without_spills(src, tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    check_instantiations_listed(src)
    res = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-std=c++17", f"-D{MACRO}", "-Xptxas", "-v",
                          "-o", str(tmp_path / f"{src.stem}.cubin"), str(src)],
                         capture_output=True, text=True, timeout=900)
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"nvcc failed on {src.name}:\n{log[-6000:]}"
    report = ptxas_report(log)
    assert report, f"no kernels found in the ptxas report of {src.name}:\n{log[-3000:]}"
    names = NAME_EXPRESSIONS.get(src.name, ())
    templates = {re.sub(r"<.*", "", name) for name in names}
    assert sum(1 for k in report if any(t in k for t in templates)) >= len(names), \
        "an instantiation was not compiled"
    bad = []
    for name, r in sorted(report.items()):
        print(f"{src.name}: {name}: {r.get('registers')} registers, stack {r['stack']} B, "
              f"spills {r['spill_stores']}/{r['spill_loads']} B")
        if r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{name} spills {r['spill_stores']}/{r['spill_loads']} B (stores/loads)")
        elif NO_STACK.search(name) and r["stack"]:
            bad.append(f"{name} has a {r['stack']} B stack frame (dynamically indexed registers?)")
    assert not bad, f"{src.name}: kernels meant to live in registers do not:\n" + "\n".join(bad)


def test_core_kernel_sources_exist():
    """The core's CUDA sources sit in minitorch_fft/kernels/ (where cuda_module reads them)."""
    assert sorted(p.name for p in CORE_KERNEL_DIR.glob("*.cu")) == sorted(CORE_SOURCES)
    for name in CORE_SOURCES:
        assert (CORE_KERNEL_DIR / name).read_text().strip()


def nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as exc:  # CuPy missing, or no libnvrtc to load
        pytest.skip(f"CuPy's NVRTC not usable here: {exc}")
    return nvrtc


@pytest.mark.gpu   # needs CuPy's NVRTC: runs with `pytest -m gpu` on the device, skips in CI
@pytest.mark.parametrize("src", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles_under_nvrtc(src):
    """What CuPy's RawModule does at run time: no host headers, template name expressions, sibling
    sources inlined (common.cuda_module)."""
    nvrtc = nvrtc_or_skip()
    prog = nvrtc.createProgram(kernel_source(src), src.name, [], [])
    try:
        names = NAME_EXPRESSIONS.get(src.name, ())
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, ["--std=c++17", "--gpu-architecture=sm_90", f"-D{MACRO}"])
        except Exception as exc:
            pytest.fail(f"NVRTC failed on {src.name}: {exc}\n{nvrtc.getProgramLog(prog)}")
        for name in names:
            assert nvrtc.getLoweredName(prog, name)
    finally:
        nvrtc.destroyProgram(prog)


# ---- the core's kernels compiled for the host ------------------------------------------------
# Their kernels are grid-stride loops without shared memory or barriers, so the host runs the
# threads of a launch one after another. -ffp-contract=off keeps the host's float arithmetic that
# of NumPy (no fused multiply-add), so the tests can ask for bit-identical results. Each kernel
# gets an entry point emu_<kernel>(its arguments..., grid, block).
HOST_SHIM = r"""
#include <algorithm>
#include <cmath>
#define __global__
#define __device__
#define __forceinline__ inline
struct Dim { unsigned x = 0, y = 0, z = 0; };
static Dim threadIdx, blockIdx, blockDim, gridDim;
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
using std::isnan;
using std::min;
#include "KERNEL_PATH"
template <class F> static void launch(unsigned grid, unsigned block, F kernel) {
    gridDim.x = grid; blockDim.x = block;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t) { blockIdx.x = b; threadIdx.x = t; kernel(); }
}
#define EMU(NAME, KERNEL, PARAMS, ARGS) \
    extern "C" void NAME PARAMS { launch(grid, block, [=] { KERNEL ARGS; }); }
"""
POOL_GEOM = "h, w, kh, kw, sh, sw, oh, ow"
HOST_ENTRIES = {
    "sgd.cu": r"""
EMU(emu_sgd, minitorch_sgd_momentum, (const float* g, float lr, float momentum, float wd, int first,
    float* p, float* v, long long size, unsigned grid, unsigned block), (g, lr, momentum, wd, first, p, v, size))
""",
    "dropout.cu": r"""
EMU(emu_dropout, minitorch_dropout_philox, (const float* x, const unsigned long long* state, float p,
    float scale, float* y, float* m, unsigned long long size, unsigned grid, unsigned block),
    (x, state, p, scale, y, m, size))
EMU(emu_advance, minitorch_dropout_advance, (unsigned long long* state, unsigned grid, unsigned block), (state))
""",
    "pool.cu": "".join(rf"""
EMU(emu_pool_fwd_{tag}, minitorch_maxpool_fwd<{t}>, (const float* x, float* y, unsigned char* arg,
    long long total, POOL_GEOMETRY({t}), unsigned grid, unsigned block), (x, y, arg, total, {POOL_GEOM}))
EMU(emu_pool_bwd_{tag}, minitorch_maxpool_bwd<{t}>, (const float* g, const unsigned char* arg, float* gx,
    long long total, POOL_GEOMETRY({t}), unsigned grid, unsigned block), (g, arg, gx, total, {POOL_GEOM}))
""" for tag, t in (("int", "int"), ("ll", "long long"))),
}
# Every kernel the core launches: its host entry point and its parameters' types (a dtype string
# for a pointer to that type, a NumPy scalar type for a value), as the .cu file declares them.
_GEOM32, _GEOM64 = (np.int32,) * 8, (np.int64,) * 8
HOST_SIGNATURES = {
    "minitorch_sgd_momentum": ("emu_sgd", ("float32", np.float32, np.float32, np.float32, np.int32,
                                           "float32", "float32", np.int64)),
    "minitorch_dropout_philox": ("emu_dropout", ("float32", "uint64", np.float32, np.float32, "float32",
                                                 "float32", np.uint64)),
    "minitorch_dropout_advance": ("emu_advance", ("uint64",)),
    "minitorch_maxpool_fwd<int>": ("emu_pool_fwd_int", ("float32", "float32", "uint8", np.int64) + _GEOM32),
    "minitorch_maxpool_bwd<int>": ("emu_pool_bwd_int", ("float32", "uint8", "float32", np.int64) + _GEOM32),
    "minitorch_maxpool_fwd<long long>": ("emu_pool_fwd_ll", ("float32", "float32", "uint8", np.int64) + _GEOM64),
    "minitorch_maxpool_bwd<long long>": ("emu_pool_bwd_ll", ("float32", "uint8", "float32", np.int64) + _GEOM64),
}
_CTYPES = {np.float32: ctypes.c_float, np.int32: ctypes.c_int, np.int64: ctypes.c_longlong,
           np.uint64: ctypes.c_ulonglong}


def test_every_core_kernel_has_a_host_signature():
    """HostKernel checks the launches of every kernel the host-run core sources define."""
    defined = {m for name in HOST_SOURCES
               for m in re.findall(r"__global__\s+void\s+(\w+)\s*\(", (CORE_KERNEL_DIR / name).read_text())}
    assert defined == {re.sub(r"<.*", "", name) for name in HOST_SIGNATURES}
    assert set(functional.POOL_NAME_EXPRESSIONS) <= set(HOST_SIGNATURES)


def core_host_library(tmp_path_factory, filename):
    """minitorch_fft/kernels/<filename> compiled for the host with its emu_<kernel> entry points,
    loaded; skips without g++."""
    source = HOST_SHIM.replace("KERNEL_PATH", str(CORE_KERNEL_DIR / filename)) + HOST_ENTRIES[filename]
    return host_library(tmp_path_factory, filename.replace(".", "_"), source,
                        ("-std=c++17", "-ffp-contract=off", "-Wno-unknown-pragmas"))


class HostKernel:
    """A core kernel called as CuPy's RawKernel is, run by its host build: the launch is checked
    first (a 1-D grid, one argument of the declared C type per parameter, device arrays
    C-contiguous), since a wrong type or order would be read as garbage on the GPU."""

    def __init__(self, lib, name, log):
        entry, self.signature = HOST_SIGNATURES[name]
        self.run, self.name, self.log = getattr(lib, entry), name, log

    def __call__(self, grid, block, args, shared_mem=0):
        from test_cgemm import _Device
        assert len(grid) == len(block) == 1 and grid[0] >= 1 and block[0] >= 1 and shared_mem == 0
        assert len(args) == len(self.signature), f"{self.name} takes {len(self.signature)} arguments, got {len(args)}"
        values = []
        for k, (a, want) in enumerate(zip(args, self.signature)):
            if isinstance(want, str):
                assert type(a) is _Device and a.dtype == want and a.flags.c_contiguous, \
                    f"{self.name} argument {k}: wants a contiguous device {want} array, got {type(a).__name__}"
                values.append(ctypes.c_void_p(a.ctypes.data))
            else:
                assert type(a) is want, f"{self.name} argument {k}: wants {want.__name__}, got {type(a).__name__}"
                values.append(_CTYPES[want](a))
        self.run(*values, grid[0], block[0])
        self.log.append((self.name, grid[0], block[0]))


@contextlib.contextmanager
def core_gpu_branch(lib, module):
    """Run `module`'s (functional, random or optim) GPU branch on the host: a fake CuPy whose
    arrays are NumPy arrays that answer .data.ptr (cp.empty poisons them), and `module`'s
    cuda_module compiling nothing but handing out HostKernels of `lib`. Yields the launch log,
    [(kernel, grid, block)]."""
    from minitorch_fft.backends import common, device
    from test_cgemm import _Device
    log = []
    as_device = lambda a: a.view(_Device)                                           # noqa: E731

    def empty(shape, dtype):
        return as_device(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0xFF, dtype))
    cp = types.SimpleNamespace(
        ndarray=_Device, empty=empty, empty_like=lambda a: empty(a.shape, a.dtype),
        ascontiguousarray=lambda a, dtype=None: as_device(np.ascontiguousarray(a, dtype)),
        asarray=lambda a: as_device(np.array(a)),
        cuda=types.SimpleNamespace(Device=lambda i=0: types.SimpleNamespace(        # 1 SM: grids of
            id=0, attributes={"MultiProcessorCount": 1})))                          # <= 32 blocks
    fake_module = types.SimpleNamespace(get_function=lambda name: HostKernel(lib, name, log))
    # the kernel getters (lru-cached) and launch_1d's SM count must not keep the fakes
    caches = [common.sm_count] + [f for f in vars(module).values()
                                   if hasattr(f, "cache_clear") and getattr(f, "__module__", "") == module.__name__]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", cp)
        mp.setattr(device, "_cupy", cp)
        mp.setattr(module, "cuda_module", lambda *args, **kwargs: fake_module)
        for cached in caches:
            cached.cache_clear()
        try:
            yield log
        finally:
            for cached in caches:
                cached.cache_clear()
