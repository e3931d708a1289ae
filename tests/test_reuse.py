"""Spectra shared across a training step's passes (backends/reuse.py), for cufft and fbfft.

Every result under reuse_spectra() must equal, bit for bit, the result without it (the same
FFTs on the same arrays, computed once instead of twice), and both must match PyTorch in float64.
"""
import numpy as np
import pytest

from minitorch_fft import backends
import minitorch_fft as mt
from minitorch_fft.backends import auto, cufft, fbfft, reuse
from minitorch_fft.backends.common import geometry
from conftest import DEVICES
from minitorch_fft.device import to_device
from reference import conv_reference, rel_error

FFT_BACKENDS = ["cufft", "fbfft"]


@pytest.fixture(autouse=True)
def untuned(tmp_path, monkeypatch, settings):
    """cufft untuned (its smallest basis), each test with its own tuning-cache file; layers keep
    weight spectra too (reuse_weight_spectra), so that every sharing path is exercised."""
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "autotune.json"))
    settings(cufft_tune="off", reuse_weight_spectra=True)


def operands(shape_x=(3, 4, 9, 10), shape_w=(5, 4, 3, 3), padding=(1, 2), seed=0):
    rng = np.random.default_rng(seed)
    g = geometry(shape_x, shape_w, (1, 1), padding)
    return tuple(rng.standard_normal(s).astype(np.float32)
                 for s in (shape_x, shape_w, (g.S, g.fo, g.oh, g.ow)))


def passes(backend, x, w, gy, padding):
    """fprop, bprop, accGrad of one backend module, in the order a training step runs them."""
    return (backend.fprop(x, w, padding=padding), backend.bprop(gy, w, x.shape, padding=padding),
            backend.accgrad(gy, x, w.shape, padding=padding))


def layer_step(backend, x, w, b, gy, padding, device):
    """One layer's forward and backward through autograd: (y, dx, dw, db) on the host."""
    layer = mt.SpatialConvolution(w.shape[1], w.shape[0], w.shape[2:], padding=padding, backend=backend)
    layer.weight.data, layer.bias.data = to_device(w, device), to_device(b, device)
    xt = mt.Tensor(to_device(x, device), requires_grad=True)
    y = layer(xt)
    (y * mt.Tensor(to_device(gy, device))).sum().backward()   # dL/dy = gy
    return tuple(to_device(a, "cpu") for a in (y.data, xt.grad, layer.weight.grad, layer.bias.grad))


def roles(cache):
    return sorted((k.backend, k.role) for k in cache.hit_keys)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FFT_BACKENDS)
def test_a_layer_step_with_reuse_equals_one_without(name, device):
    """A SpatialConvolution's forward and backward: identical results, three FFTs saved (w in
    bprop, x and gy in accGrad), and nothing kept after the block."""
    padding = (1, 2)
    x, w, gy = operands(padding=padding)
    b = np.random.default_rng(1).standard_normal(w.shape[0]).astype(np.float32)
    plain = layer_step(name, x, w, b, gy, padding, device)
    with backends.reuse_spectra() as cache:
        shared = layer_step(name, x, w, b, gy, padding, device)
    assert roles(cache) == [(name, "gy"), (name, "w"), (name, "x")]
    assert (cache.hits, cache.misses) == (3, 3)
    assert len(cache) == 0 and reuse.active() is None
    for a, c in zip(plain, shared, strict=True):
        np.testing.assert_array_equal(a, c)
    y_ref, gx_ref, gw_ref = conv_reference(x, w, gy, (1, 1), padding)
    for got, ref in zip(shared[:3], (y_ref + b.reshape(1, -1, 1, 1), gx_ref, gw_ref), strict=True):
        assert rel_error(got, ref) < 1e-5


@pytest.mark.parametrize("name", FFT_BACKENDS)
def test_a_two_layer_net_reuses_per_layer(name):
    """conv -> ReLU -> conv on an image that wants no gradient: the second layer saves all 3
    FFTs; the first skips bprop, so only its x spectrum is asked for again (its accGrad computes
    gy's and keeps it not, and its weight's is not kept: no bprop will ask)."""
    mt.manual_seed(0)
    net = mt.Sequential(mt.SpatialConvolution(2, 3, 3, padding=1, backend=name), mt.ReLU(),
                        mt.SpatialConvolution(3, 4, 3, padding=1, backend=name))
    x = np.random.default_rng(2).standard_normal((2, 2, 7, 7)).astype(np.float32)

    def step():
        net.zero_grad()
        y = net(mt.Tensor(x))
        (y * y).sum().backward()
        return [y.data] + [p.grad for p in net.parameters()]

    plain = step()
    with backends.reuse_spectra() as cache:
        shared = step()
        assert len(cache) == 0                   # nothing waits for a pass that will not come
    assert roles(cache) == [(name, "gy"), (name, "w"), (name, "x"), (name, "x")]
    assert cache.misses == 6 and len(cache) == 0
    for a, c in zip(plain, shared, strict=True):
        np.testing.assert_array_equal(a, c)
    for got, ref in zip(shared, two_layer_reference(net, x), strict=True):
        assert rel_error(got, ref) < 1e-5


def two_layer_reference(net, x):
    """[y, dW1, db1, dW2, db2] of conv -> ReLU -> conv and loss sum(y^2), by PyTorch in float64."""
    import torch
    import torch.nn.functional as TF
    params = [torch.tensor(np.asarray(p.data, np.float64), requires_grad=True) for p in net.parameters()]
    w1, b1, w2, b2 = params
    y = TF.conv2d(TF.relu(TF.conv2d(torch.tensor(x, dtype=torch.float64), w1, b1, padding=1)), w2, b2, padding=1)
    (y * y).sum().backward()
    return [y.detach().numpy()] + [p.grad.numpy() for p in params]


def test_no_sharing_across_backends(monkeypatch):
    """auto running a layer's fprop and bprop on cufft and its accGrad on fbfft, on a geometry
    where both use a 16x16 basis and place x and gy at the origin: cufft's spectra (another
    layout) are never handed to fbfft; only cufft's weight spectrum serves cufft's bprop."""
    picks = {"fprop": "cufft", "bprop": "cufft", "accgrad": "fbfft"}
    x, w, gy = operands((2, 3, 16, 16), (4, 3, 3, 3), (0, 0))
    assert cufft.default_config(geometry(x.shape, w.shape))["basis"] == [16, 16]
    b = np.zeros(w.shape[0], np.float32)
    expected = (layer_step("cufft", x, w, b, gy, (0, 0), "cpu")[:2]          # y, dx
                + layer_step("fbfft", x, w, b, gy, (0, 0), "cpu")[2:])         # dw, db
    monkeypatch.setattr(auto, "pick", lambda registry, pass_name, *args, **kwargs: picks[pass_name])
    with backends.reuse_spectra() as cache:
        got = layer_step("auto", x, w, b, gy, (0, 0), "cpu")
    assert roles(cache) == [("cufft", "w")] and cache.misses == 5
    for a, c in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, c)
    for a, ref in zip(got[:3], conv_reference(x, w, gy, (1, 1), (0, 0)), strict=True):
        assert rel_error(a, ref) < 1e-5


def kept_roles(cache):
    return sorted(key.role for key, _ in cache._entries)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_a_pass_keeps_only_spectra_a_later_pass_takes(monkeypatch, requires_grad):
    """auto runs a layer's fprop and accGrad on fbfft and its bprop on gemm: fprop keeps x's
    spectrum (accGrad takes it) and not w's (bprop runs elsewhere); bprop and accGrad keep none.
    With an input that wants no gradient there is no bprop at all. Results as without the block."""
    picks = {"fprop": "fbfft", "bprop": "gemm", "accgrad": "fbfft"}
    monkeypatch.setattr(auto, "pick", lambda registry, pass_name, *args, **kwargs: picks[pass_name])
    monkeypatch.setattr(auto, "remembered", lambda registry, pass_name, *args, **kwargs: picks[pass_name])
    padding = (1, 2)
    x, w, gy = operands(padding=padding)
    layer = mt.SpatialConvolution(w.shape[1], w.shape[0], w.shape[2:], padding=padding, backend="auto")
    layer.weight.data, layer.bias.data = w, np.zeros(w.shape[0], np.float32)
    xt = mt.Tensor(x, requires_grad=requires_grad)
    with backends.reuse_spectra() as cache:
        y = layer(xt)
        assert kept_roles(cache) == ["x"]
        (y * mt.Tensor(gy)).sum().backward()
        assert len(cache) == 0
    assert roles(cache) == [("fbfft", "x")]
    y_ref, gx_ref, gw_ref = conv_reference(x, w, gy, (1, 1), padding)
    assert rel_error(y.data, y_ref) < 1e-5 and rel_error(layer.weight.grad, gw_ref) < 1e-5
    assert (xt.grad is None) if not requires_grad else rel_error(xt.grad, gx_ref) < 1e-5


@pytest.mark.parametrize("name", FFT_BACKENDS)
def test_layers_keep_no_weight_spectrum_by_default(name, settings):
    """reuse_weight_spectra off (the default): a layer's fprop keeps x's spectrum only, bprop
    computes the weight's again; the results equal those without the block, bit for bit."""
    settings(reuse_weight_spectra=False)
    padding = (1, 2)
    x, w, gy = operands(padding=padding)
    b = np.zeros(w.shape[0], np.float32)
    plain = layer_step(name, x, w, b, gy, padding, "cpu")
    with backends.reuse_spectra() as cache:
        shared = layer_step(name, x, w, b, gy, padding, "cpu")
        assert len(cache) == 0
    assert roles(cache) == [(name, "gy"), (name, "x")] and cache.misses == 4
    for a, c in zip(plain, shared, strict=True):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FFT_BACKENDS)
def test_a_block_without_input_spectra_keeps_nothing_across_forward(name, device, settings):
    """reuse_spectra(inputs=False): after the forward pass nothing is held (where a step's memory
    peaks); the backward's gy spectrum still serves accGrad; results bit for bit as without."""
    settings(reuse_weight_spectra=True)          # even so: the weight's is kept for bprop, x's not
    padding = (1, 2)
    x, w, gy = operands(padding=padding)
    b = np.zeros(w.shape[0], np.float32)
    plain = layer_step(name, x, w, b, gy, padding, device)
    layer = mt.SpatialConvolution(w.shape[1], w.shape[0], w.shape[2:], padding=padding, backend=name)
    layer.weight.data, layer.bias.data = to_device(w, device), to_device(b, device)
    with backends.reuse_spectra(inputs=False) as cache:
        xt = mt.Tensor(to_device(x, device), requires_grad=True)
        y = layer(xt)
        assert [k.role for (k, _) in cache._entries] == ["w"]   # x's spectrum not kept
        (y * mt.Tensor(to_device(gy, device))).sum().backward()
        assert len(cache) == 0
    assert roles(cache) == [(name, "gy"), (name, "w")]
    shared = tuple(to_device(a, "cpu") for a in (y.data, xt.grad, layer.weight.grad, layer.bias.grad))
    for a, c in zip(plain, shared, strict=True):
        np.testing.assert_array_equal(a, c)


def test_a_gy_spectrum_no_pass_took_is_dropped_after_the_layer(monkeypatch, settings):
    """auto's first step: bprop runs on cufft and keeps gy's spectrum for accGrad, not tuned yet (so
    counted as cufft), which then runs on gemm. Nothing takes the spectrum; it is dropped once the
    layer's last pass has run, not held to the end of the block. Results as without the block."""
    settings(reuse_weight_spectra=False)
    picks = {"fprop": "gemm", "bprop": "cufft", "accgrad": "gemm"}
    monkeypatch.setattr(auto, "pick", lambda registry, pass_name, *args, **kwargs: picks[pass_name])
    monkeypatch.setattr(auto, "remembered", lambda *args, **kwargs: None)   # nothing tuned yet
    padding = (1, 2)
    x, w, gy = operands(padding=padding)
    layer = mt.SpatialConvolution(w.shape[1], w.shape[0], w.shape[2:], padding=padding, backend="auto")
    layer.weight.data, layer.bias.data = w, np.zeros(w.shape[0], np.float32)
    xt = mt.Tensor(x, requires_grad=True)
    kept = []
    real = backends.run_pass

    def run_pass(name, pass_name, *args, **kwargs):
        out = real(name, pass_name, *args, **kwargs)
        kept.append((pass_name, kept_roles(reuse.active())))
        return out
    monkeypatch.setattr(backends, "run_pass", run_pass)
    with backends.reuse_spectra(inputs=False) as cache:
        y = layer(xt)
        (y * mt.Tensor(gy)).sum().backward()
        assert len(cache) == 0
    assert kept == [("fprop", []), ("bprop", ["gy"]), ("accgrad", [])]
    assert cache.hits == 0
    y_ref, gx_ref, gw_ref = conv_reference(x, w, gy, (1, 1), padding)
    assert rel_error(y.data, y_ref) < 1e-5 and rel_error(xt.grad, gx_ref) < 1e-5
    assert rel_error(layer.weight.grad, gw_ref) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_the_adapters_order_drops_a_gy_spectrum_bprop_did_not_take(device):
    """The PyTorch adapter's backward runs accGrad (later=("bprop",)) then bprop (later=()): an
    accGrad on cufft keeps gy's spectrum for bprop, which runs on gemm and does not take it; after
    bprop nothing is kept. Twice: on the GPU the second round takes run_pass's prepared path."""
    padding = (1, 2)
    x, w, gy = (to_device(a, device) for a in operands(padding=padding))
    g = dict(x_shape=x.shape, w_shape=w.shape, stride=(1, 1), padding=padding)
    _, gx_ref, gw_ref = conv_reference(*(to_device(a, "cpu") for a in (x, w, gy)), (1, 1), padding)
    for _ in range(2):
        with backends.reuse_spectra(inputs=False) as cache:
            gw = backends.run_pass("cufft", "accgrad", gy, x, w.shape, later=("bprop",), **g)
            assert kept_roles(cache) == ["gy"]
            gx = backends.run_pass("gemm", "bprop", gy, w, x.shape, later=(), **g)
            assert len(cache) == 0 and cache.hits == 0
        assert rel_error(to_device(gw, "cpu"), gw_ref) < 1e-5
        assert rel_error(to_device(gx, "cpu"), gx_ref) < 1e-5


def test_no_sharing_across_bases(monkeypatch):
    """A cufft accGrad tuned to a larger basis than fprop and bprop computes its own spectra of x
    and gy; fprop's weight spectrum still serves bprop (same basis)."""
    def run(xp, pass_name, g, run_config):
        config = cufft.default_config(g)
        if pass_name == "accgrad":
            config["basis"] = [n + 2 for n in config["basis"]]
        return run_config(config)

    monkeypatch.setattr(cufft, "_run", run)
    padding = (1, 2)
    x, w, gy = operands(padding=padding)
    plain = passes(cufft, x, w, gy, padding)
    with backends.reuse_spectra() as cache:
        shared = passes(cufft, x, w, gy, padding)
        assert len(cache) == 4                   # x and gy on each basis, none asked for again
    assert roles(cache) == [("cufft", "w")] and cache.misses == 5
    for a, c in zip(plain, shared, strict=True):
        np.testing.assert_array_equal(a, c)
    for got, ref in zip(shared, conv_reference(x, w, gy, (1, 1), padding), strict=True):
        assert rel_error(got, ref) < 1e-5


def test_fbfft_keeps_apart_an_input_placed_at_other_offsets():
    """One x under two paddings that share fbfft's 16x16 basis: x sits at (1, 1) and at (2, 2),
    so its spectra differ and only the weight's is shared."""
    x, w, _ = operands((2, 3, 9, 9), (4, 3, 3, 3), (1, 1))
    plain = [fbfft.fprop(x, w, padding=p) for p in ((1, 1), (2, 2))]
    with backends.reuse_spectra() as cache:
        shared = [fbfft.fprop(x, w, padding=p) for p in ((1, 1), (2, 2))]
    assert roles(cache) == [("fbfft", "w")]
    for a, c in zip(plain, shared, strict=True):
        np.testing.assert_array_equal(a, c)
    for y, p in zip(shared, ((1, 1), (2, 2)), strict=True):
        g = geometry(x.shape, w.shape, (1, 1), p)
        ref = conv_reference(x, w, np.zeros((g.S, g.fo, g.oh, g.ow)), (1, 1), p)[0]
        assert rel_error(y, ref) < 1e-5


@pytest.mark.parametrize("name", FFT_BACKENDS)
def test_chunked_batches_share_only_the_weight(name, settings):
    """One image per chunk: chunk spectra are never kept, the (unchunked) weight's still is."""
    backend = backends.get(name)
    settings(**{f"{name}_workspace_mb": 2**-20})
    padding = (1, 1)
    x, w, gy = operands(padding=padding)
    plain = passes(backend, x, w, gy, padding)
    with backends.reuse_spectra() as cache:
        shared = passes(backend, x, w, gy, padding)
    assert roles(cache) == [(name, "w")]
    for a, c in zip(plain, shared, strict=True):
        np.testing.assert_array_equal(a, c)
    for got, ref in zip(shared, conv_reference(x, w, gy, (1, 1), padding), strict=True):
        assert rel_error(got, ref) < 1e-5


def test_the_cache_is_dropped_after_the_block_even_on_error():
    x, w, _ = operands()
    with pytest.raises(RuntimeError, match="stop"):
        with backends.reuse_spectra() as cache:
            fbfft.fprop(x, w, padding=(1, 2))
            assert len(cache) == 2 and reuse.active() is cache
            raise RuntimeError("stop")
    assert len(cache) == 0 and reuse.active() is None
    with backends.reuse_spectra() as outer:
        with backends.reuse_spectra() as inner:
            fbfft.fprop(x, w, padding=(1, 2))
        assert reuse.active() is outer and len(outer) == 0 and inner.misses == 2
    assert backends.cufft.reuse_spectra is backends.reuse_spectra   # the older name still works


def test_tuners_time_every_candidate_without_sharing(tmp_path, monkeypatch, settings):
    """auto and cufft's tuner call a pass many times on the same arrays while timing it: inside a
    step those calls must not be served from the step's cache."""
    monkeypatch.setenv("MINITORCH_AUTO_TUNE", "on")
    monkeypatch.setattr(auto, "_memory", {})
    settings(cufft_tune="on")
    x, w, _ = operands((2, 3, 6, 6), (4, 3, 3, 3), (0, 0))
    with backends.reuse_spectra() as cache:
        backends.choose("auto", "fprop", x.shape, w.shape, (1, 1), (0, 0))
        assert (cache.hits, cache.misses) == (0, 0)
        cufft.fprop(x, w)                        # tunes (many calls), then runs the winner once
    assert (cache.hits, cache.misses) == (0, 2)


class _OutOfMemory:
    __name__ = "backends.oom_stub"

    @staticmethod
    def supports(*args):
        return True

    @staticmethod
    def bprop(*args, **kwargs):
        raise MemoryError("out of memory (stub)")


@pytest.mark.parametrize("name", FFT_BACKENDS)
def test_a_layers_accgrad_keeps_nothing_when_its_bprop_ran_first(name, monkeypatch):
    """The framework's layers run bprop, then accGrad: accGrad's gy spectrum has no consumer left
    (the PyTorch adapter's order, accGrad first, is the one that keeps it for bprop). Where accGrad
    computes gy's spectrum again (bprop's was dropped: an out-of-memory fallback, or a cufft basis
    tuned apart), the block must not hold it until it ends."""
    real = backends.run_pass

    def run_pass(backend, pass_name, *args, **kwargs):
        if pass_name == "accgrad":
            reuse.drop()
        return real(backend, pass_name, *args, **kwargs)

    monkeypatch.setattr(backends, "run_pass", run_pass)
    x, w, gy = operands(padding=(1, 1))
    layer = mt.SpatialConvolution(w.shape[1], w.shape[0], w.shape[2:], padding=(1, 1), backend=name)
    layer.weight.data = w
    with backends.reuse_spectra() as cache:
        y = layer(mt.Tensor(x, requires_grad=True))
        (y * mt.Tensor(gy)).sum().backward()
        assert len(cache) == 0


def test_out_of_memory_fallback_drops_the_steps_spectra(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY, "oom_stub", _OutOfMemory)
    monkeypatch.setattr(backends, "_warned", set())
    x, w, gy = operands(padding=(0, 0))
    with backends.reuse_spectra() as cache:
        fbfft.fprop(x, w)
        assert len(cache) == 2
        with pytest.warns(ResourceWarning, match="falling back to gemm"):
            gx = backends.run_pass("oom_stub", "bprop", gy, w, x.shape, x_shape=x.shape, w_shape=w.shape,
                                   stride=(1, 1), padding=(0, 0))
        assert len(cache) == 0
    assert rel_error(gx, conv_reference(x, w, gy, (1, 1), (0, 0))[1]) < 1e-5


@pytest.mark.parametrize("name", FFT_BACKENDS + ["polyphase"])
def test_an_optimizer_step_inside_the_block_drops_the_weights_spectra(name):
    """A first layer (its input needs no gradient, so bprop never consumes fprop's weight
    spectrum) updated by SGD inside one reuse_spectra() block: the next forward must see the
    new weights, not the spectrum of the old ones."""
    rng = np.random.default_rng(3)
    stride = 2 if name == "polyphase" else 1
    layer = mt.SpatialConvolution(3, 4, 3, stride=stride, padding=1, backend=name)
    opt = mt.optim.SGD(layer.parameters(), lr=0.5, momentum=0.9)
    x = mt.Tensor(rng.standard_normal((2, 3, 9, 9)).astype(np.float32))
    with backends.reuse_spectra():
        layer(x).sum().backward()
        opt.step()
        after = layer(x).data
    ref, _, _ = conv_reference(x.data, layer.weight.data, np.zeros(after.shape), (stride, stride), (1, 1))
    ref = ref + layer.bias.data.reshape(1, -1, 1, 1)
    assert rel_error(after, ref) < 1e-5


def test_a_block_leaves_wherever_it_is():
    """Blocks end in any order (two threads' steps: the state is the process's, as a CUDA backward
    runs on PyTorch's own thread): the one that ends leaves, the others stay as they were, and
    suspended() hides the block open under it until it ends."""
    first, second = backends.reuse_spectra(), backends.reuse_spectra()
    a = first.__enter__()
    x, w, _ = operands(padding=(0, 0))
    fbfft.fprop(x, w)                          # the first block keeps x's and w's spectra
    assert len(a) == 2
    b = second.__enter__()
    assert reuse.active() is b
    first.__exit__(None, None, None)           # the first opened ends first
    assert reuse.active() is b
    with reuse.suspended():
        assert reuse.active() is None
    assert reuse.active() is b and len(a) == 0
    second.__exit__(None, None, None)
    assert reuse.active() is None and not reuse._open


def _consistent(blocks, state, top_state):
    """Under the blocks' lock: the blocks open now and whether `state()` names the last as top_state(last) says."""
    with blocks._lock:
        open_now = list(blocks._blocks.values())
        return open_now, state() is top_state(open_now[-1] if open_now else None)


def run_at_once(worker, threads=4):
    """worker() on `threads` threads at once, switching as often as the interpreter lets them; fails
    plainly if one is still running after a minute (a deadlock?)."""
    import sys
    import threading
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        running = [threading.Thread(target=worker) for _ in range(threads)]
        for t in running:
            t.start()
        for t in running:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in running), "a thread is still running (a deadlock?)"


def test_blocks_of_threads_opening_and_ending_at_once_stay_open_while_they_run():
    """Threads opening and ending reuse_spectra() and keeping() blocks at once: each block is among
    the open ones all the while it runs, the state names the last open block whenever it is read
    under the lock, and none is left open after. (Without a lock, a block's end raised IndexError
    where another thread's block had left the list between its look and its delete, and the list
    rebuilt without a keeping() block could drop another thread's; with on_top outside the lock the
    state could name a block that had left.)"""
    lost, stale, errors = [], [], []
    active_of = lambda b: b if isinstance(b, reuse.StepCache) else None   # noqa: E731
    keep_of = lambda e: None if e is None else e[1]                        # noqa: E731

    def worker():
        try:
            for _ in range(3000):
                with backends.reuse_spectra() as cache, reuse.keeping(("x",)):
                    blocks, ok = _consistent(reuse._open, lambda: reuse._active, active_of)
                    keeps, ok_keep = _consistent(reuse._keeps, lambda: reuse._keep, keep_of)
                    if not any(b is cache for b in blocks) or not keeps:
                        lost.append(cache)
                    if not (ok and ok_keep):
                        stale.append(cache)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    run_at_once(worker)
    assert not errors, errors
    assert not lost, f"{len(lost)} blocks dropped from the open ones while they ran"
    assert not stale, f"the state named another block than the last open one {len(stale)} times"
    assert reuse.active() is None and not reuse._open and reuse._keep is None and not reuse._keeps


def test_a_block_may_end_inside_another_blocks_change():
    """The garbage collector can close an abandoned generator that holds a block (a `with` left
    suspended) in the middle of another block's change, on the same thread (Python 3.12 runs
    collections at a call's start, on_top's too). Simulated here by on_top closing it: no deadlock
    (a plain lock waited on itself), and the state names the last open block after each change,
    also where the block being told about is the one that left (told again)."""
    import threading
    from minitorch_fft.backends.utils import OpenBlocks
    told, state = [], {}

    def holder(blocks, name):
        with blocks.open(name):
            yield

    def scenario():
        abandoned = {}

        def on_top(block):
            g = abandoned.pop(block, None)   # the finaliser runs as `block` is told about
            if g is not None:
                g.close()
            told.append(block)
            state["top"] = block

        blocks = OpenBlocks(on_top)
        g = holder(blocks, "first")
        next(g)                                   # "first" open, its generator left suspended
        with blocks.open("second"):
            assert state["top"] == "second"
            abandoned["first"] = g                # ends while the end of "second" tells about it
        state["done"] = (len(blocks), state["top"])

    t = threading.Thread(target=scenario, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "deadlocked: a block's end waited on the lock its own thread held"
    assert state["done"] == (0, None)
    assert told[-1] is None and "first" in told
