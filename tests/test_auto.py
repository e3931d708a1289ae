"""The `auto` autotuner on the CPU: timing, checking against gemm, skipping, caching."""
import contextlib
import time
import types

import numpy as np
import pytest

from minitorch_fft import backends
from minitorch_fft.backends import auto, config, gemm, tuning

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
    monkeypatch.setattr(auto, "_memory", {})
    monkeypatch.setattr(auto, "_routes", {})
    monkeypatch.setattr(auto, "_route_records", {})
    return tmp_path / "tune.json"


def registry(**extra):
    return dict(backends._REGISTRY, **extra)


def test_winner_is_per_pass(tuner):
    # "gemm" (also the reference: SlowIn computes with the real gemm) and "a" are slow in fprop,
    # "b" in bprop: fprop must go to b, bprop must not.
    # Only the stubs compete: a real backend (fbfft's NumPy model, say) could tie with them in
    # bprop and win on the tie order, which is not what this test is about.
    reg = {"gemm": SlowIn("fprop"), "a": SlowIn("fprop"), "b": SlowIn("bprop")}
    picks = {p: auto.pick(reg, p, **GEOM) for p in ("fprop", "bprop")}
    assert picks["fprop"] == "b" and picks["bprop"] in ("a", "gemm")
    rows = auto.choices()
    assert {r["pass"] for r in rows} == {"fprop", "bprop"}
    assert all(set(r["ms"]) >= {"a", "b"} for r in rows)
    assert "fprop" in auto.format_choices()


def test_failing_and_wrong_candidates_are_skipped_with_a_reason(tuner):
    reg = registry(oom=Broken(MemoryError("out of memory (stub)")), wrong=Broken())
    assert auto.pick(reg, "fprop", **GEOM) not in ("oom", "wrong")
    rec = auto.choices()[0]
    assert "MemoryError" in rec["skipped"]["oom"]
    assert "disagrees with gemm" in rec["skipped"]["wrong"]


def test_choice_is_cached_on_disk_and_not_tuned_again(tuner, monkeypatch):
    reg = registry(a=SlowIn("none"))
    first = auto.pick(reg, "accgrad", **GEOM)
    assert tuner.exists()
    monkeypatch.setattr(auto, "_memory", {})        # a new process: memory empty...
    tuning._caches.clear()
    monkeypatch.setattr(auto, "_tune", lambda *a: pytest.fail("tuned again despite the cache"))
    assert auto.pick(reg, "accgrad", **GEOM) == first  # ...the disk cache answers


def test_a_cached_choice_is_tuned_again_when_a_new_candidate_joins(tuner, monkeypatch):
    """A choice on disk made among gemm and `a` does not stand once `b` is registered (a new
    backend, or cuDNN installed since): the new process times all three and caches that."""
    reg = {"gemm": SlowIn("accgrad"), "a": SlowIn("accgrad")}
    auto.pick(reg, "accgrad", **GEOM)
    monkeypatch.setattr(auto, "_memory", {})        # a new process, one more backend
    tuning._caches.clear()
    reg["b"] = SlowIn("none")
    assert auto.pick(reg, "accgrad", **GEOM) == "b"
    monkeypatch.setattr(auto, "_memory", {})        # and the record on disk now covers all three
    tuning._caches.clear()
    monkeypatch.setattr(auto, "_tune", lambda *a: pytest.fail("tuned again despite a complete record"))
    assert auto.pick(reg, "accgrad", **GEOM) == "b"
    assert set(auto.choices()[0]["ms"]) == {"gemm", "a", "b"}


def test_a_cached_choice_is_tuned_again_when_a_candidates_revision_changes(tuner, monkeypatch):
    """A choice on disk made while gemm was at revision 0 for this geometry does not stand once
    gemm says 1 (its code for the geometry changed speed): tuned again, the revision recorded, and
    that record then stands."""
    reg = {"gemm": SlowIn("accgrad"), "a": SlowIn("none")}
    assert auto.pick(reg, "accgrad", **GEOM) == "a"
    assert "revisions" not in next(iter(auto._memory.values()))
    monkeypatch.setattr(auto, "_memory", {})        # a new process, gemm revised: now the fastest
    tuning._caches.clear()
    reg["gemm"] = SlowIn("none")
    reg["gemm"].revision = lambda pass_name, x_shape, w_shape, stride, padding, math: 1
    reg["a"] = SlowIn("accgrad")
    assert auto.pick(reg, "accgrad", **GEOM) == "gemm"
    assert next(iter(auto._memory.values()))["revisions"] == {"gemm": 1}
    monkeypatch.setattr(auto, "_memory", {})
    tuning._caches.clear()
    monkeypatch.setattr(auto, "_tune", lambda *a: pytest.fail("tuned again despite a current record"))
    assert auto.pick(reg, "accgrad", **GEOM) == "gemm"


def test_gpu_candidates_are_timed_in_bursts_and_single_call_records_are_tuned_again(tuner, monkeypatch):
    """On the GPU auto times each span as INNER back-to-back calls (a step queues its passes, so a
    candidate's host time between launches hides behind the GPU), and records it; a record timed
    otherwise (before session 65: single calls, no "inner") is tuned again, and one in today's bursts
    stands. The CPU times single calls (nothing queues there)."""
    seen = []
    real = tuning.timeit

    def spy(fn, xp, warmup=1, repeat=5, inner=1):
        seen.append(inner)
        return real(fn, xp, warmup=warmup, repeat=repeat, inner=inner)
    monkeypatch.setattr(tuning, "timeit", spy)
    reg = {"gemm": SlowIn("accgrad"), "a": SlowIn("none")}
    assert auto._inner(np) == 1 and auto.INNER > 1
    assert auto.pick(reg, "accgrad", **GEOM) == "a"
    assert seen and set(seen) == {1} and "inner" not in next(iter(auto._memory.values()))

    def new_process():
        monkeypatch.setattr(auto, "_memory", {})
        monkeypatch.setattr(tuning, "_memo", {})
        tuning._caches.clear()
        seen.clear()
    new_process()
    monkeypatch.setattr(auto, "_inner", lambda xp: auto.INNER)   # as on the GPU
    assert auto.pick(reg, "accgrad", **GEOM) == "a"              # the single-call record: tuned again
    assert seen and set(seen) == {auto.INNER}
    key = next(iter(auto._memory))
    assert tuning.default_cache().get(key)["inner"] == auto.INNER
    new_process()
    monkeypatch.setattr(auto, "_tune", lambda *a: pytest.fail("tuned again despite a record in today's bursts"))
    assert auto.pick(reg, "accgrad", **GEOM) == "a" and seen == []


def test_a_route_record_timed_in_other_bursts_is_timed_again(tuner, monkeypatch):
    """Channels-last route records carry the bursts they were timed in, as auto's NCHW records do."""
    pointwise = dict(x_shape=(2, 6, 5, 7), w_shape=(4, 6, 1, 1), stride=(1, 1), padding=(0, 0))
    run = nchw_stand_in(0.01)
    assert auto.nhwc_route({"gemm": gemm}, run, "fprop", **pointwise, xp=np) == "gemm"
    key = next(iter(auto._route_records))
    assert "inner" not in tuning.default_cache().get(key)
    for name in ("_routes", "_route_records"):
        monkeypatch.setattr(auto, name, {})
    monkeypatch.setattr(tuning, "_memo", {})
    monkeypatch.setattr(auto, "_inner", lambda xp: auto.INNER)
    calls = len(run.calls)
    assert auto.nhwc_route({"gemm": gemm}, run, "fprop", **pointwise, xp=np) == "gemm"
    assert len(run.calls) > calls and tuning.default_cache().get(key)["inner"] == auto.INNER
    for name in ("_routes", "_route_records"):                     # a record in today's bursts stands
        monkeypatch.setattr(auto, name, {})
    monkeypatch.setattr(tuning, "_memo", {})
    calls = len(run.calls)
    assert auto.nhwc_route({"gemm": gemm}, run, "fprop", **pointwise, xp=np) == "gemm" and len(run.calls) == calls


def test_a_hand_edited_record_with_bad_revisions_is_tuned_again(tuner, monkeypatch):
    """"revisions" that is not a mapping (an edited file) makes the record stale, tuned again, where it
    had raised AttributeError."""
    import json
    reg = {"gemm": SlowIn("accgrad"), "a": SlowIn("none")}
    reg["gemm"].revision = lambda pass_name, x_shape, w_shape, stride, padding, math: 1
    assert auto.pick(reg, "accgrad", **GEOM) == "a"
    data = json.loads(tuner.read_text())
    for records in data["devices"].values():
        for record in records.values():
            record["revisions"] = [1, 2]
    tuner.write_text(json.dumps(data))
    monkeypatch.setattr(auto, "_memory", {})
    monkeypatch.setattr(auto, "_fast", {})
    tuning._caches.clear()
    tuning._memo.clear()
    tuned = []
    tune = auto._tune
    monkeypatch.setattr(auto, "_tune", lambda *a, **k: tuned.append(1) or tune(*a, **k))
    assert auto.pick(reg, "accgrad", **GEOM) == "a" and tuned == [1]


def test_gemm_revision_marks_what_changed():
    for p in ("fprop", "bprop", "accgrad"):                     # 1x1 accGrad 3: summed by sum_rows
        assert gemm.revision(p, (2, 8, 5, 5), (4, 8, 1, 1), (1, 1), (0, 0)) == (3 if p == "accgrad" else 2)
        # strided: fprop 3 and bprop 5 since the fused forms (kernels/pointwise.cu) joined them, 4 and 6
        # since auto times their prepared launch
        assert gemm.revision(p, (2, 8, 5, 5), (4, 8, 1, 1), (2, 2), (0, 0)) == {"fprop": 4, "bprop": 6}.get(p, 3)
    # accGrad 1: per-image products, 2: the implicit form, 3: im2col's grid (fprop, bprop: 1), 4, 5: accgrad_small,
    # 6: implicit8, 7-9: the rows form, 10: per-image partials summed by sum_rows
    assert gemm.revision("accgrad", (2, 8, 5, 5), (4, 8, 3, 3), (1, 1), (1, 1)) == 10
    assert gemm.revision("fprop", (2, 8, 5, 5), (4, 8, 3, 3), (1, 1), (1, 1)) == 1
    assert gemm.revision("bprop", (2, 8, 5, 5), (4, 8, 1, 1), (1, 1), (1, 1)) == 1   # padded 1x1: im2col


def test_the_candidate_set_restricts_auto_and_keys_its_choices_apart(tuner, monkeypatch, settings):
    # "cudnn" stands in for the vendor backend: the fastest, so it wins wherever it may compete.
    reg = {"gemm": SlowIn("fprop"), "slow": SlowIn("fprop"), "cudnn": SlowIn("none")}
    monkeypatch.setattr(backends, "_REGISTRY", reg)
    assert backends.choose("auto", "fprop", **GEOM) is reg["cudnn"]
    settings(auto_backends="ours")
    assert backends.choose("auto", "fprop", **GEOM) in (reg["gemm"], reg["slow"])
    settings(auto_backends=("slow",))
    assert backends.choose("auto", "fprop", **GEOM) is reg["slow"]
    assert {k[5] for k in auto._memory} == {"auto", "auto[ours]", "auto[slow]"}  # none stands for another
    settings(auto_backends="gemm,nothing")
    with pytest.raises(ValueError, match=r"MINITORCH_AUTO_BACKENDS names \['nothing'\], which are not registered"):
        backends.choose("auto", "fprop", **GEOM)
    reg["none"] = SlowIn("fprop")
    reg["none"].supports = lambda *args: False
    settings(auto_backends=("none",))                   # the message names the setting that left no candidate
    with pytest.raises(ValueError, match=r"among \['none'\], the candidates the auto_backends setting "
                                         r"\(MINITORCH_AUTO_BACKENDS\) leaves"):
        backends.choose("auto", "fprop", **GEOM)


def test_cpu_default_is_untimed_and_deterministic(monkeypatch):
    monkeypatch.setenv("MINITORCH_AUTO_TUNE", "auto")
    monkeypatch.setattr(auto, "_tune", lambda *a: pytest.fail("timed on the CPU"))
    assert auto.pick(registry(), "fprop", **GEOM) == "gemm"
    assert backends.choose("auto", "bprop", **GEOM) is gemm


def test_bad_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MINITORCH_AUTO_TUNE", "sometimes")
    with pytest.raises(ValueError, match="MINITORCH_AUTO_TUNE='sometimes' is not allowed: it takes auto, on or off"):
        auto.pick(registry(a=SlowIn("none")), "fprop", **GEOM)


# -- the selection rule: repeated rounds, a tie margin, a layer's passes kept together ----------

class Timed:
    """gemm's results (times 1 + error), with fake times per pass for fake_clock to report: a
    number, or a list with one entry per timing round."""

    def __init__(self, name, error=0.0, **ms):
        self.name, self.error, self.ms, self.__name__ = name, error, ms, f"stub_{name}"

    def supports(self, *args):
        return True

    def __getattr__(self, pass_name):
        if pass_name not in backends.PASSES:
            raise AttributeError(pass_name)

        def run(*args, **kwargs):
            self.calls.append((self, pass_name))
            out = getattr(gemm, pass_name)(*args, **kwargs)
            return out * np.float32(1 + self.error)
        return run


@pytest.fixture
def fake_clock(tuner, monkeypatch):
    """tuning.timeit runs fn once and reports the fake time of the stub that ran; returns the
    (stub name, pass) of every timed call, in order."""
    calls, timed = [], []
    monkeypatch.setattr(Timed, "calls", calls, raising=False)

    def timeit(fn, xp, warmup, repeat):
        fn()
        stub, pass_name = calls[-1]
        timed.append((stub.name, pass_name))
        ms = stub.ms[pass_name]
        return ms.pop(0) if isinstance(ms, list) else ms

    monkeypatch.setattr(tuning, "timeit", timeit)
    return timed


def stubs(*timed):
    return {t.name: t for t in timed}


def test_select_takes_the_fastest_outside_the_margin():
    assert auto.select({"gemm": 1.0, "cufft": 1.1}, {}, 0.03) == ("gemm", "fastest")
    assert auto.select({"gemm": 1.0, "cufft": 1.02}, {}, 0.0) == ("gemm", "fastest")


def test_select_breaks_a_tie_by_the_layer_then_the_tie_order():
    winner, why = auto.select({"gemm": 1.0, "cufft": 1.02}, {}, 0.03)
    assert winner == "cufft" and "tie order" in why and "2.0% slower than gemm" in why
    winner, why = auto.select({"cufft": 1.0, "fbfft": 1.02}, {"fprop": "fbfft"}, 0.03)
    assert winner == "fbfft" and "the layer's fprop backend" in why
    # most of the other passes win; a sibling's backend outside the margin does not
    assert auto.select({"cufft": 1.0, "fbfft": 1.01},
                           {"fprop": "cufft", "bprop": "fbfft", "accgrad": "fbfft"}, 0.03)[0] == "fbfft"
    assert auto.select({"gemm": 1.0, "fbfft": 1.2}, {"fprop": "fbfft"}, 0.03)[0] == "gemm"
    # backends outside TIE_ORDER (those that share no spectra) come last, then by time: a tie
    # between gemm and cudnn goes to the faster, and a sibling outside TIE_ORDER has no vote
    assert auto.select({"mine": 1.0, "gemm": 1.01, "fbfft": 1.02}, {}, 0.03)[0] == "fbfft"
    assert auto.select({"mine": 1.01, "other": 1.0}, {}, 0.03)[0] == "other"
    assert auto.select({"gemm": 1.02, "cudnn": 1.0}, {}, 0.03) == ("cudnn", "fastest")
    assert auto.select({"gemm": 1.02, "cudnn": 1.0}, {"fprop": "gemm", "bprop": "gemm"}, 0.03)[0] == "cudnn"


def test_margin_from_the_environment(monkeypatch):
    assert auto.margin() == auto.MARGIN == 0.03
    monkeypatch.setenv("MINITORCH_AUTO_MARGIN", "0.1")
    assert auto.margin() == 0.1
    for bad in ("3%", "-0.01", "1", "nan"):
        monkeypatch.setenv("MINITORCH_AUTO_MARGIN", bad)
        with pytest.raises(ValueError, match=f"MINITORCH_AUTO_MARGIN='{bad}' is not allowed: it takes 0 <= x < 1"):
            auto.margin()


def test_rounds_are_interleaved_and_their_median_decides(fake_clock):
    # cufft has one bad round (a clock hiccup): one round of timing would have picked gemm.
    reg = stubs(Timed("gemm", fprop=[1.2, 1.2, 1.2]), Timed("cufft", fprop=[5.0, 1.0, 1.0]))
    assert auto.ROUNDS == 3
    assert auto.pick(reg, "fprop", **GEOM) == "cufft"
    assert fake_clock == [("gemm", "fprop"), ("cufft", "fprop")] * 3
    assert auto.choices()[0]["ms"] == {"gemm": 1.2, "cufft": 1.0}


def test_a_layers_passes_stay_on_one_backend_within_the_margin(fake_clock):
    reg = stubs(Timed("gemm", fprop=2.0, bprop=2.0, accgrad=1.00),
                Timed("cufft", fprop=1.5, bprop=1.00, accgrad=1.01),
                Timed("fbfft", fprop=1.0, bprop=1.02, accgrad=1.05))
    picks = {p: auto.pick(reg, p, **GEOM) for p in backends.PASSES}
    # fprop: fbfft is fastest by far. bprop: fbfft is 2% behind cufft, so the layer's fprop
    # backend wins. accGrad: fbfft is 5% behind, outside the margin; gemm and cufft tie (1%),
    # and cufft comes first in the tie order.
    assert picks == {"fprop": "fbfft", "bprop": "fbfft", "accgrad": "cufft"}
    why = {r["pass"]: r["why"] for r in auto.choices()}
    assert why["fprop"] == "fastest" and "the layer's fprop backend" in why["bprop"]
    assert "tie order" in why["accgrad"]
    assert "within the 3.0% margin" in auto.format_choices()


def test_zero_margin_lets_the_fastest_win(fake_clock, monkeypatch):
    monkeypatch.setenv("MINITORCH_AUTO_MARGIN", "0")
    reg = stubs(Timed("gemm", bprop=1.0), Timed("cufft", bprop=1.001))
    assert auto.pick(reg, "bprop", **GEOM) == "gemm"


def test_tf32_choices_are_tuned_and_checked_apart_from_fp32(fake_clock, monkeypatch):
    """With the complex GEMM on TF32 (faked: the CPU never runs it) the tuner keys its choice
    apart and accepts a TF32-sized error; back in fp32 the same candidate is rejected."""
    mode = {"now": "tf32"}
    monkeypatch.setattr(backends.cgemm, "mode", lambda xp: mode["now"])
    reg = stubs(Timed("gemm", fprop=2.0), Timed("cufft", error=1e-3, fprop=1.0))
    assert auto.pick(reg, "fprop", **GEOM) == "cufft"
    mode["now"] = "fp32"
    assert auto.pick(reg, "fprop", **GEOM) == "gemm"          # tuned again, not reused
    rows = {r["math"]: r for r in auto.choices()}
    assert rows["tf32"]["backend"] == "cufft" and "cufft" not in rows["fp32"]["ms"]
    assert "disagrees with gemm" in rows["fp32"]["skipped"]["cufft"]
    mode["now"] = "tf32"
    monkeypatch.setattr(auto, "_tune", lambda *a: pytest.fail("the TF32 choice was tuned again"))
    assert auto.pick(reg, "fprop", **GEOM) == "cufft"


@pytest.mark.parametrize("record", ["gemm", {"choice": "gemm"}, {"choice": 3, "ms": {}, "skipped": {}, "why": ""},
                                    {"choice": "gemm", "ms": {"gemm": "fast"}, "skipped": {}, "why": ""},
                                    {"backend": "gemm", "ms": {}, "skipped": {}}])   # version 2's format
def test_a_malformed_cached_record_is_ignored_with_a_warning_and_retuned(tuner, record):
    reg = {"gemm": SlowIn("none"), "a": SlowIn("fprop")}
    geom = auto._geometry_key(GEOM["x_shape"], GEOM["w_shape"], GEOM["stride"], GEOM["padding"])
    tuning.default_cache().put(tuning.key(np, np.float32, geom, "fprop", "auto"), record)
    with pytest.warns(UserWarning, match="invalid cached tuning record .*; tuning again"):
        assert auto.pick(reg, "fprop", **GEOM) == "gemm"             # "a" sleeps in fprop
    assert set(auto.choices()[0]["ms"]) == {"gemm", "a"}             # timed again
    assert "fprop" in auto.format_choices()                          # the table still prints


def test_a_cached_choice_of_a_backend_missing_here_says_so_and_is_retuned(tuner):
    """A cache tuned where cuDNN's frontend was installed, read where it is not: the warning says
    why the record is set aside (session 39 read "invalid" and looked for a corrupt file)."""
    reg = {"gemm": SlowIn("none"), "a": SlowIn("fprop")}
    geom = auto._geometry_key(GEOM["x_shape"], GEOM["w_shape"], GEOM["stride"], GEOM["padding"])
    tuning.default_cache().put(tuning.key(np, np.float32, geom, "fprop", "auto"),
                               {"choice": "cudnn", "ms": {"cudnn": 0.1, "gemm": 0.2}, "skipped": {}, "why": ""})
    with pytest.warns(UserWarning, match="its choice is not among this process's candidates .*backend not "
                                         "installed here"):
        assert auto.pick(reg, "fprop", **GEOM) == "gemm"
    tuning.default_cache().put(tuning.key(np, np.float32, geom, "bprop", "auto"), "gemm")   # not a record
    with pytest.warns(UserWarning, match="invalid cached tuning record 'gemm' .*: not a tuning record"):
        assert auto.pick(reg, "bprop", **GEOM) in reg


def test_a_remembered_choice_skips_the_tuning_key(tuner, monkeypatch):
    """After a layer's first call, choose() answers from the arguments as given (one lookup);
    a reset of the tuner's memory (a new process, in tests) sends it back to pick()."""
    reg = {"gemm": SlowIn("fprop"), "b": SlowIn("bprop")}
    assert auto.remembered(reg, "fprop", **GEOM) is None
    first = auto.pick(reg, "fprop", **GEOM)
    assert auto.remembered(reg, "fprop", **GEOM) == first
    assert auto.remembered(reg, "bprop", **GEOM) is None          # per pass
    assert auto.remembered({"gemm": reg["gemm"]}, "fprop", **GEOM) == (first if first == "gemm" else None)
    # Equal as dict keys, but not sizes geometry() accepts: never answered from memory.
    for odd in (dict(GEOM, x_shape=(2.0, 3, 9, 9)), dict(GEOM, stride=(True, True)),
                dict(GEOM, padding=(np.int64(1), 1)), dict(GEOM, x_shape=[2, 3, 9, 9])):
        assert auto.remembered(reg, "fprop", **odd) is None
    monkeypatch.setattr(auto, "_memory", {})
    assert auto.remembered(reg, "fprop", **GEOM) is None


def test_choose_takes_the_remembered_path_after_the_first_call(tuner, monkeypatch):
    x_shape, w_shape = (2, 3, 8, 8), (4, 3, 3, 3)
    first = backends.choose("auto", "fprop", x_shape, w_shape, (1, 1), (1, 1))
    monkeypatch.setattr(auto, "pick", lambda *a, **k: pytest.fail("pick() ran again"))
    assert backends.choose("auto", "fprop", x_shape, w_shape, (1, 1), (1, 1)) is first
    assert auto.remembered(backends._REGISTRY, "fprop", [2, 3, 8, 8], w_shape, (1, 1), (1, 1)) is None
    with pytest.raises(TypeError):                   # a float size still reaches geometry()'s check
        backends.choose("auto", "fprop", (2.0, 3, 8, 8), w_shape, (1, 1), (1, 1))
    monkeypatch.setenv("MINITORCH_AUTO_TUNE", "sometimes")
    with pytest.raises(ValueError, match="MINITORCH_AUTO_TUNE"):
        backends.choose("auto", "fprop", x_shape, w_shape, (1, 1), (1, 1))


@pytest.mark.gpu
def test_the_memory_cap_skips_a_candidate_that_needs_more_and_restores_the_limit(settings, monkeypatch, tmp_path):
    """MINITORCH_AUTO_MEMORY_MB: a candidate that allocates beyond the cap while auto times it
    fails and is skipped with its reason; the pool's limit is as before afterwards."""
    import cupy as cp

    class Hungry:                       # a stand-in backend that takes 64 MiB on every call
        @staticmethod
        def supports(*args):
            return True

        @staticmethod
        def fprop(x, w, stride, padding):
            cp.empty(64 << 20, np.uint8)
            return gemm.fprop(x, w, stride=stride, padding=padding)

    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "t.json"))
    monkeypatch.setattr(auto, "_memory", {})
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()              # cached free blocks would serve the 64 MiB past the cap
    before = pool.get_limit()
    settings(auto_tune="on", auto_memory_mb=16)
    picked = auto.pick({"gemm": gemm, "hungry": Hungry}, "fprop", (2, 3, 16, 16), (4, 3, 3, 3), (1, 1), (1, 1), cp)
    assert picked == "gemm"
    record = next(r for r in auto.choices() if r["pass"] == "fprop")
    assert "OutOfMemory" in record["skipped"]["hungry"], record
    assert pool.get_limit() == before


def test_tuning_leaves_no_cufft_buffers(tmp_path, monkeypatch, settings):
    """Timing cufft grows its persistent scratch buffers and plan cache to the tuned layer's size;
    auto drops them once the choice is made, whichever backend won (a converted ResNet-50's step
    held them at its peak: benchmarks/NOTES.md, session 13)."""
    from minitorch_fft.backends import cufft, cufft_buffers
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "t.json"))
    monkeypatch.setattr(auto, "_memory", {})
    settings(auto_tune="on")
    cufft_buffers.release_buffers()
    grown = []
    real = cufft.fprop

    def watched(*args, **kwargs):
        out = real(*args, **kwargs)
        grown.append(len(cufft_buffers._scratch_buffers))
        return out
    monkeypatch.setattr(cufft, "fprop", watched)
    picked = auto.pick({"gemm": gemm, "cufft": cufft}, "fprop", (2, 3, 16, 16), (4, 3, 5, 5), (1, 1), (2, 2), np)
    assert picked in ("gemm", "cufft")
    assert grown and max(grown) > 0            # cufft ran and kept buffers while it was timed
    assert cufft_buffers._scratch_buffers == {} and cufft_buffers._plans == {}


def test_a_tie_decided_by_the_old_order_is_tuned_again():
    """Records from before session 20 may hold a tie handed to a backend that shares no spectra
    (gemm before cudnn): today's rule takes the faster there (or the one with clearly less host work,
    which a record without host times cannot tell), so the record is not reused."""
    old = {"choice": "gemm", "ms": {"gemm": 1.02, "cudnn": 1.0}, "skipped": {}, "why": "tie order"}
    assert not auto._compared(old, ["gemm", "cudnn"], {})
    host = {"gemm": 0.1, "cudnn": 0.05}
    assert auto._compared(dict(old, choice="cudnn", host_ms=host), ["gemm", "cudnn"], {})
    assert not auto._compared(dict(old, choice="cudnn"), ["gemm", "cudnn"], {})   # a tie host work decides now
    shared = {"choice": "fbfft", "ms": {"fbfft": 1.02, "cudnn": 1.0}, "skipped": {}, "why": "tie order"}
    assert auto._compared(shared, ["fbfft", "cudnn"], {})          # still today's rule
    assert auto._compared({"choice": "gemm", "ms": {}, "skipped": {}, "why": "untimed"}, [], {})
    assert not auto._compared(dict(shared, inner=4), ["fbfft", "cudnn"], {})          # bursts of 4, asked 1
    assert auto._compared(dict(shared, inner=4), ["fbfft", "cudnn"], {}, inner=4)
    assert not auto._compared(shared, ["fbfft", "cudnn"], {}, inner=4)               # single calls, asked 4


def test_a_tie_given_to_less_host_work_is_kept_and_one_the_rule_undoes_is_tuned_again(tuner, monkeypatch):
    """A record whose slower choice won its tie on host work (session 65's rule) is today's rule's own
    answer: it stands in every later process. One whose host saving is under the margin's share of the
    time is not (the faster wins that now), nor one without host times; a tie with a backend of
    TIE_ORDER in it is decided by the order, whatever the host times."""
    ms = {"gemm": 1.02, "cudnn": 1.0}
    won = {"choice": "gemm", "ms": ms, "skipped": {}, "why": "host", "inner": 4,
           "host_ms": {"gemm": 0.05, "cudnn": 0.2}}
    assert auto._compared(won, ["gemm", "cudnn"], {}, inner=4)
    assert not auto._compared(dict(won, host_ms={"gemm": 0.05, "cudnn": 0.06}), ["gemm", "cudnn"], {}, inner=4)
    assert not auto._compared({k: v for k, v in won.items() if k != "host_ms"}, ["gemm", "cudnn"], {}, inner=4)
    assert not auto._host_undecided({"choice": "fbfft", "ms": {"fbfft": 1.02, "gemm": 1.0, "cudnn": 1.01},
                                     "skipped": {}, "why": "tie order"})
    # in a process: the record on disk is reused, not tuned again
    reg = {"gemm": SlowIn("none"), "cudnn": SlowIn("none")}
    geom = auto._geometry_key(**GEOM)
    tuning.default_cache().put(tuning.key(np, np.float32, geom, "fprop", "auto"), dict(won, inner=1))
    monkeypatch.setattr(auto, "_tune", lambda *a: pytest.fail("tuned again despite a record of today's rule"))
    assert auto.pick(reg, "fprop", **GEOM) == "gemm"


def test_an_exact_tie_reads_back_from_the_file_as_it_was_decided(tuner, monkeypatch):
    """The cache file stores a record's dicts sorted; an exact tie in the rounded times must be decided the
    same way on them as in the tuning process (by label, not by the candidates' order), or the record would be
    tuned again in the next process."""
    clock = {"gemm": 0.10001, "cudnn": 0.09999}   # both 0.1 once rounded, gemm first in the candidates' order
    last = []
    monkeypatch.setattr(tuning, "timeit", lambda fn, xp, warmup, repeat, **k: (fn(), clock[last[-1]])[1])
    record = tuning.tune(["gemm", "cudnn"], lambda c: (last.append(c), np.ones(2))[1], np, margin=0.03,
                         prefer=auto._tie_rule(None)[0], host=True)
    assert record["ms"] == {"gemm": 0.1, "cudnn": 0.1}
    key = tuning.key(np, np.float32, auto._geometry_key(**GEOM), "fprop", "auto")
    tuning.default_cache().put(key, record)
    tuning._caches.clear()                                  # a new process reads the file
    back = tuning.default_cache().get(key)
    assert list(back["ms"]) == ["cudnn", "gemm"] and back["choice"] == record["choice"]
    assert auto._compared(back, ["gemm", "cudnn"], {})


def test_choices_under_other_memory_bounds_are_keyed_apart(tuner, monkeypatch, settings):
    """A choice made under the default workspace bounds does not stand under others (a smaller
    cuDNN workspace admits slower plans, a smaller gemm workspace runs in more chunks): tuned
    again under its own key, and at the defaults the key and the remembered choice are as before."""
    reg = {"gemm": SlowIn("none"), "a": SlowIn("fprop")}
    assert auto.label() == "auto"
    assert auto.pick(reg, "fprop", **GEOM) == "gemm"
    tuned = []
    real_tune = auto._tune
    monkeypatch.setattr(auto, "_tune", lambda *a: tuned.append(a[1]) or real_tune(*a))
    settings(cudnn_workspace_mb=1024, winograd_f4=False)
    assert auto.label() == "auto{winograd_f4=0,cudnn_workspace_mb=1024}"
    assert auto.remembered(reg, "fprop", **GEOM) is None          # the default's choice does not answer
    assert auto.pick(reg, "fprop", **GEOM) == "gemm" and len(tuned) == 1
    settings(auto_backends=("gemm", "a"), gemm_workspace_mb=64.5)
    assert auto.label() == "auto[gemm,a]{gemm_workspace_mb=64.5,winograd_f4=0,cudnn_workspace_mb=1024}"
    back = config.ENVIRONMENT   # each setting follows the environment again: its default here
    settings(auto_backends=back, gemm_workspace_mb=back, cudnn_workspace_mb=back, winograd_f4=back)
    assert auto.label() == "auto"
    assert auto.remembered(reg, "fprop", **GEOM) == "gemm" and len(tuned) == 1   # the default's, not tuned again
    assert {k[5] for k in auto._memory} == {"auto", "auto{winograd_f4=0,cudnn_workspace_mb=1024}"}


def test_a_bad_bound_is_named_by_the_full_path_not_the_remembered_one(tuner, monkeypatch):
    reg = {"gemm": SlowIn("none"), "a": SlowIn("fprop")}
    auto.pick(reg, "fprop", **GEOM)
    monkeypatch.setenv("MINITORCH_CUDNN_WORKSPACE_MB", "lots")
    assert auto.remembered(reg, "fprop", **GEOM) is None
    with pytest.raises(config.ConfigError, match="MINITORCH_CUDNN_WORKSPACE_MB"):
        auto.pick(reg, "fprop", **GEOM)


def test_a_processs_first_settings_block_gets_a_label_of_its_own():
    """In a fresh process (no settings block entered yet) the first block's settings are not the
    start-up ones: state() and label() say so (session 41: both said the start-up's)."""
    import os
    import pathlib
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINITORCH_")}   # every setting at its default
    code = ("from minitorch_fft.backends import auto, config\n"
            "start, text = config.state(), auto.label()\n"
            "with config.override(cudnn_workspace_mb=1024):\n"
            "    print(config.state() != start, text, auto.label())\n"
            "print(config.state() == start, auto.label())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=pathlib.Path(__file__).resolve().parents[1]).stdout.split()
    assert out == ["True", "auto", "auto{cudnn_workspace_mb=1024}", "True", "auto"]


class NhwcStandIn:
    """cuDNN's NHWC passes as the route tuner calls them, on NumPy: gemm on NCHW copies, the result laid
    out channels-last. `sleep` seconds a call; `wrong` scales the result. Counts its calls."""

    def __init__(self, sleep=0.0, wrong=False, supported=True):
        self.sleep, self.wrong, self.supported, self.calls = sleep, wrong, supported, []

    def supports(self, x_shape, w_shape, stride=(1, 1), padding=(0, 0)):
        return self.supported

    def __getattr__(self, pass_name):
        def run(a, b, *rest, stride, padding, layout):
            assert layout == "nhwc" and a.transpose(0, 2, 3, 1).flags.c_contiguous   # as a channels-last tensor
            self.calls.append(pass_name)
            time.sleep(self.sleep)
            out = getattr(gemm, pass_name)(np.ascontiguousarray(a), np.ascontiguousarray(b), *rest,
                                           stride=stride, padding=padding)
            return backends.layout.to_nhwc(out * np.float32(2 if self.wrong else 1))
        return run


def nchw_stand_in(sleep):
    """run_pass as nhwc_route calls it: the NCHW pass on contiguous arrays; `sleep` seconds a call."""
    calls = []

    def run(name, pass_name, a, b, *rest, x_shape, w_shape, stride, padding, later):
        assert name == "auto" and later == () and a.flags.c_contiguous and b.flags.c_contiguous
        calls.append(pass_name)
        time.sleep(sleep)
        return getattr(gemm, pass_name)(a, b, *rest, stride=stride, padding=padding)
    run.calls = calls
    return run


@pytest.mark.parametrize("slow", ["cudnn", "nchw"])
def test_a_channels_last_pass_takes_the_faster_route_once_and_caches_it(tuner, monkeypatch, slow):
    """nhwc_route times cuDNN's NHWC plans against the NCHW passes on copies, per pass; the record goes
    to the tuning cache under its own key (label() + ":nhwc") and answers a new process untimed."""
    cudnn = NhwcStandIn(sleep=0.01 if slow == "cudnn" else 0.0)
    run = nchw_stand_in(sleep=0.01 if slow == "nchw" else 0.0)
    want = "nchw" if slow == "cudnn" else "cudnn"
    for pass_name in ("fprop", "bprop", "accgrad"):
        assert auto.nhwc_route({"cudnn": cudnn}, run, pass_name, **GEOM, xp=np) == want
    assert sorted(set(cudnn.calls)) == sorted(set(run.calls)) == ["accgrad", "bprop", "fprop"]
    rows = auto.route_choices()
    assert {r["pass"] for r in rows} == {"fprop", "bprop", "accgrad"}
    assert all(r["route"] == want and set(r["ms"]) == {"cudnn", "nchw"} for r in rows)
    assert all(k[-1] == "auto:nhwc" for k in auto._route_records)
    timed = len(cudnn.calls)
    assert auto.nhwc_route({"cudnn": cudnn}, run, "fprop", **GEOM, xp=np) == want     # remembered
    monkeypatch.setattr(auto, "_routes", {})            # a new process: from the cache file, untimed
    monkeypatch.setattr(auto, "_route_records", {})
    monkeypatch.setattr(tuning, "_memo", {})
    monkeypatch.setattr(tuning, "_caches", {})          # read from the file again
    assert auto.nhwc_route({"cudnn": cudnn}, run, "bprop", **GEOM, xp=np) == want
    assert len(cudnn.calls) == timed
    assert auto.choices() == []                         # auto's own records apart, in memory and on disk
    geom = auto._geometry_key(GEOM["x_shape"], GEOM["w_shape"], GEOM["stride"], GEOM["padding"])
    assert tuning.default_cache().get(tuning.key(np, np.float32, geom, "fprop", auto.label())) is None
    assert tuning.default_cache().get(tuning.key(np, np.float32, geom, "fprop", "auto:nhwc"))["choice"] == want


class RouteCounts:
    """A stand-in for the adapter's count (measure): a route's run adds `route_bytes[route]` to the
    peak of the count open around it, and its first run leaves `held[route]` bytes held (live after
    it, as a plan's buffers kept). The routes' stand-ins call took(route)."""

    def __init__(self, route_bytes, held=None):
        self.route_bytes, self.held, self.open, self.counts, self.runs = route_bytes, held or {}, None, 0, {}

    @contextlib.contextmanager
    def __call__(self):
        self.open, self.counts = types.SimpleNamespace(peak=0, live=0), self.counts + 1
        try:
            yield self.open
        finally:
            self.open = None

    def took(self, route):
        first = route not in self.runs
        self.runs[route] = self.runs.get(route, 0) + 1
        if self.open is not None:
            self.open.peak += self.route_bytes[route]
            if first:
                self.open.live += self.held.get(route, 0)


def counted_routes(counts, cudnn_sleep, nchw_sleep):
    """The cudnn and nchw stand-ins, each telling `counts` what it holds."""
    cudnn, run = NhwcStandIn(sleep=cudnn_sleep), nchw_stand_in(sleep=nchw_sleep)
    cudnn_pass, calls = cudnn.__getattr__, run.calls

    class Counted(NhwcStandIn):
        def __getattr__(self, pass_name):
            def go(*args, **kwargs):
                counts.took("cudnn")
                return cudnn_pass(pass_name)(*args, **kwargs)
            return go

    def nchw(*args, **kwargs):
        counts.took("nchw")
        return run(*args, **kwargs)
    nchw.calls = calls
    return Counted(), nchw


@pytest.mark.parametrize("bound_mb, want", [(None, "nchw"), (64, "cudnn"), (512, "nchw")])
def test_a_routes_memory_is_weighed_under_nhwc_route_mb(tuner, settings, monkeypatch, bound_mb, want):
    """Each route's first two runs are counted (measure): the record's "bytes" is the second's peak
    (the timing's warm-up) plus what the first (the check's, which may tune) left held besides its
    result; under nhwc_route_mb a faster route holding more than the bound above the leanest does
    not win, and the record, keyed by the bound, says why. Unset, the fastest wins (session 59:
    VGG-16's TF32 channels-last accGrads on the copies' route, 5589 MiB against stock's 5057)."""
    MiB = 2**20
    counts = RouteCounts({"cudnn": 8 * MiB, "nchw": 400 * MiB}, held={"nchw": 2 * MiB})
    cudnn, run = counted_routes(counts, cudnn_sleep=0.01, nchw_sleep=0.0)      # the copies' route is faster
    if bound_mb is not None:
        settings(nhwc_route_mb=bound_mb)
    assert auto.nhwc_route({"cudnn": cudnn}, run, "accgrad", **GEOM, xp=np, measure=counts) == want
    assert counts.counts == 4 and min(counts.runs.values()) > 2                 # two runs a route of the several
    (row,) = auto.route_choices()
    gw_bytes = 4 * np.prod(GEOM["w_shape"])                                     # the first run's result, not held
    assert row["route"] == want and row["bytes"] == {"cudnn": 8 * MiB, "nchw": 402 * MiB - gw_bytes}
    assert row["ms"]["nchw"] < row["ms"]["cudnn"]
    if want == "cudnn":
        assert row["why"] == ("fastest of the routes within nhwc_route_mb of the leanest (8 MiB); nchw (fastest) "
                              "held 402 MiB, cudnn 8 MiB")
    (key,) = auto._route_records
    assert key[-1] == ("auto:nhwc" if bound_mb is None else f"auto:nhwc{{nhwc_route_mb={bound_mb}}}")
    timed = len(run.calls)
    monkeypatch.setattr(auto, "_routes", {})            # a new process: the record from the file, untimed
    monkeypatch.setattr(auto, "_route_records", {})
    monkeypatch.setattr(tuning, "_memo", {})
    monkeypatch.setattr(tuning, "_caches", {})
    assert auto.nhwc_route({"cudnn": cudnn}, run, "accgrad", **GEOM, xp=np, measure=counts) == want
    assert len(run.calls) == timed


def test_a_bound_times_again_a_route_record_made_without_a_count(tuner, settings):
    """Under nhwc_route_mb a record with no "bytes" (made where nothing counted: the CPU, a caller
    without measure) is timed again by a process that counts, then weighed; without a count it
    stands. The fast path keys the bound: a change of it is seen on the next call."""
    MiB = 2**20
    counts = RouteCounts({"cudnn": 0, "nchw": 300 * MiB})
    cudnn, run = counted_routes(counts, cudnn_sleep=0.01, nchw_sleep=0.0)
    with config.override(nhwc_route_mb=16):
        assert auto.nhwc_route({"cudnn": cudnn}, run, "fprop", **GEOM, xp=np) == "nchw"        # no count: as timed
        timed = len(run.calls)
        assert auto.nhwc_route({"cudnn": cudnn}, run, "fprop", **GEOM, xp=np) == "nchw"        # stands
        assert len(run.calls) == timed
        auto._routes.clear()                                     # a process that counts: the record read from the cache
        auto._route_records.clear()
        assert auto.nhwc_route({"cudnn": cudnn}, run, "fprop", **GEOM, xp=np, measure=counts) == "cudnn"
        assert len(run.calls) > timed and counts.counts == 4
        auto._routes.clear()                                     # a process that does not count: the record stands
        auto._route_records.clear()
        timed = len(run.calls)
        assert auto.nhwc_route({"cudnn": cudnn}, run, "fprop", **GEOM, xp=np) == "cudnn"
        assert len(run.calls) == timed
    assert auto.nhwc_route({"cudnn": cudnn}, run, "fprop", **GEOM, xp=np, measure=counts) == "nchw"   # unset


def test_weighing_keeps_a_lean_enough_choice_and_the_tie_rule():
    """_weighed: a choice within the bound stands; otherwise the tie rule's pick within it (the
    margin, then ROUTES' order); a record without "bytes", or no bound, as timed."""
    MiB = 2**20
    rec = {"choice": "nchw", "ms": {"cudnn": 2.0, "gemm": 1.5, "nchw": 1.0}, "skipped": {}, "why": "fastest",
           "bytes": {"cudnn": 10 * MiB, "gemm": 20 * MiB, "nchw": 500 * MiB}}
    assert auto._weighed(rec, None) is rec
    assert auto._weighed(rec, 490 * MiB) is rec
    assert auto._weighed(rec, 16 * MiB)["choice"] == "gemm"
    assert auto._weighed(rec, 1 * MiB)["choice"] == "cudnn"
    tied = {**rec, "ms": {"cudnn": 1.52, "gemm": 1.5, "nchw": 1.0}}       # within auto's 3 % margin
    assert auto._weighed(tied, 16 * MiB)["choice"] == "cudnn"
    assert auto._weighed({**rec, "ms": {"cudnn": 1.6, "gemm": 1.5, "nchw": 1.0}}, 16 * MiB)["choice"] == "gemm"
    assert auto._weighed({k: v for k, v in rec.items() if k != "bytes"}, 1 * MiB)["choice"] == "nchw"
    assert rec["choice"] == "nchw"                                                # the record is not changed


def test_a_pointwise_channels_last_layer_also_times_the_gemm_route(tuner, monkeypatch):
    """A 1x1 kernel without padding has a third route, "gemm" (one GEMM on the NHWC arrays as they are),
    timed with the other two under its own record key (label() + ":nhwc+gemm", so that a record made
    before it joined is timed again); other kernels keep two routes. With cuDNN's and the NCHW routes
    slow, it wins, and no NCHW pass or copy runs for it after the timing."""
    pointwise = dict(x_shape=(2, 6, 5, 7), w_shape=(4, 6, 1, 1), stride=(1, 1), padding=(0, 0))
    both = {"cudnn": NhwcStandIn(), "gemm": gemm}
    assert auto.routes_for(both, **pointwise, xp=np) == ("cudnn", "gemm", "nchw")
    assert auto.routes_for({"cudnn": NhwcStandIn()}, **pointwise, xp=np) == ("cudnn", "nchw")   # gemm not a candidate
    assert auto.routes_for(both, **GEOM, xp=np) == ("cudnn", "nchw")
    assert auto.routes_for(both, **dict(pointwise, padding=(1, 1)), xp=np) == ("cudnn", "nchw")
    # a record of the old key (two routes, made before "gemm" joined) is not taken for the 1x1 layer
    geom = auto._geometry_key(pointwise["x_shape"], pointwise["w_shape"], pointwise["stride"], pointwise["padding"])
    old = tuning.key(np, np.float32, geom, "fprop", "auto:nhwc")
    tuning.remembered(old, lambda: {"choice": "cudnn", "ms": {"cudnn": 1.0, "nchw": 2.0}, "skipped": {},
                                    "why": "fastest"})
    assert tuning.default_cache().get(old)["choice"] == "cudnn"
    cudnn, run = NhwcStandIn(sleep=0.01), nchw_stand_in(0.01)
    for pass_name in ("fprop", "bprop", "accgrad"):
        assert auto.nhwc_route({"cudnn": cudnn, "gemm": gemm}, run, pass_name, **pointwise, xp=np) == "gemm"
    rows = auto.route_choices()
    assert len(rows) == 3 and all(set(r["ms"]) == {"cudnn", "gemm", "nchw"} and not r["skipped"] for r in rows)
    assert all(k[-1] == "auto:nhwc+gemm" for k in auto._route_records)
    calls = (len(cudnn.calls), len(run.calls))
    for pass_name in ("fprop", "bprop", "accgrad"):   # chosen: no timing, no NCHW pass or cuDNN call again
        assert auto.nhwc_route({"cudnn": cudnn, "gemm": gemm}, run, pass_name, **pointwise, xp=np) == "gemm"
    assert (len(cudnn.calls), len(run.calls)) == calls
    assert auto.nhwc_route({"cudnn": cudnn, "gemm": gemm}, run, "fprop", **GEOM, xp=np) in ("cudnn", "nchw")   # 3x3
    assert set(auto.route_choices()[-1]["ms"]) == {"cudnn", "nchw"}
    assert tuning.default_cache().get(tuning.key(np, np.float32, geom, "fprop", "auto:nhwc+gemm"))["choice"] == "gemm"
    assert tuning.default_cache().get(old)["choice"] == "cudnn"   # the old record stands, unread


def test_without_cudnn_a_pointwise_layer_times_gemm_against_copies_and_others_take_copies_untimed(tuner):
    """Without cuDNN among the candidates (not installed, not supported, or auto_backends without it), a 1x1
    layer's routes are "gemm" and "nchw", timed under a key that names them; any other kernel has "nchw"
    alone, which is the answer untimed, with no record."""
    pointwise = dict(x_shape=(2, 6, 5, 7), w_shape=(4, 6, 1, 1), stride=(2, 1), padding=(0, 0))
    unsupported = NhwcStandIn(supported=False)
    assert auto.routes_for({"gemm": gemm}, **pointwise, xp=np) == ("gemm", "nchw")
    assert auto.routes_for({"cudnn": unsupported, "gemm": gemm}, **pointwise, xp=np) == ("gemm", "nchw")
    assert auto.routes_for({"cudnn": unsupported, "gemm": gemm}, **GEOM, xp=np) == ("nchw",)
    run = nchw_stand_in(0.01)
    for pass_name in ("fprop", "bprop", "accgrad"):
        assert auto.nhwc_route({"gemm": gemm}, run, pass_name, **pointwise, xp=np) == "gemm"
    rows = auto.route_choices()
    assert len(rows) == 3 and all(set(r["ms"]) == {"gemm", "nchw"} for r in rows)
    assert all(k[-1] == "auto:nhwc=gemm+nchw" for k in auto._route_records)
    calls = len(run.calls)
    assert auto.nhwc_route({"gemm": gemm}, run, "fprop", **GEOM, xp=np) == "nchw"
    assert len(run.calls) == calls and len(auto.route_choices()) == 3


def test_a_route_record_made_at_another_revision_is_timed_again(tuner, monkeypatch):
    """A route record carries the revisions of the routes' own passes (cudnn's revision(), gemm's of its
    channels-last form); one made at others is timed again, as auto's NCHW records are. A record without
    them (session 46's) was made at cudnn 2 and gemm 1, and stands while those are today's."""
    pointwise = dict(x_shape=(2, 6, 5, 7), w_shape=(4, 6, 1, 1), stride=(1, 1), padding=(0, 0))
    geom = auto._geometry_key(pointwise["x_shape"], pointwise["w_shape"], pointwise["stride"], pointwise["padding"])
    key = tuning.key(np, np.float32, geom, "fprop", "auto:nhwc=gemm+nchw")
    tuning.default_cache().put(key, {"choice": "nchw", "ms": {"gemm": 2.0, "nchw": 1.0}, "skipped": {},
                                     "why": "fastest"})   # as session 46 wrote them: no revisions
    run = nchw_stand_in(0.01)
    assert auto.nhwc_route({"gemm": gemm}, run, "fprop", **pointwise, xp=np) == "nchw"   # stands, untimed
    assert run.calls == [] and gemm._revision("fprop_nhwc", None) == auto._UNRECORDED_REVISIONS["gemm"]

    def new_process():
        for name in ("_routes", "_route_records"):
            monkeypatch.setattr(auto, name, {})
        monkeypatch.setattr(tuning, "_memo", {})
    new_process()
    monkeypatch.setattr(gemm, "revision", lambda pass_name, *a, **k: 2 if pass_name.endswith("_nhwc") else 1)
    assert auto.nhwc_route({"gemm": gemm}, run, "fprop", **pointwise, xp=np) == "gemm"   # timed again
    assert run.calls == ["fprop"] * len(run.calls) and run.calls
    record = tuning.default_cache().get(key)
    assert record["choice"] == "gemm" and record["revisions"] == {"gemm": 2}
    new_process()
    calls = len(run.calls)
    assert auto.nhwc_route({"gemm": gemm}, run, "fprop", **pointwise, xp=np) == "gemm"   # today's: stands
    assert len(run.calls) == calls


def test_a_session_46_route_record_stands_until_cudnn_or_gemm_changes(tuner, monkeypatch):
    """A record under session 46's keys (auto:nhwc+gemm), without revisions, counts as made at cudnn 2 and
    gemm 1: it stands while those are today's revisions, and is timed again once cudnn's changes."""
    pointwise = dict(x_shape=(2, 6, 5, 7), w_shape=(4, 6, 1, 1), stride=(1, 1), padding=(0, 0))
    cudnn = NhwcStandIn(sleep=0.01)
    cudnn.revision = lambda pass_name, *a, **k: auto._UNRECORDED_REVISIONS["cudnn"]   # as cudnn.revision answers
    gemm_at_1 = types.SimpleNamespace(revision=lambda pass_name, *a, **k: auto._UNRECORDED_REVISIONS["gemm"])
    geom = auto._geometry_key(pointwise["x_shape"], pointwise["w_shape"], pointwise["stride"], pointwise["padding"])
    key = tuning.key(np, np.float32, geom, "bprop", "auto:nhwc+gemm")
    tuning.default_cache().put(key, {"choice": "cudnn", "ms": {"cudnn": 1.0, "gemm": 2.0, "nchw": 3.0},
                                     "skipped": {}, "why": "fastest"})
    run = nchw_stand_in(0.01)
    assert auto.nhwc_route({"cudnn": cudnn, "gemm": gemm_at_1}, run, "bprop", **pointwise, xp=np) == "cudnn"
    assert cudnn.calls == run.calls == []                       # stands, untimed
    for name in ("_routes", "_route_records"):
        monkeypatch.setattr(auto, name, {})
    monkeypatch.setattr(tuning, "_memo", {})
    cudnn.revision = lambda pass_name, *a, **k: 3               # cuDNN's search changed: timed again
    assert auto.nhwc_route({"cudnn": cudnn, "gemm": gemm_at_1}, run, "bprop", **pointwise, xp=np) == "gemm"
    assert cudnn.calls and run.calls
    assert tuning.default_cache().get(key)["revisions"] == {"cudnn": 3, "gemm": 1}


def test_a_channels_last_route_that_disagrees_with_gemm_is_skipped(tuner):
    cudnn = NhwcStandIn(wrong=True)     # fast and wrong
    assert auto.nhwc_route({"cudnn": cudnn}, nchw_stand_in(0.01), "fprop", **GEOM, xp=np) == "nchw"
    assert "disagrees with gemm" in auto.route_choices()[0]["skipped"]["cudnn"]


def test_a_channels_last_route_is_not_timed_with_tuning_off(tuner, monkeypatch):
    """Tuning off: cuDNN's NHWC plans, untimed and not cached (no NCHW choice needed either)."""
    monkeypatch.setenv("MINITORCH_AUTO_TUNE", "off")
    cudnn, run = NhwcStandIn(), nchw_stand_in(0.0)
    assert auto.nhwc_route({"cudnn": cudnn}, run, "fprop", **GEOM, xp=np) == "cudnn"
    assert cudnn.calls == run.calls == [] and auto.route_choices() == [] and not tuner.exists()
