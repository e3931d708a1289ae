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
@pytest.mark.parametrize("k,s,p,hw", [(3, 2, 1, (12, 12)), (3, 2, 1, (7, 8)), ((3, 2), (2, 1), (1, 1), (6, 5))])
def test_max_pooling_with_padding(device, k, s, p, hw, rng):
    """ResNet's stem pooling (3x3, stride 2, pad 1): the padding never wins, even where every
    input in the window is negative."""
    x = rng.standard_normal((2, 3) + hw).astype(np.float32) - 3
    compare(mt.SpatialMaxPooling(k, s, padding=p), lambda t: TF.max_pool2d(t, k, s, p), [x], device, rng)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,s,p,include", [(2, 2, 0, True), (3, 2, 1, True), (3, 2, 1, False),
                                           ((3, 2), (1, 2), (1, 0), False), (3, 1, 0, True)])
def test_average_pooling(device, k, s, p, include, rng):
    x = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    compare(mt.SpatialAveragePooling(k, s, padding=p, count_include_pad=include),
            lambda t: TF.avg_pool2d(t, k, s, p, count_include_pad=include), [x], device, rng)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hw,out", [((7, 7), 7), ((7, 5), 1), ((8, 12), (4, 3)), ((5, 7), (3, 4)),
                                    ((1, 1), 7), ((2, 3), (7, 7))])
def test_adaptive_average_pooling(device, hw, out, rng):
    """Every path: the identity, the global mean, equal windows, torch's overlapping windows."""
    x = rng.standard_normal((2, 3) + hw).astype(np.float32)
    compare(mt.SpatialAdaptiveAveragePooling(out), lambda t: TF.adaptive_avg_pool2d(t, out), [x], device, rng)


def test_pooling_errors():
    x = mt.Tensor(np.zeros((1, 1, 4, 4), np.float32))
    with pytest.raises(ValueError, match="at most half the kernel"):
        mt.SpatialMaxPooling(3, 2, padding=2)
    with pytest.raises(ValueError, match="at most half the kernel"):
        mt.functional.avg_pool2d(x, 2, 2, padding=(0, 2))
    with pytest.raises(ValueError, match="larger than the"):
        mt.SpatialAveragePooling(5)(x)
    with pytest.raises(ValueError, match="output_size"):
        mt.SpatialAdaptiveAveragePooling(0)
    assert repr(mt.SpatialMaxPooling(3, 2, padding=1)) == "SpatialMaxPooling(3x3, stride 2, pad 1)"


def _torch_bn(planes, affine, momentum, layer):
    """torch's BatchNorm2d in float64 with `layer`'s weight and bias (random, so the affine part
    is exercised) and running statistics."""
    ref = torch.nn.BatchNorm2d(planes, affine=affine, momentum=momentum).double()
    with torch.no_grad():
        for k, v in layer.state_dict().items():
            getattr(ref, k).copy_(torch.tensor(v))
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine,momentum", [(True, 0.1), (False, 0.3), (True, None)])
def test_batch_normalization_against_torch(device, affine, momentum, rng):
    """Three training steps then evaluation: outputs, the input's and parameters' gradients, the
    running statistics (unbiased variance, momentum or cumulative average) and the batch count,
    all as torch.nn.BatchNorm2d's in float64."""
    planes = 4
    layer = mt.SpatialBatchNormalization(planes, momentum=momentum, affine=affine)
    if affine:
        layer.weight.data = rng.uniform(0.5, 1.5, planes).astype(np.float32)
        layer.bias.data = rng.standard_normal(planes).astype(np.float32)
    layer.running_var.data = rng.uniform(0.5, 2, planes).astype(np.float32)
    ref = _torch_bn(planes, affine, momentum, layer)
    layer.to(device)
    for training in (True, True, True, False):
        layer.train(training), ref.train(training)
        x = (rng.standard_normal((3, planes, 5, 6)) * 2 + 1).astype(np.float32)
        g = rng.standard_normal(x.shape).astype(np.float32)
        xt = mt.Tensor(mt.to_device(x, device), requires_grad=True)
        layer.zero_grad()
        out = layer(xt)
        (out * mt.Tensor(mt.to_device(g, device))).sum().backward()
        xr = torch.tensor(x.astype(np.float64), requires_grad=True)
        ref.zero_grad()
        out_ref = ref(xr)
        out_ref.backward(torch.tensor(g.astype(np.float64)))
        assert rel_error(out.data, out_ref.detach().numpy()) <= 1e-5
        assert rel_error(xt.grad, xr.grad.numpy()) <= 1e-4
        if affine:
            assert rel_error(layer.weight.grad, ref.weight.grad.numpy()) <= 1e-5
            assert rel_error(layer.bias.grad, ref.bias.grad.numpy()) <= 1e-5
        state = layer.state_dict()
        for k, v in ref.state_dict().items():
            assert state[k].dtype == (np.int64 if k == "num_batches_tracked" else np.float32)
            if k == "num_batches_tracked":
                assert int(state[k]) == int(v)
            else:
                assert rel_error(state[k], v.numpy()) <= 1e-6, k
    assert int(layer.num_batches_tracked.data) == 3       # evaluation counts nothing


def test_batch_normalization_state_and_errors():
    """Buffers are in state_dict (PyTorch's keys, order and dtypes), not in parameters(); they load
    all or nothing with the parameters, from torch's own state_dict as it is."""
    net = mt.Sequential(mt.SpatialConvolution(2, 3, 1, bias=False), mt.SpatialBatchNormalization(3))
    assert [n for n, _ in net.named_parameters()] == ["0.weight", "1.weight", "1.bias"]
    assert list(net.state_dict()) == list(torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 1, bias=False), torch.nn.BatchNorm2d(3)).state_dict())
    assert [n for n, _ in net.named_buffers()] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    ref = torch.nn.BatchNorm2d(3)
    ref.train()(torch.randn(4, 3, 2, 2))
    bn = mt.SpatialBatchNormalization(3).load_state_dict(ref.state_dict())
    assert int(bn.num_batches_tracked.data) == 1 and bn.num_batches_tracked.data.dtype == np.int64
    np.testing.assert_array_equal(bn.running_var.data, ref.running_var.numpy())
    before = bn.state_dict()
    for bad, match in [({"num_batches_tracked": np.float32(2.0)}, "holds integers"),
                       ({"running_mean": np.zeros(4, np.float32)}, "shape"),
                       ({"num_batches_tracked": np.uint64(2**64 - 1)}, "range")]:
        with pytest.raises(mt.checkpoint.CheckpointError, match=match):
            bn.load_state_dict(dict(ref.state_dict(), **bad))
        assert all(np.array_equal(v, bn.state_dict()[k]) for k, v in before.items())   # untouched
    with pytest.raises(ValueError, match="more than 1 value per plane"):
        bn.train()(mt.Tensor(np.zeros((1, 3, 1, 1), np.float32)))
    with pytest.raises(ValueError, match="3 planes"):
        bn(mt.Tensor(np.zeros((2, 4, 2, 2), np.float32)))
    with pytest.raises(ValueError, match="momentum"):
        mt.SpatialBatchNormalization(3, momentum=1.5)
    with pytest.raises(ValueError, match="eps"):
        mt.SpatialBatchNormalization(3, eps=0)


def test_residual_addition(rng):
    """A block's shortcut: y = f(x) + x, the gradient reaching x through both paths."""
    conv = mt.SpatialConvolution(2, 2, 3, padding=1)
    w, b = (torch.tensor(p.numpy().astype(np.float64)) for p in (conv.weight, conv.bias))
    compare(lambda t: conv(t) + t, lambda t: TF.conv2d(t, w, b, padding=1) + t,
            [rng.standard_normal((2, 2, 5, 5)).astype(np.float32)], "cpu", rng)


@pytest.mark.gpu
def test_buffers_move_with_the_module_and_update_in_place():
    """to('cuda') moves the buffers; a training step updates them in the same memory (what a
    captured CUDA graph relies on)."""
    import cupy as cp
    bn = mt.SpatialBatchNormalization(3).to("cuda")
    assert all(isinstance(b.data, cp.ndarray) for b in bn.buffers())
    ptrs = [b.data.data.ptr for b in bn.buffers()]
    bn(mt.Tensor(cp.ones((2, 3, 2, 2), np.float32)))
    assert [b.data.data.ptr for b in bn.buffers()] == ptrs and int(bn.num_batches_tracked.data) == 1
    assert isinstance(bn.to("cpu").running_mean.data, np.ndarray)


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


def test_linear_refuses_a_bias_or_weight_of_another_shape():
    """numpy broadcast a bias of shape (1,) or (batch, out) into the output, and failed only at backward."""
    x, w = mt.Tensor(np.ones((2, 3), np.float32)), mt.Tensor(np.ones((4, 3), np.float32))
    for bias in (np.array([10.0]), np.ones((2, 4)), np.ones(5)):
        with pytest.raises(ValueError, match=r"linear: bias must have shape \(4,\), one value per output"):
            functional.linear(x, w, mt.Tensor(bias.astype(np.float32)))
    with pytest.raises(ValueError, match=r"linear expects weight of shape \(out_features, in_features\), got \(3,\)"):
        functional.linear(x, mt.Tensor(np.ones(3, np.float32)))
    y = functional.linear(x, w, mt.Tensor(np.arange(4, dtype=np.float32)))
    assert np.array_equal(y.numpy(), np.tile(np.arange(4, dtype=np.float32) + 3, (2, 1)))
