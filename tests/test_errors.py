"""Bad input at every public entry point: a ValueError/TypeError that names the problem.

BAD_INPUTS is the table RELIABILITY.md counts; each row is (entry point, call, error, pattern).
"""
import numpy as np
import pytest

import backends
import minitorch_fft as mt
import models
from backends.common import geometry
from conftest import DEVICES

f32 = np.float32
X = np.ones((2, 3, 8, 8), f32)
W = np.ones((4, 3, 3, 3), f32)
GY = np.ones((2, 4, 6, 6), f32)


def conv_layer_call(x):
    return mt.SpatialConvolution(3, 4, 3)(mt.Tensor(x))


BAD_INPUTS = [
    # backends, for every registered backend (expanded below)
    ("backend.fprop", lambda b: b.fprop(X[0], W), ValueError, "4-D"),
    ("backend.fprop", lambda b: b.fprop(X, np.ones((4, 2, 3, 3), f32)), ValueError, "channel mismatch"),
    ("backend.fprop", lambda b: b.fprop(X, np.ones((4, 3, 9, 9), f32)), ValueError, "larger than the padded input"),
    ("backend.fprop", lambda b: b.fprop(np.ones((0, 3, 8, 8), f32), W), ValueError, "zero-size"),
    ("backend.fprop", lambda b: b.fprop(X, W, padding=(-1, 0)), ValueError, "padding must be >= 0"),
    ("backend.fprop", lambda b: b.fprop(X, W, stride=(0, 1)), ValueError, "stride must be >= 1"),
    ("backend.fprop", lambda b: b.fprop(X.astype(np.float64), W), TypeError, "float32"),
    ("backend.fprop", lambda b: b.fprop(X.astype(np.float16), W), TypeError, "float32"),
    ("backend.fprop", lambda b: b.fprop(X, W, stride=1.5), TypeError, "stride must be an int"),
    ("backend.bprop", lambda b: b.bprop(GY[:, :3], W, X.shape), ValueError, "gy must have shape"),
    ("backend.accgrad", lambda b: b.accgrad(GY, X.astype(np.int32), W.shape), TypeError, "float32"),
    ("backend.accgrad", lambda b: b.accgrad(GY, X, (4, 3, 3)), ValueError, "4-D"),
    ("backend.bprop", lambda b: b.bprop(GY, "weights", X.shape), TypeError, "array"),
]
BACKEND_ROWS = [pytest.param(name, call, err, pat, id=f"{name}-{entry}-{i}")
                for name in backends.names() for i, (entry, call, err, pat) in enumerate(BAD_INPUTS)]

OTHER_ROWS = [
    ("backends.get", lambda: backends.get("winograd"), ValueError, "unknown convolution backend 'winograd'"),
    ("layer", lambda: mt.SpatialConvolution(3, 4, 3, backend="winograd"), ValueError, "unknown convolution backend"),
    ("layer", lambda: mt.SpatialConvolution(0, 4, 3), ValueError, "in_planes must be a positive int"),
    ("layer", lambda: mt.SpatialConvolution(3, 4, 0), ValueError, "kernel_size must be >= 1"),
    ("layer", lambda: mt.SpatialConvolution(3, 4, 3, stride=0), ValueError, "stride must be >= 1"),
    ("layer", lambda: mt.SpatialConvolution(3, 4, 3, padding=-2), ValueError, "padding must be >= 0"),
    ("layer", lambda: mt.SpatialConvolution(3, 4, (3, 3, 3)), TypeError, "kernel_size must be an int or a pair"),
    ("layer", lambda: conv_layer_call(np.ones((3, 8, 8), f32)), ValueError, "4-D"),
    ("layer", lambda: conv_layer_call(np.ones((1, 2, 8, 8), f32)), ValueError, "channel mismatch"),
    ("layer", lambda: conv_layer_call(np.ones((1, 3, 2, 2), f32)), ValueError, "larger than the padded input"),
    ("layer", lambda: mt.SpatialMaxPooling(3, 2)(mt.Tensor(np.ones((1, 1, 2, 2)))), ValueError, "larger than the input"),
    ("layer", lambda: mt.Linear(4, 2)(mt.Tensor(np.ones((3, 5)))), ValueError, "5 features"),
    ("layer", lambda: mt.View(7)(mt.Tensor(np.ones((2, 6)))), ValueError, "cannot view"),
    ("layer", lambda: mt.Dropout(1.0), ValueError, "dropout probability"),
    ("layer", lambda: mt.SpatialMaxPooling(0), ValueError, "must be >= 1"),
    ("layer", lambda: mt.SpatialMaxPooling(17)(mt.Tensor(np.ones((1, 1, 17, 17)))), ValueError, "at most 256"),
    ("autograd", lambda: mt.Linear(4, 3)(mt.Tensor(np.ones((2, 4)))).backward(np.ones((2, 1), f32)),
     ValueError, r"gradient of shape \(2, 1\) for a tensor of shape \(2, 3\)"),
    ("criterion", lambda: mt.CrossEntropyCriterion()(mt.Tensor(np.ones((2, 3))), np.array([0, 3])), ValueError, r"\[0, 3\)"),
    ("criterion", lambda: mt.CrossEntropyCriterion()(mt.Tensor(np.ones((2, 3))), np.array([0.5, 1.0])), TypeError, "integer"),
    ("criterion", lambda: mt.ClassNLLCriterion()(mt.Tensor(np.ones((2, 3))), np.array([0])), ValueError, r"shape \(2,\)"),
    ("criterion", lambda: mt.CrossEntropyCriterion()(mt.Tensor(np.ones((2, 3))), mt.Tensor(np.array([0, 1]))),
     TypeError, "not a Tensor"),
    ("tensor", lambda: mt.Tensor(np.ones((2, 3))) * np.ones((2, 3)), TypeError, "a Tensor and a number"),
    ("tensor", lambda: mt.Tensor(np.ones((2, 3))) + True, TypeError, "a Tensor and a number"),
    ("model", lambda: models.get("vgg"), ValueError, "unknown model 'vgg'"),
    ("model", lambda: models.get("digits")(mt.Tensor(np.ones((2, 1, 10, 10)))), ValueError, "cannot view"),
    ("optim", lambda: mt.optim.SGD([], lr=0.1), ValueError, "empty parameter list"),
    ("optim", lambda: mt.optim.SGD(mt.Linear(2, 2).parameters(), lr=-1), ValueError, "lr must be"),
    ("optim", lambda: mt.optim.SGD(mt.Linear(2, 2).parameters(), lr=True), ValueError, "lr must be"),
    ("optim", lambda: mt.optim.SGD(mt.Linear(2, 2).parameters(), lr=0.1, momentum=float("nan")), ValueError, "momentum"),
    ("device", lambda: mt.Tensor(np.ones(2)).to("tpu"), ValueError, "unknown device 'tpu'"),
    ("device", lambda: mt.normalize_device("cuda:3"), ValueError, "CUDA_VISIBLE_DEVICES=3"),
    ("data", lambda: list(mt.data.batches(mt.data.ArrayDataset(np.ones((2, 1)), [0, 1]), 0)), ValueError, "batch_size"),
    ("data", lambda: mt.data.ArrayDataset(np.ones((3, 1)), [0, 1]), ValueError, "differ in count"),
    ("data", lambda: mt.data.ArrayDataset(np.ones((2, 1)), [0.5, 1.2]), TypeError, "fractional values"),
]


@pytest.mark.parametrize("name,call,err,pattern", BACKEND_ROWS)
def test_backend_bad_input(name, call, err, pattern):
    with pytest.raises(err, match=pattern):
        call(backends.get(name))


@pytest.mark.parametrize("entry,call,err,pattern", OTHER_ROWS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(OTHER_ROWS)])
def test_bad_input(entry, call, err, pattern):
    with pytest.raises(err, match=pattern):
        call()


def test_unsupported_geometry_for_a_named_backend_is_clear():
    """A named backend asked for what it cannot do says so (gemm supports all; use a stub)."""
    class StrideOneOnly:
        @staticmethod
        def supports(x_shape, w_shape, stride, padding):
            return tuple(stride) == (1, 1)
    backends._REGISTRY["stride1_stub"] = StrideOneOnly
    try:
        with pytest.raises(ValueError, match="'stride1_stub' does not support fprop"):
            backends.choose("stride1_stub", "fprop", X.shape, W.shape, (2, 2), (0, 0))
    finally:
        del backends._REGISTRY["stride1_stub"]


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_propagate(device):
    x = np.random.default_rng(0).standard_normal((1, 1, 8, 8)).astype(f32)
    x[0, 0, 2, 2], x[0, 0, 6, 6] = np.nan, np.inf
    mt.manual_seed(0)
    net = models.get("digits", 10).to(device).eval()
    y = net(mt.Tensor(mt.to_device(x, device))).numpy()
    assert np.isnan(y).any()  # no crash, and the NaN is visible in the output
    for name in backends.names():
        b = backends.get(name)
        if b.supports(x.shape, (2, 1, 3, 3), (1, 1), (1, 1)):
            out = mt.to_device(b.fprop(mt.to_device(x, device), mt.to_device(np.ones((2, 1, 3, 3), f32), device),
                                       padding=(1, 1)), "cpu")
            assert np.isnan(out).any(), name


@pytest.mark.gpu
def test_numpy_mixed_with_cupy_is_a_clear_error():
    import cupy as cp
    for name in backends.names():
        with pytest.raises(TypeError, match="must all be NumPy or all CuPy"):
            backends.get(name).fprop(cp.asarray(X), W)
    with pytest.raises(TypeError, match="different devices"):
        mt.SpatialConvolution(3, 4, 3)(mt.Tensor(cp.asarray(X)))


def test_a_non_integer_shape_never_poisons_the_geometry_cache():
    """geometry() is cached: 8.0 (or True for 1) must be refused every time, and must not make a
    later call with the same shape in ints fail or take float fields."""
    for _ in range(2):
        with pytest.raises(TypeError, match="input shape must be a sequence of ints"):
            geometry((2.0, 3, 8, 8), (4, 3, 3, 3), 1, 0)
        with pytest.raises(TypeError, match="stride must be an int"):
            geometry((2, 3, 8, 8), (4, 3, 3, 3), True, 0)
        with pytest.raises(TypeError, match="stride must be an int"):
            geometry((2, 3, 8, 8), (4, 3, 3, 3), 1.0, 0)
        g = geometry((2, 3, 8, 8), (4, 3, 3, 3), 1, 0)
        assert all(type(v) is int for v in g) and (g.oh, g.ow) == (6, 6)
    g = geometry(np.array([2, 3, 8, 8]), tuple(np.int64(v) for v in (4, 3, 3, 3)), [1, 1], (0, 0))
    assert all(type(v) is int for v in g)


def test_a_named_backend_says_which_of_its_limits_the_geometry_passes():
    layer = mt.SpatialConvolution(1, 1, 3, backend="fbfft")
    with pytest.raises(ValueError, match="its kernels go up to 128"):
        layer(mt.Tensor(np.ones((1, 1, 130, 130), np.float32)))


def test_a_failed_state_dict_load_changes_nothing():
    net = models.get("digits", 10)
    before = {k: v.copy() for k, v in net.state_dict().items()}
    state = {k: np.ones_like(v) for k, v in before.items()}
    last = list(state)[-1]
    state[last] = np.ones(state[last].shape + (2,), f32)              # the last entry is wrong
    with pytest.raises(ValueError, match=f"state_dict\\[{last!r}\\] has shape"):
        net.load_state_dict(state)
    assert all(np.array_equal(v, before[k]) for k, v in net.state_dict().items())


def test_a_tied_parameter_is_listed_and_updated_once():
    class Tied(mt.Module):
        def __init__(self):
            self.a = mt.Linear(2, 2)
            self.b = self.a

    net = Tied()
    assert len(net.parameters()) == 2                                  # a.weight, a.bias; not b.*
    w0 = net.a.weight.data.copy()
    for p in net.parameters():
        p.grad = np.ones_like(p.data)
    mt.optim.SGD(net.parameters(), lr=0.1).step()
    np.testing.assert_allclose(net.a.weight.data, w0 - 0.1, rtol=0, atol=1e-7)
