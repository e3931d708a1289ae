"""Every CUDA source under backends/kernels/ and minitorch_fft/kernels/ (the core's pooling,
dropout and SGD kernels) compiles for sm_90, and its kernels live in registers: ptxas reports
no spill stores or loads (and, for the fbfft kernels, whose register arrays must be indexed by
constants only, no stack frame at all).

Templates are instantiated the project's way: each source lists every instantiation its
backend compiles inside `#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS` (CuPy instantiates by
name expression at run time instead). CuPy compiles the same sources through NVRTC,
which the last test checks too where CuPy's NVRTC bindings load (no GPU needed).
Run with -s to see the register counts. core_host_library() compiles a core kernel for the
host, where test_optim, test_graphs and test_layers run it against the NumPy path.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import minitorch_fft
from backends import fbfft_kernels
from backends.common import KERNEL_DIR
from conftest import host_library
from minitorch_fft import functional

CORE_KERNEL_DIR = Path(minitorch_fft.__file__).resolve().parent / "kernels"
CORE_SOURCES = ("pool.cu", "dropout.cu", "sgd.cu")   # what functional, random and optim load
SOURCES = sorted(KERNEL_DIR.glob("*.cu")) + sorted(CORE_KERNEL_DIR.glob("*.cu"))
MACRO = "MINITORCH_EXPLICIT_INSTANTIATIONS"
# NVRTC name expressions a backend or the core asks for (checked to resolve under NVRTC).
NAME_EXPRESSIONS = {"fbfft.cu": fbfft_kernels.NAME_EXPRESSIONS, "pool.cu": functional.POOL_NAME_EXPRESSIONS}
# Kernels that must not even have a stack frame (register arrays indexed by constants).
NO_STACK = re.compile(r"fbfft")


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
    """What CuPy's RawModule does at run time: no host headers, template name expressions."""
    nvrtc = nvrtc_or_skip()
    prog = nvrtc.createProgram(src.read_text(), src.name, [], [])
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
# of NumPy (no fused multiply-add), so the tests can ask for bit-identical results.
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
"""


def core_host_library(tmp_path_factory, filename, wrappers):
    """minitorch_fft/kernels/<filename> compiled for the host with `wrappers` (extern "C" entry
    points that call launch(grid, block, lambda)), loaded; skips without g++."""
    source = HOST_SHIM.replace("KERNEL_PATH", str(CORE_KERNEL_DIR / filename)) + wrappers
    return host_library(tmp_path_factory, filename.replace(".", "_"), source,
                        ("-std=c++17", "-ffp-contract=off", "-Wno-unknown-pragmas"))
