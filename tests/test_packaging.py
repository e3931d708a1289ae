"""The package as pip builds it: a wheel with the CUDA sources, the bundled digits, the license
and the version; and a runtime that needs neither scikit-learn nor SciPy."""
import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import minitorch_fft

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("minitorch_fft",)
# Run in a subprocess: importing sklearn or scipy fails, so any use of them shows.
WITHOUT_SKLEARN = "import sys; sys.modules['sklearn'] = None; sys.modules['scipy'] = None; "


def _setuptools_version():
    try:
        import setuptools
    except ImportError:
        return None
    return tuple(int(p) for p in re.findall(r"\d+", setuptools.__version__)[:2])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel, built offline from a copy of the sources (so no build/ or egg-info lands in the
    tree) with the build backend of this environment (the test extra installs it)."""
    version = _setuptools_version()
    if version is None or version < (77, 0):
        pytest.skip(f"building the wheel needs setuptools>=77 installed (found {version}); "
                    "pip install -e '.[test]' installs it")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "--no-index", "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (path,) = out.glob("minitorch_fft-*.whl")
    return path


def _metadata(zf):
    (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(zf.read(name))


def test_the_wheel_holds_the_cuda_sources_the_digits_and_the_license(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = _metadata(zf)
    sources = {p.relative_to(ROOT).as_posix() for package in PACKAGES
               for p in (ROOT / package).rglob("*.cu*") if p.suffix in (".cu", ".cuh")}
    assert sources and sources <= names, f"missing from the wheel: {sorted(sources - names)}"
    assert "minitorch_fft/digits.npz" in names
    # One top-level package: nothing named `backends` or `models` lands in site-packages beside
    # (or over) a user's own or another distribution's.
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"minitorch_fft"}
    assert "minitorch_fft/cli.py" in names and "minitorch_fft/__main__.py" in names
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert meta["Version"] == minitorch_fft.__version__
    runtime = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert not [r for r in runtime if re.match(r"(scikit-learn|scipy)\b", r)], runtime


def test_the_installed_wheel_trains_from_its_own_files(wheel, tmp_path):
    """Installed (without dependencies, into a folder of its own) and run away from the source
    tree: the digits load from the package, and the command line answers --help."""
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                          "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (WITHOUT_SKLEARN + "import minitorch_fft as mt; train, test = mt.data.digits(); "
            "print(mt.__file__, len(train), len(test))")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    where, n_train, n_test = res.stdout.split()
    assert where.startswith(str(site)) and (int(n_train), int(n_test)) == (1437, 360)
    res = subprocess.run([sys.executable, "-m", "minitorch_fft", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--max-epochs-this-run" in res.stdout, res.stderr


def test_the_runtime_needs_neither_sklearn_nor_scipy():
    code = (WITHOUT_SKLEARN + "import minitorch_fft as mt, minitorch_fft.backends, minitorch_fft.models, minitorch_fft.cli; "
            "train, test = mt.data.digits(seed=3); print(len(train), len(test))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["1437", "360"]
    assert (ROOT / "minitorch_fft" / "digits.npz").stat().st_size < 100_000


def test_the_version_is_read_without_importing_the_package():
    """pyproject takes the version from minitorch_fft.__version__; setuptools reads the literal
    from the source (no import, so a build needs none of the dependencies)."""
    project = (ROOT / "pyproject.toml").read_text().split("\n[project]\n")[1].split("\n[")[0]
    assert 'dynamic = ["version"]' in project and not re.search(r"^version\s*=", project, re.M)
    if _setuptools_version() is None:
        pytest.skip("needs setuptools")
    code = ("import sys; sys.modules['numpy'] = None; from setuptools.config.expand import read_attr; "
            "print(read_attr('minitorch_fft.__version__', root_dir='.'))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == minitorch_fft.__version__
