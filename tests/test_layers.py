"""Every layer, forward and gradients, against PyTorch in float64 (the independent reference);
the max-pooling kernels (kernels/pool.cu) compiled for the host against the NumPy passes."""
import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import minitorch_fft as mt
from conftest import DEVICES
from minitorch_fft import functional
from reference import rel_error
from test_cuda_compile import core_gpu_branch, core_host_library


def compare(ours, theirs, inputs, device, rng, tol=1e-5):
    """Run `ours` on float32 Tensors and `theirs` on float64 torch tensors; compare the
    output and the gradient of every input under the same random upstream gradient."""
    ts = [mt.Tensor(mt.to_device(a, device), requires_grad=True) for a in inputs]
    out = ours(*ts)
    tt = [torch.tensor(a.astype(np.float64), requires_grad=True) for a in inputs]
    ref = theirs(*tt)
    assert rel_error(out.data, ref.detach().numpy()) <= tol
    g = rng.standard_normal(ref.shape).astype(np.float32)
    (out * mt.Tensor(mt.to_device(g, device))).sum().backward()
    ref.backward(torch.tensor(g.astype(np.float64)))
    for t, r in zip(ts, tt):
        assert rel_error(t.grad, r.grad.numpy()) <= tol


CONV_CASES = [  # (S, f, f', h, w, kh, kw, stride, padding)
    (2, 3, 4, 9, 9, 3, 3, 1, 1),
    (1, 1, 1, 7, 5, 2, 4, (2, 1), (0, 2)),
    (3, 2, 5, 12, 10, 5, 3, (1, 2), (2, 1)),
    (2, 3, 2, 23, 23, 11, 11, 4, 2),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_spatial_convolution(device, case, rng):
    S, f, fo, h, w, kh, kw, stride, pad = case
    layer = mt.SpatialConvolution(f, fo, (kh, kw), stride=stride, padding=pad).to(device)
    wt, b = layer.weight.numpy(), layer.bias.numpy()
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    compare(layer, lambda t: TF.conv2d(t, torch.tensor(wt, dtype=torch.float64),
                                       torch.tensor(b, dtype=torch.float64), stride, pad), [x], device, rng)
    # the parameters' gradients too
    xt = torch.tensor(x.astype(np.float64))
    wr = torch.tensor(wt.astype(np.float64), requires_grad=True)
    br = torch.tensor(b.astype(np.float64), requires_grad=True)
    ref = TF.conv2d(xt, wr, br, stride, pad)
    g = rng.standard_normal(ref.shape).astype(np.float32)
    ref.backward(torch.tensor(g.astype(np.float64)))
    layer.zero_grad()
    (layer(mt.Tensor(mt.to_device(x, device))) * mt.Tensor(mt.to_device(g, device))).sum().backward()
    assert rel_error(layer.weight.grad, wr.grad.numpy()) <= 1e-5
    assert rel_error(layer.bias.grad, br.grad.numpy()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,s,hw", [(3, 2, (13, 13)), (2, 2, (8, 9)), ((2, 3), (1, 2), (7, 8))])
def test_max_pooling(device, k, s, hw, rng):
    x = rng.standard_normal((2, 3) + hw).astype(np.float32)
    compare(mt.SpatialMaxPooling(k, s), lambda t: TF.max_pool2d(t, k, s), [x], device, rng)


@pytest.mark.parametrize("device", DEVICES)
def test_max_pooling_nan_and_gradient_routing(device, rng):
    """A NaN in a window wins (Torch propagates it); the gradient goes to the argmax only, so
    a NaN upstream gradient never reaches the other elements of its window."""
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    x[0, 1, 2, 3] = x[1, 2, 6, 6] = np.nan
    out = mt.SpatialMaxPooling(3, 2)(mt.Tensor(mt.to_device(x, device), requires_grad=True))
    ref = TF.max_pool2d(torch.tensor(x.astype(np.float64)), 3, 2).numpy()
    got = mt.to_device(out.data, "cpu")
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(ref).any()
    np.testing.assert_allclose(got[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=0)
    xt = mt.Tensor(mt.to_device(np.nan_to_num(x), device), requires_grad=True)
    y = mt.SpatialMaxPooling(3, 2)(xt)
    g = np.zeros(y.shape, np.float32)
    g[0, 0, 0, 0] = np.nan
    (y * mt.Tensor(mt.to_device(g, device))).sum().backward()
    gx = mt.to_device(xt.grad, "cpu")
    assert np.isnan(gx).sum() == 1, "the NaN gradient reached more than its window's argmax"


@pytest.mark.parametrize("device", DEVICES)
def test_linear(device, rng):
    layer = mt.Linear(7, 5).to(device)
    wt, b = layer.weight.numpy(), layer.bias.numpy()
    x = rng.standard_normal((4, 7)).astype(np.float32)
    compare(lambda t: mt.functional.linear(t, layer.weight, layer.bias),
            lambda t: TF.linear(t, torch.tensor(wt, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)),
            [x], device, rng)
    compare(lambda t, w: mt.functional.linear(t, w), lambda t, w: TF.linear(t, w),
            [x, wt], device, rng)


@pytest.mark.parametrize("device", DEVICES)
def test_relu_view_logsoftmax(device, rng):
    x = rng.standard_normal((4, 3, 2, 2)).astype(np.float32)
    compare(mt.ReLU(), TF.relu, [x], device, rng)
    compare(mt.View(12), lambda t: t.reshape(4, 12), [x], device, rng)
    compare(mt.Flatten(), lambda t: t.reshape(4, -1), [x], device, rng)
    compare(mt.LogSoftMax(), lambda t: TF.log_softmax(t, dim=1), [x.reshape(4, 12)], device, rng)


@pytest.mark.parametrize("device", DEVICES)
def test_criteria(device, rng):
    x = rng.standard_normal((6, 5)).astype(np.float32) * 3
    y = rng.integers(0, 5, 6)
    yt = torch.tensor(y)
    y_dev = mt.to_device(y, device)
    compare(lambda t: mt.CrossEntropyCriterion()(t, y_dev), lambda t: TF.cross_entropy(t, yt), [x], device, rng)
    compare(lambda t: mt.ClassNLLCriterion()(mt.LogSoftMax()(t), y_dev),
            lambda t: TF.nll_loss(TF.log_softmax(t, dim=1), yt), [x], device, rng)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout(device):
    mt.manual_seed(3)
    x = mt.Tensor(mt.to_device(np.ones((200, 50), np.float32), device), requires_grad=True)
    d = mt.Dropout(0.25)
    y = d(x)
    vals = np.unique(y.numpy())
    assert len(vals) == 2 and vals[0] == 0 and np.isclose(vals[1], 1 / 0.75)
    assert abs((y.numpy() == 0).mean() - 0.25) < 0.02     # 10,000 draws: 0.02 is > 4 sigma
    y.sum().backward()
    assert np.array_equal(x.grad if device == "cpu" else mt.to_device(x.grad, "cpu"), y.numpy())
    assert d.eval()(x) is x  # identity in evaluation mode


def test_module_api():
    net = mt.Sequential(mt.SpatialConvolution(1, 2, 3), mt.ReLU(), mt.Flatten(), mt.Linear(8, 3))
    names = [n for n, _ in net.named_parameters()]
    assert names == ["0.weight", "0.bias", "3.weight", "3.bias"]
    sd = net.state_dict()
    assert sd["0.weight"].shape == (2, 1, 3, 3) and sd["3.weight"].shape == (3, 8)
    bound = 1 / np.sqrt(9)
    assert np.abs(sd["0.weight"]).max() <= bound
    other = mt.Sequential(mt.SpatialConvolution(1, 2, 3), mt.ReLU(), mt.Flatten(), mt.Linear(8, 3))
    other.load_state_dict(sd)
    assert all(np.array_equal(a, b) for a, b in zip(sd.values(), other.state_dict().values()))
    net.eval()
    assert not any(m.training for m in net.modules())
    assert repr(mt.SpatialConvolution(3, 96, 11, stride=4)) == "SpatialConvolution(3 -> 96, 11x11, stride 4)"
    with pytest.raises(ValueError, match="shape"):
        bad = dict(sd, **{"3.weight": np.zeros((3, 9), np.float32)})
        other.load_state_dict(bad)


# -- kernels/pool.cu on the host, against MaxPool2dFn's NumPy passes ------------------------------
@pytest.fixture(scope="module")
def pool_cu(tmp_path_factory):
    return core_host_library(tmp_path_factory, "pool.cu")


POOL_CASES = [((3, 3), (2, 2), (9, 11)), ((2, 3), (1, 2), (7, 8)), ((2, 2), (3, 3), (8, 9))]


def pool_case(rng, hw):
    """An input with many ties and two NaNs, and integer upstream gradients (exact sums)."""
    x = rng.integers(-2, 3, (2, 3) + hw).astype(np.float32)
    x[0, 1, 2, 3] = x[1, 2, 4, 5] = np.nan
    return x


@pytest.mark.parametrize("index", ["int", "ll"])
@pytest.mark.parametrize("k,s,hw", POOL_CASES)
def test_pool_kernels_on_the_host_equal_the_numpy_passes(pool_cu, index, k, s, hw, rng):
    """kernels/pool.cu (both index types) picks the NumPy pass's maximum and argmax, ties and NaN
    included, and routes the gradient the same way."""
    from minitorch_fft.functional import MaxPool2dFn
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)     # noqa: E731
    x = pool_case(rng, hw)
    fn = MaxPool2dFn()
    y_ref = fn.forward(x, k, s)
    g = rng.integers(-4, 5, y_ref.shape).astype(np.float32)
    gx_ref = fn.backward(g)
    c_idx = ctypes.c_int if index == "int" else ctypes.c_longlong
    geom = [c_idx(v) for v in (*x.shape[2:], *k, *s, *y_ref.shape[2:])]
    y, arg = np.full(y_ref.shape, np.nan, np.float32), np.full(y_ref.shape, 255, np.uint8)
    getattr(pool_cu, f"emu_pool_fwd_{index}")(ptr(x), ptr(y), ptr(arg), ctypes.c_longlong(y.size), *geom, 3, 32)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(arg, fn.arg)
    gx = np.full(x.shape, np.nan, np.float32)
    getattr(pool_cu, f"emu_pool_bwd_{index}")(ptr(g), ptr(arg), ptr(gx), ctypes.c_longlong(gx.size), *geom, 3, 32)
    np.testing.assert_array_equal(gx, gx_ref)


@pytest.mark.parametrize("k,s,hw", POOL_CASES)
def test_gpu_pooling_run_on_the_host_equals_the_cpu_passes(pool_cu, k, s, hw, rng):
    """MaxPool2dFn's GPU branch on a fake CuPy (test_cuda_compile.core_gpu_branch): one launch per
    pass with arguments of the kernels' C types, results equal to the CPU passes; and _pool's
    64-bit variant, picked for arrays of 2^31 elements or more."""
    from minitorch_fft.functional import MaxPool2dFn
    x = pool_case(rng, hw)
    cpu = MaxPool2dFn()
    y_ref = cpu.forward(x, k, s)
    g = rng.integers(-4, 5, y_ref.shape).astype(np.float32)
    gx_ref = cpu.backward(g)
    with core_gpu_branch(pool_cu, functional) as log:
        import cupy as cp   # the fake one
        gpu = MaxPool2dFn()
        y = gpu.forward(cp.asarray(x), k, s)
        gx = gpu.backward(cp.asarray(g))
        y64, arg64 = cp.empty(y_ref.shape, np.float32), cp.empty(y_ref.shape, np.uint8)
        functional._pool("fwd", 2**31, cp.asarray(x), *x.shape[2:], *k, *s, *y_ref.shape[2:], y64, arg64)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(gpu.arg, cpu.arg)
    np.testing.assert_array_equal(gx, gx_ref)
    np.testing.assert_array_equal(y64, y_ref)
    np.testing.assert_array_equal(arg64, cpu.arg)
    assert [name for name, _, _ in log] == ["minitorch_maxpool_fwd<int>", "minitorch_maxpool_bwd<int>",
                                            "minitorch_maxpool_fwd<long long>"]
