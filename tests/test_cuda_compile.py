"""Every CUDA source under backends/kernels/ compiles for sm_90, and its kernels live in
registers: ptxas reports no spill stores or loads (and, for the fbfft kernels, whose
register arrays must be indexed by constants only, no stack frame at all).

Templates are instantiated the project's way: each source lists every instantiation its
backend compiles inside `#ifdef MINITORCH_EXPLICIT_INSTANTIATIONS` (CuPy instantiates by
name expression at run time instead). CuPy compiles the same sources through NVRTC,
which the last test checks too where CuPy's NVRTC bindings load (no GPU needed).
Run with -s to see the register counts.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from backends import fbfft_kernels
from backends.common import KERNEL_DIR

SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
MACRO = "MINITORCH_EXPLICIT_INSTANTIATIONS"
# NVRTC name expressions a backend asks for (checked to resolve under NVRTC).
NAME_EXPRESSIONS = {"fbfft.cu": fbfft_kernels.NAME_EXPRESSIONS}
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
    want = len(NAME_EXPRESSIONS.get(src.name, ()))
    assert sum(1 for k in report if NO_STACK.search(k)) >= want, "an instantiation was not compiled"
    bad = []
    for name, r in sorted(report.items()):
        print(f"{src.name}: {name}: {r.get('registers')} registers, stack {r['stack']} B, "
              f"spills {r['spill_stores']}/{r['spill_loads']} B")
        if r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{name} spills {r['spill_stores']}/{r['spill_loads']} B (stores/loads)")
        elif NO_STACK.search(name) and r["stack"]:
            bad.append(f"{name} has a {r['stack']} B stack frame (dynamically indexed registers?)")
    assert not bad, f"{src.name}: kernels meant to live in registers do not:\n" + "\n".join(bad)


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
