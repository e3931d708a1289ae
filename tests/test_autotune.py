"""The `auto` autotuner on the CPU: timing, checking against gemm, skipping, caching."""
import time

import numpy as np
import pytest

import backends
from backends import autotune, gemm, tuning

GEOM = dict(x_shape=(2, 3, 9, 9), w_shape=(4, 3, 3, 3), stride=(1, 1), padding=(1, 1))


class SlowIn:
    """gemm, but `slow_pass` sleeps: the tuner must avoid it for that pass only."""

    def __init__(self, slow_pass):
        self.slow_pass = slow_pass
        self.__name__ = f"stub_slow_{slow_pass}"

    def supports(self, *args):
        return True

    def __getattr__(self, pass_name):
        def run(*args, **kwargs):
            if pass_name == self.slow_pass:
                time.sleep(0.02)
            return getattr(gemm, pass_name)(*args, **kwargs)
        return run


class Broken:
    def __init__(self, error=None):
        self.error = error

    def supports(self, *args):
        return True

    def __getattr__(self, pass_name):
        def run(*args, **kwargs):
            if self.error:
                raise self.error
            return np.full_like(getattr(gemm, pass_name)(*args, **kwargs), 7.0)  # wrong and fast
        return run


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    """Tuning on, on the CPU, with a fresh cache file and no remembered choices."""
    monkeypatch.setenv("MINITORCH_AUTO_TUNE", "on")
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(autotune, "_memory", {})
    return tmp_path / "tune.json"


def registry(**extra):
    return dict(backends._REGISTRY, **extra)


def test_winner_is_per_pass(tuner):
    # "gemm" (also the reference: SlowIn computes with the real gemm) and "a" are slow in fprop,
    # "b" in bprop: fprop must go to b, bprop must not.
    reg = registry(gemm=SlowIn("fprop"), a=SlowIn("fprop"), b=SlowIn("bprop"))
    picks = {p: autotune.pick(reg, p, **GEOM) for p in ("fprop", "bprop")}
    assert picks["fprop"] == "b" and picks["bprop"] in ("a", "gemm")
    rows = autotune.choices()
    assert {r["pass"] for r in rows} == {"fprop", "bprop"}
    assert all(set(r["ms"]) >= {"a", "b"} for r in rows)
    assert "fprop" in autotune.format_choices()


def test_failing_and_wrong_candidates_are_skipped_with_a_reason(tuner):
    reg = registry(oom=Broken(MemoryError("out of memory (stub)")), wrong=Broken())
    assert autotune.pick(reg, "fprop", **GEOM) not in ("oom", "wrong")
    rec = autotune.choices()[0]
    assert "MemoryError" in rec["skipped"]["oom"]
    assert "disagrees with gemm" in rec["skipped"]["wrong"]


def test_choice_is_cached_on_disk_and_not_tuned_again(tuner, monkeypatch):
    reg = registry(a=SlowIn("none"))
    first = autotune.pick(reg, "accgrad", **GEOM)
    assert tuner.exists()
    monkeypatch.setattr(autotune, "_memory", {})        # a new process: memory empty...
    tuning._caches.clear()
    monkeypatch.setattr(autotune, "_tune", lambda *a: pytest.fail("tuned again despite the cache"))
    assert autotune.pick(reg, "accgrad", **GEOM) == first  # ...the disk cache answers


def test_cpu_default_is_untimed_and_deterministic(monkeypatch):
    monkeypatch.setenv("MINITORCH_AUTO_TUNE", "auto")
    monkeypatch.setattr(autotune, "_tune", lambda *a: pytest.fail("timed on the CPU"))
    assert autotune.pick(registry(), "fprop", **GEOM) == "gemm"
    assert backends.choose("auto", "bprop", **GEOM) is gemm


def test_bad_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MINITORCH_AUTO_TUNE", "sometimes")
    with pytest.raises(ValueError, match="MINITORCH_AUTO_TUNE must be auto, on or off"):
        autotune.pick(registry(a=SlowIn("none")), "fprop", **GEOM)
