"""backends.config: every setting declared once, checked with a message that names it, read in
one place; and minitorch_fft.backends as the ground floor that imports nothing of the framework."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minitorch_fft import backends

from minitorch_fft.backends import config

ROOT = Path(__file__).resolve().parent.parent


def test_every_variable_is_declared_once_with_its_doc():
    envs = [s.env for s in config.SETTINGS.values()]
    assert len(envs) == len(set(envs))
    for s in config.SETTINGS.values():
        assert (s.env.startswith("MINITORCH_") or s.env in config.LAUNCHER_ENV) and s.doc and s.kind in config._ALLOWED


@pytest.mark.parametrize("name, raw, value", [
    ("tf32", "1", True), ("tf32", "0", False), ("gemm_workspace_mb", "64", 64.0),
    ("gemm_workspace_mb", "0.5", 0.5), ("auto_margin", "0", 0.0), ("auto_margin", "0.1", 0.1),
    ("cufft_tune", "off", "off"), ("tune_cache", "~/x.json", "~/x.json"),
    ("auto_backends", "ours", ("ours",)), ("auto_backends", " gemm, fbfft,gemm", ("gemm", "fbfft")),
    ("world_size", "4", 4), ("rank", "0", 0), ("master_addr", "127.0.0.1", "127.0.0.1"),
])
def test_the_environment_sets_a_value(monkeypatch, name, raw, value):
    monkeypatch.setenv(config.SETTINGS[name].env, raw)
    assert config.get(name) == value


@pytest.mark.parametrize("name, raw", [
    ("gemm_workspace_mb", "abc"), ("gemm_workspace_mb", "inf"), ("gemm_workspace_mb", "0"),
    ("gemm_workspace_mb", "-5"), ("gemm_workspace_mb", "nan"), ("cufft_workspace_mb", "1e400"),
    ("auto_margin", "1"), ("auto_margin", "-0.01"), ("auto_margin", "3%"),
    ("tf32", "yes"), ("tf32", "true"), ("direct_tune", "of"), ("auto_tune", "sometimes"),
    ("tune_cache", " "), ("world_size", "-1"), ("world_size", "0"), ("rank", "1.5"), ("master_port", "x"),
    ("master_port", "0"), ("auto_backends", ""), ("auto_backends", "gemm,,fbfft"), ("auto_backends", "GEMM"),
])
def test_a_bad_value_names_the_variable_and_the_limit(monkeypatch, name, raw):
    s = config.SETTINGS[name]
    monkeypatch.setenv(s.env, raw)
    with pytest.raises(config.ConfigError, match=re.escape(f"{s.env}={raw!r} is not allowed: it takes "
                                                           f"{config._ALLOWED[s.kind]}")):
        config.get(name)
    with pytest.raises(ValueError):     # a ConfigError is a ValueError: callers catch it as such
        config.check()


def test_defaults_without_the_environment(monkeypatch):
    for s in config.SETTINGS.values():
        monkeypatch.delenv(s.env, raising=False)
    assert {n: config.get(n) for n in config.SETTINGS} == {n: s.default for n, s in config.SETTINGS.items()}
    assert config.mib_bytes("gemm_workspace_mb") == 512 * 2**20


def test_override_nests_restores_and_beats_the_environment(monkeypatch):
    monkeypatch.setenv("MINITORCH_GEMM_WORKSPACE_MB", "8")
    with config.override(gemm_workspace_mb=64):
        assert config.get("gemm_workspace_mb") == 64.0
        with pytest.raises(RuntimeError):
            with config.override(gemm_workspace_mb=2):
                assert config.get("gemm_workspace_mb") == 2.0
                raise RuntimeError
        assert config.get("gemm_workspace_mb") == 64.0
        with config.override(gemm_workspace_mb=config.ENVIRONMENT):
            assert config.get("gemm_workspace_mb") == 8.0
    assert config.get("gemm_workspace_mb") == 8.0


@pytest.mark.parametrize("values", [dict(gemm_workspace_mb=0), dict(gemm_workspace_mb=float("inf")),
                                    dict(tf32=2), dict(tf32="1"), dict(cufft_tune="of"), dict(auto_margin=1.0),
                                    dict(gemm_workspace_mb=True)])
def test_a_bad_override_is_refused_before_the_block(values):
    with pytest.raises(config.ConfigError, match="takes"):
        with config.override(**values):
            pytest.fail("the block ran")


def test_an_on_off_setting_takes_0_and_1_as_its_variable_does():
    """The README's table gives 0 or 1 for them: tf32=1 in code is tf32=True (the message said 'takes 0
    or 1, got 1')."""
    with config.override(tf32=1, winograd_f4=0):
        assert config.get("tf32") is True and config.get("winograd_f4") is False
        state = config.state()
    with config.override(tf32=True, winograd_f4=False):
        assert config.state() == state                 # the same settings, the same decisions cached


def test_an_unknown_setting_is_refused():
    with pytest.raises(KeyError, match="unknown setting 'gemm_workspace'"):
        config.get("gemm_workspace")
    with pytest.raises(KeyError, match="unknown setting"):
        with config.override(nonsense=1):
            pass


def test_set_stays_below_override_blocks(monkeypatch):
    monkeypatch.delenv("MINITORCH_CGEMM_TF32", raising=False)
    try:
        config.set("tf32", True)
        assert config.get("tf32") is True
        with config.override(tf32=False):
            assert config.get("tf32") is False
        assert config.get("tf32") is True
    finally:
        config.set("tf32", None)
    assert config.get("tf32") is False


def test_snapshot_follows_the_settings_that_change_a_pass():
    before = config.snapshot()
    with config.override(fbfft_workspace_mb=16):
        assert config.snapshot() != before
    with config.override(tune_cache="/elsewhere.json"):    # where choices live changes no pass
        assert config.snapshot() == before


def test_the_readme_table_is_the_settings_table():
    """README.md's Settings table is what `python -m minitorch_fft.backends` prints, row for row."""
    readme = (ROOT / "README.md").read_text()
    for s in config.SETTINGS.values():
        assert f"`{s.env}`" in config.table()
    assert config.table() in readme, "README.md's Settings table differs from config.table()"


@pytest.mark.parametrize("args, env, rc, said", [
    ([], {}, 0, "| `MINITORCH_CGEMM_TF32` |"),
    ([], {"MINITORCH_CGEMM_TF32": "7"}, 2, "MINITORCH_CGEMM_TF32='7' is not allowed"),
    (["--bogus"], {}, 2, "unrecognized arguments: --bogus"),
])
def test_python_m_backends_prints_the_table_or_says_what_is_wrong(args, env, rc, said):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MINITORCH_")}
    res = subprocess.run([sys.executable, "-m", "minitorch_fft.backends", *args], cwd=ROOT, capture_output=True,
                         text=True, env={**clean, **env}, timeout=60)
    assert res.returncode == rc, res.stderr
    assert said in (res.stdout if rc == 0 else res.stderr) and "Traceback" not in res.stderr
    assert res.stdout.strip() == (config.table() if rc == 0 else "")


def test_a_bad_value_never_breaks_the_import():
    env = {"MINITORCH_GEMM_WORKSPACE_MB": "abc", "MINITORCH_CGEMM_TF32": "yes", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", "import minitorch_fft as mt; mt.backends.names(), mt.models.get"], cwd=ROOT,
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_backends_import_nothing_of_the_framework():
    """minitorch_fft.backends is the ground floor: it imports nothing of the framework above it.
    The package's own __init__ (which loads the framework) is kept out with an empty parent module,
    so any other minitorch_fft module that backends pulled in would show in sys.modules."""
    code = ("import sys, types; pkg = types.ModuleType('minitorch_fft'); "
            f"pkg.__path__ = [{str(ROOT / 'minitorch_fft')!r}]; sys.modules['minitorch_fft'] = pkg; "
            "import minitorch_fft.backends; "
            "print(sorted(m for m in sys.modules if m.startswith('minitorch_fft.') "
            "and not m.startswith('minitorch_fft.backends')))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    for path in (ROOT / "minitorch_fft" / "backends").rglob("*.py"):
        source = path.read_text()
        assert not re.search(r"^\s*from \.\.", source, re.M), path
        for line in re.findall(r"^\s*(?:from|import) minitorch_fft\S*", source, re.M):
            assert line.split()[-1].startswith("minitorch_fft.backends"), (path, line)


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for folder in ("minitorch_fft", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "config.py" and re.search(r"os\.environ|os\.getenv|getenv\(", path.read_text()):
                readers.append(str(path.relative_to(ROOT)))
    for path in [ROOT / "train.py"]:
        if re.search(r"os\.environ|getenv\(", path.read_text()):
            readers.append(path.name)
    assert readers == []


@pytest.mark.parametrize("variable, value, message", [
    ("MINITORCH_FBFFT_WORKSPACE_MB", "-1", "MINITORCH_FBFFT_WORKSPACE_MB='-1' is not allowed: it takes MiB > 0 "
     "(fbfft's frequency-domain buffers; larger batches run in chunks)"),
    ("MINITORCH_AUTO_BACKENDS", "gemm,nope", "MINITORCH_AUTO_BACKENDS names ['nope'], which are not registered "
     f"backends; registered: {backends.names()} (or 'ours' for all but ['cudnn'])"),
])
def test_train_exits_2_with_one_line_on_a_bad_setting(variable, value, message):
    res = subprocess.run([sys.executable, "train.py", "--epochs", "1"], cwd=ROOT,
                         env={variable: value, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"train.py: error: {message}"]


def test_the_environment_is_read_once_until_reload(monkeypatch):
    monkeypatch.delenv("MINITORCH_GEMM_WORKSPACE_MB", raising=False)
    default = config.SETTINGS["gemm_workspace_mb"].default
    assert config.get("gemm_workspace_mb") == default
    import os
    os.environ["MINITORCH_GEMM_WORKSPACE_MB"] = "32"     # behind config's back: not seen...
    try:
        assert config.get("gemm_workspace_mb") == default
        config.reload()                                   # ...until reload()
        assert config.get("gemm_workspace_mb") == 32.0
    finally:
        del os.environ["MINITORCH_GEMM_WORKSPACE_MB"]
        config.reload()
