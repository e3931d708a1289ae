"""Faults lose nothing, runs are reproducible, and every backend agrees with the
float64 reference on random geometries. RELIABILITY.md quotes the constants here."""
import json
import os
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minitorch_fft import backends
import minitorch_fft as mt
from minitorch_fft import models
import train
from conftest import backend_usable
from reference import check_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_EXAMPLES = 150   # random geometries per backend in CI (each checks fprop, bprop, accGrad)
GPU_EXAMPLES = 300   # the larger run on a GPU


@st.composite
def geometries(draw):
    kh, kw = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    ph, pw = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    sh, sw = draw(st.sampled_from([1, 1, 1, 2, 3, 4])), draw(st.sampled_from([1, 1, 1, 2, 3, 4]))
    h = draw(st.integers(max(1, kh - 2 * ph), 40))
    w = draw(st.integers(max(1, kw - 2 * pw), 40))
    S, f, fo = draw(st.integers(1, 4)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    return (S, f, h, w), (fo, f, kh, kw), (sh, sw), (ph, pw)


# Backends for one kernel size, which the draw above rarely gives: they take their own draw
# (test_narrow_backends_agree_on_random_3x3_geometries), and stay out of agreement_run.
NARROW = {"winograd": "3x3 kernels, stride 1"}


def agreement_run(device, n_examples, compare=True, shard=(0, 1)):
    """Draw n geometries; every backend that supports one must match the reference on all passes.
    Returns {backend: geometries it supported}, counted over all n. compare=False only counts
    (same geometries). shard=(i, k) compares only the draws whose geometry hashes to i modulo k, so
    that k processes share one draw (the GPU run: its 300 took 436 s in one, session 46). Each draw's
    data comes from a generator seeded by the same hash: a function of the geometry alone, so the
    shard and the data are the same whichever process draws it, and when Hypothesis replays or
    shrinks a failure."""
    xp = np if device == "cpu" else mt.device.cupy_or_none()
    names = [n for n in backends.names() if backends.auto.runs_on(backends.get(n), xp)]   # cudnn: GPU only
    tried = {name: 0 for name in names}
    drawn, (mine, shards) = [0], shard

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(geometries())
    def check(geom):
        xs, ws, stride, pad = geom
        drawn[0] += 1
        key = zlib.crc32(repr(geom).encode())
        rng = np.random.default_rng([0, key])
        x = rng.standard_normal(xs).astype(np.float32)
        w = rng.standard_normal(ws).astype(np.float32)
        for name in names:
            b = backends.get(name)
            if name not in NARROW and b.supports(xs, ws, stride, pad):
                if compare and key % shards == mine:
                    check_backend(b, x, w, stride, pad, device=device, rng=rng)
                tried[name] += 1

    check()
    assert drawn[0] == n_examples, "the draw ran a different number of examples than asked"
    return tried


def check_coverage(tried, n):
    """The floors RELIABILITY.md quotes: gemm and direct take every geometry, the FFT
    backends (stride 1, bounded basis) at least a fifth of them. A backend this machine cannot
    run (cudnn without cuDNN installed) takes none, and its callers check that."""
    assert tried["gemm"] == n and tried.get("direct", n) == n, tried
    assert all(v >= n // 5 for name, v in tried.items() if name not in NARROW and backend_usable(name)), tried


@st.composite
def geometries_3x3(draw):
    """geometries() with the kernel 3x3 and the stride 1: what the NARROW backends take."""
    (S, f, h, w), (fo, _, _, _), _, (ph, pw) = draw(geometries())
    return (S, f, max(h, 3 - 2 * ph), max(w, 3 - 2 * pw)), (fo, f, 3, 3), (1, 1), (ph, pw)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_narrow_backends_agree_on_random_3x3_geometries(device):
    rng = np.random.default_rng(1)

    @settings(max_examples=CPU_EXAMPLES // 3, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(geometries_3x3())
    def check(geom):
        xs, ws, stride, pad = geom
        x = rng.standard_normal(xs).astype(np.float32)
        w = rng.standard_normal(ws).astype(np.float32)
        for name in NARROW:
            assert backends.get(name).supports(xs, ws, stride, pad), (name, geom)
            check_backend(backends.get(name), x, w, stride, pad, device=device, rng=rng)

    check()


def test_every_backend_agrees_on_random_geometries():
    check_coverage(agreement_run("cpu", CPU_EXAMPLES), CPU_EXAMPLES)


GPU_SHARDS = 3   # benchmarks/gpu_all.sh runs them side by side, one a worker (RELIABILITY_WORKERS)


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(GPU_SHARDS))
def test_every_backend_agrees_on_random_geometries_gpu(settings, shard):
    # cudnn among them where cuDNN is installed, on cuDNN's first plan: searching every plan of
    # 300 geometries is the tuner's work, tested in test_cudnn.py; tiledfft on its heuristic
    # basis likewise (its tuning, tested in test_tiledfft.py, took the whole suite past 400 s)
    settings(cudnn_tune="off", tiledfft_tune="off")
    tried = agreement_run("cuda", GPU_EXAMPLES, shard=(shard, GPU_SHARDS))
    check_coverage(tried, GPU_EXAMPLES)
    assert tried["cudnn"] == (GPU_EXAMPLES if backends.cudnn.available() else 0), tried


def test_whole_model_gradient_matches_finite_differences():
    """Directional derivative of the digits CNN's loss in parameter space: autograd's dot
    product vs a central difference. The direction is half autograd's own gradient, half
    random: a purely random unit direction has a derivative of order |grad| / sqrt(#params),
    which float32 rounding of the loss swamps (seed-dependent errors of 1-10 %). Along this
    one the derivative is of order |grad|, and a wrong gradient in any layer still shows."""
    mt.manual_seed(0)
    net = models.get("digits", 10).eval()  # eval: dropout is the identity, the loss is deterministic
    rng = np.random.default_rng(1)
    x = mt.Tensor(rng.standard_normal((6, 1, 8, 8)))
    y = rng.integers(0, 10, 6)
    params = net.parameters()
    loss = mt.CrossEntropyCriterion()(net(x), y)
    loss.backward()
    grads = [p.grad.astype(np.float64) for p in params]
    noise = [rng.standard_normal(p.shape) for p in params]
    dirs = [g / _norm(grads) + r / _norm(noise) for g, r in zip(grads, noise)]
    dirs = [(d / _norm(dirs)).astype(np.float32) for d in dirs]  # a unit step
    analytic = sum(float((p.grad.astype(np.float64) * d).sum()) for p, d in zip(params, dirs))

    def loss_at(eps):
        saved = [p.data.copy() for p in params]
        for p, d in zip(params, dirs):
            p.data = p.data + np.float32(eps) * d
        with mt.no_grad():
            v = float(mt.CrossEntropyCriterion()(net(x), y).data)
        for p, s in zip(params, saved):
            p.data = s
        return v

    eps = 1e-3  # seeds 0-7 measured: relative error 2.5e-5 to 3.3e-3 (at 1e-2, up to 2.4e-2: kinks)
    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    assert abs(numeric - analytic) <= 1e-2 * abs(analytic), (numeric, analytic)


def _norm(arrays):
    return np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrays))


def test_same_seed_is_bit_identical(tmp_path):
    paths = [str(tmp_path / f"{i}.ckpt") for i in range(2)]
    for p in paths:
        assert train.main(["--no-progress", "--epochs", "2", "--checkpoint", p]) == 0
    a, b = (dict(np.load(p)) for p in paths)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a if k.startswith(("model/", "optim/")))


def test_ctrl_c_saves_and_resume_matches_the_uninterrupted_run(tmp_path):
    """SIGINT mid-run: a consistent checkpoint, exit 130; --resume then ends where a
    run that was never interrupted ends, loss curve and all."""
    epochs = "12"
    ckpt = str(tmp_path / "run.ckpt")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--no-progress", "--epochs", epochs,
           "--checkpoint", ckpt]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not os.path.exists(ckpt) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)  # wait for the first epoch's checkpoint: training is under way
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted in epoch" in err and "Traceback" not in err
    meta = mt.checkpoint.load(ckpt, models.get("digits", 10))
    assert meta["epoch"] < int(epochs)

    resumed = subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    straight = subprocess.run(cmd[:-2], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert json.loads(resumed.stdout.splitlines()[-1])["history"] == \
        json.loads(straight.stdout.splitlines()[-1])["history"]


class _OOMBackend:
    """Stands in for an FFT backend whose buffers do not fit."""
    __name__ = "backends.oom_stub"

    @staticmethod
    def supports(*args):
        return True

    @staticmethod
    def fprop(*args, **kwargs):
        raise MemoryError("Out of memory allocating 921 MB (stub)")

    bprop = accgrad = fprop


def test_out_of_memory_falls_back_to_chunked_gemm_and_says_so_once(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY, "oom_stub", _OOMBackend)
    mt.manual_seed(0)
    layer = mt.SpatialConvolution(3, 4, 3, padding=1, backend="oom_stub")
    ref = mt.SpatialConvolution(3, 4, 3, padding=1, backend="gemm")
    ref.load_state_dict(layer.state_dict())
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    with pytest.warns(ResourceWarning, match="ran out of GPU memory in fprop.*falling back to gemm"):
        y = layer(mt.Tensor(x, requires_grad=True))
    assert np.array_equal(y.data, ref(mt.Tensor(x)).data)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call at the same geometry is silent
        layer(mt.Tensor(x))


@pytest.mark.gpu
def test_gpu_out_of_memory_in_fft_buffers_falls_back_and_frees(monkeypatch):
    """Table 4's L2 (64 planes of 64x64, 9x9 kernel, batch 128) under a memory cap that the cufft
    buffers (frequency-domain copies of every plane) exceed but chunked gemm fits in: the layer
    warns once, returns the right answer, and leaves no scratch allocated."""
    import cupy as cp

    from minitorch_fft.backends import cufft
    monkeypatch.setattr(backends, "_warned", set())
    mt.manual_seed(0)
    layer = mt.SpatialConvolution(64, 64, 9, bias=False, backend="cufft").to("cuda")
    x = mt.Tensor(cp.random.standard_normal((128, 64, 64, 64), dtype=cp.float32))
    expected = backends.gemm.fprop(x.data, layer.weight.data)          # 103 MB output
    cufft.release_buffers()
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before, old_limit = pool.used_bytes(), pool.get_limit()
    pool.set_limit(size=before + 600 * 2**20)                         # 600 MiB on top of the inputs
    try:
        with pytest.warns(ResourceWarning, match="cufft ran out of GPU memory in fprop"):
            y = layer(x)
    finally:
        pool.set_limit(size=old_limit)
    assert float(cp.linalg.norm(y.data - expected) / cp.linalg.norm(expected)) < 1e-5
    del expected
    pool.free_all_blocks()
    assert pool.used_bytes() <= before + y.data.nbytes  # only the output is still held
