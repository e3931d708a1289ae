"""The cudnn backend: absent cuDNN handled on the CPU; on a GPU with cuDNN's frontend, its three
passes against PyTorch float64, strict fp32 and TF32, the engine choice cached, the workspace
bound, and auto choosing among candidates that include it."""
import numpy as np
import pytest

import backends
from backends import auto, cgemm, cudnn, tuning
from reference import check_backend, conv_reference, rel_error

f32 = np.float32
X_SHAPE, W_SHAPE = (2, 3, 8, 8), (4, 3, 3, 3)


@pytest.fixture
def no_cudnn(monkeypatch):
    """This process as a machine without cuDNN sees it (every CI machine)."""
    monkeypatch.setattr(cudnn, "_frontend", lambda: (None, "no cuDNN frontend (test)"))


def test_registered_as_a_vendor_backend():
    assert backends.get("cudnn") is cudnn
    assert "cudnn" in backends.VENDOR
    assert auto.PREFERENCE[-1] == "cudnn" and auto.TIE_ORDER[-1] == "cudnn"


def test_absent_cudnn_supports_nothing_and_says_why(no_cudnn):
    assert not cudnn.supports(X_SHAPE, W_SHAPE, (1, 1), (1, 1))
    with pytest.raises(ValueError, match=r"'cudnn' does not support fprop .*no cuDNN frontend \(test\)"):
        backends.choose("cudnn", "fprop", X_SHAPE, W_SHAPE, (1, 1), (1, 1))
    assert backends.choose("auto", "fprop", X_SHAPE, W_SHAPE, (1, 1), (1, 1)) is backends.gemm


def test_numpy_arrays_are_refused_after_their_own_checks():
    x, w = np.ones(X_SHAPE, f32), np.ones(W_SHAPE, f32)
    with pytest.raises(ValueError, match="channel mismatch"):
        cudnn.fprop(x, np.ones((4, 2, 3, 3), f32))
    with pytest.raises(TypeError, match=r"CuPy \(GPU\) arrays only"):
        cudnn.fprop(x, w)
    with pytest.raises(TypeError, match=r"CuPy \(GPU\) arrays only"):
        cudnn.bprop(np.ones((2, 4, 6, 6), f32), w, X_SHAPE)
    with pytest.raises(TypeError, match=r"CuPy \(GPU\) arrays only"):
        cudnn.accgrad(np.ones((2, 4, 6, 6), f32), x, W_SHAPE)


def test_auto_backends_setting_includes_or_leaves_out_cudnn(settings):
    settings(auto_backends="ours")
    assert "cudnn" not in backends.auto_registry() and "gemm" in backends.auto_registry()
    settings(auto_backends="gemm,cudnn")
    assert list(backends.auto_registry()) == ["gemm", "cudnn"]
    settings(auto_backends=None)
    assert "cudnn" in backends.auto_registry()


def test_auto_on_numpy_arrays_never_times_cudnn(settings, tmp_path):
    """cudnn takes CuPy arrays only: on the CPU it is no candidate, even where cuDNN is installed."""
    settings(auto_tune="on", auto_backends="gemm,cudnn", tune_cache=str(tmp_path / "t.json"))
    assert not auto.runs_on(cudnn, np) and auto.runs_on(backends.gemm, np)
    assert backends.choose("auto", "fprop", (2, 3, 9, 9), W_SHAPE, (1, 1), (1, 1)) is backends.gemm


# -- on a GPU with cuDNN -------------------------------------------------------------------------

def _need_cudnn():
    if not cudnn.available():
        pytest.skip(f"cuDNN not usable: {cudnn._frontend()[1]}")
    import cupy
    return cupy


GEOMETRIES = [((2, 3, 9, 9), (4, 3, 3, 3), (1, 1), (1, 1)),
              ((3, 5, 11, 7), (6, 5, 3, 5), (2, 1), (1, 2)),    # strided, padded, rectangular
              ((2, 4, 13, 13), (3, 4, 5, 5), (3, 3), (0, 0)),
              ((4, 16, 14, 14), (8, 16, 1, 1), (2, 2), (0, 0)),  # a ResNet-style 1x1 shortcut
              ((1, 1, 5, 6), (1, 1, 5, 6), (1, 1), (0, 0)),      # kernel = input
              ((2, 8, 12, 10), (16, 8, 7, 7), (1, 1), (3, 3))]


@pytest.mark.gpu
@pytest.mark.parametrize("xs,ws,stride,pad", GEOMETRIES)
def test_three_passes_strict_fp32(xs, ws, stride, pad, settings, tmp_path):
    _need_cudnn()
    settings(tf32=False, tune_cache=str(tmp_path / "t.json"))
    rng = np.random.default_rng(17)
    x, w = rng.standard_normal(xs).astype(f32), rng.standard_normal(ws).astype(f32)
    check_backend(cudnn, x, w, stride, pad, device="cuda", tol=1e-5, rng=rng)
    assert {k[3] for k in cudnn.built() if k[2] == backends.geometry(xs, ws, stride, pad)} == {"fp32"}


@pytest.mark.gpu
@pytest.mark.parametrize("xs,ws,stride,pad", GEOMETRIES[:3])
def test_three_passes_tf32(xs, ws, stride, pad, settings, tmp_path):
    _need_cudnn()
    settings(tf32=True, tune_cache=str(tmp_path / "t.json"))
    rng = np.random.default_rng(18)
    x, w = rng.standard_normal(xs).astype(f32), rng.standard_normal(ws).astype(f32)
    errs = check_backend(cudnn, x, w, stride, pad, device="cuda", tol=cgemm.TF32_TOL, rng=rng)
    assert max(errs.values()) <= cgemm.TF32_TOL
    assert "tf32" in {k[3] for k in cudnn.built() if k[2] == backends.geometry(xs, ws, stride, pad)}


@pytest.mark.gpu
def test_engine_choice_is_cached_and_reused(settings, tmp_path, monkeypatch):
    cp = _need_cudnn()
    settings(tf32=False, tune_cache=str(tmp_path / "t.json"), cudnn_tune="on")
    rng = np.random.default_rng(19)
    xs, ws = (3, 6, 15, 15), (5, 6, 3, 3)
    x, w = rng.standard_normal(xs).astype(f32), rng.standard_normal(ws).astype(f32)
    y1 = cp.asnumpy(cudnn.fprop(cp.asarray(x), cp.asarray(w), padding=(1, 1)))
    g = backends.geometry(xs, ws, (1, 1), (1, 1))
    record = tuning.default_cache().get(tuning.key(cp, f32, g, "fprop", "cudnn", math="fp32"))
    assert tuning.is_record(record), record
    assert record["ms"] or record["why"] == "only candidate", record
    # A new process: no built graph, no memo; the choice comes from the file, never searched again.
    cudnn._built.clear()
    tuning._memo.clear()
    tuning._caches.clear()
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: pytest.fail("cudnn searched a cached geometry again"))
    y2 = cp.asnumpy(cudnn.fprop(cp.asarray(x), cp.asarray(w), padding=(1, 1)))
    (name, _), = [v for k, v in cudnn.built().items() if k[2] == g and k[1] == "fprop"]
    assert name == record["choice"]
    y_ref = conv_reference(x, w, np.zeros((3, 5, 15, 15), f32), (1, 1), (1, 1))[0]
    assert rel_error(y2, y_ref) <= 1e-5 and rel_error(y1, y_ref) <= 1e-5


@pytest.mark.gpu
def test_workspace_bound_is_honoured(settings, tmp_path):
    cp = _need_cudnn()
    settings(tune_cache=str(tmp_path / "t.json"), cudnn_workspace_mb=2**-20)   # one byte: none
    rng = np.random.default_rng(20)
    xs, ws = (4, 8, 20, 20), (8, 8, 5, 5)
    x, w = rng.standard_normal(xs).astype(f32), rng.standard_normal(ws).astype(f32)
    check_backend(cudnn, x, w, (1, 1), (2, 2), device="cuda", tol=1e-5, rng=rng)
    g = backends.geometry(xs, ws, (1, 1), (2, 2))
    mine = {k: v for k, v in cudnn.built().items() if k[2] == g}
    assert len(mine) == 3 and all(k[4] == 1 and workspace <= 1 for k, (_, workspace) in mine.items()), mine


@pytest.mark.gpu
def test_auto_times_cudnn_among_the_candidates(settings, tmp_path):
    cp = _need_cudnn()
    settings(auto_tune="on", tune_cache=str(tmp_path / "t.json"), auto_backends="gemm,direct,cudnn")
    xs, ws = (8, 16, 16, 16), (16, 16, 3, 3)
    for pass_name in backends.PASSES:
        chosen = backends.choose("auto", pass_name, xs, ws, (1, 1), (1, 1), cp)
        assert chosen in (backends.gemm, backends.direct, cudnn)
    rows = [r for r in auto.choices() if r["geometry"][:4] == [8, 16, 16, 16] and r["geometry"][9] == 1]
    assert len(rows) >= 3
    for r in rows:
        assert set(r["ms"]) | set(r["skipped"]) == {"gemm", "direct", "cudnn"}, r
        assert "cudnn" in r["ms"], r      # cudnn ran, agreed with gemm and was timed
    settings(auto_backends="ours")
    assert "cudnn" not in backends.auto_registry()
    assert backends.choose("auto", "fprop", xs, ws, (1, 1), (1, 1), cp) is not cudnn
