"""run_pass's prepared path: a layer's GPU calls after its first go straight to the backend's call
for that geometry (cudnn's built plan, gemm's fused kernel launch or its pass; for a backend
without prepare(), its pass function, under the spectra roles the full path would give it),
where nothing that decided it has changed. Each call's result against PyTorch float64; every way out of the path
(other settings, another device's arrays, arrays the full path must check or convert, a new
tuning memory, a replaced pass function, a runner that raises) taken and checked to give the full
path's answer or error. The settings' state number on the CPU."""
import numpy as np
import pytest

from minitorch_fft import backends
from minitorch_fft.backends import auto, cgemm, common, config, cudnn, gemm, tuning, winograd
from reference import conv_reference, rel_error

f32 = np.float32

# (input, weight, stride, padding): a 3x3 layer, a ResNet stride-2 1x1 shortcut (gemm's fused form
# where tuned so), a stride-1 1x1 layer
GEOMETRIES = [((4, 8, 12, 12), (16, 8, 3, 3), (1, 1), (1, 1)),
              ((8, 16, 14, 14), (32, 16, 1, 1), (2, 2), (0, 0)),
              ((4, 16, 7, 7), (8, 16, 1, 1), (1, 1), (0, 0))]


def _args(pass_name, x, w, gy):
    return {"fprop": (x, w), "bprop": (gy, w, x.shape), "accgrad": (gy, x, w.shape)}[pass_name]


def _data(xs, ws, stride, padding, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(xs).astype(f32), rng.standard_normal(ws).astype(f32)
    g = backends.geometry(xs, ws, stride, padding)
    gy = rng.standard_normal((g.S, g.fo, g.oh, g.ow)).astype(f32)
    return x, w, gy, dict(zip(backends.PASSES, conv_reference(x, w, gy, stride, padding)))


def _run(name, pass_name, args, xs, ws, stride, padding):
    return backends.run_pass(name, pass_name, *args, x_shape=xs, w_shape=ws, stride=stride, padding=padding)


@pytest.fixture
def chosen(monkeypatch):
    """Counts run_pass's full-path choices (backends.choose calls)."""
    calls = []
    real = backends.choose
    monkeypatch.setattr(backends, "choose", lambda *a, **k: calls.append(a[:2]) or real(*a, **k))
    return calls


def test_settings_state_follows_their_content():
    start = config.state()
    with config.override(gemm_workspace_mb=64):
        inside = config.state()
        assert inside != start
        with config.override(tf32=True):
            assert config.state() not in (start, inside)
        assert config.state() == inside
    assert config.state() == start
    with config.override(gemm_workspace_mb=64):
        assert config.state() == inside              # the same content: the same number again
    config.set("tf32", True)
    assert config.state() != start
    config.set("tf32", None)
    assert config.state() == start
    config.reload()                                  # the environment may say something else now
    assert config.state() != start


def test_numpy_calls_take_the_full_path_every_time(chosen):
    xs, ws, s, p = GEOMETRIES[0]
    x, w, gy, ref = _data(xs, ws, s, p, 1)
    for _ in range(2):
        for pn in backends.PASSES:
            assert rel_error(_run("gemm", pn, _args(pn, x, w, gy), xs, ws, s, p), ref[pn]) <= 1e-5
    assert len(chosen) == 6
    assert not [k for k in backends._prepared if k[1:4] == ("fprop", xs, ws)]


def _need(name):
    import cupy as cp
    if name == "cudnn" and not cudnn.available():
        pytest.skip(f"cuDNN not usable: {cudnn._frontend()[1]}")
    return cp


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemm", "cudnn", "auto"])
@pytest.mark.parametrize("xs,ws,stride,padding", GEOMETRIES)
def test_later_calls_are_prepared_and_agree(name, xs, ws, stride, padding, settings, tmp_path, chosen):
    cp = _need(name)
    settings(tune_cache=str(tmp_path / "t.json"), tf32=False)
    x, w, gy, ref = _data(xs, ws, stride, padding, 2)
    args = {pn: _args(pn, *(cp.asarray(a) for a in (x, w, gy))) for pn in backends.PASSES}
    for pn in backends.PASSES:
        first = _run(name, pn, args[pn], xs, ws, stride, padding)
        # every backend has a prepared call since session 35 (a pass function with the geometry bound
        # where it offers no prepare()); under auto it is taken once the pass's tuning record exists
        assert (name, pn, xs, ws, stride, padding, config.state()) in backends._prepared
        before = len(chosen)
        second = _run(name, pn, args[pn], xs, ws, stride, padding)
        prepared = len(chosen) == before
        assert prepared
        tol = cudnn.CHECK_TOL if name != "gemm" else 1e-5
        assert rel_error(first, ref[pn]) <= tol and rel_error(second, ref[pn]) <= tol, (pn, prepared)
        assert second.data.ptr != first.data.ptr     # a new output each call


@pytest.mark.gpu
@pytest.mark.parametrize("form,case,runner", [("fused", 1, "_fused_prepared"), ("fused64", 1, "_fused_prepared"),
                                              ("per_image", 2, "_per_image_prepared")])
def test_pointwise_form_is_run_directly(form, case, runner, settings, tmp_path, chosen, monkeypatch):
    """A 1x1 fprop and bprop whose tuned form is fused (strided) or per_image (stride 1): the
    prepared call is the kernel's launch or the one GEMM, every element written (outputs
    NaN-poisoned), as the full path's."""
    cp = _need("gemm")
    settings(tune_cache=str(tmp_path / "t.json"), gemm_tune="on")
    xs, ws, stride, padding = GEOMETRIES[case]
    g = backends.geometry(xs, ws, stride, padding)
    for pn in ("fprop", "bprop"):    # the tuned form, as the tuner would have stored it
        tuning.remembered(gemm.form_key(cp, pn, g), lambda: {"choice": form, "ms": {}, "skipped": {}, "why": "test"})
    monkeypatch.setattr(cp, "empty", lambda shape, dtype=float: cp.full(shape, cp.nan, dtype))
    x, w, gy, ref = _data(xs, ws, stride, padding, 3)
    for pn in ("fprop", "bprop"):
        args = _args(pn, *(cp.asarray(a) for a in (x, w, gy)))
        first = _run("gemm", pn, args, xs, ws, stride, padding)
        entry = backends._prepared[("gemm", pn, xs, ws, stride, padding, config.state())]
        assert runner in entry.run.__qualname__
        before = len(chosen)
        second = _run("gemm", pn, args, xs, ws, stride, padding)
        assert len(chosen) == before
        assert rel_error(first, ref[pn]) <= 1e-5 and rel_error(second, ref[pn]) <= 1e-5


# winograd's prepared fprop and bprop: 3x3 stride 1, with the padding of a same-size layer, none, and more
# than 2 (bprop's transforms then read at a negative offset: its gradient plane cropped)
WINOGRAD_GEOMETRIES = [((4, 8, 12, 12), (16, 8, 3, 3), (1, 1)), ((3, 5, 9, 7), (6, 5, 3, 3), (0, 0)),
                       ((2, 4, 6, 5), (3, 4, 3, 3), (3, 3))]


@pytest.mark.gpu
@pytest.mark.parametrize("tf32,tile", [(False, 2), (False, 4), (True, 2)])
@pytest.mark.parametrize("xs,ws,padding", WINOGRAD_GEOMETRIES)
def test_winograd_fprop_and_bprop_are_their_launches(tf32, tile, xs, ws, padding, settings, tmp_path, chosen,
                                                      monkeypatch):
    """winograd's prepared fprop and bprop (winograd.prepare: its four launches, the tile as tuned)
    against PyTorch float64 and against the full path's result, bit for bit (the same kernels and
    GEMM on the same data), every output element written (allocations NaN-poisoned); accGrad is its
    pass function."""
    cp = _need("winograd")
    settings(tune_cache=str(tmp_path / "t.json"), tf32=tf32, winograd_tune="on", winograd_f4=not tf32)
    g = backends.geometry(xs, ws, (1, 1), padding)
    for pn in ("fprop", "bprop"):    # the tile, as the tuner would have stored it (of two; TF32 mode has one)
        tuning.remembered(winograd._tile_key(cp, pn, g), lambda: {"choice": tile, "ms": {}, "skipped": {}, "why": "test"})
    monkeypatch.setattr(cp, "empty", lambda shape, dtype=float: cp.full(shape, cp.nan, dtype))
    x, w, gy, ref = _data(xs, ws, (1, 1), padding, 5)
    tol = cgemm.TF32_TOL if tf32 else 1e-5
    for pn in backends.PASSES:
        args = _args(pn, *(cp.asarray(a) for a in (x, w, gy)))
        first = _run("winograd", pn, args, xs, ws, (1, 1), padding)
        entry = backends._prepared[("winograd", pn, xs, ws, (1, 1), padding, config.state())]
        launches = (getattr(entry.run, "__qualname__", "") == "prepare.<locals>.run"
                    and entry.run.__module__ == winograd.__name__)
        assert launches == (pn != "accgrad"), pn
        before = len(chosen)
        second = _run("winograd", pn, args, xs, ws, (1, 1), padding)
        assert len(chosen) == before, pn
        assert rel_error(first, ref[pn]) <= tol and rel_error(second, ref[pn]) <= tol, pn
        assert np.array_equal(second.get(), first.get()), pn   # the same launches and GEMM: bit for bit


@pytest.mark.gpu
def test_winograd_prepares_nothing_it_would_run_otherwise(settings, tmp_path):
    """Where the full path would do more than one chunk's four launches, or its tile is not tuned
    yet, winograd.prepare answers None (run_pass then calls the pass function)."""
    cp = _need("winograd")
    xs, ws, padding = WINOGRAD_GEOMETRIES[0]
    g = backends.geometry(xs, ws, (1, 1), padding)
    settings(tune_cache=str(tmp_path / "t.json"), tf32=False, winograd_tune="on", winograd_f4=True)
    assert winograd.prepare("fprop", g, cp) is None                     # two tiles, neither tuned
    tuning.remembered(winograd._tile_key(cp, "fprop", g), lambda: {"choice": 4, "ms": {}, "skipped": {}, "why": "t"})
    assert winograd.prepare("fprop", g, cp) is not None
    assert winograd.prepare("accgrad", g, cp) is None
    assert winograd.prepare("fprop", g, np) is None
    with config.override(winograd_workspace_mb=2**-20):                  # one image a chunk
        assert len(winograd._conv_chunks("fprop", g.S, g.f, g.fo, (g.h, g.w), (g.oh, g.ow), 4)) == g.S
        assert winograd.prepare("fprop", g, cp) is None


@pytest.mark.gpu
def test_every_way_out_takes_the_full_path(settings, tmp_path, chosen, monkeypatch):
    cp = _need("gemm")
    settings(tune_cache=str(tmp_path / "t.json"), auto_backends="gemm")   # auto prepares what it picks
    xs, ws, s, p = GEOMETRIES[0]
    x, w, gy, ref = _data(xs, ws, s, p, 4)
    xd, wd, gyd = (cp.asarray(a) for a in (x, w, gy))
    run = lambda *args, name="auto", pn="fprop", ws=ws: _run(name, pn, args, xs, ws, s, p)  # noqa: E731

    def full_path(*args, error=None, **kw):
        before = len(chosen)
        if error is not None:
            with pytest.raises(error[0], match=error[1]):
                run(*args, **kw)
        else:
            assert rel_error(run(*args, **kw), ref[kw.get("pn", "fprop")]) <= 1e-4
        assert len(chosen) == before + 1

    run(xd, wd)
    run(xd, wd)                                      # prepared
    n = len(chosen)
    run(xd, wd)
    assert len(chosen) == n
    full_path(xd.astype(cp.float64), wd, error=(TypeError, "float32"))
    wide = cp.zeros((xs[0], xs[1], xs[2], 2 * xs[3]), dtype=f32)
    wide[..., ::2] = xd
    full_path(wide[..., ::2], wd)                    # not contiguous: the full path copies it
    full_path(gyd[:, :, :-1], wd, xs, pn="bprop", error=(ValueError, "must have shape"))
    full_path(x, w)                                  # NumPy arrays
    with config.override(gemm_workspace_mb=64):      # other settings: another key, full path first
        full_path(xd, wd)
    monkeypatch.setattr(auto, "_memory", {})         # a new process's tuning memory
    full_path(xd, wd)
    run(xd, wd, name="gemm")
    run(xd, wd, name="gemm")                         # prepared under the name gemm too
    real = gemm.fprop                                # a replaced pass function (tests do this)
    monkeypatch.setattr(gemm, "fprop", lambda *a, **k: real(*a, **k))
    full_path(xd, wd, name="gemm")
    run(xd, wd, name="gemm")
    entry = backends._prepared[("gemm", "fprop", xs, ws, s, p, config.state())]

    def broken(a, b):
        raise RuntimeError("a runner that fails")
    monkeypatch.setattr(entry, "run", broken)
    full_path(xd, wd, name="gemm")                   # the full path runs it again, and is right
    # memory short now: the prepared call's allocation fails, and the full path checks the output
    # and refuses it, naming the limit (that the prepared call asks nothing first: the CPU test below)
    run(xd, wd, name="gemm")
    capped = cp.cuda.MemoryPool()
    capped.set_limit(size=1)
    monkeypatch.setattr(common, "CHECK_ABOVE_BYTES", 0)
    monkeypatch.setattr(common, "available_bytes", lambda xp: (1024, "in the test's limit"))
    with cp.cuda.using_allocator(capped.malloc):
        full_path(xd, wd, name="gemm", error=(ValueError, r"fprop's output .* more than the 1\.0 KiB in the test's limit"))


@pytest.mark.gpu
def test_auto_times_the_prepared_call(settings, tmp_path, monkeypatch):
    """auto times a candidate that prepares through its prepared call, after one module call (the
    checked run): what the layer's later calls run."""
    cp = _need("gemm")
    settings(tune_cache=str(tmp_path / "t.json"), auto_backends="gemm,direct", auto_tune="on")
    runs, modules = [], []
    real_prepare, real_fprop = gemm.prepare, gemm.fprop

    def prepare(pass_name, g, xp):
        run = real_prepare(pass_name, g, xp)
        return lambda a, b: runs.append(1) or run(a, b)
    monkeypatch.setattr(gemm, "prepare", prepare)
    monkeypatch.setattr(gemm, "fprop", lambda *a, **k: modules.append(1) or real_fprop(*a, **k))
    xs, ws, s, p = GEOMETRIES[0]
    x, w, gy, ref = _data(xs, ws, s, p, 5)
    y = _run("auto", "fprop", (cp.asarray(x), cp.asarray(w)), xs, ws, s, p)
    assert rel_error(y, ref["fprop"]) <= 1e-4
    record = auto.record_of("fprop", xs, ws, s, p, cp)[1]
    assert set(record["ms"]) == {"gemm", "direct"}, record
    assert len(runs) >= tuning.ROUNDS * tuning.REPEAT
    # beyond the prepared calls (gemm's prepared call for a 3x3 layer is its pass function): auto's
    # reference, the checked run, and the layer's own call
    assert len(modules) - len(runs) <= 3


def test_kept_roles_are_final_only_once_every_consumer_is_tuned(settings, tmp_path, monkeypatch):
    """Under auto, accGrad keeps gy's spectrum for a bprop not chosen yet (it may be the same
    backend), and says the answer is not final; once bprop is chosen (gemm, on the CPU) it keeps
    nothing, finally. A named backend's answer is final at once."""
    settings(tune_cache=str(tmp_path / "t.json"), auto_tune="off", reuse_weight_spectra=False)
    monkeypatch.setattr(auto, "_memory", {})          # a new process's choices: none made yet
    monkeypatch.setattr(auto, "_fast", {})
    xs, ws, s, p = (2, 3, 9, 9), (4, 3, 3, 3), (1, 1), (1, 1)
    x, w, gy, ref = _data(xs, ws, s, p, 6)
    fbfft = backends.get("fbfft")
    with backends.reuse_spectra():
        assert backends._kept_roles("auto", "accgrad", fbfft, ("bprop",), np, xs, ws, s, p) == ({"gy"}, False)
        assert rel_error(_run("auto", "bprop", (gy, w, xs), xs, ws, s, p), ref["bprop"]) <= 1e-5
        assert backends._kept_roles("auto", "accgrad", fbfft, ("bprop",), np, xs, ws, s, p) == (set(), True)
        assert backends._kept_roles("fbfft", "accgrad", fbfft, ("bprop",), np, xs, ws, s, p) == ({"gy"}, True)
        assert backends._kept_roles("fbfft", "accgrad", fbfft, (), np, xs, ws, s, p) == (set(), True)


# a stride-1 layer (fbfft's own, and cufft's: a pass function that keeps spectra) and a strided one (polyphase
# over fbfft)
SPECTRA_GEOMETRIES = [("fbfft", (4, 8, 12, 12), (16, 8, 3, 3), (1, 1), (1, 1)),
                      ("cufft", (4, 8, 12, 12), (16, 8, 3, 3), (1, 1), (1, 1)),
                      ("polyphase", (4, 3, 23, 23), (8, 3, 5, 5), (2, 2), (1, 1))]


@pytest.mark.gpu
@pytest.mark.parametrize("name,xs,ws,stride,padding", SPECTRA_GEOMETRIES)
def test_a_prepared_fft_pass_shares_spectra_as_the_full_path(name, xs, ws, stride, padding, settings, tmp_path,
                                                             chosen):
    """An FFT backend's prepared call (fbfft's and polyphase's prepare(), cufft's pass function): a
    layer's later calls run it straight (no choosing), and inside reuse_spectra() keep and find the
    spectra the full path's calls do: the same hits, step after step, each result against float64.
    cufft untuned: a tuned pass may take a basis of its own, and then the spectrum kept for it is
    another basis's, which nobody asks for (backends/reuse.py, Hazards)."""
    cp = _need(name)
    settings(tune_cache=str(tmp_path / "t.json"), cufft_tune="off")
    x, w, gy, ref = _data(xs, ws, stride, padding, 7)
    xd, wd, gyd = (cp.asarray(a) for a in (x, w, gy))
    hits = []
    for step in range(3):
        before = len(chosen)
        with backends.reuse_spectra(inputs=True) as cache:
            out = {"fprop": backends.run_pass(name, "fprop", xd, wd, x_shape=xs, w_shape=ws, stride=stride,
                                              padding=padding),
                   "accgrad": backends.run_pass(name, "accgrad", gyd, xd, ws, x_shape=xs, w_shape=ws, stride=stride,
                                                padding=padding, later=("bprop",)),
                   "bprop": backends.run_pass(name, "bprop", gyd, wd, xs, x_shape=xs, w_shape=ws, stride=stride,
                                              padding=padding, later=())}
            assert len(cache) == 0                   # every kept spectrum was taken by its consumer
        hits.append(cache.hits)
        for pn, result in out.items():
            assert rel_error(result, ref[pn]) <= 1e-4, (step, pn)
        assert len(chosen) == before + (3 if step == 0 else 0), step   # prepared after the first step
    assert hits[0] == hits[1] == hits[2] >= 2, hits   # accGrad finds fprop's x, bprop accGrad's gy
    entry = backends._prepared[(name, "accgrad", xs, ws, stride, padding, config.state())]
    assert entry.spectra and entry.roles == {(("bprop",), True): {"gy"}}
    assert _prepared_by(entry, backends.get(name)) == (name != "cufft")


def _prepared_by(entry, module):
    """Whether a prepared call's run is module.prepare()'s (else the pass function, bound)."""
    run = entry.run
    return getattr(run, "__qualname__", "").startswith("prepare.") and getattr(run, "__module__", "") == module.__name__


# fbfft's prepared passes: a 3x3 layer, asymmetric padding, a 5x5 one; polyphase's: AlexNet's conv1 scaled down;
# tiledfft's (its basis tuned at the first call): clipped last tiles, and a tall plane with a rectangular kernel
# and bprop's padding negative
FFT_GEOMETRIES = [("fbfft", (4, 8, 12, 12), (16, 8, 3, 3), (1, 1), (1, 1)),
                  ("fbfft", (3, 5, 9, 7), (6, 5, 3, 3), (1, 1), (2, 0)),
                  ("fbfft", (2, 4, 13, 13), (3, 4, 5, 5), (1, 1), (2, 2)),
                  ("polyphase", (4, 3, 23, 23), (8, 3, 11, 11), (4, 4), (2, 2)),
                  ("polyphase", (3, 2, 13, 12), (5, 2, 4, 3), (2, 3), (1, 2)),
                  ("tiledfft", (4, 8, 20, 13), (16, 8, 3, 3), (1, 1), (1, 1)),
                  ("tiledfft", (2, 4, 40, 9), (3, 4, 7, 2), (1, 1), (3, 4))]


@pytest.mark.gpu
@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("name,xs,ws,stride,padding", FFT_GEOMETRIES)
def test_fft_prepared_passes_are_their_launches(name, xs, ws, stride, padding, tf32, settings, tmp_path, chosen,
                                                monkeypatch):
    """fbfft's, polyphase's and tiledfft's prepared passes (prepare(): the launches with their arguments
    worked out once, cgemm.prepare's GEMM) against PyTorch float64 and against the full path's result,
    bit for bit (the same kernels and GEMM on the same data), every output element written
    (allocations NaN-poisoned), in strict fp32 and in TF32 mode."""
    cp = _need(name)
    settings(tune_cache=str(tmp_path / "t.json"), tf32=tf32)
    monkeypatch.setattr(cp, "empty", lambda shape, dtype=float: cp.full(shape, cp.nan, dtype))
    x, w, gy, ref = _data(xs, ws, stride, padding, 11)
    tol = cgemm.TF32_TOL if tf32 else 1e-5
    module = backends.get(name)
    for pn in backends.PASSES:
        args = _args(pn, *(cp.asarray(a) for a in (x, w, gy)))
        first = _run(name, pn, args, xs, ws, stride, padding)
        assert _prepared_by(backends._prepared[(name, pn, xs, ws, stride, padding, config.state())], module), pn
        before = len(chosen)
        second = _run(name, pn, args, xs, ws, stride, padding)
        assert len(chosen) == before, pn
        assert rel_error(first, ref[pn]) <= tol and rel_error(second, ref[pn]) <= tol, pn
        assert np.array_equal(second.get(), first.get()), pn   # the same launches and GEMM: bit for bit


class _FakeCupy:
    """A stand-in for CuPy in _Prepared's checks: NumPy arrays, on "device 0"."""
    ndarray = np.ndarray

    class cuda:
        class runtime:
            getDevice = staticmethod(lambda: 0)


def test_the_prepared_call_asks_nothing_about_memory(monkeypatch):
    """The prepared path does not check the output's size against free memory: the full path checked
    it at the geometry's first call, and a later allocation that fails sends the call to the full
    path, which checks and says so. Before session 37 it asked (cudaMemGetInfo in the PyTorch
    adapter) before every pass above common.CHECK_ABOVE_BYTES. A stand-in for CuPy (NumPy arrays on
    "device 0"), the threshold 0."""
    asked = []
    monkeypatch.setattr(common, "CHECK_ABOVE_BYTES", 0)
    monkeypatch.setattr(common, "check_fits", lambda *args: asked.append(args))
    monkeypatch.setattr(common, "available_bytes", lambda xp: asked.append(xp) or (0, "in the test"))
    monkeypatch.setattr(backends, "_prepared", {})
    monkeypatch.setattr(backends.get("fbfft"), "prepare", lambda *args: None)   # its pass function, bound (its own
    xs, ws, s, p = (2, 3, 9, 9), (4, 3, 3, 3), (1, 1), (1, 1)                   # prepare() launches GPU kernels)
    x, w, _, ref = _data(xs, ws, s, p, 9)
    backends._prepare("fbfft", "fprop", backends.get("fbfft"), (x, w), _FakeCupy, xs, ws, s, p)
    entry = backends._prepared[("fbfft", "fprop", xs, ws, s, p, config.state())]
    out = entry((x, w))
    assert asked == [] and rel_error(out, ref["fprop"]) <= 1e-5


def test_prepared_roles_are_kept_only_once_final(settings, monkeypatch):
    """_Prepared's spectra roles, with a stand-in for CuPy (NumPy arrays on "device 0") and for
    auto's memory: an accGrad whose bprop is not chosen yet keeps gy for it and does not remember
    that answer; once bprop is chosen (gemm) it keeps nothing, and that is remembered per (later,
    the block's inputs). Outside a reuse block no roles are asked for."""
    from minitorch_fft.backends import reuse
    settings(reuse_weight_spectra=False)
    chosen = {}
    monkeypatch.setattr(auto, "remembered", lambda registry, pass_name, *args: chosen.get(pass_name))

    xs, ws, s, p = (2, 3, 9, 9), (4, 3, 3, 3), (1, 1), (1, 1)
    x, _, gy, _ = _data(xs, ws, s, p, 8)
    kept = []

    def run(a, b):
        kept.append(reuse._keep)
        return "ran"
    entry = backends._Prepared(_FakeCupy, run, backends.get("fbfft"), "accgrad", (gy, x, ws), None,
                               spectra=True, where=("auto", xs, ws, s, p))
    with backends.reuse_spectra():
        assert entry((gy, x, ws), ("bprop",)) == "ran"
        assert kept[-1] == {"gy"} and entry.roles == {}              # bprop not chosen: not remembered
        chosen["bprop"] = "gemm"
        assert entry((gy, x, ws), ("bprop",)) == "ran"
        assert kept[-1] == set() and entry.roles == {(("bprop",), True): set()}
        assert entry((gy, x, ws), ()) == "ran" and kept[-1] == set()  # no later pass: nothing to keep
        assert set(entry.roles) == {(("bprop",), True), ((), True)}
    assert entry((gy, x, ws), ("bprop",)) == "ran" and kept[-1] is None
    assert entry((gy.astype(np.float64), x, ws), ("bprop",)) is None      # the full path's to check


def test_a_backend_says_whether_its_prepared_call_keeps_spectra(monkeypatch):
    """backends._prepare runs a prepare()'d call under the spectra roles where the backend module says
    PREPARED_SPECTRA (fbfft, polyphase), not where it does not (tiledfft, winograd, gemm, cudnn); a
    pass function always. Stand-ins for CuPy (NumPy arrays on "device 0") and for the prepared runs."""
    monkeypatch.setattr(backends, "_prepared", {})
    xs, ws, s, p = (2, 3, 9, 9), (4, 3, 3, 3), (1, 1), (1, 1)
    x, w, _, _ = _data(xs, ws, s, p, 10)
    kept = {}
    for name in ("fbfft", "polyphase", "tiledfft", "winograd", "gemm", "cufft"):
        module = backends.get(name)
        if hasattr(module, "prepare"):
            monkeypatch.setattr(module, "prepare", lambda pass_name, g, xp: (lambda a, b: "ran"))
        backends._prepare(name, "fprop", module, (x, w), _FakeCupy, xs, ws, s, p)
        kept[name] = backends._prepared[(name, "fprop", xs, ws, s, p, config.state())].spectra
    assert kept == {"fbfft": True, "polyphase": True, "tiledfft": False, "winograd": False, "gemm": False,
                    "cufft": True}
